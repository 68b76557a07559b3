"""Appending an Arrow table to a transaction, without a copy when every row is in one partition.

pyiceberg's ``Transaction.append`` splits a table into partitions by filtering it once per
distinct partition value (``pyiceberg.io.pyarrow._determine_partitions``), which copies every
row even when they all share one value. A segment object's rows usually do: a tiered object
covers seconds to minutes of publish time, and tables are partitioned by
``day(_publish_time)`` (:mod:`.layout`). :func:`append_table` does what
``Transaction.append`` does (schema check, fast or merge append by the table's
``commit.manifest-merge.enabled``, data files bin-packed by ``write.target-file-size-bytes``),
but when the partition transform gives one value for every row it writes the table as it is,
with that value as the partition key, and otherwise leaves the split to pyiceberg.

The data files it writes itself carry what pyiceberg's would: the same file schema with field
ids, partition values (Iceberg spec, "Partition Transforms"), location and column statistics,
through pyiceberg's own Parquet writer and statistics; only ``_offset``, ``_publish_time`` and
``_raw_payload`` are written without a dictionary (:class:`_ParquetWriter`), which makes a tiered object's files
smaller and their writing faster.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.io import FileIO, OutputFile
from pyiceberg.io.fileformat import DataFileStatistics, FileFormatFactory
from pyiceberg.io.pyarrow import (
    ParquetFormatWriter,
    StatisticsCollector,
    _check_pyarrow_schema_compatible,
    _dataframe_to_data_files,
    _to_requested_schema,
    bin_pack_arrow_table,
    compute_statistics_plan,
    data_file_statistics_from_parquet_metadata,
    parquet_path_to_id_mapping,
    pyarrow_to_schema,
    schema_to_pyarrow,
    write_file,
)
from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
from pyiceberg.partitioning import PartitionFieldValue, PartitionKey
from pyiceberg.schema import Schema, sanitize_column_names
from pyiceberg.table import DOWNCAST_NS_TIMESTAMP_TO_US_ON_WRITE, Table, TableProperties, Transaction, WriteTask
from pyiceberg.table.locations import load_location_provider
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.transforms import IdentityTransform, TimeTransform
from pyiceberg.typedef import Properties, Record
from pyiceberg.utils.config import Config
from pyiceberg.utils.properties import property_as_bool, property_as_int

from danube_pipeline.storage.table_columns import RAW_PAYLOAD_COLUMN

__all__ = [
    "PLAIN_COLUMNS",
    "MetadataCachingTransaction",
    "append_table",
    "data_files",
    "single_partition_key",
    "write_parquet_files",
]


class MetadataCachingTransaction(Transaction):
    """A pyiceberg ``Transaction`` whose ``table_metadata`` is computed once per state.

    pyiceberg 0.12 recomputes ``Transaction.table_metadata`` on every read: it replays the
    staged updates onto the table's metadata and deep-copies the result, snapshot list
    included, and one append reads it about twenty times. That is about a third of a small
    commit's time, growing with the table's history (apache/iceberg-python issue #2673; the
    cache below is the one proposed upstream in pull request #3784, not in a release yet).

    The result is kept while the two inputs are the same objects: the table's metadata, which
    a commit or refresh replaces, and the tuple of staged updates, which staging rebinds. The
    only difference seen by callers: ``last_updated_ms`` of the metadata read inside the
    transaction no longer changes between reads of the same state; the committed metadata's
    timestamp is set by the commit as before.

    Args:
        table: the table to change.
    """

    def __init__(self, table: Table) -> None:
        super().__init__(table)
        self._cached: tuple[object, object, TableMetadata] | None = None

    @property
    def table_metadata(self) -> TableMetadata:
        base, updates = self._table.metadata, self._updates
        cached = self._cached
        if cached is not None and cached[0] is base and cached[1] is updates:
            return cached[2]
        metadata = super().table_metadata
        self._cached = (base, updates, metadata)
        return metadata


def append_table(transaction: Transaction, df: pa.Table, io: FileIO, snapshot_properties: dict[str, str]) -> None:
    """Append ``df`` to ``transaction`` as one snapshot with ``snapshot_properties`` in its
    summary (module docstring).

    Args:
        transaction: an open transaction on the table.
        df: rows of the table's schema (pyiceberg's ``schema_to_pyarrow``).
        io: the table's file IO.
        snapshot_properties: extra snapshot summary fields.

    Raises:
        ValueError: ``df``'s schema does not fit the table's (pyiceberg's check).
    """
    metadata = transaction.table_metadata
    if not df.schema.equals(write_plan(metadata).arrow_schema):
        # pyiceberg's own conversion of the table's schema fits by construction; anything else
        # is checked as pyiceberg checks it
        _check_pyarrow_schema_compatible(
            metadata.schema(),
            provided_schema=df.schema,
            downcast_ns_timestamp_to_us=Config().get_bool(DOWNCAST_NS_TIMESTAMP_TO_US_ON_WRITE) or False,
            format_version=metadata.format_version,
        )
    update = transaction.update_snapshot(snapshot_properties=snapshot_properties)
    merge = property_as_bool(
        metadata.properties, TableProperties.MANIFEST_MERGE_ENABLED, TableProperties.MANIFEST_MERGE_ENABLED_DEFAULT
    )
    with update.merge_append() if merge else update.fast_append() as append_files:
        if df.num_rows:
            for data_file in data_files(transaction.table_metadata, df, io, append_files.commit_uuid):
                append_files.append_data_file(data_file)


def data_files(metadata: TableMetadata, df: pa.Table, io: FileIO, write_uuid: uuid.UUID) -> Iterator[DataFile]:
    """Write ``df`` as data files of the table ``metadata`` describes (module docstring).

    Returns:
        The written files' :class:`~pyiceberg.manifest.DataFile` entries.
    """
    spec = metadata.spec()
    key = None if spec.is_unpartitioned() else single_partition_key(metadata, df)
    if key is None:
        yield from _dataframe_to_data_files(table_metadata=metadata, write_uuid=write_uuid, df=df, io=io)
        return
    target = property_as_int(
        properties=metadata.properties,
        property_name=TableProperties.WRITE_TARGET_FILE_SIZE_BYTES,
        default=TableProperties.WRITE_TARGET_FILE_SIZE_BYTES_DEFAULT,
    )
    assert target is not None
    downcast = Config().get_bool(DOWNCAST_NS_TIMESTAMP_TO_US_ON_WRITE) or False
    task_schema = write_plan(metadata).task_schema(df.schema, downcast)
    counter = itertools.count(0)
    tasks: Iterable[WriteTask] = [
        WriteTask(write_uuid=write_uuid, task_id=next(counter), record_batches=batches, partition_key=key, schema=task_schema)
        for batches in bin_pack_arrow_table(df, target)
    ]
    if metadata.properties.get(TableProperties.WRITE_FILE_FORMAT, TableProperties.WRITE_FILE_FORMAT_DEFAULT).upper() != "PARQUET":
        yield from write_file(io=io, table_metadata=metadata, tasks=iter(tasks))
        return
    yield from write_parquet_files(io, metadata, tasks, downcast_ns_timestamp_to_us=downcast)


PLAIN_COLUMNS = ("_offset", "_publish_time")
"""Columns written without a dictionary: ``PLAIN`` (Parquet format, "Encodings")."""
_NO_DICTIONARY = (*PLAIN_COLUMNS, RAW_PAYLOAD_COLUMN)
""":data:`PLAIN_COLUMNS` and ``_raw_payload``, whose payload bytes are nearly all distinct too."""


@dataclass
class WritePlan:
    """What every write of one table schema needs, derived once (:func:`write_plan`).

    pyiceberg derives these per file: the sanitized file schema, the statistics plan (metrics
    modes), the Parquet column paths' field ids, the written batches' schema. For a tiered
    object of 100,000 rows that was about a tenth of its Parquet write. A schema id names one
    schema forever within a table (Iceberg spec, "Schemas"), so the derivations are kept per
    table uuid, schema id, format version and table properties.

    Attributes:
        file_schema: the schema the files are written with (pyiceberg's ``sanitize_column_names``).
        arrow_schema: the table's Arrow schema without field ids (pyiceberg's ``schema_to_pyarrow``),
            what the rows of :func:`append_table` have.
        statistics_plan: pyiceberg's ``compute_statistics_plan`` of ``file_schema``.
        path_ids: pyiceberg's ``parquet_path_to_id_mapping`` of ``file_schema``.
        use_dictionary: the Parquet column paths written with a dictionary (every path but
            those of :data:`_NO_DICTIONARY`), or ``None`` when that is all of them.
    """

    file_schema: Schema
    arrow_schema: pa.Schema
    statistics_plan: dict[int, StatisticsCollector]
    path_ids: dict[str, int]
    use_dictionary: list[str] | None
    format_version: int
    _task_schemas: dict[tuple[pa.Schema, bool], Schema] = field(default_factory=dict)
    _projected: dict[pa.Schema, pa.Schema | None] = field(default_factory=dict)

    def task_schema(self, arrow_schema: pa.Schema, downcast_ns_timestamp_to_us: bool) -> Schema:
        """pyiceberg's ``pyarrow_to_schema`` of rows of ``arrow_schema`` (the schema of a
        ``WriteTask``), with the table schema's name mapping."""
        key = (arrow_schema, downcast_ns_timestamp_to_us)
        schema = self._task_schemas.get(key)
        if schema is None:
            schema = pyarrow_to_schema(
                arrow_schema,
                name_mapping=self.file_schema.name_mapping,
                downcast_ns_timestamp_to_us=downcast_ns_timestamp_to_us,
                format_version=self.format_version,  # type: ignore[arg-type]
            )
            if len(self._task_schemas) < _MAX_PER_PLAN:
                self._task_schemas[key] = schema
        return schema

    def project(self, batch: pa.RecordBatch, task_schema: Schema, downcast_ns_timestamp_to_us: bool) -> pa.RecordBatch:
        """pyiceberg's ``_to_requested_schema`` of ``batch`` to the file schema, with field ids.

        When the projection of a batch schema changed no column's type (only names, field ids
        and docs), it changes no value either: later batches of that schema take the
        projected schema as they are, without the per-column visit.
        """
        projected = self._projected.get(batch.schema, _UNKNOWN)
        if isinstance(projected, pa.Schema):
            return pa.RecordBatch.from_arrays(batch.columns, schema=projected)
        out = _to_requested_schema(
            requested_schema=self.file_schema,
            file_schema=task_schema,
            batch=batch,
            downcast_ns_timestamp_to_us=downcast_ns_timestamp_to_us,
            include_field_ids=True,
            format_model=FileFormatFactory.get(FileFormat.PARQUET),
        )
        if projected is _UNKNOWN and len(self._projected) < _MAX_PER_PLAN:
            same = not downcast_ns_timestamp_to_us and out.schema.equals(batch.schema, check_metadata=False)
            self._projected[batch.schema] = out.schema if same else None
        return out


