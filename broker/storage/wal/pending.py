"""Batches accepted for appending and not yet written: what one group commit writes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass

from danube_pipeline.format.batches import set_base_offset

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


@dataclass(slots=True)
class PendingAppend:
    """One record batch waiting for the next group commit.

    Attributes:
        first_offset: the base offset the WAL assigned.
        data: the batch as the producer framed it (base offset field still 0).
        record_count: records in the batch.
        future: resolved with ``(first_offset, last_offset)`` after the ``fdatasync``.
    """

    first_offset: int
    data: bytes
    record_count: int
    future: asyncio.Future[tuple[int, int]]

    @property
    def last_offset(self) -> int:
        """The batch's last offset."""
        return self.first_offset + self.record_count - 1


def plan_write(
    pending: Sequence[PendingAppend], start_position: int
) -> tuple[list[bytes | memoryview], list[tuple[int, int]], int]:
    """The buffers to write for ``pending`` and where each batch lands.

    Each batch becomes two buffers, its base offset and the rest of its bytes (unchanged), so
    nothing is copied before the write.

    Returns:
        ``(buffers, positions, size_bytes)``: ``positions`` is each batch's
        ``(base_offset, byte_position)``.
    """
    buffers: list[bytes | memoryview] = []
    positions: list[tuple[int, int]] = []
    pos = start_position
    for item in pending:
        buffers.extend(set_base_offset(item.data, item.first_offset))
        positions.append((item.first_offset, pos))
        pos += len(item.data)
    return buffers, positions, pos - start_position


def write_all(fd: int, buffers: Sequence[bytes | memoryview], position: int) -> None:
    """``os.pwritev`` every buffer from byte ``position`` on, continuing after partial writes
    and in chunks of at most ``IOV_MAX`` buffers.

    Raises:
        OSError: the write failed (e.g. ``ENOSPC``).
    """
    views = [memoryview(b) for b in buffers if len(b)]
    i = 0
    while i < len(views):
        written = os.pwritev(fd, views[i : i + _IOV_MAX], position)
        position += written
        while written:
            size = len(views[i])
            if written >= size:
                written -= size
                i += 1
            else:
                views[i] = views[i][written:]
                written = 0
