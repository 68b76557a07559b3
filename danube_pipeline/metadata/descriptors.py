"""Reading a topic's object descriptors (``docs/etcd-layout.md`` §5.1, §5.2) back from etcd."""

from __future__ import annotations

from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import ObjectDescriptor, ObjectsCursor
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
