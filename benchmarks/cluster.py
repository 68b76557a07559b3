"""Three brokers under load on real processes: topic moves, a SIGKILLed owner, a skewed start;
then the load manager simulated at 100 brokers x 10,000 topics. Prints figures; not a test.

    .venv/bin/python benchmarks/cluster.py            # 20 moves, about 35 s
    .venv/bin/python benchmarks/cluster.py --quick    # 5 moves, shorter waits, about 20 s

etcd and three brokers (``danube_pipeline.dev.localcluster.LocalCluster``: own data directory
and fixed port each, ``--lease-ttl-s 3``, objects on ``file://``) run in a temporary directory
and are stopped by pid at the end, also on errors, Ctrl-C, SIGTERM and the time limit. Every
wait has a time limit. The phases, in order:

1. **Skewed start.** Only the first broker runs while 30 topics are created, so it owns them
   all; then the other two start. The brokers run with ``--rebalance-interval-s 2
   --rebalance-cooldown-s 2 --rebalance-threshold aggressive --rebalance-max-moves 10
   --load-report-interval-s 1`` (each flag only if ``python -m broker --help`` lists it) and the
   default strategy ``fair`` (topic counts). ``cv``: the coefficient of variation of topics per broker (population standard deviation
   over mean, from the assignment keys ``/cluster/brokers/{id}/{ns}/{topic}``, every topic
   counted), once it is at most 0.2 or after ``--rebalance-wait-s``. Target <= 0.2.
2. **Load.** From here to the end, two producers (each its own client, 250 msg/s of 128 B)
   and one consumer (its own client, Exclusive from ``EARLIEST``, acking everything; all three
   with ``retry_backoff_ms`` 100, ``--retry-backoff-ms``) run on
   ``/default/load``. Each payload carries a unique id (producer and counter). A tiering loop
   (what the sealed-segments sensor does) tiers the topic's sealed segments every second, so
   consumers can read the offsets an earlier owner holds.
3. **Moves.** ``--moves`` times: ``Admin.UnloadTopic`` on the topic's owner. A move's time runs
   from the unload call to the first ack at or above the offset the unload returned (the
   first offset the next owner hands out): the topic serves again on its new owner. p50 and
   p99 in ms; a move that does not serve again within 10 s counts as infinite. Target p99 <= 1 s.
4. **Failover.** The topic's owner gets SIGKILL. ``failover_s``: from the kill to the first
   ack of a message sent after it (so acknowledged by another broker). Target <= lease TTL +
   2 s. ``nan`` when none arrives within TTL + 15 s (no failover in this broker). Then the killed
   broker starts again on the same data directory and port (its disk returns); the load runs
   a few seconds more.
5. **Check.** The producers stop; the consumer drains (bounded by ``--drain-s``) while the
   tiering loop runs. ``lost``: acked ids the consumer never received. ``duplicated``: ids
   received at two or more offsets (a message stored twice; redeliveries of one offset are
   counted apart).
6. **Simulation.** ``benchmarks/load_manager_sim.py`` (its ``main``, imported) on 100 brokers
   x 10,000 topics, ``weighted_load``, ``aggressive``: ``sim_cv`` and the moves per round.

The run ends with exactly one line (``nan`` marks a figure that was not measured):
``cluster: lost=N duplicated=N move_p99_ms=X failover_s=X cv=X sim_cv=X``
"""

from __future__ import annotations

import _thread
import argparse
import asyncio
import collections
import contextlib
import functools
import io
import logging
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import faults_scenarios as fs
import load_manager_sim
from faults import broker_flags, say
from results import counts_per_bin, write_result

from broker.cluster.load_manager import coefficient_of_variation
from danube_pipeline.client import DanubeClient, InitialPosition, Message, Producer, SubscriptionType
from danube_pipeline.dev.localcluster import BrokerProcess, LocalCluster, free_port
from danube_pipeline.errors import DanubeError, ProducerClosedError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore
from danube_pipeline.lake.tiering import tier_sealed_segments

LOAD_TOPIC = "/default/load"
"""The topic the producers and the consumer use; it is the one moved and whose owner is killed."""
SKEW_PREFIX = "/default/skew-"
CV_TARGET = 0.2
MOVE_P99_TARGET_MS = 1000.0
MOVE_TIMEOUT_S = 10.0
REBALANCE_FLAGS = {
    "--rebalance-interval-s": "2",
    "--rebalance-cooldown-s": "2",
    "--rebalance-threshold": "aggressive",
    "--rebalance-max-moves": "10",
    "--load-report-interval-s": "1",
}
"""Broker flags of the rebalancer, each passed when ``python -m broker --help`` lists it."""


