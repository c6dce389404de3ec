"""One request's outcome: what happened to it, and every stream it started accounted for.

A stream that got ``started`` ends ``done``, or was abandoned on purpose and verified freed;
anything else is *lost* (:attr:`Outcome.lost`). :mod:`bench.soak.verdict` tallies them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Outcome:
    """What happened to one request (every stream it started is accounted for)."""

    index: int
    kind: str
    sub: str
    fmt: str
    size: str
    chars: int
    outcome: str = ""
    problem: str | None = None
    started: int = 0  # `started` messages (streams the server created)
    done: int = 0  # `done` messages
    abandoned_freed: int = 0  # abandoned on purpose and verified freed after the TTL
    expected_errors: list[str] = field(default_factory=list)
    received_errors: list[str] = field(default_factory=list)
    frames: int = 0
    resumes: int = 0
    t_start: float = 0.0
    t_end: float = 0.0

    @property
    def lost(self) -> int:
        """Streams started but neither done nor verified freed."""
        return max(0, self.started - self.done - self.abandoned_freed)

    def fail(self, problem: str) -> None:
        """Record the first problem of this request."""
        if self.problem is None:
            self.problem = problem

    def settle(self, problem: str | None, outcome: str) -> None:
        """Record ``problem`` if there is one, else the request's ``outcome``."""
        if problem:
            self.fail(problem)
        else:
            self.outcome = outcome

    def compact(self) -> dict[str, Any]:
        """The per-request record in the JSON file."""
        record = asdict(self)
        record["t_start"], record["t_end"] = round(self.t_start, 3), round(self.t_end, 3)
        record["lost"] = self.lost
        return record
