"""Replication under owner kills: etcd and 3 brokers, a namespace at replication factor 3 with
min ISR 2, idempotent producers and consumers throughout, at least 20 SIGKILLs of topic owners
(half of them with the broker's data directory deleted before it restarts), and at the end
every acked message read back from the earliest position, exactly once, at its acked offset.

    .venv/bin/python benchmarks/replication.py                        # 20 kills, 10 wiped
    .venv/bin/python benchmarks/replication.py --kills 40 --seed 7

Everything runs on loopback in a temporary directory and is stopped by pid at the end, also on
errors, Ctrl-C, SIGTERM and the time limit. The parts are the chaos checker's
(``benchmarks/chaos.py``): its load (``chaos_load.py``), end, read-back and verdict
(``chaos_end.py``, ``chaos_check.py``) and cluster (``chaos_faults.py``); ``replication_kills.py`` holds the
kills and the failover measurement, ``replication_throughput.py`` the throughput phase.

* **Cluster.** etcd and 3 brokers, ``--lease-ttl-s 3`` and ``--replica-replace-after-s 5``
  (each broker flag only if ``python -m broker --help`` lists it). The namespace ``replicated``
  gets ``replication_factor`` 3 and ``min_insync_replicas`` 2 (``update_namespace_policy``, as
  ``danube-admin namespaces set-policy``), the namespace ``single`` replication factor 1. When
  the policy does not take the replication fields, the run goes on at RF 1 without wipes (at
  RF 1 a wipe loses data by design) and says so; ``rf3_ratio`` is then ``nan``.
* **Throughput** (no faults, no other load; ``--tput-rounds 0`` skips it): 1 KiB messages through
  one producer, at RF 3 / min ISR 2 against RF 1, alternated, with the CPU of the client and of
  the brokers; ``rf3_ratio`` = best RF 3 msg/s over best RF 1 msg/s
  (``replication_throughput.py``). Target >= 0.5.
* **Load.** ``--topics`` topics in ``replicated``, one keyed producer each (its own client,
  idempotent as every producer of the client library), ``--rate`` msg/s together, every send
  recorded with its outcome (acked with its offset, failed, unknown), and one Exclusive consumer
  per topic from ``EARLIEST`` acking everything. No tiering runs at RF > 1 unless ``--tiering``:
  every read is then served from the brokers' replicated WALs, so a replica that misses an acked
  message shows as lost instead of being read back from object storage (at RF 1 the tiering
  loop runs, as in ``chaos.py``, so offsets on a failed-over broker stay readable).
* **Kills** (``replication_kills.py``), one after the other: wait until every topic's ISR is
  full again (or ``--isr-wait-s``), SIGKILL the owner of a loaded topic, measure the failover of
  every loaded topic it owned (SIGKILL until the first ack of a message sent after it; target
  ``failover_p99_s`` <= lease TTL + 2 s), restart it, wiped in exactly ``--kills`` // 2 of the
  kills (seeded). Each kill's line says whether the victim was the cluster leader (its topics
  then wait for a new leader's election first), and the failovers are summed up both ways.
* **End.** Every broker runs, the ISRs are full again (or ``--isr-wait-s``), the producers
  stop, a fresh subscription per topic reads it from ``EARLIEST`` (``chaos_check.read_partition``)
  and every acked message is judged (``chaos_check.judge``). ``lost`` counts acked messages not
  read back at their acked offset, those beyond where a reader stalled included (printed apart);
  ``duplicated`` those read at two or more offsets.

The run prints every kill, the failover figures, the outcomes of the sends, details of every
lost and duplicated message (the first 20), and ends with exactly one line:
``replication: acked=N lost=N duplicated=N failovers=N wiped=N failover_p99_s=X rf3_ratio=X``
(``failovers``: kills after which every topic the victim owned served again within the bound).
The exit status is 0 when the run finished, nothing acked was lost or duplicated and every kill
failed over; the two figures' targets are printed as met or not, not enforced.
"""

from __future__ import annotations

import _thread
import argparse
import asyncio
import contextlib
import logging
import math
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
from chaos_load import Ledger, LiveConsumer, ProducerTask, TieringLoop, new_client, settle
from faults import broker_flags
from loadgen import percentile
from replication_kills import OwnerKills, ReplicationCluster, wipe_schedule
from replication_throughput import throughput_phase

