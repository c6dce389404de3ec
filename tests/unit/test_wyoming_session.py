"""The Wyoming session without sockets: Wyoming events in, events and actions out.

A real service over the fake engine's inference thread stands behind it; no
socket is opened. Every event Home Assistant sends, the audio rendering, and
each refusal (which closes the connection).
"""

from __future__ import annotations

import asyncio

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.ping import Ping
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeStopped,
    SynthesizeTextFormat,
    SynthesizeVoice,
)

from server.engine.fake import FAIL_MARKER, FAKE_VOICES, FakeEngine
from server.frontends.wyoming.session import (
    CHUNK_FRAMES,
    Action,
    Close,
    Deliver,
    Write,
    WyomingSession,
    voice_of,
    wyoming_info,
)
from server.streams.items import Frame, OutItem
from server.streams.lifecycle import StreamState
from server.streams.service import SpeechService
from server.voices.catalog import OPENAI_VOICES
from tests.unit.conftest import MakeService


def session(service: SpeechService, seed: int | None = 0) -> WyomingSession:
    errors: list[str] = []
    s = WyomingSession(
        service,
        wyoming_info(service.catalog.entries()),
        client="ip:10.0.0.7",
        seed=seed,
        abort=lambda reason: None,
        count_error=errors.append,
    )
    s.errors = errors  # type: ignore[attr-defined]
    return s


def written(actions: list[Action]) -> list[Event]:
    return [a.event for a in actions if isinstance(a, Write)]


def refusal(actions: list[Action]) -> Error:
    """The actions refuse: one error event, then the connection closes."""
    assert isinstance(actions[-1], Close), actions
    [event] = written(actions)
    assert Error.is_type(event.type), event
    return Error.from_event(event)


def opened(actions: list[Action]) -> Deliver:
    """The actions open a stream: audio-start (pcm16 mono 24 kHz), then its delivery."""
    [start] = written(actions)
    assert AudioStart.from_event(start) == AudioStart(rate=24_000, width=2, channels=1, timestamp=0)
    deliver = actions[-1]
    assert isinstance(deliver, Deliver)
    return deliver


async def items_of(deliver: Deliver) -> list[OutItem]:
    outbox = deliver.stream.outbox
    async with asyncio.timeout(10):
        while not outbox.ended:
            await outbox.wait_change()
    return outbox.ready(outbox.start_index)


def audio(events: list[Event]) -> bytes:
    return b"".join(AudioChunk.from_event(e).audio for e in events if AudioChunk.is_type(e.type))


# --- describe ------------------------------------------------------------------------------------


async def test_describe_lists_our_voices_with_openai_names_zh_en_and_streaming(
    make_service: MakeService,
) -> None:
    s = session(await make_service())
    [event] = written(s.receive(Describe().event()))
    [tts] = Info.from_event(event).tts
    assert tts.supports_synthesize_streaming and tts.installed and tts.version
    names = [v.name for v in tts.voices]
    assert names == ["default", *[v for v in FAKE_VOICES if v != "default"], *OPENAI_VOICES]
    assert all(v.languages == ["zh", "en"] and v.installed for v in tts.voices)
    assert {v.description for v in tts.voices if v.name == "echo"} == {"echo (ChatTTS seed:14)"}


def test_a_wyoming_voice_is_its_name_for_the_stream_layer_to_resolve() -> None:
    assert voice_of(None) == "default" == voice_of(SynthesizeVoice())
    assert voice_of(SynthesizeVoice(name="echo")) == "echo"  # SpeechService.open maps it, as on every port
    assert voice_of(SynthesizeVoice(name="seed:5", speaker="x")) == "seed:5"


async def test_ping_answers_pong_and_unknown_events_are_ignored(make_service: MakeService) -> None:
    s = session(await make_service())
    [pong] = written(s.receive(Ping(text="hi").event()))
    assert pong.type == "pong" and pong.data["text"] == "hi"
    assert s.receive(Event(type="transcribe", data={})) == []


