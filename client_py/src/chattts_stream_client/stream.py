"""One stream on the client: its seq bookkeeping across resumes, its chunk queue, its text."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from chattts_stream_client.errors import (
    ChatTTSStreamError,
    EngineError,
    ProtocolViolation,
    StreamTimeout,
)
from chattts_stream_client.wire import AudioChunk, Done, FrameHeader, Segment, Word

if TYPE_CHECKING:
    from chattts_stream_client.client import Client

Phase = Literal["pending", "starting", "live", "detached", "done", "failed", "cancelled"]
_END = object()  # queued after a stream's last chunk
#: :meth:`SpeechStream.buffered`'s start threshold when the server gives no advice.
DEFAULT_BUFFER_MS = 300.0
#: A frame's audio (docs/protocol.md: 20 ms frames but the last).
FRAME_MS = 20.0
_N = TypeVar("_N", int, float)


def _number(value: object, kind: type[_N]) -> _N | None:
    """A JSON number of the server's advice, or None (absent, or not a number)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return kind(value)


class SpeechStream:
    """A stream of audio chunks: ``async for chunk in stream`` until its last frame.

    Made by :meth:`Client.speak` (one text) or :meth:`Client.open_stream` (text
    sent with :meth:`append`/:meth:`flush`/:meth:`end` while audio flows). The
    stream survives a lost connection: the client reconnects and resumes it
    after the last frame it took, so every seq is yielded exactly once.
    Iteration raises the stream's error (a refusal such as
    :class:`~chattts_stream_client.errors.Overloaded`, an
    :class:`~chattts_stream_client.errors.EngineError` after the audio it
    produced, a lost connection) once the chunks before it were taken.
    """

    def __init__(self, client: Client, stream_id: str, start: dict[str, Any], queue_size: int) -> None:
        self.id = stream_id
        self.incremental = bool(start.get("incremental"))
        self._client = client
        self._start = start
        self._queue: asyncio.Queue[object] = asyncio.Queue(maxsize=queue_size)
        self.phase: Phase = "pending"
        #: The resume token (from ``started``); None until the server accepted the stream.
        self.token: str | None = None
        self.slot: int | None = None
        self.format: str = str(start.get("format", "pcm16"))
        self.sample_rate: int = int(start.get("sample_rate", 24_000))
        #: Opus only: decoded samples to drop at the start (``started.preskip``).
        self.preskip = 0
        #: Each frame's length in ms (``started.frame_ms``; the last frame may be shorter).
        self.frame_ms: int = int(start.get("frame_ms") or 20)
        #: The stream's seed (``started.seed``: the one asked for, or the server's pick).
        self.seed: int | None = None
        #: The server's advice (``started``; None from a server without it): audio to hold
        #: before playing so the whole stream plays without a stall, the RTF it expects, and
        #: what each further second of audio adds (for text an incremental stream has yet to send).
        self.buffer_ms: int | None = None
        self.expected_rtf: float | None = None
        self.buffer_ms_per_s: int | None = None
        #: Why a resume could not promise the same audio (``resume_degraded``); None: it did.
        self.degraded: str | None = None
        #: Last seq taken with none missing before it: the ``after_seq`` of a resume.
        self.last_seq = -1
        self.done: Done | None = None
        self.error: ChatTTSStreamError | None = None
        self.resumes = 0
        self.duplicates = 0
        #: ``segment`` messages in order, each once.
        self.segments: list[Segment] = []
        self._pending_segments: dict[int, list[Segment]] = {}
        self._segment_keys: set[tuple[int, int, int | None]] = set()
        #: Every word timed so far, in order, each once (``word_timestamps`` streams).
        self.words: list[Word] = []
        self._pending_words: dict[int, list[Word]] = {}
        self._word_keys: set[tuple[int, int]] = set()
        #: Text messages (append/flush/end) the server may not have: those sent since the last
        #: ``resumed`` that counted them (or since ``start``), then those not sent yet. A
        #: connection can break with the first still in flight; ``resumed.text_received``
        #: says how many arrived, and the rest are sent again. Bounded by the server's text
        #: limit per stream (it refuses text beyond ``max_text_chars``).
        self._text_log: list[dict[str, Any]] = []
        self._text_sent = 0  # how many of _text_log went out on the current connection
        self._text_confirmed = 0  # messages the server counted, trimmed from _text_log
        self._pumping = False
        self._start_due = False
        self._connection: object = None  # the connection text goes out on (None: none yet)
        self._ended_text = False
        self._started = asyncio.Event()
        self.created = time.perf_counter()
        #: ``time.perf_counter()`` when the first chunk was read (None: none yet).
        self.first_chunk_at: float | None = None

    # --- the user's side ---------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[AudioChunk]:
        await self.start()
        while True:
            item = await self._get()
            if item is _END:
                if self.error is not None:
                    raise self.error
                return
            assert isinstance(item, AudioChunk)
            yield item

    async def _get(self) -> object:
        timeout = self._client.read_timeout
        try:
            async with asyncio.timeout(timeout):
                return await self._queue.get()
        except TimeoutError:
            raise StreamTimeout(f"no audio for {timeout} s", stream_id=self.id) from None

    async def start(self) -> SpeechStream:
        """Send ``start`` (once) and wait for the server's ``started``.

        Raises:
            ChatTTSStreamError: the server refused the stream (the subclass of its code).
            StreamTimeout: no answer within the client's ``read_timeout``.
        """
        if self.phase == "pending":
            await self._client._launch(self)
        if self.phase in ("failed", "done", "cancelled") and self.error is not None and self.token is None:
            raise self.error
        try:
            async with asyncio.timeout(self._client.read_timeout):
                await self._started.wait()
        except TimeoutError:
            raise StreamTimeout("no answer to start", stream_id=self.id) from None
        if self.token is None and self.error is not None:
            raise self.error
        return self

    async def buffered(self, min_buffer_ms: float = DEFAULT_BUFFER_MS) -> AsyncIterator[AudioChunk]:
        """The chunks, the first ones held until playback can start without a stall.

        Nothing is yielded until the audio received reaches ``max(min_buffer_ms,
        buffer_ms)`` (the server's advice; ``min_buffer_ms`` alone from a server without
        it) or the stream ended; then everything received goes out, and later chunks as they
        come. A player that starts on the first chunk this yields and plays at real time
        hears a later start instead of stutter when the server is slower than real time.
        """
        threshold_ms = max(min_buffer_ms, self.buffer_ms or 0)
        held: list[AudioChunk] | None = []
        async for chunk in self:
            if held is None:
                yield chunk
                continue
            held.append(chunk)
            audio_ms = 1000.0 * (chunk.sample - held[0].sample) / self.sample_rate + FRAME_MS
            if chunk.last or audio_ms >= threshold_ms:
                for taken in held:
                    yield taken
                held = None
        for taken in held or ():
            yield taken  # the stream ended (or failed) before the threshold

    async def read_all(self) -> bytes:
        """Every chunk's payload, concatenated (a whole file for ogg/mp3/flac, samples for PCM)."""
        return b"".join([chunk.data async for chunk in self])

    async def append(self, text: str) -> None:
        """Add text to an incremental stream; each sentence is spoken once complete."""
        await self._text({"type": "append", "id": self.id, "text": text})

    async def flush(self) -> None:
        """Speak the buffered text now, sentence end or not."""
        await self._text({"type": "flush", "id": self.id})

    async def end(self) -> None:
        """No more text: the stream finishes after the buffered text is spoken."""
        await self._text({"type": "end", "id": self.id})
        self._ended_text = True

    async def cancel(self) -> None:
        """Stop now: iteration ends at once and the server stops generating (it answers ``done``)."""
        if self.phase in ("done", "failed", "cancelled"):
            return
        live = self.phase in ("starting", "live")
        self.phase = "cancelled"
        self._drop_queued()
        self._queue.put_nowait(_END)
        if live:
            await self._client._send({"type": "cancel", "id": self.id})
        if self.token is None or not live:
            self._client._forget(self)  # nothing more will come for it

    async def _text(self, message: dict[str, Any]) -> None:
        if not self.incremental:
            raise TypeError("append/flush/end need a stream from open_stream()")
        if self._ended_text:
            raise RuntimeError("end() was already called")
        if self.error is not None:
            raise self.error
        if self.phase in ("done", "failed", "cancelled"):
            raise RuntimeError(f"the stream is {self.phase}")
        self._text_log.append(message)
        await self._send_text()  # or, between connections, after ``resumed`` / a new ``start``

    # --- the client's side -------------------------------------------------------

    async def _restart(self) -> None:
        """A new stream on the server over the client's current connection: ``start``, then all the text.

        The new stream has none of the text, so all of it is sent.
        """
        self._connection = self._client._ws
        self._start_due = True
        self._text_sent = 0
        await self._send_text()

    async def _send_text(self) -> None:
        """Send ``start`` if due, then the logged text messages not sent on this connection yet.

        One sender at a time, in order: a message logged while another call is sending goes
        out from that call's loop. Nothing goes out on a connection the stream is not attached
        to (before ``resumed`` on a new one, text waits).
        """
        if self._pumping:
            return
        self._pumping = True
        try:
            while self._connection is not None and self._connection is self._client._ws and not self.finished:
                if self._start_due:
                    self._start_due = False
                    message = self._start
                elif self._text_sent < len(self._text_log):
                    message = self._text_log[self._text_sent]
                    self._text_sent += 1
                else:
                    return
                await self._client._send(message)
        finally:
            self._pumping = False

    def _resume_message(self) -> dict[str, Any]:
        """The ``resume`` for a new connection, after the last seq taken.

        It carries what a replica that no longer holds the stream needs to regenerate it: the
        ``start`` request with its seed, and the last segment taken.
        """
        message: dict[str, Any] = {"type": "resume", "stream": self.token, "after_seq": self.last_seq}
        if self.seed is None or self.incremental:
            return message  # incremental text cannot be regenerated
        message["request"] = self._start | {"seed": self.seed}
        taken = [s for s in self.segments if s.seq <= self.last_seq and s.index is not None]
        if taken:
            message["segment"], message["segment_sample"] = taken[-1].index, taken[-1].sample
        return message

    def _on_started(self, message: dict[str, Any]) -> None:
        self.token = str(message["stream"])
        seed = message.get("seed")
        self.seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else self._start.get("seed")
        self.slot = int(message["slot"])
        self.format = str(message.get("format", self.format))
        self.sample_rate = int(message.get("sample_rate", self.sample_rate))
        self.preskip = int(message.get("preskip", 0))
        self.frame_ms = _number(message.get("frame_ms"), int) or self.frame_ms
        self.buffer_ms = _number(message.get("buffer_ms"), int)
        self.expected_rtf = _number(message.get("expected_rtf"), float)
        self.buffer_ms_per_s = _number(message.get("buffer_ms_per_s"), int)
        if self.phase == "starting":
            self.phase = "live"
        self._started.set()

    def _on_resumed(self, message: dict[str, Any]) -> None:
        self.slot = int(message["slot"])
        # A replica that regenerated the stream gives it a token of its own.
        self.token = str(message.get("stream", self.token))
        self.resumes += 1
        if self.phase in ("starting", "detached"):
            self.phase = "live"
        self._connection = self._client._ws  # text may go out on this connection again
        received = message.get("text_received")
        if isinstance(received, int) and not isinstance(received, bool):
            # The server read this many: forget those, send the rest again (lost in flight).
            arrived = min(max(received - self._text_confirmed, 0), len(self._text_log))
        else:
            # A server without ``text_received``: what went out is taken as arrived (protocol v1).
            arrived = self._text_sent
        del self._text_log[:arrived]
        self._text_confirmed += arrived
        self._text_sent = 0

    def _on_segment(self, message: dict[str, Any]) -> None:
        index = message.get("index")
        index = index if isinstance(index, int) and not isinstance(index, bool) else None
        key = (int(message["seq"]), int(message["sample"]), index)
        if key in self._segment_keys or key[0] <= self.last_seq:
            return  # replayed after a resume: taken once
        self._segment_keys.add(key)
        segment = Segment(str(message.get("text", "")), key[0], key[1], index)
        self.segments.append(segment)
        self._pending_segments.setdefault(key[0], []).append(segment)

    def _on_words(self, message: dict[str, Any]) -> None:
        key = (int(message["seq"]), int(message.get("sample", 0)))
        if key in self._word_keys or key[0] <= self.last_seq:
            return  # replayed after a resume: taken once
        self._word_keys.add(key)
        words = [Word(str(w["text"]), int(w["start"]), int(w["end"])) for w in message.get("words", ())]
        self.words += words
        self._pending_words.setdefault(key[0], []).extend(words)

    async def _on_frame(self, header: FrameHeader, payload: bytes, received_at: float) -> None:
        """Take a frame once, in seq order.

        Raises:
            ProtocolViolation: a seq beyond the next one (frames were lost).
        """
        if header.seq <= self.last_seq:
            self.duplicates += 1
            return
        if header.seq != self.last_seq + 1:
            raise ProtocolViolation(f"stream {self.id}: seq {header.seq} after {self.last_seq}")
        self.last_seq = header.seq
        if self.phase == "cancelled":
            return
        if self.first_chunk_at is None:
            self.first_chunk_at = received_at
        segments = tuple(self._pending_segments.pop(header.seq, ()))
        words = tuple(self._pending_words.pop(header.seq, ()))
        chunk = AudioChunk(payload, header.seq, header.sample, header.last, segments, received_at, words)
        await self._queue.put(chunk)  # bounded: a slow consumer slows the connection's reader

    def _on_error(self, error: ChatTTSStreamError) -> None:
        """An ``error`` for this stream: a refusal before ``started``, else a failure (``done`` follows)."""
        if self.token is None:
            self._fail_with(error)
        elif isinstance(error, EngineError) or self.error is None:
            self.error = error

    def _on_done(self, message: dict[str, Any]) -> None:
        self.done = Done(str(message["reason"]), int(message["last_seq"]), int(message["samples"]))
        if self.done.reason == "error" and self.error is None:
            self.error = EngineError("the stream failed", stream_id=self.id)
        if self.phase != "cancelled":
            self.phase = "done"
            if self._queue.full():
                self._end_later()
            else:
                self._queue.put_nowait(_END)

    def _fail_with(self, error: ChatTTSStreamError) -> None:
        """End the stream with ``error`` (raised once the chunks before it were taken)."""
        if self.phase in ("done", "failed", "cancelled"):
            return
        self.error = error
        self.phase = "failed"
        self._started.set()
        if self._queue.full():
            self._end_later()
        else:
            self._queue.put_nowait(_END)

    def _end_later(self) -> None:
        # The queue is full (a slow consumer): the end marker waits its turn, owned by the client.
        self._client._spawn(self._queue.put(_END))

    def _drop_queued(self) -> None:
        while not self._queue.empty():
            self._queue.get_nowait()

    @property
    def finished(self) -> bool:
        """The stream needs nothing more from the server."""
        return self.phase in ("done", "failed", "cancelled")
