"""JWT bearer tokens: verifying them on the broker, minting them for tools and tests (PyJWT).

A token names its principal in ``sub``. The broker takes HS256 tokens when it has a shared
secret, and RS256 or ES256 tokens when it has a PEM public key or a JWKS file; the key is chosen
by the token's algorithm and never the other way round, so a token signed with the public key
used as an HMAC secret is refused (algorithm confusion), and so is ``alg: none``.

``exp`` is required and never extended; the clock-skew leeway applies to ``nbf`` and ``iat``
only. ``iss`` and ``aud`` are checked when the broker is configured with them. A verified token
is cached by its text, and every use of the cache checks ``exp`` and ``nbf`` again.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from danube_pipeline.errors import AuthenticationError

log = logging.getLogger(__name__)

__all__ = [
    "ReloadingTokenVerifier",
    "ASYMMETRIC_ALGORITHMS",
    "HMAC_ALGORITHM",
    "MAX_PRINCIPAL_CHARS",
    "MAX_TOKEN_CHARS",
    "TokenClaims",
    "TokenVerifier",
    "bearer_token",
    "mint_token",
]

HMAC_ALGORITHM = "HS256"
ASYMMETRIC_ALGORITHMS = ("RS256", "ES256")
MAX_TOKEN_CHARS = 8192
"""A longer bearer value is refused before it is parsed."""
MAX_PRINCIPAL_CHARS = 256
_CACHE_ENTRIES = 1024


@dataclass(frozen=True, slots=True)
class TokenClaims:
    """What a verified token says.

    Attributes:
        principal: its ``sub``.
        expires_at_s: its ``exp``, seconds since the Unix epoch.
        not_before_s: its ``nbf`` (``None``: none).
        claims: every claim, as decoded.
    """

    principal: str
    expires_at_s: float
    not_before_s: float | None
    claims: Mapping[str, Any]


def _read_bytes(path: Path, what: str) -> bytes:
    """Raises: ValueError: the file cannot be read or is empty (the message names the file only)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file {path}: {exc.strerror}") from None
    if not data.strip():
        raise ValueError(f"the {what} file {path} is empty")
    return data


