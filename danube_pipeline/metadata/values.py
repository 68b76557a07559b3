"""The JSON values stored at the keys of :mod:`danube_pipeline.metadata.keys` (``docs/etcd-layout.md``).

Each structured value is a frozen dataclass whose fields, names and order are those of Danube's
layout; :func:`encode` writes compact JSON (UTF-8) and :func:`decode` reads it back. Scalar
values (``null`` markers, the partition count ``0``, ``"Reliable"``, cursors, the leader id,
the next schema id) are stored as their plain JSON form through the same two functions.
Times are whole seconds since the Unix epoch. The base (:class:`JsonRecord`, :func:`encode`,
:func:`decode`) lives in :mod:`danube_pipeline.metadata.records` and the replication values
(:class:`ReplicaAssignment`, :class:`InSyncReplicas`) in
:mod:`danube_pipeline.metadata.replica_values`; both are re-exported here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Self

from danube_pipeline.metadata.records import JsonRecord as JsonRecord
from danube_pipeline.metadata.records import JsonValue as JsonValue
from danube_pipeline.metadata.records import T as T
from danube_pipeline.metadata.records import decode as decode
from danube_pipeline.metadata.records import encode as encode
from danube_pipeline.metadata.replica_values import InSyncReplicas as InSyncReplicas
from danube_pipeline.metadata.replica_values import ReplicaAssignment as ReplicaAssignment


@dataclasses.dataclass(frozen=True, slots=True)
class BrokerRegistration(JsonRecord):
    """§1.2 ``/cluster/register/{broker_id}``.

    ``broker_addr`` and ``admin_addr`` carry an ``http://`` scheme (§1.2);
    ``advertised_addr`` is ``host:port``. ``prom_exporter`` is ``None`` while no metrics
    endpoint runs. ``internal_addr`` (``host:port`` of the broker-to-broker port, a Danube
    Pipeline addition) is written only when the broker serves one: without it the JSON has
    Danube's four fields exactly.
    """

    admin_addr: str
    advertised_addr: str
    broker_addr: str
    prom_exporter: str | None
    internal_addr: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = JsonRecord.to_json(self)
        if out.get("internal_addr") is None:
            del out["internal_addr"]
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class BrokerState(JsonRecord):
    """§1.3 ``/cluster/brokers/{broker_id}/state``: ``mode`` is ``active`` or ``draining``."""

    mode: str
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class ResourceUsage(JsonRecord):
    """One entry of :class:`LoadReport` ``resources_usage`` (usage in percent)."""

    resource: str
    usage: int


@dataclasses.dataclass(frozen=True, slots=True)
class LoadReport(JsonRecord):
    """§1.6 ``/cluster/load/{broker_id}``."""

    resources_usage: list[ResourceUsage]
    topic_list: list[str]
    topics_len: int
    _nested: ClassVar[dict[str, type[JsonRecord]]] = {"resources_usage": ResourceUsage}


@dataclasses.dataclass(frozen=True, slots=True)
class UnassignedReason(JsonRecord):
    """§1.5 value of ``/cluster/unassigned/{ns}/{topic}`` after an unload."""

    reason: str
    from_broker: int


OBJECT_LIFECYCLES = ("keep", "after-commit")
"""The values of :attr:`NamespacePolicy.object_lifecycle` (``docs/etcd-layout.md`` §2.1)."""


@dataclasses.dataclass(frozen=True, slots=True)
class NamespacePolicy(JsonRecord):
    """§2.1 ``/namespaces/{namespace}/policy``; 0 means unlimited. Sizes in bytes.

    ``object_lifecycle`` (one of :data:`OBJECT_LIFECYCLES`) says what tiering does with a
    segment object once the topic's Iceberg table holds its offsets: ``"keep"`` (the default)
    keeps it; ``"after-commit"`` deletes it once the table is verified to hold every offset of
    it, byte for byte (§5.1 ``object_deleted_at``). It is written only when not ``"keep"``, so a
    default policy's JSON is Danube's.

    ``replication_factor`` (how many brokers hold a copy of each topic's log, the owner
    included) and ``min_insync_replicas`` (how many of them, the owner included, must hold a
    batch before a producer is acked) are integers >= 1, default 1 (no replication), with
    ``min_insync_replicas <= replication_factor`` (Kafka's ``replication.factor`` and
    ``min.insync.replicas``). Each is written only when not 1, so a default policy's JSON is
    Danube's.
    """

    max_consumers_per_subscription: int = 0
    max_consumers_per_topic: int = 0
    max_message_size: int = 10 * 1024 * 1024
    max_producers_per_topic: int = 0
    max_publish_rate: int = 0
    max_subscription_dispatch_rate: int = 0
    max_subscriptions_per_topic: int = 0
    retention_size_mb: int = 0
    retention_time_minutes: int = 0
    object_lifecycle: str = "keep"
    replication_factor: int = 1
    min_insync_replicas: int = 1

    REPLICATION_FIELDS: ClassVar[tuple[str, ...]] = ("replication_factor", "min_insync_replicas")
    """The replication fields (§2.1): integers >= 1, written only when not 1."""

    ALIASES: ClassVar[dict[str, str]] = {
        "retentionSizeInMB": "retention_size_mb",
        "retentionTimeInMinutes": "retention_time_minutes",
    }
    """Danube's (and Pulsar's) camelCase retention names, accepted when reading (§2.1)."""

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """As :meth:`JsonRecord.from_json`; ``retentionTimeInMinutes`` and
        ``retentionSizeInMB`` are read as ``retention_time_minutes`` and ``retention_size_mb``
        when the snake-case field is absent.

        Raises:
            ValueError: ``data`` is not an object, a retention value is not a non-negative
                integer, a replication field is not an integer >= 1, or
                ``min_insync_replicas`` exceeds ``replication_factor``.
        """
        if isinstance(data, dict):
            data = dict(data)
            for alias, name in cls.ALIASES.items():
                if alias in data and name not in data:
                    data[name] = data[alias]
        policy = cls._from_fields(data)
        for name in ("retention_size_mb", "retention_time_minutes"):
            value = getattr(policy, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"NamespacePolicy: {name} must be a non-negative integer, got {value!r}")
        _check_lifecycle(policy.object_lifecycle, "NamespacePolicy")
        for name in cls.REPLICATION_FIELDS:
            _check_replication_field(getattr(policy, name), name, "NamespacePolicy")
        policy.check_replication("NamespacePolicy")
        return policy

    def to_json(self) -> dict[str, Any]:
        """The JSON object; ``object_lifecycle`` only when not ``"keep"``, the replication
        fields only when not 1."""
        out = JsonRecord.to_json(self)
        if self.object_lifecycle == "keep":
            del out["object_lifecycle"]
        for name in self.REPLICATION_FIELDS:
            if out[name] == 1:
                del out[name]
        return out

    def check_replication(self, where: str = "policy") -> None:
        """Refuse ``min_insync_replicas`` above ``replication_factor`` (§2.1): no producer
        could ever be acked.

        Raises:
            ValueError: it is above.
        """
        if self.min_insync_replicas > self.replication_factor:
            raise ValueError(
                f"{where}: min_insync_replicas ({self.min_insync_replicas}) must not exceed "
                f"replication_factor ({self.replication_factor})"
            )

    COUNT_LIMITS: ClassVar[tuple[str, ...]] = (
        "max_producers_per_topic",
        "max_subscriptions_per_topic",
        "max_consumers_per_topic",
        "max_consumers_per_subscription",
    )
    """The count limits the broker enforces at ``CreateProducer`` and ``Subscribe`` (§2.1)."""

    def overridden(self, data: Any) -> NamespacePolicy:
        """This policy with the fields present in ``data`` (a topic's override,
        ``/topics/{ns}/{topic}/policy``, §3.8) replacing its own; unknown fields are ignored.

        Raises:
            ValueError: ``data`` is not an object, a known field is not a non-negative
                integer (a replication field: an integer >= 1), ``object_lifecycle`` is not
                one of :data:`OBJECT_LIFECYCLES`, or the result's ``min_insync_replicas``
                exceeds its ``replication_factor``.
        """
        if not isinstance(data, dict):
            raise ValueError(f"topic policy: expected a JSON object, got {type(data).__name__}")
        data = dict(data)
        for alias, name in self.ALIASES.items():
            if alias in data and name not in data:
                data[name] = data[alias]
        changes: dict[str, int | str] = {}
        for f in dataclasses.fields(self):
            if f.name == "object_lifecycle":
                if f.name in data:
                    changes[f.name] = _check_lifecycle(data[f.name], "topic policy")
            elif f.name in self.REPLICATION_FIELDS:
                if f.name in data:
                    changes[f.name] = _check_replication_field(data[f.name], f.name, "topic policy")
            elif f.name in data:
                value = data[f.name]
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"topic policy: {f.name} must be a non-negative integer, got {value!r}")
                changes[f.name] = value
        merged = dataclasses.replace(self, **changes)  # type: ignore[arg-type]
        merged.check_replication("topic policy")
        return merged

    @property
    def retention_bytes(self) -> int:
        """``retention_size_mb`` in bytes (MiB × 1,048,576); 0 = no size limit."""
        return self.retention_size_mb * 1024 * 1024

    @property
    def retention_ms(self) -> int:
        """``retention_time_minutes`` in milliseconds; 0 = kept forever."""
        return self.retention_time_minutes * 60_000


def merged_policy(namespace_raw: object, topic_raw: object) -> tuple[NamespacePolicy, list[str]]:
    """A topic's effective policy: the namespace policy (§2.1; the defaults when absent or
    unreadable) with the fields of the topic's override (§3.8) that are present replacing the
    namespace's (an unreadable override is ignored).

    Args:
        namespace_raw: the decoded value of ``/namespaces/{ns}/policy``, ``None`` when absent.
        topic_raw: the decoded value of ``/topics/{ns}/{topic}/policy``, ``None`` when absent.

    Returns:
        The policy, and one line per value that was unreadable and set aside, for the caller's
        log (empty when both were read).
    """
    problems: list[str] = []
    policy = NamespacePolicy()
    if namespace_raw is not None:
        try:
            policy = NamespacePolicy.from_json(namespace_raw)
        except ValueError as exc:
            problems.append(f"unreadable namespace policy {namespace_raw!r} ({exc}); using defaults")
    if topic_raw is not None:
        try:
            policy = policy.overridden(topic_raw)
        except ValueError as exc:
            problems.append(f"unreadable topic policy override {topic_raw!r} ({exc}); ignored")
    return policy, problems


def _check_replication_field(value: Any, name: str, where: str) -> int:
    """``value`` if it is an integer >= 1 (``replication_factor``, ``min_insync_replicas``, §2.1).

    Raises:
        ValueError: it is not.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    return value


