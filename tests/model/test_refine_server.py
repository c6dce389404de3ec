"""``refine: true`` on the tiny ChatTTS model behind the real server (WebSocket and OpenAI port).

Random weights refine into junk, so a stand-in refiner writes a fixed rewrite (the pipeline's
form of another sentence) over two engine steps, through the engine's real refinement queue.
The model then receives the rewrite: the refined stream's audio equals a plain stream of the
other sentence, token for token, and differs from the unrefined one. Without ``refine`` (the
default) the refiner is never asked. That the rewrite ChatTTS's own refinement writes reaches
speech like ``infer(skip_refine_text=False)`` is held in ``tests/model/test_refine_engine.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest
from openai import AsyncOpenAI

from server.app import App
from server.engine.chattts.refine import RefineParams, RefineRow
from tests.integration.test_http_speech import base_url
from tests.wsclient import collect, open_client, start

pytestmark = pytest.mark.loopback  # our own server on 127.0.0.1, nothing else

TEXT = "请先精炼这一句话。"
OTHER = "换成另一句话[uv_break]，好吗？"  # what the stand-in refinement writes instead
PROMPT = "[oral_2][laugh_0][break_6]"


class FixedJob:
    """A refinement that ends after ``blocks`` advances with a fixed text for every row."""

    def __init__(self, texts: list[str], blocks: int) -> None:
        self._texts, self._left = texts, blocks

    def advance(self, tokens: int) -> bool:
        self._left -= 1
        return self._left <= 0

    def texts(self) -> list[str]:
        return list(self._texts)

    def keep(self, rows: Sequence[int]) -> None:
        self._texts = [self._texts[i] for i in rows]


class FixedRefiner:
    """Stands in for ``TextRefiner``: every row is refined into ``rewrite``; records what it was asked."""

    def __init__(self) -> None:
        self.rewrite = ""
        self.model_text: Any = None  # the engine's text pipeline
        self.asked: list[tuple[RefineRow, RefineParams]] = []
        self._lock = threading.Lock()

    def start(self, rows: Sequence[RefineRow], params: RefineParams) -> FixedJob:
        with self._lock:
            self.asked += [(row, params) for row in rows if row.text != "warm up"]
        return FixedJob([self.rewrite] * len(rows), blocks=2)


@pytest.fixture
async def refining(make_model_app: Any) -> tuple[App, FixedRefiner]:
    refiner = FixedRefiner()

    def prepare(engine: Any) -> None:
        refiner.rewrite = engine.text.model_text(OTHER)  # as ChatTTS's refinement hands it on
        refiner.model_text = engine.text.model_text
        engine.refiner = refiner

    app = await make_model_app("--refine-max-tokens", "64", prepare=prepare)
    return app, refiner


async def stream(app: App, **fields: Any) -> Any:
    ws, _ = await open_client(app.port)
    await start(ws, id="r", seed=7, **fields)
    log = (await collect(ws, {"r"}))["r"]
    await ws.close()
    assert log.done is not None and log.done["reason"] == "complete", log.errors
    return log


async def test_the_model_speaks_the_refined_text_and_refinement_is_off_by_default(
    refining: tuple[App, FixedRefiner],
) -> None:
    app, refiner = refining
    plain = await stream(app, text=TEXT)
    assert refiner.asked == []  # off unless asked for
    other = await stream(app, text=OTHER)
    refined = await stream(app, text=TEXT, refine=True, refine_prompt=PROMPT)

    [(row, params)] = refiner.asked
    assert row.text == refiner.model_text(TEXT)  # the segment after the text pipeline
    assert row.prompt == PROMPT and params.max_new_tokens == 64
    assert refined.payload == other.payload != plain.payload  # the model read the rewrite
    assert [s["text"] for s in refined.segments] == [TEXT]  # captions keep the user's text

    async with AsyncOpenAI(base_url=base_url(app), api_key="x", max_retries=0) as oai:
        speech = await oai.audio.speech.create(
            model="tts-1",
            voice="default",
            input=TEXT,
            response_format="pcm",
            extra_body={"seed": 7, "refine": True},
        )
        unrefined = await oai.audio.speech.create(
            model="tts-1", voice="default", input=TEXT, response_format="pcm", extra_body={"seed": 7}
        )
    assert speech.content == refined.payload
    assert unrefined.content == plain.payload
    assert len(refiner.asked) == 2 and refiner.asked[1][0].prompt == ""
