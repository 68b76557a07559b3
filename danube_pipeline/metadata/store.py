"""The etcd-backed :class:`MetadataStore` (writes) and the per-process :class:`LocalCache` (reads).

Seed ``000``, "MetadataStore and LocalCache Pattern": etcd is the source of truth and takes
every write; each process keeps a :class:`LocalCache` that loads the keys once and then
follows an etcd watch, so reads never go to etcd.

Values are JSON: they are written with :func:`danube_pipeline.metadata.values.encode` (compact
UTF-8 JSON) and read back with :func:`~danube_pipeline.metadata.values.decode`. An empty etcd
value reads as ``None`` (``null``); a value that is not JSON (written by some other tool) reads
as its text and is logged.

Every failure to reach etcd, or an RPC etcd rejects, is raised as
:class:`~danube_pipeline.errors.MetadataStoreError` (``retriable``).

The wire layer is ``aetcd`` 1.0 (asyncio gRPC client for the etcd v3 API). Reads, puts and
transactions go through its raw KV stub so that every answer carries the etcd header revision;
watches use its watcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import aetcd
import grpc
from aetcd import rpc

from danube_pipeline.errors import MetadataStoreError
from danube_pipeline.metadata import values
from danube_pipeline.metadata.values import JsonRecord, JsonValue

__all__ = [
    "KeyValue",
    "Lease",
    "LocalCache",
    "MetadataStore",
    "WatchEvent",
    "WatchEventType",
]

log = logging.getLogger(__name__)

_ALL_KEYS = b"\0"
"""``key = range_end = b"\\0"`` selects the whole key space in etcd range requests."""


@dataclasses.dataclass(frozen=True, slots=True)
class KeyValue:
    """One etcd key with its decoded JSON value.

    Attributes:
        key: the etcd key, e.g. ``/cluster/register/625722408599041316``.
        value: the decoded JSON value (``None`` for a ``null`` marker).
        create_revision: etcd revision that created the key.
        mod_revision: etcd revision of the last change to the key.
        version: number of writes since the key was created (1 after the first put).
    """

    key: str
    value: JsonValue
    create_revision: int
    mod_revision: int
    version: int


class WatchEventType(enum.Enum):
    """Kind of change a :class:`WatchEvent` reports."""

    PUT = "put"
    DELETE = "delete"


@dataclasses.dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change seen by a watch.

    Attributes:
        type: :attr:`WatchEventType.PUT` or :attr:`WatchEventType.DELETE`.
        key: the changed key.
        value: the new decoded value; ``None`` for a DELETE.
        mod_revision: the etcd revision of the change.
    """

    type: WatchEventType
    key: str
    value: JsonValue | None
    mod_revision: int


@contextlib.contextmanager
def _wrap_errors(operation: str) -> Iterator[None]:
    """Turn aetcd / gRPC / socket failures into :class:`MetadataStoreError`."""
    try:
        yield
    except MetadataStoreError:
        raise
    except (aetcd.ClientError, grpc.RpcError, OSError, TimeoutError) as exc:
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, grpc.aio.AioRpcError):
            reason = f"{exc.code().name}: {exc.details()}"
        raise MetadataStoreError(operation, reason) from exc


def _decode_value(key: str, raw: bytes) -> JsonValue:
    if not raw:
        return None
    try:
        return values.decode(raw)
    except ValueError:
        log.warning("etcd key %s holds a value that is not JSON; reading it as text", key)
        return raw.decode("utf-8", errors="replace")


def _key_value(kv: Any) -> KeyValue:
    key = bytes(kv.key).decode()
    return KeyValue(
        key=key,
        value=_decode_value(key, bytes(kv.value)),
        create_revision=int(kv.create_revision),
        mod_revision=int(kv.mod_revision),
        version=int(kv.version),
    )


