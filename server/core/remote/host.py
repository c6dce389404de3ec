"""The engine process: the engine core and its model, behind the socket the front end gave it.

Run as ``python -m server.core.remote.host FD [PATH]`` by :class:`~server.core.remote.link.ProcessLink`,
``FD`` an inherited Unix stream socket. With ``PATH`` (``--frontend-processes N``) it also
listens there for the front-end processes' connections, each served by the hub
(``server.core.remote.hub``); ``FD`` is then the supervisor's control connection. The first
frame is the settings; the engine and the policy are built from them as in one process
(``server.core.factory``). Commands read from the socket go to the core; the core's event
batches are encoded on the inference thread (the event loop here only writes bytes) and
written in order (with a hub, routed and encoded on the event loop).

This process's GIL is the inference thread's and this small loop's only: no front end,
encoder or client connection competes with the engine's host work. It ignores SIGINT and
SIGTERM (a Ctrl-C or a drain reaches the front end, which stops it in order with a
``Shutdown`` command) and ends when the front end's side of the socket closes, so it never
outlives its front end.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import sys
import threading

from server.core.engine_core import EngineCore
from server.core.events import CoreEvent, Shutdown
from server.core.factory import build_engine_factory, policy_config
from server.core.remote.hub import Hub
from server.core.remote.recorder import MetricRecorder
from server.core.remote.wire import WireError, decode_command, decode_settings, encode_events, read_frame

log = logging.getLogger(__name__)


async def serve(sock: socket.socket, listen: str | None = None) -> None:
    """Read the settings, run the core until told to stop or the front end goes; flush its last events."""
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    first = await read_frame(reader)
    if first is None:
        return
    settings = decode_settings(first)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s engine %(name)s: %(message)s"
    )
    loop = asyncio.get_running_loop()
    recorder = MetricRecorder()
    ended = asyncio.Event()

    hub: Hub | None = None

    def emit(events: list[CoreEvent]) -> None:  # the inference thread
        if hub is not None:  # several connections: routed on the event loop
            loop.call_soon_threadsafe(hub.dispatch, events, recorder.take())
            return
        frame = encode_events(events, recorder.take())
        loop.call_soon_threadsafe(writer.write, frame)

    core = EngineCore(
        build_engine_factory(settings),
        policy_config(settings),
        emit=emit,
        metrics=recorder,
        warmup=settings.warmup,
    )

    def run() -> None:
        try:
            core.run()
        finally:
            loop.call_soon_threadsafe(ended.set)

    listening: asyncio.Server | None = None
    if listen is not None:
        hub = Hub(core)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(listen)  # the socket of an engine host that died before this one
        listening = await asyncio.start_unix_server(functools.partial(_front_end, hub), path=listen)
    thread = threading.Thread(target=run, name="inference", daemon=True)
    thread.start()
    if hub is not None:
        commands = asyncio.create_task(hub.serve(reader, writer, control=True), name="commands")
    else:
        commands = asyncio.create_task(_take_commands(reader, core), name="commands")
    loop_ended = asyncio.create_task(ended.wait(), name="loop-ended")
    await asyncio.wait([commands, loop_ended], return_when=asyncio.FIRST_COMPLETED)
    core.shutdown()  # the front end is gone, or the loop has ended already (then a no-op)
    if listening is not None:
        listening.close()  # new front ends are refused; those connected see the socket end
    await asyncio.to_thread(thread.join)
    for task in (commands, loop_ended):
        task.cancel()
    await asyncio.gather(commands, loop_ended, return_exceptions=True)
    await asyncio.sleep(0)  # the last batch's write, scheduled by the thread before it ended
    try:
        await writer.drain()
        writer.close()
    except ConnectionError:
        pass  # the front end went first: nobody to tell


async def _front_end(hub: Hub, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One front-end process's connection: its settings frame (the control's are used), then commands."""
    try:
        if await read_frame(reader) is not None:
            await hub.serve(reader, writer, control=False)
    except WireError:
        log.exception("a front-end connection sent a frame that does not decode: closed")
    finally:
        writer.close()


async def _take_commands(reader: asyncio.StreamReader, core: EngineCore) -> None:
    """Hand every command to the core until the front end closes its side."""
    while (body := await read_frame(reader)) is not None:
        command = decode_command(body)
        if isinstance(command, Shutdown):
            core.shutdown()  # after its current step, as in one process
        else:
            core.send(command)


def main(argv: list[str]) -> int:
    """``python -m server.core.remote.host FD [PATH]``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[1]))
    try:
        import uvloop

        uvloop.run(serve(sock, argv[2] if len(argv) > 2 else None))
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
