"""Recovery time after SIGKILL as one topic's WAL grows (issue 27, item 4: scale).

One etcd and one broker (real processes in a temporary directory). At each point (100 MiB,
500 MiB, 1 GiB and 4 GiB of WAL; ``--quick``: 100 and 300 MiB) the benchmark takes a new topic
``/bench/recovery-N``, so that each restart is the first crash of a WAL written under one owner
epoch since its creation (the case where recovery has the most to rebuild), and:

1. fills its WAL up to the point, less a short tail, with one producer (64 KiB messages, a
   large window; nothing tiers, so every sealed segment stays on the broker's disk and local
   retention deletes none: it only deletes segments whose objects are verified in the store);
2. creates a subscription ``probe`` at ``LATEST`` (its start is stored in etcd);
3. writes the tail and SIGKILLs the broker while appends are in flight (acks outstanding);
4. evicts the WAL's files from the page cache (``posix_fadvise(DONTNEED)``, no root needed),
   so recovery reads the disk as after a machine restart; ``--warm`` keeps them cached;
5. restarts the broker (same data directory and port) and times, from the spawn, until the
   topic is *served again*: a producer under the same name sends one message and has it
   acknowledged, and ``probe`` receives the last offset acknowledged before the kill;
6. deletes the topic (its WAL goes with it), so the next restart recovers one topic only.

For each point it prints the WAL's size and segment count, the time to the broker's ready
file, to the topic served, the broker's CPU time until then (``/proc/<pid>/stat``, less noisy
than wall time on a shared machine), and the bytes the broker read from disk meanwhile
(``/proc/<pid>/io`` ``read_bytes``: what recovery read, cold). The phases of the restart come
from the broker's own log lines, as seconds after the spawn: its first line (the interpreter,
imports and etcd session before it), the WAL recovered (``WAL ... recovered in``, with its own
time and bytes scanned), the idempotent producers' sequences rebuilt from the WAL's newest
segments, the topic loaded, and the broker serving (its ready file); and the time the
leader-epoch cache took to rebuild from the batches (``leader epochs of N segments read``).

``recovery_s_per_gib`` is the largest point's recovery time over its WAL size, the fixed cost of
a broker start (its imports and its etcd session) included. How the time grows with the WAL is
the slope of a least-squares line through the points (``slope_s_per_gib``, its intercept
``fixed_s``); on a loaded machine the slope is noise around zero and can come out negative.
Target: <= 5 s per GiB.

    .venv/bin/python benchmarks/scale_recovery.py            # 100 MiB, 500 MiB, 1 GiB, 4 GiB
    .venv/bin/python benchmarks/scale_recovery.py --quick    # 100 and 300 MiB
    .venv/bin/python benchmarks/scale_recovery.py --sizes-mib 100,2048 --warm
    .venv/bin/python benchmarks/scale_recovery.py --sizes-mib 300,1024 --segment-max-bytes 268435456

It ends with the line ``recovery: recovery_s_per_gib=X``. Every file it wrote is deleted at
the end (the 4 GiB point needs about 4.2 GiB free).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadgen  # noqa: E402 - a sibling module of this script

NAMESPACE = "bench"
PRODUCER = "recovery-filler"
MESSAGE_BYTES = 64 * 1024
WINDOW = 256
"""Messages in flight while filling: 16 MiB."""
TAIL_BYTES = 16 * 1024 * 1024
"""Written after the probe subscription is created, the last of it in flight at the kill."""
SIZES_MIB = (100, 500, 1024, 4096)
QUICK_SIZES_MIB = (100, 300)
_MIB = 1 << 20
_PRODUCER_OPTIONS: dict[str, Any] = {
    "producer_name": PRODUCER, "max_batch_messages": 16, "max_batch_bytes": 4 * _MIB, "max_in_flight_batches": 16,
}


def wal_files(data_dir: Path, topic: str) -> list[Path]:
    """The WAL segment files (active and sealed) of ``topic`` (``/ns/name``)."""
    directory = data_dir / "wal" / topic.strip("/")
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if p.suffix in {".log", ".dnb1"}]


def wal_bytes(data_dir: Path, topic: str) -> int:
    """Bytes of ``topic``'s WAL segment files."""
    total = 0
    for path in wal_files(data_dir, topic):
        with contextlib.suppress(FileNotFoundError):  # renamed by a seal meanwhile
            total += path.stat().st_size
    return total


def evict_from_page_cache(paths: Sequence[Path]) -> None:
    """Drop ``paths``' pages from the page cache (each synced first: dirty pages stay)."""
    for path in paths:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_bytes_of(pid: int) -> int:
    """Bytes ``pid`` caused to be read from storage (``/proc/<pid>/io``), 0 if unknown."""
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return 0
    found = re.search(r"^read_bytes:\s+(\d+)", text, re.M)
    return int(found.group(1)) if found else 0


