"""Seek by time: the first offset of a topic published at or after a given time.

A subscription created with a start publish time (``SubscribeRequest.start_publish_time_us``)
starts at the first offset, in offset order, whose publish time is at or after that time, found
in the order the topic's offsets are held (``docs/etcd-layout.md`` §3.5):

1. the topic's Iceberg table, when the topic's read path is ``iceberg`` or ``auto`` (§3.10):
   :meth:`danube_pipeline.storage.table_reader.TableReader.first_offset_at` finds it through the
   table's time partitions and the manifests' ``_publish_time`` bounds, without reading every
   file;
2. the segment objects above what the table answered for (§5.1): each object is read whole, in
   offset order, until a record is published at or after the time. Descriptors carry no
   publish times, only when the object's upload started (``created_at``): an object whose
   upload started more than :data:`CLOCK_SKEW_S` before the time holds only older records and
   is skipped unread; the others are scanned (no time index);
3. the local WAL, batch by batch from its first offset, skipping a batch whose records are all
   older (a batch's first publish time and its records' deltas are in its header and records).

When nothing held is that recent, the subscription starts at the next offset (as ``LATEST``).
Publish times are the broker's clock at append; they need not grow with offsets across
producers, so "first" means the lowest offset whose publish time qualifies.
"""

from __future__ import annotations

import asyncio
import logging

from danube_pipeline.format.batches import iter_batch
from danube_pipeline.format.records import SEGMENT_HEADER_SIZE
from danube_pipeline.format.segments import StoredBatch

from broker.storage.remote import RemoteLog, fetch_range
from broker.storage.wal import WriteAheadLog

log = logging.getLogger(__name__)

_WAL_READ_RECORDS = 10_000
CLOCK_SKEW_S = 300
"""How far the clocks of the broker that published and of the host that uploaded an object
may differ, in seconds, for the upload time to bound the object's publish times."""


def first_in_batches(batches: list[StoredBatch], publish_time_us: int, *, from_offset: int = 0) -> int | None:
    """The first offset at or above ``from_offset`` in ``batches`` published at or after
    ``publish_time_us`` (µs since the epoch), or ``None``.

    Raises:
        MalformedRequestError: a batch header does not parse.
    """
    for batch in batches:
        if batch.last_offset < from_offset:
            continue
        _header, records = iter_batch(batch.data)
        for offset, time_us, _key, _attributes, _payload in records:
            if offset >= from_offset and time_us >= publish_time_us:
                return offset
    return None


def _first_in_objects(remote: RemoteLog, publish_time_us: int, from_offset: int) -> int | None:
    """Scan the objects from ``from_offset`` on (blocking: object-store I/O)."""
    for descriptor in remote.descriptors:
        if descriptor.end_offset < from_offset:
            continue
        if descriptor.created_at and (descriptor.created_at + CLOCK_SKEW_S) * 1_000_000 < publish_time_us:
            continue  # uploaded well before the time: every record in it is older
        fetched = fetch_range(remote.objects, remote.topic, descriptor, SEGMENT_HEADER_SIZE, descriptor.start_offset)
        found = first_in_batches(fetched.batches, publish_time_us, from_offset=from_offset)
        if found is not None:
            return found
    return None


def _first_in_wal(wal: WriteAheadLog, publish_time_us: int, from_offset: int) -> int | None:
    offset = max(from_offset, wal.first_offset)
    while offset < wal.durable_end:
        batches = wal.read(offset, _WAL_READ_RECORDS)
        if not batches:
            return None
        found = first_in_batches(batches, publish_time_us, from_offset=offset)
        if found is not None:
            return found
        offset = batches[-1].last_offset + 1
    return None


async def first_offset_at(wal: WriteAheadLog, remote: RemoteLog | None, publish_time_us: int) -> int:
    """The offset a subscription starting at ``publish_time_us`` starts at (module docstring).

    Args:
        wal: the topic's WAL.
        remote: its offsets in object storage (and table), ``None`` without an object store.
        publish_time_us: µs since the Unix epoch.

    Returns:
        The first offset published at or after ``publish_time_us``; the WAL's next offset when
        none is.

    Raises:
        OSError, CorruptRecordError: an object or the WAL cannot be read.
        TableReadError: the table cannot be read (read path ``iceberg``; ``auto`` goes on with
            the objects).
    """
    scanned_from = 0
    if remote is not None:
        table = remote.table
        if table is not None and table.enabled:
            try:
                found = await asyncio.to_thread(table.first_offset_at_blocking, publish_time_us)
                end = await asyncio.to_thread(table.end_offset_blocking) if found is None else None
            except Exception as exc:  # noqa: BLE001 - auto: the objects answer instead
                if table.read_path != "auto":
                    raise
                log.warning("%s: seek by time in the table failed (%s); scanning the objects", table.topic.path, exc)
                found = end = None
            if found is not None:
                return found
            if end is not None:
                scanned_from = end + 1  # nothing the table holds is that recent
        if remote.descriptors:
            found = await asyncio.to_thread(_first_in_objects, remote, publish_time_us, scanned_from)
            if found is not None:
                return found
            scanned_from = max(scanned_from, remote.descriptors[-1].end_offset + 1)
    found = _first_in_wal(wal, publish_time_us, scanned_from)
    return found if found is not None else wal.next_offset
