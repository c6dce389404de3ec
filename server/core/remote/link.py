"""The front end's side of the engine process: start it, carry the frames, bring it back when it dies.

:class:`ProcessLink` is a :class:`~server.core.link.CoreLink`. It starts
``python -m server.core.remote.host`` with one end of a Unix socket pair (nothing on disk, no
port), sends the settings, then each command as a frame; a reader task decodes the event
batches, replays the metrics recorded with them on this process's collectors and delivers the
events to the client, on the event loop. The first ``Loaded`` also builds, off the event loop,
the engine's text side this process answers ``validate_voice`` and ``text_tokens`` with
(``server.core.factory.text_side``: from the model folder that ``Loaded`` names).

When the engine process dies (a crash, the kernel's OOM killer, a ``kill -9``), ``lost`` tells
the client at once (its streams end with an engine error and it is not ready), and the process
is started again after :data:`RESTART_DELAY_S` (doubling up to :data:`MAX_RESTART_DELAY_S`
while the new one dies before loading). Its ``Ready`` makes the client ready again. A process
that dies before it ever loaded is not restarted: the server's start fails.

With ``listen`` (the supervisor of ``--frontend-processes N``) the engine process also serves
the front-end processes on that Unix socket path (``server.core.remote.hub``). With
``connect`` (one of those front-end processes, ``--engine-socket PATH``) the link starts no
process: it connects to that path, and when the connection ends (the engine host died; the
supervisor restarts it) it tells the client it is lost and tries to connect again every
:data:`CONNECT_POLL_S`: a failed connect to a Unix socket costs microseconds, and every sibling
front end polling that often is ready within a tenth of a second of the new engine host, so a
client the kernel hands to a lagging sibling is not refused while the others serve.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import server
from server.config import Settings
from server.core.events import Command, CoreEvent, Loaded, LoadFailed, Shutdown
from server.core.factory import TextSideFactory
from server.core.link import Deliver, Lost
from server.core.remote.recorder import replay
from server.core.remote.wire import (
    WireError,
    decode_events,
    encode_command,
    encode_settings,
    read_frame,
)
from server.engine_api import Engine, EngineText
from server.metrics import Metrics

log = logging.getLogger(__name__)

#: The folder holding this ``server`` package: a child process imports this very tree,
#: wherever the parent was started from.
_ROOT = str(Path(server.__file__).resolve().parents[1])

RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 10.0
#: A stopping engine process ends after its current step; past this it is killed.
STOP_TIMEOUT_S = 30.0
#: How long a front-end process waits for the engine host's socket at its start.
CONNECT_TIMEOUT_S = 60.0
#: How often a front-end process tries the engine host's socket while it is not there.
CONNECT_POLL_S = 0.1


def child_environment(**extra: str) -> dict[str, str]:
    """This process's environment for a ``python -m server…`` child, which imports this tree."""
    path = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


class Backoff:
    """The wait before a dead process is started again (the engine process, a front-end child).

    :data:`RESTART_DELAY_S`, doubling up to :data:`MAX_RESTART_DELAY_S` while it keeps dying
    young, the shortest again once one lived.
    """

    def __init__(self) -> None:
        self._delay = RESTART_DELAY_S

    def next(self, *, lived: bool) -> float:
        """The delay before the next start; ``lived``: the process that died had done its work."""
        self._delay = RESTART_DELAY_S if lived else min(MAX_RESTART_DELAY_S, self._delay * 2)
        return self._delay