_METRICS_PROPERTIES = "write.metadata.metrics."
"""The table properties the statistics plan reads (``write.metadata.metrics.default`` and
``write.metadata.metrics.column.*``, Iceberg's "Write properties")."""
_UNKNOWN: Any = object()
_MAX_PER_PLAN = 16
_MAX_PLANS = 256
_plans: OrderedDict[tuple[Any, ...], WritePlan] = OrderedDict()
_plans_lock = threading.Lock()


def write_plan(metadata: TableMetadata) -> WritePlan:
    """The :class:`WritePlan` of the table's current schema, from a bounded cache (the most
    recently used 256 table schemas)."""
    properties = metadata.properties
    metrics = tuple(sorted((k, v) for k, v in properties.items() if k.startswith(_METRICS_PROPERTIES)))
    key = (metadata.table_uuid, metadata.current_schema_id, metadata.format_version, metrics)
    with _plans_lock:
        plan = _plans.get(key)
        if plan is not None:
            _plans.move_to_end(key)
            return plan
    table_schema = metadata.schema()
    sanitized = sanitize_column_names(table_schema)
    file_schema = sanitized if sanitized != table_schema else table_schema
    path_ids = parquet_path_to_id_mapping(file_schema)
    paths = list(path_ids)
    plan = WritePlan(
        file_schema=file_schema,
        arrow_schema=schema_to_pyarrow(table_schema, include_field_ids=False),
        statistics_plan=compute_statistics_plan(file_schema, properties),
        path_ids=path_ids,
        use_dictionary=[p for p in paths if p not in _NO_DICTIONARY] if any(p in _NO_DICTIONARY for p in paths) else None,
        format_version=metadata.format_version,
    )
    with _plans_lock:
        _plans[key] = plan
        while len(_plans) > _MAX_PLANS:
            _plans.popitem(last=False)
    return plan


