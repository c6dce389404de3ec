"""The server process: WebSocket endpoint, HTTP routes, start-up and graceful drain.

``App`` wires settings, the scheduler (which owns the engine) and the
``websockets`` server. HTTP on the same port (``/health``, ``/ready``,
``/metrics``, the demo page) is answered from ``process_request`` before any
WebSocket handshake; ``/v1/stream`` continues to the handshake.
"""

from __future__ import annotations

import asyncio
import http
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from server import protocol
from server.audio import SUPPORTED_FORMATS, SUPPORTED_RATES
from server.config import Settings
from server.connection import Connection
from server.engine.base import Engine
from server.http_api import HttpApi
from server.limits import ApiKeys, client_identity, client_ip, origin_allowed, presented_key
from server.metrics import Metrics
from server.scheduler import Scheduler, SchedulerConfig
from server.service import SpeechService
from server.warmup import warm_up

log = logging.getLogger(__name__)

STREAM_PATH = "/v1/stream"
#: /health fails when the inference thread has not looped for this long.
HEARTBEAT_STALE_S = 120.0
#: How often a drain checks whether the running streams are done.
DRAIN_POLL_S = 0.05
DEMO_DIR = Path(__file__).resolve().parent.parent / "client_js"


def build_engine_factory(settings: Settings) -> Callable[[], Engine]:
    """The engine constructor for ``settings`` (called on the inference thread)."""
    if settings.engine == "fake":
        from server.engine.fake import FakeEngine

        return lambda: FakeEngine(
            step_base_s=settings.fake_step_ms / 1000, step_per_row_s=settings.fake_row_ms / 1000
        )
    from server.engine.loading import chattts_engine_factory

    return chattts_engine_factory(settings)


