"""``ProduceStream``: the batches of many producers on one stream, several per request.

One client keeps one such stream per broker, whatever the number of its producers there; a
request carries the batches that were ready together, of any topics, as a Kafka produce request
carries many partitions. Per-message gRPC work (one read, one write, their task switches) is
then paid per request instead of per batch, which is what one message per batch over thousands
of topics costs otherwise.

Each producer's batches travel on a **lane** (``SendBatchRequest.stream_id``, chosen by the
client, never reused on the stream), with the rules of ``SendStream`` per lane:

* batches are appended in the order they are read, and each lane's answers go out in that order;
* after a batch of a lane fails, nothing more of that lane is appended: its later batches are
  answered with :class:`~danube_pipeline.errors.BatchNotAppendedError` (the client resends from
  the failed one on a new lane). Other lanes go on;
* a lane whose topic has a ``max_publish_rate`` (``docs/etcd-layout.md`` §2.1) waits for it in
  a task of its own, so a throttled topic does not hold back the other lanes of the stream;
* with authorization, each batch needs ``produce`` on its producer's topic; a refused batch is
  answered with :class:`~danube_pipeline.errors.PermissionDeniedError` and fails its lane only.

Answers are sent as batches become durable: each response holds every answer ready since the
previous one. Memory is bounded per stream as for ``SendStream``: once ``max_unanswered_bytes``
of batches are read and not answered, no more requests are read. ``ProduceRequest.closed_streams``
names lanes the client left; the broker forgets them once their batches are answered (a lane
that failed is otherwise remembered while the stream lasts).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from typing import Protocol

from danube_pipeline.errors import BatchNotAppendedError, DanubeError
from danube_pipeline.proto import danube_pb2 as pb

from broker.tasks import copy_outcome

__all__ = ["BATCH_CHECK", "ItemCheck", "ProduceStreamBroker", "produce_stream"]

ItemCheck = Callable[[pb.SendBatchRequest], DanubeError | None]
"""Authorizes one batch of the stream: ``None`` if admitted, else the refusal."""

BATCH_CHECK: ContextVar[ItemCheck | None] = ContextVar("danube_produce_batch_check", default=None)
"""Set by the authorization interceptor (:mod:`broker.rpc.auth`) for the call it admitted: the
check of each batch's topic. Unset (``None``) without authorization."""

Outcome = asyncio.Future[tuple[int, int]] | BaseException


class ProduceStreamBroker(Protocol):
    """What :func:`produce_stream` needs of the broker core (:class:`broker.core.Broker`)."""

    def publish(self, producer_id: int, batch: bytes) -> asyncio.Future[tuple[int, int]]: ...

    def publish_unless_limited(self, producer_id: int, batch: bytes) -> asyncio.Future[tuple[int, int]] | None: ...

    async def throttle_publish(self, producer_id: int, batch: bytes) -> float: ...


def ms(seconds: float) -> int:
    """``seconds`` as whole milliseconds, rounded up (a wait never reads as 0)."""
    return math.ceil(seconds * 1000) if seconds > 0 else 0


def failed(outcome: Outcome) -> bool:
    """Whether ``outcome`` is known to have failed (an error, or a future that failed)."""
    if isinstance(outcome, asyncio.Future):
        return outcome.done() and (outcome.cancelled() or outcome.exception() is not None)
    return True


class _Entry:
    """One batch read and not answered yet."""

    __slots__ = ("sequence_id", "size", "outcome", "throttled_ms")

    def __init__(self, sequence_id: int, size: int, outcome: Outcome, throttled_ms: int = 0) -> None:
        self.sequence_id = sequence_id
        self.size = size
        self.outcome = outcome
        self.throttled_ms = throttled_ms

    def answerable(self) -> bool:
        return not isinstance(self.outcome, asyncio.Future) or self.outcome.done()


class _Lane:
    """One producer's batches on the stream.

    Attributes:
        entries: its batches read and not answered, in read order.
        last: its last batch read, whose failure stops the lane before it is answered.
        failed: the sequence id of its first failed batch; ``None`` while none failed.
        chain: the task appending its throttled batches in order; ``None`` when none waits.
        closing: the client left it (``closed_streams``): forgotten once answered.
    """

    __slots__ = ("stream_id", "entries", "last", "failed", "chain", "closing")

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id
        self.entries: collections.deque[_Entry] = collections.deque()
        self.last: _Entry | None = None
        self.failed: int | None = None
        self.chain: asyncio.Task[None] | None = None
        self.closing = False


