"""One Wyoming connection's protocol, sans I/O: Wyoming events in, Wyoming events and actions out.

Home Assistant's voice pipeline speaks Wyoming (``describe``/``info``,
``synthesize``, and the streaming form ``synthesize-start`` /
``synthesize-chunk`` … / ``synthesize-stop``). :class:`WyomingSession` maps
them onto the service's streams: ``synthesize`` opens one stream of its text;
``synthesize-start`` opens an incremental stream whose chunks are ``append``
ed as they come, so the first sentence is spoken while the model behind Home
Assistant still writes the next; ``synthesize-stop`` ends its text. The audio
goes out as ``audio-start``, ``audio-chunk`` … (pcm16, mono), ``audio-stop``,
then ``synthesize-stopped`` for the streaming form. One stream at a time per
connection (Wyoming has no stream ids). Every error is an ``error`` event
(``code`` = our wire code) after which the connection closes, because Home
Assistant's one-shot reader waits for ``audio-stop`` or the end of the
connection and would otherwise wait forever. ``server.frontends.wyoming.server`` carries
the actions out on a socket; tests drive this class with plain events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice
from wyoming.ping import Ping, Pong
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeStopped,
    SynthesizeVoice,
)

from server.config import VERSION
from server.errors import InvalidRequest, ServiceError, Unsupported
from server.frontends.codes import code_of
from server.streams.incremental import TextFeed
from server.streams.items import Done, Failure, Frame, OutItem
from server.streams.lifecycle import Lease
from server.streams.request import SpeechRequest
from server.streams.service import SpeechService
from server.streams.stream import Stream
from server.voices.catalog import VoiceEntry

#: Wyoming audio: signed 16-bit mono at the model's native rate.
FORMAT, RATE, WIDTH, CHANNELS = "pcm16", 24_000, 2, 1
#: Frames (20 ms each) joined into one ``audio-chunk`` at most: 200 ms.
CHUNK_FRAMES = 10
#: ChatTTS speaks Chinese and English (mixed within a sentence too).
LANGUAGES = ["zh", "en"]
ATTRIBUTION = Attribution(name="2noise ChatTTS, chattts-stream", url="https://github.com/2noise/ChatTTS")


@dataclass(frozen=True)
class Write:
    """Send an event."""

    event: Event


@dataclass(frozen=True)
class Deliver:
    """Send ``stream``'s audio as it comes (through :meth:`WyomingSession.render`)."""

    stream: Stream
    lease: Lease


@dataclass(frozen=True)
class Close:
    """Close the connection (after the events before it went out)."""


Action = Write | Deliver | Close


def wyoming_info(voices: Iterable[VoiceEntry]) -> Info:
    """The ``info`` answer to ``describe``: every port's voice list (``VoiceCatalog``), zh and en, streaming.

    ``voices``: the list now (voices made from recordings come and go). Each description says
    what a name speaks with (``echo (ChatTTS seed:14)``) or whose recording it is.
    """
    listed = [
        TtsVoice(
            name=entry.name,
            attribution=ATTRIBUTION,
            installed=True,
            description=_described(entry),
            version=None,
            languages=list(LANGUAGES),
        )
        for entry in voices
    ]
    program = TtsProgram(
        name="chattts-stream",
        attribution=ATTRIBUTION,
        installed=True,
        description="ChatTTS, streamed while it is generated",
        version=VERSION,
        voices=listed,
        supports_synthesize_streaming=True,
    )
    return Info(tts=[program])


def _described(entry: VoiceEntry) -> str:
    if entry.recording is not None:
        return f"{entry.recording.name or entry.name} (from a recording)"
    return entry.name if entry.voice == entry.name else f"{entry.name} (ChatTTS {entry.voice})"


def voice_of(voice: SynthesizeVoice | None) -> str:
    """The voice name a Wyoming voice asks for (the stream layer resolves it); none given → ``default``."""
    if voice is None or not voice.name:
        return "default"
    return voice.name


def error_event(code: str, message: str, retry_after_ms: int | None = None) -> Event:
    """A Wyoming ``error`` with our wire code (and ``retry_after_ms`` when retrying may help)."""
    event = Error(text=message, code=code).event()
    if retry_after_ms is not None:
        event.data["retry_after_ms"] = retry_after_ms
    return event


