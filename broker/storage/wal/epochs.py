"""The leader-epoch checkpoint of one topic's WAL (Kafka's ``LeaderEpochFileCache``, KIP-101).

Each entry says that the owner of leader epoch ``epoch`` wrote its first batch at
``start_offset``: the offsets of an epoch run from its start offset to the next entry's start
offset (exclusive), or to the log end for the latest epoch. A follower asks the owner where
its own latest epoch ends (:meth:`LeaderEpochCache.end_offset_for`, KIP-279) and truncates
what the owner does not hold, instead of trusting its high watermark (KIP-101).

The cache lives in the WAL directory as ``leader-epochs.json``, a JSON list of
``{"epoch": int, "start_offset": int}`` objects in ascending order, and is rewritten whole
and durably on every change (temporary file, ``fsync``, rename, directory ``fsync``:
:func:`~broker.storage.wal.segment.write_durably`). A missing file is an empty cache: a WAL
that never records an epoch never writes one. Every method does blocking file I/O; the WAL
calls them from a worker thread or before it writes.

Batches in segments of format version 3 carry their epoch too
(:mod:`danube_pipeline.format.segments`). When the WAL opens and its newest batch carries an
epoch above the cache's latest (the file was lost, or the log was written by a version of the
broker that did not record an unreplicated topic's owner epochs), the cache is rebuilt from the batches
(:meth:`LeaderEpochCache.merge_batch_epochs`), as Kafka's ``LogLoader`` rebuilds its cache
from the log. Only the segments an epoch can start in are read
(:meth:`LeaderEpochCache.rebuild_from_segments`): epochs never decrease along a log, so a segment
whose first entry carries the same epoch as the next segment's first entry holds that epoch
throughout, and recovery reads one entry of it instead of the whole file.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from danube_pipeline.format.records import EPOCH_PREFIX_SIZE, SEGMENT_HEADER_SIZE
from danube_pipeline.format.segments import has_epoch_prefix, scan_batches

from broker.storage.wal.segment import Segment, write_durably

log = logging.getLogger("broker.storage.wal.log")  # the WAL's log lines keep one logger name

EPOCHS_FILE = "leader-epochs.json"
"""Name of the checkpoint in a topic's WAL directory."""

UNDEFINED_EPOCH_OFFSET = (-1, -1)
"""What :meth:`LeaderEpochCache.end_offset_for` answers when the cache holds no epoch at or
below the one asked for (Kafka's ``UNDEFINED_EPOCH`` / ``UNDEFINED_EPOCH_OFFSET``)."""


def _entry(obj: Any, path: Path) -> tuple[int, int]:
    """One ``{"epoch", "start_offset"}`` object as ``(epoch, start_offset)``.

    Raises:
        ValueError: a field is missing, not an int, or negative.
    """
    try:
        epoch, start = obj["epoch"], obj["start_offset"]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a leader-epoch entry: {obj!r}") from exc
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, start)):
        raise ValueError(f"{path}: not a leader-epoch entry: {obj!r}")
    return epoch, start


