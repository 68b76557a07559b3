"""The record batch format (version 2) and reading segments of both versions: real bytes and
files, in process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from broker.storage.wal import WriteAheadLog, active_name, sealed_name
from danube_pipeline.format.batches import (
    BATCH_HEADER_SIZE,
    BatchBuilder,
    batch_payloads,
    batch_records,
    iter_batch,
    parse_header,
    set_base_offset,
    validate_batch,
)
from danube_pipeline.errors import CorruptRecordError, MalformedRequestError, MessageTooLargeError
from danube_pipeline.format.records import (
    BATCH_FORMAT_VERSION,
    FORMAT_VERSION,
    LEGACY_FORMAT_VERSION,
    Record,
    SegmentHeader,
    encode_record,
)
from danube_pipeline.format.segments import decode_segment, iter_stored_batches, scan_segment

pytestmark = pytest.mark.unit

T0 = 1_700_000_000_000_000


def _record(offset: int, *, key: str | None = None) -> Record:
    return Record(
        offset=offset,
        publish_time_us=T0 + offset,
        producer_id=2**64 - 5,
        producer_name="prod-é",
        schema_id=3,
        schema_version=2,
        payload=f"payload-{offset}".encode() * (offset % 3 + 1),
        attributes={"i": str(offset), "ü": "ß" * offset},
        key=key,
    )


def _v2_segment(records: list[Record], per_batch: int) -> bytes:
    out = SegmentHeader(start_offset=records[0].offset, created_at_ms=1).encode()
    for start in range(0, len(records), per_batch):
        chunk = records[start : start + per_batch]
        builder = BatchBuilder(chunk[0].publish_time_us)
        for r in chunk:
            builder.append(r.payload, timestamp_us=r.publish_time_us, key=r.key, attributes=r.attributes)
        head, rest = set_base_offset(
            builder.build(producer_id=chunk[0].producer_id, producer_name=chunk[0].producer_name,
                          schema_id=3, schema_version=2),
            chunk[0].offset,
        )
        out += head + bytes(rest)
    return out


def _v3_segment(records: list[Record], per_batch: int, epochs: list[int]) -> bytes:
    """The batches of :func:`_v2_segment`, each behind its epoch (``epochs[i]`` for batch i)."""
    v2 = _v2_segment(records, per_batch)
    out = SegmentHeader(start_offset=records[0].offset, created_at_ms=1, format_version=FORMAT_VERSION).encode()
    for (_, batch), epoch in zip(iter_stored_batches(v2, format_version=BATCH_FORMAT_VERSION), epochs, strict=True):
        out += epoch.to_bytes(8, "little") + batch.data
    return out


def _v1_segment(records: list[Record]) -> bytes:
    header = SegmentHeader(start_offset=records[0].offset, created_at_ms=1, format_version=LEGACY_FORMAT_VERSION)
    return header.encode() + b"".join(encode_record(r) for r in records)


# ------------------------------------------------------------------ the batch format


def test_batch_round_trip_keeps_every_field() -> None:
    records = [_record(i, key=None if i % 2 else f"k{i}") for i in range(7)]
    builder = BatchBuilder(T0)
    for r in records:
        builder.append(r.payload, timestamp_us=r.publish_time_us, key=r.key, attributes=r.attributes)
    data = builder.build(producer_id=records[0].producer_id, producer_name="prod-é", schema_id=3, schema_version=2,
                         base_sequence=41)
    header = validate_batch(data)
    assert (header.record_count, header.base_sequence, header.producer_name) == (7, 41, "prod-é")
    assert len(data) == header.length_bytes and header.records_start == BATCH_HEADER_SIZE + len("prod-é".encode())
    assert [bytes(p) for p in batch_payloads(data, header)] == [r.payload for r in records]
    head, rest = set_base_offset(data, 0)
    assert list(batch_records(head + bytes(rest))) == records
    stored = set_base_offset(data, 1000)
    moved = list(batch_records(stored[0] + bytes(stored[1])))
    assert [r.offset for r in moved] == list(range(1000, 1007))
    validate_batch(stored[0] + bytes(stored[1]))  # the CRC does not cover the base offset


def test_builder_refuses_what_the_format_cannot_hold() -> None:
    builder = BatchBuilder(T0)
    with pytest.raises(MalformedRequestError, match="attribute name"):
        builder.append(b"x", timestamp_us=T0, attributes={"k" * 65_536: "v"})
    with pytest.raises(MalformedRequestError, match="attributes"):
        builder.append(b"x", timestamp_us=T0, attributes={str(i): "" for i in range(65_536)})
    with pytest.raises(MalformedRequestError, match="timestamp"):
        builder.append(b"x", timestamp_us=T0 - 1)
    assert builder.record_count == 0 and builder.size_bytes == 0  # nothing half-written
    with pytest.raises(MalformedRequestError, match="at least one record"):
        builder.build(producer_id=1, producer_name="p")
    builder.append(b"x", timestamp_us=T0, attributes={"k" * 65_535: "v"})  # the largest name fits
    validate_batch(builder.build(producer_id=1, producer_name="p"))


def test_validate_checks_payload_sizes_and_text() -> None:
    builder = BatchBuilder(T0)
    builder.append(b"a" * 10, timestamp_us=T0)
    builder.append(b"b" * 11, timestamp_us=T0)
    data = builder.build(producer_id=1, producer_name="p")
    validate_batch(data, max_message_size_bytes=11)
    with pytest.raises(MessageTooLargeError) as info:
        validate_batch(data, max_message_size_bytes=10)
    assert (info.value.size_bytes, info.value.max_message_size_bytes) == (11, 10)
    with pytest.raises(MalformedRequestError, match="max_batch_bytes"):
        validate_batch(data, max_batch_bytes=len(data) - 1)
    bad = BatchBuilder(T0)
    bad.append(b"x", timestamp_us=T0, attributes={"name": "value"})
    raw = bytearray(bad.build(producer_id=1, producer_name="p"))
    raw[raw.index(b"value")] = 0xFF  # not UTF-8; fix the CRC so only the text is wrong
    from danube_pipeline.format.records import crc32c

    raw[12:16] = crc32c(bytes(raw[16:])).to_bytes(4, "little")
    with pytest.raises(MalformedRequestError, match="UTF-8"):
        validate_batch(bytes(raw))
    assert parse_header(bytes(raw)).record_count == 1


# ------------------------------------------------------------------ segments of both versions


@pytest.mark.parametrize("per_batch", [1, 3, 100])
def test_decode_segment_reads_both_versions_alike(per_batch: int) -> None:
    records = [_record(10 + i) for i in range(10)]
    v1 = decode_segment(_v1_segment(records))
    v2 = decode_segment(_v2_segment(records, per_batch), index_interval_records=4)
    assert v1.header.format_version == LEGACY_FORMAT_VERSION and v2.header.format_version == BATCH_FORMAT_VERSION
    assert v1.records == records
    assert v2.records == records
    # v2 index entries point at batch starts: the first batch, then one per 4 records or more
    assert v2.offset_index[0] == [10, 32]
    for offset, position in v2.offset_index:
        batch_pos, batch = next(iter_stored_batches(_v2_segment(records, per_batch), format_version=2, start_position=position))
        assert batch.base_offset == offset and batch_pos == position


def test_scan_segment_stops_at_a_torn_batch() -> None:
    records = [_record(i) for i in range(6)]
    data = _v2_segment(records, 2)
    scan = scan_segment(data[:-3], expected_first_offset=0, keep_positions=True)
    assert (scan.record_count, scan.last_offset) == (4, 3) and scan.error is not None
    assert [offset for offset, _ in scan.positions] == [0, 2]


def test_version_1_records_come_as_one_record_batches() -> None:
    records = [_record(i) for i in range(3)]
    batches = [b for _, b in iter_stored_batches(_v1_segment(records), format_version=LEGACY_FORMAT_VERSION)]
    assert [(b.base_offset, b.record_count) for b in batches] == [(0, 1), (1, 1), (2, 1)]
    assert [r for b in batches for r in batch_records(b.data)] == records
    header, fields = iter_batch(batches[1].data)
    assert header.producer_name == "prod-é" and next(fields)[4] == records[1].payload


@pytest.mark.asyncio
async def test_wal_serves_version_1_files_and_writes_version_3_after_them(tmp_path: Path) -> None:
    """A WAL directory from before record batches: a sealed version 1 file and a non-empty
    version 1 active file. At open the active file is sealed as it is; new batches go to a new
    version 3 file; reads cross both formats."""
    old = [_record(i) for i in range(8)]
    (tmp_path / sealed_name(0, 4)).write_bytes(_v1_segment(old[:5]))
    (tmp_path / active_name(5)).write_bytes(_v1_segment(old[5:]))
    wal = await WriteAheadLog.open(tmp_path, segment_max_age_s=3600.0)
    try:
        assert wal.next_offset == 8
        assert [(s.start_offset, s.end_offset) for s in wal.sealed_segments()] == [(0, 4), (5, 7)]
        assert wal.active_path == tmp_path / active_name(8)
        builder = BatchBuilder(T0 + 8)
        builder.append(b"new", timestamp_us=T0 + 8)
        assert await wal.append(builder.build(producer_id=9, producer_name="new"), 1) == (8, 8)
        got = [r for b in wal.read(3, 100) for r in batch_records(b.data)]
        assert [r.offset for r in got] == list(range(3, 9))
        assert got[:5] == old[3:]
        assert got[-1].payload == b"new" and got[-1].producer_name == "new"
    finally:
        await wal.close()
    assert SegmentHeader.decode((tmp_path / active_name(8)).read_bytes()).format_version == FORMAT_VERSION
    assert decode_segment((tmp_path / sealed_name(5, 7)).read_bytes()).records == old[5:]
    assert sorted(os.listdir(tmp_path)) == [sealed_name(0, 4), sealed_name(5, 7), active_name(8)]


@pytest.mark.asyncio
async def test_wal_replaces_an_empty_version_1_active_file(tmp_path: Path) -> None:
    (tmp_path / active_name(0)).write_bytes(
        SegmentHeader(start_offset=0, created_at_ms=1, format_version=LEGACY_FORMAT_VERSION).encode()
    )
    wal = await WriteAheadLog.open(tmp_path, segment_max_age_s=3600.0)
    try:
        assert wal.sealed_segments() == [] and wal.next_offset == 0
    finally:
        await wal.close()
    assert SegmentHeader.decode((tmp_path / active_name(0)).read_bytes()).format_version == FORMAT_VERSION


# ------------------------------------------------------------------ version 3: leader epochs


@pytest.mark.parametrize("per_batch", [1, 3, 100])
def test_version_3_decodes_as_version_2_with_epochs_and_entry_positions(per_batch: int) -> None:
    records = [_record(10 + i) for i in range(10)]
    n = -(-len(records) // per_batch)
    epochs = [0] + [5 + i // 2 for i in range(n - 1)]  # unknown first, then runs of two batches
    v2_data, v3_data = _v2_segment(records, per_batch), _v3_segment(records, per_batch, epochs)
    v2 = decode_segment(v2_data, index_interval_records=4)
    v3 = decode_segment(v3_data, index_interval_records=4)
    assert v3.header.format_version == FORMAT_VERSION and v3.records == v2.records == records
    stored2 = list(iter_stored_batches(v2_data, format_version=BATCH_FORMAT_VERSION))
    stored3 = list(iter_stored_batches(v3_data, format_version=FORMAT_VERSION))
    # The same batch bytes (what consumers get), the epochs apart; positions are entry starts.
    assert [b.data for _, b in stored3] == [b.data for _, b in stored2]
    assert [b.leader_epoch for _, b in stored3] == epochs and {b.leader_epoch for _, b in stored2} == {0}
    assert [p for p, _ in stored3] == [p + 8 * i for i, (p, _) in enumerate(stored2)]
    assert [o for o, _ in v3.offset_index] == [o for o, _ in v2.offset_index]
    for offset, position in v3.offset_index:
        assert (offset, position) in [(b.base_offset, p) for p, b in stored3]
    scan = scan_segment(v3_data, expected_first_offset=10, keep_positions=True)
    assert (scan.error, scan.valid_length, scan.record_count) == (None, len(v3_data), 10)
    assert scan.positions == [(b.base_offset, p) for p, b in stored3]
    bases = [b.base_offset for _, b in stored3]
    want_starts = [(e, bases[i]) for i, e in enumerate(epochs) if i == 0 or epochs[i - 1] != e]
    assert scan.epoch_starts == want_starts


def test_version_3_scan_stops_at_a_torn_entry_and_strict_readers_refuse_it() -> None:
    records = [_record(i) for i in range(6)]
    data = _v3_segment(records, 2, [7, 7, 8])
    entries = [p for p, _ in iter_stored_batches(data, format_version=FORMAT_VERSION)]
    for cut in (entries[2] + 3, entries[2] + 8, entries[2] + 20, len(data) - 1):  # in the epoch, the header, the body
        scan = scan_segment(data[:cut], expected_first_offset=0, keep_positions=True)
        assert (scan.valid_length, scan.record_count, scan.last_offset) == (entries[2], 4, 3), cut
        assert scan.error is not None and scan.epoch_starts == [(7, 0)]
        with pytest.raises(CorruptRecordError):
            decode_segment(data[:cut])
    flipped = bytearray(data)
    flipped[entries[1] + 8 + 30] ^= 1  # inside the second batch: its CRC fails, not the epoch's
    scan = scan_segment(bytes(flipped), expected_first_offset=0)
    assert (scan.valid_length, scan.record_count) == (entries[1], 2)
    epoch_changed = bytearray(data)
    epoch_changed[entries[1]] ^= 0xFF  # the CRC does not cover the epoch: read with the new one
    stored = [b for _, b in iter_stored_batches(bytes(epoch_changed), format_version=FORMAT_VERSION)]
    assert [b.leader_epoch for b in stored] == [7, 7 ^ 0xFF, 8]
    assert decode_segment(bytes(epoch_changed)).records == records
    # Read as version 2, the same bytes are garbage: the version decides the layout.
    as_v2 = SegmentHeader(start_offset=0, created_at_ms=1).encode() + data[32:]
    assert scan_segment(as_v2, expected_first_offset=0).record_count == 0
