"""Avro payloads decoded a batch at a time, into Arrow columns, in C (or by polars).

Decoding one payload at a time (``fastavro.schemaless_reader`` into a dict, then pyarrow from
Python lists) costs microseconds per record. Here the schemaless payloads of a run of records
with the same writer schema are decoded together into columns. A record schema's binary
encoding is the concatenation of its fields' encodings (Avro spec, "Binary Encoding"), so the
fields of a flat record are read one after the other, datum by datum.

**In C** (``decode_avro`` in ``danube_pipeline/lake/_framing.c``, when the extension is built):
each datum is decoded within its own bytes (the record framing gives each payload's offsets),
straight into the Arrow buffers of the columns; the guards below are checked as it goes, and a
batch that fails any is refused whole. About 0.1 µs per flight: tiering's decode of the flights
takes a sixth of the time it took with polars (``benchmarks/README.md``, ``tiering.py``).

**By polars** (the extension not built): the datums are wrapped into an in-memory Avro Object
Container File (Avro spec, "Object Container Files": the header with the schema, then one block
holding the record count, the byte size, the concatenated datums and the sync marker) and
decoded by polars' native (Rust) reader. The file's schema is a *wrapper* of the writer
schema, with the same binary encoding: every ``int`` (and ``date``) is read as ``long`` (both
are zig-zag varints), so that a value beyond 32 bits is seen rather than wrapped; timestamps
are read as plain ``long`` and converted here. That reader does not check that a block's
datums fill the block exactly, so the guards 1 to 3 below are computed afterwards with numpy.

**Guards.** The result must equal the per-record path (:func:`~.writer.avro_writer`) row for
row, or the batch is refused (:meth:`AvroBatchDecoder.decode` returns ``None``) and the caller
decodes it record by record, which sets the bad records aside with their reasons. A payload
with bytes left over after its datum (or one cut short) must not shift the datums after it.
The C decoder stops each datum at its payload's end and requires it to end exactly there; for
polars' reader the guard uses the record framing, which knows each payload's length ``L[i]``:

1. For every row, the *canonical* encoded length of the decoded values ``c[i]`` (varint sizes
   of the zig-zag values and string lengths, 4 or 8 bytes per float or double, 1 byte per
   boolean and per union branch index) is computed with numpy and must equal ``L[i]``.
2. A datum's bytes consumed are never fewer than the canonical length of what was decoded
   from them, and the reader decodes only within the block, whose size is ``sum(L)``. So
   ``consumed[i] >= c[i] = L[i]`` and ``sum(consumed) <= sum(L)`` force
   ``consumed[i] == L[i]`` for every row: each datum started where its payload starts and
   ended where it ends. A leftover byte, a truncation or a non-canonical (over-long) varint
   all fail check 1.
3. With every field's position so known, the union branch index and boolean bytes are read
   back from the payloads and must be the canonical ones (``0``/``2`` for branches 0/1,
   ``0``/``1`` for booleans): the native reader takes any non-null index as the value branch
   and only ``1`` as true, where the per-record path refuses an out-of-range branch and takes
   any non-zero byte as true.
4. Values must be what the per-record path accepts: ``int`` within 32 bits, ``long`` within
   ``[-2**62, 2**62)`` (a 10-byte varint is left to the per-record path, which reads it the
   way it always did), timestamps and dates within ``datetime``'s years 1 to 9999.
5. Strings are UTF-8 checked (an error refuses the batch): by polars' reader, or by Arrow after
   the C decoder (skipped when the decoder saw only ASCII bytes).

The C decoder checks 3 and 4 as it reads each value, and refuses any varint that is not
canonical or is longer than 9 bytes (a ``long`` beyond ``[-2**62, 2**62)``), which is what
check 1 refuses in polars' path.

Only the types below take this path; a writer schema with any other (named types, records,
arrays, maps, enums, fixed, decimals, multi-branch unions, other logical types) is decoded
record by record: ``null``-unions of one branch, ``int``, ``long``, ``float``, ``double``,
``boolean``, ``string``, ``bytes``, ``timestamp-millis``/``-micros``,
``local-timestamp-millis``/``-micros`` (on ``long``) and ``date`` (on ``int``).
"""

