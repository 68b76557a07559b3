"""The fault scenarios of ``benchmarks/faults.py`` and the harness they share.

Every scenario starts its own etcd and broker (real processes, ``danube_pipeline.dev.localcluster``)
in a directory it is given, injects one fault, measures, and stops what it started by pid. Every
wait has a time limit (:func:`bounded`); a scenario that cannot finish a step records why in its
result and goes on.

The harness:

* :class:`Cluster`: etcd and one broker, with etcd pause (``SIGSTOP``/``SIGCONT``), kill
  (``SIGKILL``) and a restart on the same data directory and ports that does not block the
  event loop.
* :class:`SteadyLoad`: one producer sending sequence-numbered messages (payload = 8-byte
  big-endian counter + padding) at a fixed rate with a bounded window, and one consumer (an
  Exclusive subscription from ``EARLIEST``) acking everything; both reopen themselves after a
  failure. It records which counters the broker acknowledged, at which offset, and which the
  consumer received.
* :func:`read_back`: everything stored in a topic, read from ``EARLIEST`` by a fresh Exclusive
  subscription of a fresh client; :func:`judge` compares it with a load's acks (``lost``,
  ``duplicated``).
* :func:`wait_until_publishable`: how long until a fresh client (bootstrapped to the broker)
  can create a producer and get a message acknowledged, polled every 100 ms.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc
from danube_pipeline.client import Consumer, DanubeClient, InitialPosition, Message, Producer, SubscriptionType
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer, etcdctl_binary
from danube_pipeline.error_codec import RemoteError
from danube_pipeline.errors import DanubeError, ProducerClosedError
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

T = TypeVar("T")

PAYLOAD_BYTES = 1024
"""Steady-load payload size: an 8-byte counter and 1,016 bytes of padding."""
PROBE_PAYLOAD = b"probe"
"""What a probe producer publishes; shorter than a steady payload, so read-backs skip it."""
POLL_S = 0.1
"""Interval of the publishability probe."""

PAUSED_PIDS: set[int] = set()
"""Processes this run has SIGSTOPped and not yet continued (the watchdog continues them)."""
MOUNTS: list[Path] = []
"""tmpfs mounts this run made and has not unmounted yet (the watchdog unmounts them)."""


# ---------------------------------------------------------------------------- small helpers


def fmt(value: float, digits: int) -> str:
    """``value`` with ``digits`` decimals, or ``nan`` when it was not measured."""
    return "nan" if math.isnan(value) else f"{value:.{digits}f}"


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (``VmRSS`` of ``/proc/PID/status``); ``nan`` if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


def describe(exc: BaseException) -> str:
    """One line naming an error: gRPC code and broker class for remote errors, else the type."""
    if isinstance(exc, RemoteError):
        code = getattr(exc, "code", None)
        code_name = code.name if isinstance(code, grpc.StatusCode) else "?"
        details = getattr(exc, "details", str(exc))
        return f"{code_name} {exc.error_class or '(no error class)'}: {details}"[:240]
    return f"{type(exc).__name__}: {exc}"[:240]


def is_typed_storage_error(exc: BaseException) -> bool:
    """Whether the broker reported ``exc`` as a typed error about storage, not as ``INTERNAL``.

    True when the broker named a :class:`~danube_pipeline.errors.DanubeError` subclass in the
    trailing metadata, the status is not ``INTERNAL``, and the class or message speaks of
    space, storage or a full disk.
    """
    if not isinstance(exc, RemoteError) or not exc.error_class:
        return False
    if getattr(exc, "code", None) == grpc.StatusCode.INTERNAL:
        return False
    text = f"{exc.error_class} {exc}".lower()
    return any(word in text for word in ("space", "storage", "full", "disk", "enospc"))


def mentions_full_disk(exc: BaseException) -> bool:
    """Whether ``exc``'s text is about a full disk, typed or not (``ENOSPC``, 'no space')."""
    text = f"{type(exc).__name__} {getattr(exc, 'error_class', '')} {exc}".lower()
    return any(word in text for word in ("no space", "enospc", "errno 28", "storage", "disk", "full"))


@dataclass
class Outcome(Generic[T]):
    """How a :func:`bounded` wait ended.

    Attributes:
        value: the awaitable's result when it finished in time without an error.
        error: the exception it raised, or a ``TimeoutError`` naming the limit.
        timed_out: it was still running at the limit (it was then cancelled).
    """

    value: T | None = None
    error: BaseException | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """It finished in time without an error."""
        return self.error is None


ABANDONED: set[asyncio.Task[Any]] = set()
"""Tasks that ignored five cancellations; kept referenced so they are not collected mid-run."""


async def bounded(aw: Awaitable[T], timeout_s: float) -> Outcome[T]:
    """Await ``aw`` for at most ``timeout_s`` seconds, never raising its errors.

    On time-out the task is cancelled and given up to 1 s to finish, five times over (a close
    may swallow one cancellation to clean up); a task still running after that is abandoned,
    so the caller always goes on. Cancelling the caller cancels the task too.

    Returns:
        The :class:`Outcome`: value, or error (``TimeoutError`` on time-out).
    """
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task in done:
        if task.cancelled():
            return Outcome(error=asyncio.CancelledError("cancelled"))
        exc = task.exception()
        return Outcome(error=exc) if exc is not None else Outcome(value=task.result())
    for _ in range(5):
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=1.0)
        if done:
            break
    else:
        ABANDONED.add(task)
    return Outcome(error=TimeoutError(f"not done within {timeout_s:g} s"), timed_out=True)


async def create_topic(address: str, topic: str) -> None:
    """Create ``topic`` (before a load starts, so its consumer does not race its producer).

    Raises:
        DanubeError: the broker refused or did not answer.
    """
    client = await new_client(address)
    try:
        await client.admin.create_topic(topic)
    finally:
        await bounded(client.close(), 5)


async def new_client(address: str, *, request_timeout_ms: int = 5000, retries: int = 3) -> DanubeClient:
    """A connected :class:`DanubeClient` bootstrapped to ``address``.

    Raises:
        BrokerUnavailableError: the broker did not answer.
    """
    return await connected(DanubeClient([address], request_timeout_ms=request_timeout_ms, metadata_retries=retries,
                                        retry_backoff_ms=100))


async def connected(client: DanubeClient) -> DanubeClient:
    """``client`` once connected; closed again if the connect fails.

    Raises:
        DanubeError: the connect's error (e.g. ``BrokerUnavailableError``).
    """
    try:
        await client.connect()
    except BaseException:
        await bounded(client.close(), 5)
        raise
    return client


ConsumeStep = str
"""Where :func:`consume_until_stopped` failed: ``"connect"``, ``"open"`` or ``"receive"``."""


