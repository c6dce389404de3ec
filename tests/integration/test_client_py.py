"""The Python client (client_py/) against the real server over real sockets (fake engine)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chattts_stream_client as cs
from server.app import App
from server.engine.fake import FAIL_MARKER
from server.frontends.websocket import wire as server_protocol
from tests.integration.conftest import fake_engine, fake_settings
from tests.integration.test_incremental import ANSWER, llm_tokens
from tests.tcp_proxy import CuttableProxy
from tests.wsclient import collect, open_client, start

TEXT = "First sentence of the story. 第二句话在这里。And the third one ends it."


def url(port: int) -> str:
    return f"ws://127.0.0.1:{port}/v1/stream"


async def raw_stream(port: int, **fields: Any) -> tuple[list[tuple[int, int, bool, bytes]], dict[str, Any]]:
    """The reference: one stream through the test suite's own minimal client (not client_py)."""
    ws, _ = await open_client(port)
    await start(ws, id="ref", **fields)
    log = (await collect(ws, {"ref"}))["ref"]
    await ws.close()
    assert log.done is not None
    frames = [(f.header.seq, f.header.sample, bool(f.header.flags & 1), f.payload) for f in log.frames]
    return frames, log.done


def as_tuples(chunks: list[cs.AudioChunk]) -> list[tuple[int, int, bool, bytes]]:
    return [(c.seq, c.sample, c.last, c.data) for c in chunks]


# --- acceptance 1: cuts, resume, byte for byte ---------------------------------------------------


@pytest.mark.parametrize("fmt", ["pcm16", "opus", "mp3"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(1, 30), min_size=1, max_size=3), seed=st.integers(0, 1000))
def test_cut_connections_resume_to_the_unbroken_stream(fmt: str, cuts: list[int], seed: int) -> None:
    async def scenario() -> None:
        # Generation paced (and no response cache) so that cuts find audio not generated yet.
        app = App(fake_settings("--fake-step-ms", "10", "--resume-ttl-s", "30", "--cache-bytes", "0"))
        await app.start()
        try:
            expected, done = await raw_stream(app.port, text=TEXT * 2, seed=seed, format=fmt)
            async with CuttableProxy(app.port) as proxy:
                # A small queue: the reader cannot run ahead, so cuts land while audio is in flight.
                client = cs.Client(url(proxy.port), read_timeout=20, max_queued_chunks=2)
                async with client:
                    stream = client.speak(TEXT * 2, seed=seed, format=fmt)
                    got: list[cs.AudioChunk] = []
                    plan = iter(cuts)
                    next_cut = next(plan, None)
                    taken = 0
                    cut_before_the_end = False
                    async with asyncio.timeout(60):
                        async for chunk in stream:
                            got.append(chunk)
                            taken += 1
                            if next_cut is not None and taken >= next_cut and stream.done is None:
                                server_side = app.service.registry.get(stream.token or "")
                                assert server_side is not None
                                cut_before_the_end |= not server_side.outbox.ended
                                proxy.cut()
                                taken, next_cut = 0, next(plan, None)
            assert as_tuples(got) == expected
            assert stream.done is not None and stream.done.samples == done["samples"]
            # Frames already in the client's socket buffer survive a reset, so a cut needs a
            # resume only when frames were still to come; one cut before the end surely does.
            assert stream.resumes <= proxy.cuts and client.connections == 1 + stream.resumes
            assert stream.resumes >= 1 or not cut_before_the_end
        finally:
            await app.stop()

    uvloop.run(scenario())


async def test_segments_are_reported_once_across_resumes(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "3")
    _, done = await raw_stream(app.port, text=TEXT, seed=4)
    async with CuttableProxy(app.port) as proxy, cs.Client(url(proxy.port), max_queued_chunks=1) as client:
        stream = client.speak(TEXT, seed=4)
        marks: list[cs.Segment] = []
        async for chunk in stream:
            marks += chunk.segments
            if chunk.seq in (0, 5, 12):
                proxy.cut()
    texts = ["First sentence of the story.", "第二句话在这里。", "And the third one ends it."]
    assert [m.text for m in marks] == texts
    assert marks == stream.segments and marks[0].seq == 0 and marks[0].sample == 0
    assert stream.done is not None and stream.done.samples == done["samples"]


