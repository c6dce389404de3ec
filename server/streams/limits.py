"""Per-client protection: token-bucket rate limits and connection caps.

A *client* is its API key when it presented one, else its IP address. All
state is bounded: at most ``max_clients`` buckets are kept, least recently
used first out (a forgotten client starts with a full bucket, which only
ever errs towards letting a request through). Pure logic; clock injected.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class TokenBucket:
    """``rate`` tokens per second up to ``burst``; full when created."""

    rate: float
    burst: float
    tokens: float
    updated: float

    def take(self, now: float, cost: float = 1.0) -> float:
        """Take ``cost`` tokens; returns 0 on success, else seconds until it would succeed."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= cost:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self.rate


class ClientLimiter:
    """Rate limits on new streams and caps on open connections, per client."""

    def __init__(
        self,
        *,
        streams_per_minute: float,
        burst: int,
        max_connections: int,
        max_clients: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = streams_per_minute / 60.0
        self.burst = max(1, burst)
        self.max_connections = max_connections
        self.max_clients = max_clients
        self._clock = clock
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        self._connections: dict[str, int] = {}

    def retry_after_ms(self, client: str) -> int:
        """0 when ``client`` may start a stream now (and it is counted), else how long to wait."""
        if self.rate <= 0:
            return 0
        now = self._clock()
        bucket = self._buckets.pop(client, None) or TokenBucket(self.rate, self.burst, self.burst, now)
        self._buckets[client] = bucket  # most recently used last
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        wait = bucket.take(now)
        return 0 if wait == 0 else max(1, int(wait * 1000 + 0.999))

    def open_connection(self, client: str) -> bool:
        """Count a new connection; False (not counted) when the client is at its cap."""
        count = self._connections.get(client, 0)
        if self.max_connections > 0 and count >= self.max_connections:
            return False
        self._connections[client] = count + 1
        return True

    def close_connection(self, client: str) -> None:
        """A counted connection ended."""
        count = self._connections.get(client, 0) - 1
        if count > 0:
            self._connections[client] = count
        else:
            self._connections.pop(client, None)
