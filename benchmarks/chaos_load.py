"""The workload of ``benchmarks/chaos.py``: keyed producers that record the outcome of every
send (:class:`Ledger`), consumers that run throughout (:class:`LiveConsumer`), and the tiering
loop (:class:`TieringLoop`, also used for the fault "two tiering writers at once").

Every message carries a unique id: ``producer * 10**9 + counter`` as 8 big-endian bytes, then
:data:`MARKER` and padding. The load sends each id once and never resends one itself; a
producer that fails is closed and opened again under the same name and goes on with new ids,
so an id stored twice was written twice by the client library or the broker.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import faults_scenarios as fs
import grpc

from danube_pipeline.client import Consumer, DanubeClient, InitialPosition, Message, Producer, SubscriptionType
from danube_pipeline.error_codec import RemoteError
from danube_pipeline.errors import DanubeError, ProducerClosedError
from danube_pipeline.lake.tiering import tier_sealed_segments
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore

MARKER = b"chaos-v1"
"""Follows the 8-byte id in every payload of the load."""
PAYLOAD_BYTES = 64
"""Payload size: id, marker, padding."""
_PADDING = MARKER + b"\x5a" * (PAYLOAD_BYTES - 8 - len(MARKER))
_UNKNOWN_CODES = {
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
}  # fmt: skip


def payload_of(ident: int) -> bytes:
    """The payload carrying ``ident``."""
    return ident.to_bytes(8, "big") + _PADDING


def ident_of(payload: bytes) -> int | None:
    """The id in a payload of the load, ``None`` for any other payload."""
    if len(payload) != PAYLOAD_BYTES or payload[8:] != _PADDING:
        return None
    return int.from_bytes(payload[:8], "big")


def new_client(addresses: Sequence[str], *, request_timeout_ms: int = 5000, retries: int = 5) -> DanubeClient:
    """An unconnected client bootstrapped to every broker (a restarted one keeps its port)."""
    return DanubeClient(list(addresses), request_timeout_ms=request_timeout_ms, metadata_retries=retries,
                        retry_backoff_ms=100)


def outcome_kind(exc: BaseException) -> str:
    """``failed`` when the broker answered with a typed refusal (a full disk, a fenced owner, a
    duplicate sequence), ``unknown`` when the send may have been stored without the answer
    arriving (a time-out, a transport error, an untyped or internal error)."""
    if isinstance(exc, RemoteError):
        typed = bool(exc.error_class) and getattr(exc, "code", None) not in _UNKNOWN_CODES
        return "failed" if typed else "unknown"
    return "unknown"


@dataclass
class Send:
    """One send of the load.

    Attributes:
        ident: the message id.
        topic: the topic it was sent to (a partitioned topic's root).
        sent_at: ``time.monotonic()`` of the send.
        outcome: ``pending``, ``acked``, ``failed`` or ``unknown``.
        partition: the topic or partition the ack named (``/ns/t-part-i`` on a partitioned topic).
        offset: the acked offset.
        acked_at: ``time.monotonic()`` of the ack.
        error: the error, for ``failed`` and ``unknown``.
    """

    ident: int
    topic: str
    sent_at: float
    outcome: str = "pending"
    partition: str = ""
    offset: int = -1
    acked_at: float = 0.0
    error: str = ""


@dataclass
class Ledger:
    """Every send of the load and its outcome; errors counted by description."""

    sends: dict[int, Send] = field(default_factory=dict)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)

    def note(self, exc: BaseException, where: str) -> None:
        """Count an error (at most 40 distinct descriptions are kept)."""
        text = f"{where}: {fs.describe(exc)}"[:200]
        if len(self.errors) < 40 or text in self.errors:
            self.errors[text] += 1

    def counts(self) -> collections.Counter[str]:
        """Sends by outcome."""
        return collections.Counter(s.outcome for s in self.sends.values())

    def acked(self) -> list[Send]:
        """The acked sends."""
        return [s for s in self.sends.values() if s.outcome == "acked"]


RETRY_PAUSE_S = 0.3
"""How long a producer or consumer loop waits after a failed connect or open."""


_CONSUMER_STEPS = {"connect": "consumer connect", "open": "consumer open", "receive": "consumer"}
"""How the ledger names a consumer's failure at each step of :func:`faults_scenarios.consume_until_stopped`."""


async def try_connect(addresses: Sequence[str], ledger: Ledger, what: str) -> DanubeClient | None:
    """A connected client, or ``None`` after noting the failure as ``what`` and a pause."""
    candidate = new_client(addresses)
    got = await fs.bounded(candidate.connect(), 10)
    if got.ok:
        return candidate
    ledger.note(got.error or RuntimeError("?"), what)
    await fs.bounded(candidate.close(), 5)
    await asyncio.sleep(RETRY_PAUSE_S)
    return None


async def try_open(handle: Producer | Consumer, ledger: Ledger, what: str) -> bool:
    """Open ``handle``; on failure note it as ``what``, close it, pause and return False."""
    opened = await fs.bounded(handle.open(), 15)
    if opened.ok:
        return True
    ledger.note(opened.error or RuntimeError("?"), what)
    await fs.bounded(handle.close(), 5)
    await asyncio.sleep(RETRY_PAUSE_S)
    return False


class ProducerTask:
    """One keyed producer on ``topic`` (its own client), sending every 10 ms its share of
    ``rate_per_s`` with at most ``window`` sends unresolved; reopened after a failure."""

    def __init__(self, index: int, topic: str, addresses: Sequence[str], ledger: Ledger, *, rate_per_s: float,
                 window: int = 2000, keys: int = 16) -> None:
        self.index = index
        self.topic = topic
        self.addresses = addresses
        self.ledger = ledger
        self.rate_per_s = rate_per_s
        self.window = window
        self.keys = keys
        self.name = f"chaos-{index}"
        self.opens = 0
        self._counter = 0
        self._partitions: list[str] = []
        self._unresolved: dict[int, asyncio.Future[int]] = {}
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self, *, settle_s: float = 20.0) -> None:
        """Stop sending, wait up to ``settle_s`` for the outstanding sends, close the producer."""
        self._stop.set()
        deadline = time.monotonic() + settle_s
        while self._unresolved and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self._task is not None:
            await fs.bounded(self._task, 20)
        for ident in list(self._unresolved):
            send = self.ledger.sends[ident]
            if send.outcome == "pending":
                send.outcome, send.error = "unknown", "unresolved at the end"

    def _on_done(self, ident: int, fut: asyncio.Future[int]) -> None:
        self._unresolved.pop(ident, None)
        send = self.ledger.sends[ident]
        if fut.cancelled():
            send.outcome, send.error = "unknown", "send cancelled"
            return
        exc = fut.exception()
        if exc is not None:
            send.outcome, send.error = outcome_kind(exc), fs.describe(exc)
            self.ledger.note(exc, "send")
            return
        result = fut.result()
        partition = getattr(result, "partition", None)
        send.outcome, send.offset, send.acked_at = "acked", int(result), time.monotonic()
        send.partition = self.topic if partition is None else self._partitions[partition]

    async def _run(self) -> None:
        client: DanubeClient | None = None
        try:
            while not self._stop.is_set():
                if client is None:
                    client = await try_connect(self.addresses, self.ledger, "connect")
                    if client is None:
                        continue
                producer = client.producer(self.topic, producer_name=self.name, max_in_flight_batches=8)
                if not await try_open(producer, self.ledger, "producer open"):
                    continue
                self.opens += 1
                self._partitions = [p.topic for p in producer.partition_producers]
                await self._send_until_stopped(producer)
                await fs.bounded(producer.close(), 15)
        finally:
            if client is not None:
                await fs.bounded(client.close(), 10)

    async def _send_until_stopped(self, producer: Producer) -> None:
        loop = asyncio.get_running_loop()
        tick_s = 0.01
        owed = 0.0
        next_s = loop.time()
        while not self._stop.is_set():
            next_s += tick_s
            delay = next_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.5:
                next_s = loop.time()  # fell behind (a stall): do not burst to catch up
            owed = min(owed + self.rate_per_s * tick_s, 100.0)
            while owed >= 1 and len(self._unresolved) < self.window:
                owed -= 1
                ident = self.index * 10**9 + self._counter
                self._counter += 1
                send = Send(ident, self.topic, time.monotonic())
                self.ledger.sends[ident] = send
                try:
                    fut = producer.send_nowait(payload_of(ident), key=f"k{ident % self.keys}")
                except ProducerClosedError as exc:
                    send.outcome, send.error = "failed", fs.describe(exc)  # refused before sending
                    self.ledger.note(exc, "send_nowait")
                    return
                except DanubeError as exc:
                    send.outcome, send.error = "failed", fs.describe(exc)
                    self.ledger.note(exc, "send_nowait")
                    continue
                self._unresolved[ident] = fut
                fut.add_done_callback(functools.partial(self._on_done, ident))


