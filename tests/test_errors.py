"""Typed errors survive the wire: the broker sends each error's class and constructor
arguments, the client rebuilds the error through its own constructor.

The unit test round-trips every wire error class through the broker-side encoder and the
client-side decoder. The integration tests make a real broker raise each error class it can
raise, and catch it on the client as that class with its typed fields.
"""

from __future__ import annotations

import asyncio
import inspect
import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import fastavro
import grpc
import pytest
import pytest_asyncio

from danube_pipeline.format.batches import BatchBuilder
from danube_pipeline.client import AvroSchema, DanubeClient, InitialPosition, SubscriptionType
from danube_pipeline.client._connection import ConnectionPool, Stubs
from danube_pipeline.client.status import rpc_errors
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer
from danube_pipeline.error_codec import (
    ERROR_CLASS_METADATA_KEY,
    ERROR_FIELDS_METADATA_KEY,
    WIRE_ERRORS,
    RemoteError,
    encode_error_metadata,
    error_from_status,
)
from danube_pipeline.errors import (
    MAX_WIRE_STRING_CHARS,
    BrokerUnavailableError,
    ConsumerNotFoundError,
    DanubeError,
    InvalidNameError,
    InvalidSchemaError,
    MalformedRequestError,
    MessageTooLargeError,
    MetadataStoreError,
    NotServedHereError,
    ProducerNotFoundError,
    SchemaMismatchError,
    SchemaNotFoundError,
    SegmentNotFoundError,
    SubscriptionBusyError,
    TopicNotFoundError,
)
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb

E = TypeVar("E", bound=DanubeError)

SCHEMA = json.dumps({"type": "record", "name": "R", "fields": [{"name": "a", "type": "int"}]})


def _sample(cls: type[DanubeError]) -> DanubeError:
    """An instance of ``cls`` with a distinct value for every constructor argument."""
    args: dict[str, Any] = {}
    for i, (name, param) in enumerate(inspect.signature(cls.__init__).parameters.items()):
        if name == "self":
            continue
        args[name] = 1000 + i if param.annotation in (int, "int") else f"{name}-value"
    return cls(**args)


@pytest.mark.unit
@pytest.mark.parametrize("cls", WIRE_ERRORS, ids=lambda c: c.__name__)
def test_every_wire_error_round_trips_with_its_fields(cls: type[DanubeError]) -> None:
    sent = _sample(cls)
    metadata = dict(encode_error_metadata(sent))
    assert metadata[ERROR_CLASS_METADATA_KEY] == cls.__name__
    received = error_from_status(
        cls.grpc_code, str(sent), metadata[ERROR_CLASS_METADATA_KEY], metadata[ERROR_FIELDS_METADATA_KEY]
    )
    assert isinstance(received, cls) and isinstance(received, RemoteError)
    assert str(received) == str(sent)
    assert received.code == cls.grpc_code
    assert (received.retriable, received.invalid_metadata) == (cls.retriable, cls.invalid_metadata)
    for name in inspect.signature(cls.__init__).parameters:
        if name != "self":
            assert getattr(received, name) == getattr(sent, name), name


@pytest.mark.unit
def test_long_strings_travel_as_a_bounded_prefix() -> None:
    name = "n" * 10_000
    metadata = dict(encode_error_metadata(InvalidNameError("topic", name, "too long")))
    assert len(metadata[ERROR_FIELDS_METADATA_KEY]) < 2 * MAX_WIRE_STRING_CHARS
    received = error_from_status(grpc.StatusCode.INVALID_ARGUMENT, "x", "InvalidNameError", metadata[ERROR_FIELDS_METADATA_KEY])
    assert isinstance(received, InvalidNameError)
    assert received.name.startswith("n" * MAX_WIRE_STRING_CHARS) and "10000 chars" in received.name


@pytest.mark.unit
def test_missing_or_bad_fields_still_give_the_class() -> None:
    for fields in (None, "not json", '{"wrong": 1}', "[1, 2]"):
        err = error_from_status(grpc.StatusCode.NOT_FOUND, "topic gone", "TopicNotFoundError", fields)
        assert isinstance(err, TopicNotFoundError)
        assert err.code == grpc.StatusCode.NOT_FOUND and "topic gone" in str(err)
    unknown = error_from_status(grpc.StatusCode.UNAVAILABLE, "down", "NoSuchError", None)
    assert type(unknown) is RemoteError and unknown.retriable and unknown.invalid_metadata


