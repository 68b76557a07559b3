"""MetadataStore and LocalCache against a real etcd (``docs/etcd-layout.md``, "Reads and writes")."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from helpers import eventually, stays

from danube_pipeline.errors import MetadataStoreError
from danube_pipeline.dev.localcluster import EtcdServer, etcdctl_binary, free_port
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MAX_TXN_OPS, MetadataStore, WatchEvent, WatchEventType
from danube_pipeline.metadata.values import BrokerState

pytestmark = pytest.mark.integration


async def _exists(store: MetadataStore, key: str) -> bool:
    return await store.get(key) is not None


@pytest_asyncio.fixture
async def store(etcd_endpoints: list[str]) -> AsyncIterator[MetadataStore]:
    async with await MetadataStore.connect(etcd_endpoints) as s:
        yield s


@pytest_asyncio.fixture
async def cache(store: MetadataStore) -> AsyncIterator[LocalCache]:
    c = LocalCache(store)
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


def etcdctl_get_raw(etcd: EtcdServer, key: str) -> bytes:
    out = subprocess.run(
        [etcdctl_binary(), f"--endpoints={etcd.client_url}", "get", key, "--print-value-only"],
        check=True,
        capture_output=True,
        env={"ETCDCTL_API": "3"},
    ).stdout
    return out.rstrip(b"\n")


# ---- connect


@pytest.mark.asyncio
async def test_connect_raises_metadata_store_error_when_no_endpoint_answers() -> None:
    with pytest.raises(MetadataStoreError) as info:
        await MetadataStore.connect([f"127.0.0.1:{free_port()}"], connect_timeout_s=2.0)
    assert info.value.retriable


@pytest.mark.asyncio
async def test_connect_skips_dead_endpoints(etcd_endpoints: list[str]) -> None:
    dead = f"127.0.0.1:{free_port()}"
    async with await MetadataStore.connect([dead, *etcd_endpoints], connect_timeout_s=2.0) as s:
        assert s.endpoint == etcd_endpoints[0]
        await s.put("/x", 1)


@pytest.mark.asyncio
async def test_closed_store_raises(etcd_endpoints: list[str]) -> None:
    s = await MetadataStore.connect(etcd_endpoints)
    await s.close()
    assert s.closed
    with pytest.raises(MetadataStoreError):
        await s.get("/x")


# ---- reads and writes


@pytest.mark.asyncio
async def test_put_get_revisions_and_versions(store: MetadataStore) -> None:
    r1 = await store.put("/t/a", {"x": 1})
    r2 = await store.put("/t/a", {"x": 2})
    assert r2 > r1
    kv = await store.get("/t/a")
    assert kv is not None
    assert kv.value == {"x": 2}
    assert (kv.create_revision, kv.mod_revision, kv.version) == (r1, r2, 2)
    assert await store.get("/t/missing") is None


@pytest.mark.asyncio
async def test_values_are_compact_json_and_records_are_encoded(
    store: MetadataStore, etcd: EtcdServer
) -> None:
    key = keys.broker_state(7)
    await store.put(key, BrokerState(mode="active", reason="boot"))
    assert etcdctl_get_raw(etcd, key) == b'{"mode":"active","reason":"boot"}'
    kv = await store.get(key)
    assert kv is not None and kv.value == {"mode": "active", "reason": "boot"}
    await store.put("/cluster/MY_CLUSTER", None)
    assert etcdctl_get_raw(etcd, "/cluster/MY_CLUSTER") == b"null"
    marker = await store.get("/cluster/MY_CLUSTER")
    assert marker is not None and marker.value is None


@pytest.mark.asyncio
async def test_get_prefix_is_sorted_scoped_and_reports_revision(store: MetadataStore) -> None:
    await store.put("/p/b", 2)
    await store.put("/p/a", 1)
    await store.put("/p/c/d", 3)
    last = await store.put("/q/a", 9)  # same leading characters, other prefix
    await store.put("/pp", 0)
    kvs, revision = await store.get_prefix("/p/")
    assert [kv.key for kv in kvs] == ["/p/a", "/p/b", "/p/c/d"]
    assert [kv.value for kv in kvs] == [1, 2, 3]
    assert revision >= last + 1
    empty, rev2 = await store.get_prefix("/nothing/")
    assert empty == [] and rev2 == revision


@pytest.mark.asyncio
async def test_get_many_reads_each_key_in_the_order_given(store: MetadataStore) -> None:
    first = await store.put("/many/a", 1)
    await store.put("/many/b", {"x": 2})
    got = await store.get_many(["/many/b", "/many/missing", "/many/a"])
    assert [kv.key if kv is not None else None for kv in got] == ["/many/b", None, "/many/a"]
    assert [kv.value for kv in got if kv is not None] == [{"x": 2}, 1]
    assert got[2] is not None and got[2].mod_revision == first
    assert await store.get_many([]) == []
    assert len(await store.get_many([f"/many/{i}" for i in range(MAX_TXN_OPS)])) == MAX_TXN_OPS
    with pytest.raises(ValueError, match="at most 128 keys"):
        await store.get_many([f"/many/{i}" for i in range(MAX_TXN_OPS + 1)])


@pytest.mark.asyncio
async def test_put_many_is_one_transaction(store: MetadataStore) -> None:
    revision = await store.put_many(
        [("/m/a", 1), ("/m/b", BrokerState("active", "boot")), ("/m/c", None)]
    )
    kvs, _ = await store.get_prefix("/m/")
    assert [kv.key for kv in kvs] == ["/m/a", "/m/b", "/m/c"]
    assert {kv.mod_revision for kv in kvs} == {revision}


@pytest.mark.asyncio
async def test_put_many_rejected_writes_nothing(store: MetadataStore) -> None:
    # etcd rejects a transaction that puts the same key twice: nothing may be written.
    with pytest.raises(MetadataStoreError):
        await store.put_many([("/m/x", 1), ("/m/y", 2), ("/m/x", 3)])
    assert (await store.get_prefix("/m/"))[0] == []


@pytest.mark.asyncio
async def test_put_if_absent(store: MetadataStore) -> None:
    assert await store.put_if_absent("/k", "first") is True
    assert await store.put_if_absent("/k", "second") is False
    kv = await store.get("/k")
    assert kv is not None and kv.value == "first"


@pytest.mark.asyncio
async def test_compare_and_put(store: MetadataStore) -> None:
    assert await store.compare_and_put("/c", 1, expected_mod_revision=0) is True
    assert await store.compare_and_put("/c", 2, expected_mod_revision=0) is False  # exists now
    kv = await store.get("/c")
    assert kv is not None
    assert await store.compare_and_put("/c", 3, expected_mod_revision=kv.mod_revision) is True
    assert await store.compare_and_put("/c", 4, expected_mod_revision=kv.mod_revision) is False
    now = await store.get("/c")
    assert now is not None and now.value == 3


@pytest.mark.asyncio
async def test_compare_and_put_many_all_or_nothing(store: MetadataStore) -> None:
    r = await store.put("/g/guard", 1)
    assert await store.compare_and_put_many(
        [("/g/a", 1), ("/g/b", 2)], expected_mod_revisions={"/g/guard": r - 1}
    ) is None
    assert (await store.get_prefix("/g/"))[0][0].key == "/g/guard"
    assert len((await store.get_prefix("/g/"))[0]) == 1
    written = await store.compare_and_put_many(
        [("/g/a", 1), ("/g/b", 2)], expected_mod_revisions={"/g/guard": r, "/g/new": 0}
    )
    assert written is not None and written > r
    assert len((await store.get_prefix("/g/"))[0]) == 3


@pytest.mark.asyncio
async def test_delete_and_delete_prefix(store: MetadataStore) -> None:
    await store.put_many([("/d/a", 1), ("/d/b", 2), ("/d/c/e", 3), ("/dd", 4)])
    assert await store.delete("/d/a") is True
    assert await store.delete("/d/a") is False
    assert await store.delete_prefix("/d/") == 2
    assert (await store.get_prefix("/d/"))[0] == []
    assert await store.get("/dd") is not None


@pytest.mark.asyncio
async def test_next_id_allocates_distinct_ids_under_concurrency(store: MetadataStore) -> None:
    ids = await asyncio.gather(*(store.next_id(keys.SCHEMA_NEXT_ID) for _ in range(20)))
    assert sorted(ids) == list(range(1, 21))
    counter = await store.get(keys.SCHEMA_NEXT_ID)
    assert counter is not None and counter.value == 21  # holds the NEXT free id (§4.1)


@pytest.mark.asyncio
async def test_next_id_initial_value(store: MetadataStore) -> None:
    assert await store.next_id("/ids", initial=100) == 100
    assert await store.next_id("/ids", initial=100) == 101


# ---- leases


@pytest.mark.asyncio
async def test_revoking_a_lease_deletes_its_keys(store: MetadataStore) -> None:
    lease = await store.grant_lease(30)
    await store.put(keys.broker_register(1), {"broker_addr": "x"}, lease=lease)
    await store.put("/plain", 1)
    assert await store.get(keys.broker_register(1)) is not None
    await lease.revoke()
    assert await store.get(keys.broker_register(1)) is None
    assert await store.get("/plain") is not None
    assert lease.expired


@pytest.mark.asyncio
async def test_lease_without_keepalive_expires(store: MetadataStore) -> None:
    lease = await store.grant_lease(2, keepalive=False)
    assert await store.put_if_absent("/ephemeral", 1, lease=lease)
    # etcd expires a lease at its TTL, give or take its checkpoint interval: poll, with room
    # for a loaded machine, rather than sleep a fixed time
    loop = asyncio.get_running_loop()
    deadline = loop.time() + lease.ttl_s + 15
    while await store.get("/ephemeral") is not None:
        assert loop.time() < deadline, "the lease's key outlived its TTL by 15 s"
        await asyncio.sleep(0.2)


@pytest.mark.asyncio
async def test_lease_keepalive_keeps_key(store: MetadataStore) -> None:
    async with await store.grant_lease(3) as lease:
        await store.put("/kept", 1, lease=lease)
        # the key outlives the TTL twice over, refreshed by the keep-alive
        await stays(lambda: _exists(store, "/kept"), for_s=lease.ttl_s * 2 + 1, interval_s=0.5, what="key kept")
    assert await store.get("/kept") is None


# ---- watch


@pytest.mark.asyncio
async def test_watch_prefix_replays_from_start_revision_in_order(store: MetadataStore) -> None:
    r1 = await store.put("/w/a", 1)
    await store.put("/other", 0)
    await store.put("/w/b", 2)
    await store.delete("/w/a")
    events: list[WatchEvent] = []
    gen = store.watch_prefix("/w/", start_revision=r1)
    async with contextlib.aclosing(gen):
        async for event in gen:
            events.append(event)
            if len(events) == 3:
                break
    assert [(e.type, e.key, e.value) for e in events] == [
        (WatchEventType.PUT, "/w/a", 1),
        (WatchEventType.PUT, "/w/b", 2),
        (WatchEventType.DELETE, "/w/a", None),
    ]
    assert [e.mod_revision for e in events] == sorted(e.mod_revision for e in events)
    assert events[0].mod_revision == r1
    # the store is still usable after the consumer broke out
    assert await store.put("/w/c", 3) > r1


@pytest.mark.asyncio
async def test_watch_prefix_sees_live_writes(store: MetadataStore) -> None:
    _, revision = await store.get_prefix("/live/")
    seen: list[WatchEvent] = []
    first_seen = asyncio.Event()

    async def consume() -> None:
        gen = store.watch_prefix("/live/", start_revision=revision + 1)
        async with contextlib.aclosing(gen):
            async for event in gen:
                seen.append(event)
                first_seen.set()
                if len(seen) == 2:
                    return

    task = asyncio.create_task(consume())
    r1 = await store.put("/live/x", "v")
    await asyncio.wait_for(first_seen.wait(), 5)
    # the watch is now open and has caught up: this write can only arrive live
    r2 = await store.put("/live/y", "w")
    await asyncio.wait_for(task, 5)
    assert seen == [
        WatchEvent(WatchEventType.PUT, "/live/x", "v", r1),
        WatchEvent(WatchEventType.PUT, "/live/y", "w", r2),
    ]


# ---- LocalCache


@pytest.mark.asyncio
async def test_wait_for_revision_wakes_each_call_at_its_own_revision(store: MetadataStore, cache: LocalCache) -> None:
    now = (await store.get_prefix("/w/"))[1]
    await cache.wait_for_revision(now)
    near = [asyncio.create_task(cache.wait_for_revision(now + 1)) for _ in range(50)]
    far = asyncio.create_task(cache.wait_for_revision(now + 2))
    with pytest.raises(MetadataStoreError, match=f"revision {now + 100} not seen within 0.2s"):
        await cache.wait_for_revision(now + 100, timeout_s=0.2)
    assert not any(task.done() for task in [*near, far])
    assert await store.put("/w/a", 1) == now + 1
    await asyncio.wait_for(asyncio.gather(*near), 5)
    await stays(lambda: not far.done(), for_s=0.3, what="a call waiting for a later revision")
    await store.put("/w/b", 2)
    await asyncio.wait_for(far, 5)
    await cache.wait_for_revision(now + 2)  # reached: returns at once


@pytest.mark.asyncio
async def test_cache_sees_keys_before_and_after_start(store: MetadataStore) -> None:
    await store.put("/a/before", 1)
    cache = LocalCache(store)
    await cache.start()
    try:
        assert cache.get("/a/before") == 1
        r = await store.put("/a/after", {"y": 2})
        await cache.wait_for_revision(r)
        assert cache.revision >= r
        assert cache.get("/a/after") == {"y": 2}
        r = await store.put("/a/null", None)
        await cache.wait_for_revision(r)
        assert cache.contains("/a/null") and cache.get("/a/null") is None
        assert not cache.contains("/a/missing")
        assert await store.delete("/a/before")
        await cache.wait_for_revision((await store.get_prefix("/"))[1])
        assert not cache.contains("/a/before")
        assert cache.get_prefix("/a/") == {"/a/after": {"y": 2}, "/a/null": None}
        assert list(cache.get_prefix("/")) == sorted(cache.get_prefix("/"))
    finally:
        await cache.stop()


@pytest.mark.asyncio
async def test_cache_with_several_prefixes_loads_only_them(store: MetadataStore) -> None:
    await store.put_many([("/x/1", 1), ("/y/1", 2), ("/z/1", 3)])
    cache = LocalCache(store, prefixes=["/y/", "/x/"])
    await cache.start()
    try:
        assert cache.get_prefix("/x/") == {"/x/1": 1}
        assert cache.get_prefix("/y/") == {"/y/1": 2}
        with pytest.raises(ValueError):
            cache.get("/z/1")
        # a write outside the prefixes still advances the cache revision
        r = await store.put("/z/2", 4)
        await cache.wait_for_revision(r, timeout_s=5)
        r = await store.put("/x/2", 5)
        await cache.wait_for_revision(r)
        assert cache.get("/x/2") == 5
    finally:
        await cache.stop()


@pytest.mark.asyncio
async def test_wait_for_revision_times_out(cache: LocalCache) -> None:
    with pytest.raises(MetadataStoreError):
        await cache.wait_for_revision(cache.revision + 1000, timeout_s=0.3)


@pytest.mark.asyncio
async def test_cache_reads_before_start_fail(store: MetadataStore) -> None:
    with pytest.raises(MetadataStoreError):
        LocalCache(store).get("/a")


@pytest.mark.asyncio
async def test_listeners_get_events_under_their_prefix(
    store: MetadataStore, cache: LocalCache
) -> None:
    cluster: list[WatchEvent] = []
    everything: list[WatchEvent] = []
    unsubscribe = cache.add_listener("/cluster/", cluster.append)
    cache.add_listener("/", everything.append)
    r1 = await store.put(keys.broker_state(1), BrokerState("active", "boot"))
    r2 = await store.put("/topics/default/t", 0)
    r3 = await store.delete(keys.broker_state(1))
    assert r3
    _, head = await store.get_prefix("/")
    await cache.wait_for_revision(head)
    assert cluster == [
        WatchEvent(
            WatchEventType.PUT, keys.broker_state(1), {"mode": "active", "reason": "boot"}, r1
        ),
        WatchEvent(WatchEventType.DELETE, keys.broker_state(1), None, head),
    ]
    assert [e.mod_revision for e in everything] == [r1, r2, head]
    unsubscribe()
    r = await store.put("/cluster/leader", 1)
    await cache.wait_for_revision(r)
    assert len(cluster) == 2
    assert everything[-1].key == "/cluster/leader"


@pytest.mark.asyncio
async def test_listener_sees_new_state_and_failing_listener_is_isolated(
    store: MetadataStore, cache: LocalCache
) -> None:
    seen: list[object] = []

    def boom(_: WatchEvent) -> None:
        raise RuntimeError("listener bug")

    cache.add_listener("/s/", boom)
    cache.add_listener("/s/", lambda e: seen.append(cache.get(e.key)))
    r = await store.put("/s/k", "v")
    await cache.wait_for_revision(r)
    assert seen == ["v"]  # the cache was updated before the listener ran


@pytest.mark.asyncio
async def test_cache_misses_nothing_written_while_it_starts(store: MetadataStore) -> None:
    # Each writer writes before, during and after cache.start(): it keeps going until it has
    # written 20 keys after start() returned.
    started = asyncio.Event()
    written = [0] * 8

    async def writer(n: int) -> None:
        after_start = 0
        i = 0
        while after_start < 20:
            await store.put(f"/race/{n:02d}/{i:03d}", {"n": n, "i": i})
            if i % 7 == 0:  # deletes must reach the cache too
                await store.delete(f"/race/{n:02d}/{i:03d}")
            i += 1
            written[n] = i
            after_start += started.is_set()

    writers = [asyncio.create_task(writer(n)) for n in range(8)]
    # every writer is under way before the load
    await eventually(lambda: min(written) >= 5, interval_s=0.005, what="every writer under way")
    cache = LocalCache(store)
    await cache.start()
    started.set()
    try:
        await asyncio.gather(*writers)
        expected, revision = await store.get_prefix("/")
        await cache.wait_for_revision(revision)
        assert cache.get_prefix("/") == {kv.key: kv.value for kv in expected}
        assert len(expected) == sum(i - (i + 6) // 7 for i in written)
    finally:
        await cache.stop()


@pytest.mark.asyncio
async def test_cache_recovers_after_etcd_restart(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    try:
        async with await MetadataStore.connect(server.endpoints) as store:
            await store.put("/r/before", 1)
            await store.put("/r/doomed", 1)
            cache = LocalCache(store, prefixes=["/r/"])
            await cache.start()
            seen: list[WatchEvent] = []
            cache.add_listener("/r/", seen.append)
            try:
                server.stop()
                server.start()
                async with await MetadataStore.connect(server.endpoints) as other:
                    await other.delete("/r/doomed")
                    r = await other.put("/r/after", 2)
                await cache.wait_for_revision(r, timeout_s=60)
                assert cache.get_prefix("/r/") == {"/r/after": 2, "/r/before": 1}
                assert {(e.type, e.key) for e in seen} == {
                    (WatchEventType.DELETE, "/r/doomed"),
                    (WatchEventType.PUT, "/r/after"),
                }
            finally:
                await cache.stop()
    finally:
        server.stop()
