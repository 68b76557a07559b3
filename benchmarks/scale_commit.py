"""Tiering commit time as a topic's table grows: 1 to 1,000 snapshots and 10,000 data files.

Commits segment objects one after another into one table of a real pyiceberg ``SqlCatalog``
(SQLite) on a temporary warehouse, through the real commit path, as ``benchmarks/tiering.py``
drives it without a broker: each object is decoded
(:func:`~danube_pipeline.lake.segment_columns.decode_segment_columns`), committed by
:func:`~danube_pipeline.lake.iceberg.commit_object` (offset checks, schema binding, Avro decode,
Parquet write, manifests, the catalog's compare-and-swap), then the table's upkeep runs as
tiering runs it after every pass (:func:`~danube_pipeline.lake.iceberg.upkeep.table_upkeep`:
manifest merging and snapshot expiry by the default policy; its small-file merging is off here,
so that the data files do pile up to 10,000). Each object holds ``--records`` flights (Avro, the
demo's schema) in ten producer batches, each published on another of ten UTC days, so every
commit adds ten data files (one per day partition): 1,000 snapshots hold 10,000 data files.

The time of a commit is the **CPU time of this process** (``time.process_time``) for the
object's decode, commit and upkeep; wall time is printed beside it. A point ``n`` is the median
over the ``--window`` commits that bring the table to ``n`` snapshots appended (the first point
is the first commit, alone; the table is new, so it also creates the table: the commit after it
is also printed). One core: pyarrow's and pyiceberg's thread pools are set to one thread.

    .venv/bin/python benchmarks/scale_commit.py            # 1,000 commits
    .venv/bin/python benchmarks/scale_commit.py --quick    # 1,000 commits of 10 records

It prints a table of the points and ends with
``commit: commit_ms_1=X commit_ms_1000=X``. :func:`measure_commit` returns the same figures
(``benchmarks/scale.py`` calls it).
"""

from __future__ import annotations

import os

os.environ.setdefault("PYICEBERG_MAX_WORKERS", "1")
os.environ.setdefault("POLARS_MAX_THREADS", "1")

import argparse  # noqa: E402 - the thread pools' sizes must be set before these imports
import statistics  # noqa: E402
import struct  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TypedDict  # noqa: E402

import pyarrow as pa  # noqa: E402
from pyiceberg.table import Table  # noqa: E402

from danube_pipeline.dev.flights import FLIGHT_AVRO_SCHEMA, encode_flight, iter_flights  # noqa: E402
from danube_pipeline.format.batches import BatchBuilder  # noqa: E402
from danube_pipeline.format.records import SegmentHeader, object_id  # noqa: E402
from danube_pipeline.lake import iceberg  # noqa: E402
from danube_pipeline.lake.iceberg.small_files import MergePolicy  # noqa: E402
from danube_pipeline.lake.iceberg.upkeep import UpkeepPolicy, table_upkeep  # noqa: E402
from danube_pipeline.lake.iceberg.writer import avro_writer  # noqa: E402
from danube_pipeline.lake.segment_columns import decode_segment_columns  # noqa: E402
from danube_pipeline.names import TopicName  # noqa: E402

SCHEMA_ID = 1
PRODUCER_ID = 0xDA7B_E000_0000_0002
START_US = 1_700_000_000_000_000
DAY_US = 86_400_000_000
DAYS = 10
"""Day partitions each object spreads over: ten data files per commit."""
TOPIC = TopicName("bench", "scale_commit")
POINTS = (1, 10, 100, 250, 500, 750, 1000)
BENCH_POLICY = UpkeepPolicy(small_files=MergePolicy(fan_in=0))
"""The tiering pass's upkeep without its small-file merging (the files must pile up here)."""


class Point(TypedDict):
    """One point of the curve."""

    snapshots: int
    data_files: int
    commit_ms: float
    wall_ms: float
    manifests: int
    metadata_kib: float


class CommitCurve(TypedDict):
    """What :func:`measure_commit` returns."""

    commit_ms_1: float
    commit_ms_1000: float
    points: list[Point]


