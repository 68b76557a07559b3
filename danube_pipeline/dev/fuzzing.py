"""Hypothesis strategies and properties for fuzzing the record and segment decoders and the
broker's request handling: one copy, shared by ``tests/test_fuzz.py`` (bounded runs in
``make test``) and ``benchmarks/fuzz.py`` (long runs). Needs the ``dev`` extra (hypothesis).

Every ``check_*`` function takes values drawn from the strategies here and raises
``AssertionError`` when its property breaks. A decoder that raises an exception its docstring
does not document is reported as an ``AssertionError`` naming the decoder and the exception
(the original chained).

Decoders and their documented errors:

* :func:`~danube_pipeline.format.batches.parse_header`, :func:`~danube_pipeline.format.batches.validate_batch`:
  :class:`MalformedRequestError`, :class:`MessageTooLargeError`.
* :func:`~danube_pipeline.format.segments.decode_segment`: :class:`CorruptRecordError`,
  :class:`OffsetRangeError`; :func:`~danube_pipeline.format.segments.iter_stored_batches`,
  :func:`~danube_pipeline.format.records.iter_records`, :meth:`SegmentHeader.decode`:
  :class:`CorruptRecordError`.
* :func:`~danube_pipeline.lake.segment_columns.decode_segment_columns`: the same errors as
  ``decode_segment``, with the same messages (:func:`check_segment_columns`).
* :func:`~danube_pipeline.format.segments.scan_segment`: :class:`CorruptRecordError` for an unusable
  header only; after a valid header it never raises and its ``valid_length`` is a prefix whose
  records all decode.

Requests: :class:`BrokerTarget` sends requests to a real broker over raw gRPC (generic
multi-callables, so garbage bytes go out as they are) and :func:`check_request` requires a
status in :data:`ALLOWED_CODES` and a broker still serving afterwards.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import crc32c as _crc32c
import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import strategies as st

from danube_pipeline.format.batches import (
    BatchBuilder,
    BatchHeader,
    batch_payloads,
    batch_records,
    iter_batch,
    parse_header,
    set_base_offset,
    validate_batch,
)
from danube_pipeline.errors import (
    CorruptRecordError,
    MalformedRequestError,
    MessageTooLargeError,
    OffsetRangeError,
    bounded,
)
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.format.records import (
    LEGACY_FORMAT_VERSION,
    SEGMENT_HEADER_SIZE,
    Record,
    SegmentHeader,
    encode_record,
    iter_records,
)
from danube_pipeline.format.segments import DecodedSegment, decode_segment, iter_stored_batches, scan_segment

T = TypeVar("T")
U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1
MAX_DELTA_US = U32_MAX
"""Largest timestamp delta within a batch: 4,294,967,295 µs (about 4295 s)."""

BATCH_ERRORS: tuple[type[Exception], ...] = (MalformedRequestError, MessageTooLargeError)
SEGMENT_ERRORS: tuple[type[Exception], ...] = (CorruptRecordError, OffsetRangeError)
HEADER_ERRORS: tuple[type[Exception], ...] = (CorruptRecordError,)


# =========================================================================== decoders: values


@dataclass(frozen=True)
class RecordSpec:
    """One record to frame; ``plain`` ones go through ``append_payload`` (no key, no attributes)."""

    payload: bytes
    delta_us: int
    key: str | None
    attributes: dict[str, str]
    plain: bool


@dataclass(frozen=True)
class BatchSpec:
    """A batch to frame with :class:`BatchBuilder` and the producer it is built for."""

    first_timestamp_us: int
    producer_id: int
    producer_name: str
    schema_id: int
    schema_version: int
    base_sequence: int
    records: tuple[RecordSpec, ...]

    def build(self) -> bytes:
        """The batch as a producer frames it (base offset 0)."""
        builder = BatchBuilder(self.first_timestamp_us)
        for r in self.records:
            ts = self.first_timestamp_us + r.delta_us
            if r.plain:
                builder.append_payload(r.payload, ts)
            else:
                builder.append(r.payload, timestamp_us=ts, key=r.key, attributes=r.attributes)
        return builder.build(
            producer_id=self.producer_id, producer_name=self.producer_name, schema_id=self.schema_id,
            schema_version=self.schema_version, base_sequence=self.base_sequence,
        )

    def expected(self, base_offset: int) -> list[Record]:
        """The records a reader must get back with the batch stored at ``base_offset``."""
        return [
            Record(
                offset=base_offset + i, publish_time_us=self.first_timestamp_us + r.delta_us,
                producer_id=self.producer_id, producer_name=self.producer_name, schema_id=self.schema_id,
                schema_version=self.schema_version, payload=r.payload, attributes=r.attributes, key=r.key,
            )
            for i, r in enumerate(self.records)
        ]


@dataclass(frozen=True)
class BatchCase:
    """A framed batch (``data``, base offset 0) and the same batch stored at ``base_offset``."""

    spec: BatchSpec
    base_offset: int
    data: bytes
    stored: bytes


@dataclass(frozen=True)
class SegmentCase:
    """A whole segment and what it holds.

    ``boundaries`` are the byte positions where each unit (a batch in version 2, a record in
    version 1) starts, then the segment's end; ``unit_counts`` the records of each unit.
    """

    data: bytes
    records: tuple[Record, ...]
    start_offset: int
    format_version: int
    boundaries: tuple[int, ...]
    unit_counts: tuple[int, ...]

    def records_before(self, position: int) -> int:
        """Records in the units that end at or before byte ``position``."""
        return sum(n for end, n in zip(self.boundaries[1:], self.unit_counts) if end <= position)

    def boundary_at_or_before(self, position: int) -> int:
        """The last unit boundary at or before byte ``position``."""
        return max(b for b in self.boundaries if b <= position)


@dataclass(frozen=True)
class Mutation:
    """One change to valid bytes: flip bit ``value`` of byte ``position``, XOR byte
    ``position`` with ``value``, cut the data at ``position``, or append ``extra``."""

    kind: str  # "flip" | "byte" | "truncate" | "extend"
    position: int
    value: int = 0
    extra: bytes = b""

    def apply(self, data: bytes) -> bytes:
        if self.kind == "truncate":
            return data[: self.position]
        if self.kind == "extend":
            return data + self.extra
        out = bytearray(data)
        out[self.position] ^= (1 << self.value) if self.kind == "flip" else self.value
        return bytes(out)


# =========================================================================== decoders: strategies


def utf8_text(max_size: int = 12, min_size: int = 0) -> st.SearchStrategy[str]:
    """Any text UTF-8 can carry (every code point but surrogates), control characters included."""
    return st.text(st.characters(codec="utf-8"), min_size=min_size, max_size=max_size)


_payloads = st.one_of(st.binary(max_size=48), st.binary(min_size=200, max_size=1200))
_attributes = st.dictionaries(utf8_text(8), utf8_text(16), max_size=3)


INT64_SAFE_MAX = 2**62
"""Largest offset or timestamp drawn for ``tierable`` segments: their rows fit Iceberg's int64."""


