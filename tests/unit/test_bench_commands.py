"""Every ``python -m bench...`` command the docs give still runs: its ``--help`` exits 0 (issue #44).

The commands are read from the documentation itself (``README.md``, ``CONTRIBUTING.md``,
``docs/``, ``bench/README.md``, ``bench/studies/README.md`` and the results index), so a module
that moves or is renamed without its docs fails here. Each ``--help`` runs in this process
(``runpy``, as ``python -m`` would), which imports torch once for all of them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import shlex
import sys
from pathlib import Path
from typing import Any

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


def run_as_main(module: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ``module`` in this process as ``python -m module *args`` would."""
    monkeypatch.setattr(sys, "argv", [module, *args])
    # As ``python -m`` does: the module runs afresh as __main__, even if a test imported it before.
    monkeypatch.delitem(sys.modules, module, raising=False)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def test_the_docs_give_the_suites_commands() -> None:
    # The scan itself must find commands: a broken pattern would pass every case below vacuously.
    assert {"bench", "bench.cpu", "bench.gpu", "bench.chaos", "bench.soak"} <= set(documented_modules())


@pytest.mark.parametrize("module", documented_modules())
def test_a_documented_command_answers_help(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    with pytest.raises(SystemExit) as ended, contextlib.redirect_stdout(out):
        run_as_main(module, ["--help"], monkeypatch)
    assert ended.value.code in (0, None), (module, out.getvalue()[-500:])
    assert "usage:" in out.getvalue(), (module, out.getvalue()[:300])


# --- Every full command line parses (issue #45, acceptance 9) --------------------------------
#
# ``--help`` above proves a module exists; it does not prove that the arguments a doc gives are
# the ones the module takes (``--rounds 3`` once was refused as "unrecognized arguments"). Each
# command line below goes through the module's own argparse parser, in this process, and stops
# right after parsing: ``ArgumentParser.parse_args`` is wrapped to raise ``Parsed`` once the
# arguments are accepted, so no benchmark runs.
# Placeholders (DIR, TREE_x, TINY, <hw>, <gpu>, X.json, "...") stay as written: they are values of
# path or string options, which argparse takes without looking at the file system, so each parses
# as the real value would. Environment prefixes (``OMP_WAIT_POLICY=PASSIVE``) are dropped, ``\``
# continuations joined; a line whose arguments are an ellipsis is skipped with its reason below.

CMD_DOCS = [
    REPO / "bench" / "README.md",
    REPO / "bench" / "studies" / "README.md",
    REPO / "bench" / "results" / "README.md",
]
SHELL_BLOCK = re.compile(r"```(?:sh|bash|console)\n(.*?)```", re.S)
ANY_BLOCK = re.compile(r"```.*?```", re.S)
INLINE = re.compile(r"`([^`]+)`")
ENV_PREFIX = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+")
# Lines that are not whole commands, each with the reason (matched on the command's text).
SKIPPED = {
    "…": "an ellipsis stands for the arguments of the line before it",
}


class Parsed(Exception):
    """Raised by the wrapped ``parse_args`` once a command line was accepted."""


def documented_command_lines() -> list[tuple[str, str]]:
    """``(doc, command)`` for every ``python -m bench...`` line with arguments in the docs.

    Shell blocks are read line by line after joining ``\\`` continuations; inline code spans
    (which may wrap across lines in the markdown) outside the blocks are read whole. A bare
    ``python -m bench.x`` names a module in prose; the ``--help`` test covers it.
    """
    found: list[tuple[str, str]] = []
    for doc in CMD_DOCS:
        text = doc.read_text()
        lines: list[str] = []
        for block in SHELL_BLOCK.findall(text):
            lines += block.replace("\\\n", " ").splitlines()
        lines += INLINE.findall(ANY_BLOCK.sub("", text))
        for line in lines:
            command = " ".join(line.split())
            if "python -m bench" not in command:
                continue
            command = ENV_PREFIX.sub("", command)
            if not command.startswith("python -m bench"):
                raise AssertionError(f"{doc.name}: a command line the test cannot read: {line!r}")
            if len(shlex.split(command, comments=True)) > 3:
                found.append((doc.relative_to(REPO).as_posix(), command))
    return found


def test_the_docs_give_full_command_lines() -> None:
    # Guards the reader: the lines this issue was about must be among those checked.
    commands = [c for _, c in documented_command_lines()]
    assert any(c.startswith("python -m bench.studies.hotpath --model-dir ") for c in commands)
    assert any(c.startswith("python -m bench --url ") for c in commands)
    assert len(commands) >= 40


def test_the_parse_check_refuses_an_unknown_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    # The check below must be able to fail: a flag no module has is refused.
    with pytest.raises(SystemExit) as ended:
        parse_command("python -m bench.soak --no-such-flag 3", monkeypatch)
    assert ended.value.code == 2


def parse_command(command: str, monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """Run ``command``'s module as ``python -m`` would, stopping once its arguments parsed."""
    argv = shlex.split(command, comments=True)
    module = argv[2]
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        raise Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            run_as_main(module, argv[3:], monkeypatch)
    except Parsed as parsed:
        return parsed.args[0]  # type: ignore[no-any-return]
    except SystemExit:
        sys.stderr.write(err.getvalue())
        raise
    raise AssertionError(f"{module} ended without parsing its arguments")


@pytest.mark.parametrize(("doc", "command"), documented_command_lines())
def test_a_documented_command_line_parses(doc: str, command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for marker, reason in SKIPPED.items():
        if marker in command.split():
            pytest.skip(reason)
    try:
        parse_command(command, monkeypatch)
    except SystemExit as ended:
        raise AssertionError(f"{doc}: refused: {command}") from ended
