"""The cluster and the owner kills of ``benchmarks/replication.py``.

:class:`ReplicationCluster`: etcd and 3 brokers on loopback (fixed ports, every broker straight
to etcd), the cluster of ``chaos_faults.ChaosCluster`` without its proxy and tmpfs, with the
replication flags (``--lease-ttl-s``, ``--replica-replace-after-s``) passed to every broker.

:class:`OwnerKills`: one :meth:`OwnerKills.kill` at a time, each one

1. waits until every broker runs, every loaded topic has a running owner and, at a replication
   factor above 1, every loaded topic's ISR (``/danube-data/storage/topics/{ns}/{topic}/isr``,
   ``{"isr": [broker ids], ...}``, §5.9) holds that many running brokers (or ``isr_needed``,
   ``--kill-at-isr``), or a time-out (then it kills anyway: a kill while the ISR has
   ``min_insync_replicas`` members is allowed, produce then waits until the topic is
   re-replicated);
2. picks a loaded topic (seeded), finds its owner from the assignment keys
   ``/cluster/brokers/{broker_id}/{ns}/{topic}`` (``docs/etcd-layout.md`` §1.4) and SIGKILLs it;
3. measures the failover of every loaded topic that broker owned: from the SIGKILL to the
   first ack of a message sent after it (:func:`first_ack_after`: no dead broker can have
   acked it), ``inf`` when none came within the bound;
4. restarts the broker on its port, in half of the kills (seeded) after deleting its data
   directory: it then has no ``broker_id`` file and registers as a new broker, which the
   leader re-replicates onto; otherwise it rejoins with its WAL.
"""

from __future__ import annotations

import asyncio
import math
import random
import shutil
import time
from collections.abc import Callable, Reversible, Sequence
from dataclasses import dataclass, field

import faults_scenarios as fs
from chaos_faults import ChaosCluster, FaultRecord, stable_port
from chaos_load import Send
from cluster import owners

from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.replica_values import InSyncReplicas
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName


@dataclass
class ReplicationCluster(ChaosCluster):
    """etcd and 3 brokers, each straight to etcd, with :attr:`broker_args` appended to every
    broker's command line (``--replica-replace-after-s``, and whatever else the run passes)."""

    broker_args: list[str] = field(default_factory=list)

    async def start(self) -> None:
        """Start etcd, then the 3 brokers (from the main thread: the children follow it).

        Raises:
            RuntimeError: a process did not become ready (with its log tail).
        """
        self.etcd.start()
        self.pids.add(self.etcd.pid)
        self.disk_note = "not used"
        args = ["--lease-ttl-s", str(self.lease_ttl_s), "--object-store-url", self.objects_url,
                "--segment-max-age-s", str(self.segment_max_age_s), *self.broker_args]
        for index in range(3):
            broker = BrokerProcess(etcd_endpoints=self.etcd.endpoints, data_dir=self.root / f"broker-{index + 1}",
                                   port=stable_port(), log_path=self.root / "logs" / f"broker-{index + 1}.log",
                                   extra_args=args)
            self.brokers.append(broker)
            await broker.start_async(timeout_s=60)
            self.pids.add(broker.pid)

    def running_ids(self) -> dict[int, int]:
        """``broker id -> index`` of every running broker (its id from its ready file)."""
        return {b.broker_id: i for i, b in enumerate(self.brokers) if b.running}


def first_ack_after(sends: Reversible[Send], topic: str, since: float) -> float | None:
    """When the first message sent to ``topic`` at or after ``since`` was acked.

    Args:
        sends: the ledger's sends, newest last (``Ledger.sends.values()``: insertion order);
            they are walked from the newest back to the first sent before ``since``.
        topic: the topic.
        since: ``time.monotonic()`` of the kill.

    Returns:
        The earliest ``acked_at`` among those sends, ``None`` if none of them is acked yet.
    """
    first: float | None = None
    for send in reversed(sends):
        if send.sent_at < since:
            break
        if send.topic == topic and send.outcome == "acked" and (first is None or send.acked_at < first):
            first = send.acked_at
    return first


def wipe_schedule(kills: int, wiped: int, rng: random.Random) -> list[bool]:
    """Which of ``kills`` kills delete the broker's data directory: exactly ``wiped`` of them
    (at most ``kills``), in an order drawn by ``rng``."""
    wiped = max(0, min(wiped, kills))
    flags = [True] * wiped + [False] * (kills - wiped)
    rng.shuffle(flags)
    return flags


async def isr_of(meta: MetadataStore, topic: str) -> list[int] | None:
    """The ISR of ``topic`` (``/danube-data/storage/topics/{ns}/{topic}/isr``,
    ``docs/etcd-layout.md`` §5.9), ``None`` if the key is absent or unreadable."""
    kv = await meta.get(keys.in_sync_replicas(TopicName.parse(topic)))
    if kv is None:
        return None
    try:
        return list(InSyncReplicas.from_json(kv.value).isr)
    except ValueError:
        return None


