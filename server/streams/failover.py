"""Regenerating a stream that no replica holds any more, from the segment that holds the resume point.

A seeded stream is deterministic: segment ``k`` of (text, voice, seed, parameters) draws its
random numbers from (seed, k) alone and does not depend on its batch (the fake engine
exactly; the ChatTTS engine in float32). So when a resume names a stream that is gone (its
replica died, or it was restarted) and carries the original ``start`` request, any replica can
produce the same items again and send those after ``after_seq`` with the same seq numbers.

Where it starts over:

- raw PCM at the native rate (``pcm16``, ``f32``, ``mulaw`` at 24 kHz): at the start of the
  segment that holds the resume point, whose sample offset the client read from its
  ``segment`` message. PCM frames are cut on a fixed 20 ms grid with no state between them, so
  the frames after the resume point are the same bytes.
- every other format or rate: at the start of the stream. Opus, Ogg, MP3 and FLAC encoders
  (and the resampler) carry state from every sample before, so only the same input from
  the first sample gives the same bytes (tested for each format).

What cannot be exact is said (``resume_degraded``, the audio then goes on from the resume point
but may differ from what the lost replica would have sent): another engine, weights, precision,
device type or encoder settings than the owner's (the token's fingerprint), refinement on, or
an engine that is not batch-invariant (bf16/fp16). What cannot be done at all is refused
(``UnknownStream`` naming why): no seed, an incremental stream, a request that is not the
token's. Pure planning; the service opens the stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from server.audio.base import FrameEncoder
from server.engine_api import NATIVE_SAMPLE_RATE, EngineInfo
from server.errors import InvalidRequest, UnknownStream
from server.streams.outbox import Outbox
from server.streams.request import SpeechRequest
from server.streams.routing import Claims, inexact_engine, request_digest

#: Formats whose frames carry no state from one to the next (at the native rate).
STATELESS_FORMATS = frozenset({"pcm16", "f32", "mulaw"})


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a client stands in a stream it asks to regenerate.

    Attributes:
        after_seq: the last seq it holds with none missing before it.
        segment: the index of the last segment whose ``segment`` message it took (its seq
            at most ``after_seq``), or None.
        segment_sample: that message's ``sample``.
    """

    after_seq: int
    segment: int | None = None
    segment_sample: int | None = None


@dataclass(frozen=True, slots=True)
class Regeneration:
    """How a regenerated stream starts.

    Attributes:
        first_segment: generation starts with this segment (each segment keeps its seed offset).
        native_start: that segment's first sample on the native (24 kHz) timeline.
        skip_through: items with a seq up to this one are not sent (the client has them).
        degraded: why the audio after the resume point may differ from the lost stream's; None: exact.
        frame_ms: the stream's frame length (its ``start``'s ``frame_ms``): the grid it goes on on.
    """

    first_segment: int
    native_start: int
    skip_through: int
    degraded: str | None = None
    frame_ms: int = 20

    def prepare(self, encoder: FrameEncoder, outbox: Outbox) -> None:
        """Set a fresh encoder and outbox up so that the stream goes on at ``native_start``.

        The frame grid is the stream's: the encoder first gets the part of the grid's frame
        before ``native_start`` as silence; that frame's seq is at most ``skip_through`` (the
        segment holds the resume point), so it is never sent.
        """
        if self.first_segment == 0:
            outbox.start_at(seq=0, sample=0, native=0, skip_through=self.skip_through)
            return
        frame = NATIVE_SAMPLE_RATE * self.frame_ms // 1000
        seq, pad = divmod(self.native_start, frame)
        assert not encoder.push(np.zeros(pad, dtype=np.float32)), "less than a frame gives no frame"
        outbox.start_at(
            seq=seq,
            sample=seq * frame,
            native=self.native_start,
            skip_through=self.skip_through,
            segment=self.first_segment,
        )


def plan(
    request: SpeechRequest,
    claims: Claims,
    point: ResumePoint,
    *,
    segments: int,
    fingerprint: bytes,
    engine: EngineInfo,
    owner: str | None = None,
) -> Regeneration:
    """How to regenerate the stream ``claims`` names from ``request``, for a client at ``point``.

    Args:
        request: the stream's ``start`` request, with its seed.
        claims: the verified token's claims.
        point: where the client stands.
        segments: how many text segments the request's text has.
        fingerprint: this replica's audio fingerprint.
        engine: this replica's engine.
        owner: the tenant asking (None: no tenants); the token names the stream's tenant, so
            another tenant's resume is refused as a stream that does not exist.

    Raises:
        UnknownStream: the stream cannot be regenerated here (the message says why).
        InvalidRequest: the resume point is impossible (a segment past the text, a sample past
            the resume point).
    """
    if request.seed is None:
        raise UnknownStream("the stream is gone and cannot be regenerated without its seed")
    if request.incremental:
        raise UnknownStream("the stream is gone; an incremental stream cannot be regenerated")
    if request_digest(request, owner) != claims.request:
        raise UnknownStream("the stream is gone, and the request sent with the resume is not the stream's")
    first, start = _restart_point(request, point, segments)
    degraded = _degraded(request, claims, fingerprint, engine)
    return Regeneration(first, start, point.after_seq, degraded, request.frame_ms)


def _restart_point(request: SpeechRequest, point: ResumePoint, segments: int) -> tuple[int, int]:
    """(segment, native sample) to regenerate from: the client's segment for stateless PCM, else 0."""
    stateless = request.format in STATELESS_FORMATS and request.sample_rate == NATIVE_SAMPLE_RATE
    if point.segment is None or point.segment_sample is None or not stateless:
        return 0, 0
    frame = request.sample_rate * request.frame_ms // 1000  # PCM frames: a fixed grid of frame_ms
    if not 0 <= point.segment < segments:
        raise InvalidRequest(f"segment {point.segment}: the text has {segments} segments")
    if not 0 <= point.segment_sample <= (point.after_seq + 1) * frame:
        raise InvalidRequest(f"segment_sample {point.segment_sample} lies after the resume point")
    if point.segment == 0 and point.segment_sample != 0:
        raise InvalidRequest("segment 0 starts at sample 0")
    return point.segment, point.segment_sample


def _degraded(request: SpeechRequest, claims: Claims, fingerprint: bytes, engine: EngineInfo) -> str | None:
    if claims.fingerprint != fingerprint:
        return (
            "this replica's engine, weights, precision, device type or encoder settings differ "
            "from those of the replica that started the stream"
        )
    if request.refine:
        return "the stream has refinement on, whose text may come out differently"
    return inexact_engine(engine)
