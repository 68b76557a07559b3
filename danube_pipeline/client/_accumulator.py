"""Batching of producer messages (the aiokafka ``message_accumulator`` role).

Messages are framed at once into the current record batch (:class:`danube_pipeline.format.batches.BatchBuilder`);
the batch closes when it holds ``max_batch_messages`` messages, when the next message would take
it past ``max_batch_bytes``, ``linger_ms`` after its first message arrived (when positive), or
when the producer closes it to send it, whichever comes first. A closed batch goes to the sender through the ``on_ready`` callback. A message larger than
the namespace's ``max_message_size`` is refused before it is framed.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import itertools
import operator
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from danube_pipeline.format.batches import RECORD_OVERHEAD_BYTES, BatchBuilder
from danube_pipeline.client.types import MessageId
from danube_pipeline.errors import MessageTooLargeError

_time_ns = time.time_ns


@dataclass(eq=False)
class Batch:
    """Messages sent together as one record batch, and the futures waiting for their offsets.

    Attributes:
        builder: the framed records (built into a batch per producer id when sent).
        futures: the future of each message framed by :meth:`Accumulator.append`, at its
            record's index, resolved with its offset, a :class:`MessageId` (typed ``int``: a
            future's type is invariant, and callers hold ``Future[int]``); ``None`` at the
            index of a record framed by :meth:`Accumulator.append_many`, and shorter than the
            batch when its last records have none.
        acked: resolved with the batch's first offset once the broker acknowledges it, for
            :meth:`Accumulator.append_many` (one future per batch, not per message); created
            by :meth:`acked_future` when first asked for.
        sequence_id: the ``SendBatchRequest.sequence_id`` of the batch, once sent.
        base_sequence: the producer's sequence number of the batch's first message, given when
            it is first sent and kept when it is resent (idempotent produce); -1 before.
        attempts: times the stream failed with a retriable error while this batch was the
            oldest unanswered.
    """

    builder: BatchBuilder
    futures: list[asyncio.Future[int] | None] = field(default_factory=list)
    acked: asyncio.Future[int] | None = None
    sequence_id: int = 0
    base_sequence: int = -1
    attempts: int = 0

    @property
    def message_count(self) -> int:
        """Messages in the batch."""
        return self.builder.record_count

    @property
    def size_bytes(self) -> int:
        """Bytes of the framed records."""
        return self.builder.size_bytes

    def acked_future(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[int]:
        """The batch's own future (:attr:`acked`), created on ``loop`` when first asked for."""
        if self.acked is None:
            self.acked = loop.create_future()
        return self.acked

    def waiting(self) -> list[asyncio.Future[int]]:
        """Every future of the batch that is still pending."""
        found = [f for f in self.futures if f is not None and not f.done()]
        if self.acked is not None and not self.acked.done():
            found.append(self.acked)
        return found

    def resolve(self, first_offset: int) -> None:
        """Give message ``i`` the offset ``first_offset + i``, and :attr:`acked` ``first_offset``."""
        offset = first_offset
        for future in self.futures:
            if future is not None:
                try:
                    future.set_result(MessageId(offset))
                except asyncio.InvalidStateError:  # cancelled by its caller: nothing to tell
                    pass
            offset += 1
        if self.acked is not None and not self.acked.done():
            self.acked.set_result(first_offset)

    def fail(self, exc: BaseException) -> None:
        """Fail every future of the batch that is still pending."""
        for future in self.waiting():
            future.set_exception(exc)

    @property
    def done(self) -> bool:
        """Whether every future has a result or an exception (e.g. all were cancelled)."""
        return not self.waiting()


Span = tuple[Batch, int, int]
"""``(batch, index, count)``: ``count`` messages of one :meth:`Accumulator.append_many` call
framed at records ``index ..`` of ``batch``."""