from danube_pipeline.admin.namespaces import update_namespace_policy
from danube_pipeline.metadata.store import MetadataStore

REPLICATED_NS = "replicated"
"""The namespace at ``--replication-factor`` / ``--min-insync-replicas``: the load and the RF 3 rounds."""
SINGLE_NS = "single"
"""The namespace at replication factor 1: the RF 1 rounds of the throughput phase."""


@dataclass
class Summary:
    """The closing line's figures (``None``/``nan`` until measured)."""

    acked: int | None = None
    lost: int | None = None
    duplicated: int | None = None
    failovers: int = 0
    wiped: int = 0
    failover_p99_s: float = math.nan
    rf3_ratio: float = math.nan

    def line(self) -> str:
        def n(value: int | None) -> str:
            return "nan" if value is None else str(value)

        return (f"replication: acked={n(self.acked)} lost={n(self.lost)} duplicated={n(self.duplicated)}"
                f" failovers={self.failovers} wiped={self.wiped} failover_p99_s={fs.fmt(self.failover_p99_s, 2)}"
                f" rf3_ratio={fs.fmt(self.rf3_ratio, 2)}")


@dataclass
class Load:
    """The load of a run: its ledger and topics, and what runs on them once started."""

    ledger: Ledger
    topics: list[str]
    producers: list[ProducerTask] = field(default_factory=list)
    consumers: list[LiveConsumer] = field(default_factory=list)
    tiering: TieringLoop | None = None
    kills: OwnerKills | None = None

    async def stop(self) -> None:
        """Stop every producer, consumer and the tiering loop, all at once."""
        await settle([*self.producers, *self.consumers, *([self.tiering] if self.tiering else [])])


SUMMARY = Summary()
FAILED: list[str] = []
_FINISHED = threading.Event()
_PRINT_LOCK = threading.Lock()


def say(text: str) -> None:
    """Print a line at once."""
    with _PRINT_LOCK:
        print(text, flush=True)


def failover_p99(samples: list[float]) -> float:
    """The nearest-rank p99 of failover samples in s (``inf`` for one that never came); ``nan``
    for none."""
    return percentile(sorted(samples), 0.99)


async def set_policies(meta: MetadataStore, args: argparse.Namespace) -> int:
    """Write the replication policy of :data:`REPLICATED_NS` and RF 1 for :data:`SINGLE_NS`;
    the replication factor in effect for :data:`REPLICATED_NS` (1 when the policy does not
    take the fields: the run then goes on at RF 1)."""
    changes: dict[str, int | str] = {"replication_factor": args.replication_factor,
                                     "min_insync_replicas": args.min_insync_replicas}
    try:
        doc = await update_namespace_policy(meta, REPLICATED_NS, changes)
        await update_namespace_policy(meta, SINGLE_NS, {"replication_factor": 1})
    except Exception as exc:  # noqa: BLE001 - reported; the run goes on at RF 1
        say(f"  note: the replication policy was refused ({fs.describe(exc)}); running at RF 1 without wipes")
        return 1
    policy = doc["policy"]
    applied = args.replication_factor == 1 or (
        isinstance(policy, dict) and policy.get("replication_factor") == args.replication_factor)
    if not applied:
        say("  note: NamespacePolicy has no replication_factor yet; running at RF 1 without wipes")
        return 1
    say(f"  policy of {REPLICATED_NS}: {policy}")
    return int(args.replication_factor)


async def run(args: argparse.Namespace, cluster: ReplicationCluster) -> None:
    """Start the cluster, measure throughput, run the load and the kills, judge."""
    rng = random.Random(args.seed)
    await cluster.start()
    addresses = cluster.addresses
    say(f"  etcd {cluster.etcd.endpoint}; brokers {', '.join(addresses)}; broker args {cluster.broker_args}")
    meta = await MetadataStore.connect(cluster.etcd.endpoints)
    load = Load(Ledger(), [f"/{REPLICATED_NS}/load-{i}" for i in range(args.topics)])
    try:
        factor = await set_policies(meta, args)
        if args.tput_rounds > 0:
            say(f"== throughput: {args.tput_messages:,} x 1 KiB per round, window {args.window},"
                f" {args.tput_rounds} rounds per replication factor, alternated")
            tput = await throughput_phase(cluster, meta, namespaces={1: SINGLE_NS, 3: REPLICATED_NS},
                                          in_effect={1: 1, 3: factor},
                                          rounds=args.tput_rounds, messages=args.tput_messages, window=args.window,
                                          warmup=args.tput_warmup, say=say)
            say(f"  rf1_msg_s={fs.fmt(tput.best_rf1, 0)} rf3_msg_s={fs.fmt(tput.best_rf3, 0)} (best rounds; the"
                f" replicated namespace is at RF {factor}) ratio {fs.fmt(tput.ratio, 2)}; target >= 0.5:"
                f" {'met' if tput.ratio >= 0.5 else 'NOT met'}")
            SUMMARY.rf3_ratio = tput.ratio if factor > 1 else math.nan
        await load_and_kills(args, cluster, meta, load, factor, rng)
        await judge_end(args, cluster, load)
    finally:
        await load.stop()
        await fs.bounded(meta.close(), 10)


