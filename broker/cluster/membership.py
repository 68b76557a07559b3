"""The broker's membership in the cluster: registration under a lease, its state, leader
candidacy and load reports (``docs/etcd-layout.md`` §1).

On :meth:`Membership.join` the broker writes ``/cluster/register/{id}`` under its lease,
``/cluster/{cluster_name}``, ``/cluster/brokers/{id}/state`` (``active``), runs for
``/cluster/leader`` (create-if-absent under the lease) and publishes ``/cluster/load/{id}``.
A background task refreshes the load report. Besides ``CPU`` and ``Memory``, the report's
``resources_usage`` carries ``MsgRate`` and ``ByteRate``: the messages and record-batch bytes per
second written to the broker's WALs since the previous report (:class:`TrafficMeter`).
When the lease's keep-alive finds the lease gone
(etcd was unreachable for longer than the TTL), the same task registers again at once: a new
lease, the registration, the state, leadership candidacy and a load report, retried every
:data:`REREGISTER_RETRY_S` until etcd takes them. Failures are logged once per outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping

from danube_pipeline.aio import wait_set
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import (
    Lease,
    MetadataStore,
    WatchEvent,
    WatchEventType,
)
from danube_pipeline.outages import OutageLog

from broker.cluster.load_manager import BYTE_RATE_RESOURCE, CPU_RESOURCE, MEMORY_RESOURCE, MSG_RATE_RESOURCE
from broker.tasks import spawn

log = logging.getLogger(__name__)

REREGISTER_RETRY_S = 0.25
"""Pause between two attempts to register again after the lease was lost."""

TOPIC_CHANGE_REPORT_S = 1.0
"""Topic loads and unloads write the load report at most this often: each report carries the
whole topic list, so one report per topic made loading 10,000 topics write some 10,000 reports
of up to 150 KB (``benchmarks/scale.py``)."""

MIN_RATE_WINDOW_S = 1.0
"""Rates are measured over at least this long: a report sooner after the previous one (a topic
was loaded or unloaded) repeats the previous rates."""


def _cpu_percent() -> int:
    """The 1-minute load average as a percentage of the CPUs (0 when unknown)."""
    try:
        return int(round(os.getloadavg()[0] / (os.cpu_count() or 1) * 100))
    except OSError:
        return 0


def _memory_percent() -> int:
    """Used memory (``MemTotal - MemAvailable``) as a percentage (0 when unknown)."""
    with contextlib.suppress(OSError, ValueError, KeyError, ZeroDivisionError):
        info: dict[str, int] = {}
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                info[name] = int(rest.split()[0])
        return int(round((info["MemTotal"] - info["MemAvailable"]) / info["MemTotal"] * 100))
    return 0


class TrafficMeter:
    """Messages and bytes per second from per-topic counters that only grow while a topic is
    open (the WAL's ``record_count`` and ``byte_count``).

    Args:
        counters: returns ``topic -> (records, bytes)`` written since the topic's WAL opened.
        clock: seconds, monotonic.
    """

    def __init__(
        self, counters: Callable[[], Mapping[str, tuple[int, int]]], *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._counters = counters
        self._clock = clock
        self._last: dict[str, tuple[int, int]] = {}
        self._last_s: float | None = None
        self.msg_per_s = 0.0
        self.bytes_per_s = 0.0

    def sample(self) -> tuple[float, float]:
        """The rates since the previous sample (0 at the first one).

        A topic not seen at the previous sample counts everything since its WAL opened, which
        was after that sample; a counter that went down (the topic was released and loaded
        again) counts from 0. Within :data:`MIN_RATE_WINDOW_S` of the previous sample, the
        previous rates are returned and the window goes on.

        Returns:
            ``(messages per second, bytes per second)``.
        """
        now = self._clock()
        if self._last_s is not None and now - self._last_s < MIN_RATE_WINDOW_S:
            return self.msg_per_s, self.bytes_per_s
        counts = dict(self._counters())
        if self._last_s is not None:
            records = size = 0
            for topic, (r, b) in counts.items():
                r0, b0 = self._last.get(topic, (0, 0))
                records += r - r0 if r >= r0 else r
                size += b - b0 if b >= b0 else b
            elapsed = now - self._last_s
            self.msg_per_s, self.bytes_per_s = records / elapsed, size / elapsed
        self._last, self._last_s = counts, now
        return self.msg_per_s, self.bytes_per_s


class Membership:
    """Registration, state, leadership and load reports of one broker.

    Args:
        broker_id: the broker's u64 id.
        advertised_addr: ``host:port`` clients use.
        cluster_name: written as ``/cluster/{cluster_name}`` (§1.1).
        store: etcd, for writes.
        cache: the LocalCache (leader changes are followed through it).
        lease_ttl_s: TTL of the registration lease, in seconds (§1.2).
        load_report_interval_s: how often ``/cluster/load/{id}`` is refreshed (§1.6).
        topic_list: returns the topics served here, ``/ns/topic`` sorted, for the load report.
        traffic: returns ``topic -> (records, bytes)`` written to each topic served here since
            its WAL opened, for the report's ``MsgRate`` and ``ByteRate``; none by default.
        internal_addr: ``host:port`` of the broker-to-broker port (``internal_listen``),
            registered as ``internal_addr`` (§1.2); ``None`` registers none.
        prom_exporter: the metrics URL ``http://host:port/metrics`` (``metrics_listen``),
            registered as ``prom_exporter`` (§1.2); ``None`` (no metrics endpoint) registers null.
    """

    def __init__(
        self,
        *,
        broker_id: int,
        advertised_addr: str,
        cluster_name: str,
        store: MetadataStore,
        cache: LocalCache,
        lease_ttl_s: int,
        load_report_interval_s: float,
        topic_list: Callable[[], list[str]],
        traffic: Callable[[], Mapping[str, tuple[int, int]]] = dict,
        internal_addr: str | None = None,
        prom_exporter: str | None = None,
    ) -> None:
        self.broker_id = broker_id
        self.prom_exporter = prom_exporter
        self.internal_addr = internal_addr
        self.advertised_addr = advertised_addr
        self.cluster_name = cluster_name
        self.store = store
        self.cache = cache
        self.lease_ttl_s = lease_ttl_s
        self.load_report_interval_s = load_report_interval_s
        self._topic_list = topic_list
        self.traffic = TrafficMeter(traffic)
        self._lease: Lease | None = None
        self._registered = False
        self._is_leader = False
        self.leader_epoch: int | None = None
        self.on_leadership: Callable[[bool], None] = lambda _leader: None
        self._leaving = False
        self._report_wake = asyncio.Event()
        self._topics_changed = False
        self._reporter: asyncio.Task[None] | None = None
        self._remove_listener: Callable[[], None] | None = None

    def owner_lease(self) -> int | None:
        """The id of the lease this broker is registered under (§1.2) while that lease is
        fresh, else ``None``: the registration of a lease renewed less than ``TTL - margin``
        ago cannot have expired, so no topic of this broker can have been failed over (§1.4).
        Topic owners refuse to acknowledge without it
        (:class:`broker.cluster.ownership.Ownership`, :attr:`Lease.fresh
        <danube_pipeline.metadata.lease.Lease.fresh>`)."""
        lease = self._lease
        if lease is None or not self._registered or not lease.fresh:
            return None
        return lease.id

    @property
    def is_leader(self) -> bool:
        """Whether this broker holds ``/cluster/leader`` (§1.7)."""
        return self._is_leader

    def _set_leader(self, epoch: int | None) -> None:
        """Record leadership: ``epoch`` is the leader key's create revision (§1.7), ``None``
        when this broker is not (or no longer) the leader."""
        was = self._is_leader
        self._is_leader = epoch is not None
        self.leader_epoch = epoch
        if was != self._is_leader or epoch is not None:
            try:
                self.on_leadership(self._is_leader)
            except Exception:  # noqa: BLE001 - a listener must not break the election
                log.exception("leadership listener failed")

    async def join(self) -> None:
        """Register, mark active, run for leader, publish the load report, start reporting.

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        await self._register()
        self._remove_listener = self.cache.add_listener(keys.CLUSTER_LEADER, self._on_leader_event)
        self._reporter = asyncio.create_task(self._load_reporter(), name="load-report")

    def topics_changed(self) -> None:
        """Publish a new load report soon (a topic was loaded or unloaded): within
        :data:`TOPIC_CHANGE_REPORT_S` of the previous one."""
        self._topics_changed = True
        self._report_wake.set()

    async def _register(self, reason: str = "boot") -> Lease:
        self._registered = False
        self._set_leader(None)
        old = self._lease
        if old is not None and not old.expired:  # a half-done earlier attempt: let it go
            self._lease = None
            spawn(old.revoke(), name=f"revoke-lease-{old.id}")
        lease = await self.store.grant_lease(self.lease_ttl_s)
        lease.on_expired = self._lease_expired
        self._lease = lease
        registration = values.BrokerRegistration(
            admin_addr=f"http://{self.advertised_addr}",
            advertised_addr=self.advertised_addr,
            broker_addr=f"http://{self.advertised_addr}",
            prom_exporter=self.prom_exporter,
            internal_addr=self.internal_addr,
        )
        await self.store.put(keys.cluster_name(self.cluster_name), None)
        # Registration and state live and die with the lease (§1.2, §1.3).
        await self.store.put_many(
            [
                (keys.broker_register(self.broker_id), registration),
                (keys.broker_state(self.broker_id), values.BrokerState(mode="active", reason=reason)),
            ],
            lease=lease,
        )
        await self._campaign()
        revision = await self.store.put(keys.load_report(self.broker_id), self.load_report())
        await self.cache.wait_for_revision(revision)
        self._registered = True
        return lease

    def _lease_expired(self, lease: Lease) -> None:
        """``lease`` is gone in etcd: register again now (the load reporter does it)."""
        if lease is self._lease and not self._leaving:
            self._registered = False
            self._set_leader(None)
            self._report_wake.set()

    async def _campaign(self) -> None:
        if self._leaving or self._lease is None:
            return
        lease = self._lease
        if lease.expired:  # registering again runs for leader with the new lease
            return
        try:
            # Create-if-absent under the lease; the transaction's revision is the key's create
            # revision: the leader's epoch (§1.7).
            epoch = await self.store.transaction(
                created={keys.CLUSTER_LEADER: 0}, puts=[(keys.CLUSTER_LEADER, self.broker_id)], lease=lease
            )
        except Exception as exc:  # noqa: BLE001 - retried on the next leader change
            if "lease not found" in str(exc):  # it just expired: registering again runs for leader
                log.info("leader election deferred: lease %d expired; registering again", lease.id)
                self._lease_expired(lease)
            else:
                log.warning("leader election failed: %s", exc)
            return
        if epoch is not None and lease is self._lease and not lease.expired:
            self._set_leader(epoch)
            log.info("broker %d is the cluster leader (epoch %d)", self.broker_id, epoch)

    def _on_leader_event(self, event: WatchEvent) -> None:
        if event.key == keys.CLUSTER_LEADER and event.type is WatchEventType.DELETE and not self._leaving:
            self._set_leader(None)
            spawn(self._campaign(), name="leader-campaign")

    def load_report(self) -> values.LoadReport:
        """The value of ``/cluster/load/{id}`` now (§1.6); the rates are over the time since
        the previous report (:meth:`TrafficMeter.sample`), rounded to whole numbers."""
        topic_list = self._topic_list()
        msg_per_s, bytes_per_s = self.traffic.sample()
        return values.LoadReport(
            resources_usage=[
                values.ResourceUsage(CPU_RESOURCE, _cpu_percent()),
                values.ResourceUsage(MEMORY_RESOURCE, _memory_percent()),
                values.ResourceUsage(MSG_RATE_RESOURCE, round(msg_per_s)),
                values.ResourceUsage(BYTE_RATE_RESOURCE, round(bytes_per_s)),
            ],
            topic_list=topic_list,
            topics_len=len(topic_list),
        )

    async def _load_reporter(self) -> None:
        outage = OutageLog(log, "registration and load report")
        wait_s = self.load_report_interval_s
        reported_at = 0.0
        while True:
            await wait_set(self._report_wake, wait_s)
            if self._registered and self._topics_changed:  # coalesce the reports of a burst of loads
                await asyncio.sleep(max(0.0, reported_at + TOPIC_CHANGE_REPORT_S - time.monotonic()))
            self._topics_changed = False
            reported_at = time.monotonic()
            self._report_wake.clear()
            if self._leaving:
                return
            try:
                if not self._registered or self._lease is None or self._lease.expired:
                    if not outage.failing:
                        log.warning("broker %d: registration lease lost; registering again", self.broker_id)
                    lease = await self._register(reason="registered again after its lease expired")
                    log.info("broker %d registered again (lease %d)", self.broker_id, lease.id)
                else:
                    await self.store.put(keys.load_report(self.broker_id), self.load_report())
            except Exception as exc:  # noqa: BLE001 - etcd unreachable: retried soon
                outage.failed(exc)
                wait_s = REREGISTER_RETRY_S
                continue
            outage.succeeded()
            wait_s = self.load_report_interval_s

    async def mark_draining(self, reason: str) -> None:
        """Write state ``draining`` (§1.3); a failure is logged."""
        self._leaving = True
        try:
            await self.set_state("draining", reason)
        except Exception as exc:  # noqa: BLE001
            log.warning("cannot record draining state: %s", exc)

    async def set_state(self, mode: str, reason: str) -> None:
        """Write ``/cluster/brokers/{id}/state`` (§1.3) under the registration lease.

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        lease = self._lease if self._lease is not None and not self._lease.expired else None
        await self.store.put(keys.broker_state(self.broker_id), values.BrokerState(mode=mode, reason=reason), lease=lease)

    async def leave(self) -> None:
        """Stop reporting and revoke the lease: registration and leadership go with it."""
        self._leaving = True
        if self._remove_listener is not None:
            self._remove_listener()
            self._remove_listener = None
        if self._reporter is not None:
            self._reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reporter
        self._set_leader(None)
        if self._lease is not None:
            try:
                await self._lease.revoke()
            except Exception as exc:  # noqa: BLE001
                log.warning("cannot revoke lease: %s", exc)


__all__ = ["Membership", "TrafficMeter"]
