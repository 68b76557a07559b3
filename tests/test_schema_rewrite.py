"""The schema-evolved rewrite (``danube_pipeline.lake.rewrite`` and the ``schema_rewrite`` asset)
against a real local Spark session and the real SQL catalog.

Tables are written the way tiering writes them (``iceberg.ensure_table`` and
``iceberg.append_records``: one snapshot per segment object), with version 1 of a flights
schema (``flight`` an int, ``route`` ``"JFK-LAX"``), over days in November 2026. The run's
one Spark session (``conftest.py``) serves the module, on its own catalog. The interruption is
injected with ``rewrite_table``'s ``after_unit`` hook: it raises right after the first
partition's commit, where a crash of the run would leave the table.
"""

from __future__ import annotations

import datetime as dt
import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fastavro
import pytest
from dagster import AssetKey, DagsterInstance, MultiPartitionKey, MultiPartitionsDefinition, materialize
from helpers import RegisterCatalog
from pyiceberg.catalog.sql import SqlCatalog

from assets.assets import schema_rewrite
from assets.definitions import defs
from assets.partitions import TOPICS_PARTITIONS_NAME
from assets.resources import EtcdResource, IcebergCatalogResource, SparkResource
from danube_pipeline.lake import iceberg
from danube_pipeline.lake import rewrite as rw
from danube_pipeline.lake.rewrite.shape import RewriteShape
from danube_pipeline.lake.iceberg.layout import apply_layout
from danube_pipeline.metadata.values import TableLayout
from danube_pipeline.names import TopicName
from danube_pipeline.format.records import Record
from danube_pipeline.lake.spark.checksums import RowChecksum, row_checksum
from danube_pipeline.lake.spark.procedures import compact_table, spark_table_name

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

CATALOG = "rewrite"
DAY0 = dt.date(2026, 11, 18)
V1: dict[str, Any] = {
    "type": "record",
    "name": "Flight",
    "fields": [
        {"name": "carrier", "type": "string"},
        {"name": "flight", "type": "int"},
        {"name": "route", "type": "string"},
        {"name": "dep_delay", "type": ["null", "double"]},
    ],
}
CARRIERS = ("UA", "AA", "DL")
ROUTES = ("JFK-LAX", "EWR-SFO", "LGA-ORD")
UNTOUCHED = (
    "_offset",
    "_publish_time",
    "_producer_id",
    "_producer_name",
    "_schema_id",
    "_schema_version",
    "_attributes",
    "carrier",
    "dep_delay",
)
TO_STRING: dict[str, Any] = {"version": 2, "columns": {"flight": {"type": "string", "expr": "CAST(flight AS STRING)"}}}


@dataclass
class Env:
    uri: str
    warehouse: str
    catalog: SqlCatalog
    spark: SparkSession


@pytest.fixture(scope="session")
def rewrite_catalog(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, SqlCatalog]:
    """The module's SQLite catalog, shared by its tests: ``(uri, warehouse, catalog)``."""
    root = tmp_path_factory.mktemp("rewrite-iceberg")
    uri, warehouse = f"sqlite:///{root / 'catalog.db'}", (root / "warehouse").as_uri()
    return uri, warehouse, iceberg.load_catalog(name=CATALOG, uri=uri, warehouse=warehouse)


@pytest.fixture
def rewrite_spark(rewrite_catalog: tuple[str, str, SqlCatalog], spark_on_catalog: RegisterCatalog) -> Env:
    """The module's catalog with the run's Spark session on it."""
    uri, warehouse, catalog = rewrite_catalog
    return Env(uri, warehouse, catalog, spark_on_catalog(name=CATALOG, uri=uri, warehouse=warehouse))


# --------------------------------------------------------------------------- helpers


def _day_start_us(day_index: int) -> int:
    return rw.day_bounds_us(DAY0 + dt.timedelta(days=day_index))[0]


def _records(first: int, count: int, day_index: int) -> list[Record]:
    parsed = fastavro.parse_schema(V1)
    out = []
    for i in range(first, first + count):
        buf = io.BytesIO()
        value = {
            "carrier": CARRIERS[i % 3],
            "flight": 100 + i,
            "route": ROUTES[i % 3],
            "dep_delay": None if i % 5 == 0 else i * 1.5,
        }
        fastavro.schemaless_writer(buf, parsed, value)
        publish_us = _day_start_us(day_index) + 3_600_000_000 + (i - first) * 60_000_000
        out.append(Record(i, publish_us, 7, "flights-test", 1, 1, buf.getvalue(), {"k": str(i)}))
    return out


