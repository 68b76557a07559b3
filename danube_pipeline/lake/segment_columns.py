"""Segments read into columns: the records' fields as arrays, no Python object per record.

Tiering reads every record of a segment object once, to turn it into table rows. Building a
:class:`~danube_pipeline.format.records.Record` per record costs about 10 µs in Python, more than all
the other steps together. :func:`decode_segment_columns` reads a segment (format version 2 or
3: :mod:`danube_pipeline.format.batches`, :mod:`danube_pipeline.format.segments`) into a
:class:`RecordColumns` instead:

* the batch headers are walked here (in version 3 past each entry's 8-byte leader epoch, which
  tiering does not keep): each batch's length, CRC32C, magic, record count,
  producer name and base offset checked, as :func:`~danube_pipeline.format.segments.decode_segment`
  checks them;
* the records inside are walked in C (``danube_pipeline/lake/_framing.c``), which checks their
  framing as :func:`~danube_pipeline.format.batches.validate_batch` does and copies keys, attributes
  and payloads into contiguous Arrow buffers;
* the per-batch fields (producer, schema id and version, first timestamp) are spread over the
  batch's records with numpy, and Arrow checks that keys and attributes are UTF-8 (unless the
  walker saw only ASCII bytes, which are).

The result equals ``RecordColumns.from_records(decode_segment(data).records)`` (the reference
decoder, tested on random and corrupted segments). Whenever the fast path finds anything
wrong, or a value it leaves alone (a first timestamp within 2**32 µs of the int64 limit, a
record repeating an attribute name, whose later value wins in a ``Record``), the reference
decoder reads the segment instead: a bad segment is refused with its error. Version 1 segments, and every segment when the C extension was not built (no C
compiler at install time) or ``DANUBE_NO_EXTENSIONS`` is set, are read by the reference
decoder and converted.

This module needs the pipeline extra (pyarrow, numpy); the broker does not import it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any, overload

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from danube_pipeline.format import batches
from danube_pipeline.errors import MalformedRequestError
from danube_pipeline.format.records import (
    EPOCH_PREFIX_SIZE,
    LEGACY_FORMAT_VERSION,
    SEGMENT_HEADER_SIZE,
    Record,
    SegmentHeader,
)
from danube_pipeline.format.segments import DecodedSegment, decode_segment, has_epoch_prefix

__all__ = [
    "ATTRIBUTES_TYPE",
    "RecordColumns",
    "decode_segment_columns",
    "native_extension",
    "native_framing",
    "schema_keys",
]

ATTRIBUTES_TYPE = pa.map_(pa.large_string(), pa.large_string())
"""The Arrow type of :attr:`RecordColumns.attributes`."""

_PREFIX = struct.Struct("<QII")
_ENTRY = struct.Struct("<qqqq")
_INT64_END = 1 << 63
_MAX_FIRST_TIMESTAMP_US = _INT64_END - (1 << 32)  # first + a u32 delta stays an int64


def _load_native() -> ModuleType | None:
    if os.environ.get("DANUBE_NO_EXTENSIONS"):
        return None
    try:
        from danube_pipeline.lake import _framing  # type: ignore[attr-defined]  # noqa: PLC0415 - built optionally
    except ImportError:
        return None
    return _framing  # type: ignore[no-any-return]


_native = _load_native()


def native_extension() -> ModuleType | None:
    """The C extension ``danube_pipeline.lake._framing``, or ``None`` when it was not built or
    ``DANUBE_NO_EXTENSIONS`` is set."""
    return _native


def native_framing() -> bool:
    """Whether records are walked by the C extension (``danube_pipeline.lake._framing``)."""
    return _native is not None


class RecordColumns(Sequence[Record]):
    """Records as columns, one value per record in row order.

    A ``Sequence[Record]``: indexing builds the :class:`~danube_pipeline.format.records.Record` of one
    row, slicing and :meth:`take` give columns again without copying. Code that reads many
    records uses the columns directly.

    Attributes:
        offset: int64 offsets.
        publish_time_us: int64 publish times, µs since the Unix epoch.
        producer_id: uint64 producer ids (``docs/etcd-layout.md`` §3.3).
        producer_name: ``large_string``.
        schema_id: uint64 schema ids; 0 = no schema.
        schema_version: uint32 versions within the subject; 0 = no schema.
        key: ``large_string``, null where a record has no key.
        attributes: :data:`ATTRIBUTES_TYPE`, a map per record (empty when it has none).
        payload: ``large_binary``.
    """

    __slots__ = (
        "attributes",
        "key",
        "offset",
        "payload",
        "producer_id",
        "producer_name",
        "publish_time_us",
        "schema_id",
        "schema_version",
    )

    def __init__(
        self,
        *,
        offset: npt.NDArray[np.int64],
        publish_time_us: npt.NDArray[np.int64],
        producer_id: npt.NDArray[np.uint64],
        producer_name: pa.Array,
        schema_id: npt.NDArray[np.uint64],
        schema_version: npt.NDArray[np.uint32],
        key: pa.Array,
        attributes: pa.Array,
        payload: pa.Array,
    ) -> None:
        n = len(offset)
        columns = (publish_time_us, producer_id, producer_name, schema_id, schema_version, key, attributes, payload)
        if any(len(c) != n for c in columns):
            raise ValueError(f"columns of unequal lengths: {[n, *map(len, columns)]}")
        self.offset = offset
        self.publish_time_us = publish_time_us
        self.producer_id = producer_id
        self.producer_name = producer_name
        self.schema_id = schema_id
        self.schema_version = schema_version
        self.key = key
        self.attributes = attributes
        self.payload = payload

    @classmethod
    def from_records(cls, records: Sequence[Record]) -> RecordColumns:
        """The columns of ``records`` (any sequence; returned as is when already columns).

        Raises:
            OverflowError: an offset or publish time at or beyond 2**63 (the segment format's
                u64 allows it; Iceberg's ``long`` and ``timestamp`` do not).
        """
        if isinstance(records, RecordColumns):
            return records
        n = len(records)
        map_offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(np.fromiter((len(r.attributes) for r in records), dtype=np.int32, count=n), out=map_offsets[1:])
        return cls(
            offset=np.fromiter((r.offset for r in records), dtype=np.int64, count=n),
            publish_time_us=np.fromiter((r.publish_time_us for r in records), dtype=np.int64, count=n),
            producer_id=np.fromiter((r.producer_id for r in records), dtype=np.uint64, count=n),
            producer_name=pa.array([r.producer_name for r in records], type=pa.large_string()),
            schema_id=np.fromiter((r.schema_id for r in records), dtype=np.uint64, count=n),
            schema_version=np.fromiter((r.schema_version for r in records), dtype=np.uint32, count=n),
            key=pa.array([r.key for r in records], type=pa.large_string()),
            attributes=pa.MapArray.from_arrays(
                pa.array(map_offsets),
                pa.array([k for r in records for k in r.attributes], type=pa.large_string()),
                pa.array([v for r in records for v in r.attributes.values()], type=pa.large_string()),
                type=ATTRIBUTES_TYPE,
            ),
            payload=pa.array([r.payload for r in records], type=pa.large_binary()),
        )

    def __len__(self) -> int:
        return len(self.offset)

    @overload
    def __getitem__(self, index: int) -> Record: ...

    @overload
    def __getitem__(self, index: slice) -> RecordColumns: ...

    def __getitem__(self, index: int | slice) -> Record | RecordColumns:
        n = len(self.offset)
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                return self.take(np.arange(start, stop, step, dtype=np.int64))
            stop = max(start, stop)
            return RecordColumns(
                offset=self.offset[start:stop],
                publish_time_us=self.publish_time_us[start:stop],
                producer_id=self.producer_id[start:stop],
                producer_name=self.producer_name.slice(start, stop - start),
                schema_id=self.schema_id[start:stop],
                schema_version=self.schema_version[start:stop],
                key=self.key.slice(start, stop - start),
                attributes=self.attributes.slice(start, stop - start),
                payload=self.payload.slice(start, stop - start),
            )
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(f"record index {index} out of range for {n} records")
        return Record(
            offset=int(self.offset[i]),
            publish_time_us=int(self.publish_time_us[i]),
            producer_id=int(self.producer_id[i]),
            producer_name=self.producer_name[i].as_py(),
            schema_id=int(self.schema_id[i]),
            schema_version=int(self.schema_version[i]),
            payload=self.payload[i].as_py(),
            attributes=_as_dict(self.attributes[i].as_py()),
            key=self.key[i].as_py(),
        )

    def __iter__(self) -> Iterator[Record]:
        columns = zip(
            self.offset.tolist(),
            self.publish_time_us.tolist(),
            self.producer_id.tolist(),
            self.producer_name.to_pylist(),
            self.schema_id.tolist(),
            self.schema_version.tolist(),
            self.payload.to_pylist(),
            self.attributes.to_pylist(),
            self.key.to_pylist(),
            strict=True,
        )
        for offset, time_us, pid, name, sid, version, payload, attributes, key in columns:
            yield Record(offset, time_us, pid, name, sid, version, payload, _as_dict(attributes), key)

    def take(self, indices: npt.NDArray[np.int64] | Sequence[int]) -> RecordColumns:
        """The records at ``indices`` (positions, in the order given)."""
        at = np.asarray(indices, dtype=np.int64)
        taken = pa.array(at, type=pa.int64())
        return RecordColumns(
            offset=self.offset[at],
            publish_time_us=self.publish_time_us[at],
            producer_id=self.producer_id[at],
            producer_name=self.producer_name.take(taken),
            schema_id=self.schema_id[at],
            schema_version=self.schema_version[at],
            key=self.key.take(taken),
            attributes=self.attributes.take(taken),
            payload=self.payload.take(taken),
        )

    def schema_keys(self) -> list[tuple[int, int]]:
        """The distinct ``(schema_id, schema_version)`` pairs of the records, sorted (0 included)."""
        if not len(self.offset):
            return []
        ids, versions = self.schema_id, self.schema_version
        if (ids == ids[0]).all() and (versions == versions[0]).all():  # the usual case
            return [(int(ids[0]), int(versions[0]))]
        return [
            (int(sid), int(version))
            for sid in np.unique(ids)
            for version in np.unique(versions[ids == sid])
        ]

    def is_contiguous(self) -> bool:
        """Whether the offsets run one by one from the first."""
        n = len(self.offset)
        return n == 0 or bool(np.array_equal(self.offset, np.arange(self.offset[0], self.offset[0] + n)))


def _repeated(names: Sequence[str], counts: npt.NDArray[np.int64]) -> pa.Array:
    """``names[i]`` repeated ``counts[i]`` times, as one ``large_string`` array (the per-batch
    producer names spread over the batches' records)."""
    encoded = [name.encode() for name in names]
    lengths = np.repeat(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)), counts)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    data = b"".join(name * int(count) for name, count in zip(encoded, counts.tolist(), strict=True))
    return pa.Array.from_buffers(pa.large_string(), len(lengths), [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _as_dict(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    return dict(value)


def schema_keys(records: Sequence[Record]) -> list[tuple[int, int]]:
    """The distinct ``(schema_id, schema_version)`` pairs of ``records``, sorted (0 included)."""
    if isinstance(records, RecordColumns):
        return records.schema_keys()
    return sorted({(r.schema_id, r.schema_version) for r in records})


class _Refused(Exception):
    """The fast path found a problem: the reference decoder names it."""


def decode_segment_columns(
    data: bytes | memoryview, *, where: str = "segment", index_interval_records: int = 1000
) -> DecodedSegment[RecordColumns]:
    """Decode and verify a complete segment into columns (module docstring).

    Args:
        data: the segment or ``.dnb1`` object bytes.
        where: a name for error messages (file path or object id).
        index_interval_records: records between entries of the sparse offset index.

    Returns:
        A :class:`~danube_pipeline.format.segments.DecodedSegment` of columns, equal in content to
        :func:`~danube_pipeline.format.segments.decode_segment`'s result.

    Raises:
        CorruptRecordError: bad header, torn or corrupt batch or record, or a batch whose
            records break the framing (as :func:`~danube_pipeline.format.segments.decode_segment`).
        OffsetRangeError: offsets not contiguous from the header's start offset.
        OverflowError: an offset or publish time at or beyond 2**63.
    """
    header = SegmentHeader.decode(data, where=where)
    if header.format_version != LEGACY_FORMAT_VERSION and _native is not None:
        try:
            records, index = _walk(data, header, index_interval_records)
            return DecodedSegment(header, records, index, len(data))
        except _Refused:
            pass  # the reference decoder raises the error, or reads what the fast path leaves to it
    decoded = decode_segment(data, where=where, index_interval_records=index_interval_records)
    return DecodedSegment(header, RecordColumns.from_records(decoded.records), decoded.offset_index, len(data))


def _walk(
    data: bytes | memoryview, header: SegmentHeader, index_interval_records: int
) -> tuple[RecordColumns, list[list[int]]]:
    """The fast path; raises :class:`_Refused` on anything the reference decoder must name."""
    assert _native is not None
    view = memoryview(data)
    end = len(view)
    pos = SEGMENT_HEADER_SIZE
    skip = EPOCH_PREFIX_SIZE if has_epoch_prefix(header.format_version) else 0
    expected = next_index_at = header.start_offset
    index: list[list[int]] = []
    entries = bytearray()
    counts: list[int] = []
    first_ts: list[int] = []
    producer_ids: list[int] = []
    names: list[str] = []
    schema_ids: list[int] = []
    versions: list[int] = []
    while pos < end:
        entry, pos = pos, pos + skip  # the entry (its epoch in version 3), then the batch
        if end - pos < batches.BATCH_HEADER_SIZE:
            raise _Refused(f"torn batch header at byte {pos}")
        base, length, _crc = _PREFIX.unpack_from(view, pos)
        total = 12 + length
        if total < batches.BATCH_HEADER_SIZE or pos + total > end:
            raise _Refused(f"bad batch length {length} at byte {pos}")
        if not batches.crc_matches(view, pos, total):
            raise _Refused(f"CRC32C mismatch at byte {pos}")
        if base != expected:
            raise _Refused(f"base offset {base} at byte {pos}, expected {expected}")
        try:
            h = batches.parse_header(view[pos : pos + total])
        except MalformedRequestError as exc:
            raise _Refused(str(exc)) from None
        if h.length_bytes != total:
            raise _Refused(f"batch at byte {pos}: {h.length_bytes} bytes, {total} stored")
        if h.first_timestamp_us >= _MAX_FIRST_TIMESTAMP_US:
            raise _Refused(f"first timestamp {h.first_timestamp_us} at byte {pos}")
        if base >= next_index_at:
            index.append([base, entry])
            next_index_at = base + index_interval_records
        entries += _ENTRY.pack(pos, pos + h.records_start, pos + total, h.record_count)
        counts.append(h.record_count)
        first_ts.append(h.first_timestamp_us)
        producer_ids.append(h.producer_id)
        names.append(h.producer_name)
        schema_ids.append(h.schema_id)
        versions.append(h.schema_version)
        expected = base + h.record_count
        pos += total
    if expected > _INT64_END:
        raise _Refused(f"offsets up to {expected - 1} do not fit an int64")
    try:
        walked = _native.walk_records(view, bytes(entries))
    except (ValueError, OverflowError) as exc:
        raise _Refused(str(exc)) from None
    (unusual, n, deltas, validity, key_offsets, key_data, key_nulls, map_offsets, name_offsets, name_data,
     value_offsets, value_data, payload_offsets, payload_data, ascii) = walked
    if unusual:
        raise _Refused("a record repeats an attribute name, or has more than 64 attributes")
    m = (len(name_offsets) // 8) - 1
    buf = pa.py_buffer
    try:
        key = pa.Array.from_buffers(
            pa.large_string(), n, [buf(validity) if key_nulls else None, buf(key_offsets), buf(key_data)],
            null_count=key_nulls,
        )
        attribute_names = pa.Array.from_buffers(pa.large_string(), m, [None, buf(name_offsets), buf(name_data)])
        attribute_values = pa.Array.from_buffers(pa.large_string(), m, [None, buf(value_offsets), buf(value_data)])
        for strings in (key, attribute_names, attribute_values):
            strings.validate(full=not ascii)  # UTF-8, unless the walker saw only ASCII
        attributes = pa.MapArray.from_arrays(
            pa.Array.from_buffers(pa.int32(), n + 1, [None, buf(map_offsets)]),
            attribute_names,
            attribute_values,
            type=ATTRIBUTES_TYPE,
        )
        payload = pa.Array.from_buffers(pa.large_binary(), n, [None, buf(payload_offsets), buf(payload_data)])
    except (pa.ArrowInvalid, ValueError) as exc:
        raise _Refused(str(exc)) from None
    per_batch = np.asarray(counts, dtype=np.int64)
    return (
        RecordColumns(
            offset=np.arange(header.start_offset, header.start_offset + n, dtype=np.int64),
            publish_time_us=np.repeat(np.asarray(first_ts, dtype=np.uint64), per_batch).view(np.int64)
            + np.frombuffer(deltas, dtype="<u4"),
            producer_id=np.repeat(np.asarray(producer_ids, dtype=np.uint64), per_batch),
            producer_name=_repeated(names, per_batch),
            schema_id=np.repeat(np.asarray(schema_ids, dtype=np.uint64), per_batch),
            schema_version=np.repeat(np.asarray(versions, dtype=np.uint32), per_batch),
            key=key,
            attributes=attributes,
            payload=payload,
        ),
        index,
    )
