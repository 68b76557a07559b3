"""``danube-pipeline dev --secure``: a local CA, certificates, an HS256 secret, tokens, and the
roles and bindings that let the stack run with TLS, authentication and authorization on.

Everything is written under ``{home}/security/`` (a ``0700`` directory of ``0600`` files):

=========================== ============================================================
file                        what
=========================== ============================================================
``ca.pem``, ``ca.key``      the local CA (ECDSA P-256); clients trust ``ca.pem``
``broker.pem``, ``.key``    the brokers' certificate (subject ``danube-broker``; SANs
                            ``127.0.0.1``, ``localhost`` and the listen host;
                            ``serverAuth`` and ``clientAuth``): every broker serves it and
                            presents it when it calls another broker
``{role}.pem``, ``.key``    a client certificate per principal (``admin``, ``pipeline``,
                            ``app``; ``clientAuth``)
``etcd.pem``, ``.key``      etcd's certificate (subject ``danube-etcd``; SANs ``127.0.0.1``,
                            ``localhost`` and etcd's host; ``serverAuth`` and ``clientAuth``)
                            for its client port and its peer port
``jwt.secret``              the brokers' HS256 secret (``--auth-jwt-secret-file``)
``{role}.token``            a bearer token per principal (:data:`TOKEN_TTL_S`)
``etcd-root.password``      etcd user ``root``'s password (the operator's)
``etcd-danube.password``    etcd user ``danube``'s password (brokers, writer, Dagster, shell)
=========================== ============================================================

The CA, certificates and secret are made once and kept (a shell that trusts the CA keeps
working across restarts); they are made again when a file is missing or a certificate expires
within a day. Tokens are minted at every start. The etcd passwords are made once and never
again: etcd keeps its users in its data directory (:mod:`danube_pipeline.dev.etcd_auth`).

etcd serves its clients over TLS only and authenticates every request with a user and
password: ``root`` administers users and roles; ``danube`` (etcd role ``danube``) reads every
key and writes Danube's prefixes (:data:`ETCD_READWRITE_PREFIXES`). Clients do not present
certificates to etcd (no ``--client-cert-auth``): the password names the user.

The brokers require client certificates (``--tls-require-client-cert``). That is what makes
broker-to-broker calls authenticated: a broker recognises a peer broker only by a verified
certificate carrying its own certificate's subject (``broker/rpc/auth.py``), and grpc verifies
a client certificate only on a port that requires one. Clients therefore present a certificate
of this CA *and* a token; the token names the principal (``--auth-mtls`` stays off).

Principals (``docs/etcd-layout.md`` §7; roles and bindings are created only when absent, so
changes made with ``danube-admin security`` survive a restart):

* ``admin``: a super-admin (``--super-admin admin``).
* ``pipeline``: the continuous writer and Dagster. Role ``pipeline`` (lookup, consume,
  manage_topic, manage_schema) bound at the cluster: listing, describing, sealing, reading and
  trimming segments of every topic, and schema policies.
* ``app``: the quickstart's producers and consumers. Role ``app`` (lookup, produce, consume,
  manage_topic: a producer creates its missing topic with ``CreateTopic``) bound on namespace
  ``default``; nothing elsewhere, no broker or cluster administration.
"""

from __future__ import annotations

import datetime
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from danube_pipeline.auth.permissions import Binding, Permission, Role, Scope
from danube_pipeline.auth.tokens import mint_token
from danube_pipeline.dev.certificates import CertificateAuthority, cert_pem, key_pem, subject_alt_names
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.connection import EtcdSecurity, read_password
from danube_pipeline.metadata.store import MetadataStore

__all__ = [
    "ADMIN",
    "APP",
    "AUDIENCE",
    "BROKER_SUBJECT",
    "ETCD_READWRITE_PREFIXES",
    "ETCD_ROOT",
    "ETCD_SUBJECT",
    "ETCD_USER",
    "ISSUER",
    "PIPELINE",
    "SECURITY_DIR",
    "TOKEN_TTL_S",
    "ClientCredentials",
    "DevSecurity",
    "dev_grants",
]

