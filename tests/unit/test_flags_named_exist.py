"""Every ``--flag`` that the help texts and the docs tell users to pass exists.

(a) The descriptions and help strings of ``chattts-stream``'s parsers (``serve``,
``make-dev-model``) may name any flag of either command.

(b) README.md, CONTRIBUTING.md, docs/*.md and client_py/README.md: a flag is the server's
to check unless the text says it is another tool's. Which tool a flag belongs to:

- in a command (a line of a shell code block, with its ``\\`` continuations, or an inline code
  span that starts with a program), the program's: ``chattts-stream``, ``scripts/serve.sh``
  and ``python -m server`` are checked; any other program (``python -m bench...``,
  ``scripts/setup.sh``, ``scripts/test.sh``, ``kubectl``, ``docker``, ``pip``, ``pytest`` ...)
  is not;
- anywhere else (a bare ``--max-batch`` in prose or in a table of server flags, a comment
  in a Python example), the server's, unless its paragraph, table row or list item is about
  another tool: it holds another program's command or names ``bench.<script>``,
  ``python -m <not server>``, the Dockerfile, docker, kubectl, helm, pytest, mypy or a script
  other than serve.sh.

Each unknown flag is reported with its file and line.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from server import cli

REPO = Path(__file__).resolve().parents[2]

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
SPAN = re.compile(r"`([^`]+)`")
FENCE = re.compile(r"^\s*(?:```|~~~)\s*([\w+-]*)")
SHELL_FENCES = {"sh", "bash", "shell", "console", "zsh"}
#: A line that starts a block of its own (a heading, a table row, a list item, a quote).
BLOCK_START = re.compile(r"^\s*(?:#|\||[-*+] |\d+[.)] |>)")
SINGLE_LINE_BLOCK = re.compile(r"^\s*(?:#|\|)")
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=\S*")
SERVER_PROGRAMS = {"chattts-stream", "serve.sh"}
OTHER_PROGRAMS = {
    "python", "python3", "pip", "pip3", "uv", "pipx", "kubectl", "docker", "helm", "curl", "wget",
    "npm", "npx", "node", "git", "mypy", "ruff", "pytest", "hadolint", "aplay", "ffmpeg", "ffplay",
    "nvidia-smi", "make", "bash", "sh", "websocat", "openssl", "mkdocs",
}  # fmt: skip
OTHER_MENTION = re.compile(
    r"python -m (?!server\b)|\bbench\.\w+|\bDockerfile\b|\bdocker\b|\bkubectl\b|\bhelm\b|\bpytest\b"
    r"|\bmypy\b|scripts/(?!serve\.sh)[\w-]+\.sh"
)


def docs() -> list[Path]:
    names = ["README.md", "CONTRIBUTING.md", "client_py/README.md"]
    found = [REPO / n for n in names if (REPO / n).exists()]
    return found + sorted((REPO / "docs").glob("*.md"))


def parsers() -> dict[str, argparse.ArgumentParser]:
    """``chattts-stream`` and each of its commands, by the command line that reaches it."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        found[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for command, sub in action.choices.items():
                    walk(f"{name} {command}", sub)

    walk("chattts-stream", cli._parser())
    return found


def known_flags() -> set[str]:
    return {o for p in parsers().values() for a in p._actions for o in a.option_strings if o.startswith("--")}


def help_texts() -> Iterator[tuple[str, str]]:
    """(where, text) for every description, epilog and help string of the command line.

    The raw strings, not ``format_help()``: its line wrapping may split a flag at a hyphen.
    """
    for name, parser in parsers().items():
        for field in ("description", "epilog"):
            if getattr(parser, field):
                yield f"`{name} --help` {field}", getattr(parser, field)
        for action in parser._actions:
            actions = [action]
            if isinstance(action, argparse._SubParsersAction):
                actions += action._get_subactions()  # the one-line help of each command
            for a in actions:
                if a.help and a.help is not argparse.SUPPRESS:
                    where = "/".join(a.option_strings) or a.dest or a.metavar or "?"
                    yield f"`{name} --help` of {where}", str(a.help)


def program_kind(command: str) -> str | None:
    """``"server"``, ``"other"`` (another tool's command) or ``None`` (not a command: prose decides)."""
    words = command.split()
    while words and (ENV_ASSIGNMENT.fullmatch(words[0]) or words[0] in {"$", "sudo", "exec", "time"}):
        words.pop(0)
    if not words or words[0].startswith("-"):
        return None
    first = words[0]
    name = first.rsplit("/", 1)[-1]
    if name in {"python", "python3"} and len(words) > 2 and words[1] == "-m":
        return "server" if words[2] == "server" or words[2].startswith("server.") else "other"
    if name in SERVER_PROGRAMS:
        return "server"
    if name in OTHER_PROGRAMS or name.endswith(".sh"):
        return "other"
    return None


