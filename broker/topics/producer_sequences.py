"""Idempotent produce: batches a producer sends again are not written twice.

The idempotence key is the producer *name* on a topic and the batch header's
``base_sequence`` (``danube_pipeline.format.batches``): the client numbers its messages, and a batch
keeps its sequence numbers when it is resent, under a new producer id if the producer was
re-created (a reconnect, a topic move). This follows Kafka's idempotent producer (KIP-98:
producer id plus sequence, the broker remembering the last batches of each producer), with the
name in place of the producer id, which our broker assigns per connection.

For each producer name the owner remembers the highest sequence accepted (written, or queued
for writing), the highest sequence *written* (durable), and the last
:data:`REMEMBERED_BATCHES` batches with their offsets (never forgetting one still being
written). A batch that is one of the remembered batches is answered with the offsets it was
written at (a future that follows the write while it is not yet durable). Any other batch is
new if its sequences lie above the highest written one and overlap no batch being written;
otherwise it is refused with :class:`~danube_pipeline.errors.DuplicateSequenceError` (an older
resend, or one overlapping a batch in part). Sequences may skip forward (a batch that failed is
never resent with the same numbers by a restarted client).

The state follows the WAL's outcome of each batch, not the request's. A batch whose write
fails is forgotten together with every batch of the same producer that failed in the same
write (a failed group commit fails the batch and everything queued after it), and the highest
accepted sequence falls back to what is written or still being written: the producer's resend
of the failed batches, in order, is accepted. Callers await the futures handed
out here through :func:`asyncio.shield`: a cancelled request must not cancel the write, or the
state would forget a batch the WAL still writes and its resend would be written twice (a cancelled write future is logged as such).

The state survives:

* a broker restart: rebuilt at topic load from the batch headers of the WAL's newest
  segments (:meth:`ProducerSequences.scan`);
* a topic move: the releasing owner writes it to ``/danube-data/storage/topics/{ns}/{topic}/producer_sequences``
  (``docs/etcd-layout.md`` §5.6) in the release transaction, and the next owner starts from it.

It does not survive a failover: the failed owner's last batches are on its disk only, so a
batch it wrote without acknowledging and that the producer then resent to the new owner exists
twice once the failed owner's segments are tiered (at-least-once; each copy at its own offset).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from danube_pipeline.format.batches import BatchHeader, parse_header
from danube_pipeline.errors import DuplicateSequenceError
from danube_pipeline.format.segments import StoredBatch

log = logging.getLogger(__name__)

REMEMBERED_BATCHES = 16
"""Batches remembered per producer name, to answer a resend with its original offsets."""
HANDOVER_BATCHES = 4
"""Batches per producer name written to etcd when the topic moves."""
MAX_HANDOVER_PRODUCERS = 1_000
"""Producer names (the most recently active) written to etcd when the topic moves."""


@dataclasses.dataclass(slots=True)
class WrittenBatch:
    """One batch written for a producer name: its sequences and offsets (inclusive)."""

    first_sequence: int
    last_sequence: int
    first_offset: int
    last_offset: int
    future: asyncio.Future[tuple[int, int]] | None = None


class _ProducerState:
    __slots__ = ("batches", "last_sequence", "written_sequence")

    def __init__(self) -> None:
        self.last_sequence = -1  # highest sequence accepted: written or being written
        self.written_sequence = -1  # highest sequence known written (durable)
        self.batches: collections.deque[WrittenBatch] = collections.deque()

    def remember(self, batch: WrittenBatch) -> None:
        """Add ``batch``; forget the oldest batches beyond :data:`REMEMBERED_BATCHES`, but
        never one still being written (its resend must find it)."""
        self.batches.append(batch)
        while len(self.batches) > REMEMBERED_BATCHES and self.batches[0].future is None:
            self.batches.popleft()

    def settle(self) -> list[WrittenBatch]:
        """Follow the writes that ended: keep the batches written, forget every batch whose
        write failed (or whose future was cancelled), and then set :attr:`last_sequence` back
        to the highest sequence written or still being written.

        Returns:
            The batches forgotten.
        """
        failed: list[WrittenBatch] = []
        for batch in self.batches:
            fut = batch.future
            if fut is None or not fut.done():
                continue
            if fut.cancelled() or fut.exception() is not None:
                failed.append(batch)
            else:
                batch.future = None
                self.written_sequence = max(self.written_sequence, batch.last_sequence)
        if failed:
            self.batches = collections.deque(b for b in self.batches if b.future is None or not b.future.done())
            self.last_sequence = max([self.written_sequence, *(b.last_sequence for b in self.batches)])
        return failed

    def being_written_overlaps(self, first_sequence: int, last_sequence: int) -> bool:
        """Whether ``first_sequence..last_sequence`` overlaps a batch still being written."""
        return any(
            b.future is not None and b.first_sequence <= last_sequence and first_sequence <= b.last_sequence
            for b in self.batches
        )


class ProducerSequences:
    """The sequence state of every producer name of one topic (module docstring).

    Args:
        topic: ``/ns/topic``, for errors and logs.
    """

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self._by_name: collections.OrderedDict[str, _ProducerState] = collections.OrderedDict()
        self.duplicates = 0

    def check(self, header: BatchHeader) -> asyncio.Future[tuple[int, int]] | None:
        """Whether the batch was written already.

        Returns:
            ``None`` for a new batch (or one without sequence numbers), else the future of the
            offsets it was written at.

        Raises:
            DuplicateSequenceError: its sequences were written already, but not as this batch
                (an older one, or a batch overlapping the last one in part).
        """
        if header.base_sequence < 0:
            return None
        state = self._by_name.get(header.producer_name)
        if state is None:
            return None
        self._settle(header.producer_name, state)  # writes that ended, their callbacks not run yet
        last = header.base_sequence + header.record_count - 1
        if header.base_sequence > state.last_sequence:
            return None
        for written in state.batches:
            if written.first_sequence == header.base_sequence and written.last_sequence == last:
                self.duplicates += 1
                log.info("%s: batch of %s with sequences %d..%d written already at offsets %d..%d; not written again",
                         self.topic, header.producer_name, header.base_sequence, last,
                         written.first_offset, written.last_offset)
                return _follow(written)
        if header.base_sequence > state.written_sequence and not state.being_written_overlaps(
            header.base_sequence, last
        ):
            # Never written and not being written: a batch whose write failed, resent while a
            # later batch of the producer (queued after the failure) is still being written.
            return None
        raise DuplicateSequenceError(self.topic, header.producer_name, header.base_sequence, state.last_sequence)

    def record(self, header: BatchHeader, future: asyncio.Future[tuple[int, int]], first_offset: int) -> None:
        """Remember a batch just queued for writing at ``first_offset``.

        ``future`` is the WAL's: once it is done the state follows its outcome. A batch whose
        write failed is forgotten, with every batch of the producer that failed with it, so
        that the producer's resends of them are accepted, in order.
        """
        if header.base_sequence < 0:
            return
        name = header.producer_name
        state = self._state(name)
        last = header.base_sequence + header.record_count - 1
        written = WrittenBatch(header.base_sequence, last, first_offset, first_offset + header.record_count - 1, future)
        state.remember(written)
        state.last_sequence = max(state.last_sequence, last)

        def done(fut: asyncio.Future[tuple[int, int]]) -> None:
            if fut.cancelled():
                log.warning(
                    "%s: the write of %s's batch with sequences %d..%d was cancelled; its outcome is unknown, "
                    "so a resend is written again", self.topic, name, written.first_sequence, written.last_sequence,
                )
            self._settle(name, state)

        future.add_done_callback(done)

    def _settle(self, name: str, state: _ProducerState) -> None:
        failed = state.settle()
        if failed:
            log.info(
                "%s: the write of %d batches of %s failed (sequences %d..%d); they are accepted when resent, "
                "highest accepted sequence back at %d", self.topic, len(failed), name, failed[0].first_sequence,
                failed[-1].last_sequence, state.last_sequence,
            )

    def _state(self, name: str) -> _ProducerState:
        state = self._by_name.get(name)
        if state is None:
            state = self._by_name[name] = _ProducerState()
        self._by_name.move_to_end(name)
        return state

    def scan(self, batches: Iterable[StoredBatch]) -> int:
        """Rebuild from written batches (the WAL's newest segments, in offset order).

        Returns:
            The batches with sequence numbers seen.
        """
        seen = 0
        for stored in batches:
            header = parse_header(stored.data)
            if header.base_sequence < 0:
                continue
            state = self._state(header.producer_name)
            last = header.base_sequence + header.record_count - 1
            state.remember(WrittenBatch(header.base_sequence, last, stored.base_offset, stored.last_offset))
            state.last_sequence = max(state.last_sequence, last)
            state.written_sequence = max(state.written_sequence, last)
            seen += 1
        return seen

    def to_json(self) -> dict[str, Any]:
        """The handover value (``docs/etcd-layout.md`` §5.6): ``{"producers": {name:
        {"last_sequence": n, "batches": [[first_seq, last_seq, first_offset, last_offset],
        ...]}}}``, the most recently active names first."""
        producers: dict[str, Any] = {}
        for name in reversed(self._by_name):
            state = self._by_name[name]
            self._settle(name, state)
            producers[name] = {
                "last_sequence": state.last_sequence,
                "batches": [
                    [b.first_sequence, b.last_sequence, b.first_offset, b.last_offset]
                    for b in list(state.batches)[-HANDOVER_BATCHES:]
                    if b.future is None  # written (settled); not one still being written
                ],
            }
            if len(producers) >= MAX_HANDOVER_PRODUCERS:
                break
        return {"producers": producers}

    def load(self, value: object) -> None:
        """Start from a handover value written by the previous owner (malformed parts are
        ignored)."""
        producers = value.get("producers") if isinstance(value, Mapping) else None
        if not isinstance(producers, Mapping):
            return
        for name, item in reversed(list(producers.items())):
            try:
                last = int(item["last_sequence"])
                batches = [WrittenBatch(int(a), int(b), int(c), int(d)) for a, b, c, d in item["batches"]]
            except (KeyError, TypeError, ValueError):
                continue
            state = self._state(str(name))
            state.last_sequence = max(state.last_sequence, last)
            state.written_sequence = max(state.written_sequence, last)
            for batch in batches:
                state.remember(batch)


def _follow(written: WrittenBatch) -> asyncio.Future[tuple[int, int]]:
    """A new future with the outcome of ``written``'s write: cancelling it (a resend's request
    cancelled) leaves the write and the state of the batch alone."""
    answer: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
    source = written.future
    if source is None:
        answer.set_result((written.first_offset, written.last_offset))
        return answer

    def copy(fut: asyncio.Future[tuple[int, int]]) -> None:
        if answer.done():
            return
        if fut.cancelled():
            answer.cancel()
        elif (exc := fut.exception()) is not None:
            answer.set_exception(exc)
        else:
            answer.set_result(fut.result())

    if source.done():
        copy(source)
    else:
        source.add_done_callback(copy)
    return answer


__all__ = ["HANDOVER_BATCHES", "REMEMBERED_BATCHES", "ProducerSequences", "WrittenBatch"]
