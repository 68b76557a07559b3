"""The Danube client against real brokers (and a few in-process unit checks).

Integration tests use the ``start_broker`` fixture of ``conftest.py``: a real ``python -m
broker`` process on a free port with its own data directory, against a real etcd.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import fastavro
import grpc
import pytest

from helpers import eventually

from danube_pipeline.client import (
    AvroSchema,
    DanubeClient,
    InitialPosition,
    Message,
)
from danube_pipeline.format.batches import RECORD_OVERHEAD_BYTES
from danube_pipeline.client._accumulator import Accumulator, Batch
from danube_pipeline.client.status import from_rpc_error
from danube_pipeline.error_codec import (
    ERROR_CLASS_METADATA_KEY,
    RemoteError,
)
from danube_pipeline.errors import (
    BrokerUnavailableError,
    MessageTooLargeError,
    SchemaMismatchError,
    TopicNotFoundError,
)
from danube_pipeline.dev.localcluster import free_port
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import ProducerMetadata
from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.format.segments import decode_segment

if TYPE_CHECKING:
    from danube_pipeline.client._context import Context

T = TypeVar("T")

TOPIC = "/default/client_test"

FLIGHT_SCHEMA = json.dumps(
    {
        "type": "record",
        "name": "Flight",
        "fields": [
            {"name": "carrier", "type": "string"},
            {"name": "flight", "type": "int"},
            {"name": "dep_delay", "type": ["null", "double"], "default": None},
        ],
    }
)


def avro_bytes(record: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(json.loads(FLIGHT_SCHEMA)), record)
    return buf.getvalue()


async def produce(client: DanubeClient, topic: str, count: int, *, name: str = "p") -> list[int]:
    async with client.producer(topic, producer_name=name) as producer:
        futures = [
            producer.send_nowait(f"m-{i}".encode(), attributes={"i": str(i)}) for i in range(count)
        ]
        await producer.flush()
        return [f.result() for f in futures]


# ------------------------------------------------------------------ unit


@pytest.mark.unit
def test_status_maps_trailing_error_class_to_typed_error() -> None:
    exc = grpc.aio.AioRpcError(
        grpc.StatusCode.NOT_FOUND,
        grpc.aio.Metadata(),
        grpc.aio.Metadata((ERROR_CLASS_METADATA_KEY, "TopicNotFoundError")),
        details="topic '/a/b' not found",
    )
    err = from_rpc_error(exc, "127.0.0.1:1")
    assert isinstance(err, TopicNotFoundError)
    assert not err.retriable and not err.invalid_metadata

    down = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="connect failed"
    )
    err = from_rpc_error(down, "127.0.0.1:2")
    assert isinstance(err, BrokerUnavailableError)
    assert err.retriable and err.invalid_metadata
    assert err.address == "127.0.0.1:2"

    # FAKE: the status grpc.aio raises for a stream write after the broker died (grpc/grpc#36066)
    # is built here, since the race that produces it cannot be forced. It is a transport failure,
    # so the producer resends; the broker's own INTERNAL answers are not.
    lost = grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), details="Internal error from Core"
    )
    err = from_rpc_error(lost, "127.0.0.1:3")
    assert isinstance(err, BrokerUnavailableError) and err.retriable
    bug = grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), details="internal error: KeyError: 1"
    )
    err = from_rpc_error(bug, "127.0.0.1:3")
    assert not isinstance(err, BrokerUnavailableError) and not err.retriable


@pytest.mark.unit
@pytest.mark.asyncio
async def test_accumulator_closes_batches_by_count_bytes_and_linger() -> None:
    ready: list[Batch] = []
    r = RECORD_OVERHEAD_BYTES
    acc = Accumulator(max_batch_messages=3, max_batch_bytes=3 * r + 10, linger_ms=20, on_ready=ready.append)
    acc.max_message_size_bytes = 20
    for _ in range(3):
        acc.append(b"a")
    assert [b.message_count for b in ready] == [3]  # closed by count
    acc.append(b"12345")
    acc.append(b"x" * 20)  # 5 + 20 + 2 overheads would pass the limit: the open batch closes first
    assert [b.message_count for b in ready] == [3, 1]
    with pytest.raises(MessageTooLargeError):
        acc.append(b"y" * 21)
    await eventually(lambda: len(ready) == 3, timeout_s=5, what="linger closes the open batch")
    assert [b.message_count for b in ready] == [3, 1, 1]


# ------------------------------------------------------------------ integration


@pytest.mark.integration
@pytest.mark.asyncio
async def test_send_nowait_and_flush_give_offsets_in_order(start_broker: Any) -> None:
    broker = start_broker()
    async with DanubeClient([broker.address]) as client:
        async with client.producer(TOPIC, producer_name="p", max_batch_messages=16) as producer:
            futures = [producer.send_nowait(f"m-{i}".encode()) for i in range(100)]
            await producer.flush()
            assert all(f.done() for f in futures)
            assert [f.result() for f in futures] == list(range(100))
            assert await producer.send(b"one more") == 100
        topics = await client.admin.list_topics("default")
        assert [(t.topic, t.next_offset) for t in topics] == [(TOPIC, 101)]


@pytest.mark.integration
@pytest.mark.asyncio
async def test_consume_with_ack_gives_content_and_attributes(start_broker: Any) -> None:
    broker = start_broker()
    async with DanubeClient([broker.address]) as client:
        offsets = await produce(client, TOPIC, 30)
        assert offsets == list(range(30))
        received: list[Message] = []
        async with client.consumer(
            TOPIC, subscription="sub", initial_position=InitialPosition.EARLIEST
        ) as consumer:
            async for message in consumer:
                received.append(message)
                await consumer.ack(message)
                if len(received) == 30:
                    break
            with pytest.raises(TimeoutError):
                await consumer.receive(timeout_ms=300)
    assert [m.offset for m in received] == list(range(30))
    assert [m.payload for m in received] == [f"m-{i}".encode() for i in range(30)]
    assert [dict(m.attributes) for m in received] == [{"i": str(i)} for i in range(30)]
    assert {m.producer_name for m in received} == {"p"}
    assert all(m.topic == TOPIC and m.publish_time_us > 0 for m in received)


@pytest.mark.integration
@pytest.mark.asyncio
async def test_new_consumer_resumes_after_acked_cursor(start_broker: Any) -> None:
    broker = start_broker()
    async with DanubeClient([broker.address]) as client:
        await produce(client, TOPIC, 10)
        async with client.consumer(
            TOPIC, subscription="resume", initial_position=InitialPosition.EARLIEST, ack_flush_ms=10_000
        ) as first:
            for expected in range(5):
                message = await first.receive(timeout_ms=5_000)
                assert message.offset == expected
                await first.ack(message)
        # close() flushed the five buffered acks; the rest were delivered but never acked.
        async with client.consumer(
            TOPIC, subscription="resume", initial_position=InitialPosition.EARLIEST
        ) as second:
            seen = []
            for _ in range(5):
                message = await second.receive(timeout_ms=10_000)
                seen.append(message.offset)
                await second.ack(message)
            with pytest.raises(TimeoutError):  # nothing before offset 5 is redelivered
                await second.receive(timeout_ms=500)
    assert sorted(seen) == [5, 6, 7, 8, 9]


@pytest.mark.integration
@pytest.mark.asyncio
async def test_message_too_large_is_refused_client_side_and_producer_continues(
    start_broker: Any,
) -> None:
    broker = start_broker()
    async with DanubeClient([broker.address]) as client:
        async with client.producer(TOPIC, producer_name="big") as producer:
            assert producer.max_message_size_bytes == 10 * 1024 * 1024  # namespace policy default
            assert await producer.send(b"small") == 0
            too_big = b"x" * (producer.max_message_size_bytes + 1)
            with pytest.raises(MessageTooLargeError) as info:
                producer.send_nowait(too_big)  # raised at once, not through the future
            assert not isinstance(info.value, RemoteError)
            assert info.value.size_bytes == producer.max_message_size_bytes + 1
            with pytest.raises(MessageTooLargeError):
                await producer.send(too_big)
            assert await producer.send(b"after") == 1
            exactly = b"y" * producer.max_message_size_bytes
            assert await producer.send(exactly) == 2


@pytest.mark.integration
@pytest.mark.asyncio
async def test_avro_schema_ids_travel_with_messages_and_bad_payload_is_refused(
    start_broker: Any,
) -> None:
    broker = start_broker()
    schema = AvroSchema(subject="flights-value", raw_schema=FLIGHT_SCHEMA)
    records = [{"carrier": "UA", "flight": 1545, "dep_delay": 2.0}, {"carrier": "AA", "flight": 1141, "dep_delay": None}]
    async with DanubeClient([broker.address]) as client:
        async with client.producer(TOPIC, producer_name="avro", schema=schema) as producer:
            assert producer.schema_id > 0 and producer.schema_version == 1
            assert await producer.send(avro_bytes(records[0])) == 0
            with pytest.raises(SchemaMismatchError):
                await producer.send(b"\xff\xff\xff not avro")
            # Only the bad batch failed: the producer keeps working.
            assert await producer.send(avro_bytes(records[1])) == 1
            schema_id, version = producer.schema_id, producer.schema_version
        # Registering the same schema again is idempotent.
        async with client.producer(TOPIC, producer_name="avro2", schema=schema) as again:
            assert (again.schema_id, again.schema_version) == (schema_id, version)
        async with client.consumer(
            TOPIC, subscription="avro", initial_position=InitialPosition.EARLIEST
        ) as consumer:
            got = [await consumer.receive(timeout_ms=5_000) for _ in range(2)]
    parsed = fastavro.parse_schema(json.loads(FLIGHT_SCHEMA))
    assert [fastavro.schemaless_reader(io.BytesIO(m.payload), parsed, None) for m in got] == records
    assert {(m.schema_id, m.schema_version) for m in got} == {(schema_id, version)}


@pytest.mark.integration
@pytest.mark.asyncio
async def test_dead_plus_live_bootstrap_address_bootstraps(start_broker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    broker = start_broker()
    dead = f"127.0.0.1:{free_port()}"
    # Keep the given order so the dead address is really tried first.
    monkeypatch.setattr("danube_pipeline.client._metadata.random.shuffle", lambda seq: None)
    async with DanubeClient([dead, broker.address], retry_backoff_ms=10) as client:
        metadata = client._metadata
        assert metadata.brokers == {broker.broker_id: broker.address}
        assert metadata.refresh_count == 1  # one refresh, one pass: dead address, then live one
        assert metadata.rpc_counts["ClusterMetadata"] == 2
        assert dead not in client._pool.addresses()  # bootstrap-only addresses are discarded
        info = await client.admin.cluster_metadata()
        assert [(b.broker_id, b.address) for b in info.brokers] == [(broker.broker_id, broker.address)]


@pytest.mark.unit
@pytest.mark.asyncio
async def test_only_dead_bootstrap_addresses_fail_after_the_retry_passes() -> None:
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    client = DanubeClient(dead, metadata_retries=2, retry_backoff_ms=10, request_timeout_ms=2_000)
    try:
        with pytest.raises(BrokerUnavailableError):
            await client.connect()
        # 1 + metadata_retries passes, each over both addresses; one refresh.
        assert client._metadata.refresh_count == 1
        assert client._metadata.rpc_counts["ClusterMetadata"] == 3 * 2
        assert client._metadata.brokers == {}
    finally:
        await client.close()


@pytest.mark.integration
@pytest.mark.asyncio
async def test_concurrent_lookups_share_one_refresh(start_broker: Any) -> None:
    broker = start_broker()
    async with DanubeClient([broker.address]) as client:
        assert await client.admin.create_topic(TOPIC) is True
        assert await client.admin.create_topic(TOPIC) is False
        metadata = client._metadata
        refreshes = metadata.refresh_count
        lookups = metadata.rpc_counts["TopicLookup"]
        answers = await asyncio.gather(*(client.lookup_topic(TOPIC) for _ in range(25)))
        assert set(answers) == {(broker.broker_id, broker.address)}
        assert metadata.refresh_count == refreshes + 1
        assert metadata.rpc_counts["TopicLookup"] == lookups + 1
        # Cached afterwards: no refresh at all.
        await client.lookup_topic(TOPIC)
        assert metadata.refresh_count == refreshes + 1
        with pytest.raises(TopicNotFoundError):
            await client.lookup_topic("/default/does_not_exist")


@pytest.mark.integration
@pytest.mark.asyncio
async def test_producer_recovers_when_broker_restarts_on_the_same_port(
    start_broker: Any, etcd_endpoints: list[str]
) -> None:
    broker = start_broker()
    address = broker.address
    sent: list[bytes] = []
    async with DanubeClient([address], metadata_retries=40, retry_backoff_ms=250) as client:
        async with client.producer(TOPIC, producer_name="survivor", linger_ms=1) as producer:
            assert [await producer.send(f"a{i}".encode()) for i in range(5)] == list(range(5))
            sent += [f"a{i}".encode() for i in range(5)]
            first_id = producer.producer_id

            def restart() -> None:
                broker.kill()  # no graceful drain: batches are in flight when it dies
                broker.port = int(address.rsplit(":", 1)[1])
                broker.start()

            # The broker goes down and comes back while messages keep being queued.
            restarting = asyncio.get_running_loop().run_in_executor(None, restart)
            futures: list[asyncio.Future[int]] = []
            # At least 1,200 so the read-back below crosses the 1,000-message unacked window.
            while not restarting.done() or len(futures) < 1_200:
                for _ in range(20):
                    payload = f"b{len(futures)}".encode()
                    futures.append(producer.send_nowait(payload))
                    sent.append(payload)
                await asyncio.sleep(0.005)  # pacing: keep queueing while the broker restarts
            await restarting
            assert broker.address == address
            await asyncio.wait_for(producer.flush(), 30)
            offsets = [f.result() for f in futures]  # none failed: all were resent in order
            assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
            assert offsets[0] >= 5
            assert producer.producer_id != first_id  # re-created on the restarted broker
            async with await MetadataStore.connect(etcd_endpoints) as store:
                kvs, _ = await store.get_prefix(keys.topic_producers_prefix(TopicName.parse(TOPIC)))
            # only the current producer is open; the one the crash left behind is closed
            producers = [ProducerMetadata.from_json(kv.value) for kv in kvs]
            status = {p.producer_id: p.status for p in producers}
            assert status[first_id] is False
            assert [pid for pid, is_open in status.items() if is_open] == [producer.producer_id]
            last = await producer.send(b"z")
            sent.append(b"z")
            assert last > offsets[-1]
        async with client.consumer(
            TOPIC, subscription="after", initial_position=InitialPosition.EARLIEST
        ) as consumer:
            # Ack as we go: a consumer holds at most receiver_queue_size (1000) unacked messages,
            # and a slow restart queues more than that.
            got = []
            for _ in range(last + 1):
                got.append(await consumer.receive(timeout_ms=5_000))
                await consumer.ack(got[-1])
    assert [m.offset for m in got] == list(range(last + 1))
    # At least once: every payload arrived, in order of first appearance.
    payloads = list(dict.fromkeys(m.payload for m in got))
    assert payloads == sent


@pytest.mark.integration
@pytest.mark.asyncio
async def test_consumer_resubscribes_when_broker_restarts(start_broker: Any) -> None:
    broker = start_broker()
    address = broker.address
    async with DanubeClient([address], metadata_retries=40, retry_backoff_ms=250) as client:
        await produce(client, TOPIC, 5, name="before")
        async with client.consumer(
            TOPIC, subscription="durable", initial_position=InitialPosition.EARLIEST, ack_flush_ms=10
        ) as consumer:
            first_id = consumer.consumer_id
            for expected in range(5):
                message = await consumer.receive(timeout_ms=5_000)
                assert message.offset == expected
                await consumer.ack(message)
            await consumer._flush_acks()  # the broker has the five acks before it stops

            def restart() -> None:
                broker.stop()
                broker.port = int(address.rsplit(":", 1)[1])
                broker.start()

            await asyncio.get_running_loop().run_in_executor(None, restart)
            await produce(client, TOPIC, 5, name="after")
            seen: set[int] = set()
            while seen != {5, 6, 7, 8, 9}:
                message = await consumer.receive(timeout_ms=15_000)
                assert message.offset >= 5, "an acked message was delivered again"
                seen.add(message.offset)
                await consumer.ack(message)
            assert consumer.consumer_id != first_id  # subscribed again on the restarted broker


@pytest.mark.integration
@pytest.mark.asyncio
async def test_broker_moving_to_an_unknown_address_gives_broker_unavailable(start_broker: Any) -> None:
    broker = start_broker()
    async with DanubeClient([broker.address], metadata_retries=2, retry_backoff_ms=50) as client:
        async with client.producer(TOPIC, producer_name="orphan") as producer:
            assert await producer.send(b"x") == 0
            old_port = int(broker.address.rsplit(":", 1)[1])
            broker.stop()
            while broker.port in (0, old_port):
                broker.port = free_port()  # a new port the client has no way to learn
            broker.start()
            future = producer.send_nowait(b"y")
            with pytest.raises(BrokerUnavailableError):
                await asyncio.wait_for(future, 30)
            with pytest.raises(BrokerUnavailableError):
                await client.lookup_topic("/default/other")


@pytest.mark.integration
@pytest.mark.asyncio
async def test_admin_seals_lists_and_reads_segments(start_broker: Any) -> None:
    broker = start_broker()
    async with DanubeClient([broker.address]) as client:
        await produce(client, TOPIC, 12)
        admin = client.admin
        assert await admin.list_sealed_segments(TOPIC) == []
        sealed = await admin.seal_active_segment(TOPIC)
        assert sealed is not None
        assert (sealed.start_offset, sealed.end_offset, sealed.record_count) == (0, 11, 12)
        assert await admin.seal_active_segment(TOPIC) is None  # active segment now empty
        assert await admin.list_sealed_segments(TOPIC) == [sealed]
        data = await admin.read_segment_bytes(TOPIC, 0)
        assert len(data) == sealed.size_bytes
        segment = decode_segment(data)
        assert [r.payload for r in segment.records] == [f"m-{i}".encode() for i in range(12)]



class _SlowAckConsumerStub:
    """A FAKE consumer service: the failure tested (close() landing while an Ack RPC is in
    flight) is a timing window of about a millisecond against a real broker and cannot be
    hit reliably there, so this stub keeps the first Ack in flight until it is cancelled."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.ack_started = asyncio.Event()

    async def Subscribe(self, req: pb.SubscribeRequest, timeout: float | None = None) -> pb.SubscribeResponse:  # noqa: N802 - gRPC method name
        return pb.SubscribeResponse(consumer_id=7, broker_id=1)

    def Receive(self, req: pb.ReceiveRequest) -> _NeverDelivers:  # noqa: N802
        return _NeverDelivers()

    async def Ack(self, req: pb.AckRequest, timeout: float | None = None) -> pb.AckResponse:  # noqa: N802
        if not self.ack_started.is_set():
            self.ack_started.set()
            await asyncio.Event().wait()  # the first Ack stays in flight until cancelled
        self.received.extend(req.offsets)
        for r in req.ranges:
            self.received.extend(range(r.first, r.last + 1))
        return pb.AckResponse()

    async def CloseConsumer(self, req: pb.CloseConsumerRequest, timeout: float | None = None) -> pb.CloseConsumerResponse:  # noqa: N802
        return pb.CloseConsumerResponse()


