"""Fault scenarios under load against real processes; prints what each fault did.

    .venv/bin/python benchmarks/faults.py                          # all five, about 4-5 minutes
    .venv/bin/python benchmarks/faults.py --scenario etcd-pause    # one (repeat for several)

Every scenario starts its own etcd and broker (``danube_pipeline.dev.localcluster``) on
loopback in a temporary directory and stops them by pid, also on errors, Ctrl-C and SIGTERM.
The scenarios (``faults_scenarios.py``):

1. ``etcd-pause``: broker with ``--lease-ttl-s 3``; a steady load runs (below); etcd gets
   SIGSTOP for 8 s, then SIGCONT. ``reregister_s``: seconds from SIGCONT until a fresh
   ``DanubeClient`` bootstrapped to the broker creates a producer and gets a message acked
   (a new client every 100 ms; ``nan`` if not within 60 s). Target <= 2 s.
2. ``etcd-kill``: the same broker settings and load; etcd gets SIGKILL, stays down 5 s and
   starts again on the same data directory and ports; the same probe, timed from the restart.
3. ``full-disk``: the broker's data directory on a 64 MiB tmpfs mounted here (root only;
   skipped with a note if ``mount`` fails), filled by a filler file to 8 MiB free before the
   load starts. Checks, each printed: consumers still read while the disk is full (the steady
   consumer gets every acked message, a new subscription reads from ``EARLIEST``); every
   failed send carries a typed storage-full error (not ``INTERNAL``, not a transport error);
   after the filler is deleted an ack follows within 10 s with nothing restarted; after a
   broker restart every acked message is stored exactly once.
   ``full_disk_recovered=yes`` when every check passed.
4. ``stuck-consumer``: a raw gRPC ``Subscribe`` with ``receiver_queue_size`` 2^32-1 and a
   ``Receive`` stream that is never read (the client library would drain the stream into its
   own queue); 100 MiB of 64 KiB messages are produced. ``rss_growth_mib``: broker ``VmRSS``
   peak (sampled every 100 ms) minus before; the same volume with no consumer is the control.
5. ``churn``: four rounds of 500 producers opened and closed, then 500 consumers of one Shared
   subscription opened and closed (25 at a time). ``orphan_keys``: etcd keys after the rounds
   and a wait, minus before (the subscription exists before the count). If the broker has
   ``--closed-producer-ttl-s``, it runs with ``--closed-producer-ttl-s 5`` and the wait is
   that TTL plus 5 s; otherwise the wait is 5 s. Counts right after and after the wait are
   both printed, with the new keys by kind.

The steady load of scenarios 1-3: one producer sends 1 KiB messages (an 8-byte counter and
padding, each counter sent once) at a fixed rate with at most 4,000 unresolved; one consumer
(Exclusive, ``EARLIEST``) acks everything; both reopen after failures. Afterwards a fresh
subscription reads the topic from ``EARLIEST``: ``lost`` counts acked counters stored at no
offset, ``duplicated`` counters stored at two or more offsets (summed over scenarios 1-3).

The run ends with exactly one line (``nan`` marks a figure its scenario did not measure,
``skipped`` a full-disk run without a tmpfs):
``faults: lost=N duplicated=N reregister_s=X full_disk_recovered=yes|no rss_growth_mib=X orphan_keys=N``
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import faults_scenarios as fs

SCENARIOS = ("etcd-pause", "etcd-kill", "full-disk", "stuck-consumer", "churn")
"""Scenario names, in the order they run."""


@dataclass
class Summary:
    """The closing line's figures; each stays unmeasured until its scenario ran.

    Attributes:
        lost: acked counters stored nowhere, over scenarios 1-3 that were judged.
        duplicated: counters stored at two or more offsets, over the same scenarios.
        judged: scenarios whose read-back was judged.
        reregister_s: scenario 1's figure.
        full_disk_recovered: ``yes``, ``no`` or ``skipped``; ``nan`` if not run.
        rss_growth_mib: scenario 4's figure.
        orphan_keys: scenario 5's figure.
        failed: scenarios that ended with an exception or their time limit.
    """

    lost: int = 0
    duplicated: int = 0
    judged: int = 0
    reregister_s: float = math.nan
    full_disk_recovered: str = "nan"
    rss_growth_mib: float = math.nan
    orphan_keys: float = math.nan
    failed: list[str] = field(default_factory=list)

    def add_verdict(self, verdict: fs.Verdict | None) -> None:
        """Count a scenario's verdict into ``lost`` and ``duplicated``."""
        if verdict is not None:
            self.lost += verdict.lost
            self.duplicated += verdict.duplicated
            self.judged += 1

    def line(self) -> str:
        """``faults: lost=N duplicated=N reregister_s=X full_disk_recovered=yes|no rss_growth_mib=X orphan_keys=N``."""
        lost = str(self.lost) if self.judged else "nan"
        duplicated = str(self.duplicated) if self.judged else "nan"
        orphans = "nan" if math.isnan(self.orphan_keys) else str(int(self.orphan_keys))
        return (
            f"faults: lost={lost} duplicated={duplicated} reregister_s={fs.fmt(self.reregister_s, 2)}"
            f" full_disk_recovered={self.full_disk_recovered} rss_growth_mib={fs.fmt(self.rss_growth_mib, 1)}"
            f" orphan_keys={orphans}"
        )


