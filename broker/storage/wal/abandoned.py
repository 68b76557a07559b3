"""Offsets a topic's WAL handed out once and lost: the durable local record of *abandoned*
ranges, kept in the topic's WAL directory as ``abandoned.json``.

Offsets are never handed out twice. When acknowledged batches are lost for good (the operator
accepts the loss of a quarantined segment with ``python -m broker.storage.wal.repair
--truncate``, or recovery sets aside an active segment whose header cannot be rebuilt), their
range is recorded here *before* the file changes (temporary file, ``fsync``, rename,
``fsync`` of the directory), and the WAL continues at the highest offset ever handed out
plus 1, never at the last good offset + 1. The record survives restarts; every open logs it
(WARNING) and :attr:`broker.storage.wal.log.WriteAheadLog.abandoned` counts it.

Where the highest offset handed out comes from: the highest offset any valid batch of the
lost file carries, and for a sealed file the end offset in its name (the WAL handed out
everything up to it). Bytes past the last valid batch were never acknowledged (every
acknowledgement follows an ``fdatasync`` of everything before it; a torn tail is cut off).
The owner's reserved block in etcd (``docs/etcd-layout.md`` §5.4) bounds the range from
above, but the WAL opens without etcd, so the local record is the one that counts.

The owner publishes each range as an unavailable range (§5.5) with ``abandoned`` set and
``last_written`` at its end when it loads the topic
(:func:`broker.cluster.ownership.commit_takeover`), so subscriptions skip the offsets (logged
and counted in ``skipped_unavailable``) and tiering passes over them instead of waiting.

File format::

    {"ranges": [{"first_offset": 4, "last_offset": 9, "reason": "...", "recorded_at_ms": 1795000000000}]}
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.storage.wal.segment import fsync_dir, now_ms

log = logging.getLogger("broker.storage.wal.recovery")

ABANDONED_FILE = "abandoned.json"
"""Name of the record in a topic's WAL directory."""


@dataclass(frozen=True, slots=True)
class AbandonedRange:
    """Offsets handed out once and lost for good.

    Attributes:
        first_offset: first offset lost (inclusive).
        last_offset: last offset lost (inclusive).
        reason: why (the file and what happened to it).
        recorded_at_ms: when the range was recorded (ms since the Unix epoch).
    """

    first_offset: int
    last_offset: int
    reason: str
    recorded_at_ms: int

    @property
    def offset_count(self) -> int:
        """Offsets in the range."""
        return self.last_offset - self.first_offset + 1

    def to_json(self) -> dict[str, Any]:
        """The range's JSON object in ``abandoned.json``."""
        return {
            "first_offset": self.first_offset, "last_offset": self.last_offset, "reason": self.reason,
            "recorded_at_ms": self.recorded_at_ms,
        }

    @classmethod
    def from_json(cls, obj: Any) -> AbandonedRange:
        """The range a JSON object describes.

        Raises:
            ValueError: a field is missing or mistyped, or the range is empty.
        """
        try:
            first, last, at = obj["first_offset"], obj["last_offset"], obj["recorded_at_ms"]
            reason = obj["reason"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not an abandoned range: {obj!r}") from exc
        if not all(isinstance(v, int) for v in (first, last, at)) or not isinstance(reason, str) or last < first:
            raise ValueError(f"not an abandoned range: {obj!r}")
        return cls(first_offset=first, last_offset=last, reason=reason, recorded_at_ms=at)


def read_abandoned(directory: Path) -> list[AbandonedRange]:
    """The abandoned ranges recorded in ``directory``, ascending; empty without a record.

    Raises:
        ValueError: the record exists but is not valid (the WAL must not open: the offsets it
            protects could be handed out again; fix or restore the file by hand).
        OSError: the record cannot be read.
    """
    path = directory / ABANDONED_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    try:
        ranges = [AbandonedRange.from_json(obj) for obj in json.loads(text)["ranges"]]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not an abandoned-ranges record: {exc!r}") from exc
    return sorted(ranges, key=lambda r: r.first_offset)


def record_abandoned(directory: Path, first_offset: int, last_offset: int, reason: str) -> AbandonedRange:
    """Add a range to ``directory``'s record durably (temporary file, ``fsync``, rename,
    directory ``fsync``) and log it at ERROR. A range already recorded is not added again.

    Returns:
        The range recorded (the existing one when it was recorded before).

    Raises:
        ValueError: the existing record is not valid.
        OSError: the record cannot be written.
    """
    ranges = read_abandoned(directory)
    for rng in ranges:
        if (rng.first_offset, rng.last_offset) == (first_offset, last_offset):
            return rng
    new = AbandonedRange(first_offset, last_offset, reason, now_ms())
    ranges = sorted([*ranges, new], key=lambda r: r.first_offset)
    path = directory / ABANDONED_FILE
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"ranges": [r.to_json() for r in ranges]}, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    fsync_dir(directory)
    log.error(
        "WAL %s: offsets %d..%d (%d offsets) ABANDONED: handed out once and lost (%s); they are never "
        "handed out again, appends continue at %d", directory, first_offset, last_offset, new.offset_count,
        reason, last_offset + 1,
    )
    return new


def next_offset_floor(ranges: list[AbandonedRange]) -> int:
    """The lowest offset the WAL may hand out next after ``ranges`` (0 without any)."""
    return max((r.last_offset + 1 for r in ranges), default=0)