class App:
    """One server instance: start it, serve until told to stop, drain, stop."""

    def __init__(self, settings: Settings, *, engine_factory: Callable[[], Engine] | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.scheduler = Scheduler(
            engine_factory or build_engine_factory(settings),
            config=SchedulerConfig(
                max_batch=settings.max_batch,
                max_wait_s=settings.max_wait_ms / 1000,
                max_queue=settings.max_queue,
                lookahead=settings.segment_lookahead,
            ),
            metrics=self.metrics,
            warmup=settings.warmup,
        )
        self.service = SpeechService(settings, self.scheduler, self.metrics)
        self.connections: set[Connection] = set()
        self.warmed_up = asyncio.Event()
        self._warmup_task: asyncio.Task[None] | None = None
        self._server: Server | None = None
        self.api_keys = ApiKeys(_api_keys(settings))
        self.allowed_origins = frozenset(o.strip() for o in settings.allowed_origins.split(",") if o.strip())
        self.http = HttpApi(self)  # OpenAI-compatible HTTP speech API on its own port

    # --- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Load the engine and listen (``/ready`` turns 200 after warm-up)."""
        await self.scheduler.start()
        if self.scheduler.engine_info is not None:
            info = self.scheduler.engine_info
            self.metrics.engine.info({"name": info.name, **info.extra})
        self.service.start()
        self._warmup_task = asyncio.create_task(self._warm_up(), name="warm-up")
        s = self.settings
        self._server = await serve(
            self._handle,
            s.host,
            s.port,
            process_request=self._process_request,
            compression=None,  # audio does not compress; deflate only costs CPU
            max_size=s.max_message_bytes,
            max_queue=16,
            ping_interval=20,
            ping_timeout=20,
            server_header=s.server_name,
        )
        await self.http.start()

    @property
    def port(self) -> int:
        """The bound port (useful with ``port=0``)."""
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def draining(self) -> bool:
        """SIGTERM was received: no new streams, ``/ready`` fails."""
        return self.service.draining

    @property
    def active_streams(self) -> int:
        """Streams not yet delivered (running, being sent, or waiting for a resume)."""
        return self.service.registry.active

    def _busy_streams(self) -> int:
        """Streams a drain waits for: unfinished, or with items left for a live connection."""
        return sum(
            1
            for stream in self.service.registry.all()
            if not stream.session.ended or stream.session.owner is not None
        )

    async def drain(self) -> None:
        """Graceful stop: refuse new streams, let running ones finish, close with 1012."""
        if self.service.draining:
            return
        self.service.draining = True
        log.info(
            "draining: %d active streams, up to %.0f s", self._busy_streams(), self.settings.drain_timeout_s
        )
        for conn in list(self.connections):
            await conn.close_if_idle_while_draining()
        try:
            async with asyncio.timeout(self.settings.drain_timeout_s):
                # The condition spans every stream's state; polling it during a drain is cheap.
                while self._busy_streams():  # noqa: ASYNC110
                    await asyncio.sleep(DRAIN_POLL_S)
        except TimeoutError:
            log.warning("drain timeout: %d streams still running are cut off", self._busy_streams())
        await self.stop()

    async def _warm_up(self) -> None:
        """Typical requests through the real path; ``/ready`` waits for them."""
        if self.settings.warmup:
            while not self.scheduler.ready.is_set():  # bounded waits: stop() must not hang on this
                await asyncio.to_thread(self.scheduler.ready.wait, 0.5)
            await warm_up(self.scheduler)
        self.warmed_up.set()

    async def stop(self) -> None:
        """Close every connection with 1012, stop listening and stop the inference loop."""
        if self._warmup_task is not None:
            self._warmup_task.cancel()
            await asyncio.gather(self._warmup_task, return_exceptions=True)
        await self.http.stop()
        if self._server is not None:
            self._server.close(close_connections=False)
            for conn in list(self.connections):
                await conn.ws.close(1012, "server is restarting")
            await self._server.wait_closed()
        await self.service.stop()
        await self.scheduler.stop()

    async def run_until_signalled(self) -> None:
        """Serve until SIGTERM or SIGINT, then drain and return."""
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("listening on ws://%s:%d%s", self.settings.host, self.port, STREAM_PATH)
        await stop.wait()
        log.info("signal received")
        await self.drain()

    def hello(self) -> dict[str, Any]:
        """The ``hello`` message this server sends first."""
        s = self.settings
        return protocol.hello(
            server=s.server_name,
            sample_rate=24_000,
            sample_rates=list(SUPPORTED_RATES),
            formats=list(SUPPORTED_FORMATS),
            voices=list(self.scheduler.engine_info_voices),
            max_text_chars=s.max_text_chars,
            max_streams=s.max_streams,
            resume_ttl_s=s.resume_ttl_s,
            weights=self.scheduler.engine_info.extra.get("weights") if self.scheduler.engine_info else None,
        )

    @property
    def ready(self) -> bool:
        """Warm-up finished, not draining, and the engine breaker is closed."""
        return (
            self.scheduler.ready.is_set()
            and self.warmed_up.is_set()
            and not self.draining
            and not self.scheduler.breaker_open
        )

    @property
    def healthy(self) -> bool:
        """The inference thread is alive and has looped recently."""
        fresh = time.monotonic() - self.scheduler.heartbeat < HEARTBEAT_STALE_S
        return self.scheduler.alive and fresh

    # --- WebSocket and HTTP --------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        request = ws.request
        assert request is not None
        key = presented_key(request.path, request.headers)
        if self.api_keys.required and not self.api_keys.valid(key):
            self.metrics.errors.labels(code="unauthorized").inc()
            await ws.close(1008, "missing or invalid API key")
            return
        if not origin_allowed(request.headers.get("Origin"), self.allowed_origins):
            self.metrics.errors.labels(code="forbidden_origin").inc()
            await ws.close(1008, "origin not allowed")
            return
        limiter = self.service.limiter
        peer = str(ws.remote_address[0]) if ws.remote_address else "?"
        ip = client_ip(peer, request.headers, trust_forwarded_for=self.settings.trust_forwarded_for)
        client = client_identity(key, ip)
        if not limiter.open_connection(client):
            self.metrics.errors.labels(code="too_many_connections").inc()
            await ws.close(1013, "too many connections from this client")
            return
        conn = Connection(self, ws, client)
        self.connections.add(conn)
        self.metrics.connections.set(len(self.connections))
        try:
            await conn.run()
        finally:
            limiter.close_connection(client)
            self.connections.discard(conn)
            self.metrics.connections.set(len(self.connections))

    async def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = urlsplit(request.path).path
        if path == STREAM_PATH:
            if self.draining:
                return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, "draining\n")
            if len(self.connections) >= self.settings.max_connections:
                return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, "too many connections\n")
            return None  # go on with the WebSocket handshake
        if path == "/health":
            ok = self.healthy
            return connection.respond(
                http.HTTPStatus.OK if ok else http.HTTPStatus.SERVICE_UNAVAILABLE,
                "ok\n" if ok else "inference loop stalled\n",
            )
        if path == "/ready":
            ok = self.ready
            return connection.respond(
                http.HTTPStatus.OK if ok else http.HTTPStatus.SERVICE_UNAVAILABLE,
                "ready\n" if ok else "not ready\n",
            )
        if path == "/metrics":
            return _response(200, self.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")
        if path in ("/", "/index.html"):
            # File reads go to a thread: the event loop never waits for a disk.
            return await asyncio.to_thread(
                _static, DEMO_DIR / "demo" / "index.html", "text/html; charset=utf-8"
            )
        if path.startswith("/client_js/"):
            return await asyncio.to_thread(_static_under, DEMO_DIR, path.removeprefix("/client_js/"))
        return connection.respond(http.HTTPStatus.NOT_FOUND, "not found\n")


def _api_keys(settings: Settings) -> list[str]:
    """Keys from ``--api-keys`` and, one per line, ``--api-keys-file``."""
    keys = [k.strip() for k in settings.api_keys.split(",") if k.strip()]
    if settings.api_keys_file:
        lines = Path(settings.api_keys_file).read_text(encoding="utf-8").splitlines()
        keys += [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return keys


_CONTENT_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
}


def _response(status: int, body: bytes, content_type: str) -> Response:
    headers = Headers()
    headers["Content-Type"] = content_type
    headers["Content-Length"] = str(len(body))
    headers["Cache-Control"] = "no-store"
    return Response(status, http.HTTPStatus(status).phrase, headers, body)


def _static(path: Path, content_type: str) -> Response:
    if not path.is_file():
        return _response(404, b"not found\n", "text/plain")
    return _response(200, path.read_bytes(), content_type)


def _static_under(root: Path, relative: str) -> Response:
    """Serve a file below ``root`` only (no ``..`` escapes)."""
    target = (root / relative).resolve()
    if not target.is_relative_to(root) or target.suffix not in _CONTENT_TYPES:
        return _response(404, b"not found\n", "text/plain")
    return _static(target, _CONTENT_TYPES[target.suffix])
