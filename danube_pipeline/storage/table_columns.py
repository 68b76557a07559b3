"""The reserved column names of a topic's Iceberg table and of its dead-letter table.

Defined here, under ``storage/`` (shared by the ``[broker]`` and ``[pipeline]`` extras), so that
what reads the tables (``danube_pipeline.storage.table_reader``, which the broker may import)
and what writes them (``danube_pipeline.lake.iceberg``, which re-exports these names) spell
them alike. No import beyond the standard library.

A topic's table (``{ns}.{topic}``)::

    _offset long (required) | _publish_time timestamptz (µs, UTC) | _producer_id long (u64 bits)
    | _producer_name string | _schema_id long | _schema_version int | _attributes map<string,string>
    [| _partition int] ( | _payload binary | <one column per schema field> ) [| _raw_payload binary]
    [| _key struct<value: string>] [| _rewrite_version int]

* A topic without a schema has ``_payload``: the payload exactly as published. Its presence
  marks such a "payload table".
* A topic with a schema has typed columns, and ``_raw_payload`` when its table layout says so
  (``docs/etcd-layout.md`` §3.9, ``raw_payload``): the payload exactly as published, in every row
  written since; ``null`` in rows written before the column was added.
* Both kinds get ``_key`` with ``raw_payload`` on: the record's routing key as
  ``struct<value: string>``. The struct is never null in a row written since: ``{value: null}``
  is a record without a key, ``{value: ""}`` one with the empty key. A null ``_key`` marks a
  row written before the column existed, whose key the table does not know (nor, in a table
  with a schema, its exact bytes).

Its dead-letter table (``{ns}.{topic}__dlq``) has ``_offset``, ``_publish_time``,
``_producer_name``, ``_schema_id``, ``_schema_version``, [``_partition``], ``_payload`` (exact
bytes) and ``_error``; with ``raw_payload`` on it also gets ``_producer_id``, ``_attributes``
and ``_key`` (added at the end; ``null`` in dead letters written before).
"""

from __future__ import annotations

__all__ = [
    "ATTRIBUTES_COLUMN",
    "DEAD_LETTER_SUFFIX",
    "ERROR_COLUMN",
    "KEY_COLUMN",
    "KEY_VALUE_FIELD",
    "METADATA_COLUMNS",
    "OFFSET_COLUMN",
    "PARTITION_COLUMN",
    "PAYLOAD_COLUMN",
    "PRODUCER_ID_COLUMN",
    "PRODUCER_NAME_COLUMN",
    "PUBLISH_TIME_COLUMN",
    "RAW_PAYLOAD_COLUMN",
    "RESERVED_COLUMNS",
    "REWRITE_VERSION_COLUMN",
    "SCHEMA_ID_COLUMN",
    "SCHEMA_VERSION_COLUMN",
]

OFFSET_COLUMN = "_offset"
"""The record's offset in its topic (in its partition, for a partitioned topic). Required."""
PUBLISH_TIME_COLUMN = "_publish_time"
"""The broker's publish time, ``timestamptz`` (microseconds, UTC)."""
PRODUCER_ID_COLUMN = "_producer_id"
"""The u64 producer id stored as the int64 with the same bits (``value & (2**64 - 1)`` reverses it)."""
PRODUCER_NAME_COLUMN = "_producer_name"
SCHEMA_ID_COLUMN = "_schema_id"
"""The registry's schema id; 0 = no schema."""
SCHEMA_VERSION_COLUMN = "_schema_version"
ATTRIBUTES_COLUMN = "_attributes"
"""The record's attributes, ``map<string, string>`` (an empty map, never null, where written)."""

METADATA_COLUMNS = (
    OFFSET_COLUMN,
    PUBLISH_TIME_COLUMN,
    PRODUCER_ID_COLUMN,
    PRODUCER_NAME_COLUMN,
    SCHEMA_ID_COLUMN,
    SCHEMA_VERSION_COLUMN,
    ATTRIBUTES_COLUMN,
)
"""The message metadata columns every topic table starts with, in order."""
PAYLOAD_COLUMN = "_payload"
"""A payload table's (topic without a schema) and a dead-letter table's payload: the exact bytes."""
RAW_PAYLOAD_COLUMN = "_raw_payload"
"""A schema table's copy of each payload's exact bytes, when the layout's ``raw_payload`` is on
(``docs/etcd-layout.md`` §3.9); ``null`` in rows written while it was off."""
KEY_COLUMN = "_key"
"""The record's routing key as ``struct<value: string>``, with the layout's ``raw_payload`` on:
never null in a row written since (``value`` null: no key); null in rows written before."""
KEY_VALUE_FIELD = "value"
"""The one field of :data:`KEY_COLUMN`'s struct."""
PARTITION_COLUMN = "_partition"
"""In a partitioned topic's table: the index ``i`` of the partition ``{topic}-part-{i}``."""
REWRITE_VERSION_COLUMN = "_rewrite_version"
"""Written by schema rewrites (``danube_pipeline.lake.rewrite``): the rewrite version that wrote the row."""
RESERVED_COLUMNS = frozenset(
    (*METADATA_COLUMNS, PAYLOAD_COLUMN, RAW_PAYLOAD_COLUMN, KEY_COLUMN, PARTITION_COLUMN, REWRITE_VERSION_COLUMN)
)
"""Column names a schema's field may not take: they are Danube's own."""

DEAD_LETTER_SUFFIX = "__dlq"
"""Appended to a topic's table name for its dead-letter table: ``flights`` -> ``flights__dlq``."""
ERROR_COLUMN = "_error"
"""A dead-letter table's column: why the record is not a row of the topic's table."""