_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
_EPOCHS_READ = re.compile(r"leader epochs of (\d+) segments read from the batches in ([\d.]+) s")


def log_phases(log_path: Path, since_byte: int, spawned_at: float, topic: str) -> dict[str, Any]:
    """Seconds from the spawn (``time.time()`` ``spawned_at``) to the broker's log lines of this
    run: its first line, the WAL recovered, the producers' sequences rebuilt, the topic loaded,
    serving; the WAL recovery's own
    line (``wal_recovery``), and the time the leader epochs took to read from the batches
    (``epochs_read_s``, over ``epoch_segments`` segments) when the cache was rebuilt."""
    try:
        with log_path.open("rb") as fh:
            fh.seek(since_byte)
            text = fh.read().decode(errors="replace")
    except OSError:
        return {}
    marks = {
        "wal_recovered_at_s": re.compile(rf"WAL \S+/{re.escape(topic.strip('/'))} recovered in"),
        "epochs_rebuilt_at_s": re.compile(r"leader epochs rebuilt from the batches"),
        "sequences_at_s": re.compile(rf"topic {re.escape(topic)}: producer sequences rebuilt"),
        "loaded_at_s": re.compile(rf"topic {re.escape(topic)} loaded"),
        "serving_at_s": re.compile(r"broker \d+ serving on"),
    }
    out: dict[str, Any] = {}
    for line in text.splitlines():
        stamp = _LOG_LINE.match(line)
        if stamp is None:
            continue
        at = datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(stamp.group(2)) / 1e3
        out.setdefault("first_log_at_s", round(at - spawned_at, 3))
        for key, pattern in marks.items():
            if key not in out and pattern.search(line):
                out[key] = round(at - spawned_at, 3)
                if key == "wal_recovered_at_s":
                    out["wal_recovery"] = line.split(" recovered in ", 1)[1].strip()
        if found := _EPOCHS_READ.search(line):
            out["epoch_segments"], out["epochs_read_s"] = int(found.group(1)), float(found.group(2))
    return out