async def consume_until_stopped(
    stop: asyncio.Event,
    connect: Callable[[], Awaitable[DanubeClient]],
    subscribe: Callable[[DanubeClient], Consumer],
    on_message: Callable[[Message], None],
    on_error: Callable[[BaseException, ConsumeStep], None],
    *,
    on_open: Callable[[], None] = lambda: None,
    open_timeout_s: float = 10.0,
    pause_s: float = 0.2,
) -> None:
    """The consumer loop every load shares: receive (250 ms polls) and ack until ``stop`` is
    set, connecting, subscribing and opening again after every failure.

    Args:
        stop: ends the loop; checked between receives.
        connect: a connected client (:func:`connected`); its error is reported as ``"connect"``.
        subscribe: the consumer to open on that client (it is closed after a failure).
        on_message: called with each message before it is acked.
        on_error: called with each failure and its step; the loop then pauses ``pause_s``.
        on_open: called after each successful open.
        open_timeout_s: the limit of one connect or open, in seconds.
        pause_s: the pause after a failure, in seconds.
    """
    client: DanubeClient | None = None
    try:
        while not stop.is_set():
            if client is None:
                got = await bounded(connect(), open_timeout_s)
                if not got.ok or got.value is None:
                    on_error(got.error or RuntimeError("no client"), "connect")
                    await asyncio.sleep(pause_s)
                    continue
                client = got.value
            consumer = subscribe(client)
            opened = await bounded(consumer.open(), open_timeout_s)
            if not opened.ok:
                on_error(opened.error or RuntimeError("open failed"), "open")
                await bounded(consumer.close(), 5)
                await asyncio.sleep(pause_s)
                continue
            on_open()
            try:
                while not stop.is_set():
                    try:
                        message = await consumer.receive(timeout_ms=250)
                    except TimeoutError:
                        continue
                    on_message(message)
                    await consumer.ack(message)
            except DanubeError as exc:
                on_error(exc, "receive")
                await asyncio.sleep(pause_s)
            finally:
                await bounded(consumer.close(), 10)
    finally:
        if client is not None:
            await bounded(client.close(), 10)


# ---------------------------------------------------------------------------- processes


class Cluster:
    """etcd and one broker, each in its own directory under ``root``, stopped by pid.

    Args:
        root: a directory for etcd's data and both logs.
        broker_args: extra broker command-line arguments (e.g. ``["--lease-ttl-s", "3"]``).
        broker_data_dir: the broker's data directory; default ``root / "broker"``.
    """

    def __init__(self, root: Path, *, broker_args: Sequence[str] = (), broker_data_dir: Path | None = None) -> None:
        self.root = root
        self.etcd = EtcdServer(root / "etcd", log_path=root / "etcd.log")
        self.broker = BrokerProcess(
            etcd_endpoints=self.etcd.endpoints,
            data_dir=broker_data_dir or root / "broker",
            log_path=root / "broker.log",
            extra_args=list(broker_args),
        )

    def start(self) -> None:
        """Start etcd, then the broker; each waits until ready (blocking; call from the main
        thread, whose exit the children follow).

        Raises:
            RuntimeError: a process did not become ready (with its log tail).
        """
        self.etcd.start()
        self.broker.start()

    def stop(self) -> None:
        """Continue etcd if paused, stop the broker, then etcd (SIGTERM, then SIGKILL). Idempotent."""
        self.resume_etcd()
        self.broker.stop()
        self.etcd.stop()

    @property
    def address(self) -> str:
        """The broker's ``host:port``."""
        return self.broker.address

    def pause_etcd(self) -> None:
        """``SIGSTOP`` etcd: it keeps its sockets but answers nothing."""
        pid = self.etcd.pid
        os.kill(pid, signal.SIGSTOP)
        PAUSED_PIDS.add(pid)

    def resume_etcd(self) -> None:
        """``SIGCONT`` etcd if this cluster paused it."""
        if not self.etcd.running:
            return
        pid = self.etcd.pid
        if pid in PAUSED_PIDS:
            os.kill(pid, signal.SIGCONT)
            PAUSED_PIDS.discard(pid)

    def kill_etcd(self) -> None:
        """``SIGKILL`` etcd (a crash) and reap it."""
        self.etcd.kill()

    async def restart_etcd(self, *, timeout_s: float = 20.0) -> float:
        """Start etcd again on the same data directory and ports, without blocking the loop.

        The process is spawned from the calling (main) thread; readiness (``GET /health``) is
        polled every 50 ms from a worker thread.

        Returns:
            Seconds from the spawn until etcd reported healthy.

        Raises:
            TimeoutError: etcd was not healthy within ``timeout_s`` (it is stopped).
        """
        started = time.monotonic()
        self.etcd.spawn_and_wait(
            self.etcd.command(), what="etcd (restart)", ready=lambda: True, timeout_s=1.0, on_timeout=self.etcd.stop
        )
        url = f"{self.etcd.client_url}/health"
        while time.monotonic() - started < timeout_s:
            if await asyncio.to_thread(_healthy, url):
                return time.monotonic() - started
            await asyncio.sleep(0.05)
        self.etcd.stop()
        raise TimeoutError(f"etcd not healthy within {timeout_s:g} s after the restart")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            body: Any = json.loads(response.read())
    except (OSError, urllib.error.URLError, ValueError):
        return False
    return isinstance(body, dict) and str(body.get("health")).lower() == "true"