class LeaderEpochCache:
    """The ``(epoch, start_offset)`` entries of one WAL, ascending in both (module docstring).

    Build it with :meth:`load`. Readers on the event loop may read it while a worker thread
    changes it: each change replaces :attr:`entries` in one assignment.

    Args:
        directory: the WAL directory holding ``leader-epochs.json``.
        entries: the entries, ascending by epoch and by start offset.
    """

    def __init__(self, directory: Path, entries: tuple[tuple[int, int], ...] = ()) -> None:
        self.directory = directory
        self._entries = entries

    @classmethod
    def load(cls, directory: Path, *, log_end_offset: int | None = None) -> LeaderEpochCache:
        """Read ``directory``'s checkpoint; an empty cache when there is none.

        Args:
            directory: the WAL directory.
            log_end_offset: the log's next offset, when the WAL opens: entries starting above
                it are dropped (durably, logged). The WAL records an epoch before its first
                batch, so a crash in between leaves an entry that describes no batch (Kafka's
                ``LogLoader`` truncates the cache to the log end too). An entry starting at
                ``log_end_offset`` is kept: an epoch begun before its first append.

        Raises:
            ValueError: the file is not a valid checkpoint (not JSON, a bad entry, or epochs
                or start offsets out of order); the WAL must not guess its epochs.
            OSError: the file cannot be read.
        """
        path = directory / EPOCHS_FILE
        try:
            text = path.read_text()
        except FileNotFoundError:
            return cls(directory)
        try:
            objs = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a leader-epoch checkpoint: {exc}") from exc
        if not isinstance(objs, list):
            raise ValueError(f"{path}: not a leader-epoch checkpoint: a list of entries expected")
        entries = tuple(_entry(obj, path) for obj in objs)
        for (epoch, start), (next_epoch, next_start) in zip(entries, entries[1:]):
            if next_epoch <= epoch or next_start < start:
                raise ValueError(f"{path}: entries out of order: {(epoch, start)} then {(next_epoch, next_start)}")
        cache = cls(directory, entries)
        if log_end_offset is not None and (above := [e for e in entries if e[1] > log_end_offset]):
            log.warning("WAL %s: dropping leader epochs %s above the log end %d", directory, above, log_end_offset)
            cache.truncate_from(log_end_offset + 1)
        return cache

    @property
    def path(self) -> Path:
        """The checkpoint file."""
        return self.directory / EPOCHS_FILE

    @property
    def entries(self) -> tuple[tuple[int, int], ...]:
        """Every ``(epoch, start_offset)``, ascending."""
        return self._entries

    @property
    def latest_epoch(self) -> int | None:
        """The highest epoch recorded, or ``None`` while the cache is empty."""
        return self._entries[-1][0] if self._entries else None

    def assign(self, epoch: int, start_offset: int) -> None:
        """Record that ``epoch`` starts at ``start_offset``, durably before returning.

        A no-op when ``epoch`` is already the latest. An entry of a lower epoch that starts at
        the same offset held no batch and is replaced (Kafka's ``LeaderEpochFileCache.assign``
        drops such an entry too), so every epoch but the latest covers at least one offset.

        Raises:
            ValueError: ``epoch`` is below the latest epoch, or ``start_offset`` below the
                latest entry's start offset (epochs only move forward, KIP-101).
            OSError: the checkpoint cannot be written (the cache is unchanged).
        """
        entries = self._entries
        if epoch < 0 or start_offset < 0:
            raise ValueError(f"leader epoch {epoch} at offset {start_offset}: both must be >= 0")
        if entries:
            latest, latest_start = entries[-1]
            if epoch == latest:
                return
            if epoch < latest:
                raise ValueError(f"{self.path}: leader epoch {epoch} is below the latest epoch {latest}")
            if start_offset < latest_start:
                raise ValueError(
                    f"{self.path}: leader epoch {epoch} would start at offset {start_offset}, below the start "
                    f"{latest_start} of the latest epoch {latest}"
                )
            if start_offset == latest_start:
                entries = entries[:-1]
        new = (*entries, (epoch, start_offset))
        self._write(new)
        self._entries = new
        log.info("WAL %s: leader epoch %d starts at offset %d", self.directory, epoch, start_offset)

    def merge_batch_epochs(self, epoch_starts: list[tuple[int, int]]) -> bool:
        """Merge the epochs found in the log's version 3 batches into the cache, durably.

        The batches win: each epoch they show starts at its first batch (or lower, where a
        cache entry says so: offsets in version 1/2 segments before it carry no epoch). Cache
        entries of epochs the batches do not show are kept where they fit the order (an
        epoch begun before its first append, or one of version 1/2 batches).

        Args:
            epoch_starts: ``(epoch, base_offset)`` where each run of batches of one epoch
                starts, ascending by offset (:attr:`~danube_pipeline.format.records.ScanResult.epoch_starts`
                of every version 3 segment); epoch 0 (unknown) and epochs not above the one
                before them are skipped (logged).

        Returns:
            Whether the cache changed.

        Raises:
            OSError: the checkpoint cannot be written (the cache is unchanged).
        """
        runs: dict[int, int] = {}
        latest = 0
        for epoch, start in epoch_starts:
            if epoch == 0 or epoch == latest:
                continue
            if epoch < latest:
                log.warning("WAL %s: batches of leader epoch %d at offset %d follow epoch %d; ignored",
                            self.directory, epoch, start, latest)
                continue
            runs[epoch] = start
            latest = epoch
        if not runs:
            return False
        merged: dict[int, tuple[int, bool]] = {e: (s, False) for e, s in self._entries}
        for epoch, start in runs.items():
            cached = merged.get(epoch)
            merged[epoch] = (min(start, cached[0]) if cached else start, True)
        new: list[tuple[int, int, bool]] = []  # (epoch, start, shown by the batches)
        for epoch in sorted(merged):
            start, shown = merged[epoch]
            if not shown and new and start <= new[-1][1] and new[-1][2]:
                continue  # a cache entry the batches contradict
            while new and (start < new[-1][1] or (start == new[-1][1] and not new[-1][2])):
                new.pop()  # a cache entry the batches contradict, or an epoch that held no batch
            new.append((epoch, start, shown))
        entries = tuple((epoch, start) for epoch, start, _ in new)
        if entries == self._entries:
            return False
        self._write(entries)
        # Only later epochs added (a lost checkpoint's tail, or an unreplicated topic's owner
        # epochs from before they were recorded at append) is routine; a checkpoint entry the
        # batches moved or dropped is not.
        only_added = entries[: len(self._entries)] == self._entries
        log.log(logging.INFO if only_added else logging.WARNING,
                "WAL %s: leader epochs rebuilt from the batches: %s (the checkpoint held %s)",
                self.directory, entries, self._entries)
        self._entries = entries
        return True

    def rebuild_from_segments(self, segments: Sequence[Segment]) -> bool:
        """Merge the epochs of the version 3 batches into the cache when the newest batch's
        epoch is above the cache's latest (a lost checkpoint, or epochs never recorded: module
        docstring), as Kafka's ``LogLoader`` rebuilds its cache from the log; blocking.

        Only the newest batch is read unless a rebuild is needed, and then only the segments
        an epoch can start in (:func:`batch_epoch_starts`): the cost is one small read per
        segment plus a scan of the segments where the epoch changes and of the last one, not
        a scan of the whole log.

        Args:
            segments: the WAL's segments, ascending by offset (sealed ones, then the active
                one), with their good lengths and end offsets as recovery found them.

        Returns:
            Whether the cache changed.

        Raises:
            OSError: a segment cannot be read or the checkpoint written.
        """
        kept = [seg for seg in segments if not seg.is_empty]
        if not kept or not has_epoch_prefix(kept[-1].format_version):
            return False
        newest = kept[-1]
        from_pos = newest.index.floor(newest.end)[1] if newest.index is not None else SEGMENT_HEADER_SIZE
        tail = segment_epoch_starts(newest, from_pos)
        latest = self.latest_epoch
        if not tail or tail[-1][0] == 0 or (latest is not None and latest >= tail[-1][0]):
            return False
        began = time.perf_counter()
        changed = self.merge_batch_epochs(batch_epoch_starts(kept))
        log.info("WAL %s: leader epochs of %d segments read from the batches in %.3f s",
                 self.directory, len(kept), time.perf_counter() - began)
        return changed

    def end_offset_for(self, epoch: int, log_end_offset: int) -> tuple[int, int]:
        """Where ``epoch`` ends in this log (KIP-279's ``OffsetsForLeaderEpoch`` answer).

        Args:
            epoch: the epoch asked for (a follower's latest epoch).
            log_end_offset: this log's next offset.

        Returns:
            ``(found_epoch, end_offset)``: the largest epoch at or below ``epoch`` that the
            cache holds, and the first offset after its batches: the next entry's start
            offset, or ``log_end_offset`` when it is the latest epoch (also when ``epoch`` is
            above every epoch held). :data:`UNDEFINED_EPOCH_OFFSET` ``(-1, -1)`` when the
            cache holds no epoch at or below ``epoch``. Kafka answers an epoch above the
            latest with ``UNDEFINED`` and one below the first with ``(epoch, first start)``;
            here both follow the same rule (the caller decides what to truncate).
        """
        entries = self._entries
        i = bisect.bisect_right([e for e, _ in entries], epoch) - 1
        if i < 0:
            return UNDEFINED_EPOCH_OFFSET
        found = entries[i][0]
        end = entries[i + 1][1] if i + 1 < len(entries) else log_end_offset
        return found, end

    def epoch_at(self, offset: int) -> int | None:
        """The epoch whose range holds ``offset`` (the last entry starting at or below it), or
        ``None`` when every entry starts above it (or the cache is empty)."""
        entries = self._entries
        i = bisect.bisect_right([start for _, start in entries], offset) - 1
        return entries[i][0] if i >= 0 else None

    def truncate_from(self, offset: int) -> None:
        """Drop every entry starting at or after ``offset`` (the log was cut there), durably.

        The entries are dropped in memory first (entries past the log end are meaningless), so
        a failed write leaves only the file behind; the next open drops them again.

        Raises:
            OSError: the checkpoint cannot be written.
        """
        kept = tuple(e for e in self._entries if e[1] < offset)
        if len(kept) == len(self._entries):
            return
        dropped = self._entries[len(kept):]
        self._entries = kept
        self._write(kept)
        log.info("WAL %s: leader epochs %s dropped (the log ends at %d)", self.directory, dropped, offset)

    def _write(self, entries: tuple[tuple[int, int], ...]) -> None:
        text = json.dumps([{"epoch": epoch, "start_offset": start} for epoch, start in entries])
        write_durably(self.path, (text + "\n").encode())