from __future__ import annotations

import datetime as _dt
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from danube_pipeline.lake.iceberg.schema import VALUE_COLUMN, as_avro_dict
from danube_pipeline.lake.segment_columns import native_extension

_native_decode = getattr(native_extension(), "decode_avro", None)

__all__ = ["AvroBatchDecoder", "batch_decoder"]

_MAGIC = b"Obj\x01"
_SYNC = b"danube-avro-sync"  # any 16 bytes: the reader finds blocks by their sizes
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)
# fastavro builds `epoch + timedelta(microseconds=...)`: a datetime, years 1 to 9999.
_MIN_US = (_dt.datetime(1, 1, 1, tzinfo=_dt.UTC) - _EPOCH) // _dt.timedelta(microseconds=1)
_MAX_US = (_dt.datetime.max.replace(tzinfo=_dt.UTC) - _EPOCH) // _dt.timedelta(microseconds=1)
# fastavro's `date.fromordinal(days + 719163)`: ordinals 1 to 3,652,059.
_MIN_DAYS = 1 - 719163
_MAX_DAYS = _dt.date.max.toordinal() - 719163
_INT32 = (-(1 << 31), (1 << 31) - 1)
_LONG_SAFE = (-(1 << 62), (1 << 62) - 1)  # zig-zag values below 2**63: at most 9 varint bytes

_FIXED_SIZE = {"float": 4, "double": 8, "boolean": 1}
_ARROW = {
    "int": pa.int32(),
    "long": pa.int64(),
    "float": pa.float32(),
    "double": pa.float64(),
    "boolean": pa.bool_(),
    "string": pa.large_string(),
    "bytes": pa.large_binary(),
    "timestamp-millis": pa.timestamp("us", tz="UTC"),
    "timestamp-micros": pa.timestamp("us", tz="UTC"),
    "local-timestamp-millis": pa.timestamp("us"),
    "local-timestamp-micros": pa.timestamp("us"),
    "date": pa.date32(),
}
_LOGICAL_BASE = {
    "timestamp-millis": "long",
    "timestamp-micros": "long",
    "local-timestamp-millis": "long",
    "local-timestamp-micros": "long",
    "date": "int",
}
# The C decoder's program: one byte per field, the kind's code | _NULLABLE | _NULL_SECOND
# (``decode_avro`` in danube_pipeline/lake/_framing.c).
_KIND_CODE = {
    "int": 1,
    "long": 2,
    "float": 3,
    "double": 4,
    "boolean": 5,
    "string": 6,
    "bytes": 7,
    "timestamp-millis": 8,
    "local-timestamp-millis": 8,
    "timestamp-micros": 9,
    "local-timestamp-micros": 9,
    "date": 10,
}
_NULLABLE = 0x10
_NULL_SECOND = 0x20  # "null" is the union's second branch
# What the wrapper schema declares for each kind (same binary encoding).
_DECLARED = {**{k: k for k in ("long", "float", "double", "boolean", "string", "bytes")}, "int": "long"}


@dataclass(frozen=True, slots=True)
class _Field:
    """One top-level field: its column name, kind (a key of ``_ARROW``) and union layout."""

    column: str
    kind: str
    nullable: bool
    value_branch: int = 0
    null_branch: int = 0


def _kind(avro: Any) -> str | None:
    """The kind of a non-union Avro type, or ``None`` when the batch path does not take it."""
    if isinstance(avro, str):
        return avro if avro in _DECLARED else None
    if isinstance(avro, dict):
        base = avro.get("type")
        logical = avro.get("logicalType")
        if logical is None:
            return base if isinstance(base, str) and base in _DECLARED else None
        if isinstance(logical, str) and _LOGICAL_BASE.get(logical) == base:
            return logical
    return None


