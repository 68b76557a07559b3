"""The broker's event loop (:mod:`broker.event_loop`): uvloop when installed, the standard loop
when ``DANUBE_EVENT_LOOP=asyncio``; the start-up heap frozen; the loop-lag recorder's report."""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker import event_loop

pytestmark = pytest.mark.unit


async def _loop_class_name() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_run_uses_uvloop_when_installed_and_asyncio_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")
    monkeypatch.delenv(event_loop.EVENT_LOOP_ENV, raising=False)
    assert event_loop.loop_kind() == "uvloop"
    assert event_loop.run(_loop_class_name()).startswith("uvloop")
    monkeypatch.setenv(event_loop.EVENT_LOOP_ENV, "asyncio")
    assert event_loop.loop_kind() == "asyncio"
    assert event_loop.run(_loop_class_name()).startswith("asyncio")


def test_freeze_heap_moves_the_live_objects_to_the_permanent_generation() -> None:
    try:
        event_loop.freeze_heap()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_tune_collector_sets_the_brokers_thresholds() -> None:
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)  # CPython's defaults
        event_loop.tune_collector()
        young, middle, old = gc.get_threshold()
        assert (young, middle, old) == event_loop.GC_THRESHOLDS
        assert young == 700 and middle > 10 and old > 10  # short young collections, rarer older ones
    finally:
        gc.set_threshold(*before)


def test_the_recorder_reports_a_stall_of_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "lag.json"
    monkeypatch.setenv(event_loop.LOOP_LAG_FILE_ENV, str(target))

    async def stall_once() -> None:
        recorder = event_loop.LoopLagRecorder.from_environment()
        assert recorder is not None
        recorder.start()
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # blocks the loop: the callbacks sent meanwhile wait
        gc.collect()
        await asyncio.sleep(0.05)
        await recorder.stop()

    event_loop.run(stall_once())
    report = json.loads(target.read_text())
    assert report["lag"]["count"] > 0
    assert report["lag"]["max_ms"] >= 50.0  # a callback sent early in the block waited for its end
    assert sum(report["lag"]["buckets"].values()) == report["lag"]["count"]
    assert report["gc_pause"]["count"] >= 1
    assert report["gc_pause_max_ms_by_generation"]["2"] > 0
    assert report["gc_pause_total_ms_by_generation"]["2"] >= report["gc_pause_max_ms_by_generation"]["2"]
    if Path("/proc/self/schedstat").exists():
        assert report["loop_thread"]["on_cpu_ms"] > 0  # the collection ran on the loop's thread


def test_summarize_counts_every_sample_once() -> None:
    summary = event_loop.summarize([0.05, 0.3, 3.0, 200.0])
    assert summary["count"] == 4
    assert summary["max_ms"] == 200.0
    assert summary["buckets"]["le_0.1"] == 1 and summary["buckets"]["le_0.5"] == 1
    assert summary["buckets"]["le_5"] == 1 and summary["buckets"]["above"] == 1


_LIMITS_SCRIPT = """
import resource
from broker import event_loop
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
print(*event_loop.raise_open_files_limit(), hard)
print(*event_loop.raise_open_files_limit(wanted=hard + 1024), *resource.getrlimit(resource.RLIMIT_NOFILE))
"""


def test_open_files_limit_goes_up_to_the_hard_limit_and_says_what_it_set() -> None:
    """The soft limit is raised to the hard one; ``wanted`` above the hard limit raises both
    where the process may (root with ``CAP_SYS_RESOURCE``), else leaves the hard one alone;
    either way the answer is the limit in force. In a child process, whose limits we may lower."""
    resource = pytest.importorskip("resource")
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] == resource.RLIM_INFINITY:
        pytest.skip("no hard limit of open files to raise the soft one to")
    lines = subprocess.run([sys.executable, "-c", _LIMITS_SCRIPT], capture_output=True, text=True, check=True,
                           timeout=60).stdout.split("\n")
    soft, hard, original_hard = map(int, lines[0].split())
    assert (soft, hard) == (original_hard, original_hard)
    answered_soft, answered_hard, in_force_soft, in_force_hard = map(int, lines[1].split())
    assert (answered_soft, answered_hard) == (in_force_soft, in_force_hard)
    assert (answered_soft, answered_hard) in {(original_hard + 1024,) * 2, (original_hard,) * 2}
