"""The load manager's decisions as pure, deterministic functions: which broker takes a topic,
and which topics move when the brokers' load drifts apart (``docs/etcd-layout.md`` §1).

Nothing here does I/O, reads a clock or draws a random number: the leader's loop reads the load
reports (§1.6) and broker states (§1.3), calls :func:`choose_broker` or :func:`plan_rebalance`,
and carries the moves out itself (:mod:`broker.cluster.leader` assigns the unassigned queue of §1.5,
:mod:`broker.cluster.rebalance` moves topics by unloading them into that queue). The same input always gives the same
output, whatever the order of the brokers in it.

The package is split by job:

* :mod:`.strategies`: the load input (:class:`BrokerLoad` from a §1.6 report), the strategies
  ``fair``, ``balanced`` and ``weighted_load`` that score brokers, and :func:`choose_broker`;
* :mod:`.plan`: the rebalance plan, drain and greedy balancing moves judged by the coefficient
  of variation of the scores (:func:`plan_rebalance`);
* :mod:`.decision`: :class:`LoadBalanceDecision`, the plan as stored in ``/cluster/load_balance``
  (§1.8).
"""

from broker.cluster.load_manager.decision import LoadBalanceDecision, LoadBalanceMove
from broker.cluster.load_manager.plan import (
    CV_THRESHOLDS,
    REASON_BELOW_THRESHOLD,
    REASON_COOL_DOWN,
    REASON_NO_ACTIVE_BROKER,
    REASON_NO_IMPROVING_MOVE,
    REASON_REBALANCED,
    Move,
    RebalanceAggressiveness,
    RebalancePlan,
    coefficient_of_variation,
    plan_rebalance,
)
from broker.cluster.load_manager.strategies import (
    BROKER_MODES,
    BYTE_RATE_RESOURCE,
    CPU_RESOURCE,
    MEMORY_RESOURCE,
    MSG_RATE_RESOURCE,
    STRATEGY_WEIGHTS,
    BrokerLoad,
    BrokerMode,
    Strategy,
    StrategyWeights,
    TopicLoad,
    broker_scores,
    choose_broker,
    topic_loads,
)

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
