"""A Jepsen-style checker: etcd and 3 real brokers under keyed, idempotent load and a seeded
schedule of faults; at the end every acked message must be read back exactly once, at its
acked offset.

    .venv/bin/python benchmarks/chaos.py                                   # 60 s, a fault every 5 s
    .venv/bin/python benchmarks/chaos.py --duration-s 600 --faults-every-s 10 --seed 7

Everything runs on loopback in a temporary directory and is stopped by pid at the end, also on
errors, Ctrl-C, SIGTERM and the time limit (``chaos_faults.py``: the cluster; ``chaos_load.py``:
the load; ``chaos_check.py``: the read-back and the verdict; ``chaos_end.py``: the end's steps;
``chaos_proxy.py``: the proxy).

* **Cluster.** etcd and 3 brokers (``--lease-ttl-s 3``, ``--segment-max-age-s 2``, objects on
  a local ``file://`` store). Broker 3 reaches etcd only through a TCP proxy that can be
  blackholed; broker 2's data directory is a tmpfs (root only; otherwise the disk-full fault is
  skipped with a note).
* **Load.** Two plain topics and one topic with 3 partitions. One producer per plain topic and
  two on the partitioned topic (each its own client, idempotent as every producer of the
  client library, every message with a key), together ``--rate`` msg/s. Every send is recorded
  with its outcome: acked (with its offset), failed (refused for good) or unknown (time-out,
  transport, retries given up; also whatever is unresolved at the end). A consumer per topic
  (Exclusive, from ``EARLIEST``) runs throughout. A tiering loop (``tier_sealed_segments``, as
  the continuous writer) runs every second on the brokers' object store.
* **Faults**, one at a time, every ``--faults-every-s`` (or when the previous one healed):
  every kind once per cycle, the order, targets and durations drawn by ``random.Random(--seed)``:
  ``kill`` SIGKILL a broker, restart it 0.5-3 s later on its data directory and port;
  ``pause`` SIGSTOP a broker for TTL + 1-3 s, then SIGCONT;
  ``etcd-cut`` blackhole broker 3's proxy to etcd for TTL + 1-4 s, then heal it;
  ``disk-full`` fill broker 2's tmpfs, hold it full 2-5 s, free it;
  ``etcd-restart`` SIGKILL etcd, start it again 0.5-3 s later on the same data directory and ports;
  ``move`` unload a random topic or partition (``Admin.UnloadTopic``): the leader moves it;
  ``tiering-race`` two more writers run ``tier_sealed_segments`` over every topic at once
  (three with the tiering loop).
* **End.** Every broker runs again, producers stop, tiering catches up (active segments
  sealed), and a fresh subscription reads every topic and partition from ``EARLIEST``
  (``chaos_check.py`` defines lost, duplicated and unavailable_at_end).

The run prints each fault, the counts per fault kind, the outcomes of the sends, details of
every lost and duplicated message (the first 20), and ends with exactly one line:
``chaos: acked=N lost=N duplicated=N unavailable_at_end=N faults=N seed=N``
"""

from __future__ import annotations

import _thread
import argparse
import asyncio
import collections
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chaos_check
import chaos_end
import faults_scenarios as fs
from chaos_faults import KINDS, ChaosCluster, FaultRecord, Faults, continue_paused, unmount_all
from chaos_load import Ledger, LiveConsumer, ProducerTask, TieringLoop, new_client, settle

from danube_pipeline.names import TopicName
from danube_pipeline.partitions import partition_names

PLAIN_TOPICS = ("/chaos/plain-0", "/chaos/plain-1")
PARTITIONED_TOPIC = "/chaos/parted"
PARTITIONS = 3


@dataclass
class Summary:
    """The closing line's figures (``nan`` until judged)."""

    acked: int | None = None
    lost: int | None = None
    duplicated: int | None = None
    unavailable: int | None = None
    fault_log: list[FaultRecord] = field(default_factory=list)
    seed: int = 0
    failed: list[str] = field(default_factory=list)

    def line(self) -> str:
        def n(value: int | None) -> str:
            return "nan" if value is None else str(value)

        return (f"chaos: acked={n(self.acked)} lost={n(self.lost)} duplicated={n(self.duplicated)}"
                f" unavailable_at_end={n(self.unavailable)} faults={len(self.fault_log)} seed={self.seed}")


SUMMARY = Summary()
_FINISHED = threading.Event()
_PRINT_LOCK = threading.Lock()


def say(text: str) -> None:
    """Print a line at once."""
    with _PRINT_LOCK:
        print(text, flush=True)


