"""The etcd-backed :class:`MetadataStore`: every write, and the reads that must be linearizable.

etcd is the source of truth and takes every write; each process keeps a
:class:`~danube_pipeline.metadata.cache.LocalCache` that loads the keys once and then follows an
etcd watch, so ordinary reads never go to etcd (``docs/etcd-layout.md``, "Reads and writes").

Values are JSON: they are written with :func:`danube_pipeline.metadata.values.encode` (compact
UTF-8 JSON) and read back with :func:`~danube_pipeline.metadata.values.decode`.

Every failure to reach etcd, or an RPC etcd rejects, is raised as
:class:`~danube_pipeline.errors.MetadataStoreError` (``retriable``). Each unary etcd request
waits at most ``request_timeout_s``, and never past the deadline of the enclosing
:func:`~danube_pipeline.metadata.connection.deadline_scope` (the broker opens one per RPC with
the client's deadline).

The wire layer is ``aetcd`` 1.0 (asyncio gRPC client for the etcd v3 API), held by
:class:`~danube_pipeline.metadata.connection.EtcdConnection`. Reads, puts and transactions go
through its raw KV stub so that every answer carries the etcd header revision; watches use its
watcher.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Mapping, Sequence

from aetcd import rpc

from danube_pipeline.errors import MetadataStoreError
from danube_pipeline.metadata import values
from danube_pipeline.metadata.connection import EtcdConnection
from danube_pipeline.metadata.etcd import (
    ALL_KEYS,
    KeyValue,
    WatchEvent,
    WatchEventType,
    compare_absent,
    compare_create,
    compare_exists,
    compare_mod,
    delete_op,
    key_value,
    prefix_range_end,
    put_op,
    range_op,
    watch_event,
    wrap_errors,
)
from danube_pipeline.metadata.lease import Lease
from danube_pipeline.metadata.values import JsonRecord, JsonValue

__all__ = ["KeyValue", "Lease", "MetadataStore", "WatchEvent", "WatchEventType"]

MAX_TXN_OPS = 128
"""The most operations one etcd transaction may hold by default (etcd's ``--max-txn-ops``):
the bound of :meth:`MetadataStore.get_many`."""


class MetadataStore(EtcdConnection):
    """Write (and direct read) access to Danube's etcd metadata (``docs/etcd-layout.md``).

    Create with :meth:`connect`; close with :meth:`close` or ``async with``. Keys are the
    strings of :mod:`danube_pipeline.metadata.keys`; values are JSON values or
    :class:`~danube_pipeline.metadata.values.JsonRecord` instances.
    """

    # ---- reads

    async def get(self, key: str) -> KeyValue | None:
        """Read one key straight from etcd (linearizable).

        Returns:
            The key and its decoded value, or ``None`` if it does not exist.

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        response = await self.range_raw(key.encode(), None)
        return key_value(response.kvs[0]) if response.kvs else None

    async def get_many(self, keys: Sequence[str]) -> list[KeyValue | None]:
        """Read several keys straight from etcd at one revision, in one round trip: an etcd
        ``Txn`` with no comparison whose operations are ``Range`` requests (linearizable, as
        :meth:`get`).

        Args:
            keys: at most :data:`MAX_TXN_OPS` keys (etcd's default ``--max-txn-ops``).

        Returns:
            One entry per key, in the order given: the key and its decoded value, or ``None``
            if it does not exist.

        Raises:
            ValueError: more than :data:`MAX_TXN_OPS` keys.
            MetadataStoreError: if etcd cannot be reached.
        """
        if len(keys) > MAX_TXN_OPS:
            raise ValueError(f"get_many reads at most {MAX_TXN_OPS} keys in one transaction, not {len(keys)}")
        if not keys:
            return []
        response = await self.txn_raw("get_many", [], [range_op(key) for key in keys])
        return [key_value(r.response_range.kvs[0]) if r.response_range.kvs else None for r in response.responses]

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Read every key that starts with ``prefix``, at one etcd revision.

        Returns:
            ``(kvs, revision)``: the keys sorted by key, and the etcd header revision the read
            saw (watch from ``revision + 1`` to miss nothing).

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        raw = prefix.encode()
        response = await self.range_raw(raw, prefix_range_end(raw))
        return [key_value(kv) for kv in response.kvs], int(response.header.revision)

    async def has_prefix(self, prefix: str) -> bool:
        """Whether any key starts with ``prefix`` (one etcd range read with ``limit=1``).

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        raw = prefix.encode()
        response = await self.range_raw(raw, prefix_range_end(raw), limit=1)
        return bool(response.kvs)

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
        with wrap_errors("put"):
            timeout = self._timeout("put")
            client = await self._connected()
            response = await client.kvstub.Put(
                rpc.PutRequest(
                    key=key.encode(), value=values.encode(value), lease=lease.id if lease else 0
                ),
                timeout=timeout,
                metadata=client.metadata,
            )
        return int(response.header.revision)

    async def put_many(
        self, items: Sequence[tuple[str, JsonValue | JsonRecord]], *, lease: Lease | None = None
    ) -> int:
        """Write several keys in one etcd transaction: all or none, at one revision.

        Args:
            items: ``(key, value)`` pairs.
            lease: attach every key to this lease.

        Returns:
            The etcd revision of the write.

        Raises:
            MetadataStoreError: if etcd cannot be reached or rejects the transaction (e.g. the
                same key twice, or more operations than etcd's ``--max-txn-ops``, 128 by default).
        """
        lease_id = lease.id if lease else 0
        _, revision = await self._txn("put_many", [], [put_op(k, v, lease_id) for k, v in items])
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
            compare_absent(k) if rev == 0 else compare_mod(k, rev)
            for k, rev in expected_mod_revisions.items()
        ]
        ok, revision = await self._txn(
            "compare_and_put_many", compare, [put_op(k, v) for k, v in items]
        )
        return revision if ok else None

    async def transaction(
        self,
        *,
        created: Mapping[str, int] | None = None,
        modified: Mapping[str, int] | None = None,
        exists: Sequence[str] = (),
        puts: Sequence[tuple[str, JsonValue | JsonRecord]] = (),
        deletes: Sequence[str] = (),
        lease: Lease | None = None,
    ) -> int | None:
        """Put and delete keys in one etcd transaction, iff every comparison holds.

        Args:
            created: ``key -> create_revision`` each key must still have (``0``: the key must
                not exist). Comparing a create revision pins one incarnation of a key, e.g. the
                leader key of one election (its epoch, ``docs/etcd-layout.md`` §1.7).
            modified: ``key -> mod_revision`` each key must still have (``0``: the key must
                not exist): the key is unchanged since it was read.
            exists: keys that must exist.
            puts: ``(key, value)`` pairs to write.
            deletes: keys to delete.
            lease: attach every put key to this lease.

        Returns:
            The etcd revision of the transaction, or ``None`` if a comparison failed (nothing
            written).

        Raises:
            MetadataStoreError: if etcd cannot be reached or rejects the transaction.
        """
        compare = [compare_create(k, rev) for k, rev in (created or {}).items()]
        compare += [compare_absent(k) if rev == 0 else compare_mod(k, rev) for k, rev in (modified or {}).items()]
        compare += [compare_exists(k) for k in exists]
        lease_id = lease.id if lease else 0
        ops = [put_op(k, v, lease_id) for k, v in puts] + [delete_op(k) for k in deletes]
        ok, revision = await self._txn("transaction", compare, ops)
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
            "put_if_absent", [compare_absent(key)], [put_op(key, value, lease.id if lease else 0)]
        )
        return ok

    async def compare_and_put(
        self,
        key: str,
        value: JsonValue | JsonRecord,
        *,
        expected_mod_revision: int,
        lease: Lease | None = None,
    ) -> bool:
        """Write ``key`` only if its ``mod_revision`` is still ``expected_mod_revision``.

        Args:
            key: the etcd key.
            value: the new value.
            expected_mod_revision: the ``mod_revision`` last read; ``0`` means the key must
                not exist.
            lease: attach the key to this lease.

        Returns:
            True if written; False if the key changed meanwhile.

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        compare = compare_absent(key) if expected_mod_revision == 0 else compare_mod(
            key, expected_mod_revision
        )
        ok, _ = await self._txn("compare_and_put", [compare], [put_op(key, value, lease.id if lease else 0)])
        return ok

    async def delete(self, key: str) -> bool:
        """Delete one key.

        Returns:
            True if the key existed.

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        with wrap_errors("delete"):
            timeout = self._timeout("delete")
            client = await self._connected()
            response = await client.kvstub.DeleteRange(
                rpc.DeleteRangeRequest(key=key.encode()),
                timeout=timeout,
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
        raw = prefix.encode() or ALL_KEYS
        with wrap_errors("delete_prefix"):
            timeout = self._timeout("delete_prefix")
            client = await self._connected()
            response = await client.kvstub.DeleteRange(
                rpc.DeleteRangeRequest(key=raw, range_end=prefix_range_end(prefix.encode())),
                timeout=timeout,
                metadata=client.metadata,
            )
        return int(response.deleted)

    async def next_id(self, counter_key: str, *, initial: int = 1) -> int:
        """Atomically allocate the next id from a counter key.

        The counter holds the NEXT free id (``docs/etcd-layout.md`` §4.1 ``next_schema_id``: value ``2``
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
                allocated, compare = initial, compare_absent(counter_key)
            else:
                if not isinstance(current.value, int) or isinstance(current.value, bool):
                    raise MetadataStoreError(
                        "next_id", f"counter {counter_key} holds {current.value!r}, not an integer"
                    )
                allocated, compare = current.value, compare_mod(counter_key, current.mod_revision)
            ok, _ = await self._txn("next_id", [compare], [put_op(counter_key, allocated + 1)])
            if ok:
                return allocated

    async def grant_lease(self, ttl_s: int, *, keepalive: bool = True) -> Lease:
        """Grant a lease of ``ttl_s`` seconds.

        Args:
            ttl_s: time to live in whole seconds (etcd may round small values up).
            keepalive: refresh it in the background (:class:`Lease`: three times per fresh window) until
                :meth:`Lease.revoke`. Without it the lease expires ``ttl_s`` after the grant.

        Returns:
            The lease (needs a running event loop).

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        with wrap_errors("lease grant"):
            client = await self._connected()
            sent_s = time.monotonic()
            granted = await client.lease(ttl_s)
        return Lease(self, int(granted.id), int(granted.ttl), keepalive=keepalive, granted_s=sent_s)

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
        raw = prefix.encode() or ALL_KEYS
        watch = await self.open_watch(raw, prefix_range_end(prefix.encode()), start_revision)
        try:
            with wrap_errors("watch"):
                async for event in watch:
                    yield watch_event(event)
        finally:
            await self.cancel_watch(watch)
