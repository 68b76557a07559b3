"""Table rows framed as stored batches, for a subscription that reads its topic's Iceberg table
(:mod:`broker.storage.table_reads`).

The table keeps each record, not the producer's batches, so the broker frames the records it
reads into batches of its own (``danube_pipeline.format.batches``): consecutive records of one
producer and schema version, at most :data:`BATCH_RECORDS` records and :data:`BATCH_BYTES` of
payload, each record's timestamp within the format's 32-bit delta of its batch's first.
:func:`rows_to_batches` frames the Arrow columns a table read returns
(:class:`danube_pipeline.storage.table_rows.TableRows`) without a Python object per record;
:func:`records_to_batches` frames records one by one and is the reference the first must equal.

pyarrow is imported by :func:`rows_to_batches` only (the broker's ``iceberg`` read path).
"""

from __future__ import annotations

import bisect
import itertools
import struct
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from crc32c import crc32c

from danube_pipeline.format.batches import BatchBuilder, set_base_offset
from danube_pipeline.format.records import Record
from danube_pipeline.format.segments import StoredBatch

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["BATCH_BYTES", "BATCH_RECORDS", "records_to_batches", "rows_to_batches"]

BATCH_RECORDS = 1000
"""Records per batch built from table rows, at most: the client producer's default
``max_batch_messages``, so a replay from the table hands out batches of the size a replay from
the WAL does (each batch costs the dispatcher, the stream and the consumer a step: batches of
100 made the table replay about 15 % slower)."""
BATCH_BYTES = 1024 * 1024
"""Payload bytes per batch built from table rows, at most (one record always fits)."""
_MAX_DELTA_US = 0xFFFFFFFF
_PREFIX = struct.Struct("<QII")
"""A batch's first fields (``danube_pipeline.format.batches``, "Batch"): ``base_offset``,
``batch_length`` (the bytes after it) and the CRC32C of every byte after the CRC."""
_RECORD_MIN_LENGTH = 10
"""A record's ``record_length`` without key, attributes and payload (the bytes after that
field: timestamp delta, key length, attribute count)."""


def records_to_batches(records: list[Record]) -> list[StoredBatch]:
    """Frame ``records`` (ascending, contiguous offsets) as stored batches at their offsets.

    Consecutive records of one producer and schema version go into one batch (at most
    :data:`BATCH_RECORDS` records and :data:`BATCH_BYTES` of payload), as the producer framed
    them (``danube_pipeline.format.batches``); the fields a consumer sees are the records'.

    Raises:
        MalformedRequestError: a record breaks a limit of the batch format.
    """
    out: list[StoredBatch] = []
    i = 0
    while i < len(records):
        first = records[i]
        builder = BatchBuilder(first.publish_time_us)
        size = 0
        j = i
        while j < len(records) and j - i < BATCH_RECORDS:
            r = records[j]
            same = (r.producer_id, r.producer_name, r.schema_id, r.schema_version) == (
                first.producer_id, first.producer_name, first.schema_id, first.schema_version
            )
            delta = r.publish_time_us - first.publish_time_us
            if j > i and (not same or not 0 <= delta <= _MAX_DELTA_US or size + len(r.payload) > BATCH_BYTES):
                break
            builder.append(r.payload, timestamp_us=r.publish_time_us, key=r.key, attributes=r.attributes or None)
            size += len(r.payload)
            j += 1
        data = builder.build(
            producer_id=first.producer_id, producer_name=first.producer_name,
            schema_id=first.schema_id, schema_version=first.schema_version,
        )
        base, rest = set_base_offset(data, first.offset)
        out.append(StoredBatch(first.offset, j - i, base + bytes(rest)))
        i = j
    return out


