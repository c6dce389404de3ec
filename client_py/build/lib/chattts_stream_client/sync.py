"""A blocking wrapper for scripts: the asyncio client on its own event loop in a background thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from chattts_stream_client.client import Client
from chattts_stream_client.wire import AudioChunk

T = TypeVar("T")


class SyncClient:
    """``with SyncClient(url) as c: for chunk in c.speak("...")`` — no asyncio in sight.

    Every call is bounded: it waits at most the client's ``read_timeout`` (plus
    ``connect_timeout`` for connecting) for the background loop to answer.
    """

    def __init__(self, url: str, **options: Any) -> None:
        """Start the background loop; ``options`` are :class:`Client`'s keyword arguments."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chattts-sync", daemon=True)
        self._thread.start()
        self._client: Client = self._call(self._make(url, options), 5.0)
        self._wait = self._client.read_timeout + self._client.connect_timeout

    @staticmethod
    async def _make(url: str, options: dict[str, Any]) -> Client:
        return Client(url, **options)  # created on its loop: its locks and tasks belong there

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout if timeout is not None else self._wait)
        except TimeoutError:
            future.cancel()
            raise

    def __enter__(self) -> SyncClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def client(self) -> Client:
        """The asyncio client underneath (use it only through its loop)."""
        return self._client

    def connect(self) -> dict[str, Any]:
        """Connect now; the server's ``hello``."""
        return self._call(self._client.connect())

    def speak(self, text: str, **options: Any) -> Iterator[AudioChunk]:
        """Yield the chunks of ``text`` as they arrive (options as :meth:`Client.speak`).

        Leaving the loop early cancels the stream.
        """
        stream = self._client.speak(text, **options)
        chunks = aiter(stream)
        try:
            while True:
                try:
                    yield self._call(anext(chunks))  # type: ignore[arg-type]
                except StopAsyncIteration:
                    return
        finally:
            if not stream.finished:
                self._call(stream.cancel())

    def synthesize(self, text: str, **options: Any) -> bytes:
        """All of ``text``'s audio at once."""
        return b"".join(chunk.data for chunk in self.speak(text, **options))

    def close(self) -> None:
        """Close the connection and stop the background loop."""
        if not self._loop.is_running():
            return
        try:
            self._call(self._client.close(), self._client.connect_timeout + 5.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5.0)
            if not self._thread.is_alive():
                self._loop.close()
