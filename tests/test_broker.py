"""Integration tests of the broker process (``python -m broker``) against a real etcd.

The broker is driven through the raw generated gRPC stubs.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fastavro
import grpc
import io
import pytest

from helpers import eventually_sync, stays_sync

from danube_pipeline.format.batches import BatchBuilder
from danube_pipeline.format.records import crc32c
from danube_pipeline.client.types import Message, _messages_from_delivery
from danube_pipeline.error_codec import ERROR_CLASS_METADATA_KEY
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc
from danube_pipeline.format.segments import decode_segment

pytestmark = pytest.mark.integration


class Stubs:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        )
        self.producer = pb_grpc.ProducerServiceStub(self.channel)
        self.consumer = pb_grpc.ConsumerServiceStub(self.channel)
        self.discovery = pb_grpc.DiscoveryStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)
        self.schemas = pb_grpc.SchemaRegistryStub(self.channel)

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def broker(start_broker: Callable[..., BrokerProcess]) -> BrokerProcess:
    return start_broker()


@pytest.fixture
def stubs(broker: BrokerProcess) -> Iterator[Stubs]:
    s = Stubs(broker.address)
    yield s
    s.close()


def etcd_get(endpoints: list[str], key: str) -> Any:
    async def go() -> Any:
        store = await MetadataStore.connect(endpoints)
        try:
            kv = await store.get(key)
            return None if kv is None else kv.value
        finally:
            await store.close()

    return asyncio.run(go())


def etcd_put(endpoints: list[str], key: str, value: Any) -> None:
    async def go() -> None:
        store = await MetadataStore.connect(endpoints)
        try:
            await store.put(key, value)
        finally:
            await store.close()

    asyncio.run(go())


def batch_request(
    pid: int, *payloads: bytes, name: str = "prod", schema_id: int = 0, schema_version: int = 0, sequence_id: int = 0
) -> pb.SendBatchRequest:
    """A ``SendBatchRequest`` carrying ``payloads`` as one record batch of producer ``pid``."""
    builder = BatchBuilder(time.time_ns() // 1000)
    for payload in payloads:
        builder.append(payload, timestamp_us=builder.first_timestamp_us, attributes={"k": "v"})
    batch = builder.build(producer_id=pid, producer_name=name, schema_id=schema_id, schema_version=schema_version)
    return pb.SendBatchRequest(producer_id=pid, batch=batch, sequence_id=sequence_id)


def create_producer(stubs: Stubs, topic: str, name: str = "prod", **kw: Any) -> int:
    return int(stubs.producer.CreateProducer(pb.CreateProducerRequest(topic=topic, producer_name=name, **kw)).producer_id)


def next_offset(stubs: Stubs, topic: str) -> int:
    for info in stubs.admin.ListTopics(pb.ListTopicsRequest()).topics:
        if info.topic == topic:
            return int(info.next_offset)
    raise AssertionError(f"{topic} not listed")


class Collector:
    """Reads a consumer's Receive stream in a thread."""

    def __init__(self, stubs: Stubs, consumer_id: int) -> None:
        self.call = stubs.consumer.Receive(pb.ReceiveRequest(consumer_id=consumer_id))
        self.messages: list[Message] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for batch in self.call:
                with self.lock:
                    for delivery in batch.batches:
                        self.messages.extend(_messages_from_delivery("/test", delivery))
        except grpc.RpcError:
            pass

    def wait_for(self, n: int, timeout_s: float = 10.0) -> list[Message]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.messages) >= n:
                    return list(self.messages)
            time.sleep(0.02)
        with self.lock:
            raise AssertionError(f"got {len(self.messages)} messages, expected {n}")

    def snapshot(self) -> list[Message]:
        with self.lock:
            return list(self.messages)

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(5)


def subscribe(stubs: Stubs, topic: str, sub: str, sub_type: pb.SubscriptionType = pb.EXCLUSIVE, **kw: Any) -> int:
    kw.setdefault("initial_position", pb.EARLIEST)
    return int(stubs.consumer.Subscribe(
        pb.SubscribeRequest(topic=topic, subscription=sub, subscription_type=sub_type, consumer_name="c", **kw)
    ).consumer_id)


