"""The broker-to-broker port (``--internal-listen``) in a cluster whose clients use tokens only.

Two real brokers serve TLS without requiring client certificates and take HS256 bearer
tokens; each also serves a broker-to-broker port that requires a certificate of the cluster's
CA with the brokers' subject. Covered: the port is registered as ``internal_addr`` in
``/cluster/register/{id}``; a partitioned topic deleted through one broker is deleted on the
other (``Admin.DeleteTopic`` forwarded to the internal port, audited there as a broker's
call); on the internal port a client with a valid token but no certificate, one with a
certificate of the cluster's CA for another subject, and one whose certificate has the
brokers' subject but comes from another CA are all refused, while a broker certificate alone
is served; the leader's rebalancer moves topics by unloading them through the internal port;
the rebalancer's unloader (:class:`~broker.cluster.rebalance.ClientUnloader`)
presents a certificate replaced on disk at its next call (the serial the peer audits changes).
``internal_listen`` is refused without TLS, a CA and authentication; a token-only broker
without it warns once that broker-to-broker calls will be refused, and registers Danube's four
fields only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from danube_pipeline.admin.namespaces import update_namespace_policy
from danube_pipeline.auth import mint_token
from danube_pipeline.client import DanubeClient
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.partitions import partition_names
from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

from broker.cluster.rebalance import ClientUnloader
from broker.config import BrokerConfig
from helpers import eventually, eventually_sync, owners_of_all, topic_owners
from tls_certs import CertAuthority, Pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

SECRET = b"internal-listener-secret-internal-listener"
BROKER_SUBJECT = "danube-broker"
_AUDIT = re.compile(r"danube\.audit: (\{.*\})$")


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Any]:
    """The cluster's CA, two broker certificates with one subject, a client certificate;
    another CA issuing a certificate with the brokers' subject."""
    ca = CertAuthority(tmp_path / "pki", "danube-ca")
    other = CertAuthority(tmp_path / "pki-other", "other-ca")
    return {
        "ca": ca,
        "broker1": ca.issue("broker-1", common_name=BROKER_SUBJECT),
        "broker2": ca.issue("broker-2", common_name=BROKER_SUBJECT),
        "alice": ca.issue("alice"),
        "spoof": other.issue("spoof", common_name=BROKER_SUBJECT),
    }


def _secured(pki: dict[str, Any], name: str, tmp_path: Path) -> list[str]:
    """Broker flags: TLS with ``pki[name]`` (no client certificates required), HS256 tokens,
    an internal port."""
    secret_file = tmp_path / "jwt.secret"
    if not secret_file.exists():
        secret_file.write_bytes(SECRET)
        secret_file.chmod(0o600)
    pair: Pair = pki[name]
    return [
        "--tls-cert-file", str(pair.cert_file), "--tls-key-file", str(pair.key_file),
        "--tls-ca-file", str(pki["ca"].cert_file), "--auth-jwt-secret-file", str(secret_file),
        "--internal-listen", "127.0.0.1:0",
    ]  # fmt: skip


@pytest.fixture
def brokers(pki: dict[str, Any], start_broker: Callable[..., BrokerProcess], tmp_path: Path) -> list[BrokerProcess]:
    """Two brokers: TLS (no client certificates required), HS256 tokens, an internal port."""
    return [start_broker(extra_args=[*_secured(pki, name, tmp_path), "--no-rebalance"]) for name in ("broker1", "broker2")]


def _client(broker: BrokerProcess, pki: dict[str, Any]) -> DanubeClient:
    return DanubeClient([broker.address], tls_ca_file=pki["ca"].cert_file, token=mint_token("alice", SECRET))


async def _internal_addrs(meta: MetadataStore, brokers: list[BrokerProcess]) -> dict[int, str]:
    """``broker_id -> internal_addr`` from the registrations (§1.2)."""
    out = {}
    for b in brokers:
        kv = await meta.get(keys.broker_register(b.broker_id))
        assert kv is not None and isinstance(kv.value, dict)
        out[b.broker_id] = kv.value["internal_addr"]
    return out


def _audit_lines(broker: BrokerProcess, rpc: str) -> list[dict[str, Any]]:
    lines = []
    for line in broker.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
        match = _AUDIT.search(line)
        if match:
            entry = json.loads(match.group(1))
            if entry["rpc"] == rpc:
                lines.append(entry)
    return lines