@dataclass
class Summary:
    """The closing line's figures; each stays unmeasured (``nan``) until its phase ran.

    Attributes:
        lost: acked ids the consumer never received (``None``: not judged).
        duplicated: ids received at two or more offsets.
        move_ms: the time of each move, in ms (``inf`` for a move that did not serve again).
        failover_s: SIGKILL of the owner until an ack by another broker, in s.
        cv: topics per broker, coefficient of variation, after rebalancing.
        sim_cv: the simulation's CV after its last round.
        failed: phases that ended with an error or their time limit.
    """

    lost: int | None = None
    duplicated: int | None = None
    move_ms: list[float] = field(default_factory=list)
    failover_s: float = math.nan
    cv: float = math.nan
    sim_cv: float = math.nan
    failed: list[str] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    """``(time.monotonic(), "move" | "kill")`` of each unload call and the SIGKILL (for the timeline)."""
    ack_times: list[float] = field(default_factory=list)
    """``time.monotonic()`` of every ack of the load, from its start (for the timeline)."""

    @property
    def move_p99_ms(self) -> float:
        return percentile(self.move_ms, 0.99)

    def line(self) -> str:
        """``cluster: lost=N duplicated=N move_p99_ms=X failover_s=X cv=X sim_cv=X``."""
        lost = "nan" if self.lost is None else str(self.lost)
        duplicated = "nan" if self.duplicated is None else str(self.duplicated)
        return (
            f"cluster: lost={lost} duplicated={duplicated} move_p99_ms={fs.fmt(self.move_p99_ms, 0)}"
            f" failover_s={fs.fmt(self.failover_s, 2)} cv={fs.fmt(self.cv, 3)} sim_cv={fs.fmt(self.sim_cv, 3)}"
        )


SUMMARY = Summary()
_FINISHED = threading.Event()
_CHILD_PIDS: set[int] = set()
"""Pids of the processes this run started and has not stopped (the watchdog's last resort)."""


def timeline(summary: Summary, bin_s: float = 0.1) -> dict[str, Any]:
    """``cluster.json`` (``benchmarks/results.py``): acks per ``bin_s`` from the first ack, the
    moves (with their durations) and the SIGKILL on the same clock, and the closing figures."""
    start = summary.ack_times[0] if summary.ack_times else 0.0
    moves = iter(summary.move_ms)
    events = [{"t_s": t - start, "kind": kind, "duration_ms": next(moves, None) if kind == "move" else None}
              for t, kind in summary.events]
    return {"bin_s": bin_s, "acks_per_bin": counts_per_bin(summary.ack_times, start, bin_s), "events": events,
            "move_ms": summary.move_ms, "failover_s": summary.failover_s, "cv": summary.cv, "sim_cv": summary.sim_cv,
            "lost": summary.lost, "duplicated": summary.duplicated, "failed": summary.failed}


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank ``q`` quantile of ``samples``; ``nan`` for none."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def verdict(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "NOT met")


# ---------------------------------------------------------------------------- etcd views


async def owners(meta: MetadataStore) -> dict[str, int]:
    """``topic -> owner id`` from the assignment keys (``docs/etcd-layout.md`` §1.4)."""
    kvs, _ = await meta.get_prefix(keys.BROKERS_PREFIX)
    found: dict[str, int] = {}
    for kv in kvs:
        parts = kv.key[len(keys.BROKERS_PREFIX) :].split("/")
        if len(parts) == 3 and parts[0].isdigit():
            found[f"/{parts[1]}/{parts[2]}"] = int(parts[0])
    return found


def topics_per_broker(assigned: dict[str, int], broker_ids: list[int]) -> list[int]:
    """How many topics each of ``broker_ids`` owns, in that order."""
    counts = collections.Counter(assigned.values())
    return [counts.get(b, 0) for b in broker_ids]


async def owner_of(meta: MetadataStore, topic: str) -> int | None:
    return (await owners(meta)).get(topic)


