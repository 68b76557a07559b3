"""The hand-out and acknowledgement bookkeeping of one subscription: the batches read and not
fully acknowledged, which consumer holds which of their offsets, which wait for redelivery,
and the ack floor from which the cursor follows.

Each batch read is a :class:`~broker.dispatch.consumer.Handout`: each of its unacknowledged
offsets is held by one consumer (a :class:`~broker.dispatch.consumer.Hold`) or waits for
(re)delivery, with its redelivery count. The ack floor is the first offset not yet
acknowledged; the persisted cursor is the *last offset at or below which everything is
acknowledged* (``docs/etcd-layout.md`` §3.5): ``ack_floor - 1``.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from danube_pipeline.errors import InvalidAckError

from broker.dispatch.consumer import Consumer, Handout, Hold, bit_offsets
from broker.dispatch.key_shared import KeyOrder


def _run_end(bits: int, index: int) -> int:
    """The last index of the run of set bits of ``bits`` that starts at ``index``."""
    rest = bits >> index
    return index + ((rest + 1) & ~rest).bit_length() - 2


def _lowest(bits: int) -> int:
    return (bits & -bits).bit_length() - 1 if bits else -1


class HandoutLedger:
    """Every batch of one subscription read and not fully acknowledged, by base offset.

    Attributes:
        handouts: the batches handed out, by base offset.
        bases: the sorted keys of ``handouts``.
        order: Key_Shared only: the per-key delivery order of the offsets handed out.
        redelivered: offsets taken back from a consumer they were sent to (nack, ack timeout,
            consumer left).
    """

    def __init__(self) -> None:
        self.handouts: dict[int, Handout] = {}
        self.bases: list[int] = []
        self.order = KeyOrder()
        self.redelivered = 0

    def ack_floor(self, read_position: int) -> int:
        """The first offset not acknowledged, given the next offset never handed out.

        Args:
            read_position: the next offset never handed to any consumer.

        Returns:
            The lowest unacknowledged offset of the handouts, or ``read_position`` when every
            offset handed out is acknowledged.
        """
        floor = read_position
        for base in self.bases:
            if base >= floor:
                break
            floor = min(floor, self.handouts[base].first_unacked)
        return floor

    @property
    def waiting_redelivery(self) -> list[Handout]:
        """Batches with offsets waiting for redelivery, in offset order."""
        return [self.handouts[b] for b in self.bases if self.handouts[b].pending]

    def waiting_count(self) -> int:
        """How many offsets wait for (re)delivery."""
        return sum(len(h.pending) for h in self.handouts.values())

    def add(self, handout: Handout) -> None:
        """Record a batch just read."""
        self.handouts[handout.base] = handout
        bisect.insort(self.bases, handout.base)

    def drop(self, handout: Handout) -> None:
        """Forget a batch (fully acknowledged or skipped); no-op when it is not recorded."""
        if self.handouts.pop(handout.base, None) is not None:
            self.bases.pop(bisect.bisect_left(self.bases, handout.base))

    def clear(self) -> None:
        """Forget every batch and the per-key order (a cursor reset)."""
        self.handouts.clear()
        self.bases.clear()
        self.order.clear()

    def settle(self, handout: Handout, bits: int) -> None:
        """Offsets ``bits`` of ``handout`` are acknowledged (or skipped): release them from
        their holds, from waiting, and from the per-key order."""
        if not bits:
            return
        hashes = handout.hashes
        held = 0
        for hold in list(handout.holds):
            mine = hold.bits & bits
            if mine:
                held |= mine
                if hashes is not None:
                    for o in bit_offsets(mine, handout.first):
                        self.order.release(hashes[o - handout.first], hold.consumer.id, o)
                hold.consumer.release(hold, mine)
        if hashes is None and not handout.pending and not handout.counts and not handout.reasons:
            return  # nothing kept per offset (the common case: no redelivery)
        for o in bit_offsets(bits, handout.first):
            handout.pending.pop(o, None)
            handout.counts.pop(o, None)
            handout.reasons.pop(o, None)
            if hashes is not None and not (held >> (o - handout.first)) & 1:
                self.order.release(hashes[o - handout.first], None, o)

    def take_back(
        self, hold: Hold, bits: int, *, reason: str, nack_delay_s: Callable[[int], float] | None = None
    ) -> int:
        """Offsets ``bits`` of ``hold`` go back to waiting: after the nack backoff when
        ``nack_delay_s`` is given, else at once; one more redelivery each if the hold was sent.

        Args:
            hold: the consumer's hold.
            bits: the offsets to take back (bits from ``hold.handout.first``).
            reason: why, kept per offset for the dead-letter topic.
            nack_delay_s: a nack's backoff in seconds for a redelivery count, or ``None``.

        Returns:
            How many offsets were taken back.
        """
        bits &= hold.bits
        if not bits:
            return 0
        handout, consumer = hold.handout, hold.consumer
        now = time.monotonic()
        hashes = handout.hashes
        offsets = bit_offsets(bits, handout.first)
        for o in offsets:
            count = handout.counts.get(o, 0)
            if hold.sent:
                handout.counts[o] = count + 1
            handout.pending[o] = now + (nack_delay_s(count) if nack_delay_s is not None else 0.0)
            handout.reasons[o] = reason
            if hashes is not None:
                self.order.give_back(hashes[o - handout.first], consumer.id, o)
        consumer.release(hold, bits)
        if hold.sent:
            self.redelivered += len(offsets)
        return len(offsets)

    def check(self, consumer: Consumer, ranges: list[tuple[int, int]], read_position: int) -> None:
        """Check that ``consumer`` may acknowledge (or nack) every offset of the inclusive
        ``(first, last)`` ranges: each was sent to it (its stream sent it), it still holds it,
        it is not acknowledged yet, and no offset appears twice in ``ranges``.

        Args:
            consumer: the consumer acknowledging (open, of this subscription).
            ranges: inclusive offset ranges.
            read_position: the next offset never handed to any consumer.

        Raises:
            InvalidAckError: for the first refused run of offsets, with its reason.
        """
        previous_last = -1
        for first, last in sorted(ranges):
            if last < first:
                raise InvalidAckError(consumer.id, first, last, "the range is empty (last < first)")
            if first <= previous_last:
                raise InvalidAckError(
                    consumer.id, first, min(last, previous_last), "acknowledged twice in this request"
                )
            previous_last = last
            self._check_range(consumer, first, last, read_position)

    def _check_range(self, consumer: Consumer, first: int, last: int, read_position: int) -> None:
        pos = first
        while pos <= last:
            i = bisect.bisect_right(self.bases, pos) - 1
            handout = self.handouts[self.bases[i]] if i >= 0 else None
            if handout is None or handout.last < pos:  # no handout holds pos
                nxt = self.bases[i + 1] if i + 1 < len(self.bases) else None
                end = last if nxt is None else min(last, nxt - 1)
                if pos >= read_position:
                    raise InvalidAckError(consumer.id, pos, end, "never delivered")
                end = min(end, read_position - 1)
                raise InvalidAckError(consumer.id, pos, end, "already acknowledged (or skipped)")
            end = min(last, handout.last)
            if pos < handout.first:
                raise InvalidAckError(
                    consumer.id, pos, min(end, handout.first - 1), "never delivered (before the subscription's start)"
                )
            mask = handout.mask(pos, end)
            acked = mask & handout.acked_bits
            mine = unsent = held = 0
            for hold in handout.holds:
                held |= hold.bits
                if hold.consumer is consumer:
                    mine |= hold.bits & mask
                    if not hold.sent:
                        unsent |= hold.bits & mask
            others = mask & ~acked & ~mine
            problems = [(b, kind) for b, kind in ((acked, "acked"), (others, "others"), (unsent, "unsent")) if b]
            if problems:
                bits, kind = min(problems, key=lambda p: _lowest(p[0]))
                index = _lowest(bits)
                offset = handout.first + index
                if kind == "others":
                    pending = sum(1 << (o - handout.first) for o in handout.pending) & bits
                    if (pending >> index) & 1:
                        bits, reason = pending, "not delivered to this consumer (it waits for redelivery)"
                    elif (held >> index) & 1:
                        bits, reason = bits & held, "delivered to another consumer"
                    else:
                        bits, reason = bits & ~held & ~pending, "being published to the dead-letter topic"
                else:
                    reason = "already acknowledged" if kind == "acked" else "not delivered yet (queued for the stream)"
                raise InvalidAckError(consumer.id, offset, handout.first + _run_end(bits, index), reason)
            pos = end + 1

    def ack(self, ranges: list[tuple[int, int]]) -> int:
        """Acknowledge every offset of the inclusive ``(first, last)`` ranges that is handed out
        and not acknowledged yet (the others are ignored); drop the batches left with nothing
        to acknowledge.

        Returns:
            How many offsets were newly acknowledged.
        """
        n = 0
        for first, last in ranges:
            if last < first:
                continue
            i = max(bisect.bisect_right(self.bases, first) - 1, 0)
            while i < len(self.bases) and self.bases[i] <= last:
                handout = self.handouts[self.bases[i]]
                new = handout.mask(first, last) & ~handout.acked_bits
                if new:
                    self.settle(handout, new)
                    handout.acked_bits |= new
                    n += new.bit_count()
                if handout.unacked_count == 0:
                    self.drop(handout)
                else:
                    i += 1
        return n

    def nack(
        self, consumer: Consumer, ranges: list[tuple[int, int]], *, reason: str, nack_delay_s: Callable[[int], float]
    ) -> int:
        """Take back the offsets of the inclusive ``(first, last)`` ranges that ``consumer``
        holds, for redelivery after the nack backoff.

        Args:
            consumer: the consumer that was sent them.
            ranges: inclusive offset ranges (already checked).
            reason: kept per offset for the dead-letter topic.
            nack_delay_s: the backoff in seconds for a redelivery count.

        Returns:
            How many offsets were taken back.
        """
        n = 0
        for first, last in ranges:
            i = max(bisect.bisect_right(self.bases, first) - 1, 0)
            while i < len(self.bases) and self.bases[i] <= last:
                handout = self.handouts[self.bases[i]]
                mask = handout.mask(first, last)
                for hold in [h for h in handout.holds if h.consumer is consumer]:
                    n += self.take_back(hold, mask, reason=reason, nack_delay_s=nack_delay_s)
                i += 1
        return n

    def acknowledge_below(self, offset: int) -> None:
        """Acknowledge in place and forget every batch that ends below ``offset`` (nothing can
        deliver them any more)."""
        for base in [b for b in self.bases if self.handouts[b].last < offset]:
            handout = self.handouts[base]
            self.settle(handout, handout.mask(handout.first, handout.last) & ~handout.acked_bits)
            handout.acked_bits = handout.mask(handout.first, handout.last)
            self.drop(handout)

    def acknowledge_all(self, handout: Handout) -> None:
        """Acknowledge in place every offset of ``handout`` and forget it (its batch is held
        nowhere any more)."""
        bits = handout.mask(handout.first, handout.last) & ~handout.acked_bits
        self.settle(handout, bits)
        handout.acked_bits |= bits
        self.drop(handout)
