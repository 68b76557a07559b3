"""Run-time configuration of one broker process (``python -m broker ...``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from danube_pipeline import settings
from danube_pipeline.metadata.values import COLD_READ_PATHS
from danube_pipeline.names import validate_cluster_name

from broker.cluster.load_manager import RebalanceAggressiveness, Strategy
from broker.storage.wal.sync_thread import SYNCFS_MIN_FILES
from broker.cluster.replicas import DEFAULT_REPLICA_REPLACE_AFTER_S as DEFAULT_REPLICA_REPLACE_AFTER_S

DEFAULT_SEGMENT_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_REPLICA_LAG_MAX_S = 10.0
DEFAULT_SEGMENT_MAX_AGE_S = 60.0
DEFAULT_LISTEN = "127.0.0.1:6650"
DEFAULT_MAX_BATCH_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_RECEIVER_QUEUE_SIZE = 10_000
DEFAULT_MAX_CONSUMER_BUFFER_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_STREAM_UNANSWERED_BYTES = 64 * 1024 * 1024
DEFAULT_CLOSED_PRODUCER_TTL_S = 60
DEFAULT_SUBSCRIPTION_IDLE_S = 60.0
DEFAULT_LOCAL_RETENTION_BYTES = 1024 * 1024 * 1024
DEFAULT_LOCAL_RETENTION_MS = 60 * 60 * 1000
DEFAULT_LOCAL_RETENTION_CHECK_S = 5.0
DEFAULT_OBJECT_CACHE_BYTES = 64 * 1024 * 1024
DEFAULT_PREFETCH_BYTES = 16 * 1024 * 1024
DEFAULT_OFFSET_BLOCK = 100_000
DEFAULT_NONRELIABLE_BUFFER_MESSAGES = 100_000
DEFAULT_NONRELIABLE_BUFFER_BYTES = 64 * 1024 * 1024
DEFAULT_LOAD_MANAGER_STRATEGY = "fair"
DEFAULT_REBALANCE_THRESHOLD = "balanced"
DEFAULT_REBALANCE_INTERVAL_S = 30.0
DEFAULT_REBALANCE_COOLDOWN_S = 60.0
DEFAULT_REBALANCE_MAX_MOVES = 5


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """Everything a broker needs to start.

    Attributes:
        etcd_endpoints: etcd ``host:port`` endpoints.
        listen: gRPC listen address ``host:port``; port 0 binds any free port.
        advertised_addr: ``host:port`` clients are told to use; default the listen host
            (``127.0.0.1`` for a wildcard host) and the bound port.
        data_dir: where the broker keeps its id and WALs (``data_dir/wal/{ns}/{topic}/``).
        cluster_name: written as ``/cluster/{cluster_name}`` (``docs/etcd-layout.md`` §1.1).
        segment_max_bytes: the active WAL segment is sealed at this size.
        segment_max_age_s: a non-empty active segment is sealed after this many seconds.
        wal_syncfs_min_files: a WAL commit round of at least this many files on one file system
            is made durable by one ``syncfs`` instead of one ``fdatasync`` per file; 0 never
            (``broker/storage/wal/sync_thread.py``; process-wide, set by ``python -m broker``).
            ``syncfs`` also writes back the rest of that file system's dirty data: set 0 when
            the WAL shares a busy file system.
        ready_file: JSON ``{"broker_id", "broker_addr", "pid"}`` written once serving.
        lease_ttl_s: TTL of the registration lease (§1.2).
        load_report_interval_s: how often ``/cluster/load/{id}`` is refreshed (§1.6).
        cursor_flush_interval_s: subscription cursors are persisted at least this often (§3.5).
        cursor_flush_acks: ... or after this many acks.
        shutdown_grace_s: grace period for in-flight RPCs on shutdown.
        shutdown_report_s: a stop still running after this many seconds logs every task's
            stack at ERROR, once, and goes on waiting (what it waits for, for whoever kills it).
        max_batch_bytes: largest record batch a producer may send, in bytes.
        grpc_max_message_bytes: gRPC max send/receive message size, in bytes.
        max_receiver_queue_size: the largest consumer window granted, in messages; a larger
            ``receiver_queue_size`` asked for in ``Subscribe`` is lowered to it.
        max_consumer_buffer_bytes: batch bytes queued for one consumer's ``Receive`` stream
            and not yet sent, at most (dispatch to it pauses above; one batch always fits).
        max_stream_unanswered_bytes: batch bytes one ``SendStream`` or ``ProduceStream`` may have received and not
            answered yet; the broker stops reading that stream above it (gRPC flow control
            then holds the producer back).
        closed_producer_ttl_s: a closed producer's key (``status: false``) is deleted this many
            seconds after the close, at the latest (``docs/etcd-layout.md`` §3.3).
        subscription_idle_s: a subscription without consumers is unloaded from memory after
            this many seconds (its cursor is stored first; its etcd keys stay).
        object_store_url: the object store the tiering assets write segment objects to
            (``file://`` or ``s3://``), read for offsets no longer in the local WAL.
        object_store_options: fsspec storage options for it (S3 endpoint, credentials,
            region).
        object_cache_bytes: bound of the broker's cache of objects read back, in bytes.
        prefetch_bytes: how many bytes of the following objects a cold read fetches ahead.
        local_retention_bytes: a topic's WAL keeps at most this many bytes on disk, counting
            only sealed segments already verified in object storage as deletable (the topic's
            ``/topics/{ns}/{topic}/local_retention`` key overrides it, ``docs/etcd-layout.md``
            §3.6).
        local_retention_ms: ... and deletes such segments once sealed this long ago.
        local_retention_check_s: how often local retention runs.
        position_below_retention: ``"earliest"`` (a subscription whose position expired jumps
            to the earliest retained offset, logged and counted) or ``"error"`` (its consumers
            get ``PositionBelowRetentionError``).
        offset_block: offsets a topic's owner reserves in etcd per transaction before it
            acknowledges them (``docs/etcd-layout.md`` §5.4); a broker taking a topic over from
            a failed owner starts past the failed owner's block.
        cold_read_path: where subscriptions read offsets below the local WAL
            (``docs/etcd-layout.md`` §3.10; the topic's ``/topics/{ns}/{topic}/read_path`` key
            overrides it): ``"objects"`` (the segment objects, the default), ``"iceberg"``
            (the topic's Iceberg table wherever it holds the offsets with their raw bytes,
            the objects elsewhere; a table that fails to read is retried) or ``"auto"`` (the
            table where it holds them, the objects on any trouble). The table is opened in
            the catalog of ``DANUBE_CATALOG_URI``, ``DANUBE_WAREHOUSE`` and
            ``DANUBE_CATALOG_NAME`` (:mod:`danube_pipeline.settings`).
        unavailable_range: what a subscription does at an unavailable range (a failed owner's
            offsets not in object storage, §5.5): ``"wait"`` until they are tiered, or
            ``"skip"`` them (logged and counted in ``skipped_unavailable``).
        load_manager_strategy: how the leader's rebalancer scores brokers: ``fair`` (topic
            count), ``balanced`` (topics, CPU, memory) or ``weighted_load`` (adds msg/s and
            bytes/s); ``broker/cluster/load_manager/``.
        rebalance_threshold: the coefficient of variation of the brokers' scores above which
            topics move: ``conservative`` (0.4), ``balanced`` (0.3), ``aggressive`` (0.2), or a
            number as a string (e.g. ``"0.25"``); see :attr:`rebalance_cv_threshold`.
        rebalance_interval_s: while leader, the broker looks at the load every this many
            seconds (``docs/etcd-layout.md`` §1.8).
        rebalance_cooldown_s: after a round that moved topics, no balancing move for this many
            seconds.
        rebalance_max_moves: at most this many topics move per round.
        rebalance: whether the leader rebalances at all.
        unclean_replica_election: when no in-sync replica of a replicated topic can take it
            over (``docs/etcd-layout.md`` §5.9), the leader gives it to a registered replica
            outside the ISR, logging a warning that acked messages may be lost (Kafka's
            ``unclean.leader.election.enable``); off (the default): to any active broker, whose
            takeover records the unavailable range (§5.5).
        replica_replace_after_s: the leader replaces a replica (§1.9) whose broker stayed
            unregistered this many seconds with an active broker not yet holding one.
        replica_lag_max_s: an owner removes a follower from a replicated topic's ISR (§5.9)
            once it has not reached the owner's log end for this many seconds (Kafka's
            ``replica.lag.time.max.ms``); producers wait meanwhile.
        nonreliable_buffer_messages: messages a ``NonReliable`` topic keeps in memory, at
            most; the oldest are dropped beyond (``broker/storage/memory_log.py``).
        nonreliable_buffer_bytes: ... and batch bytes, at most.
        tls_cert_file: PEM certificate chain the gRPC port serves (TLS 1.2+); ``None`` serves
            plaintext. Reloaded from the file without a restart.
        tls_key_file: PEM private key of ``tls_cert_file``.
        tls_ca_file: PEM CA bundle that verifies client certificates (and peer brokers'
            certificates for broker-to-broker calls, which are always mutual TLS under TLS).
        tls_require_client_cert: refuse clients without a certificate signed by ``tls_ca_file``.
        internal_listen: ``host:port`` of a second gRPC port for broker-to-broker calls only
            (forwarded deletions, dead letters, the rebalancer's unloads), ``None`` for none. It
            always requires and verifies client certificates against ``tls_ca_file`` and serves
            only peers whose certificate carries this broker's own certificate subject, so a
            cluster whose clients authenticate with tokens alone still runs its brokers over
            mutual TLS. Advertised as ``internal_addr`` in ``/cluster/register/{id}``
            (``docs/etcd-layout.md`` §1.2); needs TLS, ``tls_ca_file`` and authentication.
        auth_jwt_secret_file: file holding the HS256 shared secret of JWT bearer tokens.
        auth_jwt_public_key_file: PEM public key verifying RS256 or ES256 tokens.
        auth_jwt_jwks_file: a JWKS file of public keys (selected by the token's ``kid``).
        auth_jwt_issuer: the ``iss`` every token must carry (``None``: tokens need none).
        auth_jwt_audience: the ``aud`` every token must carry (``None``: tokens need none).
        auth_jwt_leeway_s: clock skew allowed on ``nbf`` and ``iat`` only, in seconds; ``exp``
            is never extended.
        auth_mtls: a verified client certificate's subject is the caller's principal.
        authorization: check every RPC against the roles bound to its principal (deny what is
            not granted); needs authentication.
        super_admins: principals granted everything.
        insecure: allow a non-loopback listen address without TLS and authentication (a
            warning is logged at every start).
        etcd_tls_ca_file: PEM CA bundle verifying etcd's certificate; etcd over TLS when set.
        etcd_tls_cert_file: client certificate for etcd (mutual TLS), with ``etcd_tls_key_file``.
        etcd_tls_key_file: its private key.
        etcd_user: etcd user name (etcd authentication); the password comes from
            ``etcd_password_file`` or ``DANUBE_ETCD_PASSWORD``, never from the command line.
        etcd_password_file: file holding the etcd user's password.
        metrics_listen: ``host:port`` serving Prometheus metrics at ``/metrics``
            (:mod:`broker.metrics`); ``None`` (the default) serves none. Port 0 binds any free
            port. Advertised as ``prom_exporter`` in ``/cluster/register/{id}``
            (``docs/etcd-layout.md`` §1.2). Plain HTTP without authentication: a non-loopback
            address needs ``insecure``.
        metrics_per_topic: label metric series by topic and subscription; ``False`` aggregates
            them per namespace (no ``topic`` or ``subscription`` label).

    Raises:
        InvalidNameError: ``cluster_name`` breaks the cluster-name grammar.
        ValueError: a size, count or duration is not positive.
    """

    data_dir: Path
    etcd_endpoints: list[str] = field(default_factory=settings.etcd_endpoints)
    listen: str = DEFAULT_LISTEN
    advertised_addr: str | None = None
    cluster_name: str = "danube"
    segment_max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES
    segment_max_age_s: float = DEFAULT_SEGMENT_MAX_AGE_S
    wal_syncfs_min_files: int = SYNCFS_MIN_FILES
    ready_file: Path | None = None
    lease_ttl_s: int = 10
    load_report_interval_s: float = 30.0
    cursor_flush_interval_s: float = 5.0
    cursor_flush_acks: int = 1000
    shutdown_grace_s: float = 5.0
    shutdown_report_s: float = 30.0
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES
    grpc_max_message_bytes: int = 64 * 1024 * 1024
    max_receiver_queue_size: int = DEFAULT_MAX_RECEIVER_QUEUE_SIZE
    max_consumer_buffer_bytes: int = DEFAULT_MAX_CONSUMER_BUFFER_BYTES
    max_stream_unanswered_bytes: int = DEFAULT_MAX_STREAM_UNANSWERED_BYTES
    closed_producer_ttl_s: int = DEFAULT_CLOSED_PRODUCER_TTL_S
    subscription_idle_s: float = DEFAULT_SUBSCRIPTION_IDLE_S
    object_store_url: str = field(default_factory=settings.object_store_url)
    object_store_options: dict[str, Any] = field(default_factory=dict)
    object_cache_bytes: int = DEFAULT_OBJECT_CACHE_BYTES
    prefetch_bytes: int = DEFAULT_PREFETCH_BYTES
    local_retention_bytes: int = DEFAULT_LOCAL_RETENTION_BYTES
    local_retention_ms: int = DEFAULT_LOCAL_RETENTION_MS
    local_retention_check_s: float = DEFAULT_LOCAL_RETENTION_CHECK_S
    position_below_retention: str = "earliest"
    offset_block: int = DEFAULT_OFFSET_BLOCK
    unavailable_range: str = "wait"
    cold_read_path: str = "objects"
    load_manager_strategy: str = DEFAULT_LOAD_MANAGER_STRATEGY
    rebalance_threshold: str = DEFAULT_REBALANCE_THRESHOLD
    rebalance_interval_s: float = DEFAULT_REBALANCE_INTERVAL_S
    rebalance_cooldown_s: float = DEFAULT_REBALANCE_COOLDOWN_S
    rebalance_max_moves: int = DEFAULT_REBALANCE_MAX_MOVES
    rebalance: bool = True
    unclean_replica_election: bool = False
    replica_replace_after_s: float = DEFAULT_REPLICA_REPLACE_AFTER_S
    replica_lag_max_s: float = DEFAULT_REPLICA_LAG_MAX_S
    nonreliable_buffer_messages: int = DEFAULT_NONRELIABLE_BUFFER_MESSAGES
    nonreliable_buffer_bytes: int = DEFAULT_NONRELIABLE_BUFFER_BYTES
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_ca_file: Path | None = None
    tls_require_client_cert: bool = False
    internal_listen: str | None = None
    auth_jwt_secret_file: Path | None = None
    auth_jwt_public_key_file: Path | None = None
    auth_jwt_jwks_file: Path | None = None
    auth_jwt_issuer: str | None = None
    auth_jwt_audience: str | None = None
    auth_jwt_leeway_s: float = 0.0
    auth_mtls: bool = False
    authorization: bool = False
    super_admins: tuple[str, ...] = ()
    insecure: bool = False
    etcd_tls_ca_file: Path | None = None
    etcd_tls_cert_file: Path | None = None
    etcd_tls_key_file: Path | None = None
    etcd_user: str | None = None
    etcd_password_file: Path | None = None
    metrics_listen: str | None = None
    metrics_per_topic: bool = True

    @property
    def tls(self) -> bool:
        """Whether the gRPC port serves TLS."""
        return self.tls_cert_file is not None

    @property
    def authentication(self) -> bool:
        """Whether callers must authenticate (a JWT key of any kind, or client certificates)."""
        return self.auth_mtls or any(
            f is not None for f in (self.auth_jwt_secret_file, self.auth_jwt_public_key_file, self.auth_jwt_jwks_file)
        )

    def __post_init__(self) -> None:
        validate_cluster_name(self.cluster_name)
        limits = {
            "segment_max_bytes": self.segment_max_bytes,
            "segment_max_age_s": self.segment_max_age_s,
            "lease_ttl_s": self.lease_ttl_s,
            "max_batch_bytes": self.max_batch_bytes,
            "max_receiver_queue_size": self.max_receiver_queue_size,
            "max_consumer_buffer_bytes": self.max_consumer_buffer_bytes,
            "max_stream_unanswered_bytes": self.max_stream_unanswered_bytes,
            "closed_producer_ttl_s": self.closed_producer_ttl_s,
            "subscription_idle_s": self.subscription_idle_s,
            "object_cache_bytes": self.object_cache_bytes,
            "local_retention_check_s": self.local_retention_check_s,
            "rebalance_interval_s": self.rebalance_interval_s,
            "load_report_interval_s": self.load_report_interval_s,
            "offset_block": self.offset_block,
            "nonreliable_buffer_messages": self.nonreliable_buffer_messages,
            "nonreliable_buffer_bytes": self.nonreliable_buffer_bytes,
        }
        bad = [name for name, value in limits.items() if value <= 0]
        if bad:
            raise ValueError(f"must be positive: {', '.join(bad)}")
        negative = [
            name
            for name, value in {
                "prefetch_bytes": self.prefetch_bytes,
                "wal_syncfs_min_files": self.wal_syncfs_min_files,
                "local_retention_bytes": self.local_retention_bytes,
                "local_retention_ms": self.local_retention_ms,
                "rebalance_cooldown_s": self.rebalance_cooldown_s,
                "rebalance_max_moves": self.rebalance_max_moves,
                "replica_replace_after_s": self.replica_replace_after_s,
                "replica_lag_max_s": self.replica_lag_max_s,
            }.items()
            if value < 0
        ]
        if negative:
            raise ValueError(f"must not be negative: {', '.join(negative)}")
        if self.position_below_retention not in ("earliest", "error"):
            raise ValueError("position_below_retention must be 'earliest' or 'error'")
        if self.unavailable_range not in ("wait", "skip"):
            raise ValueError("unavailable_range must be 'wait' or 'skip'")
        if self.cold_read_path not in COLD_READ_PATHS:
            raise ValueError(f"cold_read_path must be one of {', '.join(COLD_READ_PATHS)}, got {self.cold_read_path!r}")
        if self.load_manager_strategy not in {s.value for s in Strategy}:
            raise ValueError(
                f"load_manager_strategy must be one of {', '.join(s.value for s in Strategy)}, "
                f"got {self.load_manager_strategy!r}"
            )
        self.rebalance_cv_threshold  # noqa: B018 - validates rebalance_threshold
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_require_client_cert and (self.tls_ca_file is None or not self.tls):
            raise ValueError("tls_require_client_cert needs tls_cert_file, tls_key_file and tls_ca_file")
        if self.internal_listen is not None and not (self.tls and self.tls_ca_file and self.authentication):
            raise ValueError("internal_listen needs tls_cert_file, tls_key_file, tls_ca_file and authentication")
        if self.auth_mtls and not self.tls_require_client_cert:
            raise ValueError("auth_mtls needs tls_require_client_cert (a verified client certificate)")
        if self.authorization and not self.authentication:
            raise ValueError("authorization needs authentication (a JWT key or auth_mtls)")
        if self.auth_jwt_leeway_s < 0:
            raise ValueError("must not be negative: auth_jwt_leeway_s")
        if (self.etcd_tls_cert_file is None) != (self.etcd_tls_key_file is None):
            raise ValueError("etcd_tls_cert_file and etcd_tls_key_file go together")
        if self.metrics_listen is not None:
            _host, sep, port = self.metrics_listen.rpartition(":")
            if not sep or not port.isdigit() or int(port) > 65535:
                raise ValueError(f"metrics_listen must be host:port, got {self.metrics_listen!r}")

    @property
    def rebalance_cv_threshold(self) -> float:
        """``rebalance_threshold`` as a coefficient of variation: a named level's value
        (:data:`broker.cluster.load_manager.CV_THRESHOLDS`) or the number itself.

        Raises:
            ValueError: neither a level nor a finite number >= 0.
        """
        name = self.rebalance_threshold.strip().lower()
        if name in {a.value for a in RebalanceAggressiveness}:
            return RebalanceAggressiveness(name).threshold
        try:
            value = float(name)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                "rebalance_threshold must be conservative, balanced, aggressive or a number >= 0, "
                f"got {self.rebalance_threshold!r}"
            )
        return value

    @property
    def wal_dir(self) -> Path:
        """``data_dir/wal``: one sub-directory per ``{ns}/{topic}``."""
        return self.data_dir / "wal"