class _NeverDelivers:
    """A Receive stream that never delivers."""

    def __aiter__(self) -> _NeverDelivers:
        return self

    async def __anext__(self) -> pb.Deliveries:
        await asyncio.Event().wait()
        raise StopAsyncIteration

    def cancel(self) -> None:
        pass


@pytest.mark.unit
@pytest.mark.asyncio
async def test_close_during_an_inflight_ack_flush_loses_no_ack() -> None:
    from types import SimpleNamespace

    from danube_pipeline.client.consumer import Consumer

    service = _SlowAckConsumerStub()
    stubs = SimpleNamespace(address="fake:1", consumer=service)

    class _Ctx:
        """The part of the client's Context a Consumer uses: every call goes to ``stubs``."""

        children: set[Any] = set()
        request_timeout_s = 1.0
        backoff_s = 0.01

        async def call_owner(
            self, topic: str, fn: Callable[[Any], Awaitable[T]], *, refresh: bool = False, create_missing: bool = False
        ) -> T:
            return await fn(stubs)

    ctx = cast("Context", _Ctx())  # a fake: the failure needs a millisecond timing window
    consumer = Consumer(ctx, "/default/t", subscription="s", ack_flush_ms=20, ack_batch_size=500)
    await consumer.open()
    for offset in range(10):
        await consumer.ack(offset)
    await asyncio.wait_for(service.ack_started.wait(), 5)  # the flush's Ack(0..9) is in flight
    assert service.received == []
    await consumer.close()
    assert sorted(set(service.received)) == list(range(10))


