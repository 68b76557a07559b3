"""The producer loops and statistics that every target of ``benchmarks/peers.py`` shares.

A target hands in one coroutine function, ``send(payload) -> Future``: it queues one message
(pipelined behind the ones before it, without waiting for their acks) and returns a future
that resolves when the server acknowledges that message. The loops here decide *when* to call
it; the target never does:

* :func:`window_loop` keeps at most ``window`` messages unacknowledged: it sends, and when
  ``window`` are unacked it waits for the oldest ack before sending the next.
* :func:`open_loop` sends on a fixed schedule (``rate_per_s``) whether or not acks came back,
  and measures latency from each message's *scheduled* send time.

:func:`measure` runs one :class:`Case` on a target's :class:`Session`: an unmeasured warm-up,
the server's stored-message count and its own counters (fsyncs, where it keeps them) before
and after, and the loop in between.

Times are ``time.perf_counter()`` seconds. A message's latency runs from just before its
``send`` call (the window loop) or from its scheduled time (the open loop) to the moment the
event loop runs the done-callback of its future. CPU is measured over the same wall time:
the benchmark process from ``time.process_time()`` (all its threads), each server from
``/proc/<pid>/stat`` ``utime + stime``.
"""

from __future__ import annotations

import asyncio
import collections
import math
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "WARMUP_MESSAGES",
    "Case",
    "CaseResult",
    "LoopResult",
    "Send",
    "SendMany",
    "Session",
    "make_payload",
    "measure",
    "open_loop",
    "percentile",
    "proc_cpu_s",
    "window_loop",
    "window_loop_many",
]

Send = Callable[[bytes], Awaitable["asyncio.Future[Any]"]]
"""Queue one message; the returned future resolves on the server's ack (fails on its error)."""

SendMany = Callable[[list[bytes]], Awaitable["asyncio.Future[Any]"]]
"""Queue several messages in one call; the one returned future resolves when the server has
acknowledged every one of them (fails on the first error)."""

