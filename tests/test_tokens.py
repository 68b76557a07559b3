"""Bearer-token validation (:mod:`danube_pipeline.auth.tokens`) and the permission decision
(:mod:`danube_pipeline.auth.permissions`), in process."""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import time
from pathlib import Path
from typing import cast

import jwt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from danube_pipeline.auth import Permission, Scope, TokenVerifier, bearer_token, granted, mint_token
from danube_pipeline.errors import AuthenticationError
from danube_pipeline.metadata import keys
from danube_pipeline.names import TopicName

pytestmark = pytest.mark.unit

SECRET = b"s3cr3t-s3cr3t-s3cr3t-s3cr3t-s3cr3t-0123"
NOW = 1_800_000_000.0


def _pem_pair(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> tuple[bytes, bytes]:
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, public


@pytest.fixture(scope="module")
def rsa_pair() -> tuple[bytes, bytes]:
    return _pem_pair(rsa.generate_private_key(public_exponent=65537, key_size=2048))


@pytest.fixture(scope="module")
def ec_pair() -> tuple[bytes, bytes]:
    return _pem_pair(ec.generate_private_key(ec.SECP256R1()))


def hmac_signed(claims: dict[str, object], key: bytes) -> str:
    """An HS256 token signed with any bytes as the secret (PyJWT refuses a PEM key as one)."""
    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).decode().rstrip("=")

    head = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    payload = b64(json.dumps(claims).encode())
    return f"{head}.{payload}.{b64(hmac.new(key, f'{head}.{payload}'.encode(), hashlib.sha256).digest())}"


def unsigned(claims: dict[str, object]) -> str:
    """An ``alg: none`` token: no signature at all."""
    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).decode().rstrip("=")

    return f"{b64(json.dumps({'alg': 'none', 'typ': 'JWT'}).encode())}.{b64(json.dumps(claims).encode())}."


def hs(**kwargs: object) -> str:
    kwargs.setdefault("now_s", NOW)
    return mint_token("alice", SECRET, **kwargs)  # type: ignore[arg-type]


def test_hs256_round_trip_names_the_principal() -> None:
    claims = TokenVerifier(secret=SECRET, issuer="danube", audience="brokers").verify(
        hs(issuer="danube", audience="brokers"), now_s=NOW + 1
    )
    assert claims.principal == "alice"
    assert claims.expires_at_s == NOW + 3600


@pytest.mark.parametrize(
    ("token_kwargs", "at_s", "reason"),
    [
        ({"ttl_s": 60}, NOW + 60, "expired"),  # exp itself is already too late
        ({"ttl_s": 60}, NOW + 61, "expired"),
        ({"not_before_s": NOW + 120}, NOW, "not valid yet"),
        ({"issuer": "someone-else"}, NOW, "issuer"),
        ({"audience": "elsewhere"}, NOW, "audience"),
        ({"issuer": None}, NOW, "'iss'"),  # a configured issuer is required
        ({"audience": None}, NOW, "'aud'"),
    ],
)
def test_claims_are_checked(token_kwargs: dict[str, object], at_s: float, reason: str) -> None:
    verifier = TokenVerifier(secret=SECRET, issuer="danube", audience="brokers")
    with pytest.raises(AuthenticationError, match=reason):
        verifier.verify(hs(**{"issuer": "danube", "audience": "brokers", **token_kwargs}), now_s=at_s)


def test_leeway_applies_to_nbf_and_iat_but_never_to_exp() -> None:
    verifier = TokenVerifier(secret=SECRET, leeway_s=30)
    early = hs(not_before_s=NOW + 20)
    assert verifier.verify(early, now_s=NOW).principal == "alice"  # 20 s early, within the skew
    with pytest.raises(AuthenticationError, match="not valid yet"):
        verifier.verify(hs(not_before_s=NOW + 40), now_s=NOW)
    issued_later = mint_token("alice", SECRET, now_s=NOW + 40)  # iat in the future, beyond the skew
    with pytest.raises(AuthenticationError, match="not valid yet"):
        verifier.verify(issued_later, now_s=NOW)
    with pytest.raises(AuthenticationError, match="expired"):
        verifier.verify(hs(ttl_s=10), now_s=NOW + 10 + 1)  # Danube honoured 30 s more


def test_the_cache_never_serves_an_expired_token() -> None:
    verifier = TokenVerifier(secret=SECRET)
    token = hs(ttl_s=5)
    assert verifier.verify(token, now_s=NOW + 1).principal == "alice"
    with pytest.raises(AuthenticationError, match="expired"):
        verifier.verify(token, now_s=NOW + 5)
    claims = verifier.verify(hs(ttl_s=100), now_s=NOW)
    with pytest.raises(AuthenticationError, match="expired"):
        verifier.verify_times(claims, now_s=NOW + 100)