@pytest.mark.integration
@pytest.mark.asyncio
async def test_a_topic_with_a_dead_owner_does_not_break_other_lookups(etcd_endpoints: Any, start_broker: Any) -> None:
    """A topic assigned to a broker that is gone (not registered) is failed over to a live
    broker by the leader (``docs/etcd-layout.md`` §1.4); while its lookup waits for that, every
    other topic's lookup, on the healthy broker, still succeeds at once."""
    from danube_pipeline.metadata import keys
    from danube_pipeline.metadata.store import MetadataStore
    from danube_pipeline.names import TopicName

    broker = start_broker(extra_args=["--lease-ttl-s", "2"])
    dead_topic = TopicName.parse("/default/orphaned")
    async with await MetadataStore.connect(etcd_endpoints) as store:
        await store.put_many([
            (keys.topic_root(dead_topic), 0),
            (keys.topic_assignment(123456789, dead_topic), None),  # broker 123456789 is not registered
        ])
    async with DanubeClient([broker.address], metadata_retries=20, retry_backoff_ms=250) as client:
        await client.admin.create_topic("/default/healthy")
        orphaned = asyncio.create_task(client.lookup_topic("/default/orphaned"))
        for _ in range(3):
            owner = await client.lookup_topic("/default/healthy")
            assert owner.broker_id == broker.broker_id
            client._metadata.invalidate("/default/healthy")  # force a refresh each time
        assert (await orphaned).broker_id == broker.broker_id  # failed over to the live broker
        assert client._metadata._wanted == set()
        assert broker.address in client._pool.addresses()  # the healthy broker's channel stays


