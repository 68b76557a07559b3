"""Authentication and authorization against real brokers (``broker/rpc/auth.py``): a refusal
per known flaw, roles and bindings in etcd followed live, and the audit line.

The brokers are started by :class:`BrokerProcess`: ``python -m broker``'s own parsing and
``run``, with the security settings applied to the :class:`~broker.config.BrokerConfig` it
builds (the launcher below), so the test does not depend on how they are spelt on the command
line.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import string
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import eventually
from test_tokens import hmac_signed, unsigned
from tls_certs import CertAuthority, Pair

from danube_pipeline.auth import mint_token
from danube_pipeline.client import DanubeClient
from danube_pipeline.dev.localcluster import BrokerProcess, etcdctl_binary
from danube_pipeline.format.batches import BatchBuilder
from danube_pipeline.error_codec import ERROR_CLASS_METADATA_KEY
from danube_pipeline.errors import AuthenticationError, PermissionDeniedError
from danube_pipeline.metadata import keys
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

SECRET = b"integration-secret-integration-secret-42"
ISSUER = "danube-test"
AUDIENCE = "danube"
SALES = "/sales/orders"
OTHER = "/other/events"


@pytest.fixture
def hs256_broker(start_secure: Callable[..., BrokerProcess], tmp_path: Path) -> BrokerProcess:
    secret_file = tmp_path / "jwt.secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)
    return start_secure(
        auth_jwt_secret_file=str(secret_file), auth_jwt_issuer=ISSUER, auth_jwt_audience=AUDIENCE,
        auth_jwt_leeway_s=5, authorization=True, super_admins=["root"],
    )


def token(principal: str, **kwargs: Any) -> str:
    kwargs.setdefault("issuer", ISSUER)
    kwargs.setdefault("audience", AUDIENCE)
    return mint_token(principal, SECRET, **kwargs)


def bearer(tok: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {tok}"),)


def etcdctl(endpoints: list[str], *args: str) -> None:
    subprocess.run(
        [etcdctl_binary(), f"--endpoints={','.join(endpoints)}", *args],
        check=True, capture_output=True, timeout=30, env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
    )


def grant(endpoints: list[str]) -> None:
    """Roles ``writer`` and ``reader``; ``app-writer`` and ``app-reader`` bound in namespace ``sales``."""
    etcdctl(endpoints, "put", keys.security_role("writer"), json.dumps({"permissions": ["produce", "lookup"]}))
    etcdctl(endpoints, "put", keys.security_role("reader"), json.dumps({"permissions": ["consume", "lookup"]}))
    etcdctl(endpoints, "put", keys.security_binding("app-writer", "namespaces/sales"), json.dumps({"roles": ["writer"]}))
    etcdctl(endpoints, "put", keys.security_binding("app-reader", "namespaces/sales"), json.dumps({"roles": ["reader"]}))


def error_class(exc: grpc.aio.AioRpcError) -> str | None:
    return dict(exc.trailing_metadata() or ()).get(ERROR_CLASS_METADATA_KEY)


async def cluster_metadata(address: str, metadata: tuple[tuple[str, str], ...] = ()) -> pb.ClusterMetadataResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        response: pb.ClusterMetadataResponse = await pb_grpc.DiscoveryStub(channel).ClusterMetadata(
            pb.ClusterMetadataRequest(), metadata=metadata, timeout=10
        )
    return response


def audit_lines(broker: BrokerProcess) -> list[dict[str, Any]]:
    out = []
    for line in broker.log_path.read_text(errors="replace").splitlines():
        _, sep, rest = line.partition(" danube.audit: ")
        if sep:
            out.append(json.loads(rest))
    return out


async def test_every_bad_token_is_unauthenticated_and_leaks_nothing(hs256_broker: BrokerProcess) -> None:
    address = hs256_broker.address
    now = time.time()
    none_alg = unsigned({"sub": "root", "iss": ISSUER, "aud": AUDIENCE, "exp": int(now) + 60})
    refused = {
        "no token": (),
        "expired": bearer(token("root", ttl_s=-1)),
        "nbf in the future": bearer(token("root", not_before_s=now + 120)),
        "wrong issuer": bearer(token("root", issuer="evil")),
        "wrong audience": bearer(token("root", audience="elsewhere")),
        "bad signature": bearer(mint_token("root", b"not-the-secret-not-the-secret-0000000", issuer=ISSUER,
                                           audience=AUDIENCE)),
        "alg none": bearer(none_alg),
        "not bearer": (("authorization", "Basic cm9vdDpyb290"),),
        "garbage": bearer("a.b.c"),
    }
    for what, metadata in refused.items():
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await cluster_metadata(address, metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, what
        assert error_class(info.value) == "AuthenticationError", what
        details = info.value.details() or ""
        assert SECRET.decode() not in details and (not metadata or metadata[0][1].split()[-1] not in details), what
    # within the leeway nbf is fine; a valid token is answered; health needs no token
    assert (await cluster_metadata(address, bearer(token("root", not_before_s=now + 2)))).cluster_name == "danube"
    async with grpc.aio.insecure_channel(address) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    # a token that expires after the client connected: the next call is refused, typed (the
    # broker's verified-token cache never outlives exp)
    async with DanubeClient([address], metadata_retries=0, token=token("root", ttl_s=2)) as client:
        await client.admin.list_topics("sales")
        await asyncio.sleep(2.1)
        with pytest.raises(AuthenticationError, match="expired"):
            await client.admin.list_topics("sales")
    refusals = [a for a in audit_lines(hs256_broker) if a["result"] == "refused"]
    assert len(refusals) >= len(refused)
    assert all(a["rpc"] == "/danube.v1.Discovery/ClusterMetadata" for a in refusals[: len(refused)])
    assert SECRET.decode() not in hs256_broker.log_path.read_text()


async def test_public_key_used_as_hmac_secret_is_refused(start_secure: Callable[..., BrokerProcess], tmp_path: Path) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (tmp_path / "jwt.pub").write_bytes(public)
    broker = start_secure(auth_jwt_public_key_file=str(tmp_path / "jwt.pub"))
    good = mint_token("bob", private, algorithm="RS256")
    assert (await cluster_metadata(broker.address, bearer(good))).cluster_name == "danube"
    now = int(time.time())
    confused = hmac_signed({"sub": "root", "exp": now + 60, "iat": now}, public)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster_metadata(broker.address, bearer(confused))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "HS256" in (info.value.details() or "")


class Raw:
    """Producer and consumer calls on one channel as one principal (its token as metadata)."""

    def __init__(self, channel: grpc.aio.Channel, principal: str) -> None:
        self.metadata = bearer(token(principal))
        self.producer = pb_grpc.ProducerServiceStub(channel)
        self.consumer = pb_grpc.ConsumerServiceStub(channel)

    async def create_producer(self, topic: str) -> int:
        request = pb.CreateProducerRequest(topic=topic, producer_name="p", request_id=uuid.uuid4().hex)
        return int((await self.producer.CreateProducer(request, metadata=self.metadata, timeout=10)).producer_id)

    async def send(self, producer_id: int, payload: bytes) -> int:
        response = await self.producer.SendBatch(batch_request(producer_id, payload), metadata=self.metadata, timeout=10)
        return int(response.first_offset)

    async def subscribe(self, topic: str) -> int:
        request = pb.SubscribeRequest(topic=topic, subscription="s", consumer_name="c", initial_position=pb.EARLIEST,
                                      request_id=uuid.uuid4().hex)
        return int((await self.consumer.Subscribe(request, metadata=self.metadata, timeout=10)).consumer_id)


def batch_request(producer_id: int, payload: bytes, sequence_id: int = 0) -> pb.SendBatchRequest:
    builder = BatchBuilder(time.time_ns() // 1000)
    builder.append(payload, timestamp_us=builder.first_timestamp_us)
    batch = builder.build(producer_id=producer_id, producer_name="p", schema_id=0, schema_version=0)
    return pb.SendBatchRequest(producer_id=producer_id, batch=batch, sequence_id=sequence_id)


async def test_roles_and_bindings_decide_every_rpc(hs256_broker: BrokerProcess, etcd_endpoints: list[str]) -> None:
    address = hs256_broker.address
    grant(etcd_endpoints)
    async with DanubeClient([address], token=token("root")) as root:
        await root.admin.create_topic(SALES)
        await root.admin.create_topic(OTHER)
    denied = grpc.StatusCode.PERMISSION_DENIED
    async with grpc.aio.insecure_channel(address) as channel:
        writer, reader = Raw(channel, "app-writer"), Raw(channel, "app-reader")
        pid = await writer.create_producer(SALES)
        assert await writer.send(pid, b"hello") == 0
        for refused in (writer.create_producer(OTHER),  # produce outside its namespace
                        writer.subscribe(SALES),  # consume with produce-only rights
                        reader.create_producer(SALES),  # produce with consume-only rights
                        reader.send(pid, b"no"),  # ... also on another's producer: checked on its topic
                        reader.subscribe(OTHER)):  # consume outside the granted namespace
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await refused
            assert info.value.code() == denied and error_class(info.value) == "PermissionDeniedError"
        cid = await reader.subscribe(SALES)
        stream = reader.consumer.Receive(pb.ReceiveRequest(consumer_id=cid), metadata=reader.metadata)
        assert (await asyncio.wait_for(stream.read(), 10)).batches[0].first_offset == 0
        await reader.consumer.Ack(pb.AckRequest(consumer_id=cid, offsets=[0]), metadata=reader.metadata, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as info:  # Ack on the subscription's topic, not the cluster
            await writer.consumer.Ack(pb.AckRequest(consumer_id=cid, offsets=[0]), metadata=writer.metadata, timeout=10)
        assert info.value.code() == denied
        stream.cancel()
    async with DanubeClient([address], token=token("app-reader")) as client:  # typed errors, no admin change
        with pytest.raises(PermissionDeniedError) as typed:
            await client.admin.delete_topic(SALES, force=True)
        assert (typed.value.principal, typed.value.permission, typed.value.resource) == (
            "app-reader", "manage_topic", f"topic {SALES}")
        with pytest.raises(PermissionDeniedError):
            await client.admin.reset_cursor(SALES, "s", earliest=True)
        with pytest.raises(PermissionDeniedError):
            await client.admin.drain_broker(address)
    async with DanubeClient([address], token=token("root")) as root:  # a super-admin may
        assert await root.admin.reset_cursor(SALES, "s", earliest=True) == 0
        assert await root.admin.delete_topic(OTHER, force=True) == [OTHER]
        assert sorted(t.topic for t in await root.admin.list_topics("sales")) == [SALES]
    async with grpc.aio.insecure_channel(address) as channel:  # a failed admin change is audited too
        with pytest.raises(grpc.aio.AioRpcError):
            await pb_grpc.AdminStub(channel).DeleteTopic(pb.DeleteTopicRequest(topic="/sales/none"),
                                                         metadata=bearer(token("root")), timeout=10)
    lines = audit_lines(hs256_broker)
    assert {"principal": "root", "rpc": "/danube.v1.Admin/DeleteTopic", "resource": "topic /sales/none",
            "result": "failed: NOT_FOUND", "via": "token"} in lines
    assert {"principal": "root", "rpc": "/danube.v1.Admin/DeleteTopic", "resource": f"topic {OTHER}",
            "result": "ok", "via": "token"} in lines
    assert any(a["principal"] == "app-reader" and a["rpc"] == "/danube.v1.Admin/DrainBroker"
               and a["result"] == "refused" for a in lines)
    assert any(a["principal"] == "app-reader" and a["rpc"] == "/danube.v1.Admin/ResetCursor"
               and a["resource"] == f"topic {SALES}" and a["result"] == "refused" for a in lines)


async def test_open_streams_and_later_calls_follow_a_removed_binding(
    hs256_broker: BrokerProcess, etcd_endpoints: list[str]
) -> None:
    address = hs256_broker.address
    grant(etcd_endpoints)
    async with grpc.aio.insecure_channel(address) as channel:
        writer, reader = Raw(channel, "app-writer"), Raw(channel, "app-reader")
        pid = await writer.create_producer(SALES)
        sends = writer.producer.SendStream(metadata=writer.metadata)
        await sends.write(batch_request(pid, b"one", sequence_id=1))
        assert (await asyncio.wait_for(sends.read(), 10)).first_offset == 0
        cid = await reader.subscribe(SALES)
        receive = reader.consumer.Receive(pb.ReceiveRequest(consumer_id=cid), metadata=reader.metadata)
        assert (await asyncio.wait_for(receive.read(), 10)).batches[0].first_offset == 0
        # both bindings go while the streams are open
        etcdctl(etcd_endpoints, "del", keys.security_binding("app-reader", "namespaces/sales"))
        etcdctl(etcd_endpoints, "del", keys.security_binding("app-writer", "namespaces/sales"))

        async def refused() -> bool:
            try:
                await reader.consumer.Ack(pb.AckRequest(consumer_id=cid, offsets=[0]), metadata=reader.metadata,
                                          timeout=10)
            except grpc.aio.AioRpcError as exc:
                return bool(exc.code() == grpc.StatusCode.PERMISSION_DENIED)
            return False

        await eventually(refused, timeout_s=5, what="calls refused once the binding is gone")
        await sends.write(batch_request(pid, b"two", sequence_id=2))  # the next batch ends the stream
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while True:
                answer = await asyncio.wait_for(sends.read(), 10)
                assert answer is not grpc.aio.EOF and not answer.HasField("error") and False, answer
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        async with DanubeClient([address], token=token("root")) as root:  # the next delivery ends Receive
            assert sorted(t.next_offset for t in await root.admin.list_topics("sales")) == [1]
        root_raw = Raw(channel, "root")
        root_pid = await root_raw.create_producer(SALES)
        assert await root_raw.send(root_pid, b"three") == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(receive.read(), 10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error_class(info.value) == "PermissionDeniedError"


async def test_a_produce_stream_authorizes_each_batch_and_a_refusal_fails_only_its_lane(
    hs256_broker: BrokerProcess, etcd_endpoints: list[str]
) -> None:
    address = hs256_broker.address
    grant(etcd_endpoints)
    async with grpc.aio.insecure_channel(address) as channel:
        writer, root = Raw(channel, "app-writer"), Raw(channel, "root")
        allowed = await writer.create_producer(SALES)
        forbidden = await root.create_producer(OTHER)  # app-writer holds nothing on /other

        def item(pid: int, lane: int, sequence_id: int, payload: bytes) -> pb.SendBatchRequest:
            request = batch_request(pid, payload, sequence_id=sequence_id)
            request.stream_id = lane
            return request

        call = writer.producer.ProduceStream(metadata=writer.metadata)
        await call.write(pb.ProduceRequest(batches=[
            item(allowed, 1, 1, b"one"), item(forbidden, 2, 1, b"x"), item(forbidden, 2, 2, b"y"),
            item(allowed, 1, 2, b"two"),
        ]))
        results: list[pb.SendBatchResponse] = []
        while len(results) < 4:
            response = await asyncio.wait_for(call.read(), 10)
            assert response is not grpc.aio.EOF
            results.extend(response.results)
        by_lane = {lane: [r for r in results if r.stream_id == lane] for lane in (1, 2)}
        assert [(r.first_offset, r.HasField("error")) for r in by_lane[1]] == [(0, False), (1, False)]
        assert [r.error.error_class for r in by_lane[2]] == ["PermissionDeniedError", "BatchNotAppendedError"]

        # The binding goes: the next batch is refused as data and the stream stays open.
        etcdctl(etcd_endpoints, "del", keys.security_binding("app-writer", "namespaces/sales"))

        async def refused() -> bool:
            lane = 10 + len(results)
            await call.write(pb.ProduceRequest(batches=[item(allowed, lane, 1, b"late")]))
            response = await asyncio.wait_for(call.read(), 10)
            results.extend(response.results)
            return bool(response.results[0].error.error_class == "PermissionDeniedError")

        await eventually(refused, timeout_s=5, interval_s=0.0, what="batches refused once the binding is gone")
        call.cancel()
    async with DanubeClient([address], token=token("root")) as client:
        topics = {t.topic: t.next_offset for t in await client.admin.list_topics("sales")}
        assert topics[SALES] == 2 + sum(1 for r in results[4:] if not r.HasField("error"))
        assert {t.topic: t.next_offset for t in await client.admin.list_topics("other")}[OTHER] == 0
    assert any(a["principal"] == "app-writer" and a["rpc"] == "/danube.v1.ProducerService/ProduceStream"
               and a["resource"] == f"topic {OTHER}" and a["result"] == "refused" for a in audit_lines(hs256_broker))


async def test_a_spoofed_internal_header_grants_nothing(hs256_broker: BrokerProcess, etcd_endpoints: list[str]) -> None:
    address = hs256_broker.address
    grant(etcd_endpoints)
    async with DanubeClient([address], token=token("root")) as root:
        await root.admin.create_topic(SALES)
    spoofed = (
        ("x-danube-internal", "true"), ("internal-broker", "true"), ("danube-internal-broker", "1"),
        ("x-broker-id", "1"), ("x-forwarded-client-cert", "CN=broker"), ("x-danube-principal", "root"),
    )
    async with grpc.aio.insecure_channel(address) as channel:
        admin = pb_grpc.AdminStub(channel)
        for metadata, code in ((spoofed, grpc.StatusCode.UNAUTHENTICATED),
                               (spoofed + bearer(token("app-reader")), grpc.StatusCode.PERMISSION_DENIED)):
            for call in (admin.DeleteTopic(pb.DeleteTopicRequest(topic=SALES, force=True), metadata=metadata, timeout=10),
                         admin.DrainBroker(pb.DrainBrokerRequest(), metadata=metadata, timeout=10)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() == code
    async with DanubeClient([address], token=token("root")) as root:
        assert [t.topic for t in await root.admin.list_topics("sales")] == [SALES]



async def test_certificates_name_principals_and_only_a_brokers_certificate_is_a_broker(
    start_secure: Callable[..., BrokerProcess], etcd_endpoints: list[str], tmp_path: Path
) -> None:
    ca = CertAuthority(tmp_path / "pki")
    server = ca.issue("broker")
    secret_file = tmp_path / "jwt.secret"
    secret_file.write_bytes(SECRET)
    broker = start_secure(
        tls_cert_file=str(server.cert_file), tls_key_file=str(server.key_file), tls_ca_file=str(ca.cert_file),
        tls_require_client_cert=True, auth_mtls=True, auth_jwt_secret_file=str(secret_file),
        auth_jwt_issuer=ISSUER, auth_jwt_audience=AUDIENCE, authorization=True, super_admins=["root"],
    )
    grant(etcd_endpoints)

    def channel(pair: Pair) -> grpc.aio.Channel:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca.cert_pem, private_key=pair.key_pem, certificate_chain=pair.cert_pem
        )
        return grpc.aio.secure_channel(broker.address, credentials)

    internal = (("x-danube-internal", "true"), ("internal-broker", "true"))
    delete = pb.DeleteTopicRequest(topic=SALES, force=True)
    async with channel(ca.issue("app-reader")) as reader_channel:
        admin = pb_grpc.AdminStub(reader_channel)
        root = bearer(token("root"))
        assert (await admin.CreateTopic(pb.CreateTopicRequest(topic=SALES), metadata=root, timeout=10)).created
        # the certificate's subject is the principal: lookup in sales granted, no admin change
        listed = await admin.ListTopics(pb.ListTopicsRequest(namespace="sales"), timeout=10)
        assert [t.topic for t in listed.topics] == [SALES]
        for metadata in ((), internal):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await admin.DeleteTopic(delete, metadata=metadata, timeout=10)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "app-reader" in (info.value.details() or "")
    async with channel(ca.issue("impostor", common_name="app-writer")) as other:
        with pytest.raises(grpc.aio.AioRpcError) as info:  # a name bound in sales, but no manage right
            await pb_grpc.AdminStub(other).DeleteTopic(delete, metadata=internal, timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # a peer with the broker's own certificate subject is a broker of the cluster
    async with channel(ca.issue("peer", common_name="broker")) as peer:
        deleted = await pb_grpc.AdminStub(peer).DeleteTopic(delete, timeout=10)
        assert list(deleted.deleted) == [SALES]
    lines = audit_lines(broker)
    assert {"principal": "broker", "rpc": "/danube.v1.Admin/DeleteTopic", "resource": f"topic {SALES}",
            "result": "ok", "via": "broker"} in lines
    assert any(a["principal"] == "app-reader" and a["result"] == "refused" and a["peer"].startswith("ipv4:127.0.0.1")
               for a in lines)


async def test_fuzzed_authorization_metadata_is_always_unauthenticated(hs256_broker: BrokerProcess) -> None:
    rng = random.Random(23)
    alphabet = string.ascii_letters + string.digits + "-_.=+/ "
    values = ["Bearer " + "".join(rng.choices(alphabet, k=rng.randint(0, 400))) for _ in range(30)]
    values += [".".join(base64.urlsafe_b64encode(rng.randbytes(rng.randint(0, 60))).decode().rstrip("=")
                        for _ in range(3)) for _ in range(10)]
    values += ["Bearer " + v for v in values[-10:]] + ["Bearer " + "a" * 9000, "bearer", "Bearer  ", "x" * 100]
    async with grpc.aio.insecure_channel(hs256_broker.address) as channel:
        discovery = pb_grpc.DiscoveryStub(channel)
        for value in values:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await discovery.ClusterMetadata(pb.ClusterMetadataRequest(), metadata=(("authorization", value),),
                                                timeout=10)
            # Past 8 KiB of metadata grpc itself may refuse the call first (its soft limit drops a
            # random share of such calls); either way the token never authenticates.
            allowed = {grpc.StatusCode.UNAUTHENTICATED}
            if len(value) > 8000:
                allowed.add(grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert info.value.code() in allowed, value
    assert (await cluster_metadata(hs256_broker.address, bearer(token("root")))).cluster_name == "danube"