def error_class(err: grpc.RpcError) -> str | None:
    return dict(err.trailing_metadata() or ()).get(ERROR_CLASS_METADATA_KEY)


# ---------------------------------------------------------------------------- producing


def test_create_producer_and_send_batch(stubs: Stubs, broker: BrokerProcess, etcd_endpoints: list[str]) -> None:
    topic = "/default/orders"
    pid = create_producer(stubs, topic, "p1")
    r = stubs.producer.SendBatch(batch_request(pid, b"a", b"b", b"c", name="p1", sequence_id=9))
    assert (r.first_offset, r.last_offset, r.sequence_id) == (0, 2, 9)
    r = stubs.producer.SendBatch(batch_request(pid, b"d", b"e", name="p1"))
    assert (r.first_offset, r.last_offset) == (3, 4)
    assert stubs.producer.SendBatch(batch_request(pid, b"f", name="p1")).first_offset == 5
    assert next_offset(stubs, topic) == 6

    name = TopicName.parse(topic)
    assert etcd_get(etcd_endpoints, keys.topic_root(name)) == 0
    assert etcd_get(etcd_endpoints, keys.topic_delivery(name)) == "Reliable"
    assert etcd_get(etcd_endpoints, keys.topic_assignment(broker.broker_id, name)) is None
    meta = etcd_get(etcd_endpoints, keys.topic_producer(name, pid))
    assert meta == {"access_mode": 0, "producer_id": pid, "producer_name": "p1", "status": True, "topic_name": topic}

    stubs.producer.CloseProducer(pb.CloseProducerRequest(producer_id=pid))
    assert etcd_get(etcd_endpoints, keys.topic_producer(name, pid))["status"] is False
    with pytest.raises(grpc.RpcError) as exc:
        stubs.producer.SendBatch(batch_request(pid, b"g", name="p1"))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_class(exc.value) == "ProducerNotFoundError"


def test_send_stream_answers_in_order(stubs: Stubs) -> None:
    pid = create_producer(stubs, "/default/stream")
    requests = [
        batch_request(pid, *[b"x"] * (i % 3 + 1), sequence_id=100 + i)
        for i in range(50)
    ]
    responses = list(stubs.producer.SendStream(iter(requests)))
    assert [r.sequence_id for r in responses] == [100 + i for i in range(50)]
    expected_first = 0
    for i, r in enumerate(responses):
        assert r.first_offset == expected_first
        assert r.last_offset == expected_first + i % 3
        expected_first = r.last_offset + 1


def _corrupt(batch: bytes, how: str) -> bytes:
    """``batch`` broken in one way a client (or the network) could break it."""
    data = bytearray(batch)
    if how == "bad CRC":
        data[-1] ^= 0xFF  # a payload byte: the CRC no longer matches
    elif how == "truncated record":
        data = data[:-3]
        data[8:12] = (len(data) - 12).to_bytes(4, "little")  # batch_length agrees, the record is short
        data[12:16] = crc32c(bytes(data[16:])).to_bytes(4, "little")
    elif how == "record length past the batch":
        first_record = 60 + 4  # header + the producer name "prod"
        data[first_record : first_record + 4] = (10**6).to_bytes(4, "little")
        data[12:16] = crc32c(bytes(data[16:])).to_bytes(4, "little")
    elif how == "trailing bytes":
        data += b"\x00" * 5
        data[8:12] = (len(data) - 12).to_bytes(4, "little")
        data[12:16] = crc32c(bytes(data[16:])).to_bytes(4, "little")
    elif how == "wrong magic":
        data[16] = 1
    elif how == "batch_length past the data":
        data[8:12] = (len(data) + 100).to_bytes(4, "little")
    return bytes(data)