def _flights_table(
    env: Env, name: str, days: tuple[int, ...], *, per_object: int = 10, objects_per_day: int = 2, by_day: bool = False
) -> TopicName:
    """A table tiered with v1 records: ``objects_per_day`` appends of ``per_object`` rows per
    day of ``days`` (day indexes from DAY0).

    The table is created unpartitioned (spec 0), as tables were before they were partitioned
    by time; with ``by_day`` it is then evolved to ``day(_publish_time)`` (spec 1,
    :func:`danube_pipeline.lake.iceberg.layout.apply_layout`) before the appends."""
    topic = TopicName("default", name)
    table = iceberg.ensure_table(env.catalog, topic, V1, layout=TableLayout("none"))
    if by_day:
        apply_layout(table)
    offset = 0
    for day in days:
        for _ in range(objects_per_day):
            records = _records(offset, per_object, day)
            iceberg.append_records(table, records, V1, f"data-{offset}-{offset + per_object - 1}.dnb1")
            offset += per_object
    return topic


def _table(env: Env, topic: TopicName) -> Any:
    return env.catalog.load_table(iceberg.table_identifier(topic))


def _name(topic: TopicName) -> str:
    return spark_table_name(topic, CATALOG)


def _checksum(env: Env, topic: TopicName, columns: tuple[str, ...] = UNTOUCHED) -> RowChecksum:
    return row_checksum(env.spark.table(_name(topic)), list(columns))


