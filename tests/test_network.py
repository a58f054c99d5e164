"""`free_port` picks below the OS's ephemeral range, where an outgoing
connection (any RPC client's local end) cannot take the port between the
pick and the listener's bind; it falls back to the OS's pick where there is
no room below."""

from __future__ import annotations

import socket

import pytest

from rayvllm.utils import network


def test_a_free_port_lies_below_the_ephemeral_range_and_binds() -> None:
    low = network._ephemeral_low()
    ports = {network.free_port() for _ in range(20)}
    if low - network._LOWEST_PICK >= 1024:
        assert all(network._LOWEST_PICK <= p < low for p in ports), (low, ports)
    # Never one of Ray's default worker ports, which a Ray node will not give its GCS or dashboard.
    assert not any(10002 <= p <= 19999 for p in ports), ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_taken_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("", 0))
        taken = held.getsockname()[1]
        # The only candidate below the range is the port held here.
        monkeypatch.setattr(network, "_LOWEST_PICK", taken - 1024)
        monkeypatch.setattr(network, "_ephemeral_low", lambda: taken + 1)
        monkeypatch.setattr(network.random.SystemRandom, "randrange", lambda self, a, b: taken)
        port = network.free_port()  # every pick fails: the OS's own
        assert port != taken
        with socket.socket() as s:
            s.bind(("", port))
