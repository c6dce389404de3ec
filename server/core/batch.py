"""The policy's vocabulary with the engine core: its tuning, the batch it decides, the step's outcome.

:class:`PolicyConfig` tunes :class:`~server.core.policy.SchedulingPolicy`; ``schedule`` answers a
:class:`Batch` (drop, add, step, probe or wait), which the core (``server.core.engine_core``) runs
on the engine, and ``update`` takes what happened as an :data:`Outcome`. Plain values, no logic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from server.engine_api import SequenceRequest, StepResult

#: The batch limit when ``max_batch`` is 0 and the engine states no limit of its own.
DEFAULT_MAX_BATCH = 16
#: The block-time estimate before any block ran (it then follows the measured times).
INITIAL_SECONDS_PER_BLOCK = 0.05


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """Tuning of the policy; ``server.config.Settings`` documents the flags behind it."""

    max_batch: int = 16  # 0: the engine's KV slots (EngineInfo.max_batch), set once it is loaded
    max_wait_s: float = 0.005
    max_queue: int = 256
    lookahead: int = 1
    lookahead_lead_s: float = 1.0
    max_tokens_per_segment: int = 2048
    breaker_threshold: int = 5
    breaker_probe_interval_s: float = 2.0
    oom_recovery_steps: int = 50


@dataclass(frozen=True, kw_only=True)
class Batch:
    """What the core does next, in this order: drop, add, then step (or probe); or wait.

    Attributes:
        drop: engine sequences to free (their streams ended).
        add: sequences admitted now.
        waited_s: for each of ``add``, how long it waited for its slot.
        step: the sequences the engine advances by one block.
        probe: run the engine's warm-up as the breaker's probe instead of a step.
        wait_until: when nothing is to be done: the time to schedule again
            unless a command comes first (None: wait for a command).
    """

    drop: tuple[int, ...] = ()
    add: tuple[SequenceRequest, ...] = ()
    waited_s: tuple[float, ...] = ()
    step: tuple[int, ...] = ()
    probe: bool = False
    wait_until: float | None = None

    @property
    def idle(self) -> bool:
        """Neither a step nor a probe."""
        return not self.step and not self.probe


@dataclass(frozen=True)
class Stepped:
    """The step ran: one result per sequence, and how long the engine took."""

    results: Sequence[StepResult]
    elapsed_s: float


@dataclass(frozen=True)
class StepFailed:
    """The step raised; every sequence in it fails."""

    message: str


@dataclass(frozen=True)
class OutOfMemory:
    """The step ran out of accelerator memory; fewer rows may fit."""


@dataclass(frozen=True)
class Probed:
    """The breaker's probe ran; ``ok`` when it succeeded."""

    ok: bool


Outcome = Stepped | StepFailed | OutOfMemory | Probed
