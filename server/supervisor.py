"""``--frontend-processes N``: one engine process, N front-end processes on the same ports.

One Python process tops out near one core of front-end work (the event loop, the encoders and
the WebSocket writes share its GIL). The supervisor runs the engine core once, in the engine
process (``server.core.remote.host``, which listens on a private Unix socket), and starts N
``serve`` children that bind the same ports with ``SO_REUSEPORT`` (the kernel spreads new
connections over them) and reach the engine through ``--engine-socket``. It:

- binds the ports first (a busy port fails the start at once, and ``--port 0`` becomes one
  port all children share), and holds them (bound, never listening) until it ends;
- starts the engine process, waits for its engine to load, then starts the children, each at
  a lower CPU priority (``--frontend-priority``, resolved here from the loaded engine's device
  by :func:`frontend_priority`, applied by the child before any thread starts): on a machine
  whose cores the front ends keep busy, the engine's host work still wins a core when it
  wakes, so the front ends' load does not slow every stream's steps;
- stops everything with exit status 2 when a child's start fails (exit status 2: the flags
  fail every child the same way, e.g. an unreadable ``--api-keys-file``);
- restarts a child that dies otherwise (its clients reconnect to the others meanwhile);
- lets a resume find its stream on any child, with the machinery that does it across replicas
  (signed tokens, ``server.streams.routing``; the forward, ``server.frontends.websocket.forward``;
  the regeneration, ``server.streams.failover``) rather than a second, host-local one:

  - every child also listens on a loopback port of its own (``--sibling-ports``, its own first),
    and its tokens name that port as their owner. The supervisor binds these ports once
    (``127.0.0.1:0``, ``SO_REUSEPORT``, held and never listening, like the public ports), so a
    child started again in the same slot has the same address: a resume of a stream of the
    dead child reaches its successor, which regenerates it; while no child listens there the
    forward is refused at once and the child the resume landed on regenerates it. A draining
    child still serves the resumes forwarded to it (the peer proof) until its streams end.
    Loopback TCP rather than a Unix socket: a token's owner is a ``ws://IP:PORT`` the forward
    client dials as it is, with no second address form to sign, check and connect to;
  - a child forwards to exactly its siblings' loopback URLs besides ``--forward-allow``
    (:class:`~server.streams.routing.Router`), which still decides alone for other owners;
  - without ``--resume-secret(-file)`` the supervisor makes a random key at start and gives it
    to the children in a file of its private folder (mode 0600), never on a command line that
    ``ps`` shows; with one, the children use the operator's;
  - ``--advertise-url`` is refused: a token names a child's loopback port, which another host
    cannot reach, and a resume forwarded from there to the public address would land on any
    child and need a second hop (a forwarded resume is never forwarded again). Resume across
    hosts needs one front-end process per replica for now;
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
import os
import secrets
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
from server.core.factory import build_engine_factory, policy_config
from server.core.remote.link import Backoff, ProcessLink, child_environment
from server.engine_api import EngineInfo
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
        if settings.advertise_url:
            raise StartupError(
                "--advertise-url: not with --frontend-processes 2 or more (a resume from another host "
                "cannot reach one front-end process yet: run one front-end process per replica)"
            )
        self.settings = settings
        self._argv = argv
        self._folder = Path(tempfile.mkdtemp(prefix="chattts-stream-"))
        self._socket_path = str(self._folder / "engine.sock")
        self._metrics_dir = self._folder / "metrics"
        self._metrics_dir.mkdir()
        self._sockets: list[socket.socket] = []
        self._sibling_ports: list[int] = []  # slot → its child's loopback port (resumes of its streams)
        self._secret_flags: list[str] = []  # how the children get the resume key
        self._children: dict[int, asyncio.subprocess.Process] = {}  # slot → the child now in it
        self._stopping = False
        self._stop: asyncio.Event | None = None
        self._failed_start = False  # a child's start failed: its flags fail every child
        self._priority = "lower"  # the children's --frontend-priority, resolved once the engine loaded

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
            self._bind_sibling_ports()
            self._share_secret()
            link = ProcessLink(
                replace(s, engine_process=True),
                text=None,  # the children answer the stream layer: the supervisor holds no text side
                metrics=Metrics(),
                listen=self._socket_path,
            )
            engine = EngineClient(
                build_engine_factory(s), config=policy_config(s), metrics=Metrics(), link=link
            )
            await engine.start()
            self._priority = frontend_priority(s.frontend_priority, engine.info)
            log.info(
                "front ends on ports ws=%d http=%d wyoming=%d: %d processes, CPU priority %s",
                *ports,
                s.frontend_processes,
                self._priority,
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

    def _bind_sibling_ports(self) -> None:
        """One loopback port per child slot, bound with ``SO_REUSEPORT`` and held (never listening)."""
        for _ in range(self.settings.frontend_processes):
            sock = bind_socket("127.0.0.1", 0, "--sibling-ports", self._sockets, reuse_port=True)
            self._sibling_ports.append(sock.getsockname()[1])

    def _share_secret(self) -> None:
        """Without an operator's resume key, a random one in a 0600 file of the private folder."""
        s = self.settings
        if s.resume_secret or s.resume_secret_file:
            return  # the children read the operator's flags
        path = self._folder / "resume-secret"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as file:
            file.write(secrets.token_urlsafe(32))
        self._secret_flags = ["--resume-secret-file", str(path)]

    async def _keep(self, slot: int, ports: tuple[int, int, int]) -> int:
        """Run one child; start it again when it dies, until the drain; its last exit status."""
        backoff = Backoff()
        while True:
            child = await self._spawn(slot, ports)
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

    async def _spawn(self, slot: int, ports: tuple[int, int, int]) -> asyncio.subprocess.Process:
        """A ``serve`` child with the same flags, on the resolved ports, through the engine's socket."""
        ws, http, wyoming = ports
        env = child_environment(**{MULTIPROC_VARIABLE: str(self._metrics_dir)})
        flags = ["--port", str(ws), "--http-port", str(http), "--wyoming-port", str(wyoming)]
        flags += ["--frontend-processes", "1", "--engine-socket", self._socket_path]
        flags += ["--frontend-priority", self._priority]
        own = self._sibling_ports[slot]
        siblings = [own, *(port for port in self._sibling_ports if port != own)]
        flags += ["--sibling-ports", ",".join(map(str, siblings)), *self._secret_flags]
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "server", *self._argv, *flags, env=env
        )


def frontend_priority(choice: str, info: EngineInfo) -> str:
    """The children's ``--frontend-priority``: ``auto`` resolved by where the model runs.

    ``idle`` (``SCHED_IDLE``) keeps the engine's pace best (``bench/results/studies/
    frontend-priority-<hw>.md``) but gives the children only the cores the engine leaves: where
    the model itself runs on the CPU its threads want every core, and the children take
    ``lower`` (nice 10) instead. An engine that names no device (the fake one) runs no model here.
    """
    if choice != "auto":
        return choice
    return "lower" if info.extra.get("device", "").startswith("cpu") else "idle"


def supervise(settings: Settings, argv: list[str]) -> int:
    """Run the supervisor (``serve --frontend-processes N``, N ≥ 2); the process's exit status."""
    import uvloop

    try:
        return uvloop.run(Supervisor(settings, argv).run())
    except StartupError as exc:
        print("chattts-stream: " + " ".join(str(exc).splitlines()), file=sys.stderr)
        return 2
