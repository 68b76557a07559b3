"""An etcd lease that keeps itself alive: broker registration lives and dies with it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Self

from danube_pipeline.errors import MetadataStoreError
from danube_pipeline.outages import OutageLog

if TYPE_CHECKING:
    from danube_pipeline.metadata.store import MetadataStore

log = logging.getLogger(__name__)

RETRY_INTERVAL_S = 0.25
"""Pause before the next keep-alive after a failed one."""
RETRY_TIMEOUT_S = 1.0
"""How long a keep-alive waits for etcd while etcd is not answering."""


class Lease:
    """An etcd lease that keeps itself alive until revoked.

    Keys put with a lease disappear when the lease ends: on :meth:`revoke`, or ``ttl_s``
    seconds after the last refresh if the process dies (used for broker registration,
    ``docs/etcd-layout.md`` §1.2). While ``keepalive`` is on, a background task refreshes the
    lease every ``ttl_s / 3`` seconds; after a failed refresh (etcd unreachable) it tries again
    every :data:`RETRY_INTERVAL_S`, each attempt waiting at most :data:`RETRY_TIMEOUT_S`, so an
    expiry is noticed within about a second of etcd answering again. Failures are logged once
    per outage. Usable as ``async with`` (revokes on exit).

    Attributes:
        id: the etcd lease id.
        ttl_s: the TTL etcd granted, in seconds (etcd may round small TTLs up).
        on_expired: called once (on the event loop) when keep-alive finds the lease gone.
    """

    def __init__(self, store: MetadataStore, lease_id: int, ttl_s: int, *, keepalive: bool) -> None:
        self.id = lease_id
        self.ttl_s = ttl_s
        self.on_expired: Callable[[Lease], None] | None = None
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
        outage = OutageLog(log, f"keep-alive of etcd lease {self.id}")
        delay_s = interval_s
        while True:
            await asyncio.sleep(delay_s)
            if self._store.closed:
                return
            try:
                ttl_s = await self._store.refresh_lease(
                    self.id, timeout_s=RETRY_TIMEOUT_S if outage.failing else interval_s
                )
            except MetadataStoreError as exc:
                outage.failed(exc)
                delay_s = RETRY_INTERVAL_S
                continue
            outage.succeeded()
            delay_s = interval_s
            if ttl_s <= 0:
                log.warning("lease %d expired before it could be refreshed", self.id)
                self._expired = True
                if self.on_expired is not None:
                    self.on_expired(self)
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
