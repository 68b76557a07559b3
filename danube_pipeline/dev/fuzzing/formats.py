"""Hypothesis strategies for the record formats: batches and segments of every version, valid,
mutated (a bit flip, a byte change, a cut, appended garbage) or crafted (bytes changed under a
recomputed CRC), with the records a reader must get back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import crc32c as _crc32c
from hypothesis import strategies as st

from danube_pipeline.format.batches import BatchBuilder, set_base_offset
from danube_pipeline.format.records import (
    BATCH_FORMAT_VERSION,
    EPOCH_PREFIX_SIZE,
    FORMAT_VERSION,
    LEGACY_FORMAT_VERSION,
    Record,
    SegmentHeader,
    encode_record,
)

U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1
MAX_DELTA_US = U32_MAX
"""Largest timestamp delta within a batch: 4,294,967,295 µs (about 4295 s)."""


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

    ``boundaries`` are the byte positions where each unit (a batch in version 2, an entry of
    an epoch and a batch in version 3, a record in version 1) starts, then the segment's end;
    ``unit_counts`` the records of each unit; ``epochs`` each unit's leader epoch (0 before
    version 3).
    """

    data: bytes
    records: tuple[Record, ...]
    start_offset: int
    format_version: int
    boundaries: tuple[int, ...]
    unit_counts: tuple[int, ...]
    epochs: tuple[int, ...] = ()

    @property
    def epoch_prefix(self) -> int:
        """Bytes of each unit before its batch: the epoch of a version 3 entry, else 0."""
        return EPOCH_PREFIX_SIZE if self.format_version >= FORMAT_VERSION else 0

    def in_epoch(self, position: int) -> bool:
        """Whether byte ``position`` lies in a version 3 entry's epoch (no check covers it)."""
        return any(b <= position < b + self.epoch_prefix for b in self.boundaries[:-1])

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
    return draw(_batch_segments(BATCH_FORMAT_VERSION, max_batches, tierable=tierable))


@st.composite
def segments_v3(draw: st.DrawFn, max_batches: int = 4, *, tierable: bool = False) -> SegmentCase:
    """A version 3 segment: :func:`segments_v2`'s batches, each behind any u64 leader epoch
    (non-decreasing, as the WAL writes them; epoch 0 included)."""
    return draw(_batch_segments(FORMAT_VERSION, max_batches, tierable=tierable))


@st.composite
def _batch_segments(draw: st.DrawFn, version: int, max_batches: int, *, tierable: bool) -> SegmentCase:
    specs = draw(st.lists(batch_specs(max_records=4, tierable=tierable), max_size=max_batches))
    start = draw(st.integers(0, INT64_SAFE_MAX if tierable else U64_MAX - 4 * max_batches))
    out = bytearray(SegmentHeader(start, draw(st.integers(0, U64_MAX)), format_version=version).encode())
    epochs = sorted(draw(st.lists(st.integers(0, U64_MAX), min_size=len(specs), max_size=len(specs))))
    if version != FORMAT_VERSION:
        epochs = [0] * len(specs)
    records: list[Record] = []
    boundaries = [len(out)]
    for spec, epoch in zip(specs, epochs):
        head, rest = set_base_offset(spec.build(), start + len(records))
        records += spec.expected(start + len(records))
        if version == FORMAT_VERSION:
            out += epoch.to_bytes(EPOCH_PREFIX_SIZE, "little")
        out += head + rest
        boundaries.append(len(out))
    counts = tuple(len(s.records) for s in specs)
    return SegmentCase(bytes(out), tuple(records), start, version, tuple(boundaries), counts, tuple(epochs))


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
    """A segment of any format version."""
    return st.one_of(segments_v3(), segments_v2(), segments_v1())


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
    """A segment and one mutation of it (``tierable``: of :func:`segments_v2` or
    :func:`segments_v3` ``tierable``)."""
    case = draw(st.one_of(segments_v2(tierable=True), segments_v3(tierable=True)) if tierable else segments())
    return case, draw(mutations(len(case.data)))


def recompute_crc(data: bytearray, unit: int, end: int, version: int) -> None:
    """Recompute the CRC of the batch (versions 2 and 3) or record frame (version 1) at ``unit``."""
    if version == LEGACY_FORMAT_VERSION:
        data[unit + 4 : unit + 8] = _crc32c.crc32c(bytes(data[unit + 8 : end])).to_bytes(4, "little")
    else:
        data[unit + 12 : unit + 16] = _crc32c.crc32c(bytes(data[unit + 16 : end])).to_bytes(4, "little")


byte_edits = st.lists(st.tuples(st.integers(0, 2**31), st.integers(1, 255)), min_size=1, max_size=3)
"""1-3 ``(where, mask)`` edits: XOR the byte at ``where`` (modulo the edited span) with ``mask``."""


@st.composite
def crafted_batches(draw: st.DrawFn) -> bytes:
    """A stored batch with 1-3 bytes changed after the CRC field and the CRC recomputed: bytes
    only a buggy or hostile writer produces, which the CRC cannot catch."""
    data = bytearray(draw(batch_cases(max_records=4)).stored)
    for where, mask in draw(byte_edits):
        data[16 + where % (len(data) - 16)] ^= mask
    recompute_crc(data, 0, len(data), 2)
    return bytes(data)


@st.composite
def crafted_segments(draw: st.DrawFn) -> bytes:
    """A segment with one unit's covered bytes changed and its CRC recomputed."""
    case = draw(segments())
    data = bytearray(case.data)
    if len(case.boundaries) > 1:
        i = draw(st.integers(0, len(case.boundaries) - 2))
        unit, end = case.boundaries[i], case.boundaries[i + 1]
        unit += case.epoch_prefix  # the batch of a version 3 entry
        covered = unit + (8 if case.format_version == LEGACY_FORMAT_VERSION else 16)
        for where, mask in draw(byte_edits):
            data[covered + where % (end - covered)] ^= mask
        recompute_crc(data, unit, end, case.format_version)
    return bytes(data)


CONTAINERS: dict[str, Callable[[bytes], bytes | memoryview]] = {"bytes": bytes, "memoryview": memoryview}
"""The buffer types a decoder is handed, by name."""
containers = st.sampled_from(sorted(CONTAINERS))
"""The buffer type a decoder is handed: ``bytes`` or ``memoryview``."""

