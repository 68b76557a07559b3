"""The short variant of the chaos checker (``benchmarks/chaos.py``): etcd and 3 real brokers
under keyed, idempotent load while a seeded schedule kills, pauses, cuts off from etcd, fills
the disk of, and moves topics between brokers, restarts etcd and races two tiering writers.
Every acked message must be read back exactly once, at its acked offset.

The verdict itself is checked first on a made-up ledger (a lost, a duplicated and an
unavailable message must each be counted), so the end-to-end run cannot pass by counting
nothing.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
KINDS = re.compile(r" kinds (.+)$", re.M)  # the kinds this run injects (disk-full needs a tmpfs)
BY_KIND = re.compile(r"^== faults: \d+ \(\d+ failed to inject or heal\): (.+)$", re.M)
CLOSING = re.compile(
    r"^chaos: acked=(\d+) lost=(\d+) duplicated=(\d+) unavailable_at_end=(\d+) faults=(\d+) seed=(\d+)$"
)


def test_verdict_counts_lost_duplicated_and_unavailable() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import chaos_check
        from chaos_load import Ledger, Send
    finally:
        sys.path.remove(str(BENCHMARKS))
    ledger = Ledger()
    for ident, offset in enumerate(range(6)):
        ledger.sends[ident] = Send(ident, "/t/a", 0.0, outcome="acked", partition="/t/a", offset=offset)
    ledger.sends[99] = Send(99, "/t/a", 0.0, outcome="unknown")
    read = chaos_check.PartitionRead("/t/a", next_offset=9, reached=5, stalled=True)
    # 0 and 2 are fine; 1 is missing (lost), 3 is stored twice (duplicated), 4 is read at
    # another offset only (lost), 5 is beyond where the reader stalled (unavailable);
    # 99 was never acked and is stored twice (allowed).
    read.stored = {0: 0, 2: 2, 3: 3, 4: 99, 6: 3, 7: 4, 8: 99}
    verdict = chaos_check.judge(ledger, {"/t/a": read})
    assert verdict.acked == 6
    assert sorted(s.ident for s in verdict.lost) == [1, 4]
    assert [s.ident for s in verdict.duplicated] == [3]
    assert [s.ident for s in verdict.unavailable] == [5]
    assert verdict.misplaced == 1
    assert (verdict.stored_unacked, verdict.unacked_duplicates) == (1, 1)


def test_chaos_short_run_loses_and_duplicates_nothing() -> None:
    """60 s of faults under load, every kind the run can inject at least once. The verdict
    comes from the read-back alone; the live consumers' catch-up at the end (``--drain-s``,
    15 s by default) is only reported, so it gets 5 s."""
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "chaos.py"), "--seed", "2", "--duration-s", "60", "--faults-every-s", "5",
         "--stall-s", "20", "--drain-s", "5", "--time-limit-s", "240"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines, output[-4000:]
    closing = CLOSING.match(lines[-1])
    assert closing is not None, output[-4000:]
    acked, lost, duplicated, _unavailable, faults, seed = map(int, closing.groups())
    assert seed == 2
    assert acked > 1000, output[-4000:]
    assert faults >= 10, output[-4000:]
    kinds = KINDS.search(proc.stdout)
    by_kind = BY_KIND.search(proc.stdout)
    assert kinds is not None and by_kind is not None, output[-4000:]
    injected = {kind: int(n) for kind, n in (item.rsplit(" ", 1) for item in by_kind.group(1).split(", "))}
    assert all(injected[kind] >= 1 for kind in kinds.group(1).split(", ")), by_kind.group(0)
    assert (lost, duplicated) == (0, 0), output[-6000:]
