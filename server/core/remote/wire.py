"""The engine process's wire: commands, event batches and the settings as length-prefixed msgpack.

A frame is a 4-byte big-endian length and a msgpack body (msgspec). Commands and events are
the frozen values of ``server.core.events``, each as ``[tag, fields]`` (the tag is the class
name; the fields decode into the class, so a malformed frame fails loudly here, not deep in
the core). A numpy array (audio, a voice's codes) is a msgpack extension holding its dtype,
its shape and its raw bytes, read back without a copy (the array is read-only, as a stream
treats its audio). One frame per command; one per event batch, with the metrics the core
recorded meanwhile (``recorder.MetricOps``). The first frame the front end sends is the
:class:`~server.config.Settings` the engine process builds its engine and policy from.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgspec
import numpy as np

from server.config import Settings
from server.core import events as ev
from server.core.remote.recorder import MetricOps

_LENGTH = struct.Struct(">I")
#: A frame longer than this is refused (a voice recording's codes are the largest: kilobytes).
MAX_FRAME_BYTES = 64 * 1024 * 1024
_ARRAY = 1  # the msgpack extension code of a numpy array

COMMANDS: tuple[type[ev.Command], ...] = (
    ev.Add,
    ev.Append,
    ev.EndInput,
    ev.Cancel,
    ev.EncodeVoice,
    ev.Shutdown,
)
EVENTS: tuple[type[ev.CoreEvent], ...] = (
    ev.SegmentStarted,
    ev.Audio,
    ev.Ended,
    ev.Loaded,
    ev.LoadFailed,
    ev.Ready,
    ev.BreakerChanged,
    ev.Capacity,
    ev.VoiceEncoded,
    ev.Heartbeat,
    ev.Stopped,
)


class WireError(Exception):
    """A frame that does not decode (a bug on the other side, or not our process)."""


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        return msgspec.msgpack.Ext(_ARRAY, msgspec.msgpack.encode((array.dtype.str, array.shape, array.data)))
    raise NotImplementedError(f"cannot send {type(obj).__name__} to the engine process")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _ARRAY:
        raise WireError(f"unknown extension {code}")
    dtype, shape, raw = msgspec.msgpack.decode(data, type=tuple[str, tuple[int, ...], bytes])
    return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)


def _dec_hook(kind: type, obj: Any) -> Any:
    if isinstance(obj, np.ndarray):  # made by the extension hook; its dtype is the sender's
        return obj
    raise NotImplementedError(f"cannot read {kind} from the engine process")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_tagged = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_batch = msgspec.msgpack.Decoder(tuple[MetricOps, list[tuple[str, msgspec.Raw]]])
_settings = msgspec.msgpack.Decoder(Settings)


def _decoders(types: tuple[type, ...]) -> dict[str, msgspec.msgpack.Decoder[Any]]:
    return {t.__name__: msgspec.msgpack.Decoder(t, ext_hook=_ext_hook, dec_hook=_dec_hook) for t in types}


_command_decoders = _decoders(COMMANDS)
_event_decoders = _decoders(EVENTS)


def _frame(body: bytes) -> bytes:
    return _LENGTH.pack(len(body)) + body


def _decode(decoders: dict[str, msgspec.msgpack.Decoder[Any]], tag: str, raw: msgspec.Raw) -> Any:
    decoder = decoders.get(tag)
    if decoder is None:
        raise WireError(f"unknown message {tag!r}")
    return decoder.decode(raw)


def encode_command(command: ev.Command) -> bytes:
    """One command's frame."""
    return _frame(_encoder.encode((type(command).__name__, command)))


def decode_command(body: bytes) -> ev.Command:
    """A command from a frame's body."""
    try:
        tag, raw = _tagged.decode(body)
        command: ev.Command = _decode(_command_decoders, tag, raw)
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise WireError(f"a command that does not decode: {exc}") from None
    return command


def encode_events(events: list[ev.CoreEvent], ops: MetricOps) -> bytes:
    """One event batch's frame, with the metrics recorded with it."""
    return _frame(_encoder.encode((ops, [(type(event).__name__, event) for event in events])))


def decode_events(body: bytes) -> tuple[list[ev.CoreEvent], MetricOps]:
    """An event batch and its metrics from a frame's body."""
    try:
        ops, tagged = _batch.decode(body)
        events: list[ev.CoreEvent] = [_decode(_event_decoders, tag, raw) for tag, raw in tagged]
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise WireError(f"an event batch that does not decode: {exc}") from None
    return events, ops


def encode_settings(settings: Settings) -> bytes:
    """The settings' frame (the first the engine process reads)."""
    return _frame(_encoder.encode(settings))


def decode_settings(body: bytes) -> Settings:
    """The settings from a frame's body."""
    try:
        return _settings.decode(body)
    except msgspec.DecodeError as exc:
        raise WireError(f"settings that do not decode: {exc}") from None


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's body; None at the end of the stream (the other side closed or exited)."""
    try:
        head = await reader.readexactly(_LENGTH.size)
        (length,) = _LENGTH.unpack(head)
        if length > MAX_FRAME_BYTES:
            raise WireError(f"a frame of {length} bytes")
        return await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
