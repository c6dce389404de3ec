"""The server process: start-up, serving, drain and shutdown, each one readable sequence.

``App`` is the composition root: it builds the engine client, the service and the front ends
(``server.frontends``) and hands each what it needs; nothing reaches back into it.
:meth:`App.start` and :meth:`App.stop` read top to bottom as the steps they take.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable

from websockets.asyncio.server import Server, ServerConnection

from server.audio import SUPPORTED_FORMATS, SUPPORTED_RATES
from server.config import Settings
from server.core.client import EngineClient
from server.core.factory import build_engine_factory, policy_config, text_side
from server.core.remote.link import ProcessLink
from server.core.warmup import warm_up
from server.engine_api import Engine, EngineInfo
from server.errors import ServiceError, StartupError
from server.frontends.access import AccessDenied, AccessGate
from server.frontends.common import ServerInfo
from server.frontends.http.api import HttpApi
from server.frontends.ports import PortGuard, limits_problem, port_guards
from server.frontends.websocket.connection import Connection
from server.frontends.websocket.forward import is_forwarded
from server.frontends.websocket.listener import serve_websocket, sibling_socket
from server.frontends.websocket.routes import STREAM_PATH, Probes, Routes
from server.frontends.wyoming.server import WyomingServer, exposure_problem
from server.metrics import Metrics
from server.sockets import bind_socket
from server.streams.routing import RouterConfig, make_router, router_config
from server.streams.service import SpeechService
from server.voices.library import settings_problem

log = logging.getLogger(__name__)

#: How often a drain checks whether the running streams are done.
DRAIN_POLL_S = 0.05
_CLOSE_REASONS = {"unauthorized": "missing or invalid API key", "forbidden_origin": "origin not allowed"}


class App:
    """One server instance: start it, serve until told to stop, drain, stop."""

    def __init__(self, settings: Settings, *, engine_factory: Callable[[], Engine] | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.engine_client = EngineClient(
            engine_factory or build_engine_factory(settings),
            config=policy_config(settings),
            metrics=self.metrics,
            warmup=settings.warmup,
            link=self._engine_process(settings, engine_factory),
        )
        self.service = SpeechService(settings, self.engine_client, self.metrics)
        self.connections: set[Connection] = set()
        self.warmed_up = asyncio.Event()
        self.http: HttpApi | None = None  # the OpenAI-compatible API, when its port is open
        self.wyoming: WyomingServer | None = None  # the Wyoming server, when --wyoming-port is set
        self.websocket_guard: PortGuard | None = None  # the WebSocket port's TCP connections
        self._gate: AccessGate | None = None
        self._info: ServerInfo | None = None
        self._sockets: list[socket.socket] = []
        self._server: Server | None = None
        self._sibling_server: Server | None = None  # a front-end process's loopback port (forwards)
        self._warmup_task: asyncio.Task[None] | None = None

    def _engine_process(self, settings: Settings, factory: Callable[[], Engine] | None) -> ProcessLink | None:
        """With ``--engine-process``: the link to the engine process (None: a thread of this one).

        A front-end process of ``--frontend-processes N`` connects to the shared one instead.

        Raises:
            StartupError: an engine given in code (the engine process builds its own from the flags).
        """
        if settings.engine_socket:
            return ProcessLink(
                settings, text=text_side(settings), metrics=self.metrics, connect=settings.engine_socket
            )
        if not settings.engine_process:
            return None
        if factory is not None:
            raise StartupError("--engine-process builds its engine from the flags: no engine object crosses")
        return ProcessLink(settings, text=text_side(settings), metrics=self.metrics)

    # --- start-up and shutdown --------------------------------------------------------------

    async def start(self) -> None:
        """Start up; on any failure, undo what was started and raise.

        1. Read the API keys (``--api-keys-file``); check the voice settings; refuse an
           unauthenticated Wyoming port on a public interface while keys are set.
        2. Bind the WebSocket, HTTP and Wyoming ports, so that a busy port fails
           before minutes of model loading (nothing is accepted yet); read the resume
           secret (``--resume-secret-file``), check ``--advertise-url`` and ``--forward-allow``;
           a front-end process of ``--frontend-processes N`` also binds its loopback port
           (``--sibling-ports``), where its siblings forward the resumes of its streams.
        3. Load the engine on the inference thread; its warm-up follows there.
           With a resume secret, tokens are signed from now on (the engine's audio
           fingerprint goes into them).
        4. Read the voices made from recordings (``--voices-dir``) that this engine's weights made.
        5. Start the stream sweeper and the warm-up requests (``/ready`` waits for both).
        6. Serve WebSocket (and the loopback port), HTTP and Wyoming on the bound sockets.

        Raises:
            StartupError: one line naming the cause and the flag.
        """
        s = self.settings
        try:
            self._gate = AccessGate.from_settings(s)
            if (problem := settings_problem(s)) is not None:
                raise StartupError(problem)
            if (problem := exposure_problem(s, self._gate.api_keys.required)) is not None:
                raise StartupError(problem)
            if (problem := limits_problem(s)) is not None:
                raise StartupError(problem)
            ws_sock = self._bind(s.port, "--port")
            http_sock = self._bind_http()
            wyoming_sock = self._bind(max(0, s.wyoming_port), "--wyoming-port") if s.wyoming_port else None
            ports = 1 + (http_sock is not None) + (wyoming_sock is not None)
            guards = port_guards(
                s, ports, self.service.limiter, lambda c: self.metrics.errors.labels(code=c).inc()
            )
            self.websocket_guard = guards["WebSocket"]
            routing: RouterConfig | None = router_config(s, self.port)
            sibling_sock = sibling_socket(routing, self._sockets)
            info = await self.engine_client.start()
            if routing is not None:
                self.service.router = make_router(routing, s, info)
            await self._load_voices(info)
            self._info = server_info(s, info)
            self.metrics.engine.info({"name": info.name, **info.extra})
            self.service.start()
            self._warmup_task = asyncio.create_task(self._warm_up(), name="warm-up")
            routes = Routes(self._probes())
            self._server = await serve_websocket(self._handle, ws_sock, routes, s, guards["WebSocket"])
            if sibling_sock is not None:
                self._sibling_server = await serve_websocket(
                    self._handle, sibling_sock, routes, s, guards["WebSocket"]
                )
            if http_sock is not None:
                self.http = HttpApi(self.service, self._info, self._gate, s, self.metrics, guards["HTTP"])
                await self.http.start(http_sock)
            if wyoming_sock is not None:
                self.wyoming = WyomingServer(self.service, s, self.metrics, guards["Wyoming"])
                await self.wyoming.start(wyoming_sock)
        except BaseException:
            await self.stop()
            raise
        log.info("listening on ws://%s:%d%s", s.host, self.port, STREAM_PATH)

    async def _load_voices(self, info: EngineInfo) -> None:
        """The voices from recordings that this engine's encoder made (others are skipped, logged).

        Raises:
            StartupError: the folder cannot be read.
        """
        voices = self.service.voices
        try:
            await voices.load(info.voice_encoder)
        except OSError as exc:
            raise StartupError(
                f"cannot read --voices-dir {voices.store.folder}: {exc.strerror or exc}"
            ) from None

    async def stop(self) -> None:
        """Shut down (also after a failed start), in order; no step waits on a client for long.

        1. Stop the warm-up requests.
        2. Stop the HTTP API, the Wyoming server and the WebSocket server together: stop
           listening, close every connection at once (WebSocket with 1012, Wyoming streams
           told ``shutting_down``), each close within ``--close-timeout-s``, then cut.
        3. Free every stream (their generation stops), stop the encoder threads.
        4. Stop the inference loop after its current step; it closes the engine.
        """
        if self._warmup_task is not None:
            self._warmup_task.cancel()
            await asyncio.gather(self._warmup_task, return_exceptions=True)
        fronts = [self.http.stop() if self.http is not None else None]
        fronts += [self.wyoming.stop() if self.wyoming is not None else None, self._stop_websockets()]
        for failed in await asyncio.gather(*(f for f in fronts if f is not None), return_exceptions=True):
            if isinstance(failed, BaseException):
                log.error("stopping a front end failed", exc_info=failed)
        await self.service.stop()
        await self.engine_client.stop()
        for sock in self._sockets:  # bound but never served (a failed start): release the ports
            sock.close()

    async def _stop_websockets(self) -> None:
        servers = [server for server in (self._server, self._sibling_server) if server is not None]
        for server in servers:
            server.close(close_connections=False)
        await asyncio.gather(*(conn.close(1012, "server is restarting") for conn in list(self.connections)))
        for server in servers:
            await server.wait_closed()

    async def drain(self) -> None:
        """Graceful stop: refuse new streams, let running ones finish, close with 1012, stop.

        Idle connections are closed at once and all together (each within
        ``--close-timeout-s``) while the running streams get up to ``--drain-timeout-s``;
        then :meth:`stop`. So the drain ends within its timeout plus a few close timeouts,
        whatever the clients do.
        """
        if self.service.draining:
            return
        self.service.draining = True
        registry = self.service.registry
        log.info("draining: %d active streams, up to %.0f s", registry.busy(), self.settings.drain_timeout_s)
        closing = asyncio.create_task(self._close_idle(), name="drain-close-idle")
        try:
            async with asyncio.timeout(self.settings.drain_timeout_s):
                # The condition spans every stream's state; polling it during a drain is cheap.
                while registry.busy() or self._forwarding():  # noqa: ASYNC110
                    await asyncio.sleep(DRAIN_POLL_S)
        except TimeoutError:
            log.warning("drain timeout: %d streams still running are cut off", registry.busy())
        finally:
            await asyncio.wait([closing])  # each close is bounded: this is short
        await self.stop()

    async def _close_idle(self) -> None:
        """Close every connection without a stream, all at once."""
        idle = [conn.close_if_idle() for conn in list(self.connections)]
        if self.wyoming is not None:
            idle.append(self.wyoming.close_idle())
        if self.http is not None:
            idle.append(self.http.close_idle())  # ElevenLabs WebSockets without a context
        await asyncio.gather(*idle, return_exceptions=True)

    def _forwarding(self) -> int:
        """Streams this replica relays from their owners (they end with their owner's stream)."""
        return sum(conn.forwarding for conn in self.connections)

    async def run_until_signalled(self) -> None:
        """Start, serve until SIGTERM or SIGINT, then drain and return."""
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("signal received")
        await self.drain()

    def _bind(self, port: int, flag: str) -> socket.socket:
        shared = bool(self.settings.engine_socket)  # one of --frontend-processes N: they share the ports
        return bind_socket(self.settings.host, port, flag, self._sockets, reuse_port=shared)

    def _bind_http(self) -> socket.socket | None:
        """The HTTP API's socket: ``--http-port``; by default the WebSocket port + 1 (0 = off).

        The default may be taken (another server's WebSocket port): HTTP then stays off
        with a warning instead of failing the WebSocket server.
        """
        s = self.settings
        if s.http_port == 0:
            return None
        if s.http_port > 0:
            return self._bind(s.http_port, "--http-port")
        port = self.port + 1 if s.port else 0
        try:
            return self._bind(port, "--http-port")
        except StartupError as exc:
            log.warning("OpenAI-compatible HTTP is off: %s (set --http-port)", exc)
            return None

    async def _warm_up(self) -> None:
        """Typical requests through the real path; ``/ready`` waits for them."""
        if self.settings.warmup:
            await self.engine_client.wait_ready()
            try:
                await warm_up(self.engine_client, self.service.pace)
            except ServiceError as exc:  # e.g. --max-queue 0: nothing could be served anyway
                log.error("warm-up failed, /ready stays 503: %s", exc.message)
                return
        self.warmed_up.set()

    # --- state -----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound WebSocket port (useful with ``port=0``)."""
        port: int = self._sockets[0].getsockname()[1]
        return port

    @property
    def http_port(self) -> int | None:
        """The bound HTTP API port; None while it is off."""
        return self.http.port if self.http is not None else None

    @property
    def wyoming_port(self) -> int | None:
        """The bound Wyoming port; None while it is off."""
        return self.wyoming.port if self.wyoming is not None else None

    @property
    def draining(self) -> bool:
        """SIGTERM was received: no new streams, ``/ready`` fails."""
        return self.service.draining

    @property
    def active_streams(self) -> int:
        """Streams not yet delivered (running, being sent, or waiting for a resume)."""
        return self.service.registry.active()

    @property
    def ready(self) -> bool:
        """Warm-up finished, not draining, and the engine breaker is closed."""
        client = self.engine_client
        return client.ready and self.warmed_up.is_set() and not self.draining and not client.breaker_open

    @property
    def healthy(self) -> bool:
        """The inference thread is alive and has looped recently."""
        return self.engine_client.healthy

    def _probes(self) -> Probes:
        return Probes(
            healthy=lambda: self.healthy,
            ready=lambda: self.ready,
            draining=lambda: self.draining,
            full=lambda: len(self.connections) >= self.settings.max_connections,
            metrics=self.metrics.render,
            forwarded=lambda request: is_forwarded(self.service.router, request.path, request.headers),
        )

    # --- WebSocket connections ------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        request = ws.request
        assert request is not None and self._gate is not None and self._info is not None
        peer = str(ws.remote_address[0]) if ws.remote_address else "?"
        try:
            client = self._gate.admit(request.path, request.headers, peer)
        except AccessDenied as denied:
            self.metrics.errors.labels(code=denied.kind).inc()
            await ws.close(1008, _CLOSE_REASONS[denied.kind])
            return
        limiter = self.service.limiter
        if not limiter.open_connection(client):
            self.metrics.errors.labels(code="too_many_connections").inc()
            await ws.close(1013, "too many connections from this client")
            return
        s = self.settings
        conn = Connection(
            ws,
            self.service,
            self._info,
            client=client,
            send_timeout_s=s.send_timeout_s,
            close_timeout_s=s.close_timeout_s,
            metrics=self.metrics,
        )
        self.connections.add(conn)
        self.metrics.connections.set(len(self.connections))
        try:
            await conn.run()
        finally:
            limiter.close_connection(client)
            self.connections.discard(conn)
            self.metrics.connections.set(len(self.connections))


#: The engine facts ``hello.compute`` carries (the rest of ``EngineInfo.extra`` is only in /metrics).
COMPUTE_FACTS = ("dtype", "quantize", "token_step", "token_step_fallback", "vocoder_dtype")


def server_info(settings: Settings, engine: EngineInfo) -> ServerInfo:
    """What the server advertises, once the engine is loaded."""
    return ServerInfo(
        server=settings.server_name,
        formats=SUPPORTED_FORMATS,
        sample_rates=SUPPORTED_RATES,
        max_text_chars=settings.max_text_chars,
        max_streams=settings.max_streams,
        resume_ttl_s=settings.resume_ttl_s,
        max_json_depth=settings.max_json_depth,
        weights=engine.extra.get("weights"),
        compute={k: engine.extra[k] for k in COMPUTE_FACTS if k in engine.extra},
    )