async def load_and_kills(args: argparse.Namespace, cluster: ReplicationCluster, meta: MetadataStore, load: Load,
                         factor: int, rng: random.Random) -> None:
    """Create the load topics, start the load, kill ``--kills`` owners one after the other."""
    addresses = cluster.addresses
    topics = load.topics
    admin = new_client(addresses, request_timeout_ms=10_000, retries=10)
    try:
        await admin.connect()
        for topic in topics:
            await admin.admin.create_topic(topic)
    finally:
        await fs.bounded(admin.close(), 10)
    t0 = time.monotonic()
    kills = OwnerKills(cluster, meta, load.ledger.sends, topics=topics, replication_factor=factor,
                       isr_needed=args.kill_at_isr or factor, rng=rng, say=say, t0=t0,
                       failover_bound_s=args.lease_ttl_s + args.failover_bound_s, isr_wait_s=args.isr_wait_s)
    load.kills = kills
    waited_s, why = await kills.settle()
    say(f"== load topics {', '.join(topics)} at RF {factor}: ready after {fs.fmt(waited_s, 1)} s {why}")
    load.producers = [ProducerTask(i, t, addresses, load.ledger, rate_per_s=args.rate / len(topics))
                      for i, t in enumerate(topics)]
    load.consumers = [LiveConsumer(t, addresses, load.ledger) for t in topics]
    for producer in load.producers:
        producer.start()
    for consumer in load.consumers:
        consumer.start()
    tiering_on = args.tiering or factor <= 1
    if tiering_on:
        load.tiering = TieringLoop("tiering", addresses, cluster.etcd.endpoints, cluster.objects_url, topics)
        load.tiering.start()
    wipes = wipe_schedule(args.kills, args.kills // 2 if factor > 1 and not args.no_wipe else 0, rng)
    say(f"== load {args.rate} msg/s on {len(topics)} producers; tiering {'on' if tiering_on else 'off'};"
        f" {args.kills} kills ({sum(wipes)} wiped), lease TTL {args.lease_ttl_s} s")
    await asyncio.sleep(args.warmup_s)
    phase_end = time.monotonic() + args.max_kills_s
    for number, wipe in enumerate(wipes, start=1):
        if time.monotonic() > phase_end:
            say(f"  --max-kills-s {args.max_kills_s:g} reached after {number - 1} kills")
            FAILED.append("kill phase time limit")
            break
        due = kills.kills[-1].killed_at + args.kill_every_s if kills.kills else 0.0
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        outcome = await fs.bounded(kills.kill(number, wipe=wipe), args.isr_wait_s + args.failover_bound_s + 120)
        if not outcome.ok:
            say(f"  kill #{number} FAILED: {fs.describe(outcome.error or RuntimeError('?'))}")
            for line in await cluster.ensure_running():
                say(f"    {line}")
        SUMMARY.failovers = sum(k.failed_over for k in kills.kills)
        SUMMARY.wiped = sum(k.wiped for k in kills.kills)
    for line in await cluster.ensure_running():
        say(f"  {line}")
    waited_s, why = await kills.settle()
    say(f"  after the last kill: ready after {fs.fmt(waited_s, 1)} s {why}")
    await asyncio.sleep(args.tail_s)
    report_kills(kills, args)


def report_kills(kills: OwnerKills, args: argparse.Namespace) -> None:
    """The failover figures and the time until the ISRs were full again, by kind of restart."""
    samples = [s for k in kills.kills for s in k.failover_s.values()]
    finite = sorted(s for s in samples if math.isfinite(s))
    SUMMARY.failover_p99_s = failover_p99(samples)
    SUMMARY.failovers = sum(k.failed_over for k in kills.kills)
    SUMMARY.wiped = sum(k.wiped for k in kills.kills)
    target = args.lease_ttl_s + 2
    say(f"== kills: {len(kills.kills)} ({SUMMARY.wiped} wiped), {SUMMARY.failovers} failed over;"
        f" {len(samples)} topic failovers: p50 {fs.fmt(percentile(finite, 0.5), 2)} s,"
        f" p99 {fs.fmt(SUMMARY.failover_p99_s, 2)} s, max {fs.fmt(max(samples, default=math.nan), 2)} s"
        f" ({len(samples) - len(finite)} not within {args.lease_ttl_s + args.failover_bound_s:g} s);"
        f" target p99 <= {target} s: {'met' if SUMMARY.failover_p99_s <= target else 'NOT met'}")
    for leader in (False, True):
        of_kind = sorted(s for k in kills.kills if k.was_leader == leader for s in k.failover_s.values())
        if of_kind:
            say(f"  failover when the victim {'was' if leader else 'was not'} the cluster leader:"
                f" p50 {fs.fmt(percentile(of_kind, 0.5), 2)} s, max {fs.fmt(of_kind[-1], 2)} s (n={len(of_kind)})")
    for wiped in (False, True):
        ready = sorted(k.ready_s for k in kills.kills if k.wiped == wiped and not math.isnan(k.ready_s))
        if ready:
            say(f"  ISRs full again after a {'wiped' if wiped else 'plain'} restart:"
                f" p50 {fs.fmt(percentile(ready, 0.5), 1)} s, max {fs.fmt(ready[-1], 1)} s (n={len(ready)})")


async def judge_end(args: argparse.Namespace, cluster: ReplicationCluster, load: Load) -> None:
    """Stop the load, read every topic from ``EARLIEST``, judge every acked message."""
    addresses = cluster.addresses
    say("== end: every broker runs, producers stop")
    await chaos_end.stop_load(addresses, load.topics, load.ledger, load.producers, load.consumers,
                              drain_s=args.drain_s, say=say)
    if load.tiering is not None:
        await load.tiering.stop()
        await chaos_check.catch_up(load.tiering, addresses, load.topics, timeout_s=args.catch_up_s, say=say)
    say("== read-back: a fresh subscription per topic from EARLIEST")
    reads = await chaos_end.read_back(addresses, load.topics, load.ledger, stall_s=args.stall_s, say=say)
    verdict = chaos_check.judge(load.ledger, reads)
    say(f"  acked {verdict.acked:,}: not read back {len(verdict.lost)} (of which found only at another offset"
        f" {verdict.misplaced}), beyond a stalled reader {len(verdict.unavailable)}, read more than once"
        f" {len(verdict.duplicated)}")
    say(f"  unacked sends stored: {verdict.stored_unacked:,} (of which stored more than once:"
        f" {verdict.unacked_duplicates}; refused for good yet stored: {verdict.stored_refused}); allowed")
    records, t0 = (load.kills.records, load.kills.t0) if load.kills else ([], 0.0)
    for line in chaos_check.detail_lines(verdict, reads, records, t0):
        say(line)
    SUMMARY.acked = verdict.acked
    SUMMARY.lost = len(verdict.lost) + len(verdict.unavailable)
    SUMMARY.duplicated = len(verdict.duplicated)


def _watchdog(limit_s: float, pids: set[int]) -> None:
    """After ``limit_s``: interrupt the main thread; 30 s later kill what is left and exit."""
    if _FINISHED.wait(limit_s):
        return
    say(f"replication: time limit of {limit_s:g} s reached; stopping")
    FAILED.append("time limit")
    _thread.interrupt_main()
    if _FINISHED.wait(30):
        return
    for pid in list(pids):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    say(SUMMARY.line())
    os._exit(3)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--seed", type=int, default=None, help="seed of the victims and of which kills wipe (default: from the clock)")
    add("--kills", type=int, default=20, help="SIGKILLs of owners; kills // 2 of them wipe the data directory")
    add("--no-wipe", action="store_true", help="never wipe a killed broker's data directory")
    add("--topics", type=int, default=4, help="loaded topics in the replicated namespace")
    add("--rate", type=int, default=400, help="messages per second, all producers together (64-byte payloads)")
    add("--replication-factor", type=int, default=3, help="the replicated namespace's replication_factor")
    add("--min-insync-replicas", type=int, default=2, help="the replicated namespace's min_insync_replicas")
    add("--lease-ttl-s", type=int, default=3, help="the brokers' --lease-ttl-s")
    add("--replica-replace-after-s", type=float, default=5.0, help="the brokers' --replica-replace-after-s")
    add("--isr-wait-s", type=float, default=60.0, help="longest wait for full ISRs before a kill and at the end, s")
    add("--kill-at-isr", type=int, default=0,
        help="kill once every ISR holds this many running brokers (default: the replication factor, a full ISR)")
    add("--failover-bound-s", type=float, default=30.0,
        help="a failover not done within lease TTL + this many s counts as infinite")
    add("--kill-every-s", type=float, default=2.0, help="at least this long from one kill to the next, s")
    add("--max-kills-s", type=float, default=1500.0, help="no kill starts after this long into the kill phase, s")
    add("--warmup-s", type=float, default=3.0, help="load without faults before the first kill, s")
    add("--tail-s", type=float, default=3.0, help="load after the ISRs are full again at the end, s")
    add("--tiering", action="store_true", help="run the tiering loop also at RF > 1")
    add("--tput-rounds", type=int, default=2, help="throughput rounds per replication factor (0: skip the phase)")
    add("--tput-messages", type=int, default=40_000, help="1 KiB messages per throughput round")
    add("--tput-warmup", type=int, default=4_000, help="unmeasured messages before each throughput round")
    add("--window", type=int, default=4096, help="most unacked messages in the throughput phase")
    add("--stall-s", type=float, default=30.0, help="a reader waiting this long at an offset ends (unavailable)")
    add("--drain-s", type=float, default=15.0, help="longest wait for the live consumers at the end, s")
    add("--catch-up-s", type=float, default=60.0, help="longest wait for tiering to catch up (when it runs), s")
    add("--time-limit-s", type=float, default=None,
        help="stop everything after this long (default 60 s per kill + 400)")
    add("--keep", action="store_true", help="keep the temporary directory (logs)")
    args = parser.parse_args(argv)
    args.seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    return args


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run, print the closing line.

    Returns:
        0 when the run finished, nothing acked was lost or duplicated and every kill failed
        over; 1 otherwise.
    """
    args = parse_args(argv)
    limit_s = args.time_limit_s or 60.0 * args.kills + 400.0
    logging.getLogger("danube_pipeline").setLevel(logging.ERROR)  # reconnect warnings: counted, not printed
    signal.signal(signal.SIGTERM, _on_sigterm)
    tmp = Path(tempfile.mkdtemp(prefix="danube-replication-"))
    say(f"replication: seed {args.seed}, {args.kills} kills; {os.cpu_count()} CPUs, Python {sys.version.split()[0]};"
        f" state in {tmp}")
    flags = broker_flags()
    wanted = {"--replica-replace-after-s": f"{args.replica_replace_after_s:g}"}
    passed = [arg for flag, value in wanted.items() if flag in flags for arg in (flag, value)]
    cluster = ReplicationCluster(tmp, lease_ttl_s=args.lease_ttl_s, broker_args=passed)
    for flag in wanted:
        if flag not in flags:
            say(f"  note: python -m broker has no {flag}; not passed")
    threading.Thread(target=_watchdog, args=(limit_s, cluster.pids), daemon=True, name="watchdog").start()
    started = time.monotonic()
    try:
        asyncio.run(run(args, cluster))
    except KeyboardInterrupt as exc:
        say(f"replication: interrupted ({exc})")
        FAILED.append("interrupted")
    except Exception as exc:  # noqa: BLE001 - the closing line is printed whatever happened
        say(f"replication: FAILED: {fs.describe(exc)}")
        for text in traceback.format_exc().rstrip().splitlines()[-8:]:
            say(f"    {text}")
        FAILED.append("error")
    finally:
        cluster.stop()
        if args.keep:
            say(f"replication: logs kept in {tmp} (logs/)")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    _FINISHED.set()
    if FAILED:
        say(f"replication: did not finish: {', '.join(FAILED)}")
    say(f"replication: {time.monotonic() - started:.0f} s in all")
    say(SUMMARY.line())
    clean = SUMMARY.lost == 0 and SUMMARY.duplicated == 0 and SUMMARY.failovers == args.kills
    return 0 if not FAILED and clean else 1


if __name__ == "__main__":
    sys.exit(main())
