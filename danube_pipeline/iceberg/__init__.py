"""The Iceberg side of tiered storage, one module per concept (as pyiceberg is laid out):

* :mod:`.catalog`: the shared SQL catalog and the topic tables in it;
* :mod:`.schema`: Avro schemas to Iceberg schemas;
* :mod:`.arrow`: records to the Arrow table an append writes;
* :mod:`.append`: the exactly-once append (the committed end offset in a table property).
"""

from danube_pipeline.iceberg.append import (
    COMMITTED_END_OFFSET_PROPERTY,
    SUMMARY_END_OFFSET,
    SUMMARY_OBJECT_ID,
    SUMMARY_PARTITION,
    SUMMARY_START_OFFSET,
    SUMMARY_TOPIC,
    AppendResult,
    append_records,
    committed_end_offset,
    committed_end_offset_property,
)
from danube_pipeline.iceberg.arrow import arrow_table_for_records
from danube_pipeline.iceberg.catalog import (
    OffsetStats,
    data_file_count,
    duplicate_offsets,
    ensure_table,
    load_catalog,
    offset_stats,
    read_offsets,
    row_count,
    snapshot_row_count,
    table_identifier,
)
from danube_pipeline.iceberg.schema import (
    METADATA_COLUMNS,
    PARTITION_COLUMN,
    PAYLOAD_COLUMN,
    VALUE_COLUMN,
    iceberg_schema_for_avro,
    widen_avro_schema,
)

__all__ = [
    "COMMITTED_END_OFFSET_PROPERTY",
    "METADATA_COLUMNS",
    "PARTITION_COLUMN",
    "PAYLOAD_COLUMN",
    "SUMMARY_END_OFFSET",
    "SUMMARY_OBJECT_ID",
    "SUMMARY_PARTITION",
    "SUMMARY_START_OFFSET",
    "SUMMARY_TOPIC",
    "VALUE_COLUMN",
    "AppendResult",
    "OffsetStats",
    "append_records",
    "arrow_table_for_records",
    "committed_end_offset",
    "committed_end_offset_property",
    "data_file_count",
    "duplicate_offsets",
    "ensure_table",
    "iceberg_schema_for_avro",
    "load_catalog",
    "offset_stats",
    "read_offsets",
    "row_count",
    "snapshot_row_count",
    "table_identifier",
    "widen_avro_schema",
]
