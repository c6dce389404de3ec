"""The test helper that picks ports for spawned servers."""

from __future__ import annotations

import socket

import pytest

from tests import serverproc
from tests.serverproc import _bindable, _ports_below_ephemeral, free_port


def test_free_port_and_the_next_one_bind_outside_the_ephemeral_range() -> None:
    # A server spawned with only --port serves HTTP on --port + 1: both must bind, and
    # neither may be a port the kernel can hand to some client in the meantime.
    low, high = _ports_below_ephemeral()
    for _ in range(20):
        port = free_port()
        assert low <= port < port + 1 <= high
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", port))
            second.bind(("127.0.0.1", port + 1))


def test_free_port_skips_a_port_whose_neighbour_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ports b..b+3 free; hold b+1. In the range b..b+3 only b+2 has a free neighbour:
    # a pick that checked its own port alone would return b a third of the time.
    base = next(b for b in range(*_ports_below_ephemeral()) if all(map(_bindable, range(b, b + 4))))
    monkeypatch.setattr(serverproc, "_ports_below_ephemeral", lambda: (base, base + 3))
    with socket.socket() as held:
        held.bind(("127.0.0.1", base + 1))
        assert {free_port() for _ in range(30)} == {base + 2}
