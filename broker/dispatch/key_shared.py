"""Key_Shared dispatch: sticky-key hashes, auto-split hash ranges, the per-key order rule, and
the hand-out of each offset to its hash's consumer.

Follows Pulsar's Key_Shared subscription in its ``AUTO_SPLIT`` mode (Pulsar docs,
"Subscription types: Key_Shared"; PIP-34):

* A message's *sticky key* is its key; a message without a key has the empty key (so all of
  them go to one consumer, in order, like one key). Its hash is ``murmur3_32(key UTF-8) mod
  65536`` (Pulsar's ``Murmur3_32Hash`` over the range size 2^16).
* The hash space ``0..65535`` is split into ranges, each owned by one consumer. The first
  consumer owns all of it; each consumer that joins takes the upper half of the largest range
  (the lowest such range on a tie); a consumer that leaves gives each of its ranges to the
  consumer of the next range up (the one below, for the topmost range).
* Per-key order across rebalancing, finer than Pulsar's "recently joined consumers" rule (which
  holds a new consumer back until *every* earlier message is acknowledged): a message goes to
  its hash's consumer only when every earlier unacknowledged message of the same hash is held
  by that same consumer, and none is waiting for (re)delivery. So a hash's new consumer gets
  its messages only once the old consumer acknowledged (or gave back) the ones it had.
"""

from __future__ import annotations

import bisect
from collections import Counter

import mmh3

from danube_pipeline.format.batches import iter_batch
from danube_pipeline.format.segments import StoredBatch

from broker.dispatch.consumer import Consumer, Handout, Hold

HASH_RANGE_SIZE = 1 << 16
"""Size of the sticky-key hash space (Pulsar's ``DEFAULT_HASH_RANGE_SIZE``)."""


def sticky_key_hash(key: str | None) -> int:
    """The hash of a message's sticky key, ``0 <= h < 65536``; ``None`` hashes as ``""``."""
    return mmh3.hash((key or "").encode("utf-8"), signed=False) % HASH_RANGE_SIZE


