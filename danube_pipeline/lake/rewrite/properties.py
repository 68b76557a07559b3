"""The names a schema-evolved rewrite leaves in a table: the table properties it reads and
keeps, the snapshot summary keys of its commits and the columns it reads and writes.

The columns are Danube's reserved ones (:mod:`danube_pipeline.storage.table_columns`):
:data:`REWRITE_VERSION_COLUMN` (``_rewrite_version``), an optional int column added at staging,
holds the version of the last rewrite that wrote the row (every row of a rewritten file:
converted, already in shape, or left alone by ``where``), null in rows no rewrite has written;
compaction keeps it, so a file whose metrics show it set to the version everywhere is known
done without being read. Every other reserved column (``_raw_payload`` among them) is carried
unchanged and verified by checksum."""

from __future__ import annotations

from danube_pipeline.storage.table_columns import PUBLISH_TIME_COLUMN, REWRITE_VERSION_COLUMN

__all__ = [
    "PUBLISH_TIME_COLUMN",
    "REWRITE_PROPERTY",
    "REWRITE_STATE_PROPERTY",
    "REWRITE_VERSION_COLUMN",
    "SUMMARY_REWRITE_GROUP",
    "SUMMARY_REWRITE_PARTITION",
    "SUMMARY_REWRITE_VERSION",
]


REWRITE_PROPERTY = "danube.rewrite"
"""Table property holding the declared :class:`RewriteSpec` as JSON (set by an operator)."""
REWRITE_STATE_PROPERTY = "danube.rewrite-state"
"""Table property holding :class:`RewriteState` as JSON (kept by :mod:`danube_pipeline.lake.rewrite.staging`)."""
SUMMARY_REWRITE_VERSION = "danube.rewrite-version"
"""Snapshot summary property of every rewrite commit: the spec's ``version``."""
SUMMARY_REWRITE_PARTITION = "danube.rewrite-partition"
"""Snapshot summary property of every rewrite commit: the partition (``day=2026-11-20``, or
``unpartitioned``) and the spec id it was read from, ``{partition}@spec-{id}``."""
SUMMARY_REWRITE_GROUP = "danube.rewrite-group"
"""Snapshot summary property of every rewrite commit: a UUID naming the commit."""