class TokenVerifier:
    """Verifies bearer tokens against the broker's keys.

    Args:
        secret: the HS256 shared secret (``None``: HS256 tokens are refused).
        public_key_pem: a PEM RSA (RS256) or EC P-256 (ES256) public key.
        jwks: a JWKS document (``{"keys": [...]}``) of RSA and EC public keys, chosen by the
            token's ``kid`` (or the only key, when there is one and the token names none).
        issuer: the ``iss`` every token must carry (``None``: not checked).
        audience: a value every token's ``aud`` must contain (``None``: not checked).
        leeway_s: clock skew allowed on ``nbf`` and ``iat``, in seconds (never on ``exp``).

    Raises:
        ValueError: no key at all, a key of an unsupported kind, or a JWKS that does not parse.
    """

    def __init__(
        self,
        *,
        secret: bytes | None = None,
        public_key_pem: bytes | None = None,
        jwks: Mapping[str, Any] | None = None,
        issuer: str | None = None,
        audience: str | None = None,
        leeway_s: float = 0.0,
    ) -> None:
        if leeway_s < 0:
            raise ValueError("leeway_s must not be negative")
        self._secret = secret
        self._public_key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey | None = None
        self._public_algorithm: str | None = None
        if public_key_pem is not None:
            key = load_pem_public_key(public_key_pem)
            if isinstance(key, rsa.RSAPublicKey):
                self._public_algorithm = "RS256"
            elif isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
                self._public_algorithm = "ES256"
            else:
                raise ValueError("the JWT public key must be an RSA key (RS256) or an EC P-256 key (ES256)")
            self._public_key = key
        self._jwks: dict[str | None, jwt.PyJWK] = {}
        if jwks is not None:
            try:
                keys = jwt.PyJWKSet.from_dict(dict(jwks)).keys
            except jwt.PyJWTError as exc:
                raise ValueError(f"the JWKS does not parse: {exc}") from None
            usable = [k for k in keys if k.algorithm_name in ASYMMETRIC_ALGORITHMS]
            self._jwks = {k.key_id: k for k in usable}
            if len(usable) == 1:
                self._jwks.setdefault(None, usable[0])
        if secret is None and self._public_key is None and not self._jwks:
            raise ValueError("a token verifier needs a secret, a public key or a JWKS with an RSA or EC key")
        self.issuer = issuer
        self.audience = audience
        self.leeway_s = leeway_s
        self._cache: collections.OrderedDict[str, TokenClaims] = collections.OrderedDict()

    @classmethod
    def from_files(
        cls,
        *,
        secret_file: Path | None = None,
        public_key_file: Path | None = None,
        jwks_file: Path | None = None,
        issuer: str | None = None,
        audience: str | None = None,
        leeway_s: float = 0.0,
    ) -> TokenVerifier:
        """A verifier with its keys read from files (the broker's ``auth_jwt_*`` settings).

        The secret file's content is the secret, surrounding whitespace removed.

        Raises:
            ValueError: a file cannot be read, is empty, or holds no usable key.
        """
        secret = _read_bytes(secret_file, "JWT secret").strip() if secret_file else None
        public = _read_bytes(public_key_file, "JWT public key") if public_key_file else None
        jwks = None
        if jwks_file is not None:
            try:
                jwks = json.loads(_read_bytes(jwks_file, "JWKS"))
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JWKS file {jwks_file} is not JSON: {exc.msg}") from None
        return cls(secret=secret, public_key_pem=public, jwks=jwks, issuer=issuer, audience=audience,
                   leeway_s=leeway_s)

    @property
    def algorithms(self) -> list[str]:
        """The algorithms this verifier takes."""
        algs = [HMAC_ALGORITHM] if self._secret is not None else []
        if self._public_algorithm is not None:
            algs.append(self._public_algorithm)
        algs += sorted({k.algorithm_name for k in self._jwks.values()} - set(algs))
        return algs

    def _key_for(self, header: Mapping[str, Any]) -> tuple[Any, str]:
        """The key verifying a token with this header, and its one algorithm.

        Raises:
            AuthenticationError: the algorithm is not taken, or no key matches the ``kid``.
        """
        alg = header.get("alg")
        if not isinstance(alg, str) or alg.lower() == "none":
            raise AuthenticationError("unsigned tokens (alg none) are not accepted")
        if alg == HMAC_ALGORITHM:
            if self._secret is None:
                raise AuthenticationError("token algorithm HS256 is not accepted by this broker")
            return self._secret, alg
        if alg not in ASYMMETRIC_ALGORITHMS:
            raise AuthenticationError(f"token algorithm {alg[:16]!r} is not accepted")
        if self._public_algorithm == alg and ("kid" not in header or not self._jwks):
            return self._public_key, alg
        kid = header.get("kid")
        jwk = self._jwks.get(kid if isinstance(kid, str) else None)
        if jwk is None or jwk.algorithm_name != alg:
            if self._public_algorithm == alg:
                return self._public_key, alg
            raise AuthenticationError("no key of this broker verifies the token (unknown kid or algorithm)")
        return jwk.key, alg

    def verify(self, token: str, *, now_s: float | None = None) -> TokenClaims:
        """The claims of ``token`` once its signature and claims are checked.

        Args:
            token: the compact JWT (without ``Bearer``).
            now_s: the current time, seconds since the Unix epoch (default the clock).

        Returns:
            Its claims; ``principal`` is its ``sub``.

        Raises:
            AuthenticationError: the token is malformed, unsigned, signed with an algorithm or
                key this broker does not take, badly signed, expired, not yet valid, or of
                another issuer or audience, or it names no subject.
        """
        now = time.time() if now_s is None else now_s
        cached = self._cache.get(token)
        if cached is not None:
            self._check_times(cached, now)
            self._cache.move_to_end(token)
            return cached
        if len(token) > MAX_TOKEN_CHARS:
            raise AuthenticationError("the token is too long")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise AuthenticationError("the token is not a well-formed JWT") from None
        key, alg = self._key_for(header)
        options: dict[str, Any] = {
            "require": ["exp", "sub"] + (["iss"] if self.issuer else []) + (["aud"] if self.audience else []),
            "verify_nbf": False,  # with the leeway below: PyJWT's leeway would extend exp too
            "verify_iat": False,
            "verify_aud": self.audience is not None,
            "verify_iss": self.issuer is not None,
        }
        try:
            payload = jwt.decode(
                token, key, algorithms=[alg], audience=self.audience, issuer=self.issuer, leeway=0,
                options=options,  # type: ignore[arg-type]
            )
        except jwt.ExpiredSignatureError:
            raise AuthenticationError("the token has expired") from None
        except jwt.InvalidIssuerError:
            raise AuthenticationError("the token's issuer is not accepted") from None
        except jwt.InvalidAudienceError:
            raise AuthenticationError("the token's audience is not accepted") from None
        except jwt.MissingRequiredClaimError as exc:
            raise AuthenticationError(f"the token lacks the {exc.claim!r} claim") from None
        except jwt.InvalidSignatureError:
            raise AuthenticationError("the token's signature does not verify") from None
        except (jwt.PyJWTError, ValueError, TypeError):
            raise AuthenticationError("the token does not verify") from None
        claims = self._claims(payload)
        # exp again against our clock: PyJWT read its own
        self._check_times(claims, now)
        self._cache[token] = claims
        if len(self._cache) > _CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return claims

    def _claims(self, payload: Mapping[str, Any]) -> TokenClaims:
        """Raises: AuthenticationError: ``sub``, ``exp``, ``nbf`` or ``iat`` of the wrong type."""
        sub = payload.get("sub")
        if not isinstance(sub, str) or not sub or len(sub) > MAX_PRINCIPAL_CHARS:
            raise AuthenticationError(f"the token's subject must be a string of 1 to {MAX_PRINCIPAL_CHARS} characters")
        times: dict[str, float | None] = {}
        for name in ("exp", "nbf", "iat"):
            value = payload.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise AuthenticationError(f"the token's {name!r} claim is not a number")
            times[name] = None if value is None else float(value)
        exp = times["exp"]
        assert exp is not None  # required above
        not_before = times["nbf"]
        iat = times["iat"]
        if iat is not None and (not_before is None or iat > not_before):
            not_before = iat  # a token issued in the future is not valid yet either
        return TokenClaims(sub, exp, not_before, dict(payload))

    def verify_times(self, claims: TokenClaims, *, now_s: float | None = None) -> None:
        """Check again that verified ``claims`` are within their validity (a long stream).

        Raises:
            AuthenticationError: expired, or not valid yet.
        """
        self._check_times(claims, time.time() if now_s is None else now_s)

    def _check_times(self, claims: TokenClaims, now_s: float) -> None:
        """Raises: AuthenticationError: expired (no leeway), or not valid yet (with the leeway)."""
        if now_s >= claims.expires_at_s:
            raise AuthenticationError("the token has expired")
        if claims.not_before_s is not None and now_s + self.leeway_s < claims.not_before_s:
            raise AuthenticationError("the token is not valid yet (nbf or iat in the future)")