@pytest.mark.parametrize(
    "how",
    ["bad CRC", "truncated record", "record length past the batch", "trailing bytes", "wrong magic", "batch_length past the data"],
)
def test_malformed_batch_is_refused_and_nothing_is_written(stubs: Stubs, how: str) -> None:
    topic = "/default/malformed"
    pid = create_producer(stubs, topic)
    assert stubs.producer.SendBatch(batch_request(pid, b"before")).first_offset == 0
    good = batch_request(pid, b"a", b"bb", b"ccc")
    with pytest.raises(grpc.RpcError) as exc:
        stubs.producer.SendBatch(pb.SendBatchRequest(producer_id=pid, batch=_corrupt(good.batch, how)))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_class(exc.value) == "MalformedRequestError"
    assert "record batch" in (exc.value.details() or "")
    assert next_offset(stubs, topic) == 1
    assert stubs.producer.SendBatch(good).first_offset == 1  # the producer goes on


def test_batch_must_carry_its_producers_identity(stubs: Stubs) -> None:
    """The header's producer id, name and schema are stored as the records' producer: a batch
    claiming another producer, name or schema is refused."""
    topic = "/default/identity"
    pid = create_producer(stubs, topic)
    other = create_producer(stubs, topic, "other")
    for request in (
        pb.SendBatchRequest(producer_id=pid, batch=batch_request(other, b"x", name="other").batch),
        batch_request(pid, b"x", name="not-prod"),
        batch_request(pid, b"x", schema_id=5, schema_version=1),
    ):
        with pytest.raises(grpc.RpcError) as exc:
            stubs.producer.SendBatch(request)
        assert error_class(exc.value) == "MalformedRequestError"
    assert next_offset(stubs, topic) == 0


def test_batch_over_the_brokers_limit_is_refused(start_broker: Callable[..., BrokerProcess]) -> None:
    broker = start_broker(extra_args=["--max-batch-bytes", "4096"])
    stubs = Stubs(broker.address)
    try:
        pid = create_producer(stubs, "/default/bigbatch")
        reply = stubs.producer.CreateProducer(pb.CreateProducerRequest(topic="/default/bigbatch", producer_name="p2"))
        assert reply.max_batch_bytes == 4096
        with pytest.raises(grpc.RpcError) as exc:
            stubs.producer.SendBatch(batch_request(pid, *[b"z" * 100] * 50))
        assert error_class(exc.value) == "MalformedRequestError" and "max_batch_bytes" in (exc.value.details() or "")
        assert next_offset(stubs, "/default/bigbatch") == 0
        assert stubs.producer.SendBatch(batch_request(pid, *[b"z" * 100] * 10)).last_offset == 9
    finally:
        stubs.close()


def test_oversized_message_rejected_and_nothing_appended(stubs: Stubs, etcd_endpoints: list[str]) -> None:
    etcd_put(etcd_endpoints, keys.namespace_policy("small"), {"max_message_size": 1000})
    topic = "/small/t"
    pid = create_producer(stubs, topic)
    assert stubs.producer.CreateProducer(pb.CreateProducerRequest(topic=topic, producer_name="p2")).max_message_size_bytes == 1000
    # creating the namespace's first topic kept the operator's policy (written just before,
    # possibly not yet in the broker's cache) instead of replacing it with the defaults
    assert etcd_get(etcd_endpoints, keys.namespace_policy("small"))["max_message_size"] == 1000
    stubs.producer.SendBatch(batch_request(pid, b"ok"))
    before = next_offset(stubs, topic)
    with pytest.raises(grpc.RpcError) as exc:
        stubs.producer.SendBatch(batch_request(pid, b"fine", b"y" * 1001))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_class(exc.value) == "MessageTooLargeError"
    assert next_offset(stubs, topic) == before
    r = stubs.producer.SendBatch(batch_request(pid, b"z" * 1000))
    assert r.first_offset == before