@pytest.mark.parametrize("fmt", ["pcm16", "opus"])
async def test_frame_ms_asks_for_longer_frames_and_a_cut_resumes_on_them(make_app: Any, fmt: str) -> None:
    app = await make_app("--fake-step-ms", "3", "--resume-ttl-s", "30")
    expected, done = await raw_stream(app.port, text=TEXT, seed=5, format=fmt, frame_ms=60)
    assert len(expected) > 6
    async with CuttableProxy(app.port) as proxy, cs.Client(url(proxy.port), max_queued_chunks=1) as client:
        stream = client.speak(TEXT, seed=5, format=fmt, frame_ms=60)
        got: list[cs.AudioChunk] = []
        async with asyncio.timeout(60):
            async for chunk in stream:
                got.append(chunk)
                if chunk.seq in (1, 4):
                    proxy.cut()
    assert stream.frame_ms == 60  # from started
    assert as_tuples(got) == expected
    assert stream.done is not None and stream.done.samples == done["samples"]
    # Without frame_ms the server's default: 20 ms frames, three times as many.
    async with cs.Client(url(app.port)) as client:
        plain = client.speak(TEXT, seed=5, format=fmt)
        chunks = [chunk async for chunk in plain]
    assert plain.frame_ms == 20
    assert len(chunks) > 2 * len(got)


# --- incremental text ---------------------------------------------------------------------------


async def test_incremental_text_gives_the_one_shot_bytes(app: App) -> None:
    async with cs.Client(url(app.port)) as client:
        once = await client.synthesize(ANSWER, seed=11)
        stream = await client.open_stream(seed=11, max_buffer_delay_ms=5000)
        first_audio_after: list[int] = []
        sent = 0

        async def feed() -> None:
            nonlocal sent
            for token in llm_tokens(ANSWER):
                await stream.append(token)
                sent += 1
                await asyncio.sleep(0.01)
            await stream.end()

        async def listen() -> bytes:
            chunks = []
            async for chunk in stream:
                if not chunks:
                    first_audio_after.append(sent)
                chunks.append(chunk.data)
            return b"".join(chunks)

        async with asyncio.timeout(60):
            _, audio = await asyncio.gather(feed(), listen())
    assert audio == once
    assert first_audio_after[0] < len(llm_tokens(ANSWER))  # audio flowed while text was still coming
    assert stream.segments[0].text == "Sentence one is here."


async def test_text_sent_while_disconnected_goes_out_after_the_resume(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "3")
    async with CuttableProxy(app.port) as proxy, cs.Client(url(proxy.port), read_timeout=20) as client:
        once = await client.synthesize(ANSWER, seed=5)
        stream = await client.open_stream(seed=5)
        await stream.append("Sentence one is here. ")
        chunks = aiter(stream)
        first = await anext(chunks)
        proxy.blocked = True  # reconnects fail until the text below is queued
        proxy.cut()
        async with asyncio.timeout(10):
            while stream.phase != "detached":
                await asyncio.sleep(0.005)
        await stream.append("第二句话在这里。The third sentence ends it all.")  # held, sent after resume
        await stream.end()
        proxy.blocked = False
        rest = [chunk.data async for chunk in chunks]
    assert first.data + b"".join(rest) == once and stream.resumes == 1


LONG_ANSWER = ANSWER + " 第四句也在这里。And a fifth one, to be sure."


async def incremental_reference(port: int, pieces: list[str], seed: int) -> bytes:
    """The uncut incremental stream of ``pieces`` (the same client, straight to the server)."""
    async with cs.Client(url(port)) as client:
        stream = await client.open_stream(seed=seed, max_buffer_delay_ms=60_000)
        for piece in pieces:
            await stream.append(piece)
        await stream.end()
        return await stream.read_all()