SECURITY_DIR = "security"
"""The directory of ``home`` holding the CA, certificates, secret and tokens."""

ADMIN = "admin"
PIPELINE = "pipeline"
APP = "app"
PRINCIPALS = (ADMIN, PIPELINE, APP)

BROKER_SUBJECT = "danube-broker"
"""The brokers' certificate common name: a peer presenting it is a broker of the cluster."""

ETCD_SUBJECT = "danube-etcd"
"""etcd's certificate common name (its client and peer ports serve it)."""

ETCD_ROOT = "root"
"""etcd's administrator (users, roles, ``auth enable``): kept for the operator."""

ETCD_USER = "danube"
"""The etcd user of the brokers, the writer, Dagster and ``env.sh``: etcd role ``danube``
(:data:`ETCD_READWRITE_PREFIXES`)."""

ETCD_READWRITE_PREFIXES = (keys.CLUSTER, keys.NAMESPACES, keys.TOPICS, keys.SCHEMAS, keys.DANUBE_DATA, keys.SECURITY)
"""The key prefixes etcd role ``danube`` may write (``docs/etcd-layout.md``); it reads every key
(a broker's cache watches the whole key space)."""

ISSUER = "danube-dev"
"""``iss`` of the dev tokens (the brokers run with ``--auth-jwt-issuer``)."""

AUDIENCE = "danube"
"""``aud`` of the dev tokens (the brokers run with ``--auth-jwt-audience``)."""

TOKEN_TTL_S = 30 * 24 * 3600.0
"""Lifetime of the tokens minted at each start, in seconds (30 days: a dev stack runs long)."""

APP_NAMESPACE = "default"

_CA_VALIDITY = datetime.timedelta(days=3650)
_LEAF_VALIDITY = datetime.timedelta(days=365)
_RENEW_BEFORE = datetime.timedelta(days=1)
_SECRET_BYTES = 32


def dev_grants() -> tuple[list[Role], list[Binding]]:
    """The roles and bindings of the dev principals (module docstring)."""
    roles = [
        Role(PIPELINE, frozenset({Permission.LOOKUP, Permission.CONSUME, Permission.MANAGE_TOPIC,
                                  Permission.MANAGE_SCHEMA})),
        Role(APP, frozenset({Permission.LOOKUP, Permission.PRODUCE, Permission.CONSUME, Permission.MANAGE_TOPIC})),
    ]
    bindings = [
        Binding(PIPELINE, Scope.cluster(), (PIPELINE,)),
        Binding(APP, Scope.of_namespace(APP_NAMESPACE), (APP,)),
    ]
    return roles, bindings


