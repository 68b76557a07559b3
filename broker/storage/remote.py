"""Reading a topic's tiered offsets back from object storage: the remote half of one log.

Sealed WAL segments are copied unchanged to object storage and described in etcd
(``docs/etcd-layout.md`` §5.1). Once a segment is deleted from the broker's disk (local
retention, :mod:`broker.storage.local_retention`), its offsets exist only there. :class:`RemoteLog` serves
them to subscriptions as the same stored batches the WAL serves, as Kafka's tiered storage
(KIP-405) serves offsets below the local log start:

* the topic's completed descriptors are followed through the broker's etcd cache (a watch), so
  the remote range ``[first_offset, end_offset]`` is always current;
* a read at offset ``o`` finds the descriptor holding ``o`` and seeks with its sparse
  ``offset_index`` to the last indexed batch at or before ``o``: one ranged GET from there to
  the object's end (or one GET of the whole object, whose MD5 is then checked against the
  descriptor's ``etag``); every batch's CRC32C is checked, offsets must be contiguous and end
  at the descriptor's ``end_offset``, and the bytes must end at its ``size``;
* fetched batches go to an :class:`ObjectCache` shared by the broker's topics and bounded in
  bytes (least recently used first out); while a subscription reads an object, the next objects
  are fetched ahead (``prefetch_bytes``);
* reads never block the event loop: :meth:`RemoteLog.read_cached` answers from the cache or
  returns ``None`` after starting the fetch, and wakes its listeners when the fetch ends.

A failed fetch (object missing, store unreachable, bytes that fail a check) is logged once per
episode and tried again after :data:`RETRY_AFTER_S`. An object whose descriptor says it was
deleted once the topic's table held it (``object_deleted_at``, the ``after-commit`` object
lifecycle) is never fetched: its offsets are read from the table
(:mod:`broker.dispatch.read_position`).
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from danube_pipeline.errors import CorruptRecordError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.values import ObjectDescriptor, UnavailableRange
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore, segment_object_path
from danube_pipeline.outages import OutageLog
from danube_pipeline.format.records import SEGMENT_HEADER_SIZE, SegmentHeader
from danube_pipeline.format.segments import StoredBatch, iter_stored_batches

from broker.storage.table_reads import TopicTable
from broker.tasks import spawn

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
"""Default bound of the broker's :class:`ObjectCache`, in bytes of batches."""
DEFAULT_PREFETCH_BYTES = 16 * 1024 * 1024
"""How far past the object being read the next objects are fetched, in object bytes."""
RETRY_AFTER_S = 1.0
"""A failed fetch is tried again after this many seconds."""


@dataclass(slots=True)
class FetchedRange:
    """Batches of one object, from a seek position to the object's end, checked.

    Attributes:
        object_id: ``data-{start}-{end}.dnb1``.
        bases: each batch's base offset, ascending (for bisect).
        batches: the batches.
        size_bytes: bytes of the batches (what the cache counts).
        read_bytes: bytes read from the object store for them (the segment header included).
    """

    object_id: str
    bases: list[int]
    batches: list[StoredBatch]
    size_bytes: int
    read_bytes: int

    @property
    def first_offset(self) -> int:
        return self.bases[0]


class ObjectCache:
    """Fetched object ranges of every topic, least recently used first out, at most
    ``max_bytes`` of batches (one range larger than the bound is kept alone).

    Attributes:
        hits, misses: reads answered from the cache, and reads that found their object not
            fetched yet (they start its fetch or wait for the one under way).
        fetched_bytes: bytes read from object storage since start (segment headers included).
    """

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.max_bytes = max_bytes
        self._ranges: OrderedDict[str, FetchedRange] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.fetched_bytes = 0

    @property
    def size_bytes(self) -> int:
        """Bytes of batches held."""
        return self._bytes

    def get(self, path: str) -> FetchedRange | None:
        """The range held for the object at ``path`` (marked recently used), or ``None``."""
        found = self._ranges.get(path)
        if found is not None:
            self._ranges.move_to_end(path)
        return found

    def peek(self, path: str) -> FetchedRange | None:
        """As :meth:`get`, without touching the recency order."""
        return self._ranges.get(path)

    def put(self, path: str, fetched: FetchedRange) -> None:
        """Hold ``fetched`` for ``path`` (replacing what was held), evicting the least recently
        used ranges beyond ``max_bytes``."""
        old = self._ranges.pop(path, None)
        if old is not None:
            self._bytes -= old.size_bytes
        self._ranges[path] = fetched
        self._bytes += fetched.size_bytes
        while self._bytes > self.max_bytes and len(self._ranges) > 1:
            _, evicted = self._ranges.popitem(last=False)
            self._bytes -= evicted.size_bytes

    def drop(self, path: str) -> None:
        """Forget the range of ``path`` (its object was deleted)."""
        old = self._ranges.pop(path, None)
        if old is not None:
            self._bytes -= old.size_bytes


