"""The decoder properties: each ``check_*`` takes values drawn from
:mod:`~danube_pipeline.dev.fuzzing.formats` and raises ``AssertionError`` when the record and
segment decoders break their contract (an undocumented error, a disagreement between two
decoders, records that do not come back)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from danube_pipeline.dev.fuzzing.formats import CONTAINERS, BatchCase, Mutation, SegmentCase
from danube_pipeline.errors import CorruptRecordError, MalformedRequestError, MessageTooLargeError, OffsetRangeError
from danube_pipeline.format.batches import (
    BatchHeader,
    batch_payloads,
    batch_records,
    iter_batch,
    parse_header,
    validate_batch,
)
from danube_pipeline.format.records import (
    LEGACY_FORMAT_VERSION,
    SEGMENT_HEADER_SIZE,
    Record,
    SegmentHeader,
    iter_records,
)
from danube_pipeline.format.segments import DecodedSegment, decode_segment, iter_stored_batches, scan_segment

T = TypeVar("T")

BATCH_ERRORS: tuple[type[Exception], ...] = (MalformedRequestError, MessageTooLargeError)
SEGMENT_ERRORS: tuple[type[Exception], ...] = (CorruptRecordError, OffsetRangeError)
HEADER_ERRORS: tuple[type[Exception], ...] = (CorruptRecordError,)


def outcome(what: str, documented: tuple[type[Exception], ...], fn: Callable[[], T]) -> tuple[T | None, Exception | None]:
    """``(fn(), None)``, or ``(None, error)`` for a documented error.

    Raises:
        AssertionError: ``fn`` raised anything else.
    """
    try:
        return fn(), None
    except documented as exc:
        return None, exc
    except Exception as exc:
        raise AssertionError(f"{what} raised undocumented {type(exc).__name__}: {exc}") from exc


def _check_accepted_batch(buf: bytes | memoryview, header: BatchHeader) -> list[Record]:
    """What validate_batch accepted must split: the same header, ``record_count`` records."""
    assert header == parse_header(buf), "parse_header disagrees with validate_batch"
    records, _ = outcome("batch_records of an accepted batch", (), lambda: list(batch_records(buf)))
    payloads, _ = outcome("batch_payloads of an accepted batch", (), lambda: [bytes(p) for p in batch_payloads(buf, header)])
    fields, _ = outcome("iter_batch of an accepted batch", (), lambda: list(iter_batch(buf)[1]))
    assert records is not None and payloads is not None and fields is not None
    assert len(records) == header.record_count, f"{len(records)} records, header says {header.record_count}"
    assert [r.offset for r in records] == list(range(header.base_offset, header.last_offset + 1))
    assert payloads == [r.payload for r in records], "batch_payloads disagrees with batch_records"
    assert fields == [(r.offset, r.publish_time_us, r.key, r.attributes, r.payload) for r in records]
    return records


def check_batch_bytes(data: bytes, container: str = "bytes") -> None:
    """Any bytes: the batch decoders raise only their documented errors, and a batch
    validate_batch accepts splits into exactly ``record_count`` records without error."""
    buf = CONTAINERS[container](data)
    outcome("parse_header", BATCH_ERRORS, lambda: parse_header(buf))
    header, _ = outcome("validate_batch", BATCH_ERRORS, lambda: validate_batch(buf))
    if header is not None:
        _check_accepted_batch(buf, header)


def check_batch_round_trip(case: BatchCase) -> None:
    """A framed batch validates, every field and record comes back, and the size limits bite
    exactly at the largest payload and the batch's size."""
    spec, n = case.spec, len(case.spec.records)
    header = validate_batch(case.data)
    assert (header.base_offset, header.length_bytes, header.record_count) == (0, len(case.data), n)
    assert (header.first_timestamp_us, header.producer_id, header.producer_name, header.base_sequence,
            header.schema_id, header.schema_version) == (spec.first_timestamp_us, spec.producer_id, spec.producer_name,
                                                         spec.base_sequence, spec.schema_id, spec.schema_version)
    assert case.stored[8:] == case.data[8:] and len(case.stored) == len(case.data)
    stored = validate_batch(case.stored)
    assert (stored.base_offset, stored.last_offset) == (case.base_offset, case.base_offset + n - 1)
    assert _check_accepted_batch(case.stored, stored) == spec.expected(case.base_offset)
    largest = max(len(r.payload) for r in spec.records)
    if largest:
        validate_batch(case.stored, max_message_size_bytes=largest)
    if largest > 1:
        _, err = outcome("validate_batch", BATCH_ERRORS, lambda: validate_batch(case.stored, max_message_size_bytes=largest - 1))
        assert isinstance(err, MessageTooLargeError), f"payload of {largest} bytes passed a limit of {largest - 1}: {err!r}"
    validate_batch(case.stored, max_batch_bytes=len(case.stored))
    _, err = outcome("validate_batch", BATCH_ERRORS, lambda: validate_batch(case.stored, max_batch_bytes=len(case.stored) - 1))
    assert isinstance(err, MalformedRequestError), f"batch of {len(case.stored)} bytes passed max_batch_bytes one less"


