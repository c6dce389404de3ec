"""Host memory reserved up front but resident only where written: what backs the CPU's KV slots.

The KV slots are sized for the worst case (every slot holding the longest prompt and
``--segment-max-tokens`` tokens), but the live streams use a small part of that. An anonymous
private mapping gives the worst case as address space only: the kernel maps a page of zeros
into resident memory the first time it is written (reads of an untouched page see the shared
zero page and cost no memory), and ``madvise(MADV_DONTNEED)`` hands written pages back, after
which they read as zeros again. So the operating system's page table is the KV cache's block
table: the shapes stay the closed set the token step was built for, and the resident memory
follows the positions the live rows hold.

Transparent huge pages are turned off for the mapping: a 2 MiB page would make a whole
stretch of every head resident at a row's first write, and could not be handed back in part.
"""

from __future__ import annotations

import mmap
import sys

#: The granularity of residency (bytes).
PAGE = mmap.PAGESIZE


def _advise(region: mmap.mmap, name: str, start: int, length: int) -> bool:
    """``madvise`` by name where the platform has it; whether it was applied."""
    option = getattr(mmap, name, None)
    if option is None or length <= 0:
        return False
    try:
        region.madvise(option, start, length)
    except OSError:  # e.g. a kernel built without transparent huge pages refuses MADV_NOHUGEPAGE
        return False
    return True


def can_reserve() -> bool:
    """Whether this platform maps anonymous private memory lazily (every POSIX system)."""
    return hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")


def can_release() -> bool:
    """Whether released pages are freed at once and read as zeros afterwards (Linux's MADV_DONTNEED)."""
    return can_reserve() and sys.platform.startswith("linux") and hasattr(mmap, "MADV_DONTNEED")


class PageReservation:
    """``nbytes`` of zeroed address space; pages become resident when written, :meth:`release` frees them.

    Args:
        nbytes: the size to reserve.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        # Private and anonymous: a released page is freed, not kept by a shared-memory object.
        self.buffer = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        _advise(self.buffer, "MADV_NOHUGEPAGE", 0, len(self.buffer))

    def release(self, start: int, stop: int) -> int:
        """Hand the whole pages inside bytes ``[start, stop)`` back to the system; bytes released.

        They read as zeros afterwards. The partial pages at either end stay as they are (their
        contents are stale, and callers treat stale contents as garbage behind a mask). Where
        the platform cannot release (:func:`can_release`), nothing is released.
        """
        first = -(-start // PAGE) * PAGE
        last = min(stop, self.nbytes) // PAGE * PAGE
        if last <= first or not can_release():
            return 0
        return last - first if _advise(self.buffer, "MADV_DONTNEED", first, last - first) else 0