async def _receive_all(consumer: Any, count: int) -> list[bytes]:
    """``count`` payloads from ``consumer``, each acked; fails after 15 s without one."""
    got: list[bytes] = []
    while len(got) < count:
        message = await consumer.receive(timeout_ms=15_000)
        got.append(message.payload)
        await consumer.ack(message)
    return got


@pytest.mark.integration
@pytest.mark.asyncio
async def test_unloading_one_topic_leaves_the_other_streams_on_its_broker_alone(start_broker: Any) -> None:
    """The broker ends the streams of an unloaded topic cleanly (``StreamEndedError``): its
    consumer and producer follow the topic, and the connection, which the streams of the
    other topic on the same broker share, is kept. Treating that end as a dead broker closed
    the connection, which cancelled the other consumer's stream and ended its receiving for
    good: it got nothing more."""
    broker = start_broker()
    async with DanubeClient([broker.address], retry_backoff_ms=50) as client:
        for topic in ("/default/moved", "/default/stays"):
            await client.admin.create_topic(topic)
        async with (
            client.consumer("/default/moved", subscription="s") as moved,
            client.consumer("/default/stays", subscription="s") as stays,
            client.producer("/default/moved", producer_name="pm") as moved_producer,
            client.producer("/default/stays", producer_name="ps") as stays_producer,
        ):
            await moved_producer.send(b"m0")
            await stays_producer.send(b"s0")
            assert await _receive_all(moved, 1) == [b"m0"] and await _receive_all(stays, 1) == [b"s0"]
            opened = client._pool.channels_opened

            await client.admin.unload_topic("/default/moved")
            await asyncio.sleep(client._pool._close_grace_s + 0.5)  # a discarded channel would be closed by now
            for i in range(1, 4):
                await moved_producer.send(b"m%d" % i)
                await stays_producer.send(b"s%d" % i)
            assert await _receive_all(stays, 3) == [b"s1", b"s2", b"s3"]
            assert await _receive_all(moved, 3) == [b"m1", b"m2", b"m3"]
            assert client._pool.channels_opened == opened  # one broker, one connection throughout


