"""Idempotent produce: batches a producer sends again are not written twice.

The idempotence key is the producer *name* on a topic and the batch header's
``base_sequence`` (``danube_pipeline.format.batches``): the client numbers its messages, and a batch
keeps its sequence numbers when it is resent, under a new producer id if the producer was
re-created (a reconnect, a topic move). This follows Kafka's idempotent producer (KIP-98:
producer id plus sequence, the broker remembering the last batches of each producer), with the
name in place of the producer id, which our broker assigns per connection.

For each producer name the owner remembers the highest sequence written and the last
:data:`REMEMBERED_BATCHES` batches with their offsets. A batch whose sequences are all at or
below the highest one is a duplicate: if it is one of the remembered batches, the answer is
the offsets it was written at (the same future while it is not yet durable); otherwise it is
refused with :class:`~danube_pipeline.errors.DuplicateSequenceError`. A batch that overlaps the
highest sequence only in part is refused the same way. Sequences may skip forward (a batch that
failed is never resent with the same numbers by a restarted client).

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
    __slots__ = ("batches", "last_sequence")

    def __init__(self) -> None:
        self.last_sequence = -1
        self.batches: collections.deque[WrittenBatch] = collections.deque(maxlen=REMEMBERED_BATCHES)


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
        last = header.base_sequence + header.record_count - 1
        if header.base_sequence > state.last_sequence:
            return None
        for written in state.batches:
            if written.first_sequence == header.base_sequence and written.last_sequence == last:
                self.duplicates += 1
                log.info("%s: batch of %s with sequences %d..%d written already at offsets %d..%d; not written again",
                         self.topic, header.producer_name, header.base_sequence, last,
                         written.first_offset, written.last_offset)
                if written.future is not None and not written.future.done():
                    return written.future
                done: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
                done.set_result((written.first_offset, written.last_offset))
                return done
        raise DuplicateSequenceError(self.topic, header.producer_name, header.base_sequence, state.last_sequence)

    def record(self, header: BatchHeader, future: asyncio.Future[tuple[int, int]], first_offset: int) -> None:
        """Remember a batch just queued for writing at ``first_offset``; forgotten again if
        its write fails (the producer resends it with the same sequences)."""
        if header.base_sequence < 0:
            return
        state = self._state(header.producer_name)
        last = header.base_sequence + header.record_count - 1
        previous = state.last_sequence
        written = WrittenBatch(header.base_sequence, last, first_offset, first_offset + header.record_count - 1, future)
        state.batches.append(written)
        state.last_sequence = last

        def done(fut: asyncio.Future[tuple[int, int]]) -> None:
            if fut.cancelled() or fut.exception() is not None:
                if written in state.batches:
                    state.batches.remove(written)
                if state.last_sequence == last:
                    state.last_sequence = previous
            else:
                written.future = None

        future.add_done_callback(done)

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
            state.batches.append(WrittenBatch(header.base_sequence, last, stored.base_offset, stored.last_offset))
            state.last_sequence = max(state.last_sequence, last)
            seen += 1
        return seen

    def to_json(self) -> dict[str, Any]:
        """The handover value (``docs/etcd-layout.md`` §5.6): ``{"producers": {name:
        {"last_sequence": n, "batches": [[first_seq, last_seq, first_offset, last_offset],
        ...]}}}``, the most recently active names first."""
        producers: dict[str, Any] = {}
        for name in reversed(self._by_name):
            state = self._by_name[name]
            producers[name] = {
                "last_sequence": state.last_sequence,
                "batches": [
                    [b.first_sequence, b.last_sequence, b.first_offset, b.last_offset]
                    for b in list(state.batches)[-HANDOVER_BATCHES:]
                    if b.future is None or b.future.done()
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
            state.batches.extend(batches)


__all__ = ["HANDOVER_BATCHES", "REMEMBERED_BATCHES", "ProducerSequences", "WrittenBatch"]
