"""The table upkeep of every tiering pass (danube_pipeline.lake.iceberg.upkeep, small_files):
manifest merging, small-file merging and snapshot expiry, on a real pyiceberg SqlCatalog."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.table import Table

from danube_pipeline.dev.flights import FLIGHT_AVRO_SCHEMA, encode_flight, iter_flights
from danube_pipeline.format.batches import BatchBuilder
from danube_pipeline.format.records import SegmentHeader, object_id
from danube_pipeline.lake import iceberg
from danube_pipeline.lake.iceberg.small_files import MergePolicy, merge_small_files, size_class
from danube_pipeline.lake.iceberg.upkeep import (
    MAX_SNAPSHOTS_PROPERTY,
    MERGE_PROPERTIES,
    UpkeepPolicy,
    expiry_cut,
    table_upkeep,
)
from danube_pipeline.lake.iceberg.writer import avro_writer
from danube_pipeline.lake.segment_columns import decode_segment_columns
from danube_pipeline.names import TopicName

pytestmark = pytest.mark.unit

TOPIC = TopicName("default", "upkeep")
DAY_US = 86_400_000_000
START_US = 1_700_000_000_000_000
PAYLOADS = [encode_flight(f) for f in iter_flights(50)]
WRITER = iceberg.RegisteredWriter(1, 1, subject="flights", schema_type="Avro", writer=avro_writer(FLIGHT_AVRO_SCHEMA))
NO_MERGE = MergePolicy(fan_in=0)


@pytest.fixture()
def catalog(tmp_path: Path) -> Catalog:
    return iceberg.load_catalog(name="t", uri=f"sqlite:///{tmp_path / 'c.db'}", warehouse=(tmp_path / "wh").as_uri())


def _segment(index: int, records: int, days: int) -> tuple[bytes, int, int]:
    """Object ``index`` of ``records`` records spread over ``days`` day partitions."""
    start = index * records
    per_day = records // days
    parts = []
    offset = start
    for day in range(days):
        ts = START_US + day * DAY_US + index * 1_000_000
        builder = BatchBuilder(ts)
        for k in range(per_day):
            builder.append(PAYLOADS[(offset + k) % len(PAYLOADS)], timestamp_us=ts + k)
        data = builder.build(producer_id=7, producer_name="t", schema_id=1, schema_version=1)
        parts.append(struct.pack("<Q", offset) + data[8:])
        offset += per_day
    header = SegmentHeader(start_offset=start, created_at_ms=START_US // 1000).encode()
    return header + b"".join(parts), start, offset - 1


def _commit(catalog: Catalog, table: Table | None, index: int, *, records: int = 4, days: int = 1) -> Table:
    data, start, end = _segment(index, records, days)
    result = iceberg.commit_object(
        catalog, TOPIC, table, decode_segment_columns(data).records, {(1, 1): WRITER}, object_id(start, end),
        topic=TOPIC.path,
    )
    assert result.append.rows_appended == end - start + 1
    return result.table


def _files_on_disk(table: Table) -> set[str]:
    root = table.location().removeprefix("file://")
    return {os.path.join(d, f) for d, _, names in os.walk(root) for f in names}


def test_merge_properties_make_the_manifest_list_stay_bounded(catalog: Catalog) -> None:
    """After 60 appends the current snapshot lists fewer manifests than min-count-to-merge:
    merge-append folds them once that many are there (a commit reads a bounded number); old
    metadata files beyond previous-versions-max are deleted."""
    table = _commit(catalog, None, 0)
    policy = UpkeepPolicy(small_files=NO_MERGE, max_snapshots=0, max_snapshot_age_ms=10**12)
    table_upkeep(table, policy)
    assert all(table.metadata.properties.get(k) == v for k, v in MERGE_PROPERTIES.items())
    with table.transaction() as transaction:  # the same mechanism, smaller counts
        transaction.set_properties({"commit.manifest.min-count-to-merge": "10",
                                    "write.metadata.previous-versions-max": "5"})
    table.refresh()
    most = 0
    for i in range(1, 60):
        table = _commit(catalog, table, i)
        table_upkeep(table, policy)
        snapshot = table.current_snapshot()
        assert snapshot is not None
        most = max(most, len(snapshot.manifests(table.io)))
    assert most <= 10
    assert iceberg.data_file_count(table) == 60
    assert len(table.metadata.snapshots) == 60
    assert iceberg.read_offsets(table) == list(range(240))
    metadata_files = [p for p in _files_on_disk(table) if p.endswith(".metadata.json")]
    assert len(metadata_files) <= 6  # write.metadata.previous-versions-max + the current one


def test_expiry_keeps_what_the_policy_says_and_every_row(catalog: Catalog) -> None:
    table = None
    policy = UpkeepPolicy(small_files=NO_MERGE, max_snapshots=30, min_snapshots_to_keep=5, expire_batch=10,
                          max_snapshot_age_ms=10**12)
    counts = []
    for i in range(60):
        table = _commit(catalog, table, i)
        table_upkeep(table, policy)
        counts.append(len(table.metadata.snapshots))
    assert table is not None
    assert max(counts) <= 30 + 10 - 1  # the cap, plus the batch not yet due
    assert len(table.metadata.snapshots) >= 30
    newest = [s.snapshot_id for s in table.snapshots()][-30:]
    current = table.current_snapshot()
    assert current is not None and current.snapshot_id == newest[-1]
    assert iceberg.read_offsets(table) == list(range(240))
    assert iceberg.committed_end_offset(table) == 239
    # the expired snapshots' manifest lists are gone; the kept ones' are there
    lists = {p for p in _files_on_disk(table) if os.path.basename(p).startswith("snap-")}
    kept_lists = {s.manifest_list.removeprefix("file://") for s in table.snapshots()}
    assert lists == kept_lists


def test_expiry_by_age_and_min_count(catalog: Catalog) -> None:
    table = None
    for i in range(12):
        table = _commit(catalog, table, i)
    assert table is not None
    now = max(s.timestamp_ms for s in table.snapshots()) + 3_600_000
    policy = UpkeepPolicy(small_files=NO_MERGE, max_snapshots=0, min_snapshots_to_keep=3, max_snapshot_age_ms=60_000)
    cut = expiry_cut(table, policy, now_ms=now)
    assert len(cut) == 9  # every one is older than the age limit, the newest 3 stay
    # a young table loses nothing to the age limit
    assert expiry_cut(table, policy, now_ms=now - 3_600_000) == []
    # the table's property caps the count whatever the code's default
    with table.transaction() as transaction:
        transaction.set_properties({MAX_SNAPSHOTS_PROPERTY: "4"})
    table.refresh()
    capped = expiry_cut(table, UpkeepPolicy(small_files=NO_MERGE, min_snapshots_to_keep=1,
                                            max_snapshot_age_ms=10**12).for_table(table))
    assert len(capped) == len(table.metadata.snapshots) - 4


def test_small_files_merge_keeps_every_row_and_bounds_the_files(catalog: Catalog) -> None:
    table = None
    policy = UpkeepPolicy(small_files=MergePolicy(fan_in=5), max_snapshots=0, max_snapshot_age_ms=10**12)
    counts = []
    for i in range(25):
        table = _commit(catalog, table, i, records=6, days=2)
        table_upkeep(table, policy)
        counts.append(iceberg.data_file_count(table))
    assert table is not None
    assert max(counts) <= 2 * 5  # two days, fewer than fan_in files per size class before a merge
    assert iceberg.read_offsets(table) == list(range(150))
    assert iceberg.duplicate_offsets(table) == {}
    assert iceberg.committed_end_offset(table) == 149
    # rows of a merged file are sorted by _offset
    assert any(s.summary is not None and s.summary["danube.merged-small-files"] for s in table.snapshots())


def test_expiry_deletes_merged_away_files_only_after_the_grace(catalog: Catalog) -> None:
    table = None
    for i in range(5):
        table = _commit(catalog, table, i)
    assert table is not None
    replaced = {t.file.file_path.removeprefix("file://") for t in table.scan().plan_files()}
    merged = merge_small_files(table, MergePolicy(fan_in=5))
    assert merged.files_replaced == 5 and merged.files_added == 1
    for i in range(5, 10):
        table = _commit(catalog, table, i)
    grace = UpkeepPolicy(small_files=NO_MERGE, max_snapshots=2, min_snapshots_to_keep=1, expire_batch=1,
                         max_snapshot_age_ms=10**12, data_file_grace_ms=3_600_000)
    table_upkeep(table, grace)
    # the 4 oldest appends expire; the snapshot before the merge stays (the merge is younger
    # than the grace), and with it the files the merge replaced
    assert len(table.metadata.snapshots) == 11 - 4
    assert replaced <= _files_on_disk(table)
    no_grace = UpkeepPolicy(small_files=NO_MERGE, max_snapshots=2, min_snapshots_to_keep=1, expire_batch=1,
                            max_snapshot_age_ms=10**12, data_file_grace_ms=0)
    table_upkeep(table, no_grace)
    assert len(table.metadata.snapshots) == 2
    assert not replaced & _files_on_disk(table)
    assert iceberg.read_offsets(table) == list(range(40))


def test_size_classes() -> None:
    policy = MergePolicy(fan_in=10, base_bytes=1000)
    assert [size_class(n, policy) for n in (1, 1000, 1001, 10_000, 10_001, 100_001)] == [0, 0, 1, 1, 2, 3]


def test_disabled_policy_does_nothing(catalog: Catalog) -> None:
    table = None
    for i in range(3):
        table = _commit(catalog, table, i)
    assert table is not None
    before: dict[str, Any] = dict(table.metadata.properties)
    result = table_upkeep(table, UpkeepPolicy.disabled())
    assert result.expiry.snapshots_expired == 0 and not result.properties_set
    assert dict(table.metadata.properties) == before
