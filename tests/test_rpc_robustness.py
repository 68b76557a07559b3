"""RPC robustness found in issue 21 (#15, and the ``Receive`` item of #12), against a real
broker process and the session etcd:

* ``Admin.DescribeTopic`` answers for a topic whose unavailable ranges (``docs/etcd-layout.md``
  §5.5) include a range with ``last_written = -1`` (its broker returned having written none of
  its offsets) or an unreadable record: one range record never fails the whole call.
* A client cancelling its ``Receive`` stream while the broker writes deliveries leaves no error
  in the broker's log (the etcd deadline scope of ``broker/rpc/status.py`` is left in the
  context that opened it).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from danube_pipeline.client import DanubeClient
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.errors import DanubeError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

from helpers import eventually, stays

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

LOG_ERRORS = ("unexpected error in RPC", "was created in a different Context", "Task exception was never retrieved")
"""Lines a broker log must never hold after a client cancels a stream."""


async def test_describe_topic_answers_with_a_range_whose_broker_wrote_nothing_and_a_bad_record(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """A range whose broker returned with an empty WAL carries ``last_written = -1`` in etcd
    (``record_last_written`` with ``next_offset - 1``), which a ``uint64`` cannot hold: the
    answer says so with ``nothing_written`` and the client sees ``-1`` again. A record with a
    field of the wrong type is left out of the answer instead of failing it."""
    broker = start_broker()
    topic = "/default/ranges"
    name = TopicName.parse(topic)
    async with DanubeClient([broker.address]) as client:
        await client.admin.create_topic(topic)
        async with client.producer(topic, producer_name="p") as producer:
            await producer.send(b"one")
        async with await MetadataStore.connect(etcd_endpoints) as meta:
            for record in (
                {"start_offset": 0, "end_offset": 999, "broker_id": 7, "since": 1, "last_written": -1,
                 "abandoned": False},
                {"start_offset": 1000, "end_offset": 1999, "broker_id": 8, "since": 2, "last_written": 1500,
                 "abandoned": False},
                {"start_offset": 2000, "end_offset": "not a number", "broker_id": 9, "since": 3},
                {"start_offset": 3000, "end_offset": 3999, "broker_id": 10, "since": 4},
            ):  # fmt: skip
                await meta.put(keys.unavailable_range(name, int(record["start_offset"])), record)  # type: ignore[call-overload]

        outcome: list[Any] = []

        async def described() -> bool:
            try:
                description = await client.admin.describe_topic(topic)
            except DanubeError as exc:
                outcome.append(exc)
                return True
            outcome.append(description)
            return len(description.unavailable_ranges) == 3

        await eventually(described, timeout_s=15, what="DescribeTopic shows the ranges written into etcd")
        answer = outcome[-1]
        assert not isinstance(answer, DanubeError), f"DescribeTopic failed: {answer!r}"
        assert [(u.start_offset, u.end_offset, u.broker_id, u.last_written) for u in answer.unavailable_ranges] == [
            (0, 999, 7, -1),
            (1000, 1999, 8, 1500),
            (3000, 3999, 10, None),
        ]
        # The raw answer: the -1 is carried by the flag, ``last_written`` stays unset.
        async with grpc.aio.insecure_channel(broker.address) as channel:
            raw = await pb_grpc.AdminStub(channel).DescribeTopic(pb.DescribeTopicRequest(topic=topic), timeout=10)
        first = raw.unavailable_ranges[0]
        assert first.nothing_written and not first.HasField("last_written")
        assert not raw.unavailable_ranges[1].nothing_written
    text = broker.log_path.read_text(encoding="utf-8", errors="replace")
    assert "unexpected error in RPC" not in text
    left_out = [line for line in text.splitlines() if "left out of DescribeTopic" in line]
    assert len(left_out) == 1 and "/default/ranges" in left_out[0] and "not a number" in left_out[0], left_out


async def test_cancelling_receive_mid_delivery_leaves_no_error_in_the_broker_log(
    start_broker: Callable[..., BrokerProcess],
) -> None:
    """Consumers open ``Receive`` (with and without a deadline) on a topic with messages flowing
    and cancel it after the first delivery, while the broker still has more to write."""
    broker = start_broker()
    topic = "/default/cancelled"
    async with DanubeClient([broker.address]) as client:
        await client.admin.create_topic(topic)
        stop = asyncio.Event()

        async def flow() -> None:
            async with client.producer(topic, producer_name="flow", max_batch_messages=10) as producer:
                i = 0
                while not stop.is_set():
                    await producer.send(b"x" * 512 + str(i).encode())
                    i += 1

        producing = asyncio.create_task(flow())
        try:
            async with grpc.aio.insecure_channel(broker.address) as channel:
                consumer = pb_grpc.ConsumerServiceStub(channel)
                for round_ in range(6):
                    subscribed = await consumer.Subscribe(pb.SubscribeRequest(
                        topic=topic, subscription=f"s{round_}", consumer_name="c", request_id=uuid.uuid4().hex,
                        initial_position=pb.EARLIEST, receiver_queue_size=1000,
                    ), timeout=10)  # fmt: skip
                    timeout = 30.0 if round_ % 2 else None
                    call = consumer.Receive(pb.ReceiveRequest(consumer_id=subscribed.consumer_id), timeout=timeout)
                    async for _ in call:
                        break
                    call.cancel()
                    assert await call.code() == grpc.StatusCode.CANCELLED
        finally:
            stop.set()
            await producing

    def clean() -> bool:
        text = broker.log_path.read_text(encoding="utf-8", errors="replace")
        return not any(line in text for line in LOG_ERRORS)

    # The broker ends the cancelled handlers in the background: nothing may appear meanwhile.
    await stays(clean, for_s=3, interval_s=0.1, what="no RPC error after cancelled Receive streams")


BURST = 3000
"""Unary calls sent at once: three times gRPC core's default backlog of calls not yet picked
up by the server (``grpc.server.max_pending_requests``, 1,000), the hard limit included."""


async def test_a_burst_of_calls_beyond_grpcs_default_backlog_is_served_not_cancelled(
    start_broker: Callable[..., BrokerProcess],
) -> None:
    """grpc.aio's server picks incoming calls up one at a time on the event loop; beyond its
    backlog limit gRPC core rejects the calls still waiting, at random, and the client sees
    ``CANCELLED`` for a call the broker never ran. With gRPC's defaults, 1,000 consumers closing
    at once lost some of their last ``Ack`` and ``CloseConsumer`` calls that way. The broker
    raises the limit (``broker/rpc/server.py``), so such a burst is served."""
    broker = start_broker()
    async with grpc.aio.insecure_channel(broker.address) as channel:
        stub = pb_grpc.DiscoveryStub(channel)
        results = await asyncio.gather(
            *(stub.ClusterMetadata(pb.ClusterMetadataRequest(), timeout=120) for _ in range(BURST)),
            return_exceptions=True,
        )
    failed = [r for r in results if isinstance(r, BaseException)]
    codes = sorted({r.code().name if isinstance(r, grpc.aio.AioRpcError) else type(r).__name__ for r in failed})
    assert not failed, f"{len(failed)} of {BURST} calls failed: {codes}"
