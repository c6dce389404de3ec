"""A pipecat TTS service backed by chattts-stream (``pip install 'chattts-stream-client[pipecat]'``).

pipecat aggregates the LLM's text into sentences and calls :meth:`run_tts`
for each as soon as it is complete; every sentence becomes one stream on the
service's single WebSocket connection (the server batches them with other
work) and its pcm16 chunks go out as ``TTSAudioRawFrame``s while they are
generated. An interruption cancels every stream of the interrupted turn on
the server at once (the engine row is freed), and a lost connection is
resumed by the client without a gap.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from pipecat.frames.frames import CancelFrame, EndFrame, ErrorFrame, Frame, StartFrame, TTSAudioRawFrame
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
            client_options: further :class:`~chattts_stream_client.Client` arguments.
            **kwargs: :class:`~pipecat.services.tts_service.TTSService` arguments.
        """
        kwargs.setdefault("text_aggregation_mode", TextAggregationMode.SENTENCE)
        super().__init__(
            sample_rate=sample_rate,
            push_start_frame=True,
            push_stop_frames=True,
            settings=TTSSettings(model="chattts", voice=voice, language=None),
            **kwargs,
        )
        self._client = Client(url, api_key=api_key, **(client_options or {}))
        self._rate = sample_rate
        self._seed = seed
        self._speed = speed
        self._streams: dict[str, set[SpeechStream]] = {}

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
        await self._client.close()

    async def cancel(self, frame: CancelFrame) -> None:
        """Close the connection (streams still running are cancelled)."""
        await super().cancel(frame)
        await self._client.close()

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Speak one sentence: its chunks become audio frames as they arrive."""
        voice = self._settings.voice if isinstance(self._settings.voice, str) else "default"
        stream = self._client.speak(
            text, voice=voice, sample_rate=self._rate, seed=self._seed, speed=self._speed, format="pcm16"
        )
        self._streams.setdefault(context_id, set()).add(stream)
        try:
            await self.start_tts_usage_metrics(text)
            async for chunk in stream:
                await self.stop_ttfb_metrics()
                if chunk.data:
                    yield TTSAudioRawFrame(chunk.data, self._rate, 1, context_id=context_id)
        except ChatTTSStreamError as exc:
            yield ErrorFrame(error=f"chattts-stream: {exc}")
        finally:
            # Interrupted (the consuming task was cancelled) or failed: stop the server's work.
            if not stream.finished:
                await stream.cancel()
            self._streams.get(context_id, set()).discard(stream)

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        """The user interrupted: cancel the turn's streams on the server now."""
        for stream in list(self._streams.pop(context_id, ())):
            await stream.cancel()
        await super().on_audio_context_interrupted(context_id)