class ReloadingTokenVerifier:
    """A :class:`TokenVerifier` whose key files are read again when they change, so keys are
    rotated by replacing the files, without a restart (as the TLS files are).

    :meth:`current` looks at the files' size and modification time at most every
    :data:`RELOAD_CHECK_S` seconds; when they changed it builds a new verifier, and a file that
    does not parse yet (a rotation half written) keeps the previous verifier, logged once.

    Args:
        files: the key files to watch.
        build: reads them into a verifier, e.g. :meth:`TokenVerifier.from_files` with its
            arguments bound (``functools.partial``); called again after a change.

    Raises:
        ValueError: the files cannot be read or hold no usable key at start.
    """

    def __init__(self, files: Sequence[Path], build: Callable[[], TokenVerifier]) -> None:
        self._files = list(files)
        self._build = build
        self._verifier = self._build()
        self._signature = self._stat()
        self._checked_s = time.monotonic()
        self._failed_signature: tuple[tuple[int, int], ...] | None = None

    def _stat(self) -> tuple[tuple[int, int], ...]:
        out = []
        for f in self._files:
            try:
                st = f.stat()
                out.append((st.st_mtime_ns, st.st_size))
            except OSError:
                out.append((-1, -1))
        return tuple(out)

    def current(self) -> TokenVerifier:
        """The verifier of the key files as they are now (re-read after a change)."""
        now = time.monotonic()
        if now - self._checked_s < RELOAD_CHECK_S:
            return self._verifier
        self._checked_s = now
        signature = self._stat()
        if signature != self._signature and signature != self._failed_signature:
            try:
                self._verifier = self._build()
                self._signature = signature
                log.info("JWT key files changed: keys reloaded")
            except ValueError as exc:
                self._failed_signature = signature
                log.warning("JWT key files changed but cannot be used yet (the previous keys stay): %s", exc)
        return self._verifier


