"""The LiveKit TTS (client_py's ``livekit`` extra) driven through ``livekit.agents.tts``, real server.

No LiveKit server is needed: a ``SynthesizeStream`` / ``ChunkedStream`` is what an
``AgentSession`` drives, and here the test drives it the same way (``push_text``, ``flush``,
``end_input``, iteration, ``aclose``) against an in-process server with the fake engine.
"""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from livekit.agents import APIConnectionError, APIConnectOptions, APIStatusError, APITimeoutError
from livekit.agents.tts import SynthesizedAudio
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT, TimedString

import chattts_stream_client as cs
from chattts_stream_client.livekit import ChatTTSStreamTTS, api_error
from server.app import App
from server.engine.fake import FakeEngine
from tests.integration.conftest import wait_until
from tests.integration.test_incremental import ANSWER, llm_tokens
from tests.serverproc import free_port
from tests.wsclient import stream_payload

REPO = Path(__file__).resolve().parents[2]
NO_RETRY = APIConnectOptions(max_retry=0, timeout=5.0)


def url(app: App) -> str:
    return f"ws://127.0.0.1:{app.port}/v1/stream"


async def collect(events: Any, timeout: float = 30.0) -> list[SynthesizedAudio]:
    got: list[SynthesizedAudio] = []
    async with asyncio.timeout(timeout):
        async for event in events:
            got.append(event)
    return got


def pcm(events: list[SynthesizedAudio]) -> bytes:
    return b"".join(e.frame.data.tobytes() for e in events)


def transcript(events: list[SynthesizedAudio]) -> list[TimedString]:
    return [t for e in events for t in e.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]


async def reference_segments(app: App, text: str, seed: int, sample_rate: int = 24_000) -> list[cs.Segment]:
    async with cs.Client(url(app)) as client:
        stream = client.speak(text, seed=seed, sample_rate=sample_rate)
        await stream.read_all()
        return stream.segments


async def test_stream_audio_equals_the_websocket_stream_with_timed_sentences(app: App) -> None:
    tts = ChatTTSStreamTTS(url=url(app), seed=9)
    assert tts.capabilities.streaming and tts.capabilities.aligned_transcript
    try:
        async with tts.stream() as stream:
            for token in llm_tokens(ANSWER):  # an LLM's tokens, as AgentSession pushes them
                stream.push_text(token)
            stream.end_input()
            events = await collect(stream)
    finally:
        await tts.aclose()
    assert {(e.frame.sample_rate, e.frame.num_channels) for e in events} == {(24_000, 1)}
    assert len({e.segment_id for e in events}) == 1 and events[-1].is_final
    assert pcm(events) == await stream_payload(app.port, text=ANSWER, seed=9, voice="default")
    # One timed string per sentence, at the sample where the server's segment mark puts it.
    segments = await reference_segments(app, ANSWER, 9)
    timed = transcript(events)
    assert [t.strip() for t in timed] == [s.text for s in segments] and len(segments) == 3
    assert [t.start_time for t in timed] == [s.sample / 24_000 for s in segments]
    assert "".join(timed) == "Sentence one is here.第二句话在这里。The third sentence ends it all."
    # The turn's stream and the two references, each one complete stream.
    assert 'chattts_streams_total{reason="complete"} 3.0' in app.metrics.render().decode()


async def test_prewarm_connects_before_the_first_stream(app: App) -> None:
    tts = ChatTTSStreamTTS(url=url(app))
    try:
        tts.prewarm()
        await wait_until(lambda: tts.client.hello is not None)
        assert tts.client.connections == 1
        async with tts.synthesize("Already connected.", conn_options=NO_RETRY) as chunked:
            assert pcm(await collect(chunked))
        assert tts.client.connections == 1  # the stream used the prewarmed connection
    finally:
        await tts.aclose()


async def test_synthesize_equals_the_websocket_stream(app: App) -> None:
    tts = ChatTTSStreamTTS(url=url(app), seed=5, sample_rate=16_000)
    try:
        async with tts.synthesize(ANSWER) as chunked:
            events = await collect(chunked)
    finally:
        await tts.aclose()
    assert {e.frame.sample_rate for e in events} == {16_000}
    assert pcm(events) == await stream_payload(
        app.port, text=ANSWER, seed=5, voice="default", sample_rate=16_000
    )
    segments = await reference_segments(app, ANSWER, 5, sample_rate=16_000)
    timed = transcript(events)
    assert [t.strip() for t in timed] == [s.text for s in segments]
    assert [t.start_time for t in timed] == [s.sample / 16_000 for s in segments]


