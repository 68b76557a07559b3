"""Stopping a local cluster of several brokers without leaving data behind (``make dev``).

A broker that releases a topic keeps its untiered segments on its own disk and serves them to
tiering (``docs/etcd-layout.md`` §5.3, §5.5). Stopped for good before tiering copied them, it
takes those offsets with it: consumers and tiering wait at its unavailable range until it runs
again. :func:`drain_and_wait` therefore drains a broker (its topics move to the others) and
waits while the continuous writer tiers what it released, before the broker is stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from danube_pipeline.client import DanubeClient
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.connection import EtcdSecurity
from danube_pipeline.metadata.descriptors import read_descriptors
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import UnavailableRange
from danube_pipeline.names import TopicName


async def untiered_ranges(store: MetadataStore, broker_id: int) -> list[str]:
    """The offsets only ``broker_id``'s disk holds: its unavailable ranges (§5.5) whose written
    offsets are neither in completed object descriptors (§5.1) nor expired (below the topic's
    first descriptor).

    Returns:
        One ``"/ns/topic start..end"`` line per range still waiting for tiering.

    Raises:
        MetadataStoreError: etcd failed.
        ValueError: a stored range or descriptor does not parse.
    """
    kvs, _ = await store.get_prefix(keys.STORAGE_TOPICS + "/")
    waiting: list[str] = []
    for kv in kvs:
        head, sep, _ = kv.key[len(keys.STORAGE_TOPICS) + 1 :].partition("/unavailable/")
        if not sep:
            continue
        rng = UnavailableRange.from_json(kv.value)
        if rng.broker_id != broker_id or rng.abandoned:
            continue
        written_end = rng.end_offset if rng.last_written is None else min(rng.end_offset, rng.last_written)
        if written_end < rng.start_offset:
            continue  # nothing of it was ever handed out
        topic = TopicName.parse("/" + head)
        descriptors, _ = await read_descriptors(store, topic)
        next_needed = rng.start_offset
        if descriptors and next_needed < descriptors[0].start_offset:
            next_needed = descriptors[0].start_offset  # below the first object: expired
        for d in descriptors:
            if d.completed and d.start_offset <= next_needed <= d.end_offset:
                next_needed = d.end_offset + 1
        if next_needed <= written_end:
            waiting.append(f"{topic.path} {next_needed}..{written_end}")
    return waiting


async def drain_and_wait(
    etcd_endpoints: list[str],
    address: str,
    broker_id: int,
    *,
    timeout_s: float,
    client_options: Mapping[str, Any] | None = None,
    etcd_security: EtcdSecurity | None = None,
) -> list[str]:
    """Drain the broker at ``address`` (``Admin.DrainBroker``: it releases every topic, §1.3),
    then wait up to ``timeout_s`` seconds until tiering holds every offset it alone holds.

    ``client_options`` are more :class:`DanubeClient` arguments (``tls_ca_file``,
    ``tls_cert_file``, ``tls_key_file``, ``token``: a principal with ``manage_broker``).
    ``etcd_security`` reaches etcd (default: the ``DANUBE_ETCD_*`` variables).

    Returns:
        What is still only on its disk at the deadline (:func:`untiered_ranges`); empty when
        the broker can be stopped without leaving offsets unreadable.

    Raises:
        BrokerUnavailableError: the broker could not be reached.
        MetadataStoreError: etcd failed.
    """
    async with DanubeClient([address], **(client_options or {})) as client:
        await client.admin.drain_broker(address)
    deadline = time.monotonic() + timeout_s
    async with await MetadataStore.connect(etcd_endpoints, security=etcd_security) as store:
        while True:
            waiting = await untiered_ranges(store, broker_id)
            if not waiting or time.monotonic() >= deadline:
                return waiting
            await asyncio.sleep(0.5)
