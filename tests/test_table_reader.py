"""Reading a topic's history back from its Iceberg table (``danube_pipeline.storage.table_reader``).

The tables are made by the real commit path: segment objects with their descriptors in etcd,
tiered by ``commit_objects_to_table`` into a SQLite catalog (``tiering_helpers.make_env``), with
the table layout's ``raw_payload`` on (``docs/etcd-layout.md`` §3.9) unless a test says
otherwise. Compaction and a ``schema_rewrite`` run in the session's Spark.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import RegisterCatalog
from pyiceberg.io.pyarrow import ArrowScan
from pyiceberg.table import Table
from pyiceberg.table.snapshots import Operation
from tiering_helpers import Env, avro, avro_payload, make_env

from danube_pipeline.errors import TableReadError
from danube_pipeline.format.records import Record
from danube_pipeline.lake import iceberg
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.partitions import partition_name
from danube_pipeline.storage import table_reader
from danube_pipeline.storage.table_reader import TableRead, TableReader

SCHEMA = avro({"name": "n", "type": "long"}, {"name": "s", "type": "string"})
DAY0 = dt.datetime(2026, 3, 1, tzinfo=dt.UTC)
BIG_PRODUCER_ID = 2**63 + 9
"""A u64 producer id with the top bit set: stored as a negative int64, read back as is."""


def _us(when: dt.datetime) -> int:
    return int(when.timestamp() * 1_000_000)


def _record(offset: int, payload: bytes, schema_id: int, *, publish_time_us: int | None = None) -> Record:
    return Record(
        offset=offset,
        publish_time_us=_us(DAY0) + offset * 1_000 if publish_time_us is None else publish_time_us,
        producer_id=BIG_PRODUCER_ID + offset % 2,
        producer_name=f"producer-{offset % 3}",
        schema_id=schema_id,
        schema_version=1 if schema_id else 0,
        payload=payload,
        attributes={"i": str(offset), "é": "ü" * (offset % 4)} if offset % 5 else {},
        key=(None, "", f"key-{offset}")[offset % 3],
    )


def _good(offset: int, **kwargs: Any) -> Record:
    return _record(offset, avro_payload(SCHEMA, {"n": offset, "s": f"row {offset}"}), 1, **kwargs)


def _corrupt(offset: int, **kwargs: Any) -> Record:
    """A dead letter: bytes that do not decode with the writer schema."""
    return _record(offset, b"\xff" * (offset % 7 + 1), 1, **kwargs)


def _raw(offset: int, **kwargs: Any) -> Record:
    """A dead letter on a topic with a schema: no schema."""
    return _record(offset, f"raw {offset}".encode(), 0, **kwargs)


class _Topic:
    """One topic's objects and table: ``put`` writes a segment object, ``tier`` commits."""

    def __init__(self, env: Env, topic: TopicName) -> None:
        self.env = env
        self.topic = topic
        self.records: list[Record] = []

    def put(self, records: list[Record]) -> None:
        asyncio.run(self.env.put(records, self.topic, batches=True))  # format version 2: keys kept
        self.records.extend(records)

    def tier(self) -> None:
        asyncio.run(self.env.tier(self.topic))

    def layout(self, *, raw_payload: bool) -> None:
        async def put() -> None:
            async with await MetadataStore.connect(self.env.endpoints) as store:
                await store.put(keys.topic_table(self.topic), {"partition_transform": "day", "raw_payload": raw_payload})

        asyncio.run(put())

    def table(self) -> Table:
        table: Table = self.env.table(self.topic)
        return table

    def current(self) -> int:
        """The table's current snapshot id."""
        snapshot = self.table().current_snapshot()
        assert snapshot is not None
        return snapshot.snapshot_id

    def reader(self) -> TableReader:
        return TableReader(self.env.catalog, iceberg.table_identifier(self.topic))

    def read_all(self, *, max_records: int, after: int | None = None, start: int = 0) -> tuple[list[Record], int | None]:
        """Read in steps of ``max_records`` from ``start`` to the end, each read after the
        previous one's snapshot; the records and the last snapshot."""
        out: list[Record] = []
        offset = start
        while True:
            got = self.reader().read(offset, max_records=max_records, after_snapshot_id=after)
            assert got.complete, got
            assert len(got.records) <= max_records
            out.extend(got.records)
            after, offset = got.snapshot_id, got.next_offset
            if not got.records:
                return out, after


