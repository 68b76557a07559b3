"""The metric objects of one broker process and the children bound per topic (the hot path).

One :class:`BrokerMetrics` per process owns the ``CollectorRegistry``. Its children are bound
once per topic (or per namespace, without per-topic labels) and cached, so an instrumented event
is a few ``inc`` calls on objects already found. :class:`NoMetrics` stands in while metrics are
off: the same methods, doing nothing.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

#: Upper bounds of ``danube_topic_message_size_bytes``, in bytes.
SIZE_BUCKETS_BYTES: tuple[float, ...] = (
    64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, float("inf"),
)  # fmt: skip
#: Upper bounds of the millisecond latency histograms.
LATENCY_BUCKETS_MS: tuple[float, ...] = (
    0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 1000, float("inf"),
)  # fmt: skip
#: Upper bounds of ``danube_wal_group_commit_messages``.
GROUP_COMMIT_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 10000, float("inf"))

TOPIC_LABELS = ("broker", "namespace", "topic")
NAMESPACE_LABELS = ("broker", "namespace")
SUBSCRIPTION_LABELS = ("broker", "namespace", "topic", "subscription")


class SizeHistogram:
    """A histogram that takes many observations of one value at once (a batch's messages at
    their mean size); exported by :class:`~broker.metrics.collector.BrokerCollector`.

    Written and read on the event loop's thread only (a scrape reads it there).

    Args:
        buckets: the upper bounds, ascending, ending with ``inf``.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, buckets: Sequence[float] = SIZE_BUCKETS_BYTES) -> None:
        self.bounds = tuple(buckets)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe_many(self, value: float, count: int) -> None:
        """Record ``count`` observations of ``value``."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, cumulative count)`` pairs, as ``HistogramMetricFamily`` takes them."""
        out, total = [], 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(total)))
        return out


class SubscriptionMetrics:
    """The children of one subscription (or of one namespace's subscriptions)."""

    __slots__ = ("_ack_timeout", "_bytes_out", "_dlq", "_messages_out", "_nack", "_redelivery")

    def __init__(self, m: BrokerMetrics, labels: tuple[str, ...]) -> None:
        self._messages_out = m.consumer_messages_out.labels(*labels)
        self._bytes_out = m.consumer_bytes_out.labels(*labels)
        self._nack = m.subscription_nack.labels(*labels)
        self._redelivery = m.subscription_redelivery.labels(*labels)
        self._ack_timeout = m.subscription_ack_timeout.labels(*labels)
        self._dlq = m.subscription_dlq.labels(*labels)

    def sent(self, group: Sequence[Any], size_bytes: int) -> None:
        """A group of deliveries (:class:`broker.dispatch.consumer.Delivery`) of ``size_bytes``
        batch bytes went to a consumer's stream."""
        self._messages_out.inc(sum(d.hold.bits.bit_count() for d in group))
        self._bytes_out.inc(size_bytes)

    def nacked(self, messages: int) -> None:
        """A consumer nacked ``messages``."""
        self._nack.inc(messages)

    def redelivered(self, messages: int) -> None:
        """``messages`` were handed out again."""
        self._redelivery.inc(messages)

    def ack_timed_out(self, messages: int) -> None:
        """``messages`` were taken back after the ack timeout."""
        self._ack_timeout.inc(messages)

    def dead_lettered(self) -> None:
        """One message went to the dead-letter topic."""
        self._dlq.inc()


