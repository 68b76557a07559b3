"""A quarantined WAL segment: corruption in the middle of a file with valid batches after it,
kept byte for byte with a marker ``{segment file name}.quarantine`` next to it until an
operator decides (:mod:`broker.storage.wal.recovery` finds it, :mod:`broker.storage.wal.repair`
lifts it)."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import crc32c as _crc32c

from danube_pipeline.errors import SegmentQuarantinedError
from danube_pipeline.format import batches
from danube_pipeline.format.records import (
    BATCH_FORMAT_VERSION,
    EPOCH_PREFIX_SIZE,
    FORMAT_VERSION,
    LEGACY_FORMAT_VERSION,
    MAX_RECORD_BODY_BYTES,
    RECORD_FIXED_SIZE,
    RECORD_FRAME_SIZE,
)
from danube_pipeline.format.records import SEGMENT_HEADER_SIZE
from danube_pipeline.format.segments import MAX_BATCH_BYTES, has_epoch_prefix, scan_batches

QUARANTINE_SUFFIX = ".quarantine"
"""Suffix of the marker written next to a quarantined segment: ``{segment file name}.quarantine``."""

_BATCH_PREFIX = struct.Struct("<QII")  # base_offset, batch_length, crc32c
_BATCH_COUNT = struct.Struct("<I")
_BATCH_MAGIC_AT = 16
_BATCH_COUNT_AT = 20
_FRAME = struct.Struct("<II")  # version 1: body_length, crc32c
_OFFSET = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class Quarantine:
    """A segment with corruption in the middle, kept byte for byte until an operator decides.

    Attributes:
        segment: the segment file.
        position: byte position of the bad batch; the good prefix is bytes ``[0, position)``.
        last_good_offset: the last offset of the good prefix (the segment's start - 1 if none).
        next_valid_offset: base offset of the first valid batch found after the bad one.
        next_valid_position: byte position of that batch.
        error: why the scan stopped at ``position``.
        detected_at_ms: when the corruption was first found (ms since the Unix epoch).
    """

    segment: Path
    position: int
    last_good_offset: int
    next_valid_offset: int
    next_valid_position: int
    error: str
    detected_at_ms: int

    @property
    def marker(self) -> Path:
        """The marker file: ``{segment file name}.quarantine`` next to the segment."""
        return marker_path(self.segment)

    def append_error(self) -> SegmentQuarantinedError:
        """The error an append to the quarantined WAL fails with."""
        return SegmentQuarantinedError(
            str(self.segment), self.position, self.last_good_offset, self.next_valid_offset
        )

    def same_facts(self, other: Quarantine) -> bool:
        """Whether ``other`` describes the same corruption (all but the detection time)."""
        return replace(other, detected_at_ms=self.detected_at_ms) == self

    def to_json(self) -> dict[str, Any]:
        """The marker's JSON object: the segment's file name, positions in bytes, offsets, the
        error text and the detection time (ISO 8601, UTC, milliseconds)."""
        detected = datetime.fromtimestamp(self.detected_at_ms / 1000, tz=UTC)
        return {
            "segment": self.segment.name,
            "position": self.position,
            "last_good_offset": self.last_good_offset,
            "next_valid_offset": self.next_valid_offset,
            "next_valid_position": self.next_valid_position,
            "error": self.error,
            "detected_at": detected.isoformat(timespec="milliseconds"),
            "operator_action": f"stop the broker, then: python -m broker.storage.wal.repair {self.segment.parent}",
        }

    @classmethod
    def from_json(cls, directory: Path, obj: Any) -> Quarantine:
        """The quarantine a marker of ``directory`` describes.

        Raises:
            ValueError: ``obj`` is not a marker object (a field is missing or mistyped).
        """
        try:
            ints = {k: obj[k] for k in ("position", "last_good_offset", "next_valid_offset", "next_valid_position")}
            if not all(isinstance(v, int) for v in ints.values()):
                raise ValueError(f"non-integer field in {ints}")
            segment, error = obj["segment"], obj["error"]
            if not isinstance(segment, str) or not isinstance(error, str) or "/" in segment:
                raise ValueError("segment and error must be strings, segment a file name")
            detected = datetime.fromisoformat(obj["detected_at"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a quarantine marker: {exc!r}") from exc
        return cls(
            segment=directory / segment, error=error, detected_at_ms=round(detected.timestamp() * 1000), **ints
        )


def marker_path(segment: Path) -> Path:
    """The quarantine marker of ``segment``: ``{segment file name}.quarantine`` next to it."""
    return segment.with_name(segment.name + QUARANTINE_SUFFIX)


def read_marker(marker: Path) -> Quarantine:
    """The quarantine a marker file describes.

    Raises:
        ValueError: the file is not JSON or not a marker.
        OSError: the file cannot be read.
    """
    try:
        obj = json.loads(marker.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{marker}: not JSON: {exc}") from exc
    return Quarantine.from_json(marker.parent, obj)


def write_marker(quarantine: Quarantine) -> Quarantine:
    """Write ``quarantine``'s marker (temporary file, ``fsync``, rename); the caller syncs the
    directory. An existing marker describing the same corruption is kept as it is.

    Returns:
        ``quarantine``, with the detection time of the existing marker when one was kept.

    Raises:
        OSError: the marker cannot be written.
    """
    marker = quarantine.marker
    try:
        old = read_marker(marker)
    except (OSError, ValueError):
        old = None
    if old is not None and quarantine.same_facts(old):
        return old
    tmp = marker.with_name(marker.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(quarantine.to_json(), f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, marker)
    return quarantine


def find_valid_after(
    data: bytes, position: int, last_good_offset: int, *, format_version: int
) -> tuple[int, int] | None:
    """Look past the bad batch at ``position`` for a valid later one.

    Walks forward from byte ``position + 1`` for the first position where a complete batch
    starts (version 2: plausible length within the data, magic, at least one record, CRC32C;
    :mod:`danube_pipeline.format.batches`) or a complete record frame (version 1: plausible length,
    CRC32C; :mod:`danube_pipeline.format.records`) whose (base) offset is above
    ``last_good_offset``. The batch at ``position`` itself never counts, whatever its offset.
    In version 3 the batch must have room for its 8-byte epoch after ``position``, and the
    entry start (the epoch's position) is returned; the entry at ``position`` never counts.

    Args:
        data: the whole segment file.
        position: byte position where the scan of the good prefix stopped.
        last_good_offset: the last offset of the good prefix (the segment's start - 1 if none).
        format_version: the segment header's format version.

    Returns:
        ``(byte_position, offset)`` of the first such batch or record, or ``None`` when
        nothing valid follows (a torn tail).
    """
    end = len(data)
    if format_version == LEGACY_FORMAT_VERSION:
        for pos in range(position + 1, end - RECORD_FRAME_SIZE - RECORD_FIXED_SIZE + 1):
            length, crc = _FRAME.unpack_from(data, pos)
            body = pos + RECORD_FRAME_SIZE
            if not RECORD_FIXED_SIZE <= length <= MAX_RECORD_BODY_BYTES or body + length > end:
                continue
            offset = _OFFSET.unpack_from(data, body)[0]
            if offset > last_good_offset and _crc32c.crc32c(memoryview(data)[body : body + length]) == crc:
                return pos, offset
        return None
    skip = EPOCH_PREFIX_SIZE if has_epoch_prefix(format_version) else 0
    magic = bytes([batches.MAGIC])
    at = position + 1 + skip + _BATCH_MAGIC_AT
    while (at := data.find(magic, at)) >= 0:
        pos = at - _BATCH_MAGIC_AT
        at += 1
        if end - pos < batches.BATCH_HEADER_SIZE:
            return None
        base, length, _crc = _BATCH_PREFIX.unpack_from(data, pos)
        total = 12 + length
        if (
            base > last_good_offset
            and batches.BATCH_HEADER_SIZE <= total <= MAX_BATCH_BYTES
            and pos + total <= end
            and _BATCH_COUNT.unpack_from(data, pos + _BATCH_COUNT_AT)[0] >= 1
            and batches.crc_matches(data, pos, total)
        ):
            return pos - skip, base
    return None


def batch_format_version(data: bytes, start_offset: int) -> tuple[int, bool]:
    """The batch format (version 3 or 2) of a segment whose header is damaged.

    Returns:
        ``(format_version, intact)``: ``intact`` when a whole batch of base offset
        ``start_offset`` starts at byte 32 in that version (its header can be rebuilt);
        otherwise the version under which the first valid batch found after byte 32 starts the
        longer run of valid batches (version 3 on a tie, what the WAL writes).
    """
    records: dict[int, int] = {}
    for version in (FORMAT_VERSION, BATCH_FORMAT_VERSION):
        prefix = has_epoch_prefix(version)
        first = scan_batches(data, keep_positions=True, epoch_prefix=prefix)
        if first.positions and first.positions[0] == (start_offset, SEGMENT_HEADER_SIZE):
            return version, True
        found = find_valid_after(data, SEGMENT_HEADER_SIZE - 1, start_offset - 1, format_version=version)
        if found is not None:
            records[version] = scan_batches(data, start_position=found[0], epoch_prefix=prefix).record_count
    best = max(records.values(), default=0)
    return next((v for v, n in records.items() if n == best), FORMAT_VERSION), False
