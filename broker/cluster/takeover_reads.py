"""The keys a topic's takeover decides from, read from etcd in one transaction, and shared
between the topics that load at once (``docs/etcd-layout.md``, "Reads and writes"; §1.4, §5.3,
§5.4, §5.9). :func:`broker.cluster.ownership.plan_takeover` decides from them.
"""

from __future__ import annotations

import asyncio
import dataclasses

from danube_pipeline.errors import MetadataStoreError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.etcd import KeyValue
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName

from broker.tasks import spawn

__all__ = ["TOPICS_PER_READ", "TakeoverReader", "TakeoverReads"]


@dataclasses.dataclass(frozen=True, slots=True)
class TakeoverReads:
    """The keys a takeover decides from, read from etcd at one revision in one round trip
    (:meth:`read`; linearizable).

    Attributes:
        assignment: this broker's assignment key of the topic (§1.5); its create revision is
            the owner epoch (§1.4).
        reservation: the offset reservation (§5.4).
        sealed: the sealed state a clean release left (§5.3).
        isr: the in-sync replica record of the previous owner (§5.9).

    Each is ``None`` when the key is absent.
    """

    assignment: KeyValue | None
    reservation: KeyValue | None
    sealed: KeyValue | None
    isr: KeyValue | None

    @staticmethod
    def keys_of(name: TopicName, broker_id: int) -> list[str]:
        """The four keys, in the order of the attributes."""
        return [
            keys.topic_assignment(broker_id, name), keys.offset_reservation(name), keys.sealed_state(name),
            keys.in_sync_replicas(name),
        ]

    @classmethod
    async def read(cls, store: MetadataStore, name: TopicName, broker_id: int) -> TakeoverReads:
        """Read the four keys of ``name`` for ``broker_id`` (:meth:`MetadataStore.get_many`).

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        assignment, reservation, sealed, isr = await store.get_many(cls.keys_of(name, broker_id))
        return cls(assignment, reservation, sealed, isr)


TOPICS_PER_READ = 32
"""Topics whose takeover keys one :class:`TakeoverReader` transaction reads (4 keys each:
within etcd's default ``--max-txn-ops`` of 128)."""


class TakeoverReader:
    """Reads the takeover keys (:class:`TakeoverReads`) of the topics that load at once in
    shared etcd transactions, the way a group commit shares a sync: one read is in flight at
    a time, and the topics that ask meanwhile go in the next one, up to
    :data:`TOPICS_PER_READ` per transaction. Each topic still gets a linearizable read made
    after it asked.

    A restart that loads 10,000 topics makes about 10,000 / 32 read round trips instead of
    10,000; each etcd call costs the broker about 0.3 ms of CPU in ``grpc.aio``
    (``benchmarks/README.md``, "Loading 10,000 topics").
    """

    def __init__(self, store: MetadataStore, broker_id: int) -> None:
        self._store = store
        self._broker_id = broker_id
        self._pending: list[tuple[TopicName, asyncio.Future[TakeoverReads]]] = []
        self._task: asyncio.Task[None] | None = None

    async def read(self, name: TopicName) -> TakeoverReads:
        """The takeover keys of ``name`` for this broker, read after the call began.

        Raises:
            MetadataStoreError: etcd unreachable, or the reader's task was cancelled (the
                broker stops).
        """
        future: asyncio.Future[TakeoverReads] = asyncio.get_running_loop().create_future()
        self._pending.append((name, future))
        if self._task is None or self._task.done():
            self._task = spawn(self._read_pending(), name="takeover-reads")
        return await future

    async def _read_pending(self) -> None:
        batch: list[tuple[TopicName, asyncio.Future[TakeoverReads]]] = []
        try:
            while self._pending:
                batch = [(name, future) for name, future in self._pending[:TOPICS_PER_READ] if not future.done()]
                del self._pending[:TOPICS_PER_READ]
                if not batch:  # every caller of this batch is gone
                    continue
                try:
                    kvs = await self._store.get_many(
                        [key for name, _ in batch for key in TakeoverReads.keys_of(name, self._broker_id)]
                    )
                except Exception as exc:  # noqa: BLE001 - each caller gets the failure
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for i, (_, future) in enumerate(batch):
                    if not future.done():
                        future.set_result(TakeoverReads(*kvs[4 * i : 4 * i + 4]))
        finally:  # cancelled: no caller waits forever
            for _, future in [*batch, *self._pending]:
                if not future.done():
                    future.set_exception(MetadataStoreError("takeover reads", "the reader was stopped"))
            self._pending.clear()