# ------------------------------------------------------------------------------- files


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` with mode ``0600`` (replacing it atomically).

    Raises:
        OSError: the file cannot be written.
    """
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _still_valid(path: Path, now: datetime.datetime) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return False
    return cert.not_valid_after_utc - _RENEW_BEFORE > now


@dataclass(frozen=True, slots=True)
class ClientCredentials:
    """What one principal's client needs: the CA, its certificate and key, and its token file.

    Attributes:
        principal: the token's ``sub`` and the certificate's common name.
        ca_file: PEM CA verifying the brokers.
        cert_file: PEM client certificate.
        key_file: its PEM private key.
        token_file: file holding the bearer token.
    """

    principal: str
    ca_file: Path
    cert_file: Path
    key_file: Path
    token_file: Path

    def env(self) -> dict[str, str]:
        """The ``DANUBE_TLS_*`` and ``DANUBE_TOKEN_FILE`` variables a ``DanubeClient`` reads
        (:mod:`danube_pipeline.settings`)."""
        return {
            "DANUBE_TLS_CA_FILE": str(self.ca_file),
            "DANUBE_TLS_CERT_FILE": str(self.cert_file),
            "DANUBE_TLS_KEY_FILE": str(self.key_file),
            "DANUBE_TOKEN_FILE": str(self.token_file),
        }

    def token(self) -> str:
        """The token, read from :attr:`token_file`.

        Raises:
            OSError: the file cannot be read.
        """
        return self.token_file.read_text(encoding="utf-8").strip()


@dataclass(frozen=True, slots=True)
class DevSecurity:
    """The security files of one dev state directory (module docstring).

    Attributes:
        directory: ``{home}/security``.
        ca_file: the CA certificate.
        broker_cert_file: the brokers' certificate.
        broker_key_file: its private key.
        secret_file: the HS256 secret.
    """

    directory: Path
    ca_file: Path
    broker_cert_file: Path
    broker_key_file: Path
    secret_file: Path

    @property
    def etcd_cert_file(self) -> Path:
        """etcd's certificate (client and peer ports)."""
        return self.directory / "etcd.pem"

    @property
    def etcd_key_file(self) -> Path:
        """Its private key."""
        return self.directory / "etcd.key"

    def etcd_password_file(self, user: str) -> Path:
        """The file holding etcd user ``user``'s password (:data:`ETCD_ROOT`, :data:`ETCD_USER`)."""
        return self.directory / f"etcd-{user}.password"

    def etcd_security(self, user: str = ETCD_USER) -> EtcdSecurity:
        """How a process of the stack reaches etcd: TLS verified with the CA, as ``user``.

        Raises:
            OSError: the password file cannot be read.
        """
        return EtcdSecurity(ca_file=self.ca_file, user=user,
                            password=read_password(self.etcd_password_file(user)) or "")

    def etcd_env(self, etcd_url: str) -> dict[str, str]:
        """The ``DANUBE_ETCD_*`` variables of :meth:`EtcdSecurity.from_env` that connect a
        child process (or a shell) to etcd at ``etcd_url`` (``https://host:port``) as
        :data:`ETCD_USER`; the password stays in its file."""
        return {
            "DANUBE_ETCD_ENDPOINTS": etcd_url,
            "DANUBE_ETCD_TLS_CA_FILE": str(self.ca_file),
            "DANUBE_ETCD_USER": ETCD_USER,
            "DANUBE_ETCD_PASSWORD_FILE": str(self.etcd_password_file(ETCD_USER)),
        }

    @classmethod
    def at(cls, home: Path) -> DevSecurity:
        """Where the files of ``home`` are (nothing is read or written)."""
        directory = home / SECURITY_DIR
        return cls(directory, directory / "ca.pem", directory / "broker.pem", directory / "broker.key",
                   directory / "jwt.secret")

    @classmethod
    def prepare(cls, home: Path, *, hosts: Sequence[str] = (), etcd_hosts: Sequence[str] = ()) -> DevSecurity:
        """Make (or keep) the CA, certificates, secret and etcd passwords of ``home``, and mint
        fresh tokens.

        Args:
            home: the dev state directory.
            hosts: more names or addresses the brokers' certificate must carry (their listen
                host), besides ``127.0.0.1`` and ``localhost``.
            etcd_hosts: the same for etcd's certificate (etcd's listen host).

        Returns:
            The files.

        Raises:
            OSError: a file cannot be written.
        """
        security = cls.at(home)
        security.directory.mkdir(parents=True, exist_ok=True)
        security.directory.chmod(0o700)
        now = datetime.datetime.now(datetime.timezone.utc)
        broker_hosts = ["127.0.0.1", "localhost", *hosts]
        etcd_hosts = ["127.0.0.1", "localhost", *etcd_hosts]
        if not security._complete(now, broker_hosts, etcd_hosts):
            security._make_all(now, broker_hosts, etcd_hosts)
        for user in (ETCD_ROOT, ETCD_USER):
            if not security.etcd_password_file(user).is_file():
                _write_private(security.etcd_password_file(user), secrets.token_hex(_SECRET_BYTES).encode())
        secret = security.secret_file.read_bytes().strip()
        for principal in PRINCIPALS:
            token = mint_token(principal, secret, ttl_s=TOKEN_TTL_S, issuer=ISSUER, audience=AUDIENCE)
            _write_private(security.client(principal).token_file, token.encode())
        return security

    def client(self, principal: str) -> ClientCredentials:
        """The credentials of ``principal`` (``admin``, ``pipeline`` or ``app``)."""
        return ClientCredentials(principal, self.ca_file, self.directory / f"{principal}.pem",
                                 self.directory / f"{principal}.key", self.directory / f"{principal}.token")

    def broker_args(self) -> list[str]:
        """The broker flags that turn TLS (client certificates required), token
        authentication and authorization on; files only, no secret on the command line."""
        return [
            "--tls-cert-file", str(self.broker_cert_file),
            "--tls-key-file", str(self.broker_key_file),
            "--tls-ca-file", str(self.ca_file),
            "--tls-require-client-cert",
            "--auth-jwt-secret-file", str(self.secret_file),
            "--auth-jwt-issuer", ISSUER,
            "--auth-jwt-audience", AUDIENCE,
            "--authorization",
            "--super-admin", ADMIN,
        ]  # fmt: skip

    async def write_grants(self, etcd_endpoints: Sequence[str], etcd_security: EtcdSecurity | None = None) -> list[str]:
        """Create the dev roles and bindings (:func:`dev_grants`) in etcd where absent.

        Args:
            etcd_endpoints: ``host:port`` (or ``https://host:port``) etcd endpoints.
            etcd_security: how to reach etcd (default: the ``DANUBE_ETCD_*`` variables).

        Returns:
            The keys created (empty when all existed).

        Raises:
            MetadataStoreError: etcd cannot be reached.
        """
        roles, bindings = dev_grants()
        entries = [(keys.security_role(r.name), r.to_json()) for r in roles]
        entries += [(keys.security_binding(b.principal, b.scope.key_tail), b.to_json()) for b in bindings]
        created = []
        async with await MetadataStore.connect(list(etcd_endpoints), security=etcd_security) as store:
            for key, value in entries:
                if await store.put_if_absent(key, dict(value)):
                    created.append(key)
        return created

    # ---- making the files

    def _complete(self, now: datetime.datetime, broker_hosts: Sequence[str], etcd_hosts: Sequence[str]) -> bool:
        """Whether every kept file exists, every certificate is valid for more than a day and
        the brokers' and etcd's certificates name every host."""
        files = [self.ca_file, self.directory / "ca.key", self.broker_key_file, self.etcd_key_file, self.secret_file]
        for principal in PRINCIPALS:
            files += [self.client(principal).cert_file, self.client(principal).key_file]
        if not all(f.is_file() for f in files):
            return False
        certs = [self.ca_file, self.broker_cert_file, self.etcd_cert_file,
                 *(self.client(p).cert_file for p in PRINCIPALS)]
        if not all(_still_valid(c, now) for c in certs):
            return False
        for cert_file, hosts in ((self.broker_cert_file, broker_hosts), (self.etcd_cert_file, etcd_hosts)):
            cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            if not all(name in sans for name in subject_alt_names(hosts)):
                return False
        return True

    def _make_all(self, now: datetime.datetime, broker_hosts: Sequence[str], etcd_hosts: Sequence[str]) -> None:
        ca = CertificateAuthority.create("danube-dev-ca", validity=_CA_VALIDITY, now=now)
        _write_private(self.directory / "ca.key", key_pem(ca.key))
        _write_private(self.ca_file, cert_pem(ca.cert))

        def issue(common_name: str, cert_file: Path, key_file: Path, *, server: bool, hosts: Sequence[str]) -> None:
            cert, key = ca.issue(common_name, hosts=hosts, server=server, validity=_LEAF_VALIDITY, now=now)
            _write_private(key_file, key_pem(key))
            _write_private(cert_file, cert_pem(cert))

        issue(BROKER_SUBJECT, self.broker_cert_file, self.broker_key_file, server=True, hosts=broker_hosts)
        issue(ETCD_SUBJECT, self.etcd_cert_file, self.etcd_key_file, server=True, hosts=etcd_hosts)
        for principal in PRINCIPALS:
            creds = self.client(principal)
            issue(principal, creds.cert_file, creds.key_file, server=False, hosts=())
        _write_private(self.secret_file, secrets.token_hex(_SECRET_BYTES).encode())
