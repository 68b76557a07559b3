"""The names a schema-evolved rewrite leaves in a table: the table properties it reads and
keeps, the snapshot summary keys of its commits and the columns it reads and writes."""

from __future__ import annotations

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
REWRITE_VERSION_COLUMN = "_rewrite_version"
"""Optional int column added at staging: the version of the last rewrite that wrote the row
(every row of a rewritten file: converted, already in shape, or left alone by ``where``); null
in rows no rewrite has written. Compaction keeps it, so a file whose metrics show it set to the
version everywhere is known done without being read."""
PUBLISH_TIME_COLUMN = "_publish_time"
