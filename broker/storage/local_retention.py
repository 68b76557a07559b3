"""Local WAL retention: sealed segments leave the broker's disk once object storage holds them.

As in Kafka's tiered storage (KIP-405, ``local.retention.bytes`` / ``local.retention.ms``),
the WAL keeps only the newest part of a topic locally; older offsets are read back from object
storage (:mod:`broker.storage.remote`). The oldest sealed segment is deleted when, and only when:

1. a completed descriptor (``docs/etcd-layout.md`` §5.1) has exactly its offsets and size,
2. its object exists in the object store with that size and MD5 etag (checked once per
   object; on ``file://`` stores the MD5 is computed from the object), or tiering deleted the
   object after verifying that the topic's table holds its records (the descriptor's
   ``object_deleted_at``, §5.1; the ``after-commit`` object lifecycle, §2.1), and
3. it falls outside local retention: the WAL is larger than the retention bytes, or the segment
   was sealed longer ago than the retention time. The limits are the broker's
   (``--local-retention-bytes``, ``--local-retention-ms``), overridden per topic by
   ``/topics/{ns}/{topic}/local_retention`` (§3.6) or for one call of ``ApplyLocalRetention``.

A sealed segment that lies wholly below the topic's first descriptor is deleted too: namespace
retention (§2.1) expired its offsets and deleted their descriptors and objects. The active
segment is never deleted. Deletion goes oldest first and stops at the first segment that must
stay, so the offsets held locally stay contiguous.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.protocols import MetadataReader
from danube_pipeline.metadata.values import ObjectDescriptor
from danube_pipeline.storage.objectstore import ObjectStore, segment_object_path
from danube_pipeline.outages import OutageLog

from broker.storage.remote import RemoteLog
from broker.storage.wal import WriteAheadLog

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RetentionLimits:
    """Local retention of one topic.

    Attributes:
        bytes: keep at most this many WAL bytes on disk (deletable segments only).
        ms: delete deletable segments sealed longer ago than this, in milliseconds.
    """

    bytes: int
    ms: int


@dataclass(frozen=True, slots=True)
class RetentionOutcome:
    """What one pass of local retention did on one topic.

    Attributes:
        deleted_segments: sealed segments deleted.
        deleted_bytes: bytes freed.
        first_local_offset: the WAL's first offset afterwards.
        wal_bytes: the WAL's size on disk afterwards.
    """

    deleted_segments: int
    deleted_bytes: int
    first_local_offset: int
    wal_bytes: int


def topic_limits(cache: MetadataReader, topic_key: str, default: RetentionLimits) -> RetentionLimits:
    """The topic's limits: its ``local_retention`` override (§3.6) field by field, else
    ``default``. An unreadable override is logged and ignored.

    Args:
        cache: the broker's cache.
        topic_key: the topic's ``/topics/{ns}/{topic}/local_retention`` key.
        default: the broker's limits.
    """
    raw = cache.get(topic_key)
    if raw is None:
        return default
    try:
        override = values.LocalRetention.from_json(raw)
    except ValueError as exc:
        log.warning("%s: unreadable local retention override %r (%s); using the broker's", topic_key, raw, exc)
        return default
    return RetentionLimits(
        bytes=default.bytes if override.bytes < 0 else override.bytes,
        ms=default.ms if override.ms < 0 else override.ms,
    )


class LocalRetention:
    """Applies local retention to the topics of one broker.

    Args:
        objects: the object store the descriptors point into.
        default: the broker's limits.
    """

    def __init__(self, objects: ObjectStore, default: RetentionLimits) -> None:
        self.objects = objects
        self.default = default
        self._verified: set[tuple[str, str, int]] = set()  # (path, etag, size) checked in the store
        self._outage = OutageLog(log, "checking tiered objects for local WAL retention")

    def limits(self, cache: MetadataReader, topic: RemoteLog) -> RetentionLimits:
        """The limits of ``topic`` (its override, else the broker's)."""
        return topic_limits(cache, keys.topic_local_retention(topic.topic), self.default)

    async def verified_in_store(self, remote: RemoteLog, descriptor: ObjectDescriptor) -> bool:
        """Whether ``descriptor``'s object exists with its size and MD5 etag (checked once per
        object; a failure to reach the store counts as not verified), or was deleted once the
        topic's table was verified to hold it (``object_deleted_at``, ``docs/etcd-layout.md`` §5.1)."""
        if descriptor.in_table_only:
            return True  # tiering verified the table holds it, then deleted the object (§5.1)
        path = segment_object_path(remote.topic, descriptor.object_id)
        key = (path, descriptor.etag or "", descriptor.size)
        if key in self._verified:
            return True
        if not descriptor.etag:
            return False
        try:
            info = await asyncio.to_thread(self.objects.info, path, compute_etag=True)
        except (OSError, ValueError) as exc:
            self._outage.failed(exc)
            return False
        self._outage.succeeded()
        if info is None or info.size_bytes != descriptor.size or info.etag != descriptor.etag:
            log.warning(
                "%s: object %s is %s, its descriptor says %d bytes, etag %s: the WAL keeps the segment",
                remote.topic.path, path,
                "missing" if info is None else f"{info.size_bytes} bytes, etag {info.etag}",
                descriptor.size, descriptor.etag,
            )
            return False
        self._verified.add(key)
        return True

    async def apply(
        self, wal: WriteAheadLog, remote: RemoteLog, limits: RetentionLimits, *, now_ms: int | None = None
    ) -> RetentionOutcome:
        """Delete the oldest sealed segments that may go (module docstring), oldest first.

        Args:
            wal: the topic's WAL.
            remote: the topic's offsets in object storage.
            limits: the retention to apply.
            now_ms: the time segment ages are measured against, ms since the epoch; default now.

        Returns:
            A :class:`RetentionOutcome`.

        Raises:
            OSError: a segment file could not be deleted (the WAL no longer serves it).
        """
        now = int(time.time() * 1000) if now_ms is None else now_ms
        deleted = 0
        freed = 0
        while True:
            sealed = wal.sealed_segments()
            if not sealed:
                break
            seg = sealed[0]
            remote_first = remote.first_offset
            expired = remote_first is not None and seg.end_offset < remote_first
            if not expired:
                descriptor = remote.descriptor_for(seg.start_offset)
                if (
                    descriptor is None
                    or descriptor.start_offset != seg.start_offset
                    or descriptor.end_offset != seg.end_offset
                ):
                    break  # not tiered yet
                if descriptor.size != seg.size_bytes:
                    log.warning(
                        "%s: segment %d..%d is %d bytes, its descriptor says %d: the WAL keeps it",
                        remote.topic.path, seg.start_offset, seg.end_offset, seg.size_bytes, descriptor.size,
                    )
                    break
                outside = wal.size_bytes > limits.bytes or now - seg.sealed_at_ms >= limits.ms
                if not outside:
                    break
                if not await self.verified_in_store(remote, descriptor):
                    break
            try:
                freed += await wal.delete_oldest_sealed(seg.start_offset)
            except ValueError:  # the WAL changed meanwhile (closed, or another pass deleted it)
                break
            deleted += 1
            log.info(
                "%s: local retention deleted WAL segment %d..%d (%s)",
                remote.topic.path, seg.start_offset, seg.end_offset,
                "expired and gone from object storage" if expired else "held in object storage",
            )
        return RetentionOutcome(deleted, freed, wal.first_offset, wal.size_bytes)