class LiveConsumer:
    """An Exclusive subscription ``live`` from ``EARLIEST`` on ``topic`` (its own client), acking
    everything, running throughout; reopened after a failure. Counts what it received."""

    def __init__(self, topic: str, addresses: Sequence[str], ledger: Ledger) -> None:
        self.topic = topic
        self.addresses = addresses
        self.ledger = ledger
        self.received: set[int] = set()
        self.deliveries = 0
        self.opens = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"live-{self.topic}")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await fs.bounded(self._task, 20)

    async def _run(self) -> None:
        def on_message(message: Message) -> None:
            self.deliveries += 1
            ident = ident_of(message.payload)
            if ident is not None:
                self.received.add(ident)

        def on_open() -> None:
            self.opens += 1

        await fs.consume_until_stopped(
            self._stop, lambda: fs.connected(new_client(self.addresses)),
            lambda client: client.consumer(
                self.topic, subscription="live", subscription_type=SubscriptionType.EXCLUSIVE,
                initial_position=InitialPosition.EARLIEST, receiver_queue_size=1000, ack_batch_size=100,
                ack_flush_ms=50,
            ),
            on_message, lambda exc, step: self.ledger.note(exc, _CONSUMER_STEPS[step]),
            on_open=on_open, open_timeout_s=15, pause_s=RETRY_PAUSE_S,
        )  # fmt: skip