@st.composite
def batch_specs(draw: st.DrawFn, max_records: int = 6, *, tierable: bool = False) -> BatchSpec:
    """Any batch: 1..``max_records`` records with non-decreasing timestamps within 4295 s,
    payloads incl. empty, optional keys, attributes of any text, any u64/u32/i64 header field
    (``tierable``: a first timestamp below :data:`INT64_SAFE_MAX`)."""
    n = draw(st.integers(1, max_records))
    deltas = sorted(draw(st.lists(st.integers(0, MAX_DELTA_US), min_size=n, max_size=n)))
    deltas = [d - deltas[0] for d in deltas]
    records = []
    for delta in deltas:
        payload = draw(_payloads)
        if draw(st.booleans()):
            records.append(RecordSpec(payload, delta, None, {}, plain=True))
        else:
            key = draw(st.none() | utf8_text(16))
            records.append(RecordSpec(payload, delta, key, draw(_attributes), plain=False))
    return BatchSpec(
        first_timestamp_us=draw(st.integers(0, INT64_SAFE_MAX if tierable else U64_MAX - MAX_DELTA_US)),
        producer_id=draw(st.integers(0, U64_MAX)),
        producer_name=draw(utf8_text(24)),
        schema_id=draw(st.integers(0, U64_MAX)),
        schema_version=draw(st.integers(0, U32_MAX)),
        base_sequence=draw(st.just(-1) | st.integers(-(2**63), 2**63 - 1)),
        records=tuple(records),
    )


@st.composite
def batch_cases(draw: st.DrawFn, max_records: int = 6) -> BatchCase:
    """A batch and the same batch stored at any base offset that keeps its offsets in u64."""
    spec = draw(batch_specs(max_records))
    data = spec.build()
    base = draw(st.integers(0, U64_MAX - len(spec.records) + 1))
    head, rest = set_base_offset(data, base)
    return BatchCase(spec, base, data, head + bytes(rest))


