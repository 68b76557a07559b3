"""``Admin.DeleteTopic`` and ``Admin.ResetCursor`` (``broker/topics/admin.py``), through the client
library, raw RPCs and ``danube-admin``, against real brokers and a real etcd; every effect is
checked in etcd (``docs/etcd-layout.md``), on disk and in object storage.

Both RPCs are left out of the fuzzing (``DISRUPTIVE_RPCS``): their bad input is tested here.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from danube_pipeline.client import DanubeClient, InitialPosition, SubscriptionType
from danube_pipeline.client._connection import ConnectionPool, Stubs
from danube_pipeline.client.status import rpc_errors
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline import faults
from danube_pipeline.errors import (
    BrokerUnavailableError,
    InvalidNameError,
    MalformedRequestError,
    NotServedHereError,
    OffsetOutOfRangeError,
    ProducerNotFoundError,
    SubscriptionNotFoundError,
    TopicInUseError,
    TopicNotFoundError,
)
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb

from helpers import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

ADMIN = Path(sys.executable).parent / "danube-admin"


async def topic_keys(meta: MetadataStore, name: TopicName) -> list[str]:
    """Every etcd key of ``name``: under its two prefixes, its root, §2.2, §1.4 and §1.5."""
    found: list[str] = []
    for prefix in (keys.topic_root(name) + "/", keys.storage_topic(name) + "/"):
        kvs, _ = await meta.get_prefix(prefix)
        found += [kv.key for kv in kvs]
    for key in (keys.topic_root(name), keys.namespace_topic(name), keys.unassigned_topic(name)):
        if await meta.get(key) is not None:
            found.append(key)
    assignments, _ = await meta.get_prefix(keys.BROKERS_PREFIX)
    found += [kv.key for kv in assignments if kv.key.endswith(f"/{name.namespace}/{name.topic}")]
    return sorted(found)


async def snapshot(meta: MetadataStore) -> dict[str, tuple[Any, int]]:
    """Every key under ``/topics/`` and ``/danube-data/`` with its value and mod revision."""
    out: dict[str, tuple[Any, int]] = {}
    for prefix in (keys.TOPICS + "/", keys.DANUBE_DATA + "/"):
        kvs, _ = await meta.get_prefix(prefix)
        out.update({kv.key: (kv.value, kv.mod_revision) for kv in kvs})
    return out


async def raw(stubs: Stubs, call: Callable[[Stubs], Any]) -> Any:
    """One RPC on raw stubs, its failure converted by the client's single mapping point."""
    with rpc_errors(stubs.address):
        return await call(stubs)


async def raw_consumer(stubs: Stubs, topic: str, subscription: str) -> Any:
    """A consumer subscribed with raw RPCs and its open ``Receive`` stream (which a forced
    deletion ends)."""
    response = await raw(stubs, lambda s: s.consumer.Subscribe(pb.SubscribeRequest(
        topic=topic, subscription=subscription, consumer_name="raw", request_id=uuid.uuid4().hex
    )))  # fmt: skip
    return stubs.consumer.Receive(pb.ReceiveRequest(consumer_id=response.consumer_id))


async def ended(call: Any) -> None:
    """Wait (at most 10 s) until the ``Receive`` stream ``call`` ends by itself."""

    async def drain() -> None:
        async for _ in call:
            pass

    await asyncio.wait_for(drain(), 10)


