"""WAL recovery reads a bounded part of the log, whatever its length (issue 27, recovery after
SIGKILL): the newest sealed segment, the active one, and for a leader-epoch cache rebuilt from
the batches (broker/storage/wal/epochs.py) one entry of each segment plus the segments an
epoch starts in. What it finds stays what a scan of every batch finds. Real files in tmp_path,
no etcd; the bytes read come from ``/proc/self/io``."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from test_wal_format_v3 import file_epochs
from test_wal_replication import append_batches, open_wal, payload_tags, read_all

from broker.storage.wal import WriteAheadLog
from broker.storage.wal.epochs import EPOCHS_FILE, LeaderEpochCache, batch_epoch_starts, segment_epoch_starts
from broker.storage.wal.recovery import LogLoader

pytestmark = pytest.mark.unit

SEGMENT_BYTES = 700
"""A few 3-record batches (172 bytes each, 180 with the epoch) per segment."""


def bytes_read() -> int:
    """Bytes this process read through ``read``-like calls so far (``rchar``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def lose_checkpoint(directory: Path) -> None:
    """Delete the WAL's epoch checkpoint, as a lost file or a broker from before unreplicated
    owner epochs were recorded at append leaves it: the next open rebuilds it from the batches."""
    (directory / EPOCHS_FILE).unlink()


def segment_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix in {".log", ".dnb1"})


def epoch_runs(directory: Path) -> tuple[tuple[int, int], ...]:
    """``(epoch, start)`` of each run of one epoch's batches, from every batch of every file."""
    stored = [(base, epoch) for path in segment_files(directory) for base, epoch in file_epochs(path)]
    return tuple((epoch, next(run)[0]) for epoch, run in itertools.groupby(stored, key=lambda be: be[1]))


async def write_epochs(directory: Path, epochs: list[int]) -> WriteAheadLog:
    """A WAL whose batches (one per item) carry ``epochs``, set as an unreplicated owner sets
    its epoch (each new one recorded in the cache at its first append); returned open."""
    wal = await open_wal(directory, segment_max_bytes=SEGMENT_BYTES)
    for epoch in epochs:
        wal.leader_epoch = epoch
        await append_batches(wal, 1)
    return wal


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "epochs",
    [
        [3] * 40,  # one epoch throughout
        [3] * 12 + [5] * 9 + [9] * 13 + [12] * 3,  # changes inside segments and at their starts
        [3] * 4 + [4] + [6] + [7] * 30 + [8],  # several in one segment; the newest batch alone
        list(range(2, 26)),  # one in every batch
    ],
)
async def test_epochs_rebuilt_from_few_segments_equal_a_scan_of_every_batch(
    tmp_path: Path, epochs: list[int]
) -> None:
    wal = await write_epochs(tmp_path, epochs)
    assert len(wal.sealed_segments()) >= 3
    await wal.close()
    expected = epoch_runs(tmp_path)
    assert LeaderEpochCache.load(tmp_path).entries == expected  # recorded at append
    lose_checkpoint(tmp_path)
    assert [e for e, _ in expected] == sorted(set(epochs))

    wal = await open_wal(tmp_path, segment_max_bytes=SEGMENT_BYTES)
    try:
        assert wal.epochs.entries == expected
        assert LeaderEpochCache.load(tmp_path).entries == expected  # written durably
        assert len(read_all(wal)) == len(epochs)
    finally:
        await wal.close()


@pytest.mark.asyncio
async def test_segments_with_the_same_first_epoch_as_the_next_are_not_scanned(tmp_path: Path) -> None:
    """The starts found from first entries and a few scans are those a scan of every segment
    finds; a segment is scanned only when the next one starts in another epoch, or it is the
    last one."""
    wal_dir = tmp_path / "wal"
    wal = await write_epochs(wal_dir, [4] * 10 + [6] * 15 + [9] * 2)
    await wal.close()
    loaded = LogLoader(wal_dir, index_interval_bytes=4096).load(0)
    assert loaded.active.fd is not None
    os.close(loaded.active.fd)
    segments = [seg for seg in [*loaded.sealed, loaded.active] if not seg.is_empty]

    full = [start for seg in segments for start in segment_epoch_starts(seg)]
    before = bytes_read()
    found = batch_epoch_starts(segments)
    read = bytes_read() - before
    assert found == full
    assert [seg.start for seg in segments] == [0, 12, 24, 36, 48, 60, 72]  # 4 batches of 3 records each
    # only the segment where epoch 6 starts (24..35) and the last one (72..80) are scanned
    assert read <= 2 * SEGMENT_BYTES + 2 * 180 + 8 * len(segments)
    (tmp_path / "cache").mkdir()
    cache = LeaderEpochCache(tmp_path / "cache")
    cache.merge_batch_epochs(found)
    assert cache.entries == epoch_runs(wal_dir) == ((4, 0), (6, 30), (9, 75))


@pytest.mark.asyncio
async def test_a_damaged_first_epoch_makes_its_segment_and_the_one_before_it_scanned(tmp_path: Path) -> None:
    """A segment whose first entry's epoch bytes were damaged (the batch CRC does not cover
    them) no longer matches its neighbours, so both are scanned: what is found is still what a
    scan of every segment finds."""
    wal_dir = tmp_path / "wal"
    wal = await write_epochs(wal_dir, [5] * 24)
    await wal.close()
    third = segment_files(wal_dir)[2]
    with third.open("r+b") as f:
        f.seek(32)  # the first entry's epoch, right after the 32-byte header
        f.write((77).to_bytes(8, "little"))
    loaded = LogLoader(wal_dir, index_interval_bytes=4096).load(0)
    assert loaded.active.fd is not None
    os.close(loaded.active.fd)
    segments = [seg for seg in [*loaded.sealed, loaded.active] if not seg.is_empty]
    found = batch_epoch_starts(segments)
    assert found == [start for seg in segments for start in segment_epoch_starts(seg)]
    assert (77, segments[2].start) in found and (5, segments[2].start + 3) in found


@pytest.mark.asyncio
async def test_reopening_a_long_wal_reads_a_bounded_part_of_it(tmp_path: Path) -> None:
    """60 segments in one epoch, a new owner epoch at the end, the checkpoint lost, and a torn
    tail: the reopen repairs the tail, rebuilds the cache, and reads a few segments' bytes, not
    the log."""
    wal = await write_epochs(tmp_path, [7] * 240 + [8] * 2)
    tags = payload_tags(read_all(wal))
    await wal.close()
    lose_checkpoint(tmp_path)
    files = segment_files(tmp_path)
    assert len(files) >= 60
    active = files[-1]
    assert active.suffix == ".log"
    with active.open("ab") as f:  # a torn append: a whole epoch and half a batch header
        f.write((9).to_bytes(8, "little") + b"\x00" * 11)
    total = sum(p.stat().st_size for p in files)

    before = bytes_read()
    wal = await open_wal(tmp_path, segment_max_bytes=SEGMENT_BYTES)
    read = bytes_read() - before
    try:
        assert wal.epochs.entries == ((7, 0), (8, 720))
        assert wal.next_offset == 726  # the torn tail cut off
        assert read < 6 * SEGMENT_BYTES + 8 * 1024, f"{read} bytes read to open a {total}-byte WAL"
        await append_batches(wal, 1)
        assert payload_tags(read_all(wal)) == [*tags, b"r726", b"r727", b"r728"]
    finally:
        await wal.close()
