"""The shared Iceberg SQL catalog and the topic tables in it.

A topic ``/{ns}/{topic}`` maps to the Iceberg table ``(ns, topic)`` (Iceberg namespace = Danube
namespace) in the SQL catalog that pyiceberg's ``SqlCatalog`` and Spark's ``JdbcCatalog`` both
use (see :mod:`danube_pipeline.lake.spark`): an embedded SQLite file by default, or a PostgreSQL
database that several hosts share (:func:`load_catalog`, which lives in
:mod:`danube_pipeline.storage.catalog` since the broker opens the catalog too). The partitions ``{topic}-part-{i}`` of a partitioned
topic (``docs/etcd-layout.md`` §3.1) all map to the partitioned topic's table, whose
``_partition`` column tells them apart; the functions reading offsets take the ``partition`` to
read (``None``: every row).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import sqlalchemy.exc
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.manifest import ManifestContent
from pyiceberg.schema import Schema
from pyiceberg.table import DataScan, Table

from danube_pipeline.lake.iceberg.evolution import evolve_table
from danube_pipeline.lake.iceberg.layout import DEFAULT_LAYOUT, partition_spec, sort_order
from danube_pipeline.lake.iceberg.schema import PARTITION_COLUMN, PAYLOAD_COLUMN, iceberg_schema_for_avro
from danube_pipeline.metadata.values import TableLayout
from danube_pipeline.names import TopicName
from danube_pipeline.storage.catalog import CATALOG_URI_ENV, CatalogNotFoundError, load_catalog

__all__ = [
    "CATALOG_URI_ENV",
    "CatalogNotFoundError",
    "OffsetStats",
    "data_file_count",
    "duplicate_offsets",
    "ensure_table",
    "ensure_table_for_schema",
    "load_catalog",
    "offset_stats",
    "read_offsets",
    "row_count",
    "snapshot_row_count",
    "table_identifier",
]

WRITE_PROPERTIES = {"format-version": "2", "write.parquet.compression-codec": "zstd"}
"""Properties of every new table: Iceberg format version 2 and the Parquet codec pyiceberg
writes by default, named so that Spark's writers (compaction, bulk loads, rewrites) use it too
instead of their own default, gzip (Iceberg spec, "Table Properties"; a day compacted from
zstd into gzip grew)."""

SUMMARY_TOTAL_DATA_FILES = "total-data-files"
"""The snapshot summary's count of live data files (Iceberg spec, "Optional Snapshot Summary
Fields")."""
SUMMARY_TOTAL_RECORDS = "total-records"
"""The snapshot summary's running row count (Iceberg spec, "Optional Snapshot Summary Fields")."""


def table_identifier(topic: TopicName) -> tuple[str, str]:
    """The Iceberg identifier of a topic's table (Iceberg namespace = Danube namespace).

    Args:
        topic: the topic.

    Returns:
        ``(namespace, topic)``, e.g. ``("default", "flights")``.
    """
    return (topic.namespace, topic.topic)


def ensure_table(
    catalog: Catalog,
    topic: TopicName,
    avro_schema: Mapping[str, Any] | str | None,
    *,
    partitioned: bool = False,
    layout: TableLayout = DEFAULT_LAYOUT,
) -> Table:
    """Load the topic's table, creating its namespace and the table when missing.

    When the table exists, it is evolved in place to take ``avro_schema``
    (:func:`~danube_pipeline.lake.iceberg.evolution.evolve_table`: new columns added as optional,
    columns the schema lacks made optional, ``int`` promoted to ``long``...). A ``_payload``
    table (created without a schema) is left as it is.

    Args:
        catalog: the shared catalog (:func:`load_catalog`).
        topic: the topic whose table it is (for a partition, the partitioned topic).
        avro_schema: the topic's Avro schema, or ``None`` for a ``_payload`` table.
        partitioned: the table of a partitioned topic, with the ``_partition`` column.
        layout: a new table's partitioning (``docs/etcd-layout.md`` §3.9; default
            ``day(_publish_time)``), as :func:`ensure_table_for_schema`.

    Returns:
        The table, loaded after any schema change.

    Raises:
        InvalidSchemaError: the Avro schema cannot be mapped (see
            :func:`~danube_pipeline.lake.iceberg.iceberg_schema_for_avro`).
        SchemaEvolutionError: the table cannot take the schema in place (a rewrite is needed;
            :func:`~danube_pipeline.lake.iceberg.evolution.incompatible_changes`).
    """
    wanted = iceberg_schema_for_avro(avro_schema, partitioned=partitioned)
    table = ensure_table_for_schema(catalog, topic, wanted, layout=layout)
    if avro_schema is not None and PAYLOAD_COLUMN not in {f.name for f in table.schema().fields}:
        evolve_table(table, wanted)
    return table


