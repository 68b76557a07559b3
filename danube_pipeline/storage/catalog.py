"""The Iceberg SQL catalog that pyiceberg's ``SqlCatalog`` and Spark's ``JdbcCatalog`` share.

An embedded SQLite file (one host) or a PostgreSQL database (several hosts), named by
``DANUBE_CATALOG_URI``, ``DANUBE_WAREHOUSE`` and ``DANUBE_CATALOG_NAME``
(:mod:`danube_pipeline.settings`). Here, in ``storage/``, because the broker opens it too (reads
of a topic's history through its table, :mod:`.table_reader`) as well as the pipeline
(``danube_pipeline.lake.iceberg`` re-exports :func:`load_catalog`). Needs pyiceberg's
``sql-sqlite`` extra, which the ``[broker]`` and ``[pipeline]`` extras install.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sqlite3
import time
from pathlib import Path
from urllib.parse import urlparse

from pyiceberg.catalog.sql import SqlCatalog
from sqlalchemy.exc import IntegrityError, ProgrammingError

from danube_pipeline import settings

__all__ = ["CATALOG_URI_ENV", "CatalogNotFoundError", "load_catalog"]


def load_catalog(
    *,
    name: str | None = None,
    uri: str | None = None,
    warehouse: str | None = None,
) -> SqlCatalog:
    """Open the shared pyiceberg ``SqlCatalog`` (creating the SQLite file's directory when the
    catalog is named, by ``uri`` or ``DANUBE_CATALOG_URI``).

    The catalog database is an embedded SQLite file (one host) or a PostgreSQL database
    (several hosts: brokers' tiering runs, Dagster, Spark). Either way pyiceberg creates the
    catalog tables (``iceberg_tables``, ``iceberg_namespace_properties``) when they are missing;
    Iceberg's ``JdbcCatalog`` in Spark uses the same tables (:func:`danube_pipeline.lake.spark.session.spark_conf`).

    Args:
        name: catalog name; Spark uses the same one (``spark.sql.catalog.<name>``). Defaults to
            ``settings.catalog_name()``.
        uri: SQLAlchemy URI: ``sqlite:////abs/catalog.db``, or
            ``postgresql+psycopg2://user:password@host:5432/database`` (``postgresql://`` means
            the same driver; user and password percent-encoded). Defaults to
            ``settings.catalog_uri()``.
        warehouse: warehouse URL, e.g. ``file:///abs/warehouse``. Defaults to
            ``settings.warehouse_url()``.

    Returns:
        The catalog; its SQLite file (if any) is in WAL journal mode.

    Raises:
        CatalogNotFoundError: neither ``uri`` nor ``DANUBE_CATALOG_URI`` names a catalog and
            the default SQLite file does not exist (an explicit ``uri`` is created when absent).
        DatabaseUrlError: ``uri`` is neither SQLite nor PostgreSQL, or PostgreSQL's driver
            (``psycopg2``, the ``postgres`` extra) is not installed.
        sqlite3.Error: the SQLite catalog file cannot be opened.
        sqlalchemy.exc.OperationalError: the PostgreSQL server refused or did not answer (wrong
            host, port, credentials or database).
        OSError: the catalog's or the warehouse's directory cannot be created.
    """
    name = name or settings.catalog_name()
    if uri is None and CATALOG_URI_ENV not in os.environ:
        _require_default_catalog(settings.catalog_uri())
    uri = uri or settings.catalog_uri()
    warehouse = warehouse or settings.warehouse_url()
    if uri.startswith("sqlite:///"):
        db_path = uri[len("sqlite:///") :].split("?", 1)[0]
        if db_path and db_path != ":memory:":
            Path(db_path).parent.mkdir(parents=True, exist_ok=True)
            _use_sqlite_wal(db_path)
    elif settings.is_postgres_url(uri):
        uri = _postgres_sqlalchemy_uri(uri)
    else:
        raise settings.DatabaseUrlError(
            uri, "the Iceberg catalog must be sqlite:///<path> or postgresql+psycopg2://user:password@host:port/db"
        )
    parsed = urlparse(warehouse)
    if parsed.scheme in ("", "file"):
        Path(parsed.path or warehouse).mkdir(parents=True, exist_ok=True)
    if not settings.is_postgres_url(uri):
        return SqlCatalog(name, uri=uri, warehouse=warehouse)
    # Hosts opening a new PostgreSQL catalog at once all create its two tables; a loser's CREATE
    # TABLE fails on the winner's table (IntegrityError or ProgrammingError). Open it again once
    # the winner is done.
    for attempt in range(1, _CATALOG_CREATE_ATTEMPTS):
        try:
            return SqlCatalog(name, uri=uri, warehouse=warehouse)
        except (IntegrityError, ProgrammingError):
            time.sleep(0.05 * attempt)
    return SqlCatalog(name, uri=uri, warehouse=warehouse)


CATALOG_URI_ENV = "DANUBE_CATALOG_URI"
"""The variable naming the catalog database (``settings.catalog_uri``)."""


class CatalogNotFoundError(FileNotFoundError):
    """``load_catalog()`` was called with no catalog named (no ``uri``, no ``DANUBE_CATALOG_URI``)
    and the default SQLite file does not exist: most likely the environment of the running
    stack is missing, and opening would create an empty catalog."""


def _require_default_catalog(uri: str) -> None:
    """Raise :class:`CatalogNotFoundError` unless the default catalog ``uri``'s SQLite file exists."""
    if not uri.startswith("sqlite:///"):
        return
    db_path = Path(uri[len("sqlite:///") :].split("?", 1)[0])
    if not db_path.is_file():
        raise CatalogNotFoundError(
            f"no Iceberg catalog at {db_path} (the default, as neither uri nor {CATALOG_URI_ENV} is set); "
            "not creating an empty one. Point at your stack first: "
            'eval "$(.venv/bin/danube-pipeline env)" for make dev, or set DANUBE_HOME or '
            f"{CATALOG_URI_ENV} and DANUBE_WAREHOUSE"
        )


_CATALOG_CREATE_ATTEMPTS = 5
"""Tries to open a PostgreSQL catalog whose tables other hosts are creating at the same time."""


def _postgres_sqlalchemy_uri(uri: str) -> str:
    """A PostgreSQL URI SQLAlchemy opens with psycopg2 (:func:`settings.sqlalchemy_postgres_url`).

    Raises:
        DatabaseUrlError: it names no host or database, or psycopg2 is not installed.
    """
    uri = settings.sqlalchemy_postgres_url(uri)
    if importlib.util.find_spec("psycopg2") is None:
        raise settings.DatabaseUrlError(
            uri, "PostgreSQL's driver psycopg2 is not installed: pip install 'danube-pipeline[postgres]'"
        )
    return uri


def _use_sqlite_wal(db_path: str) -> None:
    """Put the SQLite catalog in WAL journal mode (persistent, stored in the file).

    Spark's ``JdbcCatalog`` (xerial sqlite-jdbc) keeps pooled connections that can hold a
    shared lock between statements; in the default rollback-journal mode that blocks
    pyiceberg's next commit with "database is locked". In WAL mode readers never block the
    writer.
    """
    with contextlib.closing(sqlite3.connect(db_path, timeout=30)) as conn:
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        if str(mode).lower() != "wal":
            conn.execute("PRAGMA journal_mode=WAL")
