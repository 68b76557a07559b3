"""One etcd and N brokers on loopback (:class:`LocalCluster`), each broker with its own data
directory (:func:`broker_data_dir`) and port."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from danube_pipeline.dev.localcluster.processes import BrokerProcess, EtcdServer


def broker_data_dir(root: Path, index: int) -> Path:
    """The data directory of broker ``index`` (0-based) of a :class:`LocalCluster` in ``root``:
    ``root / "broker"`` for the first (where a one-broker ``make dev`` always kept it), then
    ``root / "broker-2"``, ``root / "broker-3"``, ..."""
    return Path(root) / ("broker" if index == 0 else f"broker-{index + 1}")


class LocalCluster:
    """One etcd and N brokers on loopback, each broker with its own data directory and port.

    etcd keeps its data in ``root / "etcd"``; broker ``i`` in :func:`broker_data_dir`. A
    broker's id lives in its data directory, so a cluster started again on the same ``root``
    comes back with the same brokers.

    Example::

        with LocalCluster(tmp_path, brokers=3) as cluster:
            async with DanubeClient(cluster.addresses) as client: ...
    """

    def __init__(
        self,
        root: Path,
        *,
        brokers: int = 1,
        host: str = "127.0.0.1",
        etcd_client_port: int | None = None,
        broker_ports: Sequence[int] | None = None,
        cluster_name: str = "danube",
        segment_max_bytes: int | None = None,
        segment_max_age_s: float | None = None,
        broker_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Args:
        root: the cluster's state directory (created if missing; reused across restarts).
        brokers: how many brokers, at least 1.
        host: interface etcd and the brokers listen on.
        etcd_client_port: etcd's client port; a free one when ``None``.
        broker_ports: one port per broker; ``0`` (the default for each) lets the broker pick a
            free one.
        cluster_name: Danube cluster name (``docs/etcd-layout.md`` §1.1).
        segment_max_bytes: seal WAL segments at this size, in bytes (broker default if None).
        segment_max_age_s: seal WAL segments at this age, in seconds (broker default if None).
        broker_args: more CLI arguments for every broker.
        env: extra environment variables for every broker.

        Raises:
            ValueError: ``brokers`` is below 1, or ``broker_ports`` does not have one port per
                broker.
        """
        if brokers < 1:
            raise ValueError(f"a cluster needs at least one broker, not {brokers}")
        ports = list(broker_ports) if broker_ports is not None else [0] * brokers
        if len(ports) != brokers:
            raise ValueError(f"{len(ports)} broker ports given for {brokers} brokers")
        self.root = Path(root)
        self.etcd = EtcdServer(self.root / "etcd", host=host, client_port=etcd_client_port)
        self.brokers = [
            BrokerProcess(
                etcd_endpoints=self.etcd.endpoints,
                data_dir=broker_data_dir(self.root, index),
                host=host,
                port=port,
                cluster_name=cluster_name,
                segment_max_bytes=segment_max_bytes,
                segment_max_age_s=segment_max_age_s,
                extra_args=broker_args,
                env=env,
            )
            for index, port in enumerate(ports)
        ]

    @property
    def addresses(self) -> list[str]:
        """Every broker's ``host:port``, in start order.

        Raises:
            RuntimeError: a broker never became ready.
        """
        return [broker.address for broker in self.brokers]

    def start(self, *, timeout_s: float = 30.0) -> None:
        """Start etcd, then the brokers one after the other, each waiting until it is ready.

        Blocking; call it from the main thread (the children follow the thread that started
        them). When one fails, everything started so far is stopped.

        Raises:
            RuntimeError: a process exited or was not ready within ``timeout_s`` (the message
                carries its log tail).
        """
        try:
            self.etcd.start(timeout_s=timeout_s)
            for broker in self.brokers:
                broker.start(timeout_s=timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the brokers (last started first), then etcd; each SIGTERM, then SIGKILL after
        a grace period. Idempotent."""
        for broker in reversed(self.brokers):
            broker.stop()
        self.etcd.stop()

    def exited(self) -> list[str]:
        """The processes that were started and are no longer running, as ``"etcd"`` or
        ``"broker N"`` (1-based)."""
        gone = ["etcd"] if self.etcd.exited else []
        return gone + [f"broker {i + 1}" for i, broker in enumerate(self.brokers) if broker.exited]

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

