"""Prometheus file-based service discovery (``file_sd``): the scrape targets of the brokers and
the continuous writer, as JSON files that Prometheus re-reads when they change.

A target file holds a list of target groups, ``[{"targets": ["host:port"], "labels": {...}}]``
(Prometheus documentation, ``<file_sd_config>``). :class:`BrokerTargets` keeps the brokers'
file current from their etcd registrations (``docs/etcd-layout.md`` §1.2: the
``prom_exporter`` URL of every ``/cluster/register/{broker_id}``), polling etcd from a thread
of the launcher; every file is written atomically (a temporary file renamed over it), so
Prometheus never reads half a file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from danube_pipeline.errors import MetadataStoreError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.connection import EtcdSecurity
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import BrokerRegistration

logger = logging.getLogger(__name__)

TargetGroup = dict[str, Any]
"""One ``file_sd`` target group: ``{"targets": ["host:port"], "labels": {"name": "value"}}``."""


def target_group(url: str, labels: Mapping[str, str] | None = None) -> TargetGroup:
    """The target group scraping ``url`` (``http://host:port/metrics``), with ``labels``.

    A scheme other than ``http`` becomes the ``__scheme__`` label and a path other than
    ``/metrics`` the ``__metrics_path__`` label, which Prometheus applies to the target.

    Raises:
        ValueError: ``url`` has no ``host:port``.
    """
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if not parts.netloc:
        raise ValueError(f"not a metrics URL: {url!r}")
    group_labels = dict(labels or {})
    if parts.scheme != "http":
        group_labels["__scheme__"] = parts.scheme
    if parts.path not in ("", "/metrics"):
        group_labels["__metrics_path__"] = parts.path
    return {"targets": [parts.netloc], "labels": group_labels}


def write_targets(path: Path, groups: Sequence[TargetGroup]) -> bool:
    """Write ``groups`` to ``path`` as a ``file_sd`` JSON file, atomically (a temporary file in
    the same directory, then renamed over ``path``), unless it already holds them.

    Returns:
        Whether the file changed.

    Raises:
        OSError: the file cannot be written.
    """
    text = json.dumps(list(groups), indent=2, sort_keys=True) + "\n"
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return True


async def registered_exporters(store: MetadataStore) -> dict[str, int]:
    """The metrics endpoint of every registered broker (``docs/etcd-layout.md`` §1.2).

    Returns:
        ``{prom_exporter URL: broker id}``; brokers whose ``prom_exporter`` is ``null`` (no
        ``--metrics-listen``) or whose registration cannot be read are left out.

    Raises:
        MetadataStoreError: etcd cannot be reached.
    """
    kvs, _ = await store.get_prefix(keys.BROKER_REGISTER_PREFIX)
    exporters: dict[str, int] = {}
    for kv in kvs:
        broker_id = kv.key[len(keys.BROKER_REGISTER_PREFIX) :]
        try:
            registration = BrokerRegistration.from_json(kv.value)
        except (TypeError, ValueError) as exc:
            logger.warning("unreadable broker registration %s: %s", kv.key, exc)
            continue
        if registration.prom_exporter and broker_id.isdigit():
            exporters[registration.prom_exporter] = int(broker_id)
    return exporters


class BrokerTargets:
    """Keeps a ``file_sd`` file of the brokers' metrics endpoints current from etcd.

    Every ``interval_s`` a thread reads ``/cluster/register/`` and rewrites the file when the
    set of endpoints changed. A broker's target carries the label ``broker`` (its id, the same
    value as the ``broker`` label of its own metrics). A broker whose registration disappears
    (it stopped or crashed, and its lease ended) stays a target until :meth:`stop`, so
    Prometheus sees ``up == 0`` for it (the ``DanubeBrokerDown`` alert) instead of forgetting
    it; a broker registering again with the same endpoint takes its target back.
    """

    def __init__(
        self,
        path: Path,
        etcd_endpoints: Sequence[str],
        *,
        interval_s: float = 1.0,
        security: EtcdSecurity | None = None,
    ) -> None:
        """Args:
        path: the target file (``.../targets/brokers.json``).
        etcd_endpoints: ``host:port`` etcd endpoints.
        interval_s: seconds between two reads of the registrations.
        security: etcd TLS and authentication; default from the ``DANUBE_ETCD_*`` variables.
        """
        self.path = path
        self.etcd_endpoints = list(etcd_endpoints)
        self.interval_s = interval_s
        self.security = security
        self.known: dict[str, int] = {}
        """Every endpoint seen since :meth:`start`, with its broker id."""
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._thread: threading.Thread | None = None

    def groups(self) -> list[TargetGroup]:
        """The target groups of every endpoint in :attr:`known`, sorted by endpoint."""
        return [target_group(url, {"broker": str(broker_id)}) for url, broker_id in sorted(self.known.items())]

    async def sync(self, store: MetadataStore) -> bool:
        """Read the registrations once and rewrite the file when they changed it.

        Returns:
            Whether the file changed.

        Raises:
            MetadataStoreError: etcd cannot be reached.
            OSError: the file cannot be written.
        """
        self.known.update(await registered_exporters(store))
        return write_targets(self.path, self.groups())

    def start(self, *, timeout_s: float = 10.0) -> None:
        """Write the file (empty), start the thread and wait for its first read of etcd.

        Raises:
            OSError: the file cannot be written.
            RuntimeError: the first read did not finish within ``timeout_s``.
        """
        write_targets(self.path, self.groups())
        self._stop.clear()
        self._synced.clear()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="prometheus-targets", daemon=True)
        self._thread.start()
        if not self._synced.wait(timeout_s):
            self.stop()
            raise RuntimeError(f"could not read the broker registrations from etcd {self.etcd_endpoints} "
                               f"within {timeout_s:g} s")

    def stop(self) -> None:
        """Stop the thread (within about ``interval_s``). Idempotent; the file stays."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 15.0)
            self._thread = None

    async def _run(self) -> None:
        store: MetadataStore | None = None
        try:
            while not self._stop.is_set():
                try:
                    if store is None:
                        store = await MetadataStore.connect(self.etcd_endpoints, security=self.security)
                    if await self.sync(store):
                        logger.info("prometheus broker targets: %s", ", ".join(sorted(self.known)) or "none")
                    self._synced.set()
                except (MetadataStoreError, OSError) as exc:
                    logger.warning("prometheus broker targets not updated: %s", exc)
                    if store is not None:
                        await store.close()
                        store = None
                await asyncio.sleep(self.interval_s)
        finally:
            if store is not None:
                await store.close()
