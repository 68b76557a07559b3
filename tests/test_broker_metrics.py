"""The broker's Prometheus metrics (``--metrics-listen``, :mod:`broker.metrics`) against a real
broker process: exact counts after producing and consuming, lag and unacked messages before and
after the acks, RPC totals, the registration's ``prom_exporter``, the per-namespace option, and
nothing served without the flag.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import eventually_sync
from prometheus_client.parser import text_string_to_metric_families

from danube_pipeline.auth import mint_token
from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess, etcdctl_binary
from danube_pipeline.format.batches import BATCH_HEADER_SIZE, RECORD_OVERHEAD_BYTES
from danube_pipeline.format.records import EPOCH_PREFIX_SIZE
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

from broker.__main__ import main, parse_command_line
from broker.config_file import load_config_file

N = 25
PAYLOAD = b"m" * 100
PRODUCER = "p"


def _registration(etcd_endpoints: list[str], broker_id: int) -> dict[str, Any]:
    out = subprocess.run(
        [etcdctl_binary(), f"--endpoints={','.join(etcd_endpoints)}", "get", f"/cluster/register/{broker_id}",
         "--print-value-only"],
        check=True, capture_output=True, text=True, timeout=30, env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    value: dict[str, Any] = json.loads(out.stdout)
    return value


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``url``'s exposition: ``(name, sorted labels) -> value``."""
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - a loopback test URL
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when none)."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def _metrics_broker(
    start: Callable[..., BrokerProcess], etcd_endpoints: list[str], *extra: str
) -> tuple[BrokerProcess, str]:
    broker = start(extra_args=["--metrics-listen", "127.0.0.1:0", *extra])
    url = _registration(etcd_endpoints, broker.broker_id)["prom_exporter"]
    assert isinstance(url, str) and url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    return broker, url


