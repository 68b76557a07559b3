"""``danube-admin topics stats`` and ``brokers stats`` (``danube_pipeline/admin/stats.py``), run as
the installed script against a real etcd and real brokers, one serving Prometheus metrics
(``--metrics-listen``) and one not. Every figure is checked against an independent source:
what the test produced and acked, ``Admin.DescribeTopic``, the segment object files on disk,
the table-commit record in etcd, the broker's own ``/metrics``."""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.lake.tiering import tier_sealed_segments
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import BrokerRegistration, TableCommit
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore

from helpers import eventually, run_admin

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

TOPIC = "/default/stats"
PAYLOAD = b"s" * 100


async def admin(etcd: Sequence[str], broker: str, *args: str) -> tuple[int, str, str]:
    run = await run_admin(*args, etcd=etcd, brokers=[broker], output=None)
    assert "Traceback" not in run.err, run.err
    return run.code, run.out, run.err


async def stats_json(etcd: Sequence[str], broker: str, *args: str) -> Any:
    code, out, err = await admin(etcd, broker, *args, "--json")
    assert code == 0, err
    return json.loads(out)


async def produce(client: DanubeClient, count: int, name: str) -> None:
    async with client.producer(TOPIC, producer_name=name, max_batch_messages=50) as producer:
        for _ in range(count):
            producer.send_nowait(PAYLOAD)
        await producer.flush()


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        body: bytes = response.read()
    return body.decode()