class MessageIds(Sequence[MessageId]):
    """The offsets of a run of messages sent together, in order, as a ``Sequence[MessageId]``
    built from the first offset and length of each batch's share, not one object per message
    (each :class:`MessageId` is made when read).

    Args:
        runs: ``(first_offset, count)`` per batch share, in order.
    """

    __slots__ = ("_ends", "_firsts")

    def __init__(self, runs: Sequence[tuple[int, int]]) -> None:
        self._firsts = [first for first, _ in runs]
        self._ends = list(itertools.accumulate(count for _, count in runs))

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @typing.overload
    def __getitem__(self, index: int) -> MessageId: ...

    @typing.overload
    def __getitem__(self, index: slice) -> list[MessageId]: ...

    def __getitem__(self, index: int | slice) -> MessageId | list[MessageId]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("MessageIds index out of range")
        run = bisect.bisect_right(self._ends, index)
        return MessageId(self._firsts[run] + index - (self._ends[run - 1] if run else 0))

    def __iter__(self) -> typing.Iterator[MessageId]:
        start = 0
        for first, end in zip(self._firsts, self._ends):
            yield from map(MessageId, range(first, first + end - start))
            start = end

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-sequence semantics: equal to a list

    def __repr__(self) -> str:
        return f"MessageIds({list(map(int, self))!r})"


def span_offsets(loop: asyncio.AbstractEventLoop, spans: list[Span]) -> asyncio.Future[MessageIds]:
    """A future resolved with the offsets of every message of ``spans``, in order, once every
    batch involved is acknowledged; failed with the first batch error seen.

    It waits on each batch's single :attr:`Batch.acked` future, not on one future per message.
    """
    result: asyncio.Future[MessageIds] = loop.create_future()
    firsts: list[int] = [0] * len(spans)
    remaining = [len(spans)]

    def batch_done(index: int, acked: asyncio.Future[int]) -> None:
        if result.done():
            return
        if acked.cancelled():
            result.cancel()
            return
        exc = acked.exception()
        if exc is not None:
            result.set_exception(exc)
            return
        firsts[index] = acked.result()
        remaining[0] -= 1
        if not remaining[0]:
            result.set_result(MessageIds([(first + start, count) for first, (_, start, count) in zip(firsts, spans)]))

    if not spans:
        result.set_result(MessageIds(()))
    for index, (batch, _, _) in enumerate(spans):
        batch.acked_future(loop).add_done_callback(functools.partial(batch_done, index))
    return result