async def test_a_deletion_is_forwarded_to_the_owners_internal_port(
    brokers: list[BrokerProcess], pki: dict[str, Any], etcd_endpoints: list[str]
) -> None:
    parent = TopicName.parse("/default/spread")
    parts = [p.path for p in partition_names(parent, 6)]
    async with _client(brokers[0], pki) as client, await MetadataStore.connect(etcd_endpoints) as meta:
        internal = await _internal_addrs(meta, brokers)
        assert all(internal[b.broker_id] not in ("", b.address) for b in brokers), internal
        assert await client.admin.create_topic(parent.path, partitions=len(parts))

        owners = await owners_of_all(meta, parts)
        assert {owners[p] for p in parts} == {b.broker_id for b in brokers}, owners
        # The first broker deletes the second broker's partitions through its internal port.
        assert sorted(await client.admin.delete_topic(parent.path)) == sorted(parts)
        remaining = await topic_owners(meta)
        assert not any(p in remaining for p in parts), remaining
    forwarded = _audit_lines(brokers[1], "/danube.v1.Admin/DeleteTopic")
    assert forwarded and all(e["via"] == "broker" and e["principal"] == BROKER_SUBJECT for e in forwarded), forwarded
    assert {e["result"] for e in forwarded} == {"ok"}


async def test_the_leaders_unloads_go_to_the_internal_port(
    pki: dict[str, Any], start_broker: Callable[..., BrokerProcess], tmp_path: Path, etcd_endpoints: list[str]
) -> None:
    rebalancing = ["--rebalance-interval-s", "1", "--rebalance-cooldown-s", "1", "--rebalance-threshold",
                   "aggressive", "--load-report-interval-s", "1"]
    first = start_broker(extra_args=[*_secured(pki, "broker1", tmp_path), *rebalancing])
    topics = [f"/default/even-{i}" for i in range(4)]
    async with _client(first, pki) as client, await MetadataStore.connect(etcd_endpoints) as meta:
        for topic in topics:
            await client.admin.create_topic(topic)
        await eventually(lambda: _all_owned(meta, topics), timeout_s=20, what="every topic has an owner")
        second = start_broker(extra_args=[*_secured(pki, "broker2", tmp_path), *rebalancing])

        async def even() -> bool:
            owners = await topic_owners(meta)
            counts = [sum(owners.get(t) == b.broker_id for t in topics) for b in (first, second)]
            return counts == [2, 2]

        await eventually(even, timeout_s=30, what="the leader moved two topics to the second broker")
    # The leader (the first broker) released its topics through its own internal port. The new
    # owner may claim a topic before the unload's handler returns and writes its line: wait for both.
    eventually_sync(lambda: len(_audit_lines(first, "/danube.v1.Admin/UnloadTopic")) >= 2, timeout_s=10,
                    what="two unloads in the leader's audit log")
    unloads = _audit_lines(first, "/danube.v1.Admin/UnloadTopic")
    assert all(e["via"] == "broker" and e["result"] == "ok" for e in unloads), unloads


async def _metadata_call(address: str, credentials: grpc.ChannelCredentials, token: str | None) -> pb.ClusterMetadataResponse:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    async with grpc.aio.secure_channel(address, credentials) as channel:
        response: pb.ClusterMetadataResponse = await pb_grpc.DiscoveryStub(channel).ClusterMetadata(
            pb.ClusterMetadataRequest(), metadata=metadata, timeout=5
        )
        return response


def _credentials(pki: dict[str, Any], pair: Pair | None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=pki["ca"].cert_pem,
        private_key=pair.key_pem if pair else None,
        certificate_chain=pair.cert_pem if pair else None,
    )


async def test_the_internal_port_serves_brokers_only(
    brokers: list[BrokerProcess], pki: dict[str, Any], etcd_endpoints: list[str]
) -> None:
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        address = (await _internal_addrs(meta, brokers))[brokers[0].broker_id]
    token = mint_token("alice", SECRET)
    # A broker's certificate alone is served (the control).
    served = await _metadata_call(address, _credentials(pki, pki["broker2"]), None)
    assert len(served.brokers) == 2
    # A valid token without a certificate: the handshake needs a client certificate.
    with pytest.raises(grpc.aio.AioRpcError) as no_cert:
        await _metadata_call(address, _credentials(pki, None), token)
    assert no_cert.value.code() == grpc.StatusCode.UNAVAILABLE
    # A certificate of the cluster's CA for another subject, with a valid token.
    with pytest.raises(grpc.aio.AioRpcError) as not_a_broker:
        await _metadata_call(address, _credentials(pki, pki["alice"]), token)
    assert not_a_broker.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "brokers only" in (not_a_broker.value.details() or "")
    # The brokers' subject, but signed by another CA.
    with pytest.raises(grpc.aio.AioRpcError) as spoofed:
        await _metadata_call(address, _credentials(pki, pki["spoof"]), None)
    assert spoofed.value.code() == grpc.StatusCode.UNAVAILABLE
    # The same token is served on the main port.
    async with _client(brokers[0], pki) as client:
        assert len((await client.admin.cluster_metadata()).brokers) == 2