@pytest.fixture
def topic(etcd_endpoints: list[str], tmp_path: Path, request: pytest.FixtureRequest) -> _Topic:
    env = make_env(etcd_endpoints, tmp_path)
    env.registry.add_avro(1, 1, SCHEMA)
    t = _Topic(env, TopicName("default", "reader_" + request.node.name.replace("[", "_").rstrip("]")[5:40]))
    t.layout(raw_payload=True)
    return t


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str]]]:
    """``(kind, table name)`` of every scan the reader starts: ``"incremental"`` or ``"full"``."""
    seen: list[tuple[str, str]] = []
    full, incremental = Table.scan, Table.incremental_append_scan

    def spy_full(self: Table, *args: Any, **kwargs: Any) -> Any:
        seen.append(("full", self.name()[-1]))
        return full(self, *args, **kwargs)

    def spy_incremental(self: Table, *args: Any, **kwargs: Any) -> Any:
        seen.append(("incremental", self.name()[-1]))
        return incremental(self, *args, **kwargs)

    monkeypatch.setattr(Table, "scan", spy_full)
    monkeypatch.setattr(Table, "incremental_append_scan", spy_incremental)
    yield seen


pytestmark = pytest.mark.integration


def test_a_full_read_gives_every_record_byte_for_byte_with_dead_letters_merged(topic: _Topic) -> None:
    """Rows and dead letters (a corrupt payload, a raw message on a topic with a schema), over
    three objects: one read returns every offset, equal to the source records in every field
    the WAL has, the routing key included (absent, empty or set)."""
    topic.put([_good(0), _good(1), _corrupt(2), _good(3), _raw(4)])
    topic.put([_good(5), _raw(6), _good(7)])
    topic.put([_corrupt(8), _good(9), _good(10)])
    topic.tier()
    dead = topic.env.catalog.load_table(("default", topic.topic.topic + "__dlq")).scan().to_arrow()
    assert sorted(dead["_offset"].to_pylist()) == [2, 4, 6, 8]

    got = topic.reader().read(0, max_records=1000)
    assert got.records == topic.records
    assert (got.next_offset, got.complete, got.snapshot_id) == (11, True, topic.current())
    assert [r.producer_id for r in got.records[:2]] == [BIG_PRODUCER_ID, BIG_PRODUCER_ID + 1]
    assert topic.reader().committed_end_offset() == 10

    middle = topic.reader().read(4, max_records=3)  # a window starting on a dead letter
    assert middle.records == topic.records[4:7] and middle.complete and middle.next_offset == 7
    beyond = topic.reader().read(11, max_records=5)
    assert (beyond.records, beyond.next_offset, beyond.complete) == ([], 11, True)


def test_a_topic_without_a_schema_reads_from_its_payload_column(topic: _Topic) -> None:
    """A payload table keeps the bytes in ``_payload`` (no ``_raw_payload``), and the routing
    key in ``_key`` once the layout's ``raw_payload`` is on; rows written before, whose key the
    table does not know, make the read incomplete."""
    topic.layout(raw_payload=False)
    topic.put([_raw(o) for o in range(3)])
    topic.tier()
    assert topic.reader().read(0, max_records=10) == TableRead([], None, 0, False)
    topic.layout(raw_payload=True)
    topic.put([_raw(o) for o in range(3, 6)])
    topic.put([_raw(o) for o in range(6, 9)])
    topic.tier()
    names = [f.name for f in topic.table().schema().fields]
    assert "_raw_payload" not in names and names[-1] == "_key"
    records, _ = topic.read_all(max_records=4, start=3)
    assert records == topic.records[3:]


def test_incremental_reads_return_only_the_new_offsets(topic: _Topic, scans: list[tuple[str, str]]) -> None:
    """Each read hands back a snapshot; the next read after it plans only later appends and
    returns exactly the offsets committed since, in reads cut short by ``max_records``."""
    topic.put([_good(o) for o in range(0, 4)])
    topic.put([_good(4), _corrupt(5), _good(6)])
    topic.tier()
    first, snapshot = topic.read_all(max_records=3)
    assert first == topic.records and snapshot == topic.current()

    topic.put([_good(o) for o in range(7, 12)])
    topic.put([_raw(12), _good(13)])
    topic.tier()
    scans.clear()
    cut = topic.reader().read(7, max_records=3, after_snapshot_id=snapshot)
    assert cut.records == topic.records[7:10] and cut.complete
    assert ("incremental", topic.topic.topic) in scans and ("full", topic.topic.topic) not in scans
    # cut inside an append: the snapshot handed back is one whose rows are all below 10
    assert cut.snapshot_id == snapshot
    second, last = topic.read_all(max_records=3, after=cut.snapshot_id, start=cut.next_offset)
    assert second == topic.records[10:]
    assert last == topic.current()
    assert ("full", topic.topic.topic) not in scans

    # a snapshot that does not fit the offset (rows at or above it are older): a full scan
    scans.clear()
    again = topic.reader().read(2, max_records=4, after_snapshot_id=last)
    assert again.records == topic.records[2:6] and ("full", topic.topic.topic) in scans


