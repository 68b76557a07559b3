"""Bulk loads on Spark: many segment objects into a topic's Iceberg table, in parallel.

What tiering does one object at a time (:func:`danube_pipeline.lake.tiering.commit_objects_to_table`),
:func:`bulk_load` does for a whole range of objects at once, for a first load of a topic with a
long history, a replay into a new table (``target``) after a schema rewrite or after fixing the
registry so that dead-lettered records decode again:

1. **Plan.** The topic's completed object descriptors (``docs/etcd-layout.md`` §5.1) above the
   target table's committed end offset (and from ``from_offset``) are the objects to read. They
   must be contiguous, and the first must continue the table, with the same rule as tiering: a
   hole is passed over only when its offsets were never handed out or were abandoned (§5.5), or
   lie below the first descriptor retention left.
2. **Schemas.** One Spark job lists the ``(schema_id, schema_version)`` pairs of the records
   (``mapInArrow`` over the objects); the registry is asked once per pair, and the table is
   created or evolved in place for them on the driver, oldest first, as
   :func:`danube_pipeline.lake.iceberg.commit_object` does per object.
3. **Decode.** A second ``mapInArrow`` job reads each object from the object store
   (:class:`~danube_pipeline.storage.objectstore.ObjectStore`), checks it against its descriptor
   (size, MD5 etag, offsets), parses it (:func:`~danube_pipeline.lake.segment_columns.decode_segment_columns`) and
   turns its records into the table's Arrow rows with the incremental path's own
   :func:`~danube_pipeline.lake.iceberg.rows.table_rows`. Records that cannot be rows come out of
   the same job as dead letters.
4. **Dead letters** are collected on the driver (they are the exception) and appended to
   ``{table}__dlq`` with :func:`~danube_pipeline.lake.iceberg.append_dead_letters`, exactly once,
   before the rows, as tiering does (:mod:`danube_pipeline.lake.iceberg.dead_letter`).
5. **Write, then publish.** Iceberg's Spark writer appends the rows as a *staged* snapshot
   (write-audit-publish: the table property ``write.wap.enabled=true`` and the session's
   ``spark.wap.id``; Iceberg docs, "Branching and Tagging" / "WAP"), whose summary carries
   ``danube.topic``, ``danube.start-offset``, ``danube.end-offset``, ``danube.object-id``,
   ``danube.dead-letter-records`` (and ``danube.partition``) through the writer's
   ``snapshot-property.*`` options. The Spark writer distributes and sorts the rows by the
   table's partition spec and sort order (``_offset``), partitioned or not. The staged
   snapshot is then published by one pyiceberg commit that moves ``main`` to it **and** sets
   ``danube.committed-end-offset`` (``.part-{i}``), under the requirement that ``main`` is
   still the snapshot the load started from (Iceberg spec, "Optimistic Concurrency":
   ``assert-ref-snapshot-id``). So the bulk path keeps the incremental path's exactly-once
   rule (:mod:`danube_pipeline.lake.iceberg.append`): :func:`~danube_pipeline.lake.iceberg.committed_end_offset`
   sees the load, tiering continues after it without duplicates, and a re-run appends
   nothing. A load that loses the race (tiering committed meanwhile) leaves its staged
   snapshot unpublished (snapshot expiry removes it) and starts over from the plan.

The result is the table tiering would have written from the same objects: the same rows and
offsets, the same dead letters and the same committed end offset, in fewer, larger snapshots
and files. Schema evolution follows the order of the writer schemas' ``(schema_id, version)``
rather than the order in which objects first used them: when a topic's records switch back
and forth between schema ids, column order may differ from tiering's.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.table.update.snapshot import ManageSnapshots

from danube_pipeline.lake import iceberg
from danube_pipeline.errors import (
    CorruptRecordError,
    DanubeError,
    InvalidSchemaError,
    OffsetRangeError,
    SchemaEvolutionError,
    SchemaNotFoundError,
)
from danube_pipeline.lake.iceberg.append import _without_commit_retries
from danube_pipeline.lake.iceberg.arrow import assemble
from danube_pipeline.lake.iceberg.dead_letter import DeadLetter
from danube_pipeline.lake.iceberg.layout import apply_layout, read_table_layout
from danube_pipeline.lake.iceberg.rows import BoundWriter, table_rows
from danube_pipeline.lake.iceberg.schema import (
    PARTITION_COLUMN,
    PAYLOAD_COLUMN,
    RESERVED_COLUMNS,
    PayloadColumn,
    schema_from_columns,
)
from danube_pipeline.lake.iceberg.writer import renamed_columns
from danube_pipeline.metadata.descriptors import (
    passable,
    read_descriptors,
    read_unavailable_ranges,
)
from danube_pipeline.metadata.values import (
    ObjectDescriptor,
    TableLayout,
    UnavailableRange,
)
from danube_pipeline.names import TopicName, validate_part
from danube_pipeline.storage.objectstore import ObjectStore, segment_object_path
from danube_pipeline.partitions import partition_of
from danube_pipeline.format.records import Record
from danube_pipeline.lake.segment_columns import decode_segment_columns, schema_keys
from danube_pipeline.lake.spark import spark_table_name
from danube_pipeline.lake.tiering import SchemaLookup, SchemaParser, default_schema_parser

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

    from danube_pipeline.metadata.store import MetadataStore

__all__ = [
    "SUMMARY_ENGINE",
    "WAP_ENABLED_PROPERTY",
    "BulkLoadConflictError",
    "BulkLoadError",
    "BulkLoadReport",
    "BulkObject",
    "bulk_load",
    "plan_objects",
]

log = logging.getLogger(__name__)

SUMMARY_ENGINE = "danube.engine"
"""Summary field of a bulk load's snapshot: ``spark``."""
WAP_ENABLED_PROPERTY = "write.wap.enabled"
"""Iceberg table property that lets a Spark write with ``spark.wap.id`` stage its snapshot."""
_WAP_ID_CONF = "spark.wap.id"
_WAP_ID_SUMMARY = "wap.id"
_ERROR_FIELD = "__danube_dead_letter_error"
_PAYLOAD_FIELD = "__danube_dead_letter_payload"
_PARSE_ERRORS = (InvalidSchemaError, ValueError, TypeError, KeyError, AttributeError)