def rows_to_batches(rows: pa.Table) -> list[StoredBatch]:
    """Frame table rows as stored batches: the batches :func:`records_to_batches` frames for
    the same records, built in Arrow.

    The batch boundaries are worked out first (one step per batch in Python; the payload
    sizes and publish times are taken out of Arrow one by one only in a window where they can
    cut a batch short); then every record's bytes (its header, key, attributes and payload)
    are joined in one Arrow array, so a batch's records are one slice of its buffer, copied
    once, after the header :class:`BatchBuilder` lays out. Rows breaking a limit of the format (a
    record over 4 GiB, an attribute name over 65,535 bytes, a null attribute value) and
    big-endian hosts take :func:`records_to_batches`, which refuses such records.

    Args:
        rows: the records, ascending and contiguous offsets, in the columns of
            :data:`danube_pipeline.storage.table_rows.ROW_SCHEMA` (each attribute name once per
            record, as the commit path writes them).

    Raises:
        MalformedRequestError: a record breaks a limit of the batch format.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    n = rows.num_rows
    if n == 0:
        return []
    rows = rows.combine_chunks()
    column = {name: rows.column(name).chunk(0) for name in rows.column_names}
    groups = [column[name] for name in ("producer_id", "producer_name", "schema_id", "schema_version")]
    ends = [n]  # where runs of one producer and schema version end
    if n > 1:
        changed = pc.or_(
            pc.or_(*(pc.not_equal(g.slice(1), g.slice(0, n - 1)) for g in groups[:2])),
            pc.or_(*(pc.not_equal(g.slice(1), g.slice(0, n - 1)) for g in groups[2:])),
        )
        ends[:0] = [i + 1 for i in pc.indices_nonzero(changed).to_pylist()]
    times = column["publish_time_us"]
    span = pc.min_max(times)
    rising = n == 1 or pc.all(pc.greater_equal(times.slice(1), times.slice(0, n - 1))).as_py()
    # the limits that can cut a batch shorter than BATCH_RECORDS, as Python lists (one object
    # per record) only when they can: a window of rising times within the 32-bit delta, or of
    # payloads that BATCH_RECORDS of cannot pass BATCH_BYTES, needs neither
    publish: list[int] | None = None
    if not rising or span["max"].as_py() - span["min"].as_py() > _MAX_DELTA_US:
        publish = times.to_pylist()
    lengths = pc.binary_length(column["payload"])
    sizes: list[int] | None = None
    if (pc.max(lengths).as_py() or 0) * BATCH_RECORDS > BATCH_BYTES:
        sizes = list(itertools.accumulate(lengths.to_pylist(), initial=0))
    starts: list[int] = []
    i = 0
    for run_end in ends:
        while i < run_end:
            j = min(run_end, i + BATCH_RECORDS)  # then the payload bytes, then the timestamps
            if sizes is not None:
                j = max(i + 1, bisect.bisect_right(sizes, sizes[i] + BATCH_BYTES, i + 1, j + 1) - 1)
            if publish is not None:
                first = publish[i]
                if rising:
                    j = bisect.bisect_right(publish, first + _MAX_DELTA_US, i + 1, j)
                elif j - i > 1 and not (first <= min(publish[i + 1 : j]) and max(publish[i + 1 : j]) - first <= _MAX_DELTA_US):
                    j = next(k for k in range(i + 1, j) if not 0 <= publish[k] - first <= _MAX_DELTA_US)
            starts.append(i)
            i = j
    base_offset: int = column["offset"][0].as_py()
    at_starts = pa.array(starts, pa.int64())
    first_times = pc.take(times, at_starts)
    # each record's batch: the batches started so far (offsets are contiguous from base_offset)
    opens = pc.is_in(column["offset"], value_set=pc.add(at_starts, base_offset))
    batch_of = pc.subtract(pc.cumulative_sum(pc.cast(opens, pa.int64())), 1)
    deltas = pc.subtract(times, pc.take(first_times, batch_of))
    framed = _framed_records(column, deltas) if sys.byteorder == "little" else None
    if framed is None:
        from danube_pipeline.storage.table_rows import TableRows

        return records_to_batches(TableRows(rows, None, 0, True).records())
    data, record_starts = framed
    positions: list[int] = pc.take(record_starts, pa.array([*starts, n], pa.int64())).to_pylist()
    ids, names, schema_ids, versions = (pc.take(g, at_starts).to_pylist() for g in groups)
    out: list[StoredBatch] = []
    for b, ((s, e), first_time) in enumerate(zip(itertools.pairwise([*starts, n]), first_times.to_pylist(), strict=True)):
        records = data[positions[b] : positions[b + 1]]  # framed in Arrow, not copied
        header = BatchBuilder.of_framed(first_time, b"", e - s).build(
            producer_id=ids[b], producer_name=names[b], schema_id=schema_ids[b], schema_version=versions[b]
        )  # the batch's header as the format lays it out, for no record bytes yet
        _, length, crc = _PREFIX.unpack_from(header)
        prefix = _PREFIX.pack(base_offset + s, length + records.size, crc32c(records, crc))  # CRC continued
        out.append(StoredBatch(base_offset + s, e - s, b"".join((prefix, memoryview(header)[_PREFIX.size :], records))))
    return out


def _fixed(values: pa.Array, width: int) -> pa.Array:
    """Integers (no nulls) as their ``width`` little-endian bytes each, a binary array."""
    import pyarrow as pa

    fixed = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(values), [None, values.buffers()[1]], 0, values.offset)
    return fixed.cast(pa.large_binary())


def _offsets(values: pa.Array) -> pa.Array:
    """The value offsets (int64, one more than ``values``) of a large binary array."""
    import pyarrow as pa

    return pa.Array.from_buffers(pa.int64(), len(values) + 1, [None, values.buffers()[1]], 0, values.offset)


def _framed_records(column: Mapping[str, pa.Array], deltas: pa.Array) -> tuple[pa.Buffer, pa.Array] | None:
    """Every record framed (``danube_pipeline.format.batches``, "Record"), one after the other
    in one buffer, and where each starts (and the last ends: int64, one more than the records);
    ``None`` when a record breaks a limit of the format. ``deltas``: each record's timestamp
    delta in its batch (µs)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    empty = pa.scalar(b"", pa.large_binary())
    n = len(deltas)
    attributes = _attribute_bytes(column["attributes"])
    if attributes is None:
        return None
    attribute_bytes, attribute_counts = attributes
    key = column["key"].cast(pa.large_binary())
    key_length = pc.binary_length(key)
    payload = column["payload"]
    length = pc.add(
        pc.add(pc.fill_null(key_length, 0), pc.binary_length(attribute_bytes)),
        pc.add(pc.binary_length(payload), _RECORD_MIN_LENGTH),
    )
    if pc.max(length).as_py() > _MAX_DELTA_US:
        return None
    joined = pc.binary_join_element_wise(
        _fixed(length.cast(pa.uint32()), 4),
        _fixed(deltas.cast(pa.uint32()), 4),
        _fixed(pc.fill_null(key_length, -1).cast(pa.int32()), 4),
        _fixed(attribute_counts, 2),
        pc.fill_null(key, empty),
        attribute_bytes,
        payload,
        empty,
    )
    assert len(joined) == n
    return joined.buffers()[2], _offsets(joined)