# --- synthesize -----------------------------------------------------------------------------------


async def test_synthesize_opens_one_seeded_pcm16_stream_and_renders_it_to_audio_stop(
    make_service: MakeService,
) -> None:
    service = await make_service()
    s = session(service, seed=5)
    deliver = opened(s.receive(Synthesize("One sentence. And two.", voice=SynthesizeVoice("echo")).event()))
    assert deliver.stream.resumable is False and deliver.stream.text is None
    items = await items_of(deliver)
    events = s.render(items)
    frames = [i for i in items if isinstance(i, Frame)]
    assert audio(events) == b"".join(f.payload for f in frames)
    assert [e.type for e in events][-1] == "audio-stop"  # no synthesize-stopped for the one-shot form
    assert AudioStop.from_event(events[-1]).timestamp == sum(f.samples for f in frames) * 1000 // 24_000
    assert s.delivered() == [] and s.stream is None
    assert deliver.stream.state is StreamState.CLOSED and len(service.registry) == 0


async def test_frames_are_joined_into_chunks_of_at_most_200_ms(make_service: MakeService) -> None:
    s = session(await make_service())
    frames: list[OutItem] = [Frame(n, bytes([n]) * 960, n * 480, 480) for n in range(2 * CHUNK_FRAMES + 5)]
    chunks = [AudioChunk.from_event(e) for e in s.render(frames)]
    assert [c.samples for c in chunks] == [4800, 4800, 2400]
    assert [c.timestamp for c in chunks] == [0, 200, 400]
    assert b"".join(c.audio for c in chunks) == b"".join(f.payload for f in frames)  # type: ignore[union-attr]


async def test_the_streaming_form_appends_chunks_ignores_the_repeat_and_ends_with_stopped(
    make_service: MakeService,
) -> None:
    s = session(await make_service())
    deliver = opened(s.receive(SynthesizeStart(voice=SynthesizeVoice("default")).event()))
    assert s.taking_text and deliver.stream.text is not None
    for piece in ["Sentence one ", "is here. ", "Two"]:
        assert s.receive(SynthesizeChunk(piece).event()) == []
    assert deliver.stream.text.total_chars == len("Sentence one is here. Two")
    # Home Assistant repeats the whole text as `synthesize` "for compatibility": not a second stream.
    assert s.receive(Synthesize("Sentence one is here. Two").event()) == []
    assert s.receive(SynthesizeStop().event()) == [] and not s.taking_text
    events = s.render(await items_of(deliver))
    assert [e.type for e in events][-2:] == ["audio-stop", "synthesize-stopped"]
    assert [m.text for m in await items_of(deliver) if type(m).__name__ == "SegmentMark"] == [
        "Sentence one is here.",
        "Two",
    ]
    assert s.delivered() == [] and s.stream is None


# --- refusals: an error event, then the connection closes ---------------------------------------


async def test_unknown_voice_is_an_unsupported_error(make_service: MakeService) -> None:
    service = await make_service()
    s = session(service)
    error = refusal(s.receive(Synthesize("Hello.", voice=SynthesizeVoice("nobody")).event()))
    assert error.code == "unsupported" and "nobody" in error.text
    assert s.errors == ["unsupported"] and len(service.registry) == 0  # type: ignore[attr-defined]


async def test_chunks_and_stop_need_a_start(make_service: MakeService) -> None:
    s = session(await make_service())
    assert refusal(s.receive(SynthesizeChunk("text").event())).code == "bad_request"
    assert refusal(session(s._service).receive(SynthesizeStop().event())).code == "bad_request"


async def test_one_stream_at_a_time_per_connection(make_service: MakeService) -> None:
    service = await make_service()
    s = session(service)
    opened(s.receive(Synthesize("First request.").event()))
    error = refusal(s.receive(Synthesize("Second request.").event()))
    assert error.code == "bad_request" and "one synthesis at a time" in error.text
    assert refusal(s.receive(SynthesizeStart().event())).code == "bad_request"
    assert len(service.registry) == 1


