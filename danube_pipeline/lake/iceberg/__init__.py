"""The Iceberg side of tiered storage, one module per concept (as pyiceberg is laid out):

* :mod:`.catalog`: the shared SQL catalog and the topic tables in it;
* :mod:`.schema`: Avro schemas to Iceberg schemas (and the columns every format shares);
* :mod:`.json_schema`, :mod:`.protobuf_schema`: JSON Schema and Protobuf to Iceberg schemas,
  and their payloads to rows;
* :mod:`.writer`: a record's writer schema, in any format, and how fields are renamed;
* :mod:`.evolution`: the table evolved in place, by Iceberg's rules;
* :mod:`.arrow`, :mod:`.rows`: records to the Arrow table an append writes;
* :mod:`.dead_letter`: the ``{topic}__dlq`` table of records that cannot be rows;
* :mod:`.append`: the exactly-once append (the committed end offset in a table property);
* :mod:`.binding`: writer schemas bound to the table (create or evolve it, dead-letter the
  versions it cannot take, map renames): the one path of tiering and bulk loads;
* :mod:`.commit`: one segment object into the table (evolve, decode, dead-letter, append).
"""

from danube_pipeline.lake.iceberg.append import (
    COMMITTED_END_OFFSET_PROPERTY,
    SUMMARY_DEAD_LETTER_RECORDS,
    SUMMARY_END_OFFSET,
    SUMMARY_OBJECT_ID,
    SUMMARY_PARTITION,
    SUMMARY_START_OFFSET,
    SUMMARY_TOPIC,
    AppendResult,
    append_records,
    append_rows,
    committed_end_offset,
    committed_end_offset_property,
    pending_records,
    without_commit_retries,
)
from danube_pipeline.lake.iceberg.arrow import arrow_table_for_records
from danube_pipeline.lake.iceberg.catalog import (
    CatalogNotFoundError,
    OffsetStats,
    data_file_count,
    duplicate_offsets,
    ensure_table,
    ensure_table_for_schema,
    load_catalog,
    offset_stats,
    read_offsets,
    row_count,
    snapshot_row_count,
    table_identifier,
)
from danube_pipeline.lake.iceberg.binding import (
    RegisteredWriter,
    WriterBinding,
    bind_writers,
    ensure_raw_payload_columns,
    ensure_table_for_writers,
    raw_message_error,
    recorded_schema,
    supersedes,
)
from danube_pipeline.lake.iceberg.commit import ObjectCommit, commit_object
from danube_pipeline.lake.iceberg.dead_letter import (
    DEAD_LETTER_SUFFIX,
    DeadLetter,
    DeadLetterAppend,
    DeadLetterReason,
    append_dead_letters,
    commit_dead_letters,
    dead_letter_identifier,
    dead_letter_offsets,
    dead_letter_schema,
    dead_letter_table_of,
    ensure_dead_letter_table,
    load_dead_letter_table,
)
from danube_pipeline.lake.iceberg.evolution import (
    SCHEMA_ID_PROPERTY,
    SCHEMA_SUBJECT_PROPERTY,
    SCHEMA_VERSION_PROPERTY,
    EvolutionPlan,
    SchemaChange,
    evolve_table,
    incompatible_changes,
    plan_evolution,
)
from danube_pipeline.lake.iceberg.json_schema import iceberg_schema_for_json_schema, json_payload_to_row
from danube_pipeline.lake.iceberg.protobuf_schema import iceberg_schema_for_protobuf, protobuf_payload_to_row
from danube_pipeline.lake.iceberg.schema import (
    METADATA_COLUMNS,
    PARTITION_COLUMN,
    PAYLOAD_COLUMN,
    KEY_COLUMN,
    RAW_PAYLOAD_COLUMN,
    VALUE_COLUMN,
    iceberg_schema_for_avro,
    key_type,
    widen_avro_schema,
)
from danube_pipeline.lake.iceberg.writer import PayloadDecodeError, WriterSchema, renamed_columns, writer_for_parsed

__all__ = [
    "CatalogNotFoundError",
    "COMMITTED_END_OFFSET_PROPERTY",
    "DEAD_LETTER_SUFFIX",
    "METADATA_COLUMNS",
    "PARTITION_COLUMN",
    "PAYLOAD_COLUMN",
    "KEY_COLUMN",
    "RAW_PAYLOAD_COLUMN",
    "SCHEMA_ID_PROPERTY",
    "SCHEMA_SUBJECT_PROPERTY",
    "SCHEMA_VERSION_PROPERTY",
    "SUMMARY_DEAD_LETTER_RECORDS",
    "SUMMARY_END_OFFSET",
    "SUMMARY_OBJECT_ID",
    "SUMMARY_PARTITION",
    "SUMMARY_START_OFFSET",
    "SUMMARY_TOPIC",
    "VALUE_COLUMN",
    "AppendResult",
    "DeadLetter",
    "DeadLetterAppend",
    "DeadLetterReason",
    "EvolutionPlan",
    "ObjectCommit",
    "OffsetStats",
    "PayloadDecodeError",
    "RegisteredWriter",
    "SchemaChange",
    "WriterBinding",
    "WriterSchema",
    "append_dead_letters",
    "append_records",
    "append_rows",
    "arrow_table_for_records",
    "bind_writers",
    "commit_dead_letters",
    "commit_object",
    "ensure_raw_payload_columns",
    "committed_end_offset",
    "committed_end_offset_property",
    "data_file_count",
    "dead_letter_identifier",
    "dead_letter_offsets",
    "dead_letter_schema",
    "dead_letter_table_of",
    "duplicate_offsets",
    "ensure_dead_letter_table",
    "ensure_table",
    "ensure_table_for_schema",
    "ensure_table_for_writers",
    "evolve_table",
    "iceberg_schema_for_avro",
    "key_type",
    "iceberg_schema_for_json_schema",
    "iceberg_schema_for_protobuf",
    "incompatible_changes",
    "json_payload_to_row",
    "load_catalog",
    "load_dead_letter_table",
    "offset_stats",
    "pending_records",
    "plan_evolution",
    "protobuf_payload_to_row",
    "raw_message_error",
    "read_offsets",
    "recorded_schema",
    "renamed_columns",
    "row_count",
    "snapshot_row_count",
    "supersedes",
    "table_identifier",
    "widen_avro_schema",
    "without_commit_retries",
    "writer_for_parsed",
]