def _norm(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return round(value.timestamp() * 1_000_000)
    if isinstance(value, dict):
        return tuple(sorted(value.items()))
    if isinstance(value, list):  # pyarrow maps come back as [(key, value), ...]
        return tuple(sorted(tuple(kv) for kv in value))
    return value


def _rows_pyiceberg(env: Env, topic: TopicName, columns: tuple[str, ...]) -> list[tuple[Any, ...]]:
    rows = _table(env, topic).scan(selected_fields=columns).to_arrow().to_pylist()
    return sorted(tuple(_norm(r[c]) for c in columns) for r in rows)


def _rows_spark(env: Env, topic: TopicName, columns: tuple[str, ...]) -> list[tuple[Any, ...]]:
    select = ", ".join(
        f"unix_micros(`{c}`) AS `{c}`" if c == "_publish_time" else f"`{c}`" for c in columns
    )
    rows = env.spark.sql(f"SELECT {select} FROM {_name(topic)}").collect()
    return sorted(tuple(_norm(r[c]) for c in columns) for r in rows)


def _rewrite_snapshots(env: Env, topic: TopicName) -> list[Any]:
    return [
        s
        for s in _table(env, topic).snapshots()
        if s.summary is not None and s.summary.get(rw.SUMMARY_REWRITE_VERSION) is not None
    ]


def _current_snapshot_id(env: Env, topic: TopicName) -> int:
    snapshot = _table(env, topic).current_snapshot()
    assert snapshot is not None
    return int(snapshot.snapshot_id)


def _files(env: Env, topic: TopicName) -> dict[str, str]:
    """Live data file path → its partition, ``name=value`` (``""`` unpartitioned)."""
    rows = _table(env, topic).inspect.files().to_pylist()
    return {
        str(r["file_path"]): ",".join(f"{k}={v}" for k, v in sorted((r["partition"] or {}).items()))
        for r in rows
    }


def _data_dir(env: Env, topic: TopicName) -> Path:
    return Path(_table(env, topic).location().removeprefix("file:")) / "data"


def _run(env: Env, topic: TopicName, **kwargs: Any) -> rw.RewriteReport:
    return rw.rewrite_table(env.spark, env.catalog, topic, catalog_name=CATALOG, **kwargs)


# --------------------------------------------------------------------------- unit


@pytest.mark.unit
def test_spec_parsing_and_its_errors() -> None:
    spec = rw.RewriteSpec.from_json(
        '{"version": 3, "columns": {"flight": {"type": "string"}, "fare": {"type": "decimal(10, 2)", "expr": "fare_cents / 100"}},'
        ' "drop": ["fare_cents"], "where": "_schema_version < 3",'
        ' "partition_spec": [{"source": "_publish_time", "transform": "day"}, {"source": "carrier", "transform": "bucket[4]"}]}'
    )
    assert spec.version == 3 and spec.drop == ("fare_cents",) and spec.where == "_schema_version < 3"
    flight = spec.column("flight")
    assert flight is not None and flight.expr == "CAST(`flight` AS STRING)"  # the default expression
    fare = spec.column("fare")
    assert fare is not None and str(fare.type) == "decimal(10, 2)"
    assert spec.partition_spec is not None
    assert [(f.source, f.transform, f.name) for f in spec.partition_spec] == [
        ("_publish_time", "day", "_publish_time_day"),
        ("carrier", "bucket[4]", "carrier_bucket_4"),
    ]
    assert rw.RewriteSpec.from_json(spec.to_json()) == spec
    assert rw.RewriteSpec.from_json(spec.to_json()).digest() == spec.digest()

    bad = {
        '{"columns": {"a": {"type": "string"}}}': "version",
        '{"version": 0, "columns": {"a": {"type": "string"}}}': "version",
        '{"version": 1, "columns": {"a": {"type": "text"}}}': "columns.a.type",
        '{"version": 1, "columns": {"a": {"type": "list<int>"}}}': "columns.a.type",
        '{"version": 1, "columns": {"a": {"type": "time"}}}': "columns.a.type",
        '{"version": 1, "columns": {"a": {"type": "string", "expr": ""}}}': "columns.a.expr",
        '{"version": 1, "columns": {"_rewrite_version": {"type": "int"}}}': "columns._rewrite_version",
        '{"version": 1, "columns": {"a": {"type": "string"}}, "drop": ["a"]}': "drop",
        '{"version": 1, "columns": {}}': "nothing to do",
        '{"version": 1, "columns": {"a": {"type": "string"}}, "colums": {}}': "unknown keys",
        '{"version": 1, "partition_spec": [{"source": "x", "transform": "days"}]}': "partition_spec[0].transform",
        "not json": "not JSON",
    }
    for text, field in bad.items():
        with pytest.raises(rw.RewriteSpecError) as caught:
            rw.RewriteSpec.from_json(text, table="default.flights")
        assert field in str(caught.value) and caught.value.table == "default.flights", text


@pytest.mark.unit
def test_units_group_files_by_partition_and_keep_the_days_files() -> None:
    day = _day_start_us(0)
    hour = 3_600_000_000

    def stats(path: str, lo: int | None, hi: int | None, partition: str = "", spec_id: int = 0) -> rw.DataFileStats:
        return rw.DataFileStats(path, spec_id, partition, 10, 1000, lo, hi)

    files = [
        stats("a", day + hour, day + 2 * hour),  # inside day 0
        stats("b", day - hour, day + hour),  # straddles day -1 / day 0
        stats("c", day + 25 * hour, day + 26 * hour),  # day 1
        stats("d", None, None),  # no bounds: every day's
        stats("e", day + hour, day + hour, "_publish_time_day=2026-11-18", 1),
    ]
    assert rw.day_bounds_us(DAY0) == (day, day + 86_400_000_000)
    units = rw.rewrite_units(files, day=DAY0)
    assert [(u.label, [f.path for f in u.files]) for u in units] == [
        ("unpartitioned@spec-0", ["a", "b", "d"]),
        ("_publish_time_day=2026-11-18@spec-1", ["e"]),
    ]
    assert [[f.path for f in u.files] for u in rw.rewrite_units(files, day=DAY0 + dt.timedelta(days=1))] == [["c", "d"]]
    assert sum(len(u.files) for u in rw.rewrite_units(files)) == 5
    assert units[0].rows == 30

    done = rw.DataFileStats("f", 0, "", 10, 1, marker_min=2, marker_nulls=0, marker_values=10)
    assert done.all_converted(2) and not done.all_converted(3)
    assert not rw.DataFileStats("g", 0, "", 10, 1, marker_min=2, marker_nulls=1, marker_values=10).all_converted(2)
    assert not rw.DataFileStats("h", 0, "", 10, 1).all_converted(1)


@pytest.mark.unit
def test_schema_rewrite_is_defined_and_not_scheduled() -> None:
    graph = defs.resolve_asset_graph()
    node = graph.get(AssetKey("schema_rewrite"))
    assert node.parent_keys == {AssetKey("iceberg_table")}
    partitions_def = node.partitions_def
    assert isinstance(partitions_def, MultiPartitionsDefinition)
    assert {d.name for d in partitions_def.partitions_defs} == {"topic", "day"}
    job = defs.resolve_job_def("schema_rewrite_job")
    assert {k.to_user_string() for k in job.asset_layer.executable_asset_keys} == {"schema_rewrite"}
    for name in ("compaction_schedule", "retention_schedule"):
        assert defs.resolve_schedule_def(name).job_name != "schema_rewrite_job"
    assert {s.name for s in defs.schedules or []} == {"compaction_schedule", "retention_schedule"}
    assert all(s.job_name != "schema_rewrite_job" for s in defs.sensors or [] if s.targets)


# --------------------------------------------------------------------------- type change


@pytest.mark.spark
def test_int_to_string_keeps_every_row(rewrite_spark: Env) -> None:
    """``flight`` int → string on an unpartitioned table: every row kept, the untouched
    columns' checksum equal, one ``replace`` snapshot carrying ``danube.rewrite-version``, the
    retired column dropped at the end; pyiceberg and Spark read the same; a re-run is a no-op."""
    env = rewrite_spark
    topic = _flights_table(env, "to_string", (0,), objects_per_day=3)
    before = _rows_pyiceberg(env, topic, ("_offset", "flight", "route"))
    checksum_before = _checksum(env, topic)
    assert checksum_before.rows == 30 and len(_files(env, topic)) == 3
    rw.set_rewrite_spec(_table(env, topic), TO_STRING)

    report = _run(env, topic, day=DAY0)

    assert report.staged and report.finalized and report.retired == {"flight": "flight__pre_v2"}
    [unit] = report.units
    assert (unit.status, unit.files_before, unit.files_after, unit.rows, unit.rows_converted) == (
        "rewritten", 3, 1, 30, 30
    )
    assert unit.checksum_before == unit.checksum_after
    assert _checksum(env, topic) == checksum_before
    table = _table(env, topic)
    assert str(table.schema().find_field("flight").field_type) == "string"
    assert "flight__pre_v2" not in {f.name for f in table.schema().fields}
    [snapshot] = _rewrite_snapshots(env, topic)
    assert snapshot.snapshot_id == unit.snapshot_id == report.snapshot_after
    assert snapshot.summary is not None and snapshot.summary.operation.value == "replace"
    assert snapshot.summary[rw.SUMMARY_REWRITE_VERSION] == "2"
    assert snapshot.summary[rw.SUMMARY_REWRITE_PARTITION] == "unpartitioned@spec-0"
    # the exactly-once bookkeeping of tiering survives (a table property)
    assert iceberg.committed_end_offset(table) == 29

    after = _rows_pyiceberg(env, topic, ("_offset", "flight", "route"))
    assert after == [(o, str(f), r) for o, f, r in before]
    columns = (*UNTOUCHED, "flight", "route", "_rewrite_version")
    assert _rows_pyiceberg(env, topic, columns) == _rows_spark(env, topic, columns)
    assert {r[-1] for r in _rows_spark(env, topic, columns)} == {2}

    snapshot_id = _current_snapshot_id(env, topic)
    again = _run(env, topic, day=DAY0)
    assert again.already_finalized and again.units == ()
    assert _current_snapshot_id(env, topic) == snapshot_id


@pytest.mark.spark
def test_bad_expressions_and_mismatches_commit_nothing(rewrite_spark: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """An expression naming a missing column is refused before anything is staged. A rewrite
    that alters an untouched column (here: a broken projection) fails with a clear error
    before its commit; the new files are deleted and the table is unchanged."""
    env = rewrite_spark
    topic = _flights_table(env, "mismatch", (0,), objects_per_day=1)
    schema = _table(env, topic).schema()
    rw.set_rewrite_spec(_table(env, topic), {"version": 2, "columns": {"flight": {"type": "string", "expr": "fligth"}}})
    with pytest.raises(rw.RewriteSpecError, match="columns.flight.expr"):
        _run(env, topic, day=DAY0)
    assert rw.read_rewrite_state(_table(env, topic)) is None and _table(env, topic).schema() == schema

    rw.set_rewrite_spec(_table(env, topic), TO_STRING)
    snapshot_id = _current_snapshot_id(env, topic)
    data_dir = _data_dir(env, topic)
    files_on_disk = sorted(data_dir.rglob("*.parquet"))
    project = RewriteShape.project

    def broken(self: Any, df: Any, **kwargs: Any) -> Any:
        from pyspark.sql import functions as F

        return project(self, df, **kwargs).withColumn("carrier", F.lower("carrier"))

    monkeypatch.setattr(RewriteShape, "project", broken)
    with pytest.raises(rw.RewriteVerificationError) as caught:
        _run(env, topic, day=DAY0)
    assert caught.value.what == "untouched checksum" and caught.value.partition == "unpartitioned@spec-0"
    assert "nothing was committed" in str(caught.value)
    assert _current_snapshot_id(env, topic) == snapshot_id
    assert sorted(data_dir.rglob("*.parquet")) == files_on_disk
    monkeypatch.undo()

    # a conversion that loses values (flight numbers do not fit DECIMAL(2,0)) stops before writing
    lossy = _flights_table(env, "lossy", (0,), objects_per_day=1)
    rw.set_rewrite_spec(_table(env, lossy), {"version": 1, "columns": {"flight": {"type": "decimal(2, 0)"}}})
    snapshot_id = _current_snapshot_id(env, lossy)
    with pytest.raises(rw.RewriteVerificationError) as caught:
        _run(env, lossy, day=DAY0)
    assert (caught.value.what, caught.value.before, caught.value.after) == ("values of flight", 10, 0)
    assert _current_snapshot_id(env, lossy) == snapshot_id
    # and the old values are never dropped: the table keeps needing the rewrite
    assert "flight__pre_v1" in {f.name for f in _table(env, lossy).schema().fields}
    assert not rw.read_rewrite_state(_table(env, lossy)).finalized  # type: ignore[union-attr]


# --------------------------------------------------------------------------- field split


@pytest.mark.spark
def test_field_split_into_a_new_partition_spec(rewrite_spark: Env) -> None:
    """``route`` split into ``origin``/``dest`` and the table moved to ``day(_publish_time)``.
    Rows tiered after staging in the new shape keep their values; the old unpartitioned files
    are rewritten into one file per day; ``route`` is dropped at the end."""
    env = rewrite_spark
    topic = _flights_table(env, "split", (0, 1))
    checksum_before = _checksum(env, topic)
    spec = rw.set_rewrite_spec(
        _table(env, topic),
        {
            "version": 1,
            "columns": {
                "origin": {"type": "string", "expr": "split(route, '-')[0]"},
                "dest": {"type": "string", "expr": "split(route, '-')[1]"},
            },
            "drop": ["route"],
            "partition_spec": [{"source": "_publish_time", "transform": "day"}],
        },
    )
    rw.stage_rewrite(_table(env, topic), spec)
    table = _table(env, topic)
    assert [str(f.transform) for f in table.spec().fields] == ["day"]
    assert not table.schema().find_field("route").required

    # tiering goes on meanwhile, in the new shape (schema v2 has origin and dest, no route)
    late = [
        {
            "_offset": 40 + i,
            "_publish_time": dt.datetime.fromtimestamp(_day_start_us(1) / 1e6 + 7200 + i, tz=dt.UTC),
            "_producer_id": 7,
            "_producer_name": "flights-test",
            "_schema_id": 2,
            "_schema_version": 2,
            "_attributes": {"k": str(40 + i)},
            "carrier": "B6",
            "flight": 900 + i,
            "route": None,
            "dep_delay": 1.0,
            "_rewrite_version": None,
            "origin": "BOS",
            "dest": "MCO",
        }
        for i in range(5)
    ]
    # a Spark append: pyiceberg 0.12 writes day-partitioned tables only with pyiceberg-core
    env.spark.createDataFrame(late, schema=env.spark.table(_name(topic)).schema).writeTo(_name(topic)).append()

    report = _run(env, topic)

    assert report.finalized and not report.staged
    units = {u.partition: u for u in report.units}
    old = units["unpartitioned@spec-0"]
    assert (old.status, old.files_before, old.files_after, old.rows, old.rows_converted) == ("rewritten", 4, 2, 40, 40)
    assert units["_publish_time_day=2026-11-19@spec-1"].status == "skipped"  # the late rows: nothing to fill
    assert sorted(set(_files(env, topic).values())) == [
        "_publish_time_day=2026-11-18",
        "_publish_time_day=2026-11-19",
    ]
    table = _table(env, topic)
    assert "route" not in {f.name for f in table.schema().fields}
    rows = _rows_spark(env, topic, ("_offset", "origin", "dest"))
    assert rows == [(i, *ROUTES[i % 3].split("-")) for i in range(40)] + [(40 + i, "BOS", "MCO") for i in range(5)]
    columns = (*UNTOUCHED, "flight", "origin", "dest", "_rewrite_version")
    assert _rows_pyiceberg(env, topic, columns) == _rows_spark(env, topic, columns)
    # the untouched columns of the 40 v1 rows are as they were
    old_rows = env.spark.table(_name(topic)).where("_offset < 40")
    assert row_checksum(old_rows, list(UNTOUCHED)) == checksum_before
    assert len(_rewrite_snapshots(env, topic)) == 1


# --------------------------------------------------------------------------- partitioned by day


@pytest.mark.spark
def test_interrupted_rewrite_resumes_without_redoing_a_partition(rewrite_spark: Env) -> None:
    """A table partitioned by day, three days: the run stops right after its first partition's
    commit; the next run skips that partition, but compaction replaces the other partitions'
    files under it, so its next commit is refused; the run after that rewrites the two others,
    one snapshot each; a last run commits nothing."""
    env = rewrite_spark
    topic = _flights_table(env, "interrupted", (0, 1, 2), by_day=True)
    checksum_before = _checksum(env, topic)
    rw.set_rewrite_spec(_table(env, topic), TO_STRING)
    files_before = _files(env, topic)
    assert len(files_before) == 6 and len(set(files_before.values())) == 3

    class Crash(Exception):
        pass

    seen: list[rw.UnitResult] = []

    def crash_after_first_commit(result: rw.UnitResult) -> None:
        seen.append(result)
        if result.status == "rewritten":
            raise Crash(result.partition)

    with pytest.raises(Crash):
        _run(env, topic, after_unit=crash_after_first_commit)
    [first] = seen
    assert first.partition == "_publish_time_day=2026-11-18@spec-1" and first.files_before == 2
    [snapshot] = _rewrite_snapshots(env, topic)
    assert snapshot.snapshot_id == first.snapshot_id
    left = _files(env, topic)
    assert len(left) == 5 and set(left) - set(files_before) != set()  # day 0's two files replaced by one
    assert rw.read_rewrite_state(_table(env, topic)) == rw.RewriteState(
        2, rw.RewriteSpec.from_json(TO_STRING).digest(), {"flight": "flight__pre_v2"}, False
    )
    # mid-way, readers see both: new values in day 0, old ones under the retired name elsewhere
    mid = env.spark.sql(
        f"SELECT count(flight) AS new, count(flight__pre_v2) AS old FROM {_name(topic)}"
    ).collect()[0]
    assert (mid["new"], mid["old"]) == (20, 60)

    # compaction replaces the next partitions' files while the run is under way: that
    # partition's commit is refused (it would bring their rows back twice), nothing is left
    def compact_meanwhile(result: rw.UnitResult) -> None:
        assert result.status == "skipped"
        compacted = compact_table(env.spark, topic, catalog_name=CATALOG)
        assert compacted.rewritten_data_files == 4

    files_on_disk = set(_data_dir(env, topic).rglob("*.parquet"))
    with pytest.raises(rw.RewriteConflictError) as caught:
        _run(env, topic, after_unit=compact_meanwhile)
    assert caught.value.partition == "_publish_time_day=2026-11-19@spec-1" and caught.value.retriable
    assert len(_rewrite_snapshots(env, topic)) == 1
    compacted_files = set(_data_dir(env, topic).rglob("*.parquet")) - files_on_disk
    assert len(compacted_files) == 2  # compaction's two files; the refused rewrite's were deleted

    report = _run(env, topic)
    assert [(u.partition, u.status) for u in report.units] == [
        ("_publish_time_day=2026-11-18@spec-1", "skipped"),
        ("_publish_time_day=2026-11-19@spec-1", "rewritten"),
        ("_publish_time_day=2026-11-20@spec-1", "rewritten"),
    ]
    assert report.finalized and report.remaining_files == 0
    assert len(_rewrite_snapshots(env, topic)) == 3
    assert _checksum(env, topic) == checksum_before
    assert _rows_spark(env, topic, ("_offset", "flight")) == [(i, str(100 + i)) for i in range(60)]

    snapshot_id = _current_snapshot_id(env, topic)
    assert _run(env, topic).already_finalized
    assert _current_snapshot_id(env, topic) == snapshot_id


@pytest.mark.spark
def test_asset_rewrites_only_the_materialized_days(rewrite_spark: Env, etcd_endpoints: list[str]) -> None:
    """``schema_rewrite`` materialized through Dagster for two (topic, day) partitions of a
    table partitioned by day: those two days' partitions are rewritten, the third day's files
    are untouched; materializing a done day again commits nothing."""
    env = rewrite_spark
    topic = _flights_table(env, "asset_days", (0, 1, 2), by_day=True)
    rw.set_rewrite_spec(_table(env, topic), TO_STRING)
    day2_files = {p for p, part in _files(env, topic).items() if part == "_publish_time_day=2026-11-20"}
    assert len(day2_files) == 2
    resources = {
        "etcd": EtcdResource(endpoints=",".join(etcd_endpoints)),
        "iceberg_catalog": IcebergCatalogResource(name=CATALOG, uri=env.uri, warehouse=env.warehouse),
        "spark": SparkResource(catalog_name=CATALOG, catalog_uri=env.uri, warehouse=env.warehouse, stop_after_use=False),
    }

    def run(day: dt.date) -> dict[str, Any]:
        if not instance.has_dynamic_partition("days", day.isoformat()):
            instance.add_dynamic_partitions("days", [day.isoformat()])
        key = MultiPartitionKey({"topic": topic.partition_key, "day": day.isoformat()})
        result = materialize([schema_rewrite], partition_key=key, resources=resources, instance=instance)
        assert result.success
        [mat] = result.asset_materializations_for_node("schema_rewrite")
        return {k: v.value for k, v in mat.metadata.items()}

    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions(TOPICS_PARTITIONS_NAME, [topic.partition_key])
        first, second = run(DAY0), run(DAY0 + dt.timedelta(days=1))
        snapshot_id = _current_snapshot_id(env, topic)
        again = run(DAY0)

        # a spec that cannot work fails the run at once, with the reason, and is not retried
        bad = _flights_table(env, "asset_bad", (0,), objects_per_day=1)
        rw.set_rewrite_spec(_table(env, bad), {"version": 1, "columns": {"flight": {"type": "string", "expr": "nope"}}})
        instance.add_dynamic_partitions(TOPICS_PARTITIONS_NAME, [bad.partition_key])
        failed = materialize(
            [schema_rewrite],
            partition_key=MultiPartitionKey({"topic": bad.partition_key, "day": DAY0.isoformat()}),
            resources=resources,
            instance=instance,
            raise_on_error=False,
        )
    assert not failed.success
    [failure] = failed.get_step_failure_events()
    assert "columns.flight.expr" in str(failure.step_failure_data.error)
    assert not [e for e in failed.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]

    assert first["table"] == f"{CATALOG}.default.asset_days" and first["day"] == "2026-11-18"
    assert (first["staged"], first["finalized"], first["version"]) == (True, False, 2)
    assert first["retired_columns"] == {"flight": "flight__pre_v2"}
    assert (first["partitions_rewritten"], first["partitions_skipped"]) == (1, 0)
    assert (first["rows"], first["rows_converted"], first["data_files_before"], first["data_files_after"]) == (20, 20, 2, 1)
    assert (first["table_data_files_before"], first["table_data_files_after"]) == (6, 5)
    assert first["remaining_files"] == 4
    [partition] = first["partitions"]
    assert partition["partition"] == "_publish_time_day=2026-11-18@spec-1" and partition["status"] == "rewritten"
    assert first["snapshot_ids"] == [partition["snapshot_id"]] and first["snapshot_after"] == partition["snapshot_id"]
    sums = first["checksums"]["_publish_time_day=2026-11-18@spec-1"]
    assert sums["before"] == sums["after"]
    assert (second["staged"], second["partitions_rewritten"], second["remaining_files"]) == (False, 1, 2)
    assert (again["partitions_rewritten"], again["partitions_skipped"], again["snapshot_ids"]) == (0, 1, [])
    assert _current_snapshot_id(env, topic) == snapshot_id  # the re-run committed nothing

    files = _files(env, topic)
    assert {p for p, part in files.items() if part == "_publish_time_day=2026-11-20"} == day2_files  # day 2 untouched
    rows = _rows_spark(env, topic, ("_offset", "flight", "flight__pre_v2"))
    assert rows == [(i, str(100 + i) if i < 40 else None, 100 + i) for i in range(60)]
    assert not rw.read_rewrite_state(_table(env, topic)).finalized  # type: ignore[union-attr]


DEFS_FOR_BACKFILL = """
from dagster import Definitions, in_process_executor

from assets.assets import schema_rewrite
from assets.resources import EtcdResource, IcebergCatalogResource, SparkResource

defs = Definitions(
    assets=[schema_rewrite],
    executor=in_process_executor,  # steps run in the test's process, on its Spark session
    resources={{
        "etcd": EtcdResource(endpoints={etcd!r}),
        "iceberg_catalog": IcebergCatalogResource(name={catalog!r}, uri={uri!r}, warehouse={warehouse!r}),
        "spark": SparkResource(catalog_name={catalog!r}, catalog_uri={uri!r}, warehouse={warehouse!r}, stop_after_use=False),
    }},
)
"""


@pytest.mark.spark
# Dagster 1.13's own asset-backfill code calls its deprecated AssetSelection.sources() and tags
# multi-partition runs dagster/partition/{dimension}, which its tag check then calls deprecated
@pytest.mark.filterwarnings("ignore:Function `AssetSelection.sources` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:Non-compliant tag keys:DeprecationWarning")
def test_backfill_over_two_days_through_the_daemon(rewrite_spark: Env, etcd_endpoints: list[str], tmp_path: Path) -> None:
    """An asset backfill of ``schema_rewrite`` over two days, as the UI's "Materialize
    selected" over a day range submits it, executed by the daemon's backfill loop: two runs,
    two days rewritten, the third day untouched."""
    import logging

    from dagster._core.execution.backfill import BulkActionStatus, PartitionBackfill
    from dagster._core.test_utils import create_test_daemon_workspace_context, instance_for_test
    from dagster._core.workspace.load_target import PythonFileTarget
    from dagster._daemon.backfill import execute_backfill_iteration
    from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon

    env = rewrite_spark
    topic = _flights_table(env, "backfilled", (0, 1, 2), by_day=True, objects_per_day=1)
    rw.set_rewrite_spec(_table(env, topic), TO_STRING)
    defs_file = tmp_path / "rewrite_defs.py"
    defs_file.write_text(
        DEFS_FOR_BACKFILL.format(
            etcd=",".join(etcd_endpoints), catalog=CATALOG, uri=env.uri, warehouse=env.warehouse
        )
    )
    keys = [f"{(DAY0 + dt.timedelta(days=d)).isoformat()}|{topic.partition_key}" for d in (0, 1)]
    # the backfill daemon queues runs, the run queue daemon launches them: here in this process
    overrides = {
        "run_launcher": {"module": "dagster._core.launcher.sync_in_memory_run_launcher", "class": "SyncInMemoryRunLauncher"},
    }
    with instance_for_test(overrides=overrides) as instance:
        instance.add_dynamic_partitions(TOPICS_PARTITIONS_NAME, [topic.partition_key])
        instance.add_dynamic_partitions("days", [k.split("|")[0] for k in keys])
        target = PythonFileTarget(str(defs_file), "defs", str(Path(__file__).resolve().parents[1]), "rewrite_test")
        with create_test_daemon_workspace_context(target, instance) as context:
            backfill = PartitionBackfill.from_asset_partitions(
                backfill_id="rewrite-two-days",
                asset_graph=context.create_request_context().asset_graph,
                partition_names=keys,
                asset_selection=[AssetKey("schema_rewrite")],
                backfill_timestamp=dt.datetime.now(dt.UTC).timestamp(),
                tags={},
                dynamic_partitions_store=instance,
                all_partitions=False,
                title=None,
                description=None,
                run_config=None,
            )
            instance.add_backfill(backfill)
            with QueuedRunCoordinatorDaemon(interval_seconds=1) as queue:
                for _ in range(6):
                    list(execute_backfill_iteration(context, logging.getLogger("backfill")))
                    list(queue.run_iteration(context))
                    done = instance.get_backfill("rewrite-two-days")
                    if done is not None and done.status != BulkActionStatus.REQUESTED:
                        break
        runs = instance.get_runs()
        done = instance.get_backfill("rewrite-two-days")
    assert done is not None and done.status == BulkActionStatus.COMPLETED_SUCCESS, done
    assert sorted(r.tags["dagster/partition"] for r in runs) == sorted(keys)
    assert all(r.is_success for r in runs)
    units = [s.summary[rw.SUMMARY_REWRITE_PARTITION] for s in _rewrite_snapshots(env, topic) if s.summary]
    assert sorted(units) == ["_publish_time_day=2026-11-18@spec-1", "_publish_time_day=2026-11-19@spec-1"]
    rows = _rows_spark(env, topic, ("_offset", "flight"))
    assert rows == [(i, str(100 + i) if i < 20 else None) for i in range(30)]
