"""Text sets: which texts the load generators send, in a reproducible order."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

#: The committed default set: short, medium and long Chinese and English texts.
DEFAULT_TEXTS = Path(__file__).resolve().parents[1] / "texts" / "default.jsonl"


@dataclass(frozen=True)
class BenchText:
    """One text to synthesize.

    Attributes:
        text: what is sent in ``start``.
        lang: language tag (``zh``, ``en``, ...; free-form).
        size: ``short``, ``medium`` or ``long`` (free-form).
    """

    text: str
    lang: str = ""
    size: str = ""


def load_texts(path: Path, *, sizes: tuple[str, ...] = (), langs: tuple[str, ...] = ()) -> list[BenchText]:
    """Read a text set.

    ``.jsonl`` files hold one object per line with ``text`` and optional
    ``lang`` and ``size``; any other file holds one text per non-empty line.
    ``sizes`` and ``langs`` keep only the matching texts (empty = all).

    Raises:
        ValueError: the file holds no text after filtering.
    """
    texts: list[BenchText] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if path.suffix == ".jsonl":
            try:
                item = json.loads(line)
                texts.append(
                    BenchText(str(item["text"]), str(item.get("lang", "")), str(item.get("size", "")))
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: expected a JSON object with 'text' ({exc})") from None
        else:
            texts.append(BenchText(line.strip()))
    texts = [t for t in texts if (not sizes or t.size in sizes) and (not langs or t.lang in langs)]
    if not texts:
        raise ValueError(f"{path}: no texts (sizes={list(sizes)}, langs={list(langs)})")
    return texts


@dataclass(frozen=True)
class Job:
    """The k-th stream of a scenario: which text and seed it uses.

    Every system under test (server, ChatTTS ``infer``, engine in-process)
    draws the same job sequence, so they synthesize the same work.
    """

    index: int
    text: BenchText
    seed: int


def seed_base(seed: int, label: str, variant: int = 0) -> int:
    """The first job seed of a scenario.

    Distinct per scenario label (``c8``, ``r1.5``) and variant (the format's
    position), so no request repeats within a run and a server's response
    cache for seeded requests never answers one; the same for every system,
    so the server and the in-process baselines synthesize the same jobs.
    """
    return seed * 100_000_000 + (zlib.crc32(label.encode()) % 10_000) * 10_000 + variant * 5_000


def job(texts: list[BenchText], index: int, base_seed: int) -> Job:
    """The ``index``-th job: texts in round-robin order, seed ``base_seed + index``."""
    return Job(index=index, text=texts[index % len(texts)], seed=base_seed + index)
