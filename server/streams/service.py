"""The stream-level API every front end shares: admit, open, find, resume, regenerate, sweep.

:class:`SpeechService` admits a :class:`SpeechRequest` (draining, rate limits), has its
:class:`~server.streams.builder.StreamBuilder` check it and build the stream (encoder, outbox,
generation, text input) complete, registers it and runs it. A front end then pulls the
stream's items (:meth:`Stream.deliver`); the stream owns its end and tells the registry when
it is freed. Errors are domain errors (``server.errors``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from server.config import Settings
from server.core.client import EngineClient
from server.errors import Draining, RateLimited, UnknownStream
from server.metrics import Metrics
from server.streams.budget import MemoryBudget
from server.streams.builder import StreamBuilder
from server.streams.cache import ResponseCache
from server.streams.failover import Regeneration, ResumePoint
from server.streams.failover import plan as plan_regeneration
from server.streams.lifecycle import Lease, StreamState
from server.streams.limits import ClientLimiter
from server.streams.pace import Pace
from server.streams.registry import StreamRegistry
from server.streams.request import SpeechRequest
from server.streams.routing import Claims, Router
from server.streams.stream import Stream
from server.streams.tokens import redact
from server.voices.catalog import VoiceCatalog, canonical
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
        self._builder = StreamBuilder(
            settings,
            engine,
            metrics,
            registry=self.registry,
            budget=self.budget,
            catalog=self.catalog,
            cache=self.cache,
            pool=self._pool,
            clock=clock,
        )

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
        stream, generating = self._builder.build(
            request,
            lease,
            router=self.router,
            route=route,
            resumable=resumable,
            client=client,
            owner=owner,
            regeneration=regeneration,
            token=token,
        )
        self.registry.add(stream)
        if client is not None:
            self.limiter.take(client)
        if generating:
            self._own(asyncio.create_task(stream.run(), name=f"stream-{redact(stream.token)}"))
        return stream

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
            segments=len(self._builder.segments(request)),
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
