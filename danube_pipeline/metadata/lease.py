"""An etcd lease that keeps itself alive: broker registration lives and dies with it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType
from typing import TYPE_CHECKING, Self

from danube_pipeline.errors import MetadataStoreError

if TYPE_CHECKING:
    from danube_pipeline.metadata.store import MetadataStore

log = logging.getLogger(__name__)


class Lease:
    """An etcd lease that keeps itself alive until revoked.

    Keys put with a lease disappear when the lease ends: on :meth:`revoke`, or ``ttl_s``
    seconds after the last refresh if the process dies (used for broker registration,
    ``docs/etcd-layout.md`` §1.2). While ``keepalive`` is on, a background task refreshes the lease every
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
                ttl_s = await self._store.refresh_lease(self.id)
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
            await self._store.revoke_lease(self.id)
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
