"""What this CPU can do: its instruction-set flags, read once from ``/proc/cpuinfo``.

The step's kernels are chosen by them (FBGEMM's 7- or 8-bit activations, the VNNI kernel) and
the compile cache is keyed by them; one reader serves all three.
"""

from __future__ import annotations

import functools
from pathlib import Path


def parse_flags(cpuinfo: str) -> frozenset[str]:
    """The flags of the first ``flags`` line of a ``/proc/cpuinfo`` text (every core has the same)."""
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


@functools.cache
def flags() -> frozenset[str] | None:
    """This CPU's flags, or None where there is no ``/proc/cpuinfo`` (not Linux)."""
    try:
        return parse_flags(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return None
