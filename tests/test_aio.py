"""``danube_pipeline/aio.py``: a wait with a deadline that never swallows a cancellation, and
no ``asyncio.wait_for`` in the product code (Python 3.11's can lose a cancellation, CPython
gh-86296, which once hung a broker's shutdown); the lock a callback can hold."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from danube_pipeline.aio import HandoffLock, wait_set

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent


async def _wait_loop(event: asyncio.Event) -> None:
    """A background loop of the broker's shape: wake on ``event`` or every second, until cancelled."""
    while True:
        await wait_set(event, 1.0)
        event.clear()


@pytest.mark.asyncio
@pytest.mark.parametrize("turns", range(6))
async def test_a_cancel_in_the_turn_the_event_is_set_stops_the_loop(turns: int) -> None:
    # Each count of loop turns between set() and cancel() puts the cancellation at another step
    # of the wake-up; with asyncio.wait_for the early ones returned the event's result instead of
    # raising CancelledError, and the loop ran on (three of the six cases then fail here).
    event = asyncio.Event()
    task = asyncio.create_task(_wait_loop(event))
    await asyncio.sleep(0)
    event.set()
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.wait({task}, timeout=2)  # neither cancels the task nor raises
    stopped = task.done()
    task.cancel()  # a loop that ran on: stop it for good before failing
    assert stopped and task.cancelled()


@pytest.mark.asyncio
async def test_wait_set_returns_whether_the_event_is_set() -> None:
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await wait_set(event, 0.05) is False
    assert loop.time() - started >= 0.04
    loop.call_later(0.01, event.set)
    assert await wait_set(event, 5.0) is True
    assert await wait_set(event, 0) is True  # already set: no wait, even with no time left
    assert await wait_set(event, None) is True


@pytest.mark.asyncio
async def test_a_timeout_around_wait_set_is_the_outer_ones() -> None:
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await wait_set(asyncio.Event(), 5.0)


@pytest.mark.asyncio
async def test_the_handoff_lock_is_first_come_first_served_and_a_callback_can_hold_it() -> None:
    lock = HandoffLock()
    assert lock.try_acquire() and lock.locked()  # from plain code, no await
    assert not lock.try_acquire()
    order: list[str] = []

    async def waiter(name: str) -> None:
        async with lock:
            order.append(name)
            await asyncio.sleep(0)

    first = asyncio.create_task(waiter("first"))
    second = asyncio.create_task(waiter("second"))
    await asyncio.sleep(0)
    lock.release()  # handed to the first waiter: still locked, a callback cannot overtake it
    assert lock.locked() and not lock.try_acquire()
    await asyncio.gather(first, second)
    assert order == ["first", "second"]
    assert not lock.locked()
    with pytest.raises(RuntimeError):
        lock.release()


@pytest.mark.asyncio
@pytest.mark.parametrize("handed_over", [False, True])
async def test_a_cancelled_waiter_of_the_handoff_lock_passes_it_on(handed_over: bool) -> None:
    lock = HandoffLock()
    assert lock.try_acquire()
    cancelled = asyncio.create_task(lock.acquire())
    behind = asyncio.create_task(lock.acquire())
    await asyncio.sleep(0)
    if handed_over:  # the lock reaches the waiter, which is cancelled before it runs
        lock.release()
        cancelled.cancel()
    else:  # cancelled while waiting, then the lock is released
        cancelled.cancel()
        await asyncio.sleep(0)
        lock.release()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert await asyncio.wait_for(behind, 1) is True  # the next waiter holds it, nothing is stuck
    lock.release()
    assert not lock.locked()


def test_no_product_module_calls_asyncio_wait_for() -> None:
    calls = []
    for package in ("danube_pipeline", "broker", "assets"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Attribute) and node.attr == "wait_for" and \
                        isinstance(node.value, ast.Name) and node.value.id == "asyncio":
                    calls.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert calls == [], "use danube_pipeline.aio.wait_set or asyncio.timeout (aio.py says why)"
