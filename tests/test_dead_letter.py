"""The dead-letter table ``{topic}__dlq``: every record tiering cannot turn into a row lands
there, with its raw payload, offset, schema id, error and publish time; the topic's offsets are
committed exactly once across the two tables; tiering never stops on bad data. Against a real
etcd (descriptors) and a real pyiceberg catalog, read back with pyiceberg."""

from __future__ import annotations

import datetime as dt
import decimal
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pyiceberg.types import DecimalType

from danube_pipeline.lake import iceberg
from danube_pipeline.lake.iceberg import commit as commit_module
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName

from tiering_helpers import PUBLISH_TIME_US, Env, avro, avro_payload, avro_records, make_env, record

TOPIC = TopicName("default", "evolving")
DLQ = ("default", "evolving__dlq")
V1 = avro({"name": "a", "type": "int"}, {"name": "flight", "type": "int"})


@pytest.fixture
def env(etcd_endpoints: list[str], tmp_path: Path) -> Env:
    return make_env(etcd_endpoints, tmp_path)


def _dlq_rows(env: Env) -> list[dict[str, Any]]:
    rows = env.catalog.load_table(DLQ).scan().to_arrow().to_pylist()
    return sorted(rows, key=lambda r: (r.get("_partition") or 0, r["_offset"]))


def _summaries(table: Any) -> list[dict[str, str]]:
    return [dict(s.summary.additional_properties) for s in table.snapshots()]


def _offsets(env: Env, topic: TopicName = TOPIC) -> tuple[list[int], list[int]]:
    main = iceberg.read_offsets(env.table(topic))
    dlq = iceberg.load_dead_letter_table(env.catalog, topic)
    return main, (iceberg.dead_letter_offsets(dlq) if dlq is not None else [])


def _assert_each_offset_once(env: Env, last: int) -> None:
    main, dead = _offsets(env)
    assert sorted(main + dead) == list(range(last + 1)), (main, dead)
    assert iceberg.duplicate_offsets(env.table(), dead_letters=iceberg.dead_letter_table_of(env.table())) == {}
    assert iceberg.committed_end_offset(env.table()) == last


