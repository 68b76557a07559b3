"""The dead-letter table ``{topic}__dlq``: records tiering cannot turn into rows of the topic's
table (as Redpanda's Iceberg topics keep theirs in ``~dlq`` tables).

A record goes there, instead of stopping tiering, when:

=====================================================  ==========================================
``_error`` starts with                                 the record
=====================================================  ==========================================
``unknown schema``                                     names a schema id (and version) the
                                                       registry does not have
``unreadable schema``                                  names a schema the registry has but that
                                                       cannot be parsed or mapped to Iceberg
``corrupt payload``                                    does not decode with its writer schema
                                                       (or leaves bytes over)
``value does not fit``                                 has a value its column cannot hold (a
                                                       ``long`` too large for a ``decimal``
                                                       column, null in a required column)
``raw message (no schema) on a topic with schema``     has no schema while the topic's table has
                                                       one: never decoded with the table's
                                                       schema
``needs schema_rewrite``                               was written with a version whose change
                                                       cannot be made in place (``int`` to
                                                       ``string``; :mod:`.evolution`) until the
                                                       ``schema_rewrite`` asset has made it
=====================================================  ==========================================

Columns (the ``_partition`` column only in the table of a partitioned topic, as in the topic's
own table)::

    _offset long (required) | _publish_time timestamptz | _producer_name string | _schema_id long
    | _schema_version int | _partition int | _payload binary | _error string
    [| _producer_id long | _attributes map<string, string> | _key struct<value: string>]

The last three are added when the topic's layout has ``raw_payload`` on (``docs/etcd-layout.md``
§3.9; :func:`ensure_dead_letter_table`), so that a dead letter keeps everything its message had;
dead letters written before hold ``null`` there. Once the table has them they are filled.

**Exactly once.** The topic's table stays the record of what is committed: its
``danube.committed-end-offset`` moves over dead-lettered offsets too
(:func:`~danube_pipeline.lake.iceberg.append.append_rows`), so every offset of the topic is in
exactly one of the two tables. An object's dead letters are appended *before* its rows, each
append one commit; the dead-letter table's own ``danube.committed-end-offset`` (``.part-{i}``)
is the end offset of the last object whose dead letters it took. When it is at or above an
object's first dead letter (that object was tried before and stopped between the two
commits), the offsets it already holds in the object's range are read back and not appended
again, and the topic's table leaves them out. Both tables' snapshot summaries carry
``danube.dead-letter-records``.

A topic named ``{t}__dlq`` would have the same table name as ``t``'s dead-letter table:
:func:`ensure_dead_letter_table` refuses to use a table that is not marked as a dead-letter
table (property ``danube.dead-letter-of``).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException, NoSuchTableError
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.types import BinaryType, IntegerType, LongType, MapType, NestedField, StringType, TimestamptzType

from danube_pipeline.errors import InvalidNameError
from danube_pipeline.lake.iceberg.append import (
    DEFAULT_COMMIT_ATTEMPTS,
    SUMMARY_DEAD_LETTER_RECORDS,
    SUMMARY_END_OFFSET,
    SUMMARY_OBJECT_ID,
    SUMMARY_PARTITION,
    SUMMARY_START_OFFSET,
    SUMMARY_TOPIC,
    committed_end_offset,
    committed_end_offset_property,
    without_commit_retries,
)
from danube_pipeline.lake.iceberg.catalog import WRITE_PROPERTIES
from danube_pipeline.lake.iceberg.evolution import add_optional_columns
from danube_pipeline.lake.iceberg.schema import KEY_DOC, PARTITION_COLUMN, PAYLOAD_COLUMN, key_type
from danube_pipeline.names import TopicName
from danube_pipeline.format.records import Record
from danube_pipeline.storage.table_columns import (
    ATTRIBUTES_COLUMN,
    DEAD_LETTER_SUFFIX,
    ERROR_COLUMN,
    KEY_COLUMN,
    KEY_VALUE_FIELD,
    PRODUCER_ID_COLUMN,
)

__all__ = [
    "DEAD_LETTER_OF_PROPERTY",
    "DEAD_LETTER_SUFFIX",
    "ERROR_COLUMN",
    "DeadLetter",
    "DeadLetterAppend",
    "DeadLetterReason",
    "append_dead_letters",
    "commit_dead_letters",
    "dead_letter_identifier",
    "dead_letter_offsets",
    "dead_letter_schema",
    "dead_letter_table_of",
    "ensure_dead_letter_table",
    "load_dead_letter_table",
]

log = logging.getLogger(__name__)

DEAD_LETTER_OF_PROPERTY = "danube.dead-letter-of"
"""Table property of a dead-letter table: the topic whose dead letters it holds (``/ns/t``)."""


class DeadLetterReason(enum.StrEnum):
    """How each ``_error`` text starts (module docstring)."""

    UNKNOWN_SCHEMA = "unknown schema"
    UNREADABLE_SCHEMA = "unreadable schema"
    CORRUPT_PAYLOAD = "corrupt payload"
    VALUE_DOES_NOT_FIT = "value does not fit"
    RAW_MESSAGE = "raw message (no schema)"
    NEEDS_SCHEMA_REWRITE = "needs schema_rewrite"


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A record that cannot be a row of its topic's table.

    Attributes:
        record: the record, payload as stored.
        error: why, starting with a :class:`DeadLetterReason`.
    """

    record: Record
    error: str


