"""``bench/results/README.md`` indexes every committed result, and only files that exist (issue #44).

One current result per question and hardware, in the folder of the ``bench`` package that made
it: a file missing from the index is a result nobody can find, a link to a missing file is a
stale row, and a file directly in ``bench/results`` has no folder to say what made it.
"""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
INDEX = RESULTS / "README.md"
#: The folders results live in: the ``bench`` packages that write them.
FOLDERS = {"harness", "cpu", "gpu", "gpu_sim", "chaos", "soak", "words", "studies"}
#: A markdown link's target: ``[text](target)``.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def indexed(index: str) -> set[str]:
    """The relative paths the index links to (anchors and web addresses left out)."""
    return {
        target.split("#", 1)[0]
        for target in LINK.findall(index)
        if not target.startswith(("http://", "https://", "#"))
    }


def committed() -> set[str]:
    """Every file under ``bench/results`` but the index, relative to it."""
    return {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file() and p != INDEX}


def problems(index: str, files: set[str]) -> list[str]:
    links = indexed(index)
    found = [f"not in bench/results/README.md: {f}" for f in sorted(files - links)]
    found += [f"bench/results/README.md links a missing file: {f}" for f in sorted(links - files)]
    found += [f"directly in bench/results (needs a folder): {f}" for f in sorted(files) if "/" not in f]
    found += [
        f"in a folder that is no bench package: {f}"
        for f in sorted(files)
        if "/" in f and f.split("/", 1)[0] not in FOLDERS
    ]
    return found


def test_the_index_lists_every_result_and_only_files_that_exist() -> None:
    assert problems(INDEX.read_text(), committed()) == []


def test_the_index_is_one_table() -> None:
    lines = INDEX.read_text().splitlines()
    headers = [line for line in lines if line.startswith("| question |")]
    assert headers == ["| question | headline number | hardware | date | command | files |"]


def test_the_check_catches_a_missing_row_a_stale_row_and_a_loose_file() -> None:
    index = "| q |\n|---|\n| a | [cpu/x.md](cpu/x.md), [json](cpu/x.json) |\n| b | [gone.md](cpu/gone.md) |\n"
    files = {"cpu/x.md", "cpu/x.json", "cpu/y.md", "loose.md", "misc/z.md"}
    assert problems(index, files) == [
        "not in bench/results/README.md: cpu/y.md",
        "not in bench/results/README.md: loose.md",
        "not in bench/results/README.md: misc/z.md",
        "bench/results/README.md links a missing file: cpu/gone.md",
        "directly in bench/results (needs a folder): loose.md",
        "in a folder that is no bench package: misc/z.md",
    ]