class AutoSplitHashRanges:
    """Hash ranges owned by consumers (module docstring): inclusive ``(start, end)`` ranges
    covering ``0..65535`` while at least one consumer is present.

    Attributes:
        ranges: ``(start, end, consumer_id)``, ascending and contiguous.
    """

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int, int]] = []

    def add(self, consumer_id: int) -> None:
        """Give ``consumer_id`` the upper half of the largest range (all of it when empty).
        Adding a consumer twice does nothing."""
        if any(c == consumer_id for _, _, c in self.ranges):
            return
        if not self.ranges:
            self.ranges = [(0, HASH_RANGE_SIZE - 1, consumer_id)]
            return
        i = max(range(len(self.ranges)), key=lambda j: (self.ranges[j][1] - self.ranges[j][0], -j))
        start, end, owner = self.ranges[i]
        if start == end:  # 65,536 consumers: nothing left to split
            return
        middle = (start + end) // 2
        self.ranges[i : i + 1] = [(start, middle, owner), (middle + 1, end, consumer_id)]

    def remove(self, consumer_id: int) -> None:
        """Hand the ranges of ``consumer_id`` to its neighbours (module docstring)."""
        out: list[tuple[int, int, int]] = []
        orphans: list[tuple[int, int]] = []
        for start, end, owner in self.ranges:
            if owner == consumer_id:
                orphans.append((start, end))
                continue
            if orphans:  # the next range up takes the ranges just before it
                start = orphans[0][0]
                orphans.clear()
            out.append((start, end, owner))
        if orphans and out:  # the topmost ranges go to the range below
            start, _end, owner = out[-1]
            out[-1] = (start, orphans[-1][1], owner)
        self.ranges = self._merged(out)

    @staticmethod
    def _merged(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        out: list[tuple[int, int, int]] = []
        for start, end, owner in ranges:
            if out and out[-1][2] == owner and out[-1][1] + 1 == start:
                out[-1] = (out[-1][0], end, owner)
            else:
                out.append((start, end, owner))
        return out

    def owner(self, key_hash: int) -> int | None:
        """The consumer id owning ``key_hash``; ``None`` without consumers."""
        i = bisect.bisect_right(self.ranges, (key_hash, HASH_RANGE_SIZE, 1 << 64)) - 1
        if i < 0:
            return None
        start, end, owner = self.ranges[i]
        return owner if start <= key_hash <= end else None


class _HashState:
    """The unacknowledged offsets of one sticky-key hash: how many each consumer holds, and
    those waiting for (re)delivery, ascending."""

    __slots__ = ("held", "waiting")

    def __init__(self) -> None:
        self.held: Counter[int] = Counter()
        self.waiting: list[int] = []


class KeyOrder:
    """The per-hash order rule of Key_Shared (module docstring).

    Every unacknowledged offset of a Key_Shared subscription is either *waiting* (never sent,
    blocked, or taken back for redelivery) or *held* by one consumer; the dispatcher reports
    each move.
    """

    def __init__(self) -> None:
        self._states: dict[int, _HashState] = {}

    def _state(self, key_hash: int) -> _HashState:
        state = self._states.get(key_hash)
        if state is None:
            state = self._states[key_hash] = _HashState()
        return state

    def wait(self, key_hash: int, offset: int) -> None:
        """``offset`` waits for (re)delivery."""
        bisect.insort(self._state(key_hash).waiting, offset)

    def _unwait(self, state: _HashState, offset: int) -> None:
        i = bisect.bisect_left(state.waiting, offset)
        if i < len(state.waiting) and state.waiting[i] == offset:
            state.waiting.pop(i)

    def may_deliver(self, key_hash: int, offset: int, consumer_id: int) -> bool:
        """Whether waiting ``offset`` may go to ``consumer_id`` now: every other offset of its
        hash held is held by that consumer, and no lower offset of the hash waits."""
        state = self._states.get(key_hash)
        if state is None:
            return True
        if state.waiting and state.waiting[0] < offset:
            return False
        return all(c == consumer_id for c in state.held)

    def hold(self, key_hash: int, offset: int, consumer_id: int) -> None:
        """Waiting ``offset`` was handed to ``consumer_id``."""
        state = self._state(key_hash)
        self._unwait(state, offset)
        state.held[consumer_id] += 1

    def release(self, key_hash: int, consumer_id: int | None, offset: int) -> None:
        """``offset`` was acknowledged: held by ``consumer_id``, or waiting (``None``)."""
        state = self._states.get(key_hash)
        if state is None:
            return
        if consumer_id is None:
            self._unwait(state, offset)
        else:
            state.held[consumer_id] -= 1
            if state.held[consumer_id] <= 0:
                del state.held[consumer_id]
        if not state.held and not state.waiting:
            del self._states[key_hash]

    def give_back(self, key_hash: int, consumer_id: int, offset: int) -> None:
        """``offset`` held by ``consumer_id`` waits for redelivery again."""
        state = self._state(key_hash)
        state.held[consumer_id] -= 1
        if state.held[consumer_id] <= 0:
            del state.held[consumer_id]
        bisect.insort(state.waiting, offset)

    def clear(self) -> None:
        """Forget everything (a cursor reset dropped every handout)."""
        self._states.clear()


def hash_batch(handout: Handout, batch: StoredBatch, order: KeyOrder) -> None:
    """Read the sticky-key hash of each offset of ``batch`` from ``handout.first`` into
    ``handout.hashes``, and register its waiting offsets with the per-key ``order``."""
    _header, records = iter_batch(batch.data)
    handout.hashes = [sticky_key_hash(key) for offset, _ts, key, _a, _p in records if offset >= handout.first]
    for o in handout.pending:
        order.wait(handout.hashes[o - handout.first], o)


def assign_by_key(
    handout: Handout,
    batch: StoredBatch,
    ready: list[int],
    eligible: list[Consumer],
    hash_ranges: AutoSplitHashRanges,
    order: KeyOrder,
) -> int:
    """Hand each waiting offset of ``ready`` (ascending) to the consumer owning its hash's
    range, when that consumer has room and the per-key ``order`` allows it.

    Args:
        handout: the batch's delivery state (its ``hashes`` read, :func:`hash_batch`).
        batch: the stored batch.
        ready: waiting offsets of the batch that are due, ascending.
        eligible: the consumers with room, attached and open.
        hash_ranges: the consumers' hash ranges.
        order: the per-key order.

    Returns:
        How many offsets were handed out.
    """
    first = handout.first
    hashes = handout.hashes
    assert hashes is not None
    by_id = {c.id: c for c in eligible}
    room = {c.id: c.permits for c in eligible}
    given: dict[int, int] = {}
    for o in ready:
        key_hash = hashes[o - first]
        owner = hash_ranges.owner(key_hash)
        if owner is None or room.get(owner, 0) <= 0:
            continue
        if not order.may_deliver(key_hash, o, owner):
            continue
        order.hold(key_hash, o, owner)
        del handout.pending[o]
        given[owner] = given.get(owner, 0) | (1 << (o - first))
        room[owner] -= 1
    for owner, bits in given.items():
        consumer = by_id[owner]
        consumer.push(batch, Hold(handout, consumer, bits))
    return sum(bits.bit_count() for bits in given.values())


__all__ = ["HASH_RANGE_SIZE", "AutoSplitHashRanges", "KeyOrder", "assign_by_key", "hash_batch", "sticky_key_hash"]
