"""Table rows read and framed as Arrow columns: ``TableReader.read_rows`` and the broker's
``rows_to_batches``, which must give exactly what ``TableReader.read`` and
``records_to_batches`` give for the same records.

The framing test needs no services; the read test tiers a raw topic into a SQLite catalog through
the real commit path (``tiering_helpers.make_env``), with the table layout's ``raw_payload`` on.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.io.pyarrow import ArrowScan
from tiering_helpers import make_env

from broker.storage import table_batches
from broker.storage.table_batches import BATCH_BYTES, records_to_batches, rows_to_batches
from danube_pipeline.format.records import Record
from danube_pipeline.lake import iceberg
from danube_pipeline.names import TopicName
from danube_pipeline.storage.table_reader import TableReader
from danube_pipeline.storage.table_rows import ROW_SCHEMA, TableRows

T0 = 1_700_000_000_000_000
BATCH_RECORDS = 100
"""Records per batch in the framing test: the module's ``BATCH_RECORDS`` patched to it (the
framing does not depend on its size; random windows crossing every boundary stay small)."""
MAX_DELTA_US = 0xFFFFFFFF


def rows_of(records: list[Record]) -> pa.Table:
    """``records`` in the columns of ``ROW_SCHEMA`` (attributes: null for none)."""
    return pa.table(
        {
            "offset": [r.offset for r in records],
            "publish_time_us": [r.publish_time_us for r in records],
            "producer_id": [r.producer_id for r in records],
            "producer_name": [r.producer_name for r in records],
            "schema_id": [r.schema_id for r in records],
            "schema_version": [r.schema_version for r in records],
            "attributes": [list(r.attributes.items()) if r.attributes else None for r in records],
            "key": [r.key for r in records],
            "payload": [r.payload for r in records],
        },
        schema=ROW_SCHEMA,
    )


def random_records(rnd: random.Random, *, rising: bool) -> list[Record]:
    """Records that cross every batch boundary: producer and schema changes, a clock stepping
    back (unless ``rising``) or jumping past the 32-bit delta, payloads crossing
    ``BATCH_BYTES``, keys absent, empty or not ASCII, attributes."""
    out: list[Record] = []
    time_us = T0
    producer = (7, "p", 0, 0)
    for i in range(rnd.randint(1, 3 * BATCH_RECORDS)):
        roll = rnd.random()
        if roll < 0.02:
            time_us += MAX_DELTA_US + rnd.choice([0, 1])
        elif roll < 0.04 and not rising:
            time_us -= rnd.randint(1, 50)
        else:
            time_us += rnd.choice([0, 1, 1_000])
        if rnd.random() < 0.03:
            producer = rnd.choice([(7, "p", 0, 0), (2**64 - 1, "q", 0, 0), (7, "p", 12, 1), (7, "é", 12, 2)])
        size = rnd.choice([0, 5, 100, 100, BATCH_BYTES // 3])
        out.append(
            Record(
                offset=500 + i,
                publish_time_us=time_us,
                producer_id=producer[0],
                producer_name=producer[1],
                schema_id=producer[2],
                schema_version=producer[3],
                payload=rnd.randbytes(size),
                attributes={f"a{j}": "ü" * j for j in range(rnd.randint(1, 3))} if rnd.random() < 0.3 else {},
                key=rnd.choice([None, "", "k", "ключ"]),
            )
        )
    return out


@pytest.mark.unit
def test_rows_frame_into_the_batches_records_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(table_batches, "BATCH_RECORDS", BATCH_RECORDS)
    rnd = random.Random(25)
    for trial in range(60):
        records = random_records(rnd, rising=trial % 2 == 0)
        rows = rows_of(records)
        assert TableRows(rows, None, 0, True).records() == records
        assert rows_to_batches(rows) == records_to_batches(records), trial
    assert rows_to_batches(rows_of([])) == []


@pytest.mark.integration
def test_read_rows_gives_what_read_gives_in_windows_and_decodes_each_file_once(
    etcd_endpoints: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three objects, three data files: windows cut by ``max_records`` and by ``max_bytes``
    return the records ``read`` returns, say when they stopped at a limit, and decode each data
    file once for all the windows of one reader."""
    env = make_env(etcd_endpoints, tmp_path)
    topic = TopicName("default", "rows")
    records = [
        Record(offset=o, publish_time_us=T0 + o, producer_id=3, producer_name="p", schema_id=0, schema_version=0,
               payload=bytes([o]) * (1 + o % 4), attributes={"o": str(o)} if o % 2 else {}, key=None if o % 3 else "k")
        for o in range(30)
    ]  # fmt: skip

    asyncio.run(env.tier_exact(records, topic, per_object=10))
    decoded: list[Any] = []
    to_table = ArrowScan.to_table

    def counting(self: ArrowScan, tasks: Any) -> pa.Table:
        tasks = list(tasks)
        decoded.extend(t.file.file_path for t in tasks)
        return to_table(self, tasks)

    monkeypatch.setattr(ArrowScan, "to_table", counting)
    reader = TableReader(env.catalog, iceberg.table_identifier(topic))
    windows: list[tuple[int, int | None, list[Record]]] = []
    offset, snapshot = 0, None
    while True:
        rows = reader.read_rows(offset, max_records=4, max_bytes=7, after_snapshot_id=snapshot)
        window = rows.records()
        if not window:
            assert (rows.next_offset, rows.complete, rows.at_limit) == (30, True, False)
            break
        assert sum(len(r.payload) for r in window) <= 7 or len(window) == 1
        assert rows.complete and (rows.at_limit or rows.next_offset == 30)
        assert rows.next_offset == offset + len(window)
        windows.append((offset, snapshot, window))
        offset, snapshot = rows.next_offset, rows.snapshot_id
    assert [r for _, _, w in windows for r in w] == records
    assert len(windows) > 8 and len(decoded) == len(set(decoded)) == 3  # each data file decoded once

    for first, after, window in windows:  # the same windows through read(), a fresh reader each
        read = TableReader(env.catalog, iceberg.table_identifier(topic)).read(
            first, max_records=len(window), after_snapshot_id=after
        )
        assert read.records == window and read.next_offset == first + len(window)