@settings(max_examples=6, deadline=None)
@given(
    cuts=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 4)), min_size=1, max_size=3),
    seed=st.integers(0, 1000),
)
def test_text_in_flight_at_a_cut_is_sent_again_after_the_resume(
    cuts: list[tuple[int, int]], seed: int
) -> None:
    """Appends (and ``end``) lost with the connection: ``resumed.text_received`` says what arrived.

    Each cut: the path stalls (the proxy holds what the client sends), 1–4 more messages go
    out into it, then the connection is reset and they are gone. The audio must still equal
    the uncut incremental stream's, byte for byte.
    """
    pieces = llm_tokens(LONG_ANSWER)
    messages = len(pieces) + 1  # the appends, then end

    async def scenario() -> None:
        # No stall timer (its timing would change the segments) and no cache; generation paced.
        app = App(fake_settings("--fake-step-ms", "2", "--resume-ttl-s", "30", "--cache-bytes", "0"))
        await app.start()
        try:
            expected = await incremental_reference(app.port, pieces, seed)
            plan = {min(at, messages - 1): held for at, held in cuts}
            proxy = CuttableProxy(app.port)
            async with proxy, cs.Client(url(proxy.port), read_timeout=20) as client:
                stream = await client.open_stream(seed=seed, max_buffer_delay_ms=60_000)

                async def feed() -> None:
                    cut_after: int | None = None
                    for index in range(messages):
                        if index in plan and cut_after is None:
                            proxy.hold()
                            cut_after = index + plan[index]
                        await (stream.append(pieces[index]) if index < len(pieces) else stream.end())
                        if cut_after is not None and (index + 1 >= cut_after or index == messages - 1):
                            await asyncio.sleep(0.02)  # the held bytes reached the proxy
                            proxy.cut()
                            cut_after = None

                async with asyncio.timeout(60):
                    _, audio = await asyncio.gather(feed(), stream.read_all())
            assert audio == expected
            assert proxy.dropped_bytes > 0 and stream.resumes >= 1  # text really was lost in flight
        finally:
            await app.stop()

    uvloop.run(scenario())


