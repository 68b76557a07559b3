"""The tiering steps behind the assets, as plain async functions over the real systems.

* :mod:`.segments`: sealed WAL segments → objects in object storage plus their descriptors in
  etcd (:func:`tier_sealed_segments`, ``docs/etcd-layout.md`` §5.1, §5.2), and which topics
  and segments still need it (:func:`list_topic_roots`, :func:`segments_needing_tiering`).
* :mod:`.table`: segment objects → one Iceberg snapshot per object, exactly once
  (:func:`commit_objects_to_table`): each snapshot's summary records the last offset it holds,
  and a commit succeeds only if the table's current snapshot is still the one the writer read
  (the catalog's atomic swap of the metadata pointer; Iceberg spec, "Optimistic
  Concurrency"). The table evolves in place with the topic's schema versions, and records
  that cannot be rows go to its dead-letter table (:mod:`danube_pipeline.lake.iceberg.commit`).
* :mod:`.incarnation`: which incarnation of a topic (deleted and created again) a table holds;
  an earlier incarnation's table is renamed out of the way and kept (:func:`current_table`),
  for every writer that trusts a table's committed end offset.
* :mod:`.checks`: what the asset checks compare (:func:`descriptor_gaps`,
  :func:`descriptor_record_count`, :func:`object_mismatches`: descriptors against each other,
  the object store and the table).

They meet the broker only through its gRPC admin API and never read its disk. The registry's
writer schemas are looked up by :mod:`danube_pipeline.lake.schema_lookup`, shared with bulk
loads.
"""

from danube_pipeline.lake.tiering.checks import (
    DescriptorGap,
    ObjectMismatch,
    completed_descriptors,
    descriptor_gaps,
    descriptor_record_count,
    object_mismatches,
)
from danube_pipeline.lake.tiering.incarnation import (
    TableIncarnation,
    current_table,
    fits_descriptors,
    holds_incarnation,
    table_incarnation,
    topic_incarnation,
)
from danube_pipeline.lake.tiering.segments import (
    OFFSET_INDEX_INTERVAL_RECORDS,
    SegmentAdmin,
    TieringReport,
    list_topic_roots,
    retained_start,
    segments_needing_tiering,
    tier_sealed_segments,
    untiered_segments,
    with_released_segments,
)
from danube_pipeline.lake.tiering.table import TableReport, commit_objects_to_table

__all__ = [
    "OFFSET_INDEX_INTERVAL_RECORDS",
    "DescriptorGap",
    "ObjectMismatch",
    "SegmentAdmin",
    "TableIncarnation",
    "TableReport",
    "TieringReport",
    "commit_objects_to_table",
    "completed_descriptors",
    "current_table",
    "descriptor_gaps",
    "descriptor_record_count",
    "fits_descriptors",
    "holds_incarnation",
    "list_topic_roots",
    "object_mismatches",
    "retained_start",
    "segments_needing_tiering",
    "table_incarnation",
    "tier_sealed_segments",
    "topic_incarnation",
    "untiered_segments",
    "with_released_segments",
]
