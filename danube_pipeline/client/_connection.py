"""The channel pool: one ``grpc.aio`` channel per broker address, shared by every caller."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from danube_pipeline.client._tasks import cancel_and_wait
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

MAX_MESSAGE_LENGTH_BYTES = 64 * 1024 * 1024
"""gRPC send and receive limit, in bytes, on every channel."""

_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_LENGTH_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_LENGTH_BYTES),
    # A restarted broker should be reachable again quickly.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass(frozen=True, slots=True)
class Stubs:
    """Every service stub on one channel."""

    address: str
    producer: pb_grpc.ProducerServiceStub
    consumer: pb_grpc.ConsumerServiceStub
    discovery: pb_grpc.DiscoveryStub
    admin: pb_grpc.AdminStub
    schema: pb_grpc.SchemaRegistryStub


class ConnectionPool:
    """Opens channels lazily and keeps one per ``"host:port"``.

    Args:
        close_grace_ms: how long a discarded channel's calls may still run before they are
            cancelled, in milliseconds.
    """

    def __init__(self, *, close_grace_ms: int = 5_000) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, Stubs] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._close_grace_s = close_grace_ms / 1000
        self.channels_opened = 0
        """Channels created so far (for tests and diagnostics)."""

    def stubs(self, address: str) -> Stubs:
        """The stubs for ``address``, opening a channel if none is open.

        Args:
            address: ``"host:port"`` without a scheme.
        """
        stubs = self._stubs.get(address)
        if stubs is None:
            channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            self.channels_opened += 1
            self._channels[address] = channel
            stubs = Stubs(
                address=address,
                producer=pb_grpc.ProducerServiceStub(channel),
                consumer=pb_grpc.ConsumerServiceStub(channel),
                discovery=pb_grpc.DiscoveryStub(channel),
                admin=pb_grpc.AdminStub(channel),
                schema=pb_grpc.SchemaRegistryStub(channel),
            )
            self._stubs[address] = stubs
        return stubs

    def rank(self, address: str) -> int:
        """How cheap ``address`` is to contact: 0 connected, 1 channel open, 2 no channel.

        Brokers that are already connected are contacted before new connections are opened.
        """
        channel = self._channels.get(address)
        if channel is None:
            return 2
        state = channel.get_state(try_to_connect=False)
        return 0 if state == grpc.ChannelConnectivity.READY else 1

    def discard(self, address: str) -> None:
        """Drop the channel to ``address`` so the next call opens a fresh connection.

        Calls still running on the old channel get ``close_grace_ms`` to finish.
        """
        channel = self._channels.pop(address, None)
        self._stubs.pop(address, None)
        if channel is not None:
            task = asyncio.get_running_loop().create_task(channel.close(self._close_grace_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def addresses(self) -> list[str]:
        """Addresses with an open channel."""
        return list(self._channels)

    async def close(self) -> None:
        """Close every channel, cancelling calls still running."""
        channels = list(self._channels.values())
        self._channels.clear()
        self._stubs.clear()
        for channel in channels:
            await channel.close()
        await cancel_and_wait(*self._closing)
