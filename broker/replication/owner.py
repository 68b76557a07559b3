"""The owner's side of a replicated topic: its followers' log ends, the in-sync replica set
(ISR) and the high watermark (Kafka's ``Partition`` leader state; ``docs/etcd-layout.md`` §5.9).

* A follower's **log end** is the ``fetch_offset`` of its latest ``FetchLog``: the follower
  fetches from its next offset, and fsyncs what it appended before it fetches again, so every
  offset below it is durable on the follower.
* The **high watermark** (HW) is the lowest log end among the ISR, the owner's durable end
  included; it never moves back. Readers (dispatch, tiering through sealed segments) stay below
  it (:meth:`WriteAheadLog.set_high_watermark`), and a producer is acknowledged only once it
  passed the producer's batch **and** the ISR has at least ``min_insync_replicas`` members
  (else :class:`~danube_pipeline.errors.NotEnoughReplicasError`, retriable).
* The **ISR** lives in etcd and only the owner changes it, in a transaction guarded by its owner
  epoch (:meth:`Ownership.put`). A follower leaves it once it has not been caught up with the
  owner's log end for ``lag_max_s`` (or once its broker's registration is gone), and joins
  again once a fetch reaches the owner's log end. While a change is being written, the HW is
  computed over the union of the old and the new set (Kafka's "maximal ISR", KIP-497), so an
  acknowledged batch is always on every member etcd names: whichever of them the leader picks at
  a failover holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import itertools
import logging
import time
from collections.abc import Awaitable, Callable

from danube_pipeline.aio import wait_set
from danube_pipeline.errors import NotEnoughReplicasError
from danube_pipeline.metadata import keys, values
from danube_pipeline.names import TopicName

from broker.storage.wal.log import WriteAheadLog
from broker.tasks import spawn

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 0.25
"""How often the ISR is checked for followers that fell behind or whose broker is gone."""


class FollowerProgress:
    """What the owner knows of one follower.

    Attributes:
        log_end: its next offset as its latest fetch reported; ``None`` before its first fetch.
        last_fetch: monotonic time of its latest fetch; ``None`` before it.
        caught_up_at: monotonic time it last reached the owner's log end (or this ownership's
            start, for a member of the ISR the owner took over with).
    """

    __slots__ = ("log_end", "last_fetch", "caught_up_at")

    def __init__(self, caught_up_at: float) -> None:
        self.log_end: int | None = None
        self.last_fetch: float | None = None
        self.caught_up_at = caught_up_at


@dataclasses.dataclass(frozen=True, slots=True)
class FollowerState:
    """One follower as ``DescribeTopic`` shows it.

    Attributes:
        broker_id: the follower.
        log_end_offset: its log end as its latest fetch reported (0 before one).
        lag: the owner's log end minus the follower's, in offsets.
        last_fetch_s: seconds since its latest fetch, ``-1`` before one.
        in_sync: whether it is in the ISR.
    """

    broker_id: int
    log_end_offset: int
    lag: int
    last_fetch_s: float
    in_sync: bool


class ReplicaTracker:
    """One replicated topic's followers, ISR and high watermark on its owner.

    Args:
        name: the topic.
        wal: its WAL (the owner's log; its durable end is the owner's log end).
        broker_id: this broker (the owner).
        owner_epoch: the owner epoch (§1.4); the ISR record carries it.
        isr: the ISR this ownership starts with (the owner included): the members of the
            previous owner's ISR still registered.
        high_watermark: where the HW starts: what this broker knew as a follower (never above
            any member's log end).
        replicas: the replica assignment now (§1.9), read at every check.
        registered: the registered broker ids now (§1.2).
        min_insync_replicas: the policy's minimum now (§2.1), read at every produce.
        write_isr: writes the ISR record guarded by the owner epoch
            (raises ``NotServedHereError`` once fenced).
        lag_max_s: how long a follower may stay behind the owner's log end before it leaves
            the ISR.
    """

    def __init__(
        self,
        name: TopicName,
        wal: WriteAheadLog,
        *,
        broker_id: int,
        owner_epoch: int,
        isr: set[int],
        high_watermark: int,
        replicas: Callable[[], set[int]],
        registered: Callable[[], set[int]],
        min_insync_replicas: Callable[[], int],
        write_isr: Callable[[str, values.JsonRecord], Awaitable[None]],
        lag_max_s: float,
    ) -> None:
        self.name = name
        self.wal = wal
        self.broker_id = broker_id
        self.owner_epoch = owner_epoch
        self.isr: frozenset[int] = frozenset(isr | {broker_id})
        self.high_watermark = min(high_watermark, wal.durable_end)
        self.isr_shrinks = 0
        self.isr_expands = 0
        self._replicas = replicas
        self._registered = registered
        self._min_isr = min_insync_replicas
        self._write_isr = write_isr
        self.lag_max_s = lag_max_s
        now = time.monotonic()
        self.followers: dict[int, FollowerProgress] = {
            b: FollowerProgress(now) for b in self.isr | replicas() if b != broker_id
        }
        self._pending: frozenset[int] = self.isr
        """The ISR while a change is written: old and new together (module docstring)."""
        self._waiters: list[tuple[int, int, asyncio.Future[tuple[int, int]], tuple[int, int]]] = []
        self._order = itertools.count()
        self._advanced = asyncio.Event()
        self._changing = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._unlisten = wal.add_listener(lambda _end: self._recompute())
        self.closed = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Write the ISR this ownership starts with, then check it every ``CHECK_INTERVAL_S``.

        Raises:
            NotServedHereError: fenced before the first write.
            MetadataStoreError: etcd unreachable.
        """
        await self._write(self.isr)
        self._recompute()
        self._task = asyncio.create_task(self._run(), name=f"isr:{self.name}")

    async def close(self) -> None:
        """Stop; producers still waiting get ``NotEnoughReplicasError`` (retriable: they look
        the topic up again and resend)."""
        self.closed = True
        self._unlisten()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for _, _, future, _ in self._waiters:
            if not future.done():
                future.set_exception(NotEnoughReplicasError(self.name.path, len(self.isr), self._min_isr()))
        self._waiters.clear()

    # ------------------------------------------------------------------ produce

    def check_produce(self) -> None:
        """Refuse a batch before it is written when the ISR is below ``min_insync_replicas``.

        Raises:
            NotEnoughReplicasError: too few in-sync replicas.
        """
        needed = self._min_isr()
        if len(self.isr) < needed:
            raise NotEnoughReplicasError(self.name.path, len(self.isr), needed)

    def replicated(self, written: asyncio.Future[tuple[int, int]]) -> asyncio.Future[tuple[int, int]]:
        """A future of ``written``'s ``(first_offset, last_offset)`` that resolves once the HW
        passed ``last_offset`` with at least ``min_insync_replicas`` in the ISR.

        The returned future fails with ``written``'s error, or with
        :class:`~danube_pipeline.errors.NotEnoughReplicasError` when the HW passes while the
        ISR is too small (the batch stays written; its resend waits again).
        """
        result: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()

        def on_written(done: asyncio.Future[tuple[int, int]]) -> None:
            if result.done():
                return
            if done.cancelled():
                result.cancel()
                return
            exc = done.exception()
            if exc is not None:
                result.set_exception(exc)
                return
            offsets = done.result()
            if self.closed:
                result.set_exception(NotEnoughReplicasError(self.name.path, len(self.isr), self._min_isr()))
                return
            heapq.heappush(self._waiters, (offsets[1], next(self._order), result, offsets))
            self._release_waiters()

        written.add_done_callback(on_written)
        return result

    def _release_waiters(self) -> None:
        hw = self.high_watermark
        needed = self._min_isr()
        while self._waiters and self._waiters[0][0] < hw:
            _, _, future, offsets = heapq.heappop(self._waiters)
            if future.done():
                continue
            if len(self.isr) < needed:
                future.set_exception(NotEnoughReplicasError(self.name.path, len(self.isr), needed))
            else:
                future.set_result(offsets)

    # ------------------------------------------------------------------ followers

    def fetched(self, follower_id: int, fetch_offset: int) -> None:
        """A follower fetched from ``fetch_offset``: its log end (module docstring)."""
        now = time.monotonic()
        progress = self.followers.get(follower_id)
        if progress is None:
            progress = self.followers[follower_id] = FollowerProgress(now)
        progress.log_end = fetch_offset
        progress.last_fetch = now
        if fetch_offset >= self.wal.durable_end:
            progress.caught_up_at = now
            if follower_id not in self.isr and fetch_offset >= self.high_watermark and not self._changing.locked():
                spawn(self._expand(follower_id), name=f"isr-expand:{self.name}")
        self._recompute()

    def _member_end(self, broker_id: int) -> int:
        if broker_id == self.broker_id:
            return self.wal.durable_end
        progress = self.followers.get(broker_id)
        if progress is None or progress.log_end is None:
            return self.high_watermark  # a member of the ISR taken over with: at least the HW
        return progress.log_end

    def _recompute(self) -> None:
        members = self.isr | self._pending
        hw = min(self._member_end(b) for b in members)
        if hw > self.high_watermark:
            self.high_watermark = hw
            self.wal.set_high_watermark(hw)
            self._advanced.set()
        self._release_waiters()

    async def wait_caught_up(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every batch taken is durable and below the HW (a
        release hands the topic over only then, so any ISR member can take it).

        Returns:
            Whether it happened in time.
        """
        deadline = time.monotonic() + timeout_s
        while self.high_watermark < self.wal.next_offset:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._advanced.clear()
            await wait_set(self._advanced, min(left, CHECK_INTERVAL_S))
        return True

    async def wait_for_data(self, fetch_offset: int, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` until the owner's log end passes ``fetch_offset``."""
        if self.wal.durable_end > fetch_offset or timeout_s <= 0:
            return
        event = asyncio.Event()
        unlisten = self.wal.add_listener(lambda end: event.set() if end > fetch_offset else None)
        try:
            await wait_set(event, timeout_s)
        finally:
            unlisten()

    def follower_lag(self, broker_id: int) -> int:
        """The owner's log end minus the follower's, in offsets (its whole log before a fetch)."""
        progress = self.followers.get(broker_id)
        end = self.wal.durable_end
        if progress is None or progress.log_end is None:
            return end - self.wal.first_offset
        return max(0, end - progress.log_end)

    def follower_states(self) -> list[FollowerState]:
        """Every follower known to this owner, by broker id."""
        now = time.monotonic()
        return [
            FollowerState(
                broker_id=b, log_end_offset=p.log_end or 0, lag=self.follower_lag(b),
                last_fetch_s=-1.0 if p.last_fetch is None else round(now - p.last_fetch, 3), in_sync=b in self.isr,
            )
            for b, p in sorted(self.followers.items())
        ]

    # ------------------------------------------------------------------ the ISR

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            try:
                await self._shrink()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd unreachable or fenced: the next check retries
                log.warning("topic %s: ISR check failed: %s", self.name, exc)

    async def _shrink(self) -> None:
        now = time.monotonic()
        registered = self._registered()
        end = self.wal.durable_end
        out = set()
        for broker_id in self.isr - {self.broker_id}:
            progress = self.followers.get(broker_id)
            if broker_id not in registered:
                out.add(broker_id)
            elif progress is not None:
                if progress.log_end is not None and progress.log_end >= end:
                    progress.caught_up_at = now
                elif now - progress.caught_up_at > self.lag_max_s:
                    out.add(broker_id)
        if out:
            async with self._changing:
                await self._change(self.isr - out)
            self.isr_shrinks += 1
            log.warning("topic %s: ISR shrank to %s (%s behind for over %.1f s or unregistered)",
                        self.name, sorted(self.isr), sorted(out), self.lag_max_s)

    async def _expand(self, follower_id: int) -> None:
        async with self._changing:
            if follower_id in self.isr or self.closed or follower_id not in self._replicas():
                return
            await self._change(self.isr | {follower_id})
        self.isr_expands += 1
        log.info("topic %s: broker %d caught up and joined the ISR %s", self.name, follower_id, sorted(self.isr))

    async def _change(self, isr: frozenset[int]) -> None:
        """Write ``isr`` to etcd, counting old and new members for the HW meanwhile."""
        self._pending = self.isr | isr
        try:
            await self._write(isr)
            self.isr = isr
        finally:
            self._pending = self.isr
        self._recompute()

    async def _write(self, isr: frozenset[int]) -> None:
        record = values.InSyncReplicas(
            owner=self.broker_id, owner_epoch=self.owner_epoch, isr=sorted(isr), high_watermark=self.high_watermark,
        )
        await self._write_isr(keys.in_sync_replicas(self.name), record)
