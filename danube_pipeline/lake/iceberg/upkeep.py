"""A topic table's upkeep after each tiering pass: manifest merging, metadata-file cleanup and
snapshot expiry, so that a commit costs the same after 1,000 commits as after the first.

Every append adds a snapshot (:mod:`.append`). Left alone, three things grow with the table's
history and make each commit slower (``benchmarks/scale_commit.py`` measures it):

* the manifest list: a fast append adds one manifest per commit, and every commit reads and
  rewrites the whole list (Iceberg spec, "Manifest Lists");
* the table metadata file: it lists every snapshot with its summary, and every commit parses
  and rewrites it (Iceberg spec, "Table Metadata", ``snapshots``, ``snapshot-log``);
* the old metadata files, one per commit, never deleted.

The remedies are Iceberg's own:

* **manifest merging** (:data:`MERGE_PROPERTIES`): ``commit.manifest-merge.enabled`` makes
  appends merge-appends, which fold the small manifests into one once there are
  ``commit.manifest.min-count-to-merge`` of them (bins of ``commit.manifest.target-size-bytes``;
  Iceberg spec, "Table Properties", and Iceberg Java's ``MergeAppend``);
* **metadata-file cleanup**: ``write.metadata.delete-after-commit.enabled`` with
  ``write.metadata.previous-versions-max`` keeps the newest metadata files only;
* **snapshot expiry** (:func:`expire_snapshots`, by an :class:`UpkeepPolicy`): the oldest
  snapshots are removed (pyiceberg's ``ExpireSnapshots``, the metadata change of Iceberg's
  ``expire_snapshots``), and the files only they referenced deleted (see below).

:func:`table_upkeep` sets the properties on a table that lacks them (once, after its first
tiering pass), whoever created it (tiering, a bulk load, Spark).

**What expiry deletes.** Table history here is linear on ``main``: appends, compaction's
``replace`` and retention's ``overwrite``/``delete`` snapshots. Expiring the oldest snapshots
then makes unreachable: their manifest lists; the manifests no kept snapshot lists; and the data
files a later snapshot ``D`` removed (its ``DELETED`` manifest entries, Iceberg spec "Manifests")
once ``D``'s parent is expired, as no kept snapshot can still reference them. This is Iceberg
Java's incremental file cleanup, and costs what the expired snapshots changed, not the table's
size. A reader that planned a snapshot from before a compaction may still read the files it
replaced: a snapshot whose child removed data files less than ``data_file_grace_ms`` ago is
kept (the policy's guard), so such files outlive their replacement by that long at least. A
run that dies between the expiry's commit and the deletes leaves its files to
``remove_orphan_files`` (:mod:`danube_pipeline.lake.retention`).

Time travel: every snapshot newer than ``max_snapshot_age_ms``, and the newest
``min_snapshots_to_keep``, stay (Iceberg's ``history.expire.max-snapshot-age-ms`` and
``history.expire.min-snapshots-to-keep``); ``max_snapshots`` caps the count whatever their age
(a table committed every second keeps minutes of history, not hours). A subscription reading
from the table that holds an expired snapshot id scans the table instead of its later snapshots
(:mod:`danube_pipeline.storage.table_reader`); the committed end offset lives in a table property
and survives expiry (:mod:`.append`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pyiceberg.exceptions import CommitFailedException
from pyiceberg.manifest import ManifestEntryStatus
from pyiceberg.table import Table, TableProperties
from pyiceberg.table.snapshots import Snapshot

from danube_pipeline.lake.iceberg.small_files import MergePolicy, MergeResult, merge_small_files

__all__ = [
    "MERGE_PROPERTIES",
    "ExpiryResult",
    "UpkeepPolicy",
    "UpkeepResult",
    "expire_snapshots",
    "expiry_cut",
    "table_upkeep",
]

log = logging.getLogger(__name__)

MERGE_PROPERTIES: dict[str, str] = {
    TableProperties.MANIFEST_MERGE_ENABLED: "true",
    TableProperties.MANIFEST_MIN_MERGE_COUNT: "100",
    TableProperties.METADATA_DELETE_AFTER_COMMIT_ENABLED: "true",
    TableProperties.METADATA_PREVIOUS_VERSIONS_MAX: "100",
}
"""Table properties that bound a commit's manifest list and the table's old metadata files
(module docstring; Iceberg's defaults for the counts: merge at 100 manifests, 8 MiB bins, keep
100 metadata files)."""

MAX_SNAPSHOT_AGE_PROPERTY = "history.expire.max-snapshot-age-ms"
"""Iceberg's table property: snapshots older than this may be expired (ms)."""
MIN_SNAPSHOTS_PROPERTY = "history.expire.min-snapshots-to-keep"
"""Iceberg's table property: the newest snapshots kept whatever their age."""
MAX_SNAPSHOTS_PROPERTY = "danube.history.expire.max-snapshots"
"""Table property: the most snapshots kept whatever their age (ours; Iceberg has none)."""


