"""A slow disk under a real broker: its lease keep-alives go on while a group commit syncs, and
an owner cut off from etcd during a slow sync does not acknowledge the batch afterwards.

Real etcd and real broker processes. Broker A's WAL syncs are slowed by the
``wal.before_fdatasync`` fault point armed with ``delay:3`` (a slow disk cannot be made to
order), longer than its lease TTL (2 s); A reaches etcd through the cuttable proxy of
``tests/test_owner_self_fencing.py``, its producer reaches it directly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest
from grpc import aio

from danube_pipeline import faults
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

from helpers import eventually
from test_owner_self_fencing import CuttableProxy, one_message, owner_of

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

DELAY_S = 3.0


async def test_slow_fdatasync_keeps_the_lease_and_an_owner_cut_off_meanwhile_does_not_ack(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    args = ["--lease-ttl-s", "2"]
    start_broker(extra_args=args)  # the leader, reachable all along
    slow = faults.environment({faults.WAL_BEFORE_FDATASYNC: f"{faults.DELAY}:{DELAY_S}"})
    async with CuttableProxy(etcd_endpoints[0]) as proxy:
        a = await asyncio.to_thread(start_broker, etcd_endpoints=[proxy.address], extra_args=args, env=slow)
        async with await MetadataStore.connect(etcd_endpoints) as meta, aio.insecure_channel(a.address) as channel:
            producers = pb_grpc.ProducerServiceStub(channel)
            admin = pb_grpc.AdminStub(channel)
            names = [TopicName.parse(f"/default/slow{i}") for i in range(2)]
            for name in names:
                await admin.CreateTopic(pb.CreateTopicRequest(topic=name.path), timeout=10)

            async def assigned() -> bool:
                return all([await owner_of(meta, n) is not None for n in names])

            await eventually(assigned, timeout_s=10, what="both topics assigned")
            on_a = [n for n in names if await owner_of(meta, n) == a.broker_id]
            assert on_a, "no topic assigned to A"
            name = on_a[0]
            created = await producers.CreateProducer(
                pb.CreateProducerRequest(topic=name.path, producer_name="p"), timeout=10
            )
            pid = created.producer_id
            registration = await meta.get(keys.broker_register(a.broker_id))
            assert registration is not None

            # 1. A write slower than the lease TTL: the keep-alives go on meanwhile (before, a
            # small commit was synced on the event loop, which stalled them).
            started = time.monotonic()
            first = await producers.SendBatch(pb.SendBatchRequest(producer_id=pid, batch=one_message(pid)), timeout=15)
            assert time.monotonic() - started >= DELAY_S
            assert first.first_offset == 0
            still = await meta.get(keys.broker_register(a.broker_id))
            assert still is not None and still.create_revision == registration.create_revision, "A lost its lease"
            assert await owner_of(meta, name) == a.broker_id

            # 2. Cut off from etcd during the slow write: when the fdatasync returns, A is past
            # its self-fencing deadline and must not acknowledge (it acked, before).
            async def second() -> pb.SendBatchResponse:
                response: pb.SendBatchResponse = await producers.SendBatch(
                    pb.SendBatchRequest(producer_id=pid, batch=one_message(pid)), timeout=15
                )
                return response

            send = asyncio.create_task(second())
            await asyncio.sleep(0.3)
            proxy.cut = True
            with pytest.raises(grpc.RpcError) as refused:
                await send
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value
            trailing = dict(refused.value.trailing_metadata() or ())
            assert "NotServedHereError" in trailing.values(), trailing
            proxy.mend()
