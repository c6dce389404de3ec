"""One stream over its own connection, timed frame by frame, through the Python client (client_py).

The harness runs against any protocol-v1 server, local or remote; it does not
import the ``server`` package. ``chattts_stream_client`` does the protocol
(and stamps each chunk with the moment it was read from the socket, so the
timings do not include the consumer's queue); this module records timings.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from bench.harness.audio import DEFAULT_SILENCE_THRESHOLD, first_loud_index, make_decoder
from bench.harness.latency import StreamRecord
from bench.harness.textset import Job
from chattts_stream_client import ChatTTSStreamError, Client, ConnectionLost, EngineError, SpeechStream


@dataclass(frozen=True)
class StreamOptions:
    """How each stream is requested and bounded.

    Attributes:
        fmt: ``pcm16`` or ``opus``.
        sample_rate: requested output rate.
        system: label stored in every record.
        max_audio_s: cancel the stream once this much audio arrived (0 = never);
            bounds the work per stream for models whose length is random.
        timeout_s: give up on a stream after this long (error ``timeout``).
        silence_threshold: int16 magnitude that counts as non-silent.
        extra: further ``start`` fields (voice, temperature, ...).
    """

    fmt: str = "pcm16"
    sample_rate: int = 24_000
    system: str = "server"
    max_audio_s: float = 0.0
    timeout_s: float = 120.0
    silence_threshold: int = DEFAULT_SILENCE_THRESHOLD
    extra: dict[str, Any] = field(default_factory=dict)


async def fetch_hello(url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The server's ``hello`` (one short-lived connection)."""
    async with Client(url, connect_timeout=timeout_s) as client:
        assert client.hello is not None
        return client.hello


async def run_stream(
    url: str, job: Job, options: StreamOptions, stop: asyncio.Event | None = None
) -> StreamRecord:
    """Run ``job`` as one stream on a fresh connection and record what arrived when.

    ``stop`` set while the stream runs cancels it (the record is marked ``cut``).
    Never raises for server or network failures: they become error codes in the record.
    """
    record = StreamRecord(
        job=job.index,
        system=options.system,
        fmt=options.fmt,
        text_size=job.text.size,
        text_lang=job.text.lang,
        sample_rate=options.sample_rate,
        t_connect=time.perf_counter(),
    )
    # No resume: a benchmark counts a lost connection as an error, it does not hide it.
    client = Client(url, connect_timeout=options.timeout_s, read_timeout=options.timeout_s, resume=False)
    try:
        await client.connect()
    except ChatTTSStreamError as exc:
        refused = isinstance(exc, ConnectionLost) and exc.code.startswith("http_")
        record.errors.append(f"connect_failed_{exc.code}" if refused else "connect_failed")
        record.t_send = time.perf_counter()
        await client.close()
        return record
    try:
        async with asyncio.timeout(options.timeout_s):
            await _converse(client, job, options, record, stop)
    except TimeoutError:  # the client's StreamTimeout is one too
        record.errors.append("timeout")
    except ConnectionLost:
        record.errors.append("connection_lost")
    finally:
        await client.close()
    return record


async def _converse(
    client: Client, job: Job, options: StreamOptions, record: StreamRecord, stop: asyncio.Event | None
) -> None:
    fields = {"format": options.fmt, "sample_rate": options.sample_rate, "seed": job.seed, **options.extra}
    stream = client.speak(job.text.text, stream_id=f"b{job.index}", **fields)
    record.t_send = time.perf_counter()
    try:
        await stream.start()
    except ConnectionLost:
        raise
    except ChatTTSStreamError as exc:  # refused: no done follows
        record.errors.append(exc.code)
        record.t_done = time.perf_counter()
        return
    record.sample_rate = stream.sample_rate
    record.advice_ms = stream.buffer_ms
    decoder = make_decoder(options.fmt, options.sample_rate)
    offset = 0
    cap = int(options.max_audio_s * options.sample_rate)
    cut_task = asyncio.create_task(_cut_on_stop(stream, stop, record)) if stop is not None else None
    try:
        async for chunk in stream:
            if record.t_first_loud is None:
                samples = decoder.decode(chunk.data)
                n = int(samples.size)
                loud = first_loud_index(samples, options.silence_threshold)
                if loud is not None:
                    record.t_first_loud, record.first_loud_sample = chunk.received_at, offset + loud
            else:  # only the count matters now: no decode (bench.harness.audio)
                n = decoder.count(chunk.data)
            record.frames.append((chunk.received_at, n))
            offset += n
            if cap and offset >= cap and not record.capped and not record.cut and not chunk.last:
                record.capped = True
                await stream.cancel()
    except EngineError:
        record.errors.append("engine_error")
    finally:
        if cut_task is not None:
            cut_task.cancel()
            await asyncio.gather(cut_task, return_exceptions=True)
    record.t_done = time.perf_counter()
    record.reason = stream.done.reason if stream.done is not None else "cancelled"
    if stream.done is not None:
        _fix_last_frame(record, stream.done.samples)


async def _cut_on_stop(stream: SpeechStream, stop: asyncio.Event, record: StreamRecord) -> None:
    """When ``stop`` is set, cancel the stream (its iteration then ends)."""
    await stop.wait()
    if not record.capped:
        record.cut = True
        await stream.cancel()


def _fix_last_frame(record: StreamRecord, total: object) -> None:
    """Opus decodes whole packets: trim the last audio frames to ``done.samples``."""
    if not isinstance(total, int) or not record.frames:
        return
    excess = record.samples - total
    for i in range(len(record.frames) - 1, -1, -1):
        if excess <= 0:
            return
        t, n = record.frames[i]
        cut = min(n, excess)
        record.frames[i] = (t, n - cut)
        excess -= cut
