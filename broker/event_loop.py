"""The broker process's event loop: uvloop when installed, the collector's thresholds, the heap
frozen after start, and an optional loop-lag recorder.

* :func:`run` runs the broker's main coroutine on uvloop when it can be imported (the
  ``broker`` extra installs it) and on the standard asyncio loop otherwise, or when
  ``DANUBE_EVENT_LOOP=asyncio``. uvloop's loop iteration, ``call_soon_threadsafe`` and socket
  handling cost less CPU per request than the pure-Python selector loop; behaviour is the same
  (asyncio's loop API, PEP 3156).
* :func:`freeze_heap` moves every object alive once the broker has started into the garbage
  collector's permanent generation (:func:`gc.freeze`): a full (generation 2) collection then no
  longer walks the imported modules, protobuf descriptors and gRPC state, which otherwise made
  each one a pause of about 25 ms on the event loop (the open-loop p99.9 of
  ``benchmarks/peers.py``).
* :func:`tune_collector` makes older collections rarer (:data:`GC_THRESHOLDS`): with thousands
  of topics written a message at a time, the state of every batch in flight outlives a few
  hundred allocations, is promoted by young collections and made full collections of the
  whole topic state frequent. It is set before the topics load: loading 3,000 topics with
  CPython's defaults ran 7 full collections (1.4 s, up to 411 ms each) of a heap that only
  grows meanwhile; with these thresholds, one.
* :func:`describe_tasks` writes the stack of every task of the running loop, for a log line
  when something that should end does not (a stop still running after
  ``shutdown_report_s``, ``python -m broker``).
* :class:`LoopLagRecorder` (on when ``DANUBE_LOOP_LAG_FILE`` names a file) measures how long a
  callback sent to the loop from a thread every millisecond waits to run, how long each
  garbage collection pauses the loop, and how long the loop's thread waited for a CPU; it
  writes a histogram of them to that file when the broker stops: evidence of stalls on the
  broker side that a client's latency percentiles on a shared machine cannot separate from
  its own. Opt-in: it keeps every sample in memory, for benchmark runs.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)

_T = TypeVar("_T")

EVENT_LOOP_ENV = "DANUBE_EVENT_LOOP"
"""``asyncio`` forces the standard loop; ``uvloop`` or unset: uvloop when it can be imported."""

LOOP_LAG_FILE_ENV = "DANUBE_LOOP_LAG_FILE"
"""Where :class:`LoopLagRecorder` writes its histogram at stop; unset: no recorder."""

LAG_BOUNDS_MS: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0)
"""Upper bounds of the histogram's buckets, ms (the last bucket is everything above)."""


def loop_kind() -> str:
    """``"uvloop"`` when :func:`run` will use uvloop, else ``"asyncio"``."""
    if os.environ.get(EVENT_LOOP_ENV, "").strip().lower() == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, _T]) -> _T:
    """Run ``main`` to its end on a new loop of :func:`loop_kind` (as :func:`asyncio.run`)."""
    if loop_kind() == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)


def describe_tasks(limit: int = 12) -> str:
    """Every unfinished task of the running loop, sorted by name, each with the innermost
    ``limit`` frames of its stack (:meth:`asyncio.Task.get_stack`), one ``file:line in
    function`` per frame. Not :meth:`asyncio.Task.print_stack`: it fails on the frames of
    gRPC's compiled coroutines, which have no line number.

    Raises:
        RuntimeError: no running loop.
    """
    lines = []
    for task in sorted((t for t in asyncio.all_tasks() if not t.done()), key=lambda t: t.get_name()):
        lines.append(f"task {task.get_name()}:")
        lines.extend(
            f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
            for frame in task.get_stack(limit=limit)
        )
    return "\n".join(lines)


def freeze_heap() -> None:
    """Collect once, then move every surviving object to the permanent generation
    (:func:`gc.freeze`), so later full collections skip the start-up heap."""
    gc.collect()
    gc.freeze()


GC_THRESHOLDS: tuple[int, int, int] = (700, 50, 50)
"""The broker's collector thresholds (:func:`gc.set_threshold`): young collections as CPython's
(after 700 net allocations of tracked objects, each short), generation 1 and full collections 5
times rarer each (every 50 instead of 10). Measured with ``benchmarks/scale.py`` and the loop-lag
report (``benchmarks/README.md``, "Commit rounds and one produce stream per client"): at 1,000
topics and one message per batch, CPython's defaults promoted the in-flight batches' state and
ran a full collection of about 250 ms every second or so (3.4 s in about 20 s); with these none
ran, the longest pause was 48 ms and msg/s rose by about 20 %. (20,000, 10, 10) gained more
msg/s there but paused the loop 15 ms per young collection and up to 430 ms per generation 1
collection, and lost msg/s with 1,000 producers and 1,000 consumers. Cyclic garbage waits
longer to be freed; most of the broker's garbage is freed by reference counting, which the
thresholds do not touch."""


def tune_collector() -> None:
    """Set :data:`GC_THRESHOLDS` (the broker's own process only, before its topics load)."""
    gc.set_threshold(*GC_THRESHOLDS)


def _bucket_counts(samples_ms: list[float]) -> dict[str, int]:
    counts = {f"le_{bound:g}": 0 for bound in LAG_BOUNDS_MS}
    counts["above"] = 0
    for value in samples_ms:
        for bound in LAG_BOUNDS_MS:
            if value <= bound:
                counts[f"le_{bound:g}"] += 1
                break
        else:
            counts["above"] += 1
    return counts


def _schedstat(tid: int) -> tuple[int, int]:
    """Nanoseconds thread ``tid`` of this process ran on a CPU and waited runnable for one
    (``(0, 0)`` where ``/proc`` has no schedstat)."""
    try:
        fields = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
        return int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return 0, 0