def seek_position(descriptor: ObjectDescriptor, offset: int) -> tuple[int, int]:
    """Where to start reading ``descriptor``'s object to find ``offset``.

    Args:
        descriptor: a completed descriptor holding ``offset``.
        offset: the offset wanted.

    Returns:
        ``(byte_position, base_offset)`` of the last ``offset_index`` entry at or before
        ``offset`` (§5.1), or ``(32, start_offset)`` (right after the segment header) when no
        entry is.
    """
    position, base = SEGMENT_HEADER_SIZE, descriptor.start_offset
    for entry_offset, entry_position in descriptor.offset_index:
        if entry_offset > offset:
            break
        position, base = int(entry_position), int(entry_offset)
    return position, base


def fetch_range(objects: ObjectStore, topic: TopicName, descriptor: ObjectDescriptor, position: int, base: int) -> FetchedRange:
    """Read and check the batches of ``descriptor``'s object from ``position`` to its end.

    Blocking (object-store I/O): run it in a worker thread.

    Args:
        objects: the object store.
        topic: the object's topic.
        descriptor: its completed descriptor.
        position: byte position of a batch, of its entry in a version 3 object (the leader
            epoch before it, :mod:`danube_pipeline.format.segments`; from :func:`seek_position`).
        base: that batch's base offset.

    Returns:
        The batches, from ``base`` to the descriptor's ``end_offset``.

    Raises:
        FileNotFoundError: the object is missing.
        CorruptRecordError: the bytes are not the ones described: size, MD5 (whole-object
            reads), segment header, a batch's CRC32C, or offsets not contiguous from ``base`` to
            ``end_offset``.
        OSError: the store failed.
    """
    path = segment_object_path(topic, descriptor.object_id)
    where = f"{topic.path}/{descriptor.object_id}"
    if position <= SEGMENT_HEADER_SIZE:
        data = objects.get_bytes(path)
        if len(data) != descriptor.size:
            raise CorruptRecordError(where, len(data), f"object is {len(data)} bytes, descriptor says {descriptor.size}")
        if descriptor.etag and hashlib.md5(data).hexdigest() != descriptor.etag:
            raise CorruptRecordError(where, 0, f"MD5 does not match the descriptor's etag {descriptor.etag}")
        header = SegmentHeader.decode(data, where=where)
        tail: bytes | memoryview = memoryview(data)[SEGMENT_HEADER_SIZE:]
        position = SEGMENT_HEADER_SIZE
        read_bytes = len(data)
    else:
        header = SegmentHeader.decode(objects.get_range(path, 0, SEGMENT_HEADER_SIZE), where=where)
        tail = objects.get_range(path, position)
        read_bytes = SEGMENT_HEADER_SIZE + len(tail)
        if position + len(tail) != descriptor.size:
            raise CorruptRecordError(
                where, position + len(tail), f"object is {position + len(tail)} bytes, descriptor says {descriptor.size}"
            )
    if header.start_offset != descriptor.start_offset:
        raise CorruptRecordError(where, 0, f"header starts at offset {header.start_offset}, descriptor at {descriptor.start_offset}")
    bases: list[int] = []
    batches: list[StoredBatch] = []
    expected = base
    size = 0
    for pos, batch in iter_stored_batches(tail, format_version=header.format_version, start_position=0, where=where):
        if batch.base_offset != expected:
            raise CorruptRecordError(where, position + pos, f"batch at offset {batch.base_offset}, expected {expected}")
        bases.append(batch.base_offset)
        batches.append(batch)
        size += len(batch.data)
        expected = batch.last_offset + 1
    if not batches or expected != descriptor.end_offset + 1:
        raise CorruptRecordError(where, descriptor.size, f"batches end at offset {expected - 1}, descriptor says {descriptor.end_offset}")
    return FetchedRange(descriptor.object_id, bases, batches, size, read_bytes)


class MetadataView(Protocol):
    """What :class:`RemoteLog` needs of the broker's etcd cache (``LocalCache``)."""

    def get(self, key: str) -> Any: ...

    def get_prefix(self, prefix: str) -> Mapping[str, Any]: ...

    def add_listener(self, prefix: str, callback: Callable[[Any], None]) -> Callable[[], None]: ...