async def test_the_unloader_presents_a_rotated_certificate_at_its_next_call(
    brokers: list[BrokerProcess], pki: dict[str, Any], etcd_endpoints: list[str]
) -> None:
    ca: CertAuthority = pki["ca"]
    first = ca.issue("unloader", common_name=BROKER_SUBJECT)
    created = ["/default/moved-a", "/default/moved-b", "/default/moved-c"]
    async with _client(brokers[0], pki) as client, await MetadataStore.connect(etcd_endpoints) as meta:
        for topic in created:
            await client.admin.create_topic(topic)
        internal = await _internal_addrs(meta, brokers)

        async def owner_address(topic: str) -> str:
            owner = (await topic_owners(meta)).get(topic)
            assert owner is not None, topic
            return internal[owner]

        await eventually(lambda: _all_owned(meta, created), timeout_s=20, what="every topic has an owner")
        owners = await topic_owners(meta)
        # two topics of one owner: the second call goes to the same address, over a new channel
        topics = next([t, u] for t in created for u in created if t < u and owners[t] == owners[u])
        unloader = ClientUnloader(brokers[0].address, tls_files=(ca.cert_file, first.cert_file, first.key_file),
                                  owner_address=owner_address)
        try:
            await unloader(topics[0])
            second = ca.issue("unloader", common_name=BROKER_SUBJECT)  # the same files, replaced
            assert second.serial != first.serial
            await unloader(topics[1])
            assert unloader.channels.reopened == 1
        finally:
            await unloader.close()
    by_id = {b.broker_id: b for b in brokers}
    seen = {}
    for topic in topics:
        lines = [e for e in _audit_lines(by_id[owners[topic]], "/danube.v1.Admin/UnloadTopic") if e["resource"] == f"topic {topic}"]
        assert len(lines) == 1 and lines[0]["result"] == "ok" and lines[0]["via"] == "broker", lines
        seen[topic] = lines[0]["cert_serial"]
    assert seen == {topics[0]: format(first.serial, "x"), topics[1]: format(second.serial, "x")}


async def _all_owned(meta: MetadataStore, topics: list[str]) -> bool:
    owners = await topic_owners(meta)
    return all(t in owners for t in topics)


async def test_internal_listen_needs_tls_a_ca_and_authentication(tmp_path: Path, pki: dict[str, Any]) -> None:
    pair: Pair = pki["broker1"]
    tls: dict[str, Any] = {"tls_cert_file": pair.cert_file, "tls_key_file": pair.key_file}
    secret: dict[str, Any] = {"auth_jwt_secret_file": tmp_path / "jwt.secret"}
    cases: list[dict[str, Any]] = [{}, {**tls, **secret}, {**tls, "tls_ca_file": pki["ca"].cert_file}]
    for settings in cases:
        with pytest.raises(ValueError, match="internal_listen needs"):
            BrokerConfig(data_dir=tmp_path, internal_listen="127.0.0.1:0", **settings)
    config = BrokerConfig(data_dir=tmp_path, internal_listen="127.0.0.1:0", tls_ca_file=pki["ca"].cert_file,
                          **tls, **secret)
    assert config.internal_listen == "127.0.0.1:0"


async def test_without_a_port_verifying_certificates_the_broker_warns_once(
    pki: dict[str, Any], start_broker: Callable[..., BrokerProcess], tmp_path: Path, etcd_endpoints: list[str]
) -> None:
    secret_file = tmp_path / "jwt.secret"
    secret_file.write_bytes(SECRET)
    pair: Pair = pki["broker1"]
    broker = start_broker(extra_args=[
        "--tls-cert-file", str(pair.cert_file), "--tls-key-file", str(pair.key_file),
        "--tls-ca-file", str(pki["ca"].cert_file), "--auth-jwt-secret-file", str(secret_file),
    ])
    log_text = broker.log_path.read_text(encoding="utf-8")
    assert log_text.count("calls from other brokers (forwarded deletions, dead letters, unloads) will be refused") == 1
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        kv = await meta.get(keys.broker_register(broker.broker_id))
    assert kv is not None and isinstance(kv.value, dict)
    assert list(kv.value) == ["admin_addr", "advertised_addr", "broker_addr", "prom_exporter"]  # no internal_addr


async def test_followers_fetch_the_owners_log_over_the_internal_port(
    brokers: list[BrokerProcess], pki: dict[str, Any], etcd_endpoints: list[str]
) -> None:
    """At replication factor 2 and ``min_insync_replicas`` 2 a producer is acked only once the
    follower fetched its batch: over the owner's internal port, with the follower's broker
    certificate (``Replication.FetchLog``, mutual TLS)."""
    async with _client(brokers[0], pki) as client, await MetadataStore.connect(etcd_endpoints) as meta:
        await update_namespace_policy(meta, "default", {"replication_factor": 2, "min_insync_replicas": 2})
        await client.admin.create_topic("/default/copied")
        async with client.producer("/default/copied", producer_name="p") as producer:
            offsets = [int(await producer.send(f"m{i}".encode())) for i in range(20)]
        assert offsets == list(range(20))
        described = await client.admin.describe_topic("/default/copied")
        assert sorted(described.isr) == sorted(b.broker_id for b in brokers)
        assert described.high_watermark == 20
        assert [f.log_end_offset for f in described.followers] == [20]
