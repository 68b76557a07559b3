"""An owner cut off from etcd stops acknowledging before its topic can be failed over (issue 21
#4, ``docs/etcd-layout.md`` §1.4, §5.4), and extending a reservation is guarded by its mod
revision (issue 21 #8).

Real etcd and real broker processes: broker A reaches etcd through a TCP proxy of this test
that can be cut (bytes are read and dropped, connections stay open: a network partition, not
a refused connection), while producers still reach A directly. Before the fix A went on
acknowledging offsets of its reserved block after the other broker had taken the topic over.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc import aio

from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.errors import NotServedHereError
from danube_pipeline.format.batches import BatchBuilder
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

from broker.cluster.ownership import Ownership, commit_takeover, plan_takeover

from helpers import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


class CuttableProxy:
    """A TCP proxy to one ``host:port``. While :attr:`cut`, every byte either way is read and
    dropped and new connections are accepted but go nowhere: nothing answers, nothing is
    refused. :meth:`mend` closes every connection, so clients reconnect with clean streams."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self.cut = False
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self.address = ""

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        self._writers.add(writer)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            if not self.cut:
                upstream = await asyncio.open_connection(*self._target)
                self._writers.add(upstream[1])
            pumps = [asyncio.create_task(self._pump(reader, upstream[1] if upstream else None))]
            if upstream is not None:
                pumps.append(asyncio.create_task(self._pump(upstream[0], writer)))
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for pump in pumps:
                pump.cancel()
        except OSError:
            pass
        finally:
            for w in (writer, upstream[1] if upstream else None):
                if w is not None:
                    self._writers.discard(w)
                    w.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter | None) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(65536):
                if dst is not None and not self.cut:
                    dst.write(data)
                    await dst.drain()

    def mend(self) -> None:
        self.cut = False
        for w in list(self._writers):
            w.close()

    async def __aenter__(self) -> CuttableProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.mend()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


