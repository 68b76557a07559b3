"""Every etcd key path of Danube's metadata layout (``docs/etcd-layout.md``).

One function per key kind; section numbers refer to ``docs/etcd-layout.md``. Offsets in object keys are
zero-padded to 20 digits so keys sort in offset order (§5.1 "Offset Padding").
"""

from __future__ import annotations

from urllib.parse import quote, unquote

from danube_pipeline.names import TopicName

CLUSTER = "/cluster"
NAMESPACES = "/namespaces"
TOPICS = "/topics"
SCHEMAS = "/schemas"
DANUBE_DATA = "/danube-data"
STORAGE_TOPICS = "/danube-data/storage/topics"
SECURITY = "/security"

OFFSET_PAD_DIGITS = 20


def pad_offset(offset: int) -> str:
    """``offset`` zero-padded to 20 digits (§5.1)."""
    return f"{offset:0{OFFSET_PAD_DIGITS}d}"


# ---- 1. cluster


def cluster_name(name: str) -> str:
    """§1.1 ``/cluster/{CLUSTER_NAME}``; value ``null``."""
    return f"{CLUSTER}/{name}"


def broker_register(broker_id: int) -> str:
    """§1.2 ``/cluster/register/{broker_id}``; value :class:`BrokerRegistration`, under a lease."""
    return f"{CLUSTER}/register/{broker_id}"


BROKER_REGISTER_PREFIX = f"{CLUSTER}/register/"


def broker_state(broker_id: int) -> str:
    """§1.3 ``/cluster/brokers/{broker_id}/state``; value :class:`BrokerState`."""
    return f"{CLUSTER}/brokers/{broker_id}/state"


def broker_prefix(broker_id: int) -> str:
    """``/cluster/brokers/{broker_id}/``, watched by the broker for its assignments (§1.4)."""
    return f"{CLUSTER}/brokers/{broker_id}/"


BROKERS_PREFIX = f"{CLUSTER}/brokers/"


def topic_assignment(broker_id: int, topic: TopicName) -> str:
    """§1.4 ``/cluster/brokers/{broker_id}/{namespace}/{topic}``; value ``null``."""
    return f"{CLUSTER}/brokers/{broker_id}/{topic.namespace}/{topic.topic}"


def unassigned_topic(topic: TopicName) -> str:
    """§1.5 ``/cluster/unassigned/{namespace}/{topic}``; value ``null`` or an unload reason."""
    return f"{CLUSTER}/unassigned/{topic.namespace}/{topic.topic}"


def load_report(broker_id: int) -> str:
    """§1.6 ``/cluster/load/{broker_id}``; value :class:`LoadReport`."""
    return f"{CLUSTER}/load/{broker_id}"


LOAD_REPORT_PREFIX = f"{CLUSTER}/load/"
"""§1.6 ``/cluster/load/``: every broker's load report."""

CLUSTER_LEADER = f"{CLUSTER}/leader"
"""§1.7 ``/cluster/leader``; value the leader's broker id (u64)."""

CLUSTER_LOAD_BALANCE = f"{CLUSTER}/load_balance"
"""§1.8 ``/cluster/load_balance``; value the leader's last
:class:`broker.cluster.load_manager.LoadBalanceDecision`."""


REPLICA_ASSIGNMENT_PREFIX = f"{CLUSTER}/replicas/"
"""§1.9 ``/cluster/replicas/``: every topic's replica assignment."""


def replica_assignment(topic: TopicName) -> str:
    """§1.9 ``/cluster/replicas/{namespace}/{topic}``; value :class:`ReplicaAssignment`, the
    brokers holding a copy of the topic's log (written by the leader only)."""
    return f"{REPLICA_ASSIGNMENT_PREFIX}{topic.namespace}/{topic.topic}"


# ---- 2. namespaces


def namespace_policy(namespace: str) -> str:
    """§2.1 ``/namespaces/{namespace}/policy``; value :class:`NamespacePolicy`."""
    return f"{NAMESPACES}/{namespace}/policy"


def namespace_topic(topic: TopicName) -> str:
    """§2.2 ``/namespaces/{namespace}/topics/{namespace}/{topic}``; value ``null``."""
    return f"{NAMESPACES}/{topic.namespace}/topics/{topic.namespace}/{topic.topic}"


def namespace_topics_prefix(namespace: str) -> str:
    """``/namespaces/{namespace}/topics/``: every topic of the namespace (§2.2)."""
    return f"{NAMESPACES}/{namespace}/topics/"


