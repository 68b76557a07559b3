"""Data files of a topic's table decoded whole and kept for the windows that read them
(:class:`DecodedFiles`, the file cache of :class:`~danube_pipeline.storage.table_reader.TableReader`).

Iceberg data files never change (the Iceberg table spec, "Data files"): a file decoded once
(only the columns a read selects) serves every later window over its offsets. The decoded files
a reader keeps are bounded by :data:`FILE_CACHE_BUDGET_BYTES` (Arrow bytes, the least recently
used dropped first; the file read last always stays).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.expressions import And, BooleanExpression
from pyiceberg.expressions.parser import parse
from pyiceberg.io.pyarrow import ArrowScan
from pyiceberg.schema import Schema
from pyiceberg.table import FileScanTask, Table

from danube_pipeline.storage.table_columns import OFFSET_COLUMN

__all__ = ["FILE_CACHE_BUDGET_BYTES", "FILE_CACHE_MAX_BYTES", "DecodedFiles"]

FILE_CACHE_MAX_BYTES = 64 * 1024 * 1024
"""A data file of at most this many bytes is decoded whole and kept for the next windows; a
larger one (a compacted file) is read window by window, filtered on ``_offset``."""
FILE_CACHE_BUDGET_BYTES = 128 * 1024 * 1024
"""Decoded files a reader keeps, at most (Arrow bytes; the least recently used go first)."""

_T = TypeVar("_T")
_Decoded = tuple[pa.Table, int | None]
"""A file's rows and, when its offsets are ``low, low + 1, ...`` in row order, ``low``."""


class Guard(Protocol):
    """Runs a read, raising its failures as the reader's ``TableReadError``."""

    def __call__(self, call: Callable[[], _T], /) -> _T: ...


class DecodedFiles:
    """The decoded data files of one reader (module docstring). Thread-safe.

    Args:
        guard: runs a decode and raises its failures as a ``TableReadError``.
    """

    def __init__(self, guard: Guard) -> None:
        self._guard = guard
        self._lock = threading.Lock()
        self._files: OrderedDict[tuple[object, ...], _Decoded] = OrderedDict()
        self._bytes = 0

    def rows(
        self, table: Table, projection: Schema, row_filter: BooleanExpression, task: FileScanTask, first: int, last: int
    ) -> tuple[pa.Table, bool]:
        """The rows of one planned data file at offsets ``first..last``, and whether they are
        offsets ``o, o + 1, ...`` in row order: from the file decoded whole and kept, or, for a
        file over :data:`FILE_CACHE_MAX_BYTES`, read filtered on the window.

        Raises:
            TableReadError: the file cannot be read (through ``guard``).
        """
        if task.file.file_size_in_bytes > FILE_CACHE_MAX_BYTES:
            window = parse(f"{OFFSET_COLUMN} >= {int(first)} and {OFFSET_COLUMN} <= {int(last)}")
            reader = ArrowScan(table.metadata, table.io, projection, And(row_filter, window))
            return self._guard(lambda: reader.to_table([task])), False
        key = _key(projection, row_filter, task)
        with self._lock:
            found = self._files.get(key)
            if found is not None:
                self._files.move_to_end(key)
        if found is None:
            found = self._guard(lambda: _decode(table, projection, row_filter, task))
            self._keep(key, found)
        whole, low = found
        if low is not None:  # offsets low, low + 1, ...: the window is a slice, no copy
            start = min(max(first - low, 0), whole.num_rows)
            return whole.slice(start, max(0, min(last - low + 1, whole.num_rows) - start)), True
        offsets = whole.column(OFFSET_COLUMN)
        return whole.filter(pc.and_(pc.greater_equal(offsets, first), pc.less_equal(offsets, last))), False

    def close(self) -> None:
        """Drop the kept files."""
        with self._lock:
            self._files.clear()
            self._bytes = 0

    def _keep(self, key: tuple[object, ...], decoded: _Decoded) -> None:
        with self._lock:
            if key in self._files:
                return
            self._files[key] = decoded
            self._bytes += decoded[0].nbytes
            while self._bytes > FILE_CACHE_BUDGET_BYTES and len(self._files) > 1:
                _, (dropped, _low) = self._files.popitem(last=False)
                self._bytes -= dropped.nbytes


def _key(projection: Schema, row_filter: BooleanExpression, task: FileScanTask) -> tuple[object, ...]:
    """What names a decoded file: its path, its delete files, the projection and the filter."""
    return (
        task.file.file_path,
        tuple(sorted(d.file_path for d in task.delete_files)),
        tuple(f.field_id for f in projection.fields),
        str(row_filter),
    )


def _decode(table: Table, projection: Schema, row_filter: BooleanExpression, task: FileScanTask) -> _Decoded:
    decoded: pa.Table = ArrowScan(table.metadata, table.io, projection, row_filter).to_table([task])
    return decoded, contiguous_from(decoded.column(OFFSET_COLUMN))


def contiguous_from(offsets: pa.ChunkedArray) -> int | None:
    """The first offset when ``offsets`` are ``first, first + 1, ...`` in row order, else
    ``None``."""
    n = len(offsets)
    if n == 0:
        return None
    low = offsets[0].as_py()
    if n > 1 and not pc.all(pc.equal(pc.subtract(offsets.slice(1), offsets.slice(0, n - 1)), 1)).as_py():
        return None
    return int(low)