def _attribute_bytes(attributes: pa.Array) -> tuple[pa.Array, pa.Array] | None:
    """Each record's attributes framed (``name_length u16 | value_length u32 | name | value``
    per pair) as a binary array, and the pair counts (uint16); ``None`` when a limit of the
    format is broken or a value is null."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(attributes)
    pairs_type = pa.large_list(pa.struct([("key", pa.large_string()), ("value", pa.large_string())]))
    lists = attributes.cast(pairs_type)
    counts = pc.fill_null(pc.list_value_length(lists), 0)
    if n == 0 or pc.max(counts).as_py() == 0:
        return pc.fill_null(pa.nulls(n, pa.large_binary()), pa.scalar(b"", pa.large_binary())), pa.nulls(n, pa.uint16()).fill_null(0)
    if pc.max(counts).as_py() > 0xFFFF:
        return None
    names, values = (a.cast(pa.large_binary()) for a in pc.list_flatten(lists).flatten())
    name_lengths, value_lengths = pc.binary_length(names), pc.binary_length(values)
    if values.null_count or pc.max(name_lengths).as_py() > 0xFFFF:
        return None
    pairs = pc.binary_join_element_wise(
        _fixed(name_lengths.cast(pa.uint16()), 2),
        _fixed(value_lengths.cast(pa.uint32()), 4),
        names,
        values,
        pa.scalar(b"", pa.large_binary()),
    )
    bounds = pc.take(_offsets(pairs), pa.concat_arrays([pa.array([0], pa.int64()), pc.cumulative_sum(counts)]))
    framed = pa.LargeBinaryArray.from_buffers(pa.large_binary(), n, [None, bounds.buffers()[1], pairs.buffers()[2]])
    return framed, counts.cast(pa.uint16())
