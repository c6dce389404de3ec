"""ElevenLabs' REST text-to-speech: ``POST /v1/text-to-speech/{voice_id}[/stream[/with-timestamps]]``.

One request is one stream of the service (like the OpenAI endpoint): the JSON body's ``text``,
the path's voice, ``output_format`` from the query, ``seed`` and ``voice_settings.speed`` from
the body (the other settings are accepted and ignored). The audio goes out as a chunked body
while it is generated (``Content-Type`` ``audio/*``, which livekit-plugins-elevenlabs checks);
``/stream/with-timestamps`` sends one JSON object per line instead, ``{"audio_base64",
"alignment", "normalized_alignment"}``, the alignment of each segment (its characters' times in
seconds from the response's start) on the line that carries its last audio. A stream that fails
before any audio gets a JSON error; one that fails later is cut off (the chunked body never ends).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from contextlib import aclosing
from typing import Annotated, Any

import msgspec
from aiohttp import web

from server.errors import ServiceError
from server.frontends import messages
from server.frontends.codes import code_of
from server.frontends.common import Seed, SendAborted, send_within
from server.frontends.elevenlabs.alignment import rest_alignment
from server.frontends.elevenlabs.formats import ElevenLabsError, OutputFormat, VoiceSettings, speed_of
from server.frontends.http.transfer import streamed_response
from server.frontends.messages import BadMessage
from server.streams.items import Failure, Frame, OutItem, Words
from server.streams.lifecycle import Lease
from server.streams.request import SpeechRequest
from server.streams.stream import Stream


class SpeechBody(msgspec.Struct, forbid_unknown_fields=False):
    """ElevenLabs' request body; its other fields (model_id, language_code, …) are accepted and ignored."""

    text: Annotated[str, msgspec.Meta(min_length=1)]
    voice_settings: VoiceSettings | None = None
    seed: Seed | None = None


_decoder = msgspec.json.Decoder(SpeechBody)


def parse_body(raw: bytes, *, max_depth: int) -> SpeechBody:
    """The body of a text-to-speech request, through every front end's decoding path.

    Raises:
        ElevenLabsError: not JSON within the nesting and number bounds (``max_depth``:
            ``--max-json-depth``), ``text`` missing or of the wrong type, or ``voice_settings``
            not an object of numbers within their ranges (400).
    """
    try:
        return messages.decode(raw, _decoder, max_depth=max_depth)
    except BadMessage as bad:
        detail = bad.message if bad.validation is None else f"invalid body: {bad.validation}"
        raise ElevenLabsError(400, "invalid_request", detail) from None


def speech_request(body: SpeechBody, voice: str, output: OutputFormat, seed: int | None) -> SpeechRequest:
    """The service's request for a REST body (``seed``: the server's when the body has none)."""
    return SpeechRequest(
        name="elevenlabs",
        text=body.text,
        voice=voice,
        speed=speed_of(body.voice_settings),
        format=output.format,
        sample_rate=output.sample_rate,
        seed=body.seed if body.seed is not None else seed,
        word_timestamps=True,
    )


class ClientGone(Exception):
    """The client went away, stopped reading, or the stream failed after the headers went out."""


async def send_stream(
    request: web.Request,
    stream: Stream,
    lease: Lease,
    output: OutputFormat,
    *,
    timestamps: bool,
    send_timeout_s: float,
    abort: Callable[[str], None],
    on_error: Callable[[ServiceError], web.Response],
    on_bytes: Callable[[int], None],
) -> web.StreamResponse:
    """Send the stream's audio (or its timestamped lines) as it comes; returns the response.

    Raises:
        ClientGone: the response could not be finished (the connection is dropped).
    """
    content_type = "application/json" if timestamps else output.content_type
    response = streamed_response(request, content_type)

    async def write(data: bytes) -> None:
        if not response.prepared:
            await response.prepare(request)
        try:
            await send_within(response.write(data), send_timeout_s, abort)
        except (SendAborted, ConnectionError):
            raise ClientGone from None
        on_bytes(len(data))

    render: Callable[[list[OutItem]], bytes] = _lines(output) if timestamps else _payloads
    async with aclosing(stream.deliver(lease, stream.outbox.sent_index)) as runs:
        async for items in runs:
            failure = next((item.error for item in items if isinstance(item, Failure)), None)
            if failure is not None:
                if not response.prepared:
                    return on_error(failure)
                abort(f"stream failed: {code_of(failure)}")
                raise ClientGone
            data = render(items)
            if data or (stream.outbox.ended and not response.prepared):
                await write(data)
    try:
        await response.write_eof()
    except ConnectionError:
        raise ClientGone from None
    return response


def _payloads(items: list[OutItem]) -> bytes:
    return b"".join(item.payload for item in items if isinstance(item, Frame))


def _lines(output: OutputFormat) -> Callable[[list[OutItem]], bytes]:
    """One JSON line per run with audio: the audio, and the alignment of the segments timed before it.

    A segment's words come before the frame of its last sample, so they ride on that line.
    """
    rate = output.sample_rate
    pending: list[Words] = []

    def render(items: list[OutItem]) -> bytes:
        pending.extend(item for item in items if isinstance(item, Words))
        audio = _payloads(items)
        if not audio:
            return b""
        alignment = _joined([rest_alignment(w, rate) for w in pending])
        pending.clear()
        line = {
            "audio_base64": base64.b64encode(audio).decode("ascii"),
            "alignment": alignment,
            "normalized_alignment": alignment,
        }
        return json.dumps(line).encode() + b"\n"

    return render


def _joined(alignments: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not alignments:
        return None
    return {key: [v for a in alignments for v in a[key]] for key in alignments[0]}
