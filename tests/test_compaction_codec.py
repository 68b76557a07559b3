"""Compaction writes a day's files in the codec the table's appends use: pyiceberg appends
zstd, and Iceberg's Spark writer, left to itself on a table without a codec property, gzip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from helpers import RegisterCatalog
from tiering_helpers import avro, avro_records

from danube_pipeline.lake import iceberg
from danube_pipeline.lake.iceberg.layout import data_files_by_day
from danube_pipeline.lake.spark.procedures import SPARK_CODEC_CONF, compact_table
from danube_pipeline.names import TopicName

pytestmark = pytest.mark.spark

SCHEMA = avro({"name": "sensor", "type": "string"}, {"name": "value", "type": "double"})


def _codecs(table: Any) -> set[str]:
    """The compression codecs of every column chunk of the table's live data files."""
    codecs: set[str] = set()
    for entry in table.inspect.files().to_pylist():
        metadata = pq.ParquetFile(entry["file_path"].removeprefix("file://")).metadata
        for group in range(metadata.num_row_groups):
            row_group = metadata.row_group(group)
            codecs |= {row_group.column(c).compression for c in range(row_group.num_columns)}
    return codecs


def test_compaction_keeps_the_appends_codec(tmp_path: Path, spark_on_catalog: RegisterCatalog) -> None:
    uri, warehouse = f"sqlite:///{tmp_path / 'catalog.db'}", (tmp_path / "warehouse").as_uri()
    catalog = iceberg.load_catalog(name="danube", uri=uri, warehouse=warehouse)
    topic = TopicName("default", "codec")
    table = iceberg.ensure_table(catalog, topic, SCHEMA)
    for start in (0, 500, 1000):
        values = [(o, {"sensor": f"s{o % 7}", "value": o / 3}) for o in range(start, start + 500)]
        iceberg.append_records(table, avro_records(SCHEMA, 1, values), SCHEMA, f"data-{start}-{start + 499}.dnb1")
    table.refresh()
    assert _codecs(table) == {"ZSTD"}
    [(day, before)] = data_files_by_day(table).items()
    spark = spark_on_catalog(name="danube", uri=uri, warehouse=warehouse)

    result = compact_table(spark, topic, catalog_name="danube", day=day)

    table.refresh()
    [after] = data_files_by_day(table).values()
    assert result.rewritten_data_files == 3 and after.data_files == 1
    assert _codecs(table) == {"ZSTD"}
    assert after.bytes < before.bytes, (before.bytes, after.bytes)
    assert spark.conf.get(SPARK_CODEC_CONF, None) is None  # the session is as it was