def _prefix_range_end(prefix: bytes) -> bytes:
    """etcd ``range_end`` selecting every key that starts with ``prefix``."""
    if not prefix:
        return _ALL_KEYS
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return _ALL_KEYS


def _compare_mod(key: str, mod_revision: int) -> Any:
    return rpc.Compare(
        key=key.encode(),
        target=rpc.Compare.MOD,
        result=rpc.Compare.EQUAL,
        mod_revision=mod_revision,
    )


def _compare_absent(key: str) -> Any:
    return rpc.Compare(
        key=key.encode(),
        target=rpc.Compare.CREATE,
        result=rpc.Compare.EQUAL,
        create_revision=0,
    )


def _put_op(key: str, value: JsonValue | JsonRecord, lease_id: int = 0) -> Any:
    return rpc.RequestOp(
        request_put=rpc.PutRequest(key=key.encode(), value=values.encode(value), lease=lease_id)
    )


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    address = endpoint.split("://", 1)[-1].rstrip("/")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise MetadataStoreError("connect", f"endpoint {endpoint!r} is not 'host:port'")
    return host.strip("[]"), int(port)


class Lease:
    """An etcd lease that keeps itself alive until revoked.

    Keys put with a lease disappear when the lease ends: on :meth:`revoke`, or ``ttl_s``
    seconds after the last refresh if the process dies (used for broker registration,
    seed ``000`` §1.2). While ``keepalive`` is on, a background task refreshes the lease every
    ``ttl_s / 3`` seconds. Usable as ``async with`` (revokes on exit).

    Attributes:
        id: the etcd lease id.
        ttl_s: the TTL etcd granted, in seconds (etcd may round small TTLs up).
    """

    def __init__(self, store: MetadataStore, lease_id: int, ttl_s: int, *, keepalive: bool) -> None:
        self.id = lease_id
        self.ttl_s = ttl_s
        self._store = store
        self._expired = False
        self._task: asyncio.Task[None] | None = None
        if keepalive:
            self._task = asyncio.get_running_loop().create_task(
                self._keepalive(), name=f"etcd-lease-{lease_id}-keepalive"
            )

    @property
    def expired(self) -> bool:
        """True once etcd reported the lease gone (keep-alive answered TTL 0) or it was revoked."""
        return self._expired

    async def _keepalive(self) -> None:
        interval_s = max(self.ttl_s / 3.0, 0.2)
        while True:
            await asyncio.sleep(interval_s)
            if self._store.closed:
                return
            try:
                ttl_s = await self._store._refresh_lease(self.id)
            except MetadataStoreError as exc:
                log.warning("lease %d keep-alive failed (will retry): %s", self.id, exc)
                continue
            if ttl_s <= 0:
                log.error("lease %d expired before it could be refreshed", self.id)
                self._expired = True
                return

    async def revoke(self) -> None:
        """Stop refreshing and revoke the lease; every key attached to it is deleted.

        Revoking a lease that already expired is not an error.

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._expired:
            return
        try:
            await self._store._revoke_lease(self.id)
        except MetadataStoreError as exc:
            if "not found" not in exc.reason:
                raise
        self._expired = True

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.revoke()

    def __repr__(self) -> str:
        return f"Lease(id={self.id}, ttl_s={self.ttl_s}, expired={self._expired})"


class MetadataStore:
    """Write (and direct read) access to Danube's etcd metadata (seed ``000``).

    Create with :meth:`connect`; close with :meth:`close` or ``async with``. Keys are the
    strings of :mod:`danube_pipeline.metadata.keys`; values are JSON values or
    :class:`~danube_pipeline.metadata.values.JsonRecord` instances.
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
    ) -> MetadataStore:
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
            host, port = _split_endpoint(endpoint)
            client = aetcd.Client(host=host, port=port, timeout=request_timeout_s)
            store = cls(client, f"{host}:{port}", request_timeout_s=request_timeout_s)
            try:
                await asyncio.wait_for(store._range(b"/", None, limit=1), connect_timeout_s)
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

    # ---- wire helpers

    async def _connected(self) -> aetcd.Client:
        if self._closed:
            raise MetadataStoreError("request", "the metadata store is closed")
        await self._client.connect()
        return self._client

    async def _range(
        self, key: bytes, range_end: bytes | None, *, revision: int = 0, limit: int = 0
    ) -> Any:
        with _wrap_errors("get"):
            client = await self._connected()
            request = rpc.RangeRequest(
                key=key,
                range_end=range_end or b"",
                revision=revision,
                limit=limit,
                sort_order=rpc.RangeRequest.ASCEND,
                sort_target=rpc.RangeRequest.KEY,
            )
            return await client.kvstub.Range(
                request, timeout=self._request_timeout_s, metadata=client.metadata
            )

    async def _txn(
        self, operation: str, compare: Sequence[Any], success: Sequence[Any]
    ) -> tuple[bool, int]:
        with _wrap_errors(operation):
            client = await self._connected()
            response = await client.kvstub.Txn(
                rpc.TxnRequest(compare=list(compare), success=list(success), failure=[]),
                timeout=self._request_timeout_s,
                metadata=client.metadata,
            )
        return bool(response.succeeded), int(response.header.revision)

    async def _refresh_lease(self, lease_id: int) -> int:
        with _wrap_errors("lease keep-alive"):
            client = await self._connected()
            reply = await client.refresh_lease(lease_id)
        return int(reply.TTL) if reply is not None else 0

    async def _revoke_lease(self, lease_id: int) -> None:
        with _wrap_errors("lease revoke"):
            client = await self._connected()
            await client.revoke_lease(lease_id)

    async def _open_watch(self, key: bytes, range_end: bytes, start_revision: int) -> aetcd.Watch:
        with _wrap_errors("watch"):
            client = await self._connected()
            return await client.watch(key, range_end=range_end, start_revision=start_revision)

    @staticmethod
    async def _cancel_watch(watch: aetcd.Watch) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(watch.cancel(), 2.0)

    # ---- reads

    async def get(self, key: str) -> KeyValue | None:
        """Read one key straight from etcd (linearizable).

        Returns:
            The key and its decoded value, or ``None`` if it does not exist.

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        response = await self._range(key.encode(), None)
        return _key_value(response.kvs[0]) if response.kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Read every key that starts with ``prefix``, at one etcd revision.

        Returns:
            ``(kvs, revision)``: the keys sorted by key, and the etcd header revision the read
            saw (watch from ``revision + 1`` to miss nothing).

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        raw = prefix.encode()
        response = await self._range(raw, _prefix_range_end(raw))
        return [_key_value(kv) for kv in response.kvs], int(response.header.revision)

    # ---- writes

    async def put(
        self, key: str, value: JsonValue | JsonRecord, *, lease: Lease | None = None
    ) -> int:
        """Write ``value`` (JSON-encoded) at ``key``.

        Args:
            key: the etcd key.
            value: a JSON value or a :class:`JsonRecord`.
            lease: attach the key to this lease (it is deleted when the lease ends).

        Returns:
            The etcd revision of the write.

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        with _wrap_errors("put"):
            client = await self._connected()
            response = await client.kvstub.Put(
                rpc.PutRequest(
                    key=key.encode(), value=values.encode(value), lease=lease.id if lease else 0
                ),
                timeout=self._request_timeout_s,
                metadata=client.metadata,
            )
        return int(response.header.revision)

    async def put_many(self, items: Sequence[tuple[str, JsonValue | JsonRecord]]) -> int:
        """Write several keys in one etcd transaction: all or none, at one revision.

        Returns:
            The etcd revision of the write.

        Raises:
            MetadataStoreError: if etcd cannot be reached or rejects the transaction (e.g. the
                same key twice, or more operations than etcd's ``--max-txn-ops``, 128 by default).
        """
        _, revision = await self._txn("put_many", [], [_put_op(k, v) for k, v in items])
        return revision

    async def compare_and_put_many(
        self,
        items: Sequence[tuple[str, JsonValue | JsonRecord]],
        *,
        expected_mod_revisions: Mapping[str, int],
    ) -> int | None:
        """Write several keys atomically iff every guarded key is unchanged.

        Args:
            items: ``(key, value)`` pairs to write.
            expected_mod_revisions: ``key -> mod_revision`` each key must still have; ``0``
                means the key must not exist.

        Returns:
            The etcd revision of the write, or ``None`` if a comparison failed (nothing written).

        Raises:
            MetadataStoreError: if etcd cannot be reached or rejects the transaction.
        """
        compare = [
            _compare_absent(k) if rev == 0 else _compare_mod(k, rev)
            for k, rev in expected_mod_revisions.items()
        ]
        ok, revision = await self._txn(
            "compare_and_put_many", compare, [_put_op(k, v) for k, v in items]
        )
        return revision if ok else None

    async def put_if_absent(
        self, key: str, value: JsonValue | JsonRecord, *, lease: Lease | None = None
    ) -> bool:
        """Create ``key`` only if it does not exist (etcd txn on ``create_revision == 0``).

        Returns:
            True if this call created the key; False if it already existed.

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        ok, _ = await self._txn(
            "put_if_absent", [_compare_absent(key)], [_put_op(key, value, lease.id if lease else 0)]
        )
        return ok

    async def compare_and_put(
        self, key: str, value: JsonValue | JsonRecord, *, expected_mod_revision: int
    ) -> bool:
        """Write ``key`` only if its ``mod_revision`` is still ``expected_mod_revision``.

        Args:
            key: the etcd key.
            value: the new value.
            expected_mod_revision: the ``mod_revision`` last read; ``0`` means the key must
                not exist.

        Returns:
            True if written; False if the key changed meanwhile.

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        compare = _compare_absent(key) if expected_mod_revision == 0 else _compare_mod(
            key, expected_mod_revision
        )
        ok, _ = await self._txn("compare_and_put", [compare], [_put_op(key, value)])
        return ok

    async def delete(self, key: str) -> bool:
        """Delete one key.

        Returns:
            True if the key existed.

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        with _wrap_errors("delete"):
            client = await self._connected()
            response = await client.kvstub.DeleteRange(
                rpc.DeleteRangeRequest(key=key.encode()),
                timeout=self._request_timeout_s,
                metadata=client.metadata,
            )
        return int(response.deleted) > 0

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every key that starts with ``prefix`` (``""`` deletes everything).

        Returns:
            The number of keys deleted.

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        raw = prefix.encode() or _ALL_KEYS
        with _wrap_errors("delete_prefix"):
            client = await self._connected()
            response = await client.kvstub.DeleteRange(
                rpc.DeleteRangeRequest(key=raw, range_end=_prefix_range_end(prefix.encode())),
                timeout=self._request_timeout_s,
                metadata=client.metadata,
            )
        return int(response.deleted)

    async def next_id(self, counter_key: str, *, initial: int = 1) -> int:
        """Atomically allocate the next id from a counter key.

        The counter holds the NEXT free id (seed ``000`` §4.1 ``next_schema_id``: value ``2``
        once id ``1`` is taken). A missing counter starts at ``initial``. Concurrent callers
        get distinct ids (compare-and-swap on the counter's ``mod_revision``, retried).

        Returns:
            The allocated id; the counter then holds ``id + 1``.

        Raises:
            MetadataStoreError: if etcd cannot be reached, or the counter is not an integer.
        """
        while True:
            current = await self.get(counter_key)
            if current is None:
                allocated, compare = initial, _compare_absent(counter_key)
            else:
                if not isinstance(current.value, int) or isinstance(current.value, bool):
                    raise MetadataStoreError(
                        "next_id", f"counter {counter_key} holds {current.value!r}, not an integer"
                    )
                allocated, compare = current.value, _compare_mod(counter_key, current.mod_revision)
            ok, _ = await self._txn("next_id", [compare], [_put_op(counter_key, allocated + 1)])
            if ok:
                return allocated

    async def grant_lease(self, ttl_s: int, *, keepalive: bool = True) -> Lease:
        """Grant a lease of ``ttl_s`` seconds.

        Args:
            ttl_s: time to live in whole seconds (etcd may round small values up).
            keepalive: refresh it in the background every ``ttl_s / 3`` seconds until
                :meth:`Lease.revoke`. Without it the lease expires ``ttl_s`` after the grant.

        Returns:
            The lease (needs a running event loop).

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        with _wrap_errors("lease grant"):
            client = await self._connected()
            granted = await client.lease(ttl_s)
        return Lease(self, int(granted.id), int(granted.ttl), keepalive=keepalive)

    async def watch_prefix(
        self, prefix: str, *, start_revision: int
    ) -> AsyncGenerator[WatchEvent, None]:
        """Stream every change under ``prefix`` from ``start_revision`` (inclusive), in order.

        An async generator: the watch is cancelled when the consumer breaks out and the
        generator is closed (``aclose()``, or ``contextlib.aclosing``).

        Args:
            prefix: key prefix to watch (``""`` = every key).
            start_revision: first revision to report; pass ``revision + 1`` after a
                :meth:`get_prefix` that returned ``revision`` to miss nothing.

        Yields:
            :class:`WatchEvent` objects, in revision order.

        Raises:
            MetadataStoreError: if etcd cannot be reached, the watch breaks, or
                ``start_revision`` was compacted away.
        """
        raw = prefix.encode() or _ALL_KEYS
        watch = await self._open_watch(raw, _prefix_range_end(prefix.encode()), start_revision)
        try:
            with _wrap_errors("watch"):
                async for event in watch:
                    yield _watch_event(event)
        finally:
            await self._cancel_watch(watch)


def _watch_event(event: Any) -> WatchEvent:
    key = bytes(event.kv.key).decode()
    if event.kind == aetcd.EventKind.DELETE:
        return WatchEvent(WatchEventType.DELETE, key, None, int(event.kv.mod_revision))
    return WatchEvent(
        WatchEventType.PUT,
        key,
        _decode_value(key, bytes(event.kv.value)),
        int(event.kv.mod_revision),
    )


def _minimal_prefixes(prefixes: Sequence[str]) -> list[str]:
    """Drop prefixes covered by a shorter one: ``["/", "/a"]`` -> ``["/"]``."""
    out: list[str] = []
    for p in sorted(set(prefixes), key=len):
        if not any(p.startswith(q) for q in out):
            out.append(p)
    return sorted(out)


class LocalCache:
    """Per-process read cache of etcd metadata (seed ``000``, "LocalCache").

    :meth:`start` loads every key under ``prefixes`` at one etcd revision ``R`` and then
    follows a watch from ``R + 1``, so no change is missed between the load and the watch.
    Reads (:meth:`get`, :meth:`get_prefix`) are served from memory. The watch covers the whole
    key space (only keys under ``prefixes`` are stored) so that :attr:`revision` follows every
    etcd write and :meth:`wait_for_revision` works for any revision a write returned.

    If the watch breaks (etcd restart, compaction) the cache logs it, reloads at a new
    revision, tells listeners about every difference as synthetic events, and resumes.

    Listeners run synchronously on the event loop for each applied change; one watch response
    (one etcd transaction) is applied completely before any waiter wakes.
    """

    def __init__(self, store: MetadataStore, *, prefixes: Sequence[str] = ("/",)) -> None:
        """Args:
        store: the store to load from and watch.
        prefixes: key prefixes to keep (default every Danube key).

        Raises:
            ValueError: if ``prefixes`` is empty.
        """
        if not prefixes:
            raise ValueError("LocalCache needs at least one prefix")
        self._store = store
        self._prefixes = _minimal_prefixes(prefixes)
        self._data: dict[str, JsonValue] = {}
        self._revision = 0
        self._started = False
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._watch: aetcd.Watch | None = None
        self._advanced = asyncio.Event()
        self._listeners: dict[int, tuple[str, Callable[[WatchEvent], None]]] = {}
        self._next_listener = 0

    # ---- lifecycle

    async def start(self) -> None:
        """Load the prefixes at one revision ``R`` and start watching from ``R + 1``.

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        if self._started:
            return
        self._stopping = False
        data, revision = await self._load()
        self._data = data
        self._set_revision(revision)
        self._watch = await self._store._open_watch(_ALL_KEYS, _ALL_KEYS, revision + 1)
        self._started = True
        self._task = asyncio.get_running_loop().create_task(self._run(), name="local-cache-watch")

    async def stop(self) -> None:
        """Stop watching (idempotent). The cached data stays readable but no longer updates."""
        self._stopping = True
        if self._watch is not None:
            await self._store._cancel_watch(self._watch)
            self._watch = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _load(self) -> tuple[dict[str, JsonValue], int]:
        first, *rest = self._prefixes
        response = await self._store._range(first.encode(), _prefix_range_end(first.encode()))
        revision = int(response.header.revision)
        kvs = list(response.kvs)
        for prefix in rest:
            pinned = await self._store._range(
                prefix.encode(), _prefix_range_end(prefix.encode()), revision=revision
            )
            kvs.extend(pinned.kvs)
        data = {kv.key: kv.value for kv in map(_key_value, kvs)}
        return dict(sorted(data.items())), revision

    async def _run(self) -> None:
        backoff_s = 0.1
        while not self._stopping:
            watch = self._watch
            try:
                if watch is None:
                    raise MetadataStoreError("watch", "no open watch")
                with _wrap_errors("watch"):
                    async for raw_event in watch:
                        if self._covers(bytes(raw_event.kv.key).decode()):
                            self._apply(_watch_event(raw_event))
                        else:  # outside the cached prefixes: only the revision advances
                            self._set_revision(int(raw_event.kv.mod_revision))
                if self._stopping:
                    return
                raise MetadataStoreError("watch", "watch stream ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any break of the watch means reload
                if self._stopping:
                    return
                log.warning(
                    "LocalCache watch broke at revision %d (%s); reloading", self._revision, exc
                )
            if watch is not None:
                await self._store._cancel_watch(watch)
            self._watch = None
            while not self._stopping:
                if self._store.closed:
                    log.info("LocalCache stops following etcd: its MetadataStore was closed")
                    return
                try:
                    await self._reload()
                    backoff_s = 0.1
                    break
                except MetadataStoreError as exc:
                    log.warning("LocalCache reload failed (retrying in %.1fs): %s", backoff_s, exc)
                    await asyncio.sleep(backoff_s)
                    backoff_s = min(backoff_s * 2, 5.0)

    async def _reload(self) -> None:
        data, revision = await self._load()
        watch = await self._store._open_watch(_ALL_KEYS, _ALL_KEYS, revision + 1)
        old = self._data
        self._data = data
        events = [
            WatchEvent(WatchEventType.DELETE, key, None, revision) for key in old if key not in data
        ] + [
            WatchEvent(WatchEventType.PUT, key, value, revision)
            for key, value in data.items()
            if key not in old or old[key] != value
        ]
        for event in sorted(events, key=lambda e: e.key):
            self._notify(event)
        if revision < self._revision:
            log.warning(
                "etcd revision went back from %d to %d (data loss?)", self._revision, revision
            )
        self._revision = revision
        self._advanced.set()
        self._advanced = asyncio.Event()
        self._watch = watch
        log.info("LocalCache reloaded %d keys at revision %d; watching again", len(data), revision)

    # ---- applying changes

    def _covers(self, key: str) -> bool:
        return any(key.startswith(p) for p in self._prefixes)

    def _apply(self, event: WatchEvent) -> None:
        if event.type is WatchEventType.PUT:
            self._data[event.key] = event.value
        else:
            self._data.pop(event.key, None)
        self._notify(event)
        self._set_revision(event.mod_revision)

    def _set_revision(self, revision: int) -> None:
        if revision > self._revision:
            self._revision = revision
            self._advanced.set()
            self._advanced = asyncio.Event()

    def _notify(self, event: WatchEvent) -> None:
        for prefix, callback in list(self._listeners.values()):
            if event.key.startswith(prefix):
                try:
                    callback(event)
                except Exception:  # noqa: BLE001 - one bad listener must not stop the cache
                    log.exception("LocalCache listener for %r failed on %s", prefix, event.key)

    # ---- reads

    @property
    def revision(self) -> int:
        """The highest etcd revision applied to the cache (0 before :meth:`start`)."""
        return self._revision

    @property
    def prefixes(self) -> list[str]:
        """The cached key prefixes (redundant ones removed)."""
        return list(self._prefixes)

    def _check_key(self, key: str) -> None:
        if not self._started:
            raise MetadataStoreError("LocalCache read", "the cache was not started")
        if not self._covers(key):
            raise ValueError(f"key {key!r} is outside the cached prefixes {self._prefixes}")

    def get(self, key: str) -> JsonValue | None:
        """The cached value of ``key``, or ``None`` if absent (or its value is ``null``).

        Raises:
            ValueError: if ``key`` is outside the cached prefixes.
            MetadataStoreError: if the cache was never started.
        """
        self._check_key(key)
        return self._data.get(key)

    def contains(self, key: str) -> bool:
        """Whether ``key`` exists (distinguishes a ``null`` marker from a missing key).

        Raises:
            ValueError: if ``key`` is outside the cached prefixes.
            MetadataStoreError: if the cache was never started.
        """
        self._check_key(key)
        return key in self._data

    def get_prefix(self, prefix: str) -> dict[str, JsonValue]:
        """Every cached ``key -> value`` whose key starts with ``prefix``, sorted by key.

        Raises:
            ValueError: if ``prefix`` is not inside the cached prefixes.
            MetadataStoreError: if the cache was never started.
        """
        self._check_key(prefix)
        return {k: v for k, v in sorted(self._data.items()) if k.startswith(prefix)}

    async def wait_for_revision(self, revision: int, *, timeout_s: float = 5.0) -> None:
        """Wait until the cache has applied ``revision`` (read-your-writes after a put).

        Args:
            revision: an etcd revision, e.g. the return value of :meth:`MetadataStore.put`.
            timeout_s: how long to wait, in seconds.

        Raises:
            MetadataStoreError: if the revision is not applied within ``timeout_s``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._revision < revision:
            remaining_s = deadline - loop.time()
            if remaining_s <= 0:
                raise MetadataStoreError(
                    "wait_for_revision",
                    f"cache at revision {self._revision}, revision {revision} not seen "
                    f"within {timeout_s}s",
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._advanced.wait(), remaining_s)

    def add_listener(
        self, prefix: str, callback: Callable[[WatchEvent], None]
    ) -> Callable[[], None]:
        """Call ``callback(event)`` for every change applied under ``prefix``.

        Callbacks run synchronously on the event loop, in revision order; exceptions they raise
        are logged and swallowed. After a watch break, differences found by the reload are
        delivered as synthetic events carrying the reload revision.

        Returns:
            A function that unsubscribes the callback (idempotent).
        """
        token = self._next_listener
        self._next_listener += 1
        self._listeners[token] = (prefix, callback)

        def unsubscribe() -> None:
            self._listeners.pop(token, None)

        return unsubscribe