@pytest.mark.integration
@pytest.mark.asyncio
async def test_a_consumer_whose_channel_is_closed_under_it_subscribes_again(start_broker: Any) -> None:
    """When another call finds the connection broken, the pool drops the channel and its
    calls are cancelled after the grace period (here 0). A consumer whose ``Receive`` stream
    is cancelled that way subscribes again over a new channel: before, its receiving task
    ended with the cancellation and the consumer waited forever. Dropping the channel a
    second time for a call of the old one leaves the new channel alone."""
    broker = start_broker()
    async with DanubeClient([broker.address], retry_backoff_ms=50) as client:
        client._pool._close_grace_s = 0.0
        await client.admin.create_topic("/default/dropped")
        async with (
            client.consumer("/default/dropped", subscription="s") as consumer,
            client.producer("/default/dropped", producer_name="p") as producer,
        ):
            await producer.send(b"before")
            assert await _receive_all(consumer, 1) == [b"before"]
            await consumer._flush_acks()  # else the resubscribed consumer gets it again (at least once)
            old = client._pool.stubs(broker.address)
            client._pool.discard(broker.address, old)  # as a call that failed on it does
            new = client._pool.stubs(broker.address)
            client._pool.discard(broker.address, old)  # a second failure on the old channel
            assert client._pool.stubs(broker.address) is new
            for i in range(3):
                await producer.send(b"after%d" % i)
            assert await _receive_all(consumer, 3) == [b"after0", b"after1", b"after2"]
