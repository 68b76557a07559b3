"""A topic's object descriptors (``docs/etcd-layout.md`` §5.1, §5.2), read back from etcd and
written with compare-and-set, and its unavailable ranges (§5.5).

Two tiering writers may run at once (the continuous writer and the Dagster asset): a new
descriptor is only ever created (:func:`create_descriptor`), never written over one another
writer made; it is completed only if it is still what this writer read or created
(:func:`complete_descriptor`); and ``objects/cur`` only moves forward. A write that loses such
a compare reports it, and the caller reads again: the other writer did the work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import ObjectDescriptor, ObjectsCursor, UnavailableRange
from danube_pipeline.names import TopicName


async def read_descriptors(store: MetadataStore, topic: TopicName) -> tuple[list[ObjectDescriptor], str | None]:
    """Every object descriptor of ``topic`` and the ``objects/cur`` pointer.

    Returns:
        The descriptors sorted by ``start_offset``, and ``objects/cur``'s ``start`` (the
        20-digit padded offset) or ``None`` when it is not written yet.

    Raises:
        MetadataStoreError: etcd failed.
        ValueError: a value under ``.../objects/`` is not a descriptor.
    """
    read = await read_descriptors_with_revisions(store, topic)
    return read.descriptors, read.cur


@dataclasses.dataclass(frozen=True, slots=True)
class DescriptorsRead:
    """A topic's descriptors as read at one etcd revision, with what a compare needs.

    Attributes:
        descriptors: the descriptors, sorted by ``start_offset``.
        mod_revisions: ``start_offset -> mod_revision`` of each descriptor's key.
        cur: ``objects/cur``'s padded ``start``, ``None`` when it is not written yet.
    """

    descriptors: list[ObjectDescriptor]
    mod_revisions: dict[int, int]
    cur: str | None


async def read_descriptors_with_revisions(store: MetadataStore, topic: TopicName) -> DescriptorsRead:
    """Every object descriptor of ``topic`` with its key's mod revision, and ``objects/cur``.

    Raises:
        MetadataStoreError: etcd failed.
        ValueError: a value under ``.../objects/`` is not a descriptor.
    """
    kvs, _ = await store.get_prefix(keys.objects_prefix(topic))
    cur_key = keys.objects_cur(topic)
    descriptors: list[ObjectDescriptor] = []
    mod_revisions: dict[int, int] = {}
    cur: str | None = None
    for kv in kvs:
        if kv.key == cur_key:
            cur = ObjectsCursor.from_json(kv.value).start
        else:
            descriptor = ObjectDescriptor.from_json(kv.value)
            descriptors.append(descriptor)
            mod_revisions[descriptor.start_offset] = kv.mod_revision
    descriptors.sort(key=lambda d: d.start_offset)
    return DescriptorsRead(descriptors, mod_revisions, cur)


async def create_descriptor(store: MetadataStore, topic: TopicName, descriptor: ObjectDescriptor) -> int | None:
    """Create ``descriptor``'s key if it does not exist (§5.1): never over another writer's.

    Returns:
        The key's mod revision after the write, or ``None`` when the key exists already.

    Raises:
        MetadataStoreError: etcd failed.
    """
    key = keys.object_descriptor(topic, descriptor.start_offset)
    return await store.transaction(modified={key: 0}, puts=[(key, descriptor)])


async def complete_descriptor(
    store: MetadataStore, topic: TopicName, descriptor: ObjectDescriptor, *, expected_mod_revision: int
) -> bool:
    """Write the completed ``descriptor`` iff its key still has ``expected_mod_revision``, and in
    the same transaction move ``objects/cur`` (§5.2) to it when it is newer than the cursor,
    guarded by the cursor's mod revision: the cursor never moves backwards. A cursor another
    writer moved meanwhile is read again.

    Args:
        store: etcd.
        topic: the topic.
        descriptor: the completed descriptor.
        expected_mod_revision: the descriptor key's mod revision this writer read or created.

    Returns:
        True if written; False if the descriptor changed (or was deleted) meanwhile: another
        writer completed it, or retention deleted it. Nothing is written then.

    Raises:
        MetadataStoreError: etcd failed.
        ValueError: ``objects/cur`` holds no cursor.
    """
    key = keys.object_descriptor(topic, descriptor.start_offset)
    cur_key = keys.objects_cur(topic)
    while True:
        cur = await store.get(cur_key)
        puts: list[tuple[str, ObjectDescriptor | ObjectsCursor]] = [(key, descriptor)]
        guards = {key: expected_mod_revision}
        if cur is None or int(ObjectsCursor.from_json(cur.value).start) < descriptor.start_offset:
            puts.append((cur_key, ObjectsCursor(start=keys.pad_offset(descriptor.start_offset))))
            guards[cur_key] = cur.mod_revision if cur is not None else 0
        if await store.transaction(modified=guards, puts=puts) is not None:
            return True
        now = await store.get(key)
        if now is None or now.mod_revision != expected_mod_revision:
            return False


async def read_unavailable_ranges(store: MetadataStore, topic: TopicName) -> list[UnavailableRange]:
    """Every unavailable range of ``topic`` (``docs/etcd-layout.md`` §5.5), ascending.

    Raises:
        MetadataStoreError: etcd failed.
        ValueError: a value under ``.../unavailable/`` is not a range.
    """
    kvs, _ = await store.get_prefix(keys.unavailable_prefix(topic))
    return sorted((UnavailableRange.from_json(kv.value) for kv in kvs), key=lambda r: r.start_offset)


def passable(ranges: Sequence[UnavailableRange], start: int, end: int) -> bool:
    """Whether every offset of ``start..end`` (inclusive) may be passed over: it was never
    handed out (above a range's ``last_written``) or its range was abandoned (§5.5). An empty
    interval is passable."""
    covered = start
    for rng in sorted(ranges, key=lambda r: r.start_offset):
        low = rng.start_offset if rng.abandoned else rng.unused_from()
        if low is not None and low <= covered <= rng.end_offset:
            covered = rng.end_offset + 1
    return covered > end


def blocking_range(ranges: Sequence[UnavailableRange], start: int, end: int) -> UnavailableRange | None:
    """The first range overlapping ``start..end`` whose offsets may still arrive (neither
    abandoned nor known to be unused there), or ``None``."""
    for rng in sorted(ranges, key=lambda r: r.start_offset):
        if rng.abandoned or rng.end_offset < start or rng.start_offset > end:
            continue
        unused = rng.unused_from()
        if unused is None or max(start, rng.start_offset) < unused:
            return rng
    return None
