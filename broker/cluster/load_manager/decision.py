"""The leader's rebalancing decision as it is stored in etcd.

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

from dataclasses import dataclass
from typing import Any, ClassVar, Self

from danube_pipeline.metadata.values import JsonRecord

from broker.cluster.load_manager.plan import RebalancePlan
from broker.cluster.load_manager.strategies import Strategy, check_rate

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
        move = cls._from_fields(data)
        if not isinstance(move.topic, str) or not _is_int(move.from_broker) or not _is_int(move.to_broker):
            raise ValueError(f"LoadBalanceMove: expected a topic string and two integer broker ids, got {data!r}")
        return move


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
        decision = cls._from_fields(data)
        if not _is_int(decision.epoch) or decision.epoch < 0:
            raise ValueError(f"LoadBalanceDecision: epoch must be an integer >= 0, got {decision.epoch!r}")
        if not _is_int(decision.timestamp) or decision.timestamp < 0:
            raise ValueError(f"LoadBalanceDecision: timestamp must be whole seconds >= 0, got {decision.timestamp!r}")
        if decision.strategy not in {s.value for s in Strategy}:
            raise ValueError(f"LoadBalanceDecision: unknown strategy {decision.strategy!r}")
        for name in ("cv_before", "cv_after"):
            check_rate("LoadBalanceDecision", name, getattr(decision, name))
        if not isinstance(decision.moves, list):
            raise ValueError("LoadBalanceDecision: moves must be an array")
        return decision


__all__ = ["LoadBalanceDecision", "LoadBalanceMove"]
