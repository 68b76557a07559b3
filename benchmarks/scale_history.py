"""Open files while consumers replay a long history on many topics (issue 27, scale).

    .venv/bin/python benchmarks/scale_history.py                  # 300 topics, 12 sealed segments each
    .venv/bin/python benchmarks/scale_history.py --topics 50 --segments 4

One etcd and one broker (real processes in a temporary directory, stopped at the end) with
small WAL segments (``--segment-bytes``). Each of ``--topics`` topics gets ``--segments``
sealed segments of 1 KiB messages; then one consumer per topic (``Exclusive``, from the
earliest offset) reads its whole history back from the WAL, acknowledging as it goes. The
broker's open files (``/proc/<pid>/fd``: all, and those naming a sealed segment) are sampled
every 100 ms from before the replay until a few seconds after it.

A read opens a sealed segment's file and keeps it open for the next read; what bounds the
files kept open is ``broker/storage/wal/local_log.py`` (``MAX_OPEN_SEALED_FILES``). The last
line: ``history: topics=N sealed_per_topic=N fds_before=N fds_peak=N sealed_open_peak=N
sealed_open_after=N replay_s=X failed_topics=N emfile_lines=N`` (topics whose history was not
read back whole; lines of the broker's log naming ``EMFILE``, "Too many open files").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import scale  # noqa: E402 - a sibling module of this script

from danube_pipeline.client import DanubeClient, InitialPosition, SubscriptionType  # noqa: E402
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer  # noqa: E402

MESSAGE_BYTES = 1024
SEALED_SUFFIX = ".dnb1"
"""The file name suffix of a sealed segment (``broker/storage/wal/segment.py``)."""


def open_files(pid: int) -> tuple[int, int]:
    """``(all, sealed segments)``: the files ``pid`` holds open now."""
    total = sealed = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        total += 1
        sealed += target.endswith(SEALED_SUFFIX)
    return total, sealed


async def sample(pid: int, peaks: list[int], stop: asyncio.Event) -> None:
    """Keep ``peaks`` at the highest ``[all, sealed]`` seen, every 100 ms until ``stop``."""
    while not stop.is_set():
        total, sealed = open_files(pid)
        peaks[0], peaks[1] = max(peaks[0], total), max(peaks[1], sealed)
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except TimeoutError:
            pass


async def fill(address: str, topics: list[str], messages: int, concurrency: int) -> None:
    """``messages`` of :data:`MESSAGE_BYTES` on each topic, one producer per topic, each message
    acknowledged before the next is sent."""
    payload = os.urandom(MESSAGE_BYTES)
    async with DanubeClient([address], request_timeout_ms=60_000) as client:
        await scale.in_parallel(topics, client.admin.create_topic, concurrency)

        async def produce(topic: str) -> None:
            async with client.producer(topic, producer_name="history") as producer:
                for _ in range(messages):  # one batch each: segments seal at their size, not one batch's
                    await producer.send(payload)

        failed = await scale.in_parallel(topics, produce, concurrency)
        if failed:
            raise RuntimeError(f"{len(failed)} topics not filled, e.g. {failed[0]}")


async def replay(address: str, topics: list[str], messages: int, concurrency: int) -> list[str]:
    """Every topic's history read back by a consumer of its own, ``concurrency`` at once.

    Returns:
        The failures, one per topic not read back whole.
    """
    async with DanubeClient([address], request_timeout_ms=60_000) as client:

        async def consume(topic: str) -> None:
            async with client.consumer(topic, subscription="replay", subscription_type=SubscriptionType.EXCLUSIVE,
                                       initial_position=InitialPosition.EARLIEST) as consumer:
                for _ in range(messages):
                    await consumer.ack(await consumer.receive(timeout_ms=30_000))

        return await scale.in_parallel(topics, consume, concurrency)


async def main(args: argparse.Namespace) -> None:
    per_segment = max(1, args.segment_bytes // (MESSAGE_BYTES + 64))
    messages = per_segment * args.segments + 1  # the last one opens the next active segment
    topics = [f"/{scale.NAMESPACE}/h{i:05d}" for i in range(args.topics)]
    with tempfile.TemporaryDirectory() as tmp, EtcdServer(Path(tmp) / "etcd") as etcd:
        broker = BrokerProcess(etcd_endpoints=etcd.endpoints, data_dir=Path(tmp) / "broker",
                               extra_args=["--segment-max-bytes", str(args.segment_bytes)])
        broker.start()
        try:
            started = time.monotonic()
            await fill(broker.address, topics, messages, args.concurrency)
            print(f"  filled {args.topics} topics with {messages} messages each in {time.monotonic() - started:.1f} s")
            before, sealed_before = open_files(broker.pid)
            peaks = [before, sealed_before]
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample(broker.pid, peaks, stop))
            started = time.monotonic()
            failed = await replay(broker.address, topics, messages, args.concurrency)
            replay_s = time.monotonic() - started
            await asyncio.sleep(3.0)
            stop.set()
            await sampler
            _after, sealed_after = open_files(broker.pid)
        finally:
            broker.stop(timeout_s=120)
        emfile = sum(line.count(b"Too many open files") for line in broker.log_path.read_bytes().splitlines())
    if failed:
        print(f"  {len(failed)} topics not read back whole, e.g. {failed[0]}")
    print(f"  replayed in {replay_s:.1f} s; broker open files: {before} before, peak {peaks[0]};"
          f" sealed segment files open: peak {peaks[1]}, {sealed_after} after;"
          f" 'Too many open files' in its log: {emfile}")
    print(f"history: topics={args.topics} sealed_per_topic={args.segments} fds_before={before} fds_peak={peaks[0]}"
          f" sealed_open_peak={peaks[1]} sealed_open_after={sealed_after} replay_s={replay_s:.1f}"
          f" failed_topics={len(failed)} emfile_lines={emfile}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topics", type=int, default=300)
    parser.add_argument("--segments", type=int, default=12, help="sealed segments per topic")
    parser.add_argument("--segment-bytes", type=int, default=16 * 1024, help="--segment-max-bytes of the broker")
    parser.add_argument("--concurrency", type=int, default=64, help="topics filled or replayed at once")
    asyncio.run(main(parser.parse_args()))
