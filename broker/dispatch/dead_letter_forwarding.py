"""Forwarding a dead-letter batch to the broker that owns the dead-letter topic.

A subscription's dead-letter topic is a topic like any other: the leader may assign it to
another broker than the source topic's owner. The source topic's owner then publishes the
dead-letter batch (:mod:`broker.dispatch.dead_letter_topic`) the way a client would, over the
``danube.v1.ProducerService`` RPCs:

1. ``CreateProducer`` on the dead-letter topic, under the batch's deterministic producer name
   (:func:`~broker.dispatch.dead_letter_topic.dead_letter_producer_name`);
2. ``SendBatch`` with the batch rebuilt for the producer id the owner assigned
   (:func:`~broker.dispatch.dead_letter_topic.dead_letter_batch_for_producer`: same records, same name,
   base sequence 0);
3. ``CloseProducer``.

The owner's idempotent-produce check (:mod:`broker.topics.producer_sequences`: producer name plus sequence,
Kafka's KIP-98) answers a repeat of step 2 (after a crash of the forwarding broker, or a lost
answer) with the offsets the batch was written at, so the dead-letter topic holds it once.
A failed call becomes its typed :class:`~danube_pipeline.errors.DanubeError` in the one place
that maps gRPC statuses (:func:`danube_pipeline.client.status.rpc_errors`); the subscription
then keeps the message waiting and tries again later.
"""

from __future__ import annotations

import logging
import uuid

import grpc

from danube_pipeline.client.status import rpc_errors
from danube_pipeline.errors import DanubeError
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

from broker.config import BrokerConfig
from broker.dispatch.dead_letter_topic import dead_letter_batch_for_producer
from broker.rpc.tls import broker_channel

log = logging.getLogger(__name__)

FORWARD_TIMEOUT_S = 10.0
"""Deadline of each forwarding RPC, in seconds."""


async def forward_dead_letter(
    address: str,
    topic_path: str,
    producer_name: str,
    batch: bytes,
    *,
    timeout_s: float = FORWARD_TIMEOUT_S,
    config: BrokerConfig | None = None,
) -> tuple[int, int]:
    """Publish a dead-letter batch on the broker at ``address``, which owns ``topic_path``.

    Args:
        address: ``host:port`` of the dead-letter topic's owner (its ``internal_addr`` when it
            serves one, else its ``advertised_addr``).
        topic_path: the dead-letter topic, ``/ns/topic``; created there if needed.
        producer_name: the batch's producer name (deterministic per source message).
        batch: the one-record dead-letter batch (producer id 0, base sequence 0).
        timeout_s: deadline of each RPC, in seconds.
        config: this broker's configuration: under TLS the call is mutual TLS
            (:func:`broker.rpc.tls.broker_channel`); ``None`` calls in plaintext.

    Returns:
        ``(first_offset, last_offset)`` in the dead-letter topic once durable there; for a
        batch written already, the offsets it was written at.

    Raises:
        DanubeError: what the owner answered, typed (``NotServedHereError`` when the topic
            moved meanwhile); ``BrokerUnavailableError`` when it could not be reached.
        MalformedRequestError: ``batch`` does not parse.
        OSError: a TLS file of ``config`` cannot be read.
    """
    channel_cm = grpc.aio.insecure_channel(address) if config is None else broker_channel(config, address)
    async with channel_cm as channel:
        stub = pb_grpc.ProducerServiceStub(channel)
        with rpc_errors(address):
            created = await stub.CreateProducer(
                pb.CreateProducerRequest(topic=topic_path, producer_name=producer_name, request_id=uuid.uuid4().hex),
                timeout=timeout_s,
            )
        producer_id = created.producer_id
        try:
            rebuilt = dead_letter_batch_for_producer(batch, producer_id)
            with rpc_errors(address):
                sent = await stub.SendBatch(pb.SendBatchRequest(producer_id=producer_id, batch=rebuilt), timeout=timeout_s)
        finally:
            try:
                with rpc_errors(address):
                    await stub.CloseProducer(pb.CloseProducerRequest(producer_id=producer_id), timeout=timeout_s)
            except DanubeError as exc:  # logged only: the send's outcome is what counts
                log.info("dead-letter producer %d (%s) on %s at %s: close failed (%s)",
                         producer_id, producer_name, topic_path, address, exc)
    return sent.first_offset, sent.last_offset


__all__ = ["FORWARD_TIMEOUT_S", "forward_dead_letter"]
