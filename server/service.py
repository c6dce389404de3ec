"""Opening, finding and expiring streams: what the WebSocket and HTTP front ends share.

:class:`SpeechService` validates a ``start`` request, splits its text,
builds the stream's session and encoder, submits it to the scheduler and
registers it for resume. Front ends (``connection.py``, the HTTP speech
endpoint) only translate their wire format to a :class:`~server.protocol.Start`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from server.audio import UnsupportedAudio, make_encoder
from server.config import Settings
from server.engine.base import SynthesisParams
from server.incremental import TextFeed
from server.metrics import Metrics
from server.protocol import ProtocolError, Start
from server.scheduler import Scheduler
from server.session import StreamSession, redact
from server.streams import Stream, StreamRegistry
from server.text import has_speakable, split_segments

log = logging.getLogger(__name__)
SWEEP_INTERVAL_S = 0.5


class SpeechService:
    """The stream-level API over the scheduler, shared by every front end."""

    def __init__(self, settings: Settings, scheduler: Scheduler, metrics: Metrics) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.metrics = metrics
        self.registry = StreamRegistry(ttl_s=settings.resume_ttl_s)
        # Opus/Ogg encoding runs here so the event loop never waits for libopus.
        self.encode_pool = ThreadPoolExecutor(
            max_workers=settings.encode_threads, thread_name_prefix="encode"
        )
        self.draining = False
        self._sweeper: asyncio.Task[None] | None = None

    def open(self, msg: Start, owner: object, on_overflow: Callable[[Stream], None]) -> Stream:
        """Validate ``msg``, submit it to the scheduler and register the stream.

        Raises:
            ProtocolError: with the wire code (``shutting_down``, ``text_too_long``,
                ``unsupported``, ``bad_request``, ``overloaded``).
        """
        s = self.settings
        sid = msg.id
        if self.draining:
            raise ProtocolError("shutting_down", "the server is draining; reconnect elsewhere", stream_id=sid)
        if msg.text is None and not msg.incremental:
            raise ProtocolError("bad_request", "missing field `text`", stream_id=sid)
        if msg.text is not None and len(msg.text) > s.max_text_chars:
            raise ProtocolError(
                "text_too_long",
                f"text has {len(msg.text)} characters; the limit is {s.max_text_chars}",
                stream_id=sid,
            )
        try:
            encoder = make_encoder(msg.format, msg.sample_rate)
        except (UnsupportedAudio, ValueError) as exc:
            raise ProtocolError("unsupported", str(exc), stream_id=sid) from None
        if not self.scheduler.validate_voice(msg.voice):
            raise ProtocolError("unsupported", f"unknown voice {msg.voice!r}", stream_id=sid)
        feed = None
        if msg.incremental:
            delay_ms = s.max_buffer_delay_ms if msg.max_buffer_delay_ms is None else msg.max_buffer_delay_ms
            feed = TextFeed(
                stream_id=sid,
                max_segment_chars=s.segment_max_chars,
                max_total_chars=s.max_text_chars,
                max_pending_chars=s.max_pending_chars,
                delay_s=delay_ms / 1000,
            )
            segments = feed.first(msg.text or "")
        else:
            text = msg.text or ""
            segments = [
                seg for seg in split_segments(text, max_chars=s.segment_max_chars) if has_speakable(seg)
            ]
            if not segments:
                raise ProtocolError("bad_request", "text has nothing to speak", stream_id=sid)
        session = StreamSession(
            client_id=sid,
            fmt=encoder.format,
            sample_rate=encoder.sample_rate,
            max_unsent_s=s.max_buffered_s,
            replay_max_s=s.replay_max_s,
            replay_max_bytes=s.replay_max_bytes,
        )
        stream = Stream(session, encoder, pool=self.encode_pool, on_overflow=on_overflow)
        stream.handle = self.scheduler.submit(
            segments, params_of(msg), stream.feed, incremental=msg.incremental
        )
        if feed is not None:
            feed.handle = stream.handle
            stream.text_feed = feed
        self.registry.add(stream, owner)
        self.metrics.active_streams.set(self.registry.active)
        return stream

    def delivered(self, stream: Stream) -> None:
        """A stream's ``done`` was sent: count it, keep it briefly for a late resume."""
        self.metrics.streams_total.labels(reason=stream.session.done_reason or "error").inc()
        if self.registry.ttl_s <= 0:
            self.registry.remove(stream)
        else:
            self.registry.linger(stream)
        self.metrics.active_streams.set(self.registry.active)

    async def forget(self, stream: Stream) -> None:
        """Stop a stream's work and drop it from the registry."""
        self.registry.remove(stream)
        self.metrics.active_streams.set(self.registry.active)
        if not stream.delivered:
            self.metrics.streams_total.labels(reason="expired").inc()
        await stream.aclose()

    # --- the TTL sweeper -------------------------------------------------------

    def start(self) -> None:
        """Start expiring detached streams."""
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="resume-ttl-sweeper")

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            await self.sweep()

    async def sweep(self) -> None:
        """Cancel and free every detached stream whose resume TTL has passed."""
        for stream in self.registry.expired():
            if not stream.delivered:
                log.info(
                    "stream %s expired: not resumed within %.0f s", redact(stream.token), self.registry.ttl_s
                )
            await self.forget(stream)
        for stream in self.registry.over_budget(self.settings.replay_total_bytes):
            await self.forget(stream)

    async def stop(self) -> None:
        """Stop the sweeper, free every stream, stop the encoder threads."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for stream in self.registry.all():
            await self.forget(stream)
        self.encode_pool.shutdown(wait=True, cancel_futures=True)


def params_of(msg: Start) -> SynthesisParams:
    """Synthesis parameters of a ``start``; unset sampling controls keep the model's defaults."""
    defaults = SynthesisParams()
    return SynthesisParams(
        voice=msg.voice,
        speed=msg.speed,
        seed=msg.seed,
        temperature=defaults.temperature if msg.temperature is None else msg.temperature,
        top_p=defaults.top_p if msg.top_p is None else msg.top_p,
        top_k=defaults.top_k if msg.top_k is None else msg.top_k,
    )
