"""``python -m danube_pipeline.dev.localcluster``: etcd and N brokers until Ctrl-C (``make dev``)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from danube_pipeline.dev.localcluster.cluster import LocalCluster


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m danube_pipeline.dev.localcluster``: etcd and N brokers until Ctrl-C,
    SIGTERM or SIGHUP (``make dev BROKERS=N``); prints where each one listens, and stops them all when
    interrupted or when one of them exits."""
    from danube_pipeline import settings

    _, etcd_port = _split_address(settings.etcd_endpoints()[0])
    broker_host, broker_port = _split_address(settings.broker_addresses()[0])
    parser = argparse.ArgumentParser(prog="python -m danube_pipeline.dev.localcluster", description=main.__doc__)
    parser.add_argument("--brokers", type=int, default=1, help="how many brokers (default 1)")
    parser.add_argument("--home", default=None, help="state directory (default $DANUBE_HOME/dev); kept")
    parser.add_argument("--host", default=broker_host, help=f"interface to listen on (default {broker_host})")
    parser.add_argument("--etcd-port", type=int, default=etcd_port,
                        help=f"etcd client port, 0 = any free one (default {etcd_port}, from $DANUBE_ETCD_ENDPOINTS)")
    parser.add_argument("--broker-port", type=int, default=broker_port,
                        help=f"port of the first broker, the next ones count up; 0 = free ports (default {broker_port})")
    parser.add_argument("--segment-max-age-s", type=float, default=60.0, help="seal WAL segments at this age (s)")
    args = parser.parse_args(argv)
    if args.brokers < 1:
        parser.error("--brokers must be at least 1")
    home = Path(args.home).resolve() if args.home else settings.danube_home() / "dev"
    ports = [args.broker_port + i if args.broker_port else 0 for i in range(args.brokers)]
    cluster = LocalCluster(
        home,
        brokers=args.brokers,
        host=args.host,
        etcd_client_port=args.etcd_port or None,
        broker_ports=ports,
        segment_max_age_s=args.segment_max_age_s,
        broker_args=["--object-store-url", (home / "objects").as_uri()],
    )

    def interrupted(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupted)
    try:
        cluster.start()
        etcd = cluster.etcd.endpoint
        print(f"etcd        {etcd}   (.venv/bin/etcdctl --endpoints={etcd} get / --prefix --keys-only)")
        for i, broker in enumerate(cluster.brokers):
            print(f"broker {i + 1:<4} {broker.address}   id {broker.broker_id}   WAL in {broker.data_dir}")
        print(f"DANUBE_ETCD_ENDPOINTS={etcd} DANUBE_BROKER_ADDRESSES={','.join(cluster.addresses)}")
        print(f"Ctrl-C stops etcd and the {args.brokers} broker{'s' if args.brokers > 1 else ''}.", flush=True)
        while not (gone := cluster.exited()):
            time.sleep(0.5)
        print(f"{', '.join(gone)} exited (logs in {home}); stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for signum in (signal.SIGTERM, signal.SIGHUP):  # a second signal must not cut the clean-up short
            signal.signal(signum, signal.SIG_IGN)
        cluster.stop()


if __name__ == "__main__":
    raise SystemExit(main())