@st.composite
def segments_v2(draw: st.DrawFn, max_batches: int = 4, *, tierable: bool = False) -> SegmentCase:
    """A version 2 segment of 0..``max_batches`` batches with contiguous offsets
    (``tierable``: offsets and timestamps below :data:`INT64_SAFE_MAX`, as tiering takes them)."""
    specs = draw(st.lists(batch_specs(max_records=4, tierable=tierable), max_size=max_batches))
    start = draw(st.integers(0, INT64_SAFE_MAX if tierable else U64_MAX - 4 * max_batches))
    out = bytearray(SegmentHeader(start, draw(st.integers(0, U64_MAX))).encode())
    records: list[Record] = []
    boundaries = [len(out)]
    for spec in specs:
        head, rest = set_base_offset(spec.build(), start + len(records))
        records += spec.expected(start + len(records))
        out += head + rest
        boundaries.append(len(out))
    counts = tuple(len(s.records) for s in specs)
    return SegmentCase(bytes(out), tuple(records), start, 2, tuple(boundaries), counts)


@st.composite
def segments_v1(draw: st.DrawFn, max_records: int = 6) -> SegmentCase:
    """A version 1 segment (one frame per record, :func:`encode_record`; no keys)."""
    n = draw(st.integers(0, max_records))
    start = draw(st.integers(0, U64_MAX - max_records))
    header = SegmentHeader(start, draw(st.integers(0, U64_MAX)), format_version=LEGACY_FORMAT_VERSION)
    out = bytearray(header.encode())
    records = []
    boundaries = [len(out)]
    for i in range(n):
        record = Record(
            offset=start + i, publish_time_us=draw(st.integers(0, U64_MAX)), producer_id=draw(st.integers(0, U64_MAX)),
            producer_name=draw(utf8_text(16)), schema_id=draw(st.integers(0, U64_MAX)),
            schema_version=draw(st.integers(0, U32_MAX)), payload=draw(_payloads), attributes=draw(_attributes),
        )
        records.append(record)
        out += encode_record(record)
        boundaries.append(len(out))
    return SegmentCase(bytes(out), tuple(records), start, LEGACY_FORMAT_VERSION, tuple(boundaries), (1,) * n)


def segments() -> st.SearchStrategy[SegmentCase]:
    """A segment of either format version."""
    return st.one_of(segments_v2(), segments_v1())


def mutations(length: int) -> st.SearchStrategy[Mutation]:
    """One bit flip, byte change, truncation or appended garbage of ``length`` valid bytes."""
    return st.one_of(
        st.builds(Mutation, st.just("flip"), st.integers(0, length - 1), st.integers(0, 7)),
        st.builds(Mutation, st.just("byte"), st.integers(0, length - 1), st.integers(1, 255)),
        st.builds(Mutation, st.just("truncate"), st.integers(0, length - 1)),
        st.builds(Mutation, st.just("extend"), st.just(length), st.just(0), st.binary(min_size=1, max_size=20)),
    )


@st.composite
def mutated_batches(draw: st.DrawFn) -> tuple[BatchCase, Mutation]:
    """A stored batch and one mutation of it."""
    case = draw(batch_cases(max_records=4))
    return case, draw(mutations(len(case.stored)))


@st.composite
def mutated_segments(draw: st.DrawFn, *, tierable: bool = False) -> tuple[SegmentCase, Mutation]:
    """A segment and one mutation of it (``tierable``: of :func:`segments_v2` ``tierable``)."""
    case = draw(segments_v2(tierable=True) if tierable else segments())
    return case, draw(mutations(len(case.data)))


def _recrc(data: bytearray, unit: int, end: int, version: int) -> None:
    """Recompute the CRC of the batch (version 2) or record frame (version 1) at ``unit``."""
    if version == LEGACY_FORMAT_VERSION:
        data[unit + 4 : unit + 8] = _crc32c.crc32c(bytes(data[unit + 8 : end])).to_bytes(4, "little")
    else:
        data[unit + 12 : unit + 16] = _crc32c.crc32c(bytes(data[unit + 16 : end])).to_bytes(4, "little")


_edits = st.lists(st.tuples(st.integers(0, 2**31), st.integers(1, 255)), min_size=1, max_size=3)


@st.composite
def crafted_batches(draw: st.DrawFn) -> bytes:
    """A stored batch with 1-3 bytes changed after the CRC field and the CRC recomputed: bytes
    only a buggy or hostile writer produces, which the CRC cannot catch."""
    data = bytearray(draw(batch_cases(max_records=4)).stored)
    for where, mask in draw(_edits):
        data[16 + where % (len(data) - 16)] ^= mask
    _recrc(data, 0, len(data), 2)
    return bytes(data)