@dataclass
class Kill:
    """One SIGKILL of an owner.

    Attributes:
        number: 1, 2, ...
        victim: the broker's name (``broker N``).
        victim_id: its broker id at the kill.
        topic: the loaded topic chosen, whose owner it was.
        owned: every loaded topic it owned at the kill.
        isr_before: ``topic -> ISR`` at the kill (empty at RF 1).
        was_leader: it was the cluster leader (``/cluster/leader``, §1.7) at the kill: its
            topics then wait for a new leader's election before they fail over.
        wiped: its data directory was deleted before the restart.
        killed_at: ``time.monotonic()`` of the SIGKILL.
        failover_s: ``topic -> seconds`` from the SIGKILL to the first ack of a message sent
            after it, for each of :attr:`owned` (``inf``: none within the bound).
        new_owner: ``topic -> broker id`` owning it once it served again (``None``: unknown).
        new_id: the broker's id after the restart (a new one after a wipe).
        ready_s: seconds from the restart until every ISR was full again (``nan``: not measured,
            ``inf``: not within the wait).
        record: the same kill as a ``chaos_faults.FaultRecord`` (for ``chaos_check.detail_lines``).
    """

    number: int
    victim: str
    victim_id: int
    topic: str
    owned: list[str]
    isr_before: dict[str, list[int] | None]
    was_leader: bool
    wiped: bool
    killed_at: float
    failover_s: dict[str, float] = field(default_factory=dict)
    new_owner: dict[str, int | None] = field(default_factory=dict)
    new_id: int = 0
    ready_s: float = math.nan
    record: FaultRecord = field(default_factory=lambda: FaultRecord("kill", "", 0.0))

    @property
    def failed_over(self) -> bool:
        """Every topic it owned served again within the bound."""
        return bool(self.owned) and all(math.isfinite(s) for s in self.failover_s.values())