def check_batch_mutation(case_and_mutation: tuple[BatchCase, Mutation]) -> None:
    """A changed stored batch: a change in the 8-byte base offset (not covered by the CRC) is
    accepted with that base offset; any other bit flip, byte change, truncation or trailing
    garbage is refused with MalformedRequestError."""
    case, m = case_and_mutation
    data = m.apply(case.stored)
    check_batch_bytes(data)
    header, err = outcome("validate_batch", BATCH_ERRORS, lambda: validate_batch(data))
    if m.kind in ("flip", "byte") and m.position < 8:
        assert header is not None, f"a change in the base offset only was refused: {err}"
        assert header.base_offset == int.from_bytes(data[:8], "little")
        assert [r.payload for r in batch_records(data)] == [r.payload for r in case.spec.records]
    else:
        assert isinstance(err, MalformedRequestError), f"{m} of a batch: validate_batch gave {header or err!r}"


def _check_decoded(decoded: DecodedSegment[list[Record]], header: SegmentHeader, size: int) -> None:
    offsets = [r.offset for r in decoded.records]
    assert offsets == list(range(header.start_offset, header.start_offset + len(offsets))), "offsets not contiguous"
    assert decoded.size_bytes == size and decoded.header == header
    index_offsets = [o for o, _ in decoded.offset_index]
    assert index_offsets == sorted(index_offsets)
    assert not offsets or decoded.offset_index[0] == [offsets[0], SEGMENT_HEADER_SIZE]


def check_segment_bytes(data: bytes, container: str = "bytes", *, strict: bool = True) -> None:
    """Any bytes: the segment decoders raise only their documented errors; scan_segment never
    raises after a valid header, reports a consistent result, and agrees with decode_segment.

    ``strict``: also require the scanned prefix to decode (every record in it checks out).
    This holds for any bytes except CRC-valid batches with broken insides (see
    :func:`crafted_segments`), which the scan does not walk by design.
    """
    buf = CONTAINERS[container](data)
    header, _ = outcome("SegmentHeader.decode", HEADER_ERRORS, lambda: SegmentHeader.decode(buf))
    decoded, _ = outcome("decode_segment", SEGMENT_ERRORS, lambda: decode_segment(buf, index_interval_records=2))
    if header is None:
        assert decoded is None, "decode_segment accepted a header SegmentHeader.decode refused"
        _, err = outcome("scan_segment", HEADER_ERRORS, lambda: scan_segment(buf))
        assert err is not None, "scan_segment accepted a header SegmentHeader.decode refused"
        return
    stored, _ = outcome("iter_stored_batches", HEADER_ERRORS,
                        lambda: list(iter_stored_batches(buf, format_version=header.format_version)))
    if decoded is not None:
        _check_decoded(decoded, header, len(data))
        # decode_segment checks each batch's record framing as the broker did before appending:
        # what it decodes, a producer could have sent.
        assert stored is not None
        for position, batch in stored:
            _, err = outcome("validate_batch", BATCH_ERRORS, lambda: validate_batch(batch.data))
            assert err is None, f"decode_segment accepted the batch at byte {position}, validate_batch refuses it: {err}"
    if header.format_version == LEGACY_FORMAT_VERSION:
        outcome("iter_records", HEADER_ERRORS, lambda: list(iter_records(buf)))
    for expected in (None, header.start_offset):
        scan, _ = outcome("scan_segment after a valid header", (),
                          lambda: scan_segment(buf, expected_first_offset=expected, keep_positions=True))
        assert scan is not None
        assert SEGMENT_HEADER_SIZE <= scan.valid_length <= len(data), f"valid_length {scan.valid_length} of {len(data)}"
        assert (scan.error is None) == (scan.valid_length == len(data)), f"error {scan.error!r} at {scan.valid_length}"
        if scan.record_count == 0:
            assert scan.first_offset is None and scan.last_offset is None and not scan.positions
        else:
            assert scan.first_offset is not None and scan.last_offset is not None
            assert scan.last_offset - scan.first_offset + 1 == scan.record_count
            positions = [p for _, p in scan.positions]
            assert positions[0] == SEGMENT_HEADER_SIZE and positions == sorted(set(positions))
        if expected is None:
            continue
        if decoded is not None:
            assert scan.error is None and scan.record_count == len(decoded.records), (
                f"decode_segment read {len(decoded.records)} records, scan_segment {scan.record_count}: {scan.error}")
        if strict:
            prefix, err = outcome("decode_segment of the scanned prefix", SEGMENT_ERRORS,
                                  lambda: decode_segment(bytes(data[: scan.valid_length])))
            assert prefix is not None, f"the scanned prefix of {scan.valid_length} bytes does not decode: {err}"
            assert len(prefix.records) == scan.record_count
            assert not prefix.records or prefix.records[-1].offset == scan.last_offset


