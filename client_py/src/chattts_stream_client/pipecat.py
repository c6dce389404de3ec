"""A pipecat TTS service backed by chattts-stream (``pip install 'chattts-stream-client[pipecat]'``).

Each LLM turn is one incremental stream on the service's single WebSocket
connection: pipecat hands over the LLM's tokens as they arrive
(:meth:`run_tts`), each is ``append``ed, and the server speaks each sentence
as soon as it is complete (one voice, one continuous timeline for the whole
answer); the turn's end (:meth:`flush_audio`) is the stream's ``end``. The
turn's pcm16 chunks go into its audio context as ``TTSAudioRawFrame``s while
they are generated, from one reader task per turn. An interruption cancels
the turn's stream on the server at once (the engine row is freed), and a
lost connection is resumed by the client without a gap or lost text. Each word's
time comes from the server (``word_timestamps``) and goes to pipecat's
``add_word_timestamps``, so the turn's text frames follow the voice and an
interrupted turn keeps only the words that were spoken.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    ErrorFrame,
    Frame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
)
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TextAggregationMode, TTSService

from chattts_stream_client.client import Client
from chattts_stream_client.errors import ChatTTSStreamError
from chattts_stream_client.stream import SpeechStream


class ChatTTSStreamTTSService(TTSService):
    """Speaks pipecat text through a chattts-stream server, streaming audio as it is generated."""

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
        word_timestamps: bool = True,
        client_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Create the service (it connects when the pipeline starts).

        Args:
            url: the server's WebSocket URL, ``ws://host:8080/v1/stream``.
            api_key: the server's API key, when it wants one.
            voice: ``default``, ``seed:<int>``, a named voice or a speaker string.
            sample_rate: 8000, 16000, 24000 (native) or 48000; pcm16 at this rate.
            seed: fixed seed for reproducible audio (None: random sampling).
            speed: 0.5 to 2.0.
            max_buffer_delay_ms: speak a clause after this long without text (None: the
                server's default).
            word_timestamps: report each word's time (``add_word_timestamps``), so that the
                turn's text frames follow the voice and an interrupted turn keeps only the
                words spoken; False: pipecat pushes the text itself, untimed.
            client_options: further :class:`~chattts_stream_client.Client` arguments.
            **kwargs: :class:`~pipecat.services.tts_service.TTSService` arguments.
        """
        # The server finds the sentences itself: the LLM's tokens go to it as they come.
        kwargs.setdefault("text_aggregation_mode", TextAggregationMode.TOKEN)
        super().__init__(
            sample_rate=sample_rate,
            push_start_frame=True,
            push_stop_frames=True,
            # With word times, the text frames are ours (timed); pipecat must not push its own.
            push_text_frames=not word_timestamps,
            settings=TTSSettings(model="chattts", voice=voice, language=None),
            **kwargs,
        )
        self._client = Client(url, api_key=api_key, **(client_options or {}))
        self._rate = sample_rate
        self._seed = seed
        self._speed = speed
        self._max_buffer_delay_ms = max_buffer_delay_ms
        self._word_timestamps = word_timestamps
        self._turns: dict[str, _Turn] = {}

    @property
    def client(self) -> Client:
        """The chattts-stream client this service speaks through."""
        return self._client

    def can_generate_metrics(self) -> bool:
        """Time to first byte and usage metrics are reported."""
        return True

    async def start(self, frame: StartFrame) -> None:
        """Connect to the server as the pipeline starts."""
        await super().start(frame)
        await self._client.connect()

    async def stop(self, frame: EndFrame) -> None:
        """Close the connection (streams still running are cancelled)."""
        await super().stop(frame)
        await self._close_all()

    async def cancel(self, frame: CancelFrame) -> None:
        """Close the connection (streams still running are cancelled)."""
        await super().cancel(frame)
        await self._close_all()

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Append the LLM's text to its turn's stream (opened with the turn's first text).

        The audio arrives through the turn's reader task, not from here (hence ``None``).
        """
        turn = self._turns.get(context_id)
        try:
            if turn is None:
                turn = await self._open_turn(context_id)
            await turn.stream.append(text)
        except ChatTTSStreamError as exc:
            yield ErrorFrame(error=f"chattts-stream: {exc}")
            return
        await self.start_tts_usage_metrics(text)
        yield None

    async def flush_audio(self, context_id: str | None = None) -> None:
        """The turn's text is complete: end its stream (the rest is spoken, then it finishes)."""
        turn = self._turns.get(context_id or "")
        if turn is not None and not turn.stream.finished:
            with contextlib.suppress(ChatTTSStreamError, RuntimeError):
                await turn.stream.end()

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        """The user interrupted: cancel the turn's stream on the server now (its row is freed)."""
        await self._close_turn(context_id)
        await super().on_audio_context_interrupted(context_id)

    async def _open_turn(self, context_id: str) -> _Turn:
        voice = self._settings.voice if isinstance(self._settings.voice, str) else "default"
        stream = await self._client.open_stream(
            voice=voice,
            sample_rate=self._rate,
            seed=self._seed,
            format="pcm16",
            max_buffer_delay_ms=self._max_buffer_delay_ms,
            speed=self._speed,  # a start field (None: left out)
            word_timestamps=self._word_timestamps or None,
        )
        # Owned by pipecat's task manager (which reports its failures), cancelled in _close_turn.
        turn = _Turn(stream, self.create_task(self._play(stream, context_id), f"turn-{context_id}"))
        self._turns[context_id] = turn
        return turn

    async def _play(self, stream: SpeechStream, context_id: str) -> None:
        """The turn's audio into its audio context as it comes, then the context's end."""
        try:
            async for chunk in stream:
                if chunk.words:  # seconds from the turn's first sample: pipecat's word clock
                    times = [(w.text, w.start / self._rate) for w in chunk.words]
                    await self.add_word_timestamps(times, context_id)
                if chunk.data:
                    frame = TTSAudioRawFrame(chunk.data, self._rate, 1, context_id=context_id)
                    await self.append_to_audio_context(context_id, frame)
        except ChatTTSStreamError as exc:
            await self.append_to_audio_context(context_id, ErrorFrame(error=f"chattts-stream: {exc}"))
        finally:
            if self._turns.get(context_id) is not None and self._turns[context_id].stream is stream:
                del self._turns[context_id]
        await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
        await self.remove_audio_context(context_id)

    async def _close_turn(self, context_id: str) -> None:
        turn = self._turns.pop(context_id, None)
        if turn is None:
            return
        await turn.stream.cancel()
        await self.cancel_task(turn.reader)

    async def _close_all(self) -> None:
        for context_id in list(self._turns):
            await self._close_turn(context_id)
        await self._client.close()


@dataclass(frozen=True)
class _Turn:
    """One LLM turn: its incremental stream on the server and the task playing its audio."""

    stream: SpeechStream
    reader: asyncio.Task[None]
