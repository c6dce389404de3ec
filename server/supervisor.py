"""``--frontend-processes N``: one engine process, N front-end processes on the same ports.

One Python process tops out near one core of front-end work (the event loop, the encoders and
the WebSocket writes share its GIL). The supervisor runs the engine core once, in the engine
process (``server.core.remote.host``, which listens on a private Unix socket), and starts N
``serve`` children that bind the same ports with ``SO_REUSEPORT`` (the kernel spreads new
connections over them) and reach the engine through ``--engine-socket``. It:

- binds the ports first (a busy port fails the start at once, and ``--port 0`` becomes one
  port all children share), and holds them (bound, never listening) until it ends;
- starts the engine process, waits for its engine to load, then starts the children;
- stops everything with exit status 2 when a child's start fails (exit status 2: the flags
  fail every child the same way, e.g. an unreadable ``--api-keys-file``);
- restarts a child that dies otherwise (its clients reconnect to the others meanwhile; a resume landing
  on another child than its stream's fails cleanly with ``unknown_stream``);
- lets the engine link restart a dead engine process: every child is not ready meanwhile;
- gives each child ``PROMETHEUS_MULTIPROC_DIR`` so that ``/metrics`` on any of them is the
  merged view (``server.metrics``);
- on SIGTERM or SIGINT drains every child (each its own drain, together), then stops the
  engine; exits 0 when every child did.

The supervisor serves nothing itself: no client connects to it, so it holds no GIL anyone waits on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from prometheus_client.multiprocess import mark_process_dead

from server.config import Settings
from server.core.client import EngineClient
from server.core.factory import build_engine_factory, policy_config, text_side
from server.core.remote.link import Backoff, ProcessLink, child_environment
from server.errors import StartupError
from server.metrics import MULTIPROC_VARIABLE, Metrics
from server.sockets import bind_socket

log = logging.getLogger(__name__)

#: A child that lived this long before it died is restarted after the shortest delay again
#: (:class:`~server.core.remote.link.Backoff`).
STABLE_S = 10.0


class Supervisor:
    """The engine process and N front-end processes: start, keep, drain."""

    def __init__(self, settings: Settings, argv: list[str]) -> None:
        if settings.frontend_processes < 2:
            raise StartupError("--frontend-processes: the supervisor runs 2 or more")
        self.settings = settings
        self._argv = argv
        self._folder = Path(tempfile.mkdtemp(prefix="chattts-stream-"))
        self._socket_path = str(self._folder / "engine.sock")
        self._metrics_dir = self._folder / "metrics"
        self._metrics_dir.mkdir()
        self._sockets: list[socket.socket] = []
        self._children: dict[int, asyncio.subprocess.Process] = {}  # slot → the child now in it
        self._stopping = False
        self._stop: asyncio.Event | None = None
        self._failed_start = False  # a child's start failed: its flags fail every child

    async def run(self) -> int:
        """Start everything, serve until SIGTERM/SIGINT, drain; the exit status.

        Raises:
            StartupError: a port cannot be bound, or the engine cannot be loaded.
        """
        loop = asyncio.get_running_loop()
        stop = self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        s = self.settings
        engine: EngineClient | None = None
        try:
            ports = self._bind_ports()
            link = ProcessLink(
                replace(s, engine_process=True),
                text=text_side(s),
                metrics=Metrics(),
                listen=self._socket_path,
            )
            engine = EngineClient(
                build_engine_factory(s), config=policy_config(s), metrics=Metrics(), link=link
            )
            await engine.start()
            log.info(
                "front ends on ports ws=%d http=%d wyoming=%d: %d processes",
                *ports,
                s.frontend_processes,
            )
            keepers = [
                asyncio.create_task(self._keep(slot, ports), name=f"front-end-{slot}")
                for slot in range(s.frontend_processes)
            ]
            await stop.wait()
            if self._failed_start:
                log.error("a front-end process could not start (exit status 2): stopping")
            else:
                log.info("signal received: draining %d front-end processes", len(self._children))
            self._stopping = True
            for child in list(self._children.values()):
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)
            codes = await asyncio.gather(*keepers)
            if self._failed_start:
                return 2
            return 0 if all(code == 0 for code in codes) else 1
        finally:
            self._stopping = True
            if engine is not None:
                await engine.stop()
            for sock in self._sockets:
                sock.close()
            shutil.rmtree(self._folder, ignore_errors=True)

    def _bind_ports(self) -> tuple[int, int, int]:
        """The WebSocket, HTTP and Wyoming ports (0: off), bound with ``SO_REUSEPORT`` and held."""
        s = self.settings

        def bind(port: int, flag: str) -> int:
            sock = bind_socket(s.host, port, flag, self._sockets, reuse_port=True)
            bound: int = sock.getsockname()[1]
            return bound

        ws = bind(s.port, "--port")
        http = 0
        if s.http_port > 0:
            http = bind(s.http_port, "--http-port")
        elif s.http_port < 0:
            try:
                http = bind(ws + 1 if s.port else 0, "--http-port")
            except StartupError as exc:
                log.warning("OpenAI-compatible HTTP is off: %s (set --http-port)", exc)
        wyoming = bind(max(0, s.wyoming_port), "--wyoming-port") if s.wyoming_port else 0
        return ws, http, wyoming

    async def _keep(self, slot: int, ports: tuple[int, int, int]) -> int:
        """Run one child; start it again when it dies, until the drain; its last exit status."""
        backoff = Backoff()
        while True:
            child = await self._spawn(ports)
            self._children[slot] = child
            began = time.monotonic()
            code = await child.wait()
            mark_process_dead(child.pid, str(self._metrics_dir))  # type: ignore[no-untyped-call] # its live gauges leave /metrics
            if self._stopping:
                return code
            if code == 2:  # the command line's start-up error (one line on stderr): the same for all
                self._failed_start = True
                assert self._stop is not None
                self._stop.set()
                return code
            how = f"signal {-code}" if code < 0 else f"exit status {code}"
            log.error("front-end process %d (pid %d) ended (%s); restarting it", slot, child.pid, how)
            await asyncio.sleep(backoff.next(lived=time.monotonic() - began > STABLE_S))
            if self._asked_to_stop():  # a drain during the delay
                return 0

    def _asked_to_stop(self) -> bool:
        return self._stopping

    async def _spawn(self, ports: tuple[int, int, int]) -> asyncio.subprocess.Process:
        """A ``serve`` child with the same flags, on the resolved ports, through the engine's socket."""
        ws, http, wyoming = ports
        env = child_environment(**{MULTIPROC_VARIABLE: str(self._metrics_dir)})
        flags = ["--port", str(ws), "--http-port", str(http), "--wyoming-port", str(wyoming)]
        flags += ["--frontend-processes", "1", "--engine-socket", self._socket_path]
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "server", *self._argv, *flags, env=env
        )


def supervise(settings: Settings, argv: list[str]) -> int:
    """Run the supervisor (``serve --frontend-processes N``, N ≥ 2); the process's exit status."""
    import uvloop

    try:
        return uvloop.run(Supervisor(settings, argv).run())
    except StartupError as exc:
        print("chattts-stream: " + " ".join(str(exc).splitlines()), file=sys.stderr)
        return 2
