"""``danube-admin security``: bearer tokens, roles and role bindings (``docs/etcd-layout.md`` §7).

Verbs and the JSON each prints:

``security tokens create --subject SUB --expires-in 1h [--issuer ISS] [--audience AUD]
(--secret-file F | --private-key-file F [--algorithm RS256|ES256] [--key-id KID])``
    Text: the token alone on stdout (a secret: redirect it into a file, ``> app.jwt``), and
    one line on stderr saying whom it names and when it expires. JSON: ``{"token": str,
    "subject": str, "algorithm": str, "key_id": str | null, "issuer": str | null, "audience":
    str | null, "issued_at_s": int, "expires_at_s": int}``. An HS256 token is signed with the
    secret file's content, surrounding whitespace removed (as the broker reads it); an RS256
    or ES256 token with a PEM private key (the algorithm follows the key unless given).
    ``--expires-in`` is a positive number of seconds, or with an ``s``, ``m``, ``h`` or ``d``
    suffix. Nothing is written to etcd.
``security tokens inspect TOKEN_FILE [--secret-file F] [--public-key-file F] [--jwks-file F]
[--issuer ISS] [--audience AUD] [--leeway-s S]``
    ``{"header": object, "claims": object, "checked": bool, "valid": bool | null, "reason":
    str | null}``: the token read from TOKEN_FILE (``-``: stdin; never from the command line)
    decoded without its signature. With a key, it is verified by the broker's own
    :class:`~danube_pipeline.auth.tokens.TokenVerifier` with the same settings as the broker's
    ``auth_jwt_*``; a token that does not verify prints the document with ``valid: false`` and
    the reason, and exits 1.
``security roles list``
    ``{"roles": [{"role": str, "key": str, "permissions": [str], "ignored": [str]}]}``: every
    §7.1 role; ``ignored`` lists stored permission names that are not permissions (they grant
    nothing).
``security roles create ROLE --permission P [--permission P ...]``
    ``{"role": str, "key": str, "created": bool, "before": [str] | null, "permissions": [str],
    "revision": int}``: writes the role, replacing an existing one (``before`` its permissions),
    with a compare on the key's ``mod_revision``, so a concurrent change fails the verb
    instead of being overwritten. An unknown permission is refused (exit 2).
``security roles delete ROLE``
    ``{"role": str, "key": str, "permissions": [str], "revision": int, "still_bound":
    [{"principal": str, "scope": str}]}``: deletes the role; ``still_bound`` lists the
    bindings that name it (they grant nothing through it now). An absent role exits 1.
``security bindings list [--principal P]``
    ``{"bindings": [{"principal": str, "scope": str, "key": str, "roles": [str]}]}``: every
    §7.2 binding, or those of one principal.
``security bindings create PRINCIPAL ROLE... --scope SCOPE``
    ``{"principal": str, "scope": str, "key": str, "created": bool, "before": [str] | null,
    "roles": [str], "missing_roles": [str], "revision": int}``: binds the roles to the
    principal at the scope, replacing the binding there (compare on ``mod_revision``, as
    above). ``missing_roles`` are roles with no §7.1 key yet (they grant nothing until created).
``security bindings delete PRINCIPAL --scope SCOPE``
    ``{"principal": str, "scope": str, "key": str, "roles": [str], "revision": int}``: deletes
    the binding. An absent binding exits 1.

``SCOPE`` is ``cluster``, ``namespace:NS`` or ``topic:/NS/TOPIC`` (the key tails of §7.2,
``namespaces/NS`` and ``topics/NS/TOPIC``, are taken too); the documents print it in the first
form. Every change prints what it changed and the etcd revision it was applied at, and one
audit line on stderr (:func:`~danube_pipeline.admin.output.audit`: who, the change, the key,
the result, also for a change lost to a concurrent one); the brokers follow it through their
watched caches.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import click
import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from danube_pipeline.admin.config import AdminError, Config, metadata_store, run
from danube_pipeline.admin.output import Json, audit, emit, field_lines, table
from danube_pipeline.auth.permissions import Permission, Scope
from danube_pipeline.auth.tokens import MAX_PRINCIPAL_CHARS, MAX_TOKEN_CHARS, TokenVerifier, mint_token
from danube_pipeline.errors import AuthenticationError, InvalidNameError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName, validate_part

__all__ = ["parse_duration_s", "parse_scope", "scope_text", "security"]

PERMISSION_NAMES: tuple[str, ...] = tuple(p.value for p in Permission)
_DURATION = re.compile(r"(\d+)([smhd]?)")
_COMPACT_JWT = re.compile(r"[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


@click.group(short_help="Tokens, roles and role bindings.")
def security() -> None:
    """Bearer tokens, roles and role bindings (docs/etcd-layout.md §7)."""


# ---------------------------------------------------------------------------- parsing


def parse_duration_s(text: str) -> int:
    """``90``, ``90s``, ``15m``, ``1h`` or ``7d`` as a positive number of seconds.

    Raises:
        ValueError: another form, or not positive.
    """
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a duration such as 90s, 15m, 1h or 7d")
    seconds = int(match.group(1)) * _UNIT_S[match.group(2)]
    if seconds <= 0:
        raise ValueError("must be positive")
    return seconds


def parse_scope(text: str) -> Scope:
    """``cluster``, ``namespace:NS`` or ``topic:/NS/TOPIC`` (or a §7.2 key tail) as a :class:`Scope`.

    Raises:
        ValueError: none of these forms, or a malformed name.
    """
    kind, sep, rest = text.partition(":")
    try:
        if sep and kind == "namespace":
            return Scope.of_namespace(rest)
        if sep and kind == "topic":
            return Scope.of_topic(TopicName.parse(rest))
        if not sep and (text == "cluster" or text.startswith(("namespaces/", "topics/"))):
            return Scope.parse(text)
    except InvalidNameError as exc:
        raise ValueError(str(exc)) from None
    except ValueError:
        pass
    raise ValueError(f"a scope is 'cluster', 'namespace:NS' or 'topic:/NS/TOPIC', got {text!r}")


def scope_text(scope: Scope) -> str:
    """The ``--scope`` form of ``scope``: ``cluster``, ``namespace:NS`` or ``topic:/NS/TOPIC``."""
    if scope.namespace is None:
        return "cluster"
    if scope.topic is None:
        return f"namespace:{scope.namespace}"
    return f"topic:/{scope.namespace}/{scope.topic}"


def _scope_option(ctx: click.Context, param: click.Parameter, value: str) -> Scope:
    try:
        return parse_scope(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def _role_name(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A click callback: one role name, or a tuple of them, in the name grammar."""
    try:
        if isinstance(value, tuple):
            return tuple(validate_part("role", v) for v in value)
        return validate_part("role", value)
    except InvalidNameError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def _principal(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and (not value or len(value) > MAX_PRINCIPAL_CHARS or not value.isprintable()):
        raise click.BadParameter(
            f"a principal is 1 to {MAX_PRINCIPAL_CHARS} printable characters", ctx=ctx, param=param
        )
    return value


def _permissions(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[str]:
    unknown = sorted({p for p in value if p not in PERMISSION_NAMES})
    if unknown:
        raise click.BadParameter(
            f"unknown permission {', '.join(map(repr, unknown))}; valid: {', '.join(PERMISSION_NAMES)}",
            ctx=ctx, param=param,
        )
    return sorted(set(value))


def _utc(seconds: object) -> str:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return str(seconds)
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------- tokens


@security.group(short_help="Mint and inspect JWT bearer tokens.")
def tokens() -> None:
    """Mint and inspect JWT bearer tokens (the broker's auth_jwt_* settings)."""


def _read_file(path: Path, what: str) -> bytes:
    """Raises: click.BadParameter: unreadable or empty (the message names the file only)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise click.BadParameter(f"cannot read the {what} file {path}: {exc.strerror}") from None
    if not data.strip():
        raise click.BadParameter(f"the {what} file {path} is empty")
    return data


def _signing_key(secret_file: Path | None, private_key_file: Path | None, algorithm: str | None) -> tuple[bytes, str]:
    """The signing key and its algorithm.

    Raises:
        click.UsageError: not exactly one key file, or an algorithm the key cannot sign.
        click.BadParameter: the file holds no usable key.
    """
    if (secret_file is None) == (private_key_file is None):
        raise click.UsageError("give exactly one of --secret-file (HS256) and --private-key-file (RS256, ES256)")
    if secret_file is not None:
        if algorithm not in (None, "HS256"):
            raise click.UsageError(f"--algorithm {algorithm} needs --private-key-file; a secret signs HS256 only")
        return _read_file(secret_file, "JWT secret").strip(), "HS256"
    assert private_key_file is not None
    pem = _read_file(private_key_file, "private key")
    try:
        key = load_pem_private_key(pem, password=None)
    except (ValueError, TypeError):
        raise click.BadParameter(
            f"the private key file {private_key_file} is not an unencrypted PEM private key"
        ) from None
    if isinstance(key, rsa.RSAPrivateKey):
        natural = "RS256"
    elif isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1):
        natural = "ES256"
    else:
        raise click.BadParameter("the private key must be an RSA key (RS256) or an EC P-256 key (ES256)")
    if algorithm not in (None, natural):
        raise click.UsageError(f"--algorithm {algorithm} does not match the private key, which signs {natural}")
    return pem, natural


@tokens.command("create")
@click.option("--subject", required=True, callback=_principal, help="The principal (sub) the token names.")
@click.option("--expires-in", "expires_in", required=True, metavar="DURATION",
              help="Lifetime: seconds, or with an s, m, h or d suffix (90s, 15m, 1h, 7d).")
@click.option("--issuer", default=None, help="iss (the broker's auth_jwt_issuer, when it has one).")
@click.option("--audience", default=None, help="aud (the broker's auth_jwt_audience, when it has one).")
@click.option("--secret-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Sign HS256 with this file's content (the broker's auth_jwt_secret_file).")
@click.option("--private-key-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Sign RS256 or ES256 with this unencrypted PEM private key.")
@click.option("--algorithm", type=click.Choice(["HS256", "RS256", "ES256"]), default=None,
              help="Default: HS256 for a secret, else the private key's own (RSA: RS256, EC P-256: ES256).")
@click.option("--key-id", default=None, help="kid in the header: the key's id in the broker's JWKS.")
@click.pass_obj
def tokens_create(
    cfg: Config, subject: str, expires_in: str, issuer: str | None, audience: str | None, secret_file: Path | None,
    private_key_file: Path | None, algorithm: str | None, key_id: str | None,
) -> None:
    """Mint a signed token for SUBJECT and print it on stdout, alone.

    The token is a secret: store it in a file only its user can read, and hand the file to
    the client (never put a token on a command line):

    \b
        (umask 077; danube-admin security tokens create --subject app \\
            --expires-in 1d --secret-file jwt.secret > app.jwt)

    It is never logged; stderr says only whom it names and when it expires.
    """
    try:
        ttl_s = parse_duration_s(expires_in)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--expires-in'") from None
    key, alg = _signing_key(secret_file, private_key_file, algorithm)
    now_s = int(time.time())
    try:
        token = mint_token(subject, key, algorithm=alg, ttl_s=ttl_s, issuer=issuer, audience=audience,
                           key_id=key_id, now_s=now_s)
    except (jwt.PyJWTError, ValueError) as exc:  # e.g. a PEM key given as the HMAC secret
        raise click.BadParameter(f"cannot sign with this key: {exc}") from None
    doc = {"token": token, "subject": subject, "algorithm": alg, "key_id": key_id, "issuer": issuer,
           "audience": audience, "issued_at_s": now_s, "expires_at_s": now_s + ttl_s}
    emit(cfg, doc, lambda d: str(d["token"]))
    if cfg.output != "json":
        click.echo(f"{alg} token for {subject!r}, expires {_utc(now_s + ttl_s)}", err=True)


def _read_token(source: str) -> str:
    """Raises: click.BadParameter: unreadable, empty, too long, or a token given as the path."""
    if _COMPACT_JWT.fullmatch(source):  # a pasted token: refuse it without echoing it
        raise click.BadParameter("TOKEN_FILE is the path of a file holding the token (or - for stdin), "
                                 "never the token itself: tokens on a command line end up in ps and shell history")
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise click.BadParameter(f"cannot read the token file {source}: {exc.strerror}") from None
    token = text.strip()
    if token.lower().startswith("bearer "):
        token = token[7:].strip()
    if not token:
        raise click.BadParameter(f"the token file {source} is empty")
    if len(token) > MAX_TOKEN_CHARS or any(c.isspace() for c in token):
        raise AdminError(f"the token file {source} does not hold one compact JWT")
    return token


def inspect_token(token: str, verifier: TokenVerifier | None) -> Json:
    """The header and claims of ``token`` (never its signature) and, with a verifier, the
    broker's verdict on it.

    Raises:
        AdminError: the token is not a well-formed JWT.
    """
    try:
        header = jwt.get_unverified_header(token)
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        raise AdminError("the token is not a well-formed JWT (header.claims.signature)") from None
    doc: Json = {"header": header, "claims": claims, "checked": verifier is not None, "valid": None, "reason": None}
    if verifier is not None:
        try:
            verifier.verify(token)
            doc["valid"] = True
        except AuthenticationError as exc:
            doc["valid"] = False
            doc["reason"] = exc.reason
    return doc


def _inspect_text(d: Json) -> str:
    def pairs(obj: dict[str, Any], times: bool) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        for name, value in obj.items():
            shown = value if isinstance(value, (str, int, float, bool)) or value is None else json.dumps(value)
            if times and name in ("exp", "nbf", "iat"):
                shown = f"{value} ({_utc(value)})"
            out.append((name, shown))
        return out or [("(none)", "")]

    lines = ["header", field_lines(pairs(d["header"], False)), "claims", field_lines(pairs(d["claims"], True))]
    if not d["checked"]:
        lines.append("signature not checked (give --secret-file, --public-key-file or --jwks-file)")
    elif d["valid"]:
        lines.append("valid: the broker with these settings accepts it")
    else:
        lines.append(f"NOT valid: {d['reason']}")
    return "\n".join(lines)


@tokens.command("inspect")
@click.argument("token_file", metavar="TOKEN_FILE")
@click.option("--secret-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Verify HS256 with this secret (the broker's auth_jwt_secret_file).")
@click.option("--public-key-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Verify RS256 / ES256 with this PEM public key (auth_jwt_public_key_file).")
@click.option("--jwks-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Verify RS256 / ES256 with this JWKS (auth_jwt_jwks_file).")
@click.option("--issuer", default=None, help="Require this iss (auth_jwt_issuer).")
@click.option("--audience", default=None, help="Require this aud (auth_jwt_audience).")
@click.option("--leeway-s", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Clock skew allowed on nbf and iat, never on exp (auth_jwt_leeway_s).")
@click.pass_obj
def tokens_inspect(
    cfg: Config, token_file: str, secret_file: Path | None, public_key_file: Path | None, jwks_file: Path | None,
    issuer: str | None, audience: str | None, leeway_s: float,
) -> None:
    """Decode the token in TOKEN_FILE (`-`: stdin) and, given a key, verify it as the broker does.

    Prints the header and the claims, never the signature. With --secret-file,
    --public-key-file and/or --jwks-file (and the broker's --issuer, --audience and
    --leeway-s), the broker's own verification runs: exit 0 when the token is valid, 1 with
    the reason when not.
    """
    token = _read_token(token_file)
    verifier = None
    if any(f is not None for f in (secret_file, public_key_file, jwks_file)):
        try:
            verifier = TokenVerifier.from_files(secret_file=secret_file, public_key_file=public_key_file,
                                                jwks_file=jwks_file, issuer=issuer, audience=audience,
                                                leeway_s=leeway_s)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    elif issuer is not None or audience is not None:
        raise click.UsageError("--issuer and --audience are checked only with a key to verify the token with")
    doc = inspect_token(token, verifier)
    emit(cfg, doc, _inspect_text)
    if doc["valid"] is False:
        click.get_current_context().exit(1)


# ---------------------------------------------------------------------------- roles and bindings


async def _replace(store: MetadataStore, key: str, field: str, values: list[str], what: str) -> Json:
    """Write ``{field: values}`` at ``key``, created or replaced, iff unchanged since read.

    Returns:
        ``{"key", "created", "before", field, "revision"}``.

    Raises:
        AdminError: the key changed (or appeared) after it was read; nothing was written.
        MetadataStoreError: etcd cannot be reached.
    """
    current = await store.get(key)
    before = _strings(current.value, field) if current else None
    revision = await store.compare_and_put_many(
        [(key, {field: values})], expected_mod_revisions={key: current.mod_revision if current else 0}
    )
    audit("put", key, "ok" if revision is not None else "conflict", **{field: values})
    if revision is None:
        raise AdminError(f"{what} changed while it was being written; nothing was written, run the command again")
    return {"key": key, "created": current is None, "before": before, field: values, "revision": revision}


async def _remove(store: MetadataStore, key: str, field: str, what: str) -> tuple[list[str], int]:
    """Delete ``key`` iff it exists and is unchanged since read.

    Returns:
        ``(its field's values, the etcd revision of the delete)``.

    Raises:
        AdminError: it does not exist, or changed meanwhile (nothing deleted).
        MetadataStoreError: etcd cannot be reached.
    """
    current = await store.get(key)
    if current is None:
        raise AdminError(f"{what} does not exist (no key {key}); nothing was deleted")
    revision = await store.transaction(modified={key: current.mod_revision}, deletes=[key])
    audit("delete", key, "ok" if revision is not None else "conflict")
    if revision is None:
        raise AdminError(f"{what} changed while it was being deleted; nothing was deleted, run the command again")
    return _strings(current.value, field), revision


def _strings(value: object, field: str) -> list[str]:
    items = value.get(field) if isinstance(value, dict) else None
    return [x for x in items if isinstance(x, str)] if isinstance(items, list) else []


@security.group(short_help="Roles: named sets of permissions (§7.1).")
def roles() -> None:
    """Roles: named sets of permissions (docs/etcd-layout.md §7.1)."""


async def _roles_list(cfg: Config) -> Json:
    async with metadata_store(cfg) as store:
        kvs, _ = await store.get_prefix(keys.SECURITY_ROLES_PREFIX)
    out = []
    for kv in kvs:
        names = _strings(kv.value, "permissions")
        out.append({
            "role": keys.decode_principal(kv.key[len(keys.SECURITY_ROLES_PREFIX):]),
            "key": kv.key,
            "permissions": sorted({p for p in names if p in PERMISSION_NAMES}),
            "ignored": sorted({p for p in names if p not in PERMISSION_NAMES}),
        })
    return {"roles": out}


@roles.command("list")
@click.pass_obj
def roles_list(cfg: Config) -> None:
    """Every role and its permissions (§7.1)."""
    emit(cfg, run(_roles_list(cfg)), lambda d: table(
        ["ROLE", "PERMISSIONS", "IGNORED"],
        [[r["role"], ",".join(r["permissions"]) or "-", ",".join(r["ignored"]) or None] for r in d["roles"]],
    ))


async def _roles_create(cfg: Config, role: str, permissions: list[str]) -> Json:
    async with metadata_store(cfg) as store:
        result = await _replace(store, keys.security_role(role), "permissions", permissions, f"role {role!r}")
    return {"role": role, **result}


@roles.command("create")
@click.argument("role", callback=_role_name)
@click.option("--permission", "-p", "permissions", multiple=True, required=True, callback=_permissions,
              help=f"A permission to grant (repeat for several): {', '.join(PERMISSION_NAMES)}.")
@click.pass_obj
def roles_create(cfg: Config, role: str, permissions: list[str]) -> None:
    """Create ROLE with the given permissions, or replace an existing role's permissions.

    The write compares the key's mod revision with the one read: if someone changed the role
    in between, nothing is written and the command fails (exit 1).
    """
    emit(cfg, run(_roles_create(cfg, role, permissions)), lambda d: (
        f"created role {d['role']}" if d["created"] else
        f"replaced role {d['role']} (was: {', '.join(d['before']) or 'nothing'})"
    ) + f": {', '.join(d['permissions'])} (revision {d['revision']})")


async def _roles_delete(cfg: Config, role: str) -> Json:
    key = keys.security_role(role)
    async with metadata_store(cfg) as store:
        permissions, revision = await _remove(store, key, "permissions", f"role {role!r}")
        bindings = await _bindings(store, None)
    bound = [{"principal": b["principal"], "scope": b["scope"]} for b in bindings if role in b["roles"]]
    return {"role": role, "key": key, "permissions": permissions, "revision": revision, "still_bound": bound}


@roles.command("delete")
@click.argument("role")
@click.pass_obj
def roles_delete(cfg: Config, role: str) -> None:
    """Delete ROLE; bindings naming it then grant nothing through it (they are listed). An
    absent role exits 1."""
    def text(d: Json) -> str:
        granted = ", ".join(d["permissions"]) or "no permissions"
        line = f"deleted role {d['role']} ({granted}) at revision {d['revision']}"
        for b in d["still_bound"]:
            line += f"\nstill bound (grants nothing now): {b['principal']} at {b['scope']}"
        return line

    emit(cfg, run(_roles_delete(cfg, role)), text)


@security.group(short_help="Role bindings: roles given to a principal at a scope (§7.2).")
def bindings() -> None:
    """Role bindings: roles given to a principal at the cluster, a namespace or a topic
    (docs/etcd-layout.md §7.2). SCOPE is cluster, namespace:NS or topic:/NS/TOPIC."""


async def _bindings(store: MetadataStore, principal: str | None) -> list[Json]:
    prefix = keys.SECURITY_BINDINGS_PREFIX if principal is None else keys.security_bindings_prefix(principal)
    kvs, _ = await store.get_prefix(prefix)
    out = []
    for kv in kvs:
        segment, _, tail = kv.key[len(keys.SECURITY_BINDINGS_PREFIX):].partition("/")
        try:
            scope = scope_text(Scope.parse(tail))
        except ValueError:
            scope = tail  # not a §7.2 scope: the brokers never read it
        out.append({"principal": keys.decode_principal(segment), "scope": scope, "key": kv.key,
                    "roles": sorted(set(_strings(kv.value, "roles")))})
    return out


async def _bindings_list(cfg: Config, principal: str | None) -> Json:
    async with metadata_store(cfg) as store:
        return {"bindings": await _bindings(store, principal)}


@bindings.command("list")
@click.option("--principal", default=None, callback=_principal, help="Only this principal's bindings.")
@click.pass_obj
def bindings_list(cfg: Config, principal: str | None) -> None:
    """Every binding (§7.2), or those of one principal."""
    emit(cfg, run(_bindings_list(cfg, principal)), lambda d: table(
        ["PRINCIPAL", "SCOPE", "ROLES"],
        [[b["principal"], b["scope"], ",".join(b["roles"]) or "-"] for b in d["bindings"]],
    ))


async def _bindings_create(cfg: Config, principal: str, roles_: list[str], scope: Scope) -> Json:
    key = keys.security_binding(principal, scope.key_tail)
    what = f"the binding of {principal!r} at {scope_text(scope)}"
    async with metadata_store(cfg) as store:
        result = await _replace(store, key, "roles", roles_, what)
        missing = [r for r in roles_ if await store.get(keys.security_role(r)) is None]
    return {"principal": principal, "scope": scope_text(scope), **result, "missing_roles": missing}


@bindings.command("create")
@click.argument("principal", callback=_principal)
@click.argument("roles_", metavar="ROLE...", nargs=-1, required=True, callback=_role_name)
@click.option("--scope", required=True, callback=_scope_option, metavar="SCOPE",
              help="cluster, namespace:NS or topic:/NS/TOPIC.")
@click.pass_obj
def bindings_create(cfg: Config, principal: str, roles_: tuple[str, ...], scope: Scope) -> None:
    """Bind the ROLEs to PRINCIPAL at SCOPE, replacing the roles bound there before.

    PRINCIPAL is a token's sub or a client certificate's subject. The write compares the key's
    mod revision with the one read: a concurrent change fails the command (exit 1).
    """
    def text(d: Json) -> str:
        verb = "bound" if d["created"] else f"rebound (was: {', '.join(d['before']) or 'nothing'})"
        line = f"{verb} {d['principal']} at {d['scope']}: {', '.join(d['roles'])} (revision {d['revision']})"
        if d["missing_roles"]:
            line += f"\nwarning: no such role yet (grants nothing until created): {', '.join(d['missing_roles'])}"
        return line

    emit(cfg, run(_bindings_create(cfg, principal, sorted(set(roles_)), scope)), text)


async def _bindings_delete(cfg: Config, principal: str, scope: Scope) -> Json:
    key = keys.security_binding(principal, scope.key_tail)
    async with metadata_store(cfg) as store:
        roles_, revision = await _remove(store, key, "roles", f"the binding of {principal!r} at {scope_text(scope)}")
    return {"principal": principal, "scope": scope_text(scope), "key": key, "roles": roles_, "revision": revision}


@bindings.command("delete")
@click.argument("principal", callback=_principal)
@click.option("--scope", required=True, callback=_scope_option, metavar="SCOPE",
              help="cluster, namespace:NS or topic:/NS/TOPIC.")
@click.pass_obj
def bindings_delete(cfg: Config, principal: str, scope: Scope) -> None:
    """Delete PRINCIPAL's binding at SCOPE. An absent binding exits 1."""
    emit(cfg, run(_bindings_delete(cfg, principal, scope)), lambda d: (
        f"deleted the binding of {d['principal']} at {d['scope']} ({', '.join(d['roles']) or 'no roles'}) "
        f"at revision {d['revision']}"
    ))
