"""Idempotent produce: batches a producer sends again are not written twice.

The idempotence key is the producer's identity on the topic and the batch header's
``base_sequence`` (``danube_pipeline.format.batches``), as in Kafka's idempotent producer
(KIP-98: producer id, epoch and sequence, the broker remembering the last batches of each
producer). The identity, a producer id and an epoch per producer name, is assigned through etcd
(:mod:`broker.topics.producer_identity`); the batch header carries it in its ``producer_id``
field (``epoch << 48 | producer id``). Sequences start at 0 per identity and keep their numbers
when a batch is resent, also after the producer was re-created under the same identity (a
reconnect, a topic move, a broker restart).

The state is kept per producer name, and belongs to one identity: :meth:`ProducerSequences.begin`
(called when a producer instance is created with its identity) starts a new, empty state for a
newer epoch, and from then on a batch carrying another header id (an older epoch: a fenced
instance) is refused with :class:`~danube_pipeline.errors.ProducerFencedError`. A producer
without an identity (an older client, the dead-letter writer) is kept by name as before: its
sequences are checked whatever the header's producer id.

For each producer name the owner remembers the highest sequence accepted (written, or queued
for writing), the highest sequence *written* (durable), and the last
:data:`REMEMBERED_BATCHES` batches with their offsets (never forgetting one still being
written). A batch that is one of the remembered batches is answered with the offsets it was
written at (a future that follows the write while it is not yet durable). Any other batch is
new if its sequences lie above the highest written one and overlap no batch being written;
otherwise it is refused with :class:`~danube_pipeline.errors.DuplicateSequenceError` (an older
resend, or one overlapping a batch in part). Sequences may skip forward.

The state follows the WAL's outcome of each batch, not the request's. A batch whose write
fails is forgotten together with every batch of the same producer that failed in the same
write (a failed group commit fails the batch and everything queued after it), and the highest
accepted sequence falls back to what is written or still being written: the producer's resend
of the failed batches, in order, is accepted. Callers await the futures handed
out here through :func:`asyncio.shield`: a cancelled request must not cancel the write, or the
state would forget a batch the WAL still writes and its resend would be written twice (a cancelled write future is logged as such).

The state survives:

* a broker restart: rebuilt at topic load from the batch headers of the WAL's newest
  segments (:meth:`ProducerSequences.scan`). The header holds the identity, so the state of a
  name is the state of the header id of its newest batches (a change of header id starts the
  state again: a newer epoch's sequences start at 0); the instance re-creating its producer
  with that identity resumes on it (:meth:`ProducerSequences.begin`). Segments written before
  identities existed carry session ids there: their state is simply never resumed;
* a topic move: the releasing owner writes it, with each name's identity, to
  ``/danube-data/storage/topics/{ns}/{topic}/producer_sequences`` (``docs/etcd-layout.md`` §5.6)
  in the release transaction, and the next owner starts from it. :data:`HANDOVER_BATCHES` per
  name cover a client's whole in-flight window (8 batches by default).

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

from danube_pipeline.errors import DuplicateSequenceError, ProducerFencedError
from danube_pipeline.format.batches import BatchHeader, parse_header
from danube_pipeline.format.segments import StoredBatch

from broker.tasks import copy_outcome
from broker.topics.producer_identity import ProducerIdentity, epoch_of, producer_id_of

log = logging.getLogger(__name__)

REMEMBERED_BATCHES = 16
"""Batches remembered per producer name, to answer a resend with its original offsets."""
HANDOVER_BATCHES = REMEMBERED_BATCHES
"""Batches per producer name written to etcd when the topic moves: every batch remembered,
which covers a client's in-flight window (``max_in_flight_batches``, 8 by default)."""
MAX_HANDOVER_PRODUCERS = 1_000
"""Producer names (the most recently active) written to etcd when the topic moves."""
FULL_HANDOVER_PRODUCERS = 500
"""The most recently active names handed over with :data:`HANDOVER_BATCHES` batches; the others
with :data:`MIN_HANDOVER_BATCHES`, which keeps the handover value a few hundred kB at most."""
MIN_HANDOVER_BATCHES = 8
"""Batches handed over for a name past :data:`FULL_HANDOVER_PRODUCERS`: the client's default
in-flight window."""


@dataclasses.dataclass(slots=True)
class WrittenBatch:
    """One batch written for a producer name: its sequences and offsets (inclusive)."""

    first_sequence: int
    last_sequence: int
    first_offset: int
    last_offset: int
    future: asyncio.Future[tuple[int, int]] | None = None


