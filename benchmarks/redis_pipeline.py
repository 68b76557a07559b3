"""Redis Streams ``XADD`` pipelined over one redis-py asyncio connection: the Redis client of
``benchmarks/peers.py``, with a bulk send beside the per-message one.
"""

from __future__ import annotations

import asyncio
import collections
import math
from typing import Any

import redis.asyncio
import redis.exceptions

__all__ = ["RedisPipeline"]


class RedisPipeline:
    """XADD over one redis-py asyncio connection, pipelined, one future per command (per bulk).

    ``send`` packs the command with redis-py and queues it; a writer task writes whatever is
    queued in one ``send_packed_command`` per event-loop tick; a reader task reads the replies
    in order (``read_response``) and resolves the oldest waiting future with each. ``send_many``
    queues K commands whose K replies resolve one future (its K places in the reply order hold
    the same future; the last reply sets it, an error reply fails it). The window loop decides
    how many are unacked; this class adds no limit of its own.
    """

    settings = "one connection; XADD pipelined: written per event-loop tick, replies read in order"

    def __init__(self, conn: redis.asyncio.Connection, key: str) -> None:
        self._conn = conn
        self._key = key
        self._loop = asyncio.get_running_loop()
        self._out: list[bytes] = []
        self._waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._wake = asyncio.Event()
        self._failed: BaseException | None = None
        self._tasks = [self._loop.create_task(self._write_loop()), self._loop.create_task(self._read_loop())]

    async def send(self, payload: bytes) -> asyncio.Future[Any]:
        """Queue ``XADD key * d payload``; the future resolves with the entry id (bytes)."""
        fut: asyncio.Future[Any] = self._loop.create_future()
        if self._failed is not None:
            fut.set_exception(self._failed)
            return fut
        self._out.extend(self._conn.pack_command("XADD", self._key, "*", "d", payload))
        self._waiting.append(fut)
        self._wake.set()
        return fut

    async def send_many(self, payloads: list[bytes]) -> asyncio.Future[Any]:
        """Queue ``XADD key * d payload`` per payload; the future resolves with the last entry id."""
        fut: asyncio.Future[Any] = self._loop.create_future()
        if self._failed is not None:
            fut.set_exception(self._failed)
            return fut
        self._out.extend(self._conn.pack_commands([("XADD", self._key, "*", "d", p) for p in payloads]))
        self._waiting.extend([fut] * len(payloads))
        self._wake.set()
        return fut

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                chunks, self._out = self._out, []
                if chunks:
                    await self._conn.send_packed_command(chunks, check_health=False)
        except Exception as exc:
            self._fail_all(exc)

    async def _read_loop(self) -> None:
        try:
            while True:
                try:
                    # timeout=math.inf: redis-py would otherwise arm its 5 s socket timeout
                    # around every single reply, which costs more than parsing it.
                    reply: Any = await self._conn.read_response(disable_decoding=True, timeout=math.inf)
                except redis.exceptions.ResponseError as exc:
                    if not (fut := self._waiting.popleft()).done():
                        fut.set_exception(exc)
                    continue
                fut = self._waiting.popleft()
                if not fut.done() and not (self._waiting and self._waiting[0] is fut):
                    fut.set_result(reply)
        except Exception as exc:
            self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        self._failed = exc
        while self._waiting:
            if not (fut := self._waiting.popleft()).done():
                fut.set_exception(exc)

    async def aclose(self) -> None:
        """Stop the writer and reader tasks and disconnect."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._conn.disconnect()
