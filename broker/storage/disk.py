"""Whether the broker's WAL disk has room: one state for the whole broker, shown in health.

A WAL whose write fails with ``ENOSPC``/``EDQUOT`` reports it here (:meth:`DiskMonitor.storage_full`).
From then until space is freed the broker is *storage full*: appends are refused with the typed,
retriable :class:`~danube_pipeline.errors.StorageFullError`, reads and dispatch go on, the gRPC
health status of ``danube.v1.ProducerService`` is ``NOT_SERVING`` (the overall status stays
``SERVING``), and the episode is logged once when it starts and once when it ends. The episode
ends when a WAL write succeeds again, or when a probe every :data:`PROBE_INTERVAL_S` finds at
least :data:`MIN_FREE_BYTES` free on the WAL file system.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from danube_pipeline.errors import StorageFullError

from broker.tasks import spawn

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0
"""How often free space is checked while the broker is storage full."""
MIN_FREE_BYTES = 4 * 1024 * 1024
"""Free bytes on the WAL file system that end a storage-full episode."""


class DiskMonitor:
    """The broker's storage-full state (a :class:`broker.storage.wal.log.StorageMonitor`).

    Args:
        wal_dir: the directory holding every WAL (its file system is probed).
        on_change: called with ``True`` when an episode starts and ``False`` when it ends.
    """

    def __init__(self, wal_dir: Path, on_change: Callable[[bool], None] = lambda _full: None) -> None:
        self.wal_dir = wal_dir
        self._on_change = on_change
        self._full_since: float | None = None
        self._probe: asyncio.Task[None] | None = None
        self.episodes = 0

    @property
    def full(self) -> bool:
        """Whether the broker is storage full now."""
        return self._full_since is not None

    def storage_full(self, directory: Path, error: StorageFullError) -> None:
        """A WAL in ``directory`` could not write for lack of space."""
        if self._full_since is not None:
            return
        self._full_since = time.monotonic()
        self.episodes += 1
        log.warning("storage full (%s): publishing refused until space is freed; reads go on", error)
        self._on_change(True)
        if self._probe is None or self._probe.done():
            self._probe = spawn(self._probe_free_space(), name="storage-probe")

    def storage_available(self, directory: Path) -> None:
        """A WAL in ``directory`` wrote successfully."""
        self._end("a write succeeded")

    def _end(self, why: str) -> None:
        if self._full_since is None:
            return
        log.info("storage has room again after %.1f s (%s): publishing resumes", time.monotonic() - self._full_since, why)
        self._full_since = None
        self._on_change(False)

    def free_bytes(self) -> int:
        """Bytes available to the broker on the WAL file system.

        Raises:
            OSError: the file system cannot be queried.
        """
        st = os.statvfs(self.wal_dir)
        return st.f_bavail * st.f_frsize

    async def _probe_free_space(self) -> None:
        while self._full_since is not None:
            await asyncio.sleep(PROBE_INTERVAL_S)
            try:
                free = self.free_bytes()
            except OSError as exc:
                log.debug("cannot probe free space of %s: %s", self.wal_dir, exc)
                continue
            if free >= MIN_FREE_BYTES:
                self._end(f"{free // (1024 * 1024)} MiB free")

    def stop(self) -> None:
        """Stop probing."""
        if self._probe is not None:
            self._probe.cancel()


__all__ = ["DiskMonitor", "MIN_FREE_BYTES", "PROBE_INTERVAL_S"]
