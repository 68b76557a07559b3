"""``python -m broker``: run one broker until SIGTERM or SIGINT.

Command line (``danube_pipeline.dev.localcluster.BrokerProcess`` depends on it)::

    python -m broker [--config danube_broker.yml] [--print-config]
        --etcd-endpoints h:p[,h:p] --listen host:port [--advertised-addr host:port]
        --data-dir DIR --cluster-name NAME [--segment-max-bytes N] [--segment-max-age-s S]
        [--max-batch-bytes N] [--lease-ttl-s S] [--object-store-url URL] [--s3-endpoint-url URL]
        [--local-retention-bytes N] [--local-retention-ms MS] [--position-below-retention MODE]
        [--offset-block N] [--unavailable-range wait|skip] [--cold-read-path objects|iceberg|auto]
        [--load-manager-strategy fair|balanced|weighted_load] [--rebalance-threshold LEVEL|CV]
        [--rebalance-interval-s S] [--rebalance-cooldown-s S] [--rebalance-max-moves N]
        [--rebalance | --no-rebalance] [--load-report-interval-s S]
        [--unclean-replica-election] [--replica-replace-after-s S] [--replica-lag-max-s S]
        [--tls-cert-file PEM --tls-key-file PEM [--tls-ca-file PEM] [--tls-require-client-cert]]
        [--internal-listen host:port]
        [--auth-jwt-secret-file F | --auth-jwt-public-key-file PEM | --auth-jwt-jwks-file F]
        [--auth-jwt-issuer ISS] [--auth-jwt-audience AUD] [--auth-jwt-leeway-s S] [--auth-mtls]
        [--authorization] [--super-admin PRINCIPAL]... [--insecure]
        [--etcd-tls-ca-file PEM] [--etcd-tls-cert-file PEM --etcd-tls-key-file PEM]
        [--etcd-user NAME] [--etcd-password-file F]
        [--metrics-listen host:port [--no-metrics-per-topic]]
        [--ready-file PATH] [--log-level INFO] [--log-format text|json]

Every setting can also come from the ``--config`` YAML file; flags override the ``DANUBE_*``
variables, which override the file (``broker/config_file.py``). A non-loopback ``--listen``
without TLS and authentication is refused (exit 2) unless ``--insecure`` is given."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from danube_pipeline import logs
from danube_pipeline.logs import LOG_FORMATS

from broker import event_loop
from broker.config import (
    DEFAULT_CLOSED_PRODUCER_TTL_S,
    DEFAULT_LISTEN,
    DEFAULT_LOAD_MANAGER_STRATEGY,
    DEFAULT_LOCAL_RETENTION_BYTES,
    DEFAULT_LOCAL_RETENTION_CHECK_S,
    DEFAULT_LOCAL_RETENTION_MS,
    DEFAULT_MAX_BATCH_BYTES,
    DEFAULT_MAX_CONSUMER_BUFFER_BYTES,
    DEFAULT_MAX_RECEIVER_QUEUE_SIZE,
    DEFAULT_MAX_STREAM_UNANSWERED_BYTES,
    DEFAULT_NONRELIABLE_BUFFER_BYTES,
    DEFAULT_NONRELIABLE_BUFFER_MESSAGES,
    DEFAULT_OBJECT_CACHE_BYTES,
    DEFAULT_OFFSET_BLOCK,
    DEFAULT_PREFETCH_BYTES,
    DEFAULT_REBALANCE_COOLDOWN_S,
    DEFAULT_REBALANCE_INTERVAL_S,
    DEFAULT_REBALANCE_MAX_MOVES,
    DEFAULT_REBALANCE_THRESHOLD,
    DEFAULT_REPLICA_LAG_MAX_S,
    DEFAULT_REPLICA_REPLACE_AFTER_S,
    DEFAULT_SEGMENT_MAX_AGE_S,
    DEFAULT_SEGMENT_MAX_BYTES,
    DEFAULT_SUBSCRIPTION_IDLE_S,
    BrokerConfig,
)
from broker.config_file import (
    build_config,
    dump_settings,
    effective_settings,
    environment_settings,
    layer,
    listen_exposure,
    load_config_file,
    metrics_exposure,
)
from broker.storage.wal.sync_thread import SYNC_THREADS, SYNCFS_MIN_FILES

if TYPE_CHECKING:
    from broker.rpc.server import BrokerServer

log = logging.getLogger("broker")


def build_parser() -> argparse.ArgumentParser:
    """The command line. No option has a default of its own: an option not given leaves the
    setting to the environment, the configuration file or :class:`BrokerConfig`'s default
    (``broker/config_file.py`` layers them)."""
    p = argparse.ArgumentParser(
        prog="python -m broker",
        usage="%(prog)s [--config FILE] [--print-config] [options]",
        description="Danube Pipeline broker",
    )
    p.add_argument("--config", default=None, metavar="FILE",
                   help="YAML configuration file (keys: BrokerConfig's field names; see "
                        "docs/danube_broker.example.yml); flags and DANUBE_* variables override it")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective configuration as YAML, secrets masked, and exit")
    p.add_argument(
        "--etcd-endpoints",
        help="comma-separated etcd host:port endpoints (default $DANUBE_ETCD_ENDPOINTS or 127.0.0.1:2379)",
    )
    p.add_argument("--listen", help=f"gRPC listen host:port; port 0 = any free port (default {DEFAULT_LISTEN}); "
                                    "a non-loopback address needs TLS and authentication, or --insecure")
    p.add_argument("--advertised-addr", help="host:port advertised to clients")
    p.add_argument("--data-dir", help="broker data directory (default $DANUBE_HOME/broker)")
    p.add_argument("--cluster-name", help="cluster name (/cluster/{name}; default danube)")
    p.add_argument("--segment-max-bytes", type=int, help=f"seal WAL segments at this size (default {DEFAULT_SEGMENT_MAX_BYTES})")
    p.add_argument("--segment-max-age-s", type=float, help=f"seal non-empty WAL segments at this age (default {DEFAULT_SEGMENT_MAX_AGE_S})")
    p.add_argument("--wal-syncfs-min-files", type=int,
                   help="make a WAL commit round of at least this many files durable with one syncfs instead of one "
                        f"fdatasync per file; 0 never, e.g. when the WAL shares a busy file system (default {SYNCFS_MIN_FILES})")
    p.add_argument("--max-batch-bytes", type=int, help=f"largest record batch a producer may send, in bytes (default {DEFAULT_MAX_BATCH_BYTES})")
    p.add_argument("--lease-ttl-s", type=int, help="TTL of the registration lease, in seconds (default 10)")
    p.add_argument("--max-receiver-queue-size", type=int,
                   help=f"largest consumer window granted, in messages (default {DEFAULT_MAX_RECEIVER_QUEUE_SIZE})")
    p.add_argument("--max-consumer-buffer-bytes", type=int,
                   help=f"batch bytes queued for one consumer stream, at most (default {DEFAULT_MAX_CONSUMER_BUFFER_BYTES})")
    p.add_argument("--max-stream-unanswered-bytes", type=int,
                   help="batch bytes one SendStream or ProduceStream may have unanswered before the broker stops reading it "
                        f"(default {DEFAULT_MAX_STREAM_UNANSWERED_BYTES})")
    p.add_argument("--closed-producer-ttl-s", type=int,
                   help=f"seconds a closed producer's etcd key is kept, at most (default {DEFAULT_CLOSED_PRODUCER_TTL_S})")
    p.add_argument("--subscription-idle-s", type=float,
                   help=f"seconds a subscription without consumers stays loaded (default {DEFAULT_SUBSCRIPTION_IDLE_S})")
    p.add_argument("--object-store-url",
                   help="object store holding the tiered segment objects, file:// or s3:// "
                        "(default $DANUBE_OBJECT_STORE_URL or file://$DANUBE_HOME/objects)")
    p.add_argument("--s3-endpoint-url", help="S3-compatible endpoint (MinIO, moto) for s3:// stores")
    p.add_argument("--s3-region", help="S3 region; credentials come from the AWS environment")
    p.add_argument("--object-cache-bytes", type=int,
                   help=f"bound of the cache of objects read back, in bytes (default {DEFAULT_OBJECT_CACHE_BYTES})")
    p.add_argument("--prefetch-bytes", type=int, help=f"object bytes a cold read fetches ahead (default {DEFAULT_PREFETCH_BYTES})")
    p.add_argument("--local-retention-bytes", type=int,
                   help="WAL bytes kept per topic once sealed segments are verified in object storage "
                        f"(default {DEFAULT_LOCAL_RETENTION_BYTES})")
    p.add_argument("--local-retention-ms", type=int,
                   help="sealed, tiered segments are deleted from the WAL once sealed this long ago "
                        f"(default {DEFAULT_LOCAL_RETENTION_MS})")
    p.add_argument("--local-retention-check-s", type=float,
                   help=f"how often local retention runs, in seconds (default {DEFAULT_LOCAL_RETENTION_CHECK_S})")
    p.add_argument("--position-below-retention", choices=("earliest", "error"),
                   help="a subscription whose position expired jumps to the earliest retained offset "
                        "(logged and counted; the default) or fails its consumers")
    p.add_argument("--offset-block", type=int,
                   help="offsets a topic's owner reserves in etcd at a time, before acknowledging them "
                        f"(default {DEFAULT_OFFSET_BLOCK})")
    p.add_argument("--unavailable-range", choices=("wait", "skip"),
                   help="at offsets a failed owner holds and nobody tiered yet, subscriptions wait (the "
                        "default), or skip them (logged and counted)")
    p.add_argument("--cold-read-path", choices=("objects", "iceberg", "auto"),
                   help="where subscriptions read offsets below the local WAL: the segment objects (the "
                        "default), the topic's Iceberg table where it holds them (iceberg), or the table "
                        "with the objects on any trouble (auto); the catalog of DANUBE_CATALOG_URI and "
                        "DANUBE_WAREHOUSE; a topic's /topics/{ns}/{topic}/read_path key overrides it")
    p.add_argument("--load-report-interval-s", type=float,
                   help="how often the load report /cluster/load/{id} is refreshed, in seconds (default 30)")
    p.add_argument("--load-manager-strategy", choices=("fair", "balanced", "weighted_load"),
                   help="how the leader scores brokers when rebalancing: topic count (fair), topics, CPU "
                        f"and memory (balanced), or also msg/s and bytes/s (weighted_load); default {DEFAULT_LOAD_MANAGER_STRATEGY}")
    p.add_argument("--rebalance-threshold",
                   help="CV of the broker scores above which topics move: conservative (0.4), balanced "
                        f"(0.3), aggressive (0.2) or a number (default {DEFAULT_REBALANCE_THRESHOLD})")
    p.add_argument("--rebalance-interval-s", type=float,
                   help=f"seconds between two looks at the load by the leader (default {DEFAULT_REBALANCE_INTERVAL_S})")
    p.add_argument("--rebalance-cooldown-s", type=float,
                   help=f"seconds without balancing moves after a round that moved topics (default {DEFAULT_REBALANCE_COOLDOWN_S})")
    p.add_argument("--rebalance-max-moves", type=int, help=f"topics moved per round, at most (default {DEFAULT_REBALANCE_MAX_MOVES})")
    p.add_argument("--rebalance", action=argparse.BooleanOptionalAction,
                   help="whether the leader moves topics to even out the load (default on)")
    p.add_argument("--unclean-replica-election", action=argparse.BooleanOptionalAction,
                   help="when no in-sync replica of a replicated topic can take it over, give it to a replica "
                        "outside the ISR (acked messages may be lost) rather than to any broker (default off)")
    p.add_argument("--replica-replace-after-s", type=float,
                   help="seconds a replica's broker stays unregistered before the leader puts that copy on "
                        f"another broker (default {DEFAULT_REPLICA_REPLACE_AFTER_S})")
    p.add_argument("--replica-lag-max-s", type=float,
                   help="seconds a follower may stay behind the owner's log end before it leaves the ISR "
                        f"(default {DEFAULT_REPLICA_LAG_MAX_S})")
    p.add_argument("--nonreliable-buffer-messages", type=int,
                   help="messages a NonReliable topic keeps in memory (the oldest are dropped beyond; "
                        f"default {DEFAULT_NONRELIABLE_BUFFER_MESSAGES})")
    p.add_argument("--nonreliable-buffer-bytes", type=int,
                   help="batch bytes a NonReliable topic keeps in memory (the oldest are dropped beyond; "
                        f"default {DEFAULT_NONRELIABLE_BUFFER_BYTES})")
    p.add_argument("--metrics-listen", metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (default: none); port 0 = any "
                        "free port; plain HTTP: a non-loopback address needs --insecure")
    p.add_argument("--metrics-per-topic", action=argparse.BooleanOptionalAction,
                   help="label metrics by topic and subscription (default), or only by namespace")
    p.add_argument("--ready-file", help="JSON file written atomically once serving")
    p.add_argument("--log-level", help="logging level (default INFO)")
    p.add_argument("--log-format", choices=LOG_FORMATS,
                   help="text lines, or one JSON object per line with broker, topic and subscription fields "
                        "(default text)")
    _add_security_flags(p)
    return p


def _add_security_flags(p: argparse.ArgumentParser) -> None:
    """TLS, authentication, authorization and etcd security. Secrets are given as files only."""
    s = p.add_argument_group("security (secrets only ever as files)")
    s.add_argument("--tls-cert-file", metavar="PEM", help="certificate chain the gRPC port serves (TLS 1.2+)")
    s.add_argument("--tls-key-file", metavar="PEM", help="private key of --tls-cert-file")
    s.add_argument("--tls-ca-file", metavar="PEM", help="CA bundle verifying client and peer-broker certificates")
    s.add_argument("--tls-require-client-cert", action=argparse.BooleanOptionalAction,
                   help="refuse clients without a certificate signed by --tls-ca-file")
    s.add_argument("--internal-listen", metavar="HOST:PORT",
                   help="second port for broker-to-broker calls only: mutual TLS with the brokers' "
                        "certificate (needs TLS, --tls-ca-file and authentication)")
    s.add_argument("--auth-jwt-secret-file", metavar="FILE", help="file holding the HS256 secret of JWT bearer tokens")
    s.add_argument("--auth-jwt-public-key-file", metavar="PEM", help="public key verifying RS256/ES256 tokens")
    s.add_argument("--auth-jwt-jwks-file", metavar="FILE", help="JWKS file of token public keys (by kid)")
    s.add_argument("--auth-jwt-issuer", help="the iss every token must carry")
    s.add_argument("--auth-jwt-audience", help="the aud every token must carry")
    s.add_argument("--auth-jwt-leeway-s", type=float, help="clock skew allowed on nbf and iat, in seconds (default 0)")
    s.add_argument("--auth-mtls", action=argparse.BooleanOptionalAction,
                   help="a verified client certificate's subject is the caller's principal")
    s.add_argument("--authorization", action=argparse.BooleanOptionalAction,
                   help="check every call against the roles bound to its principal (needs authentication)")
    s.add_argument("--super-admin", action="append", metavar="PRINCIPAL",
                   help="a principal granted everything (repeatable; replaces the file's super_admins)")
    s.add_argument("--insecure", action=argparse.BooleanOptionalAction,
                   help="allow a non-loopback --listen without TLS and authentication (a warning is logged)")
    s.add_argument("--etcd-tls-ca-file", metavar="PEM", help="CA bundle verifying etcd's certificate (etcd over TLS)")
    s.add_argument("--etcd-tls-cert-file", metavar="PEM", help="client certificate for etcd")
    s.add_argument("--etcd-tls-key-file", metavar="PEM", help="private key of --etcd-tls-cert-file")
    s.add_argument("--etcd-user", help="etcd user name")
    s.add_argument("--etcd-password-file", metavar="FILE",
                   help="file holding the etcd user's password (or $DANUBE_ETCD_PASSWORD)")


#: Options whose value is a path; made absolute against the working directory.
_PATH_OPTIONS = (
    "data_dir", "ready_file", "tls_cert_file", "tls_key_file", "tls_ca_file", "auth_jwt_secret_file",
    "auth_jwt_public_key_file", "auth_jwt_jwks_file", "etcd_tls_ca_file", "etcd_tls_cert_file",
    "etcd_tls_key_file", "etcd_password_file",
)  # fmt: skip
#: Options that are not settings.
_NOT_SETTINGS = frozenset({"config", "print_config", "super_admin", "etcd_endpoints"})


def flag_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line gives (only the options given), by field name."""
    values = {k: v for k, v in vars(args).items() if v is not None and k not in _NOT_SETTINGS}
    for name in _PATH_OPTIONS:
        if name in values:
            values[name] = Path(values[name]).resolve()
    if args.etcd_endpoints is not None:
        values["etcd_endpoints"] = [e.strip() for e in args.etcd_endpoints.split(",") if e.strip()]
    if args.super_admin is not None:
        values["super_admins"] = tuple(args.super_admin)
    return values


