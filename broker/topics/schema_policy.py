"""A topic's schema settings (``docs/etcd-layout.md`` §3.7) and ``topics_using`` (§4.2).

``/topics/{ns}/{topic}/schema`` holds :class:`~danube_pipeline.metadata.schema_values.TopicSchema`:
the subject of the first producer with a schema created on the topic, and ``allow_raw``.

* A producer **with** a schema: the topic's subject is recorded if it has none yet (the key is
  created, or its empty ``subject`` filled in, by compare-and-put), and the topic is added to
  the subject's ``topics_using``.
* A producer **without** a schema on a topic whose key names a subject is refused with
  :class:`~danube_pipeline.errors.SchemaRequiredError`, unless ``allow_raw`` is true. Its
  messages then carry schema id 0 and are never decoded with the topic's schema.
* ``allow_raw`` is set by ``Admin.SetTopicSchemaPolicy`` (``danube-admin topics
  set-schema-policy TOPIC --allow-raw``), on any broker: the key is written in etcd and the
  topic's owner reads it from its cache at the next ``CreateProducer``. On a partitioned topic
  it is set on every partition (producers publish to the partitions).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from danube_pipeline.errors import SchemaRequiredError, TopicNotFoundError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.schema_values import TopicSchema
from danube_pipeline.names import TopicName
from danube_pipeline.partitions import partition_names
from danube_pipeline.schemas.registry import RegisteredSchema, SchemaRegistry

from broker.cluster.partitions import topic_partitions

__all__ = ["check_producer_schema", "set_topic_schema_policy", "topic_schema"]

log = logging.getLogger(__name__)


class _Broker(Protocol):
    cache: LocalCache
    store: MetadataStore
    registry: SchemaRegistry


def topic_schema(broker: _Broker, name: TopicName) -> TopicSchema | None:
    """The topic's §3.7 settings from the cache; ``None`` if it has none (or they do not parse:
    logged, and read as none)."""
    raw = broker.cache.get(keys.topic_schema(name))
    if raw is None:
        return None
    try:
        return TopicSchema.from_json(raw)
    except ValueError as exc:
        log.warning("%s: unreadable schema settings %r (%s); ignored", name, raw, exc)
        return None


async def check_producer_schema(broker: _Broker, name: TopicName, schema: RegisteredSchema | None) -> None:
    """Apply the topic's schema settings to a producer about to be created (module docstring).

    Args:
        broker: the metadata it reads and writes (``cache``, ``store``, ``registry``): the
            producer sessions (:class:`broker.sessions.ProducerSessions`).
        name: the topic (a plain topic or a partition).
        schema: the producer's registered schema, ``None`` for a producer without one.

    Raises:
        SchemaRequiredError: no schema, on a topic with a subject that does not allow raw
            messages.
        MetadataStoreError: etcd unreachable (recording the subject or ``topics_using``).
    """
    settings = topic_schema(broker, name)
    if schema is None:
        if settings is not None and settings.subject and not settings.allow_raw:
            raise SchemaRequiredError(name.path, settings.subject)
        return
    if settings is None or not settings.subject:
        await _record_subject(broker, name, schema.subject)
    await broker.registry.add_topic(schema.subject, name.path)


async def _record_subject(broker: _Broker, name: TopicName, subject: str) -> None:
    key = keys.topic_schema(name)
    while True:
        kv = await broker.store.get(key)
        if kv is None:
            if await broker.store.put_if_absent(key, TopicSchema(subject=subject)):
                return
            continue
        try:
            current = TopicSchema.from_json(kv.value)
        except ValueError:
            current = TopicSchema()
        if current.subject:
            return
        updated = dataclasses.replace(current, subject=subject)
        if await broker.store.compare_and_put(key, updated, expected_mod_revision=kv.mod_revision):
            return


async def set_topic_schema_policy(broker: _Broker, name: TopicName, *, allow_raw: bool) -> list[tuple[str, TopicSchema]]:
    """Set ``allow_raw`` in the topic's §3.7 key (of every partition of a partitioned topic).

    Args:
        broker: the broker core.
        name: the topic.
        allow_raw: whether producers without a schema may publish once the topic has a subject.

    Returns:
        ``(topic path, settings now stored)`` for each topic written.

    Raises:
        TopicNotFoundError: the topic does not exist.
        MetadataStoreError: etcd unreachable.
    """
    root = keys.topic_root(name)
    if not broker.cache.contains(root) and await broker.store.get(root) is None:
        raise TopicNotFoundError(name.path)
    count = await topic_partitions(broker, name)
    targets = partition_names(name, count) if count else [name]
    return [(target.path, await _set_allow_raw(broker, target, allow_raw)) for target in targets]


async def _set_allow_raw(broker: _Broker, name: TopicName, allow_raw: bool) -> TopicSchema:
    key = keys.topic_schema(name)
    while True:
        kv = await broker.store.get(key)
        try:
            current = TopicSchema.from_json(kv.value) if kv is not None else TopicSchema()
        except ValueError:
            current = TopicSchema()
        if kv is not None and current.allow_raw == allow_raw:
            return current
        updated = dataclasses.replace(current, allow_raw=allow_raw)
        expected = kv.mod_revision if kv is not None else 0
        if await broker.store.compare_and_put(key, updated, expected_mod_revision=expected):
            return updated
