"""Batching of producer messages (the aiokafka ``message_accumulator`` role).

Messages queue into the current batch; the batch closes when it holds ``max_batch_messages``
messages, when the next message would take it past ``max_batch_bytes``, or ``linger_ms``
after its first message arrived, whichever comes first. A closed batch goes to the sender
through the ``on_ready`` callback. A message larger than the namespace's
``max_message_size`` is refused before it is queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from danube_pipeline.errors import MessageTooLargeError
from danube_pipeline.proto import danube_pb2 as pb


@dataclass(eq=False)
class Batch:
    """Messages sent together in one ``SendBatchRequest``, and their offset futures."""

    messages: list[pb.ProducerMessage] = field(default_factory=list)
    futures: list[asyncio.Future[int]] = field(default_factory=list)
    size_bytes: int = 0
    sequence_id: int = 0
    attempts: int = 0
    """Times the stream failed with a retriable error while this batch was the oldest unanswered."""

    def resolve(self, first_offset: int) -> None:
        """Give message ``i`` the offset ``first_offset + i``."""
        for i, future in enumerate(self.futures):
            if not future.done():
                future.set_result(first_offset + i)

    def fail(self, exc: BaseException) -> None:
        """Fail every future of the batch that is still pending."""
        for future in self.futures:
            if not future.done():
                future.set_exception(exc)

    @property
    def done(self) -> bool:
        """Whether every future has a result or an exception (e.g. all were cancelled)."""
        return all(f.done() for f in self.futures)


def message_size_bytes(payload: bytes) -> int:
    """The size compared with ``max_message_size``: the payload length in bytes."""
    return len(payload)


def _batch_bytes(payload: bytes, attributes: Mapping[str, str]) -> int:
    return len(payload) + sum(len(k.encode()) + len(v.encode()) for k, v in attributes.items())


class Accumulator:
    """Builds batches and hands each closed batch to ``on_ready``.

    Args:
        max_batch_messages: messages per batch, at most.
        max_batch_bytes: payload plus attribute bytes per batch, at most (a single larger
            message travels alone).
        linger_ms: how long a batch waits for more messages after its first, in milliseconds.
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
        self._max_bytes = max_batch_bytes
        self._linger_s = linger_ms / 1000
        self._on_ready = on_ready
        self._current: Batch | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.max_message_size_bytes = 0
        """Largest payload accepted, in bytes; 0 = not known yet (no check)."""

    def append(self, payload: bytes, attributes: Mapping[str, str]) -> asyncio.Future[int]:
        """Queue one message into the current batch.

        Args:
            payload: the message bytes.
            attributes: user key/value pairs.

        Returns:
            A future resolved with the message's offset once the broker acknowledges it.

        Raises:
            MessageTooLargeError: ``len(payload)`` exceeds ``max_message_size_bytes``; nothing
                was queued.
        """
        size = message_size_bytes(payload)
        if self.max_message_size_bytes and size > self.max_message_size_bytes:
            raise MessageTooLargeError(size, self.max_message_size_bytes)
        nbytes = _batch_bytes(payload, attributes)
        current = self._current
        if current is not None and current.size_bytes + nbytes > self._max_bytes:
            self.close_batch()
            current = None
        loop = asyncio.get_running_loop()
        if current is None:
            current = self._current = Batch()
            self._timer = loop.call_later(self._linger_s, self._linger_expired, current)
        future: asyncio.Future[int] = loop.create_future()
        current.messages.append(pb.ProducerMessage(payload=payload, attributes=dict(attributes)))
        current.futures.append(future)
        current.size_bytes += nbytes
        if len(current.messages) >= self._max_messages or current.size_bytes >= self._max_bytes:
            self.close_batch()
        return future

    def close_batch(self) -> None:
        """Close the current batch now (``flush``), if it holds any message."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._current = self._current, None
        if batch is not None and batch.messages:
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
