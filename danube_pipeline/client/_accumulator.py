"""Batching of producer messages (the aiokafka ``message_accumulator`` role).

Messages are framed at once into the current record batch (:class:`danube_pipeline.format.batches.BatchBuilder`);
the batch closes when it holds ``max_batch_messages`` messages, when the next message would take
it past ``max_batch_bytes``, ``linger_ms`` after its first message arrived (when positive), or
when the producer closes it to send it, whichever comes first. A closed batch goes to the sender through the ``on_ready`` callback. A message larger than
the namespace's ``max_message_size`` is refused before it is framed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from danube_pipeline.format.batches import RECORD_OVERHEAD_BYTES, BatchBuilder
from danube_pipeline.client.types import MessageId
from danube_pipeline.errors import MessageTooLargeError

_time_ns = time.time_ns


@dataclass(eq=False)
class Batch:
    """Messages sent together as one record batch, and their offset futures.

    Attributes:
        builder: the framed records (built into a batch per producer id when sent).
        futures: one per message, resolved with its offset, a :class:`MessageId` (typed
            ``int``: a future's type is invariant, and callers hold ``Future[int]``).
        sequence_id: the ``SendStream`` sequence number, once sent.
        base_sequence: the producer's sequence number of the batch's first message, given when
            it is first sent and kept when it is resent (idempotent produce); -1 before.
        attempts: times the stream failed with a retriable error while this batch was the
            oldest unanswered.
    """

    builder: BatchBuilder
    futures: list[asyncio.Future[int]] = field(default_factory=list)
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

    def resolve(self, first_offset: int) -> None:
        """Give message ``i`` the offset ``first_offset + i``."""
        for i, future in enumerate(self.futures):
            if not future.done():
                future.set_result(MessageId(first_offset + i))

    def fail(self, exc: BaseException) -> None:
        """Fail every future of the batch that is still pending."""
        for future in self.futures:
            if not future.done():
                future.set_exception(exc)

    @property
    def done(self) -> bool:
        """Whether every future has a result or an exception (e.g. all were cancelled)."""
        return all(f.done() for f in self.futures)


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
        self.max_message_size_bytes = 0
        """Largest payload accepted, in bytes; 0 = not known yet (no check)."""

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
        current = self._current
        if current is not None and current.builder.size_bytes + size + RECORD_OVERHEAD_BYTES > self.max_batch_bytes:
            self.close_batch()
            current = None
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        if current is None:
            current = self._current = Batch(BatchBuilder(now_us))
            if self._linger_s > 0:
                self._timer = loop.call_later(self._linger_s, self._linger_expired, current)
        builder = current.builder
        if attributes or key is not None:
            builder.append(payload, timestamp_us=now_us, key=key, attributes=attributes)
        else:
            builder.append_payload(payload, now_us)
        future: asyncio.Future[int] = loop.create_future()
        current.futures.append(future)
        if builder.record_count >= self._max_messages or builder.size_bytes >= self.max_batch_bytes:
            self.close_batch()
        return future

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
