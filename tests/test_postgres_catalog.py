"""The catalog database for more than one host: the Iceberg SQL catalog and Dagster's instance
storage on a real PostgreSQL server (``postgres_server.py``), configured by URL only.

* pyiceberg's ``SqlCatalog`` and Spark's ``JdbcCatalog`` commit to one PostgreSQL catalog, each
  seeing the other's snapshots and columns;
* the tiering path (``commit_objects_to_table``) writes into it, and a second catalog object
  (another host) reads the same rows;
* a Dagster instance from ``dagster_home/dagster.yaml`` with ``DANUBE_DAGSTER_STORAGE`` set to
  a ``postgresql://`` URL stores runs and materializations in PostgreSQL.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg2
import pyarrow as pa
import pytest
from dagster import (
    AssetKey,
    AssetSelection,
    DagsterEventType,
    DagsterInstance,
    MaterializeResult,
    asset,
    materialize,
)
from helpers import RegisterCatalog
from postgres_server import PostgresServer
from pyiceberg.schema import Schema
from pyiceberg.types import LongType, NestedField, StringType
from tiering_helpers import TOPIC, Env, FakeRegistry, Protos, avro, avro_records

from danube_pipeline import settings
from danube_pipeline.lake import iceberg
from danube_pipeline.dev import flights
from danube_pipeline.storage.objectstore import ObjectStore
from danube_pipeline.settings import DatabaseUrlError
from danube_pipeline.lake.spark.session import jdbc_properties, jdbc_uri, spark_conf

REPO = Path(__file__).resolve().parents[1]
CATALOG = "danube_pg"


def _libpq(url: str) -> str:
    """The SQLAlchemy URL without its driver suffix, as psycopg2 (libpq) takes it."""
    return url.replace("postgresql+psycopg2://", "postgresql://", 1)


def _query(url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = psycopg2.connect(_libpq(url))
    try:
        with conn.cursor() as cur:
            cur.execute(sql, args)
            return list(cur.fetchall())
    finally:
        conn.close()


# --------------------------------------------------------------------------- unit


@pytest.mark.unit
def test_spark_jdbc_settings_derive_from_the_catalog_url() -> None:
    url = "postgresql+psycopg2://ice%40berg:p%40ss%3Aw%2Frd@db.example:5433/cat%20alog?sslmode=require"
    assert jdbc_uri(url) == "jdbc:postgresql://db.example:5433/cat%20alog?sslmode=require"
    assert jdbc_properties(url) == {"user": "ice@berg", "password": "p@ss:w/rd"}
    assert jdbc_uri("postgresql://u@[::1]/db") == "jdbc:postgresql://[::1]:5432/db"
    assert jdbc_properties("postgres://u@h/db") == {"user": "u"}
    assert jdbc_properties("sqlite:////tmp/c.db") == {}

    conf = spark_conf(catalog_name="c1", catalog_uri=url, warehouse="file:///w")
    assert conf["spark.sql.catalog.c1.uri"] == "jdbc:postgresql://db.example:5433/cat%20alog?sslmode=require"
    assert conf["spark.sql.catalog.c1.jdbc.user"] == "ice@berg"
    assert "spark.sql.catalog.c1.jdbc.password" not in conf  # in a private password file instead
    jars = conf["spark.jars"].split(",")
    assert jars[1].endswith("postgresql.jar")  # the driver this catalog needs, right after Iceberg's
    assert not any(k.endswith("jdbc.user") for k in spark_conf(catalog_name="c2", catalog_uri="sqlite:////tmp/c.db"))


@pytest.mark.unit
@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("postgresql://u:pw@db.example", "names no database"),
        ("postgresql:///iceberg", "names no host"),
        ("postgresql://u:pw@db.example:99999/db", "port"),
        ("mysql://u:pw@db.example/db", "not a PostgreSQL URL"),
    ],
)
def test_bad_postgres_urls_are_refused_without_showing_the_password(url: str, reason: str) -> None:
    with pytest.raises(DatabaseUrlError, match=reason) as raised:
        settings.parse_postgres_url(url)
    assert "pw" not in str(raised.value) and isinstance(raised.value, ValueError)


@pytest.mark.unit
def test_load_catalog_refuses_other_databases(tmp_path: Path) -> None:
    with pytest.raises(DatabaseUrlError, match="sqlite:///<path> or postgresql"):
        iceberg.load_catalog(name=CATALOG, uri="mysql+pymysql://u:secret@h/db", warehouse=tmp_path.as_uri())
    with pytest.raises(DatabaseUrlError, match="names no database"):
        iceberg.load_catalog(name=CATALOG, uri="postgresql://u:secret@h", warehouse=tmp_path.as_uri())


@pytest.mark.unit
def test_dagster_storage_setting_is_a_directory_or_a_postgres_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same ``dagster.yaml`` keeps SQLite in a directory, and refuses other URLs clearly."""
    monkeypatch.setenv("DANUBE_DAGSTER_STORAGE", str(tmp_path / "dagster"))
    with DagsterInstance.from_config(str(_dagster_home(tmp_path))) as instance:
        assert type(instance.run_storage).__name__ == "SqliteRunStorage"
        assert instance.storage_directory() == str(tmp_path / "dagster" / "storage")
    monkeypatch.setenv("DANUBE_DAGSTER_STORAGE", "mysql://u:secret@h/db")
    with pytest.raises(DatabaseUrlError, match="directory or a postgresql://") as raised:
        DagsterInstance.from_config(str(_dagster_home(tmp_path)))
    assert "secret" not in str(raised.value)