def ensure_table_for_schema(
    catalog: Catalog,
    topic: TopicName,
    schema: Schema,
    *,
    properties: Mapping[str, str] | None = None,
    layout: TableLayout = DEFAULT_LAYOUT,
) -> Table:
    """Load the topic's table, or create it (and its namespace) with ``schema`` and ``layout``.

    Args:
        catalog: the shared catalog.
        topic: the topic whose table it is (for a partition, the partitioned topic).
        schema: the new table's schema (the metadata columns and the payload columns, e.g.
            ``WriterSchema.iceberg_schema()``); not applied to an existing table.
        properties: extra properties of a new table.
        layout: a new table's partitioning (``docs/etcd-layout.md`` §3.9; default
            ``day(_publish_time)``); it is sorted by ``_offset``. An existing table is evolved
            to its topic's layout by :func:`~danube_pipeline.lake.iceberg.layout.apply_layout`.

    Returns:
        The table.
    """
    identifier = table_identifier(topic)
    try:
        return catalog.load_table(identifier)
    except NoSuchTableError:
        _create_namespace(catalog, topic.namespace)
        return catalog.create_table_if_not_exists(
            identifier,
            schema=schema,
            partition_spec=partition_spec(schema, layout),
            sort_order=sort_order(schema),
            properties={**(properties or {}), **WRITE_PROPERTIES, "danube.topic": topic.path},
        )


def _create_namespace(catalog: Catalog, namespace: str) -> None:
    """``create_namespace_if_not_exists``, safe when another writer creates it at the same
    moment: the SQL catalog checks, then inserts, so the loser of that race gets the
    database's unique-constraint error (``sqlalchemy.exc.IntegrityError``) instead of
    ``NamespaceAlreadyExistsError``; once the namespace exists, that is success."""
    try:
        catalog.create_namespace_if_not_exists(namespace)
    except sqlalchemy.exc.IntegrityError:
        if (namespace,) not in {tuple(n) for n in catalog.list_namespaces()}:
            raise


def data_file_count(table: Table) -> int:
    """Live data files in the table's current snapshot.

    Args:
        table: the table.

    Returns:
        The file count; 0 for a table without a snapshot. Read from the current snapshot's
        summary (``total-data-files``, Iceberg spec "Optional Snapshot Summary Fields") when it
        has it, else from its manifests.
    """
    snapshot = table.current_snapshot()
    if snapshot is None:
        return 0
    total = snapshot.summary[SUMMARY_TOTAL_DATA_FILES] if snapshot.summary is not None else None
    if total is not None:
        return int(total)
    # pyiceberg's inspect.files() fails on a snapshot without any data file
    return sum(len(manifest.fetch_manifest_entry(table.io, discard_deleted=True))
               for manifest in snapshot.manifests(table.io) if manifest.content == ManifestContent.DATA)


def _offset_scan(table: Table, partition: int | None) -> DataScan:
    """A scan of the ``_offset`` column, of one partition's rows when ``partition`` is given."""
    if partition is None:
        return table.scan(selected_fields=("_offset",))
    return table.scan(row_filter=f"{PARTITION_COLUMN} = {int(partition)}", selected_fields=("_offset",))


