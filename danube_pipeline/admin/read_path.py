"""``danube-admin topics set-read-path``: where a topic's subscriptions read the offsets below
their broker's local WAL (``docs/etcd-layout.md`` §3.10). Registered on the ``topics`` group by
:mod:`danube_pipeline.admin.topics`.

``topics set-read-path /NS/TOPIC objects|iceberg|auto``
    ``{"topic": str, "cold_read_path": str, "keys": [str], "revision": int}``: a partitioned
    topic's partitions are each written too (``keys`` lists every key written, in one
    transaction).
"""

from __future__ import annotations

import click

from danube_pipeline.admin.arguments import parse_topic
from danube_pipeline.admin.config import AdminError, Config, metadata_store, run
from danube_pipeline.admin.output import Json, emit
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.values import COLD_READ_PATHS, TopicReadPath
from danube_pipeline.names import TopicName
from danube_pipeline.partitions import partition_count, partition_names

__all__ = ["topics_set_read_path"]


async def _topics_set_read_path(cfg: Config, topic: TopicName, path: str) -> Json:
    """Write §3.10 for ``topic`` and, when it is partitioned, for each of its partitions (their
    brokers read their own key), in one transaction."""
    async with metadata_store(cfg) as store:
        root = await store.get(keys.topic_root(topic))
        if root is None:
            raise AdminError(f"topic {topic.path!r} not found")
        count = partition_count(root.value)
        names = [topic, *(partition_names(topic, count) if count > 0 else [])]
        value = TopicReadPath(cold_read_path=path)
        written = [keys.topic_read_path(name) for name in names]
        revision = await store.put_many([(key, value) for key in written])
    return {"topic": topic.path, "cold_read_path": path, "keys": written, "revision": revision}


@click.command("set-read-path")
@click.argument("topic", callback=parse_topic)
@click.argument("path", type=click.Choice(COLD_READ_PATHS))
@click.pass_obj
def topics_set_read_path(cfg: Config, topic: TopicName, path: str) -> None:
    """Choose where TOPIC's subscriptions read the offsets below their broker's local WAL (§3.10):
    the segment objects (objects), the topic's Iceberg table where it holds them with their
    exact bytes (iceberg), or the table with the objects on any trouble (auto). Overrides the
    brokers' --cold-read-path; applies to the next cold read."""
    doc = run(_topics_set_read_path(cfg, topic, path))
    emit(cfg, doc, lambda d: f"{d['topic']}: cold reads from {d['cold_read_path']} (revision {d['revision']})")