class TieringLoop:
    """What the continuous writer does for tiering: ``tier_sealed_segments`` over ``topics``
    (plain topics and partitions) every ``interval_s``, on the object store the brokers use."""

    def __init__(self, name: str, addresses: Sequence[str], etcd_endpoints: Sequence[str], objects_url: str,
                 topics: Sequence[str], *, interval_s: float = 1.0) -> None:
        self.name = name
        self.addresses = addresses
        self.etcd_endpoints = list(etcd_endpoints)
        self.objects = ObjectStore(objects_url)
        self.topics = [TopicName.parse(t) for t in topics]
        self.interval_s = interval_s
        self.objects_written = 0
        self.rounds = 0
        self.last_reports: dict[str, Any] = {}
        self.errors: collections.Counter[str] = collections.Counter()
        self._client: DanubeClient | None = None
        self._meta: MetadataStore | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await fs.bounded(self._task, 10)
        await self.close()

    async def close(self) -> None:
        if self._client is not None:
            await fs.bounded(self._client.close(), 5)
            self._client = None
        if self._meta is not None:
            await fs.bounded(self._meta.close(), 5)
            self._meta = None

    async def one_round(self) -> int:
        """Tier every topic once (errors are counted, not raised); objects written."""
        written = 0
        if self._client is None:
            self._client = new_client(self.addresses, retries=1)
        for topic in self.topics:
            try:
                if self._meta is None:
                    self._meta = await asyncio.wait_for(MetadataStore.connect(self.etcd_endpoints), 10)
                report = await asyncio.wait_for(
                    tier_sealed_segments(topic, store=self._meta, admin=self._client.admin, objects=self.objects), 30
                )
                written += report.objects_written
                self.last_reports[topic.path] = report
            except Exception as exc:  # noqa: BLE001 - a broker or etcd is down: next round
                text = f"{topic.path}: {fs.describe(exc)}"[:200]
                if len(self.errors) < 30 or text in self.errors:
                    self.errors[text] += 1
        self.objects_written += written
        self.rounds += 1
        return written

    async def _run(self) -> None:
        while True:
            await self.one_round()
            await asyncio.sleep(self.interval_s)


async def two_writers_at_once(loop_a: TieringLoop, loop_b: TieringLoop) -> int:
    """Run one round of each loop concurrently (two tiering writers at once); objects written."""
    written = await asyncio.gather(loop_a.one_round(), loop_b.one_round())
    return sum(written)


async def settle(tasks: Sequence[Any]) -> None:
    """Stop every task of ``tasks`` (each has an async ``stop``), all at once."""
    with contextlib.suppress(Exception):
        await asyncio.gather(*(t.stop() for t in tasks), return_exceptions=True)
