"""The broker process: etcd connection, the gRPC server, start and graceful stop.

:class:`BrokerServer` wires the parts together: the metadata store and cache, the broker core
(:class:`broker.core.Broker`), its membership in the cluster (:class:`broker.cluster.membership.Membership`)
and the gRPC server built by :func:`create_server` with the servicers of :mod:`broker.rpc`
(``producer_service``, ``consumer_service``, ``discovery_service``, ``admin_service``,
``schema_service``). With ``internal_listen`` a second server with the same services serves
the other brokers only, over mutual TLS (:func:`broker.rpc.tls.internal_server_credentials`).

Start: connect to etcd and load the cache, bind and start the gRPC server, join the cluster
(registration, state, leader candidacy, load report), load the topics assigned here, report
healthy and write the ready file. Stop: report not serving, mark ``draining``, end consumer
streams, stop the gRPC server with a grace period, close producers and topics (cursors stored,
WALs synced), leave the cluster (the lease is revoked).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from danube_pipeline.errors import BrokerIdUnreadableError
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.schemas.registry import SchemaRegistry
from danube_pipeline.storage.identity import check_store_identity

from broker.config import DEFAULT_MAX_STREAM_UNANSWERED_BYTES, BrokerConfig
from broker.core import Broker
from broker.cluster.leader import LeaderDuties
from broker.cluster.membership import Membership
from broker.cluster.rebalance import ClientUnloader, Rebalancer
from broker.metrics.exporter import BrokerMetricsEndpoint, start_metrics
from broker.metrics.interceptor import metrics_interceptors
from broker.rpc.admin_service import AdminServicer
from broker.rpc.auth import auth_interceptors
from broker.rpc.consumer_service import ConsumerServicer
from broker.rpc.discovery_service import DiscoveryServicer
from broker.rpc.producer_service import ProducerServicer
from broker.rpc.schema_service import SchemaRegistryServicer
from broker.rpc.replication_service import ReplicationServicer
from broker.rpc.status import tolerant_handler
from broker.rpc.tls import (
    ReloadingCertificates,
    broker_tls_files,
    etcd_security,
    internal_server_credentials,
    server_credentials,
)
from broker.storage.wal.segment import fsync_dir, make_dirs_durable
from broker.tasks import spawn

log = logging.getLogger(__name__)

PRODUCER_SERVICE = "danube.v1.ProducerService"
"""The health service name that turns ``NOT_SERVING`` while the WAL disk is full."""


MAX_PENDING_CALLS = 10_000
"""Calls arrived and not yet picked up by the server beyond which gRPC core starts rejecting
new ones at random (``grpc.server.max_pending_requests``; gRPC's default is 1,000). grpc.aio's
server picks calls up one at a time on the event loop, so a burst outruns it: with the default,
1,000 consumers closing at once had some of their last ``Ack`` and ``CloseConsumer`` calls
rejected, which the client sees as ``CANCELLED`` for a call the broker never ran. A call
waiting holds its headers and at most its HTTP/2 stream window of data."""

MAX_PENDING_CALLS_HARD_LIMIT = 20_000
"""Pending calls beyond which every new one is rejected
(``grpc.server.max_pending_requests_hard_limit``; gRPC's default is 3,000)."""


BROKER_ID_FILE = "broker_id"
"""The file in ``data_dir`` holding the broker's id: one decimal u64 (1 to 2**64 - 1) and a newline."""


def load_or_create_broker_id(data_dir: Path) -> int:
    """The broker id kept in ``data_dir/broker_id``: a random u64 created on first start.

    Only a missing file creates an id. It is written durably before it is used (a temporary
    file, synced, renamed into place, then the directory synced), so a power cut cannot leave
    the broker without the id its topics' metadata names. A file that exists but holds no
    valid id is never replaced: with a new id, the broker would take its own topics over as a
    failed broker's.

    Raises:
        BrokerIdUnreadableError: the file exists but cannot be read, is empty, or does not
            hold a decimal u64 above 0.
        OSError: a new id cannot be written or synced.
    """
    path = data_dir / BROKER_ID_FILE
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        return _create_broker_id(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise BrokerIdUnreadableError(str(path), f"cannot be read: {exc}") from exc
    value = text.strip()
    if not value:
        raise BrokerIdUnreadableError(str(path), "it is empty")
    if not value.isdigit() or not 0 < int(value) < 2**64:
        raise BrokerIdUnreadableError(str(path), f"{value[:40]!r} is not a decimal u64 above 0")
    return int(value)


def _create_broker_id(path: Path) -> int:
    """Write a new random id to ``path`` durably and return it.

    Raises:
        OSError: the id cannot be written or synced.
    """
    broker_id = secrets.randbits(64) or 1
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        data = f"{broker_id}\n".encode("ascii")
        if os.write(fd, data) != len(data):
            raise OSError(f"short write of {tmp}")  # a cut id would read as another valid id
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
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
    broker: Broker,
    address: str,
    *,
    health_servicer: health.aio.HealthServicer,
    cluster_name: str,
    max_message_bytes: int,
    max_unanswered_bytes: int = DEFAULT_MAX_STREAM_UNANSWERED_BYTES,
    credentials: grpc.ServerCredentials | None = None,
    brokers_only: bool = False,
) -> tuple[aio.Server, int]:
    """Build the gRPC server with every Danube service and health, bound to ``address``.

    Args:
        broker: the broker core the servicers act on.
        address: ``host:port``; port 0 binds any free port.
        health_servicer: the ``grpc.health.v1`` servicer to expose.
        cluster_name: answered by ``Discovery.ClusterMetadata``.
        max_message_bytes: gRPC send and receive limit per message, in bytes.
        max_unanswered_bytes: per ``SendStream`` or ``ProduceStream``, batch bytes received and not answered, at most.
        credentials: TLS credentials of the port (:func:`broker.rpc.tls.server_credentials`);
            ``None`` serves plaintext.
        brokers_only: the broker-to-broker port (``internal_listen``): every call but health
            needs a peer broker's verified certificate (:class:`broker.rpc.auth.AuthInterceptor`).

    Returns:
        The (not yet started) server and the bound port.

    Raises:
        RuntimeError: if the address cannot be bound.
    """
    server = aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
            ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS_HARD_LIMIT),
        ],
        interceptors=[*metrics_interceptors(), *auth_interceptors(broker, brokers_only=brokers_only)],
    )
    servicers: dict[str, object] = {
        "danube.v1.ProducerService": ProducerServicer(broker, max_unanswered_bytes=max_unanswered_bytes),
        "danube.v1.ConsumerService": ConsumerServicer(broker),
        "danube.v1.Discovery": DiscoveryServicer(broker, cluster_name),
        "danube.v1.Admin": AdminServicer(broker),
        "danube.v1.SchemaRegistry": SchemaRegistryServicer(broker),
        "danube.v1.Replication": ReplicationServicer(broker),
    }
    server.add_generic_rpc_handlers(
        tuple(tolerant_handler(pb.DESCRIPTOR.services_by_name[name.rpartition(".")[2]], servicer)
              for name, servicer in servicers.items())
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise RuntimeError(f"cannot bind {address}")
    return server, port


class BrokerServer:
    """One broker process. Use ``await start()`` then ``await wait_closed()``; ``await stop()``
    shuts down gracefully.

    Attributes:
        config: the configuration.
        broker_id: the u64 id persisted in ``data_dir/broker_id``.
        advertised_addr: ``host:port`` clients use (known after :meth:`start`).
        port: the bound gRPC port (known after :meth:`start`).
        certificates: when TLS is on, the reloader of the served certificate (after
            :meth:`start`; :mod:`broker.rpc.tls`).
        internal_addr: ``host:port`` of the broker-to-broker port other brokers call
            (``internal_listen``'s host, or the advertised host for a wildcard, and the bound
            port), registered as ``internal_addr`` (``docs/etcd-layout.md`` §1.2); ``None``
            without ``internal_listen``.

    Raises:
        BrokerIdUnreadableError: at construction, ``data_dir/broker_id`` exists but holds no
            valid id (:func:`load_or_create_broker_id`); the broker must not start.
        OSError: at construction, the data directory or a new id cannot be made durable.
    """

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        make_dirs_durable(config.data_dir)
        self.broker_id = load_or_create_broker_id(config.data_dir)
        self.advertised_addr = ""
        self.port = 0
        self._store: MetadataStore | None = None
        self._cache: LocalCache | None = None
        self._broker: Broker | None = None
        self._membership: Membership | None = None
        self._leader_duties: LeaderDuties | None = None
        self._rebalancer: Rebalancer | None = None
        self._server: aio.Server | None = None
        self._metrics: BrokerMetricsEndpoint | None = None
        self.certificates: ReloadingCertificates | None = None
        self.internal_addr: str | None = None
        self._internal_server: aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._stopping = False
        self._stopped = asyncio.Event()

    @property
    def broker(self) -> Broker:
        """The broker core (after :meth:`start`)."""
        assert self._broker is not None, "broker not started"
        return self._broker

    async def start(self) -> None:
        """Connect to etcd, bind and start the gRPC server, join the cluster, load assigned topics.

        Raises:
            MetadataStoreError: etcd unreachable.
            ObjectStoreMismatchError: the object store is not the cluster's
                (:mod:`danube_pipeline.storage.identity`).
            RuntimeError: the listen address cannot be bound.
            OSError: a TLS or etcd credential file cannot be read.
            ValueError: the TLS key does not match its certificate, or TLS settings are
                incomplete (:func:`broker.rpc.tls.server_credentials`).
        """
        cfg = self.config
        credentials = internal_credentials = None
        if cfg.tls:  # before etcd: unreadable certificate files are a configuration error
            credentials, self.certificates = server_credentials(cfg)
        if cfg.internal_listen is not None:
            internal_credentials, _ = internal_server_credentials(cfg)
        elif cfg.authentication and not cfg.tls_require_client_cert:
            log.warning(
                "authentication is on but no port verifies client certificates (no --internal-listen, "
                "no --tls-require-client-cert): calls from other brokers (forwarded deletions, dead "
                "letters, unloads) will be refused"
            )
        store = self._store = await MetadataStore.connect(cfg.etcd_endpoints, security=etcd_security(cfg))
        cache = self._cache = LocalCache(store, prefixes=("/",))
        await cache.start()
        membership: Membership | None = None
        self._metrics = start_metrics(
            cfg, self.broker_id, broker=lambda: self._broker, rebalancer=lambda: self._rebalancer,
            is_leader=lambda: self._membership is not None and self._membership.is_leader,
        )
        broker = self._broker = Broker(
            cfg,
            self.broker_id,
            store=store,
            cache=cache,
            registry=SchemaRegistry(store, cache=cache),
            on_topics_changed=lambda: membership.topics_changed() if membership else None,
            on_storage_full=self._storage_changed,
        )
        # before serving or joining: a broker on another object store than the assets' must not start
        await check_store_identity(store, broker.objects, who=f"broker {self.broker_id}")
        await self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        serve = functools.partial(
            create_server,
            broker,
            health_servicer=self._health,
            cluster_name=cfg.cluster_name,
            max_message_bytes=cfg.grpc_max_message_bytes,
            max_unanswered_bytes=cfg.max_stream_unanswered_bytes,
        )
        self._server, self.port = serve(cfg.listen, credentials=credentials)
        host, _ = _split_host_port(cfg.listen)
        if cfg.advertised_addr:
            self.advertised_addr = cfg.advertised_addr
        else:
            adv_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
            self.advertised_addr = f"{adv_host}:{self.port}"
        if cfg.internal_listen is not None:
            self._internal_server, internal_port = serve(
                cfg.internal_listen, credentials=internal_credentials, brokers_only=True
            )
            internal_host, _ = _split_host_port(cfg.internal_listen)
            if internal_host in ("0.0.0.0", "::", ""):  # the advertised host, which the certificate names
                internal_host = _split_host_port(self.advertised_addr)[0]
            self.internal_addr = f"{internal_host}:{internal_port}"
            await self._internal_server.start()
        await self._server.start()
        membership = self._membership = Membership(
            broker_id=self.broker_id,
            advertised_addr=self.advertised_addr,
            cluster_name=cfg.cluster_name,
            store=store,
            cache=cache,
            lease_ttl_s=cfg.lease_ttl_s,
            load_report_interval_s=cfg.load_report_interval_s,
            topic_list=lambda: sorted(broker.topics),
            traffic=lambda: {path: (t.wal.record_count, t.wal.byte_count) for path, t in broker.topics.items()},
            internal_addr=self.internal_addr,
            prom_exporter=self._metrics.url if self._metrics is not None else None,
        )
        duties = self._leader_duties = LeaderDuties(
            store, cache, lambda: membership.leader_epoch if membership else None, failover_grace_s=cfg.lease_ttl_s,
            unclean_replica_election=cfg.unclean_replica_election, replica_replace_after_s=cfg.replica_replace_after_s,
        )
        broker.set_state = membership.set_state
        broker.loader.owner_session = membership  # owners stop acking on a stale lease
        membership.on_leadership = lambda _leader: duties.wake()
        duties.start()
        if cfg.rebalance:

            async def owner_address(topic: str) -> str:
                return (await broker.lookup(TopicName.parse(topic))).peer_address

            unloader = ClientUnloader(self.advertised_addr, tls_files=broker_tls_files(cfg), owner_address=owner_address)
            self._rebalancer = Rebalancer(
                store, cache, duties.epoch, duties=duties, unload=unloader,
                strategy=cfg.load_manager_strategy, threshold=cfg.rebalance_cv_threshold,
                interval_s=cfg.rebalance_interval_s, cooldown_s=cfg.rebalance_cooldown_s,
                max_moves=cfg.rebalance_max_moves,
            )
            self._rebalancer.start()
        await membership.join()
        await broker.start()
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(PRODUCER_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        if cfg.ready_file is not None:
            write_ready_file(
                cfg.ready_file,
                {"broker_id": self.broker_id, "broker_addr": self.advertised_addr, "pid": os.getpid()},
            )
        log.info(
            "broker %d serving on %s (advertised %s), %d topics loaded",
            self.broker_id, cfg.listen, self.advertised_addr, len(broker.topics),
        )
        if self.internal_addr is not None:
            log.info("broker %d serving brokers only on %s (registered %s)",
                     self.broker_id, cfg.internal_listen, self.internal_addr)

    def _storage_changed(self, full: bool) -> None:
        """Show a full WAL disk in health: ``danube.v1.ProducerService`` is ``NOT_SERVING``
        while appends are refused (reads, and the overall status, go on)."""
        if self._stopping:
            return
        status = health_pb2.HealthCheckResponse.NOT_SERVING if full else health_pb2.HealthCheckResponse.SERVING
        spawn(self._health.set(PRODUCER_SERVICE, status), name="health:producer")

    async def wait_closed(self) -> None:
        """Return once :meth:`stop` has finished."""
        await self._stopped.wait()

    async def stop(self) -> None:
        """Graceful shutdown (idempotent); see the module docstring for the steps."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        log.info("broker %d shutting down", self.broker_id)
        with contextlib.suppress(Exception):
            await self._health.enter_graceful_shutdown()
        if self._rebalancer is not None:  # no new move once stopping
            await self._rebalancer.stop()
        if self._broker is not None and self._broker.topics and self._broker.other_active_brokers():
            # Hand the topics over cleanly rather than leave them to a failover (§5.3).
            try:
                async with asyncio.timeout(self.config.shutdown_grace_s):
                    await self._broker.drain()
            except Exception as exc:  # noqa: BLE001 - the rest is failed over by the leader
                log.warning("broker %d: releasing its topics before shutdown failed: %s", self.broker_id, exc)
        if self._membership is not None:
            await self._membership.mark_draining("shutdown")
        if self._broker is not None:
            self._broker.end_consumer_streams()
        if self._server is not None:
            await self._server.stop(self.config.shutdown_grace_s)
        if self._internal_server is not None:
            await self._internal_server.stop(self.config.shutdown_grace_s)
        if self._broker is not None:
            await self._broker.close()
        if self._leader_duties is not None:
            await self._leader_duties.stop()
        if self._membership is not None:
            await self._membership.leave()
        if self._cache is not None:
            await self._cache.stop()
        if self._store is not None:
            await self._store.close()
        if self._metrics is not None:
            self._metrics.close()
        self._stopped.set()
        log.info("broker %d stopped", self.broker_id)


__all__ = ["BROKER_ID_FILE", "BrokerServer", "create_server", "load_or_create_broker_id", "write_ready_file"]
