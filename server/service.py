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
from server.audio.base import FrameEncoder
from server.cache import ResponseCache, cache_key
from server.config import Settings
from server.engine.base import SynthesisParams
from server.incremental import TextFeed
from server.limits import ClientLimiter
from server.metrics import Metrics
from server.protocol import ProtocolError, Start
from server.scheduler import Scheduler
from server.session import StreamSession, new_stream_token, redact
from server.streams import Stream, StreamRegistry
from server.tags import problem as tag_problem
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
        self.cache = ResponseCache(settings.cache_bytes) if settings.cache_bytes > 0 else None
        self.limiter = ClientLimiter(
            streams_per_minute=settings.rate_limit_per_min,
            burst=settings.rate_limit_burst,
            max_connections=settings.max_connections_per_client,
        )

    @property
    def engine_identity(self) -> str:
        """What besides the request decides the audio: the engine, its weights and block schedule."""
        s = self.settings
        return f"{s.engine}|{s.model_dir}|{s.dev_model}|{s.block_schedule}|{s.segment_max_chars}"

    def check_accepting(self, stream_id: str | None) -> None:
        """Raise ``shutting_down`` while the server drains."""
        if self.draining:
            raise ProtocolError(
                "shutting_down", "the server is draining; reconnect elsewhere", stream_id=stream_id
            )

    def check_rate(self, client: str, stream_id: str | None) -> None:
        """Raise ``rate_limited`` (with ``retry_after_ms``) when ``client`` starts too often."""
        wait_ms = self.limiter.retry_after_ms(client)
        if wait_ms:
            raise ProtocolError(
                "rate_limited",
                "too many streams started; slow down",
                stream_id=stream_id,
                retry_after_ms=wait_ms,
            )

    def open(
        self, msg: Start, owner: object, on_overflow: Callable[[Stream], None], *, route: str | None = None
    ) -> Stream:
        """Validate ``msg``, submit it to the scheduler (or answer it from the cache), register it.

        Raises:
            ProtocolError: with the wire code (``shutting_down``, ``text_too_long``,
                ``unsupported``, ``bad_request``, ``overloaded``).
        """
        self.check_accepting(msg.id)
        encoder = self._encoder_for(msg)
        segments, feed = self._plan_text(msg)
        s = self.settings
        session = StreamSession(
            client_id=msg.id,
            fmt=encoder.format,
            sample_rate=encoder.sample_rate,
            max_unsent_s=s.max_buffered_s,
            replay_max_s=s.replay_max_s,
            replay_max_bytes=s.replay_max_bytes,
            token=new_stream_token(route),
        )
        stream = Stream(session, encoder, pool=self.encode_pool, on_overflow=on_overflow)
        key = cache_key(msg, segments, self.engine_identity) if self.cache is not None else None
        cached = self.cache.get(key) if self.cache is not None and key is not None else None
        if cached is not None:
            session.load(cached.items)  # a hit: every frame is ready now, no model work
            self.metrics.cache_hits.inc()
        else:
            if key is not None:
                self.metrics.cache_misses.inc()
                stream.on_complete = lambda done: self._store(key, done)
            try:
                stream.handle = self.scheduler.submit(
                    segments, params_of(msg), stream.feed, incremental=msg.incremental
                )
            except ProtocolError as err:  # overloaded, breaker open: name the stream it concerns
                err.stream_id = msg.id
                raise
            if feed is not None:
                feed.handle = stream.handle
                stream.text_feed = feed
        self.registry.add(stream, owner)
        self.metrics.active_streams.set(self.registry.active)
        return stream

    def _encoder_for(self, msg: Start) -> FrameEncoder:
        """The stream's encoder; checks text size, format, rate and voice first."""
        limit = self.settings.max_text_chars
        if msg.text is None and not msg.incremental:
            raise ProtocolError("bad_request", "missing field `text`", stream_id=msg.id)
        if msg.text is not None and len(msg.text) > limit:
            raise ProtocolError(
                "text_too_long",
                f"text has {len(msg.text)} characters; the limit is {limit}",
                stream_id=msg.id,
            )
        try:
            s = self.settings
            encoder = make_encoder(
                msg.format,
                msg.sample_rate,
                opus_bitrate=s.opus_bitrate,
                opus_complexity=s.opus_complexity,
                ogg_page_ms=s.ogg_page_ms,
                mp3_bitrate=s.mp3_bitrate,
            )
        except (UnsupportedAudio, ValueError) as exc:
            raise ProtocolError("unsupported", str(exc), stream_id=msg.id) from None
        if not self.scheduler.validate_voice(msg.voice):
            raise ProtocolError("unsupported", f"unknown voice {msg.voice!r}", stream_id=msg.id)
        return encoder

    def _plan_text(self, msg: Start) -> tuple[list[str], TextFeed | None]:
        """The segments to submit now, and the text feed of an incremental stream."""
        s = self.settings
        if not msg.incremental:
            text = msg.text or ""
            if (problem := tag_problem(text)) is not None:
                raise ProtocolError("bad_request", problem, stream_id=msg.id)
            segments = [
                seg for seg in split_segments(text, max_chars=s.segment_max_chars) if has_speakable(seg)
            ]
            if not segments:
                raise ProtocolError("bad_request", "text has nothing to speak", stream_id=msg.id)
            return segments, None
        delay_ms = s.max_buffer_delay_ms if msg.max_buffer_delay_ms is None else msg.max_buffer_delay_ms
        feed = TextFeed(
            stream_id=msg.id,
            max_segment_chars=s.segment_max_chars,
            max_total_chars=s.max_text_chars,
            max_pending_chars=s.max_pending_chars,
            delay_s=delay_ms / 1000,
        )
        return feed.first(msg.text or ""), feed

    def delivered(self, stream: Stream) -> None:
        """A stream's ``done`` was sent: count it, keep it briefly for a late resume."""
        self.metrics.streams_total.labels(reason=stream.session.done_reason or "error").inc()
        if self.registry.ttl_s <= 0:
            self.registry.remove(stream)
        else:
            self.registry.linger(stream)
        self.metrics.active_streams.set(self.registry.active)

    def _store(self, key: str, stream: Stream) -> None:
        items = stream.session.snapshot()
        if self.cache is not None and items is not None:
            self.cache.put(key, items)
            self.metrics.cache_bytes.set(self.cache.size)

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
