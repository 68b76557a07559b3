"""Messages accepted for appending and not yet written: what one group commit encodes."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from danube_pipeline.records import Record, encode_record


@dataclass(frozen=True, slots=True)
class PendingMessage:
    """A message accepted for appending; the WAL gives it its offset.

    Attributes:
        payload: message bytes.
        publish_time_us: microseconds since the Unix epoch (already stamped by the caller).
        producer_id: u64 producer id (``docs/etcd-layout.md`` §3.3).
        producer_name: the producer's name.
        schema_id: global schema id, 0 = none.
        schema_version: schema version, 0 = none.
        attributes: user key/value pairs.
    """

    payload: bytes
    publish_time_us: int
    producer_id: int = 0
    producer_name: str = ""
    schema_id: int = 0
    schema_version: int = 0
    attributes: Mapping[str, str] = field(default_factory=dict)

    def to_record(self, offset: int) -> Record:
        """The :class:`Record` this message becomes at ``offset``."""
        return Record(
            offset=offset,
            publish_time_us=self.publish_time_us,
            producer_id=self.producer_id,
            producer_name=self.producer_name,
            schema_id=self.schema_id,
            schema_version=self.schema_version,
            payload=self.payload,
            attributes=dict(self.attributes),
        )


@dataclass(slots=True)
class PendingAppend:
    """One ``enqueue`` call waiting for the next group commit."""

    first_offset: int
    messages: Sequence[PendingMessage]
    future: asyncio.Future[tuple[int, int]]
    estimated_bytes: int


def estimated_size_bytes(messages: Sequence[PendingMessage]) -> int:
    """Approximate encoded size (frame + fixed fields + variable parts), for segment rolling."""
    total = 0
    for m in messages:
        total += 48 + len(m.payload) + len(m.producer_name)
        for k, v in m.attributes.items():
            total += 6 + len(k) + len(v)
    return total


def encode_appends(
    pending: Sequence[PendingAppend], start_position: int
) -> tuple[bytes, list[tuple[int, int]]]:
    """Encode every queued message; return the bytes and each record's (offset, position)."""
    parts: list[bytes] = []
    positions: list[tuple[int, int]] = []
    pos = start_position
    for item in pending:
        offset = item.first_offset
        for msg in item.messages:
            data = encode_record(msg.to_record(offset))
            parts.append(data)
            positions.append((offset, pos))
            pos += len(data)
            offset += 1
    return b"".join(parts), positions
