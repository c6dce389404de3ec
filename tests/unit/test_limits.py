from __future__ import annotations

from server.frontends.access import ApiKeys, client_identity, origin_allowed, presented_key
from server.streams.limits import ClientLimiter


def test_token_bucket_allows_burst_then_rate() -> None:
    now = [0.0]
    limiter = ClientLimiter(streams_per_minute=60, burst=3, max_connections=0, clock=lambda: now[0])
    assert [limiter.retry_after_ms("a") for _ in range(3)] == [0, 0, 0]
    assert limiter.retry_after_ms("a") == 1000  # one token per second
    assert limiter.retry_after_ms("b") == 0  # other clients are unaffected
    now[0] = 1.0
    assert limiter.retry_after_ms("a") == 0


def test_unlimited_when_rate_is_zero() -> None:
    limiter = ClientLimiter(streams_per_minute=0, burst=1, max_connections=0)
    assert all(limiter.retry_after_ms("a") == 0 for _ in range(100))


def test_bucket_table_is_bounded() -> None:
    limiter = ClientLimiter(streams_per_minute=1, burst=1, max_connections=0, max_clients=10)
    for i in range(1000):
        limiter.retry_after_ms(f"c{i}")
    assert len(limiter._buckets) == 10


def test_connection_caps() -> None:
    limiter = ClientLimiter(streams_per_minute=0, burst=1, max_connections=2)
    assert limiter.open_connection("a") and limiter.open_connection("a")
    assert not limiter.open_connection("a")
    limiter.close_connection("a")
    assert limiter.open_connection("a")


def test_api_keys_and_where_they_come_from() -> None:
    keys = ApiKeys(["k1", "k2"])
    assert keys.required and keys.valid("k2") and not keys.valid("k3") and not keys.valid(None)
    assert not ApiKeys([]).required
    assert presented_key("/v1/stream", {"Authorization": "Bearer k1"}) == "k1"
    assert presented_key("/v1/stream", {"X-API-Key": "k2"}) == "k2"
    assert presented_key("/v1/stream?resume=t&api_key=k3", {}) == "k3"
    assert presented_key("/v1/stream", {}) is None
    assert "k1" not in client_identity("k1", "1.2.3.4") and client_identity(None, "1.2.3.4") == "ip:1.2.3.4"


def test_origins() -> None:
    allowed = frozenset({"https://app.example"})
    assert origin_allowed("https://app.example", allowed)
    assert not origin_allowed("https://evil.example", allowed)
    assert origin_allowed(None, allowed)  # not a browser
    assert origin_allowed("https://any.example", frozenset())


def test_client_ip_trusts_forwarded_for_only_when_told() -> None:
    from server.frontends.access import client_ip

    headers = {"X-Forwarded-For": "203.0.113.9, 10.0.0.2"}
    assert client_ip("10.0.0.2", headers, trust_forwarded_for=True) == "203.0.113.9"
    assert client_ip("10.0.0.2", headers, trust_forwarded_for=False) == "10.0.0.2"
    assert client_ip("10.0.0.2", {}, trust_forwarded_for=True) == "10.0.0.2"
