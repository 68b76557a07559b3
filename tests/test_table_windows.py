"""Reading a table forward in windows, as a broker's table cursor does: one
``TableReader`` whose ``read_rows`` calls each pass the snapshot the previous one returned
and cut the window at ``max_bytes`` of payload.

The table is made by the real commit path (``tiering_helpers.make_env``: segment objects tiered
into a SQLite catalog, the table layout's ``raw_payload`` on), three objects with dead letters
among the rows, so a window's bytes cross data files and dead letters.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from pyiceberg.table import Table
from tiering_helpers import avro, avro_payload, make_env

from danube_pipeline.format.records import Record
from danube_pipeline.lake import iceberg
from danube_pipeline.names import TopicName
from danube_pipeline.storage.table_reader import TableReader

pytestmark = pytest.mark.integration

SCHEMA = avro({"name": "n", "type": "long"}, {"name": "s", "type": "string"})
T0 = int(dt.datetime(2026, 3, 1, tzinfo=dt.UTC).timestamp() * 1_000_000)


def _record(offset: int) -> Record:
    """Every third record a dead letter (bytes that are not Avro), payloads of 1 to 40 bytes."""
    dead = offset % 3 == 1
    return Record(
        offset=offset,
        publish_time_us=T0 + offset * 1_000,
        producer_id=5,
        producer_name="p",
        schema_id=1,
        schema_version=1,
        payload=b"\xff" * (offset % 7 + 1) if dead else avro_payload(SCHEMA, {"n": offset, "s": "x" * (offset % 20)}),
        attributes={"i": str(offset)} if offset % 2 else {},
        key=None if offset % 4 else f"k{offset}",
    )


def _expected_window(records: list[Record], first: int, max_bytes: int) -> list[Record]:
    """The records a window from ``first`` holds: as many as fit in ``max_bytes``, at least one."""
    out: list[Record] = []
    size = 0
    for r in records[first:]:
        size += len(r.payload)
        if out and size > max_bytes:
            break
        out.append(r)
    return out


@pytest.fixture
def table(etcd_endpoints: list[str], tmp_path: Path) -> tuple[Any, TopicName, list[Record]]:
    env = make_env(etcd_endpoints, tmp_path)
    env.registry.add_avro(1, 1, SCHEMA)
    topic = TopicName("default", "windows")
    records = [_record(o) for o in range(24)]

    asyncio.run(env.tier_exact(records, topic, per_object=8))
    return env, topic, records


def test_windows_cut_by_bytes_hold_what_fits_and_plan_each_start_once(
    table: tuple[Any, TopicName, list[Record]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each window holds the records from its first that fit in ``max_bytes`` (at least one),
    dead letters counted; a window cut by its bytes says so (``at_limit``), the last one does
    not; and the reader plans the table once for the first window and once for all the
    incremental windows after it, not once per window."""
    env, topic, records = table
    scans: list[str] = []
    full, incremental = Table.scan, Table.incremental_append_scan

    def spy_full(self: Table, *args: Any, **kwargs: Any) -> Any:
        scans.append("full:" + self.name()[-1])
        return full(self, *args, **kwargs)

    def spy_incremental(self: Table, *args: Any, **kwargs: Any) -> Any:
        scans.append("incremental:" + self.name()[-1])
        return incremental(self, *args, **kwargs)

    monkeypatch.setattr(Table, "scan", spy_full)
    monkeypatch.setattr(Table, "incremental_append_scan", spy_incremental)
    for max_bytes in (1, 25, 70, 10_000):
        scans.clear()
        reader = TableReader(env.catalog, iceberg.table_identifier(topic))
        offset, snapshot, windows = 0, None, 0
        while offset < len(records):
            rows = reader.read_rows(offset, max_records=100, max_bytes=max_bytes, after_snapshot_id=snapshot)
            expected = _expected_window(records, offset, max_bytes)
            assert rows.records() == expected, (offset, max_bytes)
            ends = offset + len(expected) == len(records)
            assert (rows.next_offset, rows.complete, rows.at_limit) == (offset + len(expected), True, not ends)
            offset, snapshot, windows = rows.next_offset, rows.snapshot_id, windows + 1
        planned = [s for s in scans if s.endswith(":" + topic.topic)]
        assert planned.count("full:" + topic.topic) == 1, max_bytes
        if max_bytes == 10_000:
            assert windows == 1 and planned == ["full:" + topic.topic]
        else:  # every later window reuses the plan of the first incremental one
            assert windows >= 3 and planned.count("incremental:" + topic.topic) == 1, (max_bytes, planned)
