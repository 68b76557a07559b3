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
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.io import FileIO, OutputFile
from pyiceberg.io.fileformat import FileFormatFactory
from pyiceberg.io.pyarrow import (
    ParquetFormatWriter,
    _check_pyarrow_schema_compatible,
    _dataframe_to_data_files,
    _to_requested_schema,
    bin_pack_arrow_table,
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
    if not df.schema.equals(schema_to_pyarrow(metadata.schema(), include_field_ids=False)):
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
    task_schema = pyarrow_to_schema(
        df.schema,
        name_mapping=metadata.schema().name_mapping,
        downcast_ns_timestamp_to_us=Config().get_bool(DOWNCAST_NS_TIMESTAMP_TO_US_ON_WRITE) or False,
        format_version=metadata.format_version,
    )
    counter = itertools.count(0)
    tasks: Iterable[WriteTask] = [
        WriteTask(write_uuid=write_uuid, task_id=next(counter), record_batches=batches, partition_key=key, schema=task_schema)
        for batches in bin_pack_arrow_table(df, target)
    ]
    if metadata.properties.get(TableProperties.WRITE_FILE_FORMAT, TableProperties.WRITE_FILE_FORMAT_DEFAULT).upper() != "PARQUET":
        yield from write_file(io=io, table_metadata=metadata, tasks=iter(tasks))
        return
    yield from write_parquet_files(io, metadata, tasks)


PLAIN_COLUMNS = ("_offset", "_publish_time")
"""Columns written without a dictionary: ``PLAIN`` (Parquet format, "Encodings")."""
_NO_DICTIONARY = (*PLAIN_COLUMNS, RAW_PAYLOAD_COLUMN)
""":data:`PLAIN_COLUMNS` and ``_raw_payload``, whose payload bytes are nearly all distinct too."""


class _ParquetWriter(ParquetFormatWriter):
    """pyiceberg's Parquet writer, without a dictionary for :data:`PLAIN_COLUMNS` (and
    ``_raw_payload``).

    Every offset is distinct, and nearly every publish time: pyarrow's default dictionary
    stores each value twice for them, and building it costs the most time of any column. They
    are written ``PLAIN`` instead, the encoding every Parquet reader reads. (``DELTA_BINARY_PACKED``
    would be smaller still, but Iceberg's vectorized Spark reader refuses it.) Every other
    column keeps the dictionary, and every table property pyiceberg reads for Parquet applies.
    """

    def __init__(self, output_file: OutputFile, file_schema: Schema, properties: Properties) -> None:
        super().__init__(output_file, file_schema, properties)
        paths = list(parquet_path_to_id_mapping(file_schema))
        if any(p in _NO_DICTIONARY for p in paths):
            self._parquet_writer_kwargs = {
                **self._parquet_writer_kwargs,
                "use_dictionary": [p for p in paths if p not in _NO_DICTIONARY],
            }


def write_parquet_files(io: FileIO, metadata: TableMetadata, tasks: Iterable[WriteTask]) -> Iterator[DataFile]:
    """pyiceberg's ``write_file`` for Parquet (the same file schema, field ids, location,
    statistics and data file entry), one task after another, through :class:`_ParquetWriter`.

    Returns:
        The written files' :class:`~pyiceberg.manifest.DataFile` entries.
    """
    table_schema = metadata.schema()
    sanitized = sanitize_column_names(table_schema)
    file_schema = sanitized if sanitized != table_schema else table_schema
    downcast = Config().get_bool(DOWNCAST_NS_TIMESTAMP_TO_US_ON_WRITE) or False
    locations = load_location_provider(table_location=metadata.location, table_properties=metadata.properties)
    parquet = FileFormatFactory.get(FileFormat.PARQUET)
    for task in tasks:
        batches = [
            _to_requested_schema(
                requested_schema=file_schema,
                file_schema=task.schema,
                batch=batch,
                downcast_ns_timestamp_to_us=downcast,
                include_field_ids=True,
                format_model=parquet,
            )
            for batch in task.record_batches
        ]
        path = locations.new_data_location(
            data_file_name=task.generate_data_file_filename(parquet.file_extension()), partition_key=task.partition_key
        )
        output = io.new_output(path)
        writer = _ParquetWriter(output, file_schema, metadata.properties)
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
    ``pyarrow_transform``, as pyiceberg does to split a table.
    """
    if not df.num_rows:
        return None
    spec, schema = metadata.spec(), metadata.schema()
    values: list[PartitionFieldValue] = []
    for field in spec.fields:
        name = schema.find_column_name(field.source_id)
        if name is None or name not in df.column_names:
            return None  # a nested source: pyiceberg's split handles it
        source = schema.find_field(field.source_id)
        transformed = field.transform.pyarrow_transform(source.field_type)(df.column(name))
        value = _the_value(transformed)
        if value is _MIXED:
            return None
        values.append(PartitionFieldValue(field=field, value=value))
    return PartitionKey(field_values=values, partition_spec=spec, schema=schema)


_MIXED = object()


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
