"""OpenAI-compatible HTTP speech endpoint (aiohttp), beside the WebSocket, same inference loop.

``POST /v1/audio/speech`` takes OpenAI's JSON body, turns it into a
:class:`~server.streams.request.SpeechRequest` and opens one more stream through
:class:`~server.streams.service.SpeechService` (same validation, limits, engine and
encoders as the WebSocket path). The audio goes out as a chunked body while
it is generated, read by the service's one outbox reader (I/O glue only).
A client that disconnects cancels its stream: HTTP streams cannot be
resumed, so they are freed at once. ``GET /v1/models`` and
``GET /v1/audio/voices`` are for discovery. Errors use OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, with our wire codes.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import struct
from contextlib import aclosing
from typing import Final

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler

from server.config import Settings
from server.errors import ServiceError, UnknownVoice
from server.frontends import messages
from server.frontends.access import AccessDenied, AccessGate, tenant_of
from server.frontends.codes import code_of
from server.frontends.common import (
    RefinePrompt,
    Seed,
    SendAborted,
    ServerInfo,
    Temperature,
    TopK,
    TopP,
    abort_transport,
    send_within,
)
from server.frontends.elevenlabs.routes import PREFIX as ELEVENLABS_PREFIX
from server.frontends.elevenlabs.routes import ElevenLabsApi
from server.frontends.http.accesslog import SERVER_LOG, RedactedAccessLogger
from server.frontends.http.common import (
    CLIENT,
    body_refused,
    counted_error,
    error_response,
    refusal,
    service_error,
)
from server.frontends.http.cors import Cors
from server.frontends.http.transfer import BodyRefused, read_body, streamed_response
from server.frontends.http.voices import VoicesApi
from server.frontends.messages import BadMessage
from server.frontends.ports import GuardedProtocol, PortGuard
from server.metrics import Metrics
from server.streams.items import Failure, Frame
from server.streams.request import SpeechRequest
from server.streams.service import SpeechService
from server.streams.stream import Lease, Stream

log = logging.getLogger(__name__)

#: OpenAI ``response_format`` → (our format, default rate, Content-Type). OpenAI's ``opus`` is Ogg Opus.
FORMATS: Final = {
    "pcm": ("pcm16", 24_000, "audio/pcm"),
    "wav": ("pcm16", 24_000, "audio/wav"),
    "opus": ("ogg", 24_000, "audio/ogg; codecs=opus"),
    "mp3": ("mp3", 24_000, "audio/mpeg"),
    "flac": ("flac", 24_000, "audio/flac"),
    # Not OpenAI's: G.711 μ-law for telephony; audio/basic is 8 kHz mono μ-law (RFC 2046).
    "mulaw": ("mulaw", 8_000, "audio/basic"),
}
#: OpenAI's default. (``aac`` is not produced: see docs/protocol.md, Formats.)
DEFAULT_FORMAT: Final = "mp3"
#: Model names accepted (any string is; these are advertised). All are the same ChatTTS model.
MODELS: Final = ("chattts", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
#: OpenAI's speed range; values inside it are clamped to ours (0.5–2.0).
OPENAI_SPEED: Final = (0.25, 4.0)
OUR_SPEED: Final = (0.5, 2.0)


class VoiceRef(msgspec.Struct, forbid_unknown_fields=False):
    """OpenAI's custom-voice object form, ``{"id": "..."}``."""

    id: str


class SpeechBody(msgspec.Struct, forbid_unknown_fields=False):
    """The body of ``POST /v1/audio/speech``; unknown fields are ignored."""

    input: str
    model: str = "chattts"
    voice: str | VoiceRef = "alloy"
    response_format: str = DEFAULT_FORMAT
    speed: float = 1.0
    instructions: str | None = None  # accepted; ChatTTS has no instruction control
    stream_format: str = "audio"
    seed: Seed | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    sample_rate: int | None = None  # extension: 16000, 24000 or 48000
    refine: bool = False  # extension: ChatTTS's refinement pass first
    refine_prompt: RefinePrompt = ""  # extension: its controls, "[oral_2][laugh_0][break_6]"


_decoder: Final = msgspec.json.Decoder(SpeechBody)
_PARAM = re.compile(r"\$\.(\w+)|field `(\w+)`")


def wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header for a stream of unknown length (RIFF and data sizes 0xFFFFFFFF)."""
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    unknown = struct.pack("<I", 0xFFFFFFFF)
    return b"RIFF" + unknown + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + unknown


def _param_of(text: str) -> str | None:
    match = _PARAM.search(text)
    return (match.group(1) or match.group(2)) if match else None


class BodyError(Exception):
    """A request body problem, naming the offending field (OpenAI's ``param``)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class _ClientGone(Exception):
    """The client disconnected, stopped reading, or the stream failed after the headers went out."""


class _StreamFailed(Exception):
    """The stream failed; its error goes out as JSON if no audio has yet."""

    def __init__(self, error: ServiceError) -> None:
        super().__init__(error.message)
        self.error = error


class HttpApi:
    """The aiohttp server for the OpenAI-compatible routes, on the app's event loop.

    Every connection is held to ``guard`` (the port's caps; per client by IP unless the
    client IP comes from ``X-Forwarded-For``), must send a request head within
    ``--header-timeout-s`` of opening or of its previous response (aiohttp's keep-alive
    clock, which runs from the connection's start), and a body within ``--body-timeout-s``.
    """

    def __init__(
        self,
        service: SpeechService,
        info: ServerInfo,
        gate: AccessGate,
        settings: Settings,
        metrics: Metrics,
        guard: PortGuard,
    ) -> None:
        self.service = service
        self.info = info
        self.gate = gate
        self.settings = settings
        self.metrics = metrics
        self.guard = guard
        self.cors = Cors(gate.allowed_origins)
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None
        self.port: int | None = None  # bound port once started; None when off
        self.elevenlabs: ElevenLabsApi | None = None  # its routes (--elevenlabs)

    async def start(self, sock: socket.socket) -> None:
        """Serve on ``sock`` (bound by the app, so that a busy port fails before the model loads)."""
        s = self.settings
        web_app = web.Application(client_max_size=s.max_message_bytes, middlewares=[self._guard])
        web_app.router.add_post("/v1/audio/speech", self.speech)
        web_app.router.add_get("/v1/models", self.models)
        web_app.router.add_get("/v1/audio/voices", self.voices)
        VoicesApi(self.service, s, self.metrics).add_routes(web_app)
        web_app.on_response_prepare.append(self.cors.on_response_prepare)
        if self.settings.elevenlabs:  # ElevenLabs' API beside OpenAI's, on the same base URL
            self.elevenlabs = ElevenLabsApi(self.service, self.info, self.gate, self.settings, self.metrics)
            self.elevenlabs.add_routes(web_app)
        # handler_cancellation: a client that disconnects cancels its handler at once, even
        # while the handler waits for audio, so its generation stops within one block.
        self._runner = web.AppRunner(
            web_app,
            handler_cancellation=True,
            shutdown_timeout=1.0,
            keepalive_timeout=s.header_timeout_s,
            lingering_time=min(10.0, s.body_timeout_s),
            access_log_class=RedactedAccessLogger,
            logger=SERVER_LOG,
        )
        await self._runner.setup()
        server = self._runner.server
        assert server is not None

        def answer(why: str) -> bytes:
            return refusal("too_many_connections", f"{why}; retry later")

        per_client = not s.trust_forwarded_for  # behind a proxy every peer is the proxy

        def connection() -> asyncio.Protocol:
            return GuardedProtocol(server(), self.guard, answer, per_client=per_client)

        self._server = await asyncio.get_running_loop().create_server(connection, sock=sock)
        self.port = int(sock.getsockname()[1])
        log.info("OpenAI-compatible HTTP on http://%s:%d/v1", s.host, self.port)

    async def close_idle(self) -> None:
        """A drain started: close the ElevenLabs WebSockets that have no context."""
        if self.elevenlabs is not None:
            await self.elevenlabs.close_idle()

    async def stop(self) -> None:
        """Stop listening; responses still running are cancelled (their streams freed)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """CORS preflights; API keys and origins as on the WebSocket; aiohttp's errors in OpenAI's shape."""
        if (answer := self.cors.preflight(request)) is not None:
            return answer
        if request.path.startswith(ELEVENLABS_PREFIX) and self.elevenlabs is not None:
            return await handler(request)  # its own key (xi-api-key, or a WebSocket's first message)
        try:
            request[CLIENT] = self.gate.admit(request.path_qs, request.headers, request.remote or "?")
        except AccessDenied as denied:
            if denied.kind == "unauthorized":
                return error_response(401, "invalid_api_key", denied.message)
            return error_response(403, "forbidden", denied.message)
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(exc.status, "bad_request", f"{request.method} {request.path}: {exc.reason}")

    # --- discovery -----------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: every name is the same ChatTTS model."""
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "chattts-stream"} for m in MODELS]
        return web.json_response({"object": "list", "data": data})

    async def voices(self, request: web.Request) -> web.Response:
        """``GET /v1/audio/voices``: every port's voice list, each name with the voice it speaks with."""
        data: list[dict[str, object]] = [
            {"id": e.name, "voice": e.voice}
            if e.recording is None
            else {**e.recording.describe(), "voice": e.voice}
            for e in self.service.catalog.entries(tenant_of(request[CLIENT]))
        ]
        return web.json_response(
            {"object": "list", "data": data, "formats": list(FORMATS), "also": ["seed:<int>", "<speaker>"]}
        )

    # --- speech --------------------------------------------------------------------

    async def speech(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/audio/speech``: validate, open a stream, send its audio as it comes."""
        lease = Lease(lambda reason: self._abort(request, reason))
        try:
            self.service.check_accepting()
            s = self.settings
            raw = await read_body(request, max_bytes=s.max_message_bytes, timeout_s=s.body_timeout_s)
            body, fmt = _parse(raw, self.settings.max_json_depth)
            client = request[CLIENT]
            stream = self.service.open(
                _request_of(body, fmt), lease, resumable=False, client=client, owner=tenant_of(client)
            )
        except BodyRefused as refused:
            return body_refused(self.metrics, refused)
        except BodyError as err:
            return counted_error(self.metrics, 400, err.code, err.message, param=err.param)
        except ServiceError as exc:
            return service_error(exc, self.metrics, param="voice" if isinstance(exc, UnknownVoice) else None)
        try:
            return await self._send_audio(request, stream, lease, FORMATS[fmt][2])
        except _ClientGone:
            return web.Response()  # never sent: aiohttp finds the connection gone
        finally:
            # Cancelled too (client gone, server stopping): nothing can resume an HTTP stream.
            self.service.abandon(stream)

    async def _send_audio(
        self, request: web.Request, stream: Stream, lease: Lease, content_type: str
    ) -> web.StreamResponse:
        """Send every frame payload as it appears; all ready frames go out in one chunk.

        The headers wait for the first audio, so a stream that fails before any gets a
        JSON error; one that fails later is cut off (the chunked body never ends cleanly).
        """
        outbox = stream.outbox
        response = streamed_response(request, content_type)

        try:
            async with aclosing(stream.deliver(lease, outbox.sent_index)) as runs:
                async for items in runs:
                    chunk = bytearray()
                    for item in items:
                        if isinstance(item, Frame):
                            chunk += item.payload
                        elif isinstance(item, Failure):
                            raise _StreamFailed(item.error)
                    if chunk or (outbox.ended and not response.prepared):
                        if not response.prepared:
                            await response.prepare(request)
                            if content_type == "audio/wav":
                                chunk[:0] = wav_header(outbox.sample_rate)
                        await self._write(request, response, bytes(chunk))
        except _StreamFailed as failed:
            if not response.prepared:
                return service_error(failed.error, self.metrics)
            self.metrics.errors.labels(code=code_of(failed.error)).inc()
            self._abort(request, f"stream failed: {code_of(failed.error)}")
            raise _ClientGone from None
        try:
            await response.write_eof()
        except ConnectionError:
            raise _ClientGone from None
        return response

    async def _write(self, request: web.Request, response: web.StreamResponse, data: bytes) -> None:
        try:
            timeout = self.settings.send_timeout_s
            await send_within(response.write(data), timeout, lambda reason: self._abort(request, reason))
        except (SendAborted, ConnectionError):  # aiohttp's ClientConnectionResetError is a ConnectionError
            raise _ClientGone from None
        self.metrics.bytes_sent.inc(len(data))

    def _abort(self, request: web.Request, reason: str) -> None:
        """Drop the client's TCP connection (a reader that falls behind, or a failed stream)."""
        abort_transport(request.transport, self.metrics, f"HTTP response to {request.remote}", reason)


def _parse(raw: bytes, max_depth: int) -> tuple[SpeechBody, str]:
    """The body, decoded (the HTTP API's one JSON decoding path) and checked.

    Raises:
        BodyError: naming the problem, and the field when there is one.
    """
    try:
        body = messages.decode(raw, _decoder, max_depth=max_depth)
    except BadMessage as bad:
        if bad.validation is None:  # malformed, too deep, or a number out of range
            raise BodyError("bad_request", bad.message, bad.field) from None
        raise BodyError("bad_request", f"invalid body: {bad.validation}", _param_of(bad.validation)) from None
    fmt = body.response_format
    if fmt not in FORMATS:
        message = f"response_format {fmt!r} is not supported; use one of {list(FORMATS)}"
        raise BodyError("unsupported", message, "response_format")
    if body.stream_format != "audio":
        raise BodyError("unsupported", "only stream_format 'audio' is supported (no 'sse')", "stream_format")
    if not OPENAI_SPEED[0] <= body.speed <= OPENAI_SPEED[1]:
        low, high = OPENAI_SPEED
        raise BodyError("bad_request", f"speed must be within {low} and {high}", "speed")
    return body, fmt


def _request_of(body: SpeechBody, fmt: str) -> SpeechRequest:
    our_format, rate, _ = FORMATS[fmt]
    voice = body.voice.id if isinstance(body.voice, VoiceRef) else body.voice
    return SpeechRequest(
        name="http",
        text=body.input,
        voice=voice,  # the stream layer resolves it (OpenAI's names too), as for every port
        speed=min(OUR_SPEED[1], max(OUR_SPEED[0], body.speed)),
        format=our_format,
        sample_rate=body.sample_rate or rate,
        seed=body.seed,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        refine=body.refine,
        refine_prompt=body.refine_prompt,
    )