async def test_draining_refuses_new_synthesis_and_closes_idle_sessions(make_service: MakeService) -> None:
    service = await make_service()
    s = session(service)
    running = opened(s.receive(Synthesize("Still running.").event()))
    service.draining = True
    assert s.close_if_idle() == []  # its stream finishes first
    s.render(await items_of(running))
    assert s.delivered() == [Close()]
    other = session(service)
    assert refusal(other.receive(Synthesize("Too late.").event())).code == "shutting_down"
    assert refusal(session(service).receive(SynthesizeStart().event())).code == "shutting_down"
    describe = session(service).receive(Describe().event())
    assert Info.is_type(written(describe)[0].type) and describe[-1] == Close()


async def test_rate_limit_by_client_ip(make_service: MakeService) -> None:
    service = await make_service("--rate-limit-per-min", "1", "--rate-limit-burst", "1")
    first = session(service)
    opened(first.receive(Synthesize("Allowed.").event()))
    error = refusal(session(service).receive(Synthesize("Refused.").event()))
    assert error.code == "rate_limited"
    [event] = written(session(service).receive(Synthesize("Refused.").event())[:1])
    assert event.data["retry_after_ms"] > 0


async def test_text_limits_apply_to_both_forms(make_service: MakeService) -> None:
    service = await make_service("--max-text-chars", "40")
    assert refusal(session(service).receive(Synthesize("x" * 41).event())).code == "text_too_long"
    s = session(service)
    opened(s.receive(SynthesizeStart().event()))
    s.receive(SynthesizeChunk("A first sentence is here. ").event())
    assert refusal(s.receive(SynthesizeChunk("And more than fits.").event())).code == "text_too_long"
    assert refusal(session(service).receive(Synthesize("").event())).code == "bad_request"


async def test_ssml_and_malformed_events_are_refused(make_service: MakeService) -> None:
    service = await make_service()
    ssml = Synthesize("<speak>Hi</speak>", text_format=SynthesizeTextFormat.SSML).event()
    assert refusal(session(service).receive(ssml)).code == "unsupported"
    assert refusal(session(service).receive(Event(type="synthesize", data={}))).code == "bad_request"
    assert (
        refusal(session(service).receive(Event(type="synthesize-chunk", data={"x": 1}))).code == "bad_request"
    )
    assert refusal(session(service).bad_event("not json")).code == "bad_request"


async def test_a_failed_stream_sends_its_error_and_closes(make_service: MakeService) -> None:
    s = session(await make_service())
    deliver = opened(s.receive(Synthesize(f"Fine first. Then {FAIL_MARKER} here.").event()))
    events = s.render(await items_of(deliver))
    errors = [Error.from_event(e) for e in events if Error.is_type(e.type)]
    assert [e.code for e in errors] == ["engine_error"]
    assert not any(AudioStop.is_type(e.type) or SynthesizeStopped.is_type(e.type) for e in events)
    assert s.delivered() == [Close()]


async def test_connection_lost_cancels_and_frees_the_stream(make_service: MakeService) -> None:
    service = await make_service("--fake-step-ms", "50")
    s = session(service)
    deliver = opened(s.receive(Synthesize("A long text that keeps generating for a while. " * 4).event()))
    engine = service.engine.engine
    assert isinstance(engine, FakeEngine)
    async with asyncio.timeout(10):
        while engine.live_sequences == 0:  # the engine took the row
            await asyncio.sleep(0.01)
    s.connection_lost()
    assert s.stream is None and deliver.stream.state is StreamState.CLOSED and len(service.registry) == 0
    async with asyncio.timeout(10):
        while engine.live_sequences:  # and dropped it, before the text was done
            await asyncio.sleep(0.01)
    assert any(kind == "drop" for kind, _ in engine.events)
