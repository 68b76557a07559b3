"""The broker's lifecycle: etcd registration, topics served here, the gRPC server.

:class:`BrokerServer` owns the process-wide state (metadata store and cache, lease, topics,
producers, consumers) and the gRPC server built by :func:`create_server`. The servicers in
:mod:`broker.services` call into it.

Start (seed ``000`` §1): register ``/cluster/register/{id}`` under a lease, mark
``/cluster/{cluster_name}``, set ``/cluster/brokers/{id}/state`` active, campaign for
``/cluster/leader``, publish ``/cluster/load/{id}``, load every topic assigned under
``/cluster/brokers/{id}/`` and follow new assignments. Stop: state ``draining``, end consumer
streams, stop the server with a grace period, store cursors, close WALs, revoke the lease.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from danube_pipeline.errors import (
    ConsumerNotFoundError,
    MetadataStoreError,
    NotServedHereError,
    ProducerNotFoundError,
    TopicNotFoundError,
)
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.store import LocalCache, Lease, MetadataStore, WatchEvent, WatchEventType
from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc
from danube_pipeline.schema_registry import SchemaRegistry

from broker.config import BrokerConfig
from broker.dispatch import Consumer
from broker.topic import Producer, Topic
from broker.wal import WriteAheadLog

log = logging.getLogger(__name__)

_MAX_REMEMBERED_CLOSED_CONSUMERS = 10_000


def load_or_create_broker_id(data_dir: Path) -> int:
    """The broker id kept in ``data_dir/broker_id``: a random u64 created on first start."""
    path = data_dir / "broker_id"
    with contextlib.suppress(FileNotFoundError, ValueError):
        return int(path.read_text().strip())
    broker_id = secrets.randbits(64) or 1
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{broker_id}\n")
    os.replace(tmp, path)
    return broker_id


def write_ready_file(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as JSON to ``path`` atomically (temporary file + rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]") or "0.0.0.0", int(port)


def create_server(
    broker: BrokerServer, address: str, *, health_servicer: health.aio.HealthServicer
) -> tuple[aio.Server, int]:
    """Build the gRPC server with every Danube service and health, bound to ``address``.

    Args:
        broker: the broker state the servicers act on.
        address: ``host:port``; port 0 binds any free port.
        health_servicer: the ``grpc.health.v1`` servicer to expose.

    Returns:
        The (not yet started) server and the bound port.

    Raises:
        RuntimeError: if the address cannot be bound.
    """
    from broker import services  # noqa: PLC0415 - services imports this module for typing

    limit = broker.config.max_message_bytes
    server = aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
        ]
    )
    pb_grpc.add_ProducerServiceServicer_to_server(services.ProducerServicer(broker), server)
    pb_grpc.add_ConsumerServiceServicer_to_server(services.ConsumerServicer(broker), server)
    pb_grpc.add_DiscoveryServicer_to_server(services.DiscoveryServicer(broker), server)
    pb_grpc.add_AdminServicer_to_server(services.AdminServicer(broker), server)
    pb_grpc.add_SchemaRegistryServicer_to_server(services.SchemaRegistryServicer(broker), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"cannot bind {address}")
    return server, port


class BrokerServer:
    """One broker: metadata registration, the topics it serves and its gRPC server.

    Use ``await start()`` then ``await wait_closed()``; ``await stop()`` shuts down gracefully.

    Attributes:
        config: the configuration.
        broker_id: the u64 id persisted in ``data_dir/broker_id``.
        advertised_addr: ``host:port`` clients use (known after :meth:`start`).
        topics: topics served here, by path ``/ns/topic``.
        producers: open producers by id.
        consumers: consumers by id (closed ones are remembered a while for late acks).
    """

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        config.data_dir.mkdir(parents=True, exist_ok=True)
        self.broker_id = load_or_create_broker_id(config.data_dir)
        self.advertised_addr = ""
        self.port = 0
        self.topics: dict[str, Topic] = {}
        self.producers: dict[int, Producer] = {}
        self.consumers: collections.OrderedDict[int, Consumer] = collections.OrderedDict()
        self._store: MetadataStore | None = None
        self._cache: LocalCache | None = None
        self._registry: SchemaRegistry | None = None
        self._lease: Lease | None = None
        self._server: aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._loading: dict[str, asyncio.Task[Topic]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._listener_removers: list[Any] = []
        self._load_report_wake = asyncio.Event()
        self._stopping = False
        self._stopped = asyncio.Event()
        self._is_leader = False

    # ------------------------------------------------------------------ accessors

    @property
    def store(self) -> MetadataStore:
        assert self._store is not None, "broker not started"
        return self._store

    @property
    def cache(self) -> LocalCache:
        assert self._cache is not None, "broker not started"
        return self._cache

    @property
    def registry(self) -> SchemaRegistry:
        assert self._registry is not None, "broker not started"
        return self._registry

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Connect to etcd, bind and start the gRPC server, register, load assigned topics.

        Raises:
            MetadataStoreError: etcd unreachable.
            RuntimeError: the listen address cannot be bound.
        """
        cfg = self.config
        self._store = await MetadataStore.connect(cfg.etcd_endpoints)
        self._cache = LocalCache(self._store, prefixes=("/",))
        await self._cache.start()
        self._registry = SchemaRegistry(self._store)

        await self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server, self.port = create_server(self, cfg.listen, health_servicer=self._health)
        host, _ = _split_host_port(cfg.listen)
        if cfg.advertised_addr:
            self.advertised_addr = cfg.advertised_addr
        else:
            adv_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
            self.advertised_addr = f"{adv_host}:{self.port}"
        await self._server.start()

        await self._register()
        self._listener_removers.append(
            self.cache.add_listener(keys.broker_prefix(self.broker_id), self._on_assignment_event)
        )
        self._listener_removers.append(self.cache.add_listener(keys.CLUSTER_LEADER, self._on_leader_event))
        for key in self.cache.get_prefix(keys.broker_prefix(self.broker_id)):
            name = self._assignment_topic(key)
            if name is not None:
                try:
                    await self.load_topic(name)
                except Exception:
                    log.exception("cannot load assigned topic %s", name)
        self._tasks.append(asyncio.create_task(self._load_reporter(), name="load-report"))
        self._tasks.append(asyncio.create_task(self._cursor_flusher(), name="cursor-flush"))
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        if cfg.ready_file is not None:
            write_ready_file(
                cfg.ready_file,
                {"broker_id": self.broker_id, "broker_addr": self.advertised_addr, "pid": os.getpid()},
            )
        log.info(
            "broker %d serving on %s (advertised %s), %d topics loaded",
            self.broker_id, cfg.listen, self.advertised_addr, len(self.topics),
        )

    async def _register(self) -> None:
        cfg = self.config
        self._lease = await self.store.grant_lease(cfg.lease_ttl_s)
        registration = values.BrokerRegistration(
            admin_addr=f"http://{self.advertised_addr}",
            advertised_addr=self.advertised_addr,
            broker_addr=f"http://{self.advertised_addr}",
            prom_exporter=None,
        )
        await self.store.put(keys.broker_register(self.broker_id), registration, lease=self._lease)
        await self.store.put_many(
            [
                (keys.cluster_name(cfg.cluster_name), None),
                (keys.broker_state(self.broker_id), values.BrokerState(mode="active", reason="boot")),
            ]
        )
        await self._campaign()
        revision = await self.store.put(keys.load_report(self.broker_id), self._load_report())
        await self.cache.wait_for_revision(revision)

    async def _campaign(self) -> None:
        if self._stopping or self._lease is None:
            return
        try:
            won = await self.store.put_if_absent(keys.CLUSTER_LEADER, self.broker_id, lease=self._lease)
        except Exception as exc:  # noqa: BLE001 - retried on the next leader change
            log.warning("leader election failed: %s", exc)
            return
        if won:
            self._is_leader = True
            log.info("broker %d is the cluster leader", self.broker_id)

    def _on_leader_event(self, event: WatchEvent) -> None:
        if event.key == keys.CLUSTER_LEADER and event.type is WatchEventType.DELETE and not self._stopping:
            self._is_leader = False
            asyncio.get_running_loop().create_task(self._campaign())

    async def wait_closed(self) -> None:
        """Return once :meth:`stop` has finished."""
        await self._stopped.wait()

    async def stop(self) -> None:
        """Graceful shutdown (idempotent): draining state, end consumer streams, stop the
        server with a grace period, mark producers closed, store cursors, close WALs (synced),
        revoke the lease."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        log.info("broker %d shutting down", self.broker_id)
        with contextlib.suppress(Exception):
            await self._health.enter_graceful_shutdown()
        if self._store is not None:
            try:
                await self.store.put(
                    keys.broker_state(self.broker_id), values.BrokerState(mode="draining", reason="shutdown")
                )
            except Exception as exc:  # noqa: BLE001
                log.warning("cannot record draining state: %s", exc)
        for remove in self._listener_removers:
            remove()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for topic in self.topics.values():
            for sub in topic.subscriptions.values():
                for consumer in list(sub.consumers):
                    sub.remove_consumer(consumer, reason="broker shutdown")
        if self._server is not None:
            await self._server.stop(self.config.shutdown_grace_s)
        if self._store is not None and self.producers:
            closed = [
                (keys.topic_producer(p.topic.name, p.id), p.metadata(status=False))
                for p in self.producers.values()
            ]
            self.producers.clear()
            try:
                for start in range(0, len(closed), 100):  # etcd's --max-txn-ops is 128
                    await self.store.put_many(closed[start : start + 100])
            except MetadataStoreError as exc:
                log.warning("cannot mark producers closed: %s", exc)
        for topic in list(self.topics.values()):
            try:
                await topic.close()
            except Exception:
                log.exception("closing topic %s failed", topic.path)
        self.topics.clear()
        if self._lease is not None:
            try:
                await self._lease.revoke()
            except Exception as exc:  # noqa: BLE001
                log.warning("cannot revoke lease: %s", exc)
        if self._cache is not None:
            await self._cache.stop()
        if self._store is not None:
            await self._store.close()
        self._stopped.set()
        log.info("broker %d stopped", self.broker_id)

    # ------------------------------------------------------------------ background

    def _load_report(self) -> values.LoadReport:
        cpus = os.cpu_count() or 1
        try:
            cpu = int(round(os.getloadavg()[0] / cpus * 100))
        except OSError:
            cpu = 0
        memory = 0
        with contextlib.suppress(OSError, ValueError, KeyError, ZeroDivisionError):
            info: dict[str, int] = {}
            with open("/proc/meminfo") as f:
                for line in f:
                    name, _, rest = line.partition(":")
                    info[name] = int(rest.split()[0])
            memory = int(round((info["MemTotal"] - info["MemAvailable"]) / info["MemTotal"] * 100))
        topic_list = sorted(self.topics)
        return values.LoadReport(
            resources_usage=[values.ResourceUsage("CPU", cpu), values.ResourceUsage("Memory", memory)],
            topic_list=topic_list,
            topics_len=len(topic_list),
        )

    async def _load_reporter(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._load_report_wake.wait(), self.config.load_report_interval_s)
            self._load_report_wake.clear()
            try:
                if self._lease is not None and self._lease.expired:
                    log.warning("registration lease %d expired; registering again", self._lease.id)
                    await self._register()
                await self.store.put(keys.load_report(self.broker_id), self._load_report())
            except Exception as exc:  # noqa: BLE001
                log.warning("load report failed: %s", exc)

    async def _cursor_flusher(self) -> None:
        while True:
            await asyncio.sleep(self.config.cursor_flush_interval_s)
            for topic in list(self.topics.values()):
                await topic.flush_cursors()

    # ------------------------------------------------------------------ topics

    def _assignment_topic(self, key: str) -> TopicName | None:
        rest = key.removeprefix(keys.broker_prefix(self.broker_id))
        parts = rest.split("/")
        if len(parts) != 2:
            return None
        try:
            return TopicName.parse(f"/{rest}")
        except Exception:  # noqa: BLE001
            return None

    def _on_assignment_event(self, event: WatchEvent) -> None:
        name = self._assignment_topic(event.key)
        if name is None or self._stopping:
            return
        loop = asyncio.get_running_loop()
        if event.type is WatchEventType.PUT:
            task = loop.create_task(self._load_quietly(name))
        else:
            task = loop.create_task(self.unload_topic(name))
        task.add_done_callback(lambda _t: None)

    async def _load_quietly(self, name: TopicName) -> None:
        try:
            await self.load_topic(name)
        except Exception:
            log.exception("cannot load newly assigned topic %s", name)

    def is_assigned_here(self, name: TopicName) -> bool:
        """Whether ``/cluster/brokers/{own id}/{ns}/{topic}`` exists (seed ``000`` §1.4)."""
        return self.cache.contains(keys.topic_assignment(self.broker_id, name))

    async def load_topic(self, name: TopicName) -> Topic:
        """Open ``name`` locally (idempotent): its WAL, started at the sealed state's
        ``last_committed_offset + 1`` when the WAL is empty (seed ``000`` §5.3).

        Raises:
            OSError, CorruptRecordError: the WAL cannot be opened.
        """
        path = name.path
        topic = self.topics.get(path)
        if topic is not None:
            return topic
        task = self._loading.get(path)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._open_topic(name))
            self._loading[path] = task
            task.add_done_callback(functools.partial(self._loading_done, path))
        return await asyncio.shield(task)

    def _loading_done(self, path: str, _task: asyncio.Task[Topic]) -> None:
        self._loading.pop(path, None)

    async def _open_topic(self, name: TopicName) -> Topic:
        cfg = self.config
        initial_offset = 0
        sealed_raw = self.cache.get(keys.sealed_state(name))
        if sealed_raw is not None:
            with contextlib.suppress(ValueError):
                initial_offset = values.SealedState.from_json(sealed_raw).last_committed_offset + 1
        wal = await WriteAheadLog.open(
            cfg.wal_dir / name.namespace / name.topic,
            segment_max_bytes=cfg.segment_max_bytes,
            segment_max_age_s=cfg.segment_max_age_s,
            initial_offset=initial_offset,
        )
        delivery = self.cache.get(keys.topic_delivery(name))
        topic = Topic(
            name,
            wal,
            store=self.store,
            cache=self.cache,
            delivery=delivery if isinstance(delivery, str) else values.RELIABLE,
            cursor_flush_acks=cfg.cursor_flush_acks,
        )
        self.topics[name.path] = topic
        if sealed_raw is not None:
            with contextlib.suppress(Exception):
                await self.store.delete(keys.sealed_state(name))
        try:
            await self._close_stale_producers(name)
        except MetadataStoreError as exc:  # the keys only describe producers: the topic still serves
            log.warning("topic %s: stale producer keys not closed: %s", name, exc)
        log.info("topic %s loaded, next offset %d", name, wal.next_offset)
        self._load_report_wake.set()
        return topic

    async def _close_stale_producers(self, name: TopicName) -> None:
        """Set ``status`` false on every producer key of ``name`` still marked open.

        Called when this broker loads the topic, before any producer is created on it here:
        an open producer key can only belong to an earlier owner (or an earlier run of this
        broker) whose connections are gone, the way a new leader epoch fences the old one
        (seed ``000`` §3.3 for the key). Each write is conditional on the key's
        ``mod_revision``, so a key changed meanwhile is left alone.

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        kvs, _ = await self.store.get_prefix(keys.topic_producers_prefix(name))
        for kv in kvs:
            try:
                producer = values.ProducerMetadata.from_json(kv.value)
            except ValueError:
                log.warning("ignoring malformed producer key %s", kv.key)
                continue
            if producer.status:
                closed = dataclasses.replace(producer, status=False)
                await self.store.compare_and_put(kv.key, closed, expected_mod_revision=kv.mod_revision)
                log.info("producer %d (%s) on %s marked closed: its owner is gone",
                         producer.producer_id, producer.producer_name, name)

    async def unload_topic(self, name: TopicName) -> None:
        """Stop serving ``name`` locally (its assignment was removed); its producers are closed."""
        topic = self.topics.pop(name.path, None)
        if topic is None:
            return
        for pid in [p for p, prod in self.producers.items() if prod.topic is topic]:
            producer = self.producers.pop(pid)
            with contextlib.suppress(MetadataStoreError):
                await self.store.put(keys.topic_producer(name, pid), producer.metadata(status=False))
        await topic.close()
        self._load_report_wake.set()
        log.info("topic %s unloaded", name)

    async def create_topic(self, name: TopicName, *, delivery: str = values.RELIABLE) -> bool:
        """Create ``name`` in etcd, assigned to this broker, and open it (seed ``000`` §2-§3).

        Returns:
            False if the topic already existed (then nothing is written).

        Raises:
            MetadataStoreError: etcd unreachable.
            OSError: the WAL cannot be created.
        """
        if self.cache.contains(keys.topic_root(name)):
            return False
        policy_key = keys.namespace_policy(name.namespace)
        if not self.cache.contains(policy_key):
            # Conditional: an operator's policy written (etcdctl put) just before this call may
            # not have reached the cache yet, and must not be replaced by the defaults.
            await self.store.put_if_absent(policy_key, values.NamespacePolicy())
        items: list[tuple[str, Any]] = [
            (keys.namespace_topic(name), None),
            (keys.topic_root(name), 0),
            (keys.topic_delivery(name), delivery),
            (keys.topic_assignment(self.broker_id, name), None),
        ]
        revision = await self.store.put_many(items)
        await self.cache.wait_for_revision(revision)
        await self.load_topic(name)
        log.info("topic %s created (%s)", name, delivery)
        return True

    async def topic_for(self, name: TopicName, *, create: bool = False, delivery: str = values.RELIABLE) -> Topic:
        """The local :class:`Topic` for ``name``, loading (or creating) it as needed.

        Raises:
            TopicNotFoundError: it does not exist and ``create`` is false.
            NotServedHereError: it exists but is assigned to another broker.
        """
        topic = self.topics.get(name.path)
        if topic is not None:
            return topic
        if not self.cache.contains(keys.topic_root(name)):
            if not create:
                raise TopicNotFoundError(name.path)
            await self.create_topic(name, delivery=delivery)
            return await self.load_topic(name)
        if not self.is_assigned_here(name):
            if self.assigned_broker(name) is None:
                # nobody serves it: the broker being alone in the cluster, take it.
                revision = await self.store.put(keys.topic_assignment(self.broker_id, name), None)
                await self.cache.wait_for_revision(revision)
            else:
                raise NotServedHereError(name.path, self.broker_id)
        return await self.load_topic(name)

    def served_topic(self, path: str) -> Topic:
        """The loaded topic at ``path``.

        Raises:
            NotServedHereError: this broker does not serve it (anymore).
        """
        topic = self.topics.get(path)
        if topic is None or topic.closed:
            raise NotServedHereError(path, self.broker_id)
        return topic

    def assigned_broker(self, name: TopicName) -> int | None:
        """The broker id the topic is assigned to, from ``/cluster/brokers/*/{ns}/{topic}``."""
        suffix = f"/{name.namespace}/{name.topic}"
        for key in self.cache.get_prefix(keys.BROKERS_PREFIX):
            if not key.endswith(suffix):
                continue
            broker_part = key[len(keys.BROKERS_PREFIX) : -len(suffix)]
            if broker_part.isdigit():
                return int(broker_part)
        return None

    # ------------------------------------------------------------------ producers / consumers

    def producer(self, producer_id: int) -> Producer:
        """The open producer ``producer_id``.

        Raises:
            ProducerNotFoundError: unknown or closed.
        """
        producer = self.producers.get(producer_id)
        if producer is None:
            raise ProducerNotFoundError(producer_id)
        return producer

    def new_id(self, taken: Any) -> int:
        """A random non-zero u64 not in ``taken``."""
        while True:
            candidate = secrets.randbits(64)
            if candidate and candidate not in taken:
                return candidate

    def consumer(self, consumer_id: int) -> Consumer:
        """The consumer ``consumer_id`` (possibly closed).

        Raises:
            ConsumerNotFoundError: never known, or forgotten.
        """
        consumer = self.consumers.get(consumer_id)
        if consumer is None:
            raise ConsumerNotFoundError(consumer_id)
        return consumer

    def remember_consumer(self, consumer: Consumer) -> None:
        self.consumers[consumer.id] = consumer
        while len(self.consumers) > _MAX_REMEMBERED_CLOSED_CONSUMERS:
            oldest_id, oldest = next(iter(self.consumers.items()))
            if not oldest.closed:
                self.consumers.move_to_end(oldest_id)
                break
            del self.consumers[oldest_id]

    @property
    def is_leader(self) -> bool:
        """Whether this broker holds ``/cluster/leader``."""
        return self._is_leader


__all__ = ["BrokerServer", "create_server", "load_or_create_broker_id", "write_ready_file"]
