"""mkdocs hook: the documentation site is the repository's own Markdown, at its repository paths.

The user docs live beside what they describe (README.md at the root, client_py/README.md,
deploy/k8s/README.md, bench/results/README.md and every result file), and they link to each
other by repository paths, which is what GitHub shows. mkdocs reads only ``docs_dir``, and
neither the include plugins nor snippets can keep a linked tree's relative links working, so
this hook replaces the files mkdocs found with:

- the pages of ``PAGES``, each at its repository path (``README.md`` is the home page, as mkdocs
  makes every ``README.md`` its folder's index);
- every other repository file that one of those pages links to (a result's JSON or plot,
  ``LICENSE``, a chart's ``values.yaml``), copied as it is, so that the link works on the site.

A link to anything else (a missing file, a page left out of ``PAGES``, an anchor that no heading
makes) stays broken, and ``mkdocs build --strict`` fails on it (``validation`` in mkdocs.yml).
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any

from mkdocs.structure.files import File, Files

#: The Markdown files that are pages of the site (globs relative to the repository root).
PAGES = (
    "README.md",
    "CONTRIBUTING.md",
    "docs/*.md",
    "client_py/README.md",
    "client_js/README.md",
    "deploy/**/README.md",
    "bench/README.md",
    "bench/studies/README.md",
    "bench/results/**/*.md",
)

#: ``[text](target)`` and ``![alt](target)``: the target up to a space, ``#`` or ``)``.
LINK = re.compile(r"\]\(\s*<?([^)\s#>]+)")


def _linked_files(root: Path, page: Path) -> set[Path]:
    """The repository files (not folders, not Markdown) that ``page`` links to by a relative path."""
    found = set()
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if "://" in target or target.startswith(("/", "mailto:")) or target.endswith(".md"):
            continue
        path = (page.parent / target).resolve()
        if path.is_file() and path.is_relative_to(root):
            found.add(path)
    return found


def on_files(files: Files, config: Any) -> Files:
    """Every page of ``PAGES`` and every file they link to, at its repository path."""
    root = Path(config.config_file_path).resolve().parent
    pages = sorted({p.resolve() for pattern in PAGES for p in root.glob(pattern) if p.is_file()})
    linked = set().union(*(_linked_files(root, p) for p in pages)) - set(pages)
    site = [
        File(
            str(PurePosixPath(path.relative_to(root).as_posix())),
            str(root),
            config.site_dir,
            config.use_directory_urls,
        )
        for path in [*pages, *sorted(linked)]
    ]
    docs_dir = Path(config.docs_dir).resolve()
    # The theme's files (and any a plugin generated) stay; docs_dir's are among the pages above.
    kept = [f for f in files if f.src_dir is None or Path(f.src_dir).resolve() != docs_dir]
    return Files([*site, *kept])
