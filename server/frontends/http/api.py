"""OpenAI-compatible HTTP speech endpoint (aiohttp), beside the WebSocket, same inference loop.

``POST /v1/audio/speech`` takes OpenAI's JSON body, turns it into a
:class:`~server.streams.request.SpeechRequest` and opens one more stream through
:class:`~server.streams.service.SpeechService` (same validation, limits, engine and
encoders as the WebSocket path). The audio goes out as a chunked body while
it is generated, or (``"stream": false``, FLAC's default) as the complete file with its
length once the stream has ended (:mod:`server.frontends.http.files`), read by the service's
one outbox reader (I/O glue only). The body's meaning is :mod:`server.frontends.http.speech_body`.
A client that disconnects cancels its stream: HTTP streams cannot be
resumed, so they are freed at once. ``GET /v1/models`` and
``GET /v1/audio/voices`` are for discovery. Errors use OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, with our wire codes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from contextlib import aclosing
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler

from server.config import Settings
from server.errors import ServiceError, UnknownVoice
from server.frontends.access import AccessDenied, AccessGate, tenant_of
from server.frontends.codes import code_of
from server.frontends.common import SendAborted, ServerInfo, abort_transport, send_within
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
from server.frontends.http.files import complete_file, live_head, pieces
from server.frontends.http.speech_body import FORMATS, MODELS, BodyError, parse_body, speech_request
from server.frontends.http.transfer import BodyRefused, read_body, streamed_response
from server.frontends.http.voices import VoicesApi
from server.frontends.ports import GuardedProtocol, PortGuard
from server.metrics import Metrics
from server.streams.items import Done, Failure, Frame
from server.streams.lifecycle import Lease
from server.streams.service import SpeechService
from server.streams.stream import Stream

log = logging.getLogger(__name__)
#: A complete response goes out in writes of about this many bytes, each within ``--send-timeout-s``.
COMPLETE_WRITE_BYTES: Final = 64 * 1024


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
        """``POST /v1/audio/speech``: validate, open a stream, send its audio (live or complete)."""
        lease = Lease(lambda reason: self._abort(request, reason))
        try:
            self.service.check_accepting()
            s = self.settings
            raw = await read_body(request, max_bytes=s.max_message_bytes, timeout_s=s.body_timeout_s)
            body = parse_body(raw, self.settings.max_json_depth)
            client = request[CLIENT]
            stream = self.service.open(
                speech_request(body), lease, resumable=False, client=client, owner=tenant_of(client)
            )
        except BodyRefused as refused:
            return body_refused(self.metrics, refused)
        except BodyError as err:
            return counted_error(self.metrics, 400, err.code, err.message, param=err.param)
        except ServiceError as exc:
            return service_error(exc, self.metrics, param="voice" if isinstance(exc, UnknownVoice) else None)
        try:
            if body.live:
                return await self._send_live(request, stream, lease, body.response_format)
            return await self._send_complete(request, stream, lease, body.response_format)
        except _ClientGone:
            return web.Response()  # never sent: aiohttp finds the connection gone
        finally:
            # Cancelled too (client gone, server stopping): nothing can resume an HTTP stream.
            self.service.abandon(stream)

    async def _send_live(
        self, request: web.Request, stream: Stream, lease: Lease, response_format: str
    ) -> web.StreamResponse:
        """Send every frame payload as it appears; all ready frames go out in one chunk.

        The headers wait for the first audio, so a stream that fails before any gets a
        JSON error; one that fails later is cut off (the chunked body never ends cleanly).
        """
        outbox = stream.outbox
        response = streamed_response(request, FORMATS[response_format][2])
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
                            chunk[:0] = live_head(response_format, outbox.sample_rate)
                        await self._write(request, response, bytes(chunk))
        except _StreamFailed as failed:
            return self._failed(request, response, failed.error)
        return await self._end(response)

    async def _send_complete(
        self, request: web.Request, stream: Stream, lease: Lease, response_format: str
    ) -> web.StreamResponse:
        """Send the whole file with its length (``Content-Length``) once the stream has ended.

        Until then the stream's outbox holds every item, counted in the memory budget like any
        unsent audio (:meth:`Outbox.hold_until_ended <server.streams.outbox.Outbox>`); a stream
        that fails gets a JSON error, never a short file.
        """
        response = web.StreamResponse(
            headers={"Content-Type": FORMATS[response_format][2], "Cache-Control": "no-store"}
        )
        try:
            async with aclosing(stream.deliver(lease, stream.outbox.sent_index, whole=True)) as runs:
                async for items in runs:  # one run: every item, the stream has ended
                    if failed := next((item for item in items if isinstance(item, Failure)), None):
                        raise _StreamFailed(failed.error)
                    payloads = [item.payload for item in items if isinstance(item, Frame)]
                    samples = next((item.samples for item in items if isinstance(item, Done)), 0)
                    parts = complete_file(response_format, payloads, samples, stream.sample_rate)
                    response.content_length = sum(map(len, parts))
                    await response.prepare(request)
                    for piece in pieces(parts, COMPLETE_WRITE_BYTES):
                        await self._write(request, response, piece)
        except _StreamFailed as failed:
            return self._failed(request, response, failed.error)
        return await self._end(response)

    def _failed(
        self, request: web.Request, response: web.StreamResponse, error: ServiceError
    ) -> web.Response:
        """A failed stream: its JSON error if nothing was sent yet, else the connection is cut.

        Raises:
            _ClientGone: the headers had gone out (the connection is aborted).
        """
        if not response.prepared:
            return service_error(error, self.metrics)
        self.metrics.errors.labels(code=code_of(error)).inc()
        self._abort(request, f"stream failed: {code_of(error)}")
        raise _ClientGone from None

    @staticmethod
    async def _end(response: web.StreamResponse) -> web.StreamResponse:
        if not response.prepared:  # the stream was freed before its audio (the memory budget)
            raise _ClientGone  # and its connection aborted
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
