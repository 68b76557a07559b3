"""``danube-pipeline dev --secure``: the files it makes, and the stack it starts.

The stack test runs two brokers with TLS (client certificates required), token authentication
and authorization, and the continuous writer connecting as ``pipeline``: the ``app`` principal
of ``env.sh`` publishes and reads back over TLS; without a token, or in plaintext, a client is
refused; ``app`` may not produce outside namespace ``default``; a deletion sent to the broker
that does not own a partition is forwarded over mutual TLS and accepted as a broker's call; the
writer commits the messages to Iceberg; the stop drains the second broker with the admin token.
etcd serves TLS only with authentication on: a plaintext client, a client without a user and
a wrong password are refused; user ``danube`` (every process of the stack, and ``env.sh``) reads
everything and writes only Danube's prefixes; the ``etcdctl`` line of the banner reads the
brokers' registrations.
"""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from helpers import eventually_sync, owners_of_all

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.cli import security_banner
from danube_pipeline.dev.stack import DevStack, read_env_file
from danube_pipeline.dev.etcd_auth import enable_etcd_auth, etcdctl_command, refuse_secured_etcd
from danube_pipeline.dev.localcluster import EtcdServer, EtcdTls, etcdctl_binary
from danube_pipeline.dev.secure import (
    ADMIN,
    APP,
    AUDIENCE,
    BROKER_SUBJECT,
    ETCD_ROOT,
    ETCD_SUBJECT,
    ETCD_USER,
    ISSUER,
    PIPELINE,
    DevSecurity,
)
from danube_pipeline.errors import (
    AuthenticationError,
    BrokerUnavailableError,
    MetadataStoreError,
    PermissionDeniedError,
)
from danube_pipeline.lake import iceberg
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.connection import EtcdSecurity
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.partitions import partition_names

TOPIC = TopicName("default", "secured")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.unit
def test_prepare_writes_private_files_and_keeps_the_ca_across_restarts(tmp_path: Path) -> None:
    security = DevSecurity.prepare(tmp_path, hosts=["127.0.0.1"])
    assert _mode(security.directory) == 0o700
    files = sorted(security.directory.iterdir())
    assert files and all(_mode(f) == 0o600 for f in files), [(f.name, oct(_mode(f))) for f in files]
    broker = x509.load_pem_x509_certificate(security.broker_cert_file.read_bytes())
    sans = broker.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    usages = broker.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert broker.subject.rfc4514_string() == f"CN={BROKER_SUBJECT}"
    secret = security.secret_file.read_bytes().strip()
    for principal in (ADMIN, PIPELINE, APP):
        creds = security.client(principal)
        claims = jwt.decode(creds.token(), secret, algorithms=["HS256"], audience=AUDIENCE, issuer=ISSUER)
        assert claims["sub"] == principal
        cert = x509.load_pem_x509_certificate(creds.cert_file.read_bytes())
        assert cert.subject.rfc4514_string() == f"CN={principal}"
        assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
            ExtendedKeyUsageOID.CLIENT_AUTH]
    args = security.broker_args()
    assert "--tls-require-client-cert" in args and "--authorization" in args
    assert secret.decode() not in " ".join(args)  # files only, never the secret
    passwords = {user: security.etcd_password_file(user).read_text() for user in (ETCD_ROOT, ETCD_USER)}
    assert len(set(passwords.values())) == 2 and all(len(pw) >= 32 for pw in passwords.values())
    ca_before = security.ca_file.read_bytes()
    DevSecurity.prepare(tmp_path, hosts=["127.0.0.1"])
    assert security.ca_file.read_bytes() == ca_before  # kept: a shell trusting it keeps working
    DevSecurity.prepare(tmp_path, hosts=["127.0.0.1", "dev.example"])  # a new host: made again
    assert security.ca_file.read_bytes() != ca_before
    etcd_cert = x509.load_pem_x509_certificate(security.etcd_cert_file.read_bytes())
    assert etcd_cert.subject.rfc4514_string() == f"CN={ETCD_SUBJECT}"
    etcd_usages = etcd_cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(etcd_usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}  # peer port too
    banner = security_banner(security)
    assert str(security.directory) in banner and str(security.client(ADMIN).token_file) in banner
    assert "etcdctl" not in banner  # no etcd URL given
    # the CA was made again for dev.example: etcd keeps its users, so the passwords are kept
    assert {user: security.etcd_password_file(user).read_text() for user in (ETCD_ROOT, ETCD_USER)} == passwords
    url = "https://127.0.0.1:2379"
    banner = security_banner(security, url)
    line = etcdctl_command(url, security, "get", "/cluster/register/", "--prefix", etcdctl=".venv/bin/etcdctl")
    assert line in banner
    assert not [pw for pw in passwords.values() if pw in banner]


