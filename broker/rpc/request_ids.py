"""Creations remembered by the client's request id, so that a retry does not create twice.

A client that gets no answer (its deadline passed, the connection broke) cannot tell whether
``CreateTopic``, ``CreateProducer`` or ``Subscribe`` took effect, and retries. Each request
carries a ``request_id`` the client keeps across its retries. :class:`RecentRequests` runs the
first attempt to its end even if its caller goes away, and answers a retry with the same
result: the same producer, the same consumer, ``created = true``. A failed attempt is not
remembered: the retry runs again.

A result is keyed by the request's kind, its *scope* and the request id. The scope is what the
request says about who asks and for what: the topic and the producer name for
``CreateProducer``, the topic, subscription and consumer name for ``Subscribe``, the topic for
``CreateTopic``. Two clients that happen to send the same request id (a badly seeded
generator, a copied request) for different topics or names thus never get each other's result.
"""

from __future__ import annotations

import asyncio
import collections
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from danube_pipeline.errors import MalformedRequestError

T = TypeVar("T")

_REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class RecentRequests:
    """Results of recent creations, by ``(kind, scope, request_id)``.

    Args:
        ttl_s: how long a result is remembered, in seconds.
        max_entries: most results remembered; the oldest are forgotten first.
    """

    def __init__(self, *, ttl_s: float = 300.0, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[
            tuple[str, tuple[str, ...], str], tuple[float, asyncio.Task[Any]]
        ] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._entries)

    def _forget_old(self) -> None:
        horizon = time.monotonic() - self.ttl_s
        while self._entries:
            key, (at, _task) = next(iter(self._entries.items()))
            if at >= horizon and len(self._entries) <= self.max_entries:
                break
            del self._entries[key]

    async def run(
        self,
        kind: str,
        request_id: str,
        create: Callable[[], Awaitable[T]],
        *,
        scope: tuple[str, ...],
        still_valid: Callable[[T], bool] = lambda _result: True,
    ) -> T:
        """``await create()`` once per ``(kind, scope, request_id)``.

        Args:
            kind: the request's kind (``"producer"``, ``"consumer"``, ``"topic"``).
            request_id: the client's id for the creation, the same on each of its retries;
                ``""`` for none.
            create: runs the creation.
            scope: what the request names: its topic, and the producer, subscription or
                consumer name it creates (module docstring).
            still_valid: whether a remembered result may still be answered.

        Without a request id, ``create`` just runs. With one, a request seen before gets the
        earlier attempt's result (awaiting it if it is still running) while that result is
        ``still_valid``; an earlier attempt that failed is run again.

        Raises:
            MalformedRequestError: ``request_id`` is not 1-128 characters of ``[A-Za-z0-9_-]``.
            Exception: whatever ``create`` raised.
        """
        if not request_id:
            return await create()
        if _REQUEST_ID.fullmatch(request_id) is None:
            raise MalformedRequestError("request_id must be 1-128 characters of [A-Za-z0-9_-]")
        self._forget_old()
        key = (kind, scope, request_id)
        entry = self._entries.get(key)
        if entry is not None:
            task = entry[1]
            if not task.done():
                result: T = await asyncio.shield(task)
                return result
            if not task.cancelled() and task.exception() is None and still_valid(task.result()):
                done: T = task.result()
                return done
        new: asyncio.Task[T] = asyncio.ensure_future(create())
        # The outcome is retrieved even when every caller went away before it ended.
        new.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._entries[key] = (time.monotonic(), new)
        self._entries.move_to_end(key)
        return await asyncio.shield(new)


__all__ = ["RecentRequests"]