def segment_epoch_starts(seg: Segment, from_pos: int = SEGMENT_HEADER_SIZE) -> list[tuple[int, int]]:
    """``(epoch, base_offset)`` where each epoch's batches start in the good entries of version
    3 segment ``seg`` from byte ``from_pos`` (an entry start) through its end offset; blocking.

    Raises:
        OSError: the file cannot be read.
    """
    with open(seg.path, "rb") as f:
        f.seek(from_pos)
        data = f.read(max(seg.length - from_pos, 0))
    scan = scan_batches(data, start_position=0, epoch_prefix=True)
    return [(epoch, base) for epoch, base in scan.epoch_starts if base <= seg.end]


def first_entry_epoch(seg: Segment) -> int | None:
    """The leader epoch of version 3 segment ``seg``'s first entry (the 8 bytes after its
    header), or ``None`` when the file is too short; blocking.

    Raises:
        OSError: the file cannot be read.
    """
    fd = os.open(seg.path, os.O_RDONLY)
    try:
        raw = os.pread(fd, EPOCH_PREFIX_SIZE, SEGMENT_HEADER_SIZE)
    finally:
        os.close(fd)
    return int.from_bytes(raw, "little") if len(raw) == EPOCH_PREFIX_SIZE else None


def batch_epoch_starts(segments: Sequence[Segment]) -> list[tuple[int, int]]:
    """``(epoch, base_offset)`` where each run of one epoch's batches starts in the version 3
    segments among ``segments`` (ascending, none empty), as a scan of every batch would find
    them, for :meth:`LeaderEpochCache.merge_batch_epochs`; blocking.

    Epochs never decrease along a log (an owner appends above every batch of an earlier
    epoch, and a truncation cuts a suffix: KIP-101), so a segment whose first entry carries
    the same epoch as the next version 3 segment's first entry holds that epoch throughout:
    it gives ``(epoch, start)`` from one 8-byte read. Every other segment (an epoch starts in
    it or at the next one, and the last) is scanned (:func:`segment_epoch_starts`).

    Raises:
        OSError: a segment cannot be read.
    """
    epoch_segments = [seg for seg in segments if has_epoch_prefix(seg.format_version)]
    firsts = [first_entry_epoch(seg) for seg in epoch_segments]
    starts: list[tuple[int, int]] = []
    for i, seg in enumerate(epoch_segments):
        first = firsts[i]
        if first is not None and i + 1 < len(epoch_segments) and firsts[i + 1] == first:
            starts.append((first, seg.start))
        else:
            starts.extend(segment_epoch_starts(seg))
    return starts
