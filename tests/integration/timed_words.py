"""Shared by the tests of word timings: our stream's words, and pipecat's view of them."""

from __future__ import annotations

from typing import Any

from pipecat.frames.frames import TTSTextFrame

from server.app import App
from tests.wsclient import StreamLog, collect, open_client, start

#: The seed the ElevenLabs tests give the server (``--elevenlabs-seed``) and the reference.
SEED = 9


async def ours(app: App, text: str) -> StreamLog:
    """Our WebSocket stream of ``text``, same voice and seed, with word timestamps."""
    ws, _ = await open_client(app.port)
    await start(ws, id="ref", text=text, seed=SEED, voice="default", word_timestamps=True)
    log = (await collect(ws, {"ref"}))["ref"]
    await ws.close()
    assert log.done is not None and log.done["reason"] == "complete"
    return log


def our_words(log: StreamLog) -> list[tuple[str, float]]:
    """Each word and its start in seconds."""
    return [(w["text"], w["start"] / 24_000) for m in log.words for w in m["words"]]


def pipecat_words(down: list[Any]) -> list[tuple[str, float]]:
    """pipecat's spoken words and their times (its pts, in s, from the first word's)."""
    frames = [f for f in down if isinstance(f, TTSTextFrame)]
    return [(f.text, f.pts / 1e9) for f in frames]


def same_times(got: list[tuple[str, float]], want: list[tuple[str, float]], *, offset: bool) -> None:
    """The same words with the same starts (within 2 ms); ``offset``: ``got`` has its own clock origin."""
    assert [w for w, _ in got] == [w for w, _ in want]
    base = got[0][1] - want[0][1] if offset else 0.0
    for (word, t), (_, expected) in zip(got, want, strict=True):
        assert abs(t - base - expected) < 0.002, (word, t - base, expected)
