"""Every ``python -m bench...`` command the docs give still runs: its ``--help`` exits 0 (issue #44).

The commands are read from the documentation itself (``README.md``, ``CONTRIBUTING.md``,
``docs/``, ``bench/README.md``, ``bench/studies/README.md`` and the results index), so a module
that moves or is renamed without its docs fails here. Each ``--help`` runs in this process
(``runpy``, as ``python -m`` would), which imports torch once for all of them.
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "bench" / "README.md",
    REPO / "bench" / "studies" / "README.md",
    REPO / "bench" / "results" / "README.md",
]
COMMAND = re.compile(r"python -m (bench(?:\.[a-z_]+)*)\b")


def documented_modules() -> list[str]:
    found: set[str] = set()
    for doc in DOCS:
        if doc.is_file():
            found |= set(COMMAND.findall(doc.read_text()))
    return sorted(found)


def test_the_docs_give_the_suites_commands() -> None:
    # The scan itself must find commands: a broken pattern would pass every case below vacuously.
    assert {"bench", "bench.cpu", "bench.gpu", "bench.chaos", "bench.soak"} <= set(documented_modules())


@pytest.mark.parametrize("module", documented_modules())
def test_a_documented_command_answers_help(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    # As ``python -m`` does: the module runs afresh as __main__, even if a test imported it before.
    monkeypatch.delitem(sys.modules, module, raising=False)
    out = io.StringIO()
    with pytest.raises(SystemExit) as ended, contextlib.redirect_stdout(out):
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    assert ended.value.code in (0, None), (module, out.getvalue()[-500:])
    assert "usage:" in out.getvalue(), (module, out.getvalue()[:300])