class _Stream:
    """The state of one ``ProduceStream`` call (module docstring)."""

    def __init__(self, broker: ProduceStreamBroker, max_unanswered_bytes: int, check: ItemCheck | None,
                 error_status: Callable[[DanubeError], pb.ErrorStatus]) -> None:
        self._broker = broker
        self._max_unanswered_bytes = max_unanswered_bytes
        self._check = check
        self._error_status = error_status
        self.lanes: dict[int, _Lane] = {}
        self.answers: list[pb.SendBatchResponse] = []
        self.ready = asyncio.Event()
        self._room = asyncio.Event()
        self.unanswered_bytes = 0
        self.unanswered = 0  # entries of every lane
        self.chains: set[asyncio.Task[None]] = set()
        self.fatal: BaseException | None = None  # an outcome that is no refusal: ends the stream

    # ---- answering

    def settle(self, lane: _Lane) -> None:
        """Move the lane's answerable head entries to the answers, in order."""
        entries = lane.entries
        while entries and entries[0].answerable():
            entry = entries.popleft()
            self.unanswered -= 1
            self.unanswered_bytes -= entry.size
            self.answers.append(self._answer(lane, entry))
        if not entries and lane.chain is None and (lane.closing or lane.failed is None):
            # Nothing to remember: a fresh lane of the same id would behave the same.
            if self.lanes.get(lane.stream_id) is lane:
                del self.lanes[lane.stream_id]
        self.ready.set()
        self._room.set()

    def _answer(self, lane: _Lane, entry: _Entry) -> pb.SendBatchResponse:
        outcome = entry.outcome
        if isinstance(outcome, asyncio.Future):
            if outcome.cancelled():
                outcome = BatchNotAppendedError(entry.sequence_id, entry.sequence_id)
            else:
                error = outcome.exception()
                if error is None:
                    first, last = outcome.result()
                    return pb.SendBatchResponse(first_offset=first, last_offset=last, sequence_id=entry.sequence_id,
                                                throttled_ms=entry.throttled_ms, stream_id=lane.stream_id)
                outcome = error
        if lane.failed is None:
            lane.failed = entry.sequence_id
        if not isinstance(outcome, DanubeError):
            if self.fatal is None:
                self.fatal = outcome  # a bug, not a refusal: ends the stream with its status
            outcome = BatchNotAppendedError(entry.sequence_id, entry.sequence_id)
        return pb.SendBatchResponse(sequence_id=entry.sequence_id, error=self._error_status(outcome),
                                    stream_id=lane.stream_id)

    def _put(self, lane: _Lane, entry: _Entry) -> None:
        lane.entries.append(entry)
        lane.last = entry
        self.unanswered += 1
        self.unanswered_bytes += entry.size
        outcome = entry.outcome
        if isinstance(outcome, asyncio.Future) and not outcome.done():
            outcome.add_done_callback(lambda _f: self.settle(lane))
        elif len(lane.entries) == 1:
            self.settle(lane)

    # ---- reading

    def read(self, request: pb.ProduceRequest) -> None:
        """Enqueue the appends of one request (never waits: a throttled lane waits in its task)."""
        for item in request.batches:
            lane = self.lanes.get(item.stream_id)
            if lane is None:
                lane = self.lanes[item.stream_id] = _Lane(item.stream_id)
            self._read_batch(lane, item)
        for stream_id in request.closed_streams:
            lane = self.lanes.get(stream_id)
            if lane is not None:
                lane.closing = True
                if not lane.entries and lane.chain is None:
                    del self.lanes[stream_id]

    def _read_batch(self, lane: _Lane, item: pb.SendBatchRequest) -> None:
        sequence_id = item.sequence_id
        if lane.failed is None and lane.last is not None and failed(lane.last.outcome):
            lane.failed = lane.last.sequence_id
        if lane.failed is not None:
            self._put(lane, _Entry(sequence_id, 0, BatchNotAppendedError(sequence_id, lane.failed)))
            return
        refusal = self._check(item) if self._check is not None else None
        if refusal is not None:
            lane.failed = sequence_id
            self._put(lane, _Entry(sequence_id, 0, refusal))
            return
        if lane.chain is None:  # no throttled batch of the lane waits: append now, unless throttled
            try:
                outcome: Outcome | None = self._broker.publish_unless_limited(item.producer_id, item.batch)
            except Exception as exc:  # noqa: BLE001 - answered in order
                lane.failed = sequence_id
                outcome = exc
            if outcome is not None:
                self._put(lane, _Entry(sequence_id, len(item.batch), outcome))
                return
        self._chain(lane, item)

    def _chain(self, lane: _Lane, item: pb.SendBatchRequest) -> None:
        """Append ``item`` once the lane's earlier throttled batches are appended and the topic's
        rate admits it, in a task: the stream reads on meanwhile."""
        loop = asyncio.get_running_loop()
        out: asyncio.Future[tuple[int, int]] = loop.create_future()
        entry = _Entry(item.sequence_id, len(item.batch), out)
        before, previous = lane.chain, lane.last

        async def append() -> None:
            try:
                if before is not None:
                    await asyncio.wait([before])
                if lane.failed is not None or (previous is not None and failed(previous.outcome)):
                    failed_id = lane.failed if lane.failed is not None else previous.sequence_id  # type: ignore[union-attr]
                    out.set_exception(BatchNotAppendedError(entry.sequence_id, failed_id))
                    return
                entry.throttled_ms = ms(await self._broker.throttle_publish(item.producer_id, item.batch))
                appended = self._broker.publish(item.producer_id, item.batch)  # no await after it
            except asyncio.CancelledError:
                out.cancel()  # the stream ended while it waited: nothing was appended
                raise
            except Exception as exc:  # noqa: BLE001 - answered in order
                out.set_exception(exc)
                return
            finally:
                if lane.chain is task:
                    lane.chain = None
            appended.add_done_callback(lambda f: copy_outcome(f, out))

        task = loop.create_task(append())
        lane.chain = task
        self.chains.add(task)
        task.add_done_callback(self.chains.discard)
        self._put(lane, entry)

    async def wait_for_room(self) -> None:
        while self.unanswered_bytes > self._max_unanswered_bytes:
            self._room.clear()
            await self._room.wait()


