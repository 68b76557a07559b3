"""``python -m broker``: run one broker until SIGTERM or SIGINT.

Command line (``danube_pipeline.dev.localcluster.BrokerProcess`` depends on it)::

    python -m broker --etcd-endpoints h:p[,h:p] --listen host:port [--advertised-addr host:port]
        --data-dir DIR --cluster-name NAME [--segment-max-bytes N] [--segment-max-age-s S]
        [--max-batch-bytes N] [--lease-ttl-s S] [--object-store-url URL] [--s3-endpoint-url URL]
        [--local-retention-bytes N] [--local-retention-ms MS] [--position-below-retention MODE]
        [--offset-block N] [--unavailable-range wait|skip]
        [--load-manager-strategy fair|balanced|weighted_load] [--rebalance-threshold LEVEL|CV]
        [--rebalance-interval-s S] [--rebalance-cooldown-s S] [--rebalance-max-moves N]
        [--rebalance | --no-rebalance] [--load-report-interval-s S]
        [--ready-file PATH] [--log-level INFO]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from danube_pipeline import settings

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
    DEFAULT_SEGMENT_MAX_AGE_S,
    DEFAULT_SEGMENT_MAX_BYTES,
    DEFAULT_SUBSCRIPTION_IDLE_S,
    BrokerConfig,
)
from broker.rpc.server import BrokerServer

log = logging.getLogger("broker")


def parse_args(argv: Sequence[str] | None = None) -> BrokerConfig:
    """Parse the command line into a :class:`BrokerConfig` (and configure logging)."""
    p = argparse.ArgumentParser(prog="python -m broker", description="Danube Pipeline broker")
    p.add_argument(
        "--etcd-endpoints",
        default=",".join(settings.etcd_endpoints()),
        help="comma-separated etcd host:port endpoints (default $DANUBE_ETCD_ENDPOINTS or 127.0.0.1:2379)",
    )
    p.add_argument("--listen", default=DEFAULT_LISTEN, help="gRPC listen host:port; port 0 = any free port")
    p.add_argument("--advertised-addr", default=None, help="host:port advertised to clients")
    p.add_argument("--data-dir", default=str(settings.danube_home() / "broker"), help="broker data directory")
    p.add_argument("--cluster-name", default="danube", help="cluster name (/cluster/{name})")
    p.add_argument("--segment-max-bytes", type=int, default=DEFAULT_SEGMENT_MAX_BYTES, help="seal WAL segments at this size")
    p.add_argument("--segment-max-age-s", type=float, default=DEFAULT_SEGMENT_MAX_AGE_S, help="seal non-empty WAL segments at this age")
    p.add_argument("--max-batch-bytes", type=int, default=DEFAULT_MAX_BATCH_BYTES, help="largest record batch a producer may send, in bytes")
    p.add_argument("--lease-ttl-s", type=int, default=10, help="TTL of the registration lease, in seconds")
    p.add_argument("--max-receiver-queue-size", type=int, default=DEFAULT_MAX_RECEIVER_QUEUE_SIZE,
                   help="largest consumer window granted, in messages")
    p.add_argument("--max-consumer-buffer-bytes", type=int, default=DEFAULT_MAX_CONSUMER_BUFFER_BYTES,
                   help="batch bytes queued for one consumer stream, at most")
    p.add_argument("--max-stream-unanswered-bytes", type=int, default=DEFAULT_MAX_STREAM_UNANSWERED_BYTES,
                   help="batch bytes one SendStream may have unanswered before the broker stops reading it")
    p.add_argument("--closed-producer-ttl-s", type=int, default=DEFAULT_CLOSED_PRODUCER_TTL_S,
                   help="seconds a closed producer's etcd key is kept, at most")
    p.add_argument("--subscription-idle-s", type=float, default=DEFAULT_SUBSCRIPTION_IDLE_S,
                   help="seconds a subscription without consumers stays loaded")
    p.add_argument("--object-store-url", default=settings.object_store_url(),
                   help="object store holding the tiered segment objects, file:// or s3:// "
                        "(default $DANUBE_OBJECT_STORE_URL or file://$DANUBE_HOME/objects)")
    p.add_argument("--s3-endpoint-url", default=None, help="S3-compatible endpoint (MinIO, moto) for s3:// stores")
    p.add_argument("--s3-region", default=None, help="S3 region; credentials come from the AWS environment")
    p.add_argument("--object-cache-bytes", type=int, default=DEFAULT_OBJECT_CACHE_BYTES,
                   help="bound of the cache of objects read back, in bytes")
    p.add_argument("--prefetch-bytes", type=int, default=DEFAULT_PREFETCH_BYTES,
                   help="object bytes a cold read fetches ahead")
    p.add_argument("--local-retention-bytes", type=int, default=DEFAULT_LOCAL_RETENTION_BYTES,
                   help="WAL bytes kept per topic once sealed segments are verified in object storage")
    p.add_argument("--local-retention-ms", type=int, default=DEFAULT_LOCAL_RETENTION_MS,
                   help="sealed, tiered segments are deleted from the WAL once sealed this long ago")
    p.add_argument("--local-retention-check-s", type=float, default=DEFAULT_LOCAL_RETENTION_CHECK_S,
                   help="how often local retention runs, in seconds")
    p.add_argument("--position-below-retention", choices=("earliest", "error"), default="earliest",
                   help="a subscription whose position expired jumps to the earliest retained offset "
                        "(logged and counted) or fails its consumers")
    p.add_argument("--offset-block", type=int, default=DEFAULT_OFFSET_BLOCK,
                   help="offsets a topic's owner reserves in etcd at a time, before acknowledging them")
    p.add_argument("--unavailable-range", choices=("wait", "skip"), default="wait",
                   help="at offsets a failed owner holds and nobody tiered yet, subscriptions wait, or "
                        "skip them (logged and counted)")
    p.add_argument("--load-report-interval-s", type=float, default=30.0,
                   help="how often the load report /cluster/load/{id} is refreshed, in seconds")
    p.add_argument("--load-manager-strategy", choices=("fair", "balanced", "weighted_load"),
                   default=DEFAULT_LOAD_MANAGER_STRATEGY,
                   help="how the leader scores brokers when rebalancing: topic count (fair), topics, CPU "
                        "and memory (balanced), or also msg/s and bytes/s (weighted_load)")
    p.add_argument("--rebalance-threshold", default=DEFAULT_REBALANCE_THRESHOLD,
                   help="CV of the broker scores above which topics move: conservative (0.4), balanced "
                        "(0.3), aggressive (0.2) or a number")
    p.add_argument("--rebalance-interval-s", type=float, default=DEFAULT_REBALANCE_INTERVAL_S,
                   help="seconds between two looks at the load by the leader")
    p.add_argument("--rebalance-cooldown-s", type=float, default=DEFAULT_REBALANCE_COOLDOWN_S,
                   help="seconds without balancing moves after a round that moved topics")
    p.add_argument("--rebalance-max-moves", type=int, default=DEFAULT_REBALANCE_MAX_MOVES,
                   help="topics moved per round, at most")
    p.add_argument("--rebalance", action=argparse.BooleanOptionalAction, default=True,
                   help="whether the leader moves topics to even out the load (default on)")
    p.add_argument("--nonreliable-buffer-messages", type=int, default=DEFAULT_NONRELIABLE_BUFFER_MESSAGES,
                   help="messages a NonReliable topic keeps in memory (the oldest are dropped beyond)")
    p.add_argument("--nonreliable-buffer-bytes", type=int, default=DEFAULT_NONRELIABLE_BUFFER_BYTES,
                   help="batch bytes a NonReliable topic keeps in memory (the oldest are dropped beyond)")
    p.add_argument("--ready-file", default=None, help="JSON file written atomically once serving")
    p.add_argument("--log-level", default="INFO", help="logging level")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    endpoints = [e.strip() for e in args.etcd_endpoints.split(",") if e.strip()]
    try:
        return BrokerConfig(
            data_dir=Path(args.data_dir).resolve(),
            etcd_endpoints=endpoints,
            listen=args.listen,
            advertised_addr=args.advertised_addr,
            cluster_name=args.cluster_name,
            segment_max_bytes=args.segment_max_bytes,
            segment_max_age_s=args.segment_max_age_s,
            max_batch_bytes=args.max_batch_bytes,
            lease_ttl_s=args.lease_ttl_s,
            max_receiver_queue_size=args.max_receiver_queue_size,
            max_consumer_buffer_bytes=args.max_consumer_buffer_bytes,
            max_stream_unanswered_bytes=args.max_stream_unanswered_bytes,
            closed_producer_ttl_s=args.closed_producer_ttl_s,
            subscription_idle_s=args.subscription_idle_s,
            object_store_url=args.object_store_url,
            object_store_options=_s3_options(args),
            object_cache_bytes=args.object_cache_bytes,
            prefetch_bytes=args.prefetch_bytes,
            local_retention_bytes=args.local_retention_bytes,
            local_retention_ms=args.local_retention_ms,
            local_retention_check_s=args.local_retention_check_s,
            position_below_retention=args.position_below_retention,
            offset_block=args.offset_block,
            unavailable_range=args.unavailable_range,
            load_report_interval_s=args.load_report_interval_s,
            load_manager_strategy=args.load_manager_strategy,
            rebalance_threshold=args.rebalance_threshold,
            rebalance_interval_s=args.rebalance_interval_s,
            rebalance_cooldown_s=args.rebalance_cooldown_s,
            rebalance_max_moves=args.rebalance_max_moves,
            rebalance=args.rebalance,
            nonreliable_buffer_messages=args.nonreliable_buffer_messages,
            nonreliable_buffer_bytes=args.nonreliable_buffer_bytes,
            ready_file=Path(args.ready_file).resolve() if args.ready_file else None,
        )
    except ValueError as exc:  # InvalidNameError is a ValueError too
        p.error(str(exc))


def _s3_options(args: argparse.Namespace) -> dict[str, object]:
    """fsspec options for an ``s3://`` object store (credentials: the AWS environment)."""
    options: dict[str, object] = {}
    if args.s3_endpoint_url:
        options["endpoint_url"] = args.s3_endpoint_url
    if args.s3_region:
        options["client_kwargs"] = {"region_name": args.s3_region}
    return options


async def run(config: BrokerConfig) -> None:
    """Start a broker and serve until SIGTERM/SIGINT, then shut down gracefully."""
    broker = BrokerServer(config)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop_requested.set)
    try:
        await broker.start()
        await stop_requested.wait()
    finally:
        await broker.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``danube-broker``)."""
    config = parse_args(argv)
    try:
        asyncio.run(run(config))
    except KeyboardInterrupt:
        return 130
    except Exception:
        log.exception("broker failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