def test_schema_mismatch_rejected(stubs: Stubs) -> None:
    schema = {"type": "record", "name": "Flight", "fields": [{"name": "id", "type": "long"}, {"name": "origin", "type": "string"}]}
    reg = stubs.schemas.RegisterSchema(pb.RegisterSchemaRequest(subject="flights", raw_schema=json.dumps(schema)))
    assert reg.schema_id > 0 and reg.version == 1
    got = stubs.schemas.GetSchema(pb.GetSchemaRequest(schema_id=reg.schema_id))
    assert got.subject == "flights" and json.loads(got.raw_schema) == schema
    pid = create_producer(stubs, "/default/flights", schema=pb.SchemaReference(schema_id=reg.schema_id))
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), {"id": 7, "origin": "JFK"})
    good = buf.getvalue()
    r = stubs.producer.SendBatch(batch_request(pid, good, schema_id=reg.schema_id, schema_version=1))
    assert r.first_offset == 0
    for bad in (good + b"\x00", b"\xff"):
        with pytest.raises(grpc.RpcError) as exc:
            stubs.producer.SendBatch(batch_request(pid, good, bad, schema_id=reg.schema_id, schema_version=1))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_class(exc.value) == "SchemaMismatchError"
    assert next_offset(stubs, "/default/flights") == 1
    sub = subscribe(stubs, "/default/flights", "s")
    c = Collector(stubs, sub)
    try:
        (m,) = c.wait_for(1)
        assert (m.schema_id, m.schema_version) == (reg.schema_id, 1)
    finally:
        c.close()


# ---------------------------------------------------------------------------- consuming


def test_subscribe_receive_ack_writes_cursor(stubs: Stubs, etcd_endpoints: list[str]) -> None:
    topic = "/default/acks"
    pid = create_producer(stubs, topic)
    payloads = [f"m{i}".encode() for i in range(5)]
    stubs.producer.SendBatch(batch_request(pid, *payloads))
    cid = subscribe(stubs, topic, "sub1")
    c = Collector(stubs, cid)
    try:
        got = c.wait_for(5)
        assert [m.offset for m in got] == [0, 1, 2, 3, 4]
        assert [m.payload for m in got] == payloads
        assert got[0].attributes == {"k": "v"} and got[0].producer_id == pid and got[0].publish_time_us > 0
        stubs.consumer.Ack(pb.AckRequest(consumer_id=cid, offsets=[0, 1, 3, 4]))
    finally:
        c.close()
    stubs.consumer.CloseConsumer(pb.CloseConsumerRequest(consumer_id=cid))
    name = TopicName.parse(topic)
    # offset 2 is not acked: the cursor stops below it
    assert etcd_get(etcd_endpoints, keys.subscription_cursor(name, "sub1")) == 1
    meta = etcd_get(etcd_endpoints, keys.topic_subscription(name, "sub1"))
    assert meta["subscription_name"] == "sub1" and meta["subscription_type"] == 0

    # a new consumer of the same subscription gets offset 2 again (redelivered), then acks it
    cid2 = subscribe(stubs, topic, "sub1")
    c2 = Collector(stubs, cid2)
    try:
        (m,) = c2.wait_for(1)
        assert m.offset == 2 and m.redelivery_count == 1
        stubs.consumer.Ack(pb.AckRequest(consumer_id=cid2, offsets=[2]))
    finally:
        c2.close()
    stubs.consumer.CloseConsumer(pb.CloseConsumerRequest(consumer_id=cid2))
    assert etcd_get(etcd_endpoints, keys.subscription_cursor(name, "sub1")) == 4


def test_acked_message_survives_sigkill(start_broker: Callable[..., BrokerProcess], tmp_path: Path) -> None:
    data_dir = tmp_path / "durable"
    broker = start_broker(data_dir=data_dir)
    stubs = Stubs(broker.address)
    topic = "/default/durable"
    pid = create_producer(stubs, topic)
    payloads = [f"durable-{i}".encode() for i in range(20)]
    r = stubs.producer.SendBatch(batch_request(pid, *payloads))
    assert (r.first_offset, r.last_offset) == (0, 19)
    stubs.close()
    broker_id = broker.broker_id
    broker.kill()

    broker = start_broker(data_dir=data_dir)
    assert broker.broker_id == broker_id
    stubs = Stubs(broker.address)
    try:
        cid = subscribe(stubs, topic, "after-restart")
        c = Collector(stubs, cid)
        try:
            got = c.wait_for(20)
            assert [m.payload for m in got] == payloads
        finally:
            c.close()
        pid = create_producer(stubs, topic)
        r = stubs.producer.SendBatch(batch_request(pid, b"next"))
        assert r.first_offset == 20
    finally:
        stubs.close()


