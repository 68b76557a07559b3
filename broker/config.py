"""Run-time configuration of one broker process (``python -m broker ...``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from danube_pipeline import settings

DEFAULT_SEGMENT_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_SEGMENT_MAX_AGE_S = 60.0
DEFAULT_LISTEN = "127.0.0.1:6650"
DEFAULT_MAX_BATCH_BYTES = 16 * 1024 * 1024


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
        ready_file: JSON ``{"broker_id", "broker_addr", "pid"}`` written once serving.
        lease_ttl_s: TTL of the registration lease (§1.2).
        load_report_interval_s: how often ``/cluster/load/{id}`` is refreshed (§1.6).
        cursor_flush_interval_s: subscription cursors are persisted at least this often (§3.5).
        cursor_flush_acks: ... or after this many acks.
        shutdown_grace_s: grace period for in-flight RPCs on shutdown.
        max_batch_bytes: largest record batch a producer may send, in bytes.
        grpc_max_message_bytes: gRPC max send/receive message size, in bytes.
    """

    data_dir: Path
    etcd_endpoints: list[str] = field(default_factory=settings.etcd_endpoints)
    listen: str = DEFAULT_LISTEN
    advertised_addr: str | None = None
    cluster_name: str = "danube"
    segment_max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES
    segment_max_age_s: float = DEFAULT_SEGMENT_MAX_AGE_S
    ready_file: Path | None = None
    lease_ttl_s: int = 10
    load_report_interval_s: float = 30.0
    cursor_flush_interval_s: float = 5.0
    cursor_flush_acks: int = 1000
    shutdown_grace_s: float = 5.0
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES
    grpc_max_message_bytes: int = 64 * 1024 * 1024

    @property
    def wal_dir(self) -> Path:
        """``data_dir/wal``: one sub-directory per ``{ns}/{topic}``."""
        return self.data_dir / "wal"
