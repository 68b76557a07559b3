"""After a produce/consume round, etcd holds exactly the layout of ``docs/etcd-layout.md``.

Every key must match one of the documented key kinds (no stray keys), and every JSON value has
the documented field names in the documented order, with the values this round implies (§1.2,
§1.3, §1.6, §2.1, §3.3, §3.4, §4.2-§4.4).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from helpers import eventually

from danube_pipeline.client import AvroSchema, DanubeClient, InitialPosition, SubscriptionType
from danube_pipeline.dev.flights import FLIGHT_AVRO_SCHEMA_JSON, encode_flight, iter_flights
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import InSyncReplicas, NamespacePolicy, ReplicaAssignment
from danube_pipeline.names import TopicName

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

DOCUMENTED_KEY_PATTERNS = [
    r"/cluster/[A-Za-z0-9_-]+",  # §1.1
    r"/cluster/register/\d+",  # §1.2
    r"/cluster/brokers/\d+/state",  # §1.3
    r"/cluster/brokers/\d+/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+",  # §1.4
    r"/cluster/unassigned/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+",  # §1.5
    r"/cluster/load/\d+",  # §1.6
    r"/cluster/leader",  # §1.7
    r"/cluster/replicas/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+",  # §1.9
    r"/namespaces/[A-Za-z0-9_-]+/policy",  # §2.1
    r"/namespaces/([A-Za-z0-9_-]+)/topics/\1/[A-Za-z0-9_-]+",  # §2.2
    r"/topics/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+",  # §3.1
    r"/topics/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+/delivery",  # §3.2
    r"/topics/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+/producers/\d+",  # §3.3
    r"/topics/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+/subscriptions/[A-Za-z0-9_-]+",  # §3.4
    r"/topics/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+/subscriptions/[A-Za-z0-9_-]+/cursor",  # §3.5
    r"/topics/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+/subscriptions/[A-Za-z0-9_-]+/table_snapshot",  # §3.5.1
    r"/topics/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+/schema",  # §3.7
    r"/topics/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+/table",  # §3.9
    r"/topics/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+/read_path",  # §3.10
    r"/schemas/_global/next_schema_id",  # §4.1
    r"/schemas/[A-Za-z0-9_.-]+/metadata",  # §4.2
    r"/schemas/[A-Za-z0-9_.-]+/versions/\d+",  # §4.3
    r"/schemas/_index/by_id/\d+",  # §4.4
    r"/danube-data/storage/topics/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+/objects/(\d{20}|cur)",  # §5.1, §5.2
    r"/danube-data/storage/topics/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+/state",  # §5.3
    r"/danube-data/storage/topics/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+/reservation",  # §5.4
    r"/danube-data/storage/topics/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+/producer_sequences",  # §5.6
    r"/danube-data/storage/topics/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+/producer_ids/[A-Za-z0-9_-]+",  # §5.6.1
    r"/danube-data/storage/topics/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+/unavailable/\d{20}",  # §5.5
    r"/danube-data/storage/topics/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+/isr",  # §5.9
    r"/danube-data/storage/store_id",  # §5.7
]

N = 50


async def test_keys_and_values_match_the_documented_layout(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    broker = start_broker()
    flights = list(iter_flights(N))
    async with DanubeClient([broker.address]) as client:
        schema = AvroSchema(subject="flights", raw_schema=FLIGHT_AVRO_SCHEMA_JSON)
        async with client.producer("/default/flights", producer_name="layout-producer", schema=schema) as producer:
            offsets = [await producer.send(encode_flight(f)) for f in flights]
            producer_id = producer.producer_id
        async with client.consumer(
            "/default/flights",
            subscription="layout-sub",
            subscription_type=SubscriptionType.SHARED,
            consumer_name="layout-consumer",
            initial_position=InitialPosition.EARLIEST,
        ) as consumer:
            for _ in range(N):
                await consumer.ack(await consumer.receive(timeout_ms=10_000))
    assert offsets == list(range(N))

    async with await MetadataStore.connect(etcd_endpoints) as store:

        async def load_report_lists_the_topic() -> bool:
            report = await store.get(f"/cluster/load/{broker.broker_id}")
            return report is not None and isinstance(report.value, dict) and bool(report.value["topic_list"])

        # the load report (§1.6) is written in the background after the topic loads
        await eventually(
            load_report_lists_the_topic, timeout_s=30, interval_s=0.2, what="a load report listing the topic"
        )
        kvs, _ = await store.get_prefix("/")
    # the decoded JSON of every key: its shape is what this test checks, field by field
    kv: dict[str, Any] = {x.key: x.value for x in kvs}

    stray = [k for k in kv if not any(re.fullmatch(p, k) for p in DOCUMENTED_KEY_PATTERNS)]
    assert stray == [], f"keys outside the documented layout: {stray}"

    b = broker.broker_id
    # §1.1 cluster marker, §1.2 registration, §1.3 state, §1.4 assignment, §1.6 load, §1.7 leader
    assert kv["/cluster/danube"] is None
    reg = kv[f"/cluster/register/{b}"]
    assert list(reg) == ["admin_addr", "advertised_addr", "broker_addr", "prom_exporter"]
    assert reg["advertised_addr"] == broker.address
    assert reg["broker_addr"] == f"http://{broker.address}"
    assert kv[f"/cluster/brokers/{b}/state"] == {"mode": "active", "reason": "boot"}
    assert kv[f"/cluster/brokers/{b}/default/flights"] is None
    load = kv[f"/cluster/load/{b}"]
    assert list(load) == ["resources_usage", "topic_list", "topics_len"]
    assert [r["resource"] for r in load["resources_usage"]] == ["CPU", "Memory", "MsgRate", "ByteRate"]
    assert load["topic_list"] == ["/default/flights"] and load["topics_len"] == 1
    assert kv["/cluster/leader"] == b
    # §2.1 policy with the documented defaults, §2.2 topic registry
    assert kv["/namespaces/default/policy"] == {
        "max_consumers_per_subscription": 0,
        "max_consumers_per_topic": 0,
        "max_message_size": 10485760,
        "max_producers_per_topic": 0,
        "max_publish_rate": 0,
        "max_subscription_dispatch_rate": 0,
        "max_subscriptions_per_topic": 0,
        "retention_size_mb": 0,
        "retention_time_minutes": 0,
    }
    assert list(kv["/namespaces/default/policy"]) == sorted(kv["/namespaces/default/policy"])
    registry = kv["/namespaces/default/topics/default/flights"]  # created by CreateTopic: its request id
    assert list(registry) == ["request_id"] and re.fullmatch(r"[0-9a-f]{32}", registry["request_id"]), registry
    # §3.1-§3.5
    assert kv["/topics/default/flights"] == 0
    assert kv["/topics/default/flights/delivery"] == "Reliable"
    prod = kv[f"/topics/default/flights/producers/{producer_id}"]
    assert list(prod) == ["access_mode", "producer_id", "producer_name", "status", "topic_name"]
    assert prod["producer_id"] == producer_id and prod["producer_name"] == "layout-producer"
    assert prod["access_mode"] == 0 and prod["topic_name"] == "/default/flights"
    assert prod["status"] is False  # closed
    sub = kv["/topics/default/flights/subscriptions/layout-sub"]
    assert list(sub) == ["consumer_id", "consumer_name", "subscription_name", "subscription_type"]
    assert sub["consumer_name"] == "layout-consumer"
    assert sub["subscription_name"] == "layout-sub" and sub["subscription_type"] == 1
    assert kv["/topics/default/flights/subscriptions/layout-sub/cursor"] == N - 1
    # §3.7 the topic's schema settings, written by its first producer with a schema
    assert kv["/topics/default/flights/schema"] == {"subject": "flights", "allow_raw": False}
    assert list(kv["/topics/default/flights/schema"]) == ["subject", "allow_raw"]
    # §5.4 the owner's reserved offset block, guarded by its assignment key's create revision
    reservation = kv["/danube-data/storage/topics/default/flights/reservation"]
    assert list(reservation) == ["broker_id", "owner_epoch", "first_offset", "end_offset", "last_written"]
    assert reservation["broker_id"] == b and reservation["first_offset"] == 0
    assert reservation["end_offset"] >= N - 1 and reservation["last_written"] is None
    assigned = {x.key: x for x in kvs}[f"/cluster/brokers/{b}/default/flights"]
    assert reservation["owner_epoch"] == assigned.create_revision
    # §4.1-§4.4
    assert kv["/schemas/_global/next_schema_id"] == 2
    meta = kv["/schemas/flights/metadata"]
    assert list(meta) == [
        "compatibility_mode", "created_at", "created_by", "id", "latest_version",
        "subject", "topics_using", "updated_at", "versions",
    ]
    assert meta["id"] == 1 and meta["latest_version"] == 1 and meta["subject"] == "flights"
    assert meta["compatibility_mode"] == "Backward" and meta["topics_using"] == ["/default/flights"]
    version = kv["/schemas/flights/versions/1"]
    assert list(version) == ["created_at", "created_by", "version", "fingerprint", "is_deprecated", "schema_def", "tags"]
    assert version["fingerprint"].startswith("sha256:") and len(version["fingerprint"]) == 7 + 64
    assert list(version["schema_def"]) == ["Avro"]
    assert version["schema_def"]["Avro"]["fingerprint"] == version["fingerprint"]
    assert version["schema_def"]["Avro"]["raw_schema"] == FLIGHT_AVRO_SCHEMA_JSON
    assert kv["/schemas/_index/by_id/1"] == {"schema_id": 1, "subject": "flights"}
    # §1.9 and §5.9 only exist for a replication factor above 1 (test_replica_placement.py)
    assert not any("/cluster/replicas/" in k or k.endswith("/isr") for k in kv)


async def test_replication_keys_and_values_match_the_documented_layout() -> None:
    """§1.9 and §5.9: the key builders give the documented paths, the values the documented
    fields in order and refuse malformed ones; §2.1's replication fields are left out at 1."""
    topic = TopicName.parse("/default/flights")
    assert keys.replica_assignment(topic) == "/cluster/replicas/default/flights"
    assert keys.replica_assignment(topic).startswith(keys.REPLICA_ASSIGNMENT_PREFIX)
    assert keys.in_sync_replicas(topic) == "/danube-data/storage/topics/default/flights/isr"
    for key in (keys.replica_assignment(topic), keys.in_sync_replicas(topic)):
        assert any(re.fullmatch(p, key) for p in DOCUMENTED_KEY_PATTERNS), key
    assignment = ReplicaAssignment(replicas=[16861613898696940338, 42, 7], since=1767225600)
    assert list(assignment.to_json()) == ["replicas", "since"]
    assert ReplicaAssignment.decode(b'{"replicas":[16861613898696940338,42,7],"since":1767225600}') == assignment
    isr = InSyncReplicas(owner=42, owner_epoch=1184, isr=[42, 7], high_watermark=336776)
    assert list(isr.to_json()) == ["owner", "owner_epoch", "isr", "high_watermark"]
    assert InSyncReplicas.from_json(isr.to_json()) == isr
    for bad in ({"replicas": [], "since": 1}, {"replicas": [1, 1], "since": 1}, {"replicas": [1, True], "since": 1},
                {"replicas": [1]}, {"replicas": [1], "since": -1}):
        with pytest.raises(ValueError):
            ReplicaAssignment.from_json(bad)
    for bad_isr in ({**isr.to_json(), "isr": []}, {**isr.to_json(), "high_watermark": -1}, {**isr.to_json(), "owner": "42"}):
        with pytest.raises(ValueError):
            InSyncReplicas.from_json(bad_isr)
    replicated = NamespacePolicy(replication_factor=3, min_insync_replicas=2).to_json()
    assert list(replicated)[-2:] == ["replication_factor", "min_insync_replicas"]
    assert {k: v for k, v in replicated.items() if "replica" not in k} == NamespacePolicy().to_json()
    assert NamespacePolicy.from_json(replicated) == NamespacePolicy(replication_factor=3, min_insync_replicas=2)