def parse_command_line(argv: Sequence[str] | None = None) -> tuple[BrokerConfig, argparse.Namespace, str]:
    """Parse the command line and layer it over the environment and ``--config``'s file.

    Returns:
        The configuration, the parsed options, and the log level.

    Exits (``SystemExit(2)``) on a bad option, configuration file or setting, with a one-line
    message.
    """
    p = build_parser()
    args = p.parse_args(argv)
    try:
        from_file = load_config_file(Path(args.config)) if args.config else {}
        values = layer(from_file, environment_settings(), flag_settings(args))
        log_level = str(values.get("log_level") or "INFO")
        args.log_format = str(values.get("log_format") or "text")
        if args.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format {args.log_format!r}: expected one of {', '.join(LOG_FORMATS)}")
        return build_config(values), args, log_level
    except ValueError as exc:  # ConfigFileError and InvalidNameError are ValueErrors too
        p.exit(2, f"{p.prog}: error: {exc}\n")


def parse_args(argv: Sequence[str] | None = None) -> BrokerConfig:
    """Parse the command line into a :class:`BrokerConfig` (and configure logging)."""
    config, _, log_level = parse_command_line(argv)
    _configure_logging(log_level)
    return config


def _configure_logging(log_level: str, log_format: str = "text") -> None:
    # every line carries the broker's id (``broker``: null until the id is read at start)
    logs.configure(log_level, log_format, process_fields={"broker": None})


