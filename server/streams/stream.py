"""One stream on the event loop: engine events → encoder → outbox, its text input, its lifecycle.

A :class:`Stream` is built complete by the service (:mod:`server.streams.builder`: its
encoder, outbox, generation and text input exist before it does) and owns its lifecycle:
which transition each event means (its states, its sender's :class:`Lease` and their
bookkeeping are :mod:`server.streams.lifecycle`'s) and what each frees. Light formats (PCM)
are encoded inline on the event loop; CPU-heavy ones (Opus, Ogg) in the encoder pool, one
call at a time (the encoders are stateful), so the event loop never waits for libopus.

What a stream holds besides its outbox is charged to its client's share of the memory
budget for as long as it holds it (:mod:`server.streams.budget`): the stream's own objects
(``STREAM_OVERHEAD_BYTES``, until it is freed), its encoder and resampler (until its last
frame is encoded: the encoder is dropped then, so an ended stream waiting for a resume holds
none; what ``started``/``resumed`` tell comes from :attr:`Stream.format`,
:attr:`Stream.sample_rate` and :attr:`Stream.preskip`), and an incremental stream's pending
text (at its bound, until its text side closes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Executor

from server.audio import CPU_HEAVY_FORMATS, frame_ms_of, opus_preskip
from server.audio.base import FrameEncoder
from server.audio.footprint import encoder_state_bytes
from server.core.events import Audio, Ended, SegmentStarted
from server.core.generation import Generation
from server.errors import EngineFailed
from server.metrics import Metrics
from server.streams.budget import PENDING_CHAR_BYTES, STREAM_OVERHEAD_BYTES, Held
from server.streams.incremental import TextFeed
from server.streams.items import Frame, OutItem
from server.streams.lifecycle import Lease, Lifecycle, StreamState
from server.streams.outbox import BufferOverflow, Outbox
from server.streams.timing import SegmentWords
from server.streams.tokens import redact

log = logging.getLogger(__name__)


class Stream:
    """One stream's output side and lifecycle, independent of any connection."""

    def __init__(
        self,
        *,
        name: str,
        token: str,
        encoder: FrameEncoder,
        outbox: Outbox,
        lease: Lease,
        metrics: Metrics,
        pool: Executor,
        generation: Generation | None = None,
        text: TextFeed | None = None,
        words: SegmentWords | None = None,
        resumable: bool = True,
        ttl_s: float = 0.0,
        on_complete: Callable[[Stream], None] | None = None,
        on_freed: Callable[[Stream], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        owner: str | None = None,
        client: str = "",
        seed: int | None = None,
        on_linger: Callable[[Stream], None] | None = None,
    ) -> None:
        self.name = name  # the client's id for the stream
        self.token = token
        #: The tenant that made it (None: no tenants); only it may resume the stream.
        self.owner = owner
        #: Who started it (its rate-limit identity): whose share of the memory budget it uses.
        self.client = client
        self.seed = seed  # its sampling seed (the client's, or the server's pick)
        #: What ``started`` and ``resumed`` tell: kept here, as the encoder is dropped at the end.
        self.format = encoder.format
        self.sample_rate = encoder.sample_rate
        self.preskip = opus_preskip(encoder)  # Opus: decoded samples a client drops at the start
        self._encoder: FrameEncoder | None = encoder
        self.outbox = outbox
        #: Where ``append``/``flush``/``end`` go (incremental streams only).
        self.text = text
        #: Times each segment's words (streams that asked for word timestamps only).
        self._words = words
        self.resumable = resumable
        #: How long it waits for a resume once detached, or lingers once delivered (0: freed at once).
        self._ttl_s = ttl_s
        self._generation = generation
        self._pool = pool if encoder.format in CPU_HEAVY_FORMATS else None
        self._word_pool = pool
        self._metrics = metrics
        self._on_complete = on_complete
        self._on_freed = on_freed
        self._clock = clock
        self.created = clock()
        self.first_frame_at: float | None = None
        self._on_linger = on_linger
        # The memory budget's charges for what is held besides the outbox (module docstring).
        self._held = Held(
            outbox.charge,
            stream=STREAM_OVERHEAD_BYTES,
            encoder=encoder_state_bytes(self.format, self.sample_rate, frame_ms_of(encoder)),
            text=PENDING_CHAR_BYTES * text.max_pending_chars if text is not None else 0,
        )
        self._life = Lifecycle(lease, outbox, metrics, clock)  # counts it as active
        if generation is None:  # a cache hit: every frame is in the outbox already
            self._drop_encoder()

    # --- lifecycle ---------------------------------------------------------------------

    @property
    def state(self) -> StreamState:
        """Where the stream is in its life."""
        return self._life.state

    @property
    def lease(self) -> Lease | None:
        """The front end sending it now (None while detached or delivered)."""
        return self._life.lease

    @property
    def counted(self) -> bool:
        """Its end was counted (delivered, expired or closed): no longer active."""
        return self._life.counted

    def idle_since(self) -> float | None:
        """When it lost its sender (detached or delivered); None while attached or gone."""
        return self._life.idle_since()

    @property
    def buffered_bytes(self) -> int:
        """What it holds for its client now: outbox, audio not yet encoded, encoder, text, itself."""
        backlog = self._generation.queued_bytes if self._generation is not None else 0
        return self.outbox.charged_bytes + backlog + self._held.total

    @property
    def has_encoder(self) -> bool:
        """It still holds its encoder (and resampler): its last frame is not encoded yet."""
        return self._encoder is not None

    @property
    def lingering(self) -> bool:
        """Ended and kept only for a resume: delivered, or detached with its outbox ended."""
        state = self._life.state
        return state is StreamState.DELIVERED or (state is StreamState.DETACHED and self.outbox.ended)

    @property
    def generating(self) -> bool:
        """Its generation has not ended and it is not closed: it holds (or waits for) an engine row."""
        return self._life.state in (StreamState.ATTACHED, StreamState.DETACHED) and not self.outbox.ended

    @property
    def busy(self) -> bool:
        """A drain waits for it: still generating, or items left for a live sender."""
        return self.generating or self._life.state is StreamState.ATTACHED

    def attach(self, lease: Lease) -> None:
        """``lease`` sends the stream from now on; a previous sender's lease is revoked."""
        if self._life.state in (StreamState.EXPIRED, StreamState.CLOSED):
            raise RuntimeError(f"stream {redact(self.token)} is {self._life.state.value}")
        self._life.attach(lease)
        self._lingering_changed()

    def detach(self, lease: Lease) -> None:
        """``lease``'s connection is gone: the resume TTL starts, or (TTL 0) the stream expires.

        A no-op if the stream moved on to another sender.
        """
        if self._life.lease is not lease:
            return
        if self._ttl_s <= 0:
            self.expire()
            return
        self._life.release(StreamState.DETACHED)
        log.info("stream %s detached; resumable for %.0f s", redact(self.token), self._ttl_s)
        self._lingering_changed()

    def _delivered(self, lease: Lease) -> None:
        """``lease`` handed ``done`` to its socket: count the stream; keep it for the TTL or free it."""
        if self._life.lease is not lease:
            return
        self._life.count(self.outbox.done_reason or "error")
        if self.resumable and self._ttl_s > 0:
            self._life.release(StreamState.DELIVERED)
            self._lingering_changed()
        else:
            self._free(StreamState.CLOSED)

    def expire(self) -> None:
        """Not resumed within the TTL (or evicted to fit the replay budget): free it."""
        if self._life.state is StreamState.DETACHED:
            log.info("stream %s expired: not resumed in time", redact(self.token))
        self._life.count("expired")
        self._free(StreamState.EXPIRED)

    def close(self, reason: str = "expired") -> None:
        """Free the stream; counted as ``reason`` unless it was counted already."""
        self._life.count(reason)
        self._free(StreamState.CLOSED)

    def _free(self, state: StreamState) -> None:
        self._life.end(state)
        # No one will read what it holds or would generate: stop it and give the memory back.
        if self._generation is not None:
            self._generation.discard()
        self._close_text()
        self._drop_encoder()
        self.outbox.release()
        self._held.drop("stream")
        if self._on_freed is not None:
            self._on_freed(self)  # the registry forgets it

    def _lingering_changed(self) -> None:
        """Tell the registry it may have become (or stopped being) ended-but-resumable."""
        if self._on_linger is not None:
            self._on_linger(self)

    def _drop_encoder(self) -> None:
        """Its last frame is encoded (or never will be): free the encoder and resampler."""
        self._encoder = None
        self._held.drop("encoder")

    def _close_text(self) -> None:
        if self.text is not None:
            self.text.close()
        self._held.drop("text")

    # --- sending -----------------------------------------------------------------------

    async def deliver(
        self, lease: Lease, index: int, *, whole: bool = False
    ) -> AsyncGenerator[list[OutItem], None]:
        """The one outbox reader: every ready run of items from ``index``, in order, pulled by the sender.

        The sender (``lease``'s front end) iterates and puts each run on its wire; asking
        for the next run is what marks the previous one sent (its frames counted, the
        first audio observed), so a sender that fails mid-run never marks what it lost.
        The iteration ends after ``done`` went out (the stream is then delivered: kept
        for the TTL, or freed) or when the stream moves to another sender. Iterate it
        under ``contextlib.aclosing`` so that a failed sender closes it at once.
        ``whole``: one run, every item, once the stream has ended (:meth:`Outbox.hold_until_ended`).
        """
        outbox = self.outbox
        if whole:
            outbox.hold_until_ended()
        while not lease.revoked:
            items = outbox.ready(index)
            if not items or (whole and not outbox.ended):
                if outbox.ended:
                    break
                await outbox.wait_change()
                continue
            yield items
            index += len(items)
            self.sent(lease, index, sum(1 for item in items if isinstance(item, Frame)))
        if not lease.revoked:
            self._delivered(lease)

    def sent(self, lease: Lease, index: int, frames: int) -> None:
        """``lease`` handed every item before ``index`` (``frames`` of them audio) to its socket."""
        if lease is not self._life.lease:
            return  # the stream moved on meanwhile: the new sender owns the numbering
        self.outbox.mark_sent(index)
        if frames:
            self._metrics.frames_sent.inc(frames)
            if self.first_frame_at is None:
                self.first_frame_at = self._clock()
                self._metrics.time_to_first_audio.observe(self.first_frame_at - self.created)

    # --- the engine's events -----------------------------------------------------------

    def cancel(self) -> None:
        """The client's ``cancel``: stop generating; ``done`` follows with reason ``cancelled``."""
        if self._generation is not None:
            self._generation.abort()
        self._close_text()

    async def run(self) -> None:
        """Feed the generation's events through the encoder into the outbox, in order."""
        if self._generation is None:
            return
        loop = asyncio.get_running_loop()
        outbox = self.outbox
        async for event in self._generation:
            encoder = self._encoder
            if encoder is None:  # freed (or ended) meanwhile
                return
            if isinstance(event, Audio):
                if self._words is not None:
                    await self._time_words(event)
                if self._pool is None:
                    frames = encoder.push(event.samples)
                else:
                    frames = await loop.run_in_executor(self._pool, encoder.push, event.samples)
                try:
                    outbox.on_frames(frames, len(event.samples))
                except BufferOverflow:
                    if (sender := self._life.lease) is not None:
                        sender.abort("too much unsent audio")
            elif isinstance(event, SegmentStarted):
                outbox.on_segment(event.text)
                if self._words is not None:
                    self._words.start(event.text)
            else:
                await self._end(event, encoder)

    async def _time_words(self, event: Audio) -> None:
        """Keep the segment's audio; at its end, time its words before its last frames go out."""
        assert self._words is not None
        self._words.add(event.samples)
        if event.segment_end:
            # The aligner is CPU work (energy and a dynamic programme): off the event loop.
            words, length = await asyncio.get_running_loop().run_in_executor(
                self._word_pool, self._words.finish
            )
            self.outbox.on_words(words, length)

    async def _end(self, event: Ended, encoder: FrameEncoder) -> None:
        if self._pool is None:
            final = encoder.finish()
        else:
            final = await asyncio.get_running_loop().run_in_executor(self._pool, encoder.finish)
        self._drop_encoder()  # nothing more to encode: an ended stream keeps only its outbox
        self._close_text()
        error = EngineFailed(event.message) if event.reason == "error" else None
        self.outbox.finish(event.reason, final, error)
        if event.reason == "complete" and self._on_complete is not None:
            self._on_complete(self)
        self._lingering_changed()  # a detached stream is now ended, kept only for a resume