@pytest.mark.integration
@pytest.mark.asyncio
async def test_counts_lag_and_rpcs_after_producing_and_consuming(
    start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str]
) -> None:
    broker, url = _metrics_broker(start_broker, etcd_endpoints)
    topic, sub = "/default/metered", "s"
    b = str(broker.broker_id)
    batch_bytes = BATCH_HEADER_SIZE + len(PRODUCER) + RECORD_OVERHEAD_BYTES + len(PAYLOAD)
    async with DanubeClient([broker.address]) as client:
        async with client.producer(topic, producer_name=PRODUCER) as producer:
            for _ in range(N):
                await producer.send(PAYLOAD)  # one batch each: the ack comes before the next send
        m = _scrape(url)
        t = {"broker": b, "namespace": "default", "topic": topic}
        assert _value(m, "danube_topic_messages_in_total", **t) == N
        assert _value(m, "danube_topic_bytes_in_total", **t) == N * batch_bytes
        assert _value(m, "danube_producer_send_total", **t, result="ok") == N
        assert _value(m, "danube_producer_send_total", **t, result="error") == 0
        assert _value(m, "danube_producer_send_latency_ms_count", **t) == N
        assert _value(m, "danube_topic_message_size_bytes_count", **t) == N
        assert _value(m, "danube_topic_message_size_bytes_sum", **t) == N * batch_bytes
        assert _value(m, "danube_wal_append_total", broker=b) == N
        # on disk each batch follows its leader epoch (segment format 3)
        assert _value(m, "danube_wal_append_bytes_total", broker=b) == N * (batch_bytes + EPOCH_PREFIX_SIZE)
        assert _value(m, "danube_wal_flush_latency_ms_count", broker=b) == N  # one sync per send here
        assert _value(m, "danube_wal_group_commit_messages_sum", broker=b) == N
        assert _value(m, "danube_broker_topics_owned", broker=b) == 1
        assert _value(m, "danube_leader_election_state", broker=b) == 1
        assert _value(m, "danube_broker_state", broker=b, state="active") == 1
        assert _value(m, "danube_wal_disk_bytes", broker=b) > N * batch_bytes
        assert _value(m, "danube_wal_disk_free_bytes", broker=b) > 0
        assert _value(m, "danube_topic_active_producers", **t) == 0  # closed
        rpc = {"broker": b, "service": "danube.v1.ProducerService"}
        assert _value(m, "danube_broker_rpc_total", **rpc, method="CreateProducer", result="OK") == 1
        assert _value(m, "danube_broker_rpc_total", **rpc, method="ProduceStream") == 0  # counted when it ends
        assert _value(m, "danube_broker_rpc_duration_ms_count", **rpc, method="CreateProducer") == 1

        async with client.consumer(
            topic, subscription=sub, initial_position=InitialPosition.EARLIEST, ack_batch_size=1
        ) as consumer:
            received = [await consumer.receive(timeout_ms=10_000) for _ in range(N)]
            s = {**t, "subscription": sub}

            def all_sent() -> bool:
                return _value(_scrape(url), "danube_consumer_messages_out_total", **s) == N

            eventually_sync(all_sent, what="every message sent to the consumer")
            m = _scrape(url)
            assert _value(m, "danube_consumer_bytes_out_total", **s) == N * batch_bytes
            assert _value(m, "danube_subscription_lag_messages", **s) == N
            assert _value(m, "danube_subscription_unacked_messages", **s) == N
            assert _value(m, "danube_topic_active_consumers", **t) == 1
            assert _value(m, "danube_topic_active_subscriptions", **t) == 1
            for message in received[:10]:
                await consumer.ack(message)

            def lag_is(n: int) -> Callable[[], bool]:
                return lambda: _value(_scrape(url), "danube_subscription_lag_messages", **s) == n

            eventually_sync(lag_is(N - 10), what=f"lag {N - 10} after 10 acks")
            assert _value(_scrape(url), "danube_subscription_unacked_messages", **s) == N - 10
            for message in received[10:]:
                await consumer.ack(message)
            eventually_sync(lag_is(0), what="lag 0 after every ack")
            m = _scrape(url)
            assert _value(m, "danube_subscription_unacked_messages", **s) == 0
            assert _value(m, "danube_subscription_nack_total", **s) == 0
    consumer_rpc = {"broker": b, "service": "danube.v1.ConsumerService"}
    # the client's one ProduceStream, shared by its producers, ended with the client
    eventually_sync(lambda: _value(_scrape(url), "danube_broker_rpc_total", **rpc, method="ProduceStream") == 1,
                    what="ProduceStream counted once the client closed it")
    assert _value(m, "danube_broker_rpc_total", **consumer_rpc, method="Subscribe", result="OK") == 1
    assert _value(m, "danube_broker_rpc_total", **consumer_rpc, method="Ack", result="OK") == N


@pytest.mark.integration
@pytest.mark.asyncio
async def test_per_namespace_series_do_not_grow_with_the_topics(
    start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str]
) -> None:
    broker, url = _metrics_broker(start_broker, etcd_endpoints, "--no-metrics-per-topic")
    b = str(broker.broker_id)

    def series() -> int:
        return len([key for key in _scrape(url) if key[0].startswith(("danube_topic_", "danube_producer_"))])

    async with DanubeClient([broker.address]) as client:
        for i in range(2):
            async with client.producer(f"/default/ns-{i}", producer_name=PRODUCER) as producer:
                await producer.send(PAYLOAD)
        with_two = series()
        for i in range(2, 6):
            async with client.producer(f"/default/ns-{i}", producer_name=PRODUCER) as producer:
                await producer.send(PAYLOAD)
    m = _scrape(url)
    assert with_two > 0 and series() == with_two  # six topics, as many series as two
    assert not [key for key in m if "topic" in dict(key[1]) or "subscription" in dict(key[1])]
    assert _value(m, "danube_topic_messages_in_total", broker=b, namespace="default") == 6
    assert _value(m, "danube_broker_topics_owned", broker=b) == 6


