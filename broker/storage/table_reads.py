"""Reading a topic's tiered offsets back from its Iceberg table: the table as a cold read source.

Where a topic's read path (``docs/etcd-layout.md`` §3.10: the topic's ``read_path`` key, else the
broker's ``--cold-read-path``) is ``iceberg`` or ``auto``, a subscription whose position lies
below the local WAL reads from the topic's table through
:class:`danube_pipeline.storage.table_reader.TableReader` before it turns to the segment objects
(:mod:`broker.storage.remote`):

* :class:`TopicTable` (one per topic, held by its :class:`~broker.storage.remote.RemoteLog`)
  follows the read path through the broker's etcd cache and opens the reader lazily, in a worker
  thread (pyiceberg is imported only then: a broker whose topics all read ``objects`` never
  loads it), as soon as the read path names the table, so the first read does not wait for
  the imports;
* :class:`TableCursor` (one per subscription) reads ahead in a worker thread (windows of
  :data:`TABLE_READ_RECORDS` records, growing to it from :data:`TABLE_FIRST_READ_RECORDS`
  after each new position, and at most :data:`TABLE_READ_BYTES`) and serves the
  records as stored batches, framed from the table's Arrow columns (:func:`rows_to_batches`: no
  Python object per record), so dispatch never blocks the event loop. It keeps the batches it
  handed out until they are acknowledged, so a redelivery re-reads the very same batch, and the
  subscription's table snapshot (§3.5.1): each read gives a snapshot that holds no row at or
  above where the read ended, and the next read from there on passes it as
  ``after_snapshot_id`` (an incremental append scan of what was appended since).

A message read from the table carries what the table kept of it
(:mod:`danube_pipeline.storage.table_reader`): rows written before the table layout's
``raw_payload`` was on keep neither the exact bytes nor the routing key, so they are read from
the objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from danube_pipeline import settings
from danube_pipeline.format.segments import StoredBatch
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.values import COLD_READ_PATHS, TableSnapshot, TopicReadPath
from danube_pipeline.names import TopicName
from danube_pipeline.outages import OutageLog
from danube_pipeline.partitions import partition_count, split_partition_name

from broker.storage.table_batches import BATCH_BYTES, BATCH_RECORDS, records_to_batches, rows_to_batches
from broker.tasks import spawn

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog

    from danube_pipeline.storage.table_reader import TableReader

__all__ = [
    "BATCH_BYTES",
    "BATCH_RECORDS",
    "TableChunk",
    "TableCursor",
    "TopicTable",
    "records_to_batches",
    "rows_to_batches",
    "shared_catalog",
]

log = logging.getLogger(__name__)

OBJECTS, ICEBERG, AUTO = COLD_READ_PATHS
TABLE_READ_RECORDS = 50_000
"""Records one table read asks for, at most (a subscription's read-ahead)."""
TABLE_FIRST_READ_RECORDS = 5_000
"""Records the first read from a position asks for, at most (a new subscription, a reset, a
move back from the objects): its first batches go out sooner. Each read ahead of it asks for
four times as many as the one before, up to :data:`TABLE_READ_RECORDS`, so the reads grow
while the first batches are dispatched."""
TABLE_READ_BYTES = 16 * 1024 * 1024
"""Payload bytes one table read asks for, at most (but always one record)."""
RETRY_AFTER_S = 1.0
"""A failed table read is tried again after this many seconds (``iceberg``)."""
OBJECTS_AFTER_FAILURE_S = 10.0
"""After a table read failed in ``auto`` (or for good), cold reads go to the objects without
asking the table for this many seconds."""


class MetadataView(Protocol):
    """What :class:`TopicTable` needs of the broker's etcd cache (``LocalCache``)."""

    def get(self, key: str) -> Any: ...

    def add_listener(self, prefix: str, callback: Callable[[Any], None]) -> Callable[[], None]: ...


_catalogs: dict[tuple[str, str, str], Catalog] = {}
_catalogs_lock = threading.Lock()


def shared_catalog() -> Catalog:
    """The Iceberg catalog of ``DANUBE_CATALOG_URI``, ``DANUBE_WAREHOUSE`` and
    ``DANUBE_CATALOG_NAME`` (:mod:`danube_pipeline.settings`), opened once per process.

    Blocking (it connects to the catalog database): call it in a worker thread.

    Raises:
        CatalogNotFoundError, DatabaseUrlError, OSError, sqlite3.Error,
        sqlalchemy.exc.OperationalError: as :func:`danube_pipeline.storage.catalog.load_catalog`.
    """
    key = (settings.catalog_uri(), settings.warehouse_url(), settings.catalog_name())
    with _catalogs_lock:
        found = _catalogs.get(key)
        if found is None:
            from danube_pipeline.storage.catalog import load_catalog

            found = _catalogs[key] = load_catalog(uri=key[0], warehouse=key[1], name=key[2])
        return found


@dataclass(frozen=True, slots=True)
class TableChunk:
    """One table read, as batches.

    Attributes:
        from_offset: where the read started.
        batches: the records from ``from_offset`` on, contiguous, as stored batches.
        next_offset: where the next read starts.
        snapshot_id: a snapshot holding no row at or above ``next_offset`` (``None``: none
            known), as :attr:`danube_pipeline.storage.table_reader.TableRead.snapshot_id`.
        complete: ``False`` when the read stopped at an offset the table cannot serve byte for
            byte (no raw bytes, row gone).
        full: the read stopped at its size limits: the table may hold more from ``next_offset``.
    """

    from_offset: int
    batches: list[StoredBatch]
    next_offset: int
    snapshot_id: int | None
    complete: bool
    full: bool


class TopicTable:
    """One topic's Iceberg table as a cold read source (module docstring).

    Args:
        topic: the topic (a partition reads its partitioned topic's table, filtered on
            ``_partition``).
        cache: the broker's ``LocalCache`` (the read path key and the topic root are read
            from it and followed by watch).
        default_path: the broker's ``--cold-read-path``.
        catalog: opens the catalog (blocking; default :func:`shared_catalog`).
    """

    def __init__(
        self,
        topic: TopicName,
        *,
        cache: MetadataView,
        default_path: str = OBJECTS,
        catalog: Callable[[], Catalog] = shared_catalog,
    ) -> None:
        if default_path not in COLD_READ_PATHS:
            raise ValueError(f"cold read path must be one of {', '.join(COLD_READ_PATHS)}")
        self.topic = topic
        self.default_path = default_path
        self._cache = cache
        self._catalog = catalog
        self._key = keys.topic_read_path(topic)
        self._identifier, self._partition = self._table_of(topic)
        self._reader: TableReader | None = None
        self._lock = threading.Lock()
        self.outage = OutageLog(log, f"reading {topic.path} from its Iceberg table")
        self.read_path = default_path
        self._reload()
        self._unwatch = cache.add_listener(self._key, lambda _event: self._reload())

    def _reload(self) -> None:
        raw = self._cache.get(self._key)
        path = self.default_path
        if raw is not None:
            try:
                path = TopicReadPath.from_json(raw).cold_read_path
            except (ValueError, TypeError) as exc:
                log.warning("%s: ignoring unreadable %s (%s); the broker's %s applies", self.topic.path, self._key, exc, path)
        if path != self.read_path:
            log.info("%s: cold reads come from %s", self.topic.path, path)
        self.read_path = path
        if path != OBJECTS and self._reader is None:
            threading.Thread(target=self._warm, name=f"table-open:{self.topic.path}", daemon=True).start()

    def _warm(self) -> None:
        """Open the reader ahead of the first read (imports, catalog connection, the table's
        metadata, the plan of its current snapshot); a failure is left to that read to meet and
        report."""
        try:
            reader = self._open()
            reader.committed_end_offset()  # the catalog connected, the table's metadata read
            reader.plan_ahead()
        except Exception as exc:  # noqa: BLE001 - reported by the read that meets it
            log.debug("%s: opening the table reader ahead of reads failed: %s", self.topic.path, exc)

    @property
    def enabled(self) -> bool:
        """Whether reads below the WAL try the table (read path ``iceberg`` or ``auto``)."""
        return self.read_path != OBJECTS

    def _table_of(self, topic: TopicName) -> tuple[tuple[str, str], int | None]:
        """The table identifier and partition index of ``topic`` (``docs/etcd-layout.md`` §3.1:
        a partition ``{parent}-part-{i}`` reads ``parent``'s table, rows of partition ``i``)."""
        split = split_partition_name(topic)
        if split is not None:
            parent, index = split
            if index < partition_count(self._cache.get(keys.topic_root(parent))):
                return (parent.namespace, parent.topic), index
        return (topic.namespace, topic.topic), None

    def _open(self) -> TableReader:
        """The reader, opened on first use (a topic without a table reads as empty). Blocking.

        Raises:
            CatalogNotFoundError, DatabaseUrlError, OSError: the catalog cannot be opened
                (:func:`shared_catalog`).
        """
        from danube_pipeline.storage.table_reader import TableReader

        with self._lock:
            if self._reader is None:
                self._reader = TableReader(self._catalog(), self._identifier, partition=self._partition)
            return self._reader

    def read_blocking(self, from_offset: int, max_records: int, after_snapshot_id: int | None) -> TableChunk:
        """Read the table from ``from_offset``, in a worker thread.

        Raises:
            TableReadError: the table cannot be read (``retriable`` as the reader says).
            CatalogNotFoundError, DatabaseUrlError, OSError: the catalog cannot be opened.
            MalformedRequestError: a record breaks a limit of the batch format.
        """
        rows = self._open().read_rows(
            from_offset, max_records=max_records, max_bytes=TABLE_READ_BYTES, after_snapshot_id=after_snapshot_id
        )
        return TableChunk(
            from_offset, rows_to_batches(rows.columns), rows.next_offset, rows.snapshot_id, rows.complete,
            rows.complete and rows.at_limit,
        )  # fmt: skip

    def first_offset_at_blocking(self, publish_time_us: int) -> int | None:
        """The first offset the table holds published at or after ``publish_time_us`` (µs since
        the epoch), ``None`` when it holds none or the topic has no table. Blocking.

        Raises:
            TableReadError: the table cannot be read.
        """
        return self._open().first_offset_at(publish_time_us)

    def end_offset_blocking(self) -> int | None:
        """The last offset the table covers, ``None`` when it covers none or the topic has no
        table. Blocking.

        Raises:
            TableReadError: the table cannot be read.
        """
        return self._open().committed_end_offset()

    def close(self) -> None:
        """Stop following the read path key; drop the reader's decoded files."""
        self._unwatch()
        if self._reader is not None:
            self._reader.close()


class TableCursor:
    """One subscription's reads from its topic's table (module docstring).

    Args:
        table: the topic's table.
        name: ``/ns/topic/subscription`` (for task names).
        snapshot: the subscription's stored table snapshot (§3.5.1), or ``None``.

    Attributes:
        wake: called when a read ends (the subscription's dispatcher wakes).
        snapshot: the last snapshot the subscription's reads covered to the table's end.
        records_served: records handed out from the table.
    """

    def __init__(self, table: TopicTable, *, name: str, snapshot: TableSnapshot | None = None) -> None:
        self.table = table
        self.name = name
        self.wake: Callable[[], None] = lambda: None
        self.snapshot = snapshot
        self.records_served = 0
        self._ahead: dict[int, StoredBatch] = {}  # read and not handed out yet, by base offset
        self._ahead_next: int | None = None  # where the batches read end
        self._ahead_records = 0  # records in _ahead
        self._window = TABLE_FIRST_READ_RECORDS  # records the last read asked for
        self._read_ahead = False  # the last read was full: the table may hold more
        self._miss: int | None = None  # an offset the table did not serve
        self._fetching: int | None = None
        self._failed_at: float | None = None
        self._objects_until = 0.0  # monotonic time until which the objects serve (after a failure)
        self._handed: dict[int, StoredBatch] = {}
        self._closed = False

    # ------------------------------------------------------------------ serving

    def read(self, offset: int, max_records: int) -> list[StoredBatch] | None:
        """Batches from ``offset`` on, from the table.

        Returns:
            The batches (the first starts at ``offset``); ``None`` while a read is under way
            (:attr:`wake` is called when it ends); ``[]`` when the table does not serve
            ``offset`` (beyond what it holds, no raw bytes, no table, or, in ``auto``, a
            failure): the caller reads the objects.
        """
        if offset in self._ahead:
            out = self._serve(offset, max_records)
            nxt = self._ahead_next
            if self._fetching is None and self._read_ahead and nxt is not None and self._ahead_records <= TABLE_READ_RECORDS:
                self._start(nxt)  # read ahead: at most two reads' records are held
            return out
        if self._miss == offset:
            self._miss = None
            return []
        if self._fetching is not None:
            return None  # wait for it, then read from here
        now = time.monotonic()
        if now < self._objects_until:
            return []
        if self._failed_at is not None and now - self._failed_at < RETRY_AFTER_S:
            return None
        self._start(offset)
        return None

    def _serve(self, offset: int, max_records: int) -> list[StoredBatch]:
        base = offset
        out: list[StoredBatch] = []
        records = 0
        while records < max_records:
            batch = self._ahead.pop(base, None)
            if batch is None:
                break
            out.append(batch)
            self._handed[batch.base_offset] = batch
            records += batch.record_count
            self._ahead_records -= batch.record_count
            base = batch.last_offset + 1
        self.records_served += records
        return out

    def handed_out(self, base: int) -> StoredBatch | None:
        """The batch at ``base`` this cursor handed out (for a redelivery), or ``None``."""
        return self._handed.get(base)

    def forget_handed(self, keep: Mapping[int, object]) -> None:
        """Drop the batches handed out whose base is not in ``keep`` (the handouts left)."""
        if len(self._handed) > 2 * len(keep) + 64:
            self._handed = {b: v for b, v in self._handed.items() if b in keep}

    # ------------------------------------------------------------------ reading

    def _start(self, offset: int) -> None:
        if self._closed:
            return
        self._fetching = offset
        spawn(self._fetch(offset), name=f"table-read:{self.name}:{offset}")

    async def _fetch(self, offset: int) -> None:
        table = self.table
        snapshot = self.snapshot
        after = snapshot.snapshot_id if snapshot is not None and offset >= snapshot.offset else None
        records = TABLE_FIRST_READ_RECORDS
        if offset == self._ahead_next:  # reading ahead
            records = min(TABLE_READ_RECORDS, 4 * self._window)
        self._window = records
        try:
            chunk = await asyncio.to_thread(table.read_blocking, offset, records, after)
        except Exception as exc:  # noqa: BLE001 - by the read path: objects (auto) or retried (iceberg)
            table.outage.failed(exc)
            self._fetching = None
            # A catalog that is not there or not usable (no file, a bad URL) is configuration:
            # not retried; anything else without a flag (the database unreachable) is.
            retriable = getattr(exc, "retriable", not isinstance(exc, FileNotFoundError | ValueError))
            if table.read_path == AUTO or not retriable:
                chunk = TableChunk(offset, [], offset, None, False, False)
                self._objects_until = time.monotonic() + OBJECTS_AFTER_FAILURE_S
            else:
                self._failed_at = time.monotonic()
                with contextlib.suppress(RuntimeError):
                    asyncio.get_running_loop().call_later(RETRY_AFTER_S, self.wake)
                return
        else:
            table.outage.succeeded()
        self._fetching = None
        self._failed_at = None
        if self._closed:
            return
        if chunk.snapshot_id is not None and (self.snapshot is None or chunk.next_offset >= self.snapshot.offset):
            self.snapshot = TableSnapshot(snapshot_id=chunk.snapshot_id, offset=chunk.next_offset)
        if not chunk.batches:
            self._miss = offset
            self._read_ahead = False
        else:
            if offset != self._ahead_next:
                self._ahead = {}
                self._ahead_records = 0
            self._ahead.update((b.base_offset, b) for b in chunk.batches)
            self._ahead_records += chunk.next_offset - chunk.from_offset
            self._ahead_next = chunk.batches[-1].last_offset + 1
            self._read_ahead = chunk.full
        self.wake()

    def close(self) -> None:
        """Drop what was read; reads under way are dropped when they end."""
        self._closed = True
        self._ahead = {}
        self._ahead_records = 0
        self._handed = {}
