"""The documentation site (mkdocs.yml, docs/site_hooks.py) builds with ``mkdocs build --strict``.

Strict: a link to a missing file or page, or to an anchor that no heading makes, fails the build,
so CI (this test) keeps every link of the user docs working on the site and on GitHub alike.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about its successor
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(config),
            "--site-dir",
            str(site),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )


def test_the_site_builds_strictly_with_every_page(tmp_path: Path) -> None:
    result = build(REPO / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    site = tmp_path / "site"
    for page in [
        "index.html",  # README.md, the home page
        "docs/operations/index.html",
        "docs/protocol/index.html",
        "docs/weights/index.html",
        "docs/architecture/index.html",
        "client_py/index.html",
        "bench/results/index.html",
        "bench/results/gpu/h200/index.html",
    ]:
        assert (site / page).is_file(), page
    assert (site / "bench/results/gpu/h200.json").is_file()  # a file a page links to comes along


def small_repo(root: Path, readme: str) -> Path:
    """A repository of two pages with the real configuration and hook, but no nav."""
    (root / "docs").mkdir(parents=True)
    (root / "data").mkdir()
    config = (REPO / "mkdocs.yml").read_text()
    (root / "mkdocs.yml").write_text(config[: config.index("\nnav:")] + "\n")
    shutil.copy(REPO / "docs/site_hooks.py", root / "docs/site_hooks.py")
    (root / "docs/guide.md").write_text("# Guide\n\n## The flags that matter\n\nText.\n")
    (root / "data/result.json").write_text("{}\n")
    (root / "README.md").write_text(readme)
    return root / "mkdocs.yml"


def test_good_links_build_and_carry_their_files(tmp_path: Path) -> None:
    config = small_repo(
        tmp_path, "# Home\n\n[g](docs/guide.md#the-flags-that-matter), [r](data/result.json)\n"
    )
    result = build(config, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site/data/result.json").is_file()


def test_a_broken_anchor_fails_the_build(tmp_path: Path) -> None:
    config = small_repo(tmp_path, "# Home\n\n[g](docs/guide.md#capacity)\n")
    result = build(config, tmp_path / "site")
    assert result.returncode != 0
    assert "does not contain an anchor '#capacity'" in result.stdout + result.stderr


def test_a_link_to_a_missing_file_fails_the_build(tmp_path: Path) -> None:
    config = small_repo(tmp_path, "# Home\n\n[r](data/gone.json), [g](docs/gone.md)\n")
    result = build(config, tmp_path / "site")
    assert result.returncode != 0
    assert "data/gone.json" in result.stdout + result.stderr
    assert "docs/gone.md" in result.stdout + result.stderr


#: The documents a user reads (architecture.md is the maintainers'): no internal issue numbers there,
#: which a user cannot look up. ``owner/repo#123`` (another project's public issue) is allowed.
USER_DOCS = [
    "README.md",
    *[str(p.relative_to(REPO)) for p in sorted((REPO / "docs").glob("*.md")) if p.name != "architecture.md"],
    "client_js/README.md",
    "client_py/README.md",
    *[str(p.relative_to(REPO)) for p in sorted((REPO / "deploy").rglob("README.md"))],
]
ISSUE_NUMBER = re.compile(r"(?i)\bissues?\s+#?\d+|(?<![\w/&])#\d+\b")


def issue_numbers(text: str) -> list[str]:
    return [f"{text.count(chr(10), 0, m.start()) + 1}: {m.group()}" for m in ISSUE_NUMBER.finditer(text)]


def test_user_docs_cite_no_internal_issue_numbers() -> None:
    assert {"README.md", "docs/operations.md", "docs/protocol.md", "client_py/README.md"} <= set(USER_DOCS)
    found = {name: issue_numbers((REPO / name).read_text()) for name in USER_DOCS}
    assert {name: hits for name, hits in found.items() if hits} == {}


def test_the_issue_number_rule_catches_what_it_should() -> None:
    text = "Fixed in #23.\nSee issue 42 and Issue #7.\nSee sigs/adapter#701, &#38;.\n"
    assert issue_numbers(text) == ["1: #23", "2: issue 42", "2: Issue #7"]


def test_the_operators_manual_stays_short() -> None:
    assert len((REPO / "docs/operations.md").read_text().splitlines()) < 500


def exported_names() -> set[str]:
    """The names a Prometheus query can use: counters with ``_total``, histograms bare or with a suffix."""
    from server.metrics import Metrics

    names = set()
    for collector in set(Metrics().registry._names_to_collectors.values()):
        for family in collector.describe():
            suffixes = {
                "counter": ["_total"],
                "info": ["_info"],
                "histogram": ["", "_bucket", "_sum", "_count"],
            }
            names |= {family.name + suffix for suffix in suffixes.get(family.type, [""])}
    return names


def test_every_metric_the_manual_names_is_exported() -> None:
    exported = exported_names()
    assert "chattts_errors" not in exported  # a counter is queried by its _total
    named = set(re.findall(r"\bchattts_[a-z_]+\b", (REPO / "docs/operations.md").read_text()))
    assert {"chattts_active_streams", "chattts_audio_generated_seconds_total"} <= named
    assert sorted(named - exported) == []
