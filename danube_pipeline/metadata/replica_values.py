"""The JSON values of topic replication (``docs/etcd-layout.md`` §1.9, §5.9): which brokers hold
a copy of a topic's log, and which of them are in sync with its owner (Kafka's replica
assignment and ISR, KIP-101). Encoded and decoded like every value
(:mod:`danube_pipeline.metadata.values`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Self

from danube_pipeline.metadata.records import JsonRecord

__all__ = ["InSyncReplicas", "ReplicaAssignment"]


def _check_broker_ids(value: Any, name: str, where: str) -> list[int]:
    """``value`` if it is a non-empty list of distinct broker ids (u64), for field ``name``.

    Raises:
        ValueError: it is not.
    """
    if (
        not isinstance(value, list)
        or not value
        or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in value)
        or len(set(value)) != len(value)
    ):
        raise ValueError(f"{where}: {name} must be a non-empty list of distinct broker ids, got {value!r}")
    return value


def _check_int(value: Any, name: str, where: str, minimum: int) -> None:
    """Raise ``ValueError`` unless ``value`` is an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaAssignment(JsonRecord):
    """§1.9 ``/cluster/replicas/{ns}/{topic}``: the brokers that hold a copy of the topic's log.

    Attributes:
        replicas: broker ids, the owner (§1.4) included; the order means nothing.
        since: when the set was last written, seconds since the Unix epoch.
    """

    replicas: list[int]
    since: int

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """Build from a decoded JSON object.

        Raises:
            ValueError: ``data`` is not an object, ``replicas`` is not a non-empty list of
                distinct broker ids, or ``since`` is not an integer >= 0.
        """
        value = cls._from_fields(data)
        _check_broker_ids(value.replicas, "replicas", "ReplicaAssignment")
        _check_int(value.since, "since", "ReplicaAssignment", 0)
        return value


@dataclasses.dataclass(frozen=True, slots=True)
class InSyncReplicas(JsonRecord):
    """§5.9 ``/danube-data/storage/topics/{ns}/{topic}/isr``: the topic's in-sync replicas, as
    its owner last recorded them (Kafka's ISR, KIP-101).

    Attributes:
        owner: the broker that wrote it, the topic's owner (§1.4).
        owner_epoch: that owner's epoch, the create revision of its assignment key (§1.4).
        isr: the owner and the followers whose log end reached the owner's within
            ``--replica-lag-max-s``; the order means nothing.
        high_watermark: the next offset below which every ISR member holds every batch (the
            lowest log end among the ISR), as of the last ISR change.
    """

    owner: int
    owner_epoch: int
    isr: list[int]
    high_watermark: int

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """Build from a decoded JSON object.

        Raises:
            ValueError: ``data`` is not an object, ``isr`` is not a non-empty list of distinct
                broker ids, or another field is not an integer >= 0.
        """
        value = cls._from_fields(data)
        _check_broker_ids(value.isr, "isr", "InSyncReplicas")
        for name in ("owner", "owner_epoch", "high_watermark"):
            _check_int(getattr(value, name), name, "InSyncReplicas", 0)
        return value
