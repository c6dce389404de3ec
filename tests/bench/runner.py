"""Run a ``python -m bench...`` harness as the bench smoke tests do: a subprocess in the repo root.

``run_module`` returns the finished process whatever its exit code (for tests that accept more
than 0); ``run_ok`` also asserts that it exited 0, with the tails of its output as the message.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

#: The repository root: the harnesses run with it as their working directory.
REPO = Path(__file__).resolve().parents[2]


def run_module(module: str, *args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``python -m module *args`` in the repo root, its output captured as text; no check of its exit."""
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_ok(module: str, *args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``run_module``, asserting that the harness exited 0."""
    proc = run_module(module, *args, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