def _table_offsets(home: Path) -> list[int]:
    catalog = iceberg.load_catalog(uri=f"sqlite:///{home / 'catalog.db'}", warehouse=(home / "warehouse").as_uri())
    ident = iceberg.table_identifier(TOPIC)
    if not catalog.table_exists(ident):
        return []
    rows = catalog.load_table(ident).scan(selected_fields=("_offset",)).to_arrow()
    return sorted(rows.column("_offset").to_pylist())


async def _publish_and_read_back(addresses: list[str], options: dict[str, Any]) -> list[int]:
    payloads = [f"secure-{i}".encode() for i in range(5)]
    async with DanubeClient(addresses, **options) as client:
        async with client.producer(TOPIC.path, producer_name="secure-test") as producer:
            offsets = [int(await producer.send(p)) for p in payloads]
        async with client.consumer(TOPIC.path, subscription="s", initial_position=InitialPosition.EARLIEST) as consumer:
            got = []
            for _ in payloads:
                message = await consumer.receive(timeout_ms=10_000)
                await consumer.ack(message)
                got.append(message.payload)
    assert got == payloads
    return offsets


async def _refusals(addresses: list[str], options: dict[str, Any]) -> None:
    quick: dict[str, Any] = {"request_timeout_ms": 3_000, "metadata_retries": 0}
    no_token = {k: v for k, v in options.items() if k != "token"}
    with pytest.raises(AuthenticationError):
        async with DanubeClient(addresses, **no_token, **quick) as client:
            await client.admin.cluster_metadata()
    with pytest.raises(BrokerUnavailableError):  # plaintext against the TLS port
        async with DanubeClient(addresses, **quick) as client:
            await client.admin.cluster_metadata()
    no_cert = {k: v for k, v in options.items() if k not in ("tls_cert_file", "tls_key_file")}
    with pytest.raises(BrokerUnavailableError):  # TLS and a token, but no client certificate
        async with DanubeClient(addresses, **no_cert, **quick) as client:
            await client.admin.cluster_metadata()
    async with DanubeClient(addresses, **options) as client:
        with pytest.raises(PermissionDeniedError):  # app's rights stop at namespace default
            async with client.producer("/other/t", producer_name="outside") as producer:
                await producer.send(b"no")
        with pytest.raises(PermissionDeniedError):
            await client.admin.drain_broker(addresses[0])


async def _forwarded_delete(stack: DevStack, parent: TopicName) -> None:
    """Delete a topic whose partitions both brokers own, as the admin: the broker that takes
    the call deletes the other's partitions on it over mutual TLS, with no token, as a broker."""
    parts = [p.path for p in partition_names(parent, 6)]
    async with DanubeClient(stack.addresses, **stack.client_options(ADMIN)) as client, \
            await MetadataStore.connect(stack.etcd_endpoints, security=stack.etcd_security) as meta:
        assert await client.admin.create_topic(parent.path, partitions=len(parts))

        found = await owners_of_all(meta, parts)
        assert {found[p] for p in parts} == {b.broker_id for b in stack.brokers}, found  # on both brokers
        assert sorted(await client.admin.delete_topic(parent.path)) == sorted(parts)