@pytest.mark.integration
def test_no_metrics_without_the_flag(start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str]) -> None:
    broker = start_broker()
    assert _registration(etcd_endpoints, broker.broker_id)["prom_exporter"] is None
    command = " ".join(broker.command())
    assert "--metrics-listen" not in command
    listening = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True, timeout=10).stdout
    ports = [line for line in listening.splitlines() if f"pid={broker.pid}," in line]
    assert len(ports) == 1, ports  # the gRPC port only


@pytest.mark.unit
def test_the_flags_and_the_configuration_file(tmp_path: Path) -> None:
    config, _, _ = parse_command_line(["--data-dir", str(tmp_path), "--metrics-listen", "127.0.0.1:9400",
                                       "--no-metrics-per-topic"])  # fmt: skip
    assert (config.metrics_listen, config.metrics_per_topic) == ("127.0.0.1:9400", False)
    config, _, _ = parse_command_line(["--data-dir", str(tmp_path)])
    assert (config.metrics_listen, config.metrics_per_topic) == (None, True)  # off by default
    file = tmp_path / "broker.yml"
    file.write_text("metrics_listen: 127.0.0.1:9401\nmetrics_per_topic: false\n")
    assert load_config_file(file) == {"metrics_listen": "127.0.0.1:9401", "metrics_per_topic": False}
    with pytest.raises(SystemExit):
        parse_command_line(["--data-dir", str(tmp_path), "--metrics-listen", "9400"])


@pytest.mark.unit
def test_a_non_loopback_metrics_address_is_refused_without_insecure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--data-dir", str(tmp_path), "--metrics-listen", "0.0.0.0:9400"]) == 2
    assert "refusing to serve metrics on 0.0.0.0:9400" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.asyncio
async def test_authentication_and_authorization_outcomes_are_counted(
    start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str], tmp_path: Path
) -> None:
    secret = b"metrics-secret-metrics-secret-metrics-42"
    secret_file = tmp_path / "jwt.secret"
    secret_file.write_bytes(secret)
    secret_file.chmod(0o600)
    broker, url = _metrics_broker(
        start_broker, etcd_endpoints, "--auth-jwt-secret-file", str(secret_file), "--authorization",
        "--super-admin", "root",
    )  # fmt: skip

    async def create_topic(principal: str | None) -> grpc.StatusCode:
        metadata = () if principal is None else (("authorization", f"Bearer {mint_token(principal, secret)}"),)
        async with grpc.aio.insecure_channel(broker.address) as channel:
            try:
                await pb_grpc.AdminStub(channel).CreateTopic(
                    pb.CreateTopicRequest(topic="/default/auth_counted"), metadata=metadata, timeout=10
                )
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    assert await create_topic(None) == grpc.StatusCode.UNAUTHENTICATED
    assert await create_topic("nobody") == grpc.StatusCode.PERMISSION_DENIED
    assert await create_topic("root") == grpc.StatusCode.OK
    b = str(broker.broker_id)
    admin = {"broker": b, "service": "danube.v1.Admin", "method": "CreateTopic"}
    # the RPC counter is incremented once the call has ended, which may follow the client's
    # answer: scrape until the last call is counted
    eventually_sync(lambda: _value(_scrape(url), "danube_broker_rpc_total", **admin, result="OK") == 1,
                    timeout_s=10, interval_s=0.05, what="the last CreateTopic counted")  # fmt: skip
    m = _scrape(url)
    assert _value(m, "danube_auth_authentication_total", broker=b, result="deny") == 1
    assert _value(m, "danube_auth_authentication_total", broker=b, result="allow") == 2
    assert _value(m, "danube_auth_authorization_total", broker=b, result="deny") == 1
    assert _value(m, "danube_auth_authorization_total", broker=b, result="allow") == 1
    for result in ("UNAUTHENTICATED", "PERMISSION_DENIED", "OK"):
        assert _value(m, "danube_broker_rpc_total", **admin, result=result) == 1
