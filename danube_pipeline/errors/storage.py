"""Errors of the stored log: segments, records, offsets, a full disk, quarantined or unreadable segments.

Part of :mod:`danube_pipeline.errors`, which re-exports every name."""

from __future__ import annotations

import grpc

from danube_pipeline.errors.base import DanubeError, bounded


class SegmentNotFoundError(DanubeError, LookupError):
    """No sealed segment starts at the requested offset."""

    grpc_code = grpc.StatusCode.NOT_FOUND

    def __init__(self, topic: str, start_offset: int) -> None:
        self.topic = topic
        self.start_offset = start_offset
        super().__init__(f"topic {topic!r} has no sealed segment starting at offset {start_offset}")


class CorruptRecordError(DanubeError):
    """A record or segment failed its framing or CRC32C check."""

    grpc_code = grpc.StatusCode.DATA_LOSS

    def __init__(self, where: str, position: int, reason: str) -> None:
        self.where = where
        self.position = position
        self.reason = reason
        super().__init__(f"corrupt record in {where} at byte {position}: {reason}")


class StorageFullError(DanubeError):
    """The broker's disk has no room for a write (``ENOSPC`` or ``EDQUOT``).

    Nothing of the refused batch was kept. Retriable: the broker keeps serving reads, and
    publishing resumes by itself once space is freed.
    """

    retriable = True
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"storage full at {bounded(path)}: {reason}")


class OffsetRangeError(DanubeError):
    """Offsets were not contiguous where the design requires them to be."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, expected_offset: int, actual_offset: int, where: str) -> None:
        self.expected_offset = expected_offset
        self.actual_offset = actual_offset
        self.where = where
        super().__init__(f"{where}: expected offset {expected_offset}, found {actual_offset}")


class PositionBelowRetentionError(DanubeError):
    """A subscription's position lies below the earliest retained offset of its topic: those
    messages expired (namespace retention, ``docs/etcd-layout.md`` §2.1) and the broker is
    configured to stop the consumer rather than jump (``--position-below-retention error``)."""

    grpc_code = grpc.StatusCode.OUT_OF_RANGE

    def __init__(self, topic: str, subscription: str, position: int, earliest_offset: int) -> None:
        self.topic = topic
        self.subscription = subscription
        self.position = position
        self.earliest_offset = earliest_offset
        super().__init__(
            f"{topic}/{subscription}: position {position} is below the earliest retained offset "
            f"{earliest_offset}; offsets {position}..{earliest_offset - 1} expired"
        )


class SegmentQuarantinedError(DanubeError):
    """A topic's WAL found corruption in the middle of a segment, with valid, acknowledged
    batches after it, and quarantined the segment: appends are refused until an operator
    decides (``python -m broker.storage.wal.repair``, see :mod:`broker.storage.wal.recovery`).

    Not retriable: the condition lasts until the broker is stopped and the WAL repaired.

    Args:
        path: the quarantined segment file.
        position: byte position of the bad batch in it.
        last_good_offset: the last offset before the bad batch (the segment's start - 1 if none).
        next_valid_offset: the base offset of the first valid batch found after the bad one.
    """

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, path: str, position: int, last_good_offset: int, next_valid_offset: int) -> None:
        self.path = path
        self.position = position
        self.last_good_offset = last_good_offset
        self.next_valid_offset = next_valid_offset
        super().__init__(
            f"WAL segment {bounded(path)} is quarantined: corrupt data at byte {position} after offset "
            f"{last_good_offset}, with valid batches from offset {next_valid_offset} after it; appends are "
            "refused until an operator repairs the WAL (python -m broker.storage.wal.repair)"
        )


class SegmentUnreadableError(DanubeError):
    """A read of a topic's local WAL segment found a batch that fails its CRC32C (corruption on
    disk found after the segment was opened): the segment is quarantined for reads, its
    offsets from ``first_offset`` to ``end_offset`` are refused to readers instead of being
    served, and an operator decides (``python -m broker.storage.wal.repair``). Offsets before
    the corruption are still served.

    Not retriable: the condition lasts until the segment is repaired or restored.

    Args:
        path: the segment file.
        position: byte position of the bad batch in it.
        first_offset: the first offset not served (the last good one + 1).
        end_offset: the segment's last offset.
    """

    grpc_code = grpc.StatusCode.DATA_LOSS

    def __init__(self, path: str, position: int, first_offset: int, end_offset: int) -> None:
        self.path = path
        self.position = position
        self.first_offset = first_offset
        self.end_offset = end_offset
        super().__init__(
            f"WAL segment {bounded(path)} is corrupt at byte {position}: offsets {first_offset}..{end_offset} "
            "cannot be read until an operator repairs the WAL (python -m broker.storage.wal.repair)"
        )


class LogTruncationError(DanubeError):
    """A topic's WAL refused to truncate at ``end_offset`` and changed nothing: a sealed
    segment holds offsets at or above it (sealed segments are immutable; the high watermark
    keeps segments above it from being sealed, so a follower's truncation, KIP-101, only
    ever cuts the active segment), the offset lies below what the WAL holds, appends are
    queued, or a segment is quarantined.

    Not retriable: the same truncation fails again.

    Args:
        path: the WAL directory.
        end_offset: the first offset the truncation was to remove.
        reason: why it was refused.
    """

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, path: str, end_offset: int, reason: str) -> None:
        self.path = path
        self.end_offset = end_offset
        self.reason = reason
        super().__init__(f"WAL {bounded(path)} cannot be truncated at offset {end_offset}: {bounded(reason)}")


class TableReadError(DanubeError):
    """A topic's Iceberg table could not be read (``danube_pipeline.storage.table_reader``).

    ``retriable`` tells the two kinds apart: the catalog database or a data file was
    unreachable, or a file went away under the read (snapshot expiry, compaction): the same
    read may succeed later; or the table is not a topic table the reader understands (no
    ``_offset`` column, a ``_partition`` column it was not told about, a data file that does
    not decode): it will not. Either way, the caller serves the offsets from segment objects.

    Args:
        table: the table, ``namespace.name``.
        reason: what went wrong.
        retriable: whether the same read may succeed later.
    """

    def __init__(self, table: str, reason: str, *, retriable: bool = False) -> None:
        self.table = table
        self.reason = reason
        self.retriable = retriable
        super().__init__(f"cannot read table {bounded(table)}: {bounded(reason)}")
