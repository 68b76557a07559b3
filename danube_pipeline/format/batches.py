"""The record batch: what a producer frames, the broker checks and appends unchanged, and a
consumer splits (segment format version 2; Kafka's ``RecordBatch`` v2 is the model).

A batch is one producer's records with contiguous offsets. The producer frames it with the base
offset left at 0; the broker checks it (:func:`validate_batch`), writes the 8-byte base offset
it assigns into the first field and appends the bytes as received. The CRC does not cover the
base offset, so assigning it never changes the checksum.

Batch (little endian)::

    offset  size  field
    0       8     base_offset u64         set by the broker; not covered by the CRC
    8       4     batch_length u32        bytes after this field
    12      4     crc32c u32              CRC32C (Castagnoli) of every byte after this field
    16      1     magic u8 = 2
    17      1     attributes u8           0 (reserved)
    18      2     producer_name_length u16
    20      4     record_count u32        >= 1; offsets base_offset .. base_offset + count - 1
    24      8     first_timestamp_us u64  publish time of the first record (µs since the epoch)
    32      8     producer_id u64
    40      8     base_sequence i64       the producer's sequence number of the first record; -1 = none
    48      8     schema_id u64           0 = no schema
    56      4     schema_version u32
    60      n     producer_name (UTF-8)
    60+n    ...   record_count records

Record::

    record_length u32        bytes after this field
    timestamp_delta_us u32   publish time - first_timestamp_us
    key_length i32           -1 = no key
    attribute_count u16
    key (UTF-8) | attribute_count x (key_length u16 | value_length u32 | key | value) | value

A record's offset is the batch's base offset plus its index; its payload (``value``) is what
remains of ``record_length`` after the key and attributes.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import crc32c as _crc32c

from danube_pipeline.errors import MalformedRequestError, MessageTooLargeError
from danube_pipeline.format.records import Record

__all__ = [
    "BATCH_HEADER_SIZE",
    "BatchBuilder",
    "BatchHeader",
    "MAGIC",
    "RECORD_OVERHEAD_BYTES",
    "batch_from_record",
    "batch_payloads",
    "batch_records",
    "iter_batch",
    "native_batch_builder",
    "parse_header",
    "set_base_offset",
    "validate_batch",
]

MAGIC = 2
_PREFIX = struct.Struct("<QII")  # base_offset, batch_length, crc32c
_FIXED = struct.Struct("<BBHIQQqQI")  # magic .. schema_version
_RECORD = struct.Struct("<IIiH")  # record_length, timestamp_delta_us, key_length, attribute_count
_ATTR = struct.Struct("<HI")
_BASE = struct.Struct("<Q")

BATCH_HEADER_SIZE = _PREFIX.size + _FIXED.size  # 60 bytes, producer name not included
"""Bytes of a batch before the producer name."""
RECORD_OVERHEAD_BYTES = _RECORD.size  # 14 bytes
"""Bytes a record adds to its key, attributes and payload."""
_RECORD_MIN_LENGTH = _RECORD.size - 4  # record_length counts the bytes after itself
_CRC_START = _PREFIX.size  # the CRC covers magic .. end
_MAX_U16 = 0xFFFF
_MAX_U32 = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class BatchHeader:
    """The fixed fields of a batch.

    Attributes:
        base_offset: the first record's offset (0 until the broker assigns it).
        length_bytes: the whole batch, header included.
        record_count: records in the batch (>= 1).
        first_timestamp_us: publish time of the first record, µs since the Unix epoch.
        producer_id: the u64 producer id (``docs/etcd-layout.md`` §3.3).
        base_sequence: the producer's sequence number of the first record; -1 = none.
        schema_id: global schema id; 0 = no schema.
        schema_version: version within the schema's subject; 0 = no schema.
        producer_name: the producer's name.
        records_start: byte position of the first record within the batch.
    """

    base_offset: int
    length_bytes: int
    record_count: int
    first_timestamp_us: int
    producer_id: int
    base_sequence: int
    schema_id: int
    schema_version: int
    producer_name: str
    records_start: int

    @property
    def last_offset(self) -> int:
        """The last record's offset."""
        return self.base_offset + self.record_count - 1


def _malformed(reason: str) -> MalformedRequestError:
    return MalformedRequestError(f"record batch: {reason}")


