"""The ports' connection caps and fd shares, and the access log's redaction (pure logic)."""

from __future__ import annotations

import pytest

from server.frontends.http.accesslog import redact
from server.frontends.ports import MAX_LINGERING, PortGuard, limits_problem, port_caps
from server.streams.limits import ClientLimiter
from tests.integration.conftest import fake_settings


def test_each_port_gets_an_even_share_of_the_fds_left_after_the_reserve() -> None:
    connections, lingering = port_caps(1024, 128, 2, 2000)
    assert lingering == MAX_LINGERING and connections + lingering == (1024 - 128) // 2
    assert port_caps(1024, 128, 3, 2000)[0] + MAX_LINGERING == (1024 - 128) // 3
    assert port_caps(1 << 20, 128, 3, 2000) == (2000, MAX_LINGERING)  # --max-connections binds
    assert port_caps(130, 128, 3, 2000)[0] >= 1  # never 0: a tiny limit still serves


def test_a_port_guard_caps_the_port_and_each_client() -> None:
    refusals: list[str] = []
    limiter = ClientLimiter(streams_per_minute=0, burst=1, max_connections=2)
    guard = PortGuard("HTTP", (3, 1), counts=limiter, on_refused=refusals.append)
    assert guard.admit("ip:a") is None and guard.admit("ip:a") is None
    assert guard.admit("ip:a") == "too many connections from this client"
    assert guard.admit("ip:b") is None
    assert guard.admit("ip:c") == "the HTTP port is at its 3 connections"
    assert guard.open == 3 and refusals == ["too_many_connections"] * 2
    guard.release("ip:a")
    assert guard.admit("ip:a") is None  # room for the client and the port again
    assert limiter.open_connection("ip:a") is False  # the counts are the limiter's, shared


@pytest.mark.parametrize(
    ("target", "logged"),
    [
        ("/v1/models", "/v1/models"),
        ("/v1/models?api_key=sk-1", "/v1/models?api_key=[redacted]"),
        ("/v1/models?x=1&api_key=sk-1&y=2", "/v1/models?x=1&api_key=[redacted]&y=2"),
        ("/v1/models?api%5Fkey=sk-1", "/v1/models?api_key=[redacted]"),
        ("/v1/models?api_key=a&api_key=b", "/v1/models?api_key=[redacted]&api_key=[redacted]"),
        ("/v1/models?api_keys=keep", "/v1/models?api_keys=keep"),
    ],
)
def test_every_api_key_parameter_is_redacted(target: str, logged: str) -> None:
    assert redact(target) == logged


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--max-json-depth", "0"), "--max-json-depth"),
        (("--max-json-depth", "1000"), "--max-json-depth"),
        (("--header-timeout-s", "0"), "--header-timeout-s"),
        (("--body-timeout-s", "-1"), "--body-timeout-s"),
        (("--close-timeout-s", "0"), "--close-timeout-s"),
        (("--wyoming-idle-timeout-s", "0"), "--wyoming-idle-timeout-s"),
        (("--wyoming-text-timeout-s", "0"), "--wyoming-text-timeout-s"),
        (("--fd-reserve", "-1"), "--fd-reserve"),
    ],
)
def test_limits_that_cannot_work_name_their_flag(flags: tuple[str, ...], named: str) -> None:
    problem = limits_problem(fake_settings(*flags))
    assert problem is not None and problem.startswith(named)
    assert limits_problem(fake_settings()) is None


def test_a_flood_of_refusals_is_one_log_line_not_a_flood(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="server.frontends.ports")
    guard = PortGuard("HTTP", (1, 0))
    assert guard.admit(None) is None
    for _ in range(1000):
        assert guard.admit(None) is not None
    [line] = [r.getMessage() for r in caplog.records]
    assert line == "HTTP port refused 1 connections (the last: the HTTP port is at its 1 connections)"
