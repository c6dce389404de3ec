"""Reading one Wyoming event off a socket, within bounds of size, nesting, type and time.

A Wyoming event is a JSON header line, then ``data_length`` bytes of JSON data and
``payload_length`` bytes of payload. This is the Wyoming front end's one JSON decoding path:
each JSON part is decoded by the shared path (:func:`server.frontends.messages.decode`: the
nesting and number bounds, then msgspec), which
takes strict JSON only (no ``NaN``/``Infinity``) and integers as integers, so a length of
``1e400``, ``-Infinity``, ``"5"``, ``1.5`` or ``true`` is a :class:`BadEvent`, never an
``OverflowError``. :func:`encode_event` serializes an event for a socket the server writes to
without a stream writer (a refusal at accept time).
"""

from __future__ import annotations

import asyncio
import io
from typing import Annotated, Any, Final

import msgspec
from wyoming.event import Event, write_event

from server.frontends import messages
from server.frontends.messages import BadMessage

Length = Annotated[int, msgspec.Meta(ge=0)]


class _Header(msgspec.Struct, forbid_unknown_fields=False):
    """An event's header line (``version`` and unknown fields are ignored)."""

    type: str
    data: dict[str, Any] | None = None
    data_length: Length | None = None
    payload_length: Length | None = None


_header: Final = msgspec.json.Decoder(_Header)
_data: Final = msgspec.json.Decoder(dict[str, Any])


class BadEvent(Exception):
    """Bytes that are not a Wyoming event within the bounds (the message is safe to send)."""


def _decode(decoder: msgspec.json.Decoder[Any], raw: bytes, what: str, max_depth: int) -> Any:
    try:
        return messages.decode(raw, decoder, max_depth=max_depth)
    except BadMessage as bad:
        raise BadEvent(f"{what}: {bad.message}") from None


async def read_event(
    reader: asyncio.StreamReader, first: bytes, *, max_bytes: int, max_depth: int
) -> Event | None:
    """The event whose first byte was ``first`` (None if the connection ends inside it).

    The reader's limit bounds the header line; ``data_length + payload_length`` is bounded
    by ``max_bytes``. The caller bounds the time it takes.

    Raises:
        BadEvent: malformed or non-strict JSON, a length that is no integer of 0 or more,
            nesting deeper than ``max_depth``, or a part over ``max_bytes``.
    """
    try:
        line = first + await reader.readline()
    except ValueError:  # the reader's limit: a line with no end within max_bytes
        raise BadEvent(f"event header over {max_bytes} bytes") from None
    if not line.endswith(b"\n"):
        return None  # the end of the connection, mid-line
    header: _Header = _decode(_header, line, "event header", max_depth)
    data_length, payload_length = header.data_length or 0, header.payload_length or 0
    if data_length + payload_length > max_bytes:
        raise BadEvent(f"event over {max_bytes} bytes")
    data = dict(header.data or {})
    try:
        if data_length:
            data.update(_decode(_data, await reader.readexactly(data_length), "event data", max_depth))
        payload = await reader.readexactly(payload_length) if payload_length else None
    except asyncio.IncompleteReadError:
        return None
    return Event(type=header.type, data=data, payload=payload)


def encode_event(event: Event) -> bytes:
    """``event`` as the bytes Wyoming puts on the wire."""
    out = io.BytesIO()
    write_event(event, out)
    return out.getvalue()
