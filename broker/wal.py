"""The per-topic write-ahead log: ``dnb1`` segment files with group commit (seed ``003`` §IV).

Layout under the topic's WAL directory::

    {start:020d}.log                  the active segment (appended to)
    {start:020d}-{end:020d}.dnb1      sealed, immutable segments (uploaded unchanged as objects)

Every file is a :class:`danube_pipeline.records.SegmentHeader` followed by framed records
(:mod:`danube_pipeline.records`). Offsets are contiguous across segments.

Group commit: :meth:`WriteAheadLog.enqueue` assigns offsets at once and queues the messages;
one writer task takes everything queued since its previous write and does ONE ``os.write`` and
ONE ``os.fdatasync`` in a worker thread (so the event loop keeps accepting appends meanwhile),
then resolves every waiting future. A producer is acknowledged only after the ``fdatasync``
that covers its messages (seed ``003`` §IV "WAL Commit").

All file descriptors are opened, closed and renamed from the event loop or from the writer
while it holds the I/O lock, and reads are synchronous ``os.pread`` calls from the event loop,
so a reader never races a rename or a close.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import os
import re
import struct
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from danube_pipeline.errors import CorruptRecordError
from danube_pipeline.records import (
    RECORD_FRAME_SIZE,
    SEGMENT_HEADER_SIZE,
    Record,
    SegmentHeader,
    crc32c,
    decode_body,
    encode_record,
    scan_records,
)

log = logging.getLogger(__name__)

ACTIVE_SUFFIX = ".log"
SEALED_SUFFIX = ".dnb1"
_ACTIVE_RE = re.compile(r"^(\d{20})\.log$")
_SEALED_RE = re.compile(r"^(\d{20})-(\d{20})\.dnb1$")
_FRAME = struct.Struct("<II")

DEFAULT_INDEX_INTERVAL_BYTES = 32 * 1024
"""Distance between entries of a segment's sparse offset → byte-position index."""
_READ_CHUNK_BYTES = 1024 * 1024
_MAX_OPEN_SEALED_FDS = 64
_T = TypeVar("_T")


def active_name(start_offset: int) -> str:
    """File name of an active segment: ``{start:020d}.log``."""
    return f"{start_offset:020d}{ACTIVE_SUFFIX}"


def sealed_name(start_offset: int, end_offset: int) -> str:
    """File name of a sealed segment: ``{start:020d}-{end:020d}.dnb1`` (end inclusive)."""
    return f"{start_offset:020d}-{end_offset:020d}{SEALED_SUFFIX}"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class PendingMessage:
    """A message accepted for appending; the WAL gives it its offset.

    Attributes:
        payload: message bytes.
        publish_time_us: microseconds since the Unix epoch (already stamped by the caller).
        producer_id: u64 producer id (seed ``000`` §3.3).
        producer_name: the producer's name.
        schema_id: global schema id, 0 = none.
        schema_version: schema version, 0 = none.
        attributes: user key/value pairs.
    """

    payload: bytes
    publish_time_us: int
    producer_id: int = 0
    producer_name: str = ""
    schema_id: int = 0
    schema_version: int = 0
    attributes: Mapping[str, str] = field(default_factory=dict)

    def to_record(self, offset: int) -> Record:
        """The :class:`Record` this message becomes at ``offset``."""
        return Record(
            offset=offset,
            publish_time_us=self.publish_time_us,
            producer_id=self.producer_id,
            producer_name=self.producer_name,
            schema_id=self.schema_id,
            schema_version=self.schema_version,
            payload=self.payload,
            attributes=dict(self.attributes),
        )


@dataclass(frozen=True, slots=True)
class SealedSegment:
    """One sealed, immutable segment file.

    Attributes:
        start_offset: first offset in the file.
        end_offset: last offset in the file (inclusive).
        path: the ``.dnb1`` file.
        size_bytes: file size.
        created_at_ms: the header's creation time (ms since the epoch).
        sealed_at_ms: when it was sealed (file modification time for recovered files).
    """

    start_offset: int
    end_offset: int
    path: Path
    size_bytes: int
    created_at_ms: int
    sealed_at_ms: int

    @property
    def record_count(self) -> int:
        """Records in the segment (offsets are contiguous)."""
        return self.end_offset - self.start_offset + 1


