"""What a consumer sends to control redelivery, in wire form: the subscription's redelivery
settings on ``Subscribe`` (ack timeout, nack backoff, max redeliveries, dead-letter topic) and
the acked offsets as the fewest ``OffsetRange`` values."""

from __future__ import annotations

from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb


def offset_ranges(offsets: list[int]) -> list[pb.OffsetRange]:
    """``offsets`` as the fewest inclusive ranges (an ack of 10,000 offsets in order is one)."""
    out: list[pb.OffsetRange] = []
    first = last = -2
    for offset in sorted(offsets):
        if offset == last + 1 or offset == last:
            last = offset
            continue
        if first >= 0:
            out.append(pb.OffsetRange(first=first, last=last))
        first = last = offset
    if first >= 0:
        out.append(pb.OffsetRange(first=first, last=last))
    return out


_MAX_SETTING_MS = 7 * 24 * 3600 * 1000
"""The longest time setting: 7 days, in ms."""


def subscription_settings(
    *,
    ack_timeout_ms: int | None,
    nack_redelivery_delay_ms: int | None,
    nack_redelivery_max_delay_ms: int | None,
    max_redeliveries: int | None,
    dead_letter_topic: str | None,
) -> pb.SubscriptionSettings | None:
    """The redelivery settings to send on ``Subscribe``; ``None`` when none is given.

    Raises:
        ValueError: a time is negative or over 7 days, or ``max_redeliveries`` is negative.
        InvalidNameError: ``dead_letter_topic`` is not a valid topic name.
    """
    given = (ack_timeout_ms, nack_redelivery_delay_ms, nack_redelivery_max_delay_ms, max_redeliveries, dead_letter_topic)
    if all(v is None for v in given):
        return None
    for name, value in (
        ("ack_timeout_ms", ack_timeout_ms),
        ("nack_redelivery_delay_ms", nack_redelivery_delay_ms),
        ("nack_redelivery_max_delay_ms", nack_redelivery_max_delay_ms),
    ):
        if value is not None and not 0 <= value <= _MAX_SETTING_MS:
            raise ValueError(f"{name} must be from 0 to {_MAX_SETTING_MS} ms, not {value}")
    if max_redeliveries is not None and max_redeliveries < 0:
        raise ValueError(f"max_redeliveries must be >= 0, not {max_redeliveries}")
    if (
        nack_redelivery_delay_ms is not None
        and nack_redelivery_max_delay_ms is not None
        and nack_redelivery_max_delay_ms < nack_redelivery_delay_ms
    ):
        raise ValueError("nack_redelivery_max_delay_ms is below nack_redelivery_delay_ms")
    return pb.SubscriptionSettings(
        ack_timeout_ms=ack_timeout_ms or 0,
        nack_redelivery_delay_ms=nack_redelivery_delay_ms or 0,
        nack_redelivery_max_delay_ms=nack_redelivery_max_delay_ms or 0,
        max_redeliveries=max_redeliveries or 0,
        dead_letter_topic=TopicName.parse(dead_letter_topic).path if dead_letter_topic else "",
    )