# ---- 3. topics


def topic_root(topic: TopicName) -> str:
    """§3.1 ``/topics/{namespace}/{topic}``; value the partition count (0 = non-partitioned)."""
    return f"{TOPICS}/{topic.namespace}/{topic.topic}"


def topic_delivery(topic: TopicName) -> str:
    """§3.2 ``/topics/{namespace}/{topic}/delivery``; value ``"Reliable"`` or ``"NonReliable"``."""
    return f"{topic_root(topic)}/delivery"


def topic_local_retention(topic: TopicName) -> str:
    """§3.6 ``/topics/{namespace}/{topic}/local_retention``; value :class:`LocalRetention`,
    the topic's override of the brokers' local WAL retention (written by operators)."""
    return f"{topic_root(topic)}/local_retention"


def topic_schema(topic: TopicName) -> str:
    """§3.7 ``/topics/{namespace}/{topic}/schema``; value :class:`TopicSchema`, the topic's
    schema subject and whether producers without a schema may publish to it."""
    return f"{topic_root(topic)}/schema"


def topic_policy(topic: TopicName) -> str:
    """§3.8 ``/topics/{namespace}/{topic}/policy``; value: fields of :class:`NamespacePolicy`,
    each present one overriding the namespace policy's for this topic (written by operators)."""
    return f"{topic_root(topic)}/policy"


def topic_table(topic: TopicName) -> str:
    """§3.9 ``/topics/{namespace}/{topic}/table``; value :class:`TableLayout`, how the topic's
    Iceberg table is partitioned (written by operators or ``danube-admin topics set-table-layout``)."""
    return f"{topic_root(topic)}/table"


def topic_read_path(topic: TopicName) -> str:
    """§3.10 ``/topics/{namespace}/{topic}/read_path``; value :class:`TopicReadPath`, where the
    topic's subscriptions read offsets below the local WAL (overrides the brokers' setting)."""
    return f"{topic_root(topic)}/read_path"


def topic_producers_prefix(topic: TopicName) -> str:
    """§3.3 prefix of every producer key of ``topic``: ``/topics/{namespace}/{topic}/producers/``."""
    return f"{topic_root(topic)}/producers/"


def topic_producer(topic: TopicName, producer_id: int) -> str:
    """§3.3 ``/topics/{namespace}/{topic}/producers/{producer_id}``; :class:`ProducerMetadata`."""
    return f"{topic_producers_prefix(topic)}{producer_id}"


def topic_subscription(topic: TopicName, subscription: str) -> str:
    """§3.4 ``/topics/{namespace}/{topic}/subscriptions/{subscription_name}``."""
    return f"{topic_root(topic)}/subscriptions/{subscription}"


def subscription_cursor(topic: TopicName, subscription: str) -> str:
    """§3.5 ``.../subscriptions/{subscription_name}/cursor``; value the last acked offset (u64)."""
    return f"{topic_subscription(topic, subscription)}/cursor"


def subscription_table_snapshot(topic: TopicName, subscription: str) -> str:
    """§3.5.1 ``.../subscriptions/{subscription_name}/table_snapshot``; value
    :class:`TableSnapshot`, the last Iceberg snapshot the subscription's table reads covered."""
    return f"{topic_subscription(topic, subscription)}/table_snapshot"


# ---- 4. schemas

SCHEMA_NEXT_ID = f"{SCHEMAS}/_global/next_schema_id"
"""§4.1 ``/schemas/_global/next_schema_id``; value the next free schema id (u64)."""


def schema_metadata(subject: str) -> str:
    """§4.2 ``/schemas/{subject}/metadata``; value :class:`SchemaMetadata`."""
    return f"{SCHEMAS}/{subject}/metadata"


def schema_version(subject: str, version: int) -> str:
    """§4.3 ``/schemas/{subject}/versions/{version}``; value :class:`SchemaVersion`."""
    return f"{SCHEMAS}/{subject}/versions/{version}"


def schema_by_id(schema_id: int) -> str:
    """§4.4 ``/schemas/_index/by_id/{schema_id}``; value :class:`SchemaIndexEntry`."""
    return f"{SCHEMAS}/_index/by_id/{schema_id}"


# ---- 5. danube-data (object descriptors)