def read_offsets(table: Table, *, partition: int | None = None) -> list[int]:
    """Every ``_offset`` in the table's current snapshot (a full scan of that column).

    Args:
        table: a topic's table.
        partition: only the rows of this partition (a partitioned topic's table).

    Returns:
        The offsets, sorted, one per row (a duplicated offset appears twice).
    """
    arrow = _offset_scan(table, partition).to_arrow()
    return sorted(arrow.column("_offset").to_pylist())


@dataclass(frozen=True, slots=True)
class OffsetStats:
    """Rows and their ``_offset`` bounds in a table's current snapshot.

    Attributes:
        rows: rows the scan returns (deletes applied).
        first_offset: the smallest ``_offset``, ``None`` when there is no row.
        last_offset: the largest ``_offset``, ``None`` when there is no row.
    """

    rows: int
    first_offset: int | None
    last_offset: int | None


def offset_stats(table: Table, *, partition: int | None = None) -> OffsetStats:
    """Count the rows of the table's current snapshot and find their ``_offset`` bounds.

    Streams the ``_offset`` column batch by batch (memory: one batch).

    Args:
        table: a topic's table.
        partition: only the rows of this partition (a partitioned topic's table).

    Returns:
        The :class:`OffsetStats`.
    """
    rows = 0
    low: int | None = None
    high: int | None = None
    for batch in _offset_scan(table, partition).to_arrow_batch_reader():
        if batch.num_rows == 0:
            continue
        rows += batch.num_rows
        bounds = pc.min_max(batch.column("_offset"))
        b_low, b_high = int(bounds["min"].as_py()), int(bounds["max"].as_py())
        low = b_low if low is None else min(low, b_low)
        high = b_high if high is None else max(high, b_high)
    return OffsetStats(rows, low, high)


def row_count(table: Table) -> int:
    """Rows in the table's current snapshot, counted by scanning the ``_offset`` column.

    Args:
        table: a topic's table.

    Returns:
        The number of rows the scan returns (deletes applied).
    """
    return int(table.scan(selected_fields=("_offset",)).to_arrow().num_rows)


def snapshot_row_count(table: Table) -> int | None:
    """Rows in the table's current snapshot, from its summary (no data file is read).

    Every snapshot summary pyiceberg and Spark write carries ``total-records``, the running
    row count of the table (Iceberg spec, "Optional Snapshot Summary Fields").

    Args:
        table: the table.

    Returns:
        The row count; 0 for a table without a snapshot; ``None`` when the current snapshot's
        summary does not state it.
    """
    snapshot = table.current_snapshot()
    if snapshot is None:
        return 0
    if snapshot.summary is None:
        return None
    value = snapshot.summary[SUMMARY_TOTAL_RECORDS]
    return int(value) if value is not None else None


def duplicate_offsets(
    table: Table, *, partition: int | None = None, dead_letters: Table | None = None
) -> dict[int, int]:
    """Offsets held by more than one row of the table's current snapshot (and of its
    dead-letter table, when given: an offset is committed once, as a row of one of the two).

    Scans the ``_offset`` column only (8 bytes per row in memory).

    Args:
        table: a topic's table.
        partition: only the rows of this partition (in a partitioned topic's table each
            partition has its own offsets, so duplicates are looked for per partition).
        dead_letters: the topic's dead-letter table
            (:func:`~danube_pipeline.lake.iceberg.dead_letter.load_dead_letter_table`), whose rows
            count as well.

    Returns:
        ``{offset: rows holding it}`` for every offset held by two rows or more; empty when
        every offset is unique.
    """
    offsets = _offset_scan(table, partition).to_arrow().column("_offset")
    if dead_letters is not None:
        offsets = pa.chunked_array(
            [*offsets.chunks, *_offset_scan(dead_letters, partition).to_arrow().column("_offset").chunks],
            type=pa.int64(),
        )
    counts = pc.value_counts(offsets)
    repeated = pc.filter(counts, pc.greater(counts.field("counts"), 1))
    return {
        int(offset): int(count)
        for offset, count in zip(
            repeated.field("values").to_pylist(), repeated.field("counts").to_pylist(), strict=True
        )
    }
