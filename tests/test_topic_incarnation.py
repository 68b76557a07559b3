"""A deleted and re-created topic never meets its predecessor's table
(``danube_pipeline/lake/tiering/incarnation.py``).

Against a real etcd, a real broker, real segment objects and a real pyiceberg SQL catalog: the
re-created topic starts at offset 0 again, and its rows reach a new table while the old
incarnation's table is kept, renamed; tables written before tables recorded their incarnation
are adopted when their committed end offset fits the topic's objects, and retired otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from danube_pipeline.client import DanubeClient
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.lake import iceberg
from danube_pipeline.lake.freshness import table_freshness
from danube_pipeline.lake.iceberg.binding import TOPIC_INCARNATION_PROPERTY
from danube_pipeline.lake.tiering import commit_objects_to_table, tier_sealed_segments
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import TableCommit
from danube_pipeline.names import TopicName
from danube_pipeline.schemas.registry import SchemaRegistry
from danube_pipeline.storage.objectstore import ObjectStore

from tiering_helpers import FakeRegistry, put_object, record

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


def _catalog(root: Path) -> Any:
    return iceberg.load_catalog(
        name="danube", uri=f"sqlite:///{root / 'catalog.db'}", warehouse=(root / "warehouse").as_uri()
    )


def _payloads(table: Any) -> list[tuple[int, bytes]]:
    rows = table.scan(selected_fields=("_offset", "_payload")).to_arrow().to_pylist()
    return sorted((r["_offset"], r["_payload"]) for r in rows)


async def _produce(client: DanubeClient, topic: str, tag: bytes, count: int) -> None:
    async with client.producer(topic, producer_name=tag.decode(), max_batch_messages=10) as producer:
        for i in range(count):
            producer.send_nowait(b"%s %d" % (tag, i))
        await producer.flush()


async def test_a_recreated_topic_gets_a_new_table_and_the_old_one_is_kept(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    store_url = (tmp_path / "objects").as_uri()
    broker = start_broker(extra_args=["--object-store-url", store_url])
    objects = ObjectStore(store_url)
    catalog = _catalog(tmp_path)
    name = TopicName("default", "reborn")
    ident = iceberg.table_identifier(name)
    async with DanubeClient([broker.address]) as client, await MetadataStore.connect(etcd_endpoints) as meta:
        registry = SchemaRegistry(meta)

        async def tier_and_commit() -> Any:
            await client.admin.seal_active_segment(name.path)
            await tier_sealed_segments(name, store=meta, admin=client.admin, objects=objects)
            return await commit_objects_to_table(name, store=meta, objects=objects, catalog=catalog, registry=registry)

        await _produce(client, name.path, b"old", 30)
        first = await tier_and_commit()
        assert (first.rows_appended, first.committed_end_offset) == (30, 29)
        old_root = await meta.get(keys.topic_root(name))
        assert old_root is not None
        recorded = await meta.get(keys.table_commit(name))  # §5.8, for tools without Iceberg
        assert recorded is not None
        commit = TableCommit.from_json(recorded.value)
        assert (commit.committed_end_offset, commit.incarnation) == (29, old_root.create_revision)

        await client.admin.delete_topic(name.path)
        assert await meta.get(keys.topic_root(name)) is None  # the root key is really deleted
        await _produce(client, name.path, b"new", 12)  # the producer creates the topic again
        new_root = await meta.get(keys.topic_root(name))
        assert new_root is not None and new_root.create_revision > old_root.create_revision
        assert (await client.admin.describe_topic(name.path)).next_offset == 12  # offsets 0..11 again
        # Freshness does not take the old incarnation's committed end 29 for this topic's.
        stale = await table_freshness(name, store=meta, admin=client.admin, catalog=catalog)
        assert (stale.committed_end_offset, stale.pending_records) == (None, 12)

        second = await tier_and_commit()
        assert (second.rows_appended, second.committed_end_offset) == (12, 11)
        recorded = await meta.get(keys.table_commit(name))  # the new incarnation's, lower end
        assert recorded is not None and TableCommit.from_json(recorded.value).committed_end_offset == 11
        table = catalog.load_table(ident)
        assert table.properties[TOPIC_INCARNATION_PROPERTY] == str(new_root.create_revision)
        assert _payloads(table) == [(i, b"new %d" % i) for i in range(12)]  # nothing mixed in
        retired = catalog.load_table((name.namespace, f"reborn__incarnation_{old_root.create_revision}"))
        assert _payloads(retired) == [(i, b"old %d" % i) for i in range(30)]  # kept for readers
        assert iceberg.committed_end_offset(retired) == 29

        again = await commit_objects_to_table(name, store=meta, objects=objects, catalog=catalog, registry=registry)
        assert (again.rows_appended, again.committed_end_offset) == (0, 11)
        fresh = await table_freshness(name, store=meta, admin=client.admin, catalog=catalog)
        assert (fresh.committed_end_offset, fresh.pending_records) == (11, 0)


async def test_a_table_without_an_incarnation_is_adopted_when_it_fits_and_retired_when_not(
    etcd_endpoints: list[str], tmp_path: Path
) -> None:
    """Tables written before tables recorded their incarnation (the property removed here)."""
    catalog = _catalog(tmp_path)
    objects = ObjectStore((tmp_path / "objects").as_uri())
    name = TopicName("default", "legacy")
    ident = iceberg.table_identifier(name)
    registry = FakeRegistry()

    def forget_incarnation() -> None:
        with catalog.load_table(ident).transaction() as tx:
            tx.remove_properties(TOPIC_INCARNATION_PROPERTY)

    async with await MetadataStore.connect(etcd_endpoints) as meta:

        async def commit() -> Any:
            return await commit_objects_to_table(name, store=meta, objects=objects, catalog=catalog, registry=registry)

        await meta.put(keys.topic_root(name), 0)
        first_root = await meta.get(keys.topic_root(name))
        assert first_root is not None
        await put_object(meta, objects, name, [record(o, b"a%d" % o) for o in range(0, 10)])
        assert (await commit()).committed_end_offset == 9
        forget_incarnation()

        # Fits (its committed end 9 is an object's end): adopted, and tiering goes on.
        await put_object(meta, objects, name, [record(o, b"a%d" % o) for o in range(10, 15)])
        adopted = await commit()
        assert (adopted.rows_appended, adopted.committed_end_offset) == (5, 14)
        assert catalog.load_table(ident).properties[TOPIC_INCARNATION_PROPERTY] == str(first_root.create_revision)
        forget_incarnation()

        # The topic deleted and created again: its objects end at 7, the table's committed end 14
        # fits none of them, so the table is an older incarnation's.
        await meta.delete_prefix(keys.storage_topic(name) + "/")
        await meta.delete(keys.topic_root(name))
        await meta.put(keys.topic_root(name), 0)
        second_root = await meta.get(keys.topic_root(name))
        assert second_root is not None
        await put_object(meta, objects, name, [record(o, b"b%d" % o) for o in range(0, 8)])
        fresh = await commit()
        assert (fresh.rows_appended, fresh.committed_end_offset) == (8, 7)
        assert _payloads(catalog.load_table(ident)) == [(o, b"b%d" % o) for o in range(8)]
        retired = catalog.load_table((name.namespace, f"legacy__before_incarnation_{second_root.create_revision}"))
        assert _payloads(retired) == [(o, b"a%d" % o) for o in range(15)]
