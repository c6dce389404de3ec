"""The simulated model's token arithmetic: how long a segment is, and when a row's audio is decoded.

A segment's length in audio tokens follows from its text at the voices' speech rate (seeded
jitter, as a seeded model's length is); its prompt from the control tokens and the text; a row
decodes at the cumulative targets of the block schedule. The device costs are elsewhere
(:mod:`bench.gpu_sim.model`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator

from server.engine_api import NATIVE_SAMPLE_RATE

#: One audio token is 512 samples at 24 kHz (21.3 ms; /work/shared/design/CHATTTS-FACTS.md).
SAMPLES_PER_TOKEN = 512
TOKENS_PER_S = NATIVE_SAMPLE_RATE / SAMPLES_PER_TOKEN  # 46.875
#: The served default block schedule (``--block-schedule``): a row decodes at its cumulative
#: targets 8, 24, 44, 64, 88, 112, 140, 172, 204, ... (every one a multiple of 4).
BLOCK_SCHEDULE = (8, 16, 20, 20, 24, 24, 28, 32)
#: Speech rate of the model's voices, for a segment's length in tokens: Chinese characters and
#: Latin characters (spaces included) spoken per second (typical read speech).
ZH_CHARS_PER_S = 4.5
EN_CHARS_PER_S = 14.0
#: A segment's prompt: the control tokens around the text ([Stts][spk_emb][speed_5]...[Ptts] and
#: the padding to its bucket), plus one token per CJK character or one per four Latin ones.
PROMPT_BASE_TOKENS = 16
EN_CHARS_PER_PROMPT_TOKEN = 4


def segment_tokens(text: str, seed: int | None, offset: int) -> tuple[int, int]:
    """``(audio tokens, prompt tokens)`` of a segment: its speech at the voices' rate, ±20 %.

    Deterministic in the text, the stream's seed and the segment's offset, as a seeded
    model's length is.
    """
    cjk = sum(1 for ch in text if "\u3000" <= ch <= "\u9fff" or "\uff00" <= ch <= "\uffef")
    latin = len(text) - cjk
    seconds = cjk / ZH_CHARS_PER_S + latin / EN_CHARS_PER_S
    digest = hashlib.sha256(f"{text}\x1f{seed}\x1f{offset}".encode()).digest()
    jitter = 0.8 + 0.4 * int.from_bytes(digest[:4], "little") / 2**32
    tokens = max(4, math.ceil(seconds * TOKENS_PER_S * jitter))
    prompt = PROMPT_BASE_TOKENS + cjk + -(-latin // EN_CHARS_PER_PROMPT_TOKEN)
    return tokens, prompt


def decode_targets(schedule: tuple[int, ...] = BLOCK_SCHEDULE) -> Iterator[int]:
    """A row's cumulative decode targets: 8, 24, 44, ... (the last block size repeats)."""
    total = 0
    index = 0
    while True:
        total += schedule[min(index, len(schedule) - 1)]
        index += 1
        yield total