@st.composite
def crafted_segments(draw: st.DrawFn) -> bytes:
    """A segment with one unit's covered bytes changed and its CRC recomputed."""
    case = draw(segments())
    data = bytearray(case.data)
    if len(case.boundaries) > 1:
        i = draw(st.integers(0, len(case.boundaries) - 2))
        unit, end = case.boundaries[i], case.boundaries[i + 1]
        covered = unit + (8 if case.format_version == LEGACY_FORMAT_VERSION else 16)
        for where, mask in draw(_edits):
            data[covered + where % (end - covered)] ^= mask
        _recrc(data, unit, end, case.format_version)
    return bytes(data)


_CONTAINERS: dict[str, Callable[[bytes], bytes | memoryview]] = {"bytes": bytes, "memoryview": memoryview}
containers = st.sampled_from(sorted(_CONTAINERS))
"""The buffer type a decoder is handed: ``bytes`` or ``memoryview``."""


# =========================================================================== decoders: properties


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
    buf = _CONTAINERS[container](data)
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


def _check_decoded(decoded: DecodedSegment, header: SegmentHeader, size: int) -> None:
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
    buf = _CONTAINERS[container](data)
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
    """A segment of either version decodes back to its records; the sparse index, the scan
    and the stored batches all agree with its layout."""
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
    # Every stored batch is one a producer could have sent (version 1 records become batches).
    split = [r for _, b in stored for r in _check_accepted_batch(b.data, validate_batch(b.data))]
    assert split == list(case.records)


def check_segment_mutation(case_and_mutation: tuple[SegmentCase, Mutation]) -> None:
    """A changed segment: decode_segment refuses it or returns exactly the original records
    (only the header's unchecked bytes changed, or the cut fell between units); the scan stops
    at the damaged unit and its prefix decodes to the original records."""
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
        assert m.position < SEGMENT_HEADER_SIZE, f"{m} inside the data went unnoticed"
        assert decoded.records == list(case.records)
    if m.kind == "truncate" and m.position < SEGMENT_HEADER_SIZE:
        return
    header, _ = outcome("SegmentHeader.decode", HEADER_ERRORS, lambda: SegmentHeader.decode(data))
    if header is None:
        assert m.kind in ("flip", "byte") and m.position < 8, f"{m} broke the header"
        return
    if header.start_offset != case.start_offset:
        assert m.kind in ("flip", "byte") and 8 <= m.position < 16, f"{m} changed the start offset"
        assert (decoded is None) == bool(case.records), "records accepted after a changed start offset"
        return
    scan = scan_segment(data, expected_first_offset=case.start_offset)
    if m.kind == "truncate" or (m.kind != "extend" and m.position >= SEGMENT_HEADER_SIZE):
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

    buf = _CONTAINERS[container](data)
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


# =========================================================================== requests

ALLOWED_CODES = frozenset({
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OUT_OF_RANGE,
})
"""Statuses a broker may answer any request with; never UNKNOWN, INTERNAL, DEADLINE_EXCEEDED..."""

OPEN_ENDED = frozenset({"/danube.v1.ConsumerService/Receive"})
"""Server streams that stay open while served: a call still open after ``open_wait_s`` counts as
accepted (:meth:`BrokerTarget.call` cancels it)."""


@dataclass(frozen=True)
class Rpc:
    """One RPC of ``danube.proto``, from the descriptor (so a new RPC is fuzzed without edits)."""

    service: str
    method: str
    request: type[Message]
    client_streaming: bool
    server_streaming: bool

    @property
    def path(self) -> str:
        return f"/danube.v1.{self.service}/{self.method}"

    @property
    def name(self) -> str:
        return f"{self.service}.{self.method}"


DISRUPTIVE_RPCS = frozenset({
    "Admin.DrainBroker", "Admin.UnloadTopic", "Admin.DeleteTopic", "Admin.ResetCursor", "Admin.AbandonUnavailableRange",
})
"""RPCs whose well-formed requests take the broker's topics away (every request of
``DrainBroker`` is well formed: it has no field), delete them, move a subscription's cursor
or give up offsets. They are left out of the fuzzed RPCs; their bad input is tested on its own
(``tests/test_cluster.py``, ``tests/test_topic_admin.py``)."""


def rpcs() -> list[Rpc]:
    """Every RPC of every service in ``danube.proto`` but :data:`DISRUPTIVE_RPCS`."""
    return [
        Rpc(service.name, m.name, getattr(pb, m.input_type.name), m.client_streaming, m.server_streaming)
        for service in pb.DESCRIPTOR.services_by_name.values()
        for m in service.methods
        if f"{service.name}.{m.name}" not in DISRUPTIVE_RPCS
    ]