# ------------------------------------------------------------------ against a real broker


async def _raises(cls: type[E], action: Awaitable[object]) -> E:
    """Await ``action`` and return the error, which must be a :class:`RemoteError` of ``cls``."""
    with pytest.raises(cls) as info:
        await action
    assert isinstance(info.value, RemoteError), type(info.value)
    return info.value


async def _raw(stubs: Stubs, call: Callable[[Stubs], Awaitable[object]]) -> object:
    """One call on raw stubs, its failure converted by the client's single mapping point."""
    with rpc_errors(stubs.address):
        return await call(stubs)


@pytest_asyncio.fixture
async def broker_stubs(start_broker: Callable[..., BrokerProcess]) -> AsyncIterator[tuple[BrokerProcess, Stubs]]:
    # A long lease TTL: the leader waits that long before failing over a broker it never saw
    # registered (the unregistered owner of /default/elsewhere below stays unavailable).
    broker = start_broker(extra_args=["--lease-ttl-s", "120"])
    pool = ConnectionPool()
    try:
        yield broker, pool.stubs(broker.address)
    finally:
        await pool.close()


@pytest.mark.integration
@pytest.mark.asyncio
async def test_client_errors_carry_their_fields(start_broker: Callable[..., BrokerProcess]) -> None:
    broker = start_broker()
    async with DanubeClient([broker.address], metadata_retries=0) as client:
        err = await _raises(TopicNotFoundError, client.consumer("/default/missing", subscription="s").open())
        assert err.topic == "/default/missing"

        with pytest.raises(InvalidNameError) as bad_name:  # checked on the client before sending
            client.producer("/default/bad name", producer_name="p")
        assert bad_name.value.kind == "topic"

        err2 = await _raises(
            InvalidSchemaError,
            client.producer("/default/e", producer_name="p", schema=AvroSchema("subj", '{"type": "nope"}')).open(),
        )
        assert err2.subject == "subj" and err2.reason

        async with client.producer("/default/e", producer_name="p", schema=AvroSchema("e-value", SCHEMA)) as producer:
            err3 = await _raises(SchemaMismatchError, producer.send(b"\xff\xff\xff\xff\xff\xff"))
            assert err3.subject == "e-value" and err3.schema_id == producer.schema_id and err3.reason
            await producer.send(_avro({"a": 1}))

        err4 = await _raises(SegmentNotFoundError, client.admin.read_segment_bytes("/default/e", 12345))
        assert (err4.topic, err4.start_offset) == ("/default/e", 12345)

        async with client.consumer(
            "/default/e", subscription="only-one", subscription_type=SubscriptionType.EXCLUSIVE,
            initial_position=InitialPosition.EARLIEST,
        ):
            err5 = await _raises(
                SubscriptionBusyError,
                client.consumer("/default/e", subscription="only-one", subscription_type=SubscriptionType.SHARED).open(),
            )
            assert err5.subscription == "only-one" and err5.reason