# --------------------------------------------------------------------------- pyiceberg


def _schema() -> Schema:
    return Schema(
        NestedField(1, "id", LongType(), required=False),
        NestedField(2, "name", StringType(), required=False),
    )


def _rows(start: int, end: int) -> pa.Table:
    return pa.table({"id": pa.array(range(start, end), pa.int64()), "name": [f"n{i}" for i in range(start, end)]})


@pytest.mark.integration
def test_catalog_tables_live_in_postgres_and_every_host_sees_them(postgres_url: str, tmp_path: Path) -> None:
    warehouse = (tmp_path / "warehouse").as_uri()
    # six hosts opening a new catalog at once: each creates the catalog tables if missing, and
    # all but one lose that race (IntegrityError / ProgrammingError from PostgreSQL)
    errors: list[BaseException] = []
    catalogs: list[Any] = []

    def open_catalog() -> None:
        try:
            catalogs.append(iceberg.load_catalog(name=CATALOG, uri=postgres_url, warehouse=warehouse))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=open_catalog) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and len(catalogs) == 6

    first, second = catalogs[0], catalogs[1]
    first.create_namespace("default")
    table = first.create_table(("default", "readings"), schema=_schema())
    table.append(_rows(0, 5))
    seen = second.load_table(("default", "readings"))
    assert seen.scan().to_arrow().num_rows == 5
    assert seen.metadata_location == table.metadata_location
    [(stored,)] = _query(
        postgres_url,
        "SELECT metadata_location FROM iceberg_tables WHERE catalog_name = %s AND table_namespace = %s AND table_name = %s",
        CATALOG, "default", "readings",
    )
    assert stored == table.metadata_location
    # the libpq short scheme works too
    short = iceberg.load_catalog(name=CATALOG, uri=_libpq(postgres_url).replace("postgresql://", "postgres://"), warehouse=warehouse)
    assert short.load_table(("default", "readings")).metadata_location == table.metadata_location


@pytest.mark.integration
def test_wrong_password_fails_and_names_no_password(postgres: PostgresServer, postgres_url: str, tmp_path: Path) -> None:
    from sqlalchemy.exc import OperationalError

    database = postgres_url.rsplit("/", 1)[1]
    wrong = f"postgresql+psycopg2://{postgres.user}:not-it@{postgres.host}:{postgres.port}/{database}"
    with pytest.raises(OperationalError, match="password authentication failed") as raised:
        iceberg.load_catalog(name=CATALOG, uri=wrong, warehouse=(tmp_path / "w").as_uri())
    assert "not-it" not in str(raised.value)


@pytest.mark.integration
def test_tiering_commits_into_the_postgres_catalog(etcd_endpoints: list[str], postgres_url: str, tmp_path: Path) -> None:
    warehouse = (tmp_path / "warehouse").as_uri()
    env = Env(
        etcd_endpoints,
        iceberg.load_catalog(name=CATALOG, uri=postgres_url, warehouse=warehouse),
        ObjectStore((tmp_path / "objects").as_uri()),
        FakeRegistry(),
        Protos(),
    )
    schema = avro({"name": "sensor", "type": "string"}, {"name": "value", "type": "long"})
    env.registry.add_avro(1, 1, schema)
    asyncio.run(env.put(avro_records(schema, 1, [(i, {"sensor": f"s{i % 3}", "value": i * 10}) for i in range(40)])))
    asyncio.run(env.put(avro_records(schema, 1, [(i, {"sensor": f"s{i % 3}", "value": i * 10}) for i in range(40, 100)])))

    report = asyncio.run(env.tier())
    assert report.rows_appended == 100 and report.committed_end_offset == 99

    # another host, its own catalog object on the same database
    other = iceberg.load_catalog(name=CATALOG, uri=postgres_url, warehouse=warehouse)
    table = other.load_table(iceberg.table_identifier(TOPIC))
    assert iceberg.read_offsets(table) == list(range(100))
    values = sorted(table.scan(selected_fields=("value",)).to_arrow().column("value").to_pylist())
    assert values == [i * 10 for i in range(100)]
    assert iceberg.committed_end_offset(table) == 99

    again = asyncio.run(env.tier())  # exactly once: nothing new to commit
    assert again.rows_appended == 0
    assert iceberg.row_count(other.load_table(iceberg.table_identifier(TOPIC))) == 100


