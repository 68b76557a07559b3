"""Snapshot expiry that a later run can finish: the files a retention run is about to expire
are recorded before the expiry commits, and deleted after it.

Iceberg's ``expire_snapshots`` commits the new table metadata first and deletes the files only
the expired snapshots referenced afterwards. A run killed between the two leaves those files
(among them the Parquet files of rows retention deleted) referenced by no snapshot, and
nothing looks at them again until ``remove_orphan_files``' age limit (days) passes. So the
``snapshots`` step runs in three parts:

1. :func:`record_expiring_files`: every file reachable from a snapshot other than the current
   one (manifest lists, manifests, data and delete files) and not from the current one is
   written to the *expiry record*, a JSON file in the table's ``metadata/`` directory named
   for the topic (:func:`record_location`: ``danube-expiring-{topic}.json``; one per partition
   of a partitioned topic, whose table they share), made durable before anything else.
2. The expiry commits without deleting files
   (:func:`~danube_pipeline.lake.spark.procedures.expire_snapshots_keeping_files`).
3. :func:`finish_recorded_expiry`: the recorded files that no live snapshot references are
   deleted, then the record.

Every run starts with :func:`finish_recorded_expiry`, so what a dead run recorded is deleted
by the next one. The record may name more than the commit expired (a snapshot that became
current-but-one through a concurrent commit, or a run that died before its commit): a file is
deleted only when no snapshot of the table, as loaded at that moment, references it, so a
file of a live snapshot is never touched. A record left by a run that died before its commit
therefore deletes nothing that is still referenced; it is simply replaced.

The record lives beside the table's metadata, not in a table property (bounded in size) nor
in etcd: it is as large as the file list, and it belongs to the table's storage. Should it
grow older than ``remove_orphan_files``' age limit, the files it names are older still, so
orphan removal takes both.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from pyiceberg.io import FileIO
from pyiceberg.table import Table
from pyiceberg.table.snapshots import Snapshot

from danube_pipeline.names import TopicName

__all__ = [
    "RECORD_VERSION",
    "FinishedExpiry",
    "finish_recorded_expiry",
    "live_files",
    "record_expiring_files",
    "record_location",
    "snapshot_files",
]

log = logging.getLogger(__name__)

RECORD_VERSION = 1
"""The expiry record's ``version`` field."""


@dataclass(frozen=True, slots=True)
class FinishedExpiry:
    """What :func:`finish_recorded_expiry` did.

    Attributes:
        recorded: files the record named (0 without a record).
        deleted_files: the recorded files deleted (referenced by no live snapshot).
        deleted_data_files: how many of them were data or delete files.
    """

    recorded: int = 0
    deleted_files: tuple[str, ...] = ()
    deleted_data_files: int = 0


def record_location(table: Table, topic: TopicName) -> str:
    """Where the expiry record of ``topic`` lives: ``{table location}/metadata/danube-expiring-{topic}.json``.

    Args:
        table: the topic's table (the partitioned topic's, for a partition).
        topic: the topic retention runs for (a partition's own name, for a partition).

    Returns:
        The record's location, in the table's own scheme (``file:``, ``s3:``, …).
    """
    return f"{table.location().rstrip('/')}/metadata/danube-expiring-{topic.topic}.json"


def snapshot_files(io: FileIO, snapshot: Snapshot) -> tuple[set[str], set[str]]:
    """The files a snapshot references: ``(metadata files, data files)``.

    Metadata files are its manifest list and its manifests; data files are the data and delete
    files its manifests hold as live (added or existing) entries.

    Args:
        io: the table's file IO.
        snapshot: the snapshot.

    Returns:
        The two sets of locations.

    Raises:
        OSError: a manifest list or manifest cannot be read.
    """
    meta: set[str] = {snapshot.manifest_list}
    data: set[str] = set()
    for manifest in snapshot.manifests(io):
        meta.add(manifest.manifest_path)
        for entry in manifest.fetch_manifest_entry(io, discard_deleted=True):
            data.add(entry.data_file.file_path)
    return meta, data


