"""How far a topic's Iceberg table is behind the topic: the ``fresh`` asset check.

The table is *fresh* when every record published more than ``limit_s`` seconds ago is
queryable in it. What is measured, without reading any record:

* ``pending_records``: offsets the owning broker handed out (``DescribeTopic.next_offset``)
  above the table's committed end offset (``danube.committed-end-offset``, or the partition's).
* ``lag_s``: an upper bound of the age of the oldest of those records, from the broker's
  WAL segments: the record ``committed + 1`` was appended at or after the creation of the
  sealed segment holding it (``SegmentInfo.created_at_ms``); when it is still in the active
  segment, at or after the newest sealing (``sealed_at_ms``) or the table's last commit,
  whichever is later. ``0`` when nothing is pending.

So ``lag_s`` never understates staleness: a table that commits often but falls behind on
throughput shows the age of its backlog, not the time since its last commit.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pyiceberg.catalog import Catalog

from danube_pipeline.lake import iceberg
from danube_pipeline.lake.tiering.incarnation import holds_incarnation, topic_incarnation
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.descriptors import read_descriptors
from danube_pipeline.names import TopicName
from danube_pipeline.partitions import partition_of

if TYPE_CHECKING:
    from danube_pipeline.client.types import SegmentInfo, TopicDescription
    from danube_pipeline.metadata.store import MetadataStore

__all__ = ["DEFAULT_FRESHNESS_LIMIT_S", "Freshness", "FreshnessAdmin", "freshness_limit_s", "oldest_pending_ms", "table_freshness"]

DEFAULT_FRESHNESS_LIMIT_S = 120.0
"""The ``fresh`` check's default limit, in seconds: four times the 30 s produce-to-queryable
target of ``make dev`` (``benchmarks/freshness.py``), so a short hiccup does not fail it."""


def freshness_limit_s() -> float:
    """The ``fresh`` check's limit in seconds, and the table assets' freshness policy's: ``DANUBE_FRESHNESS_LIMIT_S``, default
    :data:`DEFAULT_FRESHNESS_LIMIT_S`.

    Raises:
        ValueError: the variable is not a positive number.
    """
    raw = os.environ.get("DANUBE_FRESHNESS_LIMIT_S")
    if not raw:
        return DEFAULT_FRESHNESS_LIMIT_S
    limit = float(raw)
    if not limit > 0:
        raise ValueError(f"DANUBE_FRESHNESS_LIMIT_S must be a positive number of seconds, got {raw!r}")
    return limit


class FreshnessAdmin(Protocol):
    """The broker admin calls :func:`table_freshness` makes (``DanubeClient.admin``)."""

    async def describe_topic(self, topic: str) -> TopicDescription: ...

    async def list_sealed_segments(self, topic: str) -> list[SegmentInfo]: ...


@dataclass(frozen=True, slots=True)
class Freshness:
    """One evaluation of a topic table's freshness.

    Attributes:
        topic: ``/ns/topic``.
        next_offset: the offset the broker gives the next message.
        committed_end_offset: the table's committed end offset for the topic, ``None`` before
            any commit.
        pending_records: offsets published but not yet queryable in the table.
        lag_s: an upper bound of the age of the oldest of them, in seconds; ``0.0`` when none.
        last_commit_ms: when the table's newest snapshot was committed, ms since the Unix
            epoch; ``None`` without one.
        limit_s: the limit the check compares ``lag_s`` with.
        tiered: ``False`` for a ``NonReliable`` topic (``docs/etcd-layout.md`` §3.2), which
            is never tiered: it has nothing pending and is always fresh.
    """

    topic: str
    next_offset: int
    committed_end_offset: int | None
    pending_records: int
    lag_s: float
    last_commit_ms: int | None
    limit_s: float
    tiered: bool = True

    @property
    def passed(self) -> bool:
        """``lag_s <= limit_s``."""
        return self.lag_s <= self.limit_s


def oldest_pending_ms(first_pending: int, segments: Sequence[SegmentInfo], last_commit_ms: int | None) -> int | None:
    """When the record ``first_pending`` was appended, at the latest (module docstring): the
    creation of the sealed segment holding it, else the newest sealing or ``last_commit_ms``.

    Args:
        first_pending: the first offset not queryable in the table.
        segments: the topic's sealed WAL segments (``ListSealedSegments``).
        last_commit_ms: the table's newest snapshot time, ms since the Unix epoch, or ``None``.

    Returns:
        Milliseconds since the Unix epoch, ``None`` when nothing bounds it.
    """
    for s in sorted(segments, key=lambda s: s.start_offset):
        if s.end_offset >= first_pending:
            return s.created_at_ms
    bounds = [s.sealed_at_ms for s in segments]
    if last_commit_ms is not None:
        bounds.append(last_commit_ms)
    return max(bounds) if bounds else None


async def table_freshness(
    topic: TopicName,
    *,
    store: MetadataStore,
    admin: FreshnessAdmin,
    catalog: Catalog,
    limit_s: float = DEFAULT_FRESHNESS_LIMIT_S,
    now_ms: int | None = None,
) -> Freshness:
    """Measure how far the topic's table is behind the topic (module docstring).

    Args:
        topic: the topic (a partition ``{topic}-part-{i}`` is measured against its own
            committed end offset in the partitioned topic's table).
        store: the connected metadata store.
        admin: the broker admin API.
        catalog: the shared Iceberg catalog.
        limit_s: the freshness limit in seconds.
        now_ms: the time to measure at, ms since the Unix epoch; default now.

    Returns:
        A :class:`Freshness`.

    Raises:
        DanubeError: the broker could not describe the topic or list its segments.
        MetadataStoreError: etcd failed.
    """
    now = int(time.time() * 1000) if now_ms is None else now_ms
    delivery = await store.get(keys.topic_delivery(topic))
    if delivery is not None and delivery.value == "NonReliable":
        return Freshness(topic.path, 0, None, 0, 0.0, None, limit_s, tiered=False)
    part = await partition_of(store, topic)
    table_topic = part.parent if part is not None else topic
    ident = iceberg.table_identifier(table_topic)
    partition = part.index if part is not None else None
    table = catalog.load_table(ident) if catalog.table_exists(ident) else None
    committed = iceberg.committed_end_offset(table, partition=partition) if table is not None else None
    if table is not None:
        descriptors, _ = await read_descriptors(store, topic)
        if not holds_incarnation(table, await topic_incarnation(store, table_topic), committed, descriptors):
            table, committed = None, None  # an earlier incarnation's: this one has committed nothing
    snapshot = table.current_snapshot() if table is not None else None
    last_commit_ms = snapshot.timestamp_ms if snapshot is not None else None
    description = await admin.describe_topic(topic.path)
    first_pending = 0 if committed is None else committed + 1
    pending = max(0, description.next_offset - first_pending)
    lag_s = 0.0
    if pending:
        segments = await admin.list_sealed_segments(topic.path)
        since = oldest_pending_ms(first_pending, segments, last_commit_ms)
        lag_s = max(0.0, (now - since) / 1000) if since is not None else 0.0
    return Freshness(
        topic=topic.path,
        next_offset=description.next_offset,
        committed_end_offset=committed,
        pending_records=pending,
        lag_s=lag_s,
        last_commit_ms=last_commit_ms,
        limit_s=limit_s,
    )
