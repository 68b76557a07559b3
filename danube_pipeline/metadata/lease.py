"""An etcd lease that keeps itself alive: broker registration lives and dies with it.

It also tells, from this process alone, until when the lease is surely still alive in etcd
(:attr:`Lease.fresh_until_s`): a topic owner stops acknowledging past that point, so that a
failover, which needs the lease to have expired (``docs/etcd-layout.md`` §1.4), can never
precede one of its acknowledgements (:class:`broker.cluster.ownership.Ownership`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
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
MIN_SAFETY_MARGIN_S = 1.0
"""The least :func:`safety_margin_s` (for TTLs of at least twice that)."""


def safety_margin_s(ttl_s: float) -> float:
    """How long before its TTL runs out a lease stops counting as fresh: ``max(1 s, TTL / 3)``,
    but at most half the TTL (etcd's smallest TTLs).

    etcd expires a lease ``ttl_s`` after it *processed* the last refresh, which was after this
    process *sent* it, both measured on clocks that run at nearly the same rate. The margin
    covers the rest: the difference in clock rates, and the time between an owner's check and
    the acknowledgement it allows (one WAL write and its ``fdatasync``).
    """
    return min(max(MIN_SAFETY_MARGIN_S, ttl_s / 3.0), ttl_s / 2.0)


class Lease:
    """An etcd lease that keeps itself alive until revoked.

    Keys put with a lease disappear when the lease ends: on :meth:`revoke`, or ``ttl_s``
    seconds after the last refresh if the process dies (used for broker registration,
    ``docs/etcd-layout.md`` §1.2).

    The lease is *fresh* (:attr:`fresh`) until ``ttl_s - safety_margin_s(ttl_s)`` seconds,
    on the monotonic clock, after the last request that found it alive was *sent*
    (:attr:`renewed_s`: the grant, then each successful refresh). etcd cannot have expired it
    before then. While ``keepalive`` is on, a background task refreshes the lease three times
    per fresh window (every ``(ttl_s - margin) / 3`` seconds: 2.2 s for the default 10 s), so
    one slow or lost refresh does not let it go stale; after a failed refresh (etcd
    unreachable) it tries again every :data:`RETRY_INTERVAL_S`, each attempt waiting at most
    :data:`RETRY_TIMEOUT_S`, so an expiry is noticed within about a second of etcd answering
    again. Failures are logged once per outage. Usable as ``async with`` (revokes on exit).

    Args:
        granted_s: when the grant request was sent (monotonic); default: now.

    Attributes:
        id: the etcd lease id.
        ttl_s: the TTL etcd granted, in seconds (etcd may round small TTLs up).
        renewed_s: monotonic time the last request that found the lease alive was sent.
        on_expired: called once (on the event loop) when keep-alive finds the lease gone.
    """

    def __init__(
        self, store: MetadataStore, lease_id: int, ttl_s: int, *, keepalive: bool, granted_s: float | None = None
    ) -> None:
        self.id = lease_id
        self.ttl_s = ttl_s
        self.renewed_s = time.monotonic() if granted_s is None else granted_s
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

    @property
    def fresh_until_s(self) -> float:
        """Monotonic time until which the lease is surely alive in etcd, less the safety margin
        (:func:`safety_margin_s`); ``-inf`` once it expired or was revoked."""
        if self._expired:
            return float("-inf")
        return self.renewed_s + self.ttl_s - safety_margin_s(self.ttl_s)

    @property
    def fresh(self) -> bool:
        """Whether the monotonic clock is still before :attr:`fresh_until_s`."""
        return time.monotonic() < self.fresh_until_s

    async def _keepalive(self) -> None:
        interval_s = max((self.ttl_s - safety_margin_s(self.ttl_s)) / 3.0, 0.1)
        outage = OutageLog(log, f"keep-alive of etcd lease {self.id}")
        delay_s = interval_s
        while True:
            await asyncio.sleep(delay_s)
            if self._store.closed:
                return
            sent_s = time.monotonic()
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
            if ttl_s > 0:
                self.renewed_s = max(self.renewed_s, sent_s)
            else:
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