class _ParquetWriter(ParquetFormatWriter):
    """pyiceberg's Parquet writer, without a dictionary for :data:`PLAIN_COLUMNS` (and
    ``_raw_payload``), and with the statistics plan and column ids of a :class:`WritePlan`.

    Every offset is distinct, and nearly every publish time: pyarrow's default dictionary
    stores each value twice for them, and building it costs the most time of any column. They
    are written ``PLAIN`` instead, the encoding every Parquet reader reads. (``DELTA_BINARY_PACKED``
    would be smaller still, but Iceberg's vectorized Spark reader refuses it.) Every other
    column keeps the dictionary, and every table property pyiceberg reads for Parquet applies.
    """

    def __init__(self, output_file: OutputFile, plan: WritePlan, properties: Properties) -> None:
        super().__init__(output_file, plan.file_schema, properties)
        self._plan = plan
        if plan.use_dictionary is not None:
            self._parquet_writer_kwargs = {**self._parquet_writer_kwargs, "use_dictionary": plan.use_dictionary}

    def close(self) -> DataFileStatistics:
        """pyiceberg's ``close``, with the plan's statistics plan and column ids."""
        if self._result is not None:
            return self._result
        if self._writer is None or self._fos is None:
            raise ValueError("Cannot close a writer that was never written to")
        with self._fos:
            self._writer.close()
            self._result = data_file_statistics_from_parquet_metadata(
                parquet_metadata=self._writer.writer.metadata,
                stats_columns=self._plan.statistics_plan,
                parquet_column_mapping=self._plan.path_ids,
            )
        return self._result


