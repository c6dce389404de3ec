"""The virtual clock of ``python -m bench.gpu_sim``: the inference thread's CPU, plus modelled waits.

:class:`VirtualClock` is the inference thread's time: every second of CPU the thread really
spends (``time.thread_time``: the policy, the engine core, the hand-off, the simulated engine's
own Python around each launch) moves it on, and so does every wait for the modelled device.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class VirtualClock:
    """The inference thread's virtual time: its real CPU time, plus modelled waits.

    ``now()`` first adds the CPU time the calling thread spent since the last reading
    (``time.thread_time``, so other processes on a shared machine do not inflate it), times
    ``host_scale``, unless inside :meth:`uncharged` (the simulation's own work, which stands for
    the device or the outside world). The clock is read from one thread only.
    """

    def __init__(self, host_scale: float = 1.0) -> None:
        self.host_scale = host_scale
        self._t = 0.0
        self._mark = time.thread_time()
        self._paused = 0
        #: Host seconds charged: measured CPU time times ``host_scale``, plus :meth:`charge`.
        self.host_s = 0.0
        #: Seconds spent waiting: for the device, or idle for a command.
        self.wait_s = 0.0

    def _sync(self) -> None:
        cpu = time.thread_time()
        if not self._paused:
            spent = (cpu - self._mark) * self.host_scale
            self._t += spent
            self.host_s += spent
        self._mark = cpu

    def now(self) -> float:
        """Virtual seconds since the clock was made."""
        self._sync()
        return self._t

    def charge(self, seconds: float) -> None:
        """Host work that runs in code this machine has not (the CUDA driver)."""
        self._sync()
        self._t += seconds
        self.host_s += seconds

    def wait_until(self, t: float) -> None:
        """Block (no CPU) until virtual time ``t``; no-op when it has passed."""
        self._sync()
        if t > self._t:
            self.wait_s += t - self._t
            self._t = t

    @contextmanager
    def uncharged(self) -> Iterator[None]:
        """CPU spent inside is the simulation's own, not the server's: it moves no time."""
        self._sync()
        self._paused += 1
        try:
            yield
        finally:
            self._sync()
            self._paused -= 1
