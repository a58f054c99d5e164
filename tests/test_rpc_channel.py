"""The direct channel: one handler, replies in the order messages came,
a handler's exception re-raised at the client without ending the channel."""

from __future__ import annotations

import pytest

from rayvllm.distributed.rpc_channel import ChannelClient, ChannelServer


class Target:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def handle(self, value: int) -> int:
        if value < 0:
            raise ValueError("bad message")
        self.seen.append(value)
        return value * 10


def test_messages_reply_in_order_and_reraise() -> None:
    target = Target()
    server: ChannelServer[int, int] = ChannelServer(target.handle, "127.0.0.1")
    client: ChannelClient[int, int] = ChannelClient(server.address, server.authkey)
    try:
        client.send(1)
        client.send(2)
        assert (client.recv(), client.recv()) == (10, 20)
        with pytest.raises(ValueError, match="bad message"):
            client.call(-1)
        assert client.call(3) == 30  # a failed message does not end the channel
        assert target.seen == [1, 2, 3]
    finally:
        client.close()
        server.close()
