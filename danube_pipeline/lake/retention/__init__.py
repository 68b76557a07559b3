"""Retention: a namespace's ``retention_time_minutes`` / ``retention_size_mb`` applied to every
layer the pipeline owns (the topic's Iceberg table, its object descriptors in etcd, its segment
objects), then the broker asked to apply its local WAL retention.

**What is kept.** The policy (``docs/etcd-layout.md`` §2.1) gives a time limit (a record
whose ``publish_time`` is older than ``now - retention_ms`` has expired) and a size limit (the
newest completed objects are kept while their summed ``size`` stays within
``retention_bytes``). A topic is an offset-ordered log, so what retention keeps is a suffix of
it, starting at one offset, the *retained start* (:func:`retained_start_offset`):

* time: the first offset whose record has not expired, found by reading the segment objects
  oldest first (the objects are the source of truth: they exist for every descriptor, also for
  one not yet committed to the table and after a crash that already deleted the table's rows);
* size: the start offset of the oldest object the size limit keeps;
* the larger of the two when both are set.

Everything below the retained start is expired. When a producer's clock runs ahead of
another's, an expired record can sit right above one that has not expired; it stays until a
later run's cutoff passes the record below it. So retention never deletes a record within the
limits, and every layer keeps a contiguous range of offsets.

**Steps**, in this order, each idempotent; ``after_step(name)`` is called after each:

1. ``rows``: ``DELETE FROM {catalog}.{ns}.{topic} WHERE _offset < retained_start`` in Spark
   (whole data files are dropped, others rewritten). The table's committed end offset lives in
   its ``danube.committed-end-offset`` property, which the delete leaves alone, so the deleted
   rows are never appended again.
2. ``snapshots``: the snapshots older than the wall clock's now expire, keeping the last one:
   the deleted rows' files (and the files compaction replaced) leave storage. The files only
   those snapshots reference are recorded durably before the expiry commits and deleted after
   it (:mod:`~danube_pipeline.lake.retention.expiry`), and every run starts by deleting what
   a run that died in between recorded.
3. ``orphans``: ``remove_orphan_files`` older than ``orphan_min_age_ms`` (24 hours at least;
   files of commits still in flight must not be taken for orphans).
4. ``descriptors``: the completed descriptors (§5.1) that end below the retained start are
   deleted from etcd, oldest first, so the ones left are always contiguous. The newest
   completed descriptor is **always kept**, even when all its records expired: a broker that
   restarts with an empty WAL continues above the last descriptor's end offset, and
   ``objects/cur`` (§5.2) names it, so it must not vanish. A descriptor not yet committed to
   the table is deleted like any other once expired; the table then resumes at the first
   descriptor left (``first_offset`` of :func:`danube_pipeline.lake.iceberg.append_records`).
5. ``objects``: every object under ``topics/{ns}/{topic}/`` whose range ends below the first
   remaining descriptor: those whose descriptor step 4 deleted, and those left by a run that
   died between steps 4 and 5.
6. ``wal``: ``apply_local_retention(topic)`` on the broker admin API (:class:`RetentionAdmin`),
   skipped (``wal_step="skipped"``) while the client has no such method.

**Partitioned topics** (``docs/etcd-layout.md`` §3.1). Retention runs per partition
``{topic}-part-{i}``, each a topic with its own offsets, descriptors, objects and WAL; their
rows live in the partitioned topic's table, so step 1 deletes only the partition's rows
(``_partition = i``), and steps 2 and 3 work on that shared table.

**Crashes.** The retained start only grows from run to run (the cutoff moves forward; objects
below it were expired, so deleting them does not change where the first unexpired record is;
the size limit counts from the newest object). Whatever step a run dies after, the next run
computes the same or a later retained start and redoes what is left: rows below it (step 1
finds none if they are gone), descriptors below it, then objects below the first descriptor
left, and, before step 1, the files a run that died inside step 2 had recorded and no live
snapshot references. Between the steps every state is readable: the table holds a subset of
the offsets the descriptors cover, every remaining descriptor has its object (objects are deleted only after
their descriptor), and the descriptors are contiguous.

A namespace without limits (both 0, the default) is left alone: no rows, snapshots, orphan
files or descriptors are touched (the table's history stays available for time travel); only
objects an interrupted earlier run left below the first descriptor are removed, and the
broker is still asked to apply its own local retention.

**The package.** :mod:`~danube_pipeline.lake.retention.retained_start` decides what is kept
(the policy, the retained start, the expired descriptors, the days with expired rows);
:mod:`~danube_pipeline.lake.retention.steps` runs the steps (:func:`apply_retention`);
:mod:`~danube_pipeline.lake.retention.expiry` records and deletes the expired files. This
package re-exports their public names.
"""

from danube_pipeline.lake.retention.retained_start import (
    days_with_expired_rows,
    expired_descriptors,
    read_policy,
    retained_start_offset,
    size_start_offset,
    time_start_offset,
)
from danube_pipeline.lake.retention.steps import (
    ORPHAN_MIN_AGE_MS,
    STEPS,
    LocalRetentionResult,
    RetentionAdmin,
    RetentionReport,
    apply_retention,
)

__all__ = [
    "ORPHAN_MIN_AGE_MS",
    "STEPS",
    "LocalRetentionResult",
    "RetentionAdmin",
    "RetentionReport",
    "apply_retention",
    "days_with_expired_rows",
    "expired_descriptors",
    "read_policy",
    "retained_start_offset",
    "size_start_offset",
    "time_start_offset",
]
