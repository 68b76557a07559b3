"""The enumerations the broker, the client and the etcd values share.

Each one's values are what Danube stores in etcd (``docs/etcd-layout.md``): the subscription
type's integer in a subscription key (§3.4) and the delivery mode's string in a topic's
``delivery`` key (§3.2). Member names are the names of the broker API's protobuf enums, so
``SubscriptionType.SHARED.name`` can be passed where the protobuf field takes an enum.
"""

from __future__ import annotations

import enum

__all__ = ["DeliveryMode", "InitialPosition", "SubscriptionType"]


class SubscriptionType(enum.IntEnum):
    """How a subscription shares messages among its consumers (``docs/etcd-layout.md`` §3.4).

    Attributes:
        EXCLUSIVE: one consumer at a time; a second ``Subscribe`` is refused.
        SHARED: messages are spread round-robin over every consumer of the subscription.
        FAILOVER: one active consumer receives everything; the others stand by and take
            over, with the unacknowledged messages, when it leaves.
        KEY_SHARED: messages of one key go to one consumer, in order; keys are spread over the
            consumers by hash ranges (Pulsar's Key_Shared, AUTO_SPLIT).
    """

    EXCLUSIVE = 0
    SHARED = 1
    FAILOVER = 2
    KEY_SHARED = 3


class DeliveryMode(enum.StrEnum):
    """A topic's delivery guarantee; the value is stored as a JSON string (§3.2).

    Attributes:
        RELIABLE: every message is written to the WAL and ``fdatasync``-ed before its ack, and
            dispatched to consumers with acknowledgements and durable cursors.
        NON_RELIABLE: best effort: messages are acknowledged and dispatched from a bounded
            in-memory buffer on the owning broker (no WAL, no ``fdatasync``, not tiered); the
            oldest unread ones are dropped when it is full, and all are lost on a restart.
    """

    RELIABLE = "Reliable"
    NON_RELIABLE = "NonReliable"

    @classmethod
    def from_stored(cls, value: object) -> DeliveryMode:
        """The mode stored in etcd, ``RELIABLE`` for a missing or unknown value."""
        return cls.NON_RELIABLE if value == cls.NON_RELIABLE.value else cls.RELIABLE

    @classmethod
    def from_wire(cls, number: int) -> DeliveryMode:
        """The mode for a ``danube.v1.DeliveryMode`` protobuf number (unknown numbers are
        ``RELIABLE``, proto3's default)."""
        return cls.NON_RELIABLE if number == 1 else cls.RELIABLE


class InitialPosition(enum.IntEnum):
    """Where a new subscription starts reading (protobuf ``danube.v1.InitialPosition``).

    Attributes:
        LATEST: only messages published after the subscription is created.
        EARLIEST: from the oldest retained offset.
    """

    LATEST = 0
    EARLIEST = 1
