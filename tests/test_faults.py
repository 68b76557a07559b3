"""Faults and bad input against real processes: a real etcd paused (SIGSTOP) or killed, a real
disk filled up (tmpfs), real broker processes, the client library and raw gRPC stubs.

Each test is one finding of issue 8 and fails on the code before it:

* one producer's bad batches never fail another producer's messages;
* names follow one exact grammar per kind, on client and broker alike;
* a broker whose lease expired during an etcd pause registers again at once;
* creations cut short by an etcd outage leave no orphan keys;
* background writes failing during an etcd outage are logged once, without tracebacks;
* the client gets the broker's typed cause, not ``DEADLINE_EXCEEDED``;
* a full disk is a typed, retriable error; reads go on and publishing resumes by itself;
* a consumer asking for a huge window cannot make the broker hold the backlog in memory;
* bad schemas are refused with ``INVALID_ARGUMENT`` and not retried;
* closed producers' keys expire and idle subscriptions are unloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import crc32c
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import broker_config_args, eventually, eventually_sync
from test_broker import Collector, Stubs, batch_request, create_producer, error_class, subscribe

from danube_pipeline.format.batches import BatchBuilder
from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer
from danube_pipeline.errors import (
    InvalidNameError,
    InvalidSchemaError,
    MalformedRequestError,
    MetadataStoreError,
    StorageFullError,
)
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName, validate_cluster_name, validate_part, validate_subject
from danube_pipeline.proto import danube_pb2 as pb

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def etcd_paused(etcd: EtcdServer) -> Iterator[None]:
    """etcd stopped with SIGSTOP inside the block (connections stay open, nothing answers)."""
    os.kill(etcd.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(etcd.pid, signal.SIGCONT)


def etcd_keys(endpoints: list[str], prefix: str = "/") -> dict[str, object]:
    async def go() -> dict[str, object]:
        store = await MetadataStore.connect(endpoints)
        try:
            kvs, _ = await store.get_prefix(prefix)
            return {kv.key: kv.value for kv in kvs}
        finally:
            await store.close()

    return asyncio.run(go())


def log_text(broker: BrokerProcess) -> str:
    return broker.log_path.read_text(errors="replace")


# ---------------------------------------------------------------------------- one producer, another


def _reframed(batch: bytes, mutate: Callable[[bytearray], None]) -> bytes:
    """``batch`` changed by ``mutate`` with its CRC computed again, so only the framing is wrong."""
    data = bytearray(batch)
    mutate(data)
    struct.pack_into("<I", data, 12, crc32c.crc32c(bytes(data[16:])))
    return bytes(data)


def test_bad_batches_of_one_producer_never_fail_anothers(start_broker: Callable[..., BrokerProcess]) -> None:
    """A producer sending batches that break the record framing in every way the format has
    limits (attribute count and lengths, key length, record length) is refused batch by batch;
    a well-behaved producer on the same topic, sending meanwhile, loses nothing."""
    broker = start_broker()
    topic = "/default/two_producers"
    bad = Stubs(broker.address)
    bad_pid = create_producer(bad, topic, name="bad")

    def one_record(**attributes: str) -> bytes:
        builder = BatchBuilder(time.time_ns() // 1000)
        builder.append(b"x" * 10, timestamp_us=builder.first_timestamp_us, key="k", attributes=attributes)
        return builder.build(producer_id=bad_pid, producer_name="bad")

    base = one_record(a="b")
    record = 60 + len("bad")  # the first record's position
    mutations: list[Callable[[bytearray], None]] = [
        lambda d: struct.pack_into("<H", d, record + 12, 0xFFFF),  # 65,535 attributes claimed
        lambda d: struct.pack_into("<H", d, record + 14 + 1, 0xFFFF),  # attribute name of 65,535 bytes
        lambda d: struct.pack_into("<I", d, record + 14 + 1 + 2, 0xFFFFFFFF),  # attribute value of 4 GiB
        lambda d: struct.pack_into("<i", d, record + 8, 1 << 30),  # key past the record
        lambda d: struct.pack_into("<i", d, record + 8, -7),  # negative key length
        lambda d: struct.pack_into("<I", d, record, 0xFFFFFFF0),  # record past the batch
        lambda d: struct.pack_into("<I", d, 20, 2),  # two records claimed, one present
    ]
    bad_batches = [_reframed(base, m) for m in mutations]

    async def good_producer() -> list[int]:
        async with DanubeClient([broker.address]) as client:
            producer = await client.producer(topic, producer_name="good", max_batch_messages=50).open()
            futures = [producer.send_nowait(f"good-{i}".encode()) for i in range(3000)]
            offsets = await asyncio.gather(*futures)
            await producer.close()
            return list(offsets)

    async def bad_producer() -> list[str | None]:
        classes: list[str | None] = []
        channel = grpc.aio.insecure_channel(broker.address)
        try:
            send = channel.unary_unary(
                "/danube.v1.ProducerService/SendBatch",
                request_serializer=pb.SendBatchRequest.SerializeToString,
                response_deserializer=pb.SendBatchResponse.FromString,
            )
            for _round in range(20):
                for batch in bad_batches:
                    try:
                        await send(pb.SendBatchRequest(producer_id=bad_pid, batch=batch))
                        classes.append("accepted")
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
                        classes.append(dict(exc.trailing_metadata() or ()).get("danube-error-class"))
                await asyncio.sleep(0)  # a yield to the loop, not a wait
        finally:
            await channel.close()
        return classes

    async def both() -> tuple[list[int], list[str | None]]:
        good, refused = await asyncio.gather(good_producer(), bad_producer())
        return good, refused

    good_offsets, refused = asyncio.run(both())
    bad.close()
    assert len(good_offsets) == 3000 and len(set(good_offsets)) == 3000
    assert refused == ["MalformedRequestError"] * (20 * len(mutations))

    # Every stored message is the good producer's, each once.
    stubs = Stubs(broker.address)
    try:
        collector = Collector(stubs, subscribe(stubs, topic, "check", receiver_queue_size=5000))
        got = collector.wait_for(3000)
        collector.close()
    finally:
        stubs.close()
    assert sorted(m.payload for m in got) == sorted(f"good-{i}".encode() for i in range(3000))


@pytest.mark.unit
def test_the_client_refuses_attributes_the_format_cannot_hold() -> None:
    builder = BatchBuilder(1)
    with pytest.raises(MalformedRequestError, match="attribute name of 65536 bytes"):
        builder.append(b"x", timestamp_us=1, attributes={"k" * 65536: "v"})
    with pytest.raises(MalformedRequestError, match="65536 attributes"):
        builder.append(b"x", timestamp_us=1, attributes={str(i): "" for i in range(65536)})
    assert builder.record_count == 0


# ---------------------------------------------------------------------------- names


BAD_NAMES = ["abc\n", "abc\r", "a\x00b", "a b", "", "a/b", "é", "a" * 129, "x" * 10_000]


@pytest.mark.unit
@pytest.mark.parametrize("bad", BAD_NAMES)
def test_every_kind_of_name_is_a_full_match(bad: str) -> None:
    for kind in ("namespace", "topic", "subscription", "producer", "consumer"):
        with pytest.raises(InvalidNameError) as caught:
            validate_part(kind, bad)
        assert len(str(caught.value)) < 400  # a bounded prefix of the input is quoted
    with pytest.raises(InvalidNameError):
        TopicName.parse(f"/default/{bad}")
    with pytest.raises(InvalidNameError):
        TopicName.parse(f"/{bad}/topic")


@pytest.mark.unit
def test_subject_and_cluster_grammars() -> None:
    for good in ("flights-value", "a", "com.example.Flight_v2", "x" * 255):
        assert validate_subject(good) == good
    for bad in ("", "a\x00b", "a b", "abc\n", "_global", "_index", ".hidden", "-x", "x" * 256, "x" * 10_000, "a/b"):
        with pytest.raises(InvalidNameError):
            validate_subject(bad)
    assert validate_cluster_name("danube-prod") == "danube-prod"
    for bad in ("leader", "register", "brokers", "unassigned", "load", "a\n", ""):
        with pytest.raises(InvalidNameError):
            validate_cluster_name(bad)


def test_the_broker_refuses_bad_names_and_writes_nothing(
    start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str]
) -> None:
    broker = start_broker()
    stubs = Stubs(broker.address)
    try:
        before = etcd_keys(etcd_endpoints)
        calls: list[Callable[[], object]] = [
            lambda: stubs.admin.CreateTopic(pb.CreateTopicRequest(topic="/default/abc\n")),
            lambda: stubs.admin.CreateTopic(pb.CreateTopicRequest(topic="/de\nfault/abc")),
            lambda: stubs.admin.CreateTopic(pb.CreateTopicRequest(topic="/default/" + "x" * 10_000)),
            lambda: create_producer(stubs, "/default/ok", name="p\n"),
            lambda: create_producer(stubs, "/default/ok2", name="p" * 10_000),
            lambda: stubs.schemas.RegisterSchema(
                pb.RegisterSchemaRequest(subject="a\x00b", schema_type=pb.AVRO, raw_schema='"string"')
            ),
            lambda: stubs.schemas.RegisterSchema(
                pb.RegisterSchemaRequest(subject="s" * (2 * 1024 * 1024), schema_type=pb.AVRO, raw_schema='"string"')
            ),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
            assert error_class(caught.value) == "InvalidNameError"
            assert len(caught.value.details() or "") < 400
        # A subscription or consumer name with a newline, on an existing topic.
        create_producer(stubs, "/default/ok3", name="fine")
        for sub, consumer in (("s\n", "c"), ("s", "c\n")):
            with pytest.raises(grpc.RpcError) as caught:
                stubs.consumer.Subscribe(
                    pb.SubscribeRequest(topic="/default/ok3", subscription=sub, consumer_name=consumer)
                )
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        after = etcd_keys(etcd_endpoints)
    finally:
        stubs.close()
    new = set(after) - set(before)
    assert all(key.isprintable() and "\n" not in key for key in after)
    assert not [k for k in new if "/ok/" in k or k.endswith("/ok") or "/ok2" in k], new
    wal_dirs = [p.name for p in (broker.data_dir / "wal" / "default").iterdir()]
    assert sorted(wal_dirs) == ["ok3"]


def test_a_reserved_cluster_name_is_refused_at_start(tmp_path: Path, etcd_endpoints: list[str]) -> None:
    broker = BrokerProcess(etcd_endpoints=etcd_endpoints, data_dir=tmp_path / "b", cluster_name="leader")
    with pytest.raises(RuntimeError, match="reserved"):
        broker.start(timeout_s=20)


# ---------------------------------------------------------------------------- etcd outages


def test_a_broker_registers_again_as_soon_as_etcd_answers(
    own_etcd: EtcdServer, tmp_path: Path
) -> None:
    """etcd paused longer than the lease TTL: the registration expires; once etcd answers the
    broker registers again at once (not at its next load report, 30 s later) and new clients
    are served."""
    broker = BrokerProcess(etcd_endpoints=own_etcd.endpoints, data_dir=tmp_path / "b", extra_args=["--lease-ttl-s", "2"])
    broker.start()
    try:
        register = keys.broker_register(broker.broker_id)
        assert register in etcd_keys(own_etcd.endpoints)
        with etcd_paused(own_etcd):
            time.sleep(5)  # > TTL: etcd expires the lease when it runs again
        resumed = time.monotonic()
        eventually_sync(
            lambda: register in etcd_keys(own_etcd.endpoints), timeout_s=10, what="registered again"
        )

        async def new_client_is_served() -> None:
            async with DanubeClient([broker.address], request_timeout_ms=2000) as client:
                producer = await client.producer("/default/after_pause", producer_name="p").open()
                await producer.send(b"hello")
                await producer.close()

        asyncio.run(new_client_is_served())
        # Far below the 30 s load-report interval; the 2 s target is measured by benchmarks/faults.py.
        assert time.monotonic() - resumed < 10
        assert "registered again" in log_text(broker)
    finally:
        broker.stop()


def test_creations_cut_short_by_an_etcd_pause_leave_no_orphans(own_etcd: EtcdServer, tmp_path: Path) -> None:
    """During an etcd pause, CreateProducer and Subscribe fail with the broker's typed cause
    (MetadataStoreError, not DEADLINE_EXCEEDED). etcd may apply their writes once it runs
    again; the broker then marks the producer closed (its key expires) and deletes the
    subscription it half created."""
    broker = BrokerProcess(
        etcd_endpoints=own_etcd.endpoints,
        data_dir=tmp_path / "b",
        extra_args=["--closed-producer-ttl-s", "2", "--lease-ttl-s", "30"],
    )
    broker.start()
    topic = "/default/orphans"
    name = TopicName.parse(topic)
    try:
        stubs = Stubs(broker.address)
        create_producer(stubs, topic, name="first")  # the topic exists and is loaded
        with etcd_paused(own_etcd):
            with pytest.raises(grpc.RpcError) as producer_error:
                stubs.producer.CreateProducer(
                    pb.CreateProducerRequest(topic=topic, producer_name="during-pause"), timeout=1.5
                )
            with pytest.raises(grpc.RpcError) as subscribe_error:
                stubs.consumer.Subscribe(
                    pb.SubscribeRequest(topic=topic, subscription="during-pause", consumer_name="c"), timeout=1.5
                )
        stubs.close()
        for caught in (producer_error, subscribe_error):
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
            assert error_class(caught.value) == "MetadataStoreError"

        def no_orphans() -> bool:
            kvs = etcd_keys(own_etcd.endpoints, keys.topic_root(name) + "/")
            open_producers = [
                k for k, v in kvs.items()
                if "/producers/" in k and isinstance(v, dict) and v.get("producer_name") == "during-pause"
            ]
            subscription = [k for k in kvs if "/subscriptions/during-pause" in k]
            return not open_producers and not subscription

        eventually_sync(no_orphans, timeout_s=15, what="no producer or subscription key left from the pause")
    finally:
        broker.stop()


def test_client_sees_the_typed_cause_within_its_deadline(own_etcd: EtcdServer, tmp_path: Path) -> None:
    broker = BrokerProcess(etcd_endpoints=own_etcd.endpoints, data_dir=tmp_path / "b")
    broker.start()
    try:
        async def create_during_pause() -> BaseException:
            async with DanubeClient([broker.address], request_timeout_ms=1000, metadata_retries=0) as client:
                with etcd_paused(own_etcd):
                    try:
                        await client.admin.create_topic("/default/deadline")
                    except BaseException as exc:  # noqa: BLE001 - the error is the result
                        return exc
                return AssertionError("create_topic succeeded while etcd was paused")

        error = asyncio.run(create_during_pause())
        assert isinstance(error, MetadataStoreError), repr(error)
    finally:
        broker.stop()


def test_background_writes_fail_quietly_while_etcd_is_down(own_etcd: EtcdServer, tmp_path: Path) -> None:
    """Cursor flushes and other background writes fail while etcd is killed: one warning per
    outage, no "Task exception was never retrieved", no traceback; the cursor is stored once
    etcd is back. Cursors are flushed every second (``cursor_flush_interval_s``, 5 s by default),
    so the outage spans more than two flush intervals."""
    flush_every_second = broker_config_args(tmp_path / "b.yml", {"cursor_flush_interval_s": 1.0})
    broker = BrokerProcess(etcd_endpoints=own_etcd.endpoints, data_dir=tmp_path / "b", extra_args=flush_every_second)
    broker.start()
    topic = "/default/cursors"
    try:
        stubs = Stubs(broker.address)
        pid = create_producer(stubs, topic)
        consumer_id = subscribe(stubs, topic, "sub", receiver_queue_size=5000)
        collector = Collector(stubs, consumer_id)
        own_etcd.kill()
        for i in range(30):
            stubs.producer.SendBatch(batch_request(pid, *[f"m{i}-{j}".encode() for j in range(100)]))
        got = collector.wait_for(3000)
        stubs.consumer.Ack(pb.AckRequest(consumer_id=consumer_id, offsets=[m.offset for m in got]))
        time.sleep(2.5)  # more than two cursor flush intervals (1 s) with etcd down
        own_etcd.start()
        cursor_key = keys.subscription_cursor(TopicName.parse(topic), "sub")
        eventually_sync(lambda: etcd_keys(own_etcd.endpoints).get(cursor_key) == 2999, timeout_s=20,
                        what="cursor stored once etcd is back")
        collector.close()
        stubs.close()
    finally:
        broker.stop()
    text = log_text(broker)
    assert "never retrieved" not in text
    assert "Traceback" not in text
    assert text.count("metadata writes to etcd failing") == 1
    assert "metadata writes to etcd recovered" in text


# ---------------------------------------------------------------------------- full disk


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 24 MiB tmpfs file system (needs root; skipped where mounting is not allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_typed_reads_go_on_and_publishing_resumes(
    small_disk: Path, start_broker: Callable[..., BrokerProcess]
) -> None:
    filler = small_disk / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * (20 * 1024 * 1024))  # leaves about 4 MiB for the WAL
    broker = start_broker(
        data_dir=small_disk / "broker", segment_max_bytes=1024 * 1024, log_path=small_disk.parent / "broker.log"
    )
    topic = "/default/full"
    health = grpc.insecure_channel(broker.address)
    health_stub = health_pb2_grpc.HealthStub(health)

    def producer_health() -> int:
        request = health_pb2.HealthCheckRequest(service="danube.v1.ProducerService")
        return int(health_stub.Check(request).status)

    async def fill_then_free() -> tuple[list[int], StorageFullError | None, list[int]]:
        acked: list[int] = []
        async with DanubeClient([broker.address], metadata_retries=1, retry_backoff_ms=100) as client:
            producer = await client.producer(topic, producer_name="p", max_batch_messages=16).open()
            error: StorageFullError | None = None
            for i in range(20_000):
                try:
                    acked.append(await producer.send(i.to_bytes(8, "big") + b"x" * 1000))
                except StorageFullError as exc:
                    error = exc
                    break
            assert error is not None, "the disk never filled up"
            assert error.retriable
            assert producer_health() == health_pb2.HealthCheckResponse.NOT_SERVING
            # Reads go on while full: everything acked is delivered.
            consumer = await client.consumer(
                topic, subscription="while-full", initial_position=InitialPosition.EARLIEST
            ).open()
            seen = []
            for _ in acked:
                message = await consumer.receive(timeout_ms=10_000)
                seen.append(message.offset)
                await consumer.ack(message)
            await consumer.close()
            assert seen == acked
            filler.unlink()
            resumed: list[int] = []
            deadline = time.monotonic() + 20
            while not resumed:  # publishing resumes by itself, with the same producer
                try:
                    resumed.append(await producer.send(b"after"))
                except StorageFullError:
                    assert time.monotonic() < deadline, "publishing did not resume"
                    await asyncio.sleep(0.2)
            await eventually(lambda: producer_health() == health_pb2.HealthCheckResponse.SERVING, timeout_s=5)
            await producer.close()
            return acked, error, resumed

    try:
        acked, error, resumed = asyncio.run(fill_then_free())
    finally:
        health.close()
    text = log_text(broker)
    assert text.count("appends refused until space is freed") == 1  # once per episode, per topic
    assert "Traceback" not in text

    broker.stop()
    broker.start()  # no corruption across a restart: every acked message, once, in order

    async def read_all() -> list[int]:
        async with DanubeClient([broker.address]) as client:
            consumer = await client.consumer(
                topic, subscription="after-restart", initial_position=InitialPosition.EARLIEST
            ).open()
            offsets = []
            for _ in range(len(acked) + len(resumed)):
                message = await consumer.receive(timeout_ms=10_000)
                offsets.append(message.offset)
                await consumer.ack(message)
            await consumer.close()
            return offsets

    assert asyncio.run(read_all()) == acked + resumed


# ---------------------------------------------------------------------------- memory


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_consumer_that_never_reads_cannot_grow_broker_memory(start_broker: Callable[..., BrokerProcess]) -> None:
    """A consumer asks for a window of 2**32 - 1 and never reads its stream while 96 MiB are
    published: the broker caps the window and the bytes queued for the stream."""
    broker = start_broker(extra_args=["--max-consumer-buffer-bytes", str(4 * 1024 * 1024)])
    topic = "/default/huge_window"
    stubs = Stubs(broker.address)
    try:
        pid = create_producer(stubs, topic)
        consumer_id = subscribe(stubs, topic, "lazy", receiver_queue_size=2**32 - 1)
        stream = stubs.consumer.Receive(pb.ReceiveRequest(consumer_id=consumer_id))  # opened, never read
        baseline = _rss_mib(broker.pid)
        payload = b"p" * 8192
        for _ in range(96):
            stubs.producer.SendBatch(batch_request(pid, *[payload] * 128))  # 1 MiB per batch
        # The broker queues for the stream whatever it will within this second; what is
        # asserted is that its memory does NOT grow, so there is no state to poll for.
        time.sleep(1.0)
        growth = _rss_mib(broker.pid) - baseline
        stream.cancel()
    finally:
        stubs.close()
    assert growth < 40, f"broker RSS grew {growth:.1f} MiB for 96 MiB published to a non-reading consumer"


# ---------------------------------------------------------------------------- schemas


def test_bad_schemas_are_refused_and_not_retried(start_broker: Callable[..., BrokerProcess]) -> None:
    broker = start_broker()
    stubs = Stubs(broker.address)
    try:
        for raw in ("[" * 100_000 + "]" * 100_000, '{"type": "record", "name": "r", "fields": []' + " " * (300 * 1024) + "}"):
            with pytest.raises(grpc.RpcError) as caught:
                stubs.schemas.RegisterSchema(pb.RegisterSchemaRequest(subject="s", schema_type=pb.AVRO, raw_schema=raw))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error_class(caught.value) == "InvalidSchemaError"
    finally:
        stubs.close()
    assert "RecursionError" not in log_text(broker)

    async def client_gives_up_at_once() -> float:
        async with DanubeClient([broker.address], metadata_retries=5, retry_backoff_ms=1000) as client:
            from danube_pipeline.client import AvroSchema

            started = time.monotonic()
            with pytest.raises(InvalidSchemaError):
                await client.producer(
                    "/default/bad_schema", producer_name="p", schema=AvroSchema("s", "{" * 1000 + "}" * 1000)
                ).open()
            return time.monotonic() - started

    assert asyncio.run(client_gives_up_at_once()) < 1.0  # not retried (5 retries would take 5 s)


# ---------------------------------------------------------------------------- metadata growth


def test_closed_producers_expire_and_idle_subscriptions_unload(
    start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str]
) -> None:
    broker = start_broker(extra_args=["--closed-producer-ttl-s", "2", "--subscription-idle-s", "1"])
    topic = "/default/churn"
    prefix = keys.topic_producers_prefix(TopicName.parse(topic))

    async def churn() -> None:
        async with DanubeClient([broker.address]) as client:
            for round_ in range(2):
                producers = [
                    await client.producer(topic, producer_name=f"p{round_}-{i}").open() for i in range(100)
                ]
                for producer in producers:
                    await producer.close()
            consumer = await client.consumer(topic, subscription="idle").open()
            await consumer.close()

    asyncio.run(churn())
    eventually_sync(lambda: not etcd_keys(etcd_endpoints, prefix), timeout_s=15, what="closed producer keys expired")
    eventually_sync(lambda: "subscription idle unloaded" in log_text(broker), timeout_s=10, what="idle subscription unloaded")
    # The subscription itself is durable: its keys stay.
    assert keys.topic_subscription(TopicName.parse(topic), "idle") in etcd_keys(etcd_endpoints)
