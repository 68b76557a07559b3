"""The client's typed errors at connect against real secured brokers: a refused token is an
``AuthenticationError`` raised at once (not a ``BrokerUnavailableError`` after every metadata
pass), a principal without rights gets ``PermissionDeniedError`` at once, and a plaintext client
on a TLS port is told about ``tls_ca_file``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_auth import AUDIENCE, ISSUER, SECRET, token
from tls_certs import CertAuthority

from danube_pipeline.client import DanubeClient
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.errors import AuthenticationError, BrokerUnavailableError, PermissionDeniedError

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

#: Retries that would take ``RETRIES * BACKOFF_MS`` = 6 s before giving up on an unavailable broker.
RETRIES = 3
BACKOFF_MS = 2_000


@pytest.fixture
def secured(start_secure: Callable[..., BrokerProcess], tmp_path: Path) -> BrokerProcess:
    secret_file = tmp_path / "jwt.secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)
    return start_secure(
        auth_jwt_secret_file=secret_file, auth_jwt_issuer=ISSUER, auth_jwt_audience=AUDIENCE, authorization=True,
        super_admins=["root"],
    )


def _client(address: str, **kwargs: Any) -> DanubeClient:
    return DanubeClient([address], metadata_retries=RETRIES, retry_backoff_ms=BACKOFF_MS,
                        request_timeout_ms=5_000, **kwargs)


@pytest.mark.parametrize("credentials", ["none", "expired", "wrong-audience"])
async def test_a_refused_token_is_an_authentication_error_at_connect(secured: BrokerProcess, credentials: str) -> None:
    tok = {"none": None, "expired": token("root", ttl_s=-60),
           "wrong-audience": token("root", audience="someone-else")}[credentials]
    client = _client(secured.address, token=tok)
    started = time.monotonic()
    try:
        with pytest.raises(AuthenticationError) as info:
            await client.connect()
    finally:
        await client.close()
    assert time.monotonic() - started < BACKOFF_MS / 1000, "retried instead of raising at once"
    assert not isinstance(info.value, BrokerUnavailableError)
    if tok is not None:
        assert tok not in str(info.value)


async def test_a_principal_without_rights_gets_permission_denied_at_once(secured: BrokerProcess) -> None:
    async with _client(secured.address, token=token("root")) as root:
        await root.admin.create_topic("/sales/orders")
    async with _client(secured.address, token=token("nobody")) as client:  # authenticated, no bindings
        started = time.monotonic()
        with pytest.raises(PermissionDeniedError) as info:
            async with client.producer("/sales/orders", producer_name="p") as producer:
                await producer.send(b"refused")
        assert time.monotonic() - started < BACKOFF_MS / 1000
    assert info.value.principal == "nobody"


async def test_a_plaintext_client_on_a_tls_port_is_told_about_tls_ca_file(
    start_secure: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    ca = CertAuthority(tmp_path / "pki", "danube-ca")
    pair = ca.issue("broker-1")
    broker = start_secure(tls_cert_file=pair.cert_file, tls_key_file=pair.key_file)
    client = DanubeClient([broker.address], metadata_retries=0, request_timeout_ms=3_000)
    try:
        with pytest.raises(BrokerUnavailableError) as info:
            await client.connect()
    finally:
        await client.close()
    assert "if the broker serves TLS, give tls_ca_file" in str(info.value)
    async with DanubeClient([broker.address], tls_ca_file=ca.cert_file) as secure:
        assert (await secure.admin.cluster_metadata()).brokers