"""Schema-evolved rewrites: the changes Iceberg cannot make in place, applied by rewriting data
files in Spark, one atomic snapshot per table partition.

Iceberg evolves a schema in place only where old data files stay readable under the new
schema (Iceberg spec, "Schema Evolution": int→long, float→double, widening a decimal's
precision, required→optional, adding, dropping and renaming columns) and keeps each file in
the partition spec it was written with (spec, "Partition Evolution"). A type change such as
int→string or long→decimal(20,2), a field split (``route`` ``"JFK-LAX"`` into ``origin`` and
``dest``) and moving old files into a new partition spec need the data rewritten. This module
does that, declaratively, so a run can stop anywhere and the next one finishes the job.

The rewrite spec
================
An operator declares a rewrite in the table property :data:`REWRITE_PROPERTY`
(``danube.rewrite``) as JSON (:meth:`RewriteSpec.from_json` gives every rule)::

    {
      "version": 2,
      "columns": {
        "flight": {"type": "string", "expr": "CAST(flight AS STRING)"},
        "origin": {"type": "string", "expr": "split(route, '-')[0]"},
        "dest":   {"type": "string", "expr": "split(route, '-')[1]"}
      },
      "drop": ["route"],
      "where": "_schema_version < 2",
      "partition_spec": [{"source": "_publish_time", "transform": "day"}]
    }

* ``version``: the rewrite's own number (not the registry's schema version), above the
  previous rewrite's. Every snapshot a rewrite commits carries it in its summary
  (:data:`SUMMARY_REWRITE_VERSION`), every row it writes in :data:`REWRITE_VERSION_COLUMN`.
* ``columns``: target column → Iceberg type (``string``, ``long``, ``decimal(20, 2)``, …;
  primitives) and a Spark SQL expression giving its value from the row's columns *as they
  were before this rewrite* (default ``CAST(<name> AS <type>)``). A rewrite only fills a
  target that is null: a value already there (written by tiering in the new shape after
  staging, or by an earlier run) is never overwritten, so no row is converted twice.
* ``drop``: columns removed when the rewrite is finalized (e.g. the field that was split).
* ``where``: Spark SQL predicate over the same pre-rewrite columns choosing the rows to
  convert (default ``true``); for rows of the new shape that reached the table *before* the
  rewrite was staged and whose targets are legitimately null (``_schema_version >= 2``).
* ``partition_spec``: the target partition spec, a list of ``{"source", "transform",
  "name"?}`` with Iceberg transforms (``identity``, ``year``, ``month``, ``day``, ``hour``,
  ``bucket[N]``, ``truncate[W]``); omitted keeps the current spec.

How a rewrite runs
==================
1. **Stage** (:func:`stage_rewrite`, one pyiceberg metadata commit, no snapshot): add
   ``_rewrite_version``; add each missing target column; promote in place what Iceberg can
   promote; for a type it cannot promote, make the old column optional and rename it
   ``{name}__pre_v{version}`` (its field id, and so every old file's values, go with it) and
   add ``{name}`` with the new type and a new field id; make the ``drop`` columns optional;
   evolve the partition spec; record :class:`RewriteState` in :data:`REWRITE_STATE_PROPERTY`.
   From here on, appends write the target shape (tiering converts older writers' values into
   the widened column, :mod:`danube_pipeline.lake.iceberg.evolution`) and the target spec.
2. **Rewrite, partition by partition** (:func:`rewrite_table`): the data files of the
   requested UTC day (their ``_publish_time`` bounds touch it), grouped by (partition spec,
   partition), that sit in an older spec or hold a row with a fillable target, are read,
   converted, written as new data files in the current schema and spec, verified, and swapped
   in with Iceberg's ``RewriteFiles`` in one ``replace`` snapshot per partition, whose summary
   carries ``danube.rewrite-version``. Verified means, read back from the new files through
   Iceberg before the commit: the same row count (also in the files' metadata), the same
   order-free checksum (:func:`danube_pipeline.lake.spark.checksums.row_checksum`) of every column the
   rewrite does not write, the rewritten columns' checksum equal to the converted rows', and
   no row whose old value of a type-changed column is set but whose new value is null (a
   ``CAST`` that overflowed). On a mismatch nothing is committed, the new files are deleted
   and :class:`RewriteVerificationError` says what differs. A partition with nothing left to
   do is skipped (files whose ``_rewrite_version`` metrics show every row written by this
   version are not even read), so a re-run commits nothing.
3. **Finalize** (:func:`finalize_rewrite`, one metadata commit): when no file of the whole
   table needs work any more, the ``__pre_v`` and ``drop`` columns are dropped and the state
   is marked finished; later runs of that version do nothing at all.

Why one ``RewriteFiles`` commit per partition: it names the exact files it replaces, so rows
appended by tiering meanwhile are never touched (an overwrite by filter would delete them);
it fails ("Missing required files to delete") when compaction or retention replaced one of
those files since they were read, instead of committing their rows twice; and with
``validateFromSnapshot`` it fails when delete files were added against them
(:class:`RewriteConflictError`; the next run starts from the new files). The snapshot is a
``replace`` (Iceberg spec, "Snapshots": files rewritten without changing the table's rows):
the verification proves the rows are the same, only their representation and layout change.
The files are written through the Spark rewrite plumbing ``rewrite_data_files`` uses
(``ScanTaskSetManager``, ``FileRewriteCoordinator``; Iceberg Spark docs, "Procedures"), so they
carry the table's field ids, metrics and partition values as any Iceberg Spark write does.

Readers during a rewrite see, for a changed type, the new column null in rows not yet
converted and the old values under ``{name}__pre_v{version}``; ``COALESCE(flight,
CAST(flight__pre_v2 AS STRING))`` reads both. A table that is not partitioned has one
partition: the run for a day rewrites its files whose ``_publish_time`` bounds touch that day
(a file spanning two days is rewritten, whole, by the first of them).

The package
===========
:mod:`~danube_pipeline.lake.rewrite.spec` (the declared spec),
:mod:`~danube_pipeline.lake.rewrite.staging` (stage and finalize, the kept state),
:mod:`~danube_pipeline.lake.rewrite.planning` (files and per-partition units),
:mod:`~danube_pipeline.lake.rewrite.shape` (column roles and the conversion as Spark
expressions), :mod:`~danube_pipeline.lake.rewrite.java_table` (the Iceberg Java API over
Py4J), :mod:`~danube_pipeline.lake.rewrite.run` (:func:`rewrite_table`),
:mod:`~danube_pipeline.lake.rewrite.reports`, :mod:`~danube_pipeline.lake.rewrite.errors` and
:mod:`~danube_pipeline.lake.rewrite.properties`. This package re-exports their public names.
"""

