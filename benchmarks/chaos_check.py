"""The end of ``benchmarks/chaos.py``: tiering catches up, every topic and partition is read
from the earliest position by a fresh subscription (:func:`read_partition`), and every acked
message is judged (:func:`judge`): read back exactly once, at its acked offset.

* ``lost``: acked messages not read back at their acked offset, although the reader got past
  that offset (a message found only at another offset counts here too, and is named so).
* ``duplicated``: acked messages read back at two or more offsets.
* ``unavailable_at_end``: acked messages at or beyond the offset where a reader waited longer
  than the stall deadline (it could not tell whether they are there).
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import faults_scenarios as fs
from chaos_faults import FaultRecord
from chaos_load import Ledger, Send, TieringLoop, ident_of, new_client

from danube_pipeline.client import InitialPosition, SubscriptionType


@dataclass
class PartitionRead:
    """What a fresh subscription read from one topic or partition.

    Attributes:
        topic: the plain topic or partition read.
        next_offset: its ``next_offset`` before reading (``-1`` if it could not be described).
        stored: offset -> message id (``None`` for a payload not of the load).
        reached: every offset below this was passed by the reader.
        stalled: the reader waited at ``reached`` past the stall deadline.
        error: why the read ended early, if it did.
        unavailable_ranges: the topic's unavailable ranges when it stalled, as text.
    """

    topic: str
    next_offset: int = -1
    stored: dict[int, int | None] = field(default_factory=dict)
    reached: int = 0
    stalled: bool = False
    error: str = ""
    unavailable_ranges: str = ""
    seconds: float = 0.0


async def describe_next_offset(addresses: Sequence[str], topic: str) -> tuple[int, str]:
    """``(next_offset, unavailable ranges as text)`` of ``topic``; ``(-1, why)`` on failure."""
    client = new_client(addresses, request_timeout_ms=10_000)
    try:
        await client.connect()
        described = await client.admin.describe_topic(topic)
        return described.next_offset, str(described.unavailable_ranges)[:300]
    except Exception as exc:  # noqa: BLE001 - reported in the line
        return -1, fs.describe(exc)
    finally:
        await fs.bounded(client.close(), 5)


async def read_partition(addresses: Sequence[str], topic: str, *, max_acked: int, stall_s: float,
                         tail_idle_s: float = 5.0, timeout_s: float = 300.0) -> PartitionRead:
    """Read ``topic`` from ``EARLIEST`` with a fresh client and subscription until the reader is
    past ``max_acked`` and past ``next_offset - 1`` (or idle ``tail_idle_s`` once past
    ``max_acked``), or it waited ``stall_s`` without a message (stalled), or ``timeout_s``."""
    result = PartitionRead(topic)
    started = time.monotonic()
    result.next_offset, ranges = await describe_next_offset(addresses, topic)
    end = max(max_acked, result.next_offset - 1)

    async def run() -> None:
        client = new_client(addresses, request_timeout_ms=10_000, retries=10)
        try:
            await client.connect()
            consumer = client.consumer(
                topic, subscription=f"verify-{uuid.uuid4().hex[:10]}", subscription_type=SubscriptionType.EXCLUSIVE,
                initial_position=InitialPosition.EARLIEST, receiver_queue_size=5000, ack_batch_size=1000,
            )  # fmt: skip
            await consumer.open()
            try:
                last_message = time.monotonic()
                while result.reached <= end:
                    try:
                        message = await consumer.receive(timeout_ms=500)
                    except TimeoutError:
                        idle = time.monotonic() - last_message
                        if result.reached > max_acked and idle > tail_idle_s:
                            return  # past every acked offset; the rest was never written
                        if idle > stall_s:
                            result.stalled = True
                            return
                        continue
                    last_message = time.monotonic()
                    result.stored.setdefault(message.offset, ident_of(message.payload))
                    result.reached = max(result.reached, message.offset + 1)
                    await consumer.ack(message)
            finally:
                await fs.bounded(consumer.close(), 10)
        finally:
            await fs.bounded(client.close(), 10)

    outcome = await fs.bounded(run(), timeout_s)
    if not outcome.ok:
        result.error = fs.describe(outcome.error or RuntimeError("?"))
        result.stalled = result.reached <= max_acked
    if result.stalled:
        _, result.unavailable_ranges = await describe_next_offset(addresses, topic)
    result.unavailable_ranges = result.unavailable_ranges or ranges
    result.seconds = time.monotonic() - started
    return result


async def catch_up(tiering: TieringLoop, addresses: Sequence[str], topics: Sequence[str], *, timeout_s: float,
                   say: Callable[[str], None]) -> None:
    """Seal every active segment, then tier until a round writes nothing and waits nowhere."""
    client = new_client(addresses, request_timeout_ms=10_000)
    try:
        await client.connect()
        for topic in topics:
            sealed = await fs.bounded(client.admin.seal_active_segment(topic), 15)
            if not sealed.ok:
                say(f"  seal of {topic}'s active segment failed: {fs.describe(sealed.error or RuntimeError('?'))}")
    finally:
        await fs.bounded(client.close(), 5)
    started = time.monotonic()
    rounds = 0
    while time.monotonic() - started < timeout_s:
        written = await tiering.one_round()
        rounds += 1
        waiting = {t: r.waiting_at for t, r in tiering.last_reports.items() if r.waiting_at is not None}
        if written == 0 and not waiting and len(tiering.last_reports) == len(topics):
            say(f"  tiering caught up after {rounds} rounds, {time.monotonic() - started:.1f} s")
            return
        await asyncio.sleep(1.0)
    waiting = {t: r.waiting_at for t, r in tiering.last_reports.items() if r.waiting_at is not None}
    say(f"  tiering not caught up within {timeout_s:g} s; waiting at {waiting or 'nothing'}")


@dataclass
class Verdict:
    """Every acked message against what the readers read."""

    acked: int = 0
    lost: list[Send] = field(default_factory=list)
    duplicated: list[Send] = field(default_factory=list)
    unavailable: list[Send] = field(default_factory=list)
    misplaced: int = 0
    stored_unacked: int = 0
    unacked_duplicates: int = 0
    stored_refused: int = 0
    places: dict[int, list[tuple[str, int]]] = field(default_factory=dict)


def judge(ledger: Ledger, reads: dict[str, PartitionRead]) -> Verdict:
    """Judge every acked send of ``ledger`` against ``reads`` (by topic or partition)."""
    places: dict[int, list[tuple[str, int]]] = collections.defaultdict(list)
    for topic, read in reads.items():
        for offset, ident in read.stored.items():
            if ident is not None:
                places[ident].append((topic, offset))
    verdict = Verdict(places=places)
    for send in ledger.sends.values():
        found = places.get(send.ident, [])
        if send.outcome != "acked":
            verdict.stored_unacked += bool(found)
            verdict.unacked_duplicates += len(found) > 1
            verdict.stored_refused += bool(found) and send.outcome == "failed"
            continue
        verdict.acked += 1
        if len(found) > 1:
            verdict.duplicated.append(send)
        if (send.partition, send.offset) in found:
            continue
        stalled_read = reads.get(send.partition)
        if stalled_read is not None and stalled_read.stalled and send.offset >= stalled_read.reached:
            verdict.unavailable.append(send)
        else:
            verdict.lost.append(send)
            verdict.misplaced += bool(found)
    return verdict


def fault_near(log: Sequence[FaultRecord], at: float) -> str:
    """The fault in progress at ``at`` (monotonic), else the last one before it."""
    before = [f for f in log if f.started <= at]
    if not before:
        return "before the first fault"
    last = before[-1]
    state = "during" if not last.ended or at <= last.ended else f"{at - last.ended:.1f} s after"
    return f"{state} {last.kind} {last.target}".strip()


def detail_lines(verdict: Verdict, reads: dict[str, PartitionRead], log: Sequence[FaultRecord], t0: float,
                 limit: int = 20) -> list[str]:
    """One line per lost, duplicated and unavailable message (the first ``limit`` of each)."""
    lines: list[str] = []
    for label, sends in (("LOST", verdict.lost), ("DUPLICATED", verdict.duplicated),
                         ("unavailable", verdict.unavailable)):
        for send in sorted(sends, key=lambda s: (s.partition, s.offset))[:limit]:
            found = verdict.places.get(send.ident, [])
            read = reads.get(send.partition)
            lines.append(
                f"  {label} id {send.ident} ({send.topic}, producer {send.ident // 10**9}) acked at {send.partition}"
                f" offset {send.offset}, {send.acked_at - t0:.1f} s into the run ({fault_near(log, send.acked_at)});"
                f" read at {found or 'no offset'}"
                + (f"; the reader reached {read.reached} of next_offset {read.next_offset}" if read else "")
            )
        if len(sends) > limit:
            lines.append(f"  ... and {len(sends) - limit} more {label.lower()}")
    return lines
