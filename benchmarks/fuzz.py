"""Long fuzzing runs: the properties of ``tests/test_fuzz.py``, for much longer.

The decoder properties run in process; the request properties (two per RPC of
``danube.proto``: fuzzed fields and garbage bytes) run against a real etcd and broker started
in a temporary directory. Strategies and properties come from
:mod:`danube_pipeline.dev.fuzzing`, the package the tests use.

    .venv/bin/python benchmarks/fuzz.py                      # 10 s per property
    .venv/bin/python benchmarks/fuzz.py --seconds 60 --only decoders
    .venv/bin/python benchmarks/fuzz.py --examples 5000 --seed 7 -k SendBatch

Each property runs as consecutive hypothesis runs (at most ``--chunk`` examples each, sized
to the time left) with seeds ``seed, seed + 1, ...`` until its time (``--seconds``, wall-clock
seconds per property) or its example budget (``--examples``, cases per property) is spent,
or it fails: hypothesis then
shrinks the failure and its falsifying example is printed. A *case* is one call of the
property (shrinking calls included); *failures* counts the distinct failures hypothesis
reported for a property (0 or more; a property stops at its first failing run).

Per property it prints ``name cases=N cases_per_s=X failures=N`` and each failure, and ends
with one line: ``fuzz: cases=N failures=N cases_per_s=X`` (all properties; cases per second
over the summed run time of the properties, broker start-up excluded).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, seed, settings

from danube_pipeline.dev.fuzzing.properties import Property, decoder_properties, request_properties
from danube_pipeline.dev.fuzzing.target import BrokerTarget
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer

_NOTE_CHARS = 3000
_LINE_CHARS = 300


@dataclass
class Result:
    """What one property's run found."""

    name: str
    cases: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.cases / self.seconds if self.seconds else 0.0


def _describe(exc: BaseException) -> list[str]:
    """Each failure in ``exc`` (one, or an ExceptionGroup of several): its error and the
    falsifying example hypothesis attached as notes."""
    if isinstance(exc, BaseExceptionGroup):
        return [text for sub in exc.exceptions for text in _describe(sub)]
    lines = f"{type(exc).__name__}: {exc}".splitlines() + [n for note in getattr(exc, "__notes__", []) for n in note.splitlines()]
    text = "\n".join(line if len(line) <= _LINE_CHARS else f"{line[:_LINE_CHARS]}…({len(line)} chars)" for line in lines)
    return [text if len(text) <= _NOTE_CHARS else f"{text[:_NOTE_CHARS]}…({len(text)} chars)"]


def run_property(prop: Property, *, seconds: float, examples: int, first_seed: int, chunk: int) -> Result:
    """Run ``prop`` in hypothesis runs of ``chunk`` examples until the budget is spent or it fails."""
    result = Result(prop.name)

    def body(value: Any) -> None:
        result.cases += 1
        prop.check(value)

    started = time.perf_counter()
    run = 0
    size = min(chunk, 50)  # a short first run measures the rate; later runs fit the time left
    while True:
        spent = time.perf_counter() - started
        if examples:
            size = min(chunk, examples - result.cases)
        elif spent < seconds and result.cases:
            size = min(chunk, int(result.cases / spent * (seconds - spent)) + 1)
        if size <= 0 or (not examples and spent >= seconds):
            break
        test = settings(
            max_examples=size,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        )(given(prop.strategy)(body))
        try:
            seed(first_seed + run)(test)()
        except Exception as exc:  # noqa: BLE001 - a property failure, reported
            result.failures.extend(_describe(exc))
            break
        run += 1
    result.seconds = time.perf_counter() - started
    return result


@contextmanager
def running_broker() -> Iterator[BrokerTarget]:
    """A real etcd and broker in a temporary directory, and a prepared target."""
    with tempfile.TemporaryDirectory(prefix="danube-fuzz-") as tmp:
        root = Path(tmp)
        with EtcdServer(root / "etcd") as etcd:
            broker = BrokerProcess(etcd_endpoints=etcd.endpoints, data_dir=root / "broker")
            with broker:
                target = BrokerTarget(broker.address, alive=lambda: broker.running)
                try:
                    target.prepare()
                    yield target
                    target.assert_produce_consume()
                finally:
                    target.close()
                    _print_log_errors(broker.log_path)


def _print_log_errors(log_path: Path) -> None:
    try:
        lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return
    errors = [line for line in lines if " ERROR " in line]
    if errors:
        print(f"broker log: {len(errors)} ERROR lines, first: {errors[0][:300]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--seconds", type=float, default=10.0, help="wall-clock seconds per property (default 10)")
    p.add_argument("--examples", type=int, default=0, help="cases per property instead of --seconds")
    p.add_argument("--seed", type=int, default=0, help="seed of the first hypothesis run (default 0)")
    p.add_argument("--chunk", type=int, default=500, help="examples per hypothesis run (default 500)")
    p.add_argument("--only", choices=["decoders", "requests"], default=None, help="run one group only")
    p.add_argument("-k", dest="match", default="", help="run only properties whose name contains this")
    args = p.parse_args(argv)

    results: list[Result] = []

    def run_all(props: list[Property]) -> None:
        for prop in props:
            if args.match and args.match not in prop.name:
                continue
            r = run_property(prop, seconds=args.seconds, examples=args.examples, first_seed=args.seed, chunk=args.chunk)
            results.append(r)
            print(f"{r.name} cases={r.cases} cases_per_s={r.rate:.0f} failures={len(r.failures)}", flush=True)
            for text in r.failures:
                print("  " + text.replace("\n", "\n  "), flush=True)

    if args.only != "requests":
        run_all(decoder_properties())
    if args.only != "decoders":
        try:
            with running_broker() as target:
                run_all(request_properties(target))
        except (AssertionError, RuntimeError, subprocess.SubprocessError) as exc:
            print(f"broker: {type(exc).__name__}: {exc}", flush=True)
            results.append(Result("broker-alive-after-run", failures=[str(exc)]))

    cases = sum(r.cases for r in results)
    failures = sum(len(r.failures) for r in results)
    seconds = sum(r.seconds for r in results)
    print(f"fuzz: cases={cases} failures={failures} cases_per_s={cases / seconds if seconds else 0.0:.0f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