def units(text: str) -> Iterator[tuple[int, str, bool]]:
    """(first line, text, is a shell command) for each prose block and each code line of ``text``."""
    lines = text.splitlines()
    block: list[str] = []
    block_start = 0

    def flush() -> Iterator[tuple[int, str, bool]]:
        if block:
            yield block_start, "\n".join(block), False
            block.clear()

    fence: str | None = None
    i = 0
    while i < len(lines):
        line, number = lines[i], i + 1
        i += 1
        opening = FENCE.match(line)
        if fence is None and opening:
            yield from flush()
            fence = opening.group(1).lower()
            continue
        if fence is not None:
            if FENCE.match(line):
                fence = None
            elif fence in SHELL_FENCES:
                command = line
                while command.rstrip().endswith("\\") and i < len(lines):
                    command = command.rstrip()[:-1] + "\n" + lines[i]
                    i += 1
                yield number, command, True
            else:
                yield number, line, False  # a comment in an example: prose
            continue
        if not line.strip() or BLOCK_START.match(line):
            yield from flush()
        if line.strip():
            if not block:
                block_start = number
            block.append(line)
            if SINGLE_LINE_BLOCK.match(line):
                yield from flush()
    yield from flush()


def doc_flags(text: str) -> Iterator[tuple[int, str]]:
    """(line, flag) for every flag of ``text`` that is the server's (see the module docstring)."""
    for start, unit, is_command in units(text):
        if is_command and program_kind(unit.lstrip()) is not None:
            if program_kind(unit.lstrip()) == "server":
                for m in FLAG.finditer(unit):
                    yield start + unit.count("\n", 0, m.start()), m.group()
            continue
        spans = [(m.start(), m.end(), program_kind(m.group(1))) for m in SPAN.finditer(unit)]
        about_other = OTHER_MENTION.search(unit) is not None or any(k == "other" for *_, k in spans)
        for m in FLAG.finditer(unit):
            kind = next((k for a, b, k in spans if a <= m.start() < b), None)
            if kind == "server" or (kind is None and not about_other):
                yield start + unit.count("\n", 0, m.start()), m.group()


def test_every_flag_in_the_help_texts_exists() -> None:
    known = known_flags()
    unknown = [
        f"{where}: {flag}" for where, text in help_texts() for flag in FLAG.findall(text) if flag not in known
    ]
    assert unknown == [], "flags named in help texts that no command has:\n" + "\n".join(unknown)


def test_every_server_flag_in_the_docs_exists() -> None:
    known = known_flags()
    unknown = [
        f"{path.relative_to(REPO)}:{line}: {flag}"
        for path in docs()
        for line, flag in doc_flags(path.read_text())
        if flag not in known
    ]
    assert unknown == [], "flags named in the docs that chattts-stream does not have:\n" + "\n".join(unknown)


def test_the_parsers_and_docs_are_found() -> None:
    assert {"chattts-stream serve", "chattts-stream make-dev-model"} <= set(parsers())
    assert {"--model-dir", "--dev-model", "--no-warmup", "--size", "--help"} <= known_flags()
    names = {str(p.relative_to(REPO)) for p in docs()}
    assert {"README.md", "CONTRIBUTING.md", "docs/operations.md", "client_py/README.md"} <= names


STALE = """\
Serve it:

```sh
scripts/serve.sh --model-dir DIR --allow-dev-model   # or: --dev-model tiny
kubectl create secret generic chattts-stream-keys --from-file=keys=./k.txt
python -m bench.gpu --device cpu \\
    --smoke
```

| flag | what |
|---|---|
| `--allow-dev-model` | serve random weights |
| `--target cpu` | the Dockerfile's CPU image |

Run `chattts-stream serve --no-such-flag`, or `python -m bench
--baselines ""` against it; `scripts/test.sh --co` lists the tests.

`bench.gpu` takes `--budget-s`.

```python
client = Client(url)  # with --api-keys: key=...
```
"""


def test_the_doc_rule_catches_stale_server_flags_only() -> None:
    found = [(line, flag) for line, flag in doc_flags(STALE) if flag not in known_flags()]
    assert found == [(4, "--allow-dev-model"), (12, "--allow-dev-model"), (15, "--no-such-flag")]
    assert (4, "--dev-model") in set(doc_flags(STALE))  # a comment on a server command
    assert (21, "--api-keys") in set(doc_flags(STALE))  # a comment in an example


def test_the_help_rule_catches_a_stale_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    build = cli._parser

    def stale() -> argparse.ArgumentParser:
        parser = build()
        parser.description = "serve it with --model-dir DIR --allow-dev-model"
        return parser

    monkeypatch.setattr(cli, "_parser", stale)
    unknown = [flag for _, text in help_texts() for flag in FLAG.findall(text) if flag not in known_flags()]
    assert unknown == ["--allow-dev-model"]
