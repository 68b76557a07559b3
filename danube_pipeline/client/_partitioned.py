"""Partitioned topics (``docs/etcd-layout.md`` §3.1) in the client: the inner producers or
consumers, one per partition ``{topic}-part-{i}``, opened together, and the futures that say
which partition a message went to.

How a message picks its partition is :mod:`danube_pipeline.client._partitioner`'s job; how a
partitioned consumer takes its partitions' messages in turn,
:meth:`danube_pipeline.client._receiver.Inbox.take_in_turn`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from danube_pipeline.client.types import MessageId


class _Endpoint(Protocol):
    """An inner producer or consumer: opened and closed like the facade it stands for."""

    async def open(self) -> object: ...

    async def close(self) -> None: ...


async def open_all(inners: Sequence[_Endpoint]) -> None:
    """Open one inner producer or consumer per partition, all at once.

    Args:
        inners: the unopened inner producers or consumers, by partition index.

    Raises:
        BaseException: the first failure of an ``open``, once every inner one was closed
            again (``close`` is safe on those that did not open).
    """
    results = await asyncio.gather(*(inner.open() for inner in inners), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        await asyncio.gather(*(inner.close() for inner in inners), return_exceptions=True)
        raise failed[0]


def in_partition(inner: asyncio.Future[int], partition: int) -> asyncio.Future[int]:
    """A future following ``inner``, whose result (a :class:`MessageId`) carries ``partition``."""
    outer: asyncio.Future[int] = inner.get_loop().create_future()

    def copy(done: asyncio.Future[int]) -> None:
        if outer.done():
            return
        if done.cancelled():
            outer.cancel()
            return
        error = done.exception()
        if error is not None:
            outer.set_exception(error)
        else:
            outer.set_result(MessageId.in_partition(done.result(), partition))

    inner.add_done_callback(copy)
    return outer