@dataclass(frozen=True, slots=True)
class DeadLetterAppend:
    """What :func:`append_dead_letters` did.

    Attributes:
        snapshot_id: the dead-letter table's new snapshot, ``None`` when nothing was appended.
        rows_appended: dead letters appended.
        already_present: dead letters found already in the table (an earlier try of the same
            object), not appended again.
        offsets: every offset of the object's range now in the dead-letter table (appended or
            already present): the offsets the topic's table leaves out.
    """

    snapshot_id: int | None
    rows_appended: int
    already_present: int
    offsets: frozenset[int]


def dead_letter_identifier(topic: TopicName) -> tuple[str, str]:
    """The Iceberg identifier of a topic's dead-letter table.

    Args:
        topic: the topic (for a partition, the partitioned topic).

    Returns:
        ``(namespace, topic + "__dlq")``, e.g. ``("default", "flights__dlq")``.
    """
    return (topic.namespace, topic.topic + DEAD_LETTER_SUFFIX)


def dead_letter_schema(*, partitioned: bool = False) -> Schema:
    """The dead-letter table's schema (module docstring).

    Args:
        partitioned: the dead-letter table of a partitioned topic (with ``_partition``).

    Returns:
        The schema.
    """
    fields = [
        NestedField(1, "_offset", LongType(), required=True, doc="Danube offset in the topic (the partition's)"),
        NestedField(2, "_publish_time", TimestamptzType(), required=False, doc="publish time (µs, UTC)"),
        NestedField(3, "_producer_name", StringType(), required=False),
        NestedField(4, "_schema_id", LongType(), required=False, doc="0 = no schema"),
        NestedField(5, "_schema_version", IntegerType(), required=False),
    ]
    if partitioned:
        fields.append(
            NestedField(6, PARTITION_COLUMN, IntegerType(), required=False, doc="index i of the partition {topic}-part-{i}")
        )
    fields.append(NestedField(len(fields) + 1, PAYLOAD_COLUMN, BinaryType(), required=False, doc="the payload as stored"))
    fields.append(NestedField(len(fields) + 1, ERROR_COLUMN, StringType(), required=False, doc="why it is not a row"))
    return Schema(*fields)


def load_dead_letter_table(catalog: Catalog, topic: TopicName) -> Table | None:
    """The topic's dead-letter table, or ``None`` when it does not exist (no dead letter yet).

    Args:
        catalog: the shared catalog.
        topic: the topic (for a partition, the partitioned topic).

    Returns:
        The table, or ``None``.
    """
    try:
        return catalog.load_table(dead_letter_identifier(topic))
    except NoSuchTableError:
        return None


def dead_letter_table_of(table: Table) -> Table | None:
    """The dead-letter table of a topic's table, from the same catalog, or ``None`` when it
    has none (no record was dead-lettered yet).

    Args:
        table: a topic's table.

    Returns:
        The dead-letter table, or ``None``.
    """
    namespace, name = table.name()[-2:]
    try:
        found = table.catalog.load_table((namespace, name + DEAD_LETTER_SUFFIX))
    except NoSuchTableError:
        return None
    return found if DEAD_LETTER_OF_PROPERTY in found.properties else None


def ensure_dead_letter_table(
    catalog: Catalog, topic: TopicName, *, partitioned: bool = False, raw_payload: bool = False
) -> Table:
    """Load the topic's dead-letter table, creating it when missing.

    Args:
        catalog: the shared catalog.
        topic: the topic (for a partition, the partitioned topic).
        partitioned: a partitioned topic's (with ``_partition``).
        raw_payload: the layout's ``raw_payload`` (``docs/etcd-layout.md`` §3.9): the table
            gets ``_producer_id``, ``_attributes`` and ``_key`` when it lacks them (module docstring).

    Returns:
        The table.

    Raises:
        InvalidNameError: a table of that name exists and is not this topic's dead-letter
            table (a topic named ``{topic}__dlq``).
        CommitFailedException: adding the columns kept conflicting.
    """
    identifier = dead_letter_identifier(topic)
    table = load_dead_letter_table(catalog, topic)
    if table is None:
        catalog.create_namespace_if_not_exists(topic.namespace)
        table = catalog.create_table_if_not_exists(
            identifier,
            schema=dead_letter_schema(partitioned=partitioned),
            properties={**WRITE_PROPERTIES, DEAD_LETTER_OF_PROPERTY: topic.path},
        )
    if table.properties.get(DEAD_LETTER_OF_PROPERTY) != topic.path:
        raise InvalidNameError(
            "table", ".".join(identifier), f"exists and is not the dead-letter table of {topic.path}"
        )
    if raw_payload:
        _add_message_columns(table)
    return table


