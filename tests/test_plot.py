"""``benchmarks/plot.py`` and ``benchmarks/results.py``: result documents written the way the
benchmarks write them, then drawn as PNG charts.

The inputs here are synthetic (made-up but valid documents, in the shapes ``results.py``
describes), so the test runs in seconds without running a benchmark; the charts committed
under ``benchmarks/plots/`` come from real runs.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from matplotlib.image import imread

pytestmark = pytest.mark.unit

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
CHARTS = ("throughput.png", "latency_cdf.png", "freshness.png", "cluster_timeline.png")


@pytest.fixture
def modules() -> Iterator[tuple[ModuleType, ModuleType]]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import plot
        import results

        yield results, plot
    finally:
        sys.path.remove(str(BENCHMARKS))


def _quantiles(results: ModuleType, median_ms: float) -> list[float]:
    samples_s = [median_ms / 1000 * (0.5 + i / 2000) for i in range(2000)]
    out: list[float] = results.quantiles_ms(samples_s)
    return out


def write_synthetic(results: ModuleType, directory: Path) -> None:
    """One document per benchmark, in the shapes of the module docstring of results.py."""
    targets = {}
    for target, rate in (("danube", 100_000.0), ("redis", 60_000.0), ("nats", 3_000.0), ("nats-default", 25_000.0)):
        cases = [
            {"key": str(size), "kind": "window", "size_bytes": size, "window": 256, "rate_per_s": 0.0,
             "messages": 10_000, "msgs_per_s": rate / (1 + size / 1024), "mb_per_s": rate * size / 1e6 / (1 + size / 1024),
             "acked": 10_000, "stored": 10_000, "complete": True, "latency_quantiles_ms": _quantiles(results, 2.0)}
            for size in (100, 1024, 4096)
        ]  # fmt: skip
        cases.append({"key": "w1", "kind": "window", "size_bytes": 100, "window": 1, "rate_per_s": 0.0, "messages": 500,
                      "msgs_per_s": 1500.0, "mb_per_s": 0.15, "acked": 500, "stored": 500, "complete": True,
                      "latency_quantiles_ms": _quantiles(results, 0.6)})  # fmt: skip
        cases.append({"key": "open", "kind": "open", "size_bytes": 100, "window": 1, "rate_per_s": 5000.0,
                      "messages": 5000, "msgs_per_s": 5000.0, "mb_per_s": 0.5, "acked": 5000, "stored": 5000,
                      "complete": True, "latency_quantiles_ms": _quantiles(results, 1.5)})  # fmt: skip
        targets[target] = cases
    results.write_result("peers", {"targets": targets}, directory)
    results.write_result("ingest", {"size_bytes": 1024, "messages": 200_000, "window": 256, "ingest_msgs_per_s": 20_000.0,
                                    "latency_quantiles_ms": _quantiles(results, 9.0)}, directory)  # fmt: skip
    points = [(t / 100, 1.0 + (t % 700) / 100) for t in range(6000)]
    results.write_result("freshness", {"rate_per_s": 1000.0, "duration_s": 60.0, "dagster": True, "bin_s": 1.0,
                                       "over_time": results.binned(points, 1.0), "p50_s": 4.0, "p95_s": 7.5,
                                       "max_s": 7.99, "missing": 0}, directory)  # fmt: skip
    acks = [i / 400 for i in range(400 * 14) if not 3.2 <= i / 400 < 5.6]
    results.write_result("cluster", {"bin_s": 0.1, "acks_per_bin": results.counts_per_bin(acks, 0.0, 0.1),
                                     "events": [{"t_s": 1.0 + i / 2, "kind": "move", "duration_ms": 130.0} for i in range(5)]
                                     + [{"t_s": 3.2, "kind": "kill", "duration_ms": None}],
                                     "move_ms": [130.0] * 5, "failover_s": 2.4, "cv": 0.05, "sim_cv": 0.14, "lost": 0,
                                     "duplicated": 0, "failed": []}, directory)  # fmt: skip


def test_helpers_keep_results_small_and_strict_json(modules: tuple[ModuleType, ModuleType], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    results, _ = modules
    quantiles = results.quantiles_ms([i / 1000 for i in range(1, 2001)])  # 1 ms .. 2000 ms
    assert len(quantiles) == 1000 and quantiles[0] == 2.0 and quantiles[499] == 1000.0 and quantiles[-1] == 2000.0
    assert results.quantiles_ms([]) == []
    assert results.binned([(0.2, 3.0), (0.7, 1.0), (0.9, 2.0), (2.5, 9.0)], 1.0) == [[0.0, 2.0, 3.0, 3.0], [2.0, 9.0, 9.0, 1.0]]
    assert results.counts_per_bin([0.05, 0.15, 0.16, 0.45, -1.0], 0.0, 0.1) == [1, 2, 0, 0, 1]
    monkeypatch.setenv(results.RESULTS_ENV, str(tmp_path / "elsewhere"))
    path = results.write_result("nan", {"x": math.nan, "nested": [math.inf, 1.5]})
    assert path == tmp_path / "elsewhere" / "nan.json"
    document = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))
    assert document["x"] is None and document["nested"] == [None, 1.5] and document["benchmark"] == "nan"


def test_every_chart_is_drawn_from_synthetic_results(modules: tuple[ModuleType, ModuleType], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    results, plot = modules
    write_synthetic(results, tmp_path / "results")
    out = tmp_path / "plots"
    assert plot.main(["--results", str(tmp_path / "results"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in CHARTS:
        png = out / name
        assert f"plot: {png}" in printed
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 20_000, name  # axes, lines and text, not an empty canvas
        pixels = imread(png)
        assert pixels.shape[0] >= 400 and pixels.shape[1] >= 900, (name, pixels.shape)
        assert pixels[..., :3].std() > 0.05, name  # not one flat colour


def test_missing_inputs_are_named_and_broken_ones_fail(modules: tuple[ModuleType, ModuleType], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    results, plot = modules
    results.write_result("freshness", {"rate_per_s": 1.0, "duration_s": 1.0, "bin_s": 1.0, "over_time": [],
                                       "p50_s": 0.0, "p95_s": 0.0, "max_s": 0.0}, tmp_path)  # fmt: skip
    assert plot.main(["--results", str(tmp_path), "--out", str(tmp_path / "plots")]) == 1
    captured = capsys.readouterr()
    assert "skipped throughput.png: no peers.json" in captured.out
    assert "skipped cluster_timeline.png: no cluster.json" in captured.out
    assert "FAILED freshness.png: ValueError: no points in freshness.json" in captured.err
    assert not (tmp_path / "plots").exists()
