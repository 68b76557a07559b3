"""Benchmark results as JSON files, the input of ``benchmarks/plot.py``.

Each benchmark ends by calling :func:`write_result` with what it measured: one JSON document
per benchmark, ``benchmarks/results/{name}.json`` (the directory is ``$DANUBE_BENCH_RESULTS``
when set), replaced atomically by every run. Every document carries ``benchmark`` (its name),
``recorded_at`` (UTC, ISO 8601), ``machine`` (``{"cpus": int, "python": str, "platform":
str}``), ``command`` (the script's name and arguments), ``load_avg_1m`` (the machine's 1-minute
load average when the run ended: other work on the machine moves the figures) and the
benchmark's own fields; ``NaN`` and infinities are written as ``null``.

The helpers keep the documents small: latency samples become :data:`QUANTILE_POINTS`
quantiles (:func:`quantiles_ms`), series over time are binned (:func:`binned`,
:func:`counts_per_bin`). The documents each benchmark writes:

``peers.json``
    ``{"targets": {target: [case]}}``, each case ``{"key": str, "kind": "window" | "open",
    "size_bytes": int, "window": int, "rate_per_s": float, "messages": int, "msgs_per_s":
    float, "mb_per_s": float, "acked": int, "stored": int, "complete": bool,
    "latency_quantiles_ms": [float] (QUANTILE_POINTS values, q = i / QUANTILE_POINTS)}``.
``ingest.json``
    the run's figures (``msgs_per_s``, ``consume_msgs_per_s``, ``rss_*_mib``, ...) and
    ``latency_quantiles_ms`` of the window loop.
``freshness.json``
    ``{"rate_per_s": float, "bin_s": float, "over_time": [[t_s, p50_s, max_s, count]],
    "p50_s", "p95_s", "max_s"}``: ``t_s`` seconds of ack time since the first ack, freshness
    per ack-time bin.
``cluster.json``
    ``{"bin_s": float, "acks_per_bin": [int], "events": [{"t_s": float, "kind": "move" |
    "kill", "duration_ms": float | null}], "move_ms": [float | null], "failover_s", "cv",
    "lost", "duplicated"}``: acks over time since the load started, with the moves and the
    SIGKILL on the same clock.
``scale.json``
    ``{"topics": [point], "clients": [point], "recovery": {...} | null, "commit": {...} | null,
    "size_bytes", "window", "messages"}``: a topics point per topic count (``topics``,
    ``rss_mib``, ``rss_loaded_mib``, ``load_s``, ``ready_s``, ``msgs_per_s``, ``msgs_ratio``,
    ``etcd_keys_per_topic``, ``etcd_bytes_per_topic``, ...), a clients point per producer and
    consumer count (``clients``, ``produce_msgs_per_s``, ``consume_msgs_per_s``, ``rss_mib``),
    and what ``scale_recovery.measure_recovery`` and ``scale_commit.measure_commit`` returned.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loadgen import CaseResult

__all__ = [
    "QUANTILE_POINTS",
    "RESULTS_ENV",
    "binned",
    "counts_per_bin",
    "finite",
    "peers_document",
    "quantiles_ms",
    "read_result",
    "results_dir",
    "write_result",
]

RESULTS_ENV = "DANUBE_BENCH_RESULTS"
"""Environment variable naming the results directory (default ``benchmarks/results``)."""

QUANTILE_POINTS = 1000
"""Latency samples are kept as this many quantiles: ``q = 1/1000, 2/1000, ..., 1``."""


def results_dir() -> Path:
    """The results directory: ``$DANUBE_BENCH_RESULTS`` or ``benchmarks/results`` beside this file."""
    configured = os.environ.get(RESULTS_ENV)
    return Path(configured) if configured else Path(__file__).resolve().parent / "results"


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (``NaN``, ``inf``) replaced by ``None``, recursively
    through dicts, lists and tuples (tuples become lists), so the document is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_result(name: str, data: dict[str, Any], directory: Path | None = None) -> Path:
    """Write ``data`` as ``{directory}/{name}.json`` (atomically: a temporary file, then rename).

    Args:
        name: the benchmark's name, e.g. ``"peers"``.
        data: its figures; non-finite floats become ``null``.
        directory: where to write (default :func:`results_dir`, created when missing).

    Returns:
        The file written.

    Raises:
        OSError: the directory cannot be created or written.
    """
    target_dir = directory if directory is not None else results_dir()
    target_dir.mkdir(parents=True, exist_ok=True)
    document = {
        "benchmark": name,
        "recorded_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        **finite(data),
    }
    path = target_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(document, separators=(",", ":")) + "\n")
    tmp.replace(path)
    print(f"results: {path}")
    return path


def read_result(path: Path) -> dict[str, Any]:
    """One result document written by :func:`write_result`.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a JSON object.
    """
    document = json.loads(path.read_text())
    if not isinstance(document, dict):
        raise ValueError(f"{path}: not a JSON object")
    return document


def quantiles_ms(latencies_s: Sequence[float], points: int = QUANTILE_POINTS) -> list[float]:
    """Nearest-rank quantiles of ``latencies_s`` in milliseconds, at ``q = i / points`` for
    ``i = 1 .. points`` (so the last is the maximum); ``[]`` for no samples."""
    ordered = sorted(latencies_s)
    if not ordered:
        return []
    n = len(ordered)
    return [round(ordered[max(0, math.ceil(i / points * n) - 1)] * 1e3, 4) for i in range(1, points + 1)]


def binned(points: Iterable[tuple[float, float]], bin_s: float) -> list[list[float]]:
    """``(t_s, value)`` points grouped into bins of ``bin_s`` seconds of ``t_s``:
    ``[[bin_start_s, p50, max, count]]`` for every bin holding at least one point, in time order."""
    bins: dict[int, list[float]] = {}
    for t_s, value in points:
        bins.setdefault(int(t_s // bin_s), []).append(value)
    rows = []
    for index in sorted(bins):
        values = sorted(bins[index])
        rows.append([round(index * bin_s, 3), values[(len(values) - 1) // 2], values[-1], float(len(values))])
    return rows


def counts_per_bin(times_s: Iterable[float], start_s: float, bin_s: float) -> list[int]:
    """How many of ``times_s`` fall in each ``bin_s``-second bin from ``start_s`` on (times
    before ``start_s`` are dropped); the list ends at the last bin holding one."""
    counts: list[int] = []
    for t_s in times_s:
        if t_s < start_s:
            continue
        index = int((t_s - start_s) // bin_s)
        if index >= len(counts):
            counts.extend([0] * (index + 1 - len(counts)))
        counts[index] += 1
    return counts


def peers_document(results: dict[str, list[CaseResult]]) -> dict[str, Any]:
    """``peers.py``'s results by target, as ``peers.json`` holds them (see the module docstring)."""
    return {
        "targets": {
            target: [
                {
                    "key": r.case.key,
                    "kind": r.case.kind,
                    "size_bytes": r.case.size_bytes,
                    "window": r.case.window,
                    "chunk": r.case.chunk,
                    "rate_per_s": r.case.rate_per_s,
                    "messages": r.case.messages,
                    "msgs_per_s": r.loop.msgs_per_s,
                    "mb_per_s": r.loop.mb_per_s,
                    "acked": r.loop.acked,
                    "stored": r.stored,
                    "complete": r.loop.complete,
                    "latency_quantiles_ms": quantiles_ms(r.loop.latencies_s),
                }
                for r in cases
            ]
            for target, cases in results.items()
        }
    }
