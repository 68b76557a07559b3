"""The short variant of the replication benchmark (``benchmarks/replication.py``): etcd and 3
real brokers, a namespace at replication factor 3 with min ISR 2, idempotent producers and
consumers throughout, 4 SIGKILLs of topic owners of which 2 delete the broker's data directory
before it restarts. Every acked message must be read back exactly once, at its acked offset,
and every kill must fail over.

The benchmark's own pieces are checked first on made-up data (the failover of a kill is the
first ack of a message sent after it, never one sent before; a failover that never came makes
the p99 infinite; exactly half of the kills wipe), so the run cannot pass by measuring nothing.
"""

from __future__ import annotations

import math
import random
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.integration

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
CLOSING = re.compile(
    r"^replication: acked=(\d+) lost=(\d+) duplicated=(\d+) failovers=(\d+) wiped=(\d+)"
    r" failover_p99_s=(\S+) rf3_ratio=(\S+)$"
)


def _benchmark_modules() -> tuple[ModuleType, ModuleType, ModuleType]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import chaos_load
        import replication
        import replication_kills
    finally:
        sys.path.remove(str(BENCHMARKS))
    return chaos_load, replication, replication_kills


def test_failover_is_the_first_ack_of_a_send_after_the_kill() -> None:
    chaos_load, _, kills = _benchmark_modules()
    send = chaos_load.Send
    sends = [
        send(1, "/r/a", 9.0, outcome="acked", acked_at=10.5),  # sent before the kill, acked after: not it
        send(2, "/r/b", 10.1, outcome="acked", acked_at=10.2),  # another topic
        send(3, "/r/a", 10.2, outcome="unknown"),  # never acked
        send(4, "/r/a", 10.3, outcome="acked", acked_at=14.0),
        send(5, "/r/a", 10.4, outcome="acked", acked_at=13.5),  # acked first although sent later
        send(6, "/r/a", 10.6, outcome="pending"),
    ]
    assert kills.first_ack_after(sends, "/r/a", since=10.0) == 13.5
    assert kills.first_ack_after(sends, "/r/b", since=10.0) == 10.2
    assert kills.first_ack_after(sends, "/r/b", since=10.15) is None
    assert kills.first_ack_after({s.ident: s for s in sends}.values(), "/r/a", since=10.35) == 13.5


def test_failover_p99_and_wipe_schedule() -> None:
    _, replication, kills = _benchmark_modules()
    assert math.isnan(replication.failover_p99([]))
    samples = [3.0 + i / 100 for i in range(99)]
    assert replication.failover_p99(samples) == samples[-1]
    assert replication.failover_p99([*samples, math.inf]) == samples[-1]  # nearest rank 99 of 100
    assert replication.failover_p99([3.0, math.inf]) == math.inf
    for kills_n in (1, 4, 5, 20):
        schedule = kills.wipe_schedule(kills_n, kills_n // 2, random.Random(kills_n))
        assert len(schedule) == kills_n and sum(schedule) == kills_n // 2
    assert kills.wipe_schedule(3, 7, random.Random(0)) == [True] * 3


def test_summary_line_parses() -> None:
    _, replication, _ = _benchmark_modules()
    summary = replication.Summary(acked=10, lost=0, duplicated=1, failovers=4, wiped=2, failover_p99_s=4.25)
    match = CLOSING.match(summary.line())
    assert match is not None
    assert match.groups() == ("10", "0", "1", "4", "2", "4.25", "nan")


def test_replication_short_run_loses_and_duplicates_nothing() -> None:
    """4 kills (2 wiped) under load at RF 3, min ISR 2; no throughput phase."""
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "replication.py"), "--seed", "3", "--kills", "4", "--topics", "3",
         "--rate", "300", "--tput-rounds", "0", "--isr-wait-s", "30", "--kill-every-s", "1", "--warmup-s", "2",
         "--tail-s", "1", "--stall-s", "15", "--drain-s", "3", "--time-limit-s", "240"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines, output[-4000:]
    closing = CLOSING.match(lines[-1])
    assert closing is not None, output[-4000:]
    acked, lost, duplicated, failovers, wiped = map(int, closing.groups()[:5])
    assert acked > 1000, output[-4000:]
    assert (lost, duplicated) == (0, 0), output[-6000:]
    assert failovers >= 4, output[-4000:]
    assert math.isfinite(float(closing.group(6))), output[-4000:]  # every failover measured, none timed out
    assert wiped == 2, output[-4000:]
