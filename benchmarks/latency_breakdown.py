"""Where one message in flight spends its time (issue 27, item 2).

    .venv/bin/python benchmarks/latency_breakdown.py                  # N = 2,000 per stage
    .venv/bin/python benchmarks/latency_breakdown.py --py-spy /path/to/py-spy

Times, in one run and on one machine, the floors a produce round trip is built of:

* ``echo``: a bare ``grpc.aio`` bidi-stream echo of 100 B between two processes (this one and
  a child running only the echo server), one message in flight; and a unary echo;
* ``fsync``: a 100 B ``os.pwrite`` + ``os.fdatasync`` into a file beside the broker's data;
* ``produce``: the real produce round trip (``DanubeClient`` producer, ``linger_ms=0
  max_batch_messages=1``, one message in flight) against etcd and one broker with its
  defaults, with the broker's and this process's CPU time per message (``/proc/<pid>/stat``
  and :func:`time.process_time`).

With ``--py-spy``, it also samples the broker's event-loop thread during a second produce run
(``py-spy record --format raw``): the share of samples idle in the poller, and the busy
samples per broker stage (reading the stream, validating and enqueueing the batch, the WAL
writer, waking the producer and writing the answer, request checks, asyncio's machinery).
Under uvloop, native work inside the loop (gRPC's Cython callbacks) counts as idle: use
``--loop asyncio`` for the split.

The broker's loop is uvloop when installed; ``--loop asyncio`` sets ``DANUBE_EVENT_LOOP=asyncio``
for the broker and this process (``broker/event_loop.py``). The last line:
``latency: echo_p50_ms=X unary_p50_ms=X fsync_p50_ms=X produce_p50_ms=X floor_ms=X
echo_server_cpu_us=X broker_cpu_us=X client_cpu_us=X``, where ``floor_ms`` is the bidi echo
plus the fsync, and the CPU figures are per round trip (the echo server's and the broker's
whole process, all threads; the client's this process).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc

from danube_pipeline.client import DanubeClient

# Siblings: running ``python benchmarks/latency_breakdown.py`` puts benchmarks/ first on sys.path.
from peer_servers import HOST, DanubeCluster

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from broker import event_loop  # noqa: E402 - after the repository is on sys.path

SERVICE = "latency.Echo"
PAYLOAD = b"x" * 100
CLK_TCK = os.sysconf("SC_CLK_TCK")

IDLE_LEAVES = ("EpollSelector.select", "Runner.run")
"""Leaf frames of an event-loop thread waiting in its poller: the asyncio loop's ``select``, or
uvloop's ``run`` (uvloop's C code, gRPC's Cython callbacks included, shows no Python frame)."""

STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("stream read + validate + enqueue", ("reader (broker/rpc/produce_stream.py", "read (broker/rpc/produce_stream.py",
                                          "_read_batch (broker/rpc/produce_stream.py", "publish (broker/")),
    ("WAL writer (group commit)", ("broker/storage/wal/",)),
    ("ack: wake + answer write", ("produce_stream (broker/rpc/produce_stream.py", "settle (broker/rpc/produce_stream.py",
                                  "ProduceStream (broker/rpc/producer_service.py", "stream_wrapper (broker/rpc/")),
    ("gRPC request decoding + checks", ("broker/rpc/status.py",)),
    ("asyncio machinery", ("asyncio/",)),
)
"""Broker stages and the frame substrings that attribute a busy py-spy stack to them (the
innermost frame that matches wins)."""


def _echo_handler() -> grpc.GenericRpcHandler:
    async def bidi(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for request in requests:
            yield request

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
    })


async def _serve_echo(port_file: Path) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_echo_handler(),))
    port = server.add_insecure_port(f"{HOST}:0")
    await server.start()
    port_file.write_text(str(port))
    await server.wait_for_termination()