@pytest.mark.integration
@pytest.mark.asyncio
async def test_each_failure_kind_lands_in_the_dead_letter_table(env: Env) -> None:
    v2 = avro({"name": "a", "type": "int"}, {"name": "flight", "type": "string"})  # int -> string
    env.registry.add_avro(1, 1, V1, subject="evolving-value")
    env.registry.add_avro(1, 2, v2, subject="evolving-value")
    env.registry.add(5, 1, "Protobuf", "no.such.Message")  # registered, but cannot be parsed
    env.registry.add(6, 1, "JsonSchema", json.dumps({"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}))
    good = avro_payload(V1, {"a": 1, "flight": 1545})
    records = [
        record(0, good, 1, 1),
        record(1, good, 99, 3),  # unknown schema id
        record(2, b"\xff\xff", 1, 1),  # corrupt: does not decode
        record(3, good + b"\x00", 1, 1),  # corrupt: a byte left over
        record(4, b"\x02", 0, 0, producer="raw-producer"),  # no schema, on a table with one
        record(5, avro_payload(v2, {"a": 5, "flight": "UA1545"}), 1, 2),  # needs schema_rewrite
        record(6, b"{}", 5, 1),  # unreadable schema
        record(7, b'{"n": "seven"}', 6, 1),  # value does not fit (JSON)
        record(8, b"{nope", 6, 1),  # corrupt JSON
        record(9, good, 1, 1),
    ]
    await env.put(records)
    report = await env.tier()
    assert report.rows_appended == 2 and report.dead_letter_records == 8
    assert report.dead_letter_table == "default.evolving__dlq"
    assert report.committed_end_offset == 9
    assert env.rows("a", "flight") == [{"_offset": 0, "a": 1, "flight": 1545}, {"_offset": 9, "a": 1, "flight": 1545}]

    dead = _dlq_rows(env)
    assert [r["_offset"] for r in dead] == [1, 2, 3, 4, 5, 6, 7, 8]
    by_offset = {r["_offset"]: r for r in dead}
    for r in dead:
        source = records[r["_offset"]]
        assert r["_payload"] == source.payload
        assert (r["_schema_id"], r["_schema_version"]) == (source.schema_id, source.schema_version)
        assert r["_publish_time"] == dt.datetime.fromtimestamp((PUBLISH_TIME_US + r["_offset"]) / 1e6, tz=dt.UTC)
        assert r["_producer_name"] == source.producer_name
    errors = {o: r["_error"] for o, r in by_offset.items()}
    assert errors[1].startswith("unknown schema: schema id 99 version 3 is not in the registry")
    assert errors[2].startswith("corrupt payload: does not decode with schema id 1 version 1 (Avro)")
    assert errors[3] == "corrupt payload: does not decode with schema id 1 version 1 (Avro): 1 bytes left over after the Avro datum"
    assert errors[4] == "raw message (no schema) on a topic with schema id 1 (subject evolving-value, version 1)"
    assert errors[5].startswith("needs schema_rewrite: schema id 1 version 2 (Avro): flight: int -> string")
    assert errors[6].startswith("unreadable schema: schema id 5 version 1 (Protobuf)")
    assert errors[7].startswith("value does not fit: n: expected an integer")
    assert errors[8].startswith("corrupt payload: does not decode with schema id 6 version 1 (JsonSchema): not JSON")
    assert {reason.value for reason in iceberg.DeadLetterReason} == {e.split(":")[0].split(" on a")[0] for e in errors.values()}

    # both snapshot summaries say how many went to the dead-letter table
    main_summary = env.table().current_snapshot().summary
    assert main_summary[iceberg.SUMMARY_DEAD_LETTER_RECORDS] == "8"
    dlq_summary = env.catalog.load_table(DLQ).current_snapshot().summary
    assert dlq_summary[iceberg.SUMMARY_DEAD_LETTER_RECORDS] == "8"
    assert dlq_summary[iceberg.SUMMARY_OBJECT_ID] == "data-0-9.dnb1"
    assert (dlq_summary[iceberg.SUMMARY_START_OFFSET], dlq_summary[iceberg.SUMMARY_END_OFFSET]) == ("0", "9")
    _assert_each_offset_once(env, 9)

    # replayed: nothing more in either table
    again = await env.tier()
    assert again.rows_appended == 0 and again.dead_letter_records == 0 and again.objects_skipped == 1
    _assert_each_offset_once(env, 9)
    assert len(env.catalog.load_table(DLQ).snapshots()) == 1


@pytest.mark.integration
@pytest.mark.asyncio
async def test_a_value_that_does_not_fit_its_column(env: Env) -> None:
    """After a rewrite made ``price`` a ``decimal(5, 2)``, a late int writer's 1234567 does not
    fit it: found by pyarrow, value by value, and only that record is dead-lettered."""
    v2 = avro({"name": "price", "type": {"type": "bytes", "logicalType": "decimal", "precision": 5, "scale": 2}})
    v1 = avro({"name": "price", "type": "int"})
    env.registry.add_avro(1, 1, v1)
    env.registry.add_avro(1, 2, v2)
    iceberg.ensure_table_for_schema(
        env.catalog, TOPIC, iceberg.writer.avro_writer(v2).iceberg_schema(),
        properties={iceberg.SCHEMA_ID_PROPERTY: "1", iceberg.SCHEMA_VERSION_PROPERTY: "2"},
    )
    assert env.table().schema().find_field("price").field_type == DecimalType(5, 2)
    await env.put(avro_records(v1, 1, [(0, {"price": 12}), (1, {"price": 1234567}), (2, {"price": 999})]))
    report = await env.tier()
    assert report.dead_letter_records == 1 and report.rows_appended == 2
    assert [r["price"] for r in env.rows("price")] == [decimal.Decimal("12.00"), decimal.Decimal("999.00")]
    (dead,) = _dlq_rows(env)
    assert dead["_offset"] == 1 and dead["_error"].startswith("value does not fit: column price (decimal(5, 2)):")
    _assert_each_offset_once(env, 2)


@pytest.mark.integration
@pytest.mark.asyncio
async def test_raw_messages_on_a_table_with_a_schema_are_never_decoded(env: Env) -> None:
    """Issue 11: in a mixed object the bytes ``\\x02`` became a row with ``a=1``; in an object of
    schema-less records only, ``_payload`` was dropped and rows of nulls were committed."""
    schema = avro({"name": "a", "type": "int"})
    env.registry.add_avro(1, 1, schema, subject="evolving-value")
    await env.put([record(0, avro_payload(schema, {"a": 5}), 1, 1), record(1, b"\x02"), record(2, avro_payload(schema, {"a": 6}), 1, 1)])
    await env.put([record(3, b"\x02"), record(4, b"raw bytes")])
    report = await env.tier()
    assert report.rows_appended == 2 and report.dead_letter_records == 3
    assert env.rows("a") == [{"_offset": 0, "a": 5}, {"_offset": 2, "a": 6}]
    assert iceberg.PAYLOAD_COLUMN not in {f.name for f in env.table().schema().fields}
    dead = _dlq_rows(env)
    assert [(r["_offset"], r["_payload"]) for r in dead] == [(1, b"\x02"), (3, b"\x02"), (4, b"raw bytes")]
    assert all(r["_error"].startswith("raw message (no schema) on a topic with schema id 1") for r in dead)
    # the object of raw records only is committed by an empty snapshot that says so
    latest = env.table().current_snapshot().summary
    assert latest[iceberg.SUMMARY_OBJECT_ID] == "data-3-4.dnb1" and latest[iceberg.SUMMARY_DEAD_LETTER_RECORDS] == "2"
    assert latest["added-records"] is None or latest["added-records"] == "0"
    _assert_each_offset_once(env, 4)


@pytest.mark.integration
@pytest.mark.asyncio
async def test_a_table_without_a_schema_keeps_every_payload(env: Env) -> None:
    """A topic whose first records had no schema has a ``_payload`` table: every record keeps
    its payload there, even one with a schema id, and nothing is dead-lettered."""
    await env.put([record(0, b"\x02"), record(1, b"raw")])
    await env.put([record(2, b"\xff", 42, 1), record(3, b"")])
    report = await env.tier()
    assert report.rows_appended == 4 and report.dead_letter_records == 0
    assert [r[iceberg.PAYLOAD_COLUMN] for r in env.rows(iceberg.PAYLOAD_COLUMN)] == [b"\x02", b"raw", b"\xff", b""]
    assert iceberg.load_dead_letter_table(env.catalog, TOPIC) is None
    assert env.registry.lookups == 0


@pytest.mark.integration
@pytest.mark.asyncio
async def test_tiering_never_wedges_and_offsets_stay_exactly_once(env: Env) -> None:
    """Objects full of bad records, one after the other: every object is committed, each
    offset once in one of the two tables; a replay appends nothing."""
    env.registry.add_avro(1, 1, V1)
    good = avro_payload(V1, {"a": 1, "flight": 2})
    objects = [
        [record(0, good, 1, 1), record(1, b"\x80", 1, 1)],
        [record(2, b"x", 77, 1), record(3, b"y", 77, 1)],  # all dead letters
        [record(4, good, 1, 1)],
        [record(5, b"", 0, 0), record(6, good, 1, 1), record(7, b"\xff" * 3, 1, 1)],
    ]
    for records in objects:
        await env.put(records)
    report = await env.tier()
    assert report.objects_appended == 4 and report.rows_appended == 3 and report.dead_letter_records == 5
    main, dead = _offsets(env)
    assert main == [0, 4, 6] and dead == [1, 2, 3, 5, 7]
    _assert_each_offset_once(env, 7)
    counts = Counter(s.get(iceberg.SUMMARY_DEAD_LETTER_RECORDS) for s in _summaries(env.table()))
    assert counts == {"1": 1, "2": 2, "0": 1}

    again = await env.tier()
    assert again.rows_appended == 0 and again.dead_letter_records == 0 and again.objects_appended == 0
    _assert_each_offset_once(env, 7)


@pytest.mark.integration
@pytest.mark.asyncio
async def test_a_stop_between_the_two_commits_commits_each_offset_once(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiering stops after the dead letters were appended and before the rows: the next run
    appends the rows and no dead letter twice, even though the registry learnt the unknown
    schema meanwhile (that record stays a dead letter, and is not also a row)."""
    env.registry.add_avro(1, 1, V1)
    good = avro_payload(V1, {"a": 1, "flight": 2})
    await env.put([record(0, good, 1, 1), record(1, good, 2, 1), record(2, b"\x80", 1, 1), record(3, good, 1, 1)])

    def stop(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("stopped between the two commits")

    monkeypatch.setattr(commit_module, "append_rows", stop)
    with pytest.raises(RuntimeError, match="between the two commits"):
        await env.tier()
    assert iceberg.dead_letter_offsets(env.catalog.load_table(DLQ)) == [1, 2]
    assert iceberg.committed_end_offset(env.table()) is None
    monkeypatch.undo()

    env.registry.add_avro(2, 1, V1)  # schema id 2 now decodes
    report = await env.tier()
    assert report.rows_appended == 2 and report.dead_letter_records == 0
    assert env.table().current_snapshot().summary[iceberg.SUMMARY_DEAD_LETTER_RECORDS] == "2"
    assert iceberg.read_offsets(env.table()) == [0, 3]
    assert iceberg.dead_letter_offsets(env.catalog.load_table(DLQ)) == [1, 2]
    _assert_each_offset_once(env, 3)


@pytest.mark.integration
@pytest.mark.asyncio
async def test_partitions_share_one_dead_letter_table(env: Env) -> None:
    parent = TopicName("default", "orders")
    async with await MetadataStore.connect(env.endpoints) as store:
        await store.put(keys.topic_root(parent), 2)
    env.registry.add_avro(1, 1, V1)
    good = avro_payload(V1, {"a": 1, "flight": 2})
    parts = [TopicName("default", f"orders-part-{i}") for i in range(2)]
    await env.put([record(0, good, 1, 1), record(1, b"bad", 1, 1)], topic=parts[0])
    await env.put([record(0, b"bad", 1, 1), record(1, good, 1, 1), record(2, b"raw")], topic=parts[1])
    reports = [await env.tier(p) for p in parts]
    assert [r.dead_letter_records for r in reports] == [1, 2]
    assert {r.dead_letter_table for r in reports} == {"default.orders__dlq"}
    dlq = env.catalog.load_table(("default", "orders__dlq"))
    assert "_partition" in {f.name for f in dlq.schema().fields}
    rows = sorted((r["_partition"], r["_offset"]) for r in dlq.scan().to_arrow().to_pylist())
    assert rows == [(0, 1), (1, 0), (1, 2)]
    for i, p in enumerate(parts):
        assert iceberg.committed_end_offset(dlq, partition=i) == (1 if i == 0 else 2)
        main = iceberg.read_offsets(env.table(parent), partition=i)
        assert sorted(main + iceberg.dead_letter_offsets(dlq, partition=i)) == list(range(2 if i == 0 else 3))
    assert iceberg.duplicate_offsets(env.table(parent), partition=1, dead_letters=dlq) == {}
    again = [await env.tier(p) for p in parts]
    assert [r.dead_letter_records for r in again] == [0, 0]


@pytest.mark.integration
@pytest.mark.asyncio
async def test_a_first_object_of_unknown_schemas_still_makes_a_table_with_a_schema(env: Env) -> None:
    """The table's records carry a schema id the registry does not know yet: the table is made
    with the metadata columns only (not ``_payload``), and the first known version adds its
    columns."""
    await env.put([record(0, b"\x02", 3, 1), record(1, b"\x04", 3, 1)])
    first = await env.tier()
    assert first.dead_letter_records == 2 and first.committed_end_offset == 1
    assert [f.name for f in env.table().schema().fields] == list(iceberg.METADATA_COLUMNS)
    schema = avro({"name": "a", "type": "int"})
    env.registry.add_avro(3, 2, schema)
    await env.put(avro_records(schema, 2, [(2, {"a": 1})], schema_id=3))
    second = await env.tier()
    assert second.rows_appended == 1 and second.schema_changes == ["add optional column a int"]
    assert env.rows("a") == [{"_offset": 2, "a": 1}]
    _assert_each_offset_once(env, 2)


@pytest.mark.unit
def test_a_topic_named_like_a_dead_letter_table_is_refused(tmp_path: Path) -> None:
    from danube_pipeline.errors import InvalidNameError

    catalog = iceberg.load_catalog(name="danube", uri=f"sqlite:///{tmp_path / 'c.db'}", warehouse=(tmp_path / "w").as_uri())
    iceberg.ensure_table(catalog, TopicName("default", "evolving__dlq"), None)  # a topic's own table
    with pytest.raises(InvalidNameError, match="not the dead-letter table of /default/evolving"):
        iceberg.ensure_dead_letter_table(catalog, TOPIC)
    assert iceberg.dead_letter_table_of(iceberg.ensure_table(catalog, TOPIC, None)) is None


@pytest.mark.unit
def test_dead_letter_schema() -> None:
    assert [f.name for f in iceberg.dead_letter_schema().fields] == [
        "_offset", "_publish_time", "_producer_name", "_schema_id", "_schema_version", "_payload", "_error",
    ]
    partitioned = iceberg.dead_letter_schema(partitioned=True)
    assert [f.name for f in partitioned.fields][5:] == ["_partition", "_payload", "_error"]
    assert partitioned.find_field("_offset").required