class _SegmentIndex:
    """Sparse ``offset → byte position`` pairs of one segment, in ascending order."""

    __slots__ = ("offsets", "positions", "interval_bytes", "_last_position")

    def __init__(self, interval_bytes: int) -> None:
        self.offsets: list[int] = []
        self.positions: list[int] = []
        self.interval_bytes = interval_bytes
        self._last_position = -interval_bytes

    def add(self, offset: int, position: int) -> None:
        if position - self._last_position >= self.interval_bytes or not self.offsets:
            self.offsets.append(offset)
            self.positions.append(position)
            self._last_position = position

    def floor(self, offset: int) -> tuple[int, int]:
        """The last indexed ``(offset, position)`` at or before ``offset``; header end if none."""
        i = bisect.bisect_right(self.offsets, offset) - 1
        if i < 0:
            return (-1, SEGMENT_HEADER_SIZE)
        return self.offsets[i], self.positions[i]


class _Segment:
    """Runtime state of one segment (sealed or active)."""

    __slots__ = ("start", "end", "path", "length", "created_at_ms", "sealed_at_ms", "index", "fd")

    def __init__(self, start: int, path: Path, *, created_at_ms: int, interval_bytes: int) -> None:
        self.start = start
        self.end = start - 1  # last durable offset; start - 1 when empty
        self.path = path
        self.length = SEGMENT_HEADER_SIZE  # durable bytes
        self.created_at_ms = created_at_ms
        self.sealed_at_ms = 0
        self.index: _SegmentIndex | None = _SegmentIndex(interval_bytes)
        self.fd: int | None = None

    def info(self) -> SealedSegment:
        return SealedSegment(
            start_offset=self.start,
            end_offset=self.end,
            path=self.path,
            size_bytes=self.length,
            created_at_ms=self.created_at_ms,
            sealed_at_ms=self.sealed_at_ms,
        )


@dataclass(slots=True)
class _Pending:
    first_offset: int
    messages: Sequence[PendingMessage]
    future: asyncio.Future[tuple[int, int]]
    estimated_bytes: int


def _estimated_size(messages: Sequence[PendingMessage]) -> int:
    """Approximate encoded size (frame + fixed fields + variable parts), for segment rolling."""
    total = 0
    for m in messages:
        total += 48 + len(m.payload) + len(m.producer_name)
        for k, v in m.attributes.items():
            total += 6 + len(k) + len(v)
    return total


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _encode_batch(
    pending: Sequence[_Pending], start_position: int
) -> tuple[bytes, list[tuple[int, int]]]:
    """Encode every queued message; return the bytes and each record's (offset, position)."""
    parts: list[bytes] = []
    positions: list[tuple[int, int]] = []
    pos = start_position
    for item in pending:
        offset = item.first_offset
        for msg in item.messages:
            data = encode_record(msg.to_record(offset))
            parts.append(data)
            positions.append((offset, pos))
            pos += len(data)
            offset += 1
    return b"".join(parts), positions


