"""One connection to etcd: its endpoint, its request timeouts and deadlines, and the raw calls.

:class:`EtcdConnection` holds the ``aetcd`` client (``aetcd`` 1.0, asyncio gRPC for the etcd v3
API) and the calls every higher layer is built on: a raw range read and a transaction that
return the etcd header revision, lease keep-alive and revoke, and opening and cancelling a
watch. :class:`~danube_pipeline.metadata.store.MetadataStore` adds the JSON key-value
operations of ``docs/etcd-layout.md`` on top.

Each unary etcd request waits at most ``request_timeout_s``, and never past the deadline of the
enclosing :func:`deadline_scope` (the broker opens one per RPC with the client's deadline).
Every failure is raised as :class:`~danube_pipeline.errors.MetadataStoreError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from types import TracebackType
from typing import Any, Self

import aetcd
from aetcd import rpc

from danube_pipeline.errors import MetadataStoreError
from danube_pipeline.metadata.etcd import split_endpoint, wrap_errors

_CHANNEL_OPTIONS = (
    # Reconnect to a restarted etcd within about a second (gRPC's default backoff grows to 2 min).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

_deadline: ContextVar[float | None] = ContextVar("danube_etcd_deadline", default=None)


@contextlib.contextmanager
def deadline_scope(budget_s: float | None) -> Iterator[None]:
    """Bound every etcd request made inside the block (and in tasks it creates) to end within
    ``budget_s`` seconds from now; ``None`` adds no bound. Scopes nest: the earlier deadline wins.

    A request that would outlive the deadline fails with
    :class:`~danube_pipeline.errors.MetadataStoreError` when it is reached.
    """
    if budget_s is None:
        yield
        return
    deadline = time.monotonic() + budget_s
    outer = _deadline.get()
    token = _deadline.set(deadline if outer is None else min(deadline, outer))
    try:
        yield
    finally:
        _deadline.reset(token)


def remaining_budget_s() -> float | None:
    """Seconds left before the innermost :func:`deadline_scope` ends, ``None`` outside one."""
    deadline = _deadline.get()
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class EtcdConnection:
    """A connection to one etcd endpoint, with the raw calls the metadata layer is built on.

    Create with :meth:`connect`; close with :meth:`close` or ``async with``.
    """

    def __init__(self, client: aetcd.Client, endpoint: str, *, request_timeout_s: float) -> None:
        """Wrap an already connected aetcd client; use :meth:`connect` instead."""
        self._client = client
        self._endpoint = endpoint
        self._request_timeout_s = request_timeout_s
        self._closed = False

    @classmethod
    async def connect(
        cls,
        endpoints: Sequence[str],
        *,
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 10.0,
    ) -> Self:
        """Connect to the first etcd endpoint that answers.

        Args:
            endpoints: ``host:port`` strings (an ``http://`` prefix is accepted and ignored),
                tried in order.
            connect_timeout_s: how long each endpoint gets to answer a probe read.
            request_timeout_s: deadline of every later unary etcd request.

        Returns:
            A connected store.

        Raises:
            MetadataStoreError: if ``endpoints`` is empty or malformed, or no endpoint answers.
        """
        if not endpoints:
            raise MetadataStoreError("connect", "no etcd endpoints given")
        failures: list[str] = []
        for endpoint in endpoints:
            host, port = split_endpoint(endpoint)
            client = aetcd.Client(host=host, port=port, timeout=request_timeout_s, options=dict(_CHANNEL_OPTIONS))
            store = cls(client, f"{host}:{port}", request_timeout_s=request_timeout_s)
            try:
                await asyncio.wait_for(store.range_raw(b"/", None, limit=1), connect_timeout_s)
            except (MetadataStoreError, TimeoutError) as exc:
                failures.append(f"{endpoint}: {exc or 'timed out'}")
                with contextlib.suppress(Exception):
                    await client.close()
                continue
            return store
        raise MetadataStoreError(
            "connect", "no etcd endpoint answered (" + "; ".join(failures) + ")"
        )

    @property
    def endpoint(self) -> str:
        """The ``host:port`` this store is connected to."""
        return self._endpoint

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called; every operation then raises."""
        return self._closed

    async def close(self) -> None:
        """Close the connection (idempotent); open watches end, later calls raise
        :class:`MetadataStoreError`."""
        self._closed = True
        with contextlib.suppress(Exception):
            await self._client.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _timeout(self, operation: str) -> float:
        """Seconds the next etcd request may take: ``request_timeout_s``, or less to end by
        the deadline of the enclosing :func:`deadline_scope`.

        Raises:
            MetadataStoreError: the deadline has passed.
        """
        deadline = _deadline.get()
        if deadline is None:
            return self._request_timeout_s
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise MetadataStoreError(operation, "no time left before the request's deadline")
        return min(self._request_timeout_s, remaining)

    async def _connected(self) -> aetcd.Client:
        if self._closed:
            raise MetadataStoreError("request", "the metadata store is closed")
        await self._client.connect()
        return self._client

    async def range_raw(
        self, key: bytes, range_end: bytes | None, *, revision: int = 0, limit: int = 0
    ) -> Any:
        """One etcd ``Range`` request, answered as etcd's raw ``RangeResponse`` (its header
        carries the revision); ``range_end`` ``None`` reads the one key."""
        with wrap_errors("get"):
            timeout = self._timeout("get")
            client = await self._connected()
            request = rpc.RangeRequest(
                key=key,
                range_end=range_end or b"",
                revision=revision,
                limit=limit,
                sort_order=rpc.RangeRequest.ASCEND,
                sort_target=rpc.RangeRequest.KEY,
            )
            return await client.kvstub.Range(request, timeout=timeout, metadata=client.metadata)

    async def _txn(
        self, operation: str, compare: Sequence[Any], success: Sequence[Any]
    ) -> tuple[bool, int]:
        with wrap_errors(operation):
            timeout = self._timeout(operation)
            client = await self._connected()
            response = await client.kvstub.Txn(
                rpc.TxnRequest(compare=list(compare), success=list(success), failure=[]),
                timeout=timeout,
                metadata=client.metadata,
            )
        return bool(response.succeeded), int(response.header.revision)

    async def refresh_lease(self, lease_id: int, *, timeout_s: float | None = None) -> int:
        """Send one keep-alive for ``lease_id``; return the TTL etcd granted (0 = the lease is gone).

        Raises:
            MetadataStoreError: etcd did not answer within ``timeout_s`` (default the request
                timeout).
        """
        with wrap_errors("lease keep-alive"):
            client = await self._connected()
            async for reply in client.leasestub.LeaseKeepAlive(
                [rpc.LeaseKeepAliveRequest(ID=lease_id)],
                timeout=timeout_s or self._request_timeout_s,
                metadata=client.metadata,
            ):
                return int(reply.TTL)
        return 0

    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke ``lease_id``: etcd deletes every key attached to it."""
        with wrap_errors("lease revoke"):
            client = await self._connected()
            await client.revoke_lease(lease_id)

    async def open_watch(self, key: bytes, range_end: bytes, start_revision: int) -> aetcd.Watch:
        """Start an etcd watch of ``key`` .. ``range_end`` from ``start_revision`` (inclusive)."""
        with wrap_errors("watch"):
            client = await self._connected()
            return await client.watch(key, range_end=range_end, start_revision=start_revision)

    @staticmethod
    async def cancel_watch(watch: aetcd.Watch) -> None:
        """Cancel ``watch``, waiting at most 2 s; errors are ignored."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(watch.cancel(), 2.0)
