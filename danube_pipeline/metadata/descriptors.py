"""Reading a topic's object descriptors (``docs/etcd-layout.md`` §5.1, §5.2) and unavailable
ranges (§5.5) back from etcd."""

from __future__ import annotations

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
    kvs, _ = await store.get_prefix(keys.objects_prefix(topic))
    cur_key = keys.objects_cur(topic)
    descriptors: list[ObjectDescriptor] = []
    cur: str | None = None
    for kv in kvs:
        if kv.key == cur_key:
            cur = ObjectsCursor.from_json(kv.value).start
        else:
            descriptors.append(ObjectDescriptor.from_json(kv.value))
    descriptors.sort(key=lambda d: d.start_offset)
    return descriptors, cur


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