def storage_topic(topic: TopicName) -> str:
    """``/danube-data/storage/topics/{namespace}/{topic}``."""
    return f"{STORAGE_TOPICS}/{topic.namespace}/{topic.topic}"


def objects_prefix(topic: TopicName) -> str:
    """``.../objects/``: every descriptor of the topic and the ``cur`` pointer (§5.1, §5.2)."""
    return f"{storage_topic(topic)}/objects/"


def object_descriptor(topic: TopicName, start_offset: int) -> str:
    """§5.1 ``.../objects/{padded_start_offset}``; value :class:`ObjectDescriptor`."""
    return f"{objects_prefix(topic)}{pad_offset(start_offset)}"


def objects_cur(topic: TopicName) -> str:
    """§5.2 ``.../objects/cur``; value :class:`ObjectsCursor`."""
    return f"{objects_prefix(topic)}cur"


def sealed_state(topic: TopicName) -> str:
    """§5.3 ``.../state``; value :class:`SealedState`, written when a topic is unloaded."""
    return f"{storage_topic(topic)}/state"


def offset_reservation(topic: TopicName) -> str:
    """§5.4 ``.../reservation``; value :class:`OffsetReservation`: the offsets the owner may
    hand out without asking etcd again."""
    return f"{storage_topic(topic)}/reservation"


def producer_sequences(topic: TopicName) -> str:
    """§5.6 ``.../producer_sequences``: the idempotent producers' last sequences, handed from
    a releasing owner to the next one."""
    return f"{storage_topic(topic)}/producer_sequences"


def producer_identity(topic: TopicName, producer_name: str) -> str:
    """§5.6.1 ``.../producer_ids/{producer_name}``: the idempotent identity (producer id and
    epoch) of one producer name on the topic."""
    return f"{storage_topic(topic)}/producer_ids/{producer_name}"


def table_commit(topic: TopicName) -> str:
    """§5.8 ``.../table_commit``; value :class:`TableCommit`, the topic's (partition's) last
    commit to its Iceberg table as tiering recorded it."""
    return f"{storage_topic(topic)}/table_commit"


def in_sync_replicas(topic: TopicName) -> str:
    """§5.9 ``.../isr``; value :class:`InSyncReplicas`, the topic's in-sync replicas and high
    watermark (written by the topic's owner only, under its owner epoch)."""
    return f"{storage_topic(topic)}/isr"


def unavailable_prefix(topic: TopicName) -> str:
    """§5.5 ``.../unavailable/``: every unavailable range of the topic."""
    return f"{storage_topic(topic)}/unavailable/"


def unavailable_range(topic: TopicName, start_offset: int) -> str:
    """§5.5 ``.../unavailable/{padded_start_offset}``; value :class:`UnavailableRange`."""
    return f"{unavailable_prefix(topic)}{pad_offset(start_offset)}"


# ---- 6. legacy


def legacy_subscription_consumer(subscription: str, consumer_id: int) -> str:
    """§6 ``/subscriptions/{subscription_name}/{consumer_id}`` (legacy; not written)."""
    return f"/subscriptions/{subscription}/{consumer_id}"


# ---- 7. security


SECURITY_ROLES_PREFIX = f"{SECURITY}/roles/"
"""§7.1 ``/security/roles/``: every role."""

SECURITY_BINDINGS_PREFIX = f"{SECURITY}/bindings/"
"""§7.2 ``/security/bindings/``: every binding."""


def encode_principal(principal: str) -> str:
    """``principal`` as one key segment: percent-encoded, ``/`` included (§7.2)."""
    return quote(principal, safe="")


def decode_principal(segment: str) -> str:
    """The principal of an :func:`encode_principal` segment."""
    return unquote(segment)


def security_role(role: str) -> str:
    """§7.1 ``/security/roles/{role}``; value ``{"permissions": [...]}``."""
    return f"{SECURITY_ROLES_PREFIX}{encode_principal(role)}"


def security_bindings_prefix(principal: str) -> str:
    """§7.2 ``/security/bindings/{principal}/``: every binding of one principal."""
    return f"{SECURITY_BINDINGS_PREFIX}{encode_principal(principal)}/"


def security_binding(principal: str, scope: str) -> str:
    """§7.2 ``/security/bindings/{principal}/{scope}``; value ``{"roles": [...]}``. ``scope`` is
    ``cluster``, ``namespaces/{ns}`` or ``topics/{ns}/{topic}``."""
    return f"{security_bindings_prefix(principal)}{scope}"
