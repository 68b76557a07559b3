"""Segment format version 3 in the WAL (danube_pipeline/format/segments.py, broker/storage/wal/):
every batch stored behind the leader epoch it was written in, versions 1 and 2 still read, a
version 2 active segment continued then rolled to version 3, torn version 3 tails truncated,
and the epoch cache rebuilt from the batches when its checkpoint is lost. Real files in
tmp_path, no etcd."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import pytest
from test_wal_replication import append_batches, batch, open_wal, payload_tags, read_all, stored

from broker.storage.wal import active_name, sealed_name
from broker.storage.wal.epochs import EPOCHS_FILE, LeaderEpochCache
from broker.storage.wal.quarantine import batch_format_version
from danube_pipeline.format.records import (
    BATCH_FORMAT_VERSION,
    FORMAT_VERSION,
    SEGMENT_HEADER_SIZE,
    SegmentHeader,
)
from danube_pipeline.format.segments import decode_segment, iter_stored_batches

pytestmark = pytest.mark.unit


def file_epochs(path: Path) -> list[tuple[int, int]]:
    """``(base_offset, leader_epoch)`` of every batch of a segment file, as stored."""
    data = path.read_bytes()
    version = SegmentHeader.decode(data).format_version
    return [(b.base_offset, b.leader_epoch) for _, b in iter_stored_batches(data, format_version=version)]


def v2_active_file(directory: Path, batches: int) -> Path:
    """A version 2 active segment of ``batches`` 3-record batches from offset 0, as a WAL
    wrote it before epochs."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / active_name(0)
    # created now: an active segment past its age would be sealed by the age timer at open
    data = SegmentHeader(start_offset=0, created_at_ms=int(time.time() * 1000), format_version=BATCH_FORMAT_VERSION).encode()
    path.write_bytes(data + b"".join(stored(3 * i) for i in range(batches)))
    return path


