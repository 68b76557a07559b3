"""``danube-admin security`` (``danube_pipeline/admin/security.py``), run as the installed script:
roles and bindings checked against a real etcd (``docs/etcd-layout.md`` §7), tokens checked by
the broker's own verifier, and one real broker with authorization on that follows what the
command writes."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from helpers import AdminRun, eventually, run_admin
from test_tokens import hmac_signed

from danube_pipeline.admin.security import _replace
from danube_pipeline.auth import TokenVerifier, mint_token
from danube_pipeline.client import DanubeClient
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.errors import PermissionDeniedError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import KeyValue, MetadataStore
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

SECRET = b"admin-security-secret-admin-security-secret"
ISSUER = "danube-test"
AUDIENCE = "danube"


async def admin(etcd: list[str], *args: str, output: str = "json", stdin: bytes | None = None) -> AdminRun:
    return await run_admin(*args, etcd=etcd, output=output, stdin=stdin)


async def stored(meta: MetadataStore, key: str) -> Any:
    kv = await meta.get(key)
    return None if kv is None else kv.value


async def test_roles_and_bindings_write_exactly_the_keys_of_section_7(etcd_endpoints: list[str]) -> None:
    async def run(*args: str, output: str = "json") -> AdminRun:
        return await admin(etcd_endpoints, "security", *args, output=output)

    writer = keys.security_role("writer")
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        # roles: create, replace, refuse unknown permissions (nothing written)
        bad = await run("roles", "create", "writer", "-p", "produce", "-p", "publish")
        assert bad.code == 2 and "'publish'" in bad.err and "manage_cluster" in bad.err, bad.err
        assert await meta.get(writer) is None
        creating = await run("roles", "create", "writer", "-p", "produce", "-p", "lookup", "-p", "produce")
        made = creating.ok()
        (line,) = [json.loads(x) for x in creating.err.splitlines() if x.startswith('{"audit"')]
        assert line["change"] == "put" and line["resource"] == writer and line["result"] == "ok", line
        assert line["principal"] and line["permissions"] == ["lookup", "produce"]
        assert made == {"role": "writer", "key": writer, "created": True, "before": None,
                        "permissions": ["lookup", "produce"], "revision": made["revision"]}
        kv = await meta.get(writer)
        assert kv is not None and kv.value == {"permissions": ["lookup", "produce"]}
        assert kv.mod_revision == made["revision"]
        replaced = await run("roles", "create", "writer", "-p", "produce", output="text")
        assert replaced.code == 0 and replaced.out.startswith("replaced role writer (was: lookup, produce): produce")
        assert await stored(meta, writer) == {"permissions": ["produce"]}
        await meta.put(keys.security_role("odd"), {"permissions": ["consume", "fly"]})
        assert (await run("roles", "list")).ok() == {"roles": [
            {"role": "odd", "key": keys.security_role("odd"), "permissions": ["consume"], "ignored": ["fly"]},
            {"role": "writer", "key": writer, "permissions": ["produce"], "ignored": []},
        ]}

        # bindings: a principal with '/' is one percent-encoded segment; scopes round-trip
        app = "app/1"
        key = keys.security_binding(app, "namespaces/sales")
        assert key == "/security/bindings/app%2F1/namespaces/sales"
        bound = (await run("bindings", "create", app, "writer", "ghost", "--scope", "namespace:sales")).ok()
        assert bound == {"principal": app, "scope": "namespace:sales", "key": key, "created": True, "before": None,
                         "roles": ["ghost", "writer"], "missing_roles": ["ghost"], "revision": bound["revision"]}
        assert await stored(meta, key) == {"roles": ["ghost", "writer"]}
        text = await run("bindings", "create", app, "writer", "--scope", "namespace:sales", output="text")
        assert text.out.startswith("rebound (was: ghost, writer) app/1 at namespace:sales: writer"), text.out
        assert await stored(meta, key) == {"roles": ["writer"]}
        topic_key = keys.security_binding("ops", "topics/sales/orders")
        (await run("bindings", "create", "ops", "odd", "--scope", "topic:/sales/orders")).ok()
        (await run("bindings", "create", "root", "writer", "--scope", "cluster")).ok()
        assert await stored(meta, topic_key) == {"roles": ["odd"]}
        assert await stored(meta, keys.security_binding("root", "cluster")) == {"roles": ["writer"]}
        everything = (await run("bindings", "list")).ok()["bindings"]
        assert [(b["principal"], b["scope"], b["roles"]) for b in everything] == [
            (app, "namespace:sales", ["writer"]), ("ops", "topic:/sales/orders", ["odd"]), ("root", "cluster", ["writer"])]
        assert (await run("bindings", "list", "--principal", "ops")).ok() == {"bindings": [
            {"principal": "ops", "scope": "topic:/sales/orders", "key": topic_key, "roles": ["odd"]}]}
        for scope in ("sales", "namespace:a b", "topic:/sales"):
            refused = await run("bindings", "create", "x", "writer", "--scope", scope)
            assert refused.code == 2 and "--scope" in refused.err, (scope, refused.err)

        # deletes: what was removed is printed; absent ones exit 1 and change nothing
        gone = (await run("roles", "delete", "writer")).ok()
        assert gone == {"role": "writer", "key": writer, "permissions": ["produce"], "revision": gone["revision"],
                        "still_bound": [{"principal": app, "scope": "namespace:sales"},
                                        {"principal": "root", "scope": "cluster"}]}
        assert await meta.get(writer) is None
        again = await run("roles", "delete", "writer")
        assert (again.code, again.out) == (1, "") and again.err.startswith("error: role 'writer' does not exist")
        unbound = await run("bindings", "delete", app, "--scope", "namespace:sales", output="text")
        assert unbound.out.strip().startswith("deleted the binding of app/1 at namespace:sales (writer) at revision")
        assert await meta.get(key) is None
        absent = await run("bindings", "delete", app, "--scope", "namespace:sales")
        assert absent.code == 1 and "does not exist" in absent.err and "nothing was deleted" in absent.err
        assert [kv.key for kv in (await meta.get_prefix(keys.SECURITY))[0]] == [
            topic_key, keys.security_binding("root", "cluster"), keys.security_role("odd")]


class StaleReads:
    """A store whose reads return what was read before someone else wrote."""

    def __init__(self, store: MetadataStore, stale: KeyValue) -> None:
        self.store, self.stale = store, stale

    async def get(self, key: str) -> KeyValue | None:
        return self.stale

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


async def test_a_concurrent_change_is_never_overwritten(etcd_endpoints: list[str]) -> None:
    key = keys.security_role("writer")
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        await meta.put(key, {"permissions": ["produce"]})
        read = await meta.get(key)
        assert read is not None
        await meta.put(key, {"permissions": ["consume"]})  # someone else, after our read
        with pytest.raises(Exception, match="changed while it was being written"):
            await _replace(StaleReads(meta, read), key, "permissions", ["lookup"], "role 'writer'")  # type: ignore[arg-type]
        assert await stored(meta, key) == {"permissions": ["consume"]}
        result = await _replace(meta, key, "permissions", ["lookup"], "role 'writer'")
        assert result["before"] == ["consume"] and await stored(meta, key) == {"permissions": ["lookup"]}


def _jwks_entry(public: ec.EllipticCurvePublicKey, kid: str) -> dict[str, str]:
    numbers = public.public_numbers()

    def b64(n: int) -> str:
        return base64.urlsafe_b64encode(n.to_bytes(32, "big")).decode().rstrip("=")

    return {"kty": "EC", "crv": "P-256", "x": b64(numbers.x), "y": b64(numbers.y), "kid": kid, "alg": "ES256"}


async def test_tokens_create_and_inspect_agree_with_the_brokers_verifier(tmp_path: Path) -> None:
    async def run(*args: str, output: str = "json", stdin: bytes | None = None) -> AdminRun:
        return await admin(["127.0.0.1:1"], "security", "tokens", *args, output=output, stdin=stdin)

    secret = tmp_path / "jwt.secret"
    secret.write_bytes(SECRET + b"\n")
    made = await run("create", "--subject", "app", "--expires-in", "2h", "--secret-file", str(secret),
                     "--issuer", ISSUER, "--audience", AUDIENCE, output="text")
    assert made.code == 0, made.err
    token = made.out.strip()
    assert made.out == token + "\n"  # the token alone on stdout
    assert token not in made.err and "'app'" in made.err
    verifier = TokenVerifier.from_files(secret_file=secret, issuer=ISSUER, audience=AUDIENCE)
    claims = verifier.verify(token)
    assert claims.principal == "app" and 7190 <= claims.expires_at_s - time.time() <= 7200
    (tmp_path / "app.jwt").write_text(made.out)

    # inspect: header and claims, never the signature; verdicts as the broker's
    plain = (await run("inspect", str(tmp_path / "app.jwt"))).ok()
    assert plain["header"] == {"alg": "HS256", "typ": "JWT"} and plain["claims"]["sub"] == "app"
    assert (plain["checked"], plain["valid"]) == (False, None)
    assert token.split(".")[2] not in json.dumps(plain)
    ok = await run("inspect", "-", "--secret-file", str(secret), "--issuer", ISSUER, "--audience", AUDIENCE,
                   stdin=made.out.encode())
    assert ok.ok()["valid"] is True
    for args, reason in (
        (("--issuer", "other"), "the token's issuer is not accepted"),
        (("--audience", "elsewhere"), "the token's audience is not accepted"),
    ):
        bad = await run("inspect", str(tmp_path / "app.jwt"), "--secret-file", str(secret), *args)
        assert bad.code == 1 and json.loads(bad.out)["reason"] == reason
    (tmp_path / "other.secret").write_bytes(b"not-the-secret-not-the-secret-not-the-secret")
    wrong = await run("inspect", str(tmp_path / "app.jwt"), "--secret-file", str(tmp_path / "other.secret"),
                      output="text")
    assert wrong.code == 1 and "NOT valid: the token's signature does not verify" in wrong.out
    (tmp_path / "old.jwt").write_text(mint_token("app", SECRET, ttl_s=-5))
    old = await run("inspect", str(tmp_path / "old.jwt"), "--secret-file", str(secret))
    assert old.code == 1 and json.loads(old.out)["reason"] == "the token has expired"
    pasted = await run("inspect", token)  # never from the command line, and never echoed
    assert pasted.code == 2 and token not in pasted.err and "never the token itself" in pasted.err
    (tmp_path / "junk").write_text("not a token")
    assert (await run("inspect", str(tmp_path / "junk"))).code == 1

    # RS256 from a private key, checked with the public key; ES256 with a kid, checked with a JWKS
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (tmp_path / "rsa.pem").write_bytes(rsa_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    (tmp_path / "rsa.pub").write_bytes(rsa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    rs = (await run("create", "--subject", "svc", "--expires-in", "15m", "--private-key-file",
                    str(tmp_path / "rsa.pem"))).ok()
    assert rs["algorithm"] == "RS256" and rs["expires_at_s"] - rs["issued_at_s"] == 900
    (tmp_path / "rs.jwt").write_text(rs["token"])
    assert (await run("inspect", str(tmp_path / "rs.jwt"), "--public-key-file", str(tmp_path / "rsa.pub"))).ok()["valid"]
    no_key = await run("inspect", str(tmp_path / "rs.jwt"), "--secret-file", str(secret))
    assert no_key.code == 1 and "no key" in json.loads(no_key.out)["reason"]
    # the public key used as an HMAC secret: refused by a verifier that holds that public key
    pem_secret = await run("create", "--subject", "root", "--expires-in", "1m", "--secret-file", str(tmp_path / "rsa.pub"))
    assert pem_secret.code == 2 and "should not be used as an HMAC secret" in pem_secret.err, pem_secret.err
    now = int(time.time())
    (tmp_path / "confused.jwt").write_text(hmac_signed({"sub": "root", "exp": now + 60, "iat": now},
                                                       (tmp_path / "rsa.pub").read_bytes()))
    confused = await run("inspect", str(tmp_path / "confused.jwt"), "--public-key-file", str(tmp_path / "rsa.pub"))
    assert confused.code == 1 and "HS256" in json.loads(confused.out)["reason"]
    ec_key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "ec.pem").write_bytes(ec_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    (tmp_path / "jwks.json").write_text(json.dumps({"keys": [_jwks_entry(ec_key.public_key(), "k1")]}))
    es = (await run("create", "--subject", "svc", "--expires-in", "1d", "--private-key-file", str(tmp_path / "ec.pem"),
                    "--key-id", "k1")).ok()
    assert (es["algorithm"], es["key_id"]) == ("ES256", "k1")
    (tmp_path / "es.jwt").write_text(es["token"])
    es_doc = (await run("inspect", str(tmp_path / "es.jwt"), "--jwks-file", str(tmp_path / "jwks.json"))).ok()
    assert es_doc["header"]["kid"] == "k1" and es_doc["valid"] is True

    # bad arguments: exit 2, no token printed
    bad_args: list[tuple[str, ...]] = [
        ("--expires-in", "0s", "--secret-file", str(secret)),
        ("--expires-in", "1w", "--secret-file", str(secret)),
        ("--expires-in", "1h"),
        ("--expires-in", "1h", "--secret-file", str(secret), "--private-key-file", str(tmp_path / "ec.pem")),
        ("--expires-in", "1h", "--private-key-file", str(tmp_path / "ec.pem"), "--algorithm", "RS256"),
        ("--expires-in", "1h", "--private-key-file", str(tmp_path / "rsa.pub"))]
    for options in bad_args:
        refused = await run("create", "--subject", "app", *options)
        assert refused.code == 2 and refused.out == "" and "Traceback" not in refused.err, (options, refused.err)


async def test_a_broker_follows_what_danube_admin_security_writes(
    start_secure: Callable[..., BrokerProcess], etcd_endpoints: list[str], tmp_path: Path
) -> None:
    secret = tmp_path / "jwt.secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    broker = start_secure(auth_jwt_secret_file=str(secret), auth_jwt_issuer=ISSUER, auth_jwt_audience=AUDIENCE,
                           authorization=True, super_admins=["root"])

    async def run(*args: str) -> AdminRun:
        return await admin(etcd_endpoints, "security", *args)

    async def token_of(subject: str) -> str:
        made = await admin(etcd_endpoints, "security", "tokens", "create", "--subject", subject, "--expires-in", "10m",
                           "--secret-file", str(secret), "--issuer", ISSUER, "--audience", AUDIENCE, output="text")
        assert made.code == 0, made.err
        (tmp_path / f"{subject}.jwt").write_text(made.out)
        return made.out.strip()

    root, writer = await token_of("root"), await token_of("app-writer")
    async with DanubeClient([broker.address], token=root) as admin_client:
        await admin_client.admin.create_topic("/sales/orders")

    async def publish() -> int:
        async with DanubeClient([broker.address], token=writer, metadata_retries=0) as client:
            async with client.producer("/sales/orders", producer_name="p") as producer:
                return int(await producer.send(b"hello"))

    with pytest.raises(PermissionDeniedError):  # authenticated, but nothing granted yet
        await publish()
    (await run("roles", "create", "writer", "-p", "produce", "-p", "lookup")).ok()
    (await run("bindings", "create", "app-writer", "writer", "--scope", "namespace:sales")).ok()

    async def published() -> bool:
        try:
            await publish()
        except PermissionDeniedError:
            return False
        return True

    await eventually(published, timeout_s=10, what="the binding lets app-writer publish")

    async def create_producer_refused() -> bool:
        request = pb.CreateProducerRequest(topic="/sales/orders", producer_name="p2", request_id=uuid.uuid4().hex)
        async with grpc.aio.insecure_channel(broker.address) as channel:
            try:
                await pb_grpc.ProducerServiceStub(channel).CreateProducer(
                    request, metadata=(("authorization", f"Bearer {writer}"),), timeout=10)
            except grpc.aio.AioRpcError as exc:
                details = exc.details() or ""
                return exc.code() == grpc.StatusCode.PERMISSION_DENIED and "app-writer" in details and "produce" in details
        return False

    assert not await create_producer_refused()  # the binding still grants produce
    (await run("bindings", "delete", "app-writer", "--scope", "namespace:sales")).ok()
    await eventually(create_producer_refused, timeout_s=10, what="CreateProducer refused once the binding is gone")
    with pytest.raises(PermissionDeniedError):
        await publish()
    log = broker.log_path.read_text(errors="replace")
    assert writer not in log and root not in log and SECRET.decode() not in log