def _percentiles(samples_s: list[float]) -> tuple[float, float]:
    ordered = sorted(samples_s)
    return ordered[len(ordered) // 2] * 1000, ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000


async def _time_each(n: int, once: Callable[[], Awaitable[object]]) -> list[float]:
    for _ in range(min(200, n)):  # warm-up
        await once()
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        await once()
        samples.append(time.perf_counter() - started)
    return samples


async def measure_echo(n: int) -> tuple[list[float], list[float], float]:
    """Bidi and unary echo round trips (s) against a child process serving only the echo, and
    the echo server's CPU per bidi round trip (µs): gRPC's own cost on the server side."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        child = subprocess.Popen([sys.executable, __file__, "--echo-server", str(port_file)])
        try:
            while not port_file.exists() or not port_file.read_text():
                if child.poll() is not None:
                    raise RuntimeError("the echo server exited")
                await asyncio.sleep(0.05)
            async with grpc.aio.insecure_channel(f"{HOST}:{port_file.read_text()}") as channel:
                call = channel.stream_stream(f"/{SERVICE}/Bidi")()
                responses = call.__aiter__()

                async def bidi_once() -> object:
                    await call.write(PAYLOAD)
                    return await responses.__anext__()

                await _time_each(200, bidi_once)
                server_before = _cpu_s(child.pid)
                bidi = await _time_each(n, bidi_once)
                server_us = (_cpu_s(child.pid) - server_before) / n * 1e6
                await call.done_writing()
                unary_call = channel.unary_unary(f"/{SERVICE}/Unary")
                unary = await _time_each(n, lambda: unary_call(PAYLOAD))
            return bidi, unary, server_us
        finally:
            child.terminate()
            child.wait(10)


def measure_fsync(directory: Path, n: int) -> list[float]:
    """100 B ``pwrite`` + ``fdatasync`` times (s), appending to one file in ``directory``."""
    fd = os.open(directory / "fsync-probe", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        samples = []
        for i in range(n):
            started = time.perf_counter()
            os.pwrite(fd, PAYLOAD, i * len(PAYLOAD))
            os.fdatasync(fd)
            samples.append(time.perf_counter() - started)
        return samples
    finally:
        os.close(fd)
        os.unlink(directory / "fsync-probe")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


async def measure_produce(address: str, pid: int, n: int, topic: str) -> tuple[list[float], float, float]:
    """Produce round trips (s), one in flight, and the broker's and this process's CPU per
    message (µs)."""
    async with DanubeClient([address]) as client, client.producer(
        topic, producer_name="latency", linger_ms=0, max_batch_messages=1
    ) as producer:
        await _time_each(200, lambda: producer.send(PAYLOAD))
        broker_before, client_before = _cpu_s(pid), time.process_time()
        samples = await _time_each(n, lambda: producer.send(PAYLOAD))
        broker_us = (_cpu_s(pid) - broker_before) / n * 1e6
        client_us = (time.process_time() - client_before) / n * 1e6
    return samples, broker_us, client_us


def _stage_of(frames: list[str]) -> str:
    for frame in reversed(frames):  # innermost first
        for stage, needles in STAGES:
            if any(needle in frame for needle in needles):
                return stage
    return "other"


async def profile_broker(py_spy: str, address: str, pid: int, n: int, out: Path) -> dict[str, float]:
    """Sample the broker's event-loop thread with py-spy during a produce run.

    Returns:
        ``"idle"``: the share of all samples waiting in the poller; then, per stage, its
        share of the busy samples.
    """
    recorder = subprocess.Popen(
        [py_spy, "record", "--pid", str(pid), "--rate", "2000", "--format", "raw", "--output", str(out),
         "--nonblocking", "--idle", "--threads"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    await asyncio.sleep(1.0)
    await measure_produce(address, pid, n, "/bench/latency-profile")
    recorder.send_signal(signal.SIGINT)
    recorder.wait(30)
    counts: collections.Counter[str] = collections.Counter()
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if "MainThread" not in frames[0]:
            continue  # only the event-loop thread
        idle = any(frames[-1].startswith(leaf) for leaf in IDLE_LEAVES)
        counts["idle" if idle else _stage_of(frames)] += int(count)
    total = sum(counts.values()) or 1
    busy = (total - counts["idle"]) or 1
    return {"idle": counts["idle"] / total, **{stage: counts[stage] / busy for stage, _ in (*STAGES, ("other", ()))}}


async def main(args: argparse.Namespace) -> None:
    print(f"latency breakdown: one 100 B message in flight, N={args.n} per stage; loop {event_loop.loop_kind()}")
    bidi, unary, echo_server_us = await measure_echo(args.n)
    with tempfile.TemporaryDirectory(prefix="latency-") as tmp:
        root = Path(tmp)
        fsync = measure_fsync(root, args.n)
        with DanubeCluster(root / "danube") as cluster:
            produce, broker_us, client_us = await measure_produce(
                cluster.address, cluster.pid, args.n, "/bench/latency"
            )
            shares = (
                await profile_broker(args.py_spy, cluster.address, cluster.pid, args.n,
                                     Path(args.profile_out) if args.profile_out else root / "py-spy.txt")
                if args.py_spy else {}
            )
    rows = [("grpc.aio bidi echo (2 processes)", bidi), ("grpc.aio unary echo", unary),
            ("100 B write + fdatasync", fsync), ("produce round trip (broker)", produce)]
    for name, samples in rows:
        p50, p99 = _percentiles(samples)
        print(f"  {name:<34} p50 {p50:7.3f} ms  p99 {p99:7.3f} ms  mean {statistics.fmean(samples) * 1000:7.3f} ms")
    print(f"  CPU per round trip: echo server {echo_server_us:.0f} us; "
          f"per produced message: broker {broker_us:.0f} us, client {client_us:.0f} us")
    if shares:
        idle = shares.pop("idle")
        print(f"  broker loop thread: idle (poller) {idle * 100:.1f} % of samples; busy samples by stage:")
    for stage, share in shares.items():
        print(f"    {stage:<34} {share * 100:5.1f} %")
    echo_p50, unary_p50, fsync_p50, produce_p50 = (_percentiles(s)[0] for s in (bidi, unary, fsync, produce))
    print(f"latency: echo_p50_ms={echo_p50:.3f} unary_p50_ms={unary_p50:.3f} fsync_p50_ms={fsync_p50:.3f} "
          f"produce_p50_ms={produce_p50:.3f} floor_ms={echo_p50 + fsync_p50:.3f} "
          f"echo_server_cpu_us={echo_server_us:.0f} broker_cpu_us={broker_us:.0f} client_cpu_us={client_us:.0f}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("-n", type=int, default=2000, help="round trips per stage (default 2,000)")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="event loop of the broker and this process (uvloop when installed)")
    p.add_argument("--py-spy", help="path of a py-spy binary: also sample the broker's loop thread")
    p.add_argument("--profile-out", help="keep py-spy's raw samples in this file")
    p.add_argument("--echo-server", help=argparse.SUPPRESS)  # the child: serve the echo, write the port here
    return p.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.loop == "asyncio":
        os.environ[event_loop.EVENT_LOOP_ENV] = "asyncio"
    if arguments.echo_server:
        event_loop.run(_serve_echo(Path(arguments.echo_server)))
    else:
        event_loop.run(main(arguments))
