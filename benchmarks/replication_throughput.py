"""The quiet throughput phase of ``benchmarks/replication.py``: msg/s of 1 KiB messages at the
replicated namespace's policy (RF 3, min ISR 2) against a namespace at RF 1, on the same
cluster, with no faults and no other load.

Each round creates one fresh topic per namespace and measures both, the order alternating
between rounds (RF 1 first, then RF 3 first, ...) so that a drift of the machine does not favour
one. A measurement is ``loadgen.window_loop`` (at most ``window`` messages unacked) on one
producer of the client library (``linger_ms=0``, ``max_batch_messages=128``,
``max_in_flight_batches=32``, a window of 4,096 messages by default) after an unmeasured
warm-up. The window is sized so that RF 1 is bound by CPU, not by its latency: an ack at RF 3
waits for two ``fdatasync`` calls and a fetch round trip, so with ``benchmarks/peers.py``'s
window of 256 (``--window 256``) RF 3 is bound by latency instead (0.21 measured). A topic
at RF > 1 is measured once its ISR holds that many running brokers.
The ratio is the best RF 3 round over the best RF 1 round (as ``timeit`` keeps the minimum).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import faults_scenarios as fs
from chaos_check import describe_next_offset
from chaos_load import new_client
from loadgen import LoopResult, make_payload, window_loop
from replication_kills import ReplicationCluster, isr_of

from danube_pipeline.client.admin import AdminClient
from danube_pipeline.metadata.store import MetadataStore

PAYLOAD_BYTES = 1024
PRODUCER_OPTIONS: dict[str, Any] = {"linger_ms": 0, "max_batch_messages": 128, "max_in_flight_batches": 32}
"""The producer of every measurement, at every replication factor."""


@dataclass
class Throughput:
    """The phase's figures: msg/s per round at each replication factor (``nan``: failed)."""

    rf1_msg_s: list[float] = field(default_factory=list)
    rf3_msg_s: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def best_rf1(self) -> float:
        """The best RF 1 round, msg/s (``nan``: none measured)."""
        return max((r for r in self.rf1_msg_s if math.isfinite(r)), default=math.nan)

    @property
    def best_rf3(self) -> float:
        """The best RF 3 round, msg/s (``nan``: none measured)."""
        return max((r for r in self.rf3_msg_s if math.isfinite(r)), default=math.nan)

    @property
    def ratio(self) -> float:
        """Best RF 3 round over best RF 1 round (``nan`` when either is missing)."""
        return self.best_rf3 / self.best_rf1 if self.best_rf1 > 0 else math.nan


async def wait_replicated(cluster: ReplicationCluster, meta: MetadataStore, topic: str, replication_factor: int,
                          timeout_s: float) -> float:
    """Wait until ``topic`` answers ``DescribeTopic`` and (RF > 1) its ISR holds
    ``replication_factor`` running brokers; seconds waited, ``inf`` after ``timeout_s``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        next_offset, _ = await describe_next_offset(cluster.addresses, topic)
        if next_offset >= 0:
            if replication_factor <= 1:
                return time.monotonic() - started
            isr = await isr_of(meta, topic)
            running = cluster.running_ids()
            if isr is not None and len({b for b in isr if b in running}) >= replication_factor:
                return time.monotonic() - started
        await asyncio.sleep(0.25)
    return math.inf


async def measure_topic(addresses: Sequence[str], topic: str, *, messages: int, window: int, warmup: int,
                        server_pids: Sequence[int] = ()) -> LoopResult:
    """Warm up, then one ``window_loop`` of ``messages`` 1 KiB messages on ``topic``; the CPU
    of ``server_pids`` (the brokers) is measured over the loop.

    Raises:
        DanubeError: the producer could not be opened.
    """
    payload = make_payload(PAYLOAD_BYTES)
    client = new_client(addresses, request_timeout_ms=10_000, retries=10)
    try:
        await client.connect()
        async with client.producer(topic, producer_name=f"tput-{topic.rsplit('/', 1)[-1]}",
                                   **PRODUCER_OPTIONS) as producer:
            send_nowait = producer.send_nowait

            async def send(data: bytes) -> asyncio.Future[Any]:
                return send_nowait(data)

            await window_loop(send, payload, messages=warmup, window=window, time_limit_s=60)
            return await window_loop(send, payload, messages=messages, window=window, server_pids=server_pids,
                                     time_limit_s=120)
    finally:
        await fs.bounded(client.close(), 10)


async def throughput_phase(cluster: ReplicationCluster, meta: MetadataStore, *, namespaces: dict[int, str],
                           in_effect: dict[int, int], rounds: int, messages: int, window: int, warmup: int,
                           say: Callable[[str], None]) -> Throughput:
    """Measure ``rounds`` times at each replication factor of ``namespaces`` (``{1: ns, 3: ns}``).

    ``in_effect`` maps each of them to the factor its namespace's policy really has (the ISR
    waited for). A round that fails is recorded as ``nan`` with a note; nothing is raised.
    """
    result = Throughput()
    admin = new_client(cluster.addresses, request_timeout_ms=10_000, retries=10)
    try:
        await admin.connect()
        for round_index in range(rounds):
            order = sorted(namespaces) if round_index % 2 == 0 else sorted(namespaces, reverse=True)
            for factor in order:
                topic = f"/{namespaces[factor]}/tput-{round_index}"
                figures = result.rf1_msg_s if factor == 1 else result.rf3_msg_s
                got = await fs.bounded(_one(cluster, meta, admin.admin, topic, in_effect[factor], messages=messages,
                                            window=window, warmup=warmup), 240)
                if not got.ok or got.value is None:
                    figures.append(math.nan)
                    note = f"round {round_index + 1} RF {factor}: {fs.describe(got.error or RuntimeError('?'))}"
                    result.notes.append(note)
                    say(f"  {note}")
                    continue
                loop, waited_s = got.value
                figures.append(loop.msgs_per_s if loop.complete else math.nan)
                say(f"  round {round_index + 1} RF {factor} ({topic}, replicated after {fs.fmt(waited_s, 1)} s):"
                    f" {loop.msgs_per_s:,.0f} msg/s, {loop.mb_per_s:.1f} MB/s, p50 {loop.latency_ms(0.5):.1f} ms,"
                    f" p99 {loop.latency_ms(0.99):.1f} ms; CPU: client {loop.client_cpu_pct:.0f} %, 3 brokers"
                    f" {loop.server_cpu_pct:.0f} % of one core"
                    + ("" if loop.complete else f"; INCOMPLETE: {loop.first_error}"))
    finally:
        await fs.bounded(admin.close(), 10)
    return result


async def _one(cluster: ReplicationCluster, meta: MetadataStore, admin: AdminClient, topic: str, factor: int, *,
               messages: int, window: int, warmup: int) -> tuple[LoopResult, float]:
    await admin.create_topic(topic)
    waited_s = await wait_replicated(cluster, meta, topic, factor, 60)
    loop = await measure_topic(cluster.addresses, topic, messages=messages, window=window, warmup=warmup,
                               server_pids=[b.pid for b in cluster.brokers if b.running])
    return loop, waited_s
