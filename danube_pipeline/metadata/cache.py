"""The per-process :class:`LocalCache`: every read is served from memory, kept current by an
etcd watch (``docs/etcd-layout.md``, "Reads and writes")."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import heapq
import itertools
import logging
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Self

import aetcd

from danube_pipeline.errors import MetadataStoreError
from danube_pipeline.metadata.etcd import (
    ALL_KEYS,
    WatchEvent,
    WatchEventType,
    key_value,
    prefix_range_end,
    watch_event,
    wrap_errors,
)
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import JsonValue
from danube_pipeline.outages import OutageLog

__all__ = ["LocalCache"]

log = logging.getLogger(__name__)

_MAX_RELOAD_BACKOFF_S = 1.0
"""Longest wait between two reload attempts while etcd is unreachable: a broker sees etcd's
state again within about a second of etcd answering."""


LOAD_PAGE_KEYS = 2000
"""Keys per etcd ``Range`` when the cache loads (or reloads) its prefixes: a page stays far
below gRPC's 4 MiB message limit (a key and its JSON value rarely exceed 1 KiB)."""

_Revisions = tuple[int, int]
"""A cached key's etcd ``(create_revision, mod_revision)``."""


def _minimal_prefixes(prefixes: Sequence[str]) -> list[str]:
    """Drop prefixes covered by a shorter one: ``["/", "/a"]`` -> ``["/"]``."""
    out: list[str] = []
    for p in sorted(set(prefixes), key=len):
        if not any(p.startswith(q) for q in out):
            out.append(p)
    return sorted(out)


