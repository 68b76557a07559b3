"""The :class:`LocalCache`'s indexes (issue 27, scale): ``get_prefix`` bisects a sorted key list
and an event looks up its listeners by the prefixes of its key, instead of scanning every key
and every listener. Both must answer exactly what the scans answered: every key under the
prefix, sorted, after puts, overwrites and deletes; every listener whose prefix starts the key,
in registration order, and none after it unsubscribed.

Real etcd (the session's); the expectations are computed by brute force from what was written.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from helpers import eventually

from danube_pipeline.metadata import cache as cache_module
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore, WatchEvent

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

ROOT = "/cache-index"


async def test_get_prefix_matches_a_scan_after_puts_overwrites_and_deletes(etcd_endpoints: list[str]) -> None:
    rng = random.Random(27)
    async with await MetadataStore.connect(etcd_endpoints) as store:
        await store.put(f"{ROOT}/seed/x", 0)  # loaded by start(), not by the watch
        async with LocalCache(store, prefixes=(f"{ROOT}/",)) as cache:
            written: dict[str, int] = {f"{ROOT}/seed/x": 0}
            names = [f"{ROOT}/{ns}/{topic}/{leaf}" for ns in ("a", "ab", "b") for topic in ("t", "t1", "t10")
                     for leaf in ("root", "cursor")]  # fmt: skip
            revision = 0
            for step in range(120):
                key = rng.choice(names)
                if key in written and rng.random() < 0.4:
                    await store.delete(key)
                    del written[key]
                    revision = max(revision, (await store.put(f"{ROOT}-marker", step)))
                else:
                    written[key] = step
                    revision = await store.put(key, step)
            await cache.wait_for_revision(revision)
            for prefix in (f"{ROOT}/", f"{ROOT}/a", f"{ROOT}/a/", f"{ROOT}/ab/t1", f"{ROOT}/b/t10/", f"{ROOT}/c"):
                expected = {k: v for k, v in sorted(written.items()) if k.startswith(prefix)}
                got = cache.get_prefix(prefix)
                assert got == expected, prefix
                assert list(got) == sorted(expected), prefix  # in key order


async def test_listeners_get_the_events_under_their_prefix_in_registration_order(
    etcd_endpoints: list[str],
) -> None:
    async with await MetadataStore.connect(etcd_endpoints) as store, LocalCache(store, prefixes=("/",)) as cache:
        calls: list[tuple[str, str]] = []

        def listener(name: str) -> Callable[[WatchEvent], None]:
            return lambda event: calls.append((name, event.key))

        prefixes = {"all": f"{ROOT}/", "ns-a": f"{ROOT}/a/", "topic": f"{ROOT}/a/t/", "ns-a-too": f"{ROOT}/a/",
                    "other": f"{ROOT}/b/", "exact": f"{ROOT}/a/t/root"}  # fmt: skip
        removers = {name: cache.add_listener(prefix, listener(name)) for name, prefix in prefixes.items()}
        revision = await store.put(f"{ROOT}/a/t/root", 1)
        await cache.wait_for_revision(revision)
        assert calls == [(name, f"{ROOT}/a/t/root") for name in ("all", "ns-a", "topic", "ns-a-too", "exact")]

        calls.clear()
        removers["ns-a"]()
        removers["ns-a"]()  # idempotent
        removers["exact"]()
        revision = await store.put(f"{ROOT}/a/t/root", 2)
        await cache.wait_for_revision(revision)
        assert calls == [(name, f"{ROOT}/a/t/root") for name in ("all", "topic", "ns-a-too")]

        calls.clear()
        removers["all"]()
        late: list[WatchEvent] = []
        cache.add_listener(f"{ROOT}/b", late.append)
        revision = await store.put(f"{ROOT}/b/x", 3)
        await cache.wait_for_revision(revision)
        await store.delete(f"{ROOT}/b/x")
        await eventually(lambda: len(late) == 2, timeout_s=5, what="the delete delivered")
        assert calls == [("other", f"{ROOT}/b/x"), ("other", f"{ROOT}/b/x")]
        assert [event.key for event in late] == [f"{ROOT}/b/x", f"{ROOT}/b/x"]


async def test_the_load_reads_in_pages_at_one_revision(etcd_endpoints: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # Pages of 7 keys: 30 keys under two prefixes take several pages each (a broker with
    # 10,000 topics holds more than one gRPC message of keys).
    monkeypatch.setattr(cache_module, "LOAD_PAGE_KEYS", 7)
    async with await MetadataStore.connect(etcd_endpoints) as store:
        written = {f"{ROOT}/paged/{prefix}/{i:03d}": i for prefix in ("p", "q") for i in range(15)}
        for key, value in written.items():
            await store.put(key, value)
        async with LocalCache(store, prefixes=(f"{ROOT}/paged/p/", f"{ROOT}/paged/q/")) as cache:
            for prefix in ("p", "q"):
                under = f"{ROOT}/paged/{prefix}/"
                assert cache.get_prefix(under) == {k: v for k, v in sorted(written.items()) if k.startswith(under)}
            revision = await store.put(f"{ROOT}/paged/q/new", 99)  # the watch follows from the load's revision
            await cache.wait_for_revision(revision)
            assert cache.get(f"{ROOT}/paged/q/new") == 99


async def test_reads_outside_the_cached_prefixes_are_refused(etcd_endpoints: list[str]) -> None:
    """A read must fall under one of the prefixes (checked with one ``str.startswith`` of them
    all): keys under either prefix are read, a key beside them raises ``ValueError``."""
    async with await MetadataStore.connect(etcd_endpoints) as store:
        await store.put(f"{ROOT}-p/a/x", 1)
        await store.put(f"{ROOT}-q/b/y", 2)
        async with LocalCache(store, prefixes=(f"{ROOT}-p/a/", f"{ROOT}-q/")) as cache:
            assert cache.get(f"{ROOT}-p/a/x") == 1
            assert cache.get(f"{ROOT}-q/b/y") == 2
            assert cache.get(f"{ROOT}-q/absent") is None
            for outside in (f"{ROOT}-p/a", f"{ROOT}-p/b/x", f"{ROOT}-r/x", "/"):
                with pytest.raises(ValueError, match="outside the cached prefixes"):
                    cache.get(outside)