async def produce_stream(
    broker: ProduceStreamBroker,
    requests: AsyncIterator[pb.ProduceRequest],
    *,
    max_unanswered_bytes: int,
    check: ItemCheck | None,
    error_status: Callable[[DanubeError], pb.ErrorStatus],
) -> AsyncIterator[pb.ProduceResponse]:
    """Serve one ``ProduceStream`` (module docstring): read requests, answer as batches settle.

    Args:
        broker: the broker core.
        requests: the client's requests.
        max_unanswered_bytes: batch bytes read and not answered, at most, before reading pauses.
        check: authorizes each batch (``None``: no authorization).
        error_status: a refusal as data.

    Yields:
        Responses, each with the answers ready since the previous one.
    """
    stream = _Stream(broker, max_unanswered_bytes, check, error_status)
    done = False

    async def reader() -> None:
        nonlocal done
        try:
            async for request in requests:
                stream.read(request)
                await stream.wait_for_room()
        finally:
            done = True
            stream.ready.set()

    reader_task = asyncio.create_task(reader())
    try:
        while True:
            while not stream.answers and not (done and stream.unanswered == 0):
                stream.ready.clear()
                await stream.ready.wait()
                if reader_task.done() and not reader_task.cancelled() and reader_task.exception() is not None:
                    raise reader_task.exception()  # type: ignore[misc]
            if stream.fatal is not None:
                raise stream.fatal
            if stream.answers:
                answers, stream.answers = stream.answers, []
                yield pb.ProduceResponse(results=answers)
                continue
            break
        await reader_task
    finally:
        for task in [reader_task, *stream.chains]:
            if not task.done():
                task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.gather(reader_task, *stream.chains, return_exceptions=True)