async def _run_to_completion(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` in its own task and wait for its end even if the caller is cancelled
    meanwhile; the caller's cancellation is re-raised only once ``coro`` has finished."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        if not task.cancelled() and task.exception() is not None:
            log.error("operation finished during cancellation with an error: %s", task.exception())
        raise asyncio.CancelledError
    return task.result()


class WriteAheadLog:
    """Durable, append-only log of one topic, made of ``dnb1`` segment files.

    Open it with :meth:`open` and close it with :meth:`close`. ``sync_count`` and
    ``record_count`` count the ``fdatasync`` calls and records written since it was opened.
    """

    def __init__(
        self,
        directory: Path,
        *,
        segment_max_bytes: int,
        segment_max_age_s: float,
        index_interval_bytes: int = DEFAULT_INDEX_INTERVAL_BYTES,
    ) -> None:
        self.directory = directory
        self.segment_max_bytes = segment_max_bytes
        self.segment_max_age_s = segment_max_age_s
        self.index_interval_bytes = index_interval_bytes
        self.sync_count = 0
        self.record_count = 0
        self._sealed: list[_Segment] = []
        self._sealed_starts: list[int] = []
        self._active: _Segment | None = None
        self._active_first_append_s: float | None = None
        self._next_offset = 0  # next offset enqueue hands out
        self._queue: list[_Pending] = []
        self._wakeup = asyncio.Event()
        self._advanced = asyncio.Event()
        self._io_lock = asyncio.Lock()
        self._writer_task: asyncio.Task[None] | None = None
        self._timer_task: asyncio.Task[None] | None = None
        self._closed = False
        self._failed: BaseException | None = None
        self._roll_pending = False  # the active segment was sealed but no new one exists yet
        self._listeners: list[Callable[[int], None]] = []
        self._open_sealed_fds: list[_Segment] = []  # LRU of sealed segments holding an fd

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        segment_max_bytes: int = 8 * 1024 * 1024,
        segment_max_age_s: float = 60.0,
        initial_offset: int = 0,
        index_interval_bytes: int = DEFAULT_INDEX_INTERVAL_BYTES,
    ) -> WriteAheadLog:
        """Open (or create) the WAL in ``directory``, recovering its files.

        A torn or corrupt tail of the active segment is truncated (and logged); appends
        continue at the last good offset + 1.

        Args:
            directory: the topic's WAL directory, created if missing.
            segment_max_bytes: the active segment is sealed once it reaches this size.
            segment_max_age_s: a non-empty active segment is sealed once its first record is
                this old.
            initial_offset: the first offset when the WAL holds no record at all (seed ``000``
                §5.3: ``last_committed_offset + 1`` after a topic move).
            index_interval_bytes: spacing of the sparse read index.

        Sealed files whose offsets another sealed file holds entirely, and an active segment
        whose records are all in sealed files, are set aside (renamed ``*.stale``, logged).

        Raises:
            CorruptRecordError: a sealed segment's name or header is unusable, the newest one
                holds fewer records than its name says, or the active segment overlaps the
                sealed ones with records beyond them (the same offsets would exist twice).
            OSError: the directory or files cannot be read or written.
        """
        wal = cls(
            Path(directory),
            segment_max_bytes=segment_max_bytes,
            segment_max_age_s=segment_max_age_s,
            index_interval_bytes=index_interval_bytes,
        )
        await asyncio.to_thread(wal._recover, initial_offset)
        wal._writer_task = asyncio.create_task(wal._writer(), name=f"wal-writer:{directory}")
        wal._timer_task = asyncio.create_task(wal._age_timer(), name=f"wal-timer:{directory}")
        return wal

    async def close(self) -> None:
        """Write everything queued, sync, and close the files. Appends fail afterwards."""
        if self._closed:
            return
        self._closed = True
        if self._timer_task is not None:
            # Never cancel the age timer in the middle of a seal: wait for the I/O lock (held
            # for the whole seal) and cancel it while it sleeps or waits for the lock.
            async with self._io_lock:
                self._timer_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer_task
        self._wakeup.set()
        if self._writer_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer_task
        async with self._io_lock:
            active = self._active
            if active is not None and active.fd is not None:
                fd = active.fd
                active.fd = None
                await asyncio.to_thread(self._sync_and_close, fd)
            for seg in self._open_sealed_fds:
                if seg.fd is not None:
                    os.close(seg.fd)
                    seg.fd = None
            self._open_sealed_fds.clear()
        self._advanced.set()

    @staticmethod
    def _sync_and_close(fd: int) -> None:
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ recovery

    def _recover(self, initial_offset: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        sealed: list[_Segment] = []
        actives: list[tuple[int, Path]] = []
        for entry in os.scandir(self.directory):
            if m := _SEALED_RE.match(entry.name):
                start, end = int(m.group(1)), int(m.group(2))
                path = Path(entry.path)
                st = entry.stat()
                with open(path, "rb") as f:
                    header = SegmentHeader.decode(f.read(SEGMENT_HEADER_SIZE), where=str(path))
                if header.start_offset != start or end < start:
                    raise CorruptRecordError(str(path), 0, "file name disagrees with its header")
                seg = _Segment(start, path, created_at_ms=header.created_at_ms, interval_bytes=self.index_interval_bytes)
                seg.end = end
                seg.length = st.st_size
                seg.sealed_at_ms = int(st.st_mtime * 1000)
                seg.index = None  # built lazily on first read
                sealed.append(seg)
            elif m := _ACTIVE_RE.match(entry.name):
                actives.append((int(m.group(1)), Path(entry.path)))
        sealed = self._drop_covered(sealed)
        for prev, cur in zip(sealed, sealed[1:]):
            if cur.start != prev.end + 1:
                log.warning("WAL %s: gap or overlap between %s and %s", self.directory, prev.path.name, cur.path.name)
        if sealed:
            # The newest sealed file is the one a seal racing a write could have left longer
            # than its name says: check its real last offset before trusting the name.
            self._verify_sealed_end(sealed[-1])
        self._sealed = sealed
        self._sealed_starts = [s.start for s in sealed]
        sealed_end = max(s.end for s in sealed) if sealed else None
        expected_start = sealed_end + 1 if sealed_end is not None else initial_offset
        actives.sort()
        for start, path in actives[:-1]:
            log.warning("WAL %s: ignoring stale active segment %s", self.directory, path.name)
            path.rename(path.with_suffix(".stale"))
        if actives:
            start, path = actives[-1]
            self._active = self._recover_active(start, path, expected_start, empty_wal=not sealed)
        else:
            self._active = self._create_active(expected_start)
        _fsync_dir(self.directory)
        self._next_offset = self._active.end + 1
        if sealed_end is not None and self._next_offset <= sealed_end:  # never reuse a sealed offset
            raise CorruptRecordError(
                str(self._active.path), 0,
                f"next offset {self._next_offset} is not past the sealed segments' end {sealed_end}",
            )

    def _set_aside(self, path: Path, reason: str) -> None:
        stale = path.with_name(path.name + ".stale")
        log.warning("WAL %s: setting %s aside as %s: %s", self.directory, path.name, stale.name, reason)
        path.rename(stale)

    def _drop_covered(self, sealed: list[_Segment]) -> list[_Segment]:
        """Sort by ``(start, end)`` and set aside every sealed file whose whole range another
        sealed file holds (left by a copy, a restore or an interrupted seal)."""
        sealed.sort(key=lambda s: (s.start, s.end))
        kept: list[_Segment] = []
        for seg in sealed:
            if kept and kept[-1].start == seg.start:  # same start, seg.end is larger
                self._set_aside(kept.pop().path, f"its offsets are all in {seg.path.name}")
            if kept and kept[-1].end >= seg.end:
                self._set_aside(seg.path, f"its offsets are all in {kept[-1].path.name}")
                continue
            kept.append(seg)
        return kept

    def _verify_sealed_end(self, seg: _Segment) -> None:
        """Check that ``seg``'s last record is the end offset in its name.

        A file holding more records than its name says (records appended after the rename)
        is renamed to its true end, so those offsets are never handed out again. A torn or
        corrupt tail after the named end offset was never acknowledged and is cut off.

        Raises:
            CorruptRecordError: the file holds fewer records than its name says.
        """
        data = seg.path.read_bytes()
        scan = scan_records(data, expected_first_offset=seg.start, keep_positions=True)
        last = seg.start + scan.record_count - 1
        if last < seg.end:
            raise CorruptRecordError(
                str(seg.path), scan.valid_length,
                scan.error or f"holds offsets only up to {last}, its name says {seg.end}",
            )
        if scan.error is not None:
            log.warning(
                "WAL %s: truncating sealed segment %s from %d to %d bytes (records up to %d): %s",
                self.directory, seg.path.name, len(data), scan.valid_length, last, scan.error,
            )
            fd = os.open(seg.path, os.O_RDWR)
            try:
                os.ftruncate(fd, scan.valid_length)
                os.fsync(fd)
            finally:
                os.close(fd)
        if last > seg.end:
            new_path = self.directory / sealed_name(seg.start, last)
            log.error(
                "WAL %s: sealed segment %s holds records up to offset %d, past its name's end %d; "
                "renaming it to %s so those offsets are not handed out again",
                self.directory, seg.path.name, last, seg.end, new_path.name,
            )
            os.rename(seg.path, new_path)
            seg.path = new_path
            seg.end = last
        seg.length = scan.valid_length
        index = _SegmentIndex(self.index_interval_bytes)
        for offset, pos in scan.positions:
            index.add(offset, pos)
        seg.index = index

    def _recover_active(self, start: int, path: Path, expected_start: int, *, empty_wal: bool) -> _Segment:
        data = path.read_bytes()
        if sealed_mismatch := (not empty_wal and start != expected_start):
            log.warning(
                "WAL %s: active segment %s does not follow the sealed segments (expected start %d)",
                self.directory, path.name, expected_start,
            )
        try:
            header = SegmentHeader.decode(data, where=str(path))
        except CorruptRecordError as exc:
            log.warning("WAL %s: rewriting active segment %s with a fresh header: %s", self.directory, path.name, exc)
            path.unlink()
            return self._create_active(expected_start)
        if header.start_offset != start:
            log.warning("WAL %s: %s header start %d disagrees with its name", self.directory, path.name, header.start_offset)
            path.unlink()
            return self._create_active(expected_start)
        scan = scan_records(data, expected_first_offset=start, keep_positions=True)
        if not empty_wal and start < expected_start and scan.record_count:
            last = start + scan.record_count - 1
            if last < expected_start:  # every record is already in a sealed segment
                self._set_aside(path, f"offsets {start}..{last} are all in sealed segments")
                return self._create_active(expected_start)
            raise CorruptRecordError(
                str(path), 0,
                f"active segment starts at {start}, inside the sealed segments (which end at "
                f"{expected_start - 1}), and holds records up to {last}: the same offsets exist twice; "
                "refusing to open the WAL (move one of the files away by hand)",
            )
        if scan.error is not None:
            log.warning(
                "WAL %s: truncating %s from %d to %d bytes (%d good records): %s",
                self.directory, path.name, len(data), scan.valid_length, scan.record_count, scan.error,
            )
            fd = os.open(path, os.O_RDWR)
            try:
                os.ftruncate(fd, scan.valid_length)
                os.fsync(fd)
            finally:
                os.close(fd)
        if scan.record_count == 0 and (start != expected_start or sealed_mismatch):
            # Empty active segment at the wrong place (e.g. a sealed state moved the start).
            path.unlink()
            return self._create_active(expected_start)
        seg = _Segment(start, path, created_at_ms=header.created_at_ms, interval_bytes=self.index_interval_bytes)
        assert seg.index is not None
        for offset, pos in scan.positions:
            seg.index.add(offset, pos)
        seg.length = scan.valid_length
        seg.end = start + scan.record_count - 1
        seg.fd = os.open(path, os.O_RDWR | os.O_APPEND)
        if scan.record_count:
            self._active_first_append_s = header.created_at_ms / 1000.0
        return seg

    def _create_active(self, start: int) -> _Segment:
        created = _now_ms()
        path = self.directory / active_name(start)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, SegmentHeader(start_offset=start, created_at_ms=created).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        _fsync_dir(self.directory)
        seg = _Segment(start, path, created_at_ms=created, interval_bytes=self.index_interval_bytes)
        seg.fd = os.open(path, os.O_RDWR | os.O_APPEND)
        return seg

    # ------------------------------------------------------------------ appending

    @property
    def next_offset(self) -> int:
        """The offset the next enqueued message will get."""
        return self._next_offset

    @property
    def durable_end(self) -> int:
        """One past the last durable offset: every offset below it is on disk and readable."""
        assert self._active is not None
        return self._active.end + 1

    @property
    def first_offset(self) -> int:
        """The lowest offset still held locally (the first segment's start)."""
        if self._sealed:
            return self._sealed[0].start
        assert self._active is not None
        return self._active.start

    def enqueue(self, messages: Sequence[PendingMessage]) -> asyncio.Future[tuple[int, int]]:
        """Give ``messages`` contiguous offsets now and queue them for the next group commit.

        Calling this in order from one task keeps that order on disk.

        Returns:
            A future resolving to ``(first_offset, last_offset)`` after the ``fdatasync`` that
            makes them durable, or failing with the ``OSError`` of the write.

        Raises:
            ValueError: if ``messages`` is empty.
            RuntimeError: if the WAL is closed or a previous write failed unrecoverably.
        """
        if not messages:
            raise ValueError("nothing to append")
        if self._closed:
            raise RuntimeError(f"WAL {self.directory} is closed")
        if self._failed is not None:
            raise RuntimeError(f"WAL {self.directory} failed: {self._failed}")
        fut: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(self._next_offset, messages, fut, _estimated_size(messages)))
        self._next_offset += len(messages)
        self._wakeup.set()
        return fut

    async def append(self, messages: Sequence[PendingMessage]) -> tuple[int, int]:
        """Append ``messages`` and return ``(first_offset, last_offset)`` once durable.

        Cancelling the caller does not cancel the write.

        Raises:
            ValueError, RuntimeError: see :meth:`enqueue`.
            OSError: the write or ``fdatasync`` failed (nothing of the batch is kept).
        """
        return await asyncio.shield(self.enqueue(messages))

    def add_listener(self, callback: Callable[[int], None]) -> Callable[[], None]:
        """Call ``callback(durable_end)`` whenever the durable end advances; returns a remover."""
        self._listeners.append(callback)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(callback)

        return remove

    async def wait_for_offset(self, offset: int, *, timeout_s: float | None = None) -> bool:
        """Wait until ``offset`` is durable (``durable_end > offset``).

        Returns:
            True if it is, False on timeout or once the WAL is closed.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while self.durable_end <= offset and not self._closed:
            event = self._advanced
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                return False
        return self.durable_end > offset

    def _wake_waiters(self) -> None:
        """Wake every ``await self._advanced.wait()``: a write round ended (written or failed)."""
        event, self._advanced = self._advanced, asyncio.Event()
        event.set()

    def _signal_advanced(self) -> None:
        self._wake_waiters()
        end = self.durable_end
        for cb in list(self._listeners):
            try:
                cb(end)
            except Exception:  # a listener must not break the writer
                log.exception("WAL listener failed")

    async def _writer(self) -> None:
        while True:
            if not self._queue:
                if self._closed:
                    return
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            async with self._io_lock:
                if self._roll_pending:
                    try:
                        await _run_to_completion(self._finish_roll())
                    except OSError as exc:
                        self._fail_queued(exc)
                        continue
                batch = self._take_batch()
                await self._write_batch(batch)
                active = self._active
                if (
                    self._failed is None
                    and active is not None
                    and active.length >= self.segment_max_bytes
                    and active.end >= active.start
                ):
                    try:
                        await self._seal_locked()
                    except OSError:  # keep appending to the active segment; retried next write
                        log.exception("WAL %s: sealing by size failed", self.directory)

    def _take_batch(self) -> list[_Pending]:
        """Everything queued, but no more than fits the active segment (at least one append),
        so segments stay close to ``segment_max_bytes``; the rest goes after the roll."""
        assert self._active is not None
        room = self.segment_max_bytes - self._active.length
        taken = 0
        size = 0
        for item in self._queue:
            if taken and size + item.estimated_bytes > room:
                break
            size += item.estimated_bytes
            taken += 1
        batch, self._queue = self._queue[:taken], self._queue[taken:]
        return batch

    async def _write_batch(self, batch: list[_Pending]) -> None:
        active = self._active
        assert active is not None and active.fd is not None
        fd = active.fd
        start_length = active.length

        def work() -> tuple[int, list[tuple[int, int]]]:
            data, positions = _encode_batch(batch, start_length)
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fdatasync(fd)
            return len(data), positions

        try:
            size, positions = await asyncio.to_thread(work)
        except BaseException as exc:
            self._fail_batch(batch, exc, fd, start_length)
            if not isinstance(exc, Exception):
                raise
            return
        self.sync_count += 1
        self.record_count += len(positions)
        assert active.index is not None
        for offset, pos in positions:
            active.index.add(offset, pos)
        active.length = start_length + size
        active.end = positions[-1][0]
        if self._active_first_append_s is None:
            self._active_first_append_s = time.time()
        self._signal_advanced()
        for item in batch:
            if not item.future.done():
                item.future.set_result((item.first_offset, item.first_offset + len(item.messages) - 1))

    def _fail_batch(self, batch: list[_Pending], exc: BaseException, fd: int, good_length: int) -> None:
        """A write failed: drop the batch and everything queued after it (their offsets were
        never acknowledged), cut the file back, and hand the offsets out again."""
        log.error("WAL %s: write failed, failing %d queued appends: %s", self.directory, len(batch) + len(self._queue), exc)
        failed = batch + self._queue
        self._queue = []
        assert self._active is not None
        self._next_offset = self._active.end + 1
        try:
            os.ftruncate(fd, good_length)
            os.fsync(fd)
        except OSError as trunc_exc:
            self._failed = trunc_exc
            log.error("WAL %s: cannot truncate after a failed write; WAL disabled: %s", self.directory, trunc_exc)
        error = exc if isinstance(exc, Exception) else OSError(str(exc))
        for item in failed:
            if not item.future.done():
                item.future.set_exception(error)
        self._wake_waiters()  # offsets were handed back: waiters such as seal_active re-check

    def _fail_queued(self, exc: OSError) -> None:
        """No active segment to write to: fail everything queued (nothing was written)."""
        log.error("WAL %s: no active segment, failing %d queued appends: %s", self.directory, len(self._queue), exc)
        failed, self._queue = self._queue, []
        assert self._active is not None
        self._next_offset = self._active.end + 1
        for item in failed:
            if not item.future.done():
                item.future.set_exception(exc)
        self._wake_waiters()

    # ------------------------------------------------------------------ sealing

    async def seal_active(self) -> SealedSegment | None:
        """Seal the active segment now, after every message enqueued before this call is written.

        Returns:
            The new sealed segment, or ``None`` if the active segment held no record.

        Raises:
            OSError: sync, rename or directory sync failed.
        """
        target = self._next_offset
        # Wait until every append enqueued before this call is either durable or failed: a
        # failed write hands its offsets back (``_next_offset`` drops), which ends the wait too.
        while True:
            event = self._advanced
            if self._closed or self.durable_end >= min(target, self._next_offset):
                break
            await event.wait()
        async with self._io_lock:
            return await self._seal_locked()

    async def _seal_locked(self) -> SealedSegment | None:
        """Seal the active segment; the caller holds the I/O lock.

        Cancellation-safe: once started, the seal (sync, rename, new active segment, state
        update) runs to its end even if the caller is cancelled, and the caller's
        cancellation is delivered only afterwards, so the I/O lock is never released while
        the files and the in-memory state disagree.
        """
        if self._roll_pending:
            await _run_to_completion(self._finish_roll())
            return None
        active = self._active
        if active is None or active.end < active.start or active.fd is None:
            return None
        return await _run_to_completion(self._seal_steps(active))

    async def _seal_steps(self, active: _Segment) -> SealedSegment:
        assert active.fd is not None
        fd = active.fd
        new_path = self.directory / sealed_name(active.start, active.end)
        old_path = active.path

        def work() -> OSError | None:
            os.fdatasync(fd)
            os.rename(old_path, new_path)
            try:
                _fsync_dir(self.directory)
            except OSError as exc:  # the rename happened: the state must follow it
                return exc
            return None

        dir_error = await asyncio.to_thread(work)
        # From here on the file is sealed on disk: never append to it again.
        self.sync_count += 1
        if dir_error is not None:
            log.warning(
                "WAL %s: directory sync after sealing %s failed (retried with the next segment): %s",
                self.directory, new_path.name, dir_error,
            )
        create_error: OSError | None = None
        new_active: _Segment | None = None
        try:
            # Creating the new active segment syncs the directory again (covering the rename).
            new_active = await asyncio.to_thread(self._create_active, active.end + 1)
        except OSError as exc:
            create_error = exc
        # Publish the new state in one step (no await in between).
        active.path = new_path
        active.sealed_at_ms = _now_ms()
        self._sealed.append(active)
        self._sealed_starts.append(active.start)
        self._active_first_append_s = None
        if new_active is not None:
            self._active = new_active
            self._remember_sealed_fd(active)
        else:
            # ``_active`` stays the sealed segment (for reads and durable_end) until a new
            # active segment exists; the writer creates it before its next write.
            self._roll_pending = True
        log.info("WAL %s: sealed %s (%d bytes)", self.directory, new_path.name, active.length)
        if create_error is not None:
            log.error("WAL %s: cannot create the next active segment: %s", self.directory, create_error)
            raise create_error
        return active.info()

    async def _finish_roll(self) -> None:
        """Create the active segment that a seal could not create; the caller holds the lock."""
        sealed = self._active
        assert sealed is not None and self._roll_pending
        new_active = await asyncio.to_thread(self._create_active, sealed.end + 1)
        self._active = new_active
        self._roll_pending = False
        self._remember_sealed_fd(sealed)

    async def _age_timer(self) -> None:
        interval = min(1.0, max(0.01, self.segment_max_age_s / 4))
        while True:
            await asyncio.sleep(interval)
            first = self._active_first_append_s
            if first is None or time.time() - first < self.segment_max_age_s:
                continue
            try:
                async with self._io_lock:
                    if self._closed:
                        return
                    first = self._active_first_append_s
                    if first is not None and time.time() - first >= self.segment_max_age_s:
                        await self._seal_locked()
            except OSError:
                log.exception("WAL %s: sealing by age failed", self.directory)

    def sealed_segments(self) -> list[SealedSegment]:
        """Every sealed segment, ascending by start offset."""
        return [s.info() for s in self._sealed]

    def sealed_segment(self, start_offset: int) -> SealedSegment | None:
        """The sealed segment starting at ``start_offset``, or ``None``."""
        i = bisect.bisect_left(self._sealed_starts, start_offset)
        if i < len(self._sealed) and self._sealed[i].start == start_offset:
            return self._sealed[i].info()
        return None

    @property
    def active_path(self) -> Path:
        """Path of the active ``.log`` segment."""
        assert self._active is not None
        return self._active.path

    # ------------------------------------------------------------------ reading

    def _remember_sealed_fd(self, seg: _Segment) -> None:
        if seg in self._open_sealed_fds:
            self._open_sealed_fds.remove(seg)
        self._open_sealed_fds.append(seg)
        while len(self._open_sealed_fds) > _MAX_OPEN_SEALED_FDS:
            old = self._open_sealed_fds.pop(0)
            if old.fd is not None:
                os.close(old.fd)
                old.fd = None

    def _sealed_fd(self, seg: _Segment) -> int:
        if seg.fd is None:
            seg.fd = os.open(seg.path, os.O_RDONLY)
        self._remember_sealed_fd(seg)
        return seg.fd

    def _build_index(self, seg: _Segment, fd: int) -> _SegmentIndex:
        data = os.pread(fd, seg.length, 0)
        scan = scan_records(data, expected_first_offset=seg.start, keep_positions=True)
        last = seg.start + scan.record_count - 1
        if last < seg.end:
            raise CorruptRecordError(
                str(seg.path), scan.valid_length,
                scan.error or f"holds offsets up to {last}, its name says {seg.end}",
            )
        if last > seg.end or scan.error is not None:
            log.error(
                "WAL %s: sealed segment %s holds data past its end offset %d (records up to %d%s); "
                "reads stop at %d",
                self.directory, seg.path.name, seg.end, last,
                f", then: {scan.error}" if scan.error else "", seg.end,
            )
        index = _SegmentIndex(self.index_interval_bytes)
        for offset, pos in scan.positions:
            if offset > seg.end:
                break
            index.add(offset, pos)
        seg.index = index
        return index

    def read(self, from_offset: int, max_records: int, *, max_bytes: int = 4 * 1024 * 1024) -> list[Record]:
        """Read durable records starting at ``from_offset``.

        Uses each segment's sparse index, so a read costs at most one index interval of extra
        bytes. Crosses from sealed segments into later ones as needed.

        Args:
            from_offset: first offset wanted; below :attr:`first_offset` reads start there.
            max_records: at most this many records.
            max_bytes: stop once this many record bytes were read (at least one record is
                returned if available).

        Returns:
            Records with contiguous offsets (possibly empty when nothing is durable yet).

        Raises:
            CorruptRecordError: a durable record fails its CRC (disk corruption).
        """
        out: list[Record] = []
        if self._active is None or max_records <= 0:
            return out
        offset = max(from_offset, self.first_offset)
        budget = max_bytes
        while len(out) < max_records and offset < self.durable_end and budget > 0:
            seg = self._segment_for(offset)
            if seg is None:
                break
            if seg is self._active:
                assert seg.fd is not None
                fd = seg.fd
            else:
                fd = self._sealed_fd(seg)
            index = seg.index if seg.index is not None else self._build_index(seg, fd)
            got, used = self._read_segment(seg, fd, index, offset, max_records - len(out), budget)
            if not got:
                break
            out.extend(got)
            budget -= used
            offset = got[-1].offset + 1
        return out

    def _segment_for(self, offset: int) -> _Segment | None:
        active = self._active
        assert active is not None
        if offset >= active.start:
            return active
        i = bisect.bisect_right(self._sealed_starts, offset) - 1
        if i < 0:
            return None
        seg = self._sealed[i]
        return seg if offset <= seg.end else None

    def _read_segment(
        self, seg: _Segment, fd: int, index: _SegmentIndex, offset: int, max_records: int, max_bytes: int
    ) -> tuple[list[Record], int]:
        _, pos = index.floor(offset)
        end_pos = seg.length
        out: list[Record] = []
        used = 0
        buf = b""
        buf_start = pos
        while pos < end_pos and len(out) < max_records and used < max_bytes:
            rel = pos - buf_start
            if len(buf) - rel < RECORD_FRAME_SIZE:
                buf = os.pread(fd, min(_READ_CHUNK_BYTES, end_pos - pos), pos)
                buf_start, rel = pos, 0
                if len(buf) < RECORD_FRAME_SIZE:
                    raise CorruptRecordError(str(seg.path), pos, "short read of a durable frame")
            length, crc = _FRAME.unpack_from(buf, rel)
            total = RECORD_FRAME_SIZE + length
            if len(buf) - rel < total:
                buf = os.pread(fd, max(total, min(_READ_CHUNK_BYTES, end_pos - pos)), pos)
                buf_start, rel = pos, 0
                if len(buf) < total:
                    raise CorruptRecordError(str(seg.path), pos, "short read of a durable record")
            rec_offset = struct.unpack_from("<Q", buf, rel + RECORD_FRAME_SIZE)[0]
            if rec_offset > seg.end:  # never read past the segment's known end
                break
            if rec_offset >= offset:
                body = memoryview(buf)[rel + RECORD_FRAME_SIZE : rel + total]
                if crc32c(body) != crc:
                    raise CorruptRecordError(str(seg.path), pos, "CRC32C mismatch")
                out.append(decode_body(body))
                used += total
            pos += total
        return out, used