# --------------------------------------------------------------------------- Spark


@pytest.mark.spark
def test_pyiceberg_and_spark_share_the_postgres_catalog(
    postgres_url: str, tmp_path: Path, spark_on_catalog: RegisterCatalog
) -> None:
    warehouse = (tmp_path / "warehouse").as_uri()
    catalog = iceberg.load_catalog(name=CATALOG, uri=postgres_url, warehouse=warehouse)
    catalog.create_namespace("default")
    table = catalog.create_table(("default", "readings"), schema=_schema())
    for start in range(0, 50, 10):  # five snapshots, five data files
        table.append(_rows(start, start + 10))

    spark = spark_on_catalog(name=CATALOG, uri=postgres_url, warehouse=warehouse)
    name = f"`{CATALOG}`.`default`.`readings`"
    row = spark.sql(f"SELECT count(*) AS n, sum(id) AS s FROM {name}").collect()[0]
    assert (row["n"], row["s"]) == (50, sum(range(50)))

    spark.sql(f"INSERT INTO {name} VALUES (50, 'n50'), (51, 'n51')").collect()
    spark.sql(f"ALTER TABLE {name} ADD COLUMNS (note string)").collect()
    spark.sql(f"INSERT INTO {name} VALUES (52, 'n52', 'from spark')").collect()
    files_before = spark.sql(f"SELECT count(*) AS n FROM {name}.files").collect()[0]["n"]
    assert files_before >= 7  # pyiceberg's five, and Spark's inserts
    rewritten = spark.sql(
        f"CALL `{CATALOG}`.system.rewrite_data_files(table => 'default.readings', "
        "options => map('min-input-files', '2'))"
    ).collect()[0]
    assert rewritten["rewritten_data_files_count"] == files_before and rewritten["added_data_files_count"] == 1
    spark_snapshot = spark.sql(
        f"SELECT snapshot_id FROM {CATALOG}.default.readings.snapshots ORDER BY committed_at DESC LIMIT 1"
    ).collect()[0]["snapshot_id"]

    seen = catalog.load_table(("default", "readings"))
    snapshot = seen.current_snapshot()
    assert snapshot is not None and snapshot.snapshot_id == spark_snapshot
    assert snapshot.summary is not None and snapshot.summary.operation.value == "replace"
    assert "note" in {f.name for f in seen.schema().fields}
    rows = seen.scan().to_arrow().sort_by("id").to_pylist()
    assert [r["id"] for r in rows] == list(range(53))
    assert rows[-1]["note"] == "from spark" and rows[0]["note"] is None
    assert iceberg.data_file_count(seen) == 1

    seen.append(pa.table({
        "id": pa.array([53], pa.int64()), "name": ["n53"], "note": ["from pyiceberg"],
    }))
    notes = spark.sql(f"SELECT note FROM {CATALOG}.default.readings WHERE note IS NOT NULL ORDER BY id").collect()
    assert [r["note"] for r in notes] == ["from spark", "from pyiceberg"]


# --------------------------------------------------------------------------- Dagster


async def _produce_flights(address: str, count: int) -> int:
    """Publish the first ``count`` flights with their Avro schema and seal the segment; the
    last offset."""
    from danube_pipeline.client import AvroSchema, DanubeClient

    async with DanubeClient([address]) as client:
        schema = AvroSchema(subject=flights.FLIGHTS_SUBJECT, raw_schema=flights.FLIGHT_AVRO_SCHEMA_JSON)
        async with client.producer(flights.FLIGHTS_TOPIC, producer_name="pg-loader", schema=schema) as producer:
            futures = [producer.send_nowait(flights.encode_flight(f)) for f in flights.iter_flights(count)]
            offsets = await asyncio.gather(*futures)
        await client.admin.seal_active_segment(flights.FLIGHTS_TOPIC)
    return int(offsets[-1])


