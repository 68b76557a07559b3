"""The dispatch loop of one subscription: one task that reads batches (from the WAL or object
storage) and re-reads the batches to redeliver, and hands them to consumers while they have
room in their window; it takes back what the ack timeout expires and sends what ran out of
redeliveries to the dead-letter topic (:mod:`broker.dispatch.dead_letter_topic`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from danube_pipeline import faults, logs
from danube_pipeline.aio import wait_set
from danube_pipeline.errors import SegmentUnreadableError
from danube_pipeline.format.batches import iter_batch
from danube_pipeline.format.segments import StoredBatch
from danube_pipeline.modes import SubscriptionType

from broker.dispatch.consumer import Consumer, Handout
from broker.dispatch.dead_letter_topic import dead_letter_batch, dead_letter_producer_name
from broker.dispatch.policy import DispatchPolicy, eligible_consumers
from broker.tasks import spawn

if TYPE_CHECKING:
    from broker.dispatch.subscription import Subscription

log = logging.getLogger("broker.dispatch.subscription")  # the subscription's log lines keep one logger name

_MAX_READ_RECORDS_PER_ROUND = 10_000
MAX_KEY_SHARED_WAITING = 10_000
"""Key_Shared: new batches are read only while fewer offsets than this (or than the consumers'
windows together, if more) wait for their key's consumer."""
_DEAD_LETTER_RETRY_S = 1.0
"""Pause before a failed dead-letter publish is tried again (at least)."""


