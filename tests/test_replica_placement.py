"""The leader's side of topic replication (``docs/etcd-layout.md`` §1.9, §2.1, §5.9): replica
sets written with the assignment, a failed owner's topic going to an in-sync replica, dead
replicas replaced, and policies whose ``min_insync_replicas`` exceeds ``replication_factor``
refused. Real etcd, real brokers.

Nothing here waits for the owner's side of replication: the ISR records the leader reads are
written by the test, straight to etcd, while their owner is frozen (SIGSTOP) and then killed.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest

from danube_pipeline.client import DanubeClient
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import InSyncReplicas, NamespacePolicy, ReplicaAssignment, merged_policy
from danube_pipeline.names import TopicName

from helpers import eventually, owners_of_all, run_admin, topic_owners

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

ARGS = ["--lease-ttl-s", "2", "--replica-replace-after-s", "3", "--no-rebalance"]


async def replicas_of(meta: MetadataStore, topic: str) -> list[int] | None:
    kv = await meta.get(keys.replica_assignment(TopicName.parse(topic)))
    return None if kv is None else ReplicaAssignment.from_json(kv.value).replicas


async def test_a_policy_with_more_insync_replicas_than_copies_is_refused(etcd_endpoints: list[str]) -> None:
    """``set-policy`` refuses ``min_insync_replicas`` > ``replication_factor`` (nothing written) and
    values below 1; a hand-written policy like that reads as the defaults, and a topic override
    that makes the merged policy inconsistent is ignored (§2.1, §3.8)."""
    refused = await run_admin("namespaces", "set-policy", "default", "--replication-factor", "2",
                              "--min-insync-replicas", "3", etcd=etcd_endpoints)
    assert refused.code == 1 and "min_insync_replicas (3) must not exceed replication_factor (2)" in refused.err
    assert (await run_admin("namespaces", "set-policy", "default", "--replication-factor", "0",
                            etcd=etcd_endpoints)).code == 2  # click: below the range
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        assert await meta.get(keys.namespace_policy("default")) is None
    done = (await run_admin("namespaces", "set-policy", "default", "--replication-factor", "3",
                            "--min-insync-replicas", "2", etcd=etcd_endpoints)).ok()
    assert done["changed"] == ["min_insync_replicas", "replication_factor"]
    lowered = await run_admin("namespaces", "set-policy", "default", "--replication-factor", "1", etcd=etcd_endpoints)
    assert lowered.code == 1 and "must not exceed" in lowered.err
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        stored = await meta.get(keys.namespace_policy("default"))
        assert stored is not None and isinstance(stored.value, dict)
        assert (stored.value["replication_factor"], stored.value["min_insync_replicas"]) == (3, 2)
    policy, problems = merged_policy({"replication_factor": 1, "min_insync_replicas": 2}, None)
    assert policy == NamespacePolicy() and "must not exceed" in problems[0]
    policy, problems = merged_policy({"replication_factor": "three"}, None)
    assert policy == NamespacePolicy() and problems
    policy, problems = merged_policy(stored.value, {"replication_factor": 1})
    assert (policy.replication_factor, policy.min_insync_replicas) == (3, 2) and "ignored" in problems[0]
    policy, problems = merged_policy(stored.value, {"replication_factor": 2, "min_insync_replicas": 1})
    assert (policy.replication_factor, policy.min_insync_replicas, problems) == (2, 1, [])
    assert "replication_factor" not in NamespacePolicy().to_json()  # the default JSON is Danube's


async def test_replicas_are_placed_failed_over_to_the_isr_and_replaced(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """Namespace ``default`` at replication factor 3 on three brokers X < Y < Z (ids):

    * each new topic gets a replica set of the three brokers, its owner included (§1.9); a topic
      of a namespace at factor 1 gets none;
    * X owns t1 and t4, Y owns t2 and /single/t, Z owns t3. With t1's ISR written as {X, Y} and
      t4's as {X}, X is killed: t1 goes to Y (the ISR member; without replication the fair
      choice would be Z, which has fewer topics), t4 to Z (no ISR member left: the
      unreplicated choice), and every set keeps X (back in time, it follows again);
    * a fourth broker W starts and replaces X in every set (``--replica-replace-after-s``).
    """
    brokers = [start_broker(extra_args=ARGS) for _ in range(3)]
    x, y, z = sorted(b.broker_id for b in brokers)
    by_id = {b.broker_id: b for b in brokers}
    (await run_admin("namespaces", "set-policy", "default", "--replication-factor", "3",
                     "--min-insync-replicas", "2", etcd=etcd_endpoints)).ok()
    topics = [f"/default/t{i}" for i in range(1, 5)]
    async with DanubeClient([b.address for b in brokers], metadata_retries=40, retry_backoff_ms=250) as client:
        for topic in topics:  # one at a time: fewest topics first, the lowest id on a tie
            await client.admin.create_topic(topic)
            async with await MetadataStore.connect(etcd_endpoints) as meta:
                await owners_of_all(meta, [topic])
        await client.admin.create_topic("/single/t")
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        owners = await owners_of_all(meta, [*topics, "/single/t"])
        assert [owners[t] for t in topics] == [x, y, z, x] and owners["/single/t"] == y
        for topic in topics:
            replicas = await replicas_of(meta, topic)
            assert replicas is not None and sorted(replicas) == [x, y, z] and owners[topic] in replicas
        assert await replicas_of(meta, "/single/t") is None  # factor 1: no replica key

        t1, t4 = TopicName.parse(topics[0]), TopicName.parse(topics[3])
        os.kill(by_id[x].pid, signal.SIGSTOP)  # frozen: it writes nothing more, its lease runs out
        for name, isr in ((t1, [x, y]), (t4, [x])):
            assigned = await meta.get(keys.topic_assignment(x, name))
            assert assigned is not None
            await meta.put(keys.in_sync_replicas(name), InSyncReplicas(
                owner=x, owner_epoch=assigned.create_revision, isr=isr, high_watermark=0))
        by_id[x].kill()

        async def failed_over() -> bool:
            now = await topic_owners(meta)
            return now.get(topics[0]) in (y, z) and now.get(topics[3]) in (y, z)

        await eventually(failed_over, timeout_s=30, interval_s=0.2, what="t1 and t4 failed over")
        now = await topic_owners(meta)
        assert now[topics[0]] == y, "t1 must go to its in-sync replica"
        assert now[topics[3]] == z, "t4 (no in-sync replica left) goes where an unreplicated topic would"
        for topic in topics:  # X keeps its place until it is replaced
            assert sorted(await replicas_of(meta, topic) or []) == [x, y, z]

        w = start_broker(extra_args=ARGS).broker_id

        async def replaced() -> bool:
            sets = [sorted(await replicas_of(meta, t) or []) for t in topics]
            return all(s == sorted([y, z, w]) for s in sets)

        await eventually(replaced, timeout_s=40, interval_s=0.5, what="X's copies replaced by W")
        assert (await topic_owners(meta))[topics[1]] == y  # re-replication moves copies, never the owner


async def test_unclean_replica_election_takes_a_replica_outside_the_isr(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """Replication factor 2 on brokers X < Y < Z with ``--unclean-replica-election``: t1 (owner X,
    replicas {X, Y}) has an ISR of X alone when X is killed. Y, the replica outside the ISR,
    takes it, although Z holds fewer topics (Z is where it goes without the flag), and the
    leader warns that acked messages may be lost (§1.9)."""
    brokers = [start_broker(extra_args=[*ARGS, "--unclean-replica-election"]) for _ in range(3)]
    x, y, z = sorted(b.broker_id for b in brokers)
    by_id = {b.broker_id: b for b in brokers}
    (await run_admin("namespaces", "set-policy", "default", "--replication-factor", "2", etcd=etcd_endpoints)).ok()
    async with DanubeClient([b.address for b in brokers], metadata_retries=40, retry_backoff_ms=250) as client:
        for topic in ("/default/t1", "/default/t2"):
            await client.admin.create_topic(topic)
    t1 = TopicName.parse("/default/t1")
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        owners = await owners_of_all(meta, ["/default/t1", "/default/t2"])
        assert (owners["/default/t1"], owners["/default/t2"]) == (x, y)
        assert sorted(await replicas_of(meta, "/default/t1") or []) == [x, y]
        os.kill(by_id[x].pid, signal.SIGSTOP)
        assigned = await meta.get(keys.topic_assignment(x, t1))
        assert assigned is not None
        await meta.put(keys.in_sync_replicas(t1), InSyncReplicas(
            owner=x, owner_epoch=assigned.create_revision, isr=[x], high_watermark=0))
        by_id[x].kill()

        async def failed_over() -> bool:
            return (await topic_owners(meta)).get("/default/t1") in (y, z)

        await eventually(failed_over, timeout_s=30, interval_s=0.2, what="t1 failed over")
        assert (await topic_owners(meta))["/default/t1"] == y
    logs = "".join(by_id[b].log_path.read_text(errors="replace") for b in (y, z))
    assert f"broker {y} (a replica outside the ISR) takes it; messages acked by the ISR may be lost" in logs


async def test_make_dev_with_three_brokers_replicates_the_default_namespace(etcd_endpoints: list[str]) -> None:
    """``make dev BROKERS=3`` sets ``default`` to replication factor 3, 2 in sync, through the
    ``set-policy`` path; ``BROKERS=1`` writes nothing (1 and 1 apply), unless a stack of three
    left 3 and 2: then it sets 1 and 1 again."""
    from danube_pipeline.dev.stack import dev_replication, set_dev_replication

    assert [dev_replication(n) for n in (1, 2, 3, 5)] == [(1, 1), (2, 1), (3, 2), (3, 2)]
    assert await set_dev_replication(etcd_endpoints, 1) is None
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        assert await meta.get(keys.namespace_policy("default")) is None
        assert await set_dev_replication(etcd_endpoints, 3) == {"replication_factor": 3, "min_insync_replicas": 2}
        stored = await meta.get(keys.namespace_policy("default"))
    assert stored is not None
    assert NamespacePolicy.from_json(stored.value) == NamespacePolicy(replication_factor=3, min_insync_replicas=2)
    assert await set_dev_replication(etcd_endpoints, 3) is None  # already so: nothing written
    # One broker after three: 1 and 1 again, or every producer would be refused.
    assert await set_dev_replication(etcd_endpoints, 1) == {"replication_factor": 1, "min_insync_replicas": 1}
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        stored = await meta.get(keys.namespace_policy("default"))
    assert stored is not None and NamespacePolicy.from_json(stored.value).replication_factor == 1