async def admin(etcd: Sequence[str], broker: str, *args: str) -> tuple[int, str, str]:
    """``danube-admin --output json ARGS`` as a subprocess: ``(exit code, stdout, stderr)``."""
    proc = await asyncio.create_subprocess_exec(
        str(ADMIN), "--etcd-endpoints", ",".join(etcd), "--brokers", broker, "--output", "json", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_delete_is_refused_in_use_then_forced_and_leaves_nothing_behind(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    objects_dir = tmp_path / "objects"
    broker = start_broker(extra_args=["--object-store-url", f"file://{objects_dir}"])
    name = TopicName.parse("/default/doomed")
    other = TopicName.parse("/default/doomed-not")  # shares the prefix without the slash
    wal_dir = broker.data_dir / "wal" / "default" / "doomed"
    released_dir = broker.data_dir / "released" / "default" / "doomed"
    pool = ConnectionPool()
    stubs = pool.stubs(broker.address)
    try:
        async with DanubeClient([broker.address]) as client, await MetadataStore.connect(etcd_endpoints) as meta:
            await client.admin.create_topic(other.path)
            async with client.producer(name.path, producer_name="p") as producer:
                assert [await producer.send(b"m%d" % i) for i in range(3)] == [0, 1, 2]
                # a connected producer: refused, nothing changes
                before = await snapshot(meta)
                with pytest.raises(TopicInUseError) as refused:
                    await client.admin.delete_topic(name.path)
                assert (refused.value.producers, refused.value.consumers) == (1, 0)
                assert "in use" in str(refused.value) and "force" in str(refused.value)
                assert await snapshot(meta) == before
                assert await producer.send(b"m3") == 3
            # the WAL moves to the released segments; the next owner (this broker) goes on at 4
            assert await client.admin.unload_topic(name.path) == 4
            assert released_dir.is_dir()
            # an object and its descriptor (§5.1), as the tiering assets would write them
            (objects_dir / "topics" / "default" / "doomed").mkdir(parents=True)
            (objects_dir / "topics" / "default" / "doomed" / "data-0-3.dnb1").write_bytes(b"x" * 10)
            (objects_dir / "topics" / "default" / "doomed" / "stray.bin").write_bytes(b"y")
            descriptor = values.ObjectDescriptor(
                completed=True, created_at=int(time.time()), end_offset=3, etag=None, object_id="data-0-3.dnb1",
                offset_index=[[0, 32]], size=10, start_offset=0,
            )  # fmt: skip
            await meta.put(keys.object_descriptor(name, 0), descriptor)
            await meta.put(keys.objects_cur(name), values.ObjectsCursor(start=keys.pad_offset(0)))
            await meta.put(keys.topic_local_retention(name), {"bytes": 1024})

            # raw clients, which do not subscribe again or re-create the topic by themselves
            stream = await raw_consumer(stubs, name.path, "audit")
            created = await raw(stubs, lambda s: s.producer.CreateProducer(
                pb.CreateProducerRequest(topic=name.path, producer_name="raw", request_id=uuid.uuid4().hex)
            ))  # fmt: skip
            with pytest.raises(TopicInUseError) as refused:
                await client.admin.delete_topic(name.path)
            assert (refused.value.producers, refused.value.consumers) == (1, 1)
            assert wal_dir.is_dir() and await topic_keys(meta, name)

            assert await client.admin.delete_topic(name.path, force=True) == [name.path]
            await ended(stream)  # the consumer's stream ended
            with pytest.raises(ProducerNotFoundError):  # the raw producer was closed
                await raw(stubs, lambda s: s.producer.CloseProducer(
                    pb.CloseProducerRequest(producer_id=created.producer_id)
                ))  # fmt: skip

            assert await topic_keys(meta, name) == []
            everything, _ = await meta.get_prefix("/")
            assert [kv.key for kv in everything if "/doomed/" in kv.key or kv.key.endswith("/doomed")] == []
            assert not wal_dir.exists() and not released_dir.exists()
            assert not (objects_dir / "topics" / "default" / "doomed").exists() or not any(
                (objects_dir / "topics" / "default" / "doomed").iterdir()
            )
            assert await topic_keys(meta, other) != []  # the neighbour is untouched
            with pytest.raises(TopicNotFoundError):
                await client.admin.delete_topic(name.path)

            # the name can be used again, from offset 0
            assert await client.admin.create_topic(name.path) is True
            async with client.producer(name.path, producer_name="again") as producer:
                assert await producer.send(b"new") == 0
            assert (await client.admin.describe_topic(name.path)).subscriptions == []
    finally:
        await pool.close()


async def test_reset_cursor_to_earliest_latest_an_offset_and_a_time(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    broker = start_broker(extra_args=["--subscription-idle-s", "1"])
    name = TopicName.parse("/default/replay")
    async with DanubeClient([broker.address]) as client, await MetadataStore.connect(etcd_endpoints) as meta:
        async with client.producer(name.path, producer_name="p") as producer:
            for i in range(3):
                await producer.send(b"m%d" % i)
            # time passes on both sides of the noted time, so it falls strictly between two messages
            await asyncio.sleep(0.05)
            middle_ms = time.time_ns() // 1_000_000
            await asyncio.sleep(0.05)
            for i in range(3, 5):
                await producer.send(b"m%d" % i)

            async with client.consumer(
                name.path, subscription="s", subscription_type=SubscriptionType.SHARED,
                initial_position=InitialPosition.EARLIEST,
            ) as consumer:  # fmt: skip

                async def take(n: int) -> list[int]:
                    got = []
                    for _ in range(n):
                        message = await consumer.receive(timeout_ms=10_000)
                        await consumer.ack(message)
                        got.append(message.offset)
                    return got

                async def live_cursor(expected: int) -> None:
                    async def reached() -> bool:
                        subs = (await client.admin.describe_topic(name.path)).subscriptions
                        return any(sub.name == "s" and sub.cursor == expected for sub in subs)

                    await eventually(reached, what=f"the acks reach the broker (cursor {expected})")

                async def stored_cursor() -> Any:
                    kv = await meta.get(keys.subscription_cursor(name, "s"))
                    return None if kv is None else kv.value

                assert await take(5) == [0, 1, 2, 3, 4]
                await live_cursor(4)

                # earliest: everything again, to the connected consumer (it subscribes again)
                assert await client.admin.reset_cursor(name.path, "s", earliest=True) == 0
                assert await stored_cursor() == -1  # offset 0: cursor -1 (§3.5)
                assert await take(5) == [0, 1, 2, 3, 4]
                await live_cursor(4)

                # latest: only what is published from now on
                assert await client.admin.reset_cursor(name.path, "s", latest=True) == 5
                assert await stored_cursor() == 4
                await producer.send(b"m5")
                assert await take(1) == [5]
                await live_cursor(5)

                # an offset
                assert await client.admin.reset_cursor(name.path, "s", offset=2) == 2
                assert await stored_cursor() == 1
                assert await take(4) == [2, 3, 4, 5]
                await live_cursor(5)

                # a time: the first message published at or after it
                assert await client.admin.reset_cursor(name.path, "s", timestamp_ms=middle_ms) == 3
                assert await take(3) == [3, 4, 5]
                await live_cursor(5)
                assert await client.admin.reset_cursor(name.path, "s", timestamp_ms=1) == 0  # before all: earliest
                assert await take(6) == [0, 1, 2, 3, 4, 5]
                await live_cursor(5)
                future_ms = time.time_ns() // 1_000_000 + 3_600_000
                assert await client.admin.reset_cursor(name.path, "s", timestamp_ms=future_ms) == 6  # after all
                await producer.send(b"m6")
                assert await take(1) == [6]  # (and the consumer subscribed again before it closes)

        # a subscription that is not loaded (without consumers, it is unloaded after 1 s)
        async def unloaded() -> bool:
            return not (await client.admin.describe_topic(name.path)).subscriptions

        await eventually(unloaded, what="the idle subscription is unloaded")
        assert await client.admin.reset_cursor(name.path, "s", offset=4) == 4
        assert await stored_cursor() == 3
        async with client.consumer(name.path, subscription="s", subscription_type=SubscriptionType.SHARED) as consumer:
            assert [(await consumer.receive(timeout_ms=10_000)).offset for _ in range(3)] == [4, 5, 6]


async def test_bad_input_is_refused_with_a_clear_error_and_changes_nothing(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    broker = start_broker()
    name = TopicName.parse("/default/kept")
    pool = ConnectionPool()
    stubs = pool.stubs(broker.address)
    try:
        async with DanubeClient([broker.address]) as client, await MetadataStore.connect(etcd_endpoints) as meta:
            async with client.producer(name.path, producer_name="p") as producer:
                for i in range(3):
                    await producer.send(b"m%d" % i)
            async with client.consumer(name.path, subscription="s", initial_position=InitialPosition.EARLIEST) as c:
                await c.ack(await c.receive(timeout_ms=10_000))
            before = await snapshot(meta)
            described = await client.admin.describe_topic(name.path)

            # the client checks before sending
            for kwargs in ({}, {"earliest": True, "latest": True}, {"offset": 1, "timestamp_ms": 5}, {"offset": -1}):
                with pytest.raises(MalformedRequestError):
                    await client.admin.reset_cursor(name.path, "s", **kwargs)
            for bad_topic in ("/default/bad name", "no-slash", "/a/b/c"):
                with pytest.raises(InvalidNameError):
                    await client.admin.delete_topic(bad_topic)
                with pytest.raises(InvalidNameError):
                    await client.admin.reset_cursor(bad_topic, "s", earliest=True)
            with pytest.raises(InvalidNameError):
                await client.admin.reset_cursor(name.path, "bad/sub", earliest=True)

            # the broker refuses
            with pytest.raises(TopicNotFoundError):
                await client.admin.delete_topic("/default/missing")
            with pytest.raises(TopicNotFoundError):
                await client.admin.reset_cursor("/default/missing", "s", earliest=True)
            with pytest.raises(SubscriptionNotFoundError) as missing:
                await client.admin.reset_cursor(name.path, "nobody", earliest=True)
            assert (missing.value.topic, missing.value.subscription) == (name.path, "nobody")
            with pytest.raises(OffsetOutOfRangeError) as beyond:
                await client.admin.reset_cursor(name.path, "s", offset=4)
            assert (beyond.value.offset, beyond.value.earliest_offset, beyond.value.next_offset) == (4, 0, 3)

            # raw requests: what the client never sends
            def reset(**fields: Any) -> Callable[[Stubs], Any]:
                return lambda s: s.admin.ResetCursor(pb.ResetCursorRequest(**fields))

            for fields in (
                {"topic": name.path, "subscription": "s"},  # no position
                {"topic": name.path, "subscription": "s", "earliest": False},
                {"topic": name.path, "subscription": "s", "latest": False},
            ):
                with pytest.raises(MalformedRequestError):
                    await raw(stubs, reset(**fields))
            for fields in (
                {"topic": "/default/bad name", "subscription": "s", "earliest": True},
                {"topic": name.path, "subscription": "", "earliest": True},
                {"topic": name.path, "subscription": "x" * 200, "latest": True},
            ):
                with pytest.raises(InvalidNameError):
                    await raw(stubs, reset(**fields))
            with pytest.raises(OffsetOutOfRangeError):
                await raw(stubs, reset(topic=name.path, subscription="s", offset=2**64 - 1))
            def delete(topic: str) -> Callable[[Stubs], Any]:
                return lambda s: s.admin.DeleteTopic(pb.DeleteTopicRequest(topic=topic))

            for topic in ("", "/default/bad name", "x" * 300):
                with pytest.raises(InvalidNameError):
                    await raw(stubs, delete(topic))

            assert await snapshot(meta) == before
            after = await client.admin.describe_topic(name.path)
            assert (after.next_offset, after.subscriptions) == (described.next_offset, described.subscriptions)
    finally:
        await pool.close()


async def test_danube_admin_delete_and_reset_cursor(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    broker = start_broker()
    name = TopicName.parse("/ops/cli")

    async def run(*args: str) -> tuple[int, str, str]:
        return await admin(etcd_endpoints, broker.address, *args)

    async with DanubeClient([broker.address]) as client, await MetadataStore.connect(etcd_endpoints) as meta:
        async with client.producer(name.path, producer_name="p") as producer:
            for i in range(4):
                await producer.send(b"m%d" % i)
            async with client.consumer(name.path, subscription="s", initial_position=InitialPosition.EARLIEST) as c:
                await c.ack(await c.receive(timeout_ms=10_000))

            code, out, err = await run("subscriptions", "reset-cursor", name.path, "s", "--offset", "2")
            assert (code, err) == (0, "") and json.loads(out) == {
                "topic": name.path, "subscription": "s", "position": {"offset": 2}, "next_offset": 2
            }
            assert (await meta.get(keys.subscription_cursor(name, "s"))).value == 1  # type: ignore[union-attr]
            code, out, _ = await run("subscriptions", "reset-cursor", name.path, "s", "--latest")
            assert json.loads(out)["next_offset"] == 4 and code == 0
            code, out, _ = await run("subscriptions", "reset-cursor", name.path, "s", "--timestamp", "1970-01-01T00:00:01Z")
            assert code == 0 and json.loads(out)["position"] == {"timestamp_ms": 1000} and json.loads(out)["next_offset"] == 0
            code, out, _ = await run("subscriptions", "reset-cursor", name.path, "s", "--earliest")
            assert code == 0 and json.loads(out)["position"] == {"earliest": True}

            usage = [
                ("subscriptions", "reset-cursor", name.path, "s"),
                ("subscriptions", "reset-cursor", name.path, "s", "--earliest", "--latest"),
                ("subscriptions", "reset-cursor", name.path, "s", "--offset", "1", "--timestamp", "5"),
                ("subscriptions", "reset-cursor", name.path, "s", "--offset", "-1"),
                ("subscriptions", "reset-cursor", name.path, "s", "--timestamp", "yesterday"),
                ("subscriptions", "reset-cursor", name.path, "bad/sub", "--latest"),
                ("subscriptions", "reset-cursor", "/ops/bad name", "s", "--latest"),
                ("topics", "delete", "not-a-topic"),
            ]
            refused = [
                (("subscriptions", "reset-cursor", name.path, "s", "--offset", "99"), "out of range"),
                (("subscriptions", "reset-cursor", name.path, "nobody", "--latest"), "has no subscription 'nobody'"),
                (("topics", "delete", name.path), "in use (1 producer(s), 0 consumer(s) connected)"),
                (("topics", "delete", "/ops/missing"), "topic '/ops/missing' not found"),
            ]
            before = await snapshot(meta)
            runs = await asyncio.gather(*(run(*args) for args in usage), *(run(*args) for args, _ in refused))
            for args, (code, out, err) in zip(usage, runs[: len(usage)], strict=True):
                assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, (args, err)
            assert "exactly one of --offset, --earliest, --latest, --timestamp" in runs[1][2]
            for (args, text), (code, out, err) in zip(refused, runs[len(usage) :], strict=True):
                assert code == 1 and out == "" and err.startswith("error: ") and text in err, (args, err)
            assert await snapshot(meta) == before

        code, out, err = await run("topics", "delete", name.path)
        assert (code, err) == (0, "") and json.loads(out) == {"topic": name.path, "force": False, "deleted": [name.path]}
        assert await topic_keys(meta, name) == []
        await client.admin.create_topic(name.path)
        pool = ConnectionPool()
        try:
            stream = await raw_consumer(pool.stubs(broker.address), name.path, "s")
            code, out, err = await run("topics", "delete", name.path, "--force")
            await ended(stream)
        finally:
            await pool.close()
        assert code == 0 and json.loads(out)["deleted"] == [name.path]
        assert await topic_keys(meta, name) == []


async def test_deleting_a_partitioned_topic_deletes_every_partition_through_its_owner(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    first, second = start_broker(), start_broker()
    name = TopicName.parse("/default/parts")
    partitions = [TopicName.parse(f"/default/parts-part-{i}") for i in range(4)]
    async with DanubeClient([first.address]) as client, await MetadataStore.connect(etcd_endpoints) as meta:
        assert await client.admin.create_topic(name.path, partitions=4) is True
        owners = {(await client.lookup_topic(p.path)).broker_id for p in partitions}
        assert owners == {first.broker_id, second.broker_id}  # forwarded to the other broker too
        for p in partitions:
            async with client.producer(p.path, producer_name="p") as producer:
                await producer.send(b"x")
        assert sorted(await client.admin.delete_topic(name.path)) == sorted(p.path for p in partitions)
        for topic in (name, *partitions):
            assert await topic_keys(meta, topic) == [], topic
        for broker in (first, second):
            assert not any((broker.data_dir / "wal" / "default").glob("parts*"))
        with pytest.raises(TopicNotFoundError):
            await client.admin.delete_topic(name.path)


async def test_a_retried_create_topic_whose_answer_was_lost_answers_created(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """A ``CreateTopic`` applied in etcd whose answer never came back (the broker died right
    after the write: fault point ``topic.after_create``), retried with the same request id on
    another broker, answers ``created = true``; another request id still answers ``false``."""
    survivor = start_broker()
    async with await MetadataStore.connect(etcd_endpoints) as meta:

        async def survivor_leads() -> bool:
            leader = await meta.get(keys.CLUSTER_LEADER)
            return leader is not None and leader.value == survivor.broker_id

        await eventually(survivor_leads, timeout_s=15, what="the first broker is the leader")
        doomed = start_broker(env=faults.environment({faults.TOPIC_AFTER_CREATE: faults.SIGKILL}))
        name = TopicName("default", f"lost-answer-{uuid.uuid4().hex[:8]}")
        request = pb.CreateTopicRequest(topic=name.path, request_id=uuid.uuid4().hex)
        pool = ConnectionPool()
        try:
            with pytest.raises(BrokerUnavailableError):  # killed after the write, before answering
                await raw(pool.stubs(doomed.address), lambda s: s.admin.CreateTopic(request, timeout=10))
            assert (await meta.get(keys.topic_root(name))) is not None  # the first attempt was applied
            retried = await raw(pool.stubs(survivor.address), lambda s: s.admin.CreateTopic(request, timeout=15))
            assert retried.created
            other = pb.CreateTopicRequest(topic=name.path, request_id=uuid.uuid4().hex)
            try:
                answer = await raw(pool.stubs(survivor.address), lambda s: s.admin.CreateTopic(other, timeout=15))
                assert not answer.created
            except NotServedHereError:  # it exists, assigned to the dead broker: not created either
                pass
        finally:
            await pool.close()


async def test_create_topic_retried_on_another_broker_answers_created_plain_and_partitioned(
    start_broker: Callable[..., BrokerProcess]
) -> None:
    """The same ``CreateTopic`` (same request id) answered by one broker, then sent again to
    another (the client's retry after a lost answer goes to the next broker): ``created`` both
    times, for a plain and for a partitioned topic; a new request id answers ``false``."""
    first, second = start_broker(), start_broker()
    pool = ConnectionPool()
    try:
        for topic, partitions in (("/default/retried-plain", 0), ("/default/retried-parts", 2)):
            request = pb.CreateTopicRequest(topic=topic, request_id=uuid.uuid4().hex, partitions=partitions)
            assert (await raw(pool.stubs(first.address), lambda s: s.admin.CreateTopic(request, timeout=15))).created
            assert (await raw(pool.stubs(second.address), lambda s: s.admin.CreateTopic(request, timeout=15))).created
            other = pb.CreateTopicRequest(topic=topic, request_id=uuid.uuid4().hex, partitions=partitions)
            try:
                answer = await raw(pool.stubs(second.address), lambda s: s.admin.CreateTopic(other, timeout=15))
                assert not answer.created
            except NotServedHereError:  # the plain topic is the first broker's: not created either
                pass
    finally:
        await pool.close()
