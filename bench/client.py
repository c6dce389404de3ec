"""One stream over its own WebSocket connection, timed frame by frame (protocol v1).

Deliberately independent of the ``server`` package: the harness runs
against any protocol-v1 server, local or remote.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench.audio import DEFAULT_SILENCE_THRESHOLD, first_loud_index, make_decoder
from bench.latency import StreamRecord
from bench.textset import Job

HEADER = struct.Struct("<BBHII")
FLAG_LAST = 0x01


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


async def open_connection(url: str, timeout_s: float = 30.0) -> tuple[ClientConnection, dict[str, Any]]:
    """Connect (no compression, no size limit) and read ``hello``."""
    ws = await connect(url, compression=None, max_size=None, open_timeout=timeout_s, ping_interval=None)
    try:
        async with asyncio.timeout(timeout_s):
            hello = json.loads(await ws.recv())
    except BaseException:
        await ws.close()
        raise
    if not isinstance(hello, dict) or hello.get("type") != "hello":
        await ws.close()
        raise ValueError(f"expected hello, got {hello!r}")
    return ws, hello


async def fetch_hello(url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The server's ``hello`` (one short-lived connection)."""
    ws, hello = await open_connection(url, timeout_s)
    await ws.close()
    return hello


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
    try:
        ws, _ = await open_connection(url, options.timeout_s)
    except InvalidStatus as exc:
        record.errors.append(f"connect_failed_http_{exc.response.status_code}")
        record.t_send = time.perf_counter()
        return record
    except (OSError, TimeoutError, ConnectionClosed, ValueError):
        record.errors.append("connect_failed")
        record.t_send = time.perf_counter()
        return record
    try:
        async with asyncio.timeout(options.timeout_s):
            await _converse(ws, job, options, record, stop)
    except TimeoutError:
        record.errors.append("timeout")
    except ConnectionClosed as exc:
        code = exc.rcvd.code if exc.rcvd is not None else 1006
        record.errors.append(f"connection_closed_{code}")
    finally:
        await ws.close()
    return record


async def _converse(
    ws: ClientConnection, job: Job, options: StreamOptions, record: StreamRecord, stop: asyncio.Event | None
) -> None:
    sid = f"b{job.index}"
    start = {
        "type": "start",
        "id": sid,
        "text": job.text.text,
        "format": options.fmt,
        "sample_rate": options.sample_rate,
        "seed": job.seed,
        **options.extra,
    }
    cancel = json.dumps({"type": "cancel", "id": sid})
    record.t_send = time.perf_counter()
    await ws.send(json.dumps(start, ensure_ascii=False))
    decoder = make_decoder(options.fmt, options.sample_rate)
    offset = 0
    started = False
    cap = int(options.max_audio_s * options.sample_rate)
    cut_task = asyncio.create_task(_cut_on_stop(ws, stop, cancel, record)) if stop is not None else None
    try:
        while True:
            raw = await ws.recv()
            now = time.perf_counter()
            if isinstance(raw, bytes):
                flags = raw[1]
                samples = decoder.decode(raw[HEADER.size :])
                record.frames.append((now, int(samples.size)))
                if record.t_first_loud is None:
                    loud = first_loud_index(samples, options.silence_threshold)
                    if loud is not None:
                        record.t_first_loud, record.first_loud_sample = now, offset + loud
                offset += int(samples.size)
                if cap and offset >= cap and not record.capped and not record.cut and not flags & FLAG_LAST:
                    record.capped = True
                    await ws.send(cancel)
                continue
            message = json.loads(raw)
            kind = message.get("type")
            if kind == "started":
                started = True
                record.sample_rate = int(message.get("sample_rate", options.sample_rate))
            elif kind == "error":
                record.errors.append(str(message.get("code", "unknown")))
                if not started and message.get("code") != "engine_error":
                    record.t_done = now  # refused: no done follows
                    return
            elif kind == "done":
                record.t_done = now
                record.reason = str(message.get("reason"))
                _fix_last_frame(record, message.get("samples"))
                return
    finally:
        if cut_task is not None:
            cut_task.cancel()
            await asyncio.gather(cut_task, return_exceptions=True)


async def _cut_on_stop(ws: ClientConnection, stop: asyncio.Event, cancel: str, record: StreamRecord) -> None:
    """When ``stop`` is set, cancel the stream (the reader then waits for its ``done``)."""
    await stop.wait()
    if not record.capped:
        record.cut = True
        await ws.send(cancel)


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