def _percentile(ordered: list[float], fraction: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))] if ordered else 0.0


def summarize(samples_ms: list[float]) -> dict[str, Any]:
    """``samples_ms`` as a count, p50/p99/p99.9/max (ms) and :data:`LAG_BOUNDS_MS` buckets."""
    ordered = sorted(samples_ms)
    return {
        "count": len(ordered),
        "p50_ms": round(_percentile(ordered, 0.5), 3),
        "p99_ms": round(_percentile(ordered, 0.99), 3),
        "p999_ms": round(_percentile(ordered, 0.999), 3),
        "max_ms": round(ordered[-1], 3) if ordered else 0.0,
        "buckets": _bucket_counts(ordered),
    }


class LoopLagRecorder:
    """Records the event loop's lag and the garbage collector's pauses (module docstring).

    Args:
        path: the JSON file :meth:`stop` writes.
        interval_s: how often a stamped callback is sent to the loop.

    Attributes:
        lag_ms: how long each stamped callback waited for the loop, ms.
        gc_pauses_ms: ``(generation, ms)`` of each collection.
    """

    def __init__(self, path: Path, *, interval_s: float = 0.001) -> None:
        self._path = path
        self._interval_s = interval_s
        self.lag_ms: list[float] = []
        self.gc_pauses_ms: list[tuple[int, float]] = []
        self._gc_started = 0.0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_tid = threading.get_native_id()
        self._started_s = time.perf_counter()
        self._schedstat_start = (0, 0)

    @classmethod
    def from_environment(cls) -> LoopLagRecorder | None:
        """A recorder writing to ``$DANUBE_LOOP_LAG_FILE``, or ``None`` when it is unset."""
        target = os.environ.get(LOOP_LAG_FILE_ENV)
        return cls(Path(target)) if target else None

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_pauses_ms.append((info["generation"], (time.perf_counter() - self._gc_started) * 1000))

    def _ping(self, loop: asyncio.AbstractEventLoop) -> None:
        # In a thread: every interval, a callback stamped with its send time. How long it waits
        # for the loop is the loop's lag (independent of the loop's timer resolution: uvloop's
        # timers move in whole milliseconds).
        while not self._stopped.wait(self._interval_s):
            try:
                loop.call_soon_threadsafe(self._arrived, time.perf_counter())
            except RuntimeError:  # the loop is closed
                return

    def _arrived(self, sent: float) -> None:
        self.lag_ms.append((time.perf_counter() - sent) * 1000)

    def start(self) -> None:
        """Start timing the running loop and the collector."""
        gc.callbacks.append(self._on_gc)
        self._loop_tid = threading.get_native_id()
        self._started_s = time.perf_counter()
        self._schedstat_start = _schedstat(self._loop_tid)
        loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._ping, args=(loop,), name="loop-lag", daemon=True)
        self._thread.start()

    def report(self) -> dict[str, Any]:
        """The figures :meth:`stop` writes. ``loop_thread`` says how the loop's thread spent
        the recording (``/proc/<pid>/task/<tid>/schedstat``): on a CPU, and runnable but
        waiting for one (the machine's other work, not the loop's)."""
        now = _schedstat(self._loop_tid)
        on_cpu_ms = (now[0] - self._schedstat_start[0]) / 1e6
        waiting_ms = (now[1] - self._schedstat_start[1]) / 1e6
        return {
            "loop": loop_kind(),
            "recorded_s": round(time.perf_counter() - self._started_s, 3),
            "loop_thread": {"on_cpu_ms": round(on_cpu_ms, 1), "runnable_waiting_for_cpu_ms": round(waiting_ms, 1)},
            "interval_ms": self._interval_s * 1000,
            "lag": summarize(self.lag_ms),
            "gc_pause": summarize([ms for _, ms in self.gc_pauses_ms]),
            "gc_pause_total_ms_by_generation": {
                str(gen): round(sum(ms for g, ms in self.gc_pauses_ms if g == gen), 3) for gen in (0, 1, 2)
            },
            "gc_pause_max_ms_by_generation": {
                str(gen): round(max((ms for g, ms in self.gc_pauses_ms if g == gen), default=0.0), 3)
                for gen in (0, 1, 2)
            },
        }

    async def stop(self) -> None:
        """Stop recording and write :meth:`report` to the file (a failed write is logged)."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._stopped.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        try:
            self._path.write_text(json.dumps(self.report(), indent=1) + "\n")
        except OSError as exc:
            log.warning("cannot write the loop-lag report %s: %s", self._path, exc)


def raise_open_files_limit(wanted: int | None = None) -> tuple[int, int]:
    """Raise this process's soft limit of open files to its hard limit, as brokers of many
    topics need (each WAL holds its active segment open, and recently read sealed ones); the
    hard limit is the operator's (``ulimit -Hn``, systemd's ``LimitNOFILE``).

    Args:
        wanted: also raise the hard limit to this many files where the process may (root, or
            ``CAP_SYS_RESOURCE``), as ``benchmarks/scale.py`` does for the broker it spawns
            (children inherit both limits); ``None``: leave the hard limit alone.

    Returns:
        ``(soft, hard)`` after the call; unchanged where the platform has no such limit.
    """
    try:
        import resource  # noqa: PLC0415 - POSIX only
    except ImportError:
        return (-1, -1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if wanted is not None and hard != resource.RLIM_INFINITY and wanted > hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))
            return wanted, wanted
        except (ValueError, OSError):
            pass  # not privileged: the soft limit can still go up to the hard one
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft, hard