async def test_stats_from_a_broker_serving_metrics(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    objects_dir = tmp_path / "objects"
    broker = start_broker(
        segment_max_bytes=8192,
        extra_args=["--metrics-listen", "127.0.0.1:0", "--object-store-url", objects_dir.as_uri()],
    )
    etcd, address = etcd_endpoints, broker.address
    topic = TopicName.parse(TOPIC)
    async with await MetadataStore.connect(etcd) as meta, DanubeClient([address]) as client:
        registration = await meta.get(keys.broker_register(broker.broker_id))
        assert registration is not None
        url = BrokerRegistration.from_json(registration.value).prom_exporter
        assert url is not None and url.startswith("http://127.0.0.1:") and url.endswith("/metrics")

        # 300 messages tiered to segment objects, 200 more in the WAL only.
        await produce(client, 300, "first")
        await client.admin.seal_active_segment(TOPIC)
        report = await tier_sealed_segments(
            topic, store=meta, admin=client.admin, objects=ObjectStore(objects_dir.as_uri())
        )
        assert report.objects_written >= 1
        await produce(client, 200, "second")

        async with client.consumer(
            TOPIC, subscription="reader", initial_position=InitialPosition.EARLIEST, ack_batch_size=1
        ) as consumer:
            received = [await consumer.receive(timeout_ms=10_000) for _ in range(120)]
            for message in received[:100]:
                await consumer.ack(message)

            async def acked_100() -> bool:
                subs = (await client.admin.describe_topic(TOPIC)).subscriptions
                return any(s.name == "reader" and s.cursor == 99 for s in subs)

            await eventually(acked_100, what="cursor at 99")
            described = await client.admin.describe_topic(TOPIC)

            doc = await stats_json(etcd, address, "topics", "stats", TOPIC, "--interval-s", "0.5")
            assert doc["topic"] == TOPIC and doc["partitions"] == 0 and doc["problems"] == []
            [t] = doc["partition_topics"]
            assert t["owner"] == {"broker_id": broker.broker_id, "address": address}
            # Nothing produced or consumed while it measured: rates exactly zero, per topic.
            assert t["rates"] == {
                "scope": "topic", "messages_in_per_s": 0.0, "bytes_in_per_s": 0.0,
                "messages_out_per_s": 0.0, "bytes_out_per_s": 0.0,
            }  # fmt: skip
            [sub] = t["subscriptions"]
            assert sub["name"] == "reader" and sub["source"] == "metrics" and sub["consumers"] == 1
            assert sub["lag_messages"] == 500 - 100
            assert 20 <= sub["unacked_messages"] <= 400  # 120 received, 100 acked; prefetch may hand out more
            wal, objects, iceberg = t["storage"]["wal"], t["storage"]["segment_objects"], t["storage"]["iceberg"]
            assert wal == {"bytes": described.wal_bytes, "first_offset": described.first_local_offset, "next_offset": 500}
            files = sorted(objects_dir.rglob("*.dnb1"))
            assert objects["objects"] == len(files) == report.objects_written
            assert objects["bytes"] == sum(f.stat().st_size for f in files) > 300 * len(PAYLOAD)
            assert objects["first_offset"] == 0 and objects["end_offset"] == described.remote_end_offset
            assert iceberg["committed_end_offset"] is None and iceberg["rows"] is None and iceberg["bytes"] is None
            assert iceberg["table"].endswith(".default.stats")

            # Traffic while it measures: rates from the two scrapes.
            async def steady() -> None:
                async with client.producer(TOPIC, producer_name="steady") as producer:
                    while True:
                        await producer.send(PAYLOAD)
                        await asyncio.sleep(0.005)

            async def drain() -> None:
                while True:
                    await consumer.ack(await consumer.receive(timeout_ms=30_000))

            tasks = [asyncio.create_task(steady()), asyncio.create_task(drain())]
            await asyncio.sleep(0.5)
            try:
                busy = await stats_json(etcd, address, "topics", "stats", TOPIC)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            rates = busy["partition_topics"][0]["rates"]
            assert busy["interval_s"] == 1.0
            assert 20 <= rates["messages_in_per_s"] <= 250  # one send at a time, 5 ms apart
            assert len(PAYLOAD) <= rates["bytes_in_per_s"] / rates["messages_in_per_s"] <= 4 * len(PAYLOAD)
            assert rates["messages_out_per_s"] > 0 and rates["bytes_out_per_s"] > 0

        # The table-commit record (§5.8), as tiering writes it after an Iceberg commit.
        commit = TableCommit(table="default.stats", committed_end_offset=299, snapshot_id=42,
                             committed_at_ms=1_700_000_000_000, incarnation=1)  # fmt: skip
        await meta.put(keys.table_commit(topic), commit)
        code, text, err = await admin(etcd, address, "topics", "stats", TOPIC, "--interval-s", "0.2")
        assert code == 0, err
        assert "backlog:" in text and "reader" in text and "through offset 299 (snapshot 42)" in text
        assert "rows and bytes unknown" in text

        # brokers stats: figures against etcd, DescribeTopic and the broker's own metrics.
        first = await stats_json(etcd, address, "brokers", "stats", "--interval-s", "0.2")
        with pytest.raises(Exception):
            await client.admin.describe_topic("/default/never-created")  # one failed RPC
        second = await stats_json(etcd, address, "brokers", "stats", "--interval-s", "0.2")
        [row] = second["brokers"]
        assert second["problems"] == [] and second["leader_broker_id"] == broker.broker_id
        assert row["broker_id"] == broker.broker_id and row["address"] == address and row["leader"] is True
        assert row["state"] == "active" and row["metrics_url"] == url
        assert row["topics_owned"] == 1
        assert row["wal_bytes"] == (await client.admin.describe_topic(TOPIC)).wal_bytes
        free = shutil.disk_usage(tmp_path).free
        assert abs(row["disk_free_bytes"] - free) < 0.1 * free
        assert row["messages_in_per_s"] == 0.0 and row["messages_out_per_s"] == 0.0
        assert row["rpc_errors"] >= first["brokers"][0]["rpc_errors"] + 1
        assert 'result="NOT_FOUND"' in scrape(url)


async def test_stats_without_metrics_say_so_and_use_the_cursor(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    broker = start_broker()
    etcd, address = etcd_endpoints, broker.address
    async with DanubeClient([address]) as client:
        await produce(client, 50, "only")
        async with client.consumer(
            TOPIC, subscription="reader", initial_position=InitialPosition.EARLIEST, ack_batch_size=1
        ) as consumer:
            received = [await consumer.receive(timeout_ms=10_000) for _ in range(10)]
            for message in received:
                await consumer.ack(message)

            async def acked_10() -> bool:
                subs = (await client.admin.describe_topic(TOPIC)).subscriptions
                return any(s.name == "reader" and s.cursor == 9 for s in subs)

            await eventually(acked_10, what="cursor at 9")
            off = f"metrics off on broker {broker.broker_id}: start it with --metrics-listen"
            doc = await stats_json(etcd, address, "topics", "stats", TOPIC, "--interval-s", "0.2")
            assert doc["problems"] == [off]
            [t] = doc["partition_topics"]
            assert t["rates"]["scope"] is None and t["rates"]["messages_in_per_s"] is None
            [sub] = t["subscriptions"]
            assert sub["source"] == "describe" and sub["lag_messages"] == 40
            code, text, err = await admin(etcd, address, "topics", "stats", TOPIC, "--interval-s", "0.2")
            assert code == 0 and text.rstrip().endswith(off), (text, err)

        # A partitioned topic is measured partition by partition.
        await client.admin.create_topic("/default/parted", partitions=2)
        parted = await stats_json(etcd, address, "topics", "stats", "/default/parted", "--interval-s", "0.2")
        assert parted["partitions"] == 2 and parted["problems"] == [off]
        assert [p["topic"] for p in parted["partition_topics"]] == ["/default/parted-part-0", "/default/parted-part-1"]
        assert {p["storage"]["iceberg"]["table"].rsplit(".", 1)[1] for p in parted["partition_topics"]} == {"parted"}

    doc = await stats_json(etcd, address, "brokers", "stats", "--interval-s", "0.2")
    [row] = doc["brokers"]
    assert doc["problems"] == [off]
    assert row["metrics_url"] is None and row["topics_owned"] == 3  # /default/stats and two partitions
    assert row["messages_in_per_s"] is None and row["wal_bytes"] is None and row["rpc_errors"] is None
    code, text, err = await admin(etcd, address, "brokers", "stats")
    assert code == 0 and off in text and "BROKER_ID" in text, (text, err)


async def test_topic_rates_are_the_namespace_s_without_per_topic_metrics(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    broker = start_broker(extra_args=["--metrics-listen", "127.0.0.1:0", "--no-metrics-per-topic"])
    etcd, address = etcd_endpoints, broker.address
    async with DanubeClient([address]) as client:
        await produce(client, 10, "before")

        async def steady() -> None:
            async with client.producer(TOPIC, producer_name="steady") as producer:
                while True:
                    await producer.send(PAYLOAD)
                    await asyncio.sleep(0.005)

        task = asyncio.create_task(steady())
        await asyncio.sleep(0.3)
        try:
            doc = await stats_json(etcd, address, "topics", "stats", TOPIC)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    [t] = doc["partition_topics"]
    assert doc["problems"] == []
    assert t["rates"]["scope"] == "namespace"
    assert 20 <= t["rates"]["messages_in_per_s"] <= 250
    assert t["rates"]["messages_out_per_s"] == 0.0
    code, text, err = await admin(etcd, address, "topics", "stats", TOPIC, "--interval-s", "0.2")
    assert code == 0 and "in (the namespace's: per-topic metrics off)" in text, (text, err)