class WyomingSession:
    """The state of one Wyoming connection: at most one stream, and whether it takes text chunks.

    Args:
        service: opens and frees streams.
        info: what ``describe`` answers.
        client: the client's rate-limit identity (its IP: Wyoming has no API keys).
        seed: the sampling seed of every request (None: random).
        abort: drops the connection at once (its reader fell too far behind).
        count_error: counts an error sent, by code.
    """

    def __init__(
        self,
        service: SpeechService,
        info: Info,
        *,
        client: str,
        seed: int | None,
        abort: Callable[[str], None],
        count_error: Callable[[str], None],
    ) -> None:
        self._service = service
        self._info = info.event()
        self._client = client
        self._seed = seed
        self._abort = abort
        self._count_error = count_error
        self.stream: Stream | None = None
        #: The stream takes ``synthesize-chunk`` text (between ``synthesize-start`` and ``-stop``).
        self.taking_text = False
        self._failed = False

    # --- client events -------------------------------------------------------------

    def receive(self, event: Event) -> list[Action]:
        """One event from the client; returns what to do, in order."""
        try:
            return self._dispatch(event)
        except ServiceError as exc:
            return self._refuse(code_of(exc), exc.message, exc.retry_after_ms)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            return self._refuse("bad_request", f"invalid {event.type} event: {exc!r}")

    def _dispatch(self, event: Event) -> list[Action]:
        kind = event.type
        if Describe.is_type(kind):
            return [Write(self._info), *self.close_if_idle()]
        if Ping.is_type(kind):
            return [Write(Pong(text=Ping.from_event(event).text).event())]
        if Synthesize.is_type(kind):
            if self.taking_text:
                return []  # Home Assistant repeats the whole text "for compatibility": spoken already
            synthesize = Synthesize.from_event(event)
            return self._open(synthesize.text, synthesize.voice, synthesize.text_format, streaming=False)
        if SynthesizeStart.is_type(kind):
            start = SynthesizeStart.from_event(event)
            return self._open(None, start.voice, start.text_format, streaming=True)
        if SynthesizeChunk.is_type(kind):
            self._feed().append(SynthesizeChunk.from_event(event).text)
            return []
        if SynthesizeStop.is_type(kind):
            self._feed().end()
            self.taking_text = False
            return []
        return []  # Wyoming peers ignore events they do not serve

    def bad_event(self, message: str) -> list[Action]:
        """Bytes that are no Wyoming event: say so and close."""
        return self._refuse("bad_request", message)

    def timed_out(self, message: str) -> list[Action]:
        """A deadline of the connection passed (idle, a slow event, text without its stop): say so, close."""
        return self._refuse("timeout", message)

    def _open(
        self, text: str | None, voice: SynthesizeVoice | None, text_format: object, *, streaming: bool
    ) -> list[Action]:
        if self.stream is not None:
            raise InvalidRequest("one synthesis at a time per connection; wait for its audio-stop")
        if text_format is not None and str(getattr(text_format, "value", text_format)) != "text":
            raise Unsupported(f"text_format {text_format!r} is not supported; send plain text")
        service = self._service
        service.check_accepting()
        request = SpeechRequest(
            name="wyoming",
            text="" if streaming else text,
            voice=voice_of(voice),
            format=FORMAT,
            sample_rate=RATE,
            seed=self._seed,
            incremental=streaming,
        )
        lease = Lease(self._abort)
        self.stream = service.open(request, lease, resumable=False, client=self._client)
        self.taking_text = streaming
        start = AudioStart(rate=RATE, width=WIDTH, channels=CHANNELS, timestamp=0).event()
        return [Write(start), Deliver(self.stream, lease)]

    def _feed(self) -> TextFeed:
        if not self.taking_text or self.stream is None or self.stream.text is None:
            raise InvalidRequest("synthesize-chunk and synthesize-stop come after synthesize-start")
        return self.stream.text

    def _refuse(self, code: str, message: str, retry_after_ms: int | None = None) -> list[Action]:
        self._count_error(code)
        self._failed = True
        return [Write(error_event(code, message, retry_after_ms)), Close()]

    # --- sending --------------------------------------------------------------------

    def render(self, items: list[OutItem]) -> list[Event]:
        """A run of outbox items as Wyoming events: frames joined into chunks, then the end."""
        events: list[Event] = []
        frames: list[Frame] = []
        for item in items:
            if isinstance(item, Frame):
                frames.append(item)
                continue
            events += _chunks(frames)
            frames = []
            if isinstance(item, Failure):
                code = code_of(item.error)
                self._count_error(code)
                self._failed = True
                events.append(error_event(code, item.error.message))
            elif isinstance(item, Done) and item.reason == "complete":
                events.append(AudioStop(timestamp=item.samples * 1000 // RATE).event())
                if self.stream is not None and self.stream.text is not None:  # the streaming form
                    events.append(SynthesizeStopped().event())
        return events + _chunks(frames)

    def delivered(self) -> list[Action]:
        """The stream's last event went out: free it; close after a failure or during a drain."""
        self._free()
        return [Close()] if self._failed else self.close_if_idle()

    def close_if_idle(self) -> list[Action]:
        """During a drain, a connection without a stream is closed."""
        return [Close()] if self._service.draining and self.stream is None else []

    def connection_lost(self) -> None:
        """The client is gone: its stream stops generating and is freed (nothing can resume it)."""
        self._free()

    def _free(self) -> None:
        stream, self.stream = self.stream, None
        self.taking_text = False
        if stream is not None:
            self._service.abandon(stream)


def _chunks(frames: list[Frame]) -> list[Event]:
    """Frames joined into ``audio-chunk`` events of at most :data:`CHUNK_FRAMES` frames each."""
    events = []
    for i in range(0, len(frames), CHUNK_FRAMES):
        group = frames[i : i + CHUNK_FRAMES]
        audio = b"".join(f.payload for f in group)
        if audio:
            timestamp = group[0].sample * 1000 // RATE
            events.append(
                AudioChunk(
                    rate=RATE, width=WIDTH, channels=CHANNELS, audio=audio, timestamp=timestamp
                ).event()
            )
    return events