WARMUP_MESSAGES = 1_000
"""Unmeasured messages sent before each case (N if fewer)."""
OPEN_LOOP_MIN_SLEEP_S = 0.001
"""The shortest wait of :func:`open_loop` between two sends. The loops' timers are in whole
milliseconds: asyncio's rounds a shorter wait up to 1 ms (epoll), uvloop's down to 0 ms,
which turned the wait into a busy loop that took a whole core from the servers on a 2-core
machine (the client at 100 % at 5,000 msg/s)."""

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used so far, from ``/proc``.

    Resolution is one clock tick (usually 10 ms). Returns ``nan`` if the process is gone.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return math.nan
    # Fields after "(comm)" start at field 3 (state); utime and stime are fields 14 and 15.
    rest = stat[stat.rindex(")") + 2 :].split()
    return (int(rest[11]) + int(rest[12])) / _CLK_TCK


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-quantile (``0 < q <= 1``) of ascending values; ``nan`` if empty."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def make_payload(size_bytes: int) -> bytes:
    """A payload of ``size_bytes`` bytes (a repeating 0..255 pattern, not compressible to nothing)."""
    return (bytes(range(256)) * (size_bytes // 256 + 1))[:size_bytes]


@dataclass
class LoopResult:
    """What one loop measured.

    Attributes:
        messages: messages the loop was asked to send.
        size_bytes: payload size of each, in bytes.
        sent: messages actually handed to ``send`` (less than ``messages`` after a time-out).
        acked: messages whose future resolved with a result.
        failed: messages whose future failed (or never resolved before the time limit).
        first_error: the first failure, as text.
        elapsed_s: wall seconds from the first send to the last ack (or to the give-up).
        send_span_s: wall seconds from the first send to the last send.
        latencies_s: per acked message, seconds from send (or schedule) to ack, ascending.
        send_latencies_s: open loop only: seconds from the actual send call to ack, ascending.
        client_cpu_s: CPU seconds of this process over ``elapsed_s``.
        server_cpu_s: CPU seconds of the server processes over ``elapsed_s`` (``nan`` unknown).
        timed_out: the loop stopped at its time limit.
    """

    messages: int
    size_bytes: int
    sent: int = 0
    acked: int = 0
    failed: int = 0
    first_error: str | None = None
    elapsed_s: float = 0.0
    send_span_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    send_latencies_s: list[float] = field(default_factory=list)
    client_cpu_s: float = 0.0
    server_cpu_s: float = math.nan
    timed_out: bool = False

    @property
    def msgs_per_s(self) -> float:
        """Acked messages per wall second."""
        return self.acked / self.elapsed_s if self.elapsed_s > 0 else math.nan

    @property
    def mb_per_s(self) -> float:
        """Acked payload megabytes (10^6 bytes) per wall second."""
        return self.msgs_per_s * self.size_bytes / 1e6

    def latency_ms(self, q: float) -> float:
        """The ``q``-quantile of :attr:`latencies_s`, in milliseconds."""
        return percentile(self.latencies_s, q) * 1e3

    def send_latency_ms(self, q: float) -> float:
        """The ``q``-quantile of :attr:`send_latencies_s`, in milliseconds."""
        return percentile(self.send_latencies_s, q) * 1e3

    @property
    def client_cpu_pct(self) -> float:
        """Client CPU over wall time, in percent of one core."""
        return 100.0 * self.client_cpu_s / self.elapsed_s if self.elapsed_s > 0 else math.nan

    @property
    def server_cpu_pct(self) -> float:
        """Server CPU over wall time, in percent of one core (``nan`` when unknown)."""
        return 100.0 * self.server_cpu_s / self.elapsed_s if self.elapsed_s > 0 else math.nan

    @property
    def complete(self) -> bool:
        """Every message was sent and acked."""
        return self.acked == self.messages and not self.failed and not self.timed_out


class _Recorder:
    """Ack times per message index, filled by done-callbacks; failures counted."""

    def __init__(self, messages: int) -> None:
        self.start_s = [0.0] * messages
        self.ack_s = [0.0] * messages
        self.acked = [False] * messages
        self.failed = 0
        self.first_error: str | None = None

    def watch(self, fut: asyncio.Future[Any], index: int) -> None:
        """Record ``fut``'s completion time (or failure) as message ``index``'s ack."""

        def done(f: asyncio.Future[Any]) -> None:
            if f.cancelled():
                self._fail(index, "cancelled")
            elif (exc := f.exception()) is not None:
                self._fail(index, f"{type(exc).__name__}: {exc}")
            else:
                self.ack_s[index] = time.perf_counter()
                self.acked[index] = True

        fut.add_done_callback(done)

    def watch_many(self, fut: asyncio.Future[Any], index: int, count: int) -> None:
        """Record ``fut``'s completion time (or failure) as the ack of messages ``index`` ..
        ``index + count - 1``."""

        def done(f: asyncio.Future[Any]) -> None:
            if f.cancelled():
                self._fail(index, "cancelled", count)
            elif (exc := f.exception()) is not None:
                self._fail(index, f"{type(exc).__name__}: {exc}", count)
            else:
                self.ack_s[index : index + count] = [time.perf_counter()] * count
                self.acked[index : index + count] = [True] * count

        fut.add_done_callback(done)

    def _fail(self, index: int, text: str, count: int = 1) -> None:
        self.failed += count
        if self.first_error is None:
            self.first_error = f"message {index}: {text}"

    def latencies(self, sent: int, since: Sequence[float]) -> list[float]:
        """Ascending ``ack - since[i]`` over the acked messages among the first ``sent``."""
        return sorted(self.ack_s[i] - since[i] for i in range(sent) if self.acked[i])


class _CpuMeter:
    """CPU seconds of this process and of ``server_pids`` between construction and :meth:`stop`."""

    def __init__(self, server_pids: Sequence[int]) -> None:
        self._pids = list(server_pids)
        self._client0 = time.process_time()
        self._server0 = [proc_cpu_s(p) for p in self._pids]

    def stop(self, result: LoopResult) -> None:
        result.client_cpu_s = time.process_time() - self._client0
        if self._pids:
            result.server_cpu_s = sum(proc_cpu_s(p) - s0 for p, s0 in zip(self._pids, self._server0))


async def _wait_oldest(fut: asyncio.Future[Any], deadline_s: float) -> bool:
    """Wait for ``fut`` until ``deadline_s`` (perf_counter); True if it is done.

    Its failure is the recorder's business, not the loop's, so nothing is raised for it.
    """
    timeout = deadline_s - time.perf_counter()
    if timeout <= 0:
        return fut.done()
    try:
        await asyncio.wait_for(asyncio.shield(fut), timeout)
    except TimeoutError:
        return False
    except asyncio.CancelledError:
        if not fut.cancelled():
            raise
    except Exception:
        pass
    return True


async def _drain(unacked: collections.deque[asyncio.Future[Any]], deadline_s: float) -> bool:
    """Wait for every future in ``unacked`` until ``deadline_s`` (perf_counter); True if all done."""
    pending = [f for f in unacked if not f.done()]
    if not pending:
        return True
    timeout = max(0.0, deadline_s - time.perf_counter())
    _, still = await asyncio.wait(pending, timeout=timeout)
    return not still


def _finish(result: LoopResult, rec: _Recorder, sent: int, started_s: float, acks_done: bool) -> None:
    """Fill ``result`` from the recorder; messages still unacked count as failed."""
    result.sent = sent
    result.acked = sum(rec.acked[:sent])
    result.failed = rec.failed + (sent - result.acked - rec.failed if not acks_done else 0)
    result.first_error = rec.first_error
    if not acks_done and result.first_error is None:
        result.first_error = f"{sent - result.acked - rec.failed} messages still unacked at the time limit"
    last_ack = max((rec.ack_s[i] for i in range(sent) if rec.acked[i]), default=started_s)
    result.elapsed_s = (last_ack if acks_done else time.perf_counter()) - started_s


async def window_loop(
    send: Send,
    payload: bytes,
    *,
    messages: int,
    window: int,
    server_pids: Sequence[int] = (),
    time_limit_s: float = 300.0,
) -> LoopResult:
    """Send ``messages`` copies of ``payload`` with at most ``window`` unacked at any time.

    After each send, acked messages leave the window from the oldest on; when ``window``
    remain unacked, the loop waits for the oldest one's ack before the next send.

    Args:
        send: the target's send (see :data:`Send`).
        payload: the message bytes.
        messages: how many to send.
        window: most unacked messages, at least 1.
        server_pids: processes whose CPU counts as the server's.
        time_limit_s: stop sending (and stop waiting for acks) after this many wall seconds.

    Returns:
        The measurement; latency is from just before each ``send`` call to its ack.
    """
    if window < 1 or messages < 1:
        raise ValueError("window and messages must be at least 1")
    rec = _Recorder(messages)
    unacked: collections.deque[asyncio.Future[Any]] = collections.deque()
    result = LoopResult(messages=messages, size_bytes=len(payload))
    start_s = rec.start_s
    clock = time.perf_counter
    meter = _CpuMeter(server_pids)
    started_s = clock()
    deadline_s = started_s + time_limit_s
    sent = 0
    for i in range(messages):
        start_s[i] = clock()
        fut = await send(payload)
        rec.watch(fut, i)
        unacked.append(fut)
        sent = i + 1
        while unacked and unacked[0].done():
            unacked.popleft()
        while len(unacked) >= window:
            if not await _wait_oldest(unacked[0], deadline_s):
                break
            while unacked and unacked[0].done():
                unacked.popleft()
        if len(unacked) >= window or clock() > deadline_s:
            result.timed_out = sent < messages
            break
    result.send_span_s = clock() - started_s
    acks_done = await _drain(unacked, deadline_s)
    await asyncio.sleep(0)  # let the last done-callbacks run
    meter.stop(result)
    _finish(result, rec, sent, started_s, acks_done)
    result.timed_out = result.timed_out or not acks_done
    result.latencies_s = rec.latencies(sent, start_s)
    return result


async def window_loop_many(
    send_many: SendMany,
    payload: bytes,
    *,
    messages: int,
    window: int,
    chunk: int,
    server_pids: Sequence[int] = (),
    time_limit_s: float = 300.0,
) -> LoopResult:
    """:func:`window_loop` handing the target ``chunk`` messages per call (its bulk send): at
    most ``window`` messages unacked, each call's messages acked together by one future.

    A call takes ``min(chunk, room in the window, messages left)`` messages; when the window
    is full the loop waits for the oldest call's ack. Every message of a call has that call's
    send and ack times, so the latency percentiles stay per message.

    Args:
        send_many: the target's bulk send (see :data:`SendMany`).
        payload: the message bytes.
        messages: how many to send.
        window: most unacked messages, at least 1.
        chunk: messages per call, at least 1.
        server_pids: processes whose CPU counts as the server's.
        time_limit_s: stop sending (and stop waiting for acks) after this many wall seconds.

    Returns:
        The measurement; latency is from just before each call to its ack.
    """
    if window < 1 or messages < 1 or chunk < 1:
        raise ValueError("window, messages and chunk must be at least 1")
    rec = _Recorder(messages)
    unacked: collections.deque[tuple[asyncio.Future[Any], int]] = collections.deque()
    result = LoopResult(messages=messages, size_bytes=len(payload))
    clock = time.perf_counter
    meter = _CpuMeter(server_pids)
    started_s = clock()
    deadline_s = started_s + time_limit_s
    sent = in_flight = 0
    while sent < messages:
        count = min(chunk, window - in_flight, messages - sent)
        rec.start_s[sent : sent + count] = [clock()] * count
        fut = await send_many([payload] * count)
        rec.watch_many(fut, sent, count)
        unacked.append((fut, count))
        sent += count
        in_flight += count
        while unacked and unacked[0][0].done():
            in_flight -= unacked.popleft()[1]
        while in_flight >= window:
            if not await _wait_oldest(unacked[0][0], deadline_s):
                break
            while unacked and unacked[0][0].done():
                in_flight -= unacked.popleft()[1]
        if in_flight >= window or clock() > deadline_s:
            result.timed_out = sent < messages
            break
    result.send_span_s = clock() - started_s
    acks_done = await _drain(collections.deque(f for f, _ in unacked), deadline_s)
    await asyncio.sleep(0)  # let the last done-callbacks run
    meter.stop(result)
    _finish(result, rec, sent, started_s, acks_done)
    result.timed_out = result.timed_out or not acks_done
    result.latencies_s = rec.latencies(sent, rec.start_s)
    return result


async def open_loop(
    send: Send,
    payload: bytes,
    *,
    messages: int,
    rate_per_s: float,
    server_pids: Sequence[int] = (),
    time_limit_s: float = 300.0,
) -> LoopResult:
    """Send ``messages`` copies of ``payload`` on a fixed schedule, ``rate_per_s`` per second.

    Message ``i`` is due at ``start + i / rate_per_s``, whatever happened to earlier acks. The
    loop sleeps until the next message is due, at least :data:`OPEN_LOOP_MIN_SLEEP_S`, then
    sends every message that is due. Timer wake-ups come in whole milliseconds, so at 5,000
    msg/s messages leave in small bursts up to about 1 ms after their scheduled time; that
    lateness counts in the latency, the same for every target and either event loop.

    Args:
        send: the target's send (see :data:`Send`).
        payload: the message bytes.
        messages: how many to send.
        rate_per_s: the schedule, in messages per second.
        server_pids: processes whose CPU counts as the server's.
        time_limit_s: stop sending (and stop waiting for acks) after this many wall seconds.

    Returns:
        The measurement; :attr:`LoopResult.latencies_s` is from the scheduled send time,
        :attr:`LoopResult.send_latencies_s` from the actual ``send`` call.
    """
    if rate_per_s <= 0 or messages < 1:
        raise ValueError("rate_per_s must be positive and messages at least 1")
    rec = _Recorder(messages)
    scheduled_s = [0.0] * messages
    unacked: collections.deque[asyncio.Future[Any]] = collections.deque()
    result = LoopResult(messages=messages, size_bytes=len(payload))
    interval_s = 1.0 / rate_per_s
    clock = time.perf_counter
    meter = _CpuMeter(server_pids)
    started_s = clock()
    deadline_s = started_s + time_limit_s
    sent = 0
    while sent < messages:
        now = clock()
        if now > deadline_s:
            result.timed_out = True
            break
        due = started_s + sent * interval_s
        if due > now:
            await asyncio.sleep(max(due - now, OPEN_LOOP_MIN_SLEEP_S))
            continue
        while sent < messages and started_s + sent * interval_s <= now:
            scheduled_s[sent] = started_s + sent * interval_s
            rec.start_s[sent] = clock()
            fut = await send(payload)
            rec.watch(fut, sent)
            unacked.append(fut)
            sent += 1
        while unacked and unacked[0].done():
            unacked.popleft()
    result.send_span_s = clock() - started_s
    acks_done = await _drain(unacked, deadline_s)
    await asyncio.sleep(0)
    meter.stop(result)
    _finish(result, rec, sent, started_s, acks_done)
    result.timed_out = result.timed_out or not acks_done
    result.latencies_s = rec.latencies(sent, scheduled_s)
    result.send_latencies_s = rec.latencies(sent, rec.start_s)
    return result


@dataclass(frozen=True)
class Case:
    """One measurement.

    Attributes:
        key: names the case's own stream or topic on each target.
        kind: ``"window"`` (:func:`window_loop`) or ``"open"`` (:func:`open_loop`).
        messages: messages measured (after the warm-up).
        size_bytes: payload size, in bytes.
        window: most unacked messages (window cases; 1 = one in flight).
        rate_per_s: the open loop's schedule, in messages per second.
        chunk: window cases with ``window`` > 1: messages per call of the target's bulk send
            (:func:`window_loop_many`); 1 = one ``send`` per message (:func:`window_loop`).
    """

    key: str
    kind: str
    messages: int
    size_bytes: int
    window: int = 1
    rate_per_s: float = 0.0
    chunk: int = 1

    @property
    def label(self) -> str:
        """What the case is, for the output."""
        if self.kind == "open":
            return f"open loop {self.rate_per_s:,.0f} msg/s, {self.messages:,} x {self.size_bytes} B"
        if self.window == 1:
            return f"one in flight, {self.messages:,} x {self.size_bytes} B"
        bulk = f", {self.chunk} per bulk send" if self.chunk > 1 else ""
        return f"{self.size_bytes} B x {self.messages:,}, W={self.window}{bulk}"


@dataclass
class Session:
    """One case's producer on one target.

    Attributes:
        send: queue one message (see :data:`loadgen.Send`).
        send_many: queue several messages in one call (see :data:`loadgen.SendMany`); the
            window cases use it when the run asks for bulk sends (``Case.chunk`` > 1).
        stored: messages the server holds in this case's stream or topic.
        counters: the server's own counters for it, by name (``"fsyncs"`` where the server
            counts its fsyncs), or None where it keeps none.
        settings: the client settings used, for the output.
    """

    send: Send
    stored: Callable[[], Awaitable[int]]
    counters: Callable[[], Awaitable[dict[str, int]]] | None
    settings: str
    send_many: SendMany | None = None


@dataclass
class CaseResult:
    """A case's loop result and what the server's counts grew by over the measured loop."""

    case: Case
    loop: LoopResult
    stored: int
    counters: dict[str, int]
    settings: str

    @property
    def fsyncs(self) -> int | None:
        """fsync calls the server made during the loop, or None where it does not count them."""
        return self.counters.get("fsyncs")


async def measure(session: Session, case: Case, *, server_pids: Sequence[int], time_limit_s: float) -> CaseResult:
    """Warm up, read the server's counters, run ``case``'s loop, read the counters again.

    The warm-up is :data:`WARMUP_MESSAGES` messages (``case.messages`` if fewer) through the
    window loop with the case's window (1 for the open loop), not measured.
    """
    payload = make_payload(case.size_bytes)
    warmup = min(WARMUP_MESSAGES, case.messages)
    await window_loop(session.send, payload, messages=warmup, window=case.window, time_limit_s=time_limit_s)
    stored0, counters0 = await session.stored(), (await session.counters() if session.counters else {})
    if case.kind == "window" and case.chunk > 1 and case.window > 1:
        if session.send_many is None:
            raise ValueError(f"{case.label}: the target has no bulk send")
        loop = await window_loop_many(
            session.send_many, payload, messages=case.messages, window=case.window, chunk=case.chunk,
            server_pids=server_pids, time_limit_s=time_limit_s,
        )  # fmt: skip
    elif case.kind == "window":
        loop = await window_loop(
            session.send, payload, messages=case.messages, window=case.window,
            server_pids=server_pids, time_limit_s=time_limit_s,
        )  # fmt: skip
    else:
        loop = await open_loop(
            session.send, payload, messages=case.messages, rate_per_s=case.rate_per_s,
            server_pids=server_pids, time_limit_s=time_limit_s,
        )  # fmt: skip
    stored1, counters1 = await session.stored(), (await session.counters() if session.counters else {})
    grown = {name: counters1[name] - value for name, value in counters0.items() if name in counters1}
    return CaseResult(case, loop, stored1 - stored0, grown, session.settings)