class _ProducerState:
    __slots__ = ("batches", "header_id", "identity", "last_sequence", "written_sequence")

    def __init__(self, identity: ProducerIdentity | None = None, header_id: int | None = None) -> None:
        self.last_sequence = -1  # highest sequence accepted: written or being written
        self.written_sequence = -1  # highest sequence known written (durable)
        self.batches: collections.deque[WrittenBatch] = collections.deque()
        # The identity this state belongs to (begin() or a handover); None for a producer
        # without one, or a state rebuilt from the WAL not yet resumed by its instance.
        self.identity = identity
        # The header producer_id of the batches remembered (the identity's header id, or the
        # newest batch's for a state rebuilt from the WAL).
        self.header_id = identity.header_id if identity is not None else header_id

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

    def begin(self, name: str, identity: ProducerIdentity) -> None:
        """A producer instance with ``identity`` was created (its identity just assigned or
        confirmed in etcd, :mod:`broker.topics.producer_identity`).

        The instance resumes on the name's state when that state is its identity's (the same
        instance re-creating its producer: handed over, rebuilt from the WAL, or still here).
        A newer identity starts an empty state (its sequences start at 0); from then on the
        batches of older instances are refused. An identity older than the state's (two
        creations racing) changes nothing.
        """
        state = self._by_name.get(name)
        if state is not None:
            if state.identity == identity:
                return
            if state.identity is None and state.header_id == identity.header_id:
                state.identity = identity
                self._by_name.move_to_end(name)
                return
            current = state.identity
            if current is not None and current.producer_id == identity.producer_id and current.epoch > identity.epoch:
                return
        self._by_name[name] = _ProducerState(identity)
        self._by_name.move_to_end(name)
        log.info("%s: producer %s starts epoch %d of producer id %d; its sequences start again",
                 self.topic, name, identity.epoch, identity.producer_id)

    def check(self, header: BatchHeader) -> asyncio.Future[tuple[int, int]] | None:
        """Whether the batch was written already.

        Returns:
            ``None`` for a new batch (or one without sequence numbers), else the future of the
            offsets it was written at.

        Raises:
            DuplicateSequenceError: its sequences were written already, but not as this batch
                (an older one, or a batch overlapping the last one in part).
            ProducerFencedError: a newer instance holds the producer's name: the batch carries
                another identity than the one the name's state belongs to.
        """
        state = self._by_name.get(header.producer_name)
        if state is not None and state.identity is not None and header.producer_id != state.identity.header_id:
            held = epoch_of(header.producer_id) if producer_id_of(header.producer_id) == state.identity.producer_id else 0
            raise ProducerFencedError(self.topic, header.producer_name, held, state.identity.epoch)
        if header.base_sequence < 0 or state is None:
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
        if state.identity is None:
            state.header_id = header.producer_id
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
            if state.batches and stored.base_offset <= state.batches[-1].last_offset:
                continue  # older than what the handover holds (a WAL from an earlier ownership)
            if state.header_id is None:
                state.header_id = header.producer_id
            elif state.header_id != header.producer_id:
                # Another instance (a newer epoch, or another session of a producer without
                # identity) wrote next: the name's state is now that instance's.
                state = self._by_name[header.producer_name] = _ProducerState(header_id=header.producer_id)
            last = header.base_sequence + header.record_count - 1
            state.remember(WrittenBatch(header.base_sequence, last, stored.base_offset, stored.last_offset))
            state.last_sequence = max(state.last_sequence, last)
            state.written_sequence = max(state.written_sequence, last)
            seen += 1
        return seen

    def to_json(self) -> dict[str, Any]:
        """The handover value (``docs/etcd-layout.md`` §5.6): ``{"producers": {name:
        {"last_sequence": n, "batches": [[first_seq, last_seq, first_offset, last_offset],
        ...], "header_id": h, "producer_id": p, "epoch": e}}}``, the most recently active
        names first (``header_id`` when known, ``producer_id`` and ``epoch`` for a state
        with an identity)."""
        producers: dict[str, Any] = {}
        for name in reversed(self._by_name):
            state = self._by_name[name]
            self._settle(name, state)
            count = HANDOVER_BATCHES if len(producers) < FULL_HANDOVER_PRODUCERS else MIN_HANDOVER_BATCHES
            item: dict[str, Any] = {
                "last_sequence": state.last_sequence,
                "batches": [
                    [b.first_sequence, b.last_sequence, b.first_offset, b.last_offset]
                    for b in list(state.batches)[-count:]
                    if b.future is None  # written (settled); not one still being written
                ],
            }
            if state.header_id is not None:
                item["header_id"] = state.header_id
            if state.identity is not None:
                item.update(state.identity.to_json())
            producers[name] = item
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
                header_id = int(item["header_id"]) if "header_id" in item else None
            except (KeyError, TypeError, ValueError):
                continue
            identity = ProducerIdentity.from_json(item) if "producer_id" in item else None
            state = self._by_name[str(name)] = _ProducerState(identity, header_id)
            self._by_name.move_to_end(str(name))
            state.last_sequence = last
            state.written_sequence = last
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

    if source.done():
        copy_outcome(source, answer)
    else:
        source.add_done_callback(lambda fut: copy_outcome(fut, answer))
    return answer


__all__ = ["HANDOVER_BATCHES", "REMEMBERED_BATCHES", "ProducerSequences", "WrittenBatch"]
