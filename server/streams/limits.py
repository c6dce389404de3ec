"""Per-client protection: token-bucket rate limits and connection caps.

A *client* is its API key's tenant when keys are configured, else its IP address. All
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
        wait = self.wait(now, cost)
        if wait == 0:
            self.tokens -= cost
        return wait

    def wait(self, now: float, cost: float = 1.0) -> float:
        """Seconds until ``cost`` tokens are there (0: now); takes none."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        return 0.0 if self.tokens >= cost else (cost - self.tokens) / self.rate


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
        wait_ms = self.wait_ms(client)
        if wait_ms == 0:
            self.take(client)
        return wait_ms

    def wait_ms(self, client: str) -> int:
        """0 when ``client`` may start a stream now, else how long to wait; counts nothing.

        The service asks this first and :meth:`take` s only once the stream exists, so a
        ``start`` refused for another reason costs the client no token.
        """
        if self.rate <= 0:
            return 0
        wait = self._bucket(client).wait(self._clock())
        return 0 if wait == 0 else max(1, int(wait * 1000 + 0.999))

    def take(self, client: str) -> None:
        """Count a stream ``client`` started (after :meth:`wait_ms` said 0)."""
        if self.rate > 0:
            self._bucket(client).take(self._clock())

    def _bucket(self, client: str) -> TokenBucket:
        bucket = self._buckets.pop(client, None) or TokenBucket(
            self.rate, self.burst, self.burst, self._clock()
        )
        self._buckets[client] = bucket  # most recently used last
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return bucket

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
