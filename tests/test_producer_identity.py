"""The idempotent producer's identity (``broker/topics/producer_identity.py``,
``docs/etcd-layout.md`` §5.6.1), against real etcd and real broker processes.

* A second producer opened under the same name bumps the epoch in etcd and fences the first:
  the first's next send fails with :class:`ProducerFencedError`, the second's messages are
  stored once.
* Sequences start at 0 per identity (read from the batch headers stored), the header carries
  ``epoch << 48 | producer id``, and a new instance starts at 0 again under the next epoch,
  whatever the clock says (the clock step is faked in the client process: the machine's clock
  is shared and cannot be stepped for a test).
* A producer whose broker is SIGKILLed and restarted re-creates its producer under the same
  identity and resumes: every message is stored exactly once.
* A move hands the whole in-flight window over: 8 batches written on the first owner and
  resent to the next one (as a client does when the move cut its answers off) are each
  answered with their first offsets, and written once.
* Request-id deduplication of ``CreateProducer`` is scoped by the topic and the producer name.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.errors import ProducerFencedError
from danube_pipeline.format.batches import BatchBuilder, BatchHeader, parse_header
from danube_pipeline.format.records import SegmentHeader
from danube_pipeline.format.segments import iter_stored_batches
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


async def read_payloads(client: DanubeClient, topic: str, subscription: str, count: int) -> list[tuple[int, bytes]]:
    """``count`` messages from the earliest position, then a short wait that must find no more."""
    out: list[tuple[int, bytes]] = []
    async with client.consumer(topic, subscription=subscription, initial_position=InitialPosition.EARLIEST) as consumer:
        for _ in range(count):
            message = await consumer.receive(timeout_ms=15_000)
            out.append((message.offset, message.payload))
            await consumer.ack(message)
        with pytest.raises(TimeoutError):
            await consumer.receive(timeout_ms=500)
    return out


async def stored_headers(client: DanubeClient, topic: str) -> list[BatchHeader]:
    """The headers of every batch of ``topic`` on its owner (its active segment sealed first)."""
    await client.admin.seal_active_segment(topic)
    headers: list[BatchHeader] = []
    for segment in await client.admin.list_sealed_segments(topic):
        data = await client.admin.read_segment_bytes(topic, segment.start_offset)
        version = SegmentHeader.decode(data).format_version
        headers += [parse_header(b.data) for _pos, b in iter_stored_batches(data, format_version=version)]
    return headers


async def test_a_second_producer_with_the_same_name_fences_the_first(
    start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str]
) -> None:
    broker = start_broker()
    topic = "/default/fenced"
    async with DanubeClient([broker.address]) as first_client, DanubeClient([broker.address]) as second_client:
        async with first_client.producer(topic, producer_name="twin") as first:
            assert [await first.send(f"first-{i}".encode()) for i in range(3)] == [0, 1, 2]
            async with second_client.producer(topic, producer_name="twin") as second:
                assert second.idempotent_producer_id == first.idempotent_producer_id
                assert second.producer_epoch == first.producer_epoch + 1
                assert [await second.send(f"second-{i}".encode()) for i in range(3)] == [3, 4, 5]
                with pytest.raises(ProducerFencedError) as fenced:
                    await first.send(b"first-late")
                assert (fenced.value.producer_epoch, fenced.value.current_epoch) == (
                    first.producer_epoch, second.producer_epoch
                )
                assert not fenced.value.retriable
                with pytest.raises(ProducerFencedError):  # and every later send
                    first.send_nowait(b"first-later")
                assert await second.send(b"second-3") == 6
        async with await MetadataStore.connect(etcd_endpoints) as meta:
            kv = await meta.get(keys.producer_identity(TopicName.parse(topic), "twin"))
        assert kv is not None and kv.value == {"producer_id": second.idempotent_producer_id, "epoch": second.producer_epoch}
        log = await read_payloads(second_client, topic, "check", 7)
    expected = [f"first-{i}".encode() for i in range(3)] + [f"second-{i}".encode() for i in range(4)]
    assert log == list(enumerate(expected))


async def test_sequences_begin_at_zero_per_identity_whatever_the_clock(
    start_broker: Callable[..., BrokerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = start_broker()
    topic = "/default/from-zero"
    async with DanubeClient([broker.address]) as client:
        async with client.producer(topic, producer_name="counter", max_batch_messages=5, linger_ms=50) as producer:
            await asyncio.gather(*(producer.send_nowait(f"a{i}".encode()) for i in range(12)))
            first_identity = (producer.idempotent_producer_id, producer.producer_epoch)
        # A fake clock step (the machine's clock is shared): the client's wall clock one hour back.
        real_time_ns = time.time_ns
        monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() - 3_600 * 10**9)
        async with client.producer(topic, producer_name="counter", max_batch_messages=5, linger_ms=50) as producer:
            offsets = await asyncio.gather(*(producer.send_nowait(f"b{i}".encode()) for i in range(7)))
            second_identity = (producer.idempotent_producer_id, producer.producer_epoch)
        monkeypatch.undo()
        assert sorted(offsets) == list(range(12, 19))  # none refused after the clock step
        assert second_identity == (first_identity[0], first_identity[1] + 1)
        headers = await stored_headers(client, topic)
    by_instance: dict[int, list[tuple[int, int]]] = {}
    for header in headers:
        by_instance.setdefault(header.producer_id, []).append((header.base_sequence, header.record_count))
    pid = first_identity[0]
    assert set(by_instance) == {first_identity[1] << 48 | pid, second_identity[1] << 48 | pid}
    for batches in by_instance.values():
        assert batches[0][0] == 0  # sequences begin at 0 per identity, and are contiguous
        assert [seq for seq, _count in batches] == [sum(c for _s, c in batches[:i]) for i in range(len(batches))]
    assert [sum(c for _s, c in by_instance[first_identity[1] << 48 | pid])] == [12]


async def test_a_producer_resumes_without_duplicates_after_its_broker_is_killed_and_restarted(
    start_broker: Callable[..., BrokerProcess],
) -> None:
    broker = start_broker()
    address = broker.address
    topic = "/default/resumed"
    sent: list[bytes] = []
    async with DanubeClient([address], metadata_retries=40, retry_backoff_ms=250) as client:
        async with client.producer(topic, producer_name="survivor", max_batch_messages=20) as producer:
            assert await producer.send(b"warm-up") == 0
            sent.append(b"warm-up")
            identity = (producer.idempotent_producer_id, producer.producer_epoch)
            session = producer.producer_id

            def restart() -> None:
                broker.kill()  # SIGKILL: batches are written and unanswered when it dies
                broker.port = int(address.rsplit(":", 1)[1])
                broker.start()

            restarting = asyncio.get_running_loop().run_in_executor(None, restart)
            futures: list[asyncio.Future[int]] = []
            while not restarting.done() or len(futures) < 1_000:
                for _ in range(20):
                    payload = f"m{len(futures)}".encode()
                    futures.append(producer.send_nowait(payload))
                    sent.append(payload)
                await asyncio.sleep(0.005)  # pacing: keep queueing while the broker restarts
            await restarting
            await asyncio.wait_for(producer.flush(), 30)
            offsets = [f.result() for f in futures]
            assert producer.producer_id != session  # re-created on the restarted broker ...
            assert (producer.idempotent_producer_id, producer.producer_epoch) == identity  # ... as the same instance
        assert sorted(offsets) == list(range(1, len(futures) + 1))
        log = await read_payloads(client, topic, "check", len(sent))
    assert [p for _o, p in log] == sent  # each once, in order


def _batch(header_id: int, name: str, base_sequence: int, count: int) -> bytes:
    builder = BatchBuilder(1)
    for i in range(count):
        builder.append(f"{name}-{base_sequence + i}".encode(), timestamp_us=1)
    return builder.build(producer_id=header_id, producer_name=name, base_sequence=base_sequence)


async def test_a_move_hands_the_whole_in_flight_window_over(
    start_broker: Callable[..., BrokerProcess],
) -> None:
    first = start_broker()
    topic = "/default/window"
    window = 8  # the client's default max_in_flight_batches

    async def create(stub: pb_grpc.ProducerServiceStub, pid: int = 0, epoch: int = 0) -> pb.CreateProducerResponse:
        request = pb.CreateProducerRequest(
            topic=topic, producer_name="window", idempotent=True, idempotent_producer_id=pid, producer_epoch=epoch
        )
        response: pb.CreateProducerResponse = await stub.CreateProducer(request, timeout=10)
        return response

    async def send_all(stub: pb_grpc.ProducerServiceStub, created: pb.CreateProducerResponse) -> list[tuple[int, int]]:
        header_id = created.producer_epoch << 48 | created.idempotent_producer_id
        answers = []
        for n in range(window):
            request = pb.SendBatchRequest(producer_id=created.producer_id, batch=_batch(header_id, "window", 3 * n, 3))
            answer = await stub.SendBatch(request, timeout=10)
            answers.append((answer.first_offset, answer.last_offset))
        return answers

    async with grpc.aio.insecure_channel(first.address) as channel:
        created = await create(pb_grpc.ProducerServiceStub(channel))
        written = await send_all(pb_grpc.ProducerServiceStub(channel), created)
    assert written == [(3 * n, 3 * n + 2) for n in range(window)]
    second = start_broker()
    async with DanubeClient([first.address, second.address]) as client:
        assert await client.admin.unload_topic(topic) == 3 * window
        assert (await client.lookup_topic(topic)).broker_id == second.broker_id
        async with grpc.aio.insecure_channel(second.address) as channel:
            stub = pb_grpc.ProducerServiceStub(channel)
            resumed = await create(stub, created.idempotent_producer_id, created.producer_epoch)
            assert (resumed.idempotent_producer_id, resumed.producer_epoch) == (
                created.idempotent_producer_id, created.producer_epoch
            )
            assert await send_all(stub, resumed) == written  # each answered with its first offsets
        assert (await client.admin.describe_topic(topic)).next_offset == 3 * window


async def test_request_ids_are_scoped_by_topic_and_producer_name(
    start_broker: Callable[..., BrokerProcess],
) -> None:
    broker = start_broker()
    async with grpc.aio.insecure_channel(broker.address) as channel:
        stub = pb_grpc.ProducerServiceStub(channel)

        async def create(topic: str, name: str) -> int:
            request = pb.CreateProducerRequest(topic=topic, producer_name=name, request_id="same-id")
            return int((await stub.CreateProducer(request, timeout=10)).producer_id)

        first = await create("/default/scoped-a", "p")
        assert await create("/default/scoped-a", "p") == first  # a retry: the same producer
        others = {await create("/default/scoped-b", "p"), await create("/default/scoped-a", "q")}
        assert first not in others and len(others) == 2
