"""Released segments: the WALs of topics this broker gave up, kept until they are tiered.

When a topic leaves this broker (released, drained, or fenced), its WAL directory moves to
``data_dir/released/{ns}/{topic}/{released at, ms}/`` (:attr:`ReleasedSegments.directory`).
Its sealed segments are served from there over ``ListSealedSegments`` / ``ReadSegment``
(``released``) so tiering can still copy them, and deleted by :meth:`ReleasedSegments.retain`
once object storage holds them or their offsets expired (``docs/etcd-layout.md`` §5.3, §5.5).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from pathlib import Path

from danube_pipeline.format.records import SEGMENT_HEADER_SIZE
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore

from broker.config import BrokerConfig
from broker.storage.local_retention import LocalRetention
from broker.storage.remote import ObjectCache, RemoteLog
from broker.storage.wal.segment import SEALED_NAME_RE, fsync_dir, make_dirs_durable

__all__ = ["ReleasedSegments"]

log = logging.getLogger(__name__)

_MOVE_ATTEMPTS = 3
"""Renames tried by :meth:`ReleasedSegments.move` when :meth:`ReleasedSegments.retain` removed
the (empty) target directory in between."""


class ReleasedSegments:
    """The released WAL directories of one broker.

    Args:
        config: the broker's configuration (``data_dir``, ``wal_dir``).
        cache: the LocalCache, for the topics' descriptors.
        objects: the object store the segments are tiered to.
        object_cache: the broker's cache of object ranges.
        local_retention: checks that an object holds a segment.
    """

    def __init__(
        self,
        config: BrokerConfig,
        *,
        cache: LocalCache,
        objects: ObjectStore,
        object_cache: ObjectCache,
        local_retention: LocalRetention,
    ) -> None:
        self._config = config
        self._cache = cache
        self._objects = objects
        self._object_cache = object_cache
        self._local_retention = local_retention

    @property
    def directory(self) -> Path:
        """Where the WAL directories of released topics are kept until their segments are
        tiered: ``data_dir/released/{ns}/{topic}/{released at, ms}/``."""
        return self._config.data_dir / "released"

    def segments(self, name: TopicName) -> list[tuple[Path, int, int, int]]:
        """Sealed segments kept from earlier ownerships of ``name``:
        ``(path, start_offset, end_offset, size_bytes)``, ascending by start offset."""
        base = self.directory / name.namespace / name.topic
        found = []
        if base.is_dir():
            for release in base.iterdir():
                if not release.is_dir():
                    continue
                for f in release.iterdir():
                    m = SEALED_NAME_RE.fullmatch(f.name)
                    if m is not None:
                        found.append((f, int(m.group(1)), int(m.group(2)), f.stat().st_size))
        return sorted(found, key=lambda t: t[1])

    async def move_off_loop(self, name: TopicName) -> Path | None:
        """:meth:`move` in a worker thread: its directory syncs never stall the event loop
        (lease keep-alives run there).

        Raises:
            OSError: see :meth:`move`.
        """
        return await asyncio.to_thread(self.move, name)

    def move(self, name: TopicName) -> Path | None:
        """Move the topic's WAL directory to :attr:`directory` (its sealed segments are
        served for tiering from there); ``None`` when there is none.

        Durable when it returns: the directories created under :attr:`directory` are synced
        into their parents, and both parents of the rename are synced, so a power cut leaves
        the WAL in exactly one of the two places.

        It runs in a worker thread while :meth:`retain` may run on the event loop, and
        :meth:`retain` removes a topic's directory under :attr:`directory` once it is empty:
        between creating that directory and the rename. The rename then fails with
        ``FileNotFoundError`` while the WAL is still in place; the directory is created again
        and the rename retried (at most :data:`_MOVE_ATTEMPTS` times).

        Raises:
            OSError: a directory cannot be created or synced, or the rename failed.
        """
        wal_dir = self._config.wal_dir / name.namespace / name.topic
        if not wal_dir.exists():
            return None
        target = self.directory / name.namespace / name.topic / str(time.time_ns() // 1_000_000)
        for attempt in range(_MOVE_ATTEMPTS):
            make_dirs_durable(target.parent)
            try:
                os.replace(wal_dir, target)
                break
            except FileNotFoundError:
                if not wal_dir.exists() or attempt == _MOVE_ATTEMPTS - 1:
                    raise
                log.info("topic %s: released directory removed under the move (retain); creating it again", name)
        fsync_dir(target.parent)
        fsync_dir(wal_dir.parent)
        return target

    async def retain(self) -> int:
        """Delete the released segments whose object is verified in object storage, or whose
        offsets expired (below the topic's first descriptor), and the directories left empty.

        Returns:
            The segment files deleted.

        Raises:
            OSError: a file could not be deleted.
        """
        deleted = 0
        base = self.directory
        if not base.is_dir():
            return 0
        for topic_dir in sorted(p for ns in base.iterdir() if ns.is_dir() for p in ns.iterdir() if p.is_dir()):
            try:
                name = TopicName.parse(f"/{topic_dir.parent.name}/{topic_dir.name}")
            except ValueError:
                continue
            remote = RemoteLog(
                name, cache=self._cache, objects=self._objects, object_cache=self._object_cache, prefetch_bytes=0
            )
            try:
                for path, start, end, size in self.segments(name):
                    expired = remote.first_offset is not None and end < remote.first_offset
                    if not expired:
                        d = remote.descriptor_for(start)
                        if d is None or (d.start_offset, d.end_offset, d.size) != (start, end, size):
                            continue
                        if not await self._local_retention.verified_in_store(remote, d):
                            continue
                    await asyncio.to_thread(path.unlink)
                    deleted += 1
                    log.info("%s: released segment %s deleted: %s", name, path.name,
                             "expired" if expired else "held in object storage")
            finally:
                remote.close()
            for release in list(topic_dir.iterdir()):
                # Gone once nothing is left but empty active segments (a header, no record).
                if release.is_dir() and all(
                    f.suffix == ".log" and f.stat().st_size <= SEGMENT_HEADER_SIZE for f in release.iterdir()
                ):
                    await asyncio.to_thread(shutil.rmtree, release, True)
            with contextlib.suppress(OSError):
                topic_dir.rmdir()
        return deleted
