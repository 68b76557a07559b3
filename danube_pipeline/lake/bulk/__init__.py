"""Bulk loads on Spark: many segment objects into a topic's Iceberg table, in parallel.

What tiering does one object at a time (:func:`danube_pipeline.lake.tiering.commit_objects_to_table`),
:func:`bulk_load` does for a whole range of objects at once, for a first load of a topic with a
long history, a replay into a new table (``target``) after a schema rewrite or after fixing the
registry so that dead-lettered records decode again:

1. **Plan.** The topic's completed object descriptors (``docs/etcd-layout.md`` §5.1) above the
   target table's committed end offset (and from ``from_offset``) are the objects to read. They
   must be contiguous, and the first must continue the table, with the same rule as tiering: a
   hole is passed over only when its offsets were never handed out or were abandoned (§5.5), or
   lie below the first descriptor retention left.
2. **Schemas.** One Spark job lists the ``(schema_id, schema_version)`` pairs of the records
   (``mapInArrow`` over the objects); the registry is asked once per pair, and the table is
   created or evolved in place for them on the driver, oldest first, through the function
   :func:`danube_pipeline.lake.iceberg.commit_object` calls per object
   (:func:`~danube_pipeline.lake.iceberg.binding.bind_writers`).
3. **Decode.** A second ``mapInArrow`` job reads each object from the object store
   (:class:`~danube_pipeline.storage.objectstore.ObjectStore`), checks it against its descriptor
   (size, MD5 etag, offsets), parses it (:func:`~danube_pipeline.lake.segment_columns.decode_segment_columns`) and
   turns its records into the table's Arrow rows with the incremental path's own
   :func:`~danube_pipeline.lake.iceberg.rows.table_rows`. Records that cannot be rows come out of
   the same job as dead letters.
4. **Dead letters** are collected on the driver (they are the exception) and appended to
   ``{table}__dlq`` with :func:`~danube_pipeline.lake.iceberg.commit_dead_letters`, exactly once,
   before the rows, as tiering does (:mod:`danube_pipeline.lake.iceberg.dead_letter`).
5. **Write, then publish.** Iceberg's Spark writer appends the rows as a *staged* snapshot
   (write-audit-publish: the table property ``write.wap.enabled=true`` and the session's
   ``spark.wap.id``; Iceberg docs, "Branching and Tagging" / "WAP"), whose summary carries
   ``danube.topic``, ``danube.start-offset``, ``danube.end-offset``, ``danube.object-id``,
   ``danube.dead-letter-records`` (and ``danube.partition``) through the writer's
   ``snapshot-property.*`` options. The Spark writer distributes and sorts the rows by the
   table's partition spec and sort order (``_offset``), partitioned or not. The staged
   snapshot is then published by one pyiceberg commit that moves ``main`` to it **and** sets
   ``danube.committed-end-offset`` (``.part-{i}``), under the requirement that ``main`` is
   still the snapshot the load started from (Iceberg spec, "Optimistic Concurrency":
   ``assert-ref-snapshot-id``). So the bulk path keeps the incremental path's exactly-once
   rule (:mod:`danube_pipeline.lake.iceberg.append`): :func:`~danube_pipeline.lake.iceberg.committed_end_offset`
   sees the load, tiering continues after it without duplicates, and a re-run appends
   nothing. A load that loses the race (tiering committed meanwhile) leaves its staged
   snapshot unpublished (snapshot expiry removes it) and starts over from the plan.

The result is the table tiering would have written from the same objects: the same rows and
offsets, the same dead letters and the same committed end offset, in fewer, larger snapshots
and files. Schema evolution follows the order of the writer schemas' ``(schema_id, version)``
rather than the order in which objects first used them: when a topic's records switch back
and forth between schema ids, column order may differ from tiering's.

One module per step: :mod:`.plan` (step 1), :mod:`.schemas` (step 2 on the driver),
:mod:`.tasks` (what the Spark tasks run in steps 2 and 3), :mod:`.publish` (steps 3 to 5) and
:mod:`.load` (:func:`bulk_load`, which runs them in order).
"""

from danube_pipeline.lake.bulk.load import BulkLoadReport, bulk_load
from danube_pipeline.lake.bulk.plan import BulkLoadConflictError, BulkLoadError, BulkObject, plan_objects
from danube_pipeline.lake.bulk.publish import SUMMARY_ENGINE, WAP_ENABLED_PROPERTY

__all__ = [
    "SUMMARY_ENGINE",
    "WAP_ENABLED_PROPERTY",
    "BulkLoadConflictError",
    "BulkLoadError",
    "BulkLoadReport",
    "BulkObject",
    "bulk_load",
    "plan_objects",
]