@dataclass(frozen=True, slots=True)
class UpkeepPolicy:
    """How much history a topic's table keeps (module docstring, "Time travel").

    A table's properties override the defaults: ``history.expire.max-snapshot-age-ms``,
    ``history.expire.min-snapshots-to-keep`` and ``danube.history.expire.max-snapshots``.

    Attributes:
        max_snapshot_age_ms: snapshots older than this are expired (default 15 minutes).
        min_snapshots_to_keep: the newest snapshots always kept (default 10).
        max_snapshots: at most this many snapshots kept, the newest (default 100); 0: no cap.
        expire_batch: expiry commits only once this many snapshots are due, so that it is not
            a second commit after every append (default 20).
        data_file_grace_ms: a snapshot whose child removed data files (a compaction, a row
            delete, a small-file merge) that recently is kept, with those files (default 2
            minutes: how long a reader's plan of an older snapshot may still read them). The
            count of snapshots is therefore bounded by ``max_snapshots`` plus the commits of
            that long.
        merge_manifests: set :data:`MERGE_PROPERTIES` on a table that lacks them.
        small_files: when small data files are merged
            (:func:`~danube_pipeline.lake.iceberg.small_files.merge_small_files`).
        enabled: ``False`` does nothing at all (the baseline of ``benchmarks/scale_commit.py``).
    """

    max_snapshot_age_ms: int = 15 * 60_000
    min_snapshots_to_keep: int = 10
    max_snapshots: int = 100
    expire_batch: int = 20
    data_file_grace_ms: int = 2 * 60_000
    merge_manifests: bool = True
    small_files: MergePolicy = MergePolicy()
    enabled: bool = True

    @classmethod
    def disabled(cls) -> UpkeepPolicy:
        """A policy that leaves the table alone."""
        return cls(merge_manifests=False, small_files=MergePolicy(fan_in=0), enabled=False)

    def for_table(self, table: Table) -> UpkeepPolicy:
        """This policy with the table's own properties applied."""
        props = table.metadata.properties

        def value(name: str, default: int) -> int:
            text = props.get(name)
            try:
                return int(text) if text is not None else default
            except ValueError:
                log.warning("%s: table property %s=%r is not an integer; using %d", table.name(), name, text, default)
                return default

        return UpkeepPolicy(
            max_snapshot_age_ms=value(MAX_SNAPSHOT_AGE_PROPERTY, self.max_snapshot_age_ms),
            min_snapshots_to_keep=max(1, value(MIN_SNAPSHOTS_PROPERTY, self.min_snapshots_to_keep)),
            max_snapshots=value(MAX_SNAPSHOTS_PROPERTY, self.max_snapshots),
            expire_batch=self.expire_batch,
            data_file_grace_ms=self.data_file_grace_ms,
            merge_manifests=self.merge_manifests,
            small_files=self.small_files,
            enabled=self.enabled,
        )

    def describe(self) -> str:
        """One line for logs and benchmarks."""
        if not self.enabled:
            return "no upkeep (fast appends, every snapshot and metadata file kept)"
        return (f"merge {self.small_files.fan_in} small files per size class, merge manifests at {MERGE_PROPERTIES[TableProperties.MANIFEST_MIN_MERGE_COUNT]}, "
                f"expire snapshots older than {self.max_snapshot_age_ms / 1000:g} s or beyond the newest "
                f"{self.max_snapshots} (keep >= {self.min_snapshots_to_keep}), in batches of {self.expire_batch}")


