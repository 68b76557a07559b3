"""Which incarnation of a topic a table holds, so that a re-created topic never meets its
predecessor's committed end offset.

A deleted topic's name can be created again (``docs/etcd-layout.md`` §3.1), and the new topic
starts at offset 0, while its Iceberg table (never dropped with the topic) still holds the old
topic's rows and committed end offset: the new rows would be skipped as already committed. Each
**incarnation** of a topic therefore has an id, the etcd ``create_revision`` of its root key
``/topics/{ns}/{topic}`` (a deleted and re-created key always gets a new, larger one; for a
partition of a partitioned topic, the partitioned topic's root, whose table it shares). A table
records the incarnation it holds in its property ``danube.topic-incarnation``, set when tiering
creates it (:func:`~danube_pipeline.lake.iceberg.commit.commit_object`).

Every writer that trusts a table's committed end offset first calls :func:`current_table`:

* a table of the current incarnation is used as it is;
* a table of another incarnation is **retired**: renamed to ``{topic}__incarnation_{id}``
  (its dead-letter table to ``{topic}__incarnation_{id}__dlq``), where it stays for readers
  with all its rows, and logged at WARNING; the new incarnation then gets a fresh table;
* a table without the property (written before it existed) is **adopted** (the property is set)
  when its committed end offset fits the topic's descriptors (:func:`fits_descriptors`: no
  committed offset yet, the end offset of one of its completed objects, or below all of them
  after retention), and retired as ``{topic}__before_incarnation_{id}`` otherwise.

Readers that must not change anything (freshness) call :func:`holds_incarnation` and treat a
table of another incarnation as no table.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException, NoSuchTableError, TableAlreadyExistsError
from pyiceberg.table import Table

from danube_pipeline.lake import iceberg
from danube_pipeline.lake.iceberg.binding import TOPIC_INCARNATION_PROPERTY
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.values import ObjectDescriptor
from danube_pipeline.names import TopicName

if TYPE_CHECKING:
    from danube_pipeline.metadata.store import MetadataStore

__all__ = [
    "TOPIC_INCARNATION_PROPERTY",
    "TableIncarnation",
    "current_table",
    "fits_descriptors",
    "holds_incarnation",
    "table_incarnation",
    "topic_incarnation",
]

log = logging.getLogger(__name__)

_ATTEMPTS = 5
"""Tries to adopt or retire a table while other writers do the same."""


class TableIncarnation(Enum):
    """How a table stands to the topic's current incarnation (:func:`table_incarnation`)."""

    CURRENT = "current"
    """It records the current incarnation."""
    OTHER = "other"
    """It records another incarnation."""
    UNRECORDED = "unrecorded"
    """It records none (written before the property existed)."""


async def topic_incarnation(store: MetadataStore, table_topic: TopicName) -> int | None:
    """The current incarnation of the topic whose table is ``table_topic``'s.

    Args:
        store: the connected metadata store.
        table_topic: the topic the table is named after (the partitioned topic, for a partition).

    Returns:
        The ``create_revision`` of its root key (§3.1), or ``None`` when the topic does not exist.

    Raises:
        MetadataStoreError: etcd failed.
    """
    kv = await store.get(keys.topic_root(table_topic))
    return kv.create_revision if kv is not None else None


def table_incarnation(table: Table, incarnation: int) -> TableIncarnation:
    """Whether ``table`` holds the topic's incarnation ``incarnation``.

    Args:
        table: the topic's table.
        incarnation: the topic's current incarnation (:func:`topic_incarnation`).

    Returns:
        The :class:`TableIncarnation`; a property that is not an integer counts as another
        incarnation.
    """
    recorded = table.properties.get(TOPIC_INCARNATION_PROPERTY)
    if recorded is None:
        return TableIncarnation.UNRECORDED
    return TableIncarnation.CURRENT if recorded == str(incarnation) else TableIncarnation.OTHER


def fits_descriptors(committed: int | None, descriptors: Sequence[ObjectDescriptor]) -> bool:
    """Whether a committed end offset can be the current incarnation's, judged by its objects.

    Tiering and bulk loads commit whole objects, and retention keeps the newest descriptor, so
    the committed end offset of the current incarnation's table is the end offset of one of
    its completed objects, or below the first one left.

    Args:
        committed: the table's committed end offset (for the partition), ``None`` when nothing
            was committed.
        descriptors: the topic's descriptors (§5.1).

    Returns:
        True when it fits.
    """
    if committed is None:
        return True
    completed = [d for d in descriptors if d.completed]
    if not completed:
        return False
    return committed < completed[0].start_offset or any(d.end_offset == committed for d in completed)