def one_message(producer_id: int) -> bytes:
    builder = BatchBuilder(time.time_ns() // 1000)
    builder.append(b"m", timestamp_us=builder.first_timestamp_us)
    return builder.build(producer_id=producer_id, producer_name="p")


async def owner_of(meta: MetadataStore, name: TopicName) -> int | None:
    kvs, _ = await meta.get_prefix(keys.BROKERS_PREFIX)
    suffix = f"/{name.namespace}/{name.topic}"
    for kv in kvs:
        if kv.key.endswith(suffix):
            return int(kv.key[len(keys.BROKERS_PREFIX) :].split("/")[0])
    return None


async def reservation(meta: MetadataStore, name: TopicName) -> values.OffsetReservation | None:
    kv = await meta.get(keys.offset_reservation(name))
    return None if kv is None else values.OffsetReservation.from_json(kv.value)


async def test_an_owner_cut_off_from_etcd_stops_acking_before_the_takeover(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """Broker A owns a topic and loses etcd while its producer still reaches it. The leader
    (broker B) fails A over once A's lease expired and B takes the topic. A, which cannot
    learn any of that, must have stopped acknowledging by then: no offset of A's block is
    acknowledged after the takeover (before the fix: every send until the block ran out)."""
    args = ["--lease-ttl-s", "2"]
    b = start_broker(extra_args=args)  # first: the leader, reachable all along
    async with CuttableProxy(etcd_endpoints[0]) as proxy:
        await _cut_during_takeover(proxy, b, start_broker, etcd_endpoints, args)


async def _cut_during_takeover(
    proxy: CuttableProxy, b: BrokerProcess, start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str],
    args: list[str],
) -> None:
    # Started in a thread: the proxy runs on this event loop while the broker connects.
    a = await asyncio.to_thread(start_broker, etcd_endpoints=[proxy.address], extra_args=args)
    acks: list[tuple[float, int]] = []
    errors: list[str] = []
    async with await MetadataStore.connect(etcd_endpoints) as meta, aio.insecure_channel(a.address) as channel:
        producers = pb_grpc.ProducerServiceStub(channel)
        admin = pb_grpc.AdminStub(channel)
        # The leader gives new topics to the broker with fewer: one of two lands on A.
        names = [TopicName.parse(f"/default/cut{i}") for i in range(2)]
        for name in names:
            await admin.CreateTopic(pb.CreateTopicRequest(topic=name.path), timeout=10)
        owners: dict[str, int | None] = {}

        async def all_assigned() -> bool:
            owners.update({n.path: await owner_of(meta, n) for n in names})
            return None not in owners.values()

        await eventually(all_assigned, timeout_s=10, what="both topics assigned")
        on_a = [n for n in names if owners[n.path] == a.broker_id]
        assert on_a, f"no topic assigned to A: {owners}"
        name = on_a[0]
        created = await producers.CreateProducer(pb.CreateProducerRequest(topic=name.path, producer_name="p"), timeout=10)
        pid = created.producer_id

        async def produce() -> None:
            while True:
                try:
                    request = pb.SendBatchRequest(producer_id=pid, batch=one_message(pid))
                    r = await producers.SendBatch(request, timeout=1)
                    acks.append((time.monotonic(), r.first_offset))
                except grpc.RpcError as exc:
                    errors.append(str(exc.code()))
                    await asyncio.sleep(0.02)

        producing = asyncio.create_task(produce())
        try:
            await eventually(lambda: len(acks) >= 20, timeout_s=10, what="A acknowledges")
            proxy.cut = True
            cut_s = time.monotonic()

            async def taken_over() -> bool:
                res = await reservation(meta, name)
                return res is not None and res.broker_id == b.broker_id

            await eventually(taken_over, timeout_s=20, what="B takes the topic over")
            takeover_s = time.monotonic()
            await asyncio.sleep(2.0)  # A keeps being asked: count what it acknowledges meanwhile
        finally:
            producing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await producing
        res = await reservation(meta, name)
        assert res is not None and res.broker_id == b.broker_id
        a_block_end = res.first_offset - 1  # B started past A's block
        before_cut = [o for t, o in acks if t < cut_s]
        late = [o for t, o in acks if t > takeover_s and o <= a_block_end]
        assert before_cut, "A acknowledged nothing before the cut"
        assert late == [], (
            f"A acknowledged {len(late)} offsets of its block after B took the topic over "
            f"({takeover_s - cut_s:.1f} s after the cut)"
        )
        last_ack_s = max(t for t, o in acks if o <= a_block_end)
        assert last_ack_s < takeover_s


TOPIC = TopicName.parse("/default/extension")


async def test_an_extension_is_guarded_by_the_reservations_mod_revision(etcd_endpoints: list[str]) -> None:
    """Someone else rewrote the reservation since the owner last wrote it, without changing the
    owner epoch (issue 21 #8): the extension must not overwrite it blindly. The owner reads it
    again and goes on only when it is still its own block, else it is fenced."""
    broker_id = 7
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        await meta.put(keys.topic_assignment(broker_id, TOPIC), None)
        plan = await plan_takeover(meta, TOPIC, broker_id, wal_holds_data=False, tiered_end=None)
        own, _ = await commit_takeover(meta, TOPIC, broker_id, plan, 0, block=10, wal_holds_data=False, tiered_end=None)
        assert isinstance(own, Ownership) and own.reserved_end == 9
        # Another writer (an operator, a stale process of another broker) puts a reservation of
        # another broker with a block past ours; the assignment, and so the epoch, is unchanged.
        foreign = values.OffsetReservation(broker_id=99, owner_epoch=1, first_offset=10, end_offset=500)
        await meta.put(keys.offset_reservation(TOPIC), foreign)
        with pytest.raises(NotServedHereError):
            await own.reserve_through(15)
        kept = await reservation(meta, TOPIC)
        assert kept == foreign  # not overwritten
        assert own.fenced



async def test_an_extension_adopts_its_own_reservation_rewritten_unchanged(etcd_endpoints: list[str]) -> None:
    """The reservation's mod revision moved but its value is exactly the owner's own block (a
    write of its own retried after a timeout): the owner adopts the revision and extends."""
    name = TopicName.parse("/default/extension-again")
    broker_id = 7
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        await meta.put(keys.topic_assignment(broker_id, name), None)
        plan = await plan_takeover(meta, name, broker_id, wal_holds_data=False, tiered_end=None)
        own, _ = await commit_takeover(meta, name, broker_id, plan, 0, block=10, wal_holds_data=False, tiered_end=None)
        current = await reservation(meta, name)
        assert current is not None
        await meta.put(keys.offset_reservation(name), current)  # same value, new mod revision
        await own.reserve_through(15)
        extended = await reservation(meta, name)
        assert extended is not None and extended.end_offset == 24 and not own.fenced


async def test_an_owner_whose_lease_expired_resumes_once_it_registers_again_and_still_owns(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """A lone broker loses etcd for longer than its TTL: it refuses appends (retriable), its
    lease expires, nobody takes the topic. Once etcd answers it registers under a new lease,
    confirms with a guarded write that it still owns the topic, and acknowledges again, in
    the same block."""
    async with CuttableProxy(etcd_endpoints[0]) as proxy:
        await _expire_and_come_back(proxy, start_broker, etcd_endpoints)


async def _expire_and_come_back(
    proxy: CuttableProxy, start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str]
) -> None:
    a = await asyncio.to_thread(start_broker, etcd_endpoints=[proxy.address], extra_args=["--lease-ttl-s", "2"])
    name = TopicName.parse("/default/comeback")
    async with await MetadataStore.connect(etcd_endpoints) as meta, aio.insecure_channel(a.address) as channel:
        producers = pb_grpc.ProducerServiceStub(channel)
        created = await producers.CreateProducer(pb.CreateProducerRequest(topic=name.path, producer_name="p"), timeout=10)
        pid = created.producer_id

        async def send() -> int | None:
            try:
                r = await producers.SendBatch(pb.SendBatchRequest(producer_id=pid, batch=one_message(pid)), timeout=1)
                return int(r.first_offset)
            except grpc.RpcError as exc:
                assert exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED), exc
                return None

        assert await send() == 0
        before = await reservation(meta, name)
        register = keys.broker_register(a.broker_id)
        proxy.cut = True

        async def refused() -> bool:
            return await send() is None

        await eventually(refused, timeout_s=5, what="appends refused once the lease is stale")

        async def expired() -> bool:
            return await meta.get(register) is None

        await eventually(expired, timeout_s=10, what="the lease expires in etcd")
        proxy.mend()

        async def acked() -> bool:
            return await send() is not None

        await eventually(acked, timeout_s=15, what="appends resume after registering again")
        assert await owner_of(meta, name) == a.broker_id
        after = await reservation(meta, name)
        assert before is not None and after is not None
        assert (after.broker_id, after.owner_epoch) == (a.broker_id, before.owner_epoch)
        assert after.end_offset == before.end_offset  # the same block, confirmed
        kv, registered = await meta.get(keys.offset_reservation(name)), await meta.get(register)
        assert kv is not None and registered is not None
        assert kv.mod_revision > registered.create_revision  # confirmed after it registered again