def write_parquet_files(
    io: FileIO,
    metadata: TableMetadata,
    tasks: Iterable[WriteTask],
    *,
    downcast_ns_timestamp_to_us: bool | None = None,
) -> Iterator[DataFile]:
    """pyiceberg's ``write_file`` for Parquet (the same file schema, field ids, location,
    statistics and data file entry), one task after another, through :class:`_ParquetWriter`.

    Args:
        io: the table's file IO.
        metadata: the table's metadata.
        tasks: the files to write.
        downcast_ns_timestamp_to_us: pyiceberg's ``downcast-ns-timestamp-to-us-on-write``;
            read from its configuration when ``None``.

    Returns:
        The written files' :class:`~pyiceberg.manifest.DataFile` entries.
    """
    plan = write_plan(metadata)
    if downcast_ns_timestamp_to_us is None:
        downcast_ns_timestamp_to_us = Config().get_bool(DOWNCAST_NS_TIMESTAMP_TO_US_ON_WRITE) or False
    locations = load_location_provider(table_location=metadata.location, table_properties=metadata.properties)
    parquet = FileFormatFactory.get(FileFormat.PARQUET)
    for task in tasks:
        batches = [plan.project(batch, task.schema, downcast_ns_timestamp_to_us) for batch in task.record_batches]
        path = locations.new_data_location(
            data_file_name=task.generate_data_file_filename(parquet.file_extension()), partition_key=task.partition_key
        )
        output = io.new_output(path)
        writer = _ParquetWriter(output, plan, metadata.properties)
        with writer:
            writer.write(pa.Table.from_batches(batches))
        statistics = writer.result()
        yield DataFile.from_args(
            content=DataFileContent.DATA,
            file_path=path,
            file_format=FileFormat.PARQUET,
            partition=task.partition_key.partition if task.partition_key else Record(),
            file_size_in_bytes=len(output),
            sort_order_id=None,
            spec_id=metadata.default_spec_id,
            equality_ids=None,
            key_metadata=None,
            **statistics.to_serialized_dict(),
        )


def single_partition_key(metadata: TableMetadata, df: pa.Table) -> PartitionKey | None:
    """The partition key of ``df``'s rows under the table's current spec when it is the same
    for every row, else ``None`` (also for an empty table).

    Each spec field's transform is applied to its source column with pyiceberg's own
    ``pyarrow_transform``, as pyiceberg does to split a table. An identity or time transform
    (year, month, day, hour) preserves order, so it is applied to the column's least and
    greatest values only: the rows share one value exactly when those two do.
    """
    if not df.num_rows:
        return None
    spec, schema = metadata.spec(), metadata.schema()
    values: list[PartitionFieldValue] = []
    for spec_field in spec.fields:
        name = schema.find_column_name(spec_field.source_id)
        if name is None or name not in df.column_names:
            return None  # a nested source: pyiceberg's split handles it
        source = schema.find_field(spec_field.source_id)
        column: pa.Array | pa.ChunkedArray = df.column(name)
        if isinstance(spec_field.transform, IdentityTransform | TimeTransform):
            column = _least_and_greatest(column)
        transformed = spec_field.transform.pyarrow_transform(source.field_type)(column)
        value = _the_value(transformed)
        if value is _MIXED:
            return None
        values.append(PartitionFieldValue(field=spec_field, value=value))
    return PartitionKey(field_values=values, partition_spec=spec, schema=schema)


_MIXED = object()


def _least_and_greatest(column: pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """The least and greatest values of a column without nulls (floats and columns with nulls,
    which :func:`_the_value` decides on as a whole, are returned as they are)."""
    if column.null_count or pa.types.is_floating(column.type) or len(column) < 3:
        return column
    try:
        bounds = pc.min_max(column)
    except pa.ArrowNotImplementedError:
        return column
    return pa.array([bounds["min"], bounds["max"]], type=column.type)


def _the_value(array: pa.Array | pa.ChunkedArray) -> Any:
    """The one value of ``array`` (``None`` when all are null), or ``_MIXED``."""
    nulls = array.null_count
    if nulls == len(array):
        return None
    if nulls or pa.types.is_floating(array.type):  # NaN is neither min nor max: leave floats to pyiceberg
        return _MIXED
    try:
        bounds = pc.min_max(array)
    except pa.ArrowNotImplementedError:
        return _MIXED
    low, high = bounds["min"].as_py(), bounds["max"].as_py()
    return low if low == high else _MIXED