def test_bad_signature_and_garbage_are_refused_without_echoing_the_token() -> None:
    verifier = TokenVerifier(secret=SECRET)
    forged = mint_token("alice", b"another-secret-another-secret-0123456", now_s=NOW)
    with pytest.raises(AuthenticationError, match="signature") as info:
        verifier.verify(forged, now_s=NOW)
    assert forged not in str(info.value) and SECRET.decode() not in str(info.value)
    head, payload, sig = hs().split(".")
    other = json.loads(base64.urlsafe_b64decode(payload + "=="))
    other["sub"] = "root"
    tampered = ".".join([head, base64.urlsafe_b64encode(json.dumps(other).encode()).decode().rstrip("="), sig])
    with pytest.raises(AuthenticationError, match="signature"):
        verifier.verify(tampered, now_s=NOW)
    for garbage in ("", "abc", "a.b.c", "x" * 10_000):
        with pytest.raises(AuthenticationError):
            verifier.verify(garbage, now_s=NOW)


def test_alg_none_is_refused() -> None:
    token = unsigned({"sub": "root", "exp": int(NOW) + 60})
    for verifier in (TokenVerifier(secret=SECRET), TokenVerifier(secret=SECRET, leeway_s=5)):
        with pytest.raises(AuthenticationError, match="alg none"):
            verifier.verify(token, now_s=NOW)


def test_missing_sub_or_exp_is_refused() -> None:
    verifier = TokenVerifier(secret=SECRET)
    with pytest.raises(AuthenticationError, match="'exp'"):
        verifier.verify(jwt.encode({"sub": "a"}, SECRET, algorithm="HS256"), now_s=NOW)
    with pytest.raises(AuthenticationError, match="'sub'"):
        verifier.verify(jwt.encode({"exp": int(NOW) + 9}, SECRET, algorithm="HS256"), now_s=NOW)


@pytest.mark.parametrize("kind", ["rsa", "ec"])
def test_public_key_tokens(kind: str, rsa_pair: tuple[bytes, bytes], ec_pair: tuple[bytes, bytes]) -> None:
    private, public = rsa_pair if kind == "rsa" else ec_pair
    alg = "RS256" if kind == "rsa" else "ES256"
    verifier = TokenVerifier(public_key_pem=public)
    assert verifier.algorithms == [alg]
    assert verifier.verify(mint_token("bob", private, algorithm=alg, now_s=NOW), now_s=NOW).principal == "bob"
    # algorithm confusion: the public key, which anyone may hold, used as an HMAC secret
    forged = hmac_signed({"sub": "root", "exp": int(NOW) + 60}, public)
    with pytest.raises(AuthenticationError, match="HS256 is not accepted"):
        verifier.verify(forged, now_s=NOW)


def test_jwks_selects_the_key_by_kid(rsa_pair: tuple[bytes, bytes], ec_pair: tuple[bytes, bytes], tmp_path: Path) -> None:
    rsa_private, rsa_public = rsa_pair
    ec_private, ec_public = ec_pair
    jwks = {"keys": [
        {**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(cast(rsa.RSAPublicKey, serialization.load_pem_public_key(rsa_public)))),
         "kid": "r1", "alg": "RS256"},
        {**json.loads(jwt.algorithms.ECAlgorithm.to_jwk(cast(ec.EllipticCurvePublicKey, serialization.load_pem_public_key(ec_public)))),
         "kid": "e1", "alg": "ES256"},
    ]}
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps(jwks))
    verifier = TokenVerifier.from_files(jwks_file=path)
    assert verifier.verify(mint_token("r", rsa_private, algorithm="RS256", key_id="r1", now_s=NOW), now_s=NOW).principal == "r"
    assert verifier.verify(mint_token("e", ec_private, algorithm="ES256", key_id="e1", now_s=NOW), now_s=NOW).principal == "e"
    with pytest.raises(AuthenticationError, match="kid"):  # an RSA token naming the EC key
        verifier.verify(mint_token("r", rsa_private, algorithm="RS256", key_id="e1", now_s=NOW), now_s=NOW)
    with pytest.raises(AuthenticationError, match="HS256"):
        verifier.verify(hs(), now_s=NOW)


