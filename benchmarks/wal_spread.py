"""The broker's WAL path alone, spread over many WALs: one-message appends, closed loop.

What the group commit costs per append when thousands of topics are each written a message at a
time (``benchmarks/README.md``, "One GIL release per commit round"). One process, uvloop, no
gRPC and no client: ``--wals`` WALs opened in a temporary directory, then ``--messages`` appends
of one 128-byte message each, round-robin over the WALs, at most ``--window`` unacknowledged
(each acknowledgement sends the next). Each commit round is timed in its sync thread (the real
:func:`~broker.storage.wal.sync_thread.run_round`, wrapped).

Run it twice to compare the commit round's system calls made from C (``_commit_round.c``, the
default where it is built) and from Python (``--python-round``). Prints figures; not a test.

    .venv/bin/python benchmarks/wal_spread.py                    # 1,000 WALs, 30,000 appends
    .venv/bin/python benchmarks/wal_spread.py --python-round

Ends with ``wal_spread: wals=N round=c|python appends_per_s=X loop_cpu_us=X process_cpu_us=X
round_ms_p50=X round_jobs_p50=X``: the loop thread's and the whole process's CPU per append, the
median round's time in its thread (its writes, sync and closing writes, GIL waits included) and
commits.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import uvloop

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH: another tree can be measured
from danube_pipeline.format.batches import BatchBuilder  # noqa: E402 - after the repository is on sys.path

from broker.storage.wal import WriteAheadLog, sync_thread  # noqa: E402
from broker.storage.wal.sync_thread import CommitJob  # noqa: E402


def frame(i: int) -> bytes:
    builder = BatchBuilder(1_700_000_000_000_000 + i)
    builder.append(b"x" * 128, timestamp_us=1_700_000_000_000_000 + i)
    return builder.build(producer_id=7, producer_name="p")


def time_rounds() -> list[tuple[int, float]]:
    """Wrap the sync threads' round to record ``(commits, seconds)`` of each."""
    rounds: list[tuple[int, float]] = []
    lock = threading.Lock()
    real = sync_thread.run_round

    def timed(jobs: Sequence[CommitJob], syncfs_min_files: int) -> list[BaseException | None]:
        started = time.perf_counter()
        errors = real(jobs, syncfs_min_files)
        with lock:
            rounds.append((len(jobs), time.perf_counter() - started))
        return errors

    sync_thread.run_round = timed
    return rounds


async def spread(wals_count: int, messages: int, window: int, rounds: list[tuple[int, float]]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="wal-spread-") as tmp:
        wals = [
            await WriteAheadLog.open(Path(tmp) / f"w{i}", segment_max_age_s=3600.0) for i in range(wals_count)
        ]
        try:
            for wal in wals:  # the first append of each WAL records its epoch: not measured
                await wal.append(frame(0), 1)
            rounds.clear()
            data = frame(1)
            sent = acked = 0
            finished = asyncio.Event()

            def send() -> None:
                nonlocal sent
                wal = wals[sent % wals_count]
                sent += 1
                wal.enqueue(data, 1).add_done_callback(on_ack)

            def on_ack(_: asyncio.Future[tuple[int, int]]) -> None:
                nonlocal acked
                acked += 1
                if sent < messages:
                    send()
                elif acked == messages:
                    finished.set()

            started, loop_cpu, process_cpu = time.perf_counter(), time.thread_time(), time.process_time()
            for _ in range(min(window, messages)):
                send()
            await finished.wait()
            elapsed = time.perf_counter() - started
            loop_cpu = time.thread_time() - loop_cpu
            process_cpu = time.process_time() - process_cpu
        finally:
            for wal in wals:
                await wal.close()
    measured = list(rounds)
    return {
        "appends_per_s": messages / elapsed,
        "loop_cpu_us": loop_cpu / messages * 1e6,
        "process_cpu_us": process_cpu / messages * 1e6,
        "round_ms_p50": statistics.median(s for _, s in measured) * 1000 if measured else float("nan"),
        "round_jobs_p50": statistics.median(j for j, _ in measured) if measured else float("nan"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wals", type=int, default=1000)
    parser.add_argument("--messages", type=int, default=30_000)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--python-round", action="store_true", help="the round's system calls from Python")
    args = parser.parse_args()
    if args.python_round:
        sync_thread.native_round = None
    round_kind = "c" if getattr(sync_thread, "native_round", None) is not None else "python"
    rounds = time_rounds()
    figures = uvloop.run(spread(args.wals, args.messages, args.window, rounds))
    print(f"{args.wals:,} WALs, {args.messages:,} one-message appends, window {args.window}, round in {round_kind}: "
          f"{figures['appends_per_s']:,.0f} appends/s; CPU per append: loop {figures['loop_cpu_us']:.1f} us, "
          f"process {figures['process_cpu_us']:.1f} us; round p50 {figures['round_ms_p50']:.2f} ms "
          f"({figures['round_jobs_p50']:.0f} commits)")
    print(f"wal_spread: wals={args.wals} round={round_kind} appends_per_s={figures['appends_per_s']:.0f} "
          f"loop_cpu_us={figures['loop_cpu_us']:.1f} process_cpu_us={figures['process_cpu_us']:.1f} "
          f"round_ms_p50={figures['round_ms_p50']:.2f} round_jobs_p50={figures['round_jobs_p50']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
