"""Run requests through an engine and collect per-sequence audio."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from server.engine_api import SequenceRequest

#: Where engine tests run the model: ``cpu`` (CI), or ``cuda`` (``python -m bench.gpu`` sets it).
TEST_DEVICE = os.environ.get("CHATTTS_TEST_DEVICE", "cpu")


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


def step_until_finished(engine: Any, live: list[int], max_steps: int = 300) -> None:
    """Step the ``live`` sequences together until every one has finished (``live`` ends empty)."""
    for _ in range(max_steps):
        if not live:
            break
        for result in engine.step(live):
            if result.finished:
                live.remove(result.seq_id)
    assert not live, "sequences did not finish"


def full_size_decoder_and_vocos() -> tuple[Any, Any]:
    """ChatTTS's full-size Decoder and Vocos with random weights at trained-like layer scales (seed 0)."""
    from dataclasses import asdict

    import torch
    from ChatTTS.config import config as cfg
    from ChatTTS.model import DVAE
    from vocos import Vocos
    from vocos.pretrained import instantiate_class

    from server.engine.chattts.devmodel import _scale_layer_scales

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    c = cfg.Config()
    decoder = DVAE(decoder_config=asdict(c.decoder), dim=c.decoder.idim).eval()
    _scale_layer_scales(decoder, gen)
    vocos = Vocos(
        feature_extractor=instantiate_class(args=(), init=asdict(c.vocos.feature_extractor)),
        backbone=instantiate_class(args=(), init=asdict(c.vocos.backbone)),
        head=instantiate_class(args=(), init=asdict(c.vocos.head)),
    ).eval()
    return decoder, vocos