def parse_header(data: bytes | memoryview, position: int = 0) -> BatchHeader:
    """Read the header of the batch at ``position`` (no CRC check; see :func:`validate_batch`).

    Raises:
        MalformedRequestError: the header is short, its magic is not 2, its length does not
            fit the data, or the producer name is not UTF-8.
    """
    end = len(data)
    if end - position < BATCH_HEADER_SIZE:
        raise _malformed(f"{end - position} bytes, shorter than the {BATCH_HEADER_SIZE}-byte header")
    base, length, _crc = _PREFIX.unpack_from(data, position)
    magic, _attrs, name_len, count, first_ts, producer_id, base_seq, schema_id, schema_version = _FIXED.unpack_from(
        data, position + _PREFIX.size
    )
    if magic != MAGIC:
        raise _malformed(f"magic {magic}, expected {MAGIC}")
    total = 12 + length
    if total < BATCH_HEADER_SIZE + name_len or position + total > end:
        raise _malformed(f"batch_length {length} does not fit the {end - position} bytes received")
    if count < 1:
        raise _malformed("record_count is 0")
    start = position + BATCH_HEADER_SIZE
    try:
        name = bytes(data[start : start + name_len]).decode()
    except UnicodeDecodeError as exc:
        raise _malformed(f"producer name is not UTF-8: {exc}") from exc
    return BatchHeader(
        base_offset=base,
        length_bytes=total,
        record_count=count,
        first_timestamp_us=first_ts,
        producer_id=producer_id,
        base_sequence=base_seq,
        schema_id=schema_id,
        schema_version=schema_version,
        producer_name=name,
        records_start=BATCH_HEADER_SIZE + name_len,
    )


def crc_matches(data: bytes | memoryview, position: int, length_bytes: int) -> bool:
    """Whether the batch at ``position`` (``length_bytes`` long) carries the CRC32C of its bytes."""
    crc: int = _PREFIX.unpack_from(data, position)[2]
    view = memoryview(data)[position + _CRC_START : position + length_bytes]
    computed: int = _crc32c.crc32c(view)
    return computed == crc


def validate_batch(
    data: bytes | memoryview, *, max_message_size_bytes: int = 0, max_batch_bytes: int = 0
) -> BatchHeader:
    """Check a batch from a producer completely before anything is written.

    Checks the header, the CRC32C, and every record's framing: lengths inside the batch,
    ``record_count`` records ending exactly at the batch's end, keys and attribute names and
    values in UTF-8, and each payload against ``max_message_size_bytes``. No record object is
    built: the records are walked in place.

    Args:
        data: exactly one batch.
        max_message_size_bytes: largest payload allowed, in bytes; 0 = no limit.
        max_batch_bytes: largest batch allowed, in bytes; 0 = no limit.

    Returns:
        The batch's header.

    Raises:
        MalformedRequestError: the batch is truncated, oversized, has trailing bytes, a bad
            CRC, a record that breaks the framing, or text that is not UTF-8.
        MessageTooLargeError: a payload exceeds ``max_message_size_bytes``.
    """
    if max_batch_bytes and len(data) > max_batch_bytes:
        raise _malformed(f"{len(data)} bytes exceeds the broker's max_batch_bytes of {max_batch_bytes}")
    header = parse_header(data)
    if header.length_bytes != len(data):
        raise _malformed(f"batch_length says {header.length_bytes} bytes, {len(data)} were sent")
    if not crc_matches(data, 0, header.length_bytes):
        raise _malformed("CRC32C mismatch")
    view = memoryview(data)
    pos = header.records_start
    end = header.length_bytes
    for i in range(header.record_count):
        if end - pos < _RECORD.size:
            raise _malformed(f"record {i} truncated at byte {pos}")
        length, _delta, key_len, attr_count = _RECORD.unpack_from(view, pos)
        record_end = pos + 4 + length
        if length < _RECORD_MIN_LENGTH or record_end > end:
            raise _malformed(f"record {i} at byte {pos}: length {length} runs past the batch")
        field = pos + _RECORD.size
        if key_len >= 0:
            if field + key_len > record_end:
                raise _malformed(f"record {i}: key of {key_len} bytes runs past the record")
            _utf8(view[field : field + key_len], f"record {i} key")
            field += key_len
        elif key_len != -1:
            raise _malformed(f"record {i}: key_length {key_len}")
        for a in range(attr_count):
            if field + _ATTR.size > record_end:
                raise _malformed(f"record {i}: attribute {a} truncated")
            klen, vlen = _ATTR.unpack_from(view, field)
            field += _ATTR.size
            if field + klen + vlen > record_end:
                raise _malformed(f"record {i}: attribute {a} runs past the record")
            _utf8(view[field : field + klen], f"record {i} attribute name")
            _utf8(view[field + klen : field + klen + vlen], f"record {i} attribute value")
            field += klen + vlen
        payload_size = record_end - field
        if max_message_size_bytes and payload_size > max_message_size_bytes:
            raise MessageTooLargeError(payload_size, max_message_size_bytes)
        pos = record_end
    if pos != end:
        raise _malformed(f"{end - pos} bytes after the last of {header.record_count} records")
    return header


