"""Segments are held to the prompt budget with the model's own token count (issue 42, finding 10).

Spelled-out numbers are about 10 tokens a digit for ChatTTS's tokenizer while the text limits
count characters: a long number used to fail its whole stream with ``engine_error`` inside the
engine. Now it is cut at spaces where it has them, or refused at ``start``/``append``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from server.app import App
from tests.wsclient import collect, open_client, recv_json, start

pytestmark = pytest.mark.loopback  # our own server on 127.0.0.1, nothing else

#: Small slots: the budget is the segment limit (120 tokens), voices and refinement off.
FLAGS = ("--segment-max-tokens", "64", "--voice-max-seconds", "0", "--refine-max-tokens", "0")
#: 20 digits: about 190 tokens once spelled out, with no space to cut at.
LONG_NUMBER = "12345678901234567890"
#: Three 7-digit numbers: about 190 tokens, cut at the spaces into pieces that fit.
NUMBERS = "1234567 7654321 1234567"


async def budget_app(make_model_app: Any) -> App:
    app: App = await make_model_app(*FLAGS)
    return app


async def test_the_engine_counts_spelled_out_numbers_and_publishes_its_budget(make_model_app: Any) -> None:
    app = await budget_app(make_model_app)
    client = app.engine_client
    assert client.info.max_text_tokens == 120
    assert client.text_tokens(LONG_NUMBER) > 120 >= len(LONG_NUMBER)  # characters say little
    assert client.text_tokens(NUMBERS) > 120
    assert all(client.text_tokens(n) <= 120 for n in NUMBERS.split())


async def test_a_long_number_is_refused_at_start_not_failed_in_the_engine(make_model_app: Any) -> None:
    app = await budget_app(make_model_app)
    ws, _ = await open_client(app.port)
    await start(ws, id="n", text=f"The code is {LONG_NUMBER}.", seed=1)
    log = (await collect(ws, {"n"}))["n"]
    assert log.started is None and log.done is None, log.order  # nothing started: no engine_error
    assert [e["code"] for e in log.errors] == ["bad_request"]
    assert "tokens for the model" in log.errors[0]["message"]
    # The connection serves on.
    await start(ws, id="ok", text="Short and fine.", seed=1)
    done = (await collect(ws, {"ok"}))["ok"].done
    assert done is not None and done["reason"] == "complete"
    await ws.close()


async def test_numbers_with_spaces_are_cut_into_segments_that_fit(make_model_app: Any) -> None:
    app = await budget_app(make_model_app)
    ws, _ = await open_client(app.port)
    await start(ws, id="s", text=NUMBERS, seed=1)
    log = (await collect(ws, {"s"}))["s"]
    await ws.close()
    assert log.errors == [] and log.done is not None and log.done["reason"] == "complete", log.order
    texts = [s["text"] for s in log.segments]
    assert " ".join(texts) == NUMBERS and len(texts) > 1
    assert all(app.engine_client.text_tokens(t) <= 120 for t in texts)


async def test_an_append_that_makes_a_number_too_long_is_refused_and_the_stream_goes_on(
    make_model_app: Any,
) -> None:
    app = await budget_app(make_model_app)
    ws, _ = await open_client(app.port)
    await start(ws, id="i", incremental=True, seed=1, text="The code is 1234567890")
    started = await recv_json(ws)
    assert started["type"] == "started"
    # The same number goes on: 20 digits in one run, over the budget.
    await ws.send(json.dumps({"type": "append", "id": "i", "text": "1234567890 and more"}))
    refused = await recv_json(ws)
    assert refused["type"] == "error" and refused["code"] == "bad_request", refused
    await ws.send(json.dumps({"type": "append", "id": "i", "text": ", then the end."}))
    await ws.send(json.dumps({"type": "end", "id": "i"}))
    log = (await collect(ws, {"i"}, {started["slot"]: "i"}))["i"]
    await ws.close()
    assert log.errors == [] and log.done is not None and log.done["reason"] == "complete", log.order
    assert [s["text"] for s in log.segments] == ["The code is 1234567890, then the end."]