@pytest.mark.asyncio
async def test_every_batch_is_stored_behind_the_epoch_it_was_written_in(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    assert wal.leader_epoch == 0
    await append_batches(wal, 1)  # 0..2: epoch 0, unknown
    wal.leader_epoch = 4  # an unreplicated topic's owner epoch: recorded at its first append
    await append_batches(wal, 1)  # 3..5
    first = wal.enqueue(batch(6), 3)  # queued before the epoch begins: keeps epoch 4
    started = asyncio.ensure_future(wal.begin_epoch(7))
    await asyncio.sleep(0)  # the epoch start is queued, behind ``first``
    assert wal.leader_epoch == 7
    second = wal.enqueue(batch(9), 3)
    await asyncio.gather(first, started, second)
    with pytest.raises(ValueError, match="negative"):
        wal.leader_epoch = -1
    assert SegmentHeader.decode(wal.active_path.read_bytes()).format_version == FORMAT_VERSION
    assert file_epochs(wal.active_path) == [(0, 0), (3, 4), (6, 4), (9, 7)]
    got = read_all(wal)
    assert [b.leader_epoch for b in got] == [0, 4, 4, 7]
    assert [b.data for b in got] == [stored(o) for o in (0, 3, 6, 9)]  # no epoch in what readers get
    assert wal.epochs.entries == ((4, 3), (7, 9))
    assert [e for e, _ in wal.read_for_replication(0, 1 << 20)] == [0, 4, 4, 7]
    await wal.close()


@pytest.mark.asyncio
async def test_append_replica_stores_each_batch_with_its_own_epoch(tmp_path: Path) -> None:
    follower = await open_wal(tmp_path, segment_max_bytes=400)
    copied = [(epoch, stored(3 * i)) for i, epoch in enumerate([0, 2, 2, 2, 5, 5, 8])]
    await follower.append_replica(copied[:4])
    await follower.append_replica(copied[4:])
    assert follower.leader_epoch == 0  # a follower's own epoch is untouched
    assert [(b.leader_epoch, b.data) for b in read_all(follower)] == copied
    assert [(e, b.data) for e, b in follower.read_for_replication(0, 1 << 20)] == copied
    assert follower.epochs.entries == ((0, 0), (2, 3), (5, 12), (8, 18))
    await follower.close()
    files = sorted(tmp_path.glob("0*"))
    assert len(files) > 1  # rolled: the epochs are stored in every segment
    assert [e for f in files for e in file_epochs(f)] == [(3 * i, e) for i, (e, _) in enumerate(copied)]


@pytest.mark.asyncio
async def test_a_version_2_active_segment_is_continued_in_version_2_then_rolls_to_version_3(tmp_path: Path) -> None:
    path = v2_active_file(tmp_path, 2)  # 0..5
    wal = await open_wal(tmp_path)
    wal.leader_epoch = 3
    await append_batches(wal, 2)  # 6..11, appended to the version 2 file: no epoch stored
    data = path.read_bytes()
    assert SegmentHeader.decode(data).format_version == BATCH_FORMAT_VERSION
    assert len(data) == SEGMENT_HEADER_SIZE + sum(len(stored(o)) for o in (0, 3, 6, 9))
    assert [b.leader_epoch for b in read_all(wal)] == [0, 0, 0, 0]
    await wal.truncate_to(9)  # a version 2 active segment still truncates by batch
    assert wal.next_offset == 9 and len(path.read_bytes()) == SEGMENT_HEADER_SIZE + 3 * len(stored(0))
    await append_batches(wal, 1)  # 9..11 again
    sealed = await wal.seal_active()
    assert sealed is not None and (sealed.start_offset, sealed.end_offset) == (0, 11)
    await append_batches(wal, 1)  # 12..14: the new active segment is version 3
    assert SegmentHeader.decode(wal.active_path.read_bytes()).format_version == FORMAT_VERSION
    assert file_epochs(wal.active_path) == [(12, 3)]
    await wal.close()

    wal = await open_wal(tmp_path)  # reads cross both versions; the sealed file stays version 2
    assert payload_tags(read_all(wal)) == [f"r{i}".encode() for i in range(15)]
    assert [b.leader_epoch for b in read_all(wal)] == [0, 0, 0, 0, 3]
    sealed_data = (tmp_path / sealed_name(0, 11)).read_bytes()
    assert decode_segment(sealed_data).header.format_version == BATCH_FORMAT_VERSION
    assert [r.offset for r in decode_segment(sealed_data).records] == list(range(12))
    await wal.close()


@pytest.mark.parametrize("torn", ["epoch", "batch_header", "batch_body"])
@pytest.mark.asyncio
async def test_a_torn_version_3_tail_is_truncated_at_open(tmp_path: Path, torn: str) -> None:
    wal = await open_wal(tmp_path)
    wal.leader_epoch = 6
    await append_batches(wal, 3)  # 0..8
    path = wal.active_path
    await wal.close()
    good = path.read_bytes()
    entry = (6).to_bytes(8, "little") + stored(9)
    cut = {"epoch": 5, "batch_header": 8 + 20, "batch_body": len(entry) - 3}[torn]
    path.write_bytes(good + entry[:cut])  # a write torn by a power cut, never acknowledged

    wal = await open_wal(tmp_path)
    assert wal.quarantine is None and wal.next_offset == 9
    assert path.read_bytes() == good
    wal.leader_epoch = 7
    await append_batches(wal, 1)
    assert file_epochs(path) == [(0, 6), (3, 6), (6, 6), (9, 7)]
    await wal.close()
    assert decode_segment(path.read_bytes()).records[-1].offset == 11


@pytest.mark.asyncio
async def test_a_lost_epoch_checkpoint_is_rebuilt_from_the_batches(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path, segment_max_bytes=400)
    await wal.begin_epoch(2)
    await append_batches(wal, 3)  # 0..8
    await wal.begin_epoch(5)
    await append_batches(wal, 3)  # 9..17, rolling on the way
    await wal.begin_epoch(8)
    await append_batches(wal, 1)  # 18..20
    assert wal.sealed_segments()  # the epochs are found across sealed and active segments
    entries = wal.epochs.entries
    assert entries == ((2, 0), (5, 9), (8, 18))
    served = wal.read_for_replication(0, 1 << 20)
    await wal.close()

    (tmp_path / EPOCHS_FILE).unlink()
    wal = await open_wal(tmp_path, segment_max_bytes=400)
    assert wal.epochs.entries == entries and wal.latest_epoch == 8
    assert wal.epochs.end_offset_for(5, wal.next_offset) == (5, 18)
    assert wal.read_for_replication(0, 1 << 20) == served
    await wal.close()
    assert json.loads((tmp_path / EPOCHS_FILE).read_text())[-1] == {"epoch": 8, "start_offset": 18}

    (tmp_path / EPOCHS_FILE).write_text('[{"epoch": 2, "start_offset": 0}]')  # behind: extended
    wal = await open_wal(tmp_path, segment_max_bytes=400)
    assert wal.epochs.entries == entries
    await wal.close()


@pytest.mark.asyncio
async def test_an_unreplicated_owner_epoch_is_recorded_at_its_first_append(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An owner epoch set directly (no ``begin_epoch``) is recorded in the cache, durably,
    by the first append after it, at that append's offset (Kafka assigns at append); an
    epoch without an append records nothing, and reopening rebuilds nothing."""
    wal = await open_wal(tmp_path)
    wal.leader_epoch = 41
    assert wal.latest_epoch is None  # nothing appended in it yet
    await append_batches(wal, 2)  # 0..5
    assert wal.epochs.entries == ((41, 0),)
    assert LeaderEpochCache.load(tmp_path).entries == ((41, 0),)  # durable before the ack
    wal.leader_epoch = 50  # an owner that appends nothing
    await wal.close()

    caplog.set_level(logging.INFO, logger="broker.storage.wal.log")
    wal = await open_wal(tmp_path)
    assert wal.epochs.entries == ((41, 0),) and wal.leader_epoch == 0
    wal.leader_epoch = 57  # the next owner's epoch
    await append_batches(wal, 1)
    await wal.close()
    wal = await open_wal(tmp_path)
    assert wal.epochs.entries == ((41, 0), (57, 6))
    await wal.begin_epoch(60)  # a later replicated owner's epoch goes on from there
    await wal.close()
    assert LeaderEpochCache.load(tmp_path).entries == ((41, 0), (57, 6), (60, 9))
    assert not [r for r in caplog.records if "read from the batches" in r.getMessage()]


@pytest.mark.asyncio
async def test_a_wal_left_at_epoch_0_writes_no_epoch_file_and_rebuilds_nothing(tmp_path: Path) -> None:
    v2_active_file(tmp_path, 1)  # a version 2 file too: no epochs to find there
    wal = await open_wal(tmp_path)
    await append_batches(wal, 1)
    await wal.seal_active()
    await append_batches(wal, 1)
    await wal.close()
    wal = await open_wal(tmp_path)
    assert wal.latest_epoch is None
    assert [e for e, _ in wal.read_for_replication(0, 1 << 20)] == [0, 0, 0]
    await wal.close()
    assert not (tmp_path / EPOCHS_FILE).exists()


@pytest.mark.asyncio
async def test_objects_of_every_version_are_read_from_their_offset_index(tmp_path: Path) -> None:
    """A sealed version 3 segment uploaded byte for byte: the descriptor's ``offset_index``
    (from the tiering decoder) points at entry starts, and a ranged read from any entry gets
    the batches without their epochs, as a version 2 object's does."""
    from broker.storage.remote import fetch_range, seek_position  # noqa: PLC0415 - the broker's object reads
    from danube_pipeline.lake.segment_columns import decode_segment_columns  # noqa: PLC0415 - pipeline extra
    from danube_pipeline.metadata.values import ObjectDescriptor  # noqa: PLC0415
    from danube_pipeline.names import TopicName  # noqa: PLC0415
    from danube_pipeline.storage.objectstore import ObjectStore, segment_object_path  # noqa: PLC0415

    wal = await open_wal(tmp_path / "wal")
    wal.leader_epoch = 9
    await append_batches(wal, 6)  # 0..17
    sealed = await wal.seal_active()
    await wal.close()
    assert sealed is not None
    v3 = sealed.path.read_bytes()
    v2 = SegmentHeader(start_offset=0, created_at_ms=1).encode() + b"".join(stored(3 * i) for i in range(6))
    objects = ObjectStore(f"file://{tmp_path / 'objects'}")
    topic = TopicName("default", "v3")
    for version, data in ((FORMAT_VERSION, v3), (BATCH_FORMAT_VERSION, v2)):
        decoded = decode_segment_columns(data, index_interval_records=6)
        assert decoded.header.format_version == version
        oid = f"data-0-17-v{version}.dnb1"
        objects.put_bytes(segment_object_path(topic, oid), data)
        descriptor = ObjectDescriptor(
            completed=True, created_at=1, end_offset=17, etag="", object_id=oid,
            offset_index=decoded.offset_index, size=len(data), start_offset=0,
        )
        assert [o for o, _ in decoded.offset_index] == [0, 6, 12]
        position, base = seek_position(descriptor, 13)
        assert (position, base) == (decoded.offset_index[2][1], 12) and position > SEGMENT_HEADER_SIZE
        fetched = fetch_range(objects, topic, descriptor, position, base)
        assert fetched.bases == [12, 15] and [b.data for b in fetched.batches] == [stored(12), stored(15)]
        assert [b.leader_epoch for b in fetched.batches] == ([9, 9] if version == FORMAT_VERSION else [0, 0])
        whole = fetch_range(objects, topic, descriptor, SEGMENT_HEADER_SIZE, 0)
        assert [b.data for b in whole.batches] == [stored(3 * i) for i in range(6)]


@pytest.mark.parametrize("version", [BATCH_FORMAT_VERSION, FORMAT_VERSION])
@pytest.mark.asyncio
async def test_a_damaged_header_is_rebuilt_in_the_version_its_batches_are_in(tmp_path: Path, version: int) -> None:
    if version == BATCH_FORMAT_VERSION:
        path = v2_active_file(tmp_path, 3)  # 0..8
    else:
        wal = await open_wal(tmp_path)
        wal.leader_epoch = 2
        await append_batches(wal, 3)
        path = wal.active_path
        await wal.close()
    data = path.read_bytes()
    path.write_bytes(bytes(32) + data[32:])  # the whole header zeroed
    assert batch_format_version(data, 0) == (version, True)
    body = bytearray(data)
    body[32 + (8 if version == FORMAT_VERSION else 0) + 30] ^= 0xFF  # the first batch too: not intact
    assert batch_format_version(bytes(body), 0) == (version, False)  # found by the valid batches after it

    wal = await open_wal(tmp_path)
    assert wal.quarantine is None and wal.next_offset == 9
    assert SegmentHeader.decode(path.read_bytes()).format_version == version
    await append_batches(wal, 1)
    assert payload_tags(read_all(wal)) == [f"r{i}".encode() for i in range(12)]
    await wal.close()
    assert decode_segment(path.read_bytes()).header.format_version == version


def test_merging_batch_epochs_keeps_what_only_the_checkpoint_knows(tmp_path: Path) -> None:
    cache = LeaderEpochCache(tmp_path, ((1, 0), (2, 8)))  # 0..9 in a version 2 segment, epochs only here
    assert cache.merge_batch_epochs([(2, 10), (3, 20), (3, 25), (0, 30), (1, 40)])  # 0 and going down: skipped
    assert cache.entries == ((1, 0), (2, 8), (3, 20)) == LeaderEpochCache.load(tmp_path).entries
    assert not cache.merge_batch_epochs([(3, 20)])  # nothing new: not rewritten
    assert not cache.merge_batch_epochs([(0, 0)])
    contradicted = LeaderEpochCache(tmp_path, ((4, 0), (5, 30)))  # the batches say 5 started at 10
    assert contradicted.merge_batch_epochs([(4, 0), (5, 10), (6, 20)])
    assert contradicted.entries == ((4, 0), (5, 10), (6, 20))
    held_none = LeaderEpochCache(tmp_path, ((7, 50),))  # begun at 50 as owner, never written to
    assert held_none.merge_batch_epochs([(8, 50)])
    assert held_none.entries == ((8, 50),)


def test_a_rebuild_that_only_adds_epochs_is_routine_and_one_that_moves_an_entry_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rebuild that only adds epochs (a lost checkpoint's tail, or a WAL written before
    unreplicated owner epochs were recorded at append, where every load after writes added
    them) is logged at INFO, not as a warning (at 10,000 topics that was 10,000 warnings per
    restart). A checkpoint the batches contradict still warns."""
    caplog.set_level(logging.INFO, logger="broker.storage.wal.log")
    assert LeaderEpochCache(tmp_path).merge_batch_epochs([(1, 0), (2, 5)])  # never recorded
    assert LeaderEpochCache(tmp_path, ((1, 0),)).merge_batch_epochs([(1, 0), (2, 5)])  # one more
    assert LeaderEpochCache(tmp_path, ((4, 0), (5, 30))).merge_batch_epochs([(4, 0), (5, 10)])  # moved
    assert LeaderEpochCache(tmp_path, ((7, 50),)).merge_batch_epochs([(8, 50)])  # dropped
    rebuilt = [r.levelname for r in caplog.records if "rebuilt from the batches" in r.getMessage()]
    assert rebuilt == ["INFO", "INFO", "WARNING", "WARNING"]
