"""Issue 21 #5: a :class:`LocalCache` whose watch broke tells its listeners about every change
it missed, also a key deleted and created again with the same value (ABA), and keeps the new
create revision (an assignment key's create revision is the owner epoch,
``docs/etcd-layout.md`` §1.4).

Everything is real: the session etcd, and a TCP proxy between the cache's store and etcd that
the test cuts (every connection reset, new ones refused) and restores. The cut is the watch
break an etcd restart causes, but keeps the cache away from etcd for as long as the test needs
to write behind its back, which a restart cannot guarantee (the cache reconnects within about
a second of etcd answering).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from helpers import eventually

from danube_pipeline.dev.localcluster import free_port
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore, WatchEvent, WatchEventType

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


class CuttableProxy:
    """A TCP forwarder from ``127.0.0.1:port`` to ``target``; :meth:`cut` resets every
    connection and refuses new ones until :meth:`restore`."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def restore(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.get_running_loop().create_task(self._pipe(source, sink))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while chunk := await source.read(65536):
                sink.write(chunk)
                await sink.drain()
        sink.transport.abort()


@pytest_asyncio.fixture
async def proxy(etcd_endpoints: list[str]) -> AsyncIterator[CuttableProxy]:
    p = CuttableProxy(etcd_endpoints[0])
    await p.restore()
    try:
        yield p
    finally:
        await p.cut()


async def test_reload_reports_a_key_recreated_with_the_same_value(
    etcd_endpoints: list[str], proxy: CuttableProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="danube_pipeline.metadata.cache")
    async with await MetadataStore.connect(etcd_endpoints) as direct, await MetadataStore.connect(
        [proxy.endpoint]
    ) as through_proxy:
        await direct.put("/aba/recreated", {"owner": 1})
        await direct.put("/aba/rewritten", {"same": True})
        await direct.put("/aba/untouched", 7)
        before = await direct.get("/aba/recreated")
        assert before is not None
        cache = LocalCache(through_proxy, prefixes=["/aba/"])
        await cache.start()
        seen: list[WatchEvent] = []
        cache.add_listener("/aba/", seen.append)
        try:
            assert cache.create_revision("/aba/recreated") == before.create_revision
            await proxy.cut()
            await eventually(lambda: "LocalCache watch broke" in caplog.text, what="the watch broke")
            # Behind the cache's back: the key goes and comes back with the same value (an
            # assignment deleted and made again: a new owner epoch), another is rewritten as is.
            await direct.delete("/aba/recreated")
            await direct.put("/aba/recreated", {"owner": 1})
            last = await direct.put("/aba/rewritten", {"same": True})
            after = await direct.get("/aba/recreated")
            assert after is not None and after.create_revision > before.create_revision
            await proxy.restore()
            await cache.wait_for_revision(last, timeout_s=20)

            assert cache.get_prefix("/aba/") == {
                "/aba/recreated": {"owner": 1}, "/aba/rewritten": {"same": True}, "/aba/untouched": 7
            }
            assert [(e.type, e.key) for e in seen] == [
                (WatchEventType.DELETE, "/aba/recreated"),
                (WatchEventType.PUT, "/aba/recreated"),
                (WatchEventType.PUT, "/aba/rewritten"),
            ]
            assert seen[1].value == {"owner": 1}
            assert cache.create_revision("/aba/recreated") == after.create_revision
            assert cache.create_revision("/aba/missing") is None
        finally:
            await cache.stop()


async def test_live_watch_keeps_create_revisions(etcd_endpoints: list[str]) -> None:
    async with await MetadataStore.connect(etcd_endpoints) as store:
        cache = LocalCache(store, prefixes=["/aba/"])
        await cache.start()
        try:
            await store.put("/aba/k", 1)
            first = await store.get("/aba/k")
            assert first is not None
            await cache.wait_for_revision(first.mod_revision)
            assert cache.create_revision("/aba/k") == first.create_revision
            revision = await store.put("/aba/k", 2)
            await cache.wait_for_revision(revision)
            assert cache.create_revision("/aba/k") == first.create_revision
            await store.delete("/aba/k")
            revision = await store.put("/aba/k", 2)
            await cache.wait_for_revision(revision)
            assert cache.create_revision("/aba/k") == revision
        finally:
            await cache.stop()
