"""Which consumers of a subscription get which offsets, by subscription type
(``docs/etcd-layout.md`` §3.4): Exclusive and Failover hand everything to the active (first)
consumer; Shared hands batches out round-robin; Key_Shared hands each offset to the consumer
owning its sticky key's hash range, keeping per-key order (:mod:`broker.dispatch.key_shared`)."""

from __future__ import annotations

from danube_pipeline.format.segments import StoredBatch
from danube_pipeline.modes import SubscriptionType

from broker.dispatch.consumer import Consumer, Handout, Hold
from broker.dispatch.key_shared import AutoSplitHashRanges, KeyOrder, assign_by_key, hash_batch


def eligible_consumers(subscription_type: SubscriptionType, consumers: list[Consumer]) -> list[Consumer]:
    """The consumers that may be handed offsets now: attached, open and with room in their
    window; Exclusive and Failover: only the active (first) consumer."""
    if subscription_type in (SubscriptionType.SHARED, SubscriptionType.KEY_SHARED):
        candidates = [c for c in consumers if c.attached and not c.closed]
    else:
        active = consumers[0] if consumers else None
        candidates = [active] if active is not None and active.attached and not active.closed else []
    return [c for c in candidates if c.permits > 0]


class DispatchPolicy:
    """Hands the waiting offsets of a batch to consumers, by subscription type.

    Args:
        hash_ranges: Key_Shared: the consumers' hash ranges.
        order: Key_Shared: the per-key order of the offsets handed out.
    """

    def __init__(self, hash_ranges: AutoSplitHashRanges, order: KeyOrder) -> None:
        self._hash_ranges = hash_ranges
        self._order = order
        self._rr = 0

    def _pick(self, eligible: list[Consumer]) -> Consumer | None:
        for _ in range(len(eligible)):
            consumer = eligible[self._rr % len(eligible)]
            self._rr += 1
            if consumer.permits > 0:
                return consumer
        return None

    def assign(
        self,
        subscription_type: SubscriptionType,
        handout: Handout,
        batch: StoredBatch,
        ready: list[int],
        eligible: list[Consumer],
    ) -> int:
        """Hand the waiting offsets ``ready`` (ascending) of ``handout`` to consumers: all to one
        consumer (the next one round-robin with room), or (Key_Shared) each to its hash's
        consumer when the per-key order allows.

        Args:
            subscription_type: the subscription's type.
            handout: the batch's delivery state.
            batch: the stored batch.
            ready: waiting offsets of the batch that are due, ascending.
            eligible: the consumers with room (:func:`eligible_consumers`).

        Returns:
            How many offsets were handed out.
        """
        if subscription_type != SubscriptionType.KEY_SHARED:
            consumer = self._pick(eligible)
            if consumer is None:
                return 0
            bits = 0
            for o in ready:
                bits |= 1 << (o - handout.first)
                del handout.pending[o]
            consumer.push(batch, Hold(handout, consumer, bits))
            return len(ready)
        if handout.hashes is None:
            hash_batch(handout, batch, self._order)
        return assign_by_key(handout, batch, ready, eligible, self._hash_ranges, self._order)