class TopicMetrics:
    """The children of one topic (or of one namespace): bound once, used on every batch."""

    __slots__ = (
        "_bytes_in", "_latency", "_messages_in", "_schema_failures", "_schema_total", "_send_error",
        "_send_ok", "size",
    )  # fmt: skip

    def __init__(self, m: BrokerMetrics, labels: tuple[str, ...]) -> None:
        self._messages_in = m.topic_messages_in.labels(*labels)
        self._bytes_in = m.topic_bytes_in.labels(*labels)
        self._send_ok = m.producer_send.labels(*labels, "ok")
        self._send_error = m.producer_send.labels(*labels, "error")
        self._latency = m.producer_send_latency.labels(*labels)
        self._schema_total = m.schema_validation.labels(*labels)
        self._schema_failures = m.schema_validation_failures.labels(*labels)
        self.size = m.message_sizes.setdefault(labels, SizeHistogram())

    def produced(self, messages: int, size_bytes: int, future: asyncio.Future[Any]) -> None:
        """A record batch of ``messages`` and ``size_bytes`` was enqueued; ``future`` resolves
        at its durable ack (the latency and ``danube_producer_send_total`` are counted then)."""
        self._messages_in.inc(messages)
        self._bytes_in.inc(size_bytes)
        self.size.observe_many(size_bytes / messages if messages else 0.0, messages)
        received = time.perf_counter()

        def answered(fut: asyncio.Future[Any]) -> None:
            if fut.cancelled() or fut.exception() is not None:
                self._send_error.inc()
            else:
                self._send_ok.inc()
                self._latency.observe((time.perf_counter() - received) * 1000.0)

        future.add_done_callback(answered)

    def schema_validated(self, ok: bool) -> None:
        """A batch was validated against the producer's schema."""
        self._schema_total.inc()
        if not ok:
            self._schema_failures.inc()


class WalMetrics:
    """The broker's WAL counters (no topic label)."""

    __slots__ = ("_append", "_append_bytes", "_delete", "_delete_bytes", "_flush", "_group", "_rotate")

    def __init__(self, m: BrokerMetrics, broker: str) -> None:
        self._append = m.wal_append.labels(broker)
        self._append_bytes = m.wal_append_bytes.labels(broker)
        self._flush = m.wal_flush_latency.labels(broker)
        self._group = m.wal_group_commit.labels(broker)
        self._rotate = m.wal_rotate.labels(broker)
        self._delete = m.wal_delete.labels(broker)
        self._delete_bytes = m.wal_delete_bytes.labels(broker)

    def fdatasync(self, fd: int) -> None:
        """``os.fdatasync(fd)``, timed into ``danube_wal_flush_latency_ms``.

        Raises:
            OSError: from ``os.fdatasync``.
        """
        started = time.perf_counter()
        os.fdatasync(fd)
        self._flush.observe((time.perf_counter() - started) * 1000.0)

    def flushed(self, ms: float) -> None:
        """One sync of a commit round (its ``syncfs``, or one ``fdatasync``) took ``ms``, into
        ``danube_wal_flush_latency_ms``."""
        self._flush.observe(ms)

    def written(self, appends: Sequence[Any], size_bytes: int) -> None:
        """One group commit made ``appends`` (:class:`broker.storage.wal.pending.PendingAppend`,
        ``size_bytes`` in all) durable."""
        self._append.inc(len(appends))
        self._append_bytes.inc(size_bytes)
        self._group.observe(sum(item.record_count for item in appends))

    def rotated(self) -> None:
        """A segment was sealed."""
        self._rotate.inc()

    def deleted(self, size_bytes: int) -> None:
        """A sealed segment was deleted."""
        self._delete.inc()
        self._delete_bytes.inc(size_bytes)


class AuthMetrics:
    """Authentication and authorization outcomes."""

    __slots__ = ("_authn", "_authz")

    def __init__(self, m: BrokerMetrics, broker: str) -> None:
        self._authn = {r: m.authentication.labels(broker, r) for r in ("allow", "deny")}
        self._authz = {r: m.authorization.labels(broker, r) for r in ("allow", "deny")}

    def authenticated(self, ok: bool) -> None:
        """A caller was authenticated (``ok``) or refused."""
        self._authn["allow" if ok else "deny"].inc()

    def authorized(self, ok: bool) -> None:
        """A call was authorized (``ok``) or refused."""
        self._authz["allow" if ok else "deny"].inc()