SUMMARY = Summary()
_PRINT_LOCK = threading.Lock()
_FINISHED = threading.Event()


def say(text: str) -> None:
    """Print a line at once (the run is long; output must not wait in a buffer)."""
    with _PRINT_LOCK:
        print(text, flush=True)


def broker_flags() -> set[str]:
    """The long options ``python -m broker --help`` lists (empty if it cannot be run)."""
    try:
        out = subprocess.run([sys.executable, "-m", "broker", "--help"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {word.rstrip(",") for word in out.split() if word.startswith("--")}


def _watchdog(limit_s: float) -> None:
    """After ``limit_s``: continue paused processes, unmount tmpfs, print the line, exit."""
    if _FINISHED.wait(limit_s):
        return
    say(f"faults: time limit of {limit_s:g} s reached; stopping (children follow this process)")
    for pid in list(fs.PAUSED_PIDS):
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:
            pass
    for mount in list(fs.MOUNTS):
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=15, check=False)
    SUMMARY.failed.append("time limit")
    say(SUMMARY.line())
    os._exit(3)


def _print_result(lines: list[str]) -> None:
    for text in lines:
        say(f"  {text}")


async def run_scenario(name: str, root: Path, args: argparse.Namespace, flags: set[str]) -> None:
    """Run scenario ``name`` in ``root`` within its time limit, print its figures and record
    them in :data:`SUMMARY`; a failure is printed and the run goes on."""
    say(f"== {name}")
    started = time.monotonic()
    runners: dict[str, tuple[Callable[[], Awaitable[Any]], float]] = {
        "etcd-pause": (lambda: fs.etcd_pause(root, lease_ttl_s=args.lease_ttl_s, pause_s=args.pause_s,
                                             rate_per_s=args.rate, say=say), 150.0),
        "etcd-kill": (lambda: fs.etcd_kill(root, lease_ttl_s=args.lease_ttl_s, down_s=args.down_s,
                                           rate_per_s=args.rate, say=say), 120.0),
        "full-disk": (lambda: fs.full_disk(root, tmpfs_mib=args.tmpfs_mib, leave_mib=args.leave_mib,
                                           rate_per_s=args.full_disk_rate, resume_within_s=args.resume_within_s,
                                           say=say), 150.0),
        "stuck-consumer": (lambda: fs.stuck_consumer(root, volume_mib=args.huge_window_mib, say=say), 120.0),
        "churn": (lambda: _churn(root, args, flags), 240.0),
    }
    runner, limit_s = runners[name]
    outcome = await fs.bounded(runner(), limit_s)
    elapsed = time.monotonic() - started
    if not outcome.ok:
        SUMMARY.failed.append(name)
        error = outcome.error
        say(f"  FAILED after {elapsed:.1f} s: {fs.describe(error) if error else '?'}")
        if error is not None and not outcome.timed_out:
            tb = "".join(traceback.format_exception(error)).rstrip().splitlines()
            _print_result(["  " + line for line in tb[-8:]])
        return
    result = outcome.value
    if isinstance(result, fs.PauseResult):
        _print_result(result.notes)
        SUMMARY.reregister_s = result.reregister_s
        SUMMARY.add_verdict(result.verdict)
        say(f"  -> reregister_s={fs.fmt(result.reregister_s, 2)} (target <= 2 s)")
    elif isinstance(result, fs.KillResult):
        _print_result(result.notes)
        SUMMARY.add_verdict(result.verdict)
        say(f"  -> recover_s={fs.fmt(result.recover_s, 2)} (from the etcd restart)")
    elif isinstance(result, fs.FullDiskResult):
        if result.skipped:
            say(f"  SKIPPED: {result.skipped}")
        _print_result(result.notes)
        for check, passed in result.checks.items():
            say(f"  check: {check}: {'yes' if passed else 'NO'}")
        SUMMARY.full_disk_recovered = result.recovered
        SUMMARY.add_verdict(result.verdict)
        say(f"  -> full_disk_recovered={result.recovered}  resume_s={fs.fmt(result.resume_s, 2)}")
    elif isinstance(result, fs.StuckResult):
        _print_result(result.notes)
        SUMMARY.rss_growth_mib = result.rss_growth_mib
        say(f"  -> rss_growth_mib={fs.fmt(result.rss_growth_mib, 1)} (control without a consumer:"
            f" {fs.fmt(result.control_growth_mib, 1)})")
    elif isinstance(result, fs.ChurnResult):
        _print_result(result.notes)
        SUMMARY.orphan_keys = result.orphan_keys
        say(f"  -> orphan_keys={result.keys_after_wait - result.keys_before} after {result.wait_s:g} s"
            f" ({result.keys_after - result.keys_before} right after the last round)")
    say(f"  ({elapsed:.1f} s)")


async def _churn(root: Path, args: argparse.Namespace, flags: set[str]) -> fs.ChurnResult:
    broker_args: list[str] = []
    wait_s = args.orphan_wait_s
    if "--closed-producer-ttl-s" in flags:
        broker_args = ["--closed-producer-ttl-s", str(args.closed_producer_ttl_s)]
        wait_s = args.closed_producer_ttl_s + args.orphan_wait_s
        say(f"  broker --closed-producer-ttl-s {args.closed_producer_ttl_s}; counting again after {wait_s:g} s")
    else:
        say(f"  the broker has no --closed-producer-ttl-s; counting again after {wait_s:g} s")
    return await fs.churn(root, producers=args.churn, consumers=args.churn, rounds=args.rounds, wait_s=wait_s,
                          broker_args=broker_args, say=say)


async def run_all(names: list[str], root: Path, args: argparse.Namespace) -> None:
    """Run ``names`` in order, each in its own directory under ``root``."""
    flags = await asyncio.to_thread(broker_flags)
    for name in names:
        directory = root / name
        directory.mkdir(parents=True, exist_ok=True)
        await run_scenario(name, directory, args, flags)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    for pid in list(fs.PAUSED_PIDS):  # a stopped etcd would not act on its SIGTERM
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:
            pass
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    """Parse the command line, run the scenarios, print the closing line.

    Returns:
        0 when every scenario that ran finished (whatever its figures), 1 otherwise.
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", action="append", choices=SCENARIOS,
                        help="run only this scenario (repeatable); default all, in the order listed")
    parser.add_argument("--rate", type=int, default=1000, help="steady load of scenarios 1-2, msg/s")
    parser.add_argument("--full-disk-rate", type=int, default=2000, help="steady load of scenario 3, msg/s")
    parser.add_argument("--lease-ttl-s", type=int, default=3, help="broker --lease-ttl-s in scenarios 1-2")
    parser.add_argument("--pause-s", type=float, default=8.0, help="etcd SIGSTOP duration, s")
    parser.add_argument("--down-s", type=float, default=5.0, help="etcd down time after SIGKILL, s")
    parser.add_argument("--tmpfs-mib", type=int, default=64, help="tmpfs size of scenario 3, MiB")
    parser.add_argument("--leave-mib", type=int, default=8, help="free space the filler leaves, MiB")
    parser.add_argument("--resume-within-s", type=float, default=10.0, help="publishing must resume this soon, s")
    parser.add_argument("--huge-window-mib", type=int, default=100, help="volume produced in scenario 4, MiB")
    parser.add_argument("--churn", type=int, default=500, help="producers (and consumers) per round")
    parser.add_argument("--rounds", type=int, default=4, help="churn rounds")
    parser.add_argument("--orphan-wait-s", type=float, default=5.0, help="wait before the last key count, s")
    parser.add_argument("--closed-producer-ttl-s", type=int, default=5,
                        help="broker --closed-producer-ttl-s in scenario 5, when the broker has it")
    parser.add_argument("--time-limit-s", type=float, default=600.0, help="stop everything after this long, s")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    args = parser.parse_args()
    names = [n for n in SCENARIOS if n in (args.scenario or SCENARIOS)]

    signal.signal(signal.SIGTERM, _on_sigterm)
    threading.Thread(target=_watchdog, args=(args.time_limit_s,), daemon=True, name="watchdog").start()
    import broker

    say(f"faults: scenarios {', '.join(names)}; broker code from {Path(broker.__file__).parent};"
        f" {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    tmp = tempfile.mkdtemp(prefix="danube-faults-")
    started = time.monotonic()
    try:
        asyncio.run(run_all(names, Path(tmp), args))
    except KeyboardInterrupt as exc:
        say(f"faults: interrupted ({exc})")
        SUMMARY.failed.append("interrupted")
    finally:
        for mount in list(fs.MOUNTS):
            fs.unmount(mount)
        if args.keep:
            say(f"faults: logs kept in {tmp}")
        else:
            subprocess.run(["rm", "-rf", tmp], capture_output=True, timeout=60, check=False)
    _FINISHED.set()
    if SUMMARY.failed:
        say(f"faults: did not finish: {', '.join(SUMMARY.failed)}")
    say(f"faults: {time.monotonic() - started:.0f} s in all")
    say(SUMMARY.line())
    return 1 if SUMMARY.failed else 0


if __name__ == "__main__":
    sys.exit(main())
