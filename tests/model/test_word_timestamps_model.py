"""Word timestamps on the tiny ChatTTS model (random weights): the wire's rules hold on real model audio."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.integration.test_resume import read_until_cut
from tests.integration.test_word_timestamps import TEXT, WORDS, check_words, run, without_slot
from tests.wsclient import collect, open_client, start

pytestmark = pytest.mark.loopback  # a server on 127.0.0.1


async def test_words_on_the_tiny_model_and_their_replay_after_a_resume(make_model_app: Any) -> None:
    app = await make_model_app("--resume-ttl-s", "30")
    reference = await run(app, text=TEXT, seed=5, word_timestamps=True)
    check_words(reference, WORDS)
    target = next(m for m in reference.words if m["seq"] > 0)
    ws, _ = await open_client(app.port)
    await start(ws, id="w", text=TEXT, seed=5, word_timestamps=True)
    got: dict[int, bytes] = {}
    token = await read_until_cut(ws, got, cut_after=target["seq"])
    ws, _ = await open_client(app.port)
    await ws.send(json.dumps({"type": "resume", "stream": token, "after_seq": max(got)}))
    resumed = (await collect(ws, {"w"}))["w"]
    await ws.close()
    assert without_slot(resumed.words) == without_slot([m for m in reference.words if m["seq"] > max(got)])
