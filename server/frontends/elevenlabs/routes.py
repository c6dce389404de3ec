"""ElevenLabs' text-to-speech API on the HTTP API's port: its routes, access, bounds and drain.

``/v1/text-to-speech/{voice_id}/stream-input`` and ``/multi-stream-input`` (WebSockets) and
``POST /v1/text-to-speech/{voice_id}``, ``/stream``, ``/stream/with-timestamps`` (REST), beside
the OpenAI endpoint, so that every ElevenLabs integration (pipecat, LiveKit, ElevenLabs' SDKs)
speaks ChatTTS by changing its base URL. The key is ElevenLabs' ``xi-api-key`` header (or the
WebSocket's first message's ``xi_api_key``; ``Authorization: Bearer`` works too), checked
against our API keys by the same gate as every front end; voices are ours (``default``,
``seed:<n>``, OpenAI's names, voices from recordings), an unknown one answered as ElevenLabs
does (404 ``voice_not_found``). Refusals use ElevenLabs' shape ``{"detail": {"status",
"message"}}`` with our codes. WebSockets count against ``--max-connections`` (and the per-client
cap); a drain closes idle ones with 1012 and refuses new ones (503).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Final

from aiohttp import web

from server.config import Settings
from server.errors import ServiceError, UnknownVoice
from server.frontends.access import AccessDenied, AccessGate, tenant_of
from server.frontends.codes import code_of
from server.frontends.common import ServerInfo, abort_transport
from server.frontends.elevenlabs import rest
from server.frontends.elevenlabs.formats import (
    ElevenLabsError,
    OutputFormat,
    output_format,
    unknown_voice,
)
from server.frontends.elevenlabs.session import ElevenLabsSession, SocketOptions
from server.frontends.elevenlabs.socket import ElevenLabsSocket
from server.frontends.http.common import STATUS
from server.frontends.http.transfer import BodyRefused, read_body, refused_response
from server.frontends.messages import BadMessage, InvalidBudget, query_int
from server.metrics import Metrics
from server.streams.lifecycle import Lease
from server.streams.service import SpeechService

log = logging.getLogger(__name__)
PREFIX: Final = "/v1/text-to-speech/"
#: ElevenLabs' ``inactivity_timeout``: 20 s by default, at most 180.
INACTIVITY_S: Final = (20, 180)


def error_response(error: ElevenLabsError, metrics: Metrics) -> web.Response:
    """A refusal in ElevenLabs' shape (counted by code)."""
    metrics.errors.labels(code=error.code).inc()
    return web.json_response(error.body(), status=error.status, headers={"Cache-Control": "no-store"})


def service_refusal(exc: ServiceError) -> ElevenLabsError:
    """A domain error as ElevenLabs' answer (our wire code as its ``status``)."""
    code = code_of(exc)
    return ElevenLabsError(STATUS.get(code, 500), code, exc.message)


