"""TLS on the broker's gRPC port, against real etcd and real broker processes.

A broker is started by the usual command line plus TLS settings applied to its
:class:`~broker.config.BrokerConfig` (:class:`BrokerProcess`), with certificates made by
:mod:`tls_certs`. Covered: a client with the CA bundle is served (unary and streaming calls);
a plaintext client, or one trusting another CA, fails at once with ``BrokerUnavailableError``;
with ``tls_require_client_cert`` a client certificate from another CA (or none) is refused; a
certificate replaced on disk is served to new connections without a restart (a mismatched
pair meanwhile is ignored); a partitioned topic deleted through one broker is deleted on the
other over mutual TLS (``Admin.DeleteTopic`` forwarding, ``broker/topics/admin.py``);
TLS 1.0 and 1.1 are refused. The client's bearer token is seen by a recording gRPC server,
over plaintext and over TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import subprocess
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from cryptography import x509

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.client._connection import ChannelSecurity, ConnectionPool
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer, EtcdTls, etcdctl_binary
from danube_pipeline.errors import BrokerUnavailableError, MetadataStoreError
from danube_pipeline.metadata.connection import EtcdSecurity
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.partitions import partition_names
from danube_pipeline.proto import danube_pb2 as pb

from broker.cluster.rebalance import ClientUnloader
from helpers import broker_config_args, eventually, owners_of_all, topic_owners
from tls_certs import CertAuthority, Pair

pytestmark = pytest.mark.integration

@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Any]:
    """The cluster's CA with a certificate per broker and a client certificate, and another CA
    with a client certificate of its own."""
    ca = CertAuthority(tmp_path / "pki", "danube-ca")
    other = CertAuthority(tmp_path / "pki-other", "other-ca")
    return {
        "ca": ca,
        "broker1": ca.issue("broker-1"),
        "broker2": ca.issue("broker-2"),
        "client": ca.issue("client", common_name="alice"),
        "other": other,
        "other_client": other.issue("client", common_name="mallory"),
    }


@pytest.fixture
def start_tls_broker(start_secure: Callable[..., BrokerProcess]) -> Callable[..., BrokerProcess]:
    """``start_tls_broker(pair, ca, **settings)``: a TLS broker serving ``pair`` and verifying
    client certificates with ``ca``; stopped at teardown."""
    started = 0

    def factory(pair: Pair, ca: CertAuthority, **settings: Any) -> BrokerProcess:
        nonlocal started
        started += 1
        return start_secure(
            f"broker-{started}", tls_cert_file=pair.cert_file, tls_key_file=pair.key_file, tls_ca_file=ca.cert_file,
            **settings,
        )

    return factory


def _peer_certificate(address: str, ca_file: Path, *, client: Pair | None = None) -> x509.Certificate:
    """The certificate the broker at ``address`` serves to a new TLS connection."""
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context(cafile=str(ca_file))
    context.set_alpn_protocols(["h2"])
    if client is not None:
        context.load_cert_chain(str(client.cert_file), str(client.key_file))
    with socket.create_connection((host, int(port)), timeout=5) as raw, context.wrap_socket(
        raw, server_hostname=host
    ) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


async def _refused(client: DanubeClient, *, within_s: float = 10.0) -> BrokerUnavailableError:
    """Connect ``client``, expecting ``BrokerUnavailableError`` well before ``within_s``."""
    started = time.monotonic()
    with pytest.raises(BrokerUnavailableError) as info:
        await client.connect()
    assert time.monotonic() - started < within_s, "the refusal took too long"
    await client.close()
    return info.value


@pytest.mark.asyncio
async def test_a_tls_broker_serves_a_client_that_trusts_its_ca(
    pki: dict[str, Any], start_tls_broker: Callable[..., BrokerProcess]
) -> None:
    broker = start_tls_broker(pki["broker1"], pki["ca"])
    assert _peer_certificate(broker.address, pki["ca"].cert_file).serial_number == pki["broker1"].serial
    async with DanubeClient([broker.address], tls_ca_file=pki["ca"].cert_file) as client:
        await client.admin.create_topic("/default/secured")
        async with client.producer("/default/secured", producer_name="p") as producer:
            await producer.send(b"over tls")
        async with client.consumer(
            "/default/secured", subscription="s", initial_position=InitialPosition.EARLIEST
        ) as consumer:
            message = await consumer.receive(timeout_ms=10_000)
            await consumer.ack(message)
    assert message.payload == b"over tls"


@pytest.mark.asyncio
async def test_a_plaintext_client_or_one_trusting_another_ca_is_refused_at_once(
    pki: dict[str, Any], start_tls_broker: Callable[..., BrokerProcess]
) -> None:
    broker = start_tls_broker(pki["broker1"], pki["ca"])
    options: dict[str, Any] = {"request_timeout_ms": 3_000, "metadata_retries": 0}
    error = await _refused(DanubeClient([broker.address], **options))
    assert error.address == broker.address
    error = await _refused(DanubeClient([broker.address], tls_ca_file=pki["other"].cert_file, **options))
    # gRPC reports the failed verification as the connection's last error. On a loaded machine
    # that last attempt was once cut off before its verification ended, and then gRPC reports
    # "Handshake read failed (Endpoint closing)" instead: either way the TLS handshake failed.
    assert "CERTIFICATE_VERIFY_FAILED" in str(error) or "Handshake read failed" in str(error)
    async with DanubeClient([broker.address], tls_ca_file=pki["ca"].cert_file, **options) as client:
        assert (await client.admin.cluster_metadata()).brokers  # the same broker serves a client that trusts it


@pytest.mark.asyncio
async def test_a_client_certificate_from_another_ca_is_refused(
    pki: dict[str, Any], start_tls_broker: Callable[..., BrokerProcess]
) -> None:
    broker = start_tls_broker(pki["broker1"], pki["ca"], tls_require_client_cert=True)
    ca_file = pki["ca"].cert_file
    options: dict[str, Any] = {"request_timeout_ms": 3_000, "metadata_retries": 0, "tls_ca_file": ca_file}
    other: Pair = pki["other_client"]
    await _refused(DanubeClient([broker.address], tls_cert_file=other.cert_file, tls_key_file=other.key_file,
                                **options))
    await _refused(DanubeClient([broker.address], **options))  # no certificate at all
    mine: Pair = pki["client"]
    async with DanubeClient([broker.address], tls_cert_file=mine.cert_file, tls_key_file=mine.key_file,
                            **options) as client:
        assert (await client.admin.cluster_metadata()).brokers


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@pytest.mark.asyncio
async def test_a_certificate_replaced_on_disk_is_served_to_new_connections_without_a_restart(
    pki: dict[str, Any], start_tls_broker: Callable[..., BrokerProcess]
) -> None:
    ca: CertAuthority = pki["ca"]
    other: CertAuthority = pki["other"]
    served: Pair = pki["broker1"]
    broker = start_tls_broker(served, ca)
    pid = broker.pid
    options: dict[str, Any] = {"request_timeout_ms": 3_000, "metadata_retries": 0}
    # The first connection to a broker just started may be slow under load: retried (a
    # refusal below is asserted with no retries, so it comes at once).
    old_client = DanubeClient([broker.address], tls_ca_file=ca.cert_file, request_timeout_ms=10_000, metadata_retries=3)
    await old_client.connect()
    await _refused(DanubeClient([broker.address], tls_ca_file=other.cert_file, **options))

    # Half a rotation: a new certificate with the old key does not load; the old pair stays.
    rotated = other.issue("broker-1-rotated", write=False)
    _replace(served.cert_file, rotated.cert_pem)
    assert _peer_certificate(broker.address, ca.cert_file).serial_number == served.serial
    _replace(served.key_file, rotated.key_pem)  # now consistent: served from the next handshake

    def current_serial() -> int:
        return _peer_certificate(broker.address, other.cert_file).serial_number

    assert current_serial() == rotated.serial
    assert broker.pid == pid
    async with DanubeClient([broker.address], tls_ca_file=other.cert_file, **options) as client:
        assert (await client.admin.cluster_metadata()).brokers
    await _refused(DanubeClient([broker.address], tls_ca_file=ca.cert_file, **options))
    # A connection opened before the rotation keeps working.
    assert (await old_client.admin.cluster_metadata()).brokers
    await old_client.close()


@pytest.mark.asyncio
async def test_a_deletion_is_forwarded_between_two_brokers_over_mutual_tls(
    pki: dict[str, Any], start_tls_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str]
) -> None:
    brokers = [start_tls_broker(pki[name], pki["ca"], tls_require_client_cert=True) for name in ("broker1", "broker2")]
    mine: Pair = pki["client"]
    parent = TopicName.parse("/default/spread")
    parts = [p.path for p in partition_names(parent, 6)]
    async with DanubeClient(
        [brokers[0].address], tls_ca_file=pki["ca"].cert_file, tls_cert_file=mine.cert_file,
        tls_key_file=mine.key_file,
    ) as client, await MetadataStore.connect(etcd_endpoints) as meta:
        assert len((await client.admin.cluster_metadata()).brokers) == 2
        assert await client.admin.create_topic(parent.path, partitions=len(parts))

        owners = await owners_of_all(meta, parts)
        assert {owners[p] for p in parts} == {b.broker_id for b in brokers}, owners  # on both brokers
        # One broker receives the call and deletes the other broker's partitions on it.
        assert sorted(await client.admin.delete_topic(parent.path)) == sorted(parts)
        remaining = await topic_owners(meta)
        assert not any(p in remaining for p in parts), remaining


@pytest.mark.asyncio
async def test_the_rebalancers_unloader_calls_over_mutual_tls(
    pki: dict[str, Any], start_tls_broker: Callable[..., BrokerProcess]
) -> None:
    own: Pair = pki["broker1"]
    broker = start_tls_broker(own, pki["ca"], tls_require_client_cert=True)
    mine: Pair = pki["client"]
    async with DanubeClient([broker.address], tls_ca_file=pki["ca"].cert_file, tls_cert_file=mine.cert_file,
                            tls_key_file=mine.key_file) as client:
        await client.admin.create_topic("/default/moved")
    unloader = ClientUnloader(broker.address, tls_files=(pki["ca"].cert_file, own.cert_file, own.key_file))
    try:
        assert await unloader("/default/moved") == 0
    finally:
        await unloader.close()
    plaintext = ClientUnloader(broker.address, request_timeout_ms=2_000)
    try:
        with pytest.raises(BrokerUnavailableError):
            await plaintext("/default/moved")
    finally:
        await plaintext.close()


def _handshake(address: str, ca_file: Path, version: ssl.TLSVersion) -> None:
    """A TLS handshake with the broker at ``address`` offering only ``version``."""
    host, _, port = address.rpartition(":")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(str(ca_file))
    with warnings.catch_warnings():  # TLS 1.0 and 1.1 are deprecated: that is the point
        warnings.simplefilter("ignore", DeprecationWarning)
        context.minimum_version = context.maximum_version = version
    context.set_ciphers("DEFAULT:@SECLEVEL=0")  # let this OpenSSL offer the old versions at all
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=5) as raw, context.wrap_socket(
        raw, server_hostname=host
    ):
        pass


def _old_tls_server(pair: Pair) -> str:
    """A one-connection TLS server that accepts TLS 1.0 and later (the control: this machine's
    OpenSSL can offer the old versions). Returns its address."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        context.minimum_version = ssl.TLSVersion.TLSv1
    context.set_ciphers("DEFAULT:@SECLEVEL=0")
    context.load_cert_chain(str(pair.cert_file), str(pair.key_file))
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with contextlib.suppress(OSError), context.wrap_socket(conn, server_side=True):
                pass

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}"


