"""The direct channel: calls with replies in order, and the one-way mode the
SchedulerActor's intake uses (no replies; a failing call hangs up)."""

from __future__ import annotations

import pytest

from rayvllm.distributed.rpc_channel import ChannelClient, ChannelServer


class Target:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def put(self, value: int) -> int:
        self.seen.append(value)
        return value * 10

    def fail(self) -> None:
        raise ValueError("bad message")


def test_calls_reply_in_order_and_reraise() -> None:
    target = Target()
    server = ChannelServer(target, "127.0.0.1")
    client = ChannelClient(server.address, server.authkey)
    try:
        client.send("put", 1)
        client.send("put", 2)
        assert (client.recv(), client.recv()) == (10, 20)
        with pytest.raises(ValueError, match="bad message"):
            client.call("fail")
        assert client.call("put", 3) == 30  # a failed call does not end the channel
    finally:
        client.close()
        server.close()