def test_files_and_configuration_errors_name_no_secret(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    assert TokenVerifier.from_files(secret_file=secret_file).verify(hs(), now_s=NOW).principal == "alice"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        TokenVerifier.from_files(secret_file=empty)
    with pytest.raises(ValueError, match="needs a secret"):
        TokenVerifier()


def test_bearer_header_parsing() -> None:
    assert bearer_token(["Bearer abc.def.ghi"]) == "abc.def.ghi"
    assert bearer_token(["bearer  abc "]) == "abc"
    for values in ([], ["Basic dXNlcg=="], ["Bearer"], ["Bearer a", "Bearer b"]):
        with pytest.raises(AuthenticationError):
            bearer_token(values)


def test_granted_follows_scopes_roles_and_super_admins() -> None:
    store = {
        keys.security_role("writer"): {"permissions": ["produce", "lookup"]},
        keys.security_role("reader"): {"permissions": ["consume"]},
        keys.security_binding("app/1", "namespaces/sales"): {"roles": ["writer"]},
        keys.security_binding("app/1", "topics/other/orders"): {"roles": ["reader", "missing-role"]},
        keys.security_binding("ops", "cluster"): {"roles": ["reader"]},
    }
    read = store.get
    orders = Scope.of_topic(TopicName("sales", "orders"))
    assert granted("app/1", Permission.PRODUCE, orders, read)
    assert not granted("app/1", Permission.CONSUME, orders, read)
    assert granted("app/1", Permission.CONSUME, Scope.of_topic(TopicName("other", "orders")), read)
    assert granted("app/1", Permission.CONSUME, Scope.of_topic(TopicName("other", "orders-part-3")), read)
    assert not granted("app/1", Permission.CONSUME, Scope.of_topic(TopicName("other", "orders2")), read)
    assert not granted("app/1", Permission.PRODUCE, Scope.cluster(), read)
    assert granted("ops", Permission.CONSUME, orders, read)
    assert not granted("ops", Permission.MANAGE_TOPIC, orders, read)
    assert granted("root", Permission.MANAGE_CLUSTER, Scope.cluster(), read, super_admins=["root"])
    assert keys.security_binding("app/1", "cluster") == "/security/bindings/app%2F1/cluster"
    assert Scope.parse("topics/sales/orders") == orders
    assert Scope.parse(orders.key_tail) == orders
    with pytest.raises(ValueError):
        Scope.parse("topics/sales")


def test_tokens_expire_in_real_time() -> None:
    verifier = TokenVerifier(secret=SECRET)
    token = mint_token("alice", SECRET, ttl_s=1)
    assert verifier.verify(token).principal == "alice"
    time.sleep(1.1)
    with pytest.raises(AuthenticationError, match="expired"):
        verifier.verify(token)


JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20)
CLAIM_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)


@settings(deadline=None, database=None, max_examples=200)
@given(st.text(max_size=300) | st.binary(max_size=300).map(lambda b: b.decode("latin-1")))
def test_fuzzed_bearer_values_only_ever_fail_as_authentication_errors(value: str) -> None:
    verifier = TokenVerifier(secret=SECRET, issuer="danube", audience="brokers")
    try:
        verifier.verify(bearer_token([value]), now_s=NOW)
    except AuthenticationError as exc:
        assert SECRET.decode() not in str(exc)
    else:
        raise AssertionError(f"accepted {value!r}")


@settings(deadline=None, database=None, max_examples=200)
@given(
    st.dictionaries(st.sampled_from(["sub", "exp", "nbf", "iat", "iss", "aud", "x"]), CLAIM_VALUES, max_size=7),
    st.dictionaries(st.sampled_from(["alg", "kid", "typ", "crit"]), CLAIM_VALUES, max_size=4),
)
def test_fuzzed_claims_and_headers_signed_with_the_secret(claims: dict[str, object], header: dict[str, object]) -> None:
    """Any header and claims, correctly signed: accepted only when every rule holds, and refused
    only as an :class:`AuthenticationError`."""
    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).decode().rstrip("=")

    head = b64(json.dumps({**header, "alg": header.get("alg", "HS256")}).encode())
    body = b64(json.dumps(claims).encode())
    token = f"{head}.{body}.{b64(hmac.new(SECRET, f'{head}.{body}'.encode(), hashlib.sha256).digest())}"
    verifier = TokenVerifier(secret=SECRET, issuer="danube", audience="brokers", leeway_s=5)
    try:
        result = verifier.verify(token, now_s=NOW)
    except AuthenticationError:
        return
    assert result.principal == claims["sub"]
    assert claims["iss"] == "danube"
    exp = claims["exp"]
    assert isinstance(exp, (int, float)) and exp > NOW


def test_key_files_are_reloaded_when_they_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rotated secret file takes effect without a restart; a rotation half written (an empty
    file) keeps the previous key."""
    from danube_pipeline.auth import tokens

    monkeypatch.setattr(tokens, "RELOAD_CHECK_S", 0.0)
    secret_file = tmp_path / "jwt.secret"
    secret_file.write_bytes(b"first secret of enough length for HS256 ..")
    verifier = tokens.ReloadingTokenVerifier(
        [secret_file], functools.partial(tokens.TokenVerifier.from_files, secret_file=secret_file)
    )
    old = mint_token("alice", b"first secret of enough length for HS256 ..")
    assert verifier.current().verify(old).principal == "alice"

    secret_file.write_bytes(b"second secret, after the rotation, long enough")
    new = mint_token("bob", b"second secret, after the rotation, long enough")
    assert verifier.current().verify(new).principal == "bob"
    with pytest.raises(AuthenticationError):
        verifier.current().verify(old)

    secret_file.write_bytes(b"")  # half written: the second secret stays
    assert verifier.current().verify(new).principal == "bob"