class BrokerMetrics:
    """Every metric object of one broker process, in its own ``CollectorRegistry``.

    Args:
        broker_id: the broker's id (the ``broker`` label).
        per_topic: label series by topic (and subscription); ``False``: by namespace only.

    Attributes:
        registry: the registry the endpoint serves.
        broker: the ``broker`` label value.
        per_topic: as given.
        wal: the WAL counters.
        auth: the authentication and authorization counters.
        message_sizes: ``danube_topic_message_size_bytes`` per label tuple.
    """

    def __init__(self, broker_id: int, *, per_topic: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.broker = str(broker_id)
        self.per_topic = per_topic
        topic = TOPIC_LABELS if per_topic else NAMESPACE_LABELS
        sub = SUBSCRIPTION_LABELS if per_topic else NAMESPACE_LABELS
        r = self.registry
        self.topic_messages_in = Counter("danube_topic_messages_in", "Messages appended", topic, registry=r)
        self.topic_bytes_in = Counter("danube_topic_bytes_in", "Record-batch bytes appended", topic, registry=r)
        self.producer_send = Counter(
            "danube_producer_send", "Record batches sent, by answer", (*topic, "result"), registry=r
        )
        self.producer_send_latency = Histogram(
            "danube_producer_send_latency_ms", "Batch receipt to durable ack, in ms", topic,
            buckets=LATENCY_BUCKETS_MS, registry=r,
        )  # fmt: skip
        self.schema_validation = Counter(
            "danube_schema_validation", "Batches validated against a schema", topic, registry=r
        )
        self.schema_validation_failures = Counter(
            "danube_schema_validation_failures", "Batches refused by their schema", topic, registry=r
        )
        self.consumer_messages_out = Counter(
            "danube_consumer_messages_out", "Messages sent to consumers", sub, registry=r
        )
        self.consumer_bytes_out = Counter("danube_consumer_bytes_out", "Batch bytes sent to consumers", sub, registry=r)
        self.subscription_nack = Counter("danube_subscription_nack", "Messages nacked", sub, registry=r)
        self.subscription_redelivery = Counter(
            "danube_subscription_redelivery", "Messages handed out again", sub, registry=r
        )
        self.subscription_ack_timeout = Counter(
            "danube_subscription_ack_timeout", "Messages taken back after the ack timeout", sub, registry=r
        )
        self.subscription_dlq = Counter(
            "danube_subscription_dlq", "Messages published to the dead-letter topic", sub, registry=r
        )
        b = ("broker",)
        self.wal_append = Counter("danube_wal_append", "Record batches written to WALs", b, registry=r)
        self.wal_append_bytes = Counter("danube_wal_append_bytes", "Bytes written to WALs", b, registry=r)
        self.wal_flush_latency = Histogram(
            "danube_wal_flush_latency_ms", "One fdatasync of a WAL group commit, or one syncfs of a commit round, in ms", b,
            buckets=LATENCY_BUCKETS_MS, registry=r,
        )  # fmt: skip
        self.wal_group_commit = Histogram(
            "danube_wal_group_commit_messages", "Messages made durable per fdatasync", b,
            buckets=GROUP_COMMIT_BUCKETS, registry=r,
        )  # fmt: skip
        self.wal_rotate = Counter("danube_wal_file_rotate", "WAL segments sealed", b, registry=r)
        self.wal_delete = Counter("danube_wal_delete", "Sealed WAL segments deleted", b, registry=r)
        self.wal_delete_bytes = Counter("danube_wal_delete_bytes", "Bytes freed by WAL deletes", b, registry=r)
        self.rpc_total = Counter(
            "danube_broker_rpc", "gRPC calls, by result (a status code)", ("broker", "service", "method", "result"),
            registry=r,
        )  # fmt: skip
        self.rpc_duration = Histogram(
            "danube_broker_rpc_duration_ms", "gRPC call start to end, in ms", ("broker", "service", "method"),
            buckets=LATENCY_BUCKETS_MS, registry=r,
        )  # fmt: skip
        outcome = ("broker", "result")
        self.authentication = Counter("danube_auth_authentication", "Callers authenticated", outcome, registry=r)
        self.authorization = Counter("danube_auth_authorization", "Calls authorized", outcome, registry=r)
        self.message_sizes: dict[tuple[str, ...], SizeHistogram] = {}
        self.wal = WalMetrics(self, self.broker)
        self.auth = AuthMetrics(self, self.broker)
        self._topics: dict[str, TopicMetrics] = {}
        self._subscriptions: dict[tuple[str, str], SubscriptionMetrics] = {}
        self._lock = threading.Lock()

    def topic_labels(self, path: str) -> tuple[str, ...]:
        """The label values of topic ``path`` (``/ns/topic``): broker, namespace[, topic]."""
        namespace = path.lstrip("/").partition("/")[0]
        return (self.broker, namespace, path) if self.per_topic else (self.broker, namespace)

    def topic(self, path: str) -> TopicMetrics:
        """The children of topic ``path`` (bound on first use, then cached)."""
        found = self._topics.get(path)
        if found is None:
            with self._lock:
                found = self._topics[path] = TopicMetrics(self, self.topic_labels(path))
        return found

    def subscription(self, path: str, name: str) -> SubscriptionMetrics:
        """The children of subscription ``name`` of topic ``path`` (cached)."""
        found = self._subscriptions.get((path, name))
        if found is None:
            labels = self.topic_labels(path)
            with self._lock:
                found = self._subscriptions[(path, name)] = SubscriptionMetrics(
                    self, (*labels, name) if self.per_topic else labels
                )
        return found

    def rpc(self, service: str, method: str) -> tuple[Callable[[str], Any], Any]:
        """For one RPC method: a function from a result to its counter child, and the duration
        histogram child."""
        children: dict[str, Any] = {}

        def counter(result: str) -> Any:
            child = children.get(result)
            if child is None:
                child = children[result] = self.rpc_total.labels(self.broker, service, method, result)
            return child

        return counter, self.rpc_duration.labels(self.broker, service, method)


class _NoTopic:
    __slots__ = ()

    def produced(self, messages: int, size_bytes: int, future: asyncio.Future[Any]) -> None:
        """Nothing."""

    def schema_validated(self, ok: bool) -> None:
        """Nothing."""


class _NoSubscription:
    __slots__ = ()

    def sent(self, group: Sequence[Any], size_bytes: int) -> None:
        """Nothing."""

    def nacked(self, messages: int) -> None:
        """Nothing."""

    def redelivered(self, messages: int) -> None:
        """Nothing."""

    def ack_timed_out(self, messages: int) -> None:
        """Nothing."""

    def dead_lettered(self) -> None:
        """Nothing."""


class _NoWal:
    __slots__ = ()

    def fdatasync(self, fd: int) -> None:
        """``os.fdatasync(fd)``, untimed.

        Raises:
            OSError: from ``os.fdatasync``.
        """
        os.fdatasync(fd)

    def flushed(self, ms: float) -> None:
        """Nothing."""

    def written(self, appends: Sequence[Any], size_bytes: int) -> None:
        """Nothing."""

    def rotated(self) -> None:
        """Nothing."""

    def deleted(self, size_bytes: int) -> None:
        """Nothing."""


class _NoAuth:
    __slots__ = ()

    def authenticated(self, ok: bool) -> None:
        """Nothing."""

    def authorized(self, ok: bool) -> None:
        """Nothing."""


class NoMetrics:
    """What :func:`active` returns while metrics are off: every call does nothing."""

    wal = _NoWal()
    auth = _NoAuth()
    _topic = _NoTopic()
    _subscription = _NoSubscription()

    def topic(self, path: str) -> TopicMetrics | _NoTopic:
        """A topic's children: none."""
        return self._topic

    def subscription(self, path: str, name: str) -> SubscriptionMetrics | _NoSubscription:
        """A subscription's children: none."""
        return self._subscription


_NONE = NoMetrics()
_active: BrokerMetrics | NoMetrics = _NONE


def active() -> BrokerMetrics | NoMetrics:
    """The installed :class:`BrokerMetrics`, or a :class:`NoMetrics` while none is."""
    return _active


def install(metrics: BrokerMetrics) -> None:
    """Make ``metrics`` the process's metrics (one broker per process)."""
    global _active
    _active = metrics


def uninstall(metrics: BrokerMetrics) -> None:
    """Turn metrics off again, if ``metrics`` is the installed one."""
    global _active
    if _active is metrics:
        _active = _NONE
