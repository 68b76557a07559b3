"""The load manager's decisions as pure, deterministic functions: which broker takes a topic,
and which topics move when the brokers' load drifts apart (``docs/etcd-layout.md`` §1).

Nothing here does I/O, reads a clock or draws a random number: the leader's loop reads the load
reports (§1.6) and broker states (§1.3), calls :func:`choose_broker` or :func:`plan_rebalance`,
and carries the moves out itself (:mod:`broker.cluster.leader` assigns the unassigned queue of §1.5,
:mod:`broker.cluster.rebalance` moves topics by unloading them into that queue). The same input always gives the same
output, whatever the order of the brokers in it.

Input
-----
One :class:`BrokerLoad` per broker, built from its ``LoadReport`` (§1.6) with
:meth:`BrokerLoad.from_report`: CPU and memory percentages (``resources_usage``), the topics
(``topic_list``), the message and byte rates, and the broker's ``state``: ``active`` or
``draining`` from §1.3, or ``drained``, which the leader decides itself (a draining broker that
holds no topic any more, or whose registration §1.2 is gone). Only ``active`` brokers receive
topics; every topic of a ``draining`` or ``drained`` broker is planned to move.

**The rates ``weighted_load`` needs.** A broker's report (§1.6) carries them as two more
``resources_usage`` entries, whole numbers over the last report interval, so the value keeps
Danube's layout: ``MsgRate`` (messages per second written to the broker's topics) and
``ByteRate`` (record-batch bytes per second, the WAL's bytes). An older broker's report has
neither; they read as 0 and ``weighted_load`` ranks it by CPU, memory and topic count alone.
A report has no rates per topic: :class:`BrokerLoad` ``per_topic`` (:class:`TopicLoad`) is for
callers that know them; a topic missing from it gets an even share of what the broker totals
leave (:func:`topic_loads`), and without it every topic gets an even share.

Scores
------
Each strategy (Danube's names, :class:`Strategy`) gives every broker a score, a weighted sum of
load dimensions, each divided by its cluster mean::

    score(b) = Σ_k  weight_k · x_k(b) / mean_k,     mean_k = Σ_b x_k(b) / (number of active brokers)

so 1.0 is an average active broker once draining brokers are empty (the weights of a strategy
sum to 1; a dimension that is 0 everywhere drops out). Dimensions: topic count, CPU %, memory %,
msg/s, bytes/s. :data:`STRATEGY_WEIGHTS`:

- ``fair``: topic count only;
- ``balanced``: topic count 0.5, CPU 0.25, memory 0.25 (Danube's composite ranking weighs
  topics, CPU and memory 1 : 0.5 : 0.5 too, on raw numbers);
- ``weighted_load``: msg/s 0.3, bytes/s 0.3, CPU 0.15, memory 0.15, topic count 0.1 (an idle
  topic still costs a WAL and memory, and an idle cluster still needs a ranking).

To predict the effect of a move, a broker's score is split into its topics' shares: each topic
carries one topic's worth of the count term, its own rates, and a part of its broker's CPU and
memory, an even part in ``fair`` and ``balanced``, and in ``weighted_load`` a part proportional
to its msg/s (CPU) and bytes/s (memory), even when the broker's rate is 0. A moved topic is
predicted to take that share with it. A broker without topics keeps its CPU and memory terms as
a fixed base. The prediction is a model, not a measurement: the next reports tell what the move
really did.

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

Decision record: ``/cluster/load_balance`` (§1.8)
--------------------------------------------------
:class:`LoadBalanceDecision` is the value the leader's rebalancer (:mod:`broker.cluster.rebalance`) writes
to ``/cluster/load_balance``, one JSON object per plan that moves topics, the fields in this order:

================  ==========================  ==================================================
field             type                        meaning
================  ==========================  ==================================================
``epoch``         integer                     the leader's epoch, a number that grows with every
                                              new leader (e.g. the ``create_revision`` of
                                              ``/cluster/leader``, §1.7); a reader ignores a
                                              decision older than one it has seen
``timestamp``     integer                     when the plan was made, whole seconds since the
                                              Unix epoch (Conventions)
``strategy``      string                      ``fair``, ``balanced`` or ``weighted_load``
``cv_before``     number                      CV of the active brokers' scores before the plan
``cv_after``      number                      predicted CV once every move is made
``moves``         array of objects            ``{"topic": "/{ns}/{topic}", "from_broker": u64,
                                              "to_broker": u64}``, in the order to make them
                                              (drain moves first)
================  ==========================  ==================================================

Example (compact in etcd)::

    {"epoch":7,"timestamp":1767225600,"strategy":"fair","cv_before":0.47,"cv_after":0.0,
     "moves":[{"topic":"/default/flights","from_broker":16861613898696940338,"to_broker":42}]}
"""

