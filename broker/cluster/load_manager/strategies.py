"""How the load manager scores brokers (``docs/etcd-layout.md`` §1): the load of each broker,
the strategies ``fair``, ``balanced`` and ``weighted_load``, and the broker that takes a new
topic (:func:`choose_broker`). Pure and deterministic, as all of :mod:`broker.cluster.load_manager`.

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
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

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

def check_rate(owner: str, name: str, value: float) -> None:
    """Check that ``value`` is a finite number >= 0 (not a bool).

    Raises:
        ValueError: it is not, naming ``owner`` and ``name``.
    """
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
        check_rate("TopicLoad", "msg_per_s", self.msg_per_s)
        check_rate("TopicLoad", "bytes_per_s", self.bytes_per_s)


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
            check_rate(owner, name, getattr(self, name))
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


@dataclass(slots=True)
class ClusterScores:
    """Scores split into topic shares (module docstring, "Scores").

    Attributes:
        modes: each broker's state, by broker id.
        scores: each broker's score, by broker id.
        shares: each broker's topics and the share of its score each carries.
    """

    modes: dict[int, str]
    scores: dict[int, float]
    shares: dict[int, dict[str, float]]  # broker id -> topic -> share of its score, topics sorted


def _inverse_mean(total: float, active: int) -> float:
    return active / total if total > 0 else 0.0


def score_cluster(brokers: Iterable[BrokerLoad], strategy: Strategy) -> ClusterScores:
    """Every broker's score under ``strategy``, split into its topics' shares (module
    docstring, "Scores").

    Raises:
        ValueError: a broker id twice.
    """
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
    cluster = ClusterScores(modes={}, scores={}, shares={})
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
    return dict(score_cluster(brokers, Strategy(strategy)).scores)


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
    cluster = score_cluster(brokers, Strategy(strategy))
    active = [bid for bid, mode in cluster.modes.items() if mode == "active"]
    if not active:
        raise ValueError(f"no active broker can take {unassigned_topic}")
    return min(active, key=lambda bid: (cluster.scores[bid], bid))


__all__ = [
    "BROKER_MODES",
    "BYTE_RATE_RESOURCE",
    "CPU_RESOURCE",
    "MEMORY_RESOURCE",
    "MSG_RATE_RESOURCE",
    "STRATEGY_WEIGHTS",
    "BrokerLoad",
    "BrokerMode",
    "ClusterScores",
    "Strategy",
    "StrategyWeights",
    "TopicLoad",
    "broker_scores",
    "check_rate",
    "choose_broker",
    "score_cluster",
    "topic_loads",
]
