"""The Spark side of a bulk load: what its ``mapInArrow`` tasks run on the executors.

Steps 2 and 3 of :mod:`danube_pipeline.lake.bulk`: a task reads each of its objects from the
object store (:class:`~danube_pipeline.storage.objectstore.ObjectStore`), checks it against its
descriptor (:func:`~danube_pipeline.lake.segment_objects.read_segment_object`, then the
offsets) and either lists its ``(schema_id, schema_version)`` pairs (:func:`schema_keys_job`)
or turns its records into the table's Arrow rows with the incremental path's own
:func:`~danube_pipeline.lake.iceberg.rows.table_rows` (:func:`decode_rows_job`). Records that
cannot be rows come out of the same job as dead letters, marked by :data:`ERROR_FIELD`.
Everything a task needs travels in a :class:`DecodeTask`, which pickles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.schema import Schema

from danube_pipeline.errors import CorruptRecordError
from danube_pipeline.format.records import Record
from danube_pipeline.lake import iceberg
from danube_pipeline.lake.bulk.plan import BulkObject
from danube_pipeline.lake.iceberg.arrow import assemble
from danube_pipeline.lake.iceberg.dead_letter import DeadLetter
from danube_pipeline.lake.iceberg.rows import BoundWriter, table_rows
from danube_pipeline.lake.iceberg.schema import PARTITION_COLUMN
from danube_pipeline.lake.schema_lookup import SchemaParser, default_schema_parser
from danube_pipeline.lake.segment_columns import schema_keys
from danube_pipeline.lake.segment_objects import read_segment_object
from danube_pipeline.storage.objectstore import ObjectStore
from danube_pipeline.storage.table_columns import KEY_COLUMN, KEY_VALUE_FIELD

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

__all__ = [
    "ERROR_FIELD",
    "PAYLOAD_FIELD",
    "DecodeTask",
    "WriterRecipe",
    "decode_rows_job",
    "objects_frame",
    "output_schema",
    "schema_keys_job",
    "spark_schema",
]

ERROR_FIELD = "__danube_dead_letter_error"
"""Column of the decode job's output: a dead letter's ``_error``, null for a row."""
PAYLOAD_FIELD = "__danube_dead_letter_payload"
"""Column of the decode job's output: a dead letter's payload, null for a row."""


@dataclass(frozen=True, slots=True)
class WriterRecipe:
    """What an executor needs to rebuild one bound writer: the registry's text, parsed again
    there (parsed schemas, e.g. protobuf descriptors, do not pickle).

    Attributes:
        key: the ``(schema_id, schema_version)`` it binds.
        description: ``"schema id 3 version 2 (Avro)"``, as errors name it.
        error: the ``_error`` of its records when they cannot be rows, else ``None``.
        schema_type: ``"Avro"``, ``"JsonSchema"`` or ``"Protobuf"``, for a usable writer.
        raw_schema: the registered schema text, for a usable writer.
        subject: the registry subject, when known.
        column_for: ``{writer name: table name}`` of its renamed fields.
    """

    key: tuple[int, int]
    description: str
    error: str | None = None
    schema_type: str | None = None
    raw_schema: str | None = None
    subject: str | None = None
    column_for: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DecodeTask:
    """Everything a decode task needs, shipped to the executors with the function.

    Attributes:
        topic: ``/ns/topic`` whose objects are read (the partition's name, for a partition).
        root_url: the object store's URL.
        storage_options: the object store's options (credentials, endpoint).
        start_offset: the first offset loaded (records below it are skipped).
        schema: the table's schema, for the decode job.
        recipes: the writers to bind, for the decode job.
        parse: parses a registered schema's text; ``None``: the default parser.
        partition: the partition index, for a partition of a partitioned topic.
        raw_errors: per object id, the ``_error`` of its records without a schema.
        raw_payload: the layout's ``raw_payload`` (``docs/etcd-layout.md`` §3.9): rows carry
            their exact payload bytes in ``_raw_payload``, as tiering's do.
    """

    topic: str
    root_url: str
    storage_options: Mapping[str, Any]
    start_offset: int
    schema: Schema | None = None
    recipes: tuple[WriterRecipe, ...] = ()
    parse: SchemaParser | None = None
    partition: int | None = None
    raw_errors: Mapping[str, str] = field(default_factory=dict)
    raw_payload: bool = False


_OBJECT_FIELDS = ("object_id", "path", "size_bytes", "etag", "start_offset", "end_offset")


def objects_frame(spark: SparkSession, objects: Sequence[BulkObject]) -> DataFrame:
    """The objects as a DataFrame, one object per slice (up to the default parallelism).

    Args:
        spark: the session.
        objects: the objects the load reads, in offset order.

    Returns:
        A DataFrame of the :class:`~danube_pipeline.lake.bulk.plan.BulkObject` fields, the
        input of :func:`schema_keys_job` and :func:`decode_rows_job`.
    """
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


def _read_records(task: DecodeTask, store: ObjectStore, obj: BulkObject) -> Sequence[Record]:
    """The object's records from ``task.start_offset`` on, checked against the descriptor.

    Raises:
        CorruptRecordError: size, MD5 or offsets differ from the descriptor, or decoding fails.
        FileNotFoundError: the object is missing.
    """
    where = f"{task.topic}/{obj.object_id}"
    records = read_segment_object(store, obj.path, size_bytes=obj.size_bytes, etag=obj.etag, where=where).records
    if not records or records[0].offset != obj.start_offset or records[-1].offset != obj.end_offset:
        raise CorruptRecordError(where, 0, f"offsets differ from the descriptor's {obj.start_offset}-{obj.end_offset}")
    skip = max(0, task.start_offset - obj.start_offset)
    return records[skip:]


def schema_keys_job(task: DecodeTask) -> Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """``mapInArrow`` function: each object's distinct ``(schema_id, schema_version)``.

    Args:
        task: the load's task (``schema`` and ``recipes`` not needed).

    Returns:
        The function, yielding ``object_id string, schema_id long, schema_version int`` rows.
        It raises ``CorruptRecordError`` (inside Spark's ``PythonException``) for an object that
        does not match its descriptor.
    """
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


def _bound_writers(task: DecodeTask) -> dict[tuple[int, int], BoundWriter]:
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


def output_schema(table_schema: pa.Schema) -> pa.Schema:
    """The decode job's Arrow output: the table's columns, all nullable (a dead letter has no
    payload columns), then the dead letter's payload and ``_error`` (null for a row).

    Args:
        table_schema: the table's Arrow schema (without field ids).

    Returns:
        The schema, ending in :data:`PAYLOAD_FIELD` and :data:`ERROR_FIELD`.
    """
    fields = [f.with_nullable(True) for f in table_schema]
    return pa.schema([*fields, pa.field(PAYLOAD_FIELD, pa.binary()), pa.field(ERROR_FIELD, pa.string())])


def decode_rows_job(task: DecodeTask) -> Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """``mapInArrow`` function: each object's rows (via
    :func:`~danube_pipeline.lake.iceberg.rows.table_rows`) and dead letters.

    Args:
        task: the load's task, with the table's ``schema`` and the writers' ``recipes``.

    Returns:
        The function, yielding batches in :func:`output_schema`: rows with a null
        :data:`ERROR_FIELD`, then the object's dead letters. It raises ``CorruptRecordError``
        (inside Spark's ``PythonException``) for an object that does not match its descriptor.
    """
    assert task.schema is not None
    table_schema = schema_to_pyarrow(task.schema, include_field_ids=False)
    out_schema = output_schema(table_schema)

    def run(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        assert task.schema is not None
        store = ObjectStore(task.root_url, storage_options=task.storage_options)
        bound = _bound_writers(task)
        for obj in _objects_of(batches):
            records = _read_records(task, store, obj)
            raw_error = task.raw_errors.get(obj.object_id)
            decoded = table_rows(
                records, task.schema, bound, partition=task.partition, raw_error=raw_error,
                raw_payload=task.raw_payload,
            )
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
        PAYLOAD_FIELD: [r.payload for r in records],
        ERROR_FIELD: [d.error for d in letters],
    }
    if partition is not None:
        data[PARTITION_COLUMN] = [partition] * len(records)
    if KEY_COLUMN in out_schema.names:  # the table has _key (raw_payload): the letters carry theirs
        data[KEY_COLUMN] = [{KEY_VALUE_FIELD: r.key} for r in records]
    data["_publish_time"] = data["_publish_time"].cast(out_schema.field("_publish_time").type)
    return assemble(out_schema, data, len(records))


def spark_schema(arrow_schema: pa.Schema) -> StructType:
    """Spark's type for an Arrow schema (the decode job's declared output).

    Args:
        arrow_schema: e.g. :func:`output_schema`'s.

    Returns:
        The Spark ``StructType``.
    """
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(arrow_schema)
