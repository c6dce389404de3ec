"""A LiveKit Agents TTS backed by chattts-stream (``pip install 'chattts-stream-client[livekit]'``).

:class:`ChatTTSStreamTTS` is a ``livekit.agents.tts.TTS`` with ``streaming=True`` and
``aligned_transcript=True``. All its streams share one WebSocket connection (one
:class:`~chattts_stream_client.Client`, resumed without a gap if it drops).

- :meth:`ChatTTSStreamTTS.stream`: each LiveKit segment (the text pushed until a ``flush`` or
  ``end_input``) is one incremental stream of the server, opened with the segment's first
  text: ``push_text`` is our ``append`` (the server speaks each sentence as soon as it is
  complete), and the segment's end (``flush``, or ``end_input``) is our ``end``: the rest is
  spoken at once, sentence end or not, and the stream finishes, which ends the segment.
- :meth:`ChatTTSStreamTTS.synthesize`: one whole text, one stream.
- Timed transcripts: every frame carries ``TimedString``s (seconds from the segment's start):
  one per word when the server sends word timings, else one per text segment (sentence) at
  the sample it starts.
- Our error codes are LiveKit's API errors, so its retries apply where they can help:
  ``overloaded``/``rate_limited`` → ``APIStatusError`` 429 (retried), ``shutting_down`` 503,
  ``engine_error`` 500 (both retried), refusals of the request (``bad_request``,
  ``unsupported``, ``text_too_long``, ``unauthorized``) 4xx (not retried), a lost connection
  ``APIConnectionError`` and no answer in time ``APITimeoutError`` (retried).
- Closing a stream (``aclose``, as LiveKit does on an interruption) cancels its server
  streams at once: the engine stops generating and frees the row.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from livekit.agents import (
    DEFAULT_API_CONNECT_OPTIONS,
    APIConnectionError,
    APIConnectOptions,
    APIError,
    APIStatusError,
    APITimeoutError,
    tts,
)
from livekit.agents.types import TimedString
from livekit.agents.utils import shortuuid

from chattts_stream_client.client import Client
from chattts_stream_client.errors import ChatTTSStreamError, ConnectionLost, StreamTimeout, Unauthorized
from chattts_stream_client.stream import SpeechStream
from chattts_stream_client.wire import AudioChunk

#: Our wire codes as HTTP statuses: LiveKit retries 408, 429, 499 and every 5xx, never other 4xx.
_STATUS = {
    "bad_request": 400,
    "unsupported": 400,
    "text_too_long": 413,
    "duplicate_id": 409,
    "too_many_streams": 429,
    "rate_limited": 429,
    "overloaded": 429,
    "engine_error": 500,
    "internal": 500,
    "shutting_down": 503,
}


def api_error(error: ChatTTSStreamError) -> APIError:
    """LiveKit's error for one of ours (``retryable`` where a new attempt may succeed)."""
    body = {"code": error.code, "message": error.message, "retry_after_ms": error.retry_after_ms}
    if isinstance(error, StreamTimeout):
        return APITimeoutError(f"chattts-stream: {error}")
    if isinstance(error, Unauthorized):
        return APIStatusError(f"chattts-stream: {error}", status_code=401, body=body)
    if isinstance(error, ConnectionLost) or error.code not in _STATUS:
        # Also unknown_stream, resume_expired, protocol: the stream is lost, a new one may work.
        return APIConnectionError(f"chattts-stream: {error}")
    return APIStatusError(f"chattts-stream: {error}", status_code=_STATUS[error.code], body=body)


