"""``refine`` and ``refine_prompt`` through the real WebSocket and OpenAI endpoint (fake engine).

The fake engine's audio is a function of every synthesis parameter, refinement included, so
a stream's bytes show what reached the engine. The real refinement (the tiny ChatTTS model,
a stubbed refiner) is in ``tests/model/test_refine_server.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from openai import AsyncOpenAI

from server.app import App
from server.audio.pcm import to_pcm16
from server.engine.fake import expected_audio
from server.engine_api import SequenceRequest, SynthesisParams
from server.text.segments import split_segments
from tests.integration.test_http_speech import assert_openai_error, base_url, post
from tests.wsclient import collect, open_client, start

TEXT = "先精炼这一句。Then this one."
PROMPT = "[oral_2][laugh_0][break_6]"


def expected(text: str, seed: int, **params: Any) -> bytes:
    synthesis = SynthesisParams(seed=seed, **params)
    parts = [
        expected_audio(SequenceRequest(seq_id=0, text=seg, params=synthesis, seed_offset=k))
        for k, seg in enumerate(split_segments(text))
    ]
    return to_pcm16(np.concatenate(parts)).tobytes()


async def ws_log(app: App, **fields: Any) -> Any:
    ws, _ = await open_client(app.port)
    await start(ws, id="r", **fields)
    log = (await collect(ws, {"r"}))["r"]
    await ws.close()
    return log


async def test_refine_reaches_the_engine_from_both_front_ends_and_is_off_by_default(app: App) -> None:
    refined = expected(TEXT, 4, refine=True, refine_prompt=PROMPT)
    log = await ws_log(app, text=TEXT, seed=4, refine=True, refine_prompt=PROMPT)
    assert log.done["reason"] == "complete" and log.payload == refined
    async with AsyncOpenAI(base_url=base_url(app), api_key="x", max_retries=0) as oai:
        speech = await oai.audio.speech.create(
            model="tts-1",
            voice="alloy",
            input=TEXT,
            response_format="pcm",
            extra_body={"seed": 4, "refine": True, "refine_prompt": PROMPT},
        )
        plain = await oai.audio.speech.create(
            model="tts-1", voice="alloy", input=TEXT, response_format="pcm", extra_body={"seed": 4}
        )
    assert speech.content == refined
    assert plain.content == expected(TEXT, 4) != refined
    assert (await ws_log(app, text=TEXT, seed=4)).payload == expected(TEXT, 4)


async def test_incremental_streams_refine_each_segment(app: App) -> None:
    ws, _ = await open_client(app.port)
    await start(ws, id="r", incremental=True, seed=6, refine=True)
    await ws.send('{"type": "append", "id": "r", "text": "先精炼这一句。"}')
    await ws.send('{"type": "append", "id": "r", "text": "Then this one."}')
    await ws.send('{"type": "end", "id": "r"}')
    log = (await collect(ws, {"r"}))["r"]
    await ws.close()
    assert log.done["reason"] == "complete"
    assert log.payload == expected(TEXT, 6, refine=True)


@pytest.mark.parametrize(
    ("prompt", "reason"),
    [
        ("[uv_break]", "refine_prompt takes [oral_0-9], [laugh_0-2] and [break_0-7]"),
        ("[oral_2] more", "may only hold tags"),
        ("[break_9]", "out of range"),
        ("[oral_1][oral_3]", "twice"),
    ],
)
async def test_bad_refine_prompts_are_refused_by_name(app: App, prompt: str, reason: str) -> None:
    log = await ws_log(app, text=TEXT, refine=True, refine_prompt=prompt)
    assert log.errors[0]["code"] == "bad_request" and reason in log.errors[0]["message"]
    status, _, answer = await post(app, {"input": TEXT, "refine": True, "refine_prompt": prompt})
    assert_openai_error(status, answer, "bad_request", None)
    assert reason in answer["error"]["message"]


async def test_an_overlong_refine_prompt_names_the_field(app: App) -> None:
    status, _, answer = await post(app, {"input": TEXT, "refine_prompt": "[oral_2]" * 9})
    assert_openai_error(status, answer, "bad_request", "refine_prompt")
    log = await ws_log(app, text=TEXT, refine_prompt="[oral_2]" * 9)
    assert log.errors[0]["code"] == "bad_request" and "refine_prompt" in log.errors[0]["message"]


async def test_refinement_can_be_off_on_the_server(make_app: Any) -> None:
    app = await make_app("--refine-max-tokens", "0")
    log = await ws_log(app, text=TEXT, refine=True)
    assert log.errors[0]["code"] == "unsupported" and "--refine-max-tokens 0" in log.errors[0]["message"]
    status, _, answer = await post(app, {"input": TEXT, "refine": True})
    assert_openai_error(status, answer, "unsupported", None)
    assert (await ws_log(app, text=TEXT, seed=1)).payload == expected(TEXT, 1)  # unrefined still speaks


async def test_refinement_is_part_of_the_cache_key(app: App) -> None:
    plain = await ws_log(app, text=TEXT, seed=8)
    refined = await ws_log(app, text=TEXT, seed=8, refine=True)
    prompted = await ws_log(app, text=TEXT, seed=8, refine=True, refine_prompt=PROMPT)
    assert len({plain.payload, refined.payload, prompted.payload}) == 3
    assert "chattts_cache_hits_total 0.0" in app.metrics.render().decode()
    again = await ws_log(app, text=TEXT, seed=8, refine=True)
    assert again.payload == refined.payload
    assert "chattts_cache_hits_total 1.0" in app.metrics.render().decode()
