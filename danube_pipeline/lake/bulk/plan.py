"""Which segment objects a bulk load reads: step 1 of :mod:`danube_pipeline.lake.bulk`.

:func:`plan_objects` picks the topic's completed object descriptors (``docs/etcd-layout.md``
§5.1) above the target table's committed end offset (and from ``from_offset``). They must be
contiguous, and the first must continue the table, with the same rule as tiering: a hole is
passed over only when its offsets were never handed out or were abandoned (§5.5), or lie below
the first descriptor retention left.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from danube_pipeline.errors import DanubeError, OffsetRangeError
from danube_pipeline.metadata.descriptors import passable
from danube_pipeline.metadata.values import ObjectDescriptor, UnavailableRange
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import segment_object_path

__all__ = ["BulkLoadConflictError", "BulkLoadError", "BulkObject", "plan_objects"]


class BulkLoadError(DanubeError):
    """A bulk load cannot run as asked (the message says why); nothing was committed."""

    def __init__(self, topic: str, reason: str) -> None:
        self.topic = topic
        self.reason = reason
        super().__init__(f"bulk load of {topic}: {reason}")


class BulkLoadConflictError(BulkLoadError):
    """Another writer committed to the table while the load ran, every attempt.

    The staged snapshots were not published; running the load again continues after what the
    other writer committed.
    """

    retriable = True


@dataclass(frozen=True, slots=True)
class BulkObject:
    """One segment object to read, as a Spark task sees it (from its §5.1 descriptor).

    Attributes:
        object_id: ``data-{start}-{end}.dnb1``.
        path: the object's path in the store (:func:`~danube_pipeline.storage.objectstore.segment_object_path`).
        size_bytes: the descriptor's size.
        etag: the descriptor's MD5 hex, or ``None``.
        start_offset: first offset in the object.
        end_offset: last offset in the object (inclusive).
    """

    object_id: str
    path: str
    size_bytes: int
    etag: str | None
    start_offset: int
    end_offset: int



def plan_objects(
    topic: TopicName,
    descriptors: Sequence[ObjectDescriptor],
    ranges: Sequence[UnavailableRange],
    *,
    committed: int | None,
    from_offset: int | None = None,
) -> tuple[int | None, list[BulkObject]]:
    """The objects a load reads, and the first offset it appends.

    Args:
        topic: the topic whose descriptors these are.
        descriptors: its object descriptors (incomplete ones are ignored), §5.1.
        ranges: its unavailable ranges, §5.5.
        committed: the target table's committed end offset, ``None`` for a new or empty table.
        from_offset: load from this offset on (a first load or a replay that skips history);
            ``None``: from the first retained object, or after ``committed``.

    Returns:
        ``(first offset to append, objects)``; ``(None, [])`` when nothing is pending.

    Raises:
        OffsetRangeError: the objects leave a gap, the first one does not continue the table,
            or ``from_offset`` lies past the committed end offset + 1 (that would skip offsets).
        BulkLoadError: ``from_offset`` is negative, or an object to load was deleted under the
            ``after-commit`` lifecycle (its offsets live only in the topic's table).
    """
    if from_offset is not None and from_offset < 0:
        raise BulkLoadError(topic.path, f"from_offset must be >= 0, got {from_offset}")
    completed = sorted((d for d in descriptors if d.completed), key=lambda d: d.start_offset)
    if not completed:
        return None, []
    if (
        committed is not None
        and from_offset is not None
        and from_offset > committed + 1
        and not passable(ranges, committed + 1, from_offset - 1)
    ):
        raise OffsetRangeError(committed + 1, from_offset, f"{topic.path} from_offset")
    start = completed[0].start_offset
    if from_offset is not None:
        start = max(start, from_offset)
    if committed is not None:
        start = max(start, committed + 1)
    chosen = [d for d in completed if d.end_offset >= start]
    if not chosen:
        return None, []
    start = max(start, chosen[0].start_offset)
    deleted = [d for d in chosen if d.object_deleted_at is not None]
    if deleted:
        raise BulkLoadError(
            topic.path,
            f"{len(deleted)} of the objects to load ({deleted[0].object_id} first) were deleted once the topic's "
            f"table held their offsets (object_lifecycle after-commit, docs/etcd-layout.md §5.1); a load into "
            f"another table can start at from_offset {deleted[-1].end_offset + 1}",
        )
    if committed is not None and chosen[0].start_offset > committed + 1:
        expired = committed + 1 < completed[0].start_offset
        if not expired and not passable(ranges, committed + 1, chosen[0].start_offset - 1):
            raise OffsetRangeError(committed + 1, chosen[0].start_offset, f"{topic.path}/{chosen[0].object_id}")
    for prev, d in itertools.pairwise(chosen):
        if d.start_offset != prev.end_offset + 1 and not passable(ranges, prev.end_offset + 1, d.start_offset - 1):
            raise OffsetRangeError(prev.end_offset + 1, d.start_offset, f"{topic.path}/{d.object_id}")
    return start, [
        BulkObject(d.object_id, segment_object_path(topic, d.object_id), d.size, d.etag, d.start_offset, d.end_offset)
        for d in chosen
    ]