@dataclass
class Known:
    """Ids and names that exist on the target broker, so fuzzed requests reach past lookups."""

    topics: list[str] = field(default_factory=list)
    producer_ids: list[int] = field(default_factory=list)
    producer_name: str = "fuzz-producer"
    consumer_ids: list[int] = field(default_factory=list)
    subscriptions: list[str] = field(default_factory=list)
    schema_ids: list[int] = field(default_factory=list)
    subjects: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=lambda: [0])


def _or_known(values: Sequence[T], other: st.SearchStrategy[T]) -> st.SearchStrategy[T]:
    return st.one_of(st.sampled_from(list(values)), other) if values else other


_u64 = st.one_of(st.integers(0, U64_MAX), st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, U64_MAX]))
_u32 = st.one_of(st.integers(0, U32_MAX), st.sampled_from([0, 1, 2**31 - 1, 2**31, U32_MAX]))
_i32 = st.integers(-(2**31), 2**31 - 1)
_i64 = st.integers(-(2**63), 2**63 - 1)
_long_text = st.builds(lambda unit, n: unit * n, st.sampled_from(["a", "\x00", "é", "/", "\U0001d11e", "\n", "-"]),
                       st.integers(129, 70_000))
any_text = st.one_of(
    utf8_text(40),
    st.text(st.characters(codec="utf-8", categories=["Cc", "Cf", "Zl", "Zp"]), min_size=1, max_size=8),
    _long_text,
)
"""Strings for any request field: any text, control and format characters, 129..70,000 chars."""
names = st.one_of(
    st.from_regex(r"[A-Za-z0-9_-]{1,24}", fullmatch=True),
    st.builds(lambda c, n: c * n, st.sampled_from("aZ9_-"), st.integers(120, 140)),
    st.builds(lambda n, tail: n + tail, st.from_regex(r"[a-z]{1,8}", fullmatch=True),
              st.sampled_from(["\n", "\x00", "/", "/x", ".", " ", "é", "\r\n", "\u2028"])),
)
"""Names near the grammar ``[A-Za-z0-9_-]{1,128}``: valid, at and over the length limit, with a
bad last character (a trailing newline that ``$`` lets through, NUL, slash, non-ASCII)."""
topic_paths = st.builds(lambda ns, t: f"/{ns}/{t}", st.one_of(st.just("fuzz"), names, any_text), st.one_of(names, any_text))
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | utf8_text(10),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
        utf8_text(8) | st.sampled_from(["type", "name", "fields", "items", "values", "symbols"]), kids, max_size=4),
    max_leaves=12,
)
raw_schemas = st.one_of(
    any_text,
    _json.map(json.dumps),
    st.sampled_from(['"bytes"', '"string"', '{"type": "record", "name": "R", "fields": [{"name": "a", "type": "long"}]}',
                     '{"type": "array", "items": "R"}', '{"type": "enum", "name": "E", "symbols": ["A", "A"]}',
                     '{"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": false}',
                     '{"$ref": "http://example.com/remote.json"}', '{"type": "nope"}',
                     'syntax = "proto3"; message R { int64 a = 1; map<string, R> m = 2; }',
                     'syntax = "proto2"; message R { required int64 a = 1; }', 'syntax = "proto3"; import "x.proto";',
                     'syntax = "proto3"; ' + "message M { " * 70 + "}" * 70]),
    st.builds(lambda n: "[" * n + "]" * n, st.integers(1, 50_000)),
    st.builds(lambda n: '{"type": ' * n + '"int"' + "}" * n, st.integers(1, 5_000)),
)
"""Schema texts of the three types (Avro, JSON Schema, ``.proto``): valid, JSON of any shape, nested
deep enough to stress the parsers; any text is sent with any ``schema_type``."""


def _string_field(name: str, known: Known) -> st.SearchStrategy[str]:
    if name == "topic":
        return _or_known(known.topics, st.one_of(topic_paths, any_text))
    if name == "namespace":
        return st.one_of(st.just("fuzz"), names, any_text)
    if name == "raw_schema":
        return raw_schemas
    if name == "subject":
        return _or_known(known.subjects, st.one_of(names, any_text))
    if name == "subscription":
        return _or_known(known.subscriptions, st.one_of(names, any_text))
    return st.one_of(names, any_text)


def _u64_field(name: str, known: Known) -> st.SearchStrategy[int]:
    hints = {"producer_id": known.producer_ids, "consumer_id": known.consumer_ids, "schema_id": known.schema_ids}
    return _or_known(hints.get(name, known.offsets), _u64)


