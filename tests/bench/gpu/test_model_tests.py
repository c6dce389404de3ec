"""The model-test stage of ``python -m bench.gpu``: its pytest arguments and the failures' reasons."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.gpu.model_tests import failure_reasons, run_as_group, xdist_args


def test_workers_run_a_file_each_without_the_benchmark_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "xdist" else None)
    args = xdist_args(8)
    assert args[:4] == ["-n", "8", "--dist", "loadfile"]
    # pytest-benchmark turns itself off under xdist with a warning, an INTERNALERROR under -W error
    assert args[4:] == ["-p", "no:benchmark"]
    assert xdist_args(0) == []


def test_no_workers_where_xdist_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert xdist_args(8) == []  # one process, instead of pytest refusing "-n"


def test_every_failure_keeps_its_reason() -> None:
    output = "\n".join(
        [
            "[gw1] [ 50%] FAILED tests/model/test_x.py::test_a",
            "=========================== short test summary info ============================",
            "FAILED tests/model/test_x.py::test_a - RuntimeError: tensors on two devices",
            "FAILED tests/model/test_y.py::test_b[int8] - AssertionError: assert 'cuda-graphs' == 'eager'",
            "ERROR tests/model/test_z.py",
            "==== 2 failed, 1 error, 5 passed in 3.2s ====",
        ]
    )
    assert failure_reasons(output) == {
        "tests/model/test_x.py::test_a": "RuntimeError: tensors on two devices",
        "tests/model/test_y.py::test_b[int8]": "AssertionError: assert 'cuda-graphs' == 'eager'",
        "tests/model/test_z.py": "",
    }


def test_a_timed_out_stage_leaves_no_grandchild_running(tmp_path: Path) -> None:
    """xdist's workers are the pytest process's children: the timeout must end them too."""
    pid_file = tmp_path / "grandchild.pid"
    spawn = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        run_as_group([sys.executable, "-c", spawn], timeout=3.0)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and _alive(grandchild):
        time.sleep(0.05)
    alive = _alive(grandchild)
    if alive:  # do not leave it behind when the check fails
        os.kill(grandchild, signal.SIGKILL)
    assert not alive


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing
