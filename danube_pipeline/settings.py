"""Where a local Danube Pipeline keeps its state, and the environment variables that move it.

Every component (broker, Dagster assets, demo, benchmarks, tests) resolves its defaults here,
so one ``DANUBE_HOME`` points them all at the same etcd, object store and Iceberg catalog.

========================== ============================================ =====================
variable                   meaning                                      default
========================== ============================================ =====================
``DANUBE_HOME``            local state directory                        ``./.danube``
``DANUBE_ETCD_ENDPOINTS``  comma-separated ``host:port`` etcd endpoints ``127.0.0.1:2379``
``DANUBE_BROKER_ADDRESSES`` comma-separated bootstrap brokers           ``127.0.0.1:6650``
``DANUBE_OBJECT_STORE_URL`` fsspec URL of the object-store root         ``file://$DANUBE_HOME/objects``
``DANUBE_CATALOG_URI``     SQLAlchemy URI of the Iceberg SQL catalog    ``sqlite:///$DANUBE_HOME/catalog.db``
                           (``sqlite:///…`` or ``postgresql://…``)
``DANUBE_WAREHOUSE``       Iceberg warehouse URL                        ``file://$DANUBE_HOME/warehouse``
``DANUBE_CATALOG_NAME``    Iceberg catalog name (pyiceberg and Spark)   ``danube``
``DANUBE_TLS_CA_FILE``     client: PEM CA bundle verifying the brokers  (plaintext)
``DANUBE_TLS_CERT_FILE``   client: PEM client certificate (mutual TLS)  (none)
``DANUBE_TLS_KEY_FILE``    client: its PEM private key                  (none)
``DANUBE_TOKEN_FILE``      client: file holding a bearer token          (no token)
========================== ============================================ =====================

The client's TLS and token variables apply to a ``DanubeClient`` given none of
``tls_ca_file``, ``tls_cert_file``, ``tls_key_file`` (respectively no ``token``).

A catalog on PostgreSQL (``postgresql+psycopg2://user:password@host:5432/db``) is shared by
every host; Spark's JDBC URL and credentials are derived from the same URL
(:func:`parse_postgres_url`). Dagster's instance storage is chosen the same way, by the value of
``DANUBE_DAGSTER_STORAGE`` (a directory or a ``postgresql://`` URL, ``dagster_home/README.md``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from danube_pipeline.errors import DanubeError

POSTGRES_DEFAULT_PORT = 5432
"""The port a PostgreSQL URL without one means (libpq's and pgjdbc's default)."""
_POSTGRES_SCHEME = re.compile(r"^postgres(?:ql)?(?:\+[A-Za-z0-9_]+)?$")


class DatabaseUrlError(DanubeError, ValueError):
    """A catalog or Dagster storage URL that cannot be used.

    Attributes:
        url: the URL with its password replaced by ``***`` (:func:`redact_url`).
        reason: what is wrong with it.
    """

    def __init__(self, url: str, reason: str) -> None:
        self.url = redact_url(url)
        self.reason = reason
        super().__init__(f"database URL {self.url!r}: {reason}")


def redact_url(url: str) -> str:
    """``url`` with the password of its user-info part replaced by ``***`` (for messages and logs).

    Args:
        url: any URL, e.g. ``postgresql://u:secret@h/db``.

    Returns:
        E.g. ``postgresql://u:***@h/db``; ``url`` unchanged when it has no password.
    """
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:@/?#]*):[^@/?#]*@", r"\1:***@", url)


def is_postgres_url(url: str) -> bool:
    """Whether ``url`` is a PostgreSQL URL: scheme ``postgresql`` or ``postgres``, with or without
    a SQLAlchemy driver suffix (``postgresql+psycopg2``)."""
    scheme, sep, _ = url.partition("://")
    return bool(sep) and _POSTGRES_SCHEME.match(scheme) is not None


@dataclass(frozen=True, slots=True)
class PostgresUrl:
    """The parts of a PostgreSQL connection URL (libpq's URI form, as SQLAlchemy reads it).

    Attributes:
        host: host name or address (an IPv6 address without brackets).
        port: TCP port (:data:`POSTGRES_DEFAULT_PORT` when the URL gives none).
        database: database name (percent-decoded).
        user: user name (percent-decoded), ``None`` when the URL gives none.
        password: password (percent-decoded), ``None`` when the URL gives none.
        query: the URL's query string, undecoded (e.g. ``sslmode=require``); libpq and
            PostgreSQL's JDBC driver share these parameter names.
    """

    host: str
    port: int
    database: str
    user: str | None
    password: str | None
    query: str

    def jdbc_url(self) -> str:
        """The PostgreSQL JDBC driver's URL: ``jdbc:postgresql://host:port/database[?query]``,
        without the credentials (they go in :meth:`jdbc_properties`)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        url = f"jdbc:postgresql://{host}:{self.port}/{quote(self.database, safe='')}"
        return f"{url}?{self.query}" if self.query else url

    def jdbc_properties(self) -> dict[str, str]:
        """The JDBC connection properties carrying the credentials: ``user`` and ``password``,
        each only when the URL gives it."""
        props: dict[str, str] = {}
        if self.user is not None:
            props["user"] = self.user
        if self.password is not None:
            props["password"] = self.password
        return props


def sqlalchemy_postgres_url(url: str) -> str:
    """A PostgreSQL URL as SQLAlchemy opens it with psycopg2 (the ``postgres`` extra's driver).

    ``postgresql://`` and ``postgres://`` (libpq's short scheme, which SQLAlchemy refuses)
    become ``postgresql+psycopg2://``: SQLAlchemy 2.1 would otherwise pick psycopg 3. An
    explicit driver suffix (``postgresql+psycopg://``) is kept.

    Args:
        url: a PostgreSQL URL.

    Returns:
        The URL with a ``postgresql+<driver>`` scheme.

    Raises:
        DatabaseUrlError: as :func:`parse_postgres_url`.
    """
    parse_postgres_url(url)
    scheme, _, rest = url.partition("://")
    _, plus, driver = scheme.partition("+")
    return f"postgresql+{driver if plus else 'psycopg2'}://{rest}"


def parse_postgres_url(url: str) -> PostgresUrl:
    """Split a PostgreSQL URL into its parts.

    ``postgresql+psycopg2://user:p%40ss@db.example:5433/iceberg?sslmode=require`` gives host
    ``db.example``, port 5433, database ``iceberg``, user ``user``, password ``p@ss`` and query
    ``sslmode=require``. User, password and database are percent-decoded (RFC 3986 §2.1), as
    libpq and SQLAlchemy decode them.

    Args:
        url: a ``postgresql://``, ``postgres://`` or ``postgresql+<driver>://`` URL.

    Returns:
        The :class:`PostgresUrl`.

    Raises:
        DatabaseUrlError: not a PostgreSQL URL, or it names no host (a Unix-socket URL, which
            JDBC cannot use) or no database, or its port is not a number.
    """
    if not is_postgres_url(url):
        raise DatabaseUrlError(url, "not a PostgreSQL URL (postgresql://user:password@host:port/database)")
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise DatabaseUrlError(url, "the port is not a number from 0 to 65535") from None
    if not parts.hostname:
        raise DatabaseUrlError(url, "names no host (give host[:port] after '//')")
    database = unquote(parts.path.lstrip("/"))
    if not database:
        raise DatabaseUrlError(url, "names no database (add /<database> after the host)")
    return PostgresUrl(
        host=parts.hostname,
        port=port or POSTGRES_DEFAULT_PORT,
        database=database,
        user=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
        query=parts.query,
    )


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def danube_home() -> Path:
    """The local state directory (absolute)."""
    return Path(os.environ.get("DANUBE_HOME", ".danube")).resolve()


def etcd_endpoints() -> list[str]:
    """etcd endpoints as ``host:port`` strings."""
    return _split(os.environ.get("DANUBE_ETCD_ENDPOINTS", "127.0.0.1:2379"))


def broker_addresses() -> list[str]:
    """Bootstrap broker addresses as ``host:port`` strings (used only to learn the cluster)."""
    return _split(os.environ.get("DANUBE_BROKER_ADDRESSES", "127.0.0.1:6650"))


def _optional_path(variable: str) -> Path | None:
    value = os.environ.get(variable, "").strip()
    return Path(value) if value else None


def client_tls_files() -> tuple[Path | None, Path | None, Path | None]:
    """The client's TLS files from the environment: ``(ca_file, cert_file, key_file)`` of
    ``DANUBE_TLS_CA_FILE``, ``DANUBE_TLS_CERT_FILE`` and ``DANUBE_TLS_KEY_FILE``, each ``None``
    when unset."""
    return (
        _optional_path("DANUBE_TLS_CA_FILE"),
        _optional_path("DANUBE_TLS_CERT_FILE"),
        _optional_path("DANUBE_TLS_KEY_FILE"),
    )


def client_token() -> str | None:
    """The bearer token in the file ``DANUBE_TOKEN_FILE`` names (stripped), ``None`` when unset.

    Raises:
        OSError: the file cannot be read.
    """
    path = _optional_path("DANUBE_TOKEN_FILE")
    return path.read_text(encoding="utf-8").strip() if path is not None else None


def object_store_url() -> str:
    """fsspec URL of the object-store root, e.g. ``file:///…/objects`` or ``s3://bucket/prefix``."""
    return os.environ.get("DANUBE_OBJECT_STORE_URL", (danube_home() / "objects").as_uri())


def catalog_uri() -> str:
    """SQLAlchemy URI of the Iceberg SQL catalog database."""
    return os.environ.get("DANUBE_CATALOG_URI", f"sqlite:///{danube_home() / 'catalog.db'}")


def warehouse_url() -> str:
    """Iceberg warehouse location."""
    return os.environ.get("DANUBE_WAREHOUSE", (danube_home() / "warehouse").as_uri())


def catalog_name() -> str:
    """Iceberg catalog name shared by pyiceberg and Spark."""
    return os.environ.get("DANUBE_CATALOG_NAME", "danube")


def environment(home: Path, *, etcd_endpoints: Sequence[str], broker_addresses: Sequence[str]) -> dict[str, str]:
    """Every ``DANUBE_*`` variable for a local deployment whose state lives under ``home``.

    Args:
        home: the state directory (objects, catalog and warehouse go inside it).
        etcd_endpoints: ``host:port`` etcd endpoints.
        broker_addresses: ``host:port`` bootstrap brokers.

    Returns:
        A mapping to merge into a child process's environment.
    """
    return {
        "DANUBE_HOME": str(home),
        "DANUBE_ETCD_ENDPOINTS": ",".join(etcd_endpoints),
        "DANUBE_BROKER_ADDRESSES": ",".join(broker_addresses),
        "DANUBE_OBJECT_STORE_URL": (home / "objects").as_uri(),
        "DANUBE_CATALOG_URI": f"sqlite:///{home / 'catalog.db'}",
        "DANUBE_WAREHOUSE": (home / "warehouse").as_uri(),
        "DANUBE_CATALOG_NAME": catalog_name(),
    }
