"""Partitioned topics: the partitions' names, and which partition of which topic a name is.

A partitioned topic ``/{ns}/{topic}`` holds no messages. Its topic root
``/topics/{ns}/{topic}`` holds the partition count N > 0 (``docs/etcd-layout.md`` §3.1; a plain
topic's root holds 0), and its N partitions are ordinary topics named ``{topic}-part-{i}``,
``i`` in ``0..N-1``, each with its own root (value 0), owner, WAL, subscriptions and object
descriptors, assigned and moved on their own. Producers route messages to the partitions,
consumers subscribe to all of them, and tiering writes every partition into the one Iceberg
table of the partitioned topic (``_partition`` column, :mod:`danube_pipeline.lake.iceberg`).

A name alone does not say whether a topic is a partition: ``orders-part-0`` may be a plain
topic. It is partition ``0`` of ``orders`` only while ``/topics/{ns}/orders`` holds a count
above 0 (:func:`partition_of`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from danube_pipeline.errors import MalformedRequestError
from danube_pipeline.metadata import keys
from danube_pipeline.names import TopicName, validate_part

if TYPE_CHECKING:
    from danube_pipeline.metadata.store import MetadataStore

__all__ = [
    "MAX_PARTITIONS",
    "PARTITION_INFIX",
    "PartitionOf",
    "partition_count",
    "partition_name",
    "partition_names",
    "partition_of",
    "split_partition_name",
]

PARTITION_INFIX: Final = "-part-"
"""Between a partitioned topic's name and a partition's index: ``orders-part-3``."""

MAX_PARTITIONS: Final = 100
"""The most partitions a topic may have. Creating a partitioned topic is one etcd transaction
that compares every partition's root (etcd refuses a transaction of more than 128 operations
with its default ``--max-txn-ops``)."""

_PARTITION = re.compile(r"(.+)-part-(0|[1-9][0-9]*)")


def partition_name(parent: TopicName, index: int) -> TopicName:
    """Partition ``index`` of ``parent``: ``/{ns}/{topic}-part-{index}``.

    Raises:
        InvalidNameError: the name is longer than the topic grammar allows (128 characters).
    """
    return TopicName(parent.namespace, validate_part("topic", f"{parent.topic}{PARTITION_INFIX}{index}"))


def partition_names(parent: TopicName, partitions: int) -> list[TopicName]:
    """Every partition of ``parent``, in index order.

    Args:
        parent: the partitioned topic.
        partitions: its partition count, 1 to :data:`MAX_PARTITIONS`.

    Returns:
        ``[{topic}-part-0, ..., {topic}-part-{partitions-1}]``.

    Raises:
        MalformedRequestError: ``partitions`` is not between 1 and :data:`MAX_PARTITIONS`.
        InvalidNameError: a partition's name is longer than 128 characters.
    """
    if not 1 <= partitions <= MAX_PARTITIONS:
        raise MalformedRequestError(f"a partitioned topic has 1 to {MAX_PARTITIONS} partitions, not {partitions}")
    return [partition_name(parent, i) for i in range(partitions)]


def split_partition_name(topic: TopicName) -> tuple[TopicName, int] | None:
    """``(parent, index)`` if ``topic``'s name has the form ``{parent}-part-{index}`` (index in
    decimal, without leading zeros), else ``None``. The name alone does not make it a
    partition: see :func:`partition_of`."""
    m = _PARTITION.fullmatch(topic.topic)
    if m is None:
        return None
    return TopicName(topic.namespace, m.group(1)), int(m.group(2))


def partition_count(root_value: object) -> int:
    """The partition count a topic root holds (``docs/etcd-layout.md`` §3.1): N > 0 for a
    partitioned topic, 0 for a plain one (and for a value that is not a non-negative JSON
    integer)."""
    if isinstance(root_value, bool) or not isinstance(root_value, int) or root_value < 0:
        return 0
    return root_value


@dataclass(frozen=True, slots=True)
class PartitionOf:
    """A topic that is a partition of a partitioned topic.

    Attributes:
        parent: the partitioned topic, e.g. ``/default/orders``.
        index: the partition's index, ``0..partitions-1``.
        partitions: the parent's partition count.
    """

    parent: TopicName
    index: int
    partitions: int


async def partition_of(store: MetadataStore, topic: TopicName) -> PartitionOf | None:
    """Which partition of which topic ``topic`` is, read straight from etcd: it is partition
    ``i`` of ``parent`` when its name is ``{parent}-part-{i}`` and the root
    ``/topics/{ns}/{parent}`` holds a count above ``i`` (``docs/etcd-layout.md`` §3.1).

    Args:
        store: the connected metadata store.
        topic: any topic.

    Returns:
        The :class:`PartitionOf`, or ``None`` for a topic that is not a partition.

    Raises:
        MetadataStoreError: etcd failed.
    """
    split = split_partition_name(topic)
    if split is None:
        return None
    parent, index = split
    kv = await store.get(keys.topic_root(parent))
    count = partition_count(kv.value) if kv is not None else 0
    if index >= count:
        return None
    return PartitionOf(parent, index, count)
