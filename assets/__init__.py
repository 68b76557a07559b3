"""The Dagster code location (``assets.definitions``).

Importing this package turns gRPC's fork support off in the process and in every process it
starts (``GRPC_ENABLE_FORK_SUPPORT=false``, unless the environment already sets it), before
anything imports ``grpc``: the run workers hold gRPC channels (etcd, the broker) while PySpark
launches Spark's JVM, and PySpark launches it with ``fork`` and a ``preexec_fn``. gRPC's fork
support (atfork handlers meant for a fork that is *not* followed by ``exec``) then runs at
every such fork; with channels busy it logs ``Other threads are currently calling into gRPC,
skipping fork() handlers`` and can break the parent's poller (``epoll_wait error: Bad file
descriptor``). The JVM's child execs ``java`` at once and never calls gRPC, so it needs no
fork support. gRPC reads the variable when it is first imported, which in a run worker
(a process of its own, started with the code server's environment) is after this package;
:func:`danube_pipeline.lake.spark.session.build_spark_session` warns when it launches the JVM
in a process where gRPC was imported with fork support on.
"""

import os as _os

GRPC_FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
"""gRPC's switch for its fork handlers, read once, when ``grpc`` is first imported."""

_os.environ.setdefault(GRPC_FORK_SUPPORT_ENV, "false")
