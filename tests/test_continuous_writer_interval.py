"""The continuous writer's commit interval counts from the previous seal: records that arrive
while a pass tiers and commits do not wait a whole interval more once the writer sees them
(``benchmarks/freshness.py``'s p95 under ``make dev``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from assets.continuous_writer import ContinuousWriter, WriterConfig
from danube_pipeline.client import DanubeClient
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.lake import iceberg
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore

pytestmark = pytest.mark.integration

TOPIC = TopicName("default", "interval")


async def _produce(addresses: list[str], payloads: list[bytes]) -> None:
    async with DanubeClient(addresses) as client, client.producer(TOPIC.path, producer_name="interval") as producer:
        await asyncio.gather(*(producer.send_nowait(p) for p in payloads))


def test_interval_counts_from_the_previous_seal(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    broker = start_broker(segment_max_age_s=600.0)
    objects = ObjectStore((tmp_path / "objects").as_uri())
    catalog = iceberg.load_catalog(uri=f"sqlite:///{tmp_path / 'catalog.db'}", warehouse=(tmp_path / "wh").as_uri())
    now = [100.0]

    async def scenario() -> None:
        async with await MetadataStore.connect(etcd_endpoints) as store, DanubeClient([broker.address]) as client:
            writer = ContinuousWriter(
                store=store, admin=client.admin, objects=objects, catalog=catalog,
                config=WriterConfig(commit_interval_s=5.0, commit_max_records=1000), clock=lambda: now[0],
            )
            await _produce([broker.address], [b"a", b"b"])
            [seen] = await writer.run_once()
            assert seen.sealed_end_offset is None
            now[0] += 5.0
            [sealed] = await writer.run_once()  # sealed at t=105
            assert sealed.sealed_end_offset == 1
            # records that arrived during that pass, first seen 4 s after the seal
            await _produce([broker.address], [b"c"])
            now[0] += 4.0
            [early] = await writer.run_once()
            assert early.sealed_end_offset is None  # 4 s since the seal: not yet
            now[0] += 1.0
            [due] = await writer.run_once()  # 5 s since the seal, 1 s since first seen
            assert due.sealed_end_offset == 2
            assert due.table is not None and due.table.committed_end_offset == 2

    asyncio.run(scenario())
