"""Where one subscription reads next: from the WAL, the topic's Iceberg table or the segment
objects (``docs/etcd-layout.md`` §3.10), and what happens when that position falls below
retention, into an unavailable range (§5.5) or into a hole that nothing holds."""

from __future__ import annotations

import logging
from collections.abc import Callable

from danube_pipeline.errors import PositionBelowRetentionError
from danube_pipeline.format.segments import StoredBatch
from danube_pipeline.metadata.values import TableSnapshot, UnavailableRange

from broker.dispatch.consumer import Consumer
from broker.dispatch.handouts import HandoutLedger
from broker.storage.remote import RemoteLog
from broker.storage.table_reads import TableCursor
from broker.storage.wal import WriteAheadLog

log = logging.getLogger("broker.dispatch.subscription")  # the subscription's log lines keep one logger name

BELOW_RETENTION_EARLIEST = "earliest"
BELOW_RETENTION_ERROR = "error"
BELOW_RETENTION_MODES = (BELOW_RETENTION_EARLIEST, BELOW_RETENTION_ERROR)
UNAVAILABLE_WAIT = "wait"
UNAVAILABLE_SKIP = "skip"
UNAVAILABLE_MODES = (UNAVAILABLE_WAIT, UNAVAILABLE_SKIP)


def earliest_offset(wal: WriteAheadLog, remote: RemoteLog | None) -> int:
    """The earliest offset a subscription of the topic can read.

    Without an object store, the WAL's first offset. With one: object storage's first offset
    when it has any below the WAL's first (offsets below it expired: retention deleted their
    descriptors, ``docs/etcd-layout.md`` §5.1); 0 when object storage holds nothing of the
    topic yet, since offsets below the WAL may still be tiered (an earlier owner's segments).
    """
    local = wal.first_offset
    if remote is None:
        return local
    first = remote.first_offset
    if first is None:
        return 0
    return min(first, local)