def all_partitions() -> list[str]:
    """Every plain topic and partition the load writes to."""
    return [*PLAIN_TOPICS, *(p.path for p in partition_names(TopicName.parse(PARTITIONED_TOPIC), PARTITIONS))]


async def run_faults(faults: Faults, args: argparse.Namespace, t0: float) -> None:
    """One fault every ``--faults-every-s`` until ``--duration-s`` has passed: every kind once
    per cycle, in an order shuffled by the seeded generator (a short run still sees each kind)."""
    slot = 1
    cycle: list[str] = []
    while True:
        due = t0 + args.warmup_s + (slot - 1) * args.faults_every_s
        if due - t0 >= args.duration_s:
            return
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        if not cycle:
            cycle = list(faults.kinds)
            faults.rng.shuffle(cycle)
        await faults.inject(cycle.pop())
        slot = max(slot + 1, int((time.monotonic() - t0 - args.warmup_s) / args.faults_every_s) + 1)


async def run(args: argparse.Namespace, cluster: ChaosCluster) -> None:
    """Start the cluster and the load, inject the faults, judge."""
    rng = random.Random(args.seed)
    await cluster.start()
    addresses = cluster.addresses
    say(f"  etcd {cluster.etcd.endpoint}; brokers {', '.join(addresses)} (broker 3 via proxy {cluster.proxy.address});"
        f" broker 2 on {'a tmpfs' if cluster.disk_note is None else 'disk: ' + cluster.disk_note}")
    if cluster.disk_note is not None:
        say(f"  note: the disk-full fault is skipped: no tmpfs ({cluster.disk_note})")
    admin = new_client(addresses, request_timeout_ms=10_000, retries=10)
    ledger = Ledger()
    producers: list[ProducerTask] = []
    consumers: list[LiveConsumer] = []
    topics = all_partitions()
    tiering = TieringLoop("tiering", addresses, cluster.etcd.endpoints, cluster.objects_url, topics)
    try:
        await admin.connect()
        for topic in PLAIN_TOPICS:
            await admin.admin.create_topic(topic)
        await admin.admin.create_topic(PARTITIONED_TOPIC, partitions=PARTITIONS)
        targets = [*PLAIN_TOPICS, PARTITIONED_TOPIC, PARTITIONED_TOPIC]
        producers = [ProducerTask(i, t, addresses, ledger, rate_per_s=args.rate / len(targets))
                     for i, t in enumerate(targets)]
        consumers = [LiveConsumer(t, addresses, ledger) for t in (*PLAIN_TOPICS, PARTITIONED_TOPIC)]
        for producer in producers:
            producer.start()
        for consumer in consumers:
            consumer.start()
        tiering.start()
        t0 = time.monotonic()
        faults = Faults(cluster, rng, topics=topics, tiering_topics=topics, say=say, t0=t0)
        SUMMARY.fault_log = faults.log  # counted in the closing line also when the run is interrupted
        say(f"== load {args.rate} msg/s on {len(targets)} producers, faults every {args.faults_every_s:g} s for"
            f" {args.duration_s:g} s, kinds {', '.join(faults.kinds)}")
        await run_faults(faults, args, t0)
        await asyncio.sleep(max(0.0, t0 + args.duration_s - time.monotonic()))
        say("== end: every broker runs, producers stop, tiering catches up")
        for line in await cluster.ensure_running():
            say(f"  {line}")
        await chaos_end.stop_load(addresses, topics, ledger, producers, consumers, drain_s=args.drain_s, say=say)
        await tiering.stop()
        await chaos_check.catch_up(tiering, addresses, topics, timeout_s=args.catch_up_s, say=say)
        tiering.start()
        say(f"  tiering: {tiering.objects_written} objects over {tiering.rounds} rounds;"
            f" {sum(tiering.errors.values())} errors" + (f", e.g. {tiering.errors.most_common(1)[0][0]}" if tiering.errors else ""))
        say("== read-back: a fresh subscription per topic and partition from EARLIEST")
        reads = await chaos_end.read_back(addresses, topics, ledger, stall_s=args.stall_s, say=say)
        verdict = chaos_check.judge(ledger, reads)
        by_kind = collections.Counter(f.kind for f in faults.log)
        failed_faults = sum(1 for f in faults.log if "FAILED" in f.note)
        say(f"== faults: {len(faults.log)} ({failed_faults} failed to inject or heal): "
            + ", ".join(f"{k} {by_kind.get(k, 0)}" for k in KINDS))
        say(f"  unacked sends stored: {verdict.stored_unacked:,} (of which stored more than once:"
            f" {verdict.unacked_duplicates}; refused for good yet stored: {verdict.stored_refused}); allowed")
        say(f"  acked messages found only at another offset than acked: {verdict.misplaced} (counted as lost)")
        for line in chaos_check.detail_lines(verdict, reads, faults.log, t0):
            say(line)
        SUMMARY.acked = verdict.acked
        SUMMARY.lost = len(verdict.lost)
        SUMMARY.duplicated = len(verdict.duplicated)
        SUMMARY.unavailable = len(verdict.unavailable)
    finally:
        await settle([*producers, *consumers, tiering])
        await fs.bounded(admin.close(), 10)
        await fs.bounded(cluster.proxy.close(), 10)