@dataclass(frozen=True, slots=True)
class ExpiryResult:
    """What :func:`expire_snapshots` did.

    Attributes:
        snapshots_expired: snapshots removed from the table's metadata.
        metadata_files_deleted: manifest lists and manifests deleted.
        data_files_deleted: data and delete files deleted.
    """

    snapshots_expired: int = 0
    metadata_files_deleted: int = 0
    data_files_deleted: int = 0


@dataclass(frozen=True, slots=True)
class UpkeepResult:
    """What :func:`table_upkeep` did.

    Attributes:
        properties_set: the table lacked :data:`MERGE_PROPERTIES` and got them.
        merged: the small files merged.
        expiry: the snapshot expiry.
    """

    properties_set: bool = False
    merged: MergeResult = MergeResult()
    expiry: ExpiryResult = ExpiryResult()


def expiry_cut(table: Table, policy: UpkeepPolicy, *, now_ms: int | None = None) -> list[Snapshot]:
    """The snapshots ``policy`` expires now, oldest first: a prefix of the current snapshot's
    ancestry, plus any snapshot outside it older than the age limit.

    An ancestor is expired when it is older than ``max_snapshot_age_ms`` or beyond the newest
    ``max_snapshots``, and is not among the newest ``min_snapshots_to_keep``; the prefix stops
    at the first snapshot whose child removed data files less than ``data_file_grace_ms`` ago.
    Branch and tag heads are never expired.

    Args:
        table: the table, as loaded.
        policy: the policy (with the table's properties applied by the caller, or not).
        now_ms: the time, ms since the Unix epoch (default: now).

    Returns:
        The snapshots to expire; empty when none is due.
    """
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    current = table.current_snapshot()
    if current is None:
        return []
    metadata = table.metadata
    by_id = {s.snapshot_id: s for s in metadata.snapshots}
    chain: list[Snapshot] = []  # newest first
    snapshot: Snapshot | None = current
    while snapshot is not None:
        chain.append(snapshot)
        snapshot = by_id.get(snapshot.parent_snapshot_id) if snapshot.parent_snapshot_id is not None else None
    protected = {ref.snapshot_id for ref in metadata.refs.values()}
    oldest_first = chain[::-1]
    keep_from = len(chain) - max(1, policy.min_snapshots_to_keep)  # index in oldest_first
    cap_from = len(chain) - policy.max_snapshots if policy.max_snapshots > 0 else 0
    cut: list[Snapshot] = []
    for i, s in enumerate(oldest_first[:max(0, keep_from)]):
        due = s.timestamp_ms < now_ms - policy.max_snapshot_age_ms or i < cap_from
        if not due or s.snapshot_id in protected:
            break
        child = oldest_first[i + 1]
        if _removes_files(child) and child.timestamp_ms > now_ms - policy.data_file_grace_ms:
            break
        cut.append(s)
    in_chain = {s.snapshot_id for s in chain}
    stray = [s for s in metadata.snapshots if s.snapshot_id not in in_chain and s.snapshot_id not in protected
             and s.timestamp_ms < now_ms - policy.max_snapshot_age_ms]
    return cut + stray


def _removes_files(snapshot: Snapshot) -> bool:
    """Whether ``snapshot``'s summary says it removed data or delete files."""
    summary = snapshot.summary
    if summary is None:
        return True  # unknown: treat as removing
    return any(int(summary[k] or 0) for k in ("deleted-data-files", "removed-delete-files", "removed-position-delete-files",
                                                "removed-equality-delete-files") if summary[k] is not None)


