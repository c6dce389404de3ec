"""A loopback TCP proxy whose connections a test can cut (TCP reset), like a network failure."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct


class CuttableProxy:
    """Forwards 127.0.0.1:<port> to a target port; :meth:`cut` resets every open connection.

    ``downstream_bytes_per_s`` paces what goes to the client, like a slow link: what the server
    sent waits in the proxy (in flight), so a cut loses it rather than the client holding all
    of a stream in its socket buffer already.
    """

    def __init__(self, target_port: int, *, downstream_bytes_per_s: float | None = None) -> None:
        self.target_port = target_port
        self.downstream_bytes_per_s = downstream_bytes_per_s
        self.port = 0
        self.cuts = 0
        #: While set, new connections are reset at once (the network is still down).
        self.blocked = False
        #: While set, what clients send is held, not forwarded (a stalled path); a cut drops it.
        self.holding = False
        #: Bytes from clients that a cut dropped while held (they never reached the server).
        self.dropped_bytes = 0
        self._held_bytes = 0  # held since hold(): only their count is ever needed
        self._flowing = asyncio.Event()  # cleared: nothing more goes to the client (a stalled link)
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._pairs: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> CuttableProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self._reset_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self._server.wait_closed()

    @property
    def connected(self) -> bool:
        """Some connection goes through the proxy now."""
        return bool(self._pairs)

    def stall(self) -> None:
        """Stop passing the server's bytes to the client (TCP then pushes back on the server)."""
        self._flowing.clear()

    def flow(self) -> None:
        """Pass the server's bytes on again."""
        self._flowing.set()

    def hold(self) -> None:
        """From now until the next :meth:`cut`, bytes clients send stay in the proxy (in flight)."""
        self.holding = True

    def cut(self) -> None:
        """Reset every connection through the proxy now (both sides see a TCP RST).

        Bytes held since :meth:`hold` are dropped with them, as a network failure drops what
        is in flight; forwarding resumes for the connections made after the cut.
        """
        if self._pairs:
            self.cuts += 1
        self.dropped_bytes += self._held_bytes
        self._held_bytes = 0
        self.holding = False
        self._reset_all()

    def _reset_all(self) -> None:
        for client, upstream in self._pairs:
            for writer in (client, upstream):
                sock = writer.get_extra_info("socket")
                if sock is not None:  # linger 0: close sends RST and drops unsent data
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
        self._pairs.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.blocked:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._pairs.append((writer, up_writer))
        for source, sink, upstream in ((reader, up_writer, True), (up_reader, writer, False)):
            task = asyncio.create_task(self._pipe(source, sink, upstream))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, upstream: bool) -> None:
        rate = None if upstream else self.downstream_bytes_per_s
        # RuntimeError: a cut closed the sink while this pipe slept (paced).
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            while True:
                if not upstream:
                    await self._flowing.wait()
                data = await source.read(65536 if rate is None else 2048)
                if not data:
                    break
                if upstream and self.holding:
                    self._held_bytes += len(data)
                    continue
                sink.write(data)
                await sink.drain()
                if rate is not None:
                    await asyncio.sleep(len(data) / rate)
        sink.transport.abort()
