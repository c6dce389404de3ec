"""The soak's request mix: kinds, sizes and bad inputs with their weights, and the seeded plan of requests.

Fixed before the run: the same ``--seed`` and server limits give the same plan, so a failing
request can be replayed. :mod:`bench.soak.load` plays it.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from bench.harness.textset import BenchText

#: Request kinds and their default weights in the mix.
KIND_WEIGHTS: dict[str, float] = {
    "complete": 0.28,
    "repeat": 0.08,
    "cancel": 0.12,
    "abandon": 0.10,
    "resume": 0.12,
    "incremental": 0.08,
    "multi": 0.06,
    "bad": 0.16,
}
#: Text sizes and their weights; ``xlong`` is built up to the server's ``max_text_chars``.
SIZE_WEIGHTS: dict[str, float] = {"short": 0.55, "medium": 0.3, "long": 0.12, "xlong": 0.03}
#: Bad inputs: sub-kind → the error code the server must answer.
BAD_INPUTS: dict[str, str] = {
    "malformed_json": "bad_request",
    "unknown_type": "bad_request",
    "too_long": "text_too_long",
    "bad_format": "unsupported",
    "bad_rate": "unsupported",
    "bad_voice": "unsupported",
    "bad_field": "bad_request",
    "binary": "bad_request",
    "cancel_unknown": "bad_request",
    "resume_unknown": "unknown_stream",
    "unspeakable": "bad_request",
    "duplicate_id": "duplicate_id",
    "too_many_streams": "too_many_streams",
    "append_not_incremental": "bad_request",
}
REPEAT_POOL = 12


@dataclass(frozen=True)
class Plan:
    """One request of the soak, fixed before the run (seeded)."""

    index: int
    kind: str
    sub: str
    text: BenchText
    fmt: str
    seed: int | None
    cut_after: tuple[int, ...]  # frames before each cancel/cut
    pause_frac: float  # before a resume, as a fraction of the resume TTL (at most a quarter)
    pieces: tuple[str, ...]  # incremental
    extra_texts: tuple[BenchText, ...]  # multi / too_many_streams


def build_long_text(rng: random.Random, pool: list[BenchText], lang: str, lo: int, hi: int) -> BenchText:
    """Concatenate texts of ``lang`` until the length lies in ``[lo, hi]`` characters."""
    target = rng.randint(lo, hi)
    same = [t for t in pool if t.lang == lang] or pool
    sep = " " if lang == "en" else ""
    out = ""
    while True:
        piece = rng.choice(same).text
        if len(out) + len(sep) + len(piece) > target:
            break
        out = f"{out}{sep}{piece}" if out else piece
    if len(out) < lo:  # top up with the start of one more text, cut at a word boundary
        out = (out + sep + rng.choice(same).text * 4)[:target].rstrip()
    return BenchText(out, lang, "xlong")


def make_plan(n: int, seed: int, texts: list[BenchText], max_text_chars: int, max_streams: int) -> list[Plan]:
    """The seeded request mix (same ``seed`` and server limits → the same plan)."""
    rng = random.Random(seed)
    kinds, kind_w = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    sizes, size_w = list(SIZE_WEIGHTS), list(SIZE_WEIGHTS.values())
    by_size = {s: [t for t in texts if t.size == s] for s in ("short", "medium", "long")}

    def pick_text(size: str) -> BenchText:
        if size == "xlong":
            lang = rng.choice(["zh", "en"])
            return build_long_text(rng, texts, lang, max_text_chars * 6 // 10, max_text_chars)
        return rng.choice(by_size.get(size) or texts)

    repeat_pool = [
        (rng.choice(by_size.get("short") or texts), rng.choice(["pcm16", "opus"]), rng.randrange(1, 10**6))
        for _ in range(REPEAT_POOL)
    ]
    plans: list[Plan] = []
    for index in range(n):
        kind = rng.choices(kinds, kind_w)[0]
        size = rng.choices(sizes, size_w)[0]
        if kind in ("incremental", "multi") and size == "xlong":
            size = "long"
        text = pick_text(size)
        fmt = "opus" if rng.random() < 0.4 else "pcm16"
        seed_value: int | None = rng.randrange(10**6, 2**31) if rng.random() < 0.85 else None
        sub = ""
        extra: tuple[BenchText, ...] = ()
        if kind == "repeat":
            text, fmt, seed_value = repeat_pool[rng.randrange(REPEAT_POOL)]
        elif kind == "bad":
            sub = rng.choice(list(BAD_INPUTS))
            text = rng.choice(by_size.get("short") or texts)
            if sub == "too_many_streams":
                extra = tuple(rng.choice(by_size.get("short") or texts) for _ in range(max_streams))
        elif kind == "multi":
            extra = tuple(
                rng.choice(by_size.get(rng.choice(["short", "medium"])) or texts)
                for _ in range(rng.randint(2, max(2, max_streams)))
            )
        pieces: tuple[str, ...] = ()
        if kind == "incremental":
            cuts = sorted(rng.sample(range(1, len(text.text)), min(rng.randint(1, 5), len(text.text) - 1)))
            bounds = [0, *cuts, len(text.text)]
            pieces = tuple(text.text[a:b] for a, b in itertools.pairwise(bounds))
        plans.append(
            Plan(
                index=index,
                kind=kind,
                sub=sub,
                text=text,
                fmt=fmt,
                seed=seed_value,
                cut_after=tuple(rng.randint(1, 40) for _ in range(rng.choice([1, 1, 2]))),
                pause_frac=rng.uniform(0.0, 0.25),
                pieces=pieces,
                extra_texts=extra,
            )
        )
    return plans