async def test_flush_ends_the_segment_without_a_sentence_end(app: App) -> None:
    tts = ChatTTSStreamTTS(url=url(app), seed=2)
    text = "No sentence end here but the segment is over"
    try:
        async with tts.stream() as stream:
            for token in llm_tokens(text):
                stream.push_text(token)
            stream.flush()
            got: list[SynthesizedAudio] = []
            async with asyncio.timeout(30):
                async for event in stream:  # the segment ends before end_input is called
                    got.append(event)
                    if event.is_final:
                        break
            stream.end_input()
            got += await collect(stream)
    finally:
        await tts.aclose()
    assert got[-1].is_final and sum(e.is_final for e in got) == 1
    assert pcm(got) == await stream_payload(app.port, text=text, seed=2, voice="default")


async def test_aclose_cancels_the_server_stream_and_frees_the_engine_row(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "100", "--cache-bytes", "0")
    engine = app.engine_client.engine
    assert isinstance(engine, FakeEngine)
    tts = ChatTTSStreamTTS(url=url(app), seed=3)
    long_sentence = "This one long sentence keeps the engine busy for many blocks, " * 12 + "and then ends."
    try:
        stream = tts.stream()
        for token in llm_tokens(long_sentence):
            stream.push_text(token)
        stream.end_input()
        heard: list[SynthesizedAudio] = []
        async with asyncio.timeout(30):
            async for event in stream:  # the user barges in once some audio was played
                heard.append(event)
                if len(heard) == 3:
                    break
        await stream.aclose()
        # The engine drops a row only when its stream is cancelled (a finished row is not dropped).
        await wait_until(lambda: any(kind == "drop" for kind, _ in list(engine.events)))
        await wait_until(lambda: engine.live_sequences == 0)
    finally:
        await tts.aclose()
    dropped = {seq for kind, seq in engine.events if kind == "drop"}
    assert dropped and not dropped & {seq for kind, seq in engine.events if kind == "finish"}
    await wait_until(lambda: 'chattts_streams_total{reason="cancelled"} 1.0' in app.metrics.render().decode())
    full = await stream_payload(app.port, text=long_sentence, seed=3, voice="default")
    assert full.startswith(pcm(heard)) and len(pcm(heard)) < len(full)


async def test_refusals_and_lost_connections_are_livekit_api_errors(app: App) -> None:
    tts = ChatTTSStreamTTS(url=url(app), voice="no-such-voice")
    try:
        async with tts.stream(conn_options=NO_RETRY) as stream:
            stream.push_text("Hello there.")
            stream.end_input()
            with pytest.raises(APIStatusError) as refused:
                await collect(stream)
    finally:
        await tts.aclose()
    assert refused.value.status_code == 400 and not refused.value.retryable
    assert isinstance(refused.value.body, dict) and refused.value.body["code"] == "unsupported"

    port = app.port
    await app.stop()  # nothing listens there now
    tts = ChatTTSStreamTTS(url=f"ws://127.0.0.1:{port}/v1/stream")
    try:
        async with tts.synthesize("Hello.", conn_options=NO_RETRY) as chunked:
            with pytest.raises(APIConnectionError) as lost:
                await collect(chunked)
    finally:
        await tts.aclose()
    assert lost.value.retryable


async def test_livekit_retries_a_connection_error_until_the_server_is_up(make_app: Any) -> None:
    port = free_port()  # nothing listens there until the first failure
    tts = ChatTTSStreamTTS(url=f"ws://127.0.0.1:{port}/v1/stream", seed=7)
    failures: list[Any] = []
    starting: list[asyncio.Task[App]] = []

    @tts.on("error")
    def on_error(error: Any) -> None:  # LiveKit reports each failed attempt, then retries it
        failures.append(error)
        if not starting:
            starting.append(asyncio.create_task(make_app("--port", str(port))))

    try:
        async with tts.synthesize(
            "Retried until it works.", conn_options=APIConnectOptions(max_retry=20, retry_interval=0.5)
        ) as chunked:
            events = await collect(chunked, timeout=60)
    finally:
        await tts.aclose()
    app = await starting[0]
    assert failures and all(f.recoverable and isinstance(f.error, APIConnectionError) for f in failures)
    assert pcm(events) == await stream_payload(
        app.port, text="Retried until it works.", seed=7, voice="default"
    )