def test_producer_keys_closed_after_a_crash_and_on_stop(
    start_broker: Callable[..., BrokerProcess], tmp_path: Path, etcd_endpoints: list[str]
) -> None:
    data_dir = tmp_path / "producers"
    topic = "/default/producer_status"
    name = TopicName.parse(topic)
    broker = start_broker(data_dir=data_dir)
    stubs = Stubs(broker.address)
    first = create_producer(stubs, topic, name="before-crash")
    stubs.close()
    assert etcd_get(etcd_endpoints, keys.topic_producer(name, first))["status"] is True
    broker.kill()  # no chance to close its producers

    broker = start_broker(data_dir=data_dir)
    stubs = Stubs(broker.address)
    try:
        second = create_producer(stubs, topic, name="after-crash")  # the topic is loaded by now
    finally:
        stubs.close()
    # the restarted broker fenced the producer its earlier run left open
    assert etcd_get(etcd_endpoints, keys.topic_producer(name, first))["status"] is False
    assert etcd_get(etcd_endpoints, keys.topic_producer(name, second))["status"] is True
    broker.stop()  # graceful: its open producers are marked closed
    assert etcd_get(etcd_endpoints, keys.topic_producer(name, second))["status"] is False


def test_exclusive_second_consumer_rejected(stubs: Stubs) -> None:
    create_producer(stubs, "/default/excl")
    subscribe(stubs, "/default/excl", "only")
    with pytest.raises(grpc.RpcError) as exc:
        subscribe(stubs, "/default/excl", "only")
    assert exc.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert error_class(exc.value) == "SubscriptionBusyError"
    subscribe(stubs, "/default/excl", "other")  # another subscription is fine


def test_shared_consumers_split_batches(stubs: Stubs) -> None:
    """Shared dispatch hands out whole batches, round-robin, while a consumer has room in its
    window: 20 one-message batches split 10/10 over two windows of 10."""
    topic = "/default/shared"
    pid = create_producer(stubs, topic)
    a = subscribe(stubs, topic, "work", pb.SHARED, receiver_queue_size=10)
    b = subscribe(stubs, topic, "work", pb.SHARED, receiver_queue_size=10)
    ca, cb = Collector(stubs, a), Collector(stubs, b)
    try:
        for _ in range(20):
            stubs.producer.SendBatch(batch_request(pid, b"w"))
        got_a, got_b = ca.wait_for(10), cb.wait_for(10)
        # nobody acked, so each holds exactly its receiver_queue_size
        stays_sync(lambda: len(ca.snapshot()) == 10 and len(cb.snapshot()) == 10, for_s=0.2, what="windows full")
        offsets_a = {m.offset for m in got_a}
        offsets_b = {m.offset for m in got_b}
        assert offsets_a.isdisjoint(offsets_b)
        assert offsets_a | offsets_b == set(range(20))
        # acks free permits: the next batches flow again to both
        stubs.consumer.Ack(pb.AckRequest(consumer_id=a, offsets=sorted(offsets_a)))
        stubs.consumer.Ack(pb.AckRequest(consumer_id=b, offsets=sorted(offsets_b)))
        for _ in range(4):
            stubs.producer.SendBatch(batch_request(pid, b"w"))
        more_a, more_b = ca.wait_for(12), cb.wait_for(12)
        assert {m.offset for m in more_a[10:]} | {m.offset for m in more_b[10:]} == {20, 21, 22, 23}
        # one batch of 6 goes to one consumer whole, even past its window
        stubs.consumer.Ack(pb.AckRequest(consumer_id=a, offsets=[m.offset for m in more_a[10:]]))
        stubs.consumer.Ack(pb.AckRequest(consumer_id=b, offsets=[m.offset for m in more_b[10:]]))
        stubs.producer.SendBatch(batch_request(pid, *[b"v"] * 6))
        eventually_sync(lambda: len(ca.snapshot()) + len(cb.snapshot()) == 30, what="the batch of 6 delivered")
        whole = ca.snapshot()[12:] or cb.snapshot()[12:]
        assert [m.offset for m in whole] == list(range(24, 30))
    finally:
        ca.close()
        cb.close()


