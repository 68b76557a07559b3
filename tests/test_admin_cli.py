"""``danube-admin`` (``danube_pipeline/admin/cli.py``), run as the installed script against a
real etcd and real brokers; every answer is checked against etcd (``docs/etcd-layout.md``) or
the client library."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import click
import pytest

from danube_pipeline.admin.namespaces import update_namespace_policy
from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.errors import MessageTooLargeError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import KeyValue, MetadataStore
from danube_pipeline.metadata.values import NamespacePolicy, TableCommit
from danube_pipeline.names import TopicName

from helpers import AdminRun, eventually, run_admin

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

DEFAULTS = NamespacePolicy().to_json()


async def admin(etcd: Sequence[str], brokers: Sequence[str], *args: str, output: str = "json") -> AdminRun:
    return await run_admin(*args, etcd=etcd, brokers=brokers, output=output)


async def owners(meta: MetadataStore, topic: str) -> list[int]:
    """Broker ids holding an assignment key of ``topic`` (§1.4)."""
    kvs, _ = await meta.get_prefix(keys.BROKERS_PREFIX)
    name = TopicName.parse(topic)
    suffix = f"/{name.namespace}/{name.topic}"
    return sorted(int(kv.key[len(keys.BROKERS_PREFIX) :].split("/")[0]) for kv in kvs if kv.key.endswith(suffix))


async def value(meta: MetadataStore, key: str) -> Any:
    kv = await meta.get(key)
    assert kv is not None, key
    return kv.value


async def test_every_verb_in_json_matches_etcd_and_the_client(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    broker = start_broker()

    async def run(*args: str, output: str = "json") -> AdminRun:
        return await admin(etcd_endpoints, [broker.address], *args, output=output)

    me = {"broker_id": broker.broker_id, "address": broker.address}
    events = TopicName.parse("/ops/events")
    async with DanubeClient([broker.address]) as client, await MetadataStore.connect(etcd_endpoints) as meta:
        cluster = await client.admin.cluster_metadata()
        assert (await run("brokers", "list")).ok() == {
            "cluster_name": cluster.cluster_name,
            "leader_broker_id": broker.broker_id,
            "brokers": [{**me, "mode": "active", "leader": True}],
        }
        registered, _ = await meta.get_prefix(keys.BROKER_REGISTER_PREFIX)
        assert [kv.key for kv in registered] == [keys.broker_register(broker.broker_id)]
        assert (await run("brokers", "leader")).ok() == {
            "broker_id": await value(meta, keys.CLUSTER_LEADER), "address": broker.address, "mode": "active"
        }

        # namespaces create (default policy, create-if-absent) and get-policy
        assert (await run("namespaces", "create", "ops")).ok() == {"namespace": "ops", "created": True, "policy": DEFAULTS}
        assert await value(meta, keys.namespace_policy("ops")) == DEFAULTS
        assert (await run("namespaces", "create", "ops")).ok()["created"] is False
        stored = await meta.get(keys.namespace_policy("ops"))
        assert stored is not None
        assert (await run("namespaces", "get-policy", "ops")).ok() == {
            "namespace": "ops", "key": "/namespaces/ops/policy", "stored": True,
            "mod_revision": stored.mod_revision, "policy": stored.value,
        }  # fmt: skip
        nowhere = await run("namespaces", "get-policy", "nowhere")
        assert (nowhere.code, nowhere.out) == (1, "")
        assert nowhere.err.startswith("error: namespace 'nowhere' not found"), nowhere.err

        # topics create: the delivery mode lands in §3.2, the owner is the lookup's
        made = (await run("topics", "create", events.path, "--delivery", "NonReliable")).ok()
        assert made == {"topic": events.path, "created": True, "requested_delivery": "NonReliable", "owner": me}
        assert await value(meta, keys.topic_delivery(events)) == "NonReliable"
        assert (await run("topics", "create", events.path)).ok()["created"] is False
        await client.admin.create_topic("/default/other")

        # traffic: 3 messages; subscription "audit" acks 2 and closes (its cursor is stored, §3.5)
        async with client.producer(events.path, producer_name="p") as producer:
            for i in range(3):
                await producer.send(b"m%d" % i)
        async with client.consumer(events.path, subscription="audit", initial_position=InitialPosition.EARLIEST) as c:
            for _ in range(2):
                await c.ack(await c.receive(timeout_ms=10_000))
        cursor_key = keys.subscription_cursor(events, "audit")

        async def cursor_stored() -> bool:
            kv = await meta.get(cursor_key)
            return kv is not None and kv.value == 1

        await eventually(cursor_stored, what="the cursor is stored at close")

        listed = (await run("topics", "list")).ok()["topics"]
        loaded = {t.topic: t for t in await client.admin.list_topics()}
        assert [t["topic"] for t in listed] == ["/default/other", "/ops/events"]
        assert listed[1] == {
            "topic": events.path, "owner": me, "delivery": "NonReliable", "next_offset": 3,
            "sealed_segments": loaded[events.path].sealed_segments, "wal_syncs": loaded[events.path].wal_syncs,
        }  # fmt: skip
        assert listed[0]["delivery"] == "Reliable" and listed[0]["owner"] == me
        only_ops = (await run("topics", "list", "--namespace", "ops")).ok()["topics"]
        assert [t["topic"] for t in only_ops] == [events.path]
        assert (await run("topics", "list", "ops")).ok()["topics"] == only_ops
        # the first topic of a namespace wrote its default policy; text shows 0 as unlimited
        assert (await run("namespaces", "get-policy", "default")).ok()["stored"] is True
        text = await admin(etcd_endpoints, [broker.address], "namespaces", "get-policy", "default", output="text")
        assert text.code == 0 and "max_publish_rate" in text.out and "unlimited" in text.out, text

        described = (await run("topics", "describe", events.path)).ok()
        d = await client.admin.describe_topic(events.path)
        (sub,) = d.subscriptions
        assert described == {
            "topic": events.path, "owner": me, "delivery": "NonReliable", "table": "danube.ops.events",
            "schema_subject": None, "producers": [], "tiering_lag_offsets": None,
            "committed_end_offset": None, "committed_at_ms": None,
            "next_offset": 3, "first_local_offset": d.first_local_offset, "wal_bytes": d.wal_bytes,
            "sealed_segments": d.sealed_segments, "remote_first_offset": None, "remote_end_offset": None,
            "earliest_offset": d.earliest_offset, "cache_bytes": d.cache_bytes,
            "owner_epoch": d.owner_epoch, "reserved_end_offset": 99_999, "unavailable_ranges": [],
            "publish_throttled_ms": 0, "dropped_messages": 0, "buffered_messages": 3,
            "buffered_bytes": d.buffered_bytes,
            "replicas": [], "isr": [], "high_watermark": 3, "followers": [],  # replication factor 1
            "subscriptions": [{
                "name": "audit", "type": "Exclusive", "cursor": 1, "read_position": sub.read_position,
                "consumers": 0, "records_from_object_storage": 0, "records_from_table": 0,
                "skipped_below_retention": 0, "skipped_unavailable": 0, "dispatch_throttled_ms": 0,
            }],
        }  # fmt: skip
        async with client.producer("/default/other", producer_name="live") as live:
            await live.send(b"x")
            other = (await run("topics", "describe", "/default/other")).ok()
        assert other["producers"] == [{"producer_id": live.producer_id, "producer_name": "live"}]
        assert other["table"] == "danube.default.other" and other["tiering_lag_offsets"] == 1
        # what tiering records after a commit (§5.8) is shown as the table's committed end
        other_name = TopicName.parse("/default/other")
        commit = TableCommit("default.other", committed_end_offset=0, snapshot_id=7, committed_at_ms=1_795_000_000_000)
        await meta.put(keys.table_commit(other_name), commit)
        other = (await run("topics", "describe", "/default/other")).ok()
        assert (other["committed_end_offset"], other["committed_at_ms"]) == (0, 1_795_000_000_000)
        shown = (await run("topics", "describe", "/default/other", output="text")).out
        assert "through offset 0 at 2026-11-18" in shown, shown
        owner_kv = await meta.get(keys.topic_assignment(broker.broker_id, events))
        assert owner_kv is not None and d.owner_epoch == owner_kv.create_revision
        # NonReliable: the messages are in memory only, nothing in a WAL
        assert d.next_offset == 3 and d.wal_bytes == 0 and d.buffered_bytes > 0

        sub_meta = await value(meta, keys.topic_subscription(events, "audit"))
        assert (await run("subscriptions", "list", events.path)).ok() == {
            "topic": events.path,
            "owner_answered": True,
            "subscriptions": [{
                "name": "audit", "type": "Exclusive", "active_consumer_id": sub_meta["consumer_id"],
                "consumer_name": sub_meta["consumer_name"], "stored_cursor": await value(meta, cursor_key),
                "loaded": True, "cursor": 1, "read_position": sub.read_position, "consumers": 0,
                "records_from_object_storage": 0, "records_from_table": 0, "skipped_below_retention": 0,
            }],
        }  # fmt: skip

        assert (await run("namespaces", "list")).ok() == {
            "namespaces": [
                {"namespace": "default", "policy": True, "topics": 1},
                {"namespace": "ops", "policy": True, "topics": 1},
            ]
        }

        # unload with one broker: the next owner is the same broker, continuing at offset 3
        assert (await run("topics", "unload", events.path)).ok() == {
            "topic": events.path, "previous_owner": me, "next_offset": 3, "owner": me
        }
        assert (await client.admin.describe_topic(events.path)).next_offset == 3

        # text mode: aligned tables for people
        text = await run("topics", "list", output="text")
        assert text.code == 0, text.err
        header, *rows = text.out.splitlines()
        assert header.split() == ["TOPIC", "OWNER", "DELIVERY", "NEXT_OFFSET", "SEALED_SEGMENTS", "WAL_SYNCS"]
        assert [r.split()[0] for r in rows] == ["/default/other", "/ops/events"]
        assert len({len(r) for r in rows}) == 1  # the rows are aligned (right-aligned numbers)
        assert header.index("DELIVERY") == rows[1].index("NonReliable")
        text = await run("topics", "describe", events.path, output="text")
        assert text.code == 0, text.err
        assert "next offset         3" in text.out and f"owner               {broker.broker_id} ({broker.address})" in text.out
        brokers_text = (await run("brokers", "list", output="text")).out.splitlines()
        assert brokers_text[1].split() == ["BROKER_ID", "ADDRESS", "MODE", "LEADER"]
        assert brokers_text[2].split() == [str(broker.broker_id), broker.address, "active", "yes"]


async def test_set_policy_changes_only_the_given_field_and_the_broker_enforces_it(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    broker = start_broker()
    key = keys.namespace_policy("limits")
    async with DanubeClient([broker.address]) as client, await MetadataStore.connect(etcd_endpoints) as meta:
        # an operator's partial policy: fields left out take their defaults (§2.1)
        await meta.put(key, {"retention_time_minutes": 5, "max_producers_per_topic": 3})
        await client.admin.create_topic("/limits/t")
        async with client.producer("/limits/t", producer_name="early") as producer:
            assert producer.max_message_size_bytes == DEFAULTS["max_message_size"]
            changed = (await admin(etcd_endpoints, [broker.address], "namespaces", "set-policy", "limits",
                                   "--max-message-size", "1024")).ok()  # fmt: skip
            after = await meta.get(key)
            assert after is not None
            expected = {**DEFAULTS, "retention_time_minutes": 5, "max_producers_per_topic": 3, "max_message_size": 1024}
            assert after.value == expected
            assert changed == {
                "namespace": "limits", "changed": ["max_message_size"], "revision": after.mod_revision,
                "before": {**expected, "max_message_size": DEFAULTS["max_message_size"]}, "policy": expected,
            }  # fmt: skip

            # the producer opened under the old limit, so only the broker can refuse this
            async def refused() -> bool:
                try:
                    await producer.send(b"x" * 2000)
                except MessageTooLargeError:
                    return True
                return False

            await eventually(refused, what="the broker refuses a payload above the new max_message_size")
            assert await producer.send(b"y" * 1024) >= 0
        async with client.producer("/limits/t", producer_name="late") as late:
            assert late.max_message_size_bytes == 1024

        (await admin(etcd_endpoints, [broker.address], "namespaces", "set-policy", "limits",
                     "--retention-size-mb", "7", "--retention-time-minutes", "0")).ok()  # fmt: skip
        assert await value(meta, key) == {**expected, "retention_size_mb": 7, "retention_time_minutes": 0}


async def test_set_policy_never_overwrites_a_concurrent_change(etcd_endpoints: list[str]) -> None:
    """The read-modify-write of ``set-policy`` compares the mod revision it read (or the
    key's absence) and writes nothing when another writer came in between."""

    class RacingStore(MetadataStore):
        """Another operator writes the policy right after every read."""

        writes = 0

        async def get(self, key: str) -> KeyValue | None:
            kv = await super().get(key)
            await self.put(key, {"max_message_size": 2048, "retention_size_mb": self.writes})
            self.writes += 1
            return kv

    async with await RacingStore.connect(etcd_endpoints) as store:
        for namespace, initial in (("absent", None), ("present", {"retention_time_minutes": 1})):
            key = keys.namespace_policy(namespace)
            if initial is not None:
                await MetadataStore.put(store, key, initial)
            with pytest.raises(click.ClickException) as caught:
                await update_namespace_policy(store, namespace, {"retention_time_minutes": 60})
            assert caught.value.exit_code == 1 and "changed while it was being updated" in caught.value.message
            assert await MetadataStore.get(store, key) is not None
            assert (await MetadataStore.get(store, key)).value == {  # type: ignore[union-attr]
                "max_message_size": 2048, "retention_size_mb": store.writes - 1
            }


async def test_unload_and_drain_move_topics_between_two_brokers(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    first, second = start_broker(), start_broker()
    addresses = [first.address, second.address]
    by_id = {first.broker_id: first, second.broker_id: second}
    topics = [f"/default/move-{i}" for i in range(4)]
    async with DanubeClient(addresses) as client, await MetadataStore.connect(etcd_endpoints) as meta:
        for topic in topics:
            await client.admin.create_topic(topic)
            async with client.producer(topic, producer_name="p") as producer:
                await producer.send(b"before")

        before = await client.lookup_topic(topics[0])
        moved = (await admin(etcd_endpoints, addresses, "topics", "unload", topics[0])).ok()
        other = second if before.broker_id == first.broker_id else first
        assert moved == {
            "topic": topics[0],
            "previous_owner": {"broker_id": before.broker_id, "address": before.address},
            "next_offset": 1,
            "owner": {"broker_id": other.broker_id, "address": other.address},
        }
        assert await owners(meta, topics[0]) == [other.broker_id]

        owned = {t: await owners(meta, t) for t in topics}
        victim_id = max(by_id, key=lambda b: sum(o == [b] for o in owned.values()))
        victim, survivor = by_id[victim_id], next(b for i, b in by_id.items() if i != victim_id)
        drained = (await admin(etcd_endpoints, addresses, "brokers", "drain", str(victim_id))).ok()
        assert drained == {
            "broker_id": victim_id,
            "address": victim.address,
            "released_topics": sorted(t for t, o in owned.items() if o == [victim_id]),
            "mode": "drained",
        }
        assert drained["released_topics"]
        assert (await value(meta, keys.broker_state(victim_id)))["mode"] == "drained"
        for topic in topics:

            async def on_survivor(topic: str = topic) -> bool:
                return await owners(meta, topic) == [survivor.broker_id]

            await eventually(on_survivor, what=f"{topic} moves to the broker left")
        for topic in topics:
            async with client.producer(topic, producer_name="after") as producer:
                assert await producer.send(b"after") == 1  # the next owner continues the offsets

        async def modes_shown() -> bool:
            listed = (await admin(etcd_endpoints, addresses, "brokers", "list")).ok()
            return {b["broker_id"]: b["mode"] for b in listed["brokers"]} == {
                victim_id: "drained", survivor.broker_id: "active"
            }

        await eventually(modes_shown, timeout_s=10, interval_s=0.2, what="brokers list shows the drained broker")


async def test_bad_arguments_exit_2_with_one_error_line(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    broker = start_broker()
    bad = [
        ("topics", "describe", "not-a-topic"),
        ("topics", "describe", "/default/bad name"),
        ("topics", "create", "/default/t", "--delivery", "Sometimes"),
        ("topics", "list", "--namespace", "a.b"),
        ("topics", "list", "ops", "--namespace", "other"),
        ("topics", "create", "/default/t", "--partitions", "0"),
        ("subscriptions", "list", "/default/x/y"),
        ("namespaces", "create", "bad/ns"),
        ("namespaces", "set-policy", "default", "--max-message-size", "-1"),
        ("namespaces", "set-policy", "default", "--retention-time-minutes", "abc"),
        ("namespaces", "set-policy", "default"),
        ("brokers", "drain", "12345"),
        ("brokers", "drain", "not an address"),
        ("brokers", "drain", "127.0.0.1:1"),
        ("topics", "frobnicate"),
    ]
    runs = await asyncio.gather(*(admin(etcd_endpoints, [broker.address], *args) for args in bad))
    runs.append(await admin(["nohost"], [broker.address], "namespaces", "list"))
    runs.append(await admin(etcd_endpoints, [broker.address], "brokers", "list", output="yaml"))
    for args, run in zip([*bad, ("--etcd-endpoints nohost",), ("--output yaml",)], runs, strict=True):
        assert run.code == 2, (args, run)
        assert run.out == "", (args, run)
        assert run.err.startswith("error: ") and run.err.count("\n") == 1, (args, run.err)
        assert "Traceback" not in run.err
    assert "unknown broker id '12345'" in runs[bad.index(("brokers", "drain", "12345"))].err
    assert "not in the range x>=0" in runs[bad.index(("namespaces", "set-policy", "default", "--max-message-size", "-1"))].err
    async with await MetadataStore.connect(etcd_endpoints) as meta:  # nothing was written
        assert await meta.get(keys.namespace_policy("default")) is None
        assert (await value(meta, keys.broker_state(broker.broker_id)))["mode"] == "active"


async def test_an_unknown_topic_exits_1(etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]) -> None:
    broker = start_broker()
    verbs = [("topics", "describe"), ("topics", "unload"), ("subscriptions", "list")]
    runs = await asyncio.gather(*(admin(etcd_endpoints, [broker.address], *v, "/default/missing") for v in verbs))
    for verb, run in zip(verbs, runs, strict=True):
        assert run.code == 1, (verb, run)
        assert run.err == "error: topic '/default/missing' not found\n", (verb, run.err)
        assert run.out == ""
