"""The channel pool: one ``grpc.aio`` channel per broker address, shared by every caller.

Every channel of a pool has the same security (:class:`ChannelSecurity`): plaintext or TLS
(a CA bundle, optionally a client certificate), and optionally a bearer token sent as
``authorization: Bearer <token>`` metadata on every call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

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


def with_metadata(details: aio.ClientCallDetails, key: str, value: str) -> aio.ClientCallDetails:
    """``details`` with one more metadata entry ``key: value``."""
    metadata = aio.Metadata(*(details.metadata or ()))
    metadata.add(key, value)
    return aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready)


# grpc sorts a channel's interceptors by their first matching kind (``if``/``elif``), so one
# object implementing all four kinds would only see unary-unary calls: one class per kind.
# grpc ships no type hints: the bases are Any to mypy.


class _BearerUnaryUnary(aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, value: str) -> None:
        self._value = value

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(with_metadata(client_call_details, "authorization", self._value), request)


class _BearerUnaryStream(aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, value: str) -> None:
        self._value = value

    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(with_metadata(client_call_details, "authorization", self._value), request)


class _BearerStreamUnary(aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, value: str) -> None:
        self._value = value

    async def intercept_stream_unary(
        self, continuation: Callable[..., Any], client_call_details: aio.ClientCallDetails, request_iterator: Any
    ) -> Any:
        return await continuation(with_metadata(client_call_details, "authorization", self._value), request_iterator)


class _BearerStreamStream(aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, value: str) -> None:
        self._value = value

    async def intercept_stream_stream(
        self, continuation: Callable[..., Any], client_call_details: aio.ClientCallDetails, request_iterator: Any
    ) -> Any:
        return await continuation(with_metadata(client_call_details, "authorization", self._value), request_iterator)


def bearer_token_interceptors(token: str) -> tuple[aio.ClientInterceptor, ...]:
    """Interceptors adding ``authorization: Bearer <token>`` to every call of a plaintext
    channel, one per kind of call (a TLS channel carries the token as call credentials)."""
    value = f"Bearer {token}"
    return (_BearerUnaryUnary(value), _BearerUnaryStream(value), _BearerStreamUnary(value), _BearerStreamStream(value))


@dataclass(frozen=True, slots=True)
class ChannelSecurity:
    """How every channel of a pool is secured.

    Build it with :meth:`from_files`.

    Attributes:
        credentials: TLS channel credentials (with the token as call credentials when one is
            given), or ``None`` for plaintext.
        interceptors: on a plaintext channel, the interceptor adding the token, if any.
    """

    credentials: grpc.ChannelCredentials | None = None
    interceptors: tuple[aio.ClientInterceptor, ...] = ()

    @classmethod
    def from_files(
        cls,
        *,
        tls_ca_file: str | Path | None = None,
        tls_cert_file: str | Path | None = None,
        tls_key_file: str | Path | None = None,
        token: str | None = None,
    ) -> ChannelSecurity:
        """Read the TLS files (once) and build the channels' security.

        TLS is on when any of the three files is given; without ``tls_ca_file`` the server is
        verified against grpc's default roots.

        Args:
            tls_ca_file: PEM CA bundle verifying the brokers' certificates.
            tls_cert_file: PEM client certificate chain (mutual TLS), with ``tls_key_file``.
            tls_key_file: its PEM private key.
            token: a bearer token sent on every call.

        Raises:
            ValueError: only one of ``tls_cert_file`` and ``tls_key_file``, or an empty token.
            OSError: a file cannot be read.
        """
        if (tls_cert_file is None) != (tls_key_file is None):
            raise ValueError("a client certificate needs both tls_cert_file and tls_key_file")
        if token is not None and not token.strip():
            raise ValueError("the token is empty")
        token = token.strip() if token is not None else None
        if tls_ca_file is None and tls_cert_file is None:
            return cls(interceptors=bearer_token_interceptors(token) if token else ())
        credentials = grpc.ssl_channel_credentials(
            root_certificates=Path(tls_ca_file).read_bytes() if tls_ca_file is not None else None,
            private_key=Path(tls_key_file).read_bytes() if tls_key_file is not None else None,
            certificate_chain=Path(tls_cert_file).read_bytes() if tls_cert_file is not None else None,
        )
        if token:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.access_token_call_credentials(token)
            )
        return cls(credentials=credentials)

    def channel(self, address: str) -> grpc.aio.Channel:
        """A new channel to ``address`` (``"host:port"``) with this security."""
        if self.credentials is not None:
            return grpc.aio.secure_channel(address, self.credentials, options=_CHANNEL_OPTIONS)
        return grpc.aio.insecure_channel(
            address, options=_CHANNEL_OPTIONS, interceptors=list(self.interceptors) or None
        )


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
        security: how channels are secured; default plaintext without a token.
    """

    def __init__(self, *, close_grace_ms: int = 5_000, security: ChannelSecurity | None = None) -> None:
        self._security = security or ChannelSecurity()
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
            channel = self._security.channel(address)
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

    def discard(self, address: str, stubs: Stubs | None = None) -> None:
        """Drop the channel to ``address`` so the next call opens a fresh connection.

        Calls still running on the old channel get ``close_grace_ms`` to finish, then are
        cancelled: every producer and consumer on that broker reconnects.

        Args:
            address: ``"host:port"``.
            stubs: the stubs of the call that failed, if known: the channel is dropped only
                while it is still theirs. One opened since (after another call on the old
                channel failed) is kept, so one broken connection costs one reconnect, not
                one per call that was on it.
        """
        if stubs is not None and self._stubs.get(address) is not stubs:
            return
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