from __future__ import annotations

import bisect
import enum
import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

from danube_pipeline.metadata.values import JsonRecord, LoadReport

BrokerMode = Literal["active", "draining", "drained"]
"""``active`` and ``draining`` are the modes of §1.3; ``drained`` is the leader's own verdict."""

BROKER_MODES: tuple[str, ...] = ("active", "draining", "drained")

CPU_RESOURCE = "CPU"
"""§1.6 ``resources_usage`` entry: the 1-minute load average, percent of the CPUs."""
MEMORY_RESOURCE = "Memory"
"""§1.6 ``resources_usage`` entry: used memory, percent."""
MSG_RATE_RESOURCE = "MsgRate"
"""§1.6 ``resources_usage`` entry: messages per second written to the broker's topics over the
last report interval (whole number)."""
BYTE_RATE_RESOURCE = "ByteRate"
"""§1.6 ``resources_usage`` entry: record-batch bytes per second written to the broker's topics
over the last report interval (whole number)."""


class Strategy(enum.StrEnum):
    """How brokers are scored (Danube's names); see the module docstring, "Scores"."""

    FAIR = "fair"
    BALANCED = "balanced"
    WEIGHTED_LOAD = "weighted_load"


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


@dataclass(frozen=True, slots=True)
class StrategyWeights:
    """The weight of each load dimension in a score; they sum to 1.

    Attributes:
        topics: topic count.
        cpu: CPU percent (§1.6).
        memory: memory percent (§1.6).
        msg_rate: messages per second.
        byte_rate: payload bytes per second.
    """

    topics: float
    cpu: float
    memory: float
    msg_rate: float
    byte_rate: float


