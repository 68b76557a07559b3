"""Simulated rebalancing rounds of the load manager (``broker/cluster/load_manager/``) at scale.

No server runs: a seeded model of a cluster stands in for the load reports
(``docs/etcd-layout.md`` §1.6). Topics get skewed traffic (msg/s lognormal, σ 1.2; message size
lognormal around 512 B) and a skewed first placement (broker k of a shuffled order receives
topics with weight 1/k^0.8, Zipf). Each round:

1. every broker "reports": its topics, their msg/s and bytes/s, CPU % = 5 + 40 × its msg/s over
   the mean (capped at 400), memory % = 15 + 20 × its topics over the mean + 20 × its bytes/s
   over the mean (capped at 100), both rounded to integers as §1.6 writes them;
2. :func:`~broker.cluster.load_manager.plan_rebalance` plans (the only step timed);
3. the moves are applied, moved topics remember the time, and the clock advances by the round
   cool-down, so the next round may move again (topics wait out their own, longer cool-down).

``--drain K`` marks K brokers ``draining`` in the first round: their topics all move at once.
The run stops early when a round is below the CV threshold. Per round it prints the measured CV
(before the plan), the CV the plan predicts, the moves (drain + balance), the time to plan and
the plan's reason. The last line sums the run up:
``load_manager_sim: brokers=N topics=N rounds=N cv_start=X cv_end=X moves_total=N plan_ms_p99=X``
(``cv_end`` is measured on the reports after the last round).

    .venv/bin/python benchmarks/load_manager_sim.py
    .venv/bin/python benchmarks/load_manager_sim.py --strategy fair --aggressiveness aggressive --drain 5
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass, field

from broker.cluster.load_manager import (
    REASON_BELOW_THRESHOLD,
    BrokerLoad,
    RebalanceAggressiveness,
    Strategy,
    TopicLoad,
    broker_scores,
    coefficient_of_variation,
    plan_rebalance,
)


@dataclass
class SimCluster:
    """The simulated truth: who holds what, and each topic's traffic."""

    ids: list[int]
    owner: dict[str, int]
    rates: dict[str, TopicLoad]
    states: dict[int, str]
    held: dict[int, set[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.held = {bid: set() for bid in self.ids}
        for topic, bid in self.owner.items():
            self.held[bid].add(topic)

    def move(self, topic: str, source: int, target: int) -> None:
        if self.owner[topic] != source:
            raise SystemExit(f"plan moves {topic} from {source}, but {self.owner[topic]} holds it")
        self.held[source].remove(topic)
        self.held[target].add(topic)
        self.owner[topic] = target

    def reports(self) -> list[BrokerLoad]:
        """What the leader would read from §1.6 (plus the proposed rate fields) and §1.3."""
        totals = {}
        for bid in self.ids:
            msg = math.fsum(self.rates[t].msg_per_s for t in self.held[bid])
            size = math.fsum(self.rates[t].bytes_per_s for t in self.held[bid])
            totals[bid] = (msg, size)
        n = len(self.ids)
        mean_topics = len(self.owner) / n or 1.0
        mean_msg = math.fsum(m for m, _ in totals.values()) / n or 1.0
        mean_bytes = math.fsum(b for _, b in totals.values()) / n or 1.0
        loads = []
        for bid in self.ids:
            msg, size = totals[bid]
            topics = sorted(self.held[bid])
            cpu = min(400.0, 5 + 40 * msg / mean_msg)
            memory = min(100.0, 15 + 20 * len(topics) / mean_topics + 20 * size / mean_bytes)
            loads.append(BrokerLoad(
                bid, float(round(cpu)), float(round(memory)), topics, msg, size,
                {t: self.rates[t] for t in topics}, self.states[bid],  # type: ignore[arg-type]
            ))
        return loads


def build(args: argparse.Namespace) -> SimCluster:
    rng = random.Random(args.seed)
    ids: list[int] = []
    while len(ids) < args.brokers:
        bid = rng.getrandbits(64) or 1
        if bid not in ids:
            ids.append(bid)
    order = ids[:]
    rng.shuffle(order)
    weights = [1 / (k + 1) ** 0.8 for k in range(len(order))]
    rates: dict[str, TopicLoad] = {}
    owner: dict[str, int] = {}
    for i in range(args.topics):
        topic = f"/sim/t{i:06d}"
        msg = rng.lognormvariate(math.log(50), 1.2)
        size = rng.lognormvariate(math.log(512), 0.8)
        rates[topic] = TopicLoad(msg, msg * size)
        owner[topic] = rng.choices(order, weights)[0]
    return SimCluster(ids=ids, owner=owner, rates=rates, states=dict.fromkeys(ids, "active"))


def measured_cv(cluster: SimCluster, strategy: str) -> float:
    reports = cluster.reports()
    scores = broker_scores(reports, strategy)
    return coefficient_of_variation(scores[b.broker_id] for b in reports if b.state == "active")


def p99(samples: list[float]) -> float:
    """Nearest-rank 99th percentile."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", type=int, default=100)
    parser.add_argument("--topics", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=30, help="at most this many rounds")
    parser.add_argument("--strategy", choices=[s.value for s in Strategy], default="weighted_load")
    parser.add_argument("--aggressiveness", choices=[a.value for a in RebalanceAggressiveness], default="balanced")
    parser.add_argument("--max-moves", type=int, default=300, help="balancing moves per round")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cooldown-s", type=float, default=60.0, help="round cool-down = simulated round interval")
    parser.add_argument("--topic-cooldown-s", type=float, default=600.0)
    parser.add_argument("--drain", type=int, default=0, help="brokers marked draining in the first round")
    args = parser.parse_args(argv)
    if args.brokers < 1 or args.topics < 0 or args.rounds < 1 or not 0 <= args.drain < args.brokers:
        parser.error("need --brokers >= 1, --topics >= 0, --rounds >= 1 and 0 <= --drain < --brokers")

    started = time.perf_counter()
    cluster = build(args)
    for bid in random.Random(args.seed + 1).sample(cluster.ids, args.drain):
        cluster.states[bid] = "draining"
    threshold = RebalanceAggressiveness(args.aggressiveness).threshold
    print(
        f"load_manager_sim: {args.brokers} brokers, {args.topics:,} topics, strategy {args.strategy}, "
        f"{args.aggressiveness} (CV threshold {threshold}), max {args.max_moves} moves/round, "
        f"cool-down {args.cooldown_s:g} s (topics {args.topic_cooldown_s:g} s), {args.drain} draining, seed {args.seed}",
        flush=True,
    )
    print(f"{'round':>5} {'cv':>8} {'cv_pred':>8} {'drain':>6} {'balance':>7} {'plan_ms':>8}  reason")
    now, last_round = 0.0, None
    recently_moved: dict[str, float] = {}
    plan_ms: list[float] = []
    moves_total = 0
    cv_start: float | None = None
    rounds = 0
    for rounds in range(1, args.rounds + 1):
        reports = cluster.reports()
        t0 = time.perf_counter()
        plan = plan_rebalance(
            reports, args.strategy, args.aggressiveness, max_moves=args.max_moves, now_s=now,
            last_round_s=last_round, cooldown_s=args.cooldown_s, recently_moved=recently_moved,
            topic_cooldown_s=args.topic_cooldown_s,
        )
        plan_ms.append((time.perf_counter() - t0) * 1000)
        if cv_start is None:
            cv_start = plan.cv_before
        for topic, source, target in plan.moves:
            cluster.move(topic, source, target)
            recently_moved[topic] = now
        if plan.moves:
            last_round = now
        moves_total += len(plan.moves)
        print(
            f"{rounds:>5} {plan.cv_before:>8.3f} {plan.cv_after:>8.3f} {plan.drain_moves:>6} "
            f"{len(plan.balance_moves):>7} {plan_ms[-1]:>8.1f}  {plan.reason}",
            flush=True,
        )
        if plan.reason == REASON_BELOW_THRESHOLD and not plan.drain_moves:
            break
        now += args.cooldown_s
    cv_end = measured_cv(cluster, args.strategy)
    counts = sorted(len(cluster.held[b]) for b in cluster.ids if cluster.states[b] == "active")
    print(
        f"  after: topics per active broker min {counts[0]} median {counts[len(counts) // 2]} max {counts[-1]}; "
        f"wall {time.perf_counter() - started:.1f} s"
    )
    print(
        f"load_manager_sim: brokers={args.brokers} topics={args.topics} rounds={rounds} "
        f"cv_start={cv_start or 0.0:.3f} cv_end={cv_end:.3f} moves_total={moves_total} "
        f"plan_ms_p99={p99(plan_ms):.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