@st.composite
def request_batches(draw: st.DrawFn, known: Known) -> bytes:
    """``SendBatchRequest.batch``: a valid batch of the known producer or of any producer, a
    mutated or CRC-recomputed one, or any bytes."""
    spec = draw(batch_specs(max_records=4))
    use_known = draw(st.booleans())
    if known.producer_ids and use_known:
        spec = BatchSpec(spec.first_timestamp_us, draw(st.sampled_from(known.producer_ids)), known.producer_name,
                         0, 0, -1, spec.records)
    data = spec.build()
    kind = draw(st.sampled_from(["valid", "mutated", "crafted", "bytes"]))
    if kind == "mutated":
        return draw(mutations(len(data))).apply(data)
    if kind == "crafted":
        edited = bytearray(data)
        for where, mask in draw(_edits):
            edited[16 + where % (len(edited) - 16)] ^= mask
        _recrc(edited, 0, len(edited), 2)
        return bytes(edited)
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    return data


def _field_values(fd: FieldDescriptor, known: Known, depth: int) -> st.SearchStrategy[Any]:
    t = fd.type
    if t == FieldDescriptor.TYPE_MESSAGE:
        return messages(fd.message_type, known, depth + 1)
    if t == FieldDescriptor.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in fd.enum_type.values]), _i32)
    if t == FieldDescriptor.TYPE_STRING:
        return _string_field(fd.name, known)
    if t == FieldDescriptor.TYPE_BYTES:
        return request_batches(known) if fd.name == "batch" else st.binary(max_size=200)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return _u64_field(fd.name, known)
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return _u32
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return _i32
    if t in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
        return _i64
    return st.floats()


def messages(descriptor: Descriptor, known: Known, depth: int = 0) -> st.SearchStrategy[Message]:
    """A message of ``descriptor`` with any subset of its fields set to fuzzed values (field
    types from the descriptor; ids, topics and subjects of ``known`` mixed in by field name)."""
    cls: type[Message] = getattr(pb, descriptor.name)

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = cls()
        for fd in descriptor.fields:
            if not draw(st.booleans()):
                continue
            values = _field_values(fd, known, depth)
            target = getattr(msg, fd.name)
            if fd.label == FieldDescriptor.LABEL_REPEATED:
                for value in draw(st.lists(values, max_size=0 if depth > 2 else 4)):
                    if fd.type == FieldDescriptor.TYPE_MESSAGE:
                        target.add().CopyFrom(value)
                    else:
                        target.append(value)
            elif fd.type == FieldDescriptor.TYPE_MESSAGE:
                target.CopyFrom(draw(values))
            else:
                setattr(msg, fd.name, draw(values))
        return msg

    return build()


def requests(rpc: Rpc, known: Known) -> st.SearchStrategy[list[Message]]:
    """What a client sends on ``rpc``: one request message, or 0..3 on a client stream."""
    one = messages(rpc.request.DESCRIPTOR, known)
    return st.lists(one, max_size=3) if rpc.client_streaming else one.map(lambda m: [m])


_invalid_utf8 = st.binary(max_size=12).map(lambda b: b"\xff" + b)
garbage = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda f, b: bytes([f << 3 | 2, len(b)]) + b, st.integers(1, 15), _invalid_utf8),
    st.sampled_from([b"\x80", b"\x08", b"\x0a\x05ab", b"\xff" * 11, b"\x0a\xff\xff\xff\xff\x0f", b"\x0b", b"\x0c"]),
)
"""Request payloads that are not a message: any bytes, a string field that is not UTF-8, a
truncated varint or length, a group tag."""


def raw_requests(rpc: Rpc, known: Known) -> st.SearchStrategy[list[bytes]]:
    """Raw payloads for ``rpc``: garbage, or a serialized fuzzed request with one mutation."""
    def mutate(msg: Message) -> st.SearchStrategy[bytes]:
        data = msg.SerializeToString()
        return mutations(len(data)).map(lambda m: m.apply(data)) if data else garbage
    one = st.one_of(garbage, messages(rpc.request.DESCRIPTOR, known).flatmap(mutate))
    return st.lists(one, min_size=1, max_size=3) if rpc.client_streaming else one.map(lambda b: [b])


@dataclass(frozen=True)
class Answer:
    """How the broker answered a call; ``open`` for an open-ended stream we cancelled."""

    code: grpc.StatusCode
    details: str
    open: bool = False


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