STRATEGY_WEIGHTS: Mapping[Strategy, StrategyWeights] = {
    Strategy.FAIR: StrategyWeights(topics=1.0, cpu=0.0, memory=0.0, msg_rate=0.0, byte_rate=0.0),
    Strategy.BALANCED: StrategyWeights(topics=0.5, cpu=0.25, memory=0.25, msg_rate=0.0, byte_rate=0.0),
    Strategy.WEIGHTED_LOAD: StrategyWeights(topics=0.1, cpu=0.15, memory=0.15, msg_rate=0.3, byte_rate=0.3),
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


def _check_rate(owner: str, name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}: {name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class TopicLoad(JsonRecord):
    """The traffic of one topic, averaged over a report interval (:class:`BrokerLoad`
    ``per_topic``).

    Attributes:
        msg_per_s: messages published per second.
        bytes_per_s: payload bytes published per second.

    Raises:
        ValueError: a rate is negative, not finite or not a number.
    """

    msg_per_s: float = 0.0
    bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        _check_rate("TopicLoad", "msg_per_s", self.msg_per_s)
        _check_rate("TopicLoad", "bytes_per_s", self.bytes_per_s)


@dataclass(frozen=True, slots=True)
class BrokerLoad:
    """One broker's load as the leader sees it.

    Attributes:
        broker_id: the broker's u64 id.
        cpu_percent: §1.6 ``CPU`` (can exceed 100).
        memory_percent: §1.6 ``Memory``.
        topics: the topics it holds, ``/{ns}/{topic}``, each once.
        msg_per_s: messages per second over all its topics.
        bytes_per_s: payload bytes per second over all its topics.
        per_topic: rates per topic, when the report has them; a topic left out shares what the
            totals leave (:func:`topic_loads`), an entry for a topic not in ``topics`` is ignored.
        state: ``active``, ``draining`` or ``drained`` (module docstring, "Input").

    Raises:
        ValueError: an unknown ``state``, a negative or non-finite figure, or a topic listed
            twice.
    """

    broker_id: int
    cpu_percent: float
    memory_percent: float
    topics: list[str]
    msg_per_s: float = 0.0
    bytes_per_s: float = 0.0
    per_topic: dict[str, TopicLoad] | None = None
    state: BrokerMode = "active"

    def __post_init__(self) -> None:
        owner = f"BrokerLoad {self.broker_id}"
        if self.state not in BROKER_MODES:
            raise ValueError(f"{owner}: state must be one of {', '.join(BROKER_MODES)}, got {self.state!r}")
        for name in ("cpu_percent", "memory_percent", "msg_per_s", "bytes_per_s"):
            _check_rate(owner, name, getattr(self, name))
        if len(set(self.topics)) != len(self.topics):
            raise ValueError(f"{owner}: a topic is listed twice")

    @classmethod
    def from_report(
        cls,
        broker_id: int,
        report: LoadReport,
        *,
        state: BrokerMode = "active",
        msg_per_s: float | None = None,
        bytes_per_s: float | None = None,
        per_topic: dict[str, TopicLoad] | None = None,
        topics: Sequence[str] | None = None,
    ) -> BrokerLoad:
        """Build from a §1.6 load report: ``CPU``, ``Memory``, ``MsgRate`` and ``ByteRate`` of
        ``resources_usage`` (0 when absent) and ``topic_list``; ``state`` comes from §1.3 or the
        leader.

        Args:
            broker_id: the broker's u64 id.
            report: its load report.
            state: ``active``, ``draining`` or ``drained``.
            msg_per_s: overrides the report's ``MsgRate`` (messages per second).
            bytes_per_s: overrides the report's ``ByteRate`` (bytes per second).
            per_topic: rates per topic (a §1.6 report has none).
            topics: overrides ``topic_list``, e.g. with the assignment keys (§1.4), which the
                leader's cache has before the broker's next report.

        Raises:
            ValueError: as the class.
        """
        usage = {u.resource: u.usage for u in report.resources_usage}
        return cls(
            broker_id=broker_id,
            cpu_percent=float(usage.get(CPU_RESOURCE, 0)),
            memory_percent=float(usage.get(MEMORY_RESOURCE, 0)),
            topics=list(report.topic_list if topics is None else topics),
            msg_per_s=float(usage.get(MSG_RATE_RESOURCE, 0)) if msg_per_s is None else msg_per_s,
            bytes_per_s=float(usage.get(BYTE_RATE_RESOURCE, 0)) if bytes_per_s is None else bytes_per_s,
            per_topic=per_topic,
            state=state,
        )


def topic_loads(broker: BrokerLoad) -> dict[str, TopicLoad]:
    """The rates of each topic of ``broker``, in the order of ``broker.topics``.

    A topic in ``per_topic`` has its own rates; the others share evenly what the broker totals
    leave once the known rates are taken off (0 when the known ones already exceed the totals).
    Without ``per_topic``, every topic gets an even share of the totals.
    """
    known = broker.per_topic or {}
    missing = [t for t in broker.topics if t not in known]
    msg_left = bytes_left = 0.0
    if missing:
        msg_left = max(0.0, broker.msg_per_s - math.fsum(known[t].msg_per_s for t in broker.topics if t in known))
        bytes_left = max(0.0, broker.bytes_per_s - math.fsum(known[t].bytes_per_s for t in broker.topics if t in known))
    share = TopicLoad(msg_left / len(missing), bytes_left / len(missing)) if missing else TopicLoad()
    return {t: known.get(t, share) for t in broker.topics}


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


@dataclass(slots=True)
class _Cluster:
    """Scores split into topic shares (module docstring, "Scores")."""

    modes: dict[int, str]
    scores: dict[int, float]
    shares: dict[int, dict[str, float]]  # broker id -> topic -> share of its score, topics sorted


def _inverse_mean(total: float, active: int) -> float:
    return active / total if total > 0 else 0.0


def _cluster(brokers: Iterable[BrokerLoad], strategy: Strategy) -> _Cluster:
    ordered = sorted(brokers, key=lambda b: b.broker_id)
    ids = [b.broker_id for b in ordered]
    if len(set(ids)) != len(ids):
        raise ValueError("a broker id appears twice")
    w = STRATEGY_WEIGHTS[strategy]
    active = max(1, sum(1 for b in ordered if b.state == "active"))
    rated = w.msg_rate > 0 or w.byte_rate > 0
    rates = {b.broker_id: topic_loads(b) for b in ordered} if rated else {}
    inv_topics = _inverse_mean(float(sum(len(b.topics) for b in ordered)), active)
    inv_cpu = _inverse_mean(math.fsum(b.cpu_percent for b in ordered), active)
    inv_memory = _inverse_mean(math.fsum(b.memory_percent for b in ordered), active)
    inv_msg = inv_bytes = 0.0
    if rated:
        inv_msg = _inverse_mean(math.fsum(r.msg_per_s for t in rates.values() for r in t.values()), active)
        inv_bytes = _inverse_mean(math.fsum(r.bytes_per_s for t in rates.values() for r in t.values()), active)
    by_traffic = strategy is Strategy.WEIGHTED_LOAD
    cluster = _Cluster(modes={}, scores={}, shares={})
    for b in ordered:
        bid = b.broker_id
        cluster.modes[bid] = b.state
        cpu_term = w.cpu * b.cpu_percent * inv_cpu
        memory_term = w.memory * b.memory_percent * inv_memory
        topics = sorted(b.topics)
        shares: dict[str, float] = {}
        if not topics:
            cluster.scores[bid] = cpu_term + memory_term
            cluster.shares[bid] = shares
            continue
        even = 1.0 / len(topics)
        base = w.topics * inv_topics
        if rated:
            own = rates[bid]
            msg_total = math.fsum(r.msg_per_s for r in own.values())
            bytes_total = math.fsum(r.bytes_per_s for r in own.values())
            for t in topics:
                r = own[t]
                cpu_part = r.msg_per_s / msg_total if by_traffic and msg_total > 0 else even
                memory_part = r.bytes_per_s / bytes_total if by_traffic and bytes_total > 0 else even
                shares[t] = (
                    base
                    + cpu_term * cpu_part
                    + memory_term * memory_part
                    + w.msg_rate * r.msg_per_s * inv_msg
                    + w.byte_rate * r.bytes_per_s * inv_bytes
                )
        else:
            share = base + (cpu_term + memory_term) * even
            shares = dict.fromkeys(topics, share)
        cluster.shares[bid] = shares
        cluster.scores[bid] = math.fsum(shares.values())
    return cluster


def broker_scores(brokers: Sequence[BrokerLoad], strategy: Strategy | str) -> dict[int, float]:
    """Every broker's score under ``strategy`` (1.0 = an average active broker), draining ones
    included, by broker id.

    Raises:
        ValueError: an unknown strategy, or a broker id twice.
    """
    return dict(_cluster(brokers, Strategy(strategy)).scores)


def choose_broker(unassigned_topic: str, brokers: Sequence[BrokerLoad], strategy: Strategy | str) -> int:
    """The broker that should take ``unassigned_topic`` (a new topic, or one from the
    unassigned queue §1.5): the active broker with the lowest score, the lowest id on a tie.

    A topic without history has no rates, so the choice depends on the brokers only. To place
    several topics, add each chosen topic to its broker's :class:`BrokerLoad` before choosing for
    the next one.

    Returns:
        The broker id.

    Raises:
        ValueError: no broker is active, an unknown strategy, or a broker id twice.
    """
    cluster = _cluster(brokers, Strategy(strategy))
    active = [bid for bid, mode in cluster.modes.items() if mode == "active"]
    if not active:
        raise ValueError(f"no active broker can take {unassigned_topic}")
    return min(active, key=lambda bid: (cluster.scores[bid], bid))


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
        _check_rate("plan_rebalance", "aggressiveness", aggressiveness)
        threshold = float(aggressiveness)
    if max_moves < 0 or cooldown_s < 0 or topic_cooldown_s < 0:
        raise ValueError("max_moves, cooldown_s and topic_cooldown_s must be >= 0")
    cluster = _cluster(brokers, strategy)
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
    cluster: _Cluster,
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class LoadBalanceMove(JsonRecord):
    """One entry of :class:`LoadBalanceDecision` ``moves``.

    Attributes:
        topic: ``/{ns}/{topic}``.
        from_broker: the u64 id of the broker giving the topic up.
        to_broker: the u64 id of the broker taking it.
    """

    topic: str
    from_broker: int
    to_broker: int

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """Build from a decoded JSON object.

        Raises:
            ValueError: ``data`` is not an object, a field is missing or of the wrong type.
        """
        move = JsonRecord.from_json.__func__(cls, data)  # type: ignore[attr-defined]
        if not isinstance(move.topic, str) or not _is_int(move.from_broker) or not _is_int(move.to_broker):
            raise ValueError(f"LoadBalanceMove: expected a topic string and two integer broker ids, got {data!r}")
        return move  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class LoadBalanceDecision(JsonRecord):
    """The value of ``/cluster/load_balance`` (§1.8): one plan of the leader. The
    fields are described in the module docstring ("Decision record").

    Attributes:
        epoch: the leader's epoch.
        timestamp: whole seconds since the Unix epoch.
        strategy: a :class:`Strategy` value.
        cv_before: CV before the plan.
        cv_after: predicted CV after it.
        moves: in the order to make them.
    """

    epoch: int
    timestamp: int
    strategy: str
    cv_before: float
    cv_after: float
    moves: list[LoadBalanceMove]
    _nested: ClassVar[dict[str, type[JsonRecord]]] = {"moves": LoadBalanceMove}

    @classmethod
    def from_plan(cls, plan: RebalancePlan, *, epoch: int, timestamp: float, strategy: Strategy | str) -> Self:
        """The decision for ``plan``; ``timestamp`` (seconds) is rounded down to whole seconds,
        the CVs to 6 decimals."""
        return cls(
            epoch=epoch,
            timestamp=int(timestamp),
            strategy=Strategy(strategy).value,
            cv_before=round(plan.cv_before, 6),
            cv_after=round(plan.cv_after, 6),
            moves=[LoadBalanceMove(t, a, b) for t, a, b in plan.moves],
        )

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """Build from a decoded JSON object.

        Raises:
            ValueError: ``data`` is not an object, a field is missing or of the wrong type, or
                ``strategy`` is not a :class:`Strategy` value.
        """
        decision = JsonRecord.from_json.__func__(cls, data)  # type: ignore[attr-defined]
        if not _is_int(decision.epoch) or decision.epoch < 0:
            raise ValueError(f"LoadBalanceDecision: epoch must be an integer >= 0, got {decision.epoch!r}")
        if not _is_int(decision.timestamp) or decision.timestamp < 0:
            raise ValueError(f"LoadBalanceDecision: timestamp must be whole seconds >= 0, got {decision.timestamp!r}")
        if decision.strategy not in {s.value for s in Strategy}:
            raise ValueError(f"LoadBalanceDecision: unknown strategy {decision.strategy!r}")
        for name in ("cv_before", "cv_after"):
            _check_rate("LoadBalanceDecision", name, getattr(decision, name))
        if not isinstance(decision.moves, list):
            raise ValueError("LoadBalanceDecision: moves must be an array")
        return decision  # type: ignore[no-any-return]


__all__ = [
    "BROKER_MODES",
    "BYTE_RATE_RESOURCE",
    "CPU_RESOURCE",
    "CV_THRESHOLDS",
    "MEMORY_RESOURCE",
    "MSG_RATE_RESOURCE",
    "REASON_BELOW_THRESHOLD",
    "REASON_COOL_DOWN",
    "REASON_NO_ACTIVE_BROKER",
    "REASON_NO_IMPROVING_MOVE",
    "REASON_REBALANCED",
    "STRATEGY_WEIGHTS",
    "BrokerLoad",
    "BrokerMode",
    "LoadBalanceDecision",
    "LoadBalanceMove",
    "Move",
    "RebalanceAggressiveness",
    "RebalancePlan",
    "Strategy",
    "StrategyWeights",
    "TopicLoad",
    "broker_scores",
    "choose_broker",
    "coefficient_of_variation",
    "plan_rebalance",
    "topic_loads",
]
