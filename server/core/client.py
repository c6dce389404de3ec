"""The engine client: what the event loop (the service, every front end) sees of the engine.

:class:`EngineClient` starts the :class:`~server.core.engine_core.EngineCore` through a
:class:`~server.core.link.CoreLink` (on its own thread, or in an engine process of its own)
and talks to it only in typed commands and events (``server.core.events``). A stream is one call::

    generation = client.generate(GenerateRequest(segments=("Hello.",), params=SynthesisParams()))
    async for event in generation:        # SegmentStarted, Audio, ..., then Ended
        ...
    client.abort(generation.stream_id)    # or generation.abort(): stop it at the next block

``generate`` applies the policy's admission rule at once (``Overloaded`` with
``retry_after_ms``), so a refusal never waits for the inference thread.
Incremental streams (``incremental=True``) get more segments with
``append`` and finish after ``end_input``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import assert_never

from server.core.admission import refusal
from server.core.events import (
    Add,
    Admission,
    Append,
    Audio,
    BreakerChanged,
    Cancel,
    Capacity,
    CoreEvent,
    EncodeVoice,
    Ended,
    EndInput,
    Heartbeat,
    Loaded,
    LoadFailed,
    Ready,
    SegmentStarted,
    Stopped,
    VoiceEncoded,
)
from server.core.generation import GenerateRequest, Generation
from server.core.link import CoreLink, ThreadLink
from server.core.policy import INITIAL_SECONDS_PER_BLOCK, STOPPED_MESSAGE, PolicyConfig
from server.engine_api import AudioArray, Codes, Engine, EngineInfo
from server.errors import EngineFailed, EngineUnavailable, InvalidRequest, Overloaded, StartupError
from server.metrics import Metrics

#: ``healthy`` turns False when the inference thread has not been heard of for this long.
HEARTBEAT_STALE_S = 120.0


class EngineClient:
    """Starts the engine core, submits streams to it and routes its events to their generations.

    ``engine_factory`` builds the engine on an inference thread of this process; ``link``
    instead says where the core runs (``server.core.remote.link.ProcessLink``: its own process).
    """

    def __init__(
        self,
        engine_factory: Callable[[], Engine] | None = None,
        *,
        config: PolicyConfig,
        metrics: Metrics,
        warmup: bool = True,
        link: CoreLink | None = None,
    ) -> None:
        self.config = config
        self._metrics = metrics
        if link is None:
            assert engine_factory is not None, "an engine factory or a link"
            link = ThreadLink(engine_factory, config=config, metrics=metrics, warmup=warmup)
        self.link = link
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loaded: asyncio.Future[EngineInfo] | None = None
        self._ready = asyncio.Event()
        self._generations: dict[int, Generation] = {}
        self._encodes: dict[int, asyncio.Future[VoiceEncoded]] = {}
        self._ids = itertools.count()
        self._adds_sent = 0
        #: The client of each ``Add`` sent and not yet taken in by the core, in order (the core
        #: takes commands first in, first out, so ``adds_taken`` says which are taken).
        self._pending_clients: deque[str] = deque()
        self._pending_by_client: Counter[str] = Counter()
        self._capacity = Capacity(Admission(0, config.max_batch, INITIAL_SECONDS_PER_BLOCK, False), 0)
        self._stopped = False
        self._heard = time.monotonic()
        self.info = EngineInfo(name="(not loaded)")

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> EngineInfo:
        """Start the core; returns once the engine is loaded (its warm-up goes on).

        Raises:
            StartupError: the engine could not be loaded (the core has ended).
        """
        self._loop = asyncio.get_running_loop()
        self._loaded = self._loop.create_future()
        self._started = True
        await self.link.start(self._dispatch, self._on_lost)
        try:
            self.info = await self._loaded
        except StartupError:
            await self.link.join()
            raise
        return self.info

    async def stop(self) -> None:
        """Stop the loop after its current step; every stream still running ends with an error."""
        self.link.shutdown()
        if self._started:
            await self.link.join()

    async def wait_ready(self) -> None:
        """Until the engine's warm-up is over."""
        await self._ready.wait()

    @property
    def ready(self) -> bool:
        """Warmed up and looping."""
        return self._ready.is_set() and not self._stopped

    @property
    def alive(self) -> bool:
        """The core runs (or, in an engine process, is being brought back)."""
        return self._started and self.link.alive and not self._stopped

    @property
    def healthy(self) -> bool:
        """Alive, and heard of within ``HEARTBEAT_STALE_S`` (a stuck step stops its heartbeat)."""
        return self.alive and time.monotonic() - self._heard < HEARTBEAT_STALE_S

    @property
    def admission(self) -> Admission:
        """The policy's admission state as last published (what ``generate`` decides on)."""
        return self._capacity.admission

    @property
    def breaker_open(self) -> bool:
        """The engine keeps failing: new streams are refused until a probe succeeds."""
        return self._capacity.admission.breaker_open

    @property
    def engine(self) -> Engine:
        """The engine the core runs, in this process (tests read the fake engine's logs through this)."""
        return self.link.engine

    def validate_voice(self, voice: str) -> bool:
        """Whether the engine speaks ``voice`` (engines answer from immutable data: any thread)."""
        return self.link.text.validate_voice(voice)

    def text_tokens(self, text: str) -> int:
        """Tokens ``text`` is for the model (engines count apart from the inference thread: any thread)."""
        return self.link.text.text_tokens(text)

    # --- streams --------------------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> Generation:
        """Submit a stream; its events arrive through the returned generation.

        Raises:
            Overloaded: the queue is full or the breaker is open (``retry_after_ms`` set).
            EngineUnavailable: the inference loop is not running.
        """
        if self._stopped or not self.link.connected:
            raise EngineUnavailable("the inference loop is not running")
        capacity = self._capacity
        retry_ms = refusal(
            capacity.admission,
            self.config,
            self._adds_sent - capacity.adds_taken,
            client=request.client,
            pending_by_client=self._pending_by_client,
        )
        if retry_ms is not None:
            raise Overloaded("the server is at capacity; retry later", retry_after_ms=retry_ms)
        generation = Generation(self, next(self._ids), request.on_queued)
        self._generations[generation.stream_id] = generation
        self._adds_sent += 1
        self._pending_clients.append(request.client)
        self._pending_by_client[request.client] += 1
        self.link.send(
            Add(
                generation.stream_id,
                request.segments,
                request.params,
                input_closed=not request.incremental,
                client=request.client,
                first_segment=request.first_segment,
            )
        )
        self._count_queue()
        return generation

    async def encode_voice(self, audio: AudioArray, transcript: str) -> Codes:
        """A recording's codes for a voice, made on the inference thread between two steps.

        Args:
            audio: mono float32 at the engine's sample rate (checked already).
            transcript: what is said in it.

        Raises:
            InvalidRequest: the engine refused the recording or transcript (the message says why).
            EngineFailed: the model failed.
            EngineUnavailable: the inference loop is not running.
        """
        if self._stopped or not self.link.connected or self._loop is None:
            raise EngineUnavailable("the inference loop is not running")
        request_id = next(self._ids)
        future: asyncio.Future[VoiceEncoded] = self._loop.create_future()
        self._encodes[request_id] = future
        self.link.send(EncodeVoice(request_id, audio, transcript))
        try:
            answer = await future
        finally:
            self._encodes.pop(request_id, None)
        if answer.codes is not None:
            return answer.codes
        raise (EngineFailed if answer.failed else InvalidRequest)(answer.message)

    def append(self, stream_id: int, text: str) -> None:
        """One more segment for an incremental stream."""
        self.link.send(Append(stream_id, text))

    def end_input(self, stream_id: int) -> None:
        """No more segments for an incremental stream."""
        self.link.send(EndInput(stream_id))

    def abort(self, stream_id: int) -> None:
        """Stop generating a stream; its engine work is freed at the next block boundary.

        The generation ends at once with ``Ended("cancelled")``, after the events it holds.
        """
        generation = self._generations.pop(stream_id, None)
        if generation is not None:
            self.link.send(Cancel(stream_id))
            generation._push(Ended(stream_id, "cancelled"))

    # --- events from the core ----------------------------------------------------------------

    def _dispatch(self, events: list[CoreEvent]) -> None:
        self._heard = time.monotonic()
        generations = self._generations
        for event in events:
            match event:
                case SegmentStarted() | Audio() | Ended():
                    generation = generations.get(event.stream_id)
                    if generation is not None:
                        generation._push(event)
                        if isinstance(event, Ended):
                            del generations[event.stream_id]
                case Capacity():
                    self._capacity = event
                    self._taken(event.adds_taken)
                    self._count_queue()
                case VoiceEncoded():
                    future = self._encodes.get(event.request_id)
                    if future is not None and not future.done():
                        future.set_result(event)
                case Ready():
                    self._ready.set()
                case Loaded() | LoadFailed():
                    self._on_load(event)
                case Stopped():
                    self._on_stopped()
                case BreakerChanged() | Heartbeat():
                    pass  # the breaker's state arrives with the next Capacity; a heartbeat only says alive
                case _:
                    assert_never(event)

    def _on_load(self, event: Loaded | LoadFailed) -> None:
        if self._loaded is None or self._loaded.done():
            return
        if isinstance(event, Loaded):
            self._loaded.set_result(event.info)
        else:
            self._loaded.set_exception(StartupError(event.message))

    def _on_stopped(self) -> None:
        self._stopped = True
        self._ready.clear()
        # Submitted after the core stopped taking commands: nobody else will end them.
        for stream_id, generation in list(self._generations.items()):
            generation._push(Ended(stream_id, "error", STOPPED_MESSAGE))
        self._generations.clear()
        for request_id, future in self._encodes.items():
            if not future.done():
                future.set_result(VoiceEncoded(request_id, None, STOPPED_MESSAGE, failed=True))

    def _on_lost(self, message: str) -> None:
        """The core is gone without stopping (its process died): fail what it held; not ready.

        A core brought back starts from nothing: no add of the lost one counts as pending, and
        its ``Ready`` makes the client ready again.
        """
        if self._loaded is not None and not self._loaded.done():
            self._loaded.set_exception(StartupError(message))
        self._ready.clear()
        for stream_id, generation in list(self._generations.items()):
            generation._push(Ended(stream_id, "error", message))
        self._generations.clear()
        for request_id, future in self._encodes.items():
            if not future.done():
                future.set_result(VoiceEncoded(request_id, None, message, failed=True))
        self._adds_sent = 0
        self._pending_clients.clear()
        self._pending_by_client.clear()
        self._capacity = Capacity(Admission(0, self.config.max_batch, INITIAL_SECONDS_PER_BLOCK, False), 0)
        self._metrics.running_sequences.set(0)
        self._count_queue()

    def _taken(self, adds_taken: int) -> None:
        """The core has taken ``adds_taken`` adds in all: they are no longer pending."""
        pending = self._pending_by_client
        while len(self._pending_clients) > self._adds_sent - adds_taken:
            client = self._pending_clients.popleft()
            pending[client] -= 1
            if pending[client] <= 0:
                del pending[client]

    def _count_queue(self) -> None:
        capacity = self._capacity
        pending = self._adds_sent - capacity.adds_taken
        self._metrics.queue_depth.set(capacity.admission.waiting + pending)