def test_tls_before_1_2_is_refused(pki: dict[str, Any], start_tls_broker: Callable[..., BrokerProcess]) -> None:
    ca_file = pki["ca"].cert_file
    broker = start_tls_broker(pki["broker1"], pki["ca"])
    for version in (ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1):
        try:
            _handshake(_old_tls_server(pki["broker2"]), ca_file, version)
        except ssl.SSLError as exc:
            pytest.skip(f"this machine's OpenSSL cannot negotiate {version.name}: {exc}")
        with pytest.raises(ssl.SSLError) as info:
            _handshake(broker.address, ca_file, version)
        # grpc ends the handshake: an alert, or the connection closed without one.
        assert isinstance(info.value, ssl.SSLEOFError) or "PROTOCOL_VERSION" in str(info.value), info.value
    _handshake(broker.address, ca_file, ssl.TLSVersion.TLSv1_2)
    _handshake(broker.address, ca_file, ssl.TLSVersion.TLSv1_3)


# --------------------------------------------------------------------------- the client's token


class _Recorder(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc ships no type hints
    """Records the invocation metadata of every call and refuses the call."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        self.seen.append({k: v for k, v in handler_call_details.invocation_metadata})
        return None  # UNIMPLEMENTED


@pytest_asyncio.fixture
async def recorder(pki: dict[str, Any]) -> AsyncIterator[tuple[_Recorder, str, str]]:
    """A recording gRPC server on a plaintext port and a TLS port: ``(recorder, plain, tls)``."""
    handler = _Recorder()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    plain = server.add_insecure_port("127.0.0.1:0")
    pair: Pair = pki["broker1"]
    secure = server.add_secure_port(
        "127.0.0.1:0", grpc.ssl_server_credentials([(pair.key_pem, pair.cert_pem)])
    )
    await server.start()
    try:
        yield handler, f"127.0.0.1:{plain}", f"127.0.0.1:{secure}"
    finally:
        await server.stop(None)


async def _every_kind_of_call(pool: ConnectionPool, address: str) -> None:
    """A unary, a server-streaming and a bidirectional call to ``address``, each refused."""
    stubs = pool.stubs(address)
    with pytest.raises(grpc.aio.AioRpcError):
        await stubs.discovery.ClusterMetadata(pb.ClusterMetadataRequest(), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError):
        async for _ in stubs.consumer.Receive(pb.ReceiveRequest(), timeout=5):
            pass
    with pytest.raises(grpc.aio.AioRpcError):
        async for _ in stubs.producer.SendStream(iter([pb.SendBatchRequest()]), timeout=5):
            pass


@pytest.mark.asyncio
async def test_the_client_sends_its_token_on_every_kind_of_call_over_plaintext_and_tls(
    recorder: tuple[_Recorder, str, str], pki: dict[str, Any]
) -> None:
    handler, plain, secure = recorder
    ca_file = pki["ca"].cert_file
    for address, security in (
        (plain, ChannelSecurity.from_files(token="plain-token")),
        (secure, ChannelSecurity.from_files(tls_ca_file=ca_file, token="tls-token")),
    ):
        handler.seen.clear()
        pool = ConnectionPool(security=security)
        await _every_kind_of_call(pool, address)
        await pool.close()
        expected = "Bearer plain-token" if address == plain else "Bearer tls-token"
        assert [m.get("authorization") for m in handler.seen] == [expected] * 3, handler.seen
    handler.seen.clear()
    pool = ConnectionPool()  # no token: no authorization header
    await _every_kind_of_call(pool, plain)
    await pool.close()
    assert len(handler.seen) == 3 and not any("authorization" in m for m in handler.seen)


@pytest.mark.asyncio
async def test_the_client_takes_its_tls_files_and_token_from_the_environment(
    recorder: tuple[_Recorder, str, str], pki: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    handler, plain, secure = recorder
    options: dict[str, Any] = {"request_timeout_ms": 2_000, "metadata_retries": 0}
    token_file = tmp_path / "token"
    token_file.write_text("env-token\n")
    monkeypatch.setenv("DANUBE_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("DANUBE_TLS_CA_FILE", str(pki["ca"].cert_file))
    with pytest.raises(BrokerUnavailableError):  # the recorder refuses every call
        async with DanubeClient([secure], **options):
            pass
    assert handler.seen and all(m.get("authorization") == "Bearer env-token" for m in handler.seen)
    handler.seen.clear()
    with pytest.raises(BrokerUnavailableError):
        async with DanubeClient([plain], **options):  # the environment's CA: TLS to a plaintext port
            pass
    assert not handler.seen, "a TLS client reached the plaintext handler"


# --------------------------------------------------------------------------- etcd


@pytest.fixture
def tls_etcd(pki: dict[str, Any], tmp_path: Path) -> Iterator[EtcdServer]:
    """etcd serving its clients over TLS with ``broker2``'s certificate, requiring client
    certificates signed by the cluster's CA."""
    pair: Pair = pki["broker2"]
    tls = EtcdTls(pair.cert_file, pair.key_file, pki["ca"].cert_file, client_cert_auth=True)
    server = EtcdServer(tmp_path / "etcd-tls", tls=tls)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.asyncio
async def test_the_metadata_store_reaches_etcd_over_mutual_tls(tls_etcd: EtcdServer, pki: dict[str, Any]) -> None:
    mine: Pair = pki["client"]
    security = EtcdSecurity(ca_file=pki["ca"].cert_file, cert_file=mine.cert_file, key_file=mine.key_file)
    async with await MetadataStore.connect(tls_etcd.endpoints, security=security) as store:
        await store.put("/tls-probe", {"ok": True})
        assert (await store.get("/tls-probe")).value == {"ok": True}  # type: ignore[union-attr]
    with pytest.raises(MetadataStoreError):  # plaintext against the TLS port
        await MetadataStore.connect(tls_etcd.endpoints, connect_timeout_s=2)
    other: Pair = pki["other_client"]
    with pytest.raises(MetadataStoreError):  # a client certificate etcd's CA did not sign
        await MetadataStore.connect(
            tls_etcd.endpoints, connect_timeout_s=2,
            security=EtcdSecurity(ca_file=pki["ca"].cert_file, cert_file=other.cert_file, key_file=other.key_file),
        )


def test_a_broker_uses_its_etcd_tls_settings(tls_etcd: EtcdServer, pki: dict[str, Any], tmp_path: Path) -> None:
    mine: Pair = pki["client"]
    broker = BrokerProcess(
        etcd_endpoints=tls_etcd.endpoints, data_dir=tmp_path / "broker-etcd-tls",
        extra_args=broker_config_args(tmp_path / "broker-etcd-tls.yml", {
            "etcd_tls_ca_file": pki["ca"].cert_file, "etcd_tls_cert_file": mine.cert_file,
            "etcd_tls_key_file": mine.key_file,
        }),
    )  # fmt: skip
    broker.start()
    try:
        assert broker.broker_id > 0  # registered in etcd over TLS, then ready
    finally:
        broker.stop()


def _etcdctl(etcd: EtcdServer, *args: str) -> None:
    subprocess.run([etcdctl_binary(), f"--endpoints={etcd.client_url}", *args], check=True, capture_output=True,
                   timeout=30, env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"})


@pytest.mark.asyncio
async def test_etcd_user_authentication(
    own_etcd: EtcdServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _etcdctl(own_etcd, "user", "add", "root:s3cret-pw")
    _etcdctl(own_etcd, "auth", "enable")
    good = EtcdSecurity(user="root", password="s3cret-pw")
    async with await MetadataStore.connect(own_etcd.endpoints, security=good) as store:
        await store.put("/auth-probe", 1)
        assert (await store.get("/auth-probe")).value == 1  # type: ignore[union-attr]
    with pytest.raises(MetadataStoreError) as info:
        await MetadataStore.connect(own_etcd.endpoints, connect_timeout_s=2,
                                    security=EtcdSecurity(user="root", password="wrong"))
    assert "wrong" not in str(info.value)
    with pytest.raises(MetadataStoreError):  # no user: etcd refuses the request
        await MetadataStore.connect(own_etcd.endpoints, connect_timeout_s=2)
    password_file = tmp_path / "etcd-password"
    password_file.write_text("s3cret-pw\n")
    # A broker with etcd_user and etcd_password_file: its cache's watch and its lease work.
    broker = BrokerProcess(
        etcd_endpoints=own_etcd.endpoints, data_dir=tmp_path / "broker-etcd-auth",
        extra_args=broker_config_args(
            tmp_path / "broker-etcd-auth.yml", {"etcd_user": "root", "etcd_password_file": password_file}
        ),
    )
    await broker.start_async()
    try:
        async with DanubeClient([broker.address]) as client:
            await client.admin.create_topic("/default/etcd-auth")
            async with client.producer("/default/etcd-auth", producer_name="p") as producer:
                assert await producer.send(b"x") == 0
    finally:
        broker.stop()
    assert "s3cret-pw" not in (tmp_path / "broker-etcd-auth" / "broker.log").read_text()
    # From the environment: DANUBE_ETCD_USER and DANUBE_ETCD_PASSWORD_FILE.
    monkeypatch.setenv("DANUBE_ETCD_USER", "root")
    monkeypatch.setenv("DANUBE_ETCD_PASSWORD_FILE", str(password_file))
    async with await MetadataStore.connect(own_etcd.endpoints) as store:
        assert (await store.get("/auth-probe")).value == 1  # type: ignore[union-attr]
        lease = await store.grant_lease(30, keepalive=False)
        # A restarted etcd has forgotten every token: the client authenticates again.
        own_etcd.stop()
        own_etcd.start()

        async def read_again() -> bool:
            try:
                return (await store.get("/auth-probe")).value == 1  # type: ignore[union-attr]
            except MetadataStoreError as exc:
                assert "invalid auth token" not in str(exc), exc
                return False

        await eventually(read_again, timeout_s=15, what="a read after etcd's restart")
        own_etcd.stop()
        own_etcd.start()
        ttl_s = 0
        for _ in range(20):  # the keep-alive stream after another restart (a reconnect first)
            try:
                ttl_s = await store.refresh_lease(lease.id)
                break
            except MetadataStoreError as exc:
                assert "invalid auth token" not in str(exc), exc
                await asyncio.sleep(0.25)
        assert ttl_s > 0
