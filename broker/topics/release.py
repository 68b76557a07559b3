"""Giving topics up: release (unload, drain), fenced unloads, and WALs of topics owned elsewhere.

A released topic hands its offsets over to the next owner in one etcd transaction
(``docs/etcd-layout.md`` §1.5, §5.3); an unloaded one lost its assignment to someone else.
Either way the WAL is kept as released segments (:mod:`broker.topics.released`) until tiering
copied them. :meth:`TopicReleaser.abandon_unavailable_range` gives up waiting for offsets that
only a former owner held (§5.5).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from danube_pipeline.errors import (
    DanubeError,
    MetadataStoreError,
    NotEnoughReplicasError,
    NotServedHereError,
    UnavailableRangeNotFoundError,
)
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName

from broker.cluster.ownership import record_last_written, recorded_ranges, uncovered_pieces
from broker.cluster_view import ClusterView
from broker.config import BrokerConfig
from broker.replication.manager import ReplicaManager, replica_set
from broker.storage.wal import WriteAheadLog
from broker.topics.lifecycle import TopicLoader
from broker.topics.released import ReleasedSegments
from broker.topics.served import ServedTopics
from broker.topics.topic import Topic

__all__ = ["TopicReleaser"]

log = logging.getLogger(__name__)

_SETTLE_ATTEMPTS = 6
"""Reads of the assignment after a release transaction that failed or timed out."""
_SETTLE_BACKOFF_S = 0.1
"""The first wait between those reads; it doubles, up to 2 s."""


class _StillServed(Exception):
    """A release was not applied and the topic is still assigned here (internal)."""

    def __init__(self, error: DanubeError) -> None:
        super().__init__(str(error))
        self.error = error


class TopicReleaser:
    """Releases and unloads the topics of one broker.

    Args:
        served: the topics served here.
        config: the broker's configuration (``wal_dir``, segment settings).
        store: etcd, for the hand-over.
        cache: the LocalCache, waited on after the hand-over.
        cluster: whether a topic is assigned here.
        released: where released WALs are kept.
        close_producers: forgets the producers of a topic given up and marks their keys
            closed (:meth:`broker.sessions.ProducerSessions.close_topic_producers`).
        loader: finds the topic of an unavailable range.
    """

    def __init__(
        self,
        served: ServedTopics,
        config: BrokerConfig,
        *,
        store: MetadataStore,
        cache: LocalCache,
        cluster: ClusterView,
        released: ReleasedSegments,
        close_producers: Callable[[Topic], Awaitable[None]],
        loader: TopicLoader,
    ) -> None:
        self._served = served
        self._config = config
        self._store = store
        self._cache = cache
        self._cluster = cluster
        self._released = released
        self._close_producers = close_producers
        self._loader = loader
        self._broker_id = served.broker_id
        self.replicas: ReplicaManager | None = None
        """This broker's replicas: a replica's WAL stays in place (set by the broker)."""

    async def release_topic(self, name: TopicName, *, reason: str = "unload") -> int:
        """Give ``name`` up so the leader assigns it to another broker (``docs/etcd-layout.md``
        §1.5, §5.3).

        Steps: stop taking batches (producers get ``NotServedHereError`` and look the topic up
        again); seal the active segment once every batch already taken is durable; mark the
        producers closed; store every cursor and close the WAL; then, in one etcd transaction,
        write the sealed state (``last_committed_offset``), delete this broker's assignment and
        put the topic in the unassigned queue with ``{"reason", "from_broker"}``. The WAL
        directory moves to :attr:`ReleasedSegments.directory`, whose sealed segments this broker
        keeps serving over ``ListSealedSegments`` / ``ReadSegment`` (``released``) until local
        retention finds them tiered.

        Returns:
            The first offset the next owner hands out.

        The release runs alone among the loads and unloads of the topic
        (:meth:`ServedTopics.exclusive`). When the transaction fails its compare or its outcome
        is unknown (timed out), the assignment is read again (:meth:`_settle_release`): still
        assigned here, the topic is loaded again and the error raised; applied, the release
        completes; changed hands, the WAL is kept as released and its last offset recorded.

        Raises:
            NotServedHereError: the topic is not served here (or is being released), or it
                changed hands during the release.
            MetadataStoreError: the hand-over was not applied (etcd unreachable; the topic is
                served here again), or its outcome stayed unknown.
        """
        path = name.path
        if path not in self._served.topics:
            raise NotServedHereError(path, self._broker_id)
        try:
            async with self._served.exclusive(path):
                return await self._release_alone(name, reason)
        except _StillServed as still:
            # The hand-over was not applied: the topic stays here, so it is served again.
            try:
                await self._loader.load_topic(name)
            except Exception:  # noqa: BLE001 - the next request loads it again
                log.exception("topic %s: not loaded again after a release that did not happen", name)
            raise still.error from None

    async def _release_alone(self, name: TopicName, reason: str) -> int:
        """:meth:`release_topic` inside :meth:`ServedTopics.exclusive`.

        Raises:
            NotServedHereError: not served here, or the topic changed hands meanwhile (its WAL
                is kept as released and its last offset recorded).
            _StillServed: the hand-over was not applied and the topic is still assigned here.
            MetadataStoreError: etcd unreachable while the outcome was settled.
        """
        path = name.path
        topic = self._served.topics.get(path)
        if topic is None:
            raise NotServedHereError(path, self._broker_id)
        with self._served.fenced(path):
            topic.closed = True  # ServedTopics.served refuses new batches from here on
            del self._served.topics[path]
            replication = topic.replication
            if replication is not None and not await replication.wait_caught_up(self._config.replica_lag_max_s + 2):
                # An ISR member lacks batches the next owner would have to start after: keep it.
                self._served.topics[path] = topic
                topic.closed = False
                raise _StillServed(NotEnoughReplicasError(path, len(replication.isr), len(replication.isr) + 1))
            try:
                await topic.wal.seal_active()  # waits for every batch already taken
            except OSError as exc:
                log.warning("topic %s: sealing before the release failed (%s); the active segment moves as it is", name, exc)
            last = topic.wal.next_offset - 1
            untiered_from = self._untiered_from(topic)
            await self._close_producers(topic)
            await topic.close()
            self._served.changed()
            sealed = values.SealedState(
                sealed=True, last_committed_offset=last, broker_id=self._broker_id, timestamp=int(time.time())
            )
            puts: list[tuple[str, Any]] = [
                (keys.sealed_state(name), sealed),
                (keys.unassigned_topic(name), values.UnassignedReason(reason=reason, from_broker=self._broker_id)),
            ]
            ownership = topic.ownership
            if ownership is not None:  # the block shrinks to what was handed out (§5.4)
                puts.append((keys.offset_reservation(name), ownership.reservation(last)))
            puts.append((keys.producer_sequences(name), topic.sequences.to_json()))  # §5.6
            created_ranges: dict[str, int] = {}
            if untiered_from is not None and untiered_from <= last:
                # Offsets only this broker holds until they are tiered (§5.5): if it dies before,
                # consumers and tiering wait for it rather than take the gap for a loss. Only
                # where no range is recorded, each piece created, never overwriting another's.
                try:
                    recorded = await recorded_ranges(self._store, name)
                except MetadataStoreError as exc:  # nothing written: the topic stays here
                    raise _StillServed(exc) from None
                for first, end in uncovered_pieces(untiered_from, last, recorded):
                    range_key = keys.unavailable_range(name, first)
                    created_ranges[range_key] = 0
                    puts.append((range_key, values.UnavailableRange(
                        start_offset=first, end_offset=end, broker_id=self._broker_id,
                        since=int(time.time()), last_written=last,
                    )))
            failure: MetadataStoreError | None = None
            try:
                revision = await self._store.transaction(
                    created=ownership.guard if ownership is not None else None,
                    modified=created_ranges,
                    exists=[keys.topic_assignment(self._broker_id, name)],
                    puts=puts,
                    deletes=[keys.topic_assignment(self._broker_id, name)],
                )
            except MetadataStoreError as exc:  # timed out or cut off: it may have been applied
                failure, revision = exc, None
            if revision is None:
                epoch = ownership.epoch if ownership is not None else None
                await self._settle_release(name, epoch=epoch, sealed=sealed, failure=failure)
                return last + 1  # applied after all
            await self._released.move_off_loop(name)
            await self._cache.wait_for_revision(revision)
            log.info("topic %s released (%s): the next owner starts at offset %d", name, reason, last + 1)
            return last + 1

    async def _settle_release(
        self, name: TopicName, *, epoch: int | None, sealed: values.SealedState, failure: MetadataStoreError | None
    ) -> None:
        """Finish a release whose transaction failed its compare (``failure`` is ``None``) or
        whose outcome is unknown (``failure``), from what etcd holds now: the topic's WAL is
        closed and this broker serves it no more.

        * Still assigned here, in the same owner epoch: nothing was applied; the topic is
          served again (:class:`_StillServed`).
        * Otherwise, and the sealed state is the one this release wrote: it was applied; the WAL
          moves to the released segments and the release succeeded (returns).
        * Otherwise the topic changed hands under the release (failed over, reassigned): the WAL
          is kept as released and its last offset recorded (§5.4, §5.5), as an unload does.

        Raises:
            _StillServed: still assigned here.
            NotServedHereError: the topic changed hands under the release.
            MetadataStoreError: etcd stayed unreachable (the WAL stays where it is; the
                assignment's deletion, when it comes, unloads it: :meth:`unload_topic`).
        """
        assignment_key = keys.topic_assignment(self._broker_id, name)
        for attempt in range(_SETTLE_ATTEMPTS):
            try:
                assignment = await self._store.get(assignment_key)
                written = await self._store.get(keys.sealed_state(name))
                break
            except MetadataStoreError:
                if attempt == _SETTLE_ATTEMPTS - 1:
                    log.error("topic %s: the outcome of its release is unknown (etcd unreachable); its WAL "
                              "stays until the assignment is seen again", name)
                    raise
                await asyncio.sleep(min(_SETTLE_BACKOFF_S * 2**attempt, 2.0))
        if assignment is not None and (epoch is None or assignment.create_revision == epoch):
            log.warning("topic %s: release not applied (%s); the topic stays here",
                        name, failure if failure is not None else "compare failed")
            raise _StillServed(failure or MetadataStoreError("release topic", f"{name.path}: not applied; try again"))
        last = sealed.last_committed_offset
        if written is not None and written.value == sealed.to_json():
            await self._released.move_off_loop(name)
            log.info("topic %s released (outcome settled after %s): the next owner starts at offset %d",
                     name, failure, last + 1)
            return
        await self._released.move_off_loop(name)
        log.warning("topic %s changed hands during its release: WAL kept as released segments (last offset %d)",
                    name, last)
        try:
            await record_last_written(self._store, name, self._broker_id, last)
        except MetadataStoreError as exc:
            log.error("topic %s: last offset %d not recorded (%s); consumers wait at it until it is tiered",
                      name, last, exc)
        raise NotServedHereError(name.path, self._broker_id)

    @staticmethod
    def _untiered_from(topic: Topic) -> int | None:
        """The first offset of ``topic`` that only this broker holds: past the tiered offsets
        and not below its WAL's first offset (offsets below it are an earlier owner's, held on
        that owner's disk). ``None`` without an object store."""
        remote = topic.remote
        if remote is None:
            return None
        tiered_from = 0 if remote.end_offset is None else remote.end_offset + 1
        return max(tiered_from, topic.wal.first_offset)

    async def unload_topic(self, name: TopicName) -> None:
        """Stop serving ``name``: its assignment was removed by someone else (the leader failed
        this broker over, or the topic was deleted). Producers are closed; the WAL is kept as
        released segments (:meth:`keep_as_released`), also when the topic was not loaded (a load
        or a release that failed left it).

        The unload runs alone among the loads and releases of the topic
        (:meth:`ServedTopics.exclusive`) and fenced for its whole length: a load asked meanwhile
        (the topic given back at once) waits, then starts past the offsets kept as released.

        Raises:
            OSError, CorruptRecordError: the WAL cannot be opened.
            MetadataStoreError: etcd unreachable (the WAL is moved all the same).
        """
        path = name.path
        async with self._served.exclusive(path):
            if path in self._served.releasing:
                return  # a deletion under way disposes of the WAL
            with self._served.fenced(path):
                topic = self._served.topics.pop(path, None)
                if topic is not None:
                    topic.closed = True
                    await self._close_producers(topic)
                    await topic.close()
                    self._served.changed()
                    log.warning("topic %s unloaded: its assignment to broker %d was removed (fenced)",
                                name, self._broker_id)
                await self.keep_as_released(name)

    async def keep_as_released(self, name: TopicName) -> int | None:
        """Keep a WAL of a topic this broker no longer owns as released segments, and record
        the last offset it holds (``docs/etcd-layout.md`` §5.4, §5.5).

        The WAL is opened (recovery drops a torn tail), its active segment sealed, and the
        directory moved to :attr:`ReleasedSegments.directory`, from where its sealed segments
        are served for tiering under their own offsets. The last offset is recorded on this
        broker's reservation, or on the unavailable ranges the next owner recorded for it, so
        consumers and tiering pass over the offsets above it, which were never handed out.

        Returns:
            The last offset held, ``None`` when there was no WAL.

        Raises:
            OSError, CorruptRecordError: the WAL cannot be opened.
            MetadataStoreError: etcd unreachable (the WAL is moved all the same).
        """
        wal_dir = self._config.wal_dir / name.namespace / name.topic
        if not wal_dir.exists():
            return None
        if self.replicas is not None and self._cache.contains(keys.replica_assignment(name)):
            if self._broker_id in replica_set(self._cache, name):
                # A replica's log: its fetcher truncates it by epoch against the new owner, or
                # hands it back (dispose_replica_log) when the owner did not take it over in sync.
                log.info("topic %s: WAL kept in place as a replica's log", name)
                self.replicas.wake()
            else:  # no longer a replica: its offsets are with the ISR (unless a range names it)
                await self.dispose_replica_log(name)
            return None
        return await self._keep_wal_as_released(name, wal_dir)

    async def dispose_replica_log(self, name: TopicName) -> None:
        """A replica's log that its owner's log does not continue (the fetcher found no common
        leader epoch, or the owner's log starts above it): kept as released segments when an
        unavailable range still names this broker with nothing recorded (the owner took the topic
        over from outside the ISR, §5.5: these offsets may exist only here), otherwise deleted
        (whatever it held that was acknowledged is in the owner's log or in object storage).

        Raises:
            OSError, CorruptRecordError: the WAL cannot be opened.
            MetadataStoreError: etcd unreachable.
        """
        wal_dir = self._config.wal_dir / name.namespace / name.topic
        if not wal_dir.exists():
            return
        ranges = await recorded_ranges(self._store, name)
        if any(r.broker_id == self._broker_id and r.last_written is None and not r.abandoned for r in ranges):
            await self._keep_wal_as_released(name, wal_dir)
            return
        await asyncio.to_thread(shutil.rmtree, wal_dir)
        log.warning("topic %s: replica log deleted: the owner's log does not continue it", name)

    async def _keep_wal_as_released(self, name: TopicName, wal_dir: Path) -> int:
        """:meth:`keep_as_released` of an existing WAL directory."""
        wal = await WriteAheadLog.open(
            wal_dir, segment_max_bytes=self._config.segment_max_bytes, segment_max_age_s=self._config.segment_max_age_s
        )
        try:
            await wal.seal_active()
        finally:
            await wal.close()
        last = wal.next_offset - 1
        await self._released.move_off_loop(name)
        log.warning("topic %s: WAL kept as released segments (last offset %d); served for tiering", name, last)
        await record_last_written(self._store, name, self._broker_id, last)
        return last

    async def keep_unowned_wals(self) -> list[str]:
        """At start: keep as released (:meth:`keep_as_released`) every local WAL of a topic
        not assigned to this broker (it was taken over while this broker was away).

        Returns:
            The topics whose WAL was kept.
        """
        kept: list[str] = []
        base = self._config.wal_dir
        if not base.is_dir():
            return kept
        for ns_dir in sorted(p for p in base.iterdir() if p.is_dir()):
            for topic_dir in sorted(p for p in ns_dir.iterdir() if p.is_dir()):
                try:
                    name = TopicName.parse(f"/{ns_dir.name}/{topic_dir.name}")
                except ValueError:
                    continue
                async with self._served.exclusive(name.path):
                    if self._cluster.is_assigned_here(name) or name.path in self._served.topics:
                        continue
                    try:
                        await self.keep_as_released(name)
                    except Exception:
                        log.exception("topic %s: the WAL of a topic no longer owned could not be kept", name)
                        continue
                kept.append(name.path)
        return kept

    async def abandon_unavailable_range(self, name: TopicName, start_offset: int) -> int:
        """Give up waiting for the unavailable range of ``name`` starting at ``start_offset``
        (``docs/etcd-layout.md`` §5.5): subscriptions skip its offsets that object storage does
        not hold, counted, and tiering passes over them. Done on the topic's owner.

        Returns:
            The offsets of the range that were not in object storage (and were not known to
            be unused).

        Raises:
            TopicNotFoundError, NotServedHereError: see :meth:`TopicLoader.topic_for`.
            UnavailableRangeNotFoundError: no range starts there.
            MetadataStoreError: etcd unreachable, or the range changed meanwhile (retriable).
        """
        topic = await self._loader.topic_for(name)
        key = keys.unavailable_range(name, start_offset)
        kv = await self._store.get(key)
        if kv is None:
            raise UnavailableRangeNotFoundError(name.path, start_offset)
        rng = values.UnavailableRange.from_json(kv.value)
        if rng.abandoned:
            return 0
        revision = await self._store.transaction(
            modified={key: kv.mod_revision}, puts=[(key, dataclasses.replace(rng, abandoned=True))]
        )
        if revision is None:
            raise MetadataStoreError("abandon unavailable range", f"{key} changed meanwhile; try again")
        await self._cache.wait_for_revision(revision)
        end = rng.end_offset if rng.last_written is None else min(rng.end_offset, rng.last_written)
        tiered_end = topic.remote.end_offset if topic.remote is not None else None
        first_missing = rng.start_offset if tiered_end is None else max(rng.start_offset, tiered_end + 1)
        skipped = max(0, end - first_missing + 1)
        log.error("topic %s: unavailable range %d..%d of broker %d abandoned: %d offsets will never be delivered",
                  name, rng.start_offset, rng.end_offset, rng.broker_id, skipped)
        return skipped