def _add_message_columns(table: Table) -> None:
    """Add ``_producer_id``, ``_attributes`` and ``_key`` (optional) where missing, in one schema
    commit (:func:`~danube_pipeline.lake.iceberg.evolution.add_optional_columns`)."""
    add_optional_columns(table, [
        (PRODUCER_ID_COLUMN, LongType(), "u64 producer id, stored as the int64 with the same bits"),
        (
            ATTRIBUTES_COLUMN,
            MapType(key_id=1, key_type=StringType(), value_id=2, value_type=StringType(), value_required=False),
            "the record's attributes",
        ),
        (KEY_COLUMN, key_type(0), KEY_DOC),
    ])  # fmt: skip


def dead_letter_offsets(
    table: Table, *, partition: int | None = None, start_offset: int | None = None, end_offset: int | None = None
) -> list[int]:
    """The ``_offset`` of every row of a dead-letter table (of one partition, in a range).

    Args:
        table: a dead-letter table.
        partition: only this partition's rows (a partitioned topic's table).
        start_offset: only offsets at or above it.
        end_offset: only offsets at or below it.

    Returns:
        The offsets, sorted, one per row.
    """
    conditions = []
    if partition is not None:
        conditions.append(f"{PARTITION_COLUMN} = {int(partition)}")
    if start_offset is not None:
        conditions.append(f"_offset >= {int(start_offset)}")
    if end_offset is not None:
        conditions.append(f"_offset <= {int(end_offset)}")
    scan = table.scan(row_filter=" and ".join(conditions) or "True", selected_fields=("_offset",))
    return sorted(scan.to_arrow().column("_offset").to_pylist())


def _rows(table: Table, letters: Sequence[DeadLetter], partition: int | None) -> pa.Table:
    arrow_schema = schema_to_pyarrow(table.schema(), include_field_ids=False)
    data = {
        "_offset": [d.record.offset for d in letters],
        "_publish_time": [d.record.publish_time_us for d in letters],
        "_producer_name": [d.record.producer_name for d in letters],
        "_schema_id": [d.record.schema_id for d in letters],
        "_schema_version": [d.record.schema_version for d in letters],
        # a u64 producer id is stored as the int64 with the same bits (the topic table's rule)
        PRODUCER_ID_COLUMN: [
            d.record.producer_id - (1 << 64) if d.record.producer_id >= 1 << 63 else d.record.producer_id
            for d in letters
        ],
        ATTRIBUTES_COLUMN: [list(d.record.attributes.items()) for d in letters],
        KEY_COLUMN: [{KEY_VALUE_FIELD: d.record.key} for d in letters],
        PARTITION_COLUMN: [partition] * len(letters),
        PAYLOAD_COLUMN: [d.record.payload for d in letters],
        ERROR_COLUMN: [d.error for d in letters],
    }
    return pa.Table.from_arrays(
        [pa.array(data.get(f.name, [None] * len(letters)), type=f.type) for f in arrow_schema], schema=arrow_schema
    )