async def test_an_old_server_without_text_received_gets_only_the_unsent_text(
    make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against a v1 server (no ``text_received``), the client re-sends nothing it already sent."""
    original = server_protocol.resumed

    def v1_resumed(*args: Any, **kwargs: Any) -> str:
        message = json.loads(original(*args, **kwargs))
        message.pop("text_received", None)
        return json.dumps(message)

    monkeypatch.setattr(server_protocol, "resumed", v1_resumed)
    app = await make_app("--fake-step-ms", "3")
    async with CuttableProxy(app.port) as proxy, cs.Client(url(proxy.port), read_timeout=20) as client:
        once = await client.synthesize(ANSWER, seed=6)
        stream = await client.open_stream(seed=6, max_buffer_delay_ms=60_000)
        await stream.append("Sentence one is here. ")
        chunks = aiter(stream)
        first = await anext(chunks)
        proxy.cut()
        async with asyncio.timeout(10):
            while stream.phase == "live" and stream.resumes == 0:  # the client saw the loss
                await asyncio.sleep(0.005)
        await stream.append("第二句话在这里。The third sentence ends it all.")
        await stream.end()
        async with asyncio.timeout(30):
            rest = [chunk.data async for chunk in chunks]
    assert first.data + b"".join(rest) == once and stream.resumes == 1


# --- errors: one exception class per code ----------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "options", "error"),
    [
        ((), {"speed": 9.0}, cs.BadRequest),
        ((), {"text": "x" * 2001}, cs.TextTooLong),
        ((), {"format": "aac"}, cs.Unsupported),
        ((), {"voice": "nobody"}, cs.Unsupported),
        (("--max-queue", "0"), {}, cs.Overloaded),
    ],
)
async def test_refusals_raise_their_exception(
    make_app: Any, flags: tuple[str, ...], options: Any, error: type
) -> None:
    app = await make_app(*flags)
    async with cs.Client(url(app.port)) as client:
        text = options.pop("text", "Hello there.")
        with pytest.raises(error) as refused:
            await client.synthesize(text, **options)
        # The connection stays usable.
        if not flags:
            assert await client.synthesize("Still fine.", seed=1)
    assert refused.value.code == error.code and refused.value.stream_id is not None
    if error is cs.Overloaded:
        assert isinstance(refused.value, cs.RetryableError) and refused.value.retry_after_ms


async def test_rate_limited_and_too_many_streams(make_app: Any) -> None:
    limited_app = await make_app("--rate-limit-per-min", "6", "--rate-limit-burst", "1")
    async with cs.Client(url(limited_app.port)) as client:
        assert await client.synthesize("First.", seed=1)
        with pytest.raises(cs.RateLimited) as limited:
            await client.speak("Second.", seed=2).start()
    assert limited.value.retry_after_ms is not None and limited.value.retry_after_ms > 1000
    app = await make_app("--max-streams", "1", "--fake-step-ms", "20")
    async with cs.Client(url(app.port)) as client:
        first = await client.speak(TEXT, seed=1).start()
        with pytest.raises(cs.TooManyStreams):
            await client.speak("Second.", seed=2).start()
        await first.cancel()


async def test_duplicate_id_unknown_stream_and_engine_error(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "5")
    async with CuttableProxy(app.port) as proxy, cs.Client(url(proxy.port)) as client:
        live = await client.open_stream(stream_id="same")
        client._demux.streams.pop("same")  # forget it locally, so the server is the one to refuse
        with pytest.raises(cs.DuplicateId):
            await client.speak("Again.", stream_id="same").start()
        await live.end()

        failing = client.speak(f"Fine words first. Then {FAIL_MARKER} breaks.", seed=1)
        chunks = []
        with pytest.raises(cs.EngineError):
            async for chunk in failing:
                chunks.append(chunk)
        assert failing.done is not None and failing.done.reason == "error"

        long = await client.speak(TEXT * 3, seed=2).start()
        long.token = "not-a-token"  # the server will not know it after the cut
        proxy.cut()
        with pytest.raises(cs.UnknownStream):
            async for _ in long:
                pass


async def test_resume_expired_and_shutting_down(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "1", "--replay-max-s", "0.2")
    async with CuttableProxy(app.port) as proxy:
        client = cs.Client(url(proxy.port), reconnect_delays=(0.05, 0.05), max_queued_chunks=1)
        async with client:
            stream = client.speak(TEXT * 3, seed=2)
            with pytest.raises(cs.ResumeExpired):
                async for chunk in stream:
                    if chunk.seq == 1:
                        proxy.blocked = True
                        proxy.cut()
                        # The reconnect comes after the stream ended and its start was evicted.
                        server_side = app.service.registry.get(stream.token or "")
                        assert server_side is not None
                        async with asyncio.timeout(10):
                            while not server_side.outbox.ended:
                                await asyncio.sleep(0.01)
                        proxy.blocked = False
        async with cs.Client(url(app.port)) as other:
            app.service.draining = True
            with pytest.raises(cs.ShuttingDown):
                await other.synthesize("Hello.")
            with pytest.raises(cs.ConnectionLost, match="503"):  # new connections are refused
                await cs.Client(url(app.port)).connect()
            app.service.draining = False


async def test_read_timeout_and_unreachable_server(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "2000")
    async with cs.Client(url(app.port), read_timeout=0.3) as client:
        with pytest.raises(cs.StreamTimeout):
            await client.synthesize("Slow words.")
    with pytest.raises(cs.ConnectionLost):
        await cs.Client(url(1), connect_timeout=2).connect()


# --- streams, cancel, sync --------------------------------------------------------------------


async def test_several_streams_share_one_connection(app: App) -> None:
    texts = ["One stream here.", "第二个流。", "And a third one."]
    expected = [
        b"".join(f[3] for f in (await raw_stream(app.port, text=t, seed=i))[0]) for i, t in enumerate(texts)
    ]
    async with cs.Client(url(app.port)) as client:
        got = await asyncio.gather(*(client.synthesize(t, seed=i) for i, t in enumerate(texts)))
        assert client.connections == 1
    assert got == expected


async def test_cancel_ends_iteration_and_frees_the_engine_row(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "30")
    engine = fake_engine(app)
    async with cs.Client(url(app.port)) as client:
        stream = client.speak(TEXT * 4, seed=1)
        async for _ in stream:
            assert engine.live_sequences > 0
            await stream.cancel()
        assert stream.phase == "cancelled"
        async with asyncio.timeout(10):
            while engine.live_sequences or app.active_streams:
                await asyncio.sleep(0.01)
        assert await client.synthesize("Still usable.", seed=2)


async def test_sync_client(app: App) -> None:
    expected = b"".join(f[3] for f in (await raw_stream(app.port, text=TEXT, seed=3))[0])

    def script() -> tuple[bytes, int]:
        with cs.SyncClient(url(app.port)) as client:
            audio = client.synthesize(TEXT, seed=3)
            chunks = 0
            for _ in client.speak(TEXT, seed=3):  # leaving early cancels the stream
                chunks += 1
                break
            return audio, chunks

    audio, chunks = await asyncio.to_thread(script)
    assert audio == expected and chunks == 1


async def test_api_key(make_app: Any) -> None:
    app = await make_app("--api-keys", "k1")
    with pytest.raises(cs.Unauthorized, match="API key"):
        await cs.Client(url(app.port)).connect()
    with pytest.raises(cs.Unauthorized):
        await cs.Client(url(app.port), api_key="wrong").connect()
    async with cs.Client(url(app.port), api_key="k1") as client:
        assert await client.synthesize("Hello.", seed=1)