def holds_incarnation(
    table: Table, incarnation: int | None, committed: int | None, descriptors: Sequence[ObjectDescriptor]
) -> bool:
    """Whether a reader may take ``table``'s committed end offset as the topic's.

    Args:
        table: the topic's table.
        incarnation: the topic's current incarnation, ``None`` when it does not exist.
        committed: the table's committed end offset for the topic (its partition).
        descriptors: the topic's descriptors (§5.1).

    Returns:
        True for a table of the current incarnation, or without one recorded and whose
        committed end offset :func:`fits_descriptors`; also True when the topic does not exist
        (nothing to compare with).
    """
    if incarnation is None:
        return True
    state = table_incarnation(table, incarnation)
    if state is TableIncarnation.UNRECORDED:
        return fits_descriptors(committed, descriptors)
    return state is TableIncarnation.CURRENT


def _retired_name(table_topic: TopicName, table: Table, incarnation: int) -> str:
    recorded = table.properties.get(TOPIC_INCARNATION_PROPERTY)
    if recorded is not None and recorded.isdigit():
        return f"{table_topic.topic}__incarnation_{recorded}"
    return f"{table_topic.topic}__before_incarnation_{incarnation}"


def _retire(catalog: Catalog, table_topic: TopicName, table: Table, incarnation: int, why: str) -> None:
    """Rename the table (and its dead-letter table) out of the way of the new incarnation.

    Raises:
        NoSuchTableError: another writer renamed it first.
        TableAlreadyExistsError: the retired name is taken.
    """
    ident = iceberg.table_identifier(table_topic)
    retired = (table_topic.namespace, _retired_name(table_topic, table, incarnation))
    dlq = iceberg.dead_letter_identifier(table_topic)
    catalog.rename_table(ident, retired)
    log.warning(
        "table %s held another incarnation of topic %s (%s); renamed to %s and kept for readers, "
        "incarnation %d starts a new table",
        ".".join(ident), table_topic.path, why, ".".join(retired), incarnation,
    )
    if catalog.table_exists(dlq):
        retired_dlq = (retired[0], retired[1] + iceberg.DEAD_LETTER_SUFFIX)
        try:
            catalog.rename_table(dlq, retired_dlq)
        except NoSuchTableError:
            return
        log.warning("dead-letter table %s renamed to %s with it", ".".join(dlq), ".".join(retired_dlq))


def _adopt(table: Table, incarnation: int) -> None:
    """Record ``incarnation`` on a table that recorded none.

    Raises:
        CommitFailedException: another writer committed meanwhile.
    """
    with table.transaction() as tx:
        tx.set_properties({TOPIC_INCARNATION_PROPERTY: str(incarnation)})
    log.info("table %s adopted as incarnation %d of its topic", ".".join(table.name()[-2:]), incarnation)


def current_table(
    catalog: Catalog,
    table_topic: TopicName,
    incarnation: int | None,
    *,
    descriptors: Sequence[ObjectDescriptor],
    partition: int | None = None,
) -> Table | None:
    """The topic's table if it holds the current incarnation, after retiring one that does not
    (module docstring).

    Args:
        catalog: the shared catalog.
        table_topic: the topic the table is named after (the partitioned topic, for a partition).
        incarnation: the current incarnation (:func:`topic_incarnation`); ``None`` (the topic
            does not exist) returns the table as it is.
        descriptors: the descriptors of the topic being written (the partition's, for a
            partition), for a table that records no incarnation.
        partition: the partition index, for a partition of a partitioned topic.

    Returns:
        The table of the current incarnation, or ``None`` when there is none (yet).

    Raises:
        CommitFailedException: adopting kept conflicting with other writers.
        TableAlreadyExistsError: the retired table's name is taken.
    """
    ident = iceberg.table_identifier(table_topic)
    for attempt in range(1, _ATTEMPTS + 1):
        table = catalog.load_table(ident) if catalog.table_exists(ident) else None
        if table is None or incarnation is None:
            return table
        state = table_incarnation(table, incarnation)
        if state is TableIncarnation.CURRENT:
            return table
        committed = iceberg.committed_end_offset(table, partition=partition)
        try:
            if state is TableIncarnation.UNRECORDED and fits_descriptors(committed, descriptors):
                _adopt(table, incarnation)
                return catalog.load_table(ident)
            why = (
                f"incarnation {table.properties.get(TOPIC_INCARNATION_PROPERTY)}"
                if state is TableIncarnation.OTHER
                else f"no incarnation recorded, committed end offset {committed} fits none of its objects"
            )
            _retire(catalog, table_topic, table, incarnation, why)
        except (CommitFailedException, NoSuchTableError, TableAlreadyExistsError):
            # Another writer adopted or retired it first (both retire under the same name, so
            # a rename of the table it started meanwhile fails): look again.
            if attempt == _ATTEMPTS:
                raise
    return catalog.load_table(ident) if catalog.table_exists(ident) else None