def check_segment_round_trip(case_and_interval: tuple[SegmentCase, int]) -> None:
    """A segment of any version decodes back to its records; the sparse index, the scan and
    the stored batches (with their epochs) all agree with its layout."""
    case, interval = case_and_interval
    decoded = decode_segment(case.data, index_interval_records=interval)
    assert decoded.records == list(case.records)
    assert (decoded.start_offset, decoded.header.format_version) == (case.start_offset, case.format_version)
    first_offsets = [case.start_offset + sum(case.unit_counts[:i]) for i in range(len(case.unit_counts))]
    units = list(zip(first_offsets, case.boundaries))
    next_at, index = case.start_offset, []
    for offset, position in units:
        if offset >= next_at:
            index.append([offset, position])
            next_at = offset + interval
    assert decoded.offset_index == index
    scan = scan_segment(case.data, expected_first_offset=case.start_offset, keep_positions=True)
    assert (scan.error, scan.valid_length, scan.record_count) == (None, len(case.data), len(case.records))
    assert scan.positions == units
    if case.records:
        assert (scan.first_offset, scan.last_offset, decoded.end_offset) == (
            case.start_offset, case.records[-1].offset, case.records[-1].offset)
    stored = list(iter_stored_batches(case.data, format_version=case.format_version))
    assert [(p, b.base_offset, b.record_count) for p, b in stored] == [
        (p, o, n) for (o, p), n in zip(units, case.unit_counts)]
    if case.epochs:
        assert tuple(b.leader_epoch for _, b in stored) == case.epochs
    # Every stored batch is one a producer could have sent (version 1 records become batches).
    split = [r for _, b in stored for r in _check_accepted_batch(b.data, validate_batch(b.data))]
    assert split == list(case.records)