@pytest.mark.spark
def test_compaction_and_a_schema_rewrite_between_reads_neither_repeat_nor_skip(
    topic: _Topic, spark_on_catalog: RegisterCatalog
) -> None:
    """``replace`` snapshots (Spark's ``rewrite_data_files``; a ``schema_rewrite`` of ``n``
    from long to string) bring no new offsets: reads before and after them, cut inside
    appends, return every offset exactly once, byte for byte."""
    from danube_pipeline.lake import rewrite
    from danube_pipeline.lake.spark.procedures import compact_table

    for first in range(0, 12, 4):
        topic.put([_good(first), _corrupt(first + 1), _good(first + 2), _good(first + 3)])
    topic.tier()
    before = topic.reader().read(0, max_records=6)
    assert before.records == topic.records[:6] and before.complete

    topic.put([_good(o) for o in range(12, 16)])
    topic.tier()
    root = topic.env.catalog.properties["uri"].removeprefix("sqlite:///")
    spark = spark_on_catalog(name="danube", uri=f"sqlite:///{root}", warehouse=topic.env.catalog.properties["warehouse"])
    result = compact_table(spark, topic.topic, catalog_name="danube", rewrite_all=True)
    assert result.rewritten_data_files >= 4 and result.data_files_after == 1
    table = topic.table()
    current = table.current_snapshot()
    assert current is not None and current.summary is not None and current.summary.operation == Operation.REPLACE

    rest, last = topic.read_all(max_records=5, after=before.snapshot_id, start=before.next_offset)
    assert rest == topic.records[6:]
    assert last == current.snapshot_id  # the replace snapshot, once every offset is read

    topic.put([_good(16), _raw(17)])
    topic.tier()
    new = topic.reader().read(16, max_records=10, after_snapshot_id=last)
    assert new.records == topic.records[16:] and new.complete

    middle = topic.reader().read(0, max_records=9)
    rewrite.set_rewrite_spec(
        topic.table(), {"version": 2, "columns": {"n": {"type": "string", "expr": "CAST(n AS STRING)"}}}
    )
    report = rewrite.rewrite_table(spark, topic.env.catalog, topic.topic, catalog_name="danube")
    assert report.finalized and str(topic.table().schema().find_field("n").field_type) == "string"
    after_rewrite = topic.table().current_snapshot()
    assert after_rewrite is not None and after_rewrite.summary is not None
    assert after_rewrite.summary.operation != Operation.APPEND
    topic.put([_good(18), _good(19)])  # written as long: dead letters now ("needs schema_rewrite")
    topic.tier()
    rest, _ = topic.read_all(max_records=4, after=middle.snapshot_id, start=middle.next_offset)
    assert rest == topic.records[9:]
    everything, _ = topic.read_all(max_records=7)
    assert everything == topic.records


def test_an_expired_snapshot_falls_back_to_the_offset_scan(topic: _Topic, scans: list[tuple[str, str]]) -> None:
    """The snapshot handed back by a read, expired with its child (so it is no parent of any
    snapshot left): the next read plans the whole table, filtered on ``_offset``."""
    for first in range(0, 9, 3):
        topic.put([_good(o) for o in range(first, first + 3)])
        topic.tier()
    history = [s.snapshot_id for s in topic.table().snapshots()]
    assert len(history) == 3
    got = topic.reader().read(0, max_records=3)
    assert got.snapshot_id == history[0] and got.next_offset == 3

    topic.table().maintenance.expire_snapshots().by_ids(history[:2]).commit()
    assert [s.snapshot_id for s in topic.table().snapshots()] == history[2:]
    scans.clear()
    rest = topic.reader().read(3, max_records=100, after_snapshot_id=got.snapshot_id)
    assert rest.records == topic.records[3:] and rest.complete
    assert ("full", topic.topic.topic) in scans and ("incremental", topic.topic.topic) not in scans
    assert rest.snapshot_id == history[2]