@pytest.mark.integration
def test_etcd_auth_is_enabled_once_and_its_kept_password_checked_at_every_start(tmp_path: Path) -> None:
    security = DevSecurity.prepare(tmp_path)
    etcd = EtcdServer(tmp_path / "etcd", tls=EtcdTls(security.etcd_cert_file, security.etcd_key_file, security.ca_file))
    etcd.start()
    try:
        assert etcd.client_url.startswith("https://")
        # a half-done earlier attempt: user danube exists with another password, auth still off
        done = subprocess.run([etcdctl_binary(), f"--endpoints={etcd.client_url}", f"--cacert={security.ca_file}",
                               "user", "add", ETCD_USER, "--interactive=false"], input="stale-password\n",
                              capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == 0, done.stderr
        assert enable_etcd_auth(etcd.client_url, security)
        etcd.stop()
        etcd.start()  # users, roles and the switch live in etcd's data directory
        assert not enable_etcd_auth(etcd.client_url, security)
        asyncio.run(_etcd_reads_as_danube(etcd.endpoints, security))
        security.etcd_password_file(ETCD_USER).write_text("not-the-password\n")
        with pytest.raises(RuntimeError, match=f"refuses user '{ETCD_USER}'") as info:
            enable_etcd_auth(etcd.client_url, security)
        assert "not-the-password" not in str(info.value)
    finally:
        etcd.stop()
    # the same data directory started without TLS (make dev after make dev SECURE=1): told, not left to fail
    plain = EtcdServer(tmp_path / "etcd", client_port=etcd.client_port, peer_port=etcd.peer_port)
    plain.start()
    try:
        with pytest.raises(RuntimeError, match="has authentication on"):
            refuse_secured_etcd(plain.client_url, tmp_path)
        refuse_secured_etcd(plain.client_url, tmp_path / "never-secured")  # no passwords there: not checked
    finally:
        plain.stop()


async def _etcd_reads_as_danube(endpoints: list[str], security: DevSecurity) -> None:
    async with await MetadataStore.connect(endpoints, security=security.etcd_security()) as store:
        await store.put(keys.CLUSTER_LEADER, {"probe": True})
        assert (await store.get(keys.CLUSTER_LEADER)).value == {"probe": True}  # type: ignore[union-attr]


async def _etcd_refusals(stack: DevStack) -> None:
    """etcd refuses a plaintext client, a client without a user and a wrong password; user
    ``danube`` writes only Danube's prefixes."""
    assert stack.security is not None
    endpoints = stack.etcd_endpoints
    assert endpoints == [stack.etcd.client_url] and endpoints[0].startswith("https://")
    ca = stack.security.ca_file
    with pytest.raises(MetadataStoreError):  # plaintext against the TLS port
        await MetadataStore.connect(endpoints, security=EtcdSecurity(), connect_timeout_s=3)
    with pytest.raises(MetadataStoreError) as info:  # TLS, but no user
        await MetadataStore.connect(endpoints, security=EtcdSecurity(ca_file=ca), connect_timeout_s=3)
    assert "user name is empty" in str(info.value)
    with pytest.raises(MetadataStoreError) as info:
        await MetadataStore.connect(endpoints, connect_timeout_s=3,
                                    security=EtcdSecurity(ca_file=ca, user=ETCD_USER, password="Wr0ng-pw-7"))
    assert "authentication failed" in str(info.value) and "Wr0ng-pw-7" not in str(info.value)
    async with await MetadataStore.connect(endpoints, security=stack.etcd_security) as store:
        with pytest.raises(MetadataStoreError, match="permission denied"):
            await store.put("/not-danube", 1)


async def _registered_brokers(endpoints: list[str]) -> list[str]:
    """The broker registrations, read by a client configured only by the environment."""
    async with await MetadataStore.connect(endpoints) as store:
        kvs, _ = await store.get_prefix(keys.BROKER_REGISTER_PREFIX)
    return [kv.key for kv in kvs]


@pytest.mark.integration
@pytest.mark.e2e
def test_the_secure_dev_stack(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "dev"
    stack = DevStack(home, dagster_home=None, brokers=2, ui=False, secure=True, segment_max_age_s=600.0,
                     commit_interval_s=1.0)
    stack.start()
    try:
        assert stack.security is not None and stack.writer is not None
        pipeline = stack.security.client(PIPELINE)
        assert {k: stack.writer.env[k] for k in pipeline.env()} == pipeline.env()
        exports = read_env_file(home)
        assert exports["DANUBE_TOKEN_FILE"] == str(stack.security.client(APP).token_file)
        assert exports["DANUBE_TLS_CA_FILE"] == str(stack.security.ca_file)
        for broker in stack.brokers:
            assert stack.security.secret_file.read_text().strip() not in " ".join(broker.command())
        etcd_env = stack.security.etcd_env(stack.etcd.client_url)
        assert {k: exports[k] for k in etcd_env} == etcd_env == {k: stack.writer.env[k] for k in etcd_env}
        assert all({k: b.env[k] for k in etcd_env} == etcd_env for b in stack.brokers)
        etcd_password = stack.security.etcd_password_file(ETCD_USER).read_text().strip()
        root_password = stack.security.etcd_password_file(ETCD_ROOT).read_text().strip()
        argv = [" ".join(stack.etcd.command()), *(" ".join(b.command()) for b in stack.brokers)]
        assert not [a for a in argv if etcd_password in a or root_password in a]
        assert etcd_password not in (home / "env.sh").read_text()
        asyncio.run(_etcd_refusals(stack))
        with monkeypatch.context() as shell:  # a client configured only by env.sh (eval "$(danube-pipeline env)")
            for name, value in exports.items():
                shell.setenv(name, value)
            offsets = asyncio.run(_publish_and_read_back(stack.addresses, {}))
            registered = asyncio.run(_registered_brokers(exports["DANUBE_ETCD_ENDPOINTS"].split(",")))
        assert offsets == [0, 1, 2, 3, 4]
        assert sorted(registered) == sorted(keys.broker_register(b.broker_id) for b in stack.brokers)
        # the banner's etcdctl line (as root, the password read from its file) reads them too
        command = etcdctl_command(stack.etcd.client_url, stack.security, "get", keys.BROKER_REGISTER_PREFIX, "--prefix",
                                  etcdctl=etcdctl_binary())
        assert command.replace(etcdctl_binary(), ".venv/bin/etcdctl") in security_banner(stack.security,
                                                                                          stack.etcd.client_url)
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30, check=False,
                              env={"PATH": "/usr/bin:/bin"})
        assert done.returncode == 0, done.stderr
        assert [line for line in done.stdout.splitlines() if line.startswith(keys.BROKER_REGISTER_PREFIX)] == sorted(
            registered)
        asyncio.run(_refusals(stack.addresses, stack.client_options(APP)))
        asyncio.run(_forwarded_delete(stack, TopicName("default", "doomed")))
        eventually_sync(lambda: _table_offsets(home) == offsets, timeout_s=90, interval_s=0.5,
                        what="the five messages queryable, committed by the writer as `pipeline`")
        audit = [json.loads(line.split("danube.audit: ", 1)[1]) for broker in stack.brokers
                 for line in broker.log_path.read_text().splitlines() if "danube.audit: " in line]
        assert not [a for a in audit if a["principal"] == PIPELINE and a["result"] == "refused"], audit
        assert any(a["principal"] == APP and a["result"] == "refused" for a in audit)  # the log is read
        assert {"principal": PIPELINE, "rpc": "/danube.v1.Admin/SealActiveSegment", "resource": f"topic {TOPIC.path}",
                "result": "ok", "via": "token"} in audit  # the writer called with its own token
    finally:
        stack.stop()
    err = capfd.readouterr().err
    assert f"draining broker {stack.brokers[1].address}" in err, err
    assert "failed" not in err, err  # drained with the admin token (a refusal would print "failed")
    assert all(not broker.running for broker in stack.brokers)
