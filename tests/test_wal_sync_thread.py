"""The WAL's write and ``fdatasync`` run off the event loop, so a slow disk stalls no other
task (lease keep-alives above all), and an owner that went past its self-fencing deadline
during the write does not acknowledge it.

A slow disk cannot be made to order here: FAKE slow disk, ``os.fdatasync`` wrapped to sleep
first (or the ``wal.before_fdatasync`` fault point armed with ``delay``). The lease going stale
during the write is a FAKE session whose lease turns stale when the sync starts (the real
cut from etcd is in ``tests/test_owner_self_fencing.py``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from danube_pipeline import faults
from danube_pipeline.errors import NotServedHereError
from danube_pipeline.format.batches import BatchBuilder, batch_records
from danube_pipeline.names import TopicName

from broker.cluster.ownership import Ownership
from broker.storage.wal import WriteAheadLog, sync_thread

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]

SLOW_S = 0.6


def frame(i: int) -> tuple[bytes, int]:
    builder = BatchBuilder(1_700_000_000_000_000 + i)
    builder.append(f"m{i}".encode(), timestamp_us=1_700_000_000_000_000 + i)
    return builder.build(producer_id=7, producer_name="p"), 1


@pytest.fixture
def slow_fault_point() -> Iterator[None]:
    faults.arm(faults.WAL_BEFORE_FDATASYNC, f"{faults.DELAY}:{SLOW_S}")
    try:
        yield
    finally:
        faults.disarm(faults.WAL_BEFORE_FDATASYNC)


def slow_fdatasync(monkeypatch: pytest.MonkeyPatch) -> None:
    """FAKE slow disk: every ``os.fdatasync`` sleeps :data:`SLOW_S` first (the commit rounds make
    their system calls from Python meanwhile)."""
    monkeypatch.setattr(sync_thread, "native_round", None)
    real = os.fdatasync

    def slow(fd: int) -> None:
        time.sleep(SLOW_S)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow)


async def longest_loop_stall_s(work: Any) -> tuple[float, Any]:
    """Run ``work`` while a heartbeat ticks every 10 ms on the loop; the longest gap seen."""
    longest = 0.0
    stop = asyncio.Event()

    async def heartbeat() -> None:
        nonlocal longest
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            longest = max(longest, now - last)
            last = now

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.05)
    try:
        result = await work
    finally:
        stop.set()
        await beat
    return longest, result


@pytest.mark.parametrize("slow", ["fdatasync", "fault_point"])
async def test_a_slow_fdatasync_does_not_stall_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, slow: str
) -> None:
    """A small group commit (it used to be written and synced on the loop) with a slow disk:
    the loop keeps ticking, the append is acknowledged once durable."""
    wal = await WriteAheadLog.open(tmp_path, segment_max_age_s=3600.0)
    try:
        if slow == "fdatasync":
            slow_fdatasync(monkeypatch)
        else:
            request.getfixturevalue("slow_fault_point")
        started = time.monotonic()
        stall_s, offsets = await longest_loop_stall_s(wal.append(*frame(0)))
        assert offsets == (0, 0)
        assert time.monotonic() - started >= SLOW_S  # the ack waited for the slow sync
        assert stall_s < SLOW_S / 3, f"the event loop stalled {stall_s:.3f} s behind the fdatasync"
        assert [r.offset for b in wal.read(0, 10) for r in batch_records(b.data)] == [0]
    finally:
        await wal.close()


class StaleDuringSync:
    """FAKE registration session: its lease is fresh until :attr:`stale` is set."""

    def __init__(self) -> None:
        self.stale = False

    def owner_lease(self) -> int | None:
        return None if self.stale else 5


async def test_an_owner_past_its_deadline_after_the_fdatasync_does_not_ack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wal_syscalls_from_python: None
) -> None:
    """The lease is fresh when the write starts and stale once the slow ``fdatasync`` returns:
    the batch is not acknowledged (retriable NotServedHereError) and is cut off the WAL again,
    so its resend (maybe to a new owner) is the only copy. Once the lease is fresh (and
    confirmed) again, appends are acked, from the offset handed back."""
    session = StaleDuringSync()
    ownership = Ownership(
        cast(Any, None), TopicName.parse("/default/slow"), 11, epoch=1, first_offset=0, reserved_end=999,
        session=session, confirmed_lease=5,
    )
    real = os.fdatasync

    def stale_during(fd: int) -> None:
        session.stale = True  # the deadline passes while the disk works
        time.sleep(0.05)
        real(fd)

    wal = await WriteAheadLog.open(tmp_path, segment_max_age_s=3600.0)
    wal.offset_guard = ownership
    try:
        assert await wal.append(*frame(0)) == (0, 0)
        monkeypatch.setattr(os, "fdatasync", stale_during)
        with pytest.raises(NotServedHereError) as refused:
            await wal.append(*frame(1))
        assert refused.value.retriable
        assert wal.durable_end == 1 and wal.next_offset == 1  # cut off: no copy of m1 stays
        monkeypatch.setattr(os, "fdatasync", real)
        session.stale = False
        assert await wal.append(*frame(2)) == (1, 1)
        stored = wal.read(0, 10)
        assert [b.base_offset for b in stored] == [0, 1]
        assert b"m1" not in b"".join(b.data for b in stored) and b"m2" in stored[1].data
    finally:
        await wal.close()