def test_first_offset_at_reads_one_file_over_several_days(topic: _Topic, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five days, one object (one data file) each: a time inside day 3 reads one file; times
    between messages, before the first and after the last; a dead letter counts."""
    per_day = 4
    for day in range(5):
        base = _us(DAY0 + dt.timedelta(days=day, hours=2))
        offsets = range(day * per_day, (day + 1) * per_day)
        make = [_good, _good, _corrupt, _good]
        topic.put([make[i](o, publish_time_us=base + i * 1_000_000) for i, o in enumerate(offsets)])
    topic.tier()
    assert len(topic.table().inspect.files()) == 5

    read_files: list[str] = []
    class CountingScan(ArrowScan):
        def to_table(self, tasks: Any) -> Any:
            tasks = list(tasks)
            read_files.extend(t.file.file_path for t in tasks)
            return super().to_table(tasks)

    monkeypatch.setattr(table_reader, "ArrowScan", CountingScan)
    by_offset = {r.offset: r.publish_time_us for r in topic.records}
    reader = topic.reader()
    assert reader.first_offset_at(by_offset[13]) == 13
    assert len([f for f in read_files if "__dlq" not in f]) == 1
    assert reader.first_offset_at(by_offset[13] + 1) == 14  # between 13 and 14: a dead letter
    assert reader.first_offset_at(by_offset[9]) == 9
    assert reader.first_offset_at(0) == 0
    assert reader.first_offset_at(by_offset[19]) == 19
    assert reader.first_offset_at(by_offset[19] + 1) is None


def test_rows_without_raw_bytes_make_the_read_incomplete_at_the_right_offset(topic: _Topic) -> None:
    """Rows written while ``raw_payload`` was off have no bytes: a read stops before the
    first of them with ``complete=False``; the rows written with it on read byte for byte."""
    topic.layout(raw_payload=False)
    topic.put([_good(0), _good(1), _good(2), _corrupt(3)])
    topic.tier()
    assert "_raw_payload" not in {f.name for f in topic.table().schema().fields}
    none = topic.reader().read(0, max_records=10)
    assert (none.records, none.next_offset, none.complete) == ([], 0, False)
    # a dead letter written then has its bytes but not its key, producer id and attributes
    assert topic.reader().read(3, max_records=10) == TableRead([], None, 3, False)

    topic.layout(raw_payload=True)
    topic.put([_good(4), _corrupt(5), _good(6)])
    topic.tier()
    topic.layout(raw_payload=False)
    topic.put([_good(7), _good(8)])
    topic.tier()
    assert topic.reader().read(2, max_records=10) == TableRead([], None, 2, False)
    got = topic.reader().read(4, max_records=10)
    assert got.records == topic.records[4:7]
    assert (got.next_offset, got.complete) == (7, False)


def test_unreadable_tables_raise_a_typed_error_and_a_missing_table_reads_empty(topic: _Topic) -> None:
    """No table: nothing covered. A deleted data file: retriable. A plain table read as a
    partition: not retriable."""
    assert topic.reader().committed_end_offset() is None
    assert topic.reader().read(0, max_records=5) == TableRead([], None, 0, True)
    assert topic.reader().first_offset_at(0) is None

    topic.put([_good(o) for o in range(3)])
    topic.tier()
    with pytest.raises(TableReadError) as wrong:
        TableReader(topic.env.catalog, iceberg.table_identifier(topic.topic), partition=1).read(0, max_records=5)
    assert not wrong.value.retriable
    [path] = topic.table().inspect.files()["file_path"].to_pylist()
    os.remove(path.removeprefix("file://"))
    with pytest.raises(TableReadError) as gone:
        topic.reader().read(0, max_records=5)
    assert gone.value.retriable and gone.value.table == f"default.{topic.topic.topic}"


def test_each_partition_reads_its_own_offsets_from_the_shared_table(topic: _Topic) -> None:
    """The partitions ``{topic}-part-{i}`` append to the partitioned topic's one table, each
    with its own offsets (``docs/etcd-layout.md`` §3.1): a reader per partition returns only
    its rows and dead letters, and other partitions' appends never stand for its snapshots."""
    parent = topic.topic
    parts = [_Topic(topic.env, partition_name(parent, i)) for i in range(2)]

    async def make_partitioned() -> None:
        async with await MetadataStore.connect(topic.env.endpoints) as store:
            await store.put(keys.topic_root(parent), 2)

    asyncio.run(make_partitioned())
    parts[0].put([_good(0), _corrupt(1)])
    parts[0].tier()
    first = topic.current()
    parts[1].put([_good(0), _good(1)])
    parts[1].tier()
    parts[0].put([_good(2), _good(3), _good(4)])
    parts[0].tier()
    readers = [TableReader(topic.env.catalog, iceberg.table_identifier(parent), partition=i) for i in range(2)]
    assert [r.committed_end_offset() for r in readers] == [4, 1]
    zero = readers[0].read(0, max_records=3)
    assert zero.records == parts[0].records[:3] and zero.next_offset == 3
    assert zero.snapshot_id == first  # partition 0's append below offset 3, not partition 1's
    one = readers[1].read(0, max_records=10)
    assert one.records == parts[1].records and one.complete
    rest = readers[0].read(3, max_records=10, after_snapshot_id=zero.snapshot_id)
    assert rest.records == parts[0].records[3:] and rest.snapshot_id == topic.current()
    assert readers[0].first_offset_at(parts[0].records[3].publish_time_us) == 3
    with pytest.raises(TableReadError, match="one partition at a time"):
        topic.reader().read(0, max_records=1)