class RemoteLog:
    """The offsets of one topic held in object storage, read through their descriptors.

    Args:
        topic: the topic.
        cache: the broker's ``LocalCache`` (descriptors are read from it and followed by watch).
        objects: the object store the descriptors point into.
        object_cache: the broker-wide cache of fetched ranges.
        prefetch_bytes: how many bytes of the following objects to fetch ahead of a read.
        cold_read_path: the broker's ``--cold-read-path``: with one, the topic's Iceberg table
            is a cold read source too (:attr:`table`, :mod:`broker.storage.table_reads`,
            ``docs/etcd-layout.md`` §3.10); ``None`` (a log opened only to check objects):
            none.

    Attributes:
        batches_served, records_served: what :meth:`read_cached` returned since start.
        table: the topic's table as a cold read source, or ``None``.
    """

    def __init__(
        self,
        topic: TopicName,
        *,
        cache: MetadataView,
        objects: ObjectStore,
        object_cache: ObjectCache,
        prefetch_bytes: int = DEFAULT_PREFETCH_BYTES,
        cold_read_path: str | None = None,
    ) -> None:
        self.topic = topic
        self.table = (
            TopicTable(topic, cache=cache, default_path=cold_read_path) if cold_read_path is not None else None
        )
        self.objects = objects
        self.object_cache = object_cache
        self.prefetch_bytes = prefetch_bytes
        self._cache = cache
        self._prefix = keys.objects_prefix(topic)
        self._cur_key = keys.objects_cur(topic)
        self._descriptors: list[ObjectDescriptor] = []
        self._starts: list[int] = []
        self._listeners: list[Callable[[], None]] = []
        self._fetching: set[str] = set()
        self._failed_at: dict[str, float] = {}
        self._outage = OutageLog(log, f"reading {topic.path} from object storage")
        self._closed = False
        self.batches_served = 0
        self.records_served = 0
        self._unavailable_prefix = keys.unavailable_prefix(topic)
        self.unavailable: list[UnavailableRange] = []
        self._reload()
        self._reload_unavailable()
        unwatch_objects = cache.add_listener(self._prefix, lambda _event: self._reload())
        unwatch_unavailable = cache.add_listener(self._unavailable_prefix, lambda _event: self._reload_unavailable())

        def unwatch() -> None:
            unwatch_objects()
            unwatch_unavailable()

        self._unwatch = unwatch

    # ------------------------------------------------------------------ descriptors

    def _reload(self) -> None:
        found: list[ObjectDescriptor] = []
        for key, value in self._cache.get_prefix(self._prefix).items():
            if key == self._cur_key or value is None:
                continue
            try:
                descriptor = ObjectDescriptor.from_json(value)
            except (ValueError, TypeError):
                log.warning("%s: ignoring unreadable descriptor %s", self.topic.path, key)
                continue
            if descriptor.completed and descriptor.end_offset >= descriptor.start_offset:
                found.append(descriptor)
        found.sort(key=lambda d: d.start_offset)
        gone = {d.object_id for d in self._descriptors} - {d.object_id for d in found}
        for object_id in gone:
            self.object_cache.drop(segment_object_path(self.topic, object_id))
        self._descriptors = found
        self._starts = [d.start_offset for d in found]
        self._wake()

    def _reload_unavailable(self) -> None:
        found = []
        for key, value in self._cache.get_prefix(self._unavailable_prefix).items():
            try:
                found.append(UnavailableRange.from_json(value))
            except (ValueError, TypeError):
                log.warning("%s: ignoring unreadable unavailable range %s", self.topic.path, key)
        self.unavailable = sorted(found, key=lambda r: r.start_offset)
        self._wake()

    def unavailable_at(self, offset: int) -> UnavailableRange | None:
        """The unavailable range (``docs/etcd-layout.md`` §5.5) holding ``offset``, or ``None``."""
        for rng in self.unavailable:
            if rng.start_offset <= offset <= rng.end_offset:
                return rng
        return None

    @property
    def descriptors(self) -> list[ObjectDescriptor]:
        """The completed descriptors, ascending by start offset."""
        return list(self._descriptors)

    @property
    def first_offset(self) -> int | None:
        """The first offset held in object storage, ``None`` when nothing is."""
        return self._descriptors[0].start_offset if self._descriptors else None

    @property
    def end_offset(self) -> int | None:
        """The last offset held in object storage, ``None`` when nothing is."""
        return self._descriptors[-1].end_offset if self._descriptors else None

    def descriptor_for(self, offset: int) -> ObjectDescriptor | None:
        """The completed descriptor holding ``offset``, or ``None``."""
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            return None
        d = self._descriptors[i]
        return d if offset <= d.end_offset else None

    def in_table_only(self, offset: int) -> bool:
        """Whether the descriptor holding ``offset`` says its object was deleted once the
        topic's table held it (``object_deleted_at``, ``docs/etcd-layout.md`` §5.1): only the
        table serves it."""
        d = self.descriptor_for(offset)
        return d is not None and d.in_table_only

    def next_start_after(self, offset: int) -> int | None:
        """The start of the first descriptor beginning after ``offset``, or ``None``."""
        i = bisect.bisect_right(self._starts, offset)
        return self._starts[i] if i < len(self._starts) else None

    # ------------------------------------------------------------------ reading

    def add_listener(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` when a fetch ends or the descriptors change; returns a remover."""
        self._listeners.append(callback)

        def remove() -> None:
            if callback in self._listeners:
                self._listeners.remove(callback)

        return remove

    def _wake(self) -> None:
        for callback in list(self._listeners):
            try:
                callback()
            except Exception:  # a listener must not break the reader
                log.exception("remote log listener failed")

    def read_cached(self, from_offset: int, max_records: int, *, max_bytes: int = 4 * 1024 * 1024) -> list[StoredBatch] | None:
        """Batches holding ``from_offset`` and the offsets after it, from fetched objects.

        Args:
            from_offset: the first offset wanted (the first batch may start before it).
            max_records: stop once the batches hold this many records from ``from_offset`` on.
            max_bytes: stop once this many bytes are returned (at least one batch is).

        Returns:
            The batches, contiguous, within one object; ``[]`` when no descriptor holds
            ``from_offset``; ``None`` when they are not fetched yet: a fetch is started (or
            waits out :data:`RETRY_AFTER_S` after a failure) and the listeners are called when
            it ends.
        """
        descriptor = self.descriptor_for(from_offset)
        if descriptor is None or max_records <= 0:
            return []
        path = segment_object_path(self.topic, descriptor.object_id)
        fetched = self.object_cache.get(path)
        if fetched is None or fetched.first_offset > from_offset:
            self.object_cache.misses += 1
            self._start_fetch(descriptor, from_offset)
            return None
        self.object_cache.hits += 1
        i = bisect.bisect_right(fetched.bases, from_offset) - 1
        out: list[StoredBatch] = []
        records = 0
        size = 0
        while i < len(fetched.batches) and records < max_records and (not out or size < max_bytes):
            batch = fetched.batches[i]
            out.append(batch)
            records += batch.last_offset + 1 - max(from_offset, batch.base_offset)
            size += len(batch.data)
            i += 1
        self.batches_served += len(out)
        self.records_served += records
        self._prefetch_after(descriptor)
        return out

    def _prefetch_after(self, descriptor: ObjectDescriptor) -> None:
        budget = self.prefetch_bytes
        i = bisect.bisect_right(self._starts, descriptor.start_offset)
        while i < len(self._descriptors) and budget > 0:
            d = self._descriptors[i]
            budget -= d.size
            if not d.in_table_only and self.object_cache.peek(segment_object_path(self.topic, d.object_id)) is None:
                self._start_fetch(d, d.start_offset)
            i += 1

    def _start_fetch(self, descriptor: ObjectDescriptor, offset: int) -> None:
        if self._closed or descriptor.object_id in self._fetching:
            return
        if descriptor.in_table_only:  # never fetched: only the table holds it (§5.1)
            self._outage.failed(f"object {descriptor.object_id} was deleted once the table held it; read from the table")
            asyncio.get_running_loop().call_later(RETRY_AFTER_S, self._wake)
            return
        failed_at = self._failed_at.get(descriptor.object_id)
        if failed_at is not None and time.monotonic() - failed_at < RETRY_AFTER_S:
            return
        self._fetching.add(descriptor.object_id)
        position, base = seek_position(descriptor, offset)
        spawn(self._fetch(descriptor, position, base), name=f"fetch:{self.topic.path}:{descriptor.object_id}")

    async def _fetch(self, descriptor: ObjectDescriptor, position: int, base: int) -> None:
        path = segment_object_path(self.topic, descriptor.object_id)
        try:
            fetched = await asyncio.to_thread(fetch_range, self.objects, self.topic, descriptor, position, base)
        except (OSError, CorruptRecordError, ValueError) as exc:
            self._failed_at[descriptor.object_id] = time.monotonic()
            self._outage.failed(exc)
            asyncio.get_running_loop().call_later(RETRY_AFTER_S, self._wake)
            return
        finally:
            self._fetching.discard(descriptor.object_id)
        self._failed_at.pop(descriptor.object_id, None)
        self._outage.succeeded()
        self.object_cache.fetched_bytes += fetched.read_bytes  # fetched, even if dropped below
        if not self._closed and self.descriptor_for(descriptor.start_offset) == descriptor:
            self.object_cache.put(path, fetched)
        self._wake()

    def close(self) -> None:
        """Stop following the descriptors; fetches under way are dropped when they end."""
        self._closed = True
        self._unwatch()
        if self.table is not None:
            self.table.close()
        self._listeners.clear()