class Dispatcher:
    """The dispatch task of one subscription (module docstring).

    Args:
        subscription: the subscription it dispatches for; its ledger, read position, consumers
            and settings are read at every round.

    Attributes:
        dead_lettered: offsets published to the dead-letter topic and acknowledged.
    """

    def __init__(self, subscription: Subscription) -> None:
        self._sub = subscription
        self._ledger = subscription.ledger
        self._position = subscription.position
        self._policy = DispatchPolicy(subscription.hash_ranges, subscription.ledger.order)
        self.dead_lettered = 0
        self._next_due: float | None = None
        self._dead_letter_tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the dispatch task."""
        sub = self._sub
        with logs.bind(topic=sub.topic, subscription=sub.name):  # the task and its log lines carry them
            self._task = asyncio.create_task(self._run(), name=f"dispatch:{sub.topic}:{sub.name}")

    def wake(self) -> None:
        """Run a dispatch round soon (consumers, acks, settings or the log changed)."""
        self._wake.set()

    def cancel_dead_letters(self) -> None:
        """Cancel the dead-letter publishes under way (their offsets are redelivered)."""
        for task in list(self._dead_letter_tasks):
            task.cancel()

    async def stop(self) -> None:
        """Stop the dispatch task and cancel the dead-letter publishes under way (call once the
        subscription is closed)."""
        self._wake.set()
        task = self._task
        if task is not None:
            task.cancel()
        self.cancel_dead_letters()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ------------------------------------------------------------------ redelivery

    def _expire_ack_timeouts(self, now: float) -> None:
        """Take back every sent hold unacknowledged for ``ack_timeout_ms``; note the next
        deadline."""
        sub = self._sub
        timeout_s = sub.settings.ack_timeout_ms / 1000
        if not timeout_s:
            return
        for consumer in list(sub.consumers):
            for hold in list(consumer.holds):
                if not hold.sent:
                    continue
                due = hold.sent_at + timeout_s
                if due <= now:
                    n = self._ledger.take_back(hold, hold.bits, reason="ack timeout")
                    sub.metrics.ack_timed_out(n)
                    log.info("%s/%s: %d messages unacknowledged by consumer %d for %d ms: redelivered",
                             sub.topic, sub.name, n, consumer.id, sub.settings.ack_timeout_ms)
                else:
                    self._due(due)

    def _due(self, when: float) -> None:
        if self._next_due is None or when < self._next_due:
            self._next_due = when

    def _assign(self, handout: Handout, batch: StoredBatch, ready: list[int], eligible: list[Consumer]) -> int:
        return self._policy.assign(self._sub.type, handout, batch, ready, eligible)

    def _dead_letter(self, handout: Handout, offsets: list[int]) -> None:
        """Publish ``offsets`` (past ``max_redeliveries``) to the dead-letter topic, then
        acknowledge them (:mod:`broker.dispatch.dead_letter_topic`); meanwhile they are neither waiting
        nor held."""
        for o in offsets:
            del handout.pending[o]
        sub = self._sub
        task = spawn(self._publish_dead_letters(handout, offsets), name=f"dlq:{sub.topic}:{sub.name}")
        self._dead_letter_tasks.add(task)
        task.add_done_callback(self._dead_letter_tasks.discard)

    async def _publish_dead_letters(self, handout: Handout, offsets: list[int]) -> None:
        sub = self._sub
        done: set[int] = set()
        try:
            publisher = sub.dead_letter_publisher
            if publisher is None:
                raise RuntimeError("no dead-letter publisher is set for this subscription")
            dead_letter_topic = sub.settings.dead_letter_topic_for(sub.topic, sub.name)
            batches = self._position.read(handout.base, 1)
            while batches is None:  # being fetched from object storage
                await asyncio.sleep(0.05)
                batches = self._position.read(handout.base, 1)
            if not batches or batches[0].base_offset != handout.base:
                raise RuntimeError(f"batch {handout.base} is held nowhere any more")
            _header, records = iter_batch(batches[0].data)
            by_offset = {r[0]: r for r in records if r[0] in offsets}
            for o in offsets:
                if sub.closed or self._ledger.handouts.get(handout.base) is not handout:
                    return  # unloaded or reset meanwhile: the next owner of the cursor decides
                _offset, publish_time_us, key, attributes, payload = by_offset[o]
                count = handout.counts.get(o, 0)
                name = dead_letter_producer_name(sub.topic, sub.name, o)
                batch = dead_letter_batch(
                    producer_name=name, key=key, payload=payload, attributes=attributes,
                    publish_time_us=publish_time_us, topic=sub.topic, subscription=sub.name, offset=o,
                    reason=handout.reasons.get(o, ""), redelivery_count=count,
                )
                written, _last = await publisher(dead_letter_topic, name, batch)
                faults.point(faults.DEAD_LETTER_AFTER_PUBLISH)
                done.add(o)
                sub.ack_ranges([(o, o)])
                self.dead_lettered += 1
                sub.metrics.dead_lettered()
                log.info("%s/%s: offset %d redelivered %d times; published to %s at offset %d and acknowledged",
                         sub.topic, sub.name, o, count, dead_letter_topic, written)
            await sub.flush_cursor()
        except Exception as exc:  # noqa: BLE001 - retried: the offsets wait again
            log.warning("%s/%s: dead-letter publish of offsets %s failed (%s); retried later",
                        sub.topic, sub.name, [o for o in offsets if o not in done], exc)
            if sub.closed or self._ledger.handouts.get(handout.base) is not handout:
                return
            retry_at = time.monotonic() + max(_DEAD_LETTER_RETRY_S, sub.settings.nack_redelivery_delay_ms / 1000)
            for o in offsets:
                if o not in done and not (handout.acked_bits >> (o - handout.first)) & 1:
                    handout.pending[o] = retry_at
            self._wake.set()

    def _redeliver(self, now: float, eligible: list[Consumer]) -> tuple[int, bool]:
        """Hand out the waiting offsets that are due, in offset order; send those past
        ``max_redeliveries`` to the dead-letter topic. Returns the offsets handed out and
        whether reading stopped at an object being fetched."""
        moved = 0
        limit = self._sub.settings.max_redeliveries
        for base in list(self._ledger.bases):
            handout = self._ledger.handouts.get(base)
            if handout is None or not handout.pending:
                continue
            ready: list[int] = []
            for o, due in handout.pending.items():
                if due <= now:
                    ready.append(o)
                else:
                    self._due(due)
            if not ready:
                continue
            ready.sort()
            if limit:
                dead = [o for o in ready if handout.counts.get(o, 0) > limit]
                if dead:
                    self._dead_letter(handout, dead)
                    ready = [o for o in ready if handout.counts.get(o, 0) <= limit]
            eligible = [c for c in eligible if c.permits > 0]
            if not ready or not eligible:
                continue
            batches = self._position.read(handout.base, 1)
            if batches is None:  # being fetched from object storage
                return moved, True
            if not batches or batches[0].base_offset != handout.base:  # held nowhere any more
                self._skip_batch(handout)
                continue
            handed = self._assign(handout, batches[0], ready, eligible)
            self._sub.metrics.redelivered(handed)
            moved += handed
        return moved, False

    def _skip_batch(self, handout: Handout) -> None:
        log.error("%s/%s: batch %d..%d to redeliver is held nowhere any more; skipped",
                  self._sub.topic, self._sub.name, handout.base, handout.last)
        self._ledger.acknowledge_all(handout)

    # ------------------------------------------------------------------ dispatching

    def _dispatch_once(self) -> bool:
        sub, position, ledger = self._sub, self._position, self._ledger
        earliest = position.earliest_offset
        if position.offset < earliest or (ledger.bases and ledger.bases[0] < earliest):
            if not position.below_retention(earliest, sub.consumers):
                return False
        now = time.monotonic()
        self._next_due = None
        self._expire_ack_timeouts(now)
        eligible = eligible_consumers(sub.type, sub.consumers)
        moved, fetching = self._redeliver(now, eligible)
        if fetching:
            return moved > 0
        eligible = [c for c in eligible if c.permits > 0]
        if not eligible:
            return moved > 0
        permits = sum(c.permits for c in eligible)
        key_shared = sub.type == SubscriptionType.KEY_SHARED
        if key_shared and ledger.waiting_count() >= max(MAX_KEY_SHARED_WAITING, permits):
            return moved > 0  # wait for the keys' consumers to acknowledge
        if position.offset < sub.wal.durable_end:
            cold = position.offset < sub.wal.first_offset
            batches = position.read(position.offset, min(permits, _MAX_READ_RECORDS_PER_ROUND))
            if batches is None:
                return moved > 0
            if not batches and cold:
                return position.past_gap() or moved > 0
            if batches and batches[0].last_offset >= position.offset and batches[0].base_offset > position.offset:
                position.skip_hole(position.offset, batches[0].base_offset)  # a gap in the WAL
            for batch in batches:
                eligible = [c for c in eligible if c.permits > 0]
                if not eligible:
                    break
                if batch.last_offset < position.offset:
                    continue
                handout = Handout(batch.base_offset, batch.last_offset, max(batch.base_offset, position.offset))
                handout.pending = dict.fromkeys(range(handout.first, handout.last + 1), 0.0)
                ledger.add(handout)
                self._assign(handout, batch, list(range(handout.first, handout.last + 1)), eligible)
                if cold:
                    position.records_from_object_storage += batch.last_offset + 1 - handout.first
                position.offset = batch.last_offset + 1
                moved += 1
        return moved > 0

    async def _run(self) -> None:
        sub = self._sub
        while not sub.closed:
            self._wake.clear()
            try:
                progressed = self._dispatch_once()
            except SegmentUnreadableError as exc:
                # A corrupt local segment (quarantined on read): the consumers' streams end with
                # the typed error instead of waiting for ever; a new consumer is told again.
                for consumer in list(sub.consumers):
                    consumer.fail(exc)
                await self._wake.wait()
                continue
            except Exception:
                log.exception("%s/%s: dispatch failed; retrying", sub.topic, sub.name)
                await asyncio.sleep(1.0)
                continue
            if progressed:
                await asyncio.sleep(0)
                continue
            due = self._next_due
            if due is None:
                await self._wake.wait()
                continue
            await wait_set(self._wake, max(0.0, due - time.monotonic()) + 0.001)