def _utf8(view: memoryview, what: str) -> None:
    try:
        bytes(view).decode()
    except UnicodeDecodeError as exc:
        raise _malformed(f"{what} is not UTF-8: {exc}") from exc


def set_base_offset(data: bytes, base_offset: int) -> tuple[bytes, memoryview]:
    """The two pieces to write for ``data`` stored at ``base_offset``: the 8-byte base offset
    and the rest of the batch, unchanged (the CRC does not cover the base offset)."""
    return _BASE.pack(base_offset), memoryview(data)[8:]


# --------------------------------------------------------------------------- reading


def batch_payloads(data: bytes | memoryview, header: BatchHeader) -> Iterator[memoryview]:
    """The payload of every record of a checked batch, in order, without copying."""
    view = memoryview(data)
    pos = header.records_start
    for _ in range(header.record_count):
        length, _delta, key_len, attr_count = _RECORD.unpack_from(view, pos)
        record_end = pos + 4 + length
        field = pos + _RECORD.size + max(key_len, 0)
        for _ in range(attr_count):
            klen, vlen = _ATTR.unpack_from(view, field)
            field += _ATTR.size + klen + vlen
        yield view[field:record_end]
        pos = record_end


RecordFields = tuple[int, int, "str | None", dict[str, str], bytes]
"""``(offset, publish_time_us, key, attributes, payload)`` of one record."""


def iter_batch(data: bytes | memoryview, position: int = 0) -> tuple[BatchHeader, Iterator[RecordFields]]:
    """The header of the batch at ``position`` and an iterator over its records' fields.

    The caller checked the batch (CRC and framing) before.

    Raises:
        MalformedRequestError: the header does not parse.
    """
    header = parse_header(data, position)
    return header, _records(memoryview(data), position + header.records_start, header)


def _records(view: memoryview, pos: int, header: BatchHeader) -> Iterator[RecordFields]:
    base, first_ts = header.base_offset, header.first_timestamp_us
    for i in range(header.record_count):
        length, delta, key_len, attr_count = _RECORD.unpack_from(view, pos)
        record_end = pos + 4 + length
        field = pos + _RECORD.size
        key: str | None = None
        if key_len >= 0:
            key = bytes(view[field : field + key_len]).decode()
            field += key_len
        attributes: dict[str, str] = {}
        for _ in range(attr_count):
            klen, vlen = _ATTR.unpack_from(view, field)
            field += _ATTR.size
            name = bytes(view[field : field + klen]).decode()
            attributes[name] = bytes(view[field + klen : field + klen + vlen]).decode()
            field += klen + vlen
        yield base + i, first_ts + delta, key, attributes, bytes(view[field:record_end])
        pos = record_end


def batch_records(data: bytes | memoryview, position: int = 0) -> Iterator[Record]:
    """Every record of the batch at ``position``, with offsets from its base offset.

    The caller checked the batch (CRC and framing) before.

    Raises:
        MalformedRequestError: the header does not parse.
    """
    header, records = iter_batch(data, position)
    for offset, publish_time_us, key, attributes, payload in records:
        yield Record(
            offset=offset,
            publish_time_us=publish_time_us,
            producer_id=header.producer_id,
            producer_name=header.producer_name,
            schema_id=header.schema_id,
            schema_version=header.schema_version,
            payload=payload,
            attributes=attributes,
            key=key,
        )


# --------------------------------------------------------------------------- writing


def _encode_text(text: str, what: str) -> bytes:
    """``text`` in UTF-8.

    Raises:
        MalformedRequestError: ``text`` holds a lone surrogate, which UTF-8 cannot carry.
    """
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        raise _malformed(f"{what} is not encodable as UTF-8: {exc}") from exc


def _encode_attributes(attributes: Mapping[str, str]) -> bytes:
    if len(attributes) > _MAX_U16:
        raise _malformed(f"{len(attributes)} attributes, at most {_MAX_U16}")
    parts = []
    for name, value in attributes.items():
        k = _encode_text(name, "an attribute name")
        v = _encode_text(value, "an attribute value")
        if len(k) > _MAX_U16:
            raise _malformed(f"attribute name of {len(k)} bytes, at most {_MAX_U16}")
        if len(v) > _MAX_U32:
            raise _malformed(f"attribute value of {len(v)} bytes, at most {_MAX_U32}")
        parts.append(_ATTR.pack(len(k), len(v)))
        parts.append(k)
        parts.append(v)
    return b"".join(parts)