def live_files(table: Table) -> set[str]:
    """Every file some snapshot of ``table`` references (as loaded; refresh it first).

    Raises:
        OSError: a manifest list or manifest cannot be read.
    """
    live: set[str] = set()
    for snapshot in table.snapshots():
        meta, data = snapshot_files(table.io, snapshot)
        live |= meta | data
    return live


def _local_path(location: str) -> str | None:
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return unquote(parsed.path)
    if parsed.scheme == "":
        return location
    return None


def _write_durably(io: FileIO, location: str, payload: bytes) -> None:
    """Write ``payload`` to ``location``: on a local file system through a temporary file,
    fsync, rename and an fsync of the directory; elsewhere with one object write (durable
    once it returns)."""
    path = _local_path(location)
    if path is None:
        with io.new_output(location).create(overwrite=True) as out:
            out.write(payload)
        return
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as out:
        out.write(payload)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_record(io: FileIO, location: str) -> dict[str, list[str]] | None:
    source = io.new_input(location)
    if not source.exists():
        return None
    with source.open() as stream:
        raw = stream.read()
    try:
        value = json.loads(raw)
        return {"metadata_files": list(value["metadata_files"]), "data_files": list(value["data_files"])}
    except (ValueError, KeyError, TypeError) as exc:
        # a record is written whole (rename or one object write); one that does not parse was
        # not written by this module: say so, and leave its files to remove_orphan_files
        log.error("expiry record %s does not parse (%s); ignored and removed", location, exc)
        return {"metadata_files": [], "data_files": []}


def record_expiring_files(table: Table, topic: TopicName, expiring: Iterable[Snapshot]) -> int:
    """Record, durably, the files only the ``expiring`` snapshots reference (not the current
    snapshot nor any other kept one), before their expiry commits.

    Args:
        table: the topic's table, as loaded right before the expiry.
        topic: the topic retention runs for.
        expiring: the snapshots the expiry is to remove.

    Returns:
        How many files the record names.

    Raises:
        OSError: a manifest cannot be read, or the record cannot be written.
    """
    gone = {s.snapshot_id for s in expiring}
    kept: set[str] = set()
    meta: set[str] = set()
    data: set[str] = set()
    for snapshot in table.snapshots():
        m, d = snapshot_files(table.io, snapshot)
        if snapshot.snapshot_id in gone:
            meta |= m
            data |= d
        else:
            kept |= m | d
    metadata_files, data_files = sorted(meta - kept), sorted(data - kept)
    record = {
        "version": RECORD_VERSION,
        "topic": topic.path,
        "snapshot_ids": sorted(gone),
        "metadata_files": metadata_files,
        "data_files": data_files,
    }
    _write_durably(table.io, record_location(table, topic), json.dumps(record).encode())
    return len(metadata_files) + len(data_files)


def finish_recorded_expiry(table: Table, topic: TopicName) -> FinishedExpiry:
    """Delete the files the topic's expiry record names that no snapshot of the table
    references, then the record (nothing when there is none).

    Args:
        table: the topic's table; it is refreshed here.
        topic: the topic retention runs for.

    Returns:
        A :class:`FinishedExpiry`.

    Raises:
        OSError: a manifest cannot be read, or a file cannot be deleted (the record stays, so
            the next run tries again).
    """
    location = record_location(table, topic)
    record = _read_record(table.io, location)
    if record is None:
        return FinishedExpiry()
    table.refresh()
    live = live_files(table)
    deleted: list[str] = []
    data_deleted = 0
    # data files first, metadata last: until the end, the manifests still say what was there
    for kind in ("data_files", "metadata_files"):
        for path in record[kind]:
            if path in live:
                continue
            if table.io.new_input(path).exists():
                table.io.delete(path)
                deleted.append(path)
                data_deleted += kind == "data_files"
    table.io.delete(location)
    recorded = len(record["data_files"]) + len(record["metadata_files"])
    if deleted:
        log.info("%s: deleted %d of %d files recorded for expiry", topic.path, len(deleted), recorded)
    return FinishedExpiry(recorded=recorded, deleted_files=tuple(deleted), deleted_data_files=data_deleted)