def test_failover_standby_takes_over_unacked(stubs: Stubs) -> None:
    topic = "/default/failover"
    pid = create_producer(stubs, topic)
    first = subscribe(stubs, topic, "fo", pb.FAILOVER)
    second = subscribe(stubs, topic, "fo", pb.FAILOVER)
    c1, c2 = Collector(stubs, first), Collector(stubs, second)
    try:
        stubs.producer.SendBatch(batch_request(pid, *[b"f"] * 6))
        got = c1.wait_for(6)
        stubs.consumer.Ack(pb.AckRequest(consumer_id=first, offsets=[m.offset for m in got[:3]]))
        # the standby receives nothing while the active one is there
        stays_sync(lambda: c2.snapshot() == [], for_s=0.2, what="standby idle")
        stubs.consumer.CloseConsumer(pb.CloseConsumerRequest(consumer_id=first))
        taken = c2.wait_for(3)
        assert [m.offset for m in taken] == [3, 4, 5]
        assert all(m.redelivery_count == 1 for m in taken)
    finally:
        c1.close()
        c2.close()


# ---------------------------------------------------------------------------- admin and discovery


def test_read_segment_matches_sealed_file(stubs: Stubs, broker: BrokerProcess) -> None:
    topic = "/default/segments"
    pid = create_producer(stubs, topic)
    big = [bytes([i]) * 600_000 for i in range(4)]  # > 2 MiB: several chunks
    stubs.producer.SendBatch(batch_request(pid, *big))
    sealed = stubs.admin.SealActiveSegment(pb.SealActiveSegmentRequest(topic=topic))
    assert sealed.sealed and (sealed.segment.start_offset, sealed.segment.end_offset) == (0, 3)
    assert stubs.admin.SealActiveSegment(pb.SealActiveSegmentRequest(topic=topic)).sealed is False
    listed = stubs.admin.ListSealedSegments(pb.ListSealedSegmentsRequest(topic=topic)).segments
    assert [(s.start_offset, s.end_offset, s.record_count) for s in listed] == [(0, 3, 4)]

    chunks = list(stubs.admin.ReadSegment(pb.ReadSegmentRequest(topic=topic, start_offset=0)))
    assert len(chunks) >= 3 and all(len(c.data) <= 1024 * 1024 for c in chunks)
    position = 0
    for c in chunks:
        assert c.position == position
        position += len(c.data)
    data = b"".join(c.data for c in chunks)
    path = broker.data_dir / "wal" / "default" / "segments" / f"{0:020d}-{3:020d}.dnb1"
    assert data == path.read_bytes()
    assert len(data) == listed[0].size_bytes
    decoded = decode_segment(data)
    assert [r.payload for r in decoded.records] == big

    with pytest.raises(grpc.RpcError) as exc:
        list(stubs.admin.ReadSegment(pb.ReadSegmentRequest(topic=topic, start_offset=1)))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_class(exc.value) == "SegmentNotFoundError"


def test_topic_lookup_and_cluster_metadata(stubs: Stubs, broker: BrokerProcess) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        stubs.discovery.TopicLookup(pb.TopicLookupRequest(topic="/default/missing"))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_class(exc.value) == "TopicNotFoundError"

    assert stubs.admin.CreateTopic(pb.CreateTopicRequest(topic="/default/found")).created is True
    assert stubs.admin.CreateTopic(pb.CreateTopicRequest(topic="/default/found")).created is False
    found = stubs.discovery.TopicLookup(pb.TopicLookupRequest(topic="/default/found"))
    assert (found.broker_id, found.broker_addr) == (broker.broker_id, broker.address)

    meta = stubs.discovery.ClusterMetadata(pb.ClusterMetadataRequest())
    assert meta.cluster_name == "danube"
    assert [(b.broker_id, b.broker_addr, b.mode) for b in meta.brokers] == [(broker.broker_id, broker.address, "active")]
    assert meta.leader_broker_id == broker.broker_id

    with pytest.raises(grpc.RpcError) as exc:
        stubs.discovery.TopicLookup(pb.TopicLookupRequest(topic="no-slash"))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---------------------------------------------------------------- in-process regressions
# These drive broker objects directly (real WAL on a tmp dir, no etcd, no broker process).
