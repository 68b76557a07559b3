"""The ``after-commit`` object lifecycle: one cold copy of a topic, its Iceberg table.

With the namespace policy's ``object_lifecycle`` set to ``after-commit`` (``docs/etcd-layout.md``
§2.1; a topic's override, §3.8, wins), tiering deletes a segment object once its offsets are
committed to the topic's table (:func:`retire_committed_objects`, called by
:func:`danube_pipeline.lake.tiering.commit_objects_to_table`) and the table is verified to hold
the object's records (:func:`check_object`, :func:`verify_in_table`):

* **offsets**: the rows and dead letters of the object's range hold every offset of it exactly
  once (a scan of the ``_offset`` column of both tables);
* **row count**: the table serves as many records, from the object's first offset on, as the
  object holds (:class:`~danube_pipeline.storage.table_reader.TableReader`, which reads rows
  and dead letters merged and stops at an offset it cannot serve byte for byte);
* **payloads**: a SHA-256 over the payload bytes the table serves (``_raw_payload`` or
  ``_payload`` of the rows, ``_payload`` of the dead letters), in offset order, equals the one
  over the object's payloads.

The table can serve the messages only when the table layout's ``raw_payload`` is on (§3.9):
without it the object is kept, and why is logged once per topic. An object whose
verification fails (e.g. committed while ``raw_payload`` was off) is kept, logged once, and not
read again by the same process.

A verified object's descriptor gets ``object_deleted_at`` (§5.1), written with a compare on the
key's ``mod_revision``, **before** the object is deleted: a reader that sees the mark reads the
offsets from the table (the broker's cold reads, retention's time limit), and a run that dies
between the two leaves an object that the next run deletes. The descriptor stays, so the
offsets the topic's descriptors cover, the table's resume point and the completeness checks
are unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import struct
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.table import Table

from danube_pipeline.errors import TableReadError
from danube_pipeline.lake import iceberg
from danube_pipeline.lake.segment_objects import read_segment_object
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.descriptors import read_descriptors_with_revisions
from danube_pipeline.metadata.values import NamespacePolicy, ObjectDescriptor, TableLayout
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore, segment_object_path
from danube_pipeline.storage.table_columns import OFFSET_COLUMN, PARTITION_COLUMN, PUBLISH_TIME_COLUMN
from danube_pipeline.storage.table_reader import TableReader

if TYPE_CHECKING:
    from danube_pipeline.metadata.store import MetadataStore

__all__ = [
    "AFTER_COMMIT",
    "KEEP",
    "VERIFY_CHUNK_RECORDS",
    "RetiredObjects",
    "TableRange",
    "check_object",
    "first_offset_published_since",
    "payload_checksum",
    "read_object_lifecycle",
    "read_table_range",
    "retire_committed_objects",
    "verify_in_table",
]

log = logging.getLogger(__name__)

KEEP = "keep"
AFTER_COMMIT = "after-commit"
_LENGTH = struct.Struct("<Q")
_logged: set[tuple[str, str]] = set()
"""``(topic or object, reason)`` already logged: each reason is logged once per process."""
_unverified: set[tuple[str, str | None]] = set()
"""``(/ns/topic/object_id, etag)`` whose verification failed: not read again by this process
(rows written without ``raw_payload`` never gain their bytes)."""


def _log_once(subject: str, reason: str) -> None:
    if (subject, reason) not in _logged:
        _logged.add((subject, reason))
        log.warning("%s: object kept: %s", subject, reason)


@dataclasses.dataclass
class RetiredObjects:
    """What :func:`retire_committed_objects` did.

    Attributes:
        objects_deleted: objects deleted by this call (their descriptors marked).
        bytes_deleted: their sizes, bytes.
        object_ids: their names, ``data-{start}-{end}.dnb1``, in offset order.
        kept: objects committed to the table but kept, with why (``object_id -> reason``).
    """

    objects_deleted: int = 0
    bytes_deleted: int = 0
    object_ids: list[str] = dataclasses.field(default_factory=list)
    kept: dict[str, str] = dataclasses.field(default_factory=dict)


async def read_object_lifecycle(store: MetadataStore, topic: TopicName) -> str:
    """The topic's ``object_lifecycle``: its namespace policy (§2.1) with the topic's override
    (§3.8) applied; ``"keep"`` when neither is stored, and where one is unreadable (logged).

    Args:
        store: the connected metadata store.
        topic: the topic (a partitioned topic's, for its partitions).

    Returns:
        One of :data:`~danube_pipeline.metadata.values.OBJECT_LIFECYCLES`.

    Raises:
        MetadataStoreError: etcd failed.
    """
    policy = NamespacePolicy()
    namespace = await store.get(keys.namespace_policy(topic.namespace))
    override = await store.get(keys.topic_policy(topic))
    try:
        if namespace is not None and namespace.value is not None:
            policy = NamespacePolicy.from_json(namespace.value)
        if override is not None and override.value is not None:
            policy = policy.overridden(override.value)
    except (TypeError, ValueError) as exc:
        _log_once(topic.path, f"unreadable policy, objects are kept ({exc})")
        return KEEP
    return policy.object_lifecycle


def payload_checksum(payloads: Iterable[bytes]) -> str:
    """SHA-256 hex over the payloads in order, each preceded by its length (u64 LE), so that
    moving bytes from one payload to the next changes it."""
    digest = hashlib.sha256()
    for payload in payloads:
        digest.update(_LENGTH.pack(len(payload)))
        digest.update(payload)
    return digest.hexdigest()


def _offsets(table: Table | None, start: int, end: int, partition: int | None) -> list[int]:
    """``_offset`` of the rows of ``table`` in ``start..end`` (one per row, duplicates kept)."""
    if table is None or table.current_snapshot() is None:
        return []
    row_filter = f"{OFFSET_COLUMN} >= {int(start)} and {OFFSET_COLUMN} <= {int(end)}"
    if partition is not None:
        row_filter += f" and {PARTITION_COLUMN} = {int(partition)}"
    arrow: pa.Table = table.scan(row_filter=row_filter, selected_fields=(OFFSET_COLUMN,)).to_arrow()
    return [int(o) for o in arrow.column(OFFSET_COLUMN).to_pylist()]


VERIFY_CHUNK_RECORDS = 50_000
"""Records of the table one verification read covers at most: the objects to verify are read
back from the table in ranges of consecutive objects of up to this many offsets (an object
larger than it is read alone), so a backlog of many small objects costs few table scans."""


@dataclasses.dataclass(frozen=True, slots=True)
class TableRange:
    """What the table holds of the offsets ``start..end``, read once for several objects.

    Attributes:
        start, end: the range read, inclusive.
        counts: ``offset -> rows + dead letters`` holding it (offsets held by none are absent).
        payloads: ``offset -> payload`` of the records the table serves byte for byte, from
            ``start`` up to ``served_until`` (exclusive): where
            :meth:`~danube_pipeline.storage.table_reader.TableReader.read` stopped.
        served_until: the first offset of the range the table did not serve (``end + 1``
            when it served all).
    """

    start: int
    end: int
    counts: dict[int, int]
    payloads: dict[int, bytes]
    served_until: int


def read_table_range(
    catalog: Catalog, identifier: tuple[str, str], start: int, end: int, *, partition: int | None = None
) -> TableRange:
    """Read what the table holds of ``start..end`` (rows and dead letters, and the records it
    serves byte for byte) for :func:`check_object`.

    Args:
        catalog: the shared catalog.
        identifier: the topic's table ``(ns, topic)`` (the partitioned topic's, for a partition).
        start, end: the offsets, inclusive.
        partition: the partition index, for a partition's objects.

    Returns:
        The :class:`TableRange`.

    Raises:
        TableReadError: the table cannot be read.
    """
    reader = TableReader(catalog, identifier, partition=partition)
    read = reader.read(start, max_records=end - start + 1)
    try:
        table = catalog.load_table(identifier)
        held = _offsets(table, start, end, partition) + _offsets(iceberg.dead_letter_table_of(table), start, end, partition)
    except Exception as exc:  # noqa: BLE001 - any failure of the read is a table read failure
        raise TableReadError(".".join(identifier), f"{type(exc).__name__}: {exc}", retriable=True) from exc
    counts: dict[int, int] = {}
    for offset in held:
        counts[offset] = counts.get(offset, 0) + 1
    return TableRange(start, end, counts, {r.offset: r.payload for r in read.records}, read.next_offset)


def check_object(held: TableRange, descriptor: ObjectDescriptor, payloads: list[bytes]) -> str | None:
    """Whether the table holds the object's records (module docstring: offsets, row count,
    payload checksum).

    Args:
        held: what the table holds of a range covering the descriptor's offsets.
        descriptor: the object's completed descriptor.
        payloads: the object's payloads, in offset order.

    Returns:
        ``None`` when verified; else why not, as text.
    """
    start, end = descriptor.start_offset, descriptor.end_offset
    count = end - start + 1
    if len(payloads) != count:
        return f"the object holds {len(payloads)} records, its descriptor covers {count} offsets"
    offsets = range(start, end + 1)
    once = sum(1 for o in offsets if held.counts.get(o) == 1)
    if once != count:
        return f"rows and dead letters hold {once} of the offsets {start}..{end} exactly once"
    served = [held.payloads.get(o) for o in offsets]
    if any(p is None for p in served):
        return f"the table does not serve the records from offset {held.served_until} on byte for byte"
    if payload_checksum(p for p in served if p is not None) != payload_checksum(payloads):
        return "the payload checksum of the table's records differs from the object's"
    return None


def verify_in_table(
    catalog: Catalog,
    identifier: tuple[str, str],
    descriptor: ObjectDescriptor,
    payloads: list[bytes],
    *,
    partition: int | None = None,
) -> str | None:
    """:func:`check_object` for one object, reading the table for its offsets only.

    Args:
        catalog: the shared catalog.
        identifier: the topic's table ``(ns, topic)`` (the partitioned topic's, for a partition).
        descriptor: the object's completed descriptor.
        payloads: the object's payloads, in offset order, one per offset of the descriptor.
        partition: the partition index, for a partition's object.

    Returns:
        ``None`` when verified; else why not, as text.

    Raises:
        TableReadError: the table cannot be read.
    """
    held = read_table_range(catalog, identifier, descriptor.start_offset, descriptor.end_offset, partition=partition)
    return check_object(held, descriptor, payloads)


async def retire_committed_objects(
    topic: TopicName,
    *,
    store: MetadataStore,
    objects: ObjectStore,
    catalog: Catalog,
    table_topic: TopicName,
    partition: int | None,
    committed_end_offset: int | None,
    layout: TableLayout,
    now_s: int | None = None,
) -> RetiredObjects:
    """Under the ``after-commit`` lifecycle, delete every completed object of ``topic`` that the
    table holds (module docstring); a no-op under ``keep``.

    Each object at or below the table's committed end offset, not marked yet, is read (size and
    MD5 checked against its descriptor), verified with :func:`check_object` against the table
    (read back once per run of consecutive objects, :data:`VERIFY_CHUNK_RECORDS`), marked
    (``object_deleted_at``, compare on its descriptor's ``mod_revision``: a descriptor changed
    meanwhile, e.g. deleted by retention, is left alone) and then deleted. Objects of marked
    descriptors left by a run that died between the mark and the deletion are deleted too.

    Args:
        topic: the topic (or partition) whose objects to retire.
        store: the connected metadata store.
        objects: the object store holding the objects.
        catalog: the shared catalog.
        table_topic: the topic whose table holds the offsets (the partitioned topic, for a
            partition; its policy override applies).
        partition: the partition index, for a partition.
        committed_end_offset: the table's committed end offset for ``topic`` (``None``: none).
        layout: the table's layout (§3.9).
        now_s: ``object_deleted_at``, seconds since the epoch; default now.

    Returns:
        A :class:`RetiredObjects`.

    Raises:
        MetadataStoreError: etcd failed.
        OSError: the object store failed.
        CorruptRecordError: an object does not match its descriptor.
    """
    report = RetiredObjects()
    if committed_end_offset is None or await read_object_lifecycle(store, table_topic) != AFTER_COMMIT:
        return report
    if not layout.raw_payload:
        _log_once(
            topic.path,
            "object_lifecycle is after-commit, but the table layout's raw_payload is off (docs/etcd-layout.md §3.9): "
            "the table cannot serve the messages byte for byte",
        )
        return report
    identifier = iceberg.table_identifier(table_topic)
    read = await read_descriptors_with_revisions(store, topic)
    candidates: list[ObjectDescriptor] = []
    for d in read.descriptors:
        if d.in_table_only:
            continue
        if not d.completed or d.end_offset > committed_end_offset:
            break  # in offset order: the rest is not in the table yet
        if (f"{topic.path}/{d.object_id}", d.etag) in _unverified:
            report.kept[d.object_id] = "not verified earlier in this process"
            continue
        candidates.append(d)
    held: TableRange | None = None
    for i, d in enumerate(candidates):
        path = segment_object_path(topic, d.object_id)
        where = f"{topic.path}/{d.object_id}"
        try:
            if held is None or d.end_offset > held.end or held.served_until <= d.start_offset < held.end + 1:
                held = None  # free the previous range first
                held = read_table_range(
                    catalog, identifier, d.start_offset, _chunk_end(candidates, i), partition=partition
                )
        except TableReadError as exc:  # the next run tries again
            report.kept[d.object_id] = str(exc)
            log.warning("%s: object kept: the table could not be read back to verify it: %s", where, exc)
            held = None
            continue
        try:
            decoded = read_segment_object(objects, path, size_bytes=d.size, etag=d.etag, where=where)
        except FileNotFoundError:
            report.kept[d.object_id] = "missing from the object store"
            _log_once(where, report.kept[d.object_id])
            continue
        problem = check_object(held, d, decoded.records.payload.to_pylist())
        del decoded
        if problem is not None:
            report.kept[d.object_id] = problem
            _unverified.add((where, d.etag))
            _log_once(where, f"not verified in table {'.'.join(identifier)}: {problem}")
            continue
        key = keys.object_descriptor(topic, d.start_offset)
        marked = dataclasses.replace(d, object_deleted_at=int(time.time()) if now_s is None else now_s)
        written = await store.compare_and_put_many(
            [(key, marked)], expected_mod_revisions={key: read.mod_revisions[d.start_offset]}
        )
        if written is None:
            continue  # changed meanwhile (another writer marked it, retention deleted it)
        objects.delete(path)
        report.objects_deleted += 1
        report.bytes_deleted += d.size
        report.object_ids.append(d.object_id)
        log.info("%s: deleted object %s (%d bytes): the table holds its offsets", topic.path, d.object_id, d.size)
    marked_paths = {segment_object_path(topic, d.object_id) for d in read.descriptors if d.in_table_only}
    if marked_paths:
        for path in objects.list(segment_object_path(topic, "")):
            if path in marked_paths:
                objects.delete(path)  # marked by a run that died before deleting it
    return report


def _chunk_end(candidates: list[ObjectDescriptor], i: int) -> int:
    """The end offset of the run of consecutive objects from ``candidates[i]`` on that one
    table read covers (:data:`VERIFY_CHUNK_RECORDS`)."""
    end = candidates[i].end_offset
    first = candidates[i].start_offset
    for d in candidates[i + 1 :]:
        if d.start_offset != end + 1 or d.end_offset - first + 1 > VERIFY_CHUNK_RECORDS:
            break
        end = d.end_offset
    return end


def first_offset_published_since(
    catalog: Catalog,
    identifier: tuple[str, str],
    descriptor: ObjectDescriptor,
    cutoff_us: int,
    *,
    partition: int | None = None,
) -> int | None:
    """The first offset of ``descriptor``'s range whose record was published at or after
    ``cutoff_us``, read from the table (rows and dead letters; for retention's time limit over
    an object the table alone holds, ``docs/etcd-layout.md`` §5.1).

    Args:
        catalog: the shared catalog.
        identifier: the topic's table (the partitioned topic's, for a partition).
        descriptor: a descriptor marked ``object_deleted_at``.
        cutoff_us: µs since the Unix epoch.
        partition: the partition index, for a partition.

    Returns:
        The offset, or ``None`` when every record of the range the table holds was published
        earlier (or retention deleted its rows).
    """
    row_filter = (
        f"{OFFSET_COLUMN} >= {int(descriptor.start_offset)} and "
        f"{OFFSET_COLUMN} <= {int(descriptor.end_offset)} and {PUBLISH_TIME_COLUMN} >= {int(cutoff_us)}"
    )
    if partition is not None:
        row_filter += f" and {PARTITION_COLUMN} = {int(partition)}"
    if not catalog.table_exists(identifier):
        return None
    table = catalog.load_table(identifier)
    found: list[int] = []
    for source in (table, iceberg.dead_letter_table_of(table)):
        if source is None or source.current_snapshot() is None:
            continue
        column = source.scan(row_filter=row_filter, selected_fields=(OFFSET_COLUMN,)).to_arrow().column(
            OFFSET_COLUMN
        )
        if len(column):
            found.append(int(pc.min(column).as_py()))
    return min(found, default=None)