class BulkLoadError(DanubeError):
    """A bulk load cannot run as asked (the message says why); nothing was committed."""

    def __init__(self, topic: str, reason: str) -> None:
        self.topic = topic
        self.reason = reason
        super().__init__(f"bulk load of {topic}: {reason}")


class BulkLoadConflictError(BulkLoadError):
    """Another writer committed to the table while the load ran, every attempt.

    The staged snapshots were not published; running the load again continues after what the
    other writer committed.
    """

    retriable = True


@dataclass(frozen=True, slots=True)
class BulkObject:
    """One segment object to read, as a Spark task sees it (from its §5.1 descriptor).

    Attributes:
        object_id: ``data-{start}-{end}.dnb1``.
        path: the object's path in the store (:func:`~danube_pipeline.storage.objectstore.segment_object_path`).
        size_bytes: the descriptor's size.
        etag: the descriptor's MD5 hex, or ``None``.
        start_offset: first offset in the object.
        end_offset: last offset in the object (inclusive).
    """

    object_id: str
    path: str
    size_bytes: int
    etag: str | None
    start_offset: int
    end_offset: int


@dataclass
class BulkLoadReport:
    """What :func:`bulk_load` did.

    Attributes:
        topic: ``/ns/topic`` whose objects were read.
        table: ``ns.table`` written to.
        partition: the partition index when ``topic`` is a partition of a partitioned topic.
        objects_read: objects decoded by this load.
        bytes_read: bytes of those objects.
        rows_appended: rows appended to the table.
        dead_letter_table: ``ns.table__dlq`` when the load dead-lettered records, else ``None``.
        dead_letter_records: records appended to the dead-letter table.
        first_offset: the first offset loaded, ``None`` when nothing was pending.
        last_offset: the last offset loaded, ``None`` when nothing was pending.
        committed_end_offset_before: the table's committed end offset before.
        committed_end_offset: the table's committed end offset afterwards.
        snapshot_id: the snapshot the load published, ``None`` when nothing was pending.
        data_files_before: live data files of the table before (0 without a table).
        data_files_after: live data files afterwards.
        row_count: rows in the table afterwards (snapshot summary), ``None`` when unknown.
        created: whether the load created the table.
        schema_changes: in-place schema changes made, as text.
        attempts: plans run (more than 1 after losing a commit race).
    """

    topic: str
    table: str
    partition: int | None = None
    objects_read: int = 0
    bytes_read: int = 0
    rows_appended: int = 0
    dead_letter_table: str | None = None
    dead_letter_records: int = 0
    first_offset: int | None = None
    last_offset: int | None = None
    committed_end_offset_before: int | None = None
    committed_end_offset: int | None = None
    snapshot_id: int | None = None
    data_files_before: int = 0
    data_files_after: int = 0
    row_count: int | None = None
    created: bool = False
    schema_changes: list[str] = field(default_factory=list)
    attempts: int = 0


# --------------------------------------------------------------------------- plan