from danube_pipeline.lake.rewrite.errors import (
    RewriteConflictError,
    RewriteError,
    RewriteSpecError,
    RewriteStateError,
    RewriteVerificationError,
)
from danube_pipeline.lake.rewrite.planning import DataFileStats, RewriteUnit, day_bounds_us, rewrite_units
from danube_pipeline.lake.rewrite.properties import (
    PUBLISH_TIME_COLUMN,
    REWRITE_PROPERTY,
    REWRITE_STATE_PROPERTY,
    REWRITE_VERSION_COLUMN,
    SUMMARY_REWRITE_GROUP,
    SUMMARY_REWRITE_PARTITION,
    SUMMARY_REWRITE_VERSION,
)
from danube_pipeline.lake.rewrite.reports import RewriteReport, UnitResult
from danube_pipeline.lake.rewrite.run import rewrite_table
from danube_pipeline.lake.rewrite.spec import (
    ColumnRewrite,
    PartitionField,
    RewriteSpec,
    read_rewrite_spec,
    set_rewrite_spec,
    spark_sql_type,
)
from danube_pipeline.lake.rewrite.staging import (
    RewriteState,
    finalize_rewrite,
    read_rewrite_state,
    retired_name,
    stage_rewrite,
)

__all__ = [
    "PUBLISH_TIME_COLUMN",
    "REWRITE_PROPERTY",
    "REWRITE_STATE_PROPERTY",
    "REWRITE_VERSION_COLUMN",
    "SUMMARY_REWRITE_GROUP",
    "SUMMARY_REWRITE_PARTITION",
    "SUMMARY_REWRITE_VERSION",
    "ColumnRewrite",
    "DataFileStats",
    "PartitionField",
    "RewriteConflictError",
    "RewriteError",
    "RewriteReport",
    "RewriteSpec",
    "RewriteSpecError",
    "RewriteState",
    "RewriteStateError",
    "RewriteUnit",
    "RewriteVerificationError",
    "UnitResult",
    "day_bounds_us",
    "finalize_rewrite",
    "read_rewrite_spec",
    "read_rewrite_state",
    "retired_name",
    "rewrite_table",
    "rewrite_units",
    "set_rewrite_spec",
    "spark_sql_type",
    "stage_rewrite",
]