@pytest.mark.integration
@pytest.mark.asyncio
async def test_broker_errors_carry_their_fields_on_raw_calls(
    broker_stubs: tuple[BrokerProcess, Stubs], etcd_endpoints: list[str]
) -> None:
    broker, stubs = broker_stubs
    t = 30.0

    err = await _raises(InvalidNameError, _raw(stubs, lambda s: s.producer.CreateProducer(
        pb.CreateProducerRequest(topic="/default/abc def", producer_name="p"), timeout=t)))
    assert err.kind == "topic" and err.name == "abc def"

    created = await _raw(stubs, lambda s: s.producer.CreateProducer(
        pb.CreateProducerRequest(topic="/small/t", producer_name="p"), timeout=t))
    assert isinstance(created, pb.CreateProducerResponse)
    async with await MetadataStore.connect(etcd_endpoints) as store:
        revision = await store.put(keys.namespace_policy("small"), {"max_message_size": 10})
        # another broker id owns /default/elsewhere, and it never registered
        await store.put(keys.topic_root(TopicName.parse("/default/elsewhere")), 0)
        await store.put(keys.topic_assignment(4242, TopicName.parse("/default/elsewhere")), None)
    del revision

    async def too_large() -> object:
        return await _raw(stubs, lambda s: s.producer.SendBatch(pb.SendBatchRequest(
            producer_id=created.producer_id, batch=_batch(created.producer_id, "p", b"x" * 11)), timeout=t))

    err2 = await _eventually_raises(MessageTooLargeError, too_large)  # once the policy reached the cache
    assert (err2.size_bytes, err2.max_message_size_bytes) == (11, 10)

    err3 = await _raises(ProducerNotFoundError, _raw(stubs, lambda s: s.producer.SendBatch(
        pb.SendBatchRequest(producer_id=77, batch=_batch(77, "p", b"x")), timeout=t)))
    assert err3.producer_id == 77

    err4 = await _raises(ConsumerNotFoundError, _raw(stubs, lambda s: s.consumer.Ack(
        pb.AckRequest(consumer_id=88, offsets=[1]), timeout=t)))
    assert err4.consumer_id == 88

    err5 = await _raises(MalformedRequestError, _raw(stubs, lambda s: s.consumer.Subscribe(
        # 9 is no SubscriptionType: an invalid value sent on purpose
        pb.SubscribeRequest(topic="/small/t", subscription="s", subscription_type=cast(pb.SubscriptionType, 9)),
        timeout=t)))
    assert "subscription type 9" in err5.reason

    err6 = await _raises(SchemaNotFoundError, _raw(stubs, lambda s: s.schema.GetSchema(
        pb.GetSchemaRequest(schema_id=999), timeout=t)))
    assert "999" in err6.what

    err7 = await _raises(NotServedHereError, _raw(stubs, lambda s: s.admin.ListSealedSegments(
        pb.ListSealedSegmentsRequest(topic="/default/elsewhere"), timeout=t)))
    assert (err7.topic, err7.broker_id) == ("/default/elsewhere", broker.broker_id)

    err8 = await _raises(BrokerUnavailableError, _raw(stubs, lambda s: s.discovery.TopicLookup(
        pb.TopicLookupRequest(topic="/default/elsewhere"), timeout=3)))  # it waits for a failover, in vain
    assert err8.address == "broker 4242" and "not registered" in err8.reason


@pytest.mark.integration
@pytest.mark.asyncio
async def test_metadata_store_error_carries_its_fields(tmp_path: Path) -> None:
    """etcd stops under a running broker: creating a topic fails with the broker's
    MetadataStoreError, operation and reason included."""
    etcd = EtcdServer(tmp_path / "etcd")
    etcd.start()
    broker = BrokerProcess(etcd_endpoints=etcd.endpoints, data_dir=tmp_path / "broker")
    try:
        broker.start()
        pool = ConnectionPool()
        stubs = pool.stubs(broker.address)
        etcd.stop()
        try:
            err = await _raises(MetadataStoreError, _raw(stubs, lambda s: s.admin.CreateTopic(
                pb.CreateTopicRequest(topic="/default/during-outage"), timeout=60.0)))
            assert err.operation and err.reason
            assert err.retriable
        finally:
            await pool.close()
    finally:
        broker.kill()
        etcd.stop()


async def _eventually_raises(cls: type[E], call: Callable[[], Awaitable[object]], timeout_s: float = 10.0) -> E:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            await call()
        except cls as exc:
            assert isinstance(exc, RemoteError)
            return exc
        if loop.time() > deadline:
            raise AssertionError(f"{cls.__name__} not raised within {timeout_s}s")
        await asyncio.sleep(0.05)


def _avro(record: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(json.loads(SCHEMA)), record)
    return buf.getvalue()


def _batch(producer_id: int, producer_name: str, *payloads: bytes) -> bytes:
    builder = BatchBuilder(1)
    for payload in payloads:
        builder.append(payload, timestamp_us=1)
    return builder.build(producer_id=producer_id, producer_name=producer_name)
