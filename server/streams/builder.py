"""A stream built complete from a request: its seed and voice, encoder, outbox, generation, text input.

:class:`StreamBuilder` is :class:`~server.streams.service.SpeechService`'s opening half:
it completes the request (a seed for a resumable stream, the voice name resolved), checks it
(:mod:`server.streams.checks`), splits its text, answers it from the cache or starts its
generation (whole, incremental, or a regeneration from a segment on) and builds the
:class:`~server.streams.stream.Stream`, token and all. Admission, registration and the
stream's task are the service's. Errors are domain errors (``server.errors``), raised before
anything is started.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
from collections.abc import Callable
from concurrent.futures import Executor

from server.audio.base import FrameEncoder
from server.config import Settings
from server.core.client import EngineClient
from server.core.generation import GenerateRequest, Generation
from server.metrics import Metrics
from server.streams.budget import MemoryBudget
from server.streams.cache import ResponseCache, cache_key
from server.streams.checks import PromptBudget, params_with_voice, speakable_segments, stream_encoder
from server.streams.failover import Regeneration
from server.streams.incremental import TextFeed, open_feed
from server.streams.lifecycle import Lease
from server.streams.outbox import Outbox
from server.streams.registry import StreamRegistry
from server.streams.request import SpeechRequest
from server.streams.routing import Router, request_digest
from server.streams.stream import Stream
from server.streams.timing import SegmentWords
from server.streams.tokens import new_stream_token
from server.voices.catalog import VoiceCatalog
from server.voices.library import StoredVoice


@dataclasses.dataclass(frozen=True)
class _Who:
    """Whose stream is being opened: the client, its share of the memory budget, its voice."""

    client: str
    charge: Callable[[int], None]
    voice: StoredVoice | None


class StreamBuilder:
    """Builds the service's streams: over its engine, settings, cache, encoder pool and registry."""

    def __init__(
        self,
        settings: Settings,
        engine: EngineClient,
        metrics: Metrics,
        *,
        registry: StreamRegistry,
        budget: MemoryBudget,
        catalog: VoiceCatalog,
        cache: ResponseCache | None,
        pool: Executor,
        clock: Callable[[], float],
    ) -> None:
        self._settings = settings
        self._engine = engine
        self._metrics = metrics
        self._registry = registry
        self._budget = budget
        self._catalog = catalog
        self._cache = cache
        self._pool = pool
        self._clock = clock

    def build(
        self,
        request: SpeechRequest,
        lease: Lease,
        *,
        router: Router | None,
        route: str | None,
        resumable: bool,
        client: str | None,
        owner: str | None,
        regeneration: Regeneration | None,
        token: str | None,
    ) -> tuple[Stream, bool]:
        """The stream for ``request``, generating or answered from the cache, not registered yet.

        Returns the stream and whether it generates (False: a cache hit, every frame in its
        outbox already). The arguments are :meth:`SpeechService.open
        <server.streams.service.SpeechService.open>`'s; ``router`` (None: unsigned tokens) signs
        the token and picks the Ogg serial.

        Raises:
            ServiceError: ``InvalidRequest``, ``TextTooLong``, ``Unsupported``, ``Overloaded``
                or ``EngineUnavailable``; nothing is started then.
        """
        cacheable = request.seed is not None and regeneration is None
        if request.seed is None and resumable:  # reported in `started`; never a cache key
            request = dataclasses.replace(request, seed=secrets.randbits(63))
        voice, stored = self._catalog.resolve(request.voice, owner)  # OpenAI's names → seeds
        request = dataclasses.replace(request, voice=voice)
        encoder = self._encoder_for(request, router)
        s = self._settings
        who = _Who(client or "", self._budget.charger(client or ""), stored)
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
            token = new_stream_token(route) if router is None else router.mint(request, route, owner)
        stream = Stream(
            name=request.name,
            token=token,
            encoder=encoder,
            outbox=outbox,
            lease=lease,
            metrics=self._metrics,
            pool=self._pool,
            generation=generation,
            text=text_feed,
            words=SegmentWords() if request.word_timestamps else None,
            resumable=resumable,
            ttl_s=self._registry.ttl_s,
            on_complete=on_complete,
            on_freed=self._registry.remove,
            on_linger=self._registry.linger,
            clock=self._clock,
            owner=owner,
            client=who.client,
            seed=request.seed,
        )
        return stream, generation is not None

    def segments(self, request: SpeechRequest) -> tuple[str, ...]:
        """``request``'s text in the segments the engine is asked to speak (``InvalidRequest``: none)."""
        return speakable_segments(request.text or "", self._settings.segment_max_chars, self._engine)

    def _start_whole(
        self, request: SpeechRequest, outbox: Outbox, who: _Who, first: int = 0, cacheable: bool = True
    ) -> tuple[Generation | None, Callable[[Stream], None] | None]:
        """Generate the text from segment ``first`` on, or fill ``outbox`` from the cache (no generation)."""
        segments = self.segments(request)
        cache, key = (self._cache if cacheable else None), None
        if cache is not None:
            digest = who.voice.sample.digest if who.voice is not None else ""
            key = cache_key(request, segments, self._engine_identity, digest)  # None: not reproducible
        on_complete = None
        if cache is not None and key is not None:
            cached = cache.get(key)
            if cached is not None:
                outbox.load(cached.items)  # a hit: every frame is ready now, no model work
                self._metrics.cache_hits.inc()
                return None, None
            self._metrics.cache_misses.inc()
            on_complete = functools.partial(self._store, cache, key)
        params = params_with_voice(request, who.voice)
        generation = self._engine.generate(
            GenerateRequest(
                segments=segments[first:],
                params=params,
                client=who.client,
                on_queued=who.charge,
                first_segment=first,
            )
        )
        return generation, on_complete

    def _encoder_for(self, request: SpeechRequest, router: Router | None) -> FrameEncoder:
        # With signed tokens the Ogg serial is the request's, so that a regeneration matches.
        serial = None if router is None else int.from_bytes(request_digest(request)[:4])
        return stream_encoder(request, self._settings, self._engine, ogg_serial=serial)

    def _start_incremental(self, request: SpeechRequest, who: _Who) -> tuple[Generation, TextFeed]:
        s, params = self._settings, params_with_voice(request, who.voice)
        delay_ms = request.max_buffer_delay_ms
        feed = open_feed(
            lambda first: self._engine.generate(
                GenerateRequest(
                    segments=first, params=params, incremental=True, client=who.client, on_queued=who.charge
                )
            ),
            request.text or "",
            segment_max_chars=s.segment_max_chars,
            max_total_chars=s.max_text_chars,
            max_pending_chars=s.max_pending_chars,
            delay_s=(s.max_buffer_delay_ms if delay_ms is None else delay_ms) / 1000,
            budget=PromptBudget.of(self._engine),
        )
        return feed.generation, feed

    @property
    def _engine_identity(self) -> str:
        """What besides the request decides the audio: the engine, its weights and block schedule."""
        s = self._settings
        return f"{s.engine}|{s.model_dir}|{s.dev_model}|{s.block_schedule}|{s.segment_max_chars}"

    def _store(self, cache: ResponseCache, key: str, stream: Stream) -> None:
        if (items := stream.outbox.snapshot()) is not None:
            cache.put(key, items)
            self._metrics.cache_bytes.set(cache.size)
