"""The Wyoming server (Home Assistant) through real sockets, with the ``wyoming`` package's own client.

Every read has a deadline (the client's ``read_timeout``); a connection the
server closes reads as ``None``.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeStopped,
    SynthesizeVoice,
)

from server.app import App
from server.config import Settings
from server.engine.fake import FAKE_VOICES
from server.errors import StartupError
from server.frontends.wyoming.server import exposure_problem
from server.voices.catalog import OPENAI_VOICES
from tests.integration.conftest import MakeApp, fake_engine, fake_settings, wait_until
from tests.integration.test_incremental import ANSWER, llm_tokens
from tests.integration.test_voices import encoded, form, recording, upload
from tests.wsclient import stream_payload

WYOMING = ("--wyoming-port", "-1")
READ_TIMEOUT_S = 30.0
LONG_TEXT = "This long text keeps the engine busy for a good while. " * 8


def client(app: App) -> AsyncTcpClient:
    assert app.wyoming_port is not None
    return AsyncTcpClient("127.0.0.1", app.wyoming_port, connect_timeout=10, read_timeout=READ_TIMEOUT_S)


async def read(c: AsyncTcpClient) -> Event | None:
    """The next event; None once the server closed the connection."""
    return await c.read_event()


async def until_end(c: AsyncTcpClient, *, streaming: bool = False) -> list[Event]:
    """Every event up to ``audio-stop`` (``synthesize-stopped`` when ``streaming``) or an error."""
    events: list[Event] = []
    last = SynthesizeStopped if streaming else AudioStop
    while (event := await read(c)) is not None:
        events.append(event)
        if last.is_type(event.type) or Error.is_type(event.type):
            break
    return events


def pcm(events: list[Event]) -> bytes:
    return b"".join(AudioChunk.from_event(e).audio for e in events if AudioChunk.is_type(e.type))


async def ws_pcm(app: App, **fields: Any) -> bytes:
    return await stream_payload(app.port, **fields)


async def refused(app: App, *events: Event) -> Error:
    """Send ``events`` on a new connection: answered with one error event, then closed.

    A ``synthesize-start`` that was accepted is answered with ``audio-start`` first.
    """
    async with client(app) as c:
        for event in events:
            await c.write_event(event)
        answer = await read(c)
        if answer is not None and AudioStart.is_type(answer.type) and SynthesizeStart.is_type(events[0].type):
            answer = await read(c)
        assert answer is not None and Error.is_type(answer.type), answer
        assert await read(c) is None  # the server closed the connection
    return Error.from_event(answer)


# --- describe, synthesize, the streaming form ------------------------------------------------


async def test_describe_lists_our_voices(make_app: MakeApp) -> None:
    app = await make_app(*WYOMING)
    async with client(app) as c:
        await c.write_event(Describe().event())
        event = await read(c)
    assert event is not None and Info.is_type(event.type)
    [tts] = Info.from_event(event).tts
    assert tts.name == "chattts-stream" and tts.supports_synthesize_streaming
    names = {v.name for v in tts.voices}
    assert set(FAKE_VOICES) <= names and set(OPENAI_VOICES) <= names
    assert all(set(v.languages) == {"zh", "en"} for v in tts.voices)


async def test_a_voice_from_a_recording_is_listed_and_spoken(make_app: MakeApp, tmp_path: Path) -> None:
    app = await make_app(*WYOMING, "--voices-dir", str(tmp_path))
    status, voice = await upload(app, form(encoded(recording()), name="grandma"))
    assert status == 200, voice
    async with client(app) as c:  # a new connection lists it
        await c.write_event(Describe().event())
        event = await read(c)
    assert event is not None
    [tts] = Info.from_event(event).tts
    assert voice["id"] in {v.name for v in tts.voices}
    async with client(app) as c:
        await c.write_event(Synthesize("用我的声音说。", voice=SynthesizeVoice(voice["id"])).event())
        events = await until_end(c)
    assert AudioStop.is_type(events[-1].type), events[-1]
    assert pcm(events) == await ws_pcm(app, text="用我的声音说。", seed=0, voice=voice["id"])


@pytest.mark.parametrize(("flags", "seed"), [((), 0), (("--wyoming-seed", "7"), 7)])
@pytest.mark.parametrize("voice", ["echo", "alto"])
async def test_synthesize_equals_the_websocket_stream_of_the_same_request(
    make_app: MakeApp, flags: tuple[str, ...], seed: int, voice: str
) -> None:
    app = await make_app(*WYOMING, *flags)
    async with client(app) as c:
        await c.write_event(Synthesize(ANSWER, voice=SynthesizeVoice(voice)).event())
        events = await until_end(c)
    start_event = AudioStart.from_event(events[0])
    assert (start_event.rate, start_event.width, start_event.channels) == (24_000, 2, 1)
    assert AudioStop.is_type(events[-1].type)
    chunks = [AudioChunk.from_event(e) for e in events if AudioChunk.is_type(e.type)]
    assert chunks and all((c.rate, c.width, c.channels) == (24_000, 2, 1) for c in chunks)
    reference = await ws_pcm(app, text=ANSWER, seed=seed, voice=OPENAI_VOICES.get(voice, voice))
    assert pcm(events) == reference


async def test_streaming_speaks_sentence_one_before_sentence_three_is_sent(make_app: MakeApp) -> None:
    app = await make_app(*WYOMING, "--fake-step-ms", "5")
    third = ANSWER.index("The third")
    first_two, last = llm_tokens(ANSWER[:third]), llm_tokens(ANSWER[third:])
    order: list[str] = []
    events: list[Event] = []
    async with client(app) as c:
        await c.write_event(SynthesizeStart(voice=SynthesizeVoice("default")).event())
        rng = random.Random(3)
        for token in first_two:  # an LLM writing sentences one and two
            await c.write_event(SynthesizeChunk(token).event())
            await asyncio.sleep(rng.uniform(0.0, 0.02))
        while not any(AudioChunk.is_type(e.type) for e in events):  # no deadline but the client's
            event = await read(c)
            assert event is not None and not Error.is_type(event.type), event
            events.append(event)
        order.append("first audio-chunk")
        for token in last:
            await c.write_event(SynthesizeChunk(token).event())
        order.append("sentence three sent")
        await c.write_event(Synthesize(ANSWER).event())  # Home Assistant's repeat of the whole text
        await c.write_event(SynthesizeStop().event())
        events += await until_end(c, streaming=True)
    assert order == ["first audio-chunk", "sentence three sent"]
    kinds = [e.type for e in events]
    assert kinds[0] == "audio-start" and kinds[-2:] == ["audio-stop", "synthesize-stopped"]
    assert kinds.count("audio-start") == kinds.count("audio-stop") == 1
    # The same audio as the whole text at once (the repeated text was not spoken twice).
    assert pcm(events) == await ws_pcm(app, text=ANSWER, seed=0, voice="default")


# --- errors, limits, drain, disconnect -------------------------------------------------------


async def test_an_unknown_voice_gets_an_error_event(make_app: MakeApp) -> None:
    app = await make_app(*WYOMING)
    error = await refused(app, Synthesize("Hello.", voice=SynthesizeVoice("nobody")).event())
    assert error.code == "unsupported" and "nobody" in error.text
    error = await refused(app, SynthesizeStart(voice=SynthesizeVoice("nobody")).event())
    assert error.code == "unsupported"


async def test_an_unknown_control_tag_gets_an_error_event(make_app: MakeApp) -> None:
    """The same tag checks as the WebSocket and the HTTP API, in both forms of synthesize."""
    app = await make_app(*WYOMING)
    error = await refused(app, Synthesize("Wait [break_99] here.").event())
    assert error.code == "bad_request" and "[break_99]" in error.text
    error = await refused(app, Synthesize("Hello [uv_break there.").event())  # never closed
    assert error.code == "bad_request" and "[uv_break there." in error.text
    start_event = SynthesizeStart(voice=SynthesizeVoice("default")).event()
    error = await refused(app, start_event, SynthesizeChunk("你好[foo]。").event())
    assert error.code == "bad_request" and "[foo]" in error.text
    # A tag split across chunks may stay open until the chunk that closes it; not past the stop.
    error = await refused(app, start_event, SynthesizeChunk("Hi [uv_").event(), SynthesizeStop().event())
    assert error.code == "bad_request" and "[uv_" in error.text
    await wait_until(lambda: app.active_streams == 0)


async def test_a_tag_split_across_chunks_is_spoken_like_the_whole_text(make_app: MakeApp) -> None:
    app = await make_app(*WYOMING)
    text = "Hello [uv_break]there [laugh]. 你好[break_3]，再见。"
    async with client(app) as c:
        await c.write_event(SynthesizeStart(voice=SynthesizeVoice("default")).event())
        for piece in ("Hello [uv_", "break]there [la", "ugh]. 你好[", "break_3]，再见。"):
            await c.write_event(SynthesizeChunk(piece).event())
        await c.write_event(SynthesizeStop().event())
        events = await until_end(c, streaming=True)
    assert SynthesizeStopped.is_type(events[-1].type), events[-1]
    assert pcm(events) == await ws_pcm(app, text=text, seed=0, voice="default")


async def test_a_rate_limited_client_gets_an_error(make_app: MakeApp) -> None:
    app = await make_app(*WYOMING, "--rate-limit-per-min", "1", "--rate-limit-burst", "1")
    async with client(app) as c:
        await c.write_event(Synthesize("Allowed.").event())
        assert AudioStop.is_type((await until_end(c))[-1].type)
    error = await refused(app, Synthesize("Refused.").event())
    assert error.code == "rate_limited" and "slow down" in error.text
    error = await refused(app, SynthesizeStart().event())
    assert error.code == "rate_limited"


async def test_text_and_connection_limits_apply(make_app: MakeApp) -> None:
    app = await make_app(*WYOMING, "--max-text-chars", "30", "--max-connections-per-client", "1")
    assert (await refused(app, Synthesize("x" * 31).event())).code == "text_too_long"
    async with client(app) as held:
        await held.write_event(Describe().event())
        assert await read(held) is not None
        async with client(app) as second:
            answer = await read(second)
            assert answer is not None and Error.from_event(answer).code == "too_many_connections"
            assert await read(second) is None


async def test_a_draining_server_refuses_new_synthesis_finishes_running_ones_and_closes(
    make_app: MakeApp,
) -> None:
    app = await make_app(*WYOMING, "--fake-step-ms", "20")
    async with client(app) as running, client(app) as idle:
        await idle.write_event(Describe().event())
        assert await read(idle) is not None
        await running.write_event(Synthesize(ANSWER).event())
        events = []
        while not any(AudioChunk.is_type(e.type) for e in events):
            event = await read(running)
            assert event is not None
            events.append(event)
        drain = asyncio.create_task(app.drain())
        await wait_until(lambda: app.draining)
        assert await read(idle) is None  # an idle connection is closed at once
        assert (await refused(app, Synthesize("Too late.").event())).code == "shutting_down"
        events += await until_end(running)
        assert AudioStop.is_type(events[-1].type)
        assert await read(running) is None  # closed once its stream is done
        async with asyncio.timeout(30):
            await drain
    assert pcm(events) == await reference_pcm(ANSWER, seed=0)


async def reference_pcm(text: str, seed: int) -> bytes:
    """The drained app is gone: the same request on a fresh one."""
    app = App(fake_settings())
    await app.start()
    try:
        return await ws_pcm(app, text=text, seed=seed, voice="default")
    finally:
        await app.stop()


async def test_a_client_that_disconnects_cancels_and_frees_its_stream(make_app: MakeApp) -> None:
    app = await make_app(*WYOMING, "--fake-step-ms", "30")
    engine = fake_engine(app)
    async with client(app) as c:
        await c.write_event(Synthesize(LONG_TEXT).event())
        while (event := await read(c)) is not None and not AudioChunk.is_type(event.type):
            pass
        assert engine.live_sequences > 0 and app.active_streams == 1
    await wait_until(lambda: engine.live_sequences == 0)
    await wait_until(lambda: app.active_streams == 0 and len(app.service.registry) == 0)
    assert any(kind == "drop" for kind, _ in engine.events)
    assert 'chattts_streams_total{reason="cancelled"} 1.0' in app.metrics.render().decode()


async def test_stopping_the_server_cuts_a_running_stream_with_an_error(make_app: MakeApp) -> None:
    app = await make_app(*WYOMING, "--fake-step-ms", "30")
    async with client(app) as c:
        await c.write_event(Synthesize(LONG_TEXT).event())
        assert await read(c) is not None  # audio-start
        await app.stop()
        events = await until_end(c)
        assert Error.from_event(events[-1]).code == "shutting_down"
        assert await read(c) is None


async def test_bytes_that_are_no_event_or_too_big_are_refused(make_app: MakeApp) -> None:
    app = await make_app(*WYOMING, "--max-message-bytes", "4096")
    assert app.wyoming_port is not None
    for raw in (b"not json\n", json.dumps({"type": "synthesize", "payload_length": 5000}).encode() + b"\n"):
        reader, writer = await asyncio.open_connection("127.0.0.1", app.wyoming_port)
        writer.write(raw)
        async with asyncio.timeout(READ_TIMEOUT_S):
            line = await reader.readline()
            header = json.loads(line)
            data = json.loads(await reader.readexactly(header["data_length"]))
            assert header["type"] == "error" and data["code"] == "bad_request"
            assert await reader.read() == b""  # closed
        writer.close()
        await writer.wait_closed()


# --- the port ------------------------------------------------------------------------------------


def test_the_wyoming_port_refuses_to_open_publicly_beside_api_keys() -> None:
    def problem(*flags: str) -> str | None:
        settings = Settings(**{**fake_settings(*flags).__dict__})
        return exposure_problem(settings, keys_required=True)

    assert problem("--wyoming-port", "10200", "--host", "0.0.0.0") is not None
    assert "--wyoming-allow-unauthenticated" in (problem("--wyoming-port", "10200", "--host", "::") or "")
    for host in ("127.0.0.1", "::1", "localhost"):
        assert problem("--wyoming-port", "10200", "--host", host) is None
    assert problem("--wyoming-port", "10200", "--host", "0.0.0.0", "--wyoming-allow-unauthenticated") is None
    assert problem("--wyoming-port", "0", "--host", "0.0.0.0") is None
    assert exposure_problem(fake_settings("--wyoming-port", "10200", "--host", "0.0.0.0"), False) is None


async def test_api_keys_and_a_public_wyoming_port_fail_the_start() -> None:
    app = App(fake_settings("--wyoming-port", "-1", "--host", "0.0.0.0", "--api-keys", "k1"))
    with pytest.raises(StartupError, match="--wyoming-allow-unauthenticated"):
        await app.start()
    assert app.wyoming is None


async def test_wyoming_is_off_by_default(make_app: MakeApp) -> None:
    app = await make_app()
    assert app.wyoming_port is None and Settings().wyoming_port == 0