def check_segment_mutation(case_and_mutation: tuple[SegmentCase, Mutation]) -> None:
    """A changed segment: decode_segment refuses it or returns exactly the original records
    (only unchecked bytes changed: the header's, or a version 3 entry's epoch; or the cut fell
    between units); the scan stops at the damaged unit and its prefix decodes to the original
    records."""
    case, m = case_and_mutation
    data = m.apply(case.data)
    check_segment_bytes(data)
    decoded, err = outcome("decode_segment", SEGMENT_ERRORS, lambda: decode_segment(data))
    if m.kind == "truncate":
        if m.position in case.boundaries:
            assert decoded is not None, f"cut between units at {m.position}: {err}"
            assert decoded.records == list(case.records[: case.records_before(m.position)])
        else:
            assert isinstance(err, CorruptRecordError), f"cut inside a unit at {m.position}: {decoded or err!r}"
    elif m.kind == "extend":
        assert isinstance(err, CorruptRecordError), f"trailing garbage accepted: {decoded or err!r}"
    elif decoded is not None:
        assert m.position < SEGMENT_HEADER_SIZE or case.in_epoch(m.position), f"{m} inside the data went unnoticed"
        assert decoded.records == list(case.records)
    elif case.in_epoch(m.position):
        raise AssertionError(f"{m} in an epoch (which no check covers) was refused: {err!r}")
    if m.kind == "truncate" and m.position < SEGMENT_HEADER_SIZE:
        return
    header, _ = outcome("SegmentHeader.decode", HEADER_ERRORS, lambda: SegmentHeader.decode(data))
    if header is None:
        assert m.kind in ("flip", "byte") and m.position < 8, f"{m} broke the header"
        return
    if header.format_version != case.format_version:  # versions 2 and 3 differ by one bit
        assert m.kind in ("flip", "byte") and 4 <= m.position < 6, f"{m} changed the format version"
        return
    if header.start_offset != case.start_offset:
        assert m.kind in ("flip", "byte") and 8 <= m.position < 16, f"{m} changed the start offset"
        assert (decoded is None) == bool(case.records), "records accepted after a changed start offset"
        return
    scan = scan_segment(data, expected_first_offset=case.start_offset)
    if m.kind == "truncate" or (
        m.kind != "extend" and m.position >= SEGMENT_HEADER_SIZE and not case.in_epoch(m.position)
    ):
        want = case.boundary_at_or_before(m.position)
    else:
        want = len(case.data)
    assert scan.valid_length == want, f"{m}: scan kept {scan.valid_length} bytes, expected {want} ({scan.error})"
    prefix = decode_segment(data[:want])
    assert prefix.records == list(case.records[: case.records_before(want)])


def check_segment_columns(data: bytes, container: str = "bytes") -> None:
    """Any bytes: :func:`~danube_pipeline.lake.segment_columns.decode_segment_columns` agrees with
    :func:`~danube_pipeline.format.segments.decode_segment`. Both refuse the bytes with the same error
    (type and message), or both read them: the same header, offset index and records, and the
    columns equal the reference's records made columns. A record whose offset or publish time
    does not fit an int64 (the format's u64 allows it) is refused with ``OverflowError``."""
    import numpy as np  # noqa: PLC0415 - the pipeline extra: only this check needs it

    from danube_pipeline.lake.segment_columns import RecordColumns, decode_segment_columns  # noqa: PLC0415

    buf = CONTAINERS[container](data)
    ref, ref_err = outcome("decode_segment", SEGMENT_ERRORS, lambda: decode_segment(buf, index_interval_records=2))
    if ref is not None and any(r.publish_time_us >= 1 << 63 or r.offset >= 1 << 63 for r in ref.records):
        _, err = outcome("decode_segment_columns", (OverflowError,), lambda: decode_segment_columns(buf))
        assert isinstance(err, OverflowError), "an offset or publish time beyond int64 was not refused"
        return
    got, got_err = outcome(
        "decode_segment_columns", SEGMENT_ERRORS, lambda: decode_segment_columns(buf, index_interval_records=2)
    )
    if ref is None:
        assert got is None, f"decode_segment_columns accepted what decode_segment refuses: {ref_err!r}"
        assert (type(got_err), str(got_err)) == (type(ref_err), str(ref_err)), f"{got_err!r} != {ref_err!r}"
        return
    assert got is not None, f"decode_segment_columns refused what decode_segment reads: {got_err!r}"
    assert (got.header, got.offset_index, got.size_bytes) == (ref.header, ref.offset_index, ref.size_bytes)
    assert list(got.records) == ref.records
    expected = RecordColumns.from_records(ref.records)
    for name in RecordColumns.__slots__:
        mine, theirs = getattr(got.records, name), getattr(expected, name)
        if isinstance(mine, np.ndarray):
            assert mine.dtype == theirs.dtype and np.array_equal(mine, theirs), f"column {name} differs"
        else:
            assert mine.equals(theirs), f"column {name} differs: {mine} != {theirs}"
