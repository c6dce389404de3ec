"""Run requests through an engine and collect per-sequence audio."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from server.engine.base import SequenceRequest


@dataclass
class Collected:
    audio: list[np.ndarray] = field(default_factory=list)
    tokens: int = 0
    steps: int = 0

    @property
    def samples(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)


def run_to_end(engine: Any, requests: list[SequenceRequest], max_steps: int = 1000) -> dict[int, Collected]:
    for r in requests:
        engine.add(r)
    out = {r.seq_id: Collected() for r in requests}
    live = [r.seq_id for r in requests]
    for _ in range(max_steps):
        if not live:
            break
        for res in engine.step(live):
            c = out[res.seq_id]
            c.audio.append(res.audio)
            c.tokens += res.tokens
            c.steps += 1
            assert res.audio.dtype == np.float32
            if res.finished:
                live.remove(res.seq_id)
    assert not live, "sequences did not finish"
    return out
