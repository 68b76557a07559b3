"""The demo's read-backs from cold storage: the segment objects, then the Iceberg table alone.

Each read-back consumes every message published, from the earliest offset, through a
subscription of its own, and checks offsets and payloads against what was sent
(:func:`read_back`). The first runs after local retention left the WAL empty, so the broker
serves everything from the segment objects (:func:`retain_and_read_cold`). The second runs
after the ``after-commit`` object lifecycle (``docs/etcd-layout.md`` §2.1) deleted every
segment object, with the topic's cold read path set to ``iceberg`` (§3.10): the table (rows
and dead letters, exact bytes from ``_raw_payload``, §3.9) is then the only cold copy
(:func:`read_from_table`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from danube_pipeline.client import DanubeClient, InitialPosition, Message
from danube_pipeline.dev import flights
from danube_pipeline.dev.demo_summary import DemoError, DemoSummary
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.descriptors import read_descriptors
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import TableLayout, TopicReadPath
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import segment_object_path

__all__ = [
    "COLD_SUBSCRIPTION",
    "TABLE_SUBSCRIPTION",
    "keep_exact_bytes",
    "read_back",
    "read_from_table",
    "retain_and_read_cold",
    "storage_per_tier",
    "turn_on_after_commit",
]

TOPIC = TopicName.parse(flights.FLIGHTS_TOPIC)
COLD_SUBSCRIPTION = "demo-cold-read"
TABLE_SUBSCRIPTION = "demo-iceberg-read"


async def read_back(
    client: DanubeClient,
    subscription: str,
    payloads: list[bytes],
    *,
    stage: str,
    progress: bool,
    check: Callable[[Message], str | None] | None = None,
) -> tuple[int, float]:
    """Consume every message of the flights topic from the earliest offset and check each.

    Args:
        client: a connected client.
        subscription: a subscription name not used before (it starts at EARLIEST).
        payloads: what was published, by offset.
        stage: the demo stage, for errors and the progress bar.
        progress: show a progress bar.
        check: a further check of each message: what is wrong with it, or ``None``.

    Returns:
        (messages read, seconds taken).

    Raises:
        DemoError: an offset arrived out of order, a payload differs from what was sent, or
            ``check`` found something wrong.
    """
    seen = 0
    start = time.perf_counter()
    async with client.consumer(
        flights.FLIGHTS_TOPIC,
        subscription=subscription,
        consumer_name=f"{subscription}-reader",
        initial_position=InitialPosition.EARLIEST,
    ) as consumer:
        with tqdm(total=len(payloads), unit="msg", disable=not progress, desc=stage) as bar:
            while seen < len(payloads):
                message = await consumer.receive(timeout_ms=30_000)
                if message.offset != seen:
                    raise DemoError(stage, f"offset {message.offset}, expected {seen}")
                if message.payload != payloads[seen]:
                    raise DemoError(stage, f"payload of offset {seen} differs from what was sent")
                if check is not None and (wrong := check(message)) is not None:
                    raise DemoError(stage, wrong)
                await consumer.ack(message)
                seen += 1
                if seen % 5000 == 0:
                    bar.update(5000)
            bar.update(seen % 5000)
    return seen, time.perf_counter() - start


async def _read_back_served(
    client: DanubeClient, subscription: str, payloads: list[bytes], *, stage: str, progress: bool, counter: str, source: str
) -> tuple[int, float]:
    """:func:`read_back`, then check that the broker served every message from ``source``: its
    subscription counter ``counter`` (``records_from_object_storage`` or ``records_from_table``
    of :class:`~danube_pipeline.client.types.SubscriptionInfo`) equals the messages read.

    Returns:
        (messages read, messages per second).

    Raises:
        DemoError: as :func:`read_back`, or some messages came from elsewhere.
    """
    seen, elapsed = await read_back(client, subscription, payloads, stage=stage, progress=progress)
    described = await client.admin.describe_topic(flights.FLIGHTS_TOPIC)
    sub = next((s for s in described.subscriptions if s.name == subscription), None)
    served = int(getattr(sub, counter)) if sub is not None else 0
    if served != seen:
        raise DemoError(stage, f"{served} of {seen} messages came from {source}")
    return seen, seen / elapsed if elapsed > 0 else 0.0


async def retain_and_read_cold(broker_addr: str, payloads: list[bytes], summary: DemoSummary, progress: bool) -> None:
    """Local retention down to the newest segment, then every message again from the earliest
    offset, served from the segment objects.

    Raises:
        DemoError: the WAL kept older offsets, a message differs, or the broker served some
            of them from elsewhere.
    """
    async with DanubeClient([broker_addr]) as client:
        result = await client.admin.apply_local_retention(flights.FLIGHTS_TOPIC, retention_bytes=0)
        if result.first_local_offset != summary.messages_published:
            raise DemoError("local retention", f"the WAL still starts at offset {result.first_local_offset}")
        summary.wal_bytes_after_retention = result.wal_bytes
        seen, rate = await _read_back_served(client, COLD_SUBSCRIPTION, payloads, stage="cold read", progress=progress,
                                             counter="records_from_object_storage", source="object storage")
    summary.read_from_object_storage = seen
    summary.cold_read_msgs_per_s = rate


async def keep_exact_bytes(etcd_endpoints: list[str]) -> None:
    """Turn the flights table's ``raw_payload`` layout on (§3.9) before its first commit, so
    the table can serve every message byte for byte."""
    async with await MetadataStore.connect(etcd_endpoints) as store:
        await store.put(keys.topic_table(TOPIC), TableLayout(raw_payload=True))


def _bytes_under(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) if directory.exists() else 0


async def storage_per_tier(broker_addr: str, home: Path, env: dict[str, str]) -> dict[str, int]:
    """Bytes per storage tier: the topic's WAL (as its broker reports it), the files of its
    segment objects, every file under the Iceberg warehouse (data and metadata files, those of
    replaced snapshots included until snapshot expiry deletes them), and of those the data
    files the current snapshots of the topic's table and dead-letter table reference.

    Args:
        broker_addr: the broker's address.
        home: the demo's state directory (objects under ``objects/``, tables under ``warehouse/``).
        env: the ``DANUBE_*`` environment (the catalog to open).
    """
    from danube_pipeline.lake import iceberg

    async with DanubeClient([broker_addr]) as client:
        described = await client.admin.describe_topic(flights.FLIGHTS_TOPIC)
    catalog = iceberg.load_catalog(name=env["DANUBE_CATALOG_NAME"], uri=env["DANUBE_CATALOG_URI"], warehouse=env["DANUBE_WAREHOUSE"])
    table = catalog.load_table((TOPIC.namespace, TOPIC.topic))
    current = 0
    for t in (table, iceberg.dead_letter_table_of(table)):
        if t is not None and t.current_snapshot() is not None:
            current += sum(t.inspect.files().column("file_size_in_bytes").to_pylist())
    return {
        "WAL (local disk)": described.wal_bytes,
        "segment objects": _bytes_under(home / "objects" / segment_object_path(TOPIC, "").rstrip("/")),
        "Iceberg warehouse": _bytes_under(home / "warehouse"),
        "  current data files": current,
    }


async def turn_on_after_commit(etcd_endpoints: list[str]) -> None:
    """Set the ``default`` namespace's ``object_lifecycle`` to ``after-commit`` (§2.1) and the
    topic's cold read path to ``iceberg`` (§3.10)."""
    from danube_pipeline.admin.namespaces import update_namespace_policy

    async with await MetadataStore.connect(etcd_endpoints) as store:
        await update_namespace_policy(store, TOPIC.namespace, {"object_lifecycle": "after-commit"})
        await store.put(keys.topic_read_path(TOPIC), TopicReadPath(cold_read_path="iceberg"))


async def read_from_table(
    broker_addr: str, etcd_endpoints: list[str], payloads: list[bytes], summary: DemoSummary, progress: bool
) -> None:
    """Every message again from the earliest offset, served by the Iceberg table alone.

    Raises:
        DemoError: an object was not deleted, a message differs, or the broker served some
            of them from elsewhere than the table.
    """
    async with await MetadataStore.connect(etcd_endpoints) as store:
        descriptors, _ = await read_descriptors(store, TOPIC)
    kept = [d.object_id for d in descriptors if d.object_deleted_at is None]
    if kept:
        raise DemoError("after-commit", f"{len(kept)} of {len(descriptors)} segment objects were kept: {kept[:3]}")
    summary.objects_deleted = len(descriptors)
    async with DanubeClient([broker_addr]) as client:
        seen, rate = await _read_back_served(client, TABLE_SUBSCRIPTION, payloads, stage="read from Iceberg",
                                             progress=progress, counter="records_from_table", source="the table")
    summary.read_from_iceberg = seen
    summary.iceberg_read_msgs_per_s = rate
