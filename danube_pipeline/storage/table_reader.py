"""Reading a topic's history back from its Iceberg table, message by message, byte for byte.

The tiering pipeline commits every offset of a topic exactly once, as a row of its table
``{ns}.{topic}`` or of its dead-letter table ``{ns}.{topic}__dlq``
(:mod:`.table_columns`), and records the last one in the table property
``danube.committed-end-offset`` (:mod:`.table_properties`). :class:`TableReader` turns those
rows back into the :class:`~danube_pipeline.format.records.Record` values the WAL and the
segment objects hold, so a broker can serve a subscription below its local WAL from the table.

**What a read returns.** :meth:`TableReader.read` returns the records at offsets
``from_offset, from_offset + 1, ...`` up to ``max_records`` of them and no further than the
committed end offset, rows and dead letters merged by offset. It stops early, with
``complete=False``, at the first offset it cannot serve byte for byte:

* a row or dead letter written while the table layout's ``raw_payload`` was off
  (``docs/etcd-layout.md`` §3.9): its ``_key`` is ``null`` (or the table has no ``_key``), so
  the table does not know its routing key, nor, in a table with typed columns, its exact bytes
  (kept in ``_raw_payload``; a table without a schema keeps them in ``_payload``), nor, for a
  dead letter, its producer id and attributes;
* an offset the table holds neither as a row nor as a dead letter (rows deleted by retention).

The caller then serves that offset from segment objects.

**Snapshots.** Each read also returns the id of a snapshot that holds no row at or above the
returned ``next_offset`` (the table's current snapshot when the read reached its end). Passed
back as ``after_snapshot_id`` with the next read, it lets that read plan only the data files
of later snapshots: pyiceberg's incremental append scan, which reads the files that ``append``
snapshots added and ignores ``replace`` snapshots (compaction, schema rewrites) and
``overwrite`` or ``delete`` snapshots (retention's row deletes), which bring no new offsets
(Iceberg spec, "Snapshots", ``operation``). A read whose snapshot has expired, that gets none,
or whose snapshot does not fit its ``from_offset`` scans the whole table instead. Either way
the scan is filtered on ``_offset`` (and ``_partition``), so pyiceberg skips every data file
whose ``_offset`` bounds in the manifests lie outside the range (Iceberg spec, "Scan
Planning"), and an offset found twice is returned once. Only the reserved columns are read,
never the typed payload columns, so data files written before a ``schema_rewrite`` changed a
column's type (which an incremental scan may still plan) read as well as the rewritten ones.

**Reading in windows.** A read plans the data files of its pinned snapshot once (kept for the
next reads of that snapshot) and picks the files whose ``_offset`` bounds meet its window. A
data file of at most :data:`~danube_pipeline.storage.table_files.FILE_CACHE_MAX_BYTES` is
decoded whole, once (only the reserved columns), and kept while later windows read it (Iceberg
data files never change; the key names the file, its delete files and the projection): a
subscription reading a file in ten windows decodes it once
(:mod:`danube_pipeline.storage.table_files`). A window cut at ``max_bytes`` is cut before its rows are copied, where the
files' offsets ascend from one file to the next (the usual case; after a compaction they may
overlap and the cut comes after merging). :meth:`TableReader.read_rows` returns a window as Arrow columns
(:class:`TableRows`), no Python object per row, for a caller that frames them again (the
broker's batches); :meth:`TableReader.read` turns them into records.

**What the table does not keep.** A producer's sequence numbers are not columns of the table
(the broker frames the records it reads in batches of its own).

All calls block (catalog queries, Parquet reads): a broker runs them off its event loop.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.conversions import from_bytes
from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.expressions import AlwaysTrue, BooleanExpression
from pyiceberg.io.pyarrow import ArrowScan
from pyiceberg.schema import Schema
from pyiceberg.table import DataScan, FileScanTask, IncrementalAppendScan, Table
from pyiceberg.table.snapshots import Operation, Snapshot, ancestors_of, is_parent_ancestor_of
from pyiceberg.types import LongType

from danube_pipeline.errors import TableReadError
from danube_pipeline.format.records import Record
from danube_pipeline.storage.table_columns import (
    DEAD_LETTER_SUFFIX,
    KEY_COLUMN,
    METADATA_COLUMNS,
    OFFSET_COLUMN,
    PARTITION_COLUMN,
    PAYLOAD_COLUMN,
    PUBLISH_TIME_COLUMN,
    RAW_PAYLOAD_COLUMN,
)
from danube_pipeline.storage.table_rows import (
    TableRows,
    bytes_stop,
    contiguous_rows,
    empty_rows,
    holds_offset,
    normalized_rows,
)
from danube_pipeline.storage.table_files import DecodedFiles
from danube_pipeline.storage.table_properties import SUMMARY_END_OFFSET, SUMMARY_PARTITION, committed_end_offset

__all__ = ["TableRead", "TableReader", "TableRows"]

_READ_COLUMNS = (*METADATA_COLUMNS, KEY_COLUMN)
"""The metadata columns a read selects, where the table has them."""

_RETRIABLE = (OSError, TimeoutError)
"""Failures a later try may not meet: a data file unreachable or deleted under the read
(snapshot expiry after compaction), the object store timing out."""
_RETRIABLE_NAMES = frozenset({"OperationalError", "CommitFailedException"})
"""The same, matched by class name: the catalog database unreachable or locked
(``sqlalchemy.exc.OperationalError``; sqlalchemy is the SQL catalog's dependency, not this
module's)."""
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class TableRead:
    """What :meth:`TableReader.read` found.

    Attributes:
        records: the records at ``from_offset`` and after, ascending and contiguous, dead
            letters merged in; byte-exact: payload, attributes, producer name and id, publish
            time, offset, routing key, schema id and version as in the WAL.
        snapshot_id: a snapshot of the topic's table holding no row at or above
            ``next_offset``; pass it back as ``after_snapshot_id`` with the next read. ``None``
            when the table has no snapshot or none is known to qualify.
        next_offset: where the next read starts: the offset after the last record, or
            ``from_offset`` when there is none.
        complete: ``False`` when the read stopped at ``next_offset`` although the table
            commits it: its bytes or attributes are not in the table, or its row is gone (the
            caller serves it from segment objects); ``True`` when it stopped at ``max_records``
            or at the committed end offset.
    """

    records: list[Record]
    snapshot_id: int | None
    next_offset: int
    complete: bool


class TableReader:
    """Reads one topic's (or one partition's) records from its Iceberg table (module docstring).

    Every call loads the table's current metadata from the catalog, so it sees what tiering,
    compaction, retention and rewrites committed since the previous call.

    Args:
        catalog: the shared catalog (:func:`danube_pipeline.storage.catalog.load_catalog`).
        identifier: the topic's table, ``(namespace, topic)``; its dead letters are read from
            ``(namespace, topic + "__dlq")``.
        partition: the index ``i`` of the partition ``{topic}-part-{i}`` to read, for a
            partitioned topic's table (``docs/etcd-layout.md`` §3.1); ``None`` for a plain
            topic's table.
    """

    def __init__(self, catalog: Catalog, identifier: tuple[str, str], *, partition: int | None = None) -> None:
        self._catalog = catalog
        self._identifier = identifier
        self._dead_letters = (identifier[0], identifier[1] + DEAD_LETTER_SUFFIX)
        self._partition = partition
        self._name = ".".join(identifier)
        self._lock = threading.Lock()  # the caches below (a broker reads in several threads)
        self._plans: OrderedDict[tuple[object, ...], _Plan] = OrderedDict()
        self._files = DecodedFiles(self._guard)

    def read(self, from_offset: int, *, max_records: int, after_snapshot_id: int | None = None) -> TableRead:
        """The records at ``from_offset`` and after (module docstring, "What a read returns").

        Args:
            from_offset: the first offset wanted.
            max_records: at most this many records (>= 1).
            after_snapshot_id: the ``snapshot_id`` of an earlier read, if any: only data files
                appended after it are planned when it is still in the table's history and no
                row at or above ``from_offset`` is at or before it; otherwise the whole table is
                planned. Either gives the same records.

        Returns:
            The :class:`TableRead`; empty with ``complete=True`` when the table (or its
            committed range) ends below ``from_offset`` or does not exist.

        Raises:
            ValueError: ``from_offset`` is negative or ``max_records`` below 1.
            TableReadError: the table cannot be read (``retriable`` says whether a later try
                may succeed).
        """
        rows = self.read_rows(from_offset, max_records=max_records, after_snapshot_id=after_snapshot_id)
        return TableRead(rows.records(), rows.snapshot_id, rows.next_offset, rows.complete)

    def read_rows(
        self,
        from_offset: int,
        *,
        max_records: int,
        max_bytes: int | None = None,
        after_snapshot_id: int | None = None,
    ) -> TableRows:
        """:meth:`read` as Arrow columns (module docstring, "Reading in windows").

        Args:
            from_offset: the first offset wanted.
            max_records: at most this many records (>= 1).
            max_bytes: at most this many payload bytes, but always the first record; ``None``:
                no limit. A read stopped by it is complete, as one stopped by ``max_records``.
            after_snapshot_id: as for :meth:`read`.

        Returns:
            The :class:`TableRows`; empty with ``complete=True`` when the table (or its
            committed range) ends below ``from_offset`` or does not exist.

        Raises:
            ValueError: ``from_offset`` is negative, ``max_records`` below 1 or ``max_bytes``
                below 1.
            TableReadError: the table cannot be read (``retriable`` says whether a later try
                may succeed).
        """
        if from_offset < 0 or max_records < 1 or (max_bytes is not None and max_bytes < 1):
            raise ValueError(
                f"from_offset must be >= 0, max_records and max_bytes >= 1, got {from_offset}, {max_records}, {max_bytes}"
            )
        table = self._load(self._identifier)
        pinned = table.current_snapshot() if table is not None else None
        if table is None or pinned is None:
            return TableRows(empty_rows(), None, from_offset, True)
        self._check_partitioning(table)
        end = self._guard(lambda: committed_end_offset(table, partition=self._partition))
        if end is None:  # nothing committed by the commit path (yet)
            return TableRows(empty_rows(), None, from_offset, True)
        if from_offset > end:
            return TableRows(empty_rows(), pinned.snapshot_id, from_offset, True)
        last = min(end, from_offset + max_records - 1)
        window = self._with_partition(f"{OFFSET_COLUMN} >= {int(from_offset)} and {OFFSET_COLUMN} <= {int(last)}")
        dead_letters = self._load(self._dead_letters)
        dead = empty_rows()
        if dead_letters is not None and dead_letters.current_snapshot() is not None:
            dead = self._dead_letter_rows(dead_letters, window)
        start = after_snapshot_id if self._incremental_start_ok(table, pinned, after_snapshot_id) else None
        found, stop = self._rows(table, pinned, from_offset, last, start, max_bytes)
        if start is not None and not holds_offset(found, from_offset) and not holds_offset(dead, from_offset):
            # the start snapshot holds rows at or above from_offset, which the incremental
            # scan cannot see: plan the whole table instead
            start = None
            found, stop = self._rows(table, pinned, from_offset, last, None, max_bytes)
        columns, served = contiguous_rows(pa.concat_tables([dead, found]) if dead.num_rows else found, from_offset)
        count = served
        if max_bytes is not None and count > 1:
            over = pc.greater(pc.cumulative_sum(pc.binary_length(columns.column("payload"))), max_bytes)
            first_over: int = pc.index(over, True).as_py()
            count = count if first_over < 0 else max(1, first_over)
        offset = from_offset + count
        complete = offset > stop or count < served  # stop < last: cut at max_bytes
        columns = columns.slice(0, count) if count < columns.num_rows else columns
        at_limit = count == max_records or count < served or (stop < last and offset > stop)
        return TableRows(columns, self._snapshot_below(table, pinned, offset, end, start), offset, complete, at_limit)

    def first_offset_at(self, publish_time_us: int) -> int | None:
        """The first offset published at or after ``publish_time_us``: a subscription started
        at a publish time starts there.

        The scan is filtered on ``_publish_time``, so pyiceberg plans only the partitions of
        that day and later (the table's partition transform of ``_publish_time``,
        ``docs/etcd-layout.md`` §3.9) and, in them, only the data files whose ``_publish_time``
        bounds in the manifests reach the time (Iceberg spec, "Scan Planning"). The files left
        are read in the order of their lowest ``_offset`` (manifest bounds), and reading stops
        at the first file that cannot hold a smaller offset than one already found, so with
        publish times rising with offsets one file is read. Dead letters count too.

        Args:
            publish_time_us: microseconds since the Unix epoch.

        Returns:
            The smallest offset (of this reader's partition) whose publish time is at or
            after ``publish_time_us``, or ``None`` when the table holds none (the table does
            not exist, or every row was published earlier: the offset is above the table's
            committed end).

        Raises:
            TableReadError: the table cannot be read.
        """
        since = self._with_partition(f"{PUBLISH_TIME_COLUMN} >= {int(publish_time_us)}")
        found: list[int] = []
        for identifier in (self._identifier, self._dead_letters):
            table = self._load(identifier)
            if table is None or table.current_snapshot() is None:
                continue
            if identifier == self._identifier:
                self._check_partitioning(table)
            first = self._guard(functools.partial(_first_offset, table, since))
            if first is not None:
                found.append(first)
        return min(found, default=None)

    def committed_end_offset(self) -> int | None:
        """The last offset the table covers: every offset up to it is committed, as a row or as
        a dead letter (unless retention deleted it since), read from the table property
        ``danube.committed-end-offset`` (:func:`.table_properties.committed_end_offset`).

        Returns:
            The inclusive end offset of this reader's topic or partition, or ``None`` when the
            table does not exist or holds nothing yet.

        Raises:
            TableReadError: the catalog cannot be read, or the property is not an integer.
        """
        table = self._load(self._identifier)
        if table is None:
            return None
        return self._guard(lambda: committed_end_offset(table, partition=self._partition))

    def plan_ahead(self) -> None:
        """Plan the table's current snapshot whole, ahead of reads (module docstring, "Reading
        in windows"): the first read of a subscription without a snapshot of its own finds the
        plan made, while the table has not changed since. Blocking.

        Raises:
            TableReadError: the table cannot be read.
        """
        table = self._load(self._identifier)
        pinned = table.current_snapshot() if table is not None else None
        if table is None or pinned is None:
            return
        self._check_partitioning(table)
        self._plan(table, pinned, None, _selected(table)[1])

    def close(self) -> None:
        """Drop the decoded files; the reader may be used again."""
        self._files.close()

    # ------------------------------------------------------------------ internals

    def _load(self, identifier: tuple[str, str]) -> Table | None:
        """The table's current metadata, or ``None`` when the catalog has no such table."""
        try:
            return self._catalog.load_table(identifier)
        except NoSuchTableError:
            return None
        except Exception as exc:  # noqa: BLE001 - any catalog failure is a table read failure
            raise _read_error(".".join(identifier), exc) from exc

    def _guard(self, call: Callable[[], _T]) -> _T:
        """``call()``, its failures raised as :class:`TableReadError`."""
        try:
            return call()
        except TableReadError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the read is a table read failure
            raise _read_error(self._name, exc) from exc

    def _check_partitioning(self, table: Table) -> None:
        """Refuse a partitioned topic's table without ``partition`` and the reverse."""
        partitioned = PARTITION_COLUMN in _column_names(table)
        if partitioned != (self._partition is not None):
            raise TableReadError(
                self._name,
                "the table of a partitioned topic is read one partition at a time"
                if partitioned
                else f"the table has no {PARTITION_COLUMN} column to read partition {self._partition} from",
            )

    def _with_partition(self, row_filter: str) -> str:
        """``row_filter`` (pyiceberg's filter syntax), of this reader's partition's rows only."""
        if self._partition is None:
            return row_filter
        return f"{row_filter} and {PARTITION_COLUMN} = {int(self._partition)}"

    def _incremental_start_ok(self, table: Table, pinned: Snapshot, after: int | None) -> bool:
        """Whether pyiceberg's incremental append scan can start after ``after``: a snapshot
        that is the parent of one of the pinned snapshot's ancestors (kept, or expired with its
        child kept)."""
        if after is None:
            return False
        if after == pinned.snapshot_id:
            return True
        return is_parent_ancestor_of(pinned.snapshot_id, after, table.metadata)

    def _rows(
        self, table: Table, pinned: Snapshot, first: int, last: int, after: int | None, max_bytes: int | None
    ) -> tuple[pa.Table, int]:
        """The rows of the topic's table at offsets ``first..stop`` (:func:`.table_rows.normalized_rows`),
        from the data files of the snapshots after ``after`` (all when ``None``), and ``stop``:
        ``last``, or the offset at which the rows pass ``max_bytes`` of payload (:func:`.table_rows.bytes_stop`),
        so that a window cut by its bytes copies only the rows it serves."""
        payload, selected = _selected(table)
        if after == pinned.snapshot_id:
            return empty_rows(), last
        plan = self._plan(table, pinned, after, selected)
        pieces = [
            self._files.rows(table, plan.projection, plan.row_filter, task, first, last)
            for task, low, high in plan.tasks
            if (low is None or low <= last) and (high is None or high >= first)
        ]
        pieces = [(rows, contiguous) for rows, contiguous in pieces if rows.num_rows]
        if not pieces:
            return empty_rows(), last
        stop = last if max_bytes is None else bytes_stop(pieces, payload, last, max_bytes)
        kept = [rows for rows, _ in pieces]
        if stop < last:  # the pieces' offsets ascend, piece after piece: keep those up to stop
            kept = [rows.slice(0, pc.sum(pc.less_equal(rows.column(OFFSET_COLUMN), stop)).as_py()) for rows in kept]
            kept = [rows for rows in kept if rows.num_rows]  # the row at stop is kept
        arrow = pa.concat_tables(kept, promote_options="default") if len(kept) > 1 else kept[0]
        return normalized_rows(arrow, payload), stop

    def _plan(self, table: Table, pinned: Snapshot, after: int | None, selected: tuple[str, ...]) -> _Plan:
        """The data files of the pinned snapshot (of the snapshots after ``after``), with their
        ``_offset`` bounds from the manifests: planned once per snapshot and kept. A kept
        incremental plan of the pinned snapshot from an ancestor of ``after`` serves too: a
        subscription reading forward passes a newer ``after`` with each window, and planning
        again would read every append's manifest list each time."""
        key = (pinned.snapshot_id, after, selected, table.metadata.current_schema_id, table.metadata.default_spec_id)
        with self._lock:
            found = self._plans.get(key)
            kept = list(self._plans.items()) if found is None and after is not None else []
        if found is not None:
            return found
        if after is not None and kept and table.metadata.snapshot_by_id(after) is not None:  # not expired
            for (pinned_id, since, *rest), plan in reversed(kept):
                # an incremental plan of the same snapshot from an ancestor of after plans every
                # file the exact one would, and more (with lower offsets, cut by the window)
                if pinned_id == pinned.snapshot_id and isinstance(since, int) and tuple(rest) == key[2:]:
                    if is_parent_ancestor_of(after, since, table.metadata):
                        return plan
        row_filter: str | BooleanExpression = (
            AlwaysTrue() if self._partition is None else f"{PARTITION_COLUMN} = {int(self._partition)}"
        )
        if after is not None:
            scan: DataScan | IncrementalAppendScan = table.incremental_append_scan(
                from_snapshot_id_exclusive=after,
                to_snapshot_id_inclusive=pinned.snapshot_id,
                row_filter=row_filter,
                selected_fields=selected,
            )
        else:
            scan = table.scan(row_filter=row_filter, selected_fields=selected, snapshot_id=pinned.snapshot_id)
        field_id = table.schema().find_field(OFFSET_COLUMN).field_id
        tasks = self._guard(lambda: list(scan.plan_files()))
        plan = _Plan(
            projection=scan.projection(),
            row_filter=scan.row_filter,
            tasks=sorted(((t, _bound(t, field_id, True), _bound(t, field_id, False)) for t in tasks), key=_lowest),
        )
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > 4:
                self._plans.popitem(last=False)
        return plan

    def _dead_letter_rows(self, table: Table, window: str) -> pa.Table:
        """The dead letters in ``window`` (:func:`.table_rows.normalized_rows`)."""
        names = _column_names(table)
        selected = tuple(c for c in (*_READ_COLUMNS, PAYLOAD_COLUMN) if c in names)
        arrow: pa.Table = self._guard(lambda: table.scan(row_filter=window, selected_fields=selected).to_arrow())
        return normalized_rows(arrow, PAYLOAD_COLUMN)

    def _snapshot_below(
        self, table: Table, pinned: Snapshot, next_offset: int, end: int, after: int | None
    ) -> int | None:
        """A snapshot holding no row at or above ``next_offset``: the pinned one when the read
        reached the committed end; else the newest append of this partition whose summary's
        ``danube.end-offset`` is below ``next_offset`` (appends commit offsets in order, so
        every older append of the partition holds lower ones, and ``replace``, ``overwrite``
        and ``delete`` snapshots add none), or ``after`` when the walk reaches it first; an
        append without that summary field is never taken."""
        if next_offset > end:
            return pinned.snapshot_id
        wanted = None if self._partition is None else str(self._partition)
        for snapshot in ancestors_of(pinned, table.metadata):
            if snapshot.snapshot_id == after:
                return after
            summary = snapshot.summary
            if summary is None or summary.operation != Operation.APPEND or summary[SUMMARY_PARTITION] != wanted:
                continue
            value = summary[SUMMARY_END_OFFSET]
            if value is not None and int(value) < next_offset:
                return snapshot.snapshot_id
        return None


def _read_error(table: str, exc: BaseException) -> TableReadError:
    """``exc`` as a :class:`TableReadError`, retriable when a later try may not meet it."""
    retriable = isinstance(exc, _RETRIABLE) or type(exc).__name__ in _RETRIABLE_NAMES
    return TableReadError(table, f"{type(exc).__name__}: {exc}", retriable=retriable)


def _column_names(table: Table) -> set[str]:
    return {f.name for f in table.schema().fields}


def _selected(table: Table) -> tuple[str, tuple[str, ...]]:
    """The column holding the exact payload bytes, and the columns a read of ``table`` selects."""
    names = _column_names(table)
    payload = PAYLOAD_COLUMN if PAYLOAD_COLUMN in names else RAW_PAYLOAD_COLUMN
    return payload, tuple(c for c in (*_READ_COLUMNS, payload) if c in names)


@dataclass(frozen=True, slots=True)
class _Plan:
    """The data files one snapshot (range) plans: ``(task, lowest _offset, highest _offset)``
    in the order of their lowest offsets, and the projection and filter to read them with."""

    projection: Schema
    row_filter: BooleanExpression
    tasks: list[tuple[FileScanTask, int | None, int | None]]


def _bound(task: FileScanTask, field_id: int, lower: bool) -> int | None:
    """The file's lower or upper ``_offset`` bound from its manifest entry, if recorded."""
    bounds = task.file.lower_bounds if lower else task.file.upper_bounds
    raw = (bounds or {}).get(field_id)
    return None if raw is None else int(from_bytes(LongType(), raw))


def _lowest(entry: tuple[FileScanTask, int | None, int | None]) -> int:
    return -1 if entry[1] is None else entry[1]


def _first_offset(table: Table, row_filter: str) -> int | None:
    """The smallest ``_offset`` of the rows matching ``row_filter``, reading the planned files
    in the order of their lowest ``_offset`` until none can hold a smaller one."""
    scan = table.scan(row_filter=row_filter, selected_fields=(OFFSET_COLUMN, PUBLISH_TIME_COLUMN))
    field_id = table.schema().find_field(OFFSET_COLUMN).field_id

    def lowest(task: FileScanTask) -> int:
        bound = _bound(task, field_id, True)
        return -1 if bound is None else bound  # offsets are >= 0

    tasks = sorted(scan.plan_files(), key=lowest)
    reader = ArrowScan(table.metadata, table.io, scan.projection(), scan.row_filter)
    best: int | None = None
    for task in tasks:
        if best is not None and lowest(task) >= best:
            break
        offsets = reader.to_table([task]).column(OFFSET_COLUMN)
        if len(offsets):
            low = int(pc.min(offsets).as_py())
            best = low if best is None else min(best, low)
    return best