class BrokerTarget:
    """Raw gRPC calls to a real broker at ``address``; ``alive`` reports whether its process runs."""

    def __init__(self, address: str, *, alive: Callable[[], bool], timeout_s: float = 5.0, open_wait_s: float = 0.3) -> None:
        self.address = address
        self.alive = alive
        self.timeout_s = timeout_s
        self.open_wait_s = open_wait_s
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.known = Known()
        self._serial = 0

    def close(self) -> None:
        self.channel.close()

    def _unary(self, path: str, request: Message, response: type[Message]) -> Any:
        call = self.channel.unary_unary(path, request_serializer=_serialize, response_deserializer=response.FromString)
        return call(request, timeout=self.timeout_s)

    def _batch(self, producer_id: int, *payloads: bytes) -> bytes:
        builder = BatchBuilder(time.time_ns() // 1000)
        for p in payloads:
            builder.append(p, timestamp_us=builder.first_timestamp_us, attributes={"k": "v"})
        return builder.build(producer_id=producer_id, producer_name=self.known.producer_name)

    def _producer(self, topic: str) -> int:
        request = pb.CreateProducerRequest(topic=topic, producer_name=self.known.producer_name)
        return int(self._unary("/danube.v1.ProducerService/CreateProducer", request, pb.CreateProducerResponse).producer_id)

    def _send(self, producer_id: int, *payloads: bytes) -> Any:
        request = pb.SendBatchRequest(producer_id=producer_id, batch=self._batch(producer_id, *payloads))
        return self._unary("/danube.v1.ProducerService/SendBatch", request, pb.SendBatchResponse)

    def _subscribe(self, topic: str, subscription: str) -> int:
        request = pb.SubscribeRequest(topic=topic, subscription=subscription, subscription_type=pb.SHARED,
                                      consumer_name=f"{subscription}-consumer", initial_position=pb.EARLIEST)
        return int(self._unary("/danube.v1.ConsumerService/Subscribe", request, pb.SubscribeResponse).consumer_id)

    def prepare(self, topic: str = "/fuzz/known") -> Known:
        """Create what fuzzed requests may name: a topic with a producer, a sealed segment and
        more records after it, a registered schema and a consumer on a subscription."""
        k = self.known
        pid = self._producer(topic)
        self._send(pid, b"a", b"b")
        sealed = self._unary("/danube.v1.Admin/SealActiveSegment", pb.SealActiveSegmentRequest(topic=topic),
                             pb.SealActiveSegmentResponse)
        last = self._send(pid, b"c")
        schema = self._unary("/danube.v1.SchemaRegistry/RegisterSchema",
                             pb.RegisterSchemaRequest(subject="fuzz-subject", raw_schema='"bytes"'), pb.RegisterSchemaResponse)
        k.topics, k.producer_ids, k.consumer_ids = [topic], [pid], [self._subscribe(topic, "fuzz-sub")]
        k.subscriptions, k.schema_ids, k.subjects = ["fuzz-sub"], [schema.schema_id], ["fuzz-subject"]
        k.offsets = sorted({0, 1, sealed.segment.start_offset, sealed.segment.end_offset + 1, last.last_offset})
        return k

    def call(self, rpc: Rpc, request: Sequence[Message] | Sequence[bytes]) -> Answer:
        """Send ``request`` (messages, or raw bytes as they are) on ``rpc`` and read the whole answer.

        Every call has a deadline of ``timeout_s``; an open-ended stream (:data:`OPEN_ENDED`)
        still open after ``open_wait_s`` is cancelled and answered ``Answer(OK, open=True)``.
        """
        ser = None if any(isinstance(r, bytes) for r in request) else _serialize
        cancelled = threading.Event()
        timer: threading.Timer | None = None
        try:
            if not rpc.client_streaming and not rpc.server_streaming:
                self.channel.unary_unary(rpc.path, request_serializer=ser)(request[0], timeout=self.timeout_s)
                return Answer(grpc.StatusCode.OK, "")
            if rpc.client_streaming and not rpc.server_streaming:
                self.channel.stream_unary(rpc.path, request_serializer=ser)(iter(request), timeout=self.timeout_s)
                return Answer(grpc.StatusCode.OK, "")
            if rpc.client_streaming:
                call = self.channel.stream_stream(rpc.path, request_serializer=ser)(iter(request), timeout=self.timeout_s)
            else:
                call = self.channel.unary_stream(rpc.path, request_serializer=ser)(request[0], timeout=self.timeout_s)
            if rpc.path in OPEN_ENDED:
                def stop() -> None:
                    cancelled.set()
                    call.cancel()

                timer = threading.Timer(self.open_wait_s, stop)
                timer.start()
            for _ in call:
                pass
            return Answer(grpc.StatusCode.OK, "")
        except grpc.RpcError as exc:
            if cancelled.is_set() and exc.code() == grpc.StatusCode.CANCELLED:
                return Answer(grpc.StatusCode.OK, f"open after {self.open_wait_s} s", open=True)
            return Answer(exc.code(), exc.details() or "")
        finally:
            if timer is not None:
                timer.cancel()

    def assert_serving(self) -> None:
        """The process runs and answers a health check SERVING."""
        assert self.alive(), "the broker process exited"
        status = self.health.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s).status
        assert status == health_pb2.HealthCheckResponse.SERVING, f"health: {status}"

    def assert_produce_consume(self) -> None:
        """A producer on a new topic publishes a batch and a new consumer receives it back."""
        self.assert_serving()
        self._serial += 1
        topic, payload = f"/fuzz/alive-{self._serial}", f"alive {self._serial}".encode()
        pid = self._producer(topic)
        sent = self._send(pid, payload)
        cid = self._subscribe(topic, "alive")
        receive = self.channel.unary_stream("/danube.v1.ConsumerService/Receive", request_serializer=_serialize,
                                            response_deserializer=pb.Deliveries.FromString)
        stream = receive(pb.ReceiveRequest(consumer_id=cid), timeout=10)
        try:
            deliveries = next(iter(stream))
            got = [r for d in deliveries.batches for r in batch_records(d.batch)]
            assert [(r.offset, r.payload) for r in got] == [(sent.first_offset, payload)], got
            # acked while the stream is open: the broker refuses acks of a consumer whose stream ended
            self._unary("/danube.v1.ConsumerService/Ack",
                        pb.AckRequest(consumer_id=cid, offsets=[sent.first_offset]), pb.AckResponse)
        finally:
            stream.cancel()
        self._unary("/danube.v1.ConsumerService/CloseConsumer", pb.CloseConsumerRequest(consumer_id=cid),
                    pb.CloseConsumerResponse)
        self._unary("/danube.v1.ProducerService/CloseProducer", pb.CloseProducerRequest(producer_id=pid),
                    pb.CloseProducerResponse)