RELOAD_CHECK_S = 1.0
"""How often :class:`ReloadingTokenVerifier` looks at its key files, at most (seconds)."""


def mint_token(
    principal: str,
    key: bytes | str,
    *,
    algorithm: str = HMAC_ALGORITHM,
    ttl_s: float = 3600.0,
    issuer: str | None = None,
    audience: str | None = None,
    not_before_s: float | None = None,
    key_id: str | None = None,
    extra_claims: Mapping[str, Any] | None = None,
    now_s: float | None = None,
) -> str:
    """A signed JWT for ``principal`` (``sub``), for ``danube-admin`` and tests.

    Args:
        principal: the ``sub``.
        key: the HS256 secret, or the PEM private key for RS256 / ES256.
        algorithm: ``HS256``, ``RS256`` or ``ES256``.
        ttl_s: ``exp`` is this many seconds after ``iat`` (negative: an expired token).
        issuer: ``iss``, if any.
        audience: ``aud``, if any.
        not_before_s: ``nbf``, seconds since the Unix epoch, if any.
        key_id: ``kid`` in the header (a JWKS key), if any.
        extra_claims: more claims (they override the ones above).
        now_s: ``iat``, seconds since the Unix epoch (default the clock).

    Returns:
        The compact token.

    Raises:
        ValueError: an algorithm other than HS256, RS256 or ES256, or an empty principal.
    """
    if algorithm not in (HMAC_ALGORITHM, *ASYMMETRIC_ALGORITHMS):
        raise ValueError(f"algorithm must be one of HS256, RS256, ES256, got {algorithm!r}")
    if not principal or len(principal) > MAX_PRINCIPAL_CHARS:
        raise ValueError(f"the principal must be 1 to {MAX_PRINCIPAL_CHARS} characters")
    now = int(time.time() if now_s is None else now_s)
    claims: dict[str, Any] = {"sub": principal, "iat": now, "exp": now + int(ttl_s)}
    if issuer is not None:
        claims["iss"] = issuer
    if audience is not None:
        claims["aud"] = audience
    if not_before_s is not None:
        claims["nbf"] = int(not_before_s)
    claims.update(extra_claims or {})
    headers = {"kid": key_id} if key_id else None
    return jwt.encode(claims, key, algorithm=algorithm, headers=headers)


def bearer_token(values: Sequence[str]) -> str:
    """The token of the one ``authorization: Bearer <token>`` metadata value.

    Raises:
        AuthenticationError: none, several, or not a bearer value.
    """
    if not values:
        raise AuthenticationError("no credentials: send 'authorization: Bearer <token>'")
    if len(values) > 1:
        raise AuthenticationError("more than one authorization header")
    scheme, _, token = values[0].strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError("the authorization header is not 'Bearer <token>'")
    return token.strip()