class ProcessLink:
    """The engine core in a child process, over a Unix socket pair."""

    def __init__(
        self,
        settings: Settings,
        *,
        text: TextSideFactory | None,
        metrics: Metrics,
        listen: str | None = None,
        connect: str | None = None,
    ) -> None:
        self._settings = settings
        self._listen, self._connect = listen, connect
        self._text_factory = text
        self._text: EngineText | None = None
        self._metrics = metrics
        self._process: asyncio.subprocess.Process | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.StreamReader | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._deliver: Deliver | None = None
        self._lost: Lost | None = None
        self._stopping = False
        self._ever_loaded = False

    @property
    def pid(self) -> int | None:
        """The engine process's id while one runs (tests kill it)."""
        return self._process.pid if self._process is not None and self._process.returncode is None else None

    async def start(self, deliver: Deliver, lost: Lost) -> None:
        """Start the engine process; its events go to ``deliver``, its death to ``lost``."""
        self._deliver, self._lost = deliver, lost
        if self._connect is not None:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                # The socket appears when the engine host has started: polled, nothing to wait on.
                while not await self._connected_to(self._connect):  # noqa: ASYNC110
                    await asyncio.sleep(CONNECT_POLL_S)
            self._supervisor = asyncio.create_task(self._reconnecting(self._connect), name="engine-host")
            return
        await self._spawn()
        self._supervisor = asyncio.create_task(self._supervise(), name="engine-process")

    async def _connected_to(self, path: str) -> bool:
        """Connect to the engine host's socket and say the settings; False while it is not there."""
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(path)
        except OSError:
            return False
        self._writer.write(encode_settings(self._settings))
        return True

    async def _reconnecting(self, path: str) -> None:
        """Pump events until the engine host's socket ends; unless stopping, lost, then connect again."""
        while True:
            await self._pump()
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            if self._stopping:
                return
            log.error("the engine host's connection ended; streams in it failed; connecting again")
            assert self._lost is not None
            self._lost("the engine process ended; it is being restarted")
            while not self._asked_to_stop() and not await self._connected_to(path):  # noqa: ASYNC110
                await asyncio.sleep(CONNECT_POLL_S)
            if self._asked_to_stop():
                return

    async def _spawn(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = child_environment()
        try:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "server.core.remote.host",
                str(theirs.fileno()),
                *([self._listen] if self._listen is not None else []),
                pass_fds=(theirs.fileno(),),
                env=env,
            )
        finally:
            theirs.close()
        self._reader, self._writer = await asyncio.open_unix_connection(sock=ours)
        self._writer.write(encode_settings(self._settings))
        if self._stopping:  # stopped while this one was being started: it stops after loading
            self._writer.write(encode_command(Shutdown()))

    async def _supervise(self) -> None:
        """Pump events until the process ends; bring it back unless stopping or it never loaded."""
        backoff = Backoff()
        while True:
            loaded = await self._pump()
            assert self._process is not None
            code = await self._process.wait()
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            if self._stopping:
                return
            how = f"signal {-code}" if code < 0 else f"exit status {code}"
            log.error("the engine process ended (%s); streams in it failed; restarting", how)
            assert self._lost is not None
            self._lost(f"the engine process ended ({how}); it is being restarted")
            if not self._ever_loaded:
                return
            await asyncio.sleep(backoff.next(lived=loaded))
            if self._asked_to_stop():  # a drain during the delay
                return
            while not await self._respawned():
                await asyncio.sleep(MAX_RESTART_DELAY_S)
                if self._asked_to_stop():
                    return

    async def _respawned(self) -> bool:
        """Start the engine process again; False (logged) when it cannot be started now."""
        try:
            await self._spawn()
        except OSError:
            log.exception("the engine process cannot be started; trying again in %.0f s", MAX_RESTART_DELAY_S)
            return False
        return True

    def _asked_to_stop(self) -> bool:
        return self._stopping

    async def _pump(self) -> bool:
        """Deliver every event batch until the socket ends; whether this process loaded its engine."""
        reader, deliver = self._reader, self._deliver
        assert reader is not None and deliver is not None
        loaded = False
        while (body := await read_frame(reader)) is not None:
            try:
                events, ops = decode_events(body)
            except WireError:
                log.exception("the engine process sent a frame that does not decode; ending it")
                self._kill()
                break
            replay(ops, self._metrics)
            if any(isinstance(event, Loaded) for event in events):
                events = await self._with_text_side(events)
                loaded = self._ever_loaded = any(isinstance(event, Loaded) for event in events)
            deliver(events)
        return loaded

    async def _with_text_side(self, events: list[CoreEvent]) -> list[CoreEvent]:
        """``events`` once the text side is built from their ``Loaded`` (the first time only).

        Built on a thread (ChatTTS's takes seconds: imports, a tokenizer, numba's compile), while
        nothing is served yet: the client's start waits for this very ``Loaded``. One that
        cannot be built fails the start like an engine that cannot load (``LoadFailed``), and the
        engine process is stopped.
        """
        if self._text is not None or self._text_factory is None:
            return events
        info = next(event.info for event in events if isinstance(event, Loaded))
        try:
            self._text = await asyncio.to_thread(self._text_factory, info)
        except Exception as exc:  # a missing or unreadable file: one line, as a failed load says it
            log.exception("the engine's text side cannot be built in this process")
            message = f"the engine's text side cannot be loaded in the front end: {type(exc).__name__}: {exc}"
            self.shutdown()
            return [LoadFailed(" ".join(message.split())) if isinstance(e, Loaded) else e for e in events]
        return events

    def _kill(self) -> None:
        if self._process is not None and self._process.returncode is None:
            self._process.send_signal(signal.SIGKILL)

    def send(self, command: Command) -> None:
        """One frame; dropped while no engine process is connected (its streams have failed already)."""
        writer = self._writer
        if writer is not None and not writer.is_closing():
            writer.write(encode_command(command))

    def shutdown(self) -> None:
        """The engine process stops its core after the current step, then exits."""
        self._stopping = True
        if self._connect is not None:  # the engine host is shared: this front end only leaves it
            if self._writer is not None:
                self._writer.close()
            return
        self.send(Shutdown())

    async def join(self) -> None:
        """Until the engine process has exited (killed past :data:`STOP_TIMEOUT_S`)."""
        self._stopping = True
        task = self._supervisor
        if task is None:
            if self._process is not None:
                self._kill()
                await self._process.wait()
            return
        try:
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await asyncio.shield(task)
        except TimeoutError:
            log.error("the engine process did not stop within %.0f s: killed", STOP_TIMEOUT_S)
            self._kill()
            await task

    @property
    def connected(self) -> bool:
        """An engine process is connected."""
        return self._writer is not None and not self._writer.is_closing()

    @property
    def alive(self) -> bool:
        """The supervisor runs: an engine process serves, loads, or is about to be started again."""
        return self._supervisor is not None and not self._supervisor.done() and not self._stopping

    @property
    def text(self) -> EngineText:
        """The engine's text side, built here once the engine has loaded (``server.core.factory.text_side``).

        Raises:
            RuntimeError: before the engine's ``Loaded`` (or in the supervisor, which has none).
        """
        if self._text is None:
            raise RuntimeError("the engine's text side is built when the engine process has loaded")
        return self._text

    @property
    def engine(self) -> Engine:
        """Not in this process.

        Raises:
            RuntimeError: always (the engine object lives in the engine process).
        """
        raise RuntimeError("the engine runs in its own process (--engine-process)")
