"""Size-tiered merging of a table's small data files, by the writer, between Spark compactions.

A writer committing every second (the continuous writer's ``--commit-interval-s``) adds a data
file per commit and day: 3,600 an hour. The scheduled Spark compaction
(:func:`danube_pipeline.lake.spark.procedures.compact_table`, hourly) rewrites a day into files
of the target size, but until it runs every scan and every manifest merge reads all of them.
:func:`merge_small_files` keeps the count bounded in between, in the writer's own process,
with pyiceberg only:

* the day partition's live data files smaller than ``max_file_bytes`` are put in size classes
  ``k = ceil(log_F(size / base_bytes))`` with ``F = fan_in`` (0 up to ``base_bytes``);
* a class holding ``fan_in`` files or more is rewritten as one file: its rows read back
  (pyiceberg's ``ArrowScan``), sorted by ``_offset`` (the table's sort order), written through the
  commit path's writer (:func:`~danube_pipeline.lake.iceberg.data_files.data_files`), and
  committed as one ``overwrite`` snapshot that deletes the inputs and adds the output, on top
  of the snapshot they were read from (a concurrent commit makes it fail and it is tried again
  at the next pass; Iceberg spec, "Optimistic Concurrency").

This is Cassandra's size-tiered compaction: a row is rewritten about once per class (a few
times in all), and a day holds at most ``fan_in - 1`` files per class. The rows, their
offsets and the table's properties (the committed end offset) are unchanged, and the reader's
incremental scans skip ``overwrite`` snapshots, which add no offsets
(:mod:`danube_pipeline.storage.table_reader`). Tables with delete files (retention's row
deletes) are left to Spark.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import pyarrow.compute as pc
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io.pyarrow import ArrowScan
from pyiceberg.manifest import DataFile, DataFileContent, ManifestContent
from pyiceberg.table import FileScanTask, Table

from danube_pipeline.lake.iceberg.append import without_commit_retries
from danube_pipeline.lake.iceberg.data_files import data_files

__all__ = ["SUMMARY_MERGED_FILES", "MergePolicy", "MergeResult", "merge_small_files", "size_class"]

log = logging.getLogger(__name__)

SUMMARY_MERGED_FILES = "danube.merged-small-files"
"""Summary field of a merge's ``overwrite`` snapshot: the data files it replaced."""


@dataclass(frozen=True, slots=True)
class MergePolicy:
    """When :func:`merge_small_files` merges (module docstring).

    Attributes:
        fan_in: files of one size class that are merged into one (0: never merge).
        base_bytes: the upper size of class 0.
        max_file_bytes: files this large or larger are left to Spark's compaction.
    """

    fan_in: int = 10
    base_bytes: int = 256 * 1024
    max_file_bytes: int = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class MergeResult:
    """What :func:`merge_small_files` did.

    Attributes:
        files_replaced: data files removed by its snapshots.
        files_added: data files written.
        rows: rows rewritten.
    """

    files_replaced: int = 0
    files_added: int = 0
    rows: int = 0


def size_class(size_bytes: int, policy: MergePolicy) -> int:
    """The size class of a file of ``size_bytes``: 0 up to ``base_bytes``, 1 up to
    ``base_bytes * fan_in``, 2 up to ``base_bytes * fan_in ** 2``, and so on."""
    if policy.fan_in < 2:
        return 0
    k, bound = 0, policy.base_bytes
    while size_bytes > bound:
        k, bound = k + 1, bound * policy.fan_in
    return k


def merge_small_files(table: Table, policy: MergePolicy | None = None) -> MergeResult:
    """Merge each size class of a day partition that holds ``fan_in`` small files or more
    (module docstring).

    Reads the current snapshot's manifests only when its summary counts at least ``fan_in``
    data files.

    Args:
        table: the topic's table, as loaded (refreshed when changed).
        policy: when to merge; :class:`MergePolicy` defaults when ``None``.

    Returns:
        A :class:`MergeResult`.

    Raises:
        OSError: a manifest or data file cannot be read or written.
    """
    policy = policy or MergePolicy()
    snapshot = table.current_snapshot()
    if snapshot is None or policy.fan_in < 2:
        return MergeResult()
    total = snapshot.summary["total-data-files"] if snapshot.summary is not None else None
    if total is not None and int(total) < policy.fan_in:
        return MergeResult()
    manifests = snapshot.manifests(table.io)
    if any(m.content == ManifestContent.DELETES for m in manifests):
        return MergeResult()
    spec_id = table.metadata.default_spec_id
    groups: dict[tuple[str, int], list[DataFile]] = defaultdict(list)
    for manifest in manifests:
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
            f = entry.data_file
            if f.content != DataFileContent.DATA or f.spec_id != spec_id or f.file_size_in_bytes >= policy.max_file_bytes:
                continue
            groups[(repr(f.partition), size_class(f.file_size_in_bytes, policy))].append(f)
    result = MergeResult()
    for files in groups.values():
        if len(files) < policy.fan_in:
            continue
        merged = _merge(table, files)
        if merged is None:
            break
        result = MergeResult(result.files_replaced + merged.files_replaced, result.files_added + merged.files_added,
                             result.rows + merged.rows)
    return result


def _merge(table: Table, files: list[DataFile]) -> MergeResult | None:
    """Rewrite ``files`` (one partition) as one sorted file in one ``overwrite`` commit; ``None``
    when the commit lost to another writer (its output is deleted)."""
    metadata = table.metadata
    rows = ArrowScan(metadata, table.io, metadata.schema(), AlwaysTrue()).to_table(
        [FileScanTask(f) for f in files]
    )
    expected = sum(f.record_count for f in files)
    if rows.num_rows != expected:  # pragma: no cover - a data file and its manifest disagree
        raise OSError(f"{table.name()}: read {rows.num_rows} rows from {len(files)} files holding {expected}")
    rows = rows.take(pc.sort_indices(rows, sort_keys=[("_offset", "ascending")]))
    handle = without_commit_retries(table)
    written: list[DataFile] = []
    try:
        with handle.transaction() as transaction:
            update = transaction.update_snapshot(snapshot_properties={SUMMARY_MERGED_FILES: str(len(files))})
            with update.overwrite() as overwrite:
                for f in files:
                    overwrite.delete_data_file(f)
                written = list(data_files(transaction.table_metadata, rows, table.io, overwrite.commit_uuid))
                for f in written:
                    overwrite.append_data_file(f)
    except CommitFailedException as exc:
        log.info("%s: merging %d small files lost a commit race (%s); next pass", table.name(), len(files), exc)
        for f in written:
            table.io.delete(f.file_path)
        table.refresh()
        return None
    table.refresh()
    log.debug("%s: merged %d small files (%d rows) into %d", table.name(), len(files), rows.num_rows, len(written))
    return MergeResult(len(files), len(written), rows.num_rows)