class ChatTTSStreamTTS(tts.TTS[Any]):
    """Speaks LiveKit text through a chattts-stream server, streaming audio as it is generated."""

    def __init__(
        self,
        *,
        url: str,
        api_key: str | None = None,
        voice: str = "default",
        sample_rate: int = 24_000,
        seed: int | None = None,
        speed: float | None = None,
        max_buffer_delay_ms: int | None = None,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        """Create the TTS (it connects with the first stream, or on :meth:`prewarm`).

        Args:
            url: the server's WebSocket URL, ``ws://host:8080/v1/stream``.
            api_key: the server's API key, when it wants one.
            voice: ``default``, ``seed:<int>``, a named voice or a speaker string.
            sample_rate: 8000, 16000, 24000 (native) or 48000; pcm16 at this rate.
            seed: fixed seed for reproducible audio (None: random sampling).
            speed: 0.5 to 2.0.
            max_buffer_delay_ms: speak a clause after this long without text (None: the
                server's default).
            client_options: further :class:`~chattts_stream_client.Client` arguments.
        """
        super().__init__(
            capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=True),
            sample_rate=sample_rate,
            num_channels=1,
        )
        self._client = Client(url, api_key=api_key, **(client_options or {}))
        self._voice, self._seed, self._speed = voice, seed, speed
        self._max_buffer_delay_ms = max_buffer_delay_ms
        self._prewarm: asyncio.Task[Any] | None = None

    @property
    def client(self) -> Client:
        """The chattts-stream client this TTS speaks through."""
        return self._client

    @property
    def model(self) -> str:
        """The model's name."""
        return "chattts"

    @property
    def provider(self) -> str:
        """The provider's name."""
        return "chattts-stream"

    def synthesize(
        self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> tts.ChunkedStream:
        """Speak one whole text (one server stream)."""
        return _Chunked(tts=self, input_text=text, conn_options=conn_options)

    def stream(
        self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> tts.SynthesizeStream:
        """Speak text as it is pushed: one incremental server stream per segment."""
        return _Stream(tts=self, conn_options=conn_options)

    def prewarm(self) -> None:
        """Connect now (in the background), so the first stream does not wait for the handshake."""
        with contextlib.suppress(RuntimeError):  # no running loop: the first stream connects
            if self._prewarm is None:
                self._prewarm = asyncio.get_running_loop().create_task(self._client.connect())

    async def aclose(self) -> None:
        """Close the connection (streams still running are cancelled)."""
        if self._prewarm is not None:
            self._prewarm.cancel()
            await asyncio.gather(self._prewarm, return_exceptions=True)
        await self._client.close()

    async def _connect(self, conn_options: APIConnectOptions) -> None:
        try:
            async with asyncio.timeout(conn_options.timeout):
                await self._client.connect()
        except TimeoutError:
            raise APITimeoutError("chattts-stream: no connection in time") from None
        except ChatTTSStreamError as exc:
            raise api_error(exc) from exc

    async def _open(self, text: str = "", *, incremental: bool) -> SpeechStream:
        """A started server stream: incremental (text to come), or speaking ``text``."""
        fields: dict[str, Any] = {"voice": self._voice, "sample_rate": self.sample_rate, "seed": self._seed}
        fields["speed"] = self._speed  # a start field (None: left out)
        if incremental:
            return await self._client.open_stream(
                text, format="pcm16", max_buffer_delay_ms=self._max_buffer_delay_ms, **fields
            )
        return await self._client.speak(text, format="pcm16", **fields).start()


class _Transcript:
    """Turns a server stream's chunks into LiveKit's timed transcript, in seconds from its start.

    Words when the server sends them; until then, each text segment at the sample it starts
    (what LiveKit's own StreamAdapter gives for sentences). Latin pieces are joined by spaces.
    """

    def __init__(self, sample_rate: int) -> None:
        self._rate = sample_rate
        self._words_seen = False
        self._last = ""

    def of(self, chunk: AudioChunk) -> list[TimedString]:
        """The timed strings that begin in ``chunk``."""
        if chunk.words:
            self._words_seen = True
            return [
                TimedString(
                    self._spaced(w.text), start_time=w.start / self._rate, end_time=w.end / self._rate
                )
                for w in chunk.words
            ]
        if self._words_seen:
            return []
        return [TimedString(self._spaced(s.text), start_time=s.sample / self._rate) for s in chunk.segments]

    def _spaced(self, text: str) -> str:
        spaced = f" {text}" if self._last and self._last[-1].isascii() and text[:1].isascii() else text
        self._last = text
        return spaced


async def _play(stream: SpeechStream, emitter: tts.AudioEmitter, rate: int) -> None:
    """A server stream's audio and timed transcript into the emitter, as it comes."""
    transcript = _Transcript(rate)
    async for chunk in stream:
        if timed := transcript.of(chunk):
            emitter.push_timed_transcript(timed)
        if chunk.data:
            emitter.push(chunk.data)


class _Chunked(tts.ChunkedStream):
    """``synthesize``: one whole text, one server stream."""

    def __init__(self, *, tts: ChatTTSStreamTTS, input_text: str, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._owner = tts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        owner = self._owner
        output_emitter.initialize(
            request_id=shortuuid(), sample_rate=owner.sample_rate, num_channels=1, mime_type="audio/pcm"
        )
        await owner._connect(self._conn_options)
        stream: SpeechStream | None = None
        try:
            stream = await owner._open(self._input_text, incremental=False)
            # No flush here: LiveKit ends the segment after _run, marking the last audio final
            # (a flush first would make it append 10 ms of silence as the final frame).
            await _play(stream, output_emitter, owner.sample_rate)
        except ChatTTSStreamError as exc:
            raise api_error(exc) from exc
        finally:
            if stream is not None and not stream.finished:
                await stream.cancel()  # closed early (aclose): the server stops generating


#: The end of a stream's input, in the queue of segments to play.
_END = object()


class _Stream(tts.SynthesizeStream):
    """``stream``: one incremental server stream per LiveKit segment, played in order."""

    def __init__(self, *, tts: ChatTTSStreamTTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._owner = tts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        owner = self._owner
        output_emitter.initialize(
            request_id=shortuuid(),
            sample_rate=owner.sample_rate,
            num_channels=1,
            mime_type="audio/pcm",
            stream=True,
        )
        await owner._connect(self._conn_options)
        # Segments in order: a server stream, or None for a segment with no speakable text. At
        # most two wait (each holds a stream slot of the connection).
        segments: asyncio.Queue[SpeechStream | object | None] = asyncio.Queue(maxsize=2)
        opened: list[SpeechStream] = []

        async def feed() -> None:
            current: SpeechStream | None = None
            blank = ""  # leading whitespace of a segment, kept until it has text
            async for data in self._input_ch:
                if isinstance(data, self._FlushSentinel):
                    if current is not None:
                        await current.end()
                    elif blank:
                        await segments.put(None)  # LiveKit counted it: it gets its (empty) segment
                    current, blank = None, ""
                    continue
                if current is None:
                    if not data.strip():
                        blank += data
                        continue
                    self._mark_started()
                    current = await owner._open(incremental=True)
                    opened.append(current)
                    await segments.put(current)
                    data, blank = blank + data, ""
                await current.append(data)
            if current is not None:
                await current.end()
            await segments.put(_END)

        async def play() -> None:
            while (item := await segments.get()) is not _END:
                output_emitter.start_segment(segment_id=shortuuid())
                if isinstance(item, SpeechStream):
                    await _play(item, output_emitter, owner.sample_rate)
                output_emitter.end_segment()

        tasks = [asyncio.create_task(feed()), asyncio.create_task(play())]
        try:
            await asyncio.gather(*tasks)
        except ChatTTSStreamError as exc:
            raise api_error(exc) from exc
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in opened:
                if not stream.finished:
                    await stream.cancel()  # closed early (aclose, an interruption): the server stops
