"""Which topics move when the brokers' load drifts apart: the coefficient of variation of the
active brokers' scores (:mod:`broker.cluster.load_manager.strategies`), the drain moves and the
greedy balancing moves. Pure and deterministic, as all of :mod:`broker.cluster.load_manager`.

Rebalancing
-----------
The imbalance is the coefficient of variation (CV) of the active brokers' scores
(:func:`coefficient_of_variation`). :func:`plan_rebalance`:

1. **Drain.** Every topic of a ``draining`` or ``drained`` broker is placed, heaviest first, on
   the active broker with the lowest score at that point. These moves ignore the CV threshold,
   both cool-downs and ``max_moves``: the broker is going away, and a topic left on it becomes
   unavailable. They come first in the plan. ``cv_start`` is the CV once they are counted.
2. **Balance**, only when the round cool-down has passed (``now_s - last_round_s >=
   cooldown_s``) and ``cv_start`` is above the threshold of the
   :class:`RebalanceAggressiveness` (conservative 0.4, balanced 0.3, aggressive 0.2, Danube's
   values). Greedy, at most ``max_moves`` moves: each move takes the topic, from any active
   broker, whose move to the least-loaded broker lowers the CV most (in practice a topic of
   the most loaded broker, of about half the gap); it stops when no move lowers the CV. A move
   lowers the CV exactly when the topic's share ``c`` satisfies ``0 < c < a - b`` (``a``, ``b``
   the scores of source and destination), so a topic bigger than the gap never swaps the
   imbalance around. A topic moves at most once per plan, and never within
   ``topic_cooldown_s`` of its last move (``recently_moved``).

The caller records the moves it carries out: ``recently_moved[topic] = now_s`` for each, and
``last_round_s = now_s`` when the plan moved anything (both cool-downs count from there).
"""

from __future__ import annotations

import bisect
import enum
import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from broker.cluster.load_manager.strategies import (
    BrokerLoad,
    ClusterScores,
    Strategy,
    check_rate,
    score_cluster,
)

class RebalanceAggressiveness(enum.StrEnum):
    """How much imbalance is tolerated before topics move: a CV threshold
    (:data:`CV_THRESHOLDS`, Danube's values)."""

    CONSERVATIVE = "conservative"
    BALANCED = "balanced"
    AGGRESSIVE = "aggressive"

    @property
    def threshold(self) -> float:
        """The CV above which :func:`plan_rebalance` moves topics."""
        return CV_THRESHOLDS[self]


CV_THRESHOLDS: Mapping[RebalanceAggressiveness, float] = {
    RebalanceAggressiveness.CONSERVATIVE: 0.4,
    RebalanceAggressiveness.BALANCED: 0.3,
    RebalanceAggressiveness.AGGRESSIVE: 0.2,
}


REASON_NO_ACTIVE_BROKER = "no active broker"
"""No broker is ``active``: nothing can move, not even off a draining broker."""
REASON_COOL_DOWN = "cool-down"
"""The round cool-down has not passed: drain moves only."""
REASON_BELOW_THRESHOLD = "below threshold"
"""``cv_start`` is at or below the threshold: drain moves only."""
REASON_NO_IMPROVING_MOVE = "no improving move"
"""Above the threshold, but no allowed move lowers the CV (topics too big or in cool-down)."""
REASON_REBALANCED = "rebalanced"
"""At least one balancing move."""


def coefficient_of_variation(scores: Iterable[float]) -> float:
    """Population standard deviation over mean of ``scores``: 0 is perfectly even.

    Returns:
        The CV, or 0.0 with fewer than two scores or a mean of 0 or less.
    """
    xs = list(scores)
    n = len(xs)
    if n < 2:
        return 0.0
    mean = math.fsum(xs) / n
    if mean <= 0:
        return 0.0
    variance = math.fsum((x - mean) ** 2 for x in xs) / n
    return math.sqrt(variance) / mean


Move = tuple[str, int, int]
"""``(topic, from_broker, to_broker)``."""


@dataclass(frozen=True, slots=True)
class RebalancePlan:
    """What :func:`plan_rebalance` proposes.

    Attributes:
        cv_before: CV of the active brokers' scores as reported.
        cv_start: the same once the drain moves are counted (``cv_before`` when nothing drains);
            the threshold is tested on it.
        cv_after: predicted CV once every move is made; never above ``cv_start``.
        moves: ``(topic, from_broker, to_broker)`` in the order to make them: the first
            ``drain_moves`` empty draining brokers, the rest balance.
        reason: one of the ``REASON_*`` strings, why the balancing part moved what it did.
        threshold: the CV threshold applied.
        drain_moves: how many of ``moves`` empty draining or drained brokers.
    """

    cv_before: float
    cv_start: float
    cv_after: float
    moves: list[Move]
    reason: str
    threshold: float
    drain_moves: int

    @property
    def balance_moves(self) -> list[Move]:
        """The moves after the drain moves (at most ``max_moves``)."""
        return self.moves[self.drain_moves :]


