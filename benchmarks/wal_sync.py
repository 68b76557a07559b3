"""What makes many small WAL writes durable cheapest: one ``fdatasync`` per file, or one ``syncfs``.

The question behind the broker's commit rounds (``broker/storage/wal/sync_thread.py``): with
thousands of topics written a message at a time, each group commit covers one small write to its
own file. For N files (1 to 128), each round writes one 150-byte record at the end of every file,
then makes them durable either with one ``os.fdatasync`` per file (in one thread, as a round
would) or with one ``syncfs`` (the broker's :func:`~broker.storage.wal.sync_thread.sync_filesystem`),
``--rounds`` times. Prints the median time of a round and the process CPU per file (user and
system). Not a test.

    .venv/bin/python benchmarks/wal_sync.py                    # files in a temporary directory
    .venv/bin/python benchmarks/wal_sync.py --dir /data/wal    # on the WAL's file system

Ends with ``wal_sync: files=N fdatasync_ms=X syncfs_ms=X fdatasync_cpu_us_per_file=X syncfs_cpu_us_per_file=X``
for the largest N. Where ``syncfs`` is unavailable (not Linux 5.8 or later) only ``fdatasync``
is measured and the ``syncfs`` figures are ``nan``.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from broker.storage.wal import sync_thread  # noqa: E402 - after the repository is on sys.path

RECORD = b"x" * 150
FILE_COUNTS = (1, 2, 4, 8, 32, 128)


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(fds: list[int], sync: Callable[[list[int]], None], rounds: int) -> tuple[float, float]:
    """``(median round ms, CPU µs per file)`` of ``rounds`` rounds: a write to each file, then ``sync``."""
    positions = [os.fstat(fd).st_size for fd in fds]
    times: list[float] = []
    cpu0 = cpu_s()
    for _ in range(rounds):
        for i, fd in enumerate(fds):
            os.pwrite(fd, RECORD, positions[i])
            positions[i] += len(RECORD)
        started = time.perf_counter()
        sync(fds)
        times.append(time.perf_counter() - started)
    cpu = cpu_s() - cpu0
    return statistics.median(times) * 1000, cpu / (rounds * len(fds)) * 1e6


def fdatasync_each(fds: list[int]) -> None:
    for fd in fds:
        os.fdatasync(fd)


def syncfs_once(fds: list[int]) -> None:
    sync_thread.sync_filesystem(fds[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="where the files go (default: a temporary directory)")
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
    has_syncfs = sync_thread._SYNCFS is not None  # noqa: SLF001 - what the broker would use
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        print(f"{'files':>5}  {'fdatasync each: ms':>18}  {'CPU µs/file':>11}  {'one syncfs: ms':>14}  {'CPU µs/file':>11}")
        last: tuple[int, float, float, float, float] = (0, math.nan, math.nan, math.nan, math.nan)
        for count in FILE_COUNTS:
            fds = [os.open(Path(tmp) / f"n{count}-{i}", os.O_CREAT | os.O_RDWR, 0o600) for i in range(count)]
            try:
                each_ms, each_cpu = measure(fds, fdatasync_each, args.rounds)
                once_ms, once_cpu = measure(fds, syncfs_once, args.rounds) if has_syncfs else (math.nan, math.nan)
            finally:
                for fd in fds:
                    os.close(fd)
            print(f"{count:>5}  {each_ms:>18.2f}  {each_cpu:>11.0f}  {once_ms:>14.2f}  {once_cpu:>11.0f}")
            last = (count, each_ms, once_ms, each_cpu, once_cpu)
    count, each_ms, once_ms, each_cpu, once_cpu = last
    print(f"wal_sync: files={count} fdatasync_ms={each_ms:.2f} syncfs_ms={once_ms:.2f} "
          f"fdatasync_cpu_us_per_file={each_cpu:.0f} syncfs_cpu_us_per_file={once_cpu:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