Payload = bytes | bytearray | memoryview
"""A message's bytes, as :meth:`BatchBuilder.append_payload` takes them."""


def _frame_payloads_python(records: bytearray, payloads: Sequence[Payload], delta_us: int) -> int:
    """Append one record with no key and no attributes per payload, all at ``delta_us``: the
    pure-Python twin of ``_batch_builder.frame_payloads`` (same bytes, same errors).

    Returns:
        The bytes added.

    Raises:
        OverflowError: a record would be over 4 GiB; ``records`` is unchanged (every payload
            is checked before any is written).
    """
    views = [memoryview(payload) for payload in payloads]  # TypeError for a non-buffer
    for index, view in enumerate(views):
        if _RECORD_MIN_LENGTH + view.nbytes > _MAX_U32:
            length = _RECORD_MIN_LENGTH + view.nbytes
            raise OverflowError(f"payload {index}: a record of {length} bytes, at most {_MAX_U32}")
    start = len(records)
    pack = _RECORD.pack
    for view in views:
        records += pack(_RECORD_MIN_LENGTH + view.nbytes, delta_us, -1, 0)
        records += view
    return len(records) - start


def _load_native() -> tuple[Callable[[bytearray, Payload, int], int], Callable[[bytearray, Sequence[Payload], int], int]] | None:
    """The C framing functions (``danube_pipeline/format/_batch_builder.c``), or None when the
    extension was not built (no C compiler at install) or ``DANUBE_NO_EXTENSIONS`` is set."""
    if os.environ.get("DANUBE_NO_EXTENSIONS"):
        return None
    try:
        from danube_pipeline.format import _batch_builder  # type: ignore[attr-defined]  # noqa: PLC0415 - built optionally
    except ImportError:
        return None
    return _batch_builder.frame_payload, _batch_builder.frame_payloads


_native = _load_native()
_frame_payload, _frame_payloads = _native or (
    lambda records, payload, delta_us: _frame_payloads_python(records, (payload,), delta_us),
    _frame_payloads_python,
)


def native_batch_builder() -> bool:
    """Whether records without key and attributes are framed by the C extension
    (``danube_pipeline.format._batch_builder``) rather than in pure Python."""
    return _native is not None