class ReadPosition:
    """The next offset one subscription reads, and the policies that move it.

    Args:
        topic: the topic path ``/ns/topic`` (for logs and errors).
        name: the subscription name.
        wal: the topic's WAL.
        remote: the topic's offsets in object storage; ``None`` without an object store.
        ledger: the subscription's handouts (for the ack floor, and to forget batches expired).
        start_offset: the first offset to deliver.
        below_retention: ``"earliest"`` or ``"error"`` (see
            :class:`~broker.dispatch.subscription.Subscription`).
        unavailable_range: ``"wait"`` or ``"skip"`` (see
            :class:`~broker.dispatch.subscription.Subscription`).
        table_snapshot: the subscription's stored table snapshot (§3.5.1), or ``None``.

    Attributes:
        offset: the next offset never handed to any consumer.
        records_from_object_storage: records handed out from object storage.
        skipped_below_retention: offsets jumped over because they expired.
        skipped_unavailable: offsets of unavailable ranges skipped (policy or abandoned).
        position_error: set once the position fell below retention in ``"error"`` mode.
        wake: called when a table read ends (the subscription's dispatcher wakes).

    Raises:
        ValueError: ``below_retention`` or ``unavailable_range`` is not a known mode.
    """

    def __init__(
        self,
        *,
        topic: str,
        name: str,
        wal: WriteAheadLog,
        remote: RemoteLog | None,
        ledger: HandoutLedger,
        start_offset: int,
        below_retention: str,
        unavailable_range: str,
        table_snapshot: TableSnapshot | None = None,
    ) -> None:
        if below_retention not in BELOW_RETENTION_MODES:
            raise ValueError(f"below_retention must be one of {BELOW_RETENTION_MODES}")
        if unavailable_range not in UNAVAILABLE_MODES:
            raise ValueError(f"unavailable_range must be one of {UNAVAILABLE_MODES}")
        self.topic = topic
        self.name = name
        self.wal = wal
        self.remote = remote
        self.below_retention_mode = below_retention
        self.unavailable_range = unavailable_range
        self._ledger = ledger
        self.offset = start_offset
        self.records_from_object_storage = 0
        self.skipped_below_retention = 0
        self.skipped_unavailable = 0
        self.position_error: PositionBelowRetentionError | None = None
        self._waiting_at: int | None = None
        self.wake: Callable[[], None] = lambda: None
        self._table_snapshot = table_snapshot
        self._table: TableCursor | None = None
        self._records_from_closed_tables = 0  # served by table cursors closed since (a close, a reset)
        self._objects_through = -1  # offsets up to here come from the objects (the table missed)

    @property
    def earliest_offset(self) -> int:
        """The earliest offset this subscription can read (:func:`earliest_offset`)."""
        return earliest_offset(self.wal, self.remote)

    def reset(self, offset: int) -> None:
        """Read from ``offset`` next, forgetting a position error, a wait and what was read
        from the table."""
        self.offset = offset
        self.position_error = None
        self._waiting_at = None
        self._objects_through = -1
        self.close()

    @property
    def table_snapshot(self) -> TableSnapshot | None:
        """The last table snapshot the subscription's reads covered (``docs/etcd-layout.md``
        §3.5.1), or ``None``."""
        return self._table.snapshot if self._table is not None else self._table_snapshot

    @property
    def records_from_table(self) -> int:
        """Records handed out from the topic's Iceberg table (part of
        ``records_from_object_storage``)."""
        current = self._table.records_served if self._table is not None else 0
        return self._records_from_closed_tables + current

    def _table_cursor(self, *, only_source: bool = False) -> TableCursor | None:
        """The subscription's table cursor, made on first use when the read path takes the
        table, or when the table is the ``only_source`` of the offset wanted."""
        table = self.remote.table if self.remote is not None else None
        if table is None or (self._table is None and not (table.enabled or only_source)):
            return None
        if self._table is None:
            self._table = TableCursor(table, name=f"{self.topic}/{self.name}", snapshot=self._table_snapshot)
            self._table.wake = lambda: self.wake()
        return self._table

    def read(self, offset: int, max_records: int) -> list[StoredBatch] | None:
        """Batches from ``offset`` on: from the WAL when it holds ``offset``; below it, from the
        topic's table when the read path (``docs/etcd-layout.md`` §3.10) says so and the table
        serves ``offset``, else from object storage. An offset whose object was deleted once
        the table held it (§5.1 ``object_deleted_at``) is read from the table whatever the read
        path. ``None`` while an object or the table is being read (the read wakes the
        dispatcher).

        A batch handed out is read again the same way for a redelivery (``offset`` is its base):
        a batch from the table is kept until it is acknowledged, since the table's batches are
        not the producers' and the objects' batches would not line up with it.
        """
        if offset >= self.wal.first_offset:
            return self.wal.read(offset, max_records)
        remote = self.remote
        if remote is None:
            return []
        table_only = remote.in_table_only(offset)
        cursor = self._table_cursor(only_source=table_only)
        if cursor is not None:
            handouts = self._ledger.handouts
            if offset in handouts:  # a redelivery (or a look at a batch handed out)
                batch = cursor.handed_out(offset)
                if batch is not None:
                    return [batch]
                if table_only:  # handed out from its object before the object was deleted
                    return cursor.read(offset, max_records) or remote.read_cached(offset, max_records)
                return remote.read_cached(offset, max_records)
            cursor.forget_handed(handouts)
            if table_only or (offset > self._objects_through and cursor.table.enabled):
                got = cursor.read(offset, max_records)
                if got is None or got:
                    return got
                if table_only:  # the table missed it: wait (the object is never fetched), never skip
                    return remote.read_cached(offset, max_records)
                descriptor = remote.descriptor_for(offset)  # the table does not serve it: objects
                self._objects_through = descriptor.end_offset if descriptor is not None else offset
        return remote.read_cached(offset, max_records)

    def close(self) -> None:
        """Drop what was read from the table (the subscription closes or is reset)."""
        if self._table is not None:
            self._table_snapshot = self._table.snapshot
            self._records_from_closed_tables += self._table.records_served
            self._table.close()
            self._table = None

    def _untiered(self, offset: int) -> bool:
        """Whether ``offset``, below the WAL, lies above everything object storage holds: not
        tiered *yet* (an earlier owner's segments after a topic move), so worth waiting for."""
        if self.remote is None:
            return False
        end = self.remote.end_offset
        return end is None or offset > end

    def skip_below(self, offset: int) -> None:
        """Move the read position up to ``offset`` and forget the batches below it (they are
        acknowledged in place: nothing can deliver them any more). Only for offsets that
        expired (:meth:`below_retention`); offsets never handed out are passed over
        (:meth:`pass_over`)."""
        self.offset = max(self.offset, offset)
        self._ledger.acknowledge_below(offset)

    def pass_over(self, offset: int) -> None:
        """Move the read position up to ``offset`` over offsets never handed out (a hole, an
        unavailable range's never-written tail, a range skipped by policy). The batches
        already handed out all lie below the position: they stay held, queued or waiting
        for redelivery until their consumers acknowledge them."""
        self.offset = max(self.offset, offset)

    def below_retention(self, earliest: int, consumers: list[Consumer]) -> bool:
        """The position (or a batch to redeliver) lies below ``earliest``: jump or fail, by
        ``below_retention``. Returns whether dispatch may go on.

        Args:
            earliest: the earliest offset the subscription can read.
            consumers: the subscription's consumers (their streams end in ``"error"`` mode).
        """
        floor = self._ledger.ack_floor(self.offset)
        if self.below_retention_mode == BELOW_RETENTION_ERROR:
            if self.position_error is None:
                self.position_error = PositionBelowRetentionError(self.topic, self.name, floor, earliest)
                log.error("%s", self.position_error)
            for consumer in list(consumers):
                consumer.fail(self.position_error)
            return False
        skipped = max(0, earliest - floor)
        self.skipped_below_retention += skipped
        log.warning(
            "%s/%s: offsets %d..%d expired before they were acknowledged; the subscription jumps "
            "to the earliest retained offset %d (%d skipped, %d in all)",
            self.topic, self.name, floor, earliest - 1, earliest, skipped, self.skipped_below_retention,
        )
        self.skip_below(earliest)
        return True

    def past_gap(self) -> bool:
        """Nothing was read at the position, which lies below the WAL: it is in an unavailable
        range (:meth:`_at_unavailable`), not tiered yet (wait: the descriptors' watch wakes the
        dispatcher), or in a hole (skipped, :meth:`skip_hole`).

        Returns:
            Whether dispatch may go on at once (``False``: it waits).
        """
        rng = self.remote.unavailable_at(self.offset) if self.remote is not None else None
        if rng is not None:
            return self._at_unavailable(rng)
        if self._untiered(self.offset):
            # An unavailable range: wait until it is tiered (the descriptors' watch
            # wakes the dispatcher), never skip it.
            if self._waiting_at != self.offset:
                self._waiting_at = self.offset
                log.warning(
                    "%s/%s: offsets %d..%d are not in object storage yet (an earlier owner's "
                    "untiered segments); waiting for them to be tiered",
                    self.topic, self.name, self.offset, self.wal.first_offset - 1,
                )
            return False
        self.skip_hole(self.offset)
        return True

    def skip_hole(self, offset: int, target: int | None = None) -> None:
        """Nothing holds ``offset`` although offsets above it exist (descriptors or WAL
        segments not contiguous): skip to ``target`` (default: the next offset held), logged
        and counted."""
        if target is None:
            local = self.wal.first_offset
            nxt = self.remote.next_start_after(offset) if self.remote is not None else None
            target = min(nxt, local) if nxt is not None else local
        if target <= offset:
            return
        self.skipped_below_retention += target - offset
        log.error(
            "%s/%s: offsets %d..%d are held neither in object storage nor in the WAL; skipped",
            self.topic, self.name, offset, target - 1,
        )
        self.pass_over(target)

    def _at_unavailable(self, rng: UnavailableRange) -> bool:
        """The read position lies in an unavailable range (``docs/etcd-layout.md`` §5.5) and
        object storage does not hold it. Offsets the failed owner never handed out are passed
        over; the others are waited for, or skipped (counted in ``skipped_unavailable``) when
        the range was abandoned or the subscription's policy is ``"skip"``.

        Returns:
            Whether the position moved.
        """
        position = self.offset
        unused = rng.unused_from()
        if unused is not None and position >= unused:
            log.info("%s/%s: offsets %d..%d were never handed out (broker %d failed before); passed over",
                     self.topic, self.name, position, rng.end_offset, rng.broker_id)
            self.pass_over(rng.end_offset + 1)
            return True
        if rng.abandoned or self.unavailable_range == UNAVAILABLE_SKIP:
            limit = unused if unused is not None else rng.end_offset + 1
            nxt = self.remote.next_start_after(position) if self.remote is not None else None
            target = min(limit, nxt) if nxt is not None and nxt > position else limit
            self.skipped_unavailable += target - position
            log.error(
                "%s/%s: offsets %d..%d held only by broker %d are skipped (%s; %d skipped in all)",
                self.topic, self.name, position, target - 1, rng.broker_id,
                "range abandoned" if rng.abandoned else "policy skip", self.skipped_unavailable,
            )
            self.pass_over(target)
            return True
        if self._waiting_at != position:
            self._waiting_at = position
            log.warning(
                "%s/%s: offset %d is in an unavailable range (%d..%d, held only by broker %d); waiting until "
                "its segments are tiered",
                self.topic, self.name, position, rng.start_offset, rng.end_offset, rng.broker_id,
            )
        return False