async def run(config: BrokerConfig) -> None:
    """Start a broker and serve until SIGTERM/SIGINT, then shut down gracefully."""
    from broker.rpc.server import BrokerServer  # not for --print-config or a refused start

    SYNC_THREADS.syncfs_min_files = config.wal_syncfs_min_files
    broker = BrokerServer(config)
    logs.set_process_fields(broker=broker.broker_id)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop_requested.set)
    lag = event_loop.LoopLagRecorder.from_environment()
    event_loop.tune_collector()  # older collections rarer (event_loop.GC_THRESHOLDS), also while topics load
    try:
        await broker.start()
        event_loop.freeze_heap()  # full collections skip the start-up heap (broker/event_loop.py)
        if lag is not None:
            lag.start()
        await stop_requested.wait()
    finally:
        if lag is not None:
            await lag.stop()
        await _stop(broker, config.shutdown_report_s)


async def _stop(broker: BrokerServer, report_s: float) -> None:
    """``broker.stop()``; if it is still running after ``report_s`` seconds, log every task's
    stack once (ERROR) and go on waiting: a stop that hangs says what it waits for."""
    stopping = asyncio.create_task(broker.stop(), name="broker-stop")
    done, _ = await asyncio.wait({stopping}, timeout=report_s)
    if not done:
        log.error("broker stop still running after %.0f s; the tasks it may wait for:\n%s",
                  report_s, event_loop.describe_tasks())
    await stopping


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``danube-broker``).

    Returns:
        0 after a clean stop (or ``--print-config``), 1 when the broker failed, 2 when it
        refuses to listen on a non-loopback address without TLS and authentication (and no
        ``--insecure``), 130 on Ctrl-C.
    """
    config, args, log_level = parse_command_line(argv)
    if args.print_config:
        sys.stdout.write(dump_settings(effective_settings(config, log_level=log_level)))
        return 0
    _configure_logging(log_level, args.log_format)
    exposure = listen_exposure(config)
    if exposure is not None and not config.insecure:
        print(
            f"python -m broker: error: refusing to listen on {config.listen} ({exposure}): a non-loopback "
            "address needs TLS (--tls-cert-file/--tls-key-file) and authentication (a --auth-jwt-* key "
            "or --auth-mtls), or --insecure",
            file=sys.stderr,
        )
        return 2
    if exposure is not None:
        log.warning("INSECURE: serving %s on non-loopback address %s (--insecure)", exposure, config.listen)
    metrics_exposed = metrics_exposure(config)
    if metrics_exposed is not None and not config.insecure:
        print(
            f"python -m broker: error: refusing to serve metrics on {config.metrics_listen} ({metrics_exposed}; "
            "they name every topic and subscription): use a loopback address, or --insecure",
            file=sys.stderr,
        )
        return 2
    if metrics_exposed is not None:
        log.warning("INSECURE: serving metrics %s on non-loopback address %s (--insecure)",
                    metrics_exposed, config.metrics_listen)
    try:
        event_loop.raise_open_files_limit()  # a WAL per topic holds files open
        event_loop.run(run(config))  # uvloop when installed (broker/event_loop.py)
    except KeyboardInterrupt:
        return 130
    except Exception:
        log.exception("broker failed")
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
