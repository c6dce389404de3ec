"""Failover with the tiny ChatTTS model on CPU: a stream regenerated on another replica, in another batch.

float32 is batch-invariant, so the regenerated stream equals the lost one byte for byte; with
the default dtype (bf16 where the CPU computes it natively) the replica says
``resume_degraded`` instead of promising it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest

from server.app import App
from tests.resumer import Taken, open_ws, take, unbroken

pytestmark = pytest.mark.loopback
SECRET = "model-failover-test-secret-0123"
TEXTS = [
    "第一句话在这里。The second sentence is here. 第三句话结束了。",
    "Another stream shares the batch. 它也有三句话。And it ends here.",
    "A third one, to fill the batch a little more.",
]


async def cut_while_others_play(app: App, start: dict[str, Any], cut_after: int) -> Taken:
    """Start ``start`` beside two other streams (a batch of three), cut it after ``cut_after`` frames."""
    others = []
    for n, text in enumerate(TEXTS[1:]):
        ws = await open_ws(app.port)
        await ws.send(json.dumps({"type": "start", "id": f"o{n}", "text": text, "seed": 9 + n}))
        others.append(ws)
    taken = Taken(start)
    ws = await open_ws(app.port)
    await ws.send(json.dumps({"type": "start", **start}))
    assert await take(ws, taken, cut_after) == "cut"
    for other in others:
        other.transport.abort()
    return taken


async def resume_alone(app: App, taken: Taken) -> str:
    ws = await open_ws(app.port)
    await ws.send(json.dumps(taken.resume()))
    outcome = await take(ws, taken)
    await ws.close()
    return outcome


def pcm16(frame: bytes) -> np.ndarray:
    return np.frombuffer(frame[5:], "<i2").astype(np.int32)


async def test_float32_regeneration_on_another_replica_has_the_same_tokens(make_model_app: Any) -> None:
    """The stream cut on one replica (in a batch of three) and regenerated on another (alone).

    The tokens are the same in any batch (per-row counter-based sampling, float32); the audio
    is the same up to the rounding of the vocoder, which decodes a step's rows as one batch (a
    batch of another size rounds a few float32 samples differently: at most 1 LSB of pcm16).
    """
    a = await make_model_app("--resume-secret", SECRET)
    b = await make_model_app("--resume-secret", SECRET)
    start = {"id": "m", "text": TEXTS[0], "seed": 5}
    expected = await unbroken(b.port, start)  # alone, on the other replica
    taken = await cut_while_others_play(a, start, cut_after=len(expected.frames) // 2)
    assert len(taken.marks) >= 2  # past the first segment: PCM restarts at the second
    await a.stop()
    assert await resume_alone(b, taken) == "done"
    assert not any(m["type"] == "resume_degraded" for m in taken.messages)
    got, done = taken.signature()
    want, want_done = expected.signature()
    assert done == want_done and sorted(got) == sorted(want) and taken.marks == expected.marks
    assert all(got[seq][:5] == want[seq][:5] for seq in want)  # flags and sample offsets
    worst = max(int(np.abs(pcm16(got[seq]) - pcm16(want[seq])).max()) for seq in want)
    assert worst <= 1, worst  # different tokens would differ by thousands


async def test_the_default_dtype_says_when_a_regeneration_may_differ(make_model_app: Any) -> None:
    a = await make_model_app("--resume-secret", SECRET, "--dtype", "auto")
    b = await make_model_app("--resume-secret", SECRET, "--dtype", "auto")
    dtype = b.engine_client.info.extra["dtype"]
    start = {"id": "m", "text": TEXTS[0], "seed": 5}
    taken = await cut_while_others_play(a, start, cut_after=20)
    await a.stop()
    async with asyncio.timeout(120):
        assert await resume_alone(b, taken) == "done"
    degraded = [m for m in taken.messages if m["type"] == "resume_degraded"]
    if dtype == "float32":  # a CPU without native bf16: auto is float32, which is exact
        assert degraded == []
    else:
        assert len(degraded) == 1 and dtype in degraded[0]["reason"]