def _field(column: str, avro: Any) -> _Field | None:
    if isinstance(avro, list):
        if len(avro) != 2:
            return None
        nulls = [i for i, b in enumerate(avro) if b == "null" or (isinstance(b, dict) and b.get("type") == "null")]
        if len(nulls) != 1:
            return None
        value_branch = 1 - nulls[0]
        kind = _kind(avro[value_branch])
        return None if kind is None else _Field(column, kind, True, value_branch, nulls[0])
    kind = _kind(avro)
    return None if kind is None else _Field(column, kind, False)


def _declared(f: _Field) -> Any:
    base = _DECLARED[_LOGICAL_BASE.get(f.kind, f.kind)]
    if not f.nullable:
        return base
    return ["null", base] if f.null_branch == 0 else [base, "null"]


def _varint(value: int) -> bytes:
    """Avro ``long`` encoding of ``value`` (zig-zag, then base-128 varint)."""
    z = (value << 1) ^ (value >> 63)
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _varint_sizes(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
    """Bytes of the base-128 varint of each (already zig-zagged) value."""
    sizes = np.ones(z.shape, dtype=np.int64)
    top = int(z.max()) if z.size else 0
    for bits in range(7, 64, 7):
        if top < 1 << bits:  # no value has this many bits: neither has any larger threshold
            break
        sizes += z >= np.uint64(1 << bits)
    return sizes


def _zigzag(v: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    return ((v << 1) ^ (v >> 63)).astype(np.uint64)


def _ints(array: pa.Array) -> npt.NDArray[np.int64]:
    """An integer array's values as int64, without a copy for an ``int64`` array. A null slot
    holds an arbitrary value: callers mask them with the validity."""
    if array.type != pa.int64():
        array = array.cast(pa.int64())
    values = array.buffers()[1]
    if values is None:
        return np.zeros(len(array), dtype=np.int64)
    return np.frombuffer(values, dtype=np.int64, count=len(array), offset=array.offset * 8)


class AvroBatchDecoder:
    """Decodes runs of schemaless payloads of one Avro writer schema into Arrow columns.

    Made by :func:`batch_decoder`; see the module docstring for the method and its guards.
    """

    def __init__(self, fields: Sequence[_Field], *, native: bool = True) -> None:
        self.fields = tuple(fields)
        self.native = native and _native_decode is not None
        self._program = bytes(
            _KIND_CODE[f.kind] | (_NULLABLE if f.nullable else 0) | (_NULL_SECOND if f.nullable and f.null_branch else 0)
            for f in self.fields
        )
        wrapper = {
            "type": "record",
            "name": "DanubeBatch",
            "fields": [{"name": f"f{i}", "type": _declared(f)} for i, f in enumerate(self.fields)],
        }
        meta = {b"avro.schema": json.dumps(wrapper).encode(), b"avro.codec": b"null"}
        entries = b"".join(_varint(len(k)) + k + _varint(len(v)) + v for k, v in meta.items())
        self._header = _MAGIC + _varint(len(meta)) + entries + _varint(0) + _SYNC

    @property
    def columns(self) -> tuple[str, ...]:
        """The column names, in field order."""
        return tuple(f.column for f in self.fields)

    def decode(self, payloads: Sequence[bytes]) -> dict[str, pa.Array] | None:
        """Decode ``payloads`` (each one schemaless datum of the writer schema).

        Args:
            payloads: the payloads of a run of records, in order; at least one.

        Returns:
            ``{column: array}`` of ``len(payloads)`` values each, typed as the per-record path
            types them (``int`` as ``int32``, ``string`` as ``large_string``, timestamps as
            ``timestamp[us]``...), or ``None`` when the batch must be decoded record by record
            (a payload that does not decode, does not fill its bytes exactly, or holds a value
            the guards leave to the per-record path; module docstring).
        """
        n = len(payloads)
        if n == 0:
            return None
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, payloads), dtype=np.int64, count=n), out=offsets[1:])
        return self._decode(b"".join(payloads), offsets)

    def decode_array(self, payloads: pa.Array) -> dict[str, pa.Array] | None:
        """:meth:`decode` for payloads held in an Arrow ``binary`` or ``large_binary`` array
        (:attr:`~danube_pipeline.lake.segment_columns.RecordColumns.payload`): its data buffer is the
        block's body as is, and its offsets give the lengths, with no Python object per payload.

        Raises:
            TypeError: ``payloads`` is not a binary array.
        """
        n = len(payloads)
        if n == 0:
            return None
        if payloads.type == pa.binary():
            payloads = payloads.cast(pa.large_binary())
        if payloads.type != pa.large_binary():
            raise TypeError(f"payloads of type {payloads.type}, expected large_binary")
        if payloads.null_count:
            return None
        offsets_buffer, data_buffer = payloads.buffers()[1:3]
        offsets = np.frombuffer(offsets_buffer, dtype=np.int64)[payloads.offset : payloads.offset + n + 1]
        return self._decode(data_buffer if data_buffer is not None else b"", offsets)

    def _decode(self, data: bytes | pa.Buffer, offsets: npt.NDArray[np.int64]) -> dict[str, pa.Array] | None:
        """Datum ``i`` is ``data[offsets[i]:offsets[i + 1]]``: decoded in C when the extension is
        built, else by polars."""
        if self.native:
            return self._decode_native(data, offsets)
        start, end = int(offsets[0]), int(offsets[-1])
        return self._decode_polars(memoryview(data)[start:end], np.diff(offsets))

    def _decode_native(self, data: bytes | pa.Buffer, offsets: npt.NDArray[np.int64]) -> dict[str, pa.Array] | None:
        """The C decoder (``decode_avro`` in ``danube_pipeline/lake/_framing.c``): the guards of
        the module docstring are checked datum by datum as it decodes, UTF-8 by Arrow here
        (unless the decoder saw only ASCII)."""
        assert _native_decode is not None
        decoded = _native_decode(data, offsets, self._program)
        if decoded is None:
            return None
        n = len(offsets) - 1
        out: dict[str, pa.Array] = {}
        for f, (null_count, validity, values, strings, ascii) in zip(self.fields, decoded, strict=True):
            buffers = [pa.py_buffer(validity) if null_count else None, pa.py_buffer(values)]
            if strings is not None:
                buffers.append(pa.py_buffer(strings))
            array = pa.Array.from_buffers(_ARROW[f.kind], n, buffers, null_count=null_count)
            if f.kind == "string" and not ascii:
                try:
                    array.validate(full=True)
                except pa.ArrowInvalid:
                    return None
            out[f.column] = array
        return out

    def _decode_polars(self, body: bytes | memoryview, lengths: npt.NDArray[np.int64]) -> dict[str, pa.Array] | None:
        """The reference batch decoder when the C extension is not built: polars' Avro reader on
        an Object Container File of the datums, then the guards with numpy."""
        import polars as pl  # noqa: PLC0415 - a heavy import, needed only here

        n = len(lengths)
        data = b"".join((self._header, _varint(n), _varint(len(body)), body, _SYNC))
        try:
            frame = pl.read_avro(io.BytesIO(data))
        except Exception:  # noqa: BLE001 - any failure: decode record by record instead
            return None
        except pl.exceptions.PanicException:
            return None
        if frame.height != n or frame.width != len(self.fields):
            return None
        table = frame.to_arrow()
        raw = np.frombuffer(body, dtype=np.uint8)
        position = np.cumsum(lengths) - lengths  # where each row's field starts, field by field
        out: dict[str, pa.Array] = {}
        for i, f in enumerate(self.fields):
            column = table.column(i)
            array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
            valid = np.ones(n, dtype=bool) if not f.nullable else np.asarray(
                array.is_valid().to_numpy(zero_copy_only=False), dtype=bool
            )
            if not f.nullable and array.null_count:
                return None
            if f.nullable:
                expected = np.where(valid, 2 * f.value_branch, 2 * f.null_branch).astype(np.uint8)
                if not np.array_equal(raw[position], expected):
                    return None
                position = position + 1
            size, converted = self._value(f, array, raw, position, valid)
            if converted is None:
                return None
            position = position + np.where(valid, size, 0)
            out[f.column] = converted
        if not np.array_equal(position, np.cumsum(lengths)):
            return None
        return out

    def _value(
        self,
        f: _Field,
        array: pa.Array,
        raw: npt.NDArray[np.uint8],
        position: npt.NDArray[np.int64],
        valid: npt.NDArray[np.bool_],
    ) -> tuple[npt.NDArray[np.int64], pa.Array | None]:
        """The canonical encoded size of each value, and the array as the column takes it
        (``None``: leave the batch to the per-record path)."""
        kind = f.kind
        if kind in ("float", "double"):
            return np.full(len(array), _FIXED_SIZE[kind], dtype=np.int64), array
        if kind == "boolean":
            at = position[valid]
            if at.size and raw[at].max(initial=0) > 1:
                return np.ones(0, dtype=np.int64), None
            return np.ones(len(array), dtype=np.int64), array
        if kind in ("string", "bytes"):
            n_bytes = _ints(pc.binary_length(array))
            sizes = _varint_sizes(_zigzag(n_bytes)) + n_bytes
            target = _ARROW[kind]
            return sizes, array if array.type == target else array.cast(target)
        values = _ints(array)
        sizes = _varint_sizes(_zigzag(values))
        live = values[valid]
        low, high = _INT32 if _LOGICAL_BASE.get(kind, kind) == "int" else _LONG_SAFE
        if live.size and (live.min() < low or live.max() > high):
            return sizes, None
        if kind == "int":  # within 32 bits, checked above: the unchecked cast is exact
            return sizes, pc.cast(array, pa.int32(), safe=False)
        if kind == "long":
            return sizes, array
        if kind == "date":
            if live.size and (live.min() < _MIN_DAYS or live.max() > _MAX_DAYS):
                return sizes, None
            return sizes, pc.cast(array, pa.int32(), safe=False).view(pa.date32())
        scale = 1000 if kind.endswith("millis") else 1
        if live.size and (live.min() < _MIN_US // scale or live.max() > _MAX_US // scale):
            return sizes, None
        micros = pc.multiply(array, scale) if scale != 1 else array
        return sizes, micros.view(pa.timestamp("us")).cast(_ARROW[kind])


def batch_decoder(avro_schema: Mapping[str, Any] | str, *, native: bool = True) -> AvroBatchDecoder | None:
    """The batch decoder of a writer's Avro schema, or ``None`` when it has a type the batch
    path does not take (module docstring), or neither the C extension nor polars is there.

    Args:
        avro_schema: the writer's schema: parsed JSON, JSON text, or a bare primitive name.
        native: decode in C when the extension is built; ``False`` takes polars (tests compare
            the two).

    Returns:
        An :class:`AvroBatchDecoder` whose columns are those of
        :func:`~danube_pipeline.lake.iceberg.schema.payload_columns`: a record's fields, or one
        ``value`` column.
    """
    if not (native and _native_decode is not None):
        native = False
        try:
            import polars  # noqa: F401, PLC0415 - optional at run time
        except ImportError:
            return None
    schema = as_avro_dict(avro_schema)
    if schema.get("type") in ("record", "error"):
        fields = [_field(str(f["name"]), f["type"]) for f in schema.get("fields", ())]
    else:
        fields = [_field(VALUE_COLUMN, schema["type"] if set(schema) == {"type"} else schema)]
    if not fields or any(f is None for f in fields):
        return None
    return AvroBatchDecoder([f for f in fields if f is not None], native=native)
