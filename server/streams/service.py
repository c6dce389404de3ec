"""The stream-level API every front end shares: admit, open, find, resume, regenerate, sweep.

:class:`SpeechService` checks a :class:`SpeechRequest` (:mod:`server.streams.checks`), splits
its text, builds the stream (encoder, outbox, generation, text input) complete and registers
it. A front end then pulls the stream's items (:meth:`Stream.deliver`); the stream owns its
end and tells the registry when it is freed. Errors are domain errors (``server.errors``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from server.audio.base import FrameEncoder
from server.config import Settings
from server.core.client import EngineClient
from server.core.generation import GenerateRequest, Generation
from server.errors import Draining, RateLimited, UnknownStream
from server.metrics import Metrics
from server.streams.budget import MemoryBudget
from server.streams.cache import ResponseCache, cache_key
from server.streams.checks import PromptBudget, params_with_voice, speakable_segments, stream_encoder
from server.streams.failover import Regeneration, ResumePoint
from server.streams.failover import plan as plan_regeneration
from server.streams.incremental import TextFeed, open_feed
from server.streams.limits import ClientLimiter
from server.streams.outbox import Outbox
from server.streams.pace import Pace
from server.streams.registry import StreamRegistry
from server.streams.request import SpeechRequest
from server.streams.routing import Claims, Router, request_digest
from server.streams.stream import Lease, Stream, StreamState, new_stream_token, redact
from server.streams.timing import SegmentWords
from server.voices.catalog import VoiceCatalog, canonical
from server.voices.library import StoredVoice, VoiceLibrary

log = logging.getLogger(__name__)
SWEEP_INTERVAL_S = 0.5


@dataclasses.dataclass(frozen=True)
class _Who:
    """Whose stream is being opened: the client, its share of the memory budget, its voice."""

    client: str
    charge: Callable[[int], None]
    voice: StoredVoice | None


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
        self.registry = StreamRegistry.for_settings(settings, clock)
        #: Everything buffered for clients; past ``--memory-budget-bytes`` streams are freed.
        self.budget = MemoryBudget(settings.memory_budget_bytes, self.free_over_budget)
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
        #: Every port's one voice list and name resolution (``open`` resolves each request's voice).
        self.catalog = VoiceCatalog(engine, self.voices)
        #: The engine's pace, and how much a listener should buffer (``started``, ``hello``).
        self.pace = Pace(metrics)
        #: Signs tokens with their owner (set once the engine is loaded, with a shared secret).
        self.router: Router | None = None

    # --- admission -------------------------------------------------------------------------

    def check_accepting(self) -> None:
        """Raise ``Draining`` while the server drains."""
        if self.draining:
            raise Draining("the server is draining; reconnect elsewhere")

    def check_rate(self, client: str) -> None:
        """Raise ``RateLimited`` (with ``retry_after_ms``) when ``client`` starts too often."""
        if wait_ms := self.limiter.retry_after_ms(client):
            raise RateLimited("too many streams started; slow down", retry_after_ms=wait_ms)

    def admit(self, client: str) -> None:
        """Refuse while draining, then rate-limit ``client`` (a draining server takes no token).

        For work other than streams (voice uploads); :meth:`open` with ``client`` rate-limits
        a stream itself, spending the token only once the stream exists.
        """
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
        client: str | None = None,
        owner: str | None = None,
        regeneration: Regeneration | None = None,
        token: str | None = None,
    ) -> Stream:
        """Validate ``request``, start generating it (or answer it from the cache), register it.

        ``lease`` is the front end that sends the stream; ``route`` goes into the token.
        ``client`` (its rate-limit identity) is rate-limited: a token is spent only when the
        stream is opened, so a refused request costs none. ``owner`` (the client's tenant;
        None: no tenants) owns the stream: only it may resume it (on any replica: a signed
        token names it), and it speaks only the voices ``owner`` sees. A resumable stream
        without a seed gets one (``stream.seed``), so that another replica can regenerate it.
        ``regeneration``: a stream that was lost elsewhere, started over from a segment (no
        cache then), registered under ``token`` when given.

        Raises:
            ServiceError: ``Draining``, ``RateLimited``, ``InvalidRequest``, ``TextTooLong``,
                ``Unsupported``, ``Overloaded`` or ``EngineUnavailable``; nothing is started then.
        """
        self.check_accepting()
        if client is not None and (wait_ms := self.limiter.wait_ms(client)):
            raise RateLimited("too many streams started; slow down", retry_after_ms=wait_ms)
        cacheable = request.seed is not None and regeneration is None
        if request.seed is None and resumable:  # reported in `started`; never a cache key
            request = dataclasses.replace(request, seed=secrets.randbits(63))
        voice, stored = self.catalog.resolve(request.voice, owner)  # OpenAI's names → seeds
        request = dataclasses.replace(request, voice=voice)
        encoder = self._encoder_for(request)
        s = self.settings
        who = _Who(client or "", self.budget.charger(client or ""), stored)
        outbox = Outbox(
            sample_rate=encoder.sample_rate,
            max_unsent_s=s.max_buffered_s,
            replay_max_s=s.replay_max_s,
            replay_max_bytes=s.replay_max_bytes,
            charge=who.charge,
        )
        generation: Generation | None
        text_feed: TextFeed | None = None
        on_complete: Callable[[Stream], None] | None = None
        if regeneration is not None:
            regeneration.prepare(encoder, outbox)
        if request.incremental:
            generation, text_feed = self._start_incremental(request, who)
        else:
            first = 0 if regeneration is None else regeneration.first_segment
            generation, on_complete = self._start_whole(request, outbox, who, first, cacheable)
        if token is None:
            token = (
                new_stream_token(route) if self.router is None else self.router.mint(request, route, owner)
            )
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
            words=SegmentWords() if request.word_timestamps else None,
            resumable=resumable,
            ttl_s=self.registry.ttl_s,
            on_complete=on_complete,
            on_freed=self.registry.remove,
            on_linger=self.registry.linger,
            clock=self._clock,
            owner=owner,
            client=who.client,
            seed=request.seed,
        )
        self.registry.add(stream)
        if client is not None:
            self.limiter.take(client)
        if generation is not None:
            self._own(asyncio.create_task(stream.run(), name=f"stream-{redact(stream.token)}"))
        return stream

    def _start_whole(
        self, request: SpeechRequest, outbox: Outbox, who: _Who, first: int = 0, cacheable: bool = True
    ) -> tuple[Generation | None, Callable[[Stream], None] | None]:
        """Generate the text from segment ``first`` on, or fill ``outbox`` from the cache (no generation)."""
        segments = self._segments(request)
        cache, key = (self.cache if cacheable else None), None
        if cache is not None:
            digest = who.voice.sample.digest if who.voice is not None else ""
            key = cache_key(request, segments, self._engine_identity, digest)  # None: not reproducible
        on_complete = None
        if cache is not None and key is not None:
            cached = cache.get(key)
            if cached is not None:
                outbox.load(cached.items)  # a hit: every frame is ready now, no model work
                self.metrics.cache_hits.inc()
                return None, None
            self.metrics.cache_misses.inc()
            on_complete = functools.partial(self._store, cache, key)
        params = params_with_voice(request, who.voice)
        generation = self.engine.generate(
            GenerateRequest(
                segments=segments[first:],
                params=params,
                client=who.client,
                on_queued=who.charge,
                first_segment=first,
            )
        )
        return generation, on_complete

    def _encoder_for(self, request: SpeechRequest) -> FrameEncoder:
        # With signed tokens the Ogg serial is the request's, so that a regeneration matches.
        serial = None if self.router is None else int.from_bytes(request_digest(request)[:4])
        return stream_encoder(request, self.settings, self.engine, ogg_serial=serial)

    def _segments(self, request: SpeechRequest) -> tuple[str, ...]:
        return speakable_segments(request.text or "", self.settings.segment_max_chars, self.engine)

    def _start_incremental(self, request: SpeechRequest, who: _Who) -> tuple[Generation, TextFeed]:
        s, params = self.settings, params_with_voice(request, who.voice)
        delay_ms = request.max_buffer_delay_ms
        feed = open_feed(
            lambda first: self.engine.generate(
                GenerateRequest(
                    segments=first, params=params, incremental=True, client=who.client, on_queued=who.charge
                )
            ),
            request.text or "",
            segment_max_chars=s.segment_max_chars,
            max_total_chars=s.max_text_chars,
            max_pending_chars=s.max_pending_chars,
            delay_s=(s.max_buffer_delay_ms if delay_ms is None else delay_ms) / 1000,
            budget=PromptBudget.of(self.engine),
        )
        return feed.generation, feed

    @property
    def _engine_identity(self) -> str:
        """What besides the request decides the audio: the engine, its weights and block schedule."""
        s = self.settings
        return f"{s.engine}|{s.model_dir}|{s.dev_model}|{s.block_schedule}|{s.segment_max_chars}"

    def _store(self, cache: ResponseCache, key: str, stream: Stream) -> None:
        if (items := stream.outbox.snapshot()) is not None:
            cache.put(key, items)
            self.metrics.cache_bytes.set(cache.size)

    # --- resuming, sending, freeing -------------------------------------------------------------------

    def find(self, token: str, owner: str | None = None) -> Stream:
        """The stream behind a resume token, if ``owner`` owns it.

        Raises:
            UnknownStream: no stream with this token is held here for ``owner`` (another
                tenant's stream is answered as one that does not exist).
        """
        stream = self.registry.get(token)
        if stream is None or not stream.resumable or stream.owner != owner:
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
        client: str | None = None,
        owner: str | None = None,
    ) -> tuple[Stream, str | None]:
        """Start again, here, a stream that is gone (``claims``: its verified token) from ``point`` on.

        Returns the new stream, whose items after ``point.after_seq`` equal the lost ones'
        (its index to send from is ``stream.outbox.sent_index``), and why they may differ
        (None: exact). It gets a token of its own, owned here, unless ``token`` is given.
        ``client``, ``owner`` as for :meth:`open`; only the token's tenant may regenerate it.

        Raises:
            UnknownStream: it cannot be regenerated (no seed, incremental, not the token's request).
            ServiceError: as :meth:`open` (draining, overloaded, an unknown voice, ...).
        """
        assert self.router is not None, "regeneration needs signed tokens"
        self.check_accepting()
        request = dataclasses.replace(request, voice=canonical(request.voice))  # as `open` signed it
        regeneration = plan_regeneration(
            request,
            claims,
            point,
            segments=len(self._segments(request)),
            fingerprint=self.router.fingerprint,
            engine=self.engine.info,
            owner=owner,
        )
        stream = self.open(request, lease, regeneration=regeneration, token=token, client=client, owner=owner)
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
        self.registry.sweep(self.settings.replay_total_bytes)
        self.metrics.buffered_bytes.set(self.budget.total)

    def free_over_budget(self) -> None:
        """Past ``--memory-budget-bytes``: free streams until what is buffered fits again.

        :meth:`StreamRegistry.free_for_budget` says which; the client that holds the most pays.
        """
        before = self.budget.total
        freed = self.registry.free_for_budget(self.budget)
        # One line per pass, not per stream: a client that keeps meeting the budget cannot flood the log.
        log.warning(
            "memory budget (--memory-budget-bytes %d) passed: freed %d streams of %s, %d → %d bytes",
            self.budget.limit,
            len(freed),
            ", ".join(sorted({s.client for s in freed})) or "no client",
            before,
            self.budget.total,
        )
        self.metrics.buffered_bytes.set(self.budget.total)

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
