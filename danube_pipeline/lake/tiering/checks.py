"""What the asset checks compare: descriptors against each other and the object store.

:func:`descriptor_gaps` finds completed descriptors that are not contiguous,
:func:`descriptor_record_count` counts the records they cover (to compare with the table),
and :func:`object_mismatches` finds objects that are missing or not the size recorded
(``docs/etcd-layout.md`` §5.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from danube_pipeline.metadata.values import ObjectDescriptor
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore, segment_object_path

__all__ = [
    "DescriptorGap",
    "ObjectMismatch",
    "completed_descriptors",
    "descriptor_gaps",
    "descriptor_record_count",
    "object_mismatches",
]


def completed_descriptors(descriptors: Sequence[ObjectDescriptor]) -> list[ObjectDescriptor]:
    """The completed descriptors, in offset order.

    Args:
        descriptors: a topic's object descriptors (completed or not).

    Returns:
        Those with ``completed=true``, sorted by ``start_offset``.
    """
    return sorted((d for d in descriptors if d.completed), key=lambda d: d.start_offset)


@dataclass(frozen=True, slots=True)
class DescriptorGap:
    """A completed descriptor that does not start right after the one before it.

    Attributes:
        object_id: the descriptor's object, ``data-{start}-{end}.dnb1``.
        expected_start_offset: the previous completed descriptor's end offset + 1.
        start_offset: where the descriptor starts instead (lower: overlap; higher: gap).
    """

    object_id: str
    expected_start_offset: int
    start_offset: int


def descriptor_gaps(descriptors: Sequence[ObjectDescriptor]) -> list[DescriptorGap]:
    """Where the completed descriptors are not contiguous (``docs/etcd-layout.md`` §5.1).

    Args:
        descriptors: a topic's object descriptors (incomplete ones are ignored).

    Returns:
        One :class:`DescriptorGap` per completed descriptor whose start offset is not the
        previous completed descriptor's end offset + 1; empty when they are contiguous.
    """
    done = completed_descriptors(descriptors)
    return [
        DescriptorGap(d.object_id, prev.end_offset + 1, d.start_offset)
        for prev, d in zip(done, done[1:])
        if d.start_offset != prev.end_offset + 1
    ]


def descriptor_record_count(descriptors: Sequence[ObjectDescriptor], *, from_offset: int | None = None) -> int:
    """Records the completed descriptors cover, ``end_offset - start_offset + 1`` each, counting
    only offsets at or above ``from_offset`` when it is given.

    Args:
        descriptors: a topic's object descriptors (incomplete ones are ignored).
        from_offset: the first offset to count (e.g. where retention left the table), or
            ``None`` for every offset.

    Returns:
        The record count.
    """
    return sum(
        max(0, d.end_offset - max(d.start_offset, from_offset if from_offset is not None else d.start_offset) + 1)
        for d in completed_descriptors(descriptors)
    )


@dataclass(frozen=True, slots=True)
class ObjectMismatch:
    """A completed descriptor whose object is missing or not the size it records.

    Attributes:
        object_id: ``data-{start}-{end}.dnb1``.
        recorded_size_bytes: the size the descriptor records.
        stored_size_bytes: the object's size in the store, ``None`` when it is missing.
    """

    object_id: str
    recorded_size_bytes: int
    stored_size_bytes: int | None


def object_mismatches(
    topic: TopicName, descriptors: Sequence[ObjectDescriptor], objects: ObjectStore
) -> list[ObjectMismatch]:
    """Completed descriptors whose object is missing or has another size than recorded.

    Incomplete descriptors are ignored: their object may legitimately not be written yet; so
    are those marked ``object_deleted_at`` (§5.1): the table holds their offsets instead.

    Args:
        topic: the topic the descriptors belong to.
        descriptors: its object descriptors.
        objects: the object store the objects were written to.

    Returns:
        One :class:`ObjectMismatch` per missing or resized object, in offset order.

    Raises:
        OSError: the object store failed.
    """
    found: list[ObjectMismatch] = []
    for d in completed_descriptors(descriptors):
        if d.in_table_only:
            continue
        info = objects.info(segment_object_path(topic, d.object_id))
        stored = info.size_bytes if info is not None else None
        if stored != d.size:
            found.append(ObjectMismatch(d.object_id, d.size, stored))
    return found
