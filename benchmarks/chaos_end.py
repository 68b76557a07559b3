"""The end of a checked run, shared by ``benchmarks/chaos.py`` and ``benchmarks/replication.py``:
stop the load (:func:`stop_load`) and read every topic back from the earliest position
(:func:`read_back`), printing what each step saw. The verdict is ``chaos_check.judge``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence

from chaos_check import PartitionRead, describe_next_offset, read_partition
from chaos_load import Ledger, LiveConsumer, ProducerTask, settle


async def wait_served(addresses: Sequence[str], topics: Sequence[str], timeout_s: float) -> list[str]:
    """Wait until every topic answers ``DescribeTopic``; the topics that did not in time."""
    deadline = time.monotonic() + timeout_s
    pending = list(topics)
    while pending and time.monotonic() < deadline:
        results = await asyncio.gather(*(describe_next_offset(addresses, t) for t in pending))
        pending = [t for t, (next_offset, _) in zip(pending, results, strict=True) if next_offset < 0]
        if pending:
            await asyncio.sleep(1.0)
    return pending


async def stop_load(addresses: Sequence[str], topics: Sequence[str], ledger: Ledger, producers: Sequence[ProducerTask],
                    consumers: Sequence[LiveConsumer], *, drain_s: float, say: Callable[[str], None]) -> None:
    """Wait up to 60 s until every topic is served, stop the producers, give the live consumers
    up to ``drain_s`` to receive every acked message, stop them; print the sends by outcome, the
    ten most common errors and what the live consumers received (reported, not judged)."""
    unserved = await wait_served(addresses, topics, 60)
    if unserved:
        say(f"  not served after 60 s: {unserved}")
    await settle(producers)
    acked_ids = {s.ident for s in ledger.acked()}
    deadline = time.monotonic() + drain_s
    while time.monotonic() < deadline and acked_ids - set().union(*(c.received for c in consumers)):
        await asyncio.sleep(0.5)
    await settle(consumers)
    counts = ledger.counts()
    say(f"  sends: {sum(counts.values()):,}: " + ", ".join(f"{k} {v:,}" for k, v in counts.most_common())
        + f"; producer opens {[p.opens for p in producers]}")
    for text, count in ledger.errors.most_common(10):
        say(f"    x{count} {text}")
    live = set().union(*(c.received for c in consumers))
    say(f"  live consumers received {len(live & acked_ids):,} of {len(acked_ids):,} acked"
        f" ({sum(c.deliveries for c in consumers):,} deliveries, opens {[c.opens for c in consumers]})")


async def read_back(addresses: Sequence[str], topics: Sequence[str], ledger: Ledger, *, stall_s: float,
                    say: Callable[[str], None]) -> dict[str, PartitionRead]:
    """Read every topic (or partition) of ``topics`` from ``EARLIEST``, each with a fresh
    subscription, at once (:func:`chaos_check.read_partition`); print one line per topic.

    Returns:
        ``topic -> what was read``, for :func:`chaos_check.judge`.
    """
    max_acked: dict[str, int] = collections.defaultdict(lambda: -1)
    for send in ledger.acked():
        max_acked[send.partition] = max(max_acked[send.partition], send.offset)
    results = await asyncio.gather(*(read_partition(addresses, t, max_acked=max_acked[t], stall_s=stall_s)
                                     for t in topics))
    for r in results:
        say(f"  {r.topic}: read {len(r.stored):,} offsets, reached {r.reached:,} (next_offset {r.next_offset:,},"
            f" max acked {max_acked[r.topic]:,}) in {r.seconds:.1f} s"
            + (f"; STALLED at {r.reached}: unavailable ranges {r.unavailable_ranges}" if r.stalled else "")
            + (f"; {r.error}" if r.error else ""))
    return {r.topic: r for r in results}