def plan_objects(
    topic: TopicName,
    descriptors: Sequence[ObjectDescriptor],
    ranges: Sequence[UnavailableRange],
    *,
    committed: int | None,
    from_offset: int | None = None,
) -> tuple[int | None, list[BulkObject]]:
    """The objects a load reads, and the first offset it appends.

    Args:
        topic: the topic whose descriptors these are.
        descriptors: its object descriptors (incomplete ones are ignored), §5.1.
        ranges: its unavailable ranges, §5.5.
        committed: the target table's committed end offset, ``None`` for a new or empty table.
        from_offset: load from this offset on (a first load or a replay that skips history);
            ``None``: from the first retained object, or after ``committed``.

    Returns:
        ``(first offset to append, objects)``; ``(None, [])`` when nothing is pending.

    Raises:
        OffsetRangeError: the objects leave a gap, the first one does not continue the table,
            or ``from_offset`` lies past the committed end offset + 1 (that would skip offsets).
        BulkLoadError: ``from_offset`` is negative.
    """
    if from_offset is not None and from_offset < 0:
        raise BulkLoadError(topic.path, f"from_offset must be >= 0, got {from_offset}")
    completed = sorted((d for d in descriptors if d.completed), key=lambda d: d.start_offset)
    if not completed:
        return None, []
    if (
        committed is not None
        and from_offset is not None
        and from_offset > committed + 1
        and not passable(ranges, committed + 1, from_offset - 1)
    ):
        raise OffsetRangeError(committed + 1, from_offset, f"{topic.path} from_offset")
    start = completed[0].start_offset
    if from_offset is not None:
        start = max(start, from_offset)
    if committed is not None:
        start = max(start, committed + 1)
    chosen = [d for d in completed if d.end_offset >= start]
    if not chosen:
        return None, []
    start = max(start, chosen[0].start_offset)
    if committed is not None and chosen[0].start_offset > committed + 1:
        expired = committed + 1 < completed[0].start_offset
        if not expired and not passable(ranges, committed + 1, chosen[0].start_offset - 1):
            raise OffsetRangeError(committed + 1, chosen[0].start_offset, f"{topic.path}/{chosen[0].object_id}")
    for prev, d in itertools.pairwise(chosen):
        if d.start_offset != prev.end_offset + 1 and not passable(ranges, prev.end_offset + 1, d.start_offset - 1):
            raise OffsetRangeError(prev.end_offset + 1, d.start_offset, f"{topic.path}/{d.object_id}")
    return start, [
        BulkObject(d.object_id, segment_object_path(topic, d.object_id), d.size, d.etag, d.start_offset, d.end_offset)
        for d in chosen
    ]


# --------------------------------------------------------------------------- executors


@dataclass(frozen=True, slots=True)
class _WriterRecipe:
    """What an executor needs to rebuild one bound writer: the registry's text, parsed again
    there (parsed schemas, e.g. protobuf descriptors, do not pickle)."""

    key: tuple[int, int]
    description: str
    error: str | None = None
    schema_type: str | None = None
    raw_schema: str | None = None
    subject: str | None = None
    column_for: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Task:
    """Everything a decode task needs, shipped to the executors with the function."""

    topic: str
    root_url: str
    storage_options: Mapping[str, Any]
    start_offset: int
    schema: Schema | None = None
    recipes: tuple[_WriterRecipe, ...] = ()
    parse: SchemaParser | None = None
    partition: int | None = None
    raw_errors: Mapping[str, str] = field(default_factory=dict)


_OBJECT_FIELDS = ("object_id", "path", "size_bytes", "etag", "start_offset", "end_offset")


def _objects_frame(spark: SparkSession, objects: Sequence[BulkObject]) -> DataFrame:
    """The objects as a DataFrame, one object per slice (up to the default parallelism)."""
    from pyspark.sql import types as T

    schema = T.StructType(
        [
            T.StructField("object_id", T.StringType(), False),
            T.StructField("path", T.StringType(), False),
            T.StructField("size_bytes", T.LongType(), False),
            T.StructField("etag", T.StringType(), True),
            T.StructField("start_offset", T.LongType(), False),
            T.StructField("end_offset", T.LongType(), False),
        ]
    )
    rows = [tuple(getattr(o, name) for name in _OBJECT_FIELDS) for o in objects]
    slices = max(1, min(len(rows), spark.sparkContext.defaultParallelism * 2))
    return spark.createDataFrame(spark.sparkContext.parallelize(rows, slices), schema)


def _objects_of(batches: Iterable[pa.RecordBatch]) -> Iterator[BulkObject]:
    for batch in batches:
        for row in batch.to_pylist():
            yield BulkObject(**{name: row[name] for name in _OBJECT_FIELDS})


def _read_records(task: _Task, store: ObjectStore, obj: BulkObject) -> Sequence[Record]:
    """The object's records from ``task.start_offset`` on, checked against the descriptor.

    Raises:
        CorruptRecordError: size, MD5 or offsets differ from the descriptor, or decoding fails.
        FileNotFoundError: the object is missing.
    """
    data = store.get_bytes(obj.path)
    where = f"{task.topic}/{obj.object_id}"
    if len(data) != obj.size_bytes:
        raise CorruptRecordError(where, len(data), f"object is {len(data)} bytes, descriptor says {obj.size_bytes}")
    if obj.etag and hashlib.md5(data).hexdigest() != obj.etag:
        raise CorruptRecordError(where, 0, f"MD5 does not match the descriptor's etag {obj.etag}")
    records = decode_segment_columns(data, where=where).records
    if not records or records[0].offset != obj.start_offset or records[-1].offset != obj.end_offset:
        raise CorruptRecordError(where, 0, f"offsets differ from the descriptor's {obj.start_offset}-{obj.end_offset}")
    skip = max(0, task.start_offset - obj.start_offset)
    return records[skip:]