class OwnerKills:
    """The kills of a run, one :meth:`kill` at a time (see the module docstring).

    ``isr_needed`` is how many running brokers every loaded topic's ISR must hold before a kill
    (at most the replication factor; the replication factor itself means a full ISR).
    """

    def __init__(self, cluster: ReplicationCluster, meta: MetadataStore, sends: dict[int, Send], *,
                 topics: Sequence[str], replication_factor: int, isr_needed: int, rng: random.Random,
                 say: Callable[[str], None], t0: float, failover_bound_s: float, isr_wait_s: float) -> None:
        self.cluster = cluster
        self.meta = meta
        self.sends = sends
        self.topics = list(topics)
        self.replication_factor = replication_factor
        self.isr_needed = min(isr_needed, replication_factor)
        self.rng = rng
        self.say = say
        self.t0 = t0
        self.failover_bound_s = failover_bound_s
        self.isr_wait_s = isr_wait_s
        self.kills: list[Kill] = []
        self._restarted_at: float | None = None

    @property
    def records(self) -> list[FaultRecord]:
        """Every kill as a fault record."""
        return [k.record for k in self.kills]

    async def ready(self) -> tuple[bool, str]:
        """Whether every broker runs, every loaded topic has a running owner and (RF > 1) an ISR
        of at least ``isr_needed`` running brokers; and a description of what is not so."""
        if not all(b.running for b in self.cluster.brokers):
            return False, "a broker is down"
        running = self.cluster.running_ids()
        assigned = await owners(self.meta)
        unowned = [t for t in self.topics if assigned.get(t) not in running]
        if unowned:
            return False, f"no running owner: {unowned}"
        if self.replication_factor <= 1:
            return True, ""
        short: dict[str, list[int] | None] = {}
        for topic in self.topics:
            isr = await isr_of(self.meta, topic)
            if isr is None or len({b for b in isr if b in running}) < self.isr_needed:
                short[topic] = isr
        return not short, f"ISR not full: {short}" if short else ""

    async def wait_ready(self, timeout_s: float) -> tuple[float, str]:
        """Wait until :meth:`ready` (polled every 0.25 s); ``(seconds waited, "")`` or
        ``(inf, what was still not so)`` after ``timeout_s``."""
        started = time.monotonic()
        why = ""
        while time.monotonic() - started < timeout_s:
            checked = await fs.bounded(self.ready(), 10)
            if checked.ok and checked.value is not None:
                ok, why = checked.value
                if ok:
                    return time.monotonic() - started, ""
            else:
                why = fs.describe(checked.error or RuntimeError("?"))
            await asyncio.sleep(0.25)
        return math.inf, why

    async def settle(self) -> tuple[float, str]:
        """:meth:`wait_ready` for up to ``isr_wait_s``; the last kill's ``ready_s`` is set to the
        seconds from its restart until then (``inf`` if not ready in time)."""
        waited_s, why = await self.wait_ready(self.isr_wait_s)
        if self._restarted_at is not None and self.kills:
            self.kills[-1].ready_s = time.monotonic() - self._restarted_at if math.isfinite(waited_s) else math.inf
            self._restarted_at = None
        return waited_s, why

    async def _pick(self) -> tuple[str, int, int, dict[str, int]]:
        """A loaded topic (seeded), its owner's id and index, and every assignment; retried for
        up to 30 s while the owner is not a running broker of this run.

        Raises:
            RuntimeError: no loaded topic had a running owner within 30 s.
        """
        deadline = time.monotonic() + 30
        topic = self.rng.choice(self.topics)
        while time.monotonic() < deadline:
            assigned = await owners(self.meta)
            running = self.cluster.running_ids()
            owner = assigned.get(topic)
            if owner in running:
                return topic, owner, running[owner], assigned
            await asyncio.sleep(0.25)
        raise RuntimeError(f"{topic} has no running owner after 30 s")

    async def kill(self, number: int, *, wipe: bool) -> Kill:
        """Wait until the cluster is ready, SIGKILL the owner of a loaded topic, measure the
        failover of the loaded topics it owned, restart it (wiped when ``wipe``).

        Raises:
            RuntimeError: no owner to kill, or the broker did not start again.
        """
        waited_s, why = await self.settle()
        if not math.isfinite(waited_s):
            self.say(f"    not ready after {self.isr_wait_s:g} s ({why}); killing anyway")
        topic, victim_id, index, assigned = await self._pick()
        broker = self.cluster.brokers[index]
        owned = sorted(t for t in self.topics if assigned.get(t) == victim_id)
        isr_before = {t: await isr_of(self.meta, t) for t in owned} if self.replication_factor > 1 else {}
        leader = await self.meta.get(keys.CLUSTER_LEADER)
        self.cluster.pids.discard(broker.pid)
        killed_at = time.monotonic()
        broker.kill()
        kill = Kill(number, self.cluster.name(index), victim_id, topic, owned, isr_before,
                    leader is not None and leader.value == victim_id, wipe, killed_at)
        kill.record = FaultRecord("kill+wipe" if wipe else "kill", kill.victim, killed_at)
        self.kills.append(kill)
        await self._measure_failover(kill)
        if wipe:
            shutil.rmtree(broker.data_dir, ignore_errors=True)
        await broker.start_async(timeout_s=60)
        self.cluster.pids.add(broker.pid)
        self._restarted_at = time.monotonic()
        kill.new_id = broker.broker_id
        kill.record.ended = time.monotonic()
        kill.record.note = self.describe(kill)
        self.say(f"  {killed_at - self.t0:7.1f} s  #{kill.number:<3} {kill.record.note}")
        return kill

    async def _measure_failover(self, kill: Kill) -> None:
        """Fill ``kill.failover_s`` and ``kill.new_owner``: poll the ledger every 50 ms until
        every topic the victim owned has an ack of a message sent after the kill, or the bound."""
        deadline = kill.killed_at + self.failover_bound_s
        pending = set(kill.owned)
        while pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            for topic in list(pending):
                acked_at = first_ack_after(self.sends.values(), topic, kill.killed_at)
                if acked_at is not None:
                    kill.failover_s[topic] = acked_at - kill.killed_at
                    pending.discard(topic)
        for topic in pending:
            kill.failover_s[topic] = math.inf
        got = await fs.bounded(owners(self.meta), 10)
        assigned = got.value if got.ok and got.value is not None else {}
        kill.new_owner = {t: assigned.get(t) for t in kill.owned}

    def describe(self, kill: Kill) -> str:
        """One line: the victim, what it owned, the failover per topic, the restart."""
        per_topic = ", ".join(
            f"{t} {fs.fmt(kill.failover_s.get(t, math.nan), 2)} s -> {self._short(kill.new_owner.get(t))}"
            + (f" (ISR was {[self._short(b) for b in isr]})" if (isr := kill.isr_before.get(t)) else "")
            for t in kill.owned
        )
        restart = "wiped, restarted as new broker" if kill.wiped else "restarted on its data"
        role = ", the cluster leader" if kill.was_leader else ""
        return (f"SIGKILL {kill.victim} ({self._short(kill.victim_id)}{role}), owner of {kill.topic};"
                f" failover {per_topic};"
                f" {restart} ({self._short(kill.new_id)})")

    @staticmethod
    def _short(broker_id: int | None) -> str:
        """A broker id as its last 5 digits (enough to tell the brokers of a run apart)."""
        return "?" if broker_id is None else f"id ..{broker_id % 100_000:05d}"
