"""How one broker's cost grows with its work: topics, clients, WAL size, table history.

Starts its own etcd and broker (real processes in a temporary directory, stopped by pid at the
end, also on errors). Prints figures; not a test.

    .venv/bin/python benchmarks/scale.py                 # topics 1 -> 10,000, clients 1 -> 1,000
    .venv/bin/python benchmarks/scale.py --quick         # topics 1 -> 100, clients 1 -> 50
    .venv/bin/python benchmarks/scale.py --skip-recovery --skip-commit

The parts, in order:

1. **Topics.** One etcd and one broker. For each step N of ``--topics`` (1, 100, 1,000,
   10,000): the topics ``/scale/t{i}`` missing up to N are created through the admin API
   (``--create-concurrency`` calls at once; creations per second are printed, as topic
   creation itself can be the slow part), one producer per topic is opened, and one producer
   loop sends ``--messages`` messages of ``--size`` bytes spread round-robin over the N topics
   with at most ``--window`` unacknowledged (``loadgen.window_loop``; each ack follows the
   topic's WAL ``fdatasync``). Then:

   * ``rss_mib``: the broker's ``VmRSS``, the peak sampled every 100 ms over the step;
     ``rss_loaded_mib`` the one after the restart below, with every topic loaded and no client;
   * ``etcd_keys_per_topic`` and ``etcd_bytes_per_topic``: every etcd key and the sum of key
     and value sizes (one ``Range`` over the whole key space), less those before the first
     topic, divided by N (producers open, so their keys count);
   * ``msgs_per_s`` and ``msgs_ratio``: the loop's acked messages per second, and its ratio
     to the one-topic step; ``broker_cpu_us_per_msg``, ``client_cpu_us_per_msg`` and the
     send-to-ack ``p50_ms`` say what bounds it;
   * ``load_s``: the broker is stopped (SIGTERM, ``stop_s``) and started again on the same
     data directory; the time from the start until the broker lists all N topics as loaded
     (``Admin.ListTopics``, polled), ``ready_s`` until it wrote its ready file, ``load_cpu_s``
     the broker's CPU seconds by then; ``idle_cpu_pct`` its CPU over the next 5 s, no client.

2. **Clients.** A fresh etcd and broker. For each step n of ``--clients`` (1, 100, 1,000): n
   producers and n consumers at once on ``min(n, 10)`` topics (producer i and consumer i on
   topic ``i mod 10``; one ``Shared`` subscription per topic), ``--messages`` messages of
   ``--size`` bytes in all, each producer with at most ``max(2, 1024 // n)`` unacknowledged:
   produce msg/s, consume msg/s (until every message was received), the broker's peak RSS and
   CPU seconds.

3. **Recovery** (``benchmarks/scale_recovery.py``, ``measure_recovery(quick)``): recovery after
   SIGKILL as the WAL grows; ``recovery_s_per_gib``.

4. **Commit** (``benchmarks/scale_commit.py``, ``measure_commit(quick)``): Iceberg commit time
   as the table grows to 1,000 snapshots; ``commit_ms_1``, ``commit_ms_1000``.

A part whose module is missing or fails is reported and its figures are ``nan``. The curves go
to ``benchmarks/results/scale.json`` (``benchmarks/results.py``; charts by ``plot.py``). The
run ends with exactly one line:
``scale: topics=N rss_mib=X load_s=X msgs_ratio_10000=X recovery_s_per_gib=X commit_ms_1=X commit_ms_1000=X``
(the figures of the largest topic step; ``msgs_ratio_10000`` is its ratio to one topic).

Targets: RSS <= 1 GiB at 10,000 topics; all 10,000 loaded within 60 s after a restart;
aggregate msg/s over 10,000 topics >= 0.7 x one topic.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import itertools
import math
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import faults_scenarios as fs  # noqa: E402 - sibling modules of this script
import loadgen  # noqa: E402
from results import write_result  # noqa: E402

from broker.event_loop import raise_open_files_limit  # noqa: E402
from danube_pipeline.client import DanubeClient, InitialPosition, Producer, SubscriptionType  # noqa: E402
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer  # noqa: E402
from danube_pipeline.metadata.etcd import prefix_range_end  # noqa: E402
from danube_pipeline.metadata.store import MetadataStore  # noqa: E402

NAMESPACE = "scale"
TOPIC_STEPS = (1, 100, 1_000, 10_000)
TOPIC_STEPS_QUICK = (1, 10, 100)
CLIENT_STEPS = (1, 100, 1_000)
CLIENT_STEPS_QUICK = (1, 10, 50)
CLIENT_TOPICS = 10
"""The clients part spreads its producers and consumers over at most this many topics."""
OPEN_FILES_WANTED = 65_536
"""The open-files limit asked for the broker (each topic's WAL holds files open)."""
LOAD_TIMEOUT_S = 600.0
RANGE_PAGE = 2000
"""Keys per etcd ``Range`` when counting the key space."""
IDLE_S = 5.0
"""Seconds the broker's idle CPU is measured over after a restart."""
RSS_TARGET_MIB = 1024.0
LOAD_TARGET_S = 60.0
RATIO_TARGET = 0.7


def topic_path(i: int) -> str:
    """The ``i``-th topic of the topics part."""
    return f"/{NAMESPACE}/t{i:05d}"


class RssSampler(fs._RssSampler):  # noqa: SLF001 - the benchmarks' one sampler, reused
    """``VmRSS`` of the broker every 100 ms (``faults_scenarios``), with the pid replaceable
    across a restart."""


async def in_parallel(items: Sequence[str], fn: Callable[[str], Awaitable[Any]], limit: int) -> list[str]:
    """``fn`` over ``items``, ``limit`` at once (``faults_scenarios._in_parallel``); failures."""
    return await fs._in_parallel(items, fn, limit=limit, timeout_s=120.0)  # noqa: SLF001


async def etcd_usage(endpoints: list[str]) -> tuple[int, int]:
    """``(keys, bytes)`` of the whole etcd key space: every key read in pages of
    :data:`RANGE_PAGE` (one response stays under gRPC's 4 MiB), key and value sizes summed."""
    store = await MetadataStore.connect(endpoints, request_timeout_s=60.0)
    count = size = 0
    start, end = b"\0", prefix_range_end(b"")
    try:
        while True:
            response = await store.range_raw(start, end, limit=RANGE_PAGE)
            count += len(response.kvs)
            size += sum(len(kv.key) + len(kv.value) for kv in response.kvs)
            if not response.more or not response.kvs:
                return count, size
            start = bytes(response.kvs[-1].key) + b"\0"
    finally:
        await store.close()


async def listed_topics(address: str) -> int:
    """How many topics of :data:`NAMESPACE` the broker at ``address`` reports loaded."""
    async with DanubeClient([address], request_timeout_ms=30_000) as client:
        return len(await client.admin.list_topics(NAMESPACE))


async def restart(broker: BrokerProcess, expected: int) -> dict[str, float]:
    """SIGTERM the broker, start it again, wait until it lists ``expected`` topics.

    Returns:
        ``stop_s``, ``ready_s`` (start to ready file), ``load_s`` (start to all listed) and
        ``load_cpu_s`` (the new broker's CPU seconds by then) and ``idle_cpu_pct`` (its CPU
        over the :data:`IDLE_S` seconds after, with no client: the per-topic timers).
    """
    t0 = time.monotonic()
    await asyncio.to_thread(broker.stop, timeout_s=300.0)
    stop_s = time.monotonic() - t0
    t0 = time.monotonic()
    await broker.start_async(timeout_s=LOAD_TIMEOUT_S)
    ready_s = time.monotonic() - t0
    while True:
        with contextlib.suppress(Exception):
            if await listed_topics(broker.address) >= expected:
                break
        if time.monotonic() - t0 > LOAD_TIMEOUT_S:
            return {"stop_s": stop_s, "ready_s": ready_s, "load_s": math.inf, "load_cpu_s": math.nan}
        await asyncio.sleep(0.2)
    load_s = time.monotonic() - t0
    load_cpu_s = loadgen.proc_cpu_s(broker.pid)
    await asyncio.sleep(IDLE_S)
    idle_cpu_pct = (loadgen.proc_cpu_s(broker.pid) - load_cpu_s) / IDLE_S * 100
    return {"stop_s": stop_s, "ready_s": ready_s, "load_s": load_s, "load_cpu_s": load_cpu_s, "idle_cpu_pct": idle_cpu_pct}


async def produce_spread(address: str, n: int, args: argparse.Namespace, broker_pid: int) -> dict[str, float]:
    """One producer per topic, ``args.messages`` sent round-robin over the ``n`` topics."""
    payload = loadgen.make_payload(args.size)
    async with DanubeClient([address], request_timeout_ms=60_000) as client:
        producers: list[Producer] = []

        async def open_one(path: str) -> None:
            producer = client.producer(path, producer_name="scale", max_in_flight_batches=4)
            await producer.open()
            producers.append(producer)

        t0 = time.monotonic()
        failed = await in_parallel([topic_path(i) for i in range(n)], open_one, args.create_concurrency)
        open_s = time.monotonic() - t0
        if failed:
            print(f"    {len(failed)} producers failed to open, e.g. {failed[0]}")
        turn = itertools.cycle(producers)

        async def send(data: bytes) -> asyncio.Future[int]:
            return next(turn).send_nowait(data)

        # warm-up: every producer's first batch (its stream opens), not measured
        await loadgen.window_loop(send, payload, messages=min(args.messages, n + 1000), window=args.window,
                                  time_limit_s=args.time_limit_s)
        cpu0 = loadgen.proc_cpu_s(broker_pid)
        result = await loadgen.window_loop(send, payload, messages=args.messages, window=args.window,
                                           server_pids=[broker_pid], time_limit_s=args.time_limit_s)
        broker_cpu = loadgen.proc_cpu_s(broker_pid) - cpu0
        keys, size = await etcd_usage(args.etcd_endpoints)
        await asyncio.gather(*(p.close() for p in producers), return_exceptions=True)
    return {"producers_open_s": open_s, "msgs_per_s": result.msgs_per_s, "acked": result.acked,
            "broker_cpu_us_per_msg": broker_cpu / max(result.acked, 1) * 1e6,
            "client_cpu_us_per_msg": result.client_cpu_s / max(result.acked, 1) * 1e6,
            "p50_ms": loadgen.percentile(result.latencies_s, 0.5) * 1e3, "etcd_keys": keys, "etcd_bytes": size}


async def topics_part(root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The topics curve (part 1): one point per step."""
    points: list[dict[str, Any]] = []
    with EtcdServer(root / "etcd") as etcd:
        args.etcd_endpoints = etcd.endpoints
        broker = BrokerProcess(etcd_endpoints=etcd.endpoints, data_dir=root / "broker")
        broker.start()
        try:
            base_keys, base_bytes = await etcd_usage(etcd.endpoints)
            created = 0
            one_topic_rate = math.nan
            for n in args.topics:
                print(f"  -- {n:,} topics")
                sampler = RssSampler(broker.pid)
                with sampler:
                    t0 = time.monotonic()
                    async with DanubeClient([broker.address], request_timeout_ms=60_000) as client:
                        failed = await in_parallel([topic_path(i) for i in range(created, n)],
                                                   client.admin.create_topic, args.create_concurrency)
                    create_s = time.monotonic() - t0
                    if failed:
                        print(f"    {len(failed)} creations failed, e.g. {failed[0]}")
                    create_per_s = (n - created) / max(create_s, 1e-9)
                    created = n
                    produced = await produce_spread(broker.address, n, args, broker.pid)
                if n == args.topics[0]:
                    one_topic_rate = produced["msgs_per_s"]
                print(f"    created {create_per_s:,.0f} topics/s; producers opened in {produced['producers_open_s']:.1f} s;"
                      f" {produced['msgs_per_s']:,.0f} msg/s ({produced['msgs_per_s'] / one_topic_rate:.2f} x one topic),"
                      f" CPU per msg: broker {produced['broker_cpu_us_per_msg']:.0f} us, client"
                      f" {produced['client_cpu_us_per_msg']:.0f} us; send->ack p50 {produced['p50_ms']:.1f} ms;"
                      f" RSS peak {sampler.peak:.0f} MiB")  # before the restart, which may fail
                times = await restart(broker, n)
                point = {
                    "topics": n, "create_per_s": create_per_s, "rss_mib": sampler.peak,
                    "rss_loaded_mib": fs.rss_mib(broker.pid), **produced, **times,
                    "msgs_ratio": produced["msgs_per_s"] / one_topic_rate,
                    "etcd_keys_per_topic": (produced["etcd_keys"] - base_keys) / n,
                    "etcd_bytes_per_topic": (produced["etcd_bytes"] - base_bytes) / n,
                }
                points.append(point)
                print(f"    RSS peak {point['rss_mib']:.0f} MiB, after restart {point['rss_loaded_mib']:.0f} MiB;"
                      f" etcd {point['etcd_keys_per_topic']:.1f} keys and {point['etcd_bytes_per_topic']:.0f} B per topic")
                print(f"    restart: stop {times['stop_s']:.1f} s, ready {times['ready_s']:.1f} s,"
                      f" all {n:,} loaded {times['load_s']:.1f} s (broker CPU {times['load_cpu_s']:.1f} s);"
                      f" then idle: broker CPU {times['idle_cpu_pct']:.0f} %")
        finally:
            broker.stop(timeout_s=300.0)
    return points


async def clients_step(address: str, n: int, args: argparse.Namespace, broker_pid: int) -> dict[str, float]:
    """``n`` producers and ``n`` consumers at once (part 2)."""
    topics = [f"/{NAMESPACE}/c{n}-{i}" for i in range(min(n, CLIENT_TOPICS))]
    per_producer = max(1, args.messages // n)
    total = per_producer * n
    window = max(2, 1024 // n)
    payload = loadgen.make_payload(args.size)
    received = 0
    expected = total  # lowered to what was acknowledged when the produce loop hits its time limit
    all_received = asyncio.Event()
    async with DanubeClient([address], request_timeout_ms=60_000) as pclient, \
            DanubeClient([address], request_timeout_ms=60_000) as cclient:
        for path in topics:
            await pclient.admin.create_topic(path)
        consumers = [cclient.consumer(topics[i % len(topics)], subscription="scale", consumer_name=f"c{i}",
                                      subscription_type=SubscriptionType.SHARED,
                                      initial_position=InitialPosition.EARLIEST) for i in range(n)]
        producers = [pclient.producer(topics[i % len(topics)], producer_name=f"p{i}", max_in_flight_batches=2)
                     for i in range(n)]
        t0 = time.monotonic()
        sem = asyncio.Semaphore(args.create_concurrency)

        async def opened(thing: Any) -> None:
            async with sem:
                await thing.open()

        await asyncio.gather(*(opened(c) for c in consumers), *(opened(p) for p in producers))
        open_s = time.monotonic() - t0

        async def consume(consumer: Any) -> None:
            nonlocal received
            while True:
                message = await consumer.receive()
                await consumer.ack(message)
                received += 1
                if received >= expected:
                    all_received.set()

        async def produce(producer: Producer) -> int:
            result = await loadgen.window_loop(lambda data: _sent(producer, data), payload, messages=per_producer,
                                               window=window, time_limit_s=args.time_limit_s)
            return result.acked

        readers = [asyncio.create_task(consume(c)) for c in consumers]
        with RssSampler(broker_pid) as sampler:
            cpu0 = loadgen.proc_cpu_s(broker_pid)
            t0 = time.monotonic()
            acked = sum(await asyncio.gather(*(produce(p) for p in producers)))
            produce_s = time.monotonic() - t0
            expected = acked
            if received >= expected:
                all_received.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_received.wait(), args.time_limit_s)
            consume_s = time.monotonic() - t0
            cpu = loadgen.proc_cpu_s(broker_pid) - cpu0
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await asyncio.gather(*(p.close() for p in producers), *(c.close() for c in consumers), return_exceptions=True)
    return {"clients": n, "topics": len(topics), "messages": acked, "window": window, "open_s": open_s,
            "produce_msgs_per_s": acked / produce_s, "consume_msgs_per_s": received / consume_s,
            "received": received, "rss_mib": sampler.peak, "broker_cpu_s": cpu}


async def _sent(producer: Producer, data: bytes) -> asyncio.Future[int]:
    return producer.send_nowait(data)


async def clients_part(root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The clients curve (part 2): one point per step."""
    points = []
    with EtcdServer(root / "etcd-clients") as etcd:
        broker = BrokerProcess(etcd_endpoints=etcd.endpoints, data_dir=root / "broker-clients")
        broker.start()
        try:
            for n in args.clients:
                point = await clients_step(broker.address, n, args, broker.pid)
                points.append(point)
                print(f"  -- {n:,} producers + {n:,} consumers on {point['topics']} topics: opened in"
                      f" {point['open_s']:.1f} s; produce {point['produce_msgs_per_s']:,.0f} msg/s, consume"
                      f" {point['consume_msgs_per_s']:,.0f} msg/s ({point['received']:,}/{point['messages']:,});"
                      f" broker RSS peak {point['rss_mib']:.0f} MiB, CPU {point['broker_cpu_s']:.1f} s")
        finally:
            broker.stop(timeout_s=120.0)
    return points


def external_part(module: str, function: str, quick: bool) -> dict[str, Any] | None:
    """``benchmarks/{module}.py::{function}(quick)``, or ``None`` when missing or failing."""
    try:
        measure = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as exc:
        print(f"  {module}.{function} not available: {exc}")
        return None
    try:
        result: dict[str, Any] = measure(quick)
    except Exception:  # noqa: BLE001 - a failed part leaves its figures unmeasured
        traceback.print_exc()
        return None
    return result


def _figure(part: dict[str, Any] | None, key: str) -> float:
    value = (part or {}).get(key)
    return float(value) if isinstance(value, (int, float)) else math.nan


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small steps (a smoke run of about 2 minutes)")
    parser.add_argument("--topics", type=int, nargs="+", help="topic steps (default 1 100 1000 10000)")
    parser.add_argument("--clients", type=int, nargs="+", help="producer/consumer steps (default 1 100 1000)")
    parser.add_argument("--messages", type=int, help="messages per step (default 100,000; --quick 10,000)")
    parser.add_argument("--size", type=int, default=128, help="payload bytes")
    parser.add_argument("--window", type=int, default=256, help="most unacked messages of the topics loop")
    parser.add_argument("--create-concurrency", type=int, default=64, help="creations and opens at once")
    parser.add_argument("--time-limit-s", type=float, default=60.0, help="longest produce loop, in s")
    parser.add_argument("--skip-topics", action="store_true")
    parser.add_argument("--skip-clients", action="store_true")
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--skip-commit", action="store_true")
    args = parser.parse_args(argv)
    args.topics = args.topics or list(TOPIC_STEPS_QUICK if args.quick else TOPIC_STEPS)
    args.clients = args.clients or list(CLIENT_STEPS_QUICK if args.quick else CLIENT_STEPS)
    args.messages = args.messages or (10_000 if args.quick else 100_000)
    # as operators do for brokers of many topics; the broker inherits the limits
    print(f"open files limit of the broker: {raise_open_files_limit(wanted=OPEN_FILES_WANTED)[0]:,}")
    topic_points: list[dict[str, Any]] = []
    client_points: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="danube-scale-") as tmp:
        root = Path(tmp)
        if not args.skip_topics:
            print(f"topics: {args.topics}, {args.messages:,} messages of {args.size} B per step, window {args.window}")
            topic_points = asyncio.run(topics_part(root, args))
        if not args.skip_clients:
            print(f"clients: {args.clients}, {args.messages:,} messages of {args.size} B per step")
            client_points = asyncio.run(clients_part(root, args))
    recovery = None if args.skip_recovery else external_part("scale_recovery", "measure_recovery", args.quick)
    commit = None if args.skip_commit else external_part("scale_commit", "measure_commit", args.quick)
    last = topic_points[-1] if topic_points else {}
    line = (
        f"scale: topics={last.get('topics', 0)} rss_mib={fs.fmt(last.get('rss_mib', math.nan), 0)}"
        f" load_s={fs.fmt(last.get('load_s', math.nan), 1)}"
        f" msgs_ratio_10000={fs.fmt(last.get('msgs_ratio', math.nan), 2)}"
        f" recovery_s_per_gib={fs.fmt(_figure(recovery, 'recovery_s_per_gib'), 2)}"
        f" commit_ms_1={fs.fmt(_figure(commit, 'commit_ms_1'), 1)}"
        f" commit_ms_1000={fs.fmt(_figure(commit, 'commit_ms_1000'), 1)}"
    )
    write_result("scale", {"topics": topic_points, "clients": client_points, "recovery": recovery, "commit": commit,
                           "size_bytes": args.size, "window": args.window, "messages": args.messages})
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
