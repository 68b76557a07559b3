"""PNG charts of the recorded benchmark results (``benchmarks/results/*.json``).

    .venv/bin/python benchmarks/plot.py                       # results/ -> plots/
    .venv/bin/python benchmarks/plot.py --results DIR --out DIR

Reads the documents ``benchmarks/results.py`` describes (each benchmark writes its own at the
end of a run) and draws, with matplotlib's Agg backend (no display needed):

* ``throughput.png`` (``peers.json``): msg/s and MB/s of every target in the window cases, by
  message size, on log scales (the durable NATS is two orders of magnitude below the rest);
* ``latency_cdf.png`` (``peers.json``, ``ingest.json``): send-to-ack latency CDFs, one panel
  per loop: one message in flight, the open loop (from the scheduled send time) and, from
  ``ingest.py``, Danube's window loop with a consumer attached;
* ``freshness.png`` (``freshness.json``): seconds from ack to visible in Iceberg, by ack time
  (median and maximum per second of acks);
* ``cluster_timeline.png`` (``cluster.json``): acks per second under load with the topic moves
  (each shaded for the time until the topic served again) and the SIGKILL of the owner
  (shaded until the first ack by another broker);
* ``scale.png`` (``scale.json``): one broker as its work grows: RSS, the time to load every
  topic after a restart, msg/s spread over the topics and etcd bytes per topic, by topic
  count; msg/s and RSS by concurrent producers and consumers; recovery time by WAL size; the
  Iceberg commit time by snapshot count (each panel with its target where the issue sets one).

A chart whose input is missing is skipped and named. The run ends with one line per chart
written, ``plot: PATH``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.layout_engine import ConstrainedLayoutEngine
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import read_result, results_dir  # noqa: E402 - a sibling module of this script

PLOTS_DIR = Path(__file__).resolve().parent / "plots"
"""Where the charts go by default: ``benchmarks/plots``."""

TARGET_LABELS = {
    "danube": "Danube (WAL fdatasync before ack)",
    "redis": "Redis, appendfsync always",
    "nats": "NATS JetStream, sync always",
    "nats-default": "NATS JetStream, default sync (not durable)",
}
TARGET_COLORS = {"danube": "#1f5fa8", "redis": "#c0392b", "nats": "#27ae60", "nats-default": "#95a5a6"}
DPI = 110


def _label(target: str) -> str:
    return TARGET_LABELS.get(target, target)


def _color(target: str) -> str:
    return TARGET_COLORS.get(target, "#7f8c8d")


def _footer(fig: Figure, doc: dict[str, Any], extra: str = "") -> None:
    """A small line under the chart: which benchmark, when, on what machine."""
    engine = fig.get_layout_engine()
    if isinstance(engine, ConstrainedLayoutEngine):
        engine.set(rect=(0, 0.04, 1, 0.96))  # room for the line below the axes
    machine = doc.get("machine") or {}
    command = doc.get("command") or f"{doc.get('benchmark')}.py"
    load = f", load average {doc['load_avg_1m']:g}" if doc.get("load_avg_1m") is not None else ""
    text = f"{command}, recorded {doc.get('recorded_at')}; {machine.get('cpus')} CPUs{load}, Python {machine.get('python')}"
    fig.text(0.01, 0.01, text + (f"; {extra}" if extra else ""), fontsize=7, color="#555555")


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path


def plot_throughput(peers: dict[str, Any], path: Path) -> Path:
    """``throughput.png``: msg/s and MB/s by message size, one bar per target (window cases).

    Raises:
        ValueError: ``peers`` holds no complete window case.
    """
    targets: dict[str, list[dict[str, Any]]] = peers["targets"]
    window = {t: {c["size_bytes"]: c for c in cases if c["kind"] == "window" and c["window"] > 1}
              for t, cases in targets.items()}  # fmt: skip
    sizes = sorted({size for by_size in window.values() for size in by_size})
    if not sizes:
        raise ValueError("no window case in peers.json")
    fig = Figure(figsize=(11, 4.8), layout="constrained")
    axes = fig.subplots(1, 2)
    width = 0.8 / max(1, len(window))
    for ax, field, title in ((axes[0], "msgs_per_s", "messages per second"), (axes[1], "mb_per_s", "MB/s of payload")):
        for i, (target, by_size) in enumerate(window.items()):
            xs = [s + (i - (len(window) - 1) / 2) * width for s in range(len(sizes))]
            values = [by_size[size][field] if size in by_size and by_size[size][field] else 0.0 for size in sizes]
            bars = ax.bar(xs, values, width, label=_label(target), color=_color(target))
            ax.bar_label(bars, labels=[f"{v:,.0f}" if v >= 10 else f"{v:.1f}" for v in values], fontsize=6, rotation=90,
                         padding=2)  # fmt: skip
        ax.set_xticks(range(len(sizes)), [f"{s:,} B" for s in sizes])
        ax.set_yscale("log")
        ax.set_xlabel("message size")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3, which="both")
        top = ax.get_ylim()[1]
        ax.set_ylim(top=top * 4)
    first = next(iter(next(iter(window.values())).values()))
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"One producer, at most {first['window']} unacknowledged, {first['messages']:,} messages per case")
    _footer(fig, peers)
    return _save(fig, path)


def _cdf(ax: Axes, quantiles_ms: Sequence[float], label: str, color: str) -> None:
    n = len(quantiles_ms)
    ax.plot(list(quantiles_ms), [(i + 1) / n for i in range(n)], label=label, color=color, linewidth=1.6)


def _case(cases: Sequence[dict[str, Any]], key: str) -> dict[str, Any] | None:
    return next((c for c in cases if c["key"] == key and c["latency_quantiles_ms"]), None)


def plot_latency_cdf(peers: dict[str, Any] | None, ingest: dict[str, Any] | None, path: Path) -> Path:
    """``latency_cdf.png``: send-to-ack latency CDFs: one in flight and open loop (every target
    of ``peers``), and Danube's window loop with a consumer attached (``ingest``).

    Raises:
        ValueError: neither document holds latency quantiles.
    """
    panels: list[tuple[str, list[tuple[str, str, Sequence[float]]]]] = []
    if peers is not None:
        for key, title in (("w1", "one in flight"), ("open", "open loop (from the scheduled send)")):
            lines = []
            for target, cases in peers["targets"].items():
                case = _case(cases, key)
                if case is not None:
                    lines.append((_label(target), _color(target), case["latency_quantiles_ms"]))
                    if key == "open":
                        title = f"open loop, {case['rate_per_s']:,.0f} msg/s (from the scheduled send)"
                    else:
                        title = f"one in flight, {case['size_bytes']} B"
            if lines:
                panels.append((title, lines))
    if ingest is not None and ingest.get("latency_quantiles_ms"):
        panels.append((
            f"window W={ingest['window']}, {ingest['size_bytes']} B, consumer attached (ingest.py)",
            [(_label("danube"), _color("danube"), ingest["latency_quantiles_ms"])],
        ))  # fmt: skip
    if not panels:
        raise ValueError("no latency quantiles in peers.json or ingest.json")
    fig = Figure(figsize=(5 * len(panels), 4.6), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, lines) in zip(axes, panels, strict=True):
        for label, color, quantiles in lines:
            _cdf(ax, quantiles, label, color)
        ax.set_xscale("log")
        low, high = ax.get_xlim()
        decades = math.log10(high / low) if low > 0 else 0.0
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0,) if decades > 2.5 else (1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("send to ack, ms (log)")
        ax.set_ylabel("fraction of messages")
        ax.set_ylim(0, 1.01)
        ax.axhline(0.99, color="#888888", linewidth=0.8, linestyle=":")
        ax.text(ax.get_xlim()[0], 0.985, " p99", fontsize=7, va="top", color="#666666")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("Send-to-ack latency, cumulative distribution")
    _footer(fig, peers if peers is not None else ingest or {})
    return _save(fig, path)


def plot_freshness(doc: dict[str, Any], path: Path) -> Path:
    """``freshness.png``: ack to visible in Iceberg, by ack time.

    Raises:
        ValueError: the document holds no points.
    """
    rows = doc["over_time"]
    if not rows:
        raise ValueError("no points in freshness.json")
    t = [r[0] for r in rows]
    fig = Figure(figsize=(10, 4.4), layout="constrained")
    ax = fig.subplots()
    ax.fill_between(t, [r[1] for r in rows], [r[2] for r in rows], color="#1f5fa8", alpha=0.15, step="post",
                    label="median to maximum, per second of acks")  # fmt: skip
    ax.step(t, [r[1] for r in rows], where="post", color="#1f5fa8", linewidth=1.4, label="median")
    ax.step(t, [r[2] for r in rows], where="post", color="#1f5fa8", linewidth=0.8, linestyle="--", label="maximum")
    if doc.get("p95_s") is not None:
        ax.axhline(doc["p95_s"], color="#c0392b", linewidth=1, linestyle=":", label=f"p95 over the run, {doc['p95_s']:.2f} s")
    ax.set_xlabel("ack time, s from the first ack")
    ax.set_ylabel("ack to visible in Iceberg, s")
    ax.set_ylim(0, max(r[2] for r in rows) * 1.3)
    ax.set_xlim(t[0], t[-1] + doc.get("bin_s", 1.0))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", ncols=4)
    dagster = "Dagster running" if doc.get("dagster") else "no Dagster"
    fig.suptitle(f"Freshness under make dev defaults: {doc['rate_per_s']:,.0f} msg/s for {doc['duration_s']:g} s ({dagster})")
    _footer(fig, doc, f"p50 {doc['p50_s']:.2f} s, p95 {doc['p95_s']:.2f} s, max {doc['max_s']:.2f} s")
    return _save(fig, path)


def plot_cluster_timeline(doc: dict[str, Any], path: Path) -> Path:
    """``cluster_timeline.png``: acks per second with the moves and the SIGKILL marked.

    Raises:
        ValueError: the document holds no acks.
    """
    counts: list[int] = doc["acks_per_bin"]
    if not counts:
        raise ValueError("no acks in cluster.json")
    bin_s: float = doc["bin_s"]
    fig = Figure(figsize=(11, 4.4), layout="constrained")
    ax = fig.subplots()
    ax.step([i * bin_s for i in range(len(counts))], [c / bin_s for c in counts], where="post", color="#1f5fa8",
            linewidth=1, label=f"acks per second ({bin_s * 1000:g} ms bins)")  # fmt: skip
    top = max(counts) / bin_s
    moves = [e for e in doc["events"] if e["kind"] == "move"]
    for i, event in enumerate(moves):
        duration_s = (event["duration_ms"] or 0.0) / 1000
        ax.axvspan(event["t_s"], event["t_s"] + duration_s, color="#f39c12", alpha=0.35,
                   label="topic move: unload to serving again" if i == 0 else None)  # fmt: skip
    for event in (e for e in doc["events"] if e["kind"] == "kill"):
        ax.axvline(event["t_s"], color="#c0392b", linewidth=1.5, label="SIGKILL of the owner")
        if doc.get("failover_s") is not None:
            ax.axvspan(event["t_s"], event["t_s"] + doc["failover_s"], color="#c0392b", alpha=0.12,
                       label=f"failover: {doc['failover_s']:.2f} s to an ack by another broker")  # fmt: skip
    rates = sorted(c / bin_s for c in counts if c)
    typical = rates[len(rates) // 2] if rates else top
    if top > 4 * typical:  # a burst (sends buffered during the failover, acked at once) would flatten the rest
        ax.set_ylim(0, typical * 4)
        peak_at = counts.index(max(counts)) * bin_s
        ax.annotate(f"burst: {top:,.0f} acks/s", xy=(peak_at, typical * 3.9), xytext=(peak_at + 0.4, typical * 2.6),
                    fontsize=8, arrowprops={"arrowstyle": "->", "color": "#555555"})  # fmt: skip
    else:
        ax.set_ylim(0, top * 1.4)
    ax.set_xlabel("s from the first ack")
    ax.set_ylabel("acks per second")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", ncols=2)
    done = [m for m in doc.get("move_ms") or [] if m is not None]
    moves_text = f"{len(moves)} moves, slowest {max(done):.0f} ms" if done else f"{len(moves)} moves"
    fig.suptitle(f"Three brokers under load: {moves_text}, then the owner killed")
    _footer(fig, doc, f"lost {doc.get('lost')}, duplicated {doc.get('duplicated')}")
    return _save(fig, path)


def _log_x(ax: Axes, xlabel: str) -> None:
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:,.0f}"))
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3, which="both")


def _unmeasured(ax: Axes, points: Sequence[object]) -> None:
    """Say so on a panel whose part did not run."""
    if not points:
        ax.text(0.5, 0.5, "not measured in this run", transform=ax.transAxes, ha="center", color="#888888")


_Line = tuple[str, Sequence[float], str]
"""One line of a panel: ``(style, values, label)``; the first line is Danube's colour, the
others grey or green."""
_LINE_COLORS = (_color("danube"), "#7f8c8d", "#27ae60")


def _panel(ax: Axes, x: Sequence[float], lines: Sequence[_Line], *, title: str, ylabel: str,
           target: tuple[float, str] | None = None, xlabel: str = "topics", log_x: bool = True) -> None:
    """One curve panel of ``scale.png``: its lines by ``x``, the target as a dotted line."""
    for (style, values, label), color in zip(lines, _LINE_COLORS, strict=False):
        ax.plot(list(x), list(values), style, color=color, label=label)
    if target is not None and x:
        ax.axhline(target[0], color="#c0392b", linewidth=0.8, linestyle=":", label=target[1])
    if log_x:
        _log_x(ax, xlabel)
    else:
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    _unmeasured(ax, x)


def plot_scale(doc: dict[str, Any], path: Path) -> Path:
    """``scale.png``: the curves of ``benchmarks/scale.py``, one panel each.

    Raises:
        ValueError: the document holds no curve.
    """
    topics: list[dict[str, Any]] = doc.get("topics") or []
    clients: list[dict[str, Any]] = doc.get("clients") or []
    recovery = (doc.get("recovery") or {}).get("points") or []
    commit = (doc.get("commit") or {}).get("points") or []
    if not (topics or clients or recovery or commit):
        raise ValueError("no curve in scale.json")
    fig = Figure(figsize=(18, 8.5), layout="constrained")
    top, bottom = fig.subplots(2, 4)
    n = [p["topics"] for p in topics]
    _panel(top[0], n, [("o-", [p["rss_mib"] for p in topics], "peak over the step"),
                       ("s--", [p["rss_loaded_mib"] for p in topics], "after a restart, no client")],
           title="memory by topic count", ylabel="broker RSS, MiB", target=(1024, "target 1 GiB"))
    _panel(top[1], n, [("o-", [p["load_s"] for p in topics], "every topic served again"),
                       ("s--", [p["ready_s"] for p in topics], "ready file written")],
           title="load after a restart", ylabel="s from the start after SIGTERM", target=(60, "target 60 s"))
    one = topics[0]["msgs_per_s"] if topics else 0.0
    _panel(top[2], n, [("o-", [p["msgs_per_s"] for p in topics], "msg/s, one producer loop")],
           title="msg/s spread over the topics", ylabel="acked msg/s", target=(0.7 * one, "target 0.7 x one topic"))
    _panel(top[3], n, [("o-", [p["etcd_bytes_per_topic"] for p in topics], "bytes per topic")],
           title="etcd per topic", ylabel="etcd bytes (keys + values) per topic")
    for x, p in zip(n, topics, strict=True):
        top[3].annotate(f"{p['etcd_keys_per_topic']:.1f} keys", (x, p["etcd_bytes_per_topic"]), fontsize=7,
                        textcoords="offset points", xytext=(0, 6), ha="center")
    c = [p["clients"] for p in clients]
    _panel(bottom[0], c, [("o-", [p["produce_msgs_per_s"] for p in clients], "produce"),
                          ("s--", [p["consume_msgs_per_s"] for p in clients], "consume")],
           title="n producers + n consumers", ylabel="msg/s", xlabel="producers (= consumers)")
    _panel(bottom[1], c, [("o-", [p["rss_mib"] for p in clients], "broker RSS, peak")],
           title="memory by client count", ylabel="MiB", xlabel="producers (= consumers)")
    wal = [p["wal_mib"] for p in recovery]
    _panel(bottom[2], wal, [("o-", [p["recovery_s"] for p in recovery], "SIGKILL to serving"),
                            (":", [5 * w / 1024 for w in wal], "target 5 s per GiB")],
           title="recovery after SIGKILL", ylabel="s", xlabel="WAL, MiB", log_x=False)
    first = commit[0]["commit_ms"] if commit else 0.0
    _panel(bottom[3], [p["snapshots"] for p in commit], [("o-", [p["commit_ms"] for p in commit], "commit time")],
           title="Iceberg commit by history", ylabel="ms", xlabel="snapshots in the table", log_x=False,
           target=(2 * first, "target 2 x the first"))
    fig.suptitle(f"One broker as its work grows ({doc.get('size_bytes')} B messages)")
    _footer(fig, doc)
    return _save(fig, path)


def _load(directory: Path, name: str) -> dict[str, Any] | None:
    path = directory / f"{name}.json"
    return read_result(path) if path.exists() else None


def render_all(results: Path, out: Path) -> tuple[list[Path], list[str], list[str]]:
    """Every chart whose input is in ``results``, written under ``out``.

    Returns:
        ``(files written, charts skipped for want of input, charts that failed)``, the last two
        as lines naming the chart and the reason.
    """
    peers, ingest = _load(results, "peers"), _load(results, "ingest")
    freshness, cluster = _load(results, "freshness"), _load(results, "cluster")
    scale = _load(results, "scale")
    written: list[Path] = []
    skipped: list[str] = []
    failed: list[str] = []
    jobs: list[tuple[str, bool, Callable[[Path], Path], str]] = [
        ("throughput.png", peers is not None, lambda p: plot_throughput(peers or {}, p), "peers.json"),
        ("latency_cdf.png", peers is not None or ingest is not None, lambda p: plot_latency_cdf(peers, ingest, p),
         "peers.json or ingest.json"),
        ("freshness.png", freshness is not None, lambda p: plot_freshness(freshness or {}, p), "freshness.json"),
        ("cluster_timeline.png", cluster is not None, lambda p: plot_cluster_timeline(cluster or {}, p), "cluster.json"),
        ("scale.png", scale is not None, lambda p: plot_scale(scale or {}, p), "scale.json"),
    ]  # fmt: skip
    for name, present, draw, needs in jobs:
        if not present:
            skipped.append(f"{name}: no {needs} in {results}")
            continue
        try:
            written.append(draw(out / name))
        except (KeyError, ValueError, TypeError) as exc:
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    return written, skipped, failed


def main(argv: Sequence[str] | None = None) -> int:
    """Draw the charts; 0 when at least one was written and none failed, else 1."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=None, help="results directory (default: $DANUBE_BENCH_RESULTS or benchmarks/results)")
    parser.add_argument("--out", type=Path, default=PLOTS_DIR, help="where the PNG files go (default benchmarks/plots)")
    args = parser.parse_args(argv)
    written, skipped, failed = render_all(args.results or results_dir(), args.out)
    for line in skipped:
        print(f"skipped {line}")
    for line in failed:
        print(f"FAILED {line}", file=sys.stderr)
    for path in written:
        print(f"plot: {path}")
    return 0 if written and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
