"""Keys that delete themselves: closed producers (``docs/etcd-layout.md`` §3.3).

A closed producer's key (``status: false``) is written under a short etcd lease without
keep-alive, so etcd deletes it on its own: metadata does not grow with every producer ever
opened, and nothing has to remember to delete it. One lease is shared by every key written
within half a TTL, so a key lives between ``ttl_s / 2`` and ``ttl_s`` seconds after its write.
"""

from __future__ import annotations

import asyncio
import time

from danube_pipeline.errors import MetadataStoreError
from danube_pipeline.metadata.store import Lease, MetadataStore
from danube_pipeline.metadata.values import JsonRecord, JsonValue


class ExpiringKeys:
    """Writes keys under a shared lease that expires ``ttl_s`` seconds after it was granted.

    Args:
        store: etcd.
        ttl_s: the lease TTL, in seconds (etcd may round small TTLs up).
    """

    def __init__(self, store: MetadataStore, ttl_s: int) -> None:
        self._store = store
        self.ttl_s = ttl_s
        self._lease: Lease | None = None
        self._granted_at = 0.0
        self._lock = asyncio.Lock()

    async def _current(self) -> Lease:
        async with self._lock:
            if self._lease is None or time.monotonic() - self._granted_at >= self.ttl_s / 2:
                self._lease = await self._store.grant_lease(self.ttl_s, keepalive=False)
                self._granted_at = time.monotonic()
            return self._lease

    async def put(self, key: str, value: JsonValue | JsonRecord) -> int:
        """Write ``value`` at ``key``; etcd deletes the key ``ttl_s / 2`` to ``ttl_s`` seconds later.

        Returns:
            The etcd revision of the write.

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        return await self.put_many([(key, value)])

    async def compare_and_put(self, key: str, value: JsonValue | JsonRecord, *, expected_mod_revision: int) -> bool:
        """Write ``key`` under the current lease if its ``mod_revision`` is still the one read.

        Returns:
            True if written; False if the key changed meanwhile.

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        return await self._store.compare_and_put(
            key, value, expected_mod_revision=expected_mod_revision, lease=await self._current()
        )

    async def put_many(self, items: list[tuple[str, JsonValue | JsonRecord]]) -> int:
        """Write several keys in one transaction under the current lease.

        Returns:
            The etcd revision of the write.

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        lease = await self._current()
        try:
            return await self._store.put_many(items, lease=lease)
        except MetadataStoreError as exc:
            if "lease not found" not in exc.reason:
                raise
        # The lease ended early (etcd was unreachable past its TTL): take a new one.
        async with self._lock:
            if self._lease is lease:
                self._lease = None
        return await self._store.put_many(items, lease=await self._current())


__all__ = ["ExpiringKeys"]
