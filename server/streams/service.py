"""The stream-level API every front end shares: admit, open, find, resume, abandon, sweep.

:class:`SpeechService` validates a :class:`SpeechRequest`, splits its text,
builds the stream (encoder, outbox, generation, text input) complete, and
registers it for resume. A front end then pulls the stream's items itself
(:meth:`Stream.deliver`); the stream owns its end (delivered, expired, closed)
and tells the registry when it is freed. Errors are domain errors
(``server.errors``); each front end maps them to its own wire codes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from server.audio import UnsupportedAudio, make_encoder
from server.audio.base import FrameEncoder
from server.config import Settings
from server.core.client import EngineClient, GenerateRequest, Generation
from server.engine_api import SynthesisParams
from server.errors import Draining, InvalidRequest, RateLimited, TextTooLong, UnknownStream, Unsupported
from server.metrics import Metrics
from server.streams.cache import ResponseCache, cache_key
from server.streams.failover import Regeneration, ResumePoint
from server.streams.failover import plan as plan_regeneration
from server.streams.incremental import TextFeed
from server.streams.limits import ClientLimiter
from server.streams.outbox import Outbox
from server.streams.registry import StreamRegistry
from server.streams.request import SpeechRequest
from server.streams.routing import Claims, Router, request_digest
from server.streams.stream import Lease, Stream, StreamState, new_stream_token, redact
from server.text.segments import TextBuffer, has_speakable, split_segments
from server.text.tags import problem as tag_problem
from server.text.tags import refine_prompt_problem
from server.voices.library import VoiceLibrary

log = logging.getLogger(__name__)
SWEEP_INTERVAL_S = 0.5


class SpeechService:
    """Streams over the engine client, shared by every front end."""

    def __init__(
        self,
        settings: Settings,
        engine: EngineClient,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self._clock = clock
        self.registry = StreamRegistry(ttl_s=settings.resume_ttl_s, clock=clock)
        #: SIGTERM was received: new streams are refused with ``Draining``.
        self.draining = False
        # Opus/Ogg encoding runs here so the event loop never waits for libopus.
        self._pool = ThreadPoolExecutor(max_workers=settings.encode_threads, thread_name_prefix="encode")
        self._tasks: set[asyncio.Task[None]] = set()  # one per generating stream, and the sweeper
        self.cache = ResponseCache(settings.cache_bytes) if settings.cache_bytes > 0 else None
        self.limiter = ClientLimiter(
            streams_per_minute=settings.rate_limit_per_min,
            burst=settings.rate_limit_burst,
            max_connections=settings.max_connections_per_client,
        )
        #: Voices made from recordings (``POST /v1/audio/voices``), by id.
        self.voices = VoiceLibrary(settings, engine)
        #: Signs tokens with their owner (set once the engine is loaded, with a shared secret).
        self.router: Router | None = None

    def voice_names(self) -> tuple[str, ...]:
        """Every voice name a stream may use: the engine's, then those made from recordings."""
        return (*self.engine.info.voices, *(v.id for v in self.voices.all()))

    # --- admission -------------------------------------------------------------------------

    def check_accepting(self) -> None:
        """Raise ``Draining`` while the server drains."""
        if self.draining:
            raise Draining("the server is draining; reconnect elsewhere")

    def check_rate(self, client: str) -> None:
        """Raise ``RateLimited`` (with ``retry_after_ms``) when ``client`` starts too often."""
        wait_ms = self.limiter.retry_after_ms(client)
        if wait_ms:
            raise RateLimited("too many streams started; slow down", retry_after_ms=wait_ms)

    def admit(self, client: str) -> None:
        """Refuse while draining, then rate-limit ``client`` (a draining server takes no token)."""
        self.check_accepting()
        self.check_rate(client)

    # --- opening -------------------------------------------------------------------------------

    def open(
        self,
        request: SpeechRequest,
        lease: Lease,
        *,
        route: str | None = None,
        resumable: bool = True,
        regeneration: Regeneration | None = None,
        token: str | None = None,
    ) -> Stream:
        """Validate ``request``, start generating it (or answer it from the cache), register it.

        ``lease`` is the front end that sends the stream; ``route`` goes into the token. A
        resumable stream without a seed gets one (``stream.seed``), so that another replica
        can regenerate it. ``regeneration``: a stream that was lost elsewhere, started over
        from a segment (no cache then), registered under ``token`` when given.

        Raises:
            ServiceError: ``Draining``, ``InvalidRequest``, ``TextTooLong``, ``Unsupported``,
                ``Overloaded`` or ``EngineUnavailable``; nothing is started then.
        """
        self.check_accepting()
        cacheable = request.seed is not None and regeneration is None
        if request.seed is None and resumable:  # reported in `started`; never a cache key
            request = dataclasses.replace(request, seed=secrets.randbits(63))
        encoder = self._encoder_for(request)
        s = self.settings
        outbox = Outbox(
            sample_rate=encoder.sample_rate,
            max_unsent_s=s.max_buffered_s,
            replay_max_s=s.replay_max_s,
            replay_max_bytes=s.replay_max_bytes,
        )
        generation: Generation | None
        text_feed: TextFeed | None = None
        on_complete: Callable[[Stream], None] | None = None
        if regeneration is not None:
            regeneration.prepare(encoder, outbox)
        if request.incremental:
            generation, text_feed = self._start_incremental(request)
        else:
            first = 0 if regeneration is None else regeneration.first_segment
            generation, on_complete = self._start_whole(request, outbox, first, cacheable)
        if token is None:
            token = new_stream_token(route) if self.router is None else self.router.mint(request, route)
        stream = Stream(
            name=request.name,
            token=token,
            encoder=encoder,
            outbox=outbox,
            lease=lease,
            metrics=self.metrics,
            pool=self._pool,
            generation=generation,
            text=text_feed,
            resumable=resumable,
            ttl_s=self.registry.ttl_s,
            on_complete=on_complete,
            on_freed=self.registry.remove,
            clock=self._clock,
            seed=request.seed,
        )
        self.registry.add(stream)
        if generation is not None:
            self._own(asyncio.create_task(stream.run(), name=f"stream-{redact(stream.token)}"))
        return stream

    def _start_whole(
        self, request: SpeechRequest, outbox: Outbox, first: int = 0, cacheable: bool = True
    ) -> tuple[Generation | None, Callable[[Stream], None] | None]:
        """Generate the text from segment ``first`` on, or fill ``outbox`` from the cache (no generation)."""
        segments = self._segments(request)
        cache, key = (self.cache if cacheable else None), None
        if cache is not None:
            stored = self.voices.get(request.voice)
            digest = stored.sample.digest if stored is not None else ""
            key = cache_key(request, segments, self._engine_identity, digest)  # None: not reproducible
        on_complete = None
        if cache is not None and key is not None:
            cached = cache.get(key)
            if cached is not None:
                outbox.load(cached.items)  # a hit: every frame is ready now, no model work
                self.metrics.cache_hits.inc()
                return None, None
            self.metrics.cache_misses.inc()
            on_complete = self._storer(cache, key)
        generation = self.engine.generate(
            GenerateRequest(segments=segments[first:], params=self._params(request), first_segment=first)
        )
        return generation, on_complete

    def _encoder_for(self, request: SpeechRequest) -> FrameEncoder:
        """The stream's encoder; checks text size, control tags, format, rate and voice first."""
        limit = self.settings.max_text_chars
        if request.text is None and not request.incremental:
            raise InvalidRequest("missing field `text`")
        if request.text is not None and len(request.text) > limit:
            raise TextTooLong(f"text has {len(request.text)} characters; the limit is {limit}")
        # An incremental stream's first text may end inside a tag that a later append closes.
        if (problem := tag_problem(request.text or "", open_end=request.incremental)) is not None:
            raise InvalidRequest(problem)
        s = self.settings
        try:
            encoder = make_encoder(
                request.format,
                request.sample_rate,
                opus_bitrate=s.opus_bitrate,
                opus_complexity=s.opus_complexity,
                ogg_page_ms=s.ogg_page_ms,
                mp3_bitrate=s.mp3_bitrate,
                # With signed tokens the Ogg serial is the request's, so a regeneration matches.
                ogg_serial=None if self.router is None else int.from_bytes(request_digest(request)[:4]),
            )
        except (UnsupportedAudio, ValueError) as exc:
            raise Unsupported(str(exc)) from None
        if self.voices.get(request.voice) is None and not self.engine.validate_voice(request.voice):
            raise Unsupported(f"unknown voice {request.voice!r}")
        if request.refine and not self.engine.info.refine:
            raise Unsupported("refinement is off on this server (--refine-max-tokens 0)")
        if (problem := refine_prompt_problem(request.refine_prompt)) is not None:
            raise InvalidRequest(problem)
        return encoder

    def _params(self, request: SpeechRequest) -> SynthesisParams:
        """The request's synthesis parameters; a voice from a recording travels with them."""
        stored = self.voices.get(request.voice)
        if stored is None:
            return request.params
        return dataclasses.replace(request.params, reference=stored.sample)

    def _segments(self, request: SpeechRequest) -> tuple[str, ...]:
        max_chars = self.settings.segment_max_chars
        text = request.text or ""
        segments = tuple(seg for seg in split_segments(text, max_chars=max_chars) if has_speakable(seg))
        if not segments:
            raise InvalidRequest(
                "text has nothing to speak (ChatTTS speaks Chinese and English; "
                "other scripts, emoji and punctuation are skipped)"
            )
        return segments

    def _start_incremental(self, request: SpeechRequest) -> tuple[Generation, TextFeed]:
        s = self.settings
        text = request.text or ""
        buffer = TextBuffer(max_chars=s.segment_max_chars)
        first = tuple(buffer.append(text))
        generation = self.engine.generate(
            GenerateRequest(segments=first, params=self._params(request), incremental=True)
        )
        delay_ms = (
            s.max_buffer_delay_ms if request.max_buffer_delay_ms is None else request.max_buffer_delay_ms
        )
        feed = TextFeed(
            generation,
            buffer,
            total_chars=len(text),
            max_total_chars=s.max_text_chars,
            max_pending_chars=s.max_pending_chars,
            delay_s=delay_ms / 1000,
        )
        return generation, feed

    @property
    def _engine_identity(self) -> str:
        """What besides the request decides the audio: the engine, its weights and block schedule."""
        s = self.settings
        return f"{s.engine}|{s.model_dir}|{s.dev_model}|{s.block_schedule}|{s.segment_max_chars}"

    def _storer(self, cache: ResponseCache, key: str) -> Callable[[Stream], None]:
        def store(stream: Stream) -> None:
            items = stream.outbox.snapshot()
            if items is not None:
                cache.put(key, items)
                self.metrics.cache_bytes.set(cache.size)

        return store

    # --- resuming, sending, freeing -------------------------------------------------------------------

    def find(self, token: str) -> Stream:
        """The stream behind a resume token.

        Raises:
            UnknownStream: no stream with this token is held here.
        """
        stream = self.registry.get(token)
        if stream is None or not stream.resumable:
            raise UnknownStream("no stream with this token is held here")
        return stream

    def regenerate(
        self,
        claims: Claims,
        request: SpeechRequest,
        point: ResumePoint,
        lease: Lease,
        *,
        token: str | None = None,
    ) -> tuple[Stream, str | None]:
        """Start again, here, a stream that is gone (``claims``: its verified token) from ``point`` on.

        Returns the new stream, whose items after ``point.after_seq`` equal the lost ones'
        (its index to send from is ``stream.outbox.sent_index``), and why they may differ
        (None: exact). It gets a token of its own, owned here, unless ``token`` is given.

        Raises:
            UnknownStream: it cannot be regenerated (no seed, incremental, not the token's request).
            ServiceError: as :meth:`open` (draining, overloaded, an unknown voice, ...).
        """
        assert self.router is not None, "regeneration needs signed tokens"
        self.check_accepting()
        regeneration = plan_regeneration(
            request,
            claims,
            point,
            segments=len(self._segments(request)),
            fingerprint=self.router.fingerprint,
            engine=self.engine.info,
        )
        stream = self.open(request, lease, regeneration=regeneration, token=token)
        log.info(
            "stream %s regenerated from segment %d after seq %d%s",
            redact(stream.token),
            regeneration.first_segment,
            point.after_seq,
            "" if regeneration.degraded is None else f" (degraded: {regeneration.degraded})",
        )
        return stream, regeneration.degraded

    def resume(self, stream: Stream, after_seq: int, lease: Lease) -> int:
        """Move ``stream`` to ``lease`` and rewind it; returns the outbox index to send from.

        Raises:
            ResumeExpired: items after ``after_seq`` were evicted (nothing changed then).
        """
        stream.outbox.check_resumable(after_seq)
        stream.attach(lease)
        index = stream.outbox.rewind_to(after_seq)
        log.info("stream %s resumed after seq %d", redact(stream.token), after_seq)
        return index

    def abandon(self, stream: Stream) -> None:
        """A front end that cannot resume (HTTP) is done with the stream, delivered or not: free it."""
        if stream.state not in (StreamState.EXPIRED, StreamState.CLOSED):
            stream.close(stream.outbox.done_reason or "cancelled")

    # --- the TTL sweeper and shutdown ----------------------------------------------------------------

    def start(self) -> None:
        """Start expiring detached streams."""
        self._own(asyncio.create_task(self._sweep_forever(), name="resume-ttl-sweeper"))

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.sweep()

    def sweep(self) -> None:
        """Free every stream whose TTL has passed, then delivered ones over the replay budget."""
        for stream in self.registry.expired():
            if stream.state is StreamState.DETACHED:
                stream.expire()
            else:
                stream.close()
        for stream in self.registry.over_budget(self.settings.replay_total_bytes):
            stream.close()

    async def stop(self) -> None:
        """Free every stream, stop the sweeper and the streams' tasks, stop the encoder threads."""
        for stream in self.registry.all():
            stream.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _own(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())
