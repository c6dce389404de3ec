"""The model-test stage of ``python -m bench.gpu``: its pytest arguments and the failures' reasons."""

from __future__ import annotations

import importlib.util

import pytest

from bench.gpu_tests import failure_reasons, xdist_args


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