class ElevenLabsApi:
    """The ElevenLabs routes, added to the HTTP API's aiohttp application."""

    def __init__(
        self, service: SpeechService, info: ServerInfo, gate: AccessGate, settings: Settings, metrics: Metrics
    ) -> None:
        self.service = service
        self.info = info
        self.gate = gate
        self.settings = settings
        self.metrics = metrics
        self.sockets: set[ElevenLabsSocket] = set()
        self._seed = settings.elevenlabs_seed if settings.elevenlabs_seed >= 0 else None

    def add_routes(self, app: web.Application) -> None:
        """Serve the WebSocket and REST routes on ``app``."""
        app.router.add_get(PREFIX + "{voice_id}/stream-input", self.stream_input)
        app.router.add_get(PREFIX + "{voice_id}/multi-stream-input", self.multi_stream_input)
        app.router.add_post(PREFIX + "{voice_id}", self.speech)
        app.router.add_post(PREFIX + "{voice_id}/stream", self.speech)
        app.router.add_post(PREFIX + "{voice_id}/stream/with-timestamps", self.speech_with_timestamps)
        app.on_shutdown.append(self._shut_down)

    # --- access and the URL ----------------------------------------------------------

    def _admit(self, request: web.Request, key: str | None = None) -> str:
        """The client's identity; ``xi-api-key`` (or ``key``, from a first message) is its API key.

        Raises:
            AccessDenied: no valid key, or an origin not allowed.
        """
        headers: Mapping[str, str] = request.headers
        key = key or headers.get("xi-api-key")
        if key:
            headers = {**headers, "X-API-Key": key}
        return self.gate.admit(request.path_qs, headers, request.remote or "?")

    def _voice(self, request: web.Request, client: str | None) -> str:
        """The URL's voice, if ``client``'s tenant may speak it (None: a key sent later).

        Checked here so that an unknown voice is ElevenLabs' 404 before a socket opens; each
        stream's opening resolves the name again, for its tenant, as on every port.
        """
        voice_id = request.match_info["voice_id"]
        try:
            self.service.catalog.resolve(voice_id, None if client is None else tenant_of(client))
        except UnknownVoice as unknown:
            raise unknown_voice(unknown) from None
        return voice_id

    def _output(self, request: web.Request) -> OutputFormat:
        return output_format(request.query.get("output_format"))

    def _denied(self, denied: AccessDenied) -> ElevenLabsError:
        if denied.kind == "unauthorized":
            return ElevenLabsError(401, "invalid_api_key", "Invalid API key: send it as xi-api-key")
        return ElevenLabsError(403, "forbidden", denied.message)

    # --- REST -----------------------------------------------------------------------

    async def speech(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/text-to-speech/{voice_id}`` and ``/stream``: the audio, as it is made."""
        return await self._speech(request, timestamps=False)

    async def speech_with_timestamps(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/text-to-speech/{voice_id}/stream/with-timestamps``: JSON lines, audio and alignment."""
        return await self._speech(request, timestamps=True)

    async def _speech(self, request: web.Request, *, timestamps: bool) -> web.StreamResponse:
        lease = Lease(lambda reason: self._abort(request, reason))
        try:
            client = self._admit(request)
            self.service.check_accepting()
            voice, output = self._voice(request, client), self._output(request)
            s = self.settings
            raw = await read_body(request, max_bytes=s.max_message_bytes, timeout_s=s.body_timeout_s)
            body = rest.parse_body(raw, max_depth=s.max_json_depth)
            stream = self.service.open(
                rest.speech_request(body, voice, output, self._seed),
                lease,
                resumable=False,
                client=client,
                owner=tenant_of(client),
            )
        except AccessDenied as denied:
            return error_response(self._denied(denied), self.metrics)
        except BodyRefused as refused:
            error = ElevenLabsError(refused.status, refused.code, refused.message)
            return refused_response(error_response(error, self.metrics))
        except ElevenLabsError as err:
            return error_response(err, self.metrics)
        except ServiceError as exc:
            return error_response(service_refusal(exc), self.metrics)
        try:
            return await rest.send_stream(
                request,
                stream,
                lease,
                output,
                timestamps=timestamps,
                send_timeout_s=self.settings.send_timeout_s,
                abort=lambda reason: self._abort(request, reason),
                on_error=lambda exc: error_response(service_refusal(exc), self.metrics),
                on_bytes=self.metrics.bytes_sent.inc,
            )
        except rest.ClientGone:
            return web.Response()  # never sent: aiohttp finds the connection gone
        finally:
            self.service.abandon(stream)  # HTTP streams cannot be resumed: freed at once

    def _abort(self, request: web.Request, reason: str) -> None:
        abort_transport(request.transport, self.metrics, f"ElevenLabs request from {request.remote}", reason)

    # --- WebSockets -------------------------------------------------------------------

    async def stream_input(self, request: web.Request) -> web.StreamResponse:
        """``/v1/text-to-speech/{voice_id}/stream-input``: one context, until its text ends."""
        return await self._socket(request, multi=False)

    async def multi_stream_input(self, request: web.Request) -> web.StreamResponse:
        """``/v1/text-to-speech/{voice_id}/multi-stream-input``: contexts by ``context_id``."""
        return await self._socket(request, multi=True)

    async def _socket(self, request: web.Request, *, multi: bool) -> web.StreamResponse:
        s = self.settings
        try:
            client = self._handshake_client(request)
            self.service.check_accepting()
            options = SocketOptions(
                multi=multi,
                voice=self._voice(request, client),
                output=self._output(request),
                auto_mode=request.query.get("auto_mode", "false").lower() == "true",
                seed=self._query_seed(request),
                max_contexts=self.info.max_streams,
            )
            inactivity = self._inactivity_s(request)
            if len(self.sockets) >= s.max_connections:
                raise ElevenLabsError(503, "too_many_connections", "too many connections")
        except AccessDenied as denied:
            return error_response(self._denied(denied), self.metrics)
        except ElevenLabsError as err:
            return error_response(err, self.metrics)
        except ServiceError as exc:
            return error_response(service_refusal(exc), self.metrics)
        identity = client or f"ip:{request.remote}"  # the per-client cap before the key is known
        limiter = self.service.limiter
        if not limiter.open_connection(identity):
            return error_response(
                ElevenLabsError(429, "too_many_connections", "too many connections"), self.metrics
            )
        try:
            return await self._serve(request, options, client, inactivity)
        finally:
            limiter.close_connection(identity)

    async def _serve(
        self, request: web.Request, options: SocketOptions, client: str | None, inactivity: float
    ) -> web.StreamResponse:
        s = self.settings
        ws = web.WebSocketResponse(max_msg_size=s.max_message_bytes, heartbeat=20.0, compress=False)
        await ws.prepare(request)

        def admit_key(key: str | None) -> str:
            try:
                return self._admit(request, key)
            except AccessDenied as denied:
                raise PermissionError(self._denied(denied).message) from None

        session = ElevenLabsSession(
            self.service,
            options,
            client=client,
            admit_key=admit_key,
            abort=lambda reason: socket.abort(reason),
            count_error=lambda code: self.metrics.errors.labels(code=code).inc(),
            invalid=InvalidBudget(s.invalid_messages_per_s),
        )
        socket = ElevenLabsSocket(
            request,
            ws,
            session,
            send_timeout_s=s.send_timeout_s,
            inactivity_s=inactivity,
            max_json_depth=s.max_json_depth,
            metrics=self.metrics,
        )
        self.sockets.add(socket)
        try:
            await socket.run()
        finally:
            self.sockets.discard(socket)
        return ws

    def _handshake_client(self, request: web.Request) -> str | None:
        """The client, when the handshake carries a key (or none is needed); None: the first message's.

        Raises:
            AccessDenied: a key that is not valid, or an origin not allowed.
        """
        has_key = "xi-api-key" in request.headers or "Authorization" in request.headers
        if self.gate.api_keys.required and not has_key and "api_key" not in request.query:
            return None
        return self._admit(request)

    def _query_seed(self, request: web.Request) -> int | None:
        seed = _query_int(request, "seed", 0, 2**63 - 1)
        return self._seed if seed is None else seed

    @staticmethod
    def _inactivity_s(request: web.Request) -> float:
        """ElevenLabs' ``inactivity_timeout``: an integer, brought within 1 to 180 s (its default 20)."""
        default, most = INACTIVITY_S
        seconds = _query_int(request, "inactivity_timeout", 1, most, clamp=True)
        return float(default if seconds is None else seconds)

    # --- drain and stop -------------------------------------------------------------------

    async def close_idle(self) -> None:
        """A drain started: close the sockets that have no context."""
        for socket in list(self.sockets):
            await socket.close_if_idle()

    async def _shut_down(self, app: web.Application) -> None:
        """The HTTP API stops: close every socket (1012); running contexts are cut."""
        for socket in list(self.sockets):
            with contextlib.suppress(ConnectionError):
                await socket.shut_down()


def _query_int(request: web.Request, name: str, low: int, high: int, *, clamp: bool = False) -> int | None:
    """An integer query parameter (the shared rule: ASCII digits, bounded), refused as ElevenLabs does.

    Raises:
        ElevenLabsError: 400 ``bad_request`` naming the parameter and its range.
    """
    try:
        return query_int(request.query, name, low, high, clamp=clamp)
    except BadMessage as bad:
        raise ElevenLabsError(400, "bad_request", bad.message) from None