def plan_rebalance(
    brokers: Sequence[BrokerLoad],
    strategy: Strategy | str,
    aggressiveness: RebalanceAggressiveness | str | float,
    *,
    max_moves: int,
    now_s: float,
    last_round_s: float | None,
    cooldown_s: float,
    recently_moved: Mapping[str, float],
    topic_cooldown_s: float,
) -> RebalancePlan:
    """Plan the drain moves and, when due, the balancing moves (module docstring,
    "Rebalancing").

    Args:
        brokers: every broker the leader knows, each with its state.
        strategy: how brokers are scored.
        aggressiveness: the CV threshold: a :class:`RebalanceAggressiveness` (or its value), or
            the threshold itself as a number >= 0.
        max_moves: at most this many balancing moves (drain moves are not counted).
        now_s: the time of this plan, in seconds (any clock the caller keeps consistently).
        last_round_s: when the last plan that moved something was made, or None.
        cooldown_s: no balancing moves until ``cooldown_s`` seconds after ``last_round_s``.
        recently_moved: topic → when it was last moved, in seconds.
        topic_cooldown_s: a topic moved less than this many seconds ago does not move to balance.

    Returns:
        A :class:`RebalancePlan`.

    Raises:
        ValueError: an unknown strategy or aggressiveness, a negative ``max_moves`` or
            cool-down, or a broker id twice.
    """
    strategy = Strategy(strategy)
    if isinstance(aggressiveness, str):
        threshold = RebalanceAggressiveness(aggressiveness).threshold
    else:
        check_rate("plan_rebalance", "aggressiveness", aggressiveness)
        threshold = float(aggressiveness)
    if max_moves < 0 or cooldown_s < 0 or topic_cooldown_s < 0:
        raise ValueError("max_moves, cooldown_s and topic_cooldown_s must be >= 0")
    cluster = score_cluster(brokers, strategy)
    scores = cluster.scores
    active = [bid for bid, mode in cluster.modes.items() if mode == "active"]
    cv_before = coefficient_of_variation(scores[bid] for bid in active)
    if not active:
        return RebalancePlan(cv_before, cv_before, cv_before, [], REASON_NO_ACTIVE_BROKER, threshold, 0)

    # 1. drain: heaviest topic first onto the lowest-scored active broker
    moves: list[Move] = []
    leaving = [
        (-share, topic, bid)
        for bid, mode in cluster.modes.items()
        if mode != "active"
        for topic, share in cluster.shares[bid].items()
    ]
    leaving.sort()
    heap = [(scores[bid], bid) for bid in active]
    heapq.heapify(heap)
    for neg_share, topic, source in leaving:
        score, target = heapq.heappop(heap)
        scores[target] = score - neg_share
        heapq.heappush(heap, (scores[target], target))
        moves.append((topic, source, target))
    drain_moves = len(moves)
    cv_start = coefficient_of_variation(scores[bid] for bid in active)

    # 2. balance
    if last_round_s is not None and now_s - last_round_s < cooldown_s:
        reason = REASON_COOL_DOWN
    elif cv_start <= threshold:
        reason = REASON_BELOW_THRESHOLD
    else:
        balanced = _balance(cluster, active, max_moves, now_s, recently_moved, topic_cooldown_s)
        moves.extend(balanced)
        reason = REASON_REBALANCED if balanced else REASON_NO_IMPROVING_MOVE
    cv_after = coefficient_of_variation(scores[bid] for bid in active)
    return RebalancePlan(cv_before, cv_start, cv_after, moves, reason, threshold, drain_moves)


def _balance(
    cluster: ClusterScores,
    active: list[int],
    max_moves: int,
    now_s: float,
    recently_moved: Mapping[str, float],
    topic_cooldown_s: float,
) -> list[Move]:
    """Greedy balancing moves; updates ``cluster.scores``.

    With the sum of the scores fixed, the CV falls exactly when the sum of their squares does;
    moving a share ``c`` from a broker at ``a`` to one at ``b`` changes that sum by
    ``-2c(a - b - c)``. Per broker, the movable shares are kept sorted, so the best topic of a
    broker (the share nearest ``(a - b) / 2``) is a bisection.
    """
    scores = cluster.scores
    movable: dict[int, tuple[list[float], list[str]]] = {}
    for bid in active:
        entries = sorted(
            (share, topic)
            for topic, share in cluster.shares[bid].items()
            if share > 0 and not now_s - recently_moved.get(topic, -math.inf) < topic_cooldown_s
        )
        movable[bid] = ([s for s, _ in entries], [t for _, t in entries])
    squares = math.fsum(scores[bid] ** 2 for bid in active)
    moves: list[Move] = []
    while len(moves) < max_moves:
        target = min(active, key=lambda bid: (scores[bid], bid))
        low = scores[target]
        best: tuple[float, int, int] | None = None  # (gain, source, index)
        for source in sorted(active, key=lambda bid: (-scores[bid], bid)):
            gap = scores[source] - low
            if gap <= 0:
                break
            shares, _ = movable[source]
            if not shares or shares[0] >= gap:
                continue
            i = bisect.bisect_left(shares, gap / 2)
            for j in (i - 1, i):
                if 0 <= j < len(shares) and shares[j] < gap:
                    gain = 2 * shares[j] * (gap - shares[j])
                    if best is None or gain > best[0]:
                        best = (gain, source, j)
        if best is None or best[0] <= 1e-12 * squares:
            break
        gain, source, j = best
        shares, topics = movable[source]
        share = shares.pop(j)
        topic = topics.pop(j)
        scores[source] -= share
        scores[target] += share
        squares -= gain
        moves.append((topic, source, target))
    return moves


__all__ = [
    "CV_THRESHOLDS",
    "REASON_BELOW_THRESHOLD",
    "REASON_COOL_DOWN",
    "REASON_NO_ACTIVE_BROKER",
    "REASON_NO_IMPROVING_MOVE",
    "REASON_REBALANCED",
    "Move",
    "RebalanceAggressiveness",
    "RebalancePlan",
    "coefficient_of_variation",
    "plan_rebalance",
]