def check_request(target: BrokerTarget, rpc: Rpc, request: Sequence[Message] | Sequence[bytes]) -> None:
    """The broker answers ``request`` on ``rpc`` with an allowed status and keeps serving."""
    answer = target.call(rpc, request)
    assert answer.code in ALLOWED_CODES, f"{rpc.path} answered {answer.code.name}: {bounded(answer.details, 300)}"
    target.assert_serving()


# =========================================================================== registry


@dataclass(frozen=True)
class Property:
    """A named property: ``check`` must hold for every value ``strategy`` draws."""

    name: str
    strategy: st.SearchStrategy[Any]
    check: Callable[[Any], None]


def _unpacked(check: Callable[..., None], **kw: Any) -> Callable[[tuple[bytes, str]], None]:
    return lambda args: check(args[0], args[1], **kw)


def decoder_properties() -> list[Property]:
    """The decoder properties, in process (the same ones ``tests/test_fuzz.py`` runs)."""
    any_segment = st.binary(max_size=300).map(lambda b: SegmentHeader(0, 0).encode() + b) | st.binary(max_size=300)
    return [
        Property("batch_round_trip", batch_cases(), check_batch_round_trip),
        Property("segment_round_trip", st.tuples(segments(), st.integers(1, 5)), check_segment_round_trip),
        Property("batch_any_bytes", st.tuples(st.binary(max_size=300), containers), _unpacked(check_batch_bytes)),
        Property("batch_mutated", mutated_batches(), check_batch_mutation),
        Property("batch_crafted", st.tuples(crafted_batches(), containers), _unpacked(check_batch_bytes)),
        Property("segment_any_bytes", st.tuples(any_segment, containers), _unpacked(check_segment_bytes)),
        Property("segment_mutated", mutated_segments(), check_segment_mutation),
        Property("segment_crafted", st.tuples(crafted_segments(), containers), _unpacked(check_segment_bytes, strict=False)),
        Property("segment_columns", st.tuples((segments() | segments_v2(tierable=True)).map(lambda c: c.data),
                                               containers), _unpacked(check_segment_columns)),
        Property("segment_columns_mutated", mutated_segments(tierable=True).map(lambda cm: cm[1].apply(cm[0].data)),
                 lambda data: check_segment_columns(data)),
        Property("segment_columns_crafted", st.tuples(crafted_segments(), containers), _unpacked(check_segment_columns)),
    ]


def request_properties(target: BrokerTarget) -> list[Property]:
    """Two properties per RPC against ``target`` (prepared): fuzzed messages and raw garbage."""
    out = []
    for rpc in rpcs():
        def check(request: Any, rpc: Rpc = rpc) -> None:
            check_request(target, rpc, request)

        out.append(Property(f"{rpc.name}[fields]", requests(rpc, target.known), check))
        out.append(Property(f"{rpc.name}[garbage]", raw_requests(rpc, target.known), check))
    return out
