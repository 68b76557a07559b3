"""A subscription's redelivery settings: negative-ack delay with backoff, ack timeout, and the
redelivery limit after which a message goes to the dead-letter topic.

The settings follow Pulsar's consumer options of the same meaning (``negativeAckRedeliveryDelay``
with a ``MultiplierRedeliveryBackoff``, ``ackTimeout``, ``DeadLetterPolicy.maxRedeliverCount``
and ``deadLetterTopic``; Pulsar docs, "Consumers"), kept per subscription and stored in the
subscription's etcd value (``docs/etcd-layout.md`` §3.4).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from danube_pipeline.errors import MalformedRequestError
from danube_pipeline.metadata import values
from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb

DEFAULT_NACK_REDELIVERY_DELAY_MS = 60_000
"""Delay before the first redelivery of a negatively acknowledged message (Pulsar's default)."""
DEFAULT_NACK_REDELIVERY_MAX_DELAY_MS = 600_000
"""Cap of the doubling nack backoff."""
_MAX_SETTING_MS = 7 * 24 * 3600 * 1000


@dataclasses.dataclass(frozen=True, slots=True)
class RedeliverySettings:
    """How a subscription redelivers.

    Attributes:
        ack_timeout_ms: a message sent to a consumer and not acknowledged within this many
            milliseconds is redelivered (its redelivery count + 1); 0 = never.
        nack_redelivery_delay_ms: a negatively acknowledged message is redelivered after
            ``nack_redelivery_delay_ms * 2**n`` milliseconds, ``n`` its redelivery count before
            the nack, at most ``nack_redelivery_max_delay_ms``.
        nack_redelivery_max_delay_ms: the cap of that backoff, in milliseconds.
        max_redeliveries: a message is delivered at most ``1 + max_redeliveries`` times; when it
            would be redelivered once more it is published to the dead-letter topic and
            acknowledged instead. 0 = unlimited (no dead-letter topic).
        dead_letter_topic: ``/ns/topic`` of the dead-letter topic; ``None`` = the default
            ``{topic}-{subscription}-DLQ`` (:meth:`dead_letter_topic_for`).
    """

    ack_timeout_ms: int = 0
    nack_redelivery_delay_ms: int = DEFAULT_NACK_REDELIVERY_DELAY_MS
    nack_redelivery_max_delay_ms: int = DEFAULT_NACK_REDELIVERY_MAX_DELAY_MS
    max_redeliveries: int = 0
    dead_letter_topic: str | None = None

    def __post_init__(self) -> None:
        for name in ("ack_timeout_ms", "nack_redelivery_delay_ms", "nack_redelivery_max_delay_ms"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= _MAX_SETTING_MS:
                raise MalformedRequestError(f"{name} must be an integer from 0 to {_MAX_SETTING_MS}, not {value!r}")
        if not isinstance(self.max_redeliveries, int) or self.max_redeliveries < 0:
            raise MalformedRequestError(f"max_redeliveries must be >= 0, not {self.max_redeliveries!r}")
        if self.nack_redelivery_max_delay_ms < self.nack_redelivery_delay_ms:
            raise MalformedRequestError(
                f"nack_redelivery_max_delay_ms ({self.nack_redelivery_max_delay_ms}) is below "
                f"nack_redelivery_delay_ms ({self.nack_redelivery_delay_ms})"
            )
        if self.dead_letter_topic is not None:
            TopicName.parse(self.dead_letter_topic)  # InvalidNameError (a MalformedRequestError)

    def nack_delay_s(self, redelivery_count: int) -> float:
        """Seconds before a message nacked with ``redelivery_count`` earlier deliveries is
        redelivered: the doubling backoff, capped."""
        delay_ms = self.nack_redelivery_delay_ms * (1 << min(redelivery_count, 40))
        return min(delay_ms, self.nack_redelivery_max_delay_ms) / 1000

    def dead_letter_topic_for(self, topic: str, subscription: str) -> str:
        """The dead-letter topic of ``subscription`` on ``topic`` (``/ns/topic``): the setting,
        or ``{topic}-{subscription}-DLQ`` (Pulsar's default name).

        Raises:
            InvalidNameError: the default name breaks the topic grammar (too long).
        """
        if self.dead_letter_topic is not None:
            return self.dead_letter_topic
        return TopicName.parse(f"{topic}-{subscription}-DLQ").path

    @classmethod
    def from_pb(cls, settings: pb.SubscriptionSettings) -> RedeliverySettings:
        """From the wire (0 delays mean the defaults; an empty topic the default name).

        Raises:
            MalformedRequestError: a value is out of range or the topic name is malformed.
        """
        return cls(
            ack_timeout_ms=settings.ack_timeout_ms,
            nack_redelivery_delay_ms=settings.nack_redelivery_delay_ms or DEFAULT_NACK_REDELIVERY_DELAY_MS,
            nack_redelivery_max_delay_ms=settings.nack_redelivery_max_delay_ms
            or max(DEFAULT_NACK_REDELIVERY_MAX_DELAY_MS, settings.nack_redelivery_delay_ms),
            max_redeliveries=settings.max_redeliveries,
            dead_letter_topic=TopicName.parse(settings.dead_letter_topic).path if settings.dead_letter_topic else None,
        )

    @classmethod
    def from_stored(cls, value: object) -> RedeliverySettings:
        """From a stored subscription value (§3.4); defaults for a missing or unreadable one."""
        try:
            meta = values.SubscriptionMetadata.from_json(value)
            return cls(**{f: getattr(meta, f) for f in values.SubscriptionMetadata._SETTINGS})
        except (ValueError, TypeError, MalformedRequestError):
            return cls()

    def stored_fields(self) -> dict[str, Any]:
        """The settings as keyword arguments of :class:`~danube_pipeline.metadata.values.SubscriptionMetadata`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


__all__ = [
    "DEFAULT_NACK_REDELIVERY_DELAY_MS",
    "DEFAULT_NACK_REDELIVERY_MAX_DELAY_MS",
    "RedeliverySettings",
]