async def _fill(client: DanubeClient, data_dir: Path, topic: str, until_bytes: int, payload: bytes) -> None:
    """Send, keeping :data:`WINDOW` messages in flight, until the WAL holds ``until_bytes``."""
    async with client.producer(topic, **_PRODUCER_OPTIONS) as producer:
        pending: list[asyncio.Future[int]] = []
        while True:
            pending.extend(producer.send_nowait(payload) for _ in range(WINDOW // 4))
            if len(pending) >= WINDOW:
                head, pending = pending[: WINDOW // 4], pending[WINDOW // 4 :]
                await asyncio.gather(*head)
                if wal_bytes(data_dir, topic) >= until_bytes:
                    await asyncio.gather(*pending)
                    return


async def _tail_and_kill(client: DanubeClient, broker: BrokerProcess, data_dir: Path, topic: str, payload: bytes) -> int:
    """Write :data:`TAIL_BYTES` more, then SIGKILL the broker with appends in flight.

    Returns:
        The highest offset acknowledged before the kill.
    """
    acked = -1
    target = wal_bytes(data_dir, topic) + TAIL_BYTES
    producer = client.producer(topic, **_PRODUCER_OPTIONS)
    await producer.__aenter__()

    def on_ack(fut: asyncio.Future[int]) -> None:
        nonlocal acked
        if not fut.cancelled() and fut.exception() is None:
            acked = max(acked, int(fut.result()))

    futures: list[asyncio.Future[int]] = []
    try:
        while wal_bytes(data_dir, topic) < target:
            batch = [producer.send_nowait(payload) for _ in range(WINDOW // 4)]
            for fut in batch:
                fut.add_done_callback(on_ack)
            futures.extend(batch)
            await asyncio.wait(futures[-WINDOW:][:1])
        for _ in range(WINDOW):  # a full window in flight: the kill lands among appends
            fut = producer.send_nowait(payload)
            fut.add_done_callback(on_ack)
            futures.append(fut)
        await asyncio.sleep(0.02)
        broker.kill()
        return acked
    finally:
        for fut in futures:
            fut.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(producer.__aexit__(None, None, None), 5)


async def _served(address: str, topic: str, subscription: str, last_acked: int, payload: bytes) -> float:
    """Produce one message under the filler's name and read ``last_acked`` on ``subscription``.

    Returns:
        ``time.perf_counter()`` when both succeeded.

    Raises:
        RuntimeError: an acknowledged offset is missing or handed out again.
    """
    async with DanubeClient([address], request_timeout_ms=60_000, metadata_retries=50, retry_backoff_ms=50) as client:
        async with client.producer(topic, producer_name=PRODUCER) as producer:
            offset = int(await producer.send(payload))
        if offset <= last_acked:
            raise RuntimeError(f"{topic}: offset {offset} handed out again (acked up to {last_acked} before the kill)")
        async with client.consumer(
            topic, subscription=subscription, initial_position=InitialPosition.LATEST, receiver_queue_size=64,
        ) as consumer:
            while True:
                message = await consumer.receive(timeout_ms=60_000)
                await consumer.ack(message)
                if message.offset >= last_acked:
                    if message.offset != last_acked:
                        raise RuntimeError(f"{topic}: offset {last_acked}, acked before the kill, is missing")
                    return time.perf_counter()


async def _point(broker: BrokerProcess, data_dir: Path, size_mib: int, index: int, *, warm: bool) -> dict[str, Any]:
    """Fill a new topic to ``size_mib``, kill, restart, time it, delete the topic (module docstring)."""
    topic = f"/{NAMESPACE}/recovery-{index}"
    payload = loadgen.make_payload(MESSAGE_BYTES)
    async with DanubeClient([broker.address], request_timeout_ms=30_000) as client:
        fill_start = time.perf_counter()
        await _fill(client, data_dir, topic, size_mib * _MIB - TAIL_BYTES, payload)
        async with client.consumer(topic, subscription="probe", initial_position=InitialPosition.LATEST):
            pass  # the subscription starts at the next offset, stored in etcd
        last_acked = await _tail_and_kill(client, broker, data_dir, topic, payload)
        fill_s = time.perf_counter() - fill_start
    files = wal_files(data_dir, topic)
    size = sum(p.stat().st_size for p in files)
    if not warm:
        evict_from_page_cache(files)
    log_from = broker.log_path.stat().st_size if broker.log_path.exists() else 0
    spawned_at = time.time()
    started = time.perf_counter()
    await broker.start_async(timeout_s=600)
    ready_s = time.perf_counter() - started
    pid = broker.pid
    served_at = await _served(broker.address, topic, "probe", last_acked, payload)
    cpu_s = loadgen.proc_cpu_s(pid)
    read_mib = read_bytes_of(pid) / _MIB
    async with DanubeClient([broker.address], request_timeout_ms=60_000) as client:
        await client.admin.delete_topic(topic, force=True)
    await asyncio.sleep(0.3)  # the log lines are written
    left = wal_files(data_dir, topic)
    if left:
        raise RuntimeError(f"{topic}: {len(left)} WAL files left after its deletion")
    return {
        "wal_mib": round(size / _MIB, 1),
        "segments": sum(1 for p in files if p.suffix == ".dnb1") + 1,
        "fill_s": round(fill_s, 1),
        "ready_s": round(ready_s, 3),
        "recovery_s": round(served_at - started, 3),
        "broker_cpu_s": round(cpu_s, 3),
        "read_mib": round(read_mib, 1),
        "last_acked": last_acked,
        **log_phases(broker.log_path, log_from, spawned_at, topic),
    }


def fit_per_gib(points: Sequence[dict[str, Any]], key: str = "recovery_s") -> tuple[float, float]:
    """Least-squares ``(slope in s per GiB, intercept in s)`` of ``key`` against the WAL size."""
    xs = [p["wal_mib"] / 1024 for p in points]
    ys = [float(p[key]) for p in points]
    if len(xs) < 2:
        return (ys[0] / xs[0] if xs and xs[0] else float("nan")), 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else float("nan")
    return slope, my - slope * mx


def _print_point(p: dict[str, Any]) -> None:
    nan = float("nan")
    print(
        f"  {p['wal_mib']:>7.0f} MiB {p['segments']:>4} seg | ready {p['ready_s']:6.2f} s  served {p['recovery_s']:6.2f} s"
        f" | broker CPU {p['broker_cpu_s']:5.2f} s  read {p['read_mib']:7.1f} MiB | log: first {p.get('first_log_at_s', nan):5.2f}"
        f"  WAL {p.get('wal_recovered_at_s', nan):5.2f}  sequences {p.get('sequences_at_s', nan):5.2f}"
        f"  loaded {p.get('loaded_at_s', nan):5.2f}"
        f"  serving {p.get('serving_at_s', nan):5.2f} s | filled in {p['fill_s']:.0f} s",
        flush=True,
    )
    if "wal_recovery" in p:
        print(f"  {'':>16}WAL recovered in {p['wal_recovery']}", flush=True)
    if "epochs_read_s" in p:
        print(f"  {'':>16}leader epochs of {p['epoch_segments']} segments read from the batches in "
              f"{p['epochs_read_s']:.3f} s", flush=True)
    elif "epochs_rebuilt_at_s" in p:
        print(f"  {'':>16}leader epochs rebuilt from the batches at {p['epochs_rebuilt_at_s']:.2f} s", flush=True)


async def _run(broker: BrokerProcess, data_dir: Path, sizes_mib: Sequence[int], *, warm: bool) -> list[dict[str, Any]]:
    points = []
    for i, size_mib in enumerate(sizes_mib):
        point = await _point(broker, data_dir, size_mib, i, warm=warm)
        _print_point(point)
        points.append(point)
    return points


def measure_recovery(
    quick: bool, *, sizes_mib: Sequence[int] | None = None, warm: bool = False, root: Path | None = None,
    segment_max_bytes: int | None = None,
) -> dict[str, Any]:
    """Measure the broker's recovery time after SIGKILL against the WAL's size (module docstring).

    Args:
        quick: 100 and 300 MiB instead of 100 MiB, 500 MiB, 1 GiB and 4 GiB.
        sizes_mib: the points, in MiB (overrides ``quick``).
        warm: keep the WAL in the page cache across the restart (default: evicted).
        root: where the temporary directory goes (default: the system's).
        segment_max_bytes: the broker's ``--segment-max-bytes`` (default: its own, 8 MiB).

    Returns:
        ``{"recovery_s_per_gib": the last point's recovery time over its size (fixed cost
        included), "slope_s_per_gib": slope, "fixed_s": intercept, "cpu_s_per_gib": the slope of
        the broker's CPU time, "read_mib_per_gib": the slope of the bytes it read from disk,
        "warm": warm, "points": [{"wal_mib", "segments", "ready_s",
        "recovery_s", "broker_cpu_s", "read_mib", "last_acked", "fill_s", and the log's
        "first_log_at_s", "wal_recovered_at_s", "loaded_at_s", "serving_at_s", ...}, ...]}``;
        times in seconds.

    Raises:
        RuntimeError: an offset acknowledged before a kill is missing after the restart, one
            is handed out again, or a deleted topic left WAL files behind.
    """
    sizes = list(sizes_mib or (QUICK_SIZES_MIB if quick else SIZES_MIB))
    tmp = Path(tempfile.mkdtemp(prefix="danube-recovery-", dir=root))
    try:
        data_dir = tmp / "broker"
        with EtcdServer(tmp / "etcd") as etcd:
            broker = BrokerProcess(
                etcd_endpoints=etcd.endpoints, data_dir=data_dir, port=free_port(), segment_max_age_s=3600,
                segment_max_bytes=segment_max_bytes,
            )
            broker.start()
            try:
                points = asyncio.run(_run(broker, data_dir, sizes, warm=warm))
            finally:
                broker.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    slope, intercept = fit_per_gib(points)
    cpu_slope, _ = fit_per_gib(points, "broker_cpu_s")
    read_slope, _ = fit_per_gib(points, "read_mib")
    return {
        "recovery_s_per_gib": points[-1]["recovery_s"] / (points[-1]["wal_mib"] / 1024),
        "slope_s_per_gib": slope, "fixed_s": intercept, "cpu_s_per_gib": cpu_slope,
        "read_mib_per_gib": read_slope, "segment_max_bytes": segment_max_bytes, "warm": warm, "points": points,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100 and 300 MiB only")
    parser.add_argument("--sizes-mib", help="comma-separated WAL sizes in MiB (overrides --quick)")
    parser.add_argument("--warm", action="store_true", help="keep the WAL in the page cache across the restart")
    parser.add_argument("--segment-max-bytes", type=int, help="the broker's segment size (default: its own, 8 MiB)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mib.split(",")] if args.sizes_mib else None
    segments = f"segments of {args.segment_max_bytes:,} B" if args.segment_max_bytes else "the default segment size"
    print(f"recovery: one broker, a new topic per point, {MESSAGE_BYTES // 1024} KiB messages, {segments}; SIGKILL "
          f"with appends in flight; page cache {'kept' if args.warm else 'evicted'}", flush=True)
    result = measure_recovery(args.quick, sizes_mib=sizes, warm=args.warm, segment_max_bytes=args.segment_max_bytes)
    print(f"  fit: {result['slope_s_per_gib']:.3f} s per GiB + {result['fixed_s']:.2f} s fixed; "
          f"broker CPU {result['cpu_s_per_gib']:.3f} s per GiB; read from disk {result['read_mib_per_gib']:.1f} MiB "
          "per GiB (target <= 5 s per GiB)")
    print(f"  largest point: {result['points'][-1]['recovery_s']:.2f} s for {result['points'][-1]['wal_mib'] / 1024:.2f} "
          f"GiB = {result['recovery_s_per_gib']:.2f} s per GiB, the broker's start included")
    print(f"recovery: recovery_s_per_gib={result['recovery_s_per_gib']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
