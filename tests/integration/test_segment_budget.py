"""The prompt budget over a real socket with the fake engine (one token a character, 40 at most).

The tiny model's real counts (spelled-out numbers) are in ``tests/model/test_prompt_budget.py``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from server.app import App
from server.engine.fake import FakeEngine
from tests.integration.conftest import fake_engine
from tests.wsclient import collect, open_client, recv_json, start

LIMIT = 40
RUN = "x" * 50  # one run of 50 tokens: nothing to cut at


async def budget_app(make_app: Any) -> App:
    app: App = await make_app("--cache-bytes", "0", engine_factory=lambda: FakeEngine(max_text_tokens=LIMIT))
    async with asyncio.timeout(30):
        await app.warmed_up.wait()  # its requests are not the test's
    return app


async def test_a_long_segment_is_cut_at_clause_ends_and_spaces_to_fit(make_app: Any) -> None:
    app = await budget_app(make_app)
    text = "one two three four five, six seven eight nine ten eleven twelve thirteen fourteen."
    before = len(fake_engine(app).added)
    ws, _ = await open_client(app.port)
    await start(ws, id="a", text=text, seed=1)
    log = (await collect(ws, {"a"}))["a"]
    await ws.close()
    assert log.done is not None and log.done["reason"] == "complete", log.order
    texts = [s["text"] for s in log.segments]
    assert " ".join(texts) == text and texts[0] == "one two three four five,"  # the comma first
    assert all(len(request.text) <= LIMIT for request in list(fake_engine(app).added)[before:])


async def test_a_run_over_the_budget_is_refused_at_start_and_at_append(make_app: Any) -> None:
    app = await budget_app(make_app)
    ws, _ = await open_client(app.port)
    await start(ws, id="r", text=f"Look: {RUN}.", seed=1)
    refused = await recv_json(ws)
    assert (refused["type"], refused["code"], refused["id"]) == ("error", "bad_request", "r"), refused
    await start(ws, id="i", incremental=True, seed=1, text="Look: " + RUN[:30])
    started = await recv_json(ws)
    assert started["type"] == "started"
    await ws.send(json.dumps({"type": "append", "id": "i", "text": RUN[30:]}))  # continues the run
    refused = await recv_json(ws)
    assert (refused["type"], refused["code"]) == ("error", "bad_request"), refused
    await ws.send(json.dumps({"type": "append", "id": "i", "text": " and the end."}))
    await ws.send(json.dumps({"type": "end", "id": "i"}))
    log = (await collect(ws, {"i"}, {started["slot"]: "i"}))["i"]
    await ws.close()
    assert log.done is not None and log.done["reason"] == "complete", log.order
    texts = [s["text"] for s in log.segments]  # the rest of the text, cut to fit
    assert " ".join(texts) == "Look: " + RUN[:30] + " and the end." and max(map(len, texts)) <= LIMIT