def append_dead_letters(
    table: Table,
    letters: Sequence[DeadLetter],
    object_id: str,
    *,
    topic: str,
    start_offset: int,
    end_offset: int,
    partition: int | None = None,
    max_attempts: int = DEFAULT_COMMIT_ATTEMPTS,
    retry_backoff_s: float = 0.05,
) -> DeadLetterAppend:
    """Append an object's dead letters to the dead-letter table, exactly once.

    One commit adds the rows and raises the table's ``danube.committed-end-offset``
    (``.part-{i}``) to ``end_offset``; the summary carries ``danube.topic``,
    ``danube.start-offset``, ``danube.end-offset``, ``danube.object-id``,
    ``danube.dead-letter-records`` (and ``danube.partition``). Offsets of the object's range
    already in the table (module docstring) are not appended again. The commit requires the
    table's ``main`` branch to be where it was read (``AssertRefSnapshotId``); one that loses is
    retried after a refresh.

    Args:
        table: the dead-letter table (:func:`ensure_dead_letter_table`).
        letters: the object's dead letters, in offset order, within
            ``start_offset..end_offset``.
        object_id: the segment object they come from.
        topic: ``/ns/topic`` (the partition's name, for a partition).
        start_offset: the object's first offset.
        end_offset: the object's last offset.
        partition: the partition index, for a partitioned topic.
        max_attempts: commit attempts on ``CommitFailedException``.
        retry_backoff_s: sleep before the n-th retry is ``n * retry_backoff_s`` seconds.

    Returns:
        A :class:`DeadLetterAppend`.

    Raises:
        CommitFailedException: the commit still failed after ``max_attempts`` attempts.
    """
    for attempt in range(1, max_attempts + 1):
        present: set[int] = set()
        committed = committed_end_offset(table, partition=partition)
        if letters and committed is not None and committed >= letters[0].record.offset:
            present = set(
                dead_letter_offsets(table, partition=partition, start_offset=start_offset, end_offset=end_offset)
            )
        new = [d for d in letters if d.record.offset not in present]
        offsets = frozenset(present | {d.record.offset for d in letters})
        if not new:
            return DeadLetterAppend(None, 0, len(letters), offsets)
        summary = {
            SUMMARY_TOPIC: topic,
            SUMMARY_START_OFFSET: str(start_offset),
            SUMMARY_END_OFFSET: str(end_offset),
            SUMMARY_OBJECT_ID: object_id,
            SUMMARY_DEAD_LETTER_RECORDS: str(len(new)),
        }
        if partition is not None:
            summary[SUMMARY_PARTITION] = str(partition)
        high = end_offset if committed is None else max(committed, end_offset)
        handle = without_commit_retries(table)
        try:
            with handle.transaction() as transaction:
                transaction.set_properties({committed_end_offset_property(partition): str(high)})
                transaction.append(_rows(table, new, partition), snapshot_properties=summary)
        except CommitFailedException:
            if attempt == max_attempts:
                raise
            log.warning("%s %s: dead-letter commit conflicted (attempt %d), retrying", topic, object_id, attempt)
            time.sleep(retry_backoff_s * attempt)
            table.refresh()
            continue
        snapshot = handle.current_snapshot()
        table.refresh()
        log.info("%s %s: %d records to the dead-letter table", topic, object_id, len(new))
        return DeadLetterAppend(
            snapshot.snapshot_id if snapshot else None, len(new), len(letters) - len(new), offsets
        )
    raise AssertionError("unreachable")  # pragma: no cover


def commit_dead_letters(
    catalog: Catalog,
    table_topic: TopicName,
    letters: Sequence[DeadLetter],
    object_id: str,
    *,
    topic: str,
    start_offset: int,
    end_offset: int,
    partition: int | None = None,
    raw_payload: bool = False,
) -> DeadLetterAppend:
    """A range's dead letters in ``{topic}__dlq``, before its rows go to the topic's table.

    With dead letters, the dead-letter table is created if needed and they are appended
    (:func:`append_dead_letters`). Without, an earlier try of the same range may have
    dead-lettered records that now decode (the registry was fixed meanwhile): when the
    dead-letter table's committed end offset reaches ``start_offset``, the offsets it holds in
    the range are read back, and they stay there (module docstring, "Exactly once").

    Args:
        catalog: the shared catalog.
        table_topic: the topic whose table it is (the partitioned topic, for a partition).
        letters: the range's dead letters, in offset order (may be empty).
        object_id: the segment object (or objects) of the range.
        topic: ``/ns/topic`` of the records (the partition's name, for a partition).
        start_offset: the range's first offset.
        end_offset: the range's last offset.
        partition: the partition index, for a partitioned topic.
        raw_payload: the layout's ``raw_payload``: a dead-letter table it appends to gains
            ``_producer_id``, ``_attributes`` and ``_key`` first (:func:`ensure_dead_letter_table`).

    Returns:
        A :class:`DeadLetterAppend` whose ``offsets`` are the range's offsets in the
        dead-letter table (those the topic's table leaves out).

    Raises:
        CommitFailedException: the dead-letter commit kept conflicting.
        InvalidNameError: a table named like the dead-letter table is not one.
    """
    if letters:
        dlq = ensure_dead_letter_table(
            catalog, table_topic, partitioned=partition is not None, raw_payload=raw_payload
        )
        return append_dead_letters(
            dlq, letters, object_id, topic=topic, start_offset=start_offset, end_offset=end_offset,
            partition=partition,
        )
    existing = load_dead_letter_table(catalog, table_topic)
    dlq_committed = committed_end_offset(existing, partition=partition) if existing is not None else None
    if existing is not None and dlq_committed is not None and dlq_committed >= start_offset:
        # An earlier try of this range dead-lettered records that now decode: they stay there.
        present = dead_letter_offsets(existing, partition=partition, start_offset=start_offset, end_offset=end_offset)
        return DeadLetterAppend(None, 0, len(present), frozenset(present))
    return DeadLetterAppend(None, 0, 0, frozenset())
