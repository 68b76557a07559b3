"""The fuzzed requests' target: :class:`BrokerTarget` sends requests to a real broker over raw
gRPC (generic multi-callables, so garbage bytes go out as they are), and :func:`check_request`
requires a status in :data:`ALLOWED_CODES` and a broker still serving afterwards."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from danube_pipeline.dev.fuzzing.rpcs import Known, Rpc
from danube_pipeline.errors import bounded
from danube_pipeline.format.batches import BatchBuilder, batch_records
from danube_pipeline.proto import danube_pb2 as pb

ALLOWED_CODES = frozenset({
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OUT_OF_RANGE,
})
"""Statuses a broker may answer any request with; never UNKNOWN, INTERNAL, DEADLINE_EXCEEDED..."""

OPEN_ENDED = frozenset({"/danube.v1.ConsumerService/Receive"})
"""Server streams that stay open while served: a call still open after ``open_wait_s`` counts as
accepted (:meth:`BrokerTarget.call` cancels it)."""


@dataclass(frozen=True)
class Answer:
    """How the broker answered a call; ``open`` for an open-ended stream we cancelled."""

    code: grpc.StatusCode
    details: str
    open: bool = False


def _serialize(message: Message) -> bytes:
    data: bytes = message.SerializeToString()
    return data


class BrokerTarget:
    """Raw gRPC calls to a real broker at ``address``; ``alive`` reports whether its process runs."""

    def __init__(self, address: str, *, alive: Callable[[], bool], timeout_s: float = 5.0, open_wait_s: float = 0.3) -> None:
        self.address = address
        self.alive = alive
        self.timeout_s = timeout_s
        self.open_wait_s = open_wait_s
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.known = Known()
        self._serial = 0

    def close(self) -> None:
        self.channel.close()

    def _unary(self, path: str, request: Message, response: type[Message]) -> Any:
        call = self.channel.unary_unary(path, request_serializer=_serialize, response_deserializer=response.FromString)
        return call(request, timeout=self.timeout_s)

    def _batch(self, producer_id: int, *payloads: bytes) -> bytes:
        builder = BatchBuilder(time.time_ns() // 1000)
        for p in payloads:
            builder.append(p, timestamp_us=builder.first_timestamp_us, attributes={"k": "v"})
        return builder.build(producer_id=producer_id, producer_name=self.known.producer_name)

    def _producer(self, topic: str) -> int:
        request = pb.CreateProducerRequest(topic=topic, producer_name=self.known.producer_name)
        return int(self._unary("/danube.v1.ProducerService/CreateProducer", request, pb.CreateProducerResponse).producer_id)

    def _send(self, producer_id: int, *payloads: bytes) -> Any:
        request = pb.SendBatchRequest(producer_id=producer_id, batch=self._batch(producer_id, *payloads))
        return self._unary("/danube.v1.ProducerService/SendBatch", request, pb.SendBatchResponse)

    def _subscribe(self, topic: str, subscription: str) -> int:
        request = pb.SubscribeRequest(topic=topic, subscription=subscription, subscription_type=pb.SHARED,
                                      consumer_name=f"{subscription}-consumer", initial_position=pb.EARLIEST)
        return int(self._unary("/danube.v1.ConsumerService/Subscribe", request, pb.SubscribeResponse).consumer_id)

    def prepare(self, topic: str = "/fuzz/known") -> Known:
        """Create what fuzzed requests may name: a topic with a producer, a sealed segment and
        more records after it, a registered schema and a consumer on a subscription."""
        k = self.known
        pid = self._producer(topic)
        self._send(pid, b"a", b"b")
        sealed = self._unary("/danube.v1.Admin/SealActiveSegment", pb.SealActiveSegmentRequest(topic=topic),
                             pb.SealActiveSegmentResponse)
        last = self._send(pid, b"c")
        schema = self._unary("/danube.v1.SchemaRegistry/RegisterSchema",
                             pb.RegisterSchemaRequest(subject="fuzz-subject", raw_schema='"bytes"'), pb.RegisterSchemaResponse)
        k.topics, k.producer_ids, k.consumer_ids = [topic], [pid], [self._subscribe(topic, "fuzz-sub")]
        k.subscriptions, k.schema_ids, k.subjects = ["fuzz-sub"], [schema.schema_id], ["fuzz-subject"]
        k.offsets = sorted({0, 1, sealed.segment.start_offset, sealed.segment.end_offset + 1, last.last_offset})
        return k

    def call(self, rpc: Rpc, request: Sequence[Message] | Sequence[bytes]) -> Answer:
        """Send ``request`` (messages, or raw bytes as they are) on ``rpc`` and read the whole answer.

        Every call has a deadline of ``timeout_s``; an open-ended stream (:data:`OPEN_ENDED`)
        still open after ``open_wait_s`` is cancelled and answered ``Answer(OK, open=True)``.
        """
        ser = None if any(isinstance(r, bytes) for r in request) else _serialize
        cancelled = threading.Event()
        timer: threading.Timer | None = None
        try:
            if not rpc.client_streaming and not rpc.server_streaming:
                self.channel.unary_unary(rpc.path, request_serializer=ser)(request[0], timeout=self.timeout_s)
                return Answer(grpc.StatusCode.OK, "")
            if rpc.client_streaming and not rpc.server_streaming:
                self.channel.stream_unary(rpc.path, request_serializer=ser)(iter(request), timeout=self.timeout_s)
                return Answer(grpc.StatusCode.OK, "")
            if rpc.client_streaming:
                call = self.channel.stream_stream(rpc.path, request_serializer=ser)(iter(request), timeout=self.timeout_s)
            else:
                call = self.channel.unary_stream(rpc.path, request_serializer=ser)(request[0], timeout=self.timeout_s)
            if rpc.path in OPEN_ENDED:
                def stop() -> None:
                    cancelled.set()
                    call.cancel()

                timer = threading.Timer(self.open_wait_s, stop)
                timer.start()
            for _ in call:
                pass
            return Answer(grpc.StatusCode.OK, "")
        except grpc.RpcError as exc:
            if cancelled.is_set() and exc.code() == grpc.StatusCode.CANCELLED:
                return Answer(grpc.StatusCode.OK, f"open after {self.open_wait_s} s", open=True)
            return Answer(exc.code(), exc.details() or "")
        finally:
            if timer is not None:
                timer.cancel()

    def assert_serving(self) -> None:
        """The process runs and answers a health check SERVING."""
        assert self.alive(), "the broker process exited"
        status = self.health.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s).status
        assert status == health_pb2.HealthCheckResponse.SERVING, f"health: {status}"

    def assert_produce_consume(self) -> None:
        """A producer on a new topic publishes a batch and a new consumer receives it back."""
        self.assert_serving()
        self._serial += 1
        topic, payload = f"/fuzz/alive-{self._serial}", f"alive {self._serial}".encode()
        pid = self._producer(topic)
        sent = self._send(pid, payload)
        cid = self._subscribe(topic, "alive")
        receive = self.channel.unary_stream("/danube.v1.ConsumerService/Receive", request_serializer=_serialize,
                                            response_deserializer=pb.Deliveries.FromString)
        stream = receive(pb.ReceiveRequest(consumer_id=cid), timeout=10)
        try:
            deliveries = next(iter(stream))
            got = [r for d in deliveries.batches for r in batch_records(d.batch)]
            assert [(r.offset, r.payload) for r in got] == [(sent.first_offset, payload)], got
            # acked while the stream is open: the broker refuses acks of a consumer whose stream ended
            self._unary("/danube.v1.ConsumerService/Ack",
                        pb.AckRequest(consumer_id=cid, offsets=[sent.first_offset]), pb.AckResponse)
        finally:
            stream.cancel()
        self._unary("/danube.v1.ConsumerService/CloseConsumer", pb.CloseConsumerRequest(consumer_id=cid),
                    pb.CloseConsumerResponse)
        self._unary("/danube.v1.ProducerService/CloseProducer", pb.CloseProducerRequest(producer_id=pid),
                    pb.CloseProducerResponse)


def check_request(target: BrokerTarget, rpc: Rpc, request: Sequence[Message] | Sequence[bytes]) -> None:
    """The broker answers ``request`` on ``rpc`` with an allowed status and keeps serving."""
    answer = target.call(rpc, request)
    assert answer.code in ALLOWED_CODES, f"{rpc.path} answered {answer.code.name}: {bounded(answer.details, 300)}"
    target.assert_serving()