def _watchdog(limit_s: float, pids: set[int]) -> None:
    """After ``limit_s``: interrupt the main thread; 30 s later kill what is left and exit."""
    if _FINISHED.wait(limit_s):
        return
    say(f"chaos: time limit of {limit_s:g} s reached; stopping")
    SUMMARY.failed.append("time limit")
    continue_paused()
    _thread.interrupt_main()
    if _FINISHED.wait(30):
        return
    for pid in list(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    unmount_all()
    say(SUMMARY.line())
    os._exit(3)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    continue_paused()
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run, print the closing line.

    Returns:
        0 when the run finished and found nothing lost or duplicated, 1 otherwise.
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=None, help="seed of the fault schedule (default: from the clock)")
    parser.add_argument("--duration-s", type=float, default=60.0, help="how long faults are injected under load")
    parser.add_argument("--faults-every-s", type=float, default=5.0, help="one fault starts every this many seconds")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="load without faults first, s")
    parser.add_argument("--rate", type=int, default=200, help="messages per second, all producers together")
    parser.add_argument("--lease-ttl-s", type=int, default=3, help="the brokers' --lease-ttl-s")
    parser.add_argument("--tmpfs-mib", type=int, default=96, help="size of broker 2's tmpfs, MiB")
    parser.add_argument("--stall-s", type=float, default=30.0,
                        help="a reader waiting this long at an offset ends; what is beyond is unavailable_at_end")
    parser.add_argument("--drain-s", type=float, default=15.0,
                        help="longest wait for the live consumers to receive every acked message at the end, s")
    parser.add_argument("--catch-up-s", type=float, default=60.0, help="longest wait for tiering to catch up, s")
    parser.add_argument("--time-limit-s", type=float, default=None, help="stop everything after this long (default duration + 400 s)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    args = parser.parse_args(argv)
    args.seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    SUMMARY.seed = args.seed
    limit_s = args.time_limit_s or args.duration_s + 400.0
    logging.getLogger("danube_pipeline").setLevel(logging.ERROR)  # reconnect warnings: counted, not printed
    signal.signal(signal.SIGTERM, _on_sigterm)
    tmp = Path(tempfile.mkdtemp(prefix="danube-chaos-"))
    say(f"chaos: seed {args.seed}, {args.duration_s:g} s, a fault every {args.faults_every_s:g} s; {os.cpu_count()} CPUs,"
        f" Python {sys.version.split()[0]}; state in {tmp}")
    cluster = ChaosCluster(tmp, lease_ttl_s=args.lease_ttl_s, tmpfs_mib=args.tmpfs_mib)
    threading.Thread(target=_watchdog, args=(limit_s, cluster.pids), daemon=True, name="watchdog").start()
    started = time.monotonic()
    try:
        asyncio.run(run(args, cluster))
    except KeyboardInterrupt as exc:
        say(f"chaos: interrupted ({exc})")
        SUMMARY.failed.append("interrupted")
    except Exception as exc:  # noqa: BLE001 - the closing line is printed whatever happened
        say(f"chaos: FAILED: {fs.describe(exc)}")
        for text in traceback.format_exc().rstrip().splitlines()[-8:]:
            say(f"    {text}")
        SUMMARY.failed.append("error")
    finally:
        cluster.stop()
        if args.keep:
            say(f"chaos: logs kept in {tmp} (logs/)")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    _FINISHED.set()
    if SUMMARY.failed:
        say(f"chaos: did not finish: {', '.join(SUMMARY.failed)}")
    say(f"chaos: {time.monotonic() - started:.0f} s in all")
    say(SUMMARY.line())
    return 0 if not SUMMARY.failed and SUMMARY.lost == 0 and SUMMARY.duplicated == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