async def etcd_keys(etcd: EtcdServer, *, timeout_s: float = 30.0) -> set[str]:
    """Every key in etcd (``etcdctl get "" --prefix --keys-only``).

    Raises:
        RuntimeError: etcdctl failed or did not finish within ``timeout_s``.
    """
    proc = await asyncio.create_subprocess_exec(
        etcdctl_binary(), f"--endpoints={etcd.client_url}", "get", "", "--prefix", "--keys-only",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "ETCDCTL_API": "3"},
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeError(f"etcdctl get did not finish within {timeout_s:g} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"etcdctl get failed ({proc.returncode}): {err.decode(errors='replace')[:300]}")
    return {line for line in out.decode().splitlines() if line.strip()}


async def membership_keys(cluster: Cluster) -> str:
    """Whether etcd holds the broker's registration (§1.2) and a leader (§1.7) now, as a line."""
    try:
        keys = await etcd_keys(cluster.etcd)
    except RuntimeError as exc:
        return f"membership keys not read: {exc}"
    registered = f"/cluster/register/{cluster.broker.broker_id}" in keys
    leader = "/cluster/leader" in keys
    return (f"etcd now: /cluster/register/{{id}} {'present' if registered else 'MISSING'},"
            f" /cluster/leader {'present' if leader else 'MISSING'}")


# ---------------------------------------------------------------------------- steady load


class SteadyLoad:
    """One producer and one consumer on ``topic``, keeping account of every counter.

    The producer sends every 10 ms its share of ``rate_per_s`` messages, unless ``window``
    messages are unresolved (then it skips the tick: a stalled broker stalls the load instead
    of growing memory). Payload ``i`` is ``i`` as 8 big-endian bytes plus padding; each counter
    is sent once (a failed send is not resent by the load, so a counter stored twice was
    resent by the client library or the broker). The consumer, an Exclusive subscription
    ``subscription`` from ``EARLIEST``, acks every message. Both reopen after a failure (after
    200 ms); every open and close is bounded.

    Attributes:
        acked: counter -> offset the broker acknowledged.
        failed: counter -> description of the error its send failed with.
        typed_storage_failures: failed sends whose error was a typed storage-full error.
        errors: description -> count, producer side (sends and opens).
        consumer_errors: description -> count, consumer side.
        received: counters the consumer received.
        deliveries: messages the consumer received, redeliveries included.
        first_error: the first error a send failed with, and when (``time.monotonic()``).
        ack_times: ``time.monotonic()`` of every ack, in order.
        producer_opens, consumer_opens: successful opens (1 each without faults).
    """

    def __init__(
        self,
        address: str,
        topic: str,
        *,
        rate_per_s: int,
        window: int = 4000,
        subscription: str = "steady",
        payload_bytes: int = PAYLOAD_BYTES,
    ) -> None:
        self.address = address
        self.topic = topic
        self.rate_per_s = rate_per_s
        self.window = window
        self.subscription = subscription
        self.payload_bytes = payload_bytes
        self._padding = b"\x5a" * (payload_bytes - 8)
        self.sent = 0
        self.acked: dict[int, int] = {}
        self.failed: dict[int, str] = {}
        self.typed_storage_failures = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.consumer_errors: collections.Counter[str] = collections.Counter()
        self.received: set[int] = set()
        self.deliveries = 0
        self.first_error: tuple[BaseException, float] | None = None
        self.ack_times: list[float] = []
        self.last_receive_s = time.monotonic()
        self.producer_opens = 0
        self.consumer_opens = 0
        self._unresolved: dict[int, asyncio.Future[int]] = {}
        self._stop_producing = asyncio.Event()
        self._stop_consuming = asyncio.Event()
        self._producer_task: asyncio.Task[None] | None = None
        self._consumer_task: asyncio.Task[None] | None = None

    # -- payloads

    def payload(self, counter: int) -> bytes:
        """The payload carrying ``counter``."""
        return counter.to_bytes(8, "big") + self._padding

    def counter_of(self, payload: bytes) -> int | None:
        """The counter in a steady payload, ``None`` for any other payload (probes)."""
        if len(payload) != self.payload_bytes or payload[8:] != self._padding:
            return None
        return int.from_bytes(payload[:8], "big")

    # -- lifecycle

    def start(self) -> None:
        """Start the producer and the consumer tasks."""
        self._producer_task = asyncio.create_task(self._produce(), name="steady-producer")
        self._consumer_task = asyncio.create_task(self._consume(), name="steady-consumer")

    async def wait_acked(self, count: int, *, timeout_s: float) -> bool:
        """Wait until at least ``count`` messages are acked; False at the time limit."""
        deadline = time.monotonic() + timeout_s
        while len(self.acked) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(self.acked) >= count

    async def stop(self, *, drain_timeout_s: float = 20.0, idle_s: float = 5.0) -> None:
        """Stop producing (close the producer, bounded), let the consumer drain, stop it.

        The consumer stops once it has received every acked counter, after ``idle_s`` without
        a message, or after ``drain_timeout_s``.
        """
        self._stop_producing.set()
        if self._producer_task is not None:
            await bounded(self._producer_task, 20)
        deadline = time.monotonic() + drain_timeout_s
        while time.monotonic() < deadline:
            if not self.acked.keys() - self.received:
                break
            if time.monotonic() - self.last_receive_s > idle_s:
                break
            await asyncio.sleep(0.25)
        self._stop_consuming.set()
        if self._consumer_task is not None:
            await bounded(self._consumer_task, 15)

    async def abort(self) -> None:
        """Stop at once without draining (a scenario that failed or was interrupted)."""
        self._stop_producing.set()
        self._stop_consuming.set()
        for task in (self._producer_task, self._consumer_task):
            if task is not None:
                task.cancel()
                await bounded(task, 5)

    # -- figures

    @property
    def unresolved(self) -> int:
        """Sends neither acked nor failed yet."""
        return len(self._unresolved)

    def longest_ack_gap_s(self, since: float = 0.0) -> float:
        """The longest time between consecutive acks after ``since`` (monotonic seconds)."""
        times = [t for t in self.ack_times if t >= since]
        return max((b - a for a, b in itertools.pairwise(times)), default=math.nan)

    def first_ack_after(self, since: float) -> float | None:
        """Monotonic time of the first ack after ``since``, or ``None``."""
        i = bisect.bisect_right(self.ack_times, since)
        return self.ack_times[i] if i < len(self.ack_times) else None

    def summary(self) -> str:
        """One line of counts: sent, acked, failed, unresolved, received, reopenings."""
        return (
            f"sent {self.sent:,}  acked {len(self.acked):,}  failed {len(self.failed):,}  unresolved {self.unresolved:,}"
            f"  received {len(self.received):,} ({self.deliveries:,} deliveries)"
            f"  producer opens {self.producer_opens}  consumer opens {self.consumer_opens}"
        )

    # -- producer

    def _record_failure(self, counter: int | None, exc: BaseException) -> None:
        text = describe(exc)
        if counter is not None:
            self.failed[counter] = text
            self.typed_storage_failures += is_typed_storage_error(exc)
            if self.first_error is None:
                self.first_error = (exc, time.monotonic())
        if len(self.errors) < 30 or text in self.errors:
            self.errors[text] += 1

    def _on_done(self, counter: int, fut: asyncio.Future[int]) -> None:
        self._unresolved.pop(counter, None)
        if fut.cancelled():
            self._record_failure(counter, asyncio.CancelledError("send cancelled"))
            return
        exc = fut.exception()
        if exc is not None:
            self._record_failure(counter, exc)
            return
        self.acked[counter] = fut.result()
        self.ack_times.append(time.monotonic())

    async def _produce(self) -> None:
        client: DanubeClient | None = None
        try:
            while not self._stop_producing.is_set():
                if client is None:
                    got = await bounded(new_client(self.address), 10)
                    if not got.ok or got.value is None:
                        self._record_failure(None, got.error or RuntimeError("no client"))
                        await asyncio.sleep(0.2)
                        continue
                    client = got.value
                producer = client.producer(self.topic, producer_name="steady", max_in_flight_batches=4)
                opened = await bounded(producer.open(), 10)
                if not opened.ok:
                    self._record_failure(None, opened.error or RuntimeError("open failed"))
                    await bounded(producer.close(), 5)
                    await asyncio.sleep(0.2)
                    continue
                self.producer_opens += 1
                await self._send_until_stopped(producer)
                await bounded(producer.close(), 10)
        finally:
            if client is not None:
                await bounded(client.close(), 10)

    async def _send_until_stopped(self, producer: Producer) -> None:
        """Send on schedule until asked to stop; return early if the producer closed itself."""
        loop = asyncio.get_running_loop()
        tick_s = 0.01
        per_tick = max(1, round(self.rate_per_s * tick_s))
        next_s = loop.time()
        while not self._stop_producing.is_set():
            next_s += tick_s
            delay = next_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.5:
                next_s = loop.time()  # fell behind (a stall): do not burst to catch up
            room = self.window - len(self._unresolved)
            for _ in range(max(0, min(per_tick, room))):
                counter = self.sent
                self.sent += 1
                try:
                    fut = producer.send_nowait(self.payload(counter))
                except ProducerClosedError as exc:
                    self._record_failure(counter, exc)
                    return
                except DanubeError as exc:
                    self._record_failure(counter, exc)
                    continue
                self._unresolved[counter] = fut
                fut.add_done_callback(functools.partial(self._on_done, counter))

    # -- consumer

    async def _consume(self) -> None:
        def on_message(message: Message) -> None:
            self.deliveries += 1
            self.last_receive_s = time.monotonic()
            counter = self.counter_of(message.payload)
            if counter is not None:
                self.received.add(counter)

        def on_open() -> None:
            self.consumer_opens += 1

        await consume_until_stopped(
            self._stop_consuming, lambda: new_client(self.address),
            lambda client: client.consumer(
                self.topic, subscription=self.subscription, subscription_type=SubscriptionType.EXCLUSIVE,
                initial_position=InitialPosition.EARLIEST, receiver_queue_size=2000, ack_batch_size=200,
                ack_flush_ms=50,
            ),
            on_message, lambda exc, _step: self._count_consumer_error(exc), on_open=on_open,
        )  # fmt: skip

    def _count_consumer_error(self, exc: BaseException) -> None:
        text = describe(exc)
        if len(self.consumer_errors) < 30 or text in self.consumer_errors:
            self.consumer_errors[text] += 1


# ---------------------------------------------------------------------------- read-back


@dataclass
class ReadBack:
    """What a fresh subscription from ``EARLIEST`` read.

    Attributes:
        next_offset: the topic's ``next_offset`` (``Admin.ListTopics``) before reading.
        stored: offset -> steady counter (``None`` for other payloads such as probes).
        complete: every offset below ``next_offset`` was read.
        error: why the read stopped early, if it did.
        seconds: how long the read took.
    """

    next_offset: int = 0
    stored: dict[int, int | None] = field(default_factory=dict)
    complete: bool = False
    error: str | None = None
    seconds: float = 0.0


async def read_back(address: str, topic: str, load: SteadyLoad, *, timeout_s: float = 90.0, idle_s: float = 5.0) -> ReadBack:
    """Read every message of ``topic`` with a fresh client and a new Exclusive subscription from
    ``EARLIEST``, until every offset below ``next_offset`` is read, ``idle_s`` pass without a
    message, or ``timeout_s`` pass. Never raises: a failure is in :attr:`ReadBack.error`.
    """
    result = ReadBack()
    started = time.monotonic()

    async def run() -> None:
        client = await new_client(address, request_timeout_ms=10_000)
        try:
            namespace = topic.split("/")[1]
            infos = await client.admin.list_topics(namespace)
            result.next_offset = next((t.next_offset for t in infos if t.topic == topic), 0)
            consumer = client.consumer(
                topic, subscription=f"verify-{uuid.uuid4().hex[:10]}", subscription_type=SubscriptionType.EXCLUSIVE,
                initial_position=InitialPosition.EARLIEST, receiver_queue_size=20_000, ack_batch_size=5000,
            )  # fmt: skip
            await consumer.open()
            try:
                while len(result.stored) < result.next_offset:
                    try:
                        message = await consumer.receive(timeout_ms=int(idle_s * 1000))
                    except TimeoutError:
                        result.error = f"no message for {idle_s:g} s"
                        break
                    result.stored[message.offset] = load.counter_of(message.payload)
                    await consumer.ack(message)
            finally:
                await bounded(consumer.close(), 10)
        finally:
            await bounded(client.close(), 10)

    outcome = await bounded(run(), timeout_s)
    if not outcome.ok and outcome.error is not None:
        result.error = describe(outcome.error)
    result.complete = all(o in result.stored for o in range(result.next_offset))
    result.seconds = time.monotonic() - started
    return result


@dataclass
class Verdict:
    """A load's acks against a read-back.

    Attributes:
        acked: counters the broker acknowledged.
        lost: acked counters not stored at any offset.
        duplicated: counters stored at two or more offsets.
        extra_copies: stored copies beyond the first, over all counters.
        misplaced: acked counters whose acknowledged offset holds something else.
        missing_offsets: offsets below ``next_offset`` the read-back did not get.
        undelivered: acked counters the steady consumer never received.
        stored_unacked: counters stored although their send failed or never resolved.
    """

    acked: int
    lost: int
    duplicated: int
    extra_copies: int
    misplaced: int
    missing_offsets: int
    undelivered: int
    stored_unacked: int

    def line(self) -> str:
        """The verdict as one line."""
        return (
            f"acked {self.acked:,}  lost {self.lost}  duplicated {self.duplicated} ({self.extra_copies} extra copies)"
            f"  misplaced {self.misplaced}  missing offsets {self.missing_offsets}"
            f"  never delivered to the steady consumer {self.undelivered}"
            f"  stored though not acked {self.stored_unacked}"
        )


def judge(load: SteadyLoad, back: ReadBack) -> Verdict:
    """Compare ``load``'s acks with what ``back`` read."""
    offsets_of: dict[int, list[int]] = collections.defaultdict(list)
    for offset, counter in back.stored.items():
        if counter is not None:
            offsets_of[counter].append(offset)
    lost = sum(1 for c in load.acked if c not in offsets_of)
    duplicated = sum(1 for offs in offsets_of.values() if len(offs) > 1)
    extra = sum(len(offs) - 1 for offs in offsets_of.values())
    misplaced = sum(1 for c, off in load.acked.items() if off in back.stored and back.stored[off] != c)
    missing = sum(1 for o in range(back.next_offset) if o not in back.stored)
    undelivered = len(load.acked.keys() - load.received)
    stored_unacked = sum(1 for c in offsets_of if c not in load.acked)
    return Verdict(
        acked=len(load.acked), lost=lost, duplicated=duplicated, extra_copies=extra, misplaced=misplaced,
        missing_offsets=missing, undelivered=undelivered, stored_unacked=stored_unacked,
    )  # fmt: skip


# ---------------------------------------------------------------------------- publishability probe


async def publish_once(address: str, topic: str, *, timeout_s: float = 2.0) -> str | None:
    """With a fresh client bootstrapped to ``address``: create a producer on ``topic`` and send one
    message. Returns ``None`` once it is acked, else why not (within ``timeout_s``).

    The client makes one metadata pass with a 1 s deadline per RPC, so a failure is reported
    quickly; closing the client is not timed (it is bounded separately).
    """
    client = DanubeClient([address], request_timeout_ms=1000, metadata_retries=0, retry_backoff_ms=50)

    async def attempt() -> None:
        await client.connect()
        producer = client.producer(topic, producer_name="probe")
        await producer.open()
        await producer.send(PROBE_PAYLOAD)

    try:
        outcome = await bounded(attempt(), timeout_s)
    finally:
        await bounded(client.close(), 3)
    return None if outcome.ok else describe(outcome.error or RuntimeError("?"))


@dataclass
class ProbeResult:
    """How :func:`wait_until_publishable` ended.

    Attributes:
        seconds: from ``since`` until the first acked probe message, or ``nan``.
        attempts: probes made.
        last_error: why the last failed probe failed.
    """

    seconds: float = math.nan
    attempts: int = 0
    last_error: str | None = None
    errors: collections.Counter[str] = field(default_factory=collections.Counter)


async def wait_until_publishable(address: str, topic: str, *, since: float, timeout_s: float) -> ProbeResult:
    """Probe with :func:`publish_once` every :data:`POLL_S` until one is acked or ``timeout_s``
    pass after ``since`` (a ``time.monotonic()`` value)."""
    result = ProbeResult()
    while time.monotonic() - since < timeout_s:
        result.attempts += 1
        remaining = timeout_s - (time.monotonic() - since)
        error = await publish_once(address, topic, timeout_s=max(0.5, min(3.0, remaining)))
        if error is None:
            result.seconds = time.monotonic() - since
            return result
        result.last_error = error
        key = error[:240]
        if len(result.errors) < 10 or key in result.errors:
            result.errors[key] += 1
        await asyncio.sleep(POLL_S)
    return result


# ---------------------------------------------------------------------------- scenario results


@dataclass
class LoadReport:
    """The figures of a scenario under steady load (1 to 3).

    Attributes:
        verdict: the acks against the read-back, if the read-back ran.
        read_back: the read-back itself.
        notes: other lines to print.
    """

    verdict: Verdict | None = None
    read_back: ReadBack | None = None
    notes: list[str] = field(default_factory=list)


def load_lines(load: SteadyLoad, report: LoadReport) -> list[str]:
    """Lines describing a steady load and its verdict."""
    lines = [f"load      {load.summary()}"]
    for text, count in load.errors.most_common(4):
        lines.append(f"  producer error x{count}: {text}")
    for text, count in load.consumer_errors.most_common(3):
        lines.append(f"  consumer error x{count}: {text}")
    back = report.read_back
    if back is not None:
        lines.append(
            f"read-back {len(back.stored):,} of {back.next_offset:,} offsets in {back.seconds:.1f} s"
            + ("" if back.complete else f"  INCOMPLETE: {back.error}")
        )
    if report.verdict is not None:
        lines.append(f"verdict   {report.verdict.line()}")
    return lines


async def finish_load(cluster: Cluster, load: SteadyLoad, topic: str, report: LoadReport) -> None:
    """Stop ``load``, read ``topic`` back from the cluster's broker and judge it."""
    await load.stop()
    report.read_back = await read_back(cluster.address, topic, load)
    report.verdict = judge(load, report.read_back)


def asdict(obj: Any) -> dict[str, Any]:
    """``dataclasses.asdict`` for the result types (for debugging output)."""
    return dataclasses.asdict(obj)


# ---------------------------------------------------------------------------- scenario 1: etcd pause


@dataclass
class PauseResult(LoadReport):
    """Scenario 1: etcd paused longer than the broker's lease TTL.

    Attributes:
        reregister_s: from ``SIGCONT`` until a fresh client publishes, or ``nan``.
    """

    reregister_s: float = math.nan


async def etcd_pause(root: Path, *, lease_ttl_s: int = 3, pause_s: float = 8.0, rate_per_s: int = 1000,
                     probe_timeout_s: float = 60.0, say: Callable[[str], None] = print) -> PauseResult:
    """Scenario 1: ``SIGSTOP`` etcd for ``pause_s`` (longer than ``--lease-ttl-s``) under steady
    load; after ``SIGCONT``, time until a fresh client can publish (``reregister_s``)."""
    result = PauseResult()
    topic = "/faults/pause"
    cluster = Cluster(root, broker_args=["--lease-ttl-s", str(lease_ttl_s)])
    cluster.start()
    try:
        await create_topic(cluster.address, topic)
        load = SteadyLoad(cluster.address, topic, rate_per_s=rate_per_s)
        load.start()
        try:
            if not await load.wait_acked(rate_per_s, timeout_s=15):
                result.notes.append(f"load slow to start: {len(load.acked)} acked after 15 s")
            await asyncio.sleep(1.0)
            paused_at = time.monotonic()
            cluster.pause_etcd()
            say(f"  etcd SIGSTOP for {pause_s:g} s (broker --lease-ttl-s {lease_ttl_s})")
            await asyncio.sleep(pause_s)
            cluster.resume_etcd()
            resumed_at = time.monotonic()
            acked_during = sum(1 for t in load.ack_times if paused_at <= t <= resumed_at)
            probe = await wait_until_publishable(cluster.address, topic, since=resumed_at, timeout_s=probe_timeout_s)
            result.reregister_s = probe.seconds
            result.notes.append(f"acks while etcd was paused: {acked_during:,}")
            result.notes.append(
                f"probes {probe.attempts}; fresh client published {fmt(probe.seconds, 2)} s after SIGCONT"
                + ("" if not math.isnan(probe.seconds) else f" (not within {probe_timeout_s:g} s)")
            )
            for text, count in probe.errors.most_common(3):
                result.notes.append(f"  probe failure x{count}: {text}")
            await asyncio.sleep(2.0)
            result.notes.append(await membership_keys(cluster))
            result.notes.append(f"longest gap between acks from the pause on: {load.longest_ack_gap_s(paused_at - 1):.2f} s")
        except BaseException:
            cluster.resume_etcd()
            await load.abort()
            raise
        await finish_load(cluster, load, topic, result)
        result.notes[:0] = load_lines(load, result)
    finally:
        cluster.stop()
    return result


# ---------------------------------------------------------------------------- scenario 2: etcd kill


@dataclass
class KillResult(LoadReport):
    """Scenario 2: etcd killed and restarted on the same data directory and port.

    Attributes:
        recover_s: from the restart until a fresh client publishes, or ``nan``.
    """

    recover_s: float = math.nan


async def etcd_kill(root: Path, *, lease_ttl_s: int = 3, down_s: float = 5.0, rate_per_s: int = 1000,
                    probe_timeout_s: float = 45.0, say: Callable[[str], None] = print) -> KillResult:
    """Scenario 2: ``SIGKILL`` etcd under steady load, keep it down ``down_s``, start it again on
    the same data directory and ports; time until a fresh client can publish."""
    result = KillResult()
    topic = "/faults/kill"
    cluster = Cluster(root, broker_args=["--lease-ttl-s", str(lease_ttl_s)])
    cluster.start()
    try:
        await create_topic(cluster.address, topic)
        load = SteadyLoad(cluster.address, topic, rate_per_s=rate_per_s)
        load.start()
        try:
            if not await load.wait_acked(rate_per_s, timeout_s=15):
                result.notes.append(f"load slow to start: {len(load.acked)} acked after 15 s")
            await asyncio.sleep(1.0)
            killed_at = time.monotonic()
            cluster.kill_etcd()
            say(f"  etcd SIGKILL, down {down_s:g} s (broker --lease-ttl-s {lease_ttl_s})")
            await asyncio.sleep(down_s)
            restarted_at = time.monotonic()
            try:
                healthy_s = await cluster.restart_etcd()
                result.notes.append(f"etcd healthy {healthy_s:.2f} s after the restart")
                probe = await wait_until_publishable(cluster.address, topic, since=restarted_at, timeout_s=probe_timeout_s)
                result.recover_s = probe.seconds
                result.notes.append(
                    f"probes {probe.attempts}; fresh client published {fmt(probe.seconds, 2)} s after the restart"
                    + ("" if not math.isnan(probe.seconds) else f" (not within {probe_timeout_s:g} s)")
                )
                for text, count in probe.errors.most_common(3):
                    result.notes.append(f"  probe failure x{count}: {text}")
            except (TimeoutError, RuntimeError) as exc:
                result.notes.append(f"etcd restart failed: {exc}")
            acked_down = sum(1 for t in load.ack_times if killed_at <= t <= restarted_at)
            result.notes.append(f"acks while etcd was down: {acked_down:,}")
            await asyncio.sleep(3.0)
            result.notes.append(await membership_keys(cluster))
            result.notes.append(f"longest gap between acks from the kill on: {load.longest_ack_gap_s(killed_at - 1):.2f} s")
        except BaseException:
            await load.abort()
            raise
        await finish_load(cluster, load, topic, result)
        result.notes[:0] = load_lines(load, result)
    finally:
        cluster.stop()
    return result


# ---------------------------------------------------------------------------- scenario 3: full disk


@dataclass
class FullDiskResult(LoadReport):
    """Scenario 3: the broker's data directory on a small tmpfs that fills up.

    Attributes:
        skipped: why the scenario did not run (tmpfs could not be mounted), if so.
        checks: check name -> passed, in order.
        resume_s: from removing the filler until the next ack, or ``nan``.
    """

    skipped: str | None = None
    checks: dict[str, bool] = field(default_factory=dict)
    resume_s: float = math.nan

    @property
    def recovered(self) -> str:
        """``yes`` if every check passed, ``no`` if one failed, ``skipped`` if not run."""
        if self.skipped is not None:
            return "skipped"
        return "yes" if self.checks and all(self.checks.values()) else "no"


def _mount_tmpfs(directory: Path, size_mib: int) -> str | None:
    """Mount a tmpfs of ``size_mib`` MiB on ``directory``; ``None`` on success, else why not."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(directory)],
            capture_output=True, text=True, timeout=15, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mount failed: {exc}"
    if proc.returncode != 0:
        return f"mount failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
    MOUNTS.append(directory)
    return None


def unmount(directory: Path) -> None:
    """Unmount ``directory`` (lazily if it is busy); errors are ignored."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        if subprocess.run(["umount", str(directory)], capture_output=True, timeout=15, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(directory)], capture_output=True, timeout=15, check=False)
    with contextlib.suppress(ValueError):
        MOUNTS.remove(directory)


def _fill(path: Path, leave_bytes: int) -> int:
    """Write a file of zeros into ``path``'s file system until ``leave_bytes`` remain free.

    Returns:
        The filler's size in bytes.
    """
    st = os.statvfs(path.parent)
    size = max(0, st.f_bavail * st.f_frsize - leave_bytes)
    chunk = b"\0" * (1 << 20)
    written = 0
    with path.open("wb") as fh:
        while written < size:
            written += fh.write(chunk[: min(len(chunk), size - written)])
        fh.flush()
        os.fsync(fh.fileno())
    return written


def free_mib(directory: Path) -> float:
    """Free space of ``directory``'s file system, in MiB."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize / 2**20


async def _fresh_reader_reads(address: str, topic: str, *, want: int, timeout_s: float) -> tuple[int, str | None]:
    """A fresh client and a new subscription from ``EARLIEST`` read up to ``want`` messages.

    Returns:
        ``(messages read, error or None)``.
    """
    got = 0

    async def run() -> None:
        nonlocal got
        client = await new_client(address)
        try:
            consumer = client.consumer(topic, subscription=f"reader-{uuid.uuid4().hex[:8]}",
                                       initial_position=InitialPosition.EARLIEST, receiver_queue_size=5000)
            await consumer.open()
            try:
                while got < want:
                    message = await consumer.receive(timeout_ms=int(timeout_s * 1000))
                    got += 1
                    await consumer.ack(message)
            finally:
                await bounded(consumer.close(), 5)
        finally:
            await bounded(client.close(), 5)

    outcome = await bounded(run(), timeout_s)
    return got, None if outcome.ok else describe(outcome.error or RuntimeError("?"))


async def full_disk(root: Path, *, tmpfs_mib: int = 64, leave_mib: int = 8, rate_per_s: int = 2000,
                    resume_within_s: float = 10.0, say: Callable[[str], None] = print) -> FullDiskResult:
    """Scenario 3: fill the broker's tmpfs under steady load, check reads, free space, check that
    publishing resumes by itself within ``resume_within_s``, restart the broker and check that
    every acked message is stored exactly once."""
    result = FullDiskResult()
    topic = "/faults/fulldisk"
    mount_dir = root / "tmpfs"
    why = _mount_tmpfs(mount_dir, tmpfs_mib)
    if why is not None:
        result.skipped = why
        return result
    filler = mount_dir / "filler"
    cluster = Cluster(root, broker_data_dir=mount_dir / "broker")
    try:
        cluster.start()
        await create_topic(cluster.address, topic)
        filler_bytes = await asyncio.to_thread(_fill, filler, leave_mib << 20)
        say(f"  tmpfs {tmpfs_mib} MiB; filler {filler_bytes / 2**20:.1f} MiB leaves {free_mib(mount_dir):.1f} MiB free")
        load = SteadyLoad(cluster.address, topic, rate_per_s=rate_per_s)
        load.start()
        try:
            await _full_disk_steps(cluster, load, filler, mount_dir, result, resume_within_s=resume_within_s, say=say)
            await load.stop()
            say("  restarting the broker on the same data directory")
            cluster.broker.stop()
            try:
                cluster.broker.start()
                result.checks["broker restarted"] = True
            except RuntimeError as exc:
                result.checks["broker restarted"] = False
                result.notes.append(f"broker restart failed: {str(exc)[:300]}")
            if cluster.broker.running:
                result.read_back = await read_back(cluster.address, topic, load)
                result.verdict = judge(load, result.read_back)
                v = result.verdict
                result.checks["read back complete"] = result.read_back.complete
                result.checks["every acked message stored exactly once"] = (
                    v.lost == 0 and v.duplicated == 0 and v.misplaced == 0 and v.acked > 0
                )
        except BaseException:
            await load.abort()
            raise
        result.notes[:0] = load_lines(load, result)
    finally:
        cluster.stop()
        with contextlib.suppress(OSError):
            filler.unlink(missing_ok=True)
        unmount(mount_dir)
    return result


async def _full_disk_steps(cluster: Cluster, load: SteadyLoad, filler: Path, mount_dir: Path,
                           result: FullDiskResult, *, resume_within_s: float, say: Callable[[str], None]) -> None:
    """The middle of scenario 3: wait for the failure, check reads, free space, wait for acks."""
    started = time.monotonic()
    # 1. Publishing fails (or stalls: no ack for 3 s with sends outstanding).
    failure: str | None = None
    while time.monotonic() - started < 60:
        if load.first_error is not None:
            exc, at = load.first_error
            failure = describe(exc)
            result.notes.append(
                f"first send failure {at - started:.1f} s into the load: {failure}"
                f"  (typed: {'yes' if is_typed_storage_error(exc) else 'no'};"
                f" about a full disk: {'yes' if mentions_full_disk(exc) else 'no'})"
            )
            break
        last_ack = load.ack_times[-1] if load.ack_times else started
        if load.unresolved and time.monotonic() - last_ack > 3.0:
            failure = "stall"
            result.notes.append(f"publishing stalled without an error: no ack for 3 s, {load.unresolved} unresolved")
            break
        await asyncio.sleep(0.05)
    if failure is None:
        result.notes.append(f"publishing never failed within 60 s ({len(load.acked):,} acked)")
    say(f"  disk full after {time.monotonic() - started:.1f} s, {len(load.acked):,} acked; {free_mib(mount_dir):.2f} MiB free")
    # 2. Consumers can still read while the disk is full.
    await asyncio.sleep(2.0)
    acked_now = set(load.acked)
    deadline = time.monotonic() + 8.0
    while acked_now - load.received and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    behind = len(acked_now - load.received)
    want = min(1000, max(1, len(acked_now)))
    read, error = await _fresh_reader_reads(cluster.address, load.topic, want=want, timeout_s=10.0)
    result.checks["consumers read while the disk is full"] = behind == 0 and read >= want
    result.notes.append(
        f"while full: steady consumer missing {behind:,} of {len(acked_now):,} acked;"
        f" a fresh subscription read {read} of {want}" + (f" ({error})" if error else "")
    )
    # 3. Free space; publishing resumes by itself.
    filler.unlink()
    freed_at = time.monotonic()
    say(f"  filler removed: {free_mib(mount_dir):.1f} MiB free")
    resumed: float | None = None
    while time.monotonic() - freed_at < resume_within_s:
        resumed = load.first_ack_after(freed_at)
        if resumed is not None:
            break
        await asyncio.sleep(0.05)
    if resumed is not None:
        result.resume_s = resumed - freed_at
    failed = len(load.failed)
    result.checks["every failed send carries a typed storage-full error"] = (
        failed > 0 and load.typed_storage_failures == failed
    )
    result.checks[f"publishing resumes within {resume_within_s:g} s"] = resumed is not None
    result.notes.append(
        f"failed sends: {failed:,}, of which with a typed storage-full error: {load.typed_storage_failures:,};"
        f" first ack {fmt(result.resume_s, 2)} s after freeing space"
        + ("" if resumed is not None else f" (none within {resume_within_s:g} s)")
        + f"; producer opens so far {load.producer_opens}"
    )
    await asyncio.sleep(2.0)


# ---------------------------------------------------------------------------- scenario 4: stuck consumer


@dataclass
class StuckResult:
    """Scenario 4: a consumer with a 2^32-1 window that never reads.

    Attributes:
        rss_growth_mib: broker ``VmRSS`` peak while producing minus before, with the stuck
            consumer attached, or ``nan``.
        control_growth_mib: the same for the same volume with no consumer attached.
        notes: other lines to print.
    """

    rss_growth_mib: float = math.nan
    control_growth_mib: float = math.nan
    notes: list[str] = field(default_factory=list)


class _RssSampler:
    """``VmRSS`` of a pid every 100 ms while running."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.samples.append(rss_mib(self.pid))
            await asyncio.sleep(0.1)

    def __enter__(self) -> _RssSampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
        self.samples.append(rss_mib(self.pid))

    @property
    def peak(self) -> float:
        """The highest sample (``nan`` without samples)."""
        values = [s for s in self.samples if not math.isnan(s)]
        return max(values) if values else math.nan


async def _produce_bytes(producer: Producer, *, total_bytes: int, payload: bytes, window: int = 32) -> int:
    """Send ``total_bytes`` of ``payload`` messages with at most ``window`` unacked.

    Returns:
        Messages acked.

    Raises:
        TimeoutError: an ack took longer than 30 s.
        DanubeError: a send failed.
    """
    count = max(1, total_bytes // len(payload))
    pending: collections.deque[asyncio.Future[int]] = collections.deque()
    acked = 0
    for _ in range(count):
        pending.append(producer.send_nowait(payload))
        if len(pending) >= window:
            oldest = pending.popleft()
            done, _ = await asyncio.wait({oldest}, timeout=30)
            if not done:
                raise TimeoutError("no ack within 30 s")
            oldest.result()
            acked += 1
    for fut in pending:
        done, _ = await asyncio.wait({fut}, timeout=30)
        if not done:
            raise TimeoutError("no ack within 30 s")
        fut.result()
        acked += 1
    return acked


async def stuck_consumer(root: Path, *, volume_mib: int = 100, payload_bytes: int = 64 * 1024,
                         window: int = 2**32 - 1, say: Callable[[str], None] = print) -> StuckResult:
    """Scenario 4: produce ``volume_mib`` MiB with no consumer (the control), then subscribe
    through the raw gRPC API with ``receiver_queue_size`` ``window``, open the ``Receive``
    stream and never read it, and produce ``volume_mib`` MiB more; broker RSS growth of each."""
    result = StuckResult()
    topic = "/faults/stuck"
    cluster = Cluster(root)
    cluster.start()
    pid = cluster.broker.pid
    payload = bytes(range(256)) * (payload_bytes // 256)
    total = volume_mib << 20
    try:
        client = await new_client(cluster.address, request_timeout_ms=30_000)
        try:
            async with client.producer(topic, producer_name="bulk", max_batch_messages=16) as producer:
                await _produce_bytes(producer, total_bytes=4 << 20, payload=payload)  # warm-up
                await asyncio.sleep(1.0)
                before = rss_mib(pid)
                t0 = time.monotonic()
                with _RssSampler(pid) as control:
                    await _produce_bytes(producer, total_bytes=total, payload=payload)
                    took = time.monotonic() - t0
                    await asyncio.sleep(2.0)
                result.control_growth_mib = control.peak - before
                result.notes.append(
                    f"control, no consumer: {volume_mib} MiB in {took:.1f} s; broker RSS"
                    f" {before:.1f} -> peak {control.peak:.1f} MiB (+{result.control_growth_mib:.1f}),"
                    f" after {control.samples[-1]:.1f} MiB"
                )
                channel = grpc.aio.insecure_channel(cluster.address)
                call: Any = None
                try:
                    stub = pb_grpc.ConsumerServiceStub(channel)
                    subscribed = await bounded(
                        stub.Subscribe(
                            pb.SubscribeRequest(
                                topic=topic, subscription="stuck", subscription_type=pb.EXCLUSIVE,
                                consumer_name="stuck", initial_position=pb.LATEST, receiver_queue_size=window,
                            ),
                            timeout=10,
                        ),
                        15,
                    )  # fmt: skip
                    if subscribed.ok and subscribed.value is not None:
                        call = stub.Receive(pb.ReceiveRequest(consumer_id=subscribed.value.consumer_id))
                        result.notes.append(f"raw Subscribe with receiver_queue_size={window} accepted; Receive opened, never read")
                    else:
                        result.notes.append(f"raw Subscribe with receiver_queue_size={window} refused: "
                                            f"{_grpc_text(subscribed.error)}")
                    await asyncio.sleep(1.0)
                    before = rss_mib(pid)
                    t0 = time.monotonic()
                    with _RssSampler(pid) as stuck:
                        await _produce_bytes(producer, total_bytes=total, payload=payload)
                        took = time.monotonic() - t0
                        await asyncio.sleep(3.0)
                    result.rss_growth_mib = stuck.peak - before
                    state = "still open" if call is not None and not call.done() else "ended"
                    if call is not None and call.done():
                        state += f" ({_grpc_text(await _call_error(call))})"
                    result.notes.append(
                        f"stuck consumer: {volume_mib} MiB in {took:.1f} s; broker RSS"
                        f" {before:.1f} -> peak {stuck.peak:.1f} MiB (+{result.rss_growth_mib:.1f}),"
                        f" after {stuck.samples[-1]:.1f} MiB; Receive stream {state}"
                    )
                finally:
                    if call is not None:
                        call.cancel()
                    await bounded(channel.close(), 5)
        finally:
            await bounded(client.close(), 10)
    finally:
        cluster.stop()
    return result


def _grpc_text(exc: BaseException | None) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return describe(exc) if exc is not None else "?"


async def _call_error(call: Any) -> BaseException | None:
    try:
        code = await call.code()
        details = await call.details()
        return RuntimeError(f"{code.name}: {details}")
    except Exception as exc:  # noqa: BLE001 - only described
        return exc


# ---------------------------------------------------------------------------- scenario 5: churn


@dataclass
class ChurnResult:
    """Scenario 5: producers and consumers opened and closed in rounds.

    Attributes:
        keys_before: etcd keys before the first round.
        keys_after: etcd keys right after the last round.
        keys_after_wait: etcd keys ``wait_s`` later.
        wait_s: the wait.
        notes: other lines to print.
    """

    keys_before: int = 0
    keys_after: int = 0
    keys_after_wait: int = 0
    wait_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def orphan_keys(self) -> float:
        """Keys after the wait minus keys before (``nan`` if not counted)."""
        return float(self.keys_after_wait - self.keys_before) if self.keys_before else math.nan


def _key_kind(key: str) -> str:
    if "/producers/" in key:
        return "producers (§3.3)"
    if key.endswith("/cursor"):
        return "cursors (§3.5)"
    if "/subscriptions/" in key:
        return "subscriptions (§3.4)"
    return "other"


async def _in_parallel(items: Sequence[T], fn: Callable[[T], Awaitable[Any]], *, limit: int, timeout_s: float) -> list[str]:
    """Run ``fn`` over ``items`` with at most ``limit`` at once, each bounded by ``timeout_s``.

    Returns:
        Descriptions of the failures.
    """
    sem = asyncio.Semaphore(limit)
    failures: list[str] = []

    async def one(item: T) -> None:
        async with sem:
            outcome = await bounded(fn(item), timeout_s)
            if not outcome.ok:
                failures.append(describe(outcome.error or RuntimeError("?")))

    await asyncio.gather(*(one(item) for item in items))
    return failures


async def churn(root: Path, *, producers: int = 500, consumers: int = 500, rounds: int = 4, wait_s: float = 5.0,
                broker_args: Sequence[str] = (), say: Callable[[str], None] = print) -> ChurnResult:
    """Scenario 5: ``rounds`` rounds of opening and closing ``producers`` producers and
    ``consumers`` consumers (one Shared subscription) on one topic; etcd keys before, right
    after, and ``wait_s`` after."""
    result = ChurnResult(wait_s=wait_s)
    topic = "/faults/churn"
    cluster = Cluster(root, broker_args=broker_args)
    cluster.start()
    try:
        client = await new_client(cluster.address, request_timeout_ms=15_000)
        try:
            await client.admin.create_topic(topic)
            # The Shared subscription exists before the count: its keys are not orphans.
            first = client.consumer(topic, subscription="churn", subscription_type=SubscriptionType.SHARED)
            await first.open()
            await first.close()
            await asyncio.sleep(1.0)
            before = await etcd_keys(cluster.etcd)
            result.keys_before = len(before)
            failures: collections.Counter[str] = collections.Counter()
            started = time.monotonic()
            opened: list[Any] = []

            async def open_producer(i: int) -> None:
                p = client.producer(topic, producer_name=f"churn-{i}")
                await p.open()
                opened.append(p)

            async def open_consumer(i: int) -> None:
                c = client.consumer(topic, subscription="churn", subscription_type=SubscriptionType.SHARED,
                                    consumer_name=f"churn-{i}")
                await c.open()
                opened.append(c)

            async def close(x: Any) -> None:
                await x.close()

            for r in range(1, rounds + 1):
                opened.clear()
                t0 = time.monotonic()
                failures.update(await _in_parallel(range(producers), open_producer, limit=25, timeout_s=20))
                n_producers = len(opened)
                failures.update(await _in_parallel(list(opened), close, limit=25, timeout_s=20))
                opened.clear()
                t1 = time.monotonic()
                failures.update(await _in_parallel(range(consumers), open_consumer, limit=25, timeout_s=20))
                n_consumers = len(opened)
                failures.update(await _in_parallel(list(opened), close, limit=25, timeout_s=20))
                say(f"  round {r}: {n_producers} producers opened and closed in {t1 - t0:.1f} s,"
                    f" {n_consumers} consumers in {time.monotonic() - t1:.1f} s")
            result.notes.append(f"{rounds} rounds in {time.monotonic() - started:.1f} s")
            for text, count in failures.most_common(4):
                result.notes.append(f"  failure x{count}: {text}")
            after = await etcd_keys(cluster.etcd)
            result.keys_after = len(after)
            await asyncio.sleep(wait_s)
            after_wait = await etcd_keys(cluster.etcd)
            result.keys_after_wait = len(after_wait)
            for label, keys in (("right after", after), (f"after {wait_s:g} s", after_wait)):
                added = collections.Counter(_key_kind(k) for k in keys - before)
                removed = len(before - keys)
                kinds = ", ".join(f"{kind} +{n}" for kind, n in added.most_common()) or "none"
                result.notes.append(f"keys {label}: {len(keys)} (before {len(before)}); new: {kinds}; gone: {removed}")
        finally:
            await bounded(client.close(), 30)
    finally:
        cluster.stop()
    return result