def _check_lifecycle(value: Any, where: str) -> str:
    """``value`` if it is one of :data:`OBJECT_LIFECYCLES`.

    Raises:
        ValueError: it is not.
    """
    if not isinstance(value, str) or value not in OBJECT_LIFECYCLES:
        raise ValueError(f"{where}: object_lifecycle must be one of {', '.join(OBJECT_LIFECYCLES)}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class ProducerMetadata(JsonRecord):
    """§3.3 ``/topics/{ns}/{topic}/producers/{producer_id}``; ``status`` false once closed."""

    access_mode: int
    producer_id: int
    producer_name: str
    status: bool
    topic_name: str


@dataclasses.dataclass(frozen=True, slots=True)
class SubscriptionMetadata(JsonRecord):
    """§3.4 ``/topics/{ns}/{topic}/subscriptions/{name}``.

    ``subscription_type``: 0 Exclusive, 1 Shared, 2 Failover, 3 Key_Shared. ``consumer_id`` is
    ``None`` in a new subscription; the broker writes the active consumer's id when one is
    attached. The redelivery settings (``ack_timeout_ms`` ... ``dead_letter_topic``, §3.4) are
    optional in a stored value: absent ones read as their defaults.
    """

    consumer_id: int | None
    consumer_name: str
    subscription_name: str
    subscription_type: int
    ack_timeout_ms: int = 0
    nack_redelivery_delay_ms: int = 60_000
    nack_redelivery_max_delay_ms: int = 600_000
    max_redeliveries: int = 0
    dead_letter_topic: str | None = None

    _SETTINGS: ClassVar[tuple[str, ...]] = (
        "ack_timeout_ms", "nack_redelivery_delay_ms", "nack_redelivery_max_delay_ms", "max_redeliveries",
        "dead_letter_topic",
    )

    def to_json(self) -> dict[str, Any]:
        """The four Danube fields, then each redelivery setting that differs from its default
        (a subscription with default settings stores exactly Danube's value)."""
        out = JsonRecord.to_json(self)
        for f in dataclasses.fields(self):
            if f.name in self._SETTINGS and out[f.name] == f.default:
                del out[f.name]
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectDescriptor(JsonRecord):
    """§5.1 ``/danube-data/storage/topics/{ns}/{topic}/objects/{padded_start_offset}``.

    Attributes:
        completed: false until the object is fully written, then true.
        created_at: seconds since the epoch.
        end_offset: inclusive.
        etag: the object store's etag or content hash, ``None`` until known.
        object_id: ``data-{start}-{end}.dnb1``.
        offset_index: sparse ``[offset, byte_position]`` pairs within the object.
        size: object size in bytes.
        start_offset: first offset in the object.
        object_deleted_at: set (seconds since the epoch) by tiering under the ``after-commit``
            object lifecycle (§2.1) once the topic's Iceberg table was verified to hold every
            offset of the object byte for byte: the object is deleted right after, and its
            offsets are read from the table. ``None`` (left out of the JSON): the object is kept.
    """

    completed: bool
    created_at: int
    end_offset: int
    etag: str | None
    object_id: str
    offset_index: list[list[int]]
    size: int
    start_offset: int
    object_deleted_at: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object; ``object_deleted_at`` only when set (as descriptors written before it)."""
        out = JsonRecord.to_json(self)
        if self.object_deleted_at is None:
            del out["object_deleted_at"]
        return out

    @property
    def in_table_only(self) -> bool:
        """Whether the object was deleted once the table held its offsets (``object_deleted_at``)."""
        return self.object_deleted_at is not None


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectsCursor(JsonRecord):
    """§5.2 ``.../objects/cur``: ``start`` is the padded start offset of the newest object."""

    start: str


@dataclasses.dataclass(frozen=True, slots=True)
class TableCommit(JsonRecord):
    """§5.8 ``.../table_commit``: the last commit of a topic's offsets to its Iceberg table, as
    tiering recorded it after the commit (the table itself is the truth; this is for tools
    without an Iceberg reader, such as ``danube-admin``).

    Attributes:
        table: ``{ns}.{topic}`` in the catalog (a partition's is its topic's table).
        committed_end_offset: the table's committed end offset for this topic (partition).
        snapshot_id: the table's snapshot after the commit.
        committed_at_ms: that snapshot's time, ms since the epoch.
        incarnation: the topic incarnation the table holds (its root key's create revision).
    """

    table: str
    committed_end_offset: int
    snapshot_id: int
    committed_at_ms: int
    incarnation: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class LocalRetention(JsonRecord):
    """§3.6 ``/topics/{ns}/{topic}/local_retention``: a topic's override of the brokers' local
    WAL retention. ``-1`` (or a field left out) keeps the broker's setting."""

    bytes: int = -1
    ms: int = -1

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """Build from a decoded JSON object.

        Raises:
            ValueError: ``data`` is not an object, or a field is not an integer ≥ -1.
        """
        value = cls._from_fields(data)
        for name in ("bytes", "ms"):
            v = getattr(value, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < -1:
                raise ValueError(f"LocalRetention: {name} must be an integer >= -1, got {v!r}")
        return value


PARTITION_TRANSFORMS = ("hour", "day", "month", "year", "none")
"""The values of :attr:`TableLayout.partition_transform`: an Iceberg time transform of
``_publish_time`` (Iceberg spec, "Partition Transforms"), or ``"none"`` for an unpartitioned table."""


@dataclasses.dataclass(frozen=True, slots=True)
class TableLayout(JsonRecord):
    """§3.9 ``/topics/{ns}/{topic}/table``: how the topic's Iceberg table is laid out.

    Attributes:
        partition_transform: the table is partitioned by this transform of ``_publish_time``:
            one of :data:`PARTITION_TRANSFORMS` (default ``"day"``; ``"none"``: unpartitioned).
            The table is always sorted by ``_offset``.
        raw_payload: a table with typed columns keeps each payload's exact bytes in
            ``_raw_payload`` (its dead-letter table: ``_producer_id``, ``_attributes``); off by
            default; rows written while off hold ``null`` there.
    """

    partition_transform: str = "day"
    raw_payload: bool = False

    def to_json(self) -> dict[str, Any]:
        """The JSON object; ``raw_payload`` only when on (as values written before it)."""
        out = JsonRecord.to_json(self)
        if not self.raw_payload:
            del out["raw_payload"]
        return out

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """Build from a decoded JSON object.

        Raises:
            ValueError: ``data`` is not an object, ``partition_transform`` is not one of
                :data:`PARTITION_TRANSFORMS`, or ``raw_payload`` is not a boolean.
        """
        value = cls._from_fields(data)
        if value.partition_transform not in PARTITION_TRANSFORMS:
            raise ValueError(
                f"TableLayout: partition_transform must be one of {', '.join(PARTITION_TRANSFORMS)}, "
                f"got {value.partition_transform!r}"
            )
        if not isinstance(value.raw_payload, bool):
            raise ValueError(f"TableLayout: raw_payload must be true or false, got {value.raw_payload!r}")
        return value


COLD_READ_PATHS = ("objects", "iceberg", "auto")
"""The values of :attr:`TopicReadPath.cold_read_path` and of the brokers' ``--cold-read-path``."""


@dataclasses.dataclass(frozen=True, slots=True)
class TopicReadPath(JsonRecord):
    """§3.10 ``/topics/{ns}/{topic}/read_path``: where the topic's subscriptions read offsets
    below the local WAL, overriding the brokers' ``--cold-read-path``.

    Attributes:
        cold_read_path: one of :data:`COLD_READ_PATHS`: ``"objects"`` (the segment objects),
            ``"iceberg"`` (the topic's Iceberg table where it holds the offsets) or ``"auto"``
            (the table where it holds them, the objects on any trouble).
    """

    cold_read_path: str = "objects"

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """Build from a decoded JSON object.

        Raises:
            ValueError: ``data`` is not an object, or ``cold_read_path`` is not one of
                :data:`COLD_READ_PATHS`.
        """
        value = cls._from_fields(data)
        if value.cold_read_path not in COLD_READ_PATHS:
            raise ValueError(
                f"TopicReadPath: cold_read_path must be one of {', '.join(COLD_READ_PATHS)}, got {value.cold_read_path!r}"
            )
        return value


@dataclasses.dataclass(frozen=True, slots=True)
class TableSnapshot(JsonRecord):
    """§3.5.1 ``.../subscriptions/{sub}/table_snapshot``: the last Iceberg snapshot of the topic's
    table that the subscription's table reads covered.

    Attributes:
        snapshot_id: the snapshot id (Iceberg spec, "Snapshots").
        offset: the table held no offset at or above this one in that snapshot, so a read from
            any offset at or above it needs only the snapshots appended after ``snapshot_id``
            (an incremental append scan).
    """

    snapshot_id: int
    offset: int

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """Build from a decoded JSON object.

        Raises:
            ValueError: ``data`` is not an object, or a field is missing or not an integer
                (``offset`` >= 0).
        """
        value = cls._from_fields(data)
        for name in ("snapshot_id", "offset"):
            v = getattr(value, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"TableSnapshot: {name} must be an integer, got {v!r}")
        if value.offset < 0:
            raise ValueError(f"TableSnapshot: offset must be >= 0, got {value.offset}")
        return value


@dataclasses.dataclass(frozen=True, slots=True)
class SealedState(JsonRecord):
    """§5.3 ``.../state``: written on topic unload; the next owner starts its WAL at
    ``last_committed_offset + 1``."""

    sealed: bool
    last_committed_offset: int
    broker_id: int
    timestamp: int


@dataclasses.dataclass(frozen=True, slots=True)
class OffsetReservation(JsonRecord):
    """§5.4 ``.../reservation``: the block of offsets the topic's owner reserved.

    The owner writes it in a transaction guarded by its assignment key's create revision (its
    *owner epoch*, §1.4) before it acknowledges any offset above the previous ``end_offset``;
    the next owner starts past ``end_offset``.

    Attributes:
        broker_id: the owner that reserved the block.
        owner_epoch: the create revision of its assignment key (§1.4).
        first_offset: the first offset of its ownership (where its WAL started).
        end_offset: the last offset it may hand out (inclusive); -1 before any.
        last_written: set by a fenced owner when it finds its topic gone: the last offset its
            WAL holds; offsets above it up to ``end_offset`` were never handed out.
    """

    broker_id: int
    owner_epoch: int
    first_offset: int
    end_offset: int
    last_written: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class UnavailableRange(JsonRecord):
    """§5.5 ``.../unavailable/{start}``: offsets a failed owner may have acknowledged and not
    tiered, recorded by the owner that took the topic over.

    Attributes:
        start_offset, end_offset: the range, inclusive.
        broker_id: the failed owner, whose disk holds them.
        since: when the range was recorded, seconds since the epoch.
        last_written: set once that broker returned: the last offset its WAL holds; offsets
            above it were never handed out (consumers and tiering pass over them).
        abandoned: set by an operator (``danube-admin topics abandon-range``): offsets of the
            range not in object storage are skipped, counted.
    """

    start_offset: int
    end_offset: int
    broker_id: int
    since: int
    last_written: int | None = None
    abandoned: bool = False

    def unused_from(self) -> int | None:
        """The first offset of the range that was never handed out, ``None`` while unknown."""
        return None if self.last_written is None else max(self.start_offset, self.last_written + 1)


RELIABLE = "Reliable"
NON_RELIABLE = "NonReliable"