@pytest.mark.parametrize(
    ("error", "kind", "status", "retryable"),
    [
        (cs.Overloaded("busy", retry_after_ms=500), APIStatusError, 429, True),
        (cs.RateLimited("slow down"), APIStatusError, 429, True),
        (cs.TooManyStreams("4 at most"), APIStatusError, 429, True),
        (cs.ShuttingDown("draining"), APIStatusError, 503, True),
        (cs.EngineError("failed"), APIStatusError, 500, True),
        (cs.InternalError("oops"), APIStatusError, 500, True),
        (cs.BadRequest("no"), APIStatusError, 400, False),
        (cs.Unsupported("no voice"), APIStatusError, 400, False),
        (cs.TextTooLong("long"), APIStatusError, 413, False),
        (cs.DuplicateId("twice"), APIStatusError, 409, False),
        (cs.Unauthorized("key"), APIStatusError, 401, False),
        (cs.ConnectionLost("gone"), APIConnectionError, None, True),
        (cs.UnknownStream("expired"), APIConnectionError, None, True),
        (cs.ResumeExpired("evicted"), APIConnectionError, None, True),
        (cs.ProtocolViolation("bad frame"), APIConnectionError, None, True),
        (cs.StreamTimeout("no audio"), APITimeoutError, None, True),
    ],
)
def test_every_error_code_has_its_livekit_error(
    error: Any, kind: type, status: int | None, retryable: bool
) -> None:
    mapped = api_error(error)
    assert type(mapped) is kind and mapped.retryable is retryable
    if status is not None:
        assert isinstance(mapped, APIStatusError) and mapped.status_code == status
        assert isinstance(mapped.body, dict) and mapped.body["code"] == error.code


async def test_the_readme_example_runs_as_written(app: App, tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    example = next(b for b in blocks if "chattts_stream_client.livekit" in b)
    assert example.count("ws://127.0.0.1:8080/v1/stream") == 1
    script = tmp_path / "example.py"
    script.write_text(example.replace("ws://127.0.0.1:8080/v1/stream", url(app)))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(120):
        _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    spoken = "Hello from ChatTTS. 你好，欢迎。"
    assert (tmp_path / "out.pcm").read_bytes() == await stream_payload(
        app.port, text=spoken, seed=42, voice="default"
    )


def test_the_transcript_uses_word_timings_when_the_server_sends_them() -> None:
    from chattts_stream_client.livekit import _Transcript

    def chunk(
        sample: int, segments: tuple[cs.Segment, ...] = (), words: tuple[cs.Word, ...] = ()
    ) -> cs.AudioChunk:
        return cs.AudioChunk(b"\0\0", 0, sample, False, segments, 0.0, words)

    sentences = _Transcript(24_000)
    first = sentences.of(chunk(0, (cs.Segment("Hello there.", 0, 0),)))
    second = sentences.of(chunk(48_000, (cs.Segment("你好。", 3, 48_000),)))
    third = sentences.of(chunk(72_000, (cs.Segment("Bye now.", 5, 72_000),)))
    assert [(t, t.start_time) for t in first + second + third] == [
        ("Hello there.", 0.0),
        ("你好。", 2.0),
        ("Bye now.", 3.0),
    ]

    words = _Transcript(24_000)
    timed = words.of(
        chunk(
            0,
            (cs.Segment("Hello there.", 0, 0),),
            (cs.Word("Hello", 1200, 6000), cs.Word("there", 6000, 12000)),
        )
    )
    assert [(t, t.start_time, t.end_time) for t in timed] == [("Hello", 0.05, 0.25), (" there", 0.25, 0.5)]
    # Once words come, segment marks would repeat their text: they are left out.
    assert words.of(chunk(24_000, (cs.Segment("Next.", 1, 24_000),))) == []
    assert [str(t) for t in words.of(chunk(24_000, (), (cs.Word("下", 24_000, 30_000),)))] == ["下"]