def _schema_keys(task: _Task) -> Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """``mapInArrow`` function: each object's distinct ``(schema_id, schema_version)``."""
    out_schema = pa.schema([("object_id", pa.string()), ("schema_id", pa.int64()), ("schema_version", pa.int32())])

    def run(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        store = ObjectStore(task.root_url, storage_options=task.storage_options)
        for obj in _objects_of(batches):
            pairs = schema_keys(_read_records(task, store, obj))
            yield pa.RecordBatch.from_arrays(
                [
                    pa.array([obj.object_id] * len(pairs), pa.string()),
                    pa.array([p[0] for p in pairs], pa.int64()),
                    pa.array([p[1] for p in pairs], pa.int32()),
                ],
                schema=out_schema,
            )

    return run


def _bound_writers(task: _Task) -> dict[tuple[int, int], BoundWriter]:
    """The recipes' writers, parsed here (on the executor)."""
    parse = task.parse or default_schema_parser()
    bound: dict[tuple[int, int], BoundWriter] = {}
    for r in task.recipes:
        if r.error is not None or r.schema_type is None or r.raw_schema is None:
            bound[r.key] = BoundWriter(r.description, error=r.error)
            continue
        parsed = parse(r.schema_type, r.raw_schema, subject=r.subject or "?")
        bound[r.key] = BoundWriter(r.description, writer=iceberg.writer_for_parsed(parsed), column_for=r.column_for)
    return bound


def _output_schema(table_schema: pa.Schema) -> pa.Schema:
    """The decode job's Arrow output: the table's columns, all nullable (a dead letter has no
    payload columns), then the dead letter's payload and ``_error`` (null for a row)."""
    fields = [f.with_nullable(True) for f in table_schema]
    return pa.schema([*fields, pa.field(_PAYLOAD_FIELD, pa.binary()), pa.field(_ERROR_FIELD, pa.string())])


def _decode_rows(task: _Task) -> Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """``mapInArrow`` function: each object's rows (via :func:`table_rows`) and dead letters."""
    assert task.schema is not None
    table_schema = schema_to_pyarrow(task.schema, include_field_ids=False)
    out_schema = _output_schema(table_schema)

    def run(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        assert task.schema is not None
        store = ObjectStore(task.root_url, storage_options=task.storage_options)
        bound = _bound_writers(task)
        for obj in _objects_of(batches):
            records = _read_records(task, store, obj)
            raw_error = task.raw_errors.get(obj.object_id)
            decoded = table_rows(records, task.schema, bound, partition=task.partition, raw_error=raw_error)
            rows = decoded.rows
            arrays = [rows.column(f.name) for f in table_schema]
            arrays += [pa.nulls(rows.num_rows, pa.binary()), pa.nulls(rows.num_rows, pa.string())]
            yield from pa.Table.from_arrays(arrays, schema=out_schema).to_batches()
            if decoded.dead_letters:
                yield from _dead_letter_table(decoded.dead_letters, out_schema, task.partition).to_batches()

    return run


def _dead_letter_table(letters: Sequence[DeadLetter], out_schema: pa.Schema, partition: int | None) -> pa.Table:
    """Dead letters in the decode job's output schema: the metadata columns, the payload and
    ``_error``; the table's payload columns null."""
    records = [d.record for d in letters]
    data: dict[str, Any] = {
        "_offset": [r.offset for r in records],
        "_publish_time": pa.array([r.publish_time_us for r in records], pa.int64()).cast(pa.timestamp("us")),
        # a u64 producer id is stored as the int64 with the same bits (the table's rule)
        "_producer_id": [r.producer_id - (1 << 64) if r.producer_id >= 1 << 63 else r.producer_id for r in records],
        "_producer_name": [r.producer_name for r in records],
        "_schema_id": [r.schema_id for r in records],
        "_schema_version": [r.schema_version for r in records],
        "_attributes": [list(r.attributes.items()) for r in records],
        _PAYLOAD_FIELD: [r.payload for r in records],
        _ERROR_FIELD: [d.error for d in letters],
    }
    if partition is not None:
        data[PARTITION_COLUMN] = [partition] * len(records)
    data["_publish_time"] = data["_publish_time"].cast(out_schema.field("_publish_time").type)
    return assemble(out_schema, data, len(records))


# --------------------------------------------------------------------------- driver


def _spark_schema(arrow_schema: pa.Schema) -> StructType:
    """Spark's type for an Arrow schema (the decode job's declared output)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(arrow_schema)


async def _recipes_for(
    keys: Sequence[tuple[int, int]], registry: SchemaLookup, parse: SchemaParser
) -> dict[tuple[int, int], tuple[iceberg.RegisteredWriter, _WriterRecipe]]:
    """Each pair's registry answer, parsed (as tiering's ``_writer_for``), with its recipe.

    An id the registry lacks or a schema that does not parse is not an error: its records are
    dead-lettered (``unknown schema`` / ``unreadable schema``).
    """
    out: dict[tuple[int, int], tuple[iceberg.RegisteredWriter, _WriterRecipe]] = {}
    for key in keys:
        schema_id, version = key
        try:
            registered = await registry.get_by_id(schema_id, version=version or None)
        except SchemaNotFoundError as exc:
            w = iceberg.RegisteredWriter(
                schema_id, version,
                error=f"{iceberg.DeadLetterReason.UNKNOWN_SCHEMA}: schema id {schema_id} version {version} "
                f"is not in the registry ({exc})",
            )
            out[key] = (w, _WriterRecipe(key, w.description, error=w.error))
            continue
        schema_type = getattr(registered, "schema_type", iceberg.writer.AVRO)
        subject = getattr(registered, "subject", None)
        raw = registered.raw_schema if isinstance(registered.raw_schema, str) else str(registered.raw_schema)
        try:
            parsed = await asyncio.to_thread(parse, schema_type, raw, subject=subject or "?")
            writer = iceberg.writer_for_parsed(parsed)
        except _PARSE_ERRORS as exc:
            w = iceberg.RegisteredWriter(
                schema_id, version, subject, schema_type,
                error=f"{iceberg.DeadLetterReason.UNREADABLE_SCHEMA}: schema id {schema_id} version {version} "
                f"({schema_type}): {exc}",
            )
            out[key] = (w, _WriterRecipe(key, w.description, error=w.error))
            continue
        w = iceberg.RegisteredWriter(schema_id, version, subject, schema_type, writer)
        out[key] = (w, _WriterRecipe(key, w.description, schema_type=schema_type, raw_schema=raw, subject=subject))
    return out


def _schema_properties(w: iceberg.RegisteredWriter) -> dict[str, str]:
    properties = {iceberg.SCHEMA_ID_PROPERTY: str(w.schema_id), iceberg.SCHEMA_VERSION_PROPERTY: str(w.version)}
    if w.subject:
        properties[iceberg.SCHEMA_SUBJECT_PROPERTY] = w.subject
    return properties


def _column_map(w: iceberg.RegisteredWriter, recorded: iceberg.RegisteredWriter | None) -> dict[str, str]:
    if w.writer is None or recorded is None or recorded.writer is None or recorded.schema_id != w.schema_id:
        return {}
    if recorded.version <= w.version:
        return {}
    return renamed_columns(w.writer, recorded.writer)


def _renamed(columns: Sequence[PayloadColumn], names: Mapping[str, str]) -> list[PayloadColumn]:
    return [PayloadColumn(names.get(c.name, c.name), c.iceberg_type, c.required, c.convert, c.doc) for c in columns]


@dataclass
class _Prepared:
    table: Table
    created: bool
    recipes: tuple[_WriterRecipe, ...]
    recorded: iceberg.RegisteredWriter | None
    changes: list[str]


def _raw_error(recorded: iceberg.RegisteredWriter | None) -> str:
    """The ``_error`` of a record without a schema on a table following ``recorded``
    (:func:`danube_pipeline.lake.iceberg.commit_object`'s text)."""
    return f"{iceberg.DeadLetterReason.RAW_MESSAGE} on a topic with " + (
        f"schema id {recorded.schema_id} (subject {recorded.subject}, version {recorded.version})"
        if recorded is not None
        else "a schema"
    )


def _raw_errors(
    keys_by_object: Mapping[str, Sequence[tuple[int, int]]],
    order: Sequence[str],
    writers: Mapping[tuple[int, int], tuple[iceberg.RegisteredWriter, _WriterRecipe]],
    bound: Mapping[tuple[int, int], _WriterRecipe],
    recorded: iceberg.RegisteredWriter | None,
) -> dict[str, str]:
    """Each object's raw-message ``_error``, naming the schema the table followed once tiering
    had evolved it for that object (so both paths write the same dead letters)."""
    out: dict[str, str] = {}
    for object_id in order:
        for key in sorted(keys_by_object.get(object_id, ())):
            w = writers[key][0]
            ok = w.writer is not None and bound.get(key) is not None and bound[key].error is None
            if ok and (recorded is None or (w.schema_id == recorded.schema_id and w.version > recorded.version)):
                recorded = w
        out[object_id] = _raw_error(recorded)
    return out


def _prepare_table(
    catalog: Catalog,
    table_topic: TopicName,
    table: Table | None,
    writers: Mapping[tuple[int, int], tuple[iceberg.RegisteredWriter, _WriterRecipe]],
    recorded: iceberg.RegisteredWriter | None,
    *,
    partitioned: bool,
    layout: TableLayout,
    where: str,
) -> _Prepared:
    """Create or evolve the table for ``writers`` and bind each one to it: steps 1 and 3 of
    :mod:`danube_pipeline.lake.iceberg.commit`, for every writer of the load at once."""
    keys = sorted(writers)
    usable = [writers[k][0] for k in keys if writers[k][0].writer is not None]
    created = False
    if table is None:
        first = usable[0] if usable else None
        if first is not None and first.writer is not None:
            schema = schema_from_columns(list(first.writer.columns), partitioned=partitioned)
            properties = _schema_properties(first)
        else:
            schema = schema_from_columns([] if keys else None, partitioned=partitioned)
            properties = None
        table = iceberg.ensure_table_for_schema(catalog, table_topic, schema, properties=properties, layout=layout)
        created = True
    payload_table = PAYLOAD_COLUMN in {f.name for f in table.schema().fields}
    ids = iceberg.recorded_schema(table)
    if recorded is None and ids is not None and ids in writers:
        recorded = writers[ids][0]
    changes: list[str] = []
    recipes: dict[tuple[int, int], _WriterRecipe] = {}
    if not payload_table:
        for key in keys:
            w, recipe = writers[key]
            if w.writer is None:
                recipes[key] = recipe
                continue
            newer = recorded is None or (w.schema_id == recorded.schema_id and w.version > recorded.version)
            if newer and recorded is not None and recorded.writer is not None and recorded.schema_id == w.schema_id:
                table_renames = renamed_columns(recorded.writer, w.writer)
            elif newer:
                old = [f.name for f in table.schema().fields if f.name not in RESERVED_COLUMNS]
                table_renames = renamed_columns(None, w.writer, old_names=old)
            else:
                table_renames = {}
            wanted = schema_from_columns(_renamed(w.writer.columns, _column_map(w, recorded)), partitioned=partitioned)
            try:
                made = iceberg.evolve_table(
                    table, wanted, renames=table_renames, properties=_schema_properties(w) if newer else None
                )
            except SchemaEvolutionError as exc:
                error = f"{iceberg.DeadLetterReason.NEEDS_SCHEMA_REWRITE}: {w.description}: {'; '.join(exc.changes)}"
                log.warning("%s: %s", where, error)
                recipes[key] = _WriterRecipe(key, w.description, error=error)
                continue
            changes += [str(c) for c in made]
            if newer:
                recorded = w
            recipes[key] = recipe
        for key, recipe in list(recipes.items()):
            w = writers[key][0]
            if recipe.error is None:
                recipes[key] = _WriterRecipe(
                    key, recipe.description, None, recipe.schema_type, recipe.raw_schema, recipe.subject,
                    _column_map(w, recorded),
                )
    return _Prepared(catalog.load_table(table.name()), created, tuple(recipes.values()), recorded, changes)


def _collect_dead_letters(decoded: DataFrame) -> list[DeadLetter]:
    """The decode job's dead-letter rows, collected on the driver as :class:`DeadLetter`, in
    offset order (``_publish_time`` read back as µs since the epoch)."""
    from pyspark.sql import functions as F

    rows = (
        decoded.filter(F.col(_ERROR_FIELD).isNotNull())
        .select(
            "_offset", F.unix_micros("_publish_time").alias("publish_time_us"), "_producer_id", "_producer_name",
            "_schema_id", "_schema_version", "_attributes", _PAYLOAD_FIELD, _ERROR_FIELD,
        )
        .collect()
    )
    letters = [
        DeadLetter(
            Record(
                offset=int(r["_offset"]),
                publish_time_us=int(r["publish_time_us"] or 0),
                producer_id=int(r["_producer_id"] or 0) & 0xFFFF_FFFF_FFFF_FFFF,
                producer_name=r["_producer_name"] or "",
                schema_id=int(r["_schema_id"] or 0),
                schema_version=int(r["_schema_version"] or 0),
                payload=bytes(r[_PAYLOAD_FIELD] or b""),
                attributes=dict(r["_attributes"] or {}),
            ),
            str(r[_ERROR_FIELD]),
        )
        for r in rows
    ]
    letters.sort(key=lambda d: d.record.offset)
    return letters


def _ensure_wap(table: Table) -> Table:
    """Turn on write-audit-publish staging (``write.wap.enabled``) once per table."""
    if table.properties.get(WAP_ENABLED_PROPERTY) == "true":
        return table
    for _ in range(5):
        try:
            table.transaction().set_properties({WAP_ENABLED_PROPERTY: "true"}).commit_transaction()
            break
        except CommitFailedException:
            table.refresh()
    table.refresh()
    return table


def _publish(table: Table, wap_id: str, base: int | None, end: int, partition: int | None) -> int:
    """Make the staged snapshot ``wap_id`` the table's current one and set the committed end
    offset, in one commit that requires ``main`` to still be ``base``.

    Returns:
        The published snapshot's id.

    Raises:
        CommitFailedException: ``main`` moved since the load started.
        BulkLoadError: the staged snapshot is missing.
    """
    table.refresh()
    staged = [s for s in table.snapshots() if s.summary is not None and s.summary[_WAP_ID_SUMMARY] == wap_id]
    if len(staged) != 1:
        raise BulkLoadError(".".join(table.name()), f"{len(staged)} staged snapshots carry wap.id {wap_id}")
    snapshot = staged[0]
    current = table.current_snapshot()
    head = current.snapshot_id if current is not None else None
    if head != base or snapshot.parent_snapshot_id != base:
        raise CommitFailedException(f"main is at {head}, the staged snapshot's parent is {snapshot.parent_snapshot_id}")
    handle = _without_commit_retries(table)
    with handle.transaction() as tx:
        tx.set_properties({iceberg.committed_end_offset_property(partition): str(end)})
        ManageSnapshots(tx).set_current_snapshot(snapshot_id=snapshot.snapshot_id)
    table.refresh()
    return snapshot.snapshot_id


def _table_topic(source: TopicName, target: str | None) -> TopicName:
    if not target:
        return source
    if target.startswith("/"):
        return TopicName.parse(target)
    return TopicName(source.namespace, validate_part("topic", target))


async def bulk_load(
    spark: SparkSession,
    catalog: Catalog,
    topic: TopicName,
    *,
    store: MetadataStore,
    objects: ObjectStore,
    registry: SchemaLookup,
    target: str | None = None,
    from_offset: int | None = None,
    replay: bool = False,
    catalog_name: str | None = None,
    parse_schema: SchemaParser | None = None,
    max_attempts: int = 3,
) -> BulkLoadReport:
    """Load ``topic``'s segment objects into its table (or ``target``) with Spark, exactly once
    (module docstring).

    Args:
        spark: a session from :func:`danube_pipeline.lake.spark.build_spark_session` on ``catalog``'s
            database (any master: ``local[*]`` or a standalone cluster whose workers reach the
            object store).
        catalog: the same catalog, through pyiceberg.
        topic: the topic whose objects to read (for a partition ``{t}-part-{i}``, its rows get
            ``_partition = i`` and the table is ``t``'s, as in tiering).
        store: the connected metadata store (descriptors, §5.1; unavailable ranges, §5.5;
            table layout, §3.9).
        objects: the object store holding the segment objects. Its URL and storage options
            are shipped to the Spark tasks, which open it themselves.
        registry: the schema registry (``SchemaRegistry.get_by_id``).
        target: the table to write: a name in the topic's namespace (``flights_v2``) or
            ``/ns/name``; default the topic's own table. A new table is created with the topic's
            layout (§3.9).
        from_offset: first offset to load; default the first retained object's start. Offsets
            at or below the target's committed end offset are never loaded again.
        replay: a replay into a table other than the topic's own (``target`` must name one):
            every retained object from ``from_offset`` on is read again.
        catalog_name: the Spark catalog name of ``catalog``; default ``settings.catalog_name()``.
        parse_schema: parses a registered schema's text; default
            :func:`danube_pipeline.lake.tiering.default_schema_parser`. Spark tasks call it too, so
            it must pickle (a module-level function).
        max_attempts: plans run when tiering commits to the table meanwhile.

    Returns:
        A :class:`BulkLoadReport`.

    Raises:
        BulkLoadError: ``replay`` without a ``target`` other than the topic's table, or a bad
            ``from_offset``.
        BulkLoadConflictError: another writer kept committing to the table (every attempt).
        OffsetRangeError: the objects leave a gap, or do not continue the table.
        CorruptRecordError: an object does not match its descriptor or fails decoding (raised
            by a Spark task: it reaches the caller inside a ``PythonException``).
        MetadataStoreError: etcd failed.
        InvalidNameError: ``target`` is not a valid name, or a table named like the dead-letter
            table exists and is not one.
    """
    part = await partition_of(store, topic)
    source_table = part.parent if part is not None else topic
    partition = part.index if part is not None else None
    table_topic = _table_topic(source_table, target)
    if replay and table_topic == source_table:
        raise BulkLoadError(topic.path, "replay needs a target table other than the topic's own")
    descriptors, _ = await read_descriptors(store, topic)
    ranges = await read_unavailable_ranges(store, topic)
    layout = await read_table_layout(store, source_table)
    parse = parse_schema or default_schema_parser()
    ident = iceberg.table_identifier(table_topic)
    name = spark_table_name(table_topic, catalog_name)
    report = BulkLoadReport(topic=topic.path, table=".".join(ident), partition=partition)

    for attempt in range(1, max_attempts + 1):
        report.attempts = attempt
        table = catalog.load_table(ident) if catalog.table_exists(ident) else None
        if table is not None:
            if attempt == 1:
                report.data_files_before = iceberg.data_file_count(table)
            apply_layout(table, layout)
            table = catalog.load_table(ident)
        committed = iceberg.committed_end_offset(table, partition=partition) if table is not None else None
        if attempt == 1:
            report.committed_end_offset_before = committed
        start, chosen = plan_objects(topic, descriptors, ranges, committed=committed, from_offset=from_offset)
        if start is None or not chosen:
            report.committed_end_offset = committed
            break
        task = _Task(topic.path, objects.root_url, objects.storage_options, start, partition=partition)
        frame = _objects_frame(spark, chosen)
        keys_job = frame.mapInArrow(_schema_keys(task), "object_id string, schema_id long, schema_version int")
        key_rows = await asyncio.to_thread(keys_job.collect)
        keys_by_object: dict[str, list[tuple[int, int]]] = {}
        for r in key_rows:
            if int(r["schema_id"]) != 0:
                keys_by_object.setdefault(str(r["object_id"]), []).append((int(r["schema_id"]), int(r["schema_version"])))
        keys = sorted({k for ks in keys_by_object.values() for k in ks})
        payload_table = table is not None and PAYLOAD_COLUMN in {f.name for f in table.schema().fields}
        writers = {} if payload_table else await _recipes_for(keys, registry, parse)
        recorded = None
        ids = iceberg.recorded_schema(table) if table is not None and not payload_table else None
        if ids is not None and ids not in writers:
            recorded = (await _recipes_for([ids], registry, parse))[ids][0]
        elif ids is not None:
            recorded = writers[ids][0]
        prepared = _prepare_table(
            catalog, table_topic, table, writers, recorded,
            partitioned=partition is not None, layout=layout, where=f"{topic.path} bulk load",
        )
        report.created = report.created or prepared.created
        report.schema_changes += prepared.changes
        table = _ensure_wap(prepared.table)
        if iceberg.committed_end_offset(table, partition=partition) != committed:
            continue  # tiering committed while the table was prepared: plan again
        task = _Task(
            topic.path, objects.root_url, objects.storage_options, start, table.schema(), prepared.recipes,
            parse_schema, partition,
            _raw_errors(
                keys_by_object, [o.object_id for o in chosen], writers,
                {r.key: r for r in prepared.recipes}, recorded,
            ),
        )
        current = table.current_snapshot()
        base = current.snapshot_id if current is not None else None
        try:
            outcome = await asyncio.to_thread(
                _load, spark, catalog, table, table_topic, frame, task, chosen, name, base, partition
            )
        except CommitFailedException as exc:
            log.warning("%s: bulk load lost the commit race (attempt %d): %s", topic.path, attempt, exc)
            continue
        report.objects_read += len(chosen)
        report.bytes_read += sum(o.size_bytes for o in chosen)
        report.rows_appended = outcome.rows
        report.dead_letter_records = outcome.dead_letters
        if outcome.dead_letters:
            report.dead_letter_table = ".".join(iceberg.dead_letter_identifier(table_topic))
        report.first_offset, report.last_offset = start, chosen[-1].end_offset
        report.snapshot_id = outcome.snapshot_id
        break
    else:
        raise BulkLoadConflictError(topic.path, f"another writer committed to {report.table} during {max_attempts} attempts")

    if catalog.table_exists(ident):
        final = catalog.load_table(ident)
        report.committed_end_offset = iceberg.committed_end_offset(final, partition=partition)
        report.data_files_after = iceberg.data_file_count(final)
        report.row_count = iceberg.snapshot_row_count(final)
    return report


@dataclass(frozen=True, slots=True)
class _Outcome:
    snapshot_id: int
    rows: int
    dead_letters: int


def _load(
    spark: SparkSession,
    catalog: Catalog,
    table: Table,
    table_topic: TopicName,
    frame: DataFrame,
    task: _Task,
    chosen: Sequence[BulkObject],
    name: str,
    base: int | None,
    partition: int | None,
) -> _Outcome:
    """Decode, dead-letter, stage and publish (steps 3 to 5 of the module docstring).

    Raises:
        CommitFailedException: ``main`` moved meanwhile (nothing published).
    """
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    assert task.schema is not None
    out_schema = _output_schema(schema_to_pyarrow(task.schema, include_field_ids=False))
    decoded = frame.mapInArrow(_decode_rows(task), _spark_schema(out_schema)).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        start, end = task.start_offset, chosen[-1].end_offset
        object_id = chosen[0].object_id if len(chosen) == 1 else f"{chosen[0].object_id}..{chosen[-1].object_id}"
        letters = _collect_dead_letters(decoded)
        dead: frozenset[int] = frozenset()
        appended_letters = 0
        if letters:
            dlq = iceberg.ensure_dead_letter_table(catalog, table_topic, partitioned=partition is not None)
            result = iceberg.append_dead_letters(
                dlq, letters, object_id, topic=task.topic, start_offset=start, end_offset=end, partition=partition
            )
            dead, appended_letters = result.offsets, result.rows_appended
        else:
            existing = iceberg.load_dead_letter_table(catalog, table_topic)
            dlq_committed = iceberg.committed_end_offset(existing, partition=partition) if existing is not None else None
            if existing is not None and dlq_committed is not None and dlq_committed >= start:
                # an earlier try of this range dead-lettered records that now decode: they stay there
                dead = frozenset(iceberg.dead_letter_offsets(existing, partition=partition, start_offset=start, end_offset=end))
        rows = decoded.filter(F.col(_ERROR_FIELD).isNull()).drop(_ERROR_FIELD, _PAYLOAD_FIELD)
        if dead:
            rows = rows.filter(~F.col("_offset").isin(sorted(dead)))
        summary = {
            iceberg.SUMMARY_TOPIC: task.topic,
            iceberg.SUMMARY_START_OFFSET: str(start),
            iceberg.SUMMARY_END_OFFSET: str(end),
            iceberg.SUMMARY_OBJECT_ID: object_id,
            iceberg.SUMMARY_DEAD_LETTER_RECORDS: str(len(dead)),
            SUMMARY_ENGINE: "spark",
        }
        if partition is not None:
            summary[iceberg.SUMMARY_PARTITION] = str(partition)
        writer = rows.writeTo(name).option("check-nullability", "false")
        for key, value in summary.items():
            writer = writer.option(f"snapshot-property.{key}", value)
        wap_id = f"danube-bulk-{uuid.uuid4().hex}"
        spark.conf.set(_WAP_ID_CONF, wap_id)
        try:
            writer.append()
        finally:
            spark.conf.unset(_WAP_ID_CONF)
        snapshot_id = _publish(table, wap_id, base, end, partition)
        snapshot = table.snapshot_by_id(snapshot_id)
        added = snapshot.summary["added-records"] if snapshot is not None and snapshot.summary is not None else None
        log.info("%s: bulk load of offsets %d-%d published as snapshot %d", task.topic, start, end, snapshot_id)
        return _Outcome(snapshot_id, int(added or 0), appended_letters)
    finally:
        decoded.unpersist()