class LocalCache:
    """Per-process read cache of etcd metadata (``docs/etcd-layout.md``, "Reads and writes").

    :meth:`start` loads every key under ``prefixes`` at one etcd revision ``R`` and then
    follows a watch from ``R + 1``, so no change is missed between the load and the watch.
    Reads (:meth:`get`, :meth:`get_prefix`) are served from memory. The watch covers the whole
    key space (only keys under ``prefixes`` are stored) so that :attr:`revision` follows every
    etcd write and :meth:`wait_for_revision` works for any revision a write returned.

    If the watch breaks (etcd restart, compaction) the cache logs it, reloads at a new
    revision, tells listeners about every difference as synthetic events, and resumes. A key
    is compared by value and by its create and mod revisions: one deleted and created again
    meanwhile, even with the same value, is reported as a DELETE followed by a PUT (its create
    revision, e.g. an owner epoch, changed), and one rewritten with the same value as a PUT.

    Listeners run synchronously on the event loop for each applied change; one watch response
    (one etcd transaction) is applied completely before any waiter wakes.
    """

    def __init__(self, store: MetadataStore, *, prefixes: Sequence[str] = ("/",)) -> None:
        """Args:
        store: the store to load from and watch.
        prefixes: key prefixes to keep (default every Danube key).

        Raises:
            ValueError: if ``prefixes`` is empty.
        """
        if not prefixes:
            raise ValueError("LocalCache needs at least one prefix")
        self._store = store
        self._prefixes = _minimal_prefixes(prefixes)
        self._everything = self._prefixes == ["/"]
        self._prefix_tuple = tuple(self._prefixes)  # str.startswith takes a tuple: one C call per read
        self._data: dict[str, JsonValue] = {}
        self._keys: list[str] = []
        """The keys of ``_data``, sorted: :meth:`get_prefix` bisects it instead of scanning
        every key (a broker with 10,000 topics caches some 80,000 keys)."""
        self._revisions: dict[str, _Revisions] = {}
        self._revision = 0
        self._started = False
        self._stopping = False
        self._reloads = OutageLog(log, "LocalCache reload from etcd")
        self._task: asyncio.Task[None] | None = None
        self._watch: aetcd.Watch | None = None
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        """:meth:`wait_for_revision` calls waiting, a heap by revision: each applied revision
        wakes only the calls it satisfies."""
        self._waiter_ids = itertools.count()
        self._listeners: dict[str, dict[int, Callable[[WatchEvent], None]]] = {}
        """Listeners by prefix, then by token (registration order). An event looks up the
        prefixes of its key (one per registered prefix length), not every listener: a broker
        with 10,000 topics registers some 20,000 (two per topic's object descriptors)."""
        self._prefix_lengths: list[int] = []
        """The distinct lengths of the prefixes in ``_listeners``, ascending."""
        self._length_counts: dict[int, int] = {}
        """How many prefixes in ``_listeners`` have each length."""
        self._next_listener = 0

    # ---- lifecycle

    async def start(self) -> None:
        """Load the prefixes at one revision ``R`` and start watching from ``R + 1``.

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        if self._started:
            return
        self._stopping = False
        data, revisions, revision = await self._load()
        self._data = data
        self._keys = list(data)  # _load returns the keys in order
        self._revisions = revisions
        self._set_revision(revision)
        self._watch = await self._store.open_watch(ALL_KEYS, ALL_KEYS, revision + 1)
        self._started = True
        self._task = asyncio.get_running_loop().create_task(self._run(), name="local-cache-watch")

    async def stop(self) -> None:
        """Stop watching (idempotent). The cached data stays readable but no longer updates."""
        self._stopping = True
        if self._watch is not None:
            await self._store.cancel_watch(self._watch)
            self._watch = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _load(self) -> tuple[dict[str, JsonValue], dict[str, _Revisions], int]:
        kvs: list[Any] = []
        revision = 0  # the first page's revision pins every later page
        for prefix in self._prefixes:
            start, end = prefix.encode(), prefix_range_end(prefix.encode())
            while True:
                # In pages: one answer holding every key would pass gRPC's 4 MiB message limit
                # (a broker with 10,000 topics caches some 7 MiB, benchmarks/scale.py).
                response = await self._store.range_raw(start, end, revision=revision, limit=LOAD_PAGE_KEYS)
                revision = revision or int(response.header.revision)
                kvs.extend(response.kvs)
                if not response.more or not response.kvs:
                    break
                start = bytes(response.kvs[-1].key) + b"\0"
        loaded = sorted(map(key_value, kvs), key=lambda kv: kv.key)
        data = {kv.key: kv.value for kv in loaded}
        revisions = {kv.key: (kv.create_revision, kv.mod_revision) for kv in loaded}
        return data, revisions, revision

    async def _run(self) -> None:
        backoff_s = 0.1
        while not self._stopping:
            watch = self._watch
            try:
                if watch is None:
                    raise MetadataStoreError("watch", "no open watch")
                with wrap_errors("watch"):
                    async for raw_event in watch:
                        if self._covers(bytes(raw_event.kv.key).decode()):
                            self._apply(watch_event(raw_event), int(raw_event.kv.create_revision))
                        else:  # outside the cached prefixes: only the revision advances
                            self._set_revision(int(raw_event.kv.mod_revision))
                if self._stopping:
                    return
                raise MetadataStoreError("watch", "watch stream ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any break of the watch means reload
                if self._stopping:
                    return
                log.warning(
                    "LocalCache watch broke at revision %d (%s); reloading", self._revision, exc
                )
            if watch is not None:
                await self._store.cancel_watch(watch)
            self._watch = None
            while not self._stopping:
                if self._store.closed:
                    log.info("LocalCache stops following etcd: its MetadataStore was closed")
                    return
                try:
                    await self._reload()
                    self._reloads.succeeded()
                    backoff_s = 0.1
                    break
                except MetadataStoreError as exc:
                    self._reloads.failed(exc)
                    await asyncio.sleep(backoff_s)
                    backoff_s = min(backoff_s * 2, _MAX_RELOAD_BACKOFF_S)

    async def _reload(self) -> None:
        data, revisions, revision = await self._load()
        watch = await self._store.open_watch(ALL_KEYS, ALL_KEYS, revision + 1)
        for event in self._missed(data, revisions, revision):
            self._store_event(event, revisions.get(event.key, (0, 0)))
            self._notify(event)
        self._data = data
        self._keys = list(data)
        self._revisions = revisions
        if revision < self._revision:
            log.warning(
                "etcd revision went back from %d to %d (data loss?)", self._revision, revision
            )
        self._revision = revision
        self._wake_waiters()
        self._watch = watch
        log.info("LocalCache reloaded %d keys at revision %d; watching again", len(data), revision)

    # ---- applying changes

    def _covers(self, key: str) -> bool:
        return self._everything or key.startswith(self._prefix_tuple)

    def _missed(
        self, data: dict[str, JsonValue], revisions: dict[str, _Revisions], revision: int
    ) -> list[WatchEvent]:
        """The changes between the cached state and a reload at ``revision``, in key order.

        A key whose create revision differs was deleted and created again (ABA, even with the
        same value): a DELETE, then a PUT. One whose mod revision or value differs: a PUT.
        """
        events: list[WatchEvent] = []
        for key in sorted(self._data.keys() | data.keys()):
            if key not in data:
                events.append(WatchEvent(WatchEventType.DELETE, key, None, revision))
                continue
            put = WatchEvent(WatchEventType.PUT, key, data[key], revision)
            if key not in self._data:
                events.append(put)
                continue
            old_create, old_mod = self._revisions.get(key, (0, 0))
            new_create, new_mod = revisions[key]
            if old_create != new_create:
                events += [WatchEvent(WatchEventType.DELETE, key, None, revision), put]
            elif old_mod != new_mod or self._data[key] != data[key]:
                events.append(put)
        return events

    def _store_event(self, event: WatchEvent, revisions: _Revisions) -> None:
        key = event.key
        if event.type is WatchEventType.PUT:
            if key not in self._data:
                bisect.insort(self._keys, key)
            self._data[key] = event.value
            self._revisions[key] = revisions
        elif key in self._data:
            del self._data[key]
            del self._keys[bisect.bisect_left(self._keys, key)]
            self._revisions.pop(key, None)

    def _apply(self, event: WatchEvent, create_revision: int) -> None:
        self._store_event(event, (create_revision, event.mod_revision))
        self._notify(event)
        self._set_revision(event.mod_revision)

    def _set_revision(self, revision: int) -> None:
        if revision > self._revision:
            self._revision = revision
            self._wake_waiters()

    def _wake_waiters(self) -> None:
        """Resolve the :meth:`wait_for_revision` calls the cache's revision satisfies."""
        waiters = self._waiters
        while waiters and waiters[0][0] <= self._revision:
            future = heapq.heappop(waiters)[2]
            if not future.done():  # a call that timed out or was cancelled left it
                future.set_result(None)

    def _notify(self, event: WatchEvent) -> None:
        key = event.key
        matched: list[tuple[int, str, Callable[[WatchEvent], None]]] = []
        for length in self._prefix_lengths:
            if length > len(key):
                break
            prefix = key[:length]
            entries = self._listeners.get(prefix)
            if entries:
                matched.extend((token, prefix, callback) for token, callback in entries.items())
        if len(matched) > 1:
            matched.sort(key=lambda entry: entry[0])  # registration order, as documented
        for _token, prefix, callback in matched:
            try:
                callback(event)
            except Exception:  # noqa: BLE001 - one bad listener must not stop the cache
                log.exception("LocalCache listener for %r failed on %s", prefix, event.key)

    # ---- reads

    @property
    def revision(self) -> int:
        """The highest etcd revision applied to the cache (0 before :meth:`start`)."""
        return self._revision

    @property
    def prefixes(self) -> list[str]:
        """The cached key prefixes (redundant ones removed)."""
        return list(self._prefixes)

    def _check_key(self, key: str) -> None:
        if not self._started:
            raise MetadataStoreError("LocalCache read", "the cache was not started")
        if not self._covers(key):
            raise ValueError(f"key {key!r} is outside the cached prefixes {self._prefixes}")

    def get(self, key: str) -> JsonValue | None:
        """The cached value of ``key``, or ``None`` if absent (or its value is ``null``).

        Raises:
            ValueError: if ``key`` is outside the cached prefixes.
            MetadataStoreError: if the cache was never started.
        """
        self._check_key(key)
        return self._data.get(key)

    def contains(self, key: str) -> bool:
        """Whether ``key`` exists (distinguishes a ``null`` marker from a missing key).

        Raises:
            ValueError: if ``key`` is outside the cached prefixes.
            MetadataStoreError: if the cache was never started.
        """
        self._check_key(key)
        return key in self._data

    def create_revision(self, key: str) -> int | None:
        """The etcd create revision of the cached ``key``, or ``None`` if it is absent.

        A key deleted and created again has a new create revision: for an assignment key it
        is the owner epoch (``docs/etcd-layout.md`` §1.4).

        Raises:
            ValueError: if ``key`` is outside the cached prefixes.
            MetadataStoreError: if the cache was never started.
        """
        self._check_key(key)
        revisions = self._revisions.get(key)
        return revisions[0] if revisions is not None else None

    def mod_revision(self, key: str) -> int | None:
        """The etcd mod revision of the cached ``key`` (its last write), or ``None`` if absent:
        a transaction comparing it succeeds only if the key is unchanged since this read.

        Raises:
            ValueError: if ``key`` is outside the cached prefixes.
            MetadataStoreError: if the cache was never started.
        """
        self._check_key(key)
        revisions = self._revisions.get(key)
        return revisions[1] if revisions is not None else None

    def get_prefix(self, prefix: str) -> dict[str, JsonValue]:
        """Every cached ``key -> value`` whose key starts with ``prefix``, sorted by key.

        Raises:
            ValueError: if ``prefix`` is not inside the cached prefixes.
            MetadataStoreError: if the cache was never started.
        """
        self._check_key(prefix)
        keys, data = self._keys, self._data
        out: dict[str, JsonValue] = {}
        for i in range(bisect.bisect_left(keys, prefix), len(keys)):
            key = keys[i]
            if not key.startswith(prefix):
                break
            out[key] = data[key]
        return out

    async def wait_for_revision(self, revision: int, *, timeout_s: float = 5.0) -> None:
        """Wait until the cache has applied ``revision`` (read-your-writes after a put).

        Args:
            revision: an etcd revision, e.g. the return value of :meth:`MetadataStore.put`.
            timeout_s: how long to wait, in seconds.

        Raises:
            MetadataStoreError: if the revision is not applied within ``timeout_s``.
        """
        if self._revision >= revision:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (revision, next(self._waiter_ids), future))
        try:
            async with asyncio.timeout(timeout_s):
                await future
        except TimeoutError:
            raise MetadataStoreError(
                "wait_for_revision",
                f"cache at revision {self._revision}, revision {revision} not seen within {timeout_s}s",
            ) from None

    def add_listener(
        self, prefix: str, callback: Callable[[WatchEvent], None]
    ) -> Callable[[], None]:
        """Call ``callback(event)`` for every change applied under ``prefix``.

        Callbacks run synchronously on the event loop, in revision order; exceptions they raise
        are logged and swallowed. After a watch break, differences found by the reload are
        delivered as synthetic events carrying the reload revision, in key order; a key deleted
        and created again meanwhile (a new create revision) gets a DELETE, then a PUT.

        Returns:
            A function that unsubscribes the callback (idempotent).
        """
        token = self._next_listener
        self._next_listener += 1
        entries = self._listeners.get(prefix)
        if entries is None:
            entries = self._listeners[prefix] = {}
            self._count_length(len(prefix), 1)
        entries[token] = callback

        def unsubscribe() -> None:
            entries = self._listeners.get(prefix)
            if entries is None or entries.pop(token, None) is None or entries:
                return
            del self._listeners[prefix]
            self._count_length(len(prefix), -1)

        return unsubscribe

    def _count_length(self, length: int, delta: int) -> None:
        """Count a listened prefix of ``length`` in or out of :attr:`_prefix_lengths`."""
        count = self._length_counts.get(length, 0) + delta
        if count:
            self._length_counts[length] = count
        else:
            del self._length_counts[length]
        length_appeared = delta > 0 and count == 1
        if length_appeared or count == 0:  # the set of lengths changed
            self._prefix_lengths = sorted(self._length_counts)