async def wait_for(check: Callable[[], Awaitable[bool]], timeout_s: float, interval_s: float = 0.1) -> bool:
    """Poll ``check`` until it is true; False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if await check():
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval_s)


# ---------------------------------------------------------------------------- load


def new_client(addresses: list[str], *, retries: int = 10, backoff_ms: int = 100) -> DanubeClient:
    """An unconnected client bootstrapped to every broker (a restarted one keeps its port)."""
    return DanubeClient(addresses, request_timeout_ms=5000, metadata_retries=retries, retry_backoff_ms=backoff_ms)


class Load:
    """Producers and one consumer on ``topic``, keeping account of every message id.

    Producer ``p`` sends every 10 ms its share of ``rate_per_s`` messages (unless ``window`` of
    its sends are unresolved). Message id ``p * 10**12 + counter`` travels as 8 big-endian
    bytes plus padding; each id is sent once by the load (a failed send is not resent, so an id
    stored twice was resent by the client library or the broker). The consumer, an Exclusive
    subscription from ``EARLIEST``, acks every message. Each producer and the consumer has its
    own client and reopens after a failure.

    Attributes:
        acked: id -> offset the broker acknowledged.
        acks: ``(time.monotonic(), offset, id)`` of every ack, in arrival order.
        sent_at: id -> ``time.monotonic()`` of its send.
        failed: id -> description of the error its send failed with.
        received: id -> offsets the consumer got it at.
        deliveries: messages the consumer got, redeliveries included.
        errors: description -> count, both sides.
    """

    def __init__(
        self,
        addresses: list[str],
        topic: str,
        *,
        producers: int,
        rate_per_s: int,
        payload_bytes: int = 128,
        window: int = 4000,
        backoff_ms: int = 100,
    ) -> None:
        self.addresses = addresses
        self.topic = topic
        self.producers = producers
        self.rate_per_s = rate_per_s
        self.window = window
        self.backoff_ms = backoff_ms
        self._padding = b"\x5a" * (payload_bytes - 8)
        self.payload_bytes = payload_bytes
        self.acked: dict[int, int] = {}
        self.acks: list[tuple[float, int, int]] = []
        self.sent_at: dict[int, float] = {}
        self.failed: dict[int, str] = {}
        self.received: dict[int, set[int]] = collections.defaultdict(set)
        self.deliveries = 0
        self.last_offset = -1
        self.last_receive_s = time.monotonic()
        self.longest_gap: tuple[float, float, int] = (0.0, 0.0, -1)
        """The consumer's longest wait between two messages: from, to (monotonic), next offset."""
        self.errors: collections.Counter[str] = collections.Counter()
        self.opens = collections.Counter[str]()
        self._unresolved = [0] * producers
        self._stop_producing = asyncio.Event()
        self._stop_consuming = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._produce(p), name=f"producer-{p}") for p in range(self.producers)]
        self._tasks.append(asyncio.create_task(self._consume(), name="consumer"))

    async def stop_producing(self) -> None:
        self._stop_producing.set()
        await asyncio.gather(*(fs.bounded(t, 20) for t in self._tasks[: self.producers]))

    async def drain(self, timeout_s: float, *, progress: Callable[[str], None]) -> bool:
        """Wait until the consumer received every acked id; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        next_note = time.monotonic() + 10
        while self.missing():
            if time.monotonic() > deadline:
                return False
            if time.monotonic() > next_note:
                next_note += 10
                progress(f"draining: {len(self.missing()):,} acked ids not received yet; consumer at offset "
                         f"{self.last_offset:,}, last message {time.monotonic() - self.last_receive_s:.1f} s ago")
            await asyncio.sleep(0.2)
        return True

    async def stop(self) -> None:
        self._stop_producing.set()
        self._stop_consuming.set()
        await asyncio.gather(*(fs.bounded(t, 20) for t in self._tasks))

    def missing(self) -> set[int]:
        return self.acked.keys() - self.received.keys()

    def ack_index(self) -> int:
        """A position in :attr:`acks` to search from."""
        return len(self.acks)

    def first_ack(self, start: int, accept: Callable[[int, int], bool]) -> tuple[int, float | None]:
        """The time of the first ack from position ``start`` whose ``(offset, id)`` is accepted,
        and the position to search from next time."""
        acks = self.acks
        for i in range(start, len(acks)):
            t, offset, ident = acks[i]
            if accept(offset, ident):
                return i, t
        return len(acks), None

    async def wait_ack(self, accept: Callable[[int, int], bool], *, since_index: int, timeout_s: float) -> float | None:
        """Poll every 5 ms for an ack accepted by ``accept``; its time, or ``None`` at the limit."""
        deadline = time.monotonic() + timeout_s
        position = since_index
        while time.monotonic() < deadline:
            position, found = self.first_ack(position, accept)
            if found is not None:
                return found
            await asyncio.sleep(0.005)
        return None

    def summary(self) -> str:
        redelivered = self.deliveries - sum(len(offsets) for offsets in self.received.values())
        return (f"sent {len(self.sent_at):,}  acked {len(self.acked):,}  failed {len(self.failed):,}"
                f"  received {len(self.received):,} ({self.deliveries:,} deliveries, {redelivered:,} redelivered)"
                f"  opens {dict(self.opens)}")

    def _note(self, exc: BaseException) -> None:
        text = fs.describe(exc)
        if len(self.errors) < 30 or text in self.errors:
            self.errors[text] += 1

    def _on_done(self, producer: int, ident: int, fut: asyncio.Future[Any]) -> None:
        self._unresolved[producer] -= 1
        if fut.cancelled():
            self.failed[ident] = "cancelled"
            return
        exc = fut.exception()
        if exc is not None:
            self.failed[ident] = fs.describe(exc)
            self._note(exc)
            return
        offset = int(fut.result())  # the offset (an int, or the client's int subclass MessageId)
        self.acked[ident] = offset
        self.acks.append((time.monotonic(), offset, ident))

    async def _connect(self) -> DanubeClient | None:
        """A connected client, or ``None`` after a failed attempt (noted; retried by the caller)."""
        candidate = new_client(self.addresses, backoff_ms=self.backoff_ms)
        got = await fs.bounded(candidate.connect(), 10)
        if got.ok:
            return candidate
        self._note(got.error or RuntimeError("no client"))
        await fs.bounded(candidate.close(), 5)
        await asyncio.sleep(0.2)
        return None

    async def _produce(self, p: int) -> None:
        client: DanubeClient | None = None
        try:
            while not self._stop_producing.is_set():
                if client is None:
                    client = await self._connect()
                    if client is None:
                        continue
                producer = client.producer(self.topic, producer_name=f"load-{p}", max_in_flight_batches=4)
                opened = await fs.bounded(producer.open(), 10)
                if not opened.ok:
                    self._note(opened.error or RuntimeError("open failed"))
                    await fs.bounded(producer.close(), 5)
                    await asyncio.sleep(0.2)
                    continue
                self.opens[f"producer-{p}"] += 1
                await self._send_until_stopped(p, producer)
                await fs.bounded(producer.close(), 10)
        finally:
            if client is not None:
                await fs.bounded(client.close(), 10)

    async def _send_until_stopped(self, p: int, producer: Producer) -> None:
        loop = asyncio.get_running_loop()
        tick_s = 0.01
        per_tick = max(1, round(self.rate_per_s / self.producers * tick_s))
        counter = sum(1 for ident in self.sent_at if ident // 10**12 == p)
        next_s = loop.time()
        while not self._stop_producing.is_set():
            next_s += tick_s
            delay = next_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.5:
                next_s = loop.time()  # fell behind (a stall): do not burst to catch up
            for _ in range(max(0, min(per_tick, self.window - self._unresolved[p]))):
                ident = p * 10**12 + counter
                counter += 1
                self.sent_at[ident] = time.monotonic()
                try:
                    fut = producer.send_nowait(ident.to_bytes(8, "big") + self._padding)
                except ProducerClosedError as exc:
                    self.failed[ident] = fs.describe(exc)
                    return
                except DanubeError as exc:
                    self.failed[ident] = fs.describe(exc)
                    continue
                self._unresolved[p] += 1
                fut.add_done_callback(functools.partial(self._on_done, p, ident))

    async def _consume(self) -> None:
        def on_message(message: Message) -> None:
            self.deliveries += 1
            now = time.monotonic()
            if self.deliveries > 1 and now - self.last_receive_s > self.longest_gap[1] - self.longest_gap[0]:
                self.longest_gap = (self.last_receive_s, now, message.offset)
            self.last_receive_s = now
            self.last_offset = message.offset
            payload = message.payload
            if len(payload) == self.payload_bytes and payload[8:] == self._padding:
                self.received[int.from_bytes(payload[:8], "big")].add(message.offset)

        def on_open() -> None:
            self.opens["consumer"] += 1

        await fs.consume_until_stopped(
            self._stop_consuming, lambda: fs.connected(new_client(self.addresses, backoff_ms=self.backoff_ms)),
            lambda client: client.consumer(
                self.topic, subscription="check", subscription_type=SubscriptionType.EXCLUSIVE,
                initial_position=InitialPosition.EARLIEST, receiver_queue_size=2000, ack_batch_size=200,
                ack_flush_ms=50,
            ),
            on_message, lambda exc, _step: self._note(exc), on_open=on_open,
        )  # fmt: skip


class Tiering:
    """What the sealed-segments sensor does, every second: tier the sealed segments of
    ``topic`` (the owner's and those earlier owners kept, ``danube_pipeline/lake/tiering/segments.py``)."""

    def __init__(self, addresses: list[str], etcd_endpoints: list[str], objects_url: str, topic: str) -> None:
        self.addresses = addresses
        self.etcd_endpoints = etcd_endpoints
        self.objects = ObjectStore(objects_url)
        self.topic = TopicName.parse(topic)
        self.objects_written = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tiering")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await fs.bounded(self._task, 10)

    async def _run(self) -> None:
        client = new_client(self.addresses, retries=1)
        meta: MetadataStore | None = None
        try:
            while True:
                try:
                    if meta is None:
                        meta = await MetadataStore.connect(self.etcd_endpoints)
                    report = await asyncio.wait_for(
                        tier_sealed_segments(self.topic, store=meta, admin=client.admin, objects=self.objects), 30
                    )
                    self.objects_written += report.objects_written
                except Exception as exc:  # noqa: BLE001 - a broker is down or moving: next round
                    text = fs.describe(exc)
                    if len(self.errors) < 20 or text in self.errors:
                        self.errors[text] += 1
                await asyncio.sleep(1.0)
        finally:
            await fs.bounded(client.close(), 5)
            if meta is not None:
                await fs.bounded(meta.close(), 5)


# ---------------------------------------------------------------------------- phases


@dataclass
class Run:
    """What the phases share."""

    args: argparse.Namespace
    cluster: LocalCluster
    meta: MetadataStore
    admin: DanubeClient
    rebalancing: bool
    broker_ids: list[int] = field(default_factory=list)
    others_started_at: float = 0.0
    """``time.monotonic()`` when brokers 2 and 3 were serving (the rebalancing can begin)."""
    killed_at: float = math.nan
    """``time.monotonic()`` of the SIGKILL."""

    def broker(self, broker_id: int) -> BrokerProcess | None:
        return next((b for b in self.cluster.brokers if b.running and b.broker_id == broker_id), None)

    def name(self, broker_id: int | None) -> str:
        if broker_id is None:
            return "nobody"
        index = next((i for i, b in enumerate(self.broker_ids) if b == broker_id), None)
        return f"broker {index + 1}" if index is not None else f"broker id {broker_id}"


async def rebalance_phase(run: Run) -> None:
    """Wait until topics per broker have a CV of at most 0.2, or the time limit."""
    wait_s = run.args.rebalance_wait_s if run.rebalancing else min(run.args.rebalance_wait_s, 10.0)
    if not run.rebalancing:
        say("  the broker has no --rebalance-interval-s: no leader-run rebalancing; measuring after "
            f"{wait_s:g} s anyway")
    started = run.others_started_at
    last: list[int] = []
    while True:
        counts = topics_per_broker(await owners(run.meta), run.broker_ids)
        if counts != last:
            say(f"  {time.monotonic() - started:5.1f} s after brokers 2 and 3 started: topics per broker {counts}"
                f"  cv {coefficient_of_variation(counts):.3f}")
            last = counts
        if coefficient_of_variation(counts) <= CV_TARGET or time.monotonic() - started > wait_s:
            break
        await asyncio.sleep(0.25)
    SUMMARY.cv = coefficient_of_variation(last)
    reached = SUMMARY.cv <= CV_TARGET
    say(f"  -> cv={SUMMARY.cv:.3f} {'after' if reached else 'still, after'} {time.monotonic() - started:.1f} s,"
        f" topics per broker {last} (target <= {CV_TARGET}: {verdict(reached)})")


async def moves_phase(run: Run, load: Load) -> None:
    """Unload the load topic ``--moves`` times; time each until it serves on its new owner."""
    for i in range(run.args.moves):
        before = await owner_of(run.meta, LOAD_TOPIC)
        position = load.ack_index()
        started = time.monotonic()
        SUMMARY.events.append((started, "move"))
        unloaded = await fs.bounded(run.admin.admin.unload_topic(LOAD_TOPIC), MOVE_TIMEOUT_S)
        if not unloaded.ok or unloaded.value is None:
            say(f"  move {i + 1}: unload failed: {fs.describe(unloaded.error) if unloaded.error else '?'}")
            SUMMARY.move_ms.append(math.inf)
            await asyncio.sleep(1.0)
            continue
        next_offset = unloaded.value
        unload_ms = (time.monotonic() - started) * 1000
        remaining = MOVE_TIMEOUT_S - (time.monotonic() - started)

        def on_new_owner(offset: int, _ident: int, first: int = next_offset) -> bool:
            return offset >= first

        acked_at = await load.wait_ack(on_new_owner, since_index=position, timeout_s=remaining)
        after = await owner_of(run.meta, LOAD_TOPIC)
        if acked_at is None:
            SUMMARY.move_ms.append(math.inf)
            say(f"  move {i + 1:2}: {run.name(before)} -> {run.name(after)}: no ack at or above offset {next_offset:,}"
                f" within {MOVE_TIMEOUT_S:g} s")
        else:
            SUMMARY.move_ms.append((acked_at - started) * 1000)
            say(f"  move {i + 1:2}: {run.name(before)} -> {run.name(after)}: serving again after"
                f" {SUMMARY.move_ms[-1]:6.1f} ms (unload call {unload_ms:5.1f} ms; next offset {next_offset:,})")
        await asyncio.sleep(run.args.move_pause_s)
    done = [ms for ms in SUMMARY.move_ms if math.isfinite(ms)]
    p99 = SUMMARY.move_p99_ms
    say(f"  -> {len(done)} of {len(SUMMARY.move_ms)} moves served again; p50 {fs.fmt(percentile(SUMMARY.move_ms, 0.5), 1)} ms,"
        f" p99 {fs.fmt(p99, 1)} ms, max {fs.fmt(max(SUMMARY.move_ms, default=math.nan), 1)} ms"
        f" (target p99 <= {MOVE_P99_TARGET_MS:g} ms: {verdict(p99 <= MOVE_P99_TARGET_MS if SUMMARY.move_ms else None)})")


async def failover_phase(run: Run, load: Load) -> None:
    """SIGKILL the load topic's owner, time the failover, restart it on the same disk."""
    ttl = run.args.lease_ttl_s
    victim_id = await owner_of(run.meta, LOAD_TOPIC)
    victim = run.broker(victim_id) if victim_id is not None else None
    if victim is None or victim_id is None:
        raise RuntimeError(f"the owner of {LOAD_TOPIC} ({victim_id}) is not a running broker of this run")
    held = sorted(t for t, b in (await owners(run.meta)).items() if b == victim_id)
    leader = await run.meta.get(keys.CLUSTER_LEADER)
    was_leader = leader is not None and leader.value == victim_id
    say(f"  SIGKILL {run.name(victim_id)} (pid {victim.pid}, owns {len(held)} topics"
        f"{', the leader' if was_leader else ''})")
    position = load.ack_index()
    killed_at = run.killed_at = time.monotonic()
    SUMMARY.events.append((killed_at, "kill"))
    _CHILD_PIDS.discard(victim.pid)
    victim.kill()
    bound_s = ttl + 15.0

    async def all_reassigned() -> bool:
        assigned = await owners(run.meta)
        return all(assigned.get(t) not in (None, victim_id) for t in held)

    reassigned = asyncio.create_task(wait_for(all_reassigned, bound_s))
    acked_at = await load.wait_ack(lambda _offset, ident: load.sent_at.get(ident, 0.0) > killed_at,
                                   since_index=position, timeout_s=bound_s)
    reassigned_s = time.monotonic() - killed_at if await reassigned else math.nan
    now = await owners(run.meta)
    moved = [t for t in held if now.get(t) not in (None, victim_id)]
    say(f"  all {len(held)} topics it owned had another owner (assignment keys) {fs.fmt(reassigned_s, 2)} s after the kill"
        if moved == held else f"  {len(moved)} of the {len(held)} topics it owned have another owner after {bound_s:g} s")
    if acked_at is None:
        SUMMARY.failover_s = math.nan
        say(f"  no message sent after the SIGKILL was acked within {bound_s:g} s: {LOAD_TOPIC} is still owned by"
            f" {run.name(now.get(LOAD_TOPIC))}. The leader did not reassign the dead broker's topics (no failover in this broker) -> failover_s=nan")
    else:
        SUMMARY.failover_s = acked_at - killed_at
        say(f"  -> failover_s={SUMMARY.failover_s:.2f}: a message sent after the kill was acked by"
            f" {run.name(now.get(LOAD_TOPIC))} (target <= TTL {ttl} + 2 s: {verdict(SUMMARY.failover_s <= ttl + 2)})")
    await asyncio.sleep(2.0)
    restarted = time.monotonic()
    await victim.start_async(timeout_s=60)
    _CHILD_PIDS.add(victim.pid)
    say(f"  {run.name(victim_id)} restarted on its data directory in {time.monotonic() - restarted:.1f} s"
        f" ({victim.address}, id {victim.broker_id})")
    await asyncio.sleep(run.args.after_restart_s)


async def check_phase(run: Run, load: Load, tiering: Tiering) -> None:
    """Stop producing, drain the consumer, judge every acked id."""
    await load.stop_producing()
    say(f"  producers stopped: {load.summary()}")
    drained = await load.drain(run.args.drain_s, progress=lambda text: say(f"  {text}"))
    missing = load.missing()
    if not drained:
        with contextlib.suppress(DanubeError, TimeoutError):
            described = await asyncio.wait_for(run.admin.admin.describe_topic(LOAD_TOPIC), 10)
            say(f"  not drained after {run.args.drain_s:g} s; consumer at offset {load.last_offset:,}; topic: earliest"
                f" {described.earliest_offset:,}, WAL from {described.first_local_offset:,}, next {described.next_offset:,},"
                f" objects up to {described.remote_end_offset}")
        first_missing = sorted(load.acked[i] for i in missing)[:5]
        say(f"  first missing offsets: {first_missing}")
    duplicated = sum(1 for offsets in load.received.values() if len(offsets) > 1)
    elsewhere = sum(1 for ident, offset in load.acked.items() if ident in load.received and offset not in load.received[ident])
    unacked = len(load.received.keys() - load.acked.keys())
    SUMMARY.lost = len(missing)
    SUMMARY.duplicated = duplicated
    say(f"  -> lost={len(missing)} duplicated={duplicated} of {len(load.acked):,} acked"
        f" ({unacked} received that were never acked, {elsewhere} received at another offset than acked);"
        f" tiering wrote {tiering.objects_written} objects")
    since, until, offset = load.longest_gap
    say(f"     the consumer's longest wait between two messages: {until - since:.2f} s, from"
        f" {since - run.killed_at:+.2f} s to {until - run.killed_at:+.2f} s after the SIGKILL (then offset {offset:,})")
    for text, count in load.errors.most_common(8):
        say(f"     load error x{count}: {text}")
    for text, count in tiering.errors.most_common(5):
        say(f"     tiering error x{count}: {text}")


def simulation_phase(args: argparse.Namespace) -> None:
    """``load_manager_sim.main`` on 100 brokers x 10,000 topics; its output indented."""
    argv = ["--brokers", str(args.sim_brokers), "--topics", str(args.sim_topics), "--strategy", args.sim_strategy,
            "--aggressiveness", args.sim_aggressiveness]
    say(f"  benchmarks/load_manager_sim.py {' '.join(argv)}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        load_manager_sim.main(argv)
    moves: list[int] = []
    final: dict[str, str] = {}
    for text in out.getvalue().splitlines():
        say(f"    {text}")
        row = re.match(r"\s*\d+\s+[\d.]+\s+[\d.]+\s+(\d+)\s+(\d+)\s+[\d.]+\s", text)
        if row:
            moves.append(int(row.group(1)) + int(row.group(2)))
        if text.startswith("load_manager_sim: brokers="):
            final = dict(part.split("=", 1) for part in text.split()[1:])
    SUMMARY.sim_cv = float(final.get("cv_end", "nan"))
    mean = sum(moves) / len(moves) if moves else math.nan
    say(f"  -> sim_cv={fs.fmt(SUMMARY.sim_cv, 3)}; moves per round {moves} (mean {mean:.0f})")


async def phase(name: str, body: Awaitable[None], limit_s: float) -> None:
    """Run one phase within ``limit_s``; a failure is printed and recorded, and the run goes on."""
    say(f"== {name}")
    started = time.monotonic()
    outcome = await fs.bounded(body, limit_s)
    if not outcome.ok:
        SUMMARY.failed.append(name)
        say(f"  FAILED after {time.monotonic() - started:.1f} s: {fs.describe(outcome.error) if outcome.error else '?'}")
        if outcome.error is not None and not outcome.timed_out:
            for text in "".join(traceback.format_exception(outcome.error)).rstrip().splitlines()[-6:]:
                say(f"    {text}")
    say(f"  ({time.monotonic() - started:.1f} s)")


async def run_cluster(args: argparse.Namespace, cluster: LocalCluster, rebalancing: bool) -> None:
    """Phases 1-5 on ``cluster``, whose etcd and first broker are running."""
    first, others = cluster.brokers[0], cluster.brokers[1:]
    addresses = [f"{b.host}:{b.port}" for b in cluster.brokers]  # fixed ports, also across a restart
    meta = await MetadataStore.connect(cluster.etcd.endpoints)
    admin = new_client(addresses, retries=20)
    load: Load | None = None
    tiering: Tiering | None = None
    try:
        say(f"== skewed start: {args.topics} topics created while only broker 1 runs")
        await admin.connect()
        for i in range(args.topics):
            await admin.admin.create_topic(f"{SKEW_PREFIX}{i:02d}")

        async def all_on_first() -> bool:
            assigned = await owners(meta)
            return sum(1 for t, b in assigned.items() if t.startswith(SKEW_PREFIX) and b == first.broker_id) == int(args.topics)

        if not await wait_for(all_on_first, 20):
            raise RuntimeError(f"the {args.topics} topics were not all assigned to broker 1 within 20 s")
        skew = [args.topics, 0, 0]
        say(f"  all {args.topics} owned by broker 1; once brokers 2 and 3 run: topics per broker {skew}"
            f"  cv {coefficient_of_variation(skew):.3f}")
        for broker in others:
            await broker.start_async(timeout_s=60)
            _CHILD_PIDS.add(broker.pid)
        run = Run(args, cluster, meta, admin, rebalancing, [b.broker_id for b in cluster.brokers],
                  others_started_at=time.monotonic())
        for i, broker in enumerate(cluster.brokers):
            say(f"  broker {i + 1}: {broker.address} id {broker.broker_id} pid {broker.pid}")
        await admin.admin.create_topic(LOAD_TOPIC)
        load = Load(addresses, LOAD_TOPIC, producers=2, rate_per_s=args.rate, backoff_ms=args.retry_backoff_ms)
        load.start()
        tiering = Tiering(addresses, cluster.etcd.endpoints, args.objects_url, LOAD_TOPIC)
        tiering.start()
        say(f"  load: 2 producers x {args.rate // 2} msg/s of {load.payload_bytes} B and one consumer on {LOAD_TOPIC},"
            f" retry_backoff_ms={args.retry_backoff_ms} (owner {run.name(await owner_of(meta, LOAD_TOPIC))}); tiering every 1 s")
        await phase("rebalancing", rebalance_phase(run), args.rebalance_wait_s + 30)
        await phase(f"{args.moves} topic moves under load", moves_phase(run, load), args.moves * (MOVE_TIMEOUT_S + 3) + 30)
        await phase("SIGKILL of the owner", failover_phase(run, load), args.lease_ttl_s + 120)
        await phase("every acked message received", check_phase(run, load, tiering), args.drain_s + 60)
    finally:
        if load is not None:
            await load.stop()
            SUMMARY.ack_times = [t for t, _, _ in load.acks]
        if tiering is not None:
            await tiering.stop()
        await fs.bounded(admin.close(), 10)
        await fs.bounded(meta.close(), 10)


# ---------------------------------------------------------------------------- main


def _watchdog(limit_s: float) -> None:
    """After ``limit_s``: interrupt the main thread; 30 s later SIGKILL what is left and exit."""
    if _FINISHED.wait(limit_s):
        return
    say(f"cluster: time limit of {limit_s:g} s reached; stopping")
    SUMMARY.failed.append("time limit")
    _thread.interrupt_main()
    if _FINISHED.wait(30):
        return
    for pid in list(_CHILD_PIDS):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    say(SUMMARY.line())
    os._exit(3)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run the phases, print the closing line.

    Returns:
        0 when every phase finished (whatever its figures), 1 otherwise.
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="5 moves and shorter waits")
    parser.add_argument("--moves", type=int, default=None, help="topic moves (default 20; 5 with --quick)")
    parser.add_argument("--topics", type=int, default=30, help="topics created on one broker at the start")
    parser.add_argument("--rate", type=int, default=500, help="messages per second, both producers together")
    parser.add_argument("--lease-ttl-s", type=int, default=3, help="broker --lease-ttl-s")
    parser.add_argument("--retry-backoff-ms", type=int, default=100,
                        help="the load clients' retry_backoff_ms (the client's default is 200)")
    parser.add_argument("--rebalance-wait-s", type=float, default=None, help="longest wait for the CV (default 60; 30 quick)")
    parser.add_argument("--drain-s", type=float, default=None, help="longest wait for the consumer at the end (default 90; 45 quick)")
    parser.add_argument("--sim-brokers", type=int, default=100)
    parser.add_argument("--sim-topics", type=int, default=10_000)
    parser.add_argument("--sim-strategy", default="weighted_load")
    parser.add_argument("--sim-aggressiveness", default="aggressive")
    parser.add_argument("--time-limit-s", type=float, default=None, help="stop everything after this long (default 600; 300 quick)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    args = parser.parse_args(argv)
    args.moves = args.moves if args.moves is not None else (5 if args.quick else 20)
    args.rebalance_wait_s = args.rebalance_wait_s if args.rebalance_wait_s is not None else (30.0 if args.quick else 60.0)
    args.drain_s = args.drain_s if args.drain_s is not None else (45.0 if args.quick else 90.0)
    args.time_limit_s = args.time_limit_s if args.time_limit_s is not None else (300.0 if args.quick else 600.0)
    args.move_pause_s = 0.3 if args.quick else 0.5
    args.after_restart_s = 2.0 if args.quick else 4.0

    logging.getLogger("danube_pipeline").setLevel(logging.ERROR)  # reconnect warnings: counted, not printed
    signal.signal(signal.SIGTERM, _on_sigterm)
    threading.Thread(target=_watchdog, args=(args.time_limit_s,), daemon=True, name="watchdog").start()
    flags = broker_flags()
    rebalancing = "--rebalance-interval-s" in flags
    tmp = Path(tempfile.mkdtemp(prefix="danube-cluster-"))
    args.objects_url = (tmp / "objects").as_uri()
    broker_args = ["--lease-ttl-s", str(args.lease_ttl_s), "--object-store-url", args.objects_url]
    broker_args += [part for flag, value in REBALANCE_FLAGS.items() if flag in flags for part in (flag, value)]
    say(f"cluster: etcd and 3 brokers ({' '.join(broker_args[:2] + broker_args[4:])}), {os.cpu_count()} CPUs,"
        f" Python {sys.version.split()[0]}; {args.moves} moves{', quick' if args.quick else ''}")
    cluster = LocalCluster(tmp, brokers=3, broker_ports=[free_port() for _ in range(3)], broker_args=broker_args)
    started = time.monotonic()
    try:
        cluster.etcd.start()
        _CHILD_PIDS.add(cluster.etcd.pid)
        cluster.brokers[0].start()
        _CHILD_PIDS.add(cluster.brokers[0].pid)
        asyncio.run(run_cluster(args, cluster, rebalancing))
    except KeyboardInterrupt as exc:
        say(f"cluster: interrupted ({exc})")
        SUMMARY.failed.append("interrupted")
    except Exception as exc:  # noqa: BLE001 - the closing line is printed whatever happened
        say(f"cluster: FAILED: {fs.describe(exc)}")
        for text in traceback.format_exc().rstrip().splitlines()[-6:]:
            say(f"    {text}")
        SUMMARY.failed.append("setup")
    finally:
        cluster.stop()
        _CHILD_PIDS.clear()
        if args.keep:
            say(f"cluster: logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if "interrupted" not in SUMMARY.failed:
        say(f"== simulation: {args.sim_brokers} brokers x {args.sim_topics:,} topics")
        try:
            simulation_phase(args)
        except Exception as exc:  # noqa: BLE001
            SUMMARY.failed.append("simulation")
            say(f"  FAILED: {fs.describe(exc)}")
    _FINISHED.set()
    if SUMMARY.failed:
        say(f"cluster: did not finish: {', '.join(SUMMARY.failed)}")
    say(f"cluster: {time.monotonic() - started:.0f} s in all")
    say(SUMMARY.line())
    write_result("cluster", timeline(SUMMARY))
    return 1 if SUMMARY.failed else 0


if __name__ == "__main__":
    sys.exit(main())
