"""The pieces of the table read path that need no process: the values of its etcd keys
(``docs/etcd-layout.md`` §3.5.1, §3.10), the broker setting, and table records framed back
into stored batches that hold exactly the records (checked with the batch format's own CRC and
decoder)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest

from broker.config import BrokerConfig
from broker.config_file import load_config_file
from broker.storage.table_reads import BATCH_RECORDS, records_to_batches
from danube_pipeline.client.consumer import start_publish_time_us_of
from danube_pipeline.format import batches
from danube_pipeline.format.records import Record
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.values import TableSnapshot, TopicReadPath
from danube_pipeline.names import TopicName

pytestmark = pytest.mark.unit


def record(offset: int, *, producer: str = "p", time_us: int = 1_700_000_000_000_000, **extra: Any) -> Record:
    return Record(
        offset=offset, publish_time_us=time_us + offset, producer_id=7 if producer == "p" else 9,
        producer_name=producer, schema_id=3, schema_version=1, payload=f"payload {offset}".encode(), **extra,
    )


def test_the_keys_sit_beside_the_cursor_and_under_the_topic() -> None:
    topic = TopicName("default", "flights")
    assert keys.topic_read_path(topic) == "/topics/default/flights/read_path"
    assert keys.subscription_table_snapshot(topic, "s") == "/topics/default/flights/subscriptions/s/table_snapshot"
    assert keys.subscription_cursor(topic, "s").rsplit("/", 1)[0] == keys.subscription_table_snapshot(topic, "s").rsplit("/", 1)[0]


def test_values_round_trip_and_refuse_what_is_not_documented() -> None:
    assert TopicReadPath.from_json({"cold_read_path": "auto"}).to_json() == {"cold_read_path": "auto"}
    assert TopicReadPath.from_json({}).cold_read_path == "objects"
    with pytest.raises(ValueError, match="cold_read_path"):
        TopicReadPath.from_json({"cold_read_path": "table"})
    snapshot = TableSnapshot(snapshot_id=5188167221738153651, offset=12000)
    assert list(snapshot.to_json()) == ["snapshot_id", "offset"]
    assert TableSnapshot.from_json(snapshot.to_json()) == snapshot
    for bad in ({"snapshot_id": 1}, {"snapshot_id": "1", "offset": 0}, {"snapshot_id": 1, "offset": -1}, {"snapshot_id": True, "offset": 0}):
        with pytest.raises(ValueError):
            TableSnapshot.from_json(bad)


def test_the_broker_setting_defaults_to_objects_and_comes_from_the_file(tmp_path: Path) -> None:
    assert BrokerConfig(data_dir=tmp_path).cold_read_path == "objects"
    with pytest.raises(ValueError, match="cold_read_path"):
        BrokerConfig(data_dir=tmp_path, cold_read_path="table")
    file = tmp_path / "broker.yml"
    file.write_text("cold_read_path: iceberg\n")
    assert load_config_file(file) == {"cold_read_path": "iceberg"}
    example = Path(__file__).resolve().parents[1] / "docs" / "danube_broker.example.yml"
    assert load_config_file(example)["cold_read_path"] == "objects"


def test_records_become_batches_holding_exactly_them() -> None:
    records = [record(o) for o in range(100, 100 + 2 * BATCH_RECORDS + 5)]
    records.append(record(records[-1].offset + 1, time_us=1_600_000_000_000_000))  # the clock stepped back
    records += [record(o, producer="q", attributes={"a": "1", "b": ""}, key="k") for o in range(records[-1].offset + 1, records[-1].offset + 4)]
    framed = records_to_batches(records)
    assert [b.record_count for b in framed] == [BATCH_RECORDS, BATCH_RECORDS, 5, 1, 3]
    decoded: list[Record] = []
    expected_base = records[0].offset
    for batch in framed:
        assert batch.base_offset == expected_base
        assert batches.crc_matches(batch.data, 0, len(batch.data))
        batches.validate_batch(batch.data)
        decoded.extend(batches.batch_records(batch.data))
        expected_base = batch.last_offset + 1
    assert [(r.offset, r.payload, dict(r.attributes), r.key, r.publish_time_us, r.producer_id, r.producer_name,
             r.schema_id, r.schema_version) for r in decoded] == [
        (r.offset, r.payload, dict(r.attributes), r.key, r.publish_time_us, r.producer_id, r.producer_name,
         r.schema_id, r.schema_version) for r in records
    ]  # fmt: skip


def test_a_start_publish_time_is_given_once_and_with_a_time_zone() -> None:
    at = datetime.datetime(2026, 11, 26, 12, 0, 0, 123456, tzinfo=datetime.timezone.utc)
    assert start_publish_time_us_of(None, at) == int(at.timestamp()) * 1_000_000 + 123456
    assert start_publish_time_us_of(5, None) == 5
    assert start_publish_time_us_of(None, None) is None
    with pytest.raises(ValueError, match="not both"):
        start_publish_time_us_of(5, at)
    with pytest.raises(ValueError, match="timezone"):
        start_publish_time_us_of(None, at.replace(tzinfo=None))