def _dagster_home(tmp_path: Path) -> Path:
    """A ``DAGSTER_HOME`` holding a copy of the project's ``dagster.yaml``."""
    home = tmp_path / "dagster_home"
    home.mkdir(exist_ok=True)
    shutil.copy(REPO / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    return home


@pytest.mark.integration
def test_dagster_instance_on_postgres_storage(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage_url = _libpq(postgres_url)  # postgresql://user:password@host:port/db, as users write it
    monkeypatch.setenv("DANUBE_DAGSTER_STORAGE", storage_url)
    monkeypatch.setenv("DANUBE_HOME", str(tmp_path / "danube"))
    home = _dagster_home(tmp_path)

    @asset
    def readings_count() -> MaterializeResult[None]:
        return MaterializeResult(metadata={"rows": 42})

    with DagsterInstance.from_config(str(home)) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        # local artifacts cannot live at a URL: they go under DANUBE_HOME
        assert instance.storage_directory() == str(tmp_path / "danube" / "dagster" / "storage")
        result = materialize([readings_count], instance=instance)
        assert result.success
        run_id = result.run_id

    # another process (another host) opening the same configuration reads the run back
    with DagsterInstance.from_config(str(home)) as other:
        run = other.get_run_by_id(run_id)
        assert run is not None and run.is_success
        event = other.get_latest_materialization_event(AssetKey("readings_count"))
        assert event is not None and event.run_id == run_id
        materialization = event.asset_materialization
        assert materialization is not None and materialization.metadata["rows"].value == 42

    [(count,)] = _query(
        postgres_url,
        "SELECT count(*) FROM event_logs WHERE run_id = %s AND dagster_event_type = %s",
        run_id, DagsterEventType.ASSET_MATERIALIZATION.value,
    )
    assert count == 1
    assert not list((tmp_path / "danube").rglob("*.db"))  # no SQLite storage anywhere


@pytest.mark.integration
def test_tiering_assets_on_postgres_catalog_and_storage(
    etcd_endpoints: list[str],
    start_broker: Callable[..., Any],
    postgres: PostgresServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``segment_objects`` and ``iceberg_table`` materialized by a Dagster instance on PostgreSQL,
    committing to an Iceberg catalog on PostgreSQL (two databases of one server)."""
    from assets.assets import iceberg_table, segment_objects
    from assets.definitions import default_resources
    from assets.partitions import TOPICS_PARTITIONS_NAME
    from danube_pipeline.names import TopicName

    topic = TopicName.parse(flights.FLIGHTS_TOPIC)
    home = tmp_path / "danube"
    # the broker on the assets' object store (both check its identity: storage/identity.py)
    broker = start_broker(
        segment_max_bytes=64 * 1024, segment_max_age_s=600.0, extra_args=["--object-store-url", (home / "objects").as_uri()]
    )
    catalog_url = postgres.url(postgres.create_database())
    storage_url = postgres.url(postgres.create_database(), driver="postgresql")
    for key, value in {
        "DANUBE_HOME": str(home),
        "DANUBE_ETCD_ENDPOINTS": ",".join(etcd_endpoints),
        "DANUBE_BROKER_ADDRESSES": broker.address,
        "DANUBE_OBJECT_STORE_URL": (home / "objects").as_uri(),
        "DANUBE_CATALOG_URI": catalog_url,
        "DANUBE_WAREHOUSE": (home / "warehouse").as_uri(),
        "DANUBE_CATALOG_NAME": CATALOG,
        "DANUBE_DAGSTER_STORAGE": storage_url,
    }.items():
        monkeypatch.setenv(key, value)
    assert asyncio.run(_produce_flights(broker.address, 500)) == 499

    with DagsterInstance.from_config(str(_dagster_home(tmp_path))) as instance:
        instance.add_dynamic_partitions(TOPICS_PARTITIONS_NAME, [topic.partition_key])
        result = materialize(
            [segment_objects, iceberg_table],
            selection=AssetSelection.assets(segment_objects, iceberg_table),
            partition_key=topic.partition_key,
            resources=default_resources(),
            instance=instance,
        )
        assert result.success
        event = instance.get_latest_materialization_event(AssetKey("iceberg_table"))
        assert event is not None and event.asset_materialization is not None
        assert event.asset_materialization.metadata["rows_appended"].value == 500

    table = iceberg.load_catalog(name=CATALOG, uri=catalog_url, warehouse=(home / "warehouse").as_uri()).load_table(
        iceberg.table_identifier(topic)
    )
    assert iceberg.read_offsets(table) == list(range(500))
    [(location,)] = _query(catalog_url, "SELECT metadata_location FROM iceberg_tables WHERE table_name = %s", topic.topic)
    assert location == table.metadata_location
    [(materializations,)] = _query(
        storage_url, "SELECT count(*) FROM event_logs WHERE dagster_event_type = %s",
        DagsterEventType.ASSET_MATERIALIZATION.value,
    )
    assert materializations == 2  # segment_objects and iceberg_table

