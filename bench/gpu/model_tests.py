"""The model tests of ``python -m bench.gpu`` (its ``tests`` stage): which, in what order, how run.

``tests/model`` with the engine on the device (``CHATTTS_TEST_DEVICE``), the files that run
the engine's own code first, optionally in pytest-xdist processes; the verdict of every test
and the reasons of the failures come back with the run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.harness.servers import REPO_ROOT

#: The model tests that run the engine's own code on the device, first: the stage's time cap
#: (170 s) covered 40 % of ``tests/model`` on the first H200, so what comes first is what runs.
DEVICE_TESTS_FIRST = (
    "test_chattts_static.py",
    "test_chattts_engine.py",
    "test_step_forms.py",
    "test_kv_memory.py",
    "test_chattts_vocode.py",
    "test_refine_engine.py",
)


def model_tests_by_priority() -> list[Path]:
    """``tests/model``'s test files, :data:`DEVICE_TESTS_FIRST` first, then the rest by name."""
    folder = REPO_ROOT / "tests" / "model"
    files = sorted(folder.glob("test_*.py"))
    first = [folder / name for name in DEVICE_TESTS_FIRST if (folder / name).is_file()]
    return first + [path for path in files if path not in first]


def xdist_args(workers: int) -> list[str]:
    """pytest-xdist's arguments for ``workers`` processes (a file per process: its fixtures load once).

    A GPU machine has many cores and the model tests are mostly single-threaded host work, so
    processes side by side cover more of ``tests/model`` in the stage's few minutes."""
    if workers <= 0 or importlib.util.find_spec("xdist") is None:
        return []
    # pytest-benchmark (on some GPU images) turns itself off under xdist with a warning that
    # the suite's warnings-as-errors makes an INTERNALERROR (the first H200 run lost its stage so).
    return ["-n", str(workers), "--dist", "loadfile", "-p", "no:benchmark"]


def stage_tests(args: argparse.Namespace, limit: float) -> dict[str, Any]:
    """The model tests with the engine on ``args.device``."""
    selection = [str(path) for path in model_tests_by_priority()]
    if args.smoke:
        selection = [
            "tests/model/test_chattts_static.py::test_slots_are_the_batch_limit_and_memory_is_stated"
        ]
    # -v: every test's name and verdict as it finishes, so a run cut at its limit still says
    # which failed; a module that cannot be imported there (a missing dev package) costs only
    # its own tests.
    argv = [
        sys.executable, "-m", "pytest", "-v", "-rfE", "--tb=short", "-p", "no:cacheprovider",
        "--continue-on-collection-errors", *xdist_args(args.test_workers), *selection,
    ]  # fmt: skip
    env = {**os.environ, "CHATTTS_TEST_DEVICE": args.device, "HF_HUB_OFFLINE": "1"}
    try:
        proc = run_as_group(argv, cwd=REPO_ROOT, env=env, timeout=limit)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-2000:]
        return {
            "status_detail": "timed out",
            "tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail,
        }
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary)}
    if proc.returncode != 0 and not counts.get("failed") and not counts.get("error"):
        raise RuntimeError(f"pytest exited {proc.returncode}: {proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, flags=re.M)
    result = {
        "command": shlex.join(argv),
        "returncode": proc.returncode,
        "summary": summary,
        "counts": counts,
        "failures": failures,
        # -rfE's summary line per failure, with its exception: the reason of every failure
        # comes back even when the tracebacks below are cut.
        "failure_reasons": failure_reasons(proc.stdout),
    }
    if failures:  # the first failures' tracebacks: a GPU is lent rarely, the why must come back with it
        first = proc.stdout.find("= FAILURES =")
        result["failure_text"] = proc.stdout[first:][:6000] if first >= 0 else proc.stdout[-6000:]
    return result


def run_as_group(argv: list[str], *, timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` (text, output captured) in a process group of its own, all killed at ``timeout``.

    pytest-xdist's workers are the child's children: killing only the child, as
    ``subprocess.run`` does, would leave them running the model tests on the GPU through the
    stages after this one.
    """
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, output=out) from exc
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def failure_reasons(output: str) -> dict[str, str]:
    """``{test id: "Exception: message"}`` from pytest's ``-rfE`` short summary lines."""
    reasons: dict[str, str] = {}
    for test_id, reason in re.findall(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$", output, flags=re.M):
        reasons[test_id] = reason[:300]
    return reasons