def build_segment(index: int, start_offset: int, records: int, payloads: list[bytes]) -> bytes:
    """Segment object ``index``: ``records`` flights from ``start_offset``, in :data:`DAYS`
    batches, batch ``j`` published on day ``j`` (one second later per object)."""
    per_batch = max(1, records // DAYS)
    parts: list[bytes] = []
    offset = start_offset
    for day in range(DAYS):
        ts = START_US + day * DAY_US + index * 1_000_000
        builder = BatchBuilder(ts)
        for k in range(per_batch):
            builder.append(payloads[(offset + k) % len(payloads)], timestamp_us=ts + k)
        data = builder.build(producer_id=PRODUCER_ID, producer_name="scale-commit", schema_id=SCHEMA_ID, schema_version=1)
        parts.append(struct.pack("<Q", offset) + data[8:])
        offset += per_batch
    header = SegmentHeader(start_offset=start_offset, created_at_ms=START_US // 1000).encode()
    return header + b"".join(parts)


def _manifest_count(table: Table) -> int:
    snapshot = table.current_snapshot()
    return 0 if snapshot is None else len(snapshot.manifests(table.io))


def measure_commit(quick: bool, *, commits: int = 1000, records: int | None = None, window: int = 20,
                   policy: UpkeepPolicy | None = None, verbose: bool = False) -> CommitCurve:
    """Commit ``commits`` objects into a new table and time each (module docstring).

    Args:
        quick: 10 records per object (100 without), a window of 10 commits.
        commits: objects to commit (snapshots appended).
        records: records per object; overrides ``quick``'s.
        window: commits per point (the median).
        policy: the table upkeep's policy; when ``None``, :class:`UpkeepPolicy`'s defaults without
            small-file merging (:data:`BENCH_POLICY`).
        verbose: print each point as it is reached.

    Returns:
        ``commit_ms_1``, ``commit_ms_1000`` (the point at ``commits`` snapshots) and the points.
    """
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    records = records or (10 if quick else 100)
    window = min(window, 10) if quick else window
    per_object = max(1, records // DAYS) * DAYS
    payloads = [encode_flight(f) for f in iter_flights(1000)]
    writer = avro_writer(FLIGHT_AVRO_SCHEMA)
    registered = iceberg.RegisteredWriter(SCHEMA_ID, 1, subject="flights", schema_type="Avro", writer=writer)
    policy = policy or BENCH_POLICY
    cpu_ms: list[float] = []
    wall_ms: list[float] = []
    points: list[Point] = []
    wanted = [p for p in POINTS if p <= commits] + ([commits] if commits not in POINTS else [])
    with tempfile.TemporaryDirectory(prefix="danube-scale-commit-") as tmp:
        catalog = iceberg.load_catalog(
            name="bench", uri=f"sqlite:///{Path(tmp) / 'catalog.db'}", warehouse=f"file://{Path(tmp) / 'wh'}"
        )
        table = None
        for i in range(commits):
            start = i * per_object
            segment = build_segment(i, start, per_object, payloads)
            cpu, wall = time.process_time(), time.perf_counter()
            columns = decode_segment_columns(segment).records
            result = iceberg.commit_object(
                catalog, TOPIC, table, columns, {(SCHEMA_ID, 1): registered},
                object_id(start, start + per_object - 1), topic=TOPIC.path,
            )
            table = result.table
            table_upkeep(table, policy)
            cpu_ms.append((time.process_time() - cpu) * 1000)
            wall_ms.append((time.perf_counter() - wall) * 1000)
            if result.append.rows_appended != per_object:
                raise SystemExit(f"commit {i}: appended {result.append.rows_appended} of {per_object} rows")
            n = i + 1
            if n in wanted:
                span = slice(0, 1) if n == 1 else slice(max(1, n - window), n)
                metadata = table.metadata_location.removeprefix("file://")
                point = Point(
                    snapshots=n, data_files=iceberg.data_file_count(table),
                    commit_ms=statistics.median(cpu_ms[span]), wall_ms=statistics.median(wall_ms[span]),
                    manifests=_manifest_count(table), metadata_kib=os.path.getsize(metadata) / 1024,
                )
                points.append(point)
                if verbose:
                    print(_row(point), flush=True)
        if verbose and len(cpu_ms) > 1:
            print(f"(the second commit, the first into an existing table: {cpu_ms[1]:.1f} ms cpu)")
        assert table is not None
        if iceberg.snapshot_row_count(table) != commits * per_object:
            raise SystemExit(f"the table has {iceberg.snapshot_row_count(table)} rows, expected {commits * per_object}")
    return CommitCurve(commit_ms_1=points[0]["commit_ms"], commit_ms_1000=points[-1]["commit_ms"], points=points)


HEADER = f"{'snapshots':>9} {'data files':>10} {'cpu ms':>8} {'wall ms':>8} {'manifests':>9} {'metadata KiB':>12}"


def _row(p: Point) -> str:
    return (f"{p['snapshots']:>9} {p['data_files']:>10} {p['commit_ms']:>8.1f} {p['wall_ms']:>8.1f} "
            f"{p['manifests']:>9} {p['metadata_kib']:>12.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="10 records per object, windows of 10 commits")
    parser.add_argument("--commits", type=int, default=1000, help="objects committed (default 1,000)")
    parser.add_argument("--records", type=int, default=None, help="records per object (default 100; 10 with --quick)")
    parser.add_argument("--window", type=int, default=20, help="commits per point, the median (default 20)")
    parser.add_argument("--no-upkeep", action="store_true",
                        help="no snapshot expiry and no manifest merging (the baseline before issue 27)")
    args = parser.parse_args()
    policy = UpkeepPolicy.disabled() if args.no_upkeep else BENCH_POLICY
    print(f"policy: {policy.describe()}")
    print(HEADER, flush=True)
    curve = measure_commit(args.quick, commits=args.commits, records=args.records, window=args.window,
                           policy=policy, verbose=True)
    print(f"commit: commit_ms_1={curve['commit_ms_1']:.1f} commit_ms_1000={curve['commit_ms_1000']:.1f}")


if __name__ == "__main__":
    main()
