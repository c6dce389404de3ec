"""How well the engine's steps go: the batch limit after out-of-memory, and the breaker.

Pure state (no clock: ``now`` is passed in), owned by the scheduling policy
(``server.core.policy``), whose docstring states the two rules:

- **Out of memory**: the batch limit halves to the first half of the step that ran out
  (the rest stay paused in the engine); it grows back by one every ``oom_recovery_steps``
  good steps.
- **Breaker**: ``breaker_threshold`` consecutive failed steps open it; a probe runs every
  ``breaker_probe_interval_s`` until one succeeds, which closes it.
"""

from __future__ import annotations


class StepHealth:
    """The batch limit and the breaker, moved by the outcomes of the engine's steps.

    Args:
        max_batch: the batch limit with no out-of-memory behind it.
        breaker_threshold: consecutive failed steps that open the breaker.
        probe_interval_s: while open, how long from one probe (or the opening) to the next.
        oom_recovery_steps: good steps after which the limit grows back by one.
    """

    def __init__(
        self, *, max_batch: int, breaker_threshold: int, probe_interval_s: float, oom_recovery_steps: int
    ) -> None:
        self.max_batch = max_batch
        self.breaker_threshold = breaker_threshold
        self.probe_interval_s = probe_interval_s
        self.oom_recovery_steps = oom_recovery_steps
        #: Sequences one step may hold now (``max_batch`` until an out-of-memory lowers it).
        self.batch_limit = max_batch
        self._good_steps = 0  # since the last out-of-memory
        self._failures = 0  # consecutive failed steps
        self._breaker_since: float | None = None  # opened, or last probe failed, at

    @property
    def breaker_open(self) -> bool:
        """Too many consecutive failed steps; closed by a successful probe."""
        return self._breaker_since is not None

    @property
    def probe_due(self) -> float | None:
        """When the open breaker's next probe runs (None: the breaker is closed)."""
        if self._breaker_since is None:
            return None
        return self._breaker_since + self.probe_interval_s

    def out_of_memory(self, rows: int) -> None:
        """A step of ``rows`` (more than one) ran out of memory: retry with the first half."""
        self.batch_limit = max(1, rows // 2)
        self._good_steps = 0

    def stepped(self) -> None:
        """A step succeeded: the failure count resets and the batch limit may grow back."""
        self._failures = 0
        if self.batch_limit >= self.max_batch:
            return
        self._good_steps += 1
        if self._good_steps >= self.oom_recovery_steps:
            self.batch_limit += 1
            self._good_steps = 0

    def failed(self) -> bool:
        """A step failed; True when this failure opens the breaker (the caller then calls :meth:`open`)."""
        self._failures += 1
        return self._failures >= self.breaker_threshold and not self.breaker_open

    def open(self, now: float) -> None:
        """Open the breaker at ``now``: the first probe is due one interval later."""
        self._breaker_since = now

    def probed(self, ok: bool, now: float) -> bool:
        """The probe's outcome; True when it closed the breaker."""
        if not ok:
            self._breaker_since = now
            return False
        self._breaker_since = None
        self._failures = 0
        return True