def expire_snapshots(table: Table, expiring: list[Snapshot]) -> ExpiryResult:
    """Remove ``expiring`` from the table's metadata and delete the files only they reached
    (module docstring, "What expiry deletes").

    Args:
        table: the table, as loaded when ``expiring`` was chosen (:func:`expiry_cut`); refreshed.
        expiring: the snapshots to remove.

    Returns:
        An :class:`ExpiryResult`.

    Raises:
        CommitFailedException: the catalog refused the commit (the table changed meanwhile in
            a way that conflicts).
        OSError: a manifest list or manifest cannot be read.
    """
    if not expiring:
        return ExpiryResult()
    io = table.io
    gone = {s.snapshot_id for s in expiring}
    kept = [s for s in table.metadata.snapshots if s.snapshot_id not in gone]
    kept_manifests = {m.manifest_path for s in kept for m in s.manifests(io)}
    expired_lists = [s.manifest_list for s in expiring]
    expired_manifests = {m.manifest_path for s in expiring for m in s.manifests(io)} - kept_manifests
    # data files removed by a snapshot whose parent is expired now: no kept snapshot reaches them
    removed_data: set[str] = set()
    for child in table.metadata.snapshots:
        if child.parent_snapshot_id in gone and _removes_files(child):
            for manifest in child.manifests(io):
                if manifest.added_snapshot_id != child.snapshot_id or manifest.deleted_files_count == 0:
                    continue
                for entry in manifest.fetch_manifest_entry(io, discard_deleted=False):
                    if entry.status == ManifestEntryStatus.DELETED and entry.snapshot_id == child.snapshot_id:
                        removed_data.add(entry.data_file.file_path)
    table.maintenance.expire_snapshots().by_ids(sorted(gone)).commit()
    table.refresh()
    data_deleted = _delete(table, sorted(removed_data))
    meta_deleted = _delete(table, sorted(expired_manifests)) + _delete(table, expired_lists)
    return ExpiryResult(len(gone), meta_deleted, data_deleted)


def _delete(table: Table, paths: list[str]) -> int:
    deleted = 0
    for path in paths:
        try:
            table.io.delete(path)
            deleted += 1
        except FileNotFoundError:
            continue
        except OSError as exc:  # left to remove_orphan_files; the expiry is committed
            log.warning("%s: could not delete %s (%s); left for orphan removal", table.name(), path, exc)
    return deleted


def table_upkeep(table: Table, policy: UpkeepPolicy | None = None, *, now_ms: int | None = None) -> UpkeepResult:
    """Keep the table's commits cheap (module docstring): set :data:`MERGE_PROPERTIES` once,
    merge small data files (:func:`~danube_pipeline.lake.iceberg.small_files.merge_small_files`),
    and expire snapshots by ``policy`` once ``expire_batch`` of them are due.

    Safe beside other writers: each change is its own commit, and one that loses the catalog's
    compare-and-swap (or finds a snapshot to expire already gone) is logged and left to the next
    pass.

    Args:
        table: the topic's table, as loaded (refreshed when changed).
        policy: the policy; :class:`UpkeepPolicy` defaults when ``None``; the table's
            ``history.expire.*`` properties override it.
        now_ms: the time, ms since the Unix epoch (default: now).

    Returns:
        An :class:`UpkeepResult`.

    Raises:
        OSError: a manifest list or manifest cannot be read.
    """
    policy = policy or UpkeepPolicy()
    if not policy.enabled:
        return UpkeepResult()
    properties_set = False
    merged = MergeResult()
    try:
        if policy.merge_manifests:
            missing = {k: v for k, v in MERGE_PROPERTIES.items() if k not in table.metadata.properties}
            if missing:
                with table.transaction() as transaction:
                    transaction.set_properties(missing)
                properties_set = True
        merged = merge_small_files(table, policy.small_files)
        effective = policy.for_table(table)
        cut = expiry_cut(table, effective, now_ms=now_ms)
        if len(cut) < max(1, effective.expire_batch):
            return UpkeepResult(properties_set, merged)
        expiry = expire_snapshots(table, cut)
    except (CommitFailedException, ValueError) as exc:
        # ValueError: pyiceberg applies the expiry to the catalog's latest metadata, where
        # another writer (retention's Spark expiry) may have removed a snapshot already
        log.info("%s: upkeep lost a race with another writer (%s); the next pass retries", table.name(), exc)
        table.refresh()
        return UpkeepResult(properties_set, merged)
    log.debug("%s: expired %d snapshots, deleted %d metadata and %d data files", table.name(),
              expiry.snapshots_expired, expiry.metadata_files_deleted, expiry.data_files_deleted)
    return UpkeepResult(properties_set, merged, expiry)
