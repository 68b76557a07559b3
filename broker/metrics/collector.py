"""Values computed when Prometheus scrapes: read from the broker's own state, never counted on
the hot path (subscription lag and unacked messages, topics owned, leadership, the broker's
state, WAL bytes and free disk, unavailable ranges, quarantined segments, the cluster's
imbalance, the object cache and rate-limit waits).

A scrape runs on the HTTP server's thread, but the state it reads belongs to the event loop:
the reading is handed to the loop (``call_soon_threadsafe``) and the scrape waits for it, at
most :data:`SCRAPE_TIMEOUT_S`, so every value is read between two steps of the loop, never
while a dict is being changed. A failed or late read is logged and the scrape answers with the
families read without the loop (the message sizes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from danube_pipeline.modes import DeliveryMode
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from broker.metrics.families import NAMESPACE_LABELS, SUBSCRIPTION_LABELS, TOPIC_LABELS, BrokerMetrics

if TYPE_CHECKING:
    from broker.core import Broker

log = logging.getLogger(__name__)

BROKER_STATES = ("active", "draining")
SCRAPE_TIMEOUT_S = 5.0
"""How long a scrape waits for the event loop to read the broker's state."""


class BrokerCollector(Collector):
    """Exports the scrape-time families of one broker.

    Args:
        metrics: the broker's metric objects (labels, per-topic mode, message sizes).
        broker: the broker core, or a function returning it (``None`` before it exists).
        is_leader: whether this broker holds ``/cluster/leader``.
        rebalancer: returns the leader's rebalancer (``moves_made``, ``moves_failed``,
            ``moves_skipped``, ``last_result.plan.cv_before``), or ``None`` without one.
        loop: the event loop owning that state (default: the running loop at construction,
            or ``None``: read on the scraping thread).
    """

    def __init__(
        self,
        metrics: BrokerMetrics,
        broker: Callable[[], Broker | None],
        *,
        is_leader: Callable[[], bool] = lambda: False,
        rebalancer: Callable[[], Any] = lambda: None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        self._loop = loop
        self._m = metrics
        self._broker = broker
        self._is_leader = is_leader
        self._rebalancer = rebalancer

    def describe(self) -> Iterable[Metric]:
        """Nothing: the registry then calls :meth:`collect` only when scraped."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Every scrape-time family (module docstring), read on the event loop."""
        try:
            families = self._on_loop(lambda: list(self._read()))
        except Exception:  # noqa: BLE001 - a scrape must not fail the broker
            log.exception("metrics: reading the broker's state failed")
            families = []
        yield from families

    def _on_loop(self, work: Callable[[], list[Metric]]) -> list[Metric]:
        """``work()`` run on the event loop, waited for from this thread.

        Raises:
            TimeoutError: the loop did not run it within :data:`SCRAPE_TIMEOUT_S`.
            RuntimeError: the loop is closed.
        """
        loop = self._loop
        if loop is None:
            return work()
        try:
            if asyncio.get_running_loop() is loop:
                return work()
        except RuntimeError:
            pass  # not on a loop's thread: the scrape's own thread
        done: concurrent.futures.Future[list[Metric]] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(work())
            except BaseException as exc:  # noqa: BLE001 - handed to the scraping thread
                done.set_exception(exc)

        loop.call_soon_threadsafe(run)
        return done.result(timeout=SCRAPE_TIMEOUT_S)

    def _read(self) -> Iterator[Metric]:
        m = self._m
        b = (m.broker,)
        topic_labels = list(TOPIC_LABELS if m.per_topic else NAMESPACE_LABELS)
        sub_labels = list(SUBSCRIPTION_LABELS if m.per_topic else NAMESPACE_LABELS)
        sizes = HistogramMetricFamily(
            "danube_topic_message_size_bytes", "Message sizes (a batch's at its mean size)", labels=topic_labels
        )
        for labels, hist in m.message_sizes.items():
            sizes.add_metric(list(labels), hist.cumulative(), hist.sum)
        yield sizes
        broker = self._broker()
        if broker is None:
            return
        yield from self._topics(broker, topic_labels, sub_labels)
        yield _gauge("danube_broker_topics_owned", "Topics served here", b, len(broker.topics))
        yield _gauge("danube_leader_election_state", "1 on the cluster leader", b, int(self._is_leader()))
        state = GaugeMetricFamily(
            "danube_broker_state", "The broker's state: 1 for the current", labels=["broker", "state"]
        )
        current = "draining" if broker.draining or broker.served.stopping else "active"
        for name in BROKER_STATES:
            state.add_metric([m.broker, name], float(name == current))
        yield state
        yield _gauge("danube_wal_storage_full", "1 while the WAL disk refuses appends", b, int(broker.disk.full))
        try:
            usage = shutil.disk_usage(broker.config.wal_dir)
            free, used = float(usage.free), float(usage.total - usage.free)
        except OSError:
            free = used = float("nan")
        yield _gauge("danube_wal_disk_free_bytes", "Free bytes of the WAL file system", b, free)
        yield _gauge("danube_wal_disk_used_bytes", "Used bytes of the WAL file system (all files)", b, used)
        cache = broker.object_cache
        yield _counter("danube_tiered_cache_hits", "Cold reads answered from the cache", b, cache.hits)
        yield _counter("danube_tiered_cache_misses", "Cold reads that had to wait for a fetch", b, cache.misses)
        yield _counter("danube_tiered_fetched_bytes", "Bytes fetched from object storage", b, cache.fetched_bytes)
        rebalancer = self._rebalancer()
        if rebalancer is not None:
            moves = CounterMetricFamily(
                "danube_rebalancing_moves", "Topics moved by this leader", labels=["broker", "result"]
            )
            for result, value in (("moved", rebalancer.moves_made), ("failed", rebalancer.moves_failed),
                                  ("skipped", rebalancer.moves_skipped)):  # fmt: skip
                moves.add_metric([m.broker, result], float(value))
            yield moves
            plan = rebalancer.last_result.plan
            if plan is not None and self._is_leader():
                yield _gauge(
                    "danube_cluster_imbalance_cv", "CV of the brokers' scores, last round", b, plan.cv_before
                )

    def _topics(self, broker: Broker, topic_labels: list[str], sub_labels: list[str]) -> Iterator[Metric]:
        m = self._m
        per_topic: dict[str, defaultdict[tuple[str, ...], float]] = defaultdict(lambda: defaultdict(float))
        per_sub: dict[str, defaultdict[tuple[str, ...], float]] = defaultdict(lambda: defaultdict(float))
        wal_bytes = 0
        for path, topic in list(broker.topics.items()):
            labels = m.topic_labels(path)
            t = per_topic
            t["producers"][labels] += sum(not p.closed for p in list(topic.producers.values()))
            t["subscriptions"][labels] += len(topic.subscriptions)
            t["throttled"][labels] += topic.publish_limiter.throttled_ms / 1000.0
            wal = topic.wal
            wal_bytes += wal.size_bytes if topic.delivery is DeliveryMode.RELIABLE else 0  # a memory log: no disk
            t["quarantined"][labels] += int(getattr(wal, "quarantine", None) is not None)
            remote = topic.remote
            ranges = list(remote.unavailable) if remote is not None else []
            t["unavailable"][labels] += len(ranges)
            t["unavailable_offsets"][labels] += sum(r.end_offset - r.start_offset + 1 for r in ranges)
            tracker = topic.replication
            if tracker is not None:
                policy = topic.policy()
                t["under_replicated"][labels] += int(len(tracker.isr) < policy.replication_factor)
                t["under_min_isr"][labels] += int(len(tracker.isr) < policy.min_insync_replicas)
                t["isr_shrinks"][labels] += tracker.isr_shrinks
                t["isr_expands"][labels] += tracker.isr_expands
                t["follower_lag"][labels] += max((f.lag for f in tracker.follower_states()), default=0)
            elif topic.delivery is DeliveryMode.RELIABLE:
                t["under_replicated"][labels] += 0
                t["under_min_isr"][labels] += 0
            next_offset = wal.next_offset
            for name, sub in list(topic.subscriptions.items()):
                s_labels = (*labels, name) if m.per_topic else labels
                consumers = len(sub.consumers)
                t["consumers"][labels] += consumers
                per_sub["lag"][s_labels] += max(next_offset - sub.ack_floor, 0)
                per_sub["unacked"][s_labels] += sum(h.unacked_count for h in list(sub.handouts.values()))
                limiter = topic.dispatch_limiters.get(name)
                if limiter is not None:
                    per_sub["throttled"][s_labels] += limiter.throttled_ms / 1000.0
        yield from _families(per_topic, topic_labels, {
            "producers": ("danube_topic_active_producers", "Open producers", GaugeMetricFamily),
            "consumers": ("danube_topic_active_consumers", "Attached consumers", GaugeMetricFamily),
            "subscriptions": ("danube_topic_active_subscriptions", "Loaded subscriptions", GaugeMetricFamily),
            "throttled": ("danube_topic_publish_throttled_seconds", "Time batches waited for max_publish_rate",
                          CounterMetricFamily),
            "quarantined": ("danube_quarantined_segments", "Quarantined WAL segments", GaugeMetricFamily),
            "unavailable": ("danube_unavailable_ranges", "Unavailable ranges", GaugeMetricFamily),
            "unavailable_offsets": ("danube_unavailable_offsets", "Offsets in unavailable ranges",
                                    GaugeMetricFamily),
            "under_replicated": ("danube_topic_under_replicated", "1 while the ISR is smaller than the replication "
                                 "factor", GaugeMetricFamily),
            "under_min_isr": ("danube_topic_under_min_isr", "1 while the ISR is below min_insync_replicas (produce "
                              "refused)", GaugeMetricFamily),
            "isr_shrinks": ("danube_topic_isr_shrinks", "Followers removed from the ISR", CounterMetricFamily),
            "isr_expands": ("danube_topic_isr_expands", "Followers added to the ISR", CounterMetricFamily),
            "follower_lag": ("danube_topic_follower_lag_messages", "The most any follower is behind the owner's log "
                             "end, in offsets", GaugeMetricFamily),
        })  # fmt: skip
        yield from _families(per_sub, sub_labels, {
            "lag": ("danube_subscription_lag_messages", "Next offset minus the first unacknowledged",
                    GaugeMetricFamily),
            "unacked": ("danube_subscription_unacked_messages", "Handed out and not acknowledged", GaugeMetricFamily),
            "throttled": ("danube_subscription_dispatch_throttled_seconds", "Time dispatch waited for its rate",
                          CounterMetricFamily),
        })  # fmt: skip
        yield _gauge("danube_wal_disk_bytes", "Bytes of the served topics' WALs", (m.broker,), wal_bytes)


def _families(
    values: dict[str, defaultdict[tuple[str, ...], float]],
    labels: list[str],
    spec: dict[str, tuple[str, str, type[GaugeMetricFamily] | type[CounterMetricFamily]]],
) -> Iterator[Metric]:
    for key, (name, doc, kind) in spec.items():
        family = kind(name, doc, labels=labels)
        for label_values, value in values.get(key, {}).items():
            family.add_metric(list(label_values), value)
        yield family


def _gauge(name: str, doc: str, labels: tuple[str, ...], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["broker"])
    family.add_metric(list(labels), float(value))
    return family


def _counter(name: str, doc: str, labels: tuple[str, ...], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["broker"])
    family.add_metric(list(labels), float(value))
    return family
