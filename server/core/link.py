"""How the engine client reaches its core: a thread of this process, or a process of its own.

:class:`CoreLink` is what :class:`~server.core.client.EngineClient` needs of the place its
core runs: start it, send it commands, have its event batches delivered on the event loop,
stop it. :class:`ThreadLink` runs the core on a thread of this process (the default);
``server.core.remote.link.ProcessLink`` runs it in an engine process (``--engine-process``).
The client above either is the same: admission, generations, readiness.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Protocol

from server.core.engine_core import EngineCore
from server.core.events import Command, CoreEvent
from server.core.meters import CoreMetrics
from server.core.policy import PolicyConfig
from server.engine_api import Engine, EngineText

#: Called on the event loop with each event batch, in order.
Deliver = Callable[[list[CoreEvent]], None]
#: Called on the event loop when the core is gone without having stopped (its process died).
Lost = Callable[[str], None]


class CoreLink(Protocol):
    """Where the core runs, as the engine client sees it."""

    async def start(self, deliver: Deliver, lost: Lost) -> None:
        """Start the core; its events (``Loaded`` or ``LoadFailed`` first) go to ``deliver``."""

    def send(self, command: Command) -> None:
        """Queue a command for the core (the event loop's thread)."""

    def shutdown(self) -> None:
        """Ask the core to stop after its current step."""

    async def join(self) -> None:
        """Until the core has ended (after a failed load, or :meth:`shutdown`)."""

    @property
    def connected(self) -> bool:
        """A command sent now reaches a running core."""

    @property
    def alive(self) -> bool:
        """The core runs, or is being brought back (not stopped for good)."""

    @property
    def text(self) -> EngineText:
        """What answers ``validate_voice`` and ``text_tokens`` in this process (any thread)."""

    @property
    def engine(self) -> Engine:
        """The engine object itself, where it lives in this process (tests read the fake engine's logs)."""


class ThreadLink:
    """The core on a thread of this process; its events cross with one ``call_soon_threadsafe`` a batch."""

    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        *,
        config: PolicyConfig,
        metrics: CoreMetrics,
        warmup: bool = True,
    ) -> None:
        self._core = EngineCore(engine_factory, config, emit=self._emit, metrics=metrics, warmup=warmup)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Deliver | None = None

    async def start(self, deliver: Deliver, lost: Lost) -> None:
        """Start the inference thread (a thread cannot be lost without the process: ``lost`` unused)."""
        self._loop, self._deliver = asyncio.get_running_loop(), deliver
        self._thread = threading.Thread(target=self._core.run, name="inference", daemon=True)
        self._thread.start()

    def _emit(self, events: list[CoreEvent]) -> None:
        """The core's sink (inference thread): one hand-off to the event loop per batch."""
        loop, deliver = self._loop, self._deliver
        if loop is not None and deliver is not None:
            # A closed event loop raises RuntimeError: nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(deliver, events)

    def send(self, command: Command) -> None:
        """Into the core's intake."""
        self._core.send(command)

    def shutdown(self) -> None:
        """The core stops after its current step."""
        self._core.shutdown()

    async def join(self) -> None:
        """Until the inference thread has ended."""
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def connected(self) -> bool:
        """Started (commands queue until the loop takes them)."""
        return self._thread is not None

    @property
    def alive(self) -> bool:
        """The inference thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def text(self) -> EngineText:
        """The engine itself (engines answer these from immutable data, on any thread)."""
        return self.engine

    @property
    def engine(self) -> Engine:
        """The loaded engine."""
        assert self._core.engine is not None, "engine not loaded"
        return self._core.engine