class Accumulator:
    """Frames messages into batches and hands each closed batch to ``on_ready``.

    Args:
        max_batch_messages: messages per batch, at most.
        max_batch_bytes: framed bytes per batch, at most (a single larger message travels
            alone).
        linger_ms: how long a batch waits for more messages after its first, in milliseconds;
            0 = no timer (the producer closes the batch when it can send it).
        on_ready: called with every closed batch, in order.

    Raises:
        ValueError: if a limit is not positive or ``linger_ms`` is negative.
    """

    def __init__(
        self,
        *,
        max_batch_messages: int,
        max_batch_bytes: int,
        linger_ms: int,
        on_ready: Callable[[Batch], None],
    ) -> None:
        if max_batch_messages <= 0 or max_batch_bytes <= 0 or linger_ms < 0:
            raise ValueError("max_batch_messages and max_batch_bytes must be > 0, linger_ms >= 0")
        self._max_messages = max_batch_messages
        self.max_batch_bytes = max_batch_bytes
        self._linger_s = linger_ms / 1000
        self._on_ready = on_ready
        self._current: Batch | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the first append
        self._open_bytes = 0  # framed bytes of the open batch (its builder's size_bytes)
        self.max_message_size_bytes = 0
        """Largest payload accepted, in bytes; 0 = not known yet (no check)."""

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        self._loop = asyncio.get_running_loop()
        return self._loop

    def _open_batch(self, now_us: int, loop: asyncio.AbstractEventLoop) -> Batch:
        current = self._current = Batch(BatchBuilder(now_us))
        self._open_bytes = 0
        if self._linger_s > 0:
            self._timer = loop.call_later(self._linger_s, self._linger_expired, current)
        return current

    def append(
        self, payload: bytes, attributes: Mapping[str, str] | None = None, key: str | None = None
    ) -> asyncio.Future[int]:
        """Frame one message into the current batch.

        Args:
            payload: the message bytes.
            attributes: user key/value pairs.
            key: the routing key, or ``None``.

        Returns:
            A future resolved with the message's offset once the broker acknowledges it.

        Raises:
            MessageTooLargeError: ``len(payload)`` exceeds ``max_message_size_bytes``; nothing
                was queued.
            MalformedRequestError: an attribute breaks a limit of the record format.
        """
        size = len(payload)
        if self.max_message_size_bytes and size > self.max_message_size_bytes:
            raise MessageTooLargeError(size, self.max_message_size_bytes)
        now_us = _time_ns() // 1000
        loop = self._loop or self._bind_loop()
        current = self._current
        if current is None:
            current = self._open_batch(now_us, loop)
        elif self._open_bytes + size + RECORD_OVERHEAD_BYTES > self.max_batch_bytes:
            self.close_batch()
            current = self._open_batch(now_us, loop)
        builder = current.builder
        index = builder.record_count
        if attributes or key is not None:
            builder.append(payload, timestamp_us=now_us, key=key, attributes=attributes)
            framed = self._open_bytes = builder.size_bytes
        else:
            framed = self._open_bytes = builder.append_payload(payload, now_us)
        future: asyncio.Future[int] = loop.create_future()
        futures = current.futures
        if len(futures) != index:  # records of append_many before this one have no future
            futures.extend(itertools.repeat(None, index - len(futures)))
        futures.append(future)
        if index + 1 >= self._max_messages or framed >= self.max_batch_bytes:
            self.close_batch()
        return future

    def append_many(
        self, payloads: Sequence[bytes], attributes: Mapping[str, str] | None = None, key: str | None = None
    ) -> list[Span]:
        """Frame several messages, in order, into the current batch and as many more as they
        need (each closed at ``max_batch_messages`` or ``max_batch_bytes`` as :meth:`append`
        would), framing each batch's share in one call and giving no message a future of its
        own: the caller waits on each batch's :meth:`Batch.acked_future`.

        Args:
            payloads: the messages' bytes.
            attributes: user key/value pairs, the same for every message.
            key: the routing key of every message, or ``None``.

        Returns:
            Where the messages went, in order (see :data:`Span`); empty for no payloads.

        Raises:
            MessageTooLargeError: a payload exceeds ``max_message_size_bytes``.
            MalformedRequestError: an attribute or the key breaks a limit of the record format.
            Either way nothing was queued: every payload and the key and attributes are
            checked before the first is framed.
        """
        sizes = list(map(len, payloads))
        largest = max(sizes, default=0)
        if self.max_message_size_bytes and largest > self.max_message_size_bytes:
            raise MessageTooLargeError(largest, self.max_message_size_bytes)
        now_us = _time_ns() // 1000
        keyed = bool(attributes) or key is not None
        if keyed:  # check the key and attributes once, so no later record fails on them
            BatchBuilder(now_us).append(b"", timestamp_us=now_us, key=key, attributes=attributes)
        loop = self._loop or self._bind_loop()
        # ends[i]: framed bytes of payloads[:i + 1], to split the run at max_batch_bytes.
        ends = list(itertools.accumulate(map(operator.add, sizes, itertools.repeat(RECORD_OVERHEAD_BYTES))))
        spans: list[Span] = []
        i, n = 0, len(payloads)
        while i < n:
            current = self._current or self._open_batch(now_us, loop)
            builder = current.builder
            before = ends[i - 1] if i else 0
            room = before + self.max_batch_bytes - builder.size_bytes
            j = bisect.bisect_right(ends, room, i, min(n, i + self._max_messages - builder.record_count))
            if j == i:
                if builder.record_count:  # the next message does not fit: a new batch
                    self.close_batch()
                    continue
                j = i + 1  # a message larger than max_batch_bytes travels alone
            spans.append((current, builder.record_count, j - i))
            if keyed:
                for payload in payloads[i:j]:
                    builder.append(payload, timestamp_us=now_us, key=key, attributes=attributes)
            else:
                builder.append_payloads(payloads[i:j], now_us)
            self._open_bytes = builder.size_bytes
            if builder.record_count >= self._max_messages or builder.size_bytes >= self.max_batch_bytes:
                self.close_batch()
            i = j
        return spans

    @property
    def has_open_batch(self) -> bool:
        """Whether a batch holds messages not handed to ``on_ready`` yet."""
        return self._current is not None and self._current.message_count > 0

    def close_batch(self) -> None:
        """Close the current batch now (``flush``), if it holds any message."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._current = self._current, None
        if batch is not None and batch.message_count:
            self._on_ready(batch)

    def _linger_expired(self, batch: Batch) -> None:
        if self._current is batch:
            self._timer = None
            self.close_batch()

    def abort(self, exc: BaseException) -> None:
        """Fail the open batch's futures and drop it (producer closing)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._current = self._current, None
        if batch is not None:
            batch.fail(exc)