class BatchBuilder:
    """Frames records into one batch (the producer side).

    Append records with :meth:`append`, then :meth:`build` the batch for a producer. The
    records' bytes are kept, so a batch can be built again for another producer id (after the
    producer re-registers on a new broker) without framing the records again.

    Args:
        first_timestamp_us: publish time of the first record, µs since the Unix epoch.
    """

    __slots__ = ("_records", "first_timestamp_us", "record_count")

    def __init__(self, first_timestamp_us: int) -> None:
        self._records = bytearray()
        self.first_timestamp_us = first_timestamp_us
        self.record_count = 0

    @classmethod
    def of_framed(cls, first_timestamp_us: int, records: bytes | bytearray | memoryview, record_count: int) -> BatchBuilder:
        """A builder holding ``record_count`` records already framed in this format (each
        ``record_length | timestamp_delta_us | key_length | attribute_count | ...`` as
        :meth:`append` writes them, deltas from ``first_timestamp_us``), e.g. by a columnar
        encoder. The bytes are copied, not checked: :func:`validate_batch` checks a built batch.

        Args:
            first_timestamp_us: publish time of the first record, µs since the Unix epoch.
            records: the framed records.
            record_count: how many records ``records`` holds.

        Returns:
            The builder, ready to :meth:`build`.
        """
        builder = cls(first_timestamp_us)
        builder._records = bytearray(records)
        builder.record_count = record_count
        return builder

    @property
    def size_bytes(self) -> int:
        """Bytes of the records framed so far."""
        return len(self._records)

    def append_payload(self, payload: Payload, timestamp_us: int) -> int:
        """Frame a record with no key and no attributes (the common case, kept short; framed in
        C when the extension is built, see :func:`native_batch_builder`).

        A timestamp before the batch's first (the wall clock stepped back) is stored as the
        first's.

        Returns:
            :attr:`size_bytes` after the record (the caller's batch limit check needs no
            second call).

        Raises:
            MalformedRequestError: the payload is over 4 GiB, or the timestamp is more than
                4295 s after the batch's first; the builder is unchanged then.
        """
        try:
            _frame_payload(self._records, payload, self._delta(timestamp_us))
        except OverflowError as exc:
            raise _malformed(f"{exc}: does not fit the format") from exc
        self.record_count += 1
        return len(self._records)

    def append_payloads(self, payloads: Sequence[Payload], timestamp_us: int) -> None:
        """Frame one record with no key and no attributes per payload, all with the publish
        time ``timestamp_us``, in one call (in C when the extension is built).

        A timestamp before the batch's first is stored as the first's.

        Raises:
            MalformedRequestError: a payload is over 4 GiB, or the timestamp is more than
                4295 s after the batch's first; the builder is unchanged then.
        """
        try:
            _frame_payloads(self._records, payloads, self._delta(timestamp_us))
        except OverflowError as exc:
            raise _malformed(f"{exc}: does not fit the format") from exc
        self.record_count += len(payloads)

    def _delta(self, timestamp_us: int) -> int:
        """``timestamp_delta_us`` of a record at ``timestamp_us``: 0 for a time before the
        batch's first (the wall clock stepped back).

        Raises:
            MalformedRequestError: ``timestamp_us`` is more than 4295 s after the first.
        """
        delta = timestamp_us - self.first_timestamp_us
        if delta > _MAX_U32:
            raise _malformed(f"timestamp delta {delta} µs does not fit the format")
        return max(delta, 0)

    def append(
        self,
        payload: bytes,
        *,
        timestamp_us: int,
        key: str | None = None,
        attributes: Mapping[str, str] | None = None,
    ) -> int:
        """Frame one record.

        Args:
            payload: the message bytes.
            timestamp_us: its publish time, µs since the epoch, not before the first record's.
            key: its routing key, or ``None``.
            attributes: user key/value pairs.

        Returns:
            The bytes the record added.

        Raises:
            MalformedRequestError: an attribute or the record breaks a limit of the format
                (more than 65,535 attributes, an attribute name over 65,535 bytes, a record
                over 4 GiB, a timestamp before the batch's first), or the key or an attribute
                is not encodable as UTF-8 (a lone surrogate); the builder is unchanged then.
        """
        delta = timestamp_us - self.first_timestamp_us
        if not 0 <= delta <= _MAX_U32:
            raise _malformed(f"timestamp {timestamp_us} is not within 4295 s after the batch's first")
        attrs = _encode_attributes(attributes) if attributes else b""
        key_bytes = _encode_text(key, "the key") if key is not None else b""
        length = _RECORD_MIN_LENGTH + len(key_bytes) + len(attrs) + len(payload)
        if length > _MAX_U32:
            raise _malformed(f"record of {length} bytes, at most {_MAX_U32}")
        buf = self._records
        buf += _RECORD.pack(length, delta, -1 if key is None else len(key_bytes), len(attributes) if attributes else 0)
        if key_bytes:
            buf += key_bytes
        if attrs:
            buf += attrs
        buf += payload
        self.record_count += 1
        return 4 + length

    def build(
        self,
        *,
        producer_id: int,
        producer_name: str,
        schema_id: int = 0,
        schema_version: int = 0,
        base_sequence: int = -1,
    ) -> bytes:
        """The batch, base offset 0, CRC computed.

        Raises:
            MalformedRequestError: no record was appended, or the producer name is over 65,535
                bytes or not encodable as UTF-8 (a lone surrogate).
        """
        if not self.record_count:
            raise _malformed("a batch holds at least one record")
        name = _encode_text(producer_name, "the producer name")
        if len(name) > _MAX_U16:
            raise _malformed(f"producer name of {len(name)} bytes, at most {_MAX_U16}")
        fixed = _FIXED.pack(
            MAGIC, 0, len(name), self.record_count, self.first_timestamp_us, producer_id,
            base_sequence, schema_id, schema_version,
        ) + name
        crc = _crc32c.crc32c(self._records, _crc32c.crc32c(fixed))
        return _PREFIX.pack(0, 4 + len(fixed) + len(self._records), crc) + fixed + self._records


def batch_from_record(record: Record) -> bytes:
    """A one-record batch holding ``record`` at its offset (to serve segments written in the
    per-record format version 1 through the batch read path)."""
    builder = BatchBuilder(record.publish_time_us)
    builder.append(record.payload, timestamp_us=record.publish_time_us, key=record.key, attributes=record.attributes)
    data = builder.build(
        producer_id=record.producer_id,
        producer_name=record.producer_name,
        schema_id=record.schema_id,
        schema_version=record.schema_version,
    )
    return _BASE.pack(record.offset) + data[8:]
