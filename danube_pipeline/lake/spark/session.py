"""The Spark session on the shared Iceberg catalog: jar lookup, master, JDBC catalog
configuration.

Jars: the Iceberg Spark runtime comes from the ``snowpark-connect-deps-iceberg`` 1.0.1 wheel
(``jars/iceberg-spark-runtime-3.5_2.12-1.9.2.jar``) unless ``DANUBE_ICEBERG_SPARK_JAR`` names
another; the SQLite JDBC driver from Debian's ``libxerial-sqlite-jdbc-java`` unless
``DANUBE_SQLITE_JDBC_JAR`` names another; the PostgreSQL JDBC driver (for a catalog on
PostgreSQL) from Debian's ``libpostgresql-jdbc-java`` unless ``DANUBE_POSTGRESQL_JDBC_JAR`` names
another.

Credentials: a PostgreSQL catalog's password never enters the Spark configuration (which the
UI's Environment tab, ``spark.conf.get`` and event logs show). :func:`spark_conf` keeps only
``jdbc.user`` and writes the password to a private PostgreSQL password file (mode 0600, the
``.pgpass`` format); the JVM's ``org.postgresql.pgpassfile`` system property names that file, and
the PostgreSQL JDBC driver (pgjdbc 42.3 or later) reads it at each connection that has no password
(:func:`pgpass_file`).

Master: ``local[*]`` (every core of this host) unless ``DANUBE_SPARK_MASTER`` names another
(``spark://host:7077`` for a standalone cluster; :func:`spark_master`). Python workers run
the driver's own interpreter unless ``PYSPARK_PYTHON`` is set (:func:`build_spark_session`).
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from danube_pipeline import settings
from danube_pipeline.errors import DanubeError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

__all__ = [
    "SparkSetupError",
    "build_spark_session",
    "grpc_fork_hazard",
    "iceberg_spark_runtime_jar",
    "jdbc_properties",
    "jdbc_uri",
    "pgpass_file",
    "postgresql_jdbc_jar",
    "spark_conf",
    "spark_master",
    "sqlite_jdbc_jar",
]

ICEBERG_JAR_ENV = "DANUBE_ICEBERG_SPARK_JAR"
SQLITE_JAR_ENV = "DANUBE_SQLITE_JDBC_JAR"
ICEBERG_JAR_PACKAGE = "snowpark_connect_deps_iceberg"
ICEBERG_JAR_GLOB = "iceberg-spark-runtime-3.5_2.12-*.jar"
DEFAULT_SQLITE_JAR = Path("/usr/share/java/sqlite-jdbc.jar")
POSTGRES_JAR_ENV = "DANUBE_POSTGRESQL_JDBC_JAR"
DEFAULT_POSTGRES_JAR = Path("/usr/share/java/postgresql.jar")
GRPC_FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
PGPASSFILE_PROPERTY = "org.postgresql.pgpassfile"
MASTER_ENV = "DANUBE_SPARK_MASTER"
DEFAULT_MASTER = "local[*]"


class SparkSetupError(DanubeError):
    """A jar Spark needs is missing; the message says how to get it."""

    def __init__(self, what: str, remedy: str) -> None:
        self.what = what
        self.remedy = remedy
        super().__init__(f"{what}: {remedy}")


def iceberg_spark_runtime_jar() -> Path:
    """The Iceberg Spark runtime jar (Spark 3.5, Scala 2.12).

    ``$DANUBE_ICEBERG_SPARK_JAR`` if set, else the jar inside the installed
    ``snowpark-connect-deps-iceberg`` package.

    Returns:
        The jar's path.

    Raises:
        SparkSetupError: the env var names a missing file, or the package is not installed.
    """
    override = os.environ.get(ICEBERG_JAR_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise SparkSetupError(f"{ICEBERG_JAR_ENV}={override}", "no such file")
        return path
    spec = importlib.util.find_spec(ICEBERG_JAR_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SparkSetupError(
            "Iceberg Spark runtime jar not found",
            "install `snowpark-connect-deps-iceberg==1.0.1` (it ships "
            "jars/iceberg-spark-runtime-3.5_2.12-1.9.2.jar) or set "
            f"{ICEBERG_JAR_ENV} to an iceberg-spark-runtime-3.5_2.12 jar",
        )
    for location in spec.submodule_search_locations:
        found = sorted((Path(location) / "jars").glob(ICEBERG_JAR_GLOB))
        if found:
            return found[-1]
    raise SparkSetupError(
        "Iceberg Spark runtime jar not found",
        f"the installed `snowpark-connect-deps-iceberg` has no jars/{ICEBERG_JAR_GLOB}; "
        f"install version 1.0.1 or set {ICEBERG_JAR_ENV}",
    )


def sqlite_jdbc_jar() -> Path:
    """The SQLite JDBC driver jar.

    ``$DANUBE_SQLITE_JDBC_JAR`` if set, else ``/usr/share/java/sqlite-jdbc.jar``.

    Returns:
        The jar's path.

    Raises:
        SparkSetupError: the jar does not exist.
    """
    override = os.environ.get(SQLITE_JAR_ENV)
    path = Path(override) if override else DEFAULT_SQLITE_JAR
    if not path.is_file():
        raise SparkSetupError(
            f"SQLite JDBC driver not found at {path}",
            f"run `apt-get install libxerial-sqlite-jdbc-java` or set {SQLITE_JAR_ENV}",
        )
    return path


def postgresql_jdbc_jar(*, required: bool = True) -> Path | None:
    """The PostgreSQL JDBC driver jar (pgjdbc).

    ``$DANUBE_POSTGRESQL_JDBC_JAR`` if set, else ``/usr/share/java/postgresql.jar`` (Debian's
    ``libpostgresql-jdbc-java``).

    Args:
        required: raise when the jar is missing; when false, return ``None`` instead.

    Returns:
        The jar's path, or ``None`` when it is missing and not ``required``.

    Raises:
        SparkSetupError: the jar does not exist and ``required`` is true.
    """
    override = os.environ.get(POSTGRES_JAR_ENV)
    path = Path(override) if override else DEFAULT_POSTGRES_JAR
    if path.is_file():
        return path
    if not required:
        return None
    raise SparkSetupError(
        f"PostgreSQL JDBC driver not found at {path}",
        f"run `apt-get install libpostgresql-jdbc-java` or set {POSTGRES_JAR_ENV}",
    )


def spark_master() -> str:
    """The Spark master URL: ``$DANUBE_SPARK_MASTER`` if set, else ``local[*]``.

    Returns:
        A master URL as Spark takes it: ``local[*]``, ``local[2]``, ``spark://host:7077``
        (a standalone cluster: Spark docs, "Spark Standalone Mode")...
    """
    return os.environ.get(MASTER_ENV) or DEFAULT_MASTER


def jdbc_uri(catalog_uri: str) -> str:
    """Turn pyiceberg's SQLAlchemy URI into a JDBC one.

    ``sqlite:////abs/catalog.db`` → ``jdbc:sqlite:/abs/catalog.db``;
    ``postgresql+psycopg2://u:p@h:5432/db`` → ``jdbc:postgresql://h:5432/db`` (credentials
    are :func:`jdbc_properties`); a ``jdbc:`` URI is
    returned unchanged.

    Args:
        catalog_uri: a SQLAlchemy URI (``sqlite:///…``, ``postgresql…://…``) or a JDBC URI.

    Returns:
        The JDBC URI.

    Raises:
        DatabaseUrlError: (a ``ValueError``) the URI is neither SQLite, PostgreSQL nor JDBC, or
            a PostgreSQL URI lacks its host or database (:func:`settings.parse_postgres_url`).
    """
    if catalog_uri.startswith("jdbc:"):
        return catalog_uri
    if catalog_uri.startswith("sqlite:///"):
        return "jdbc:sqlite:" + catalog_uri[len("sqlite:///") :]
    if settings.is_postgres_url(catalog_uri):
        return settings.parse_postgres_url(catalog_uri).jdbc_url()
    raise settings.DatabaseUrlError(catalog_uri, "cannot be converted to JDBC: use sqlite:///… or postgresql://…")


def jdbc_properties(catalog_uri: str) -> dict[str, str]:
    """The JDBC connection properties a catalog URI carries: ``user`` and ``password`` of a
    PostgreSQL URI (percent-decoded), nothing for SQLite or a ``jdbc:`` URI.

    Args:
        catalog_uri: the URI given to :func:`jdbc_uri`.

    Returns:
        ``{property: value}``; Iceberg's ``JdbcCatalog`` takes them as ``jdbc.<property>``.

    Raises:
        DatabaseUrlError: a PostgreSQL URI lacks its host or database.
    """
    if settings.is_postgres_url(catalog_uri):
        return settings.parse_postgres_url(catalog_uri).jdbc_properties()
    return {}


def spark_conf(
    *,
    catalog_name: str | None = None,
    catalog_uri: str | None = None,
    warehouse: str | None = None,
    master: str | None = None,
    shuffle_partitions: int = 4,
    extra_jars: tuple[str, ...] = (),
) -> dict[str, str]:
    """Spark settings for a session on the shared Iceberg catalog.

    Args:
        catalog_name: Spark catalog name (``spark.sql.catalog.<name>``); defaults to
            ``settings.catalog_name()``, the same name pyiceberg uses.
        catalog_uri: pyiceberg's SQLAlchemy URI, converted with :func:`jdbc_uri`; a PostgreSQL
            URI's user becomes ``jdbc.user``; its password stays out of the returned settings
            and goes to :func:`pgpass_file` (:func:`jdbc_properties`). The JDBC driver it needs must exist; the other one is
            added when installed, so a JVM started for one catalog can open the other later.
        warehouse: the warehouse URL pyiceberg uses.
        master: Spark master URL; default :func:`spark_master` (``$DANUBE_SPARK_MASTER`` or
            ``local[*]``).
        shuffle_partitions: ``spark.sql.shuffle.partitions`` (small: local data).
        extra_jars: more jars for ``spark.jars`` (e.g. ``iceberg-aws-bundle`` for S3).

    Returns:
        ``{spark conf key: value}``, e.g. ``spark.sql.catalog.danube.uri``.

    Raises:
        SparkSetupError: a jar is missing.
        DatabaseUrlError: (a ``ValueError``) the catalog URI cannot be converted to JDBC.
    """
    name = catalog_name or settings.catalog_name()
    uri = catalog_uri or settings.catalog_uri()
    wh = warehouse or settings.warehouse_url()
    jars = [str(iceberg_spark_runtime_jar()), *_jdbc_driver_jars(jdbc_uri(uri)), *extra_jars]
    prefix = f"spark.sql.catalog.{name}"
    conf = {
        "spark.master": master or spark_master(),
        "spark.app.name": "danube-pipeline",
        "spark.jars": ",".join(jars),
        "spark.sql.extensions": "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions",
        prefix: "org.apache.iceberg.spark.SparkCatalog",
        f"{prefix}.type": "jdbc",
        f"{prefix}.uri": jdbc_uri(uri),
        f"{prefix}.warehouse": wh,
        # pyiceberg commits between Spark statements: always read the catalog's current metadata.
        f"{prefix}.cache-enabled": "false",
        # pyiceberg's SqlCatalog creates the catalog tables. Iceberg's own check for them leaves
        # a sqlite-jdbc metadata cursor open on a pooled connection, which pins that connection
        # to an old read snapshot (Spark then misses later pyiceberg commits) and, without WAL,
        # blocks pyiceberg's commits with "database is locked".
        f"{prefix}.jdbc.init-catalog-tables": "false",
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
        "spark.default.parallelism": str(shuffle_partitions),
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.memory": "1g",
        "spark.sql.session.timeZone": "UTC",
    }
    for key, value in jdbc_properties(uri).items():
        if key == "password":
            _remember_password(uri, value)
        else:
            conf[f"{prefix}.jdbc.{key}"] = value
    return conf


_pgpass_lock = threading.Lock()
_pgpass_lines: dict[str, str] = {}
_pgpass_path: Path | None = None


def _pgpass_escape(field: str) -> str:
    r"""Escape a password-file field: ``\`` and ``:`` get a backslash (PostgreSQL docs,
    "The Password File")."""
    return field.replace("\\", "\\\\").replace(":", "\\:")


def _remember_password(catalog_uri: str, password: str) -> None:
    """Add the catalog's ``host:port:database:user:password`` line to :func:`pgpass_file`, and
    point a running JVM at that file.

    Raises:
        DatabaseUrlError: the PostgreSQL URI lacks its host or database.
    """
    global _pgpass_path
    url = settings.parse_postgres_url(catalog_uri)
    key = ":".join(_pgpass_escape(part) for part in (url.host, str(url.port), url.database, url.user or "*"))
    with _pgpass_lock:
        if _pgpass_lines.get(key) != password:
            _pgpass_lines[key] = password
            if _pgpass_path is None:
                directory = tempfile.mkdtemp(prefix="danube-pgpass-")  # mode 0700
                atexit.register(shutil.rmtree, directory, ignore_errors=True)
                _pgpass_path = Path(directory) / "pgpass"
            text = "".join(f"{k}:{_pgpass_escape(p)}\n" for k, p in _pgpass_lines.items())
            fd = os.open(_pgpass_path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(text)
            os.replace(_pgpass_path.with_suffix(".tmp"), _pgpass_path)
    _point_jvm_at_pgpass()


def pgpass_file() -> Path | None:
    """The private password file holding the passwords of the PostgreSQL catalogs that
    :func:`spark_conf` configured in this process, or ``None`` when none had a password.

    One ``host:port:database:user:password`` line per catalog, mode 0600, in a directory of its
    own (``tempfile.mkdtemp``, removed when the process exits). The PostgreSQL JDBC driver reads it when a connection has no
    ``password`` property, since the JVM's ``org.postgresql.pgpassfile`` system property
    names it (:func:`build_spark_session` sets it; a catalog configured while the JVM runs sets
    it at once). That property takes precedence over ``$PGPASSFILE`` and ``~/.pgpass``.

    Returns:
        The file's path, or ``None``.
    """
    with _pgpass_lock:
        return _pgpass_path if _pgpass_lines else None


def _point_jvm_at_pgpass() -> None:
    """Set the running JVM's ``org.postgresql.pgpassfile`` to :func:`pgpass_file`; nothing when
    no JVM runs yet or there is no file (:func:`build_spark_session` does it at launch)."""
    path = pgpass_file()
    if path is None or "pyspark" not in sys.modules:
        return
    from pyspark import SparkContext

    jvm = getattr(SparkContext, "_jvm", None)
    if jvm is not None:
        jvm.java.lang.System.setProperty(PGPASSFILE_PROPERTY, str(path))


def _jdbc_driver_jars(jdbc_url: str) -> list[str]:
    """The JDBC driver jars for ``spark.jars``: the one ``jdbc_url`` needs (it must exist), then
    the other catalog driver when it is installed.

    Raises:
        SparkSetupError: the driver ``jdbc_url`` needs is missing.
    """
    if jdbc_url.startswith("jdbc:postgresql:"):
        jars = [str(postgresql_jdbc_jar())]
        try:
            jars.append(str(sqlite_jdbc_jar()))
        except SparkSetupError:
            pass  # only a later SQLite catalog in the same JVM would need it
        return jars
    pg = postgresql_jdbc_jar(required=False)
    return [str(sqlite_jdbc_jar()), *([str(pg)] if pg is not None else [])]


def grpc_fork_hazard() -> str | None:
    """Why launching Spark's JVM now is unsafe, or ``None`` when it is not.

    PySpark launches the JVM with ``fork`` and a ``preexec_fn``. In a process that imported
    ``grpc`` with its fork support on (``GRPC_ENABLE_FORK_SUPPORT`` unset or true, read at
    that import), gRPC's fork handlers run at that fork and, while channels are busy, can break
    the parent's poller. The cure is ``GRPC_ENABLE_FORK_SUPPORT=false`` before ``grpc`` is
    imported (the ``assets`` package sets it), or the JVM launched before ``grpc`` is imported.

    Returns:
        A sentence naming the hazard, or ``None``: the JVM already runs, ``grpc`` is not
        imported, or its fork support is off.
    """
    from pyspark import SparkContext

    if getattr(SparkContext, "_gateway", None) is not None or "grpc" not in sys.modules:
        return None
    if os.environ.get(GRPC_FORK_SUPPORT_ENV, "").strip().lower() in ("false", "0", "no", "off"):
        return None
    return (
        "Spark's JVM is launched (fork + exec) in a process that imported grpc with its fork "
        f"support on; set {GRPC_FORK_SUPPORT_ENV}=false before grpc is imported, or start Spark first"
    )


def build_spark_session(conf: Mapping[str, str] | None = None, **kwargs: Any) -> SparkSession:
    """Get or create a Spark session.

    Launching the JVM logs a warning when :func:`grpc_fork_hazard` names one.

    Jars are fixed when the JVM starts: a second call in one process with different jars
    gets the first session's jars. ``PYSPARK_PYTHON`` is set to this interpreter when unset,
    so Python tasks (``mapInArrow``, UDFs) run with the same packages, locally and on the
    workers of a standalone cluster on this host.

    Args:
        conf: the Spark configuration; default :func:`spark_conf` of ``kwargs``.
        **kwargs: keyword arguments of :func:`spark_conf`, used when ``conf`` is ``None``.

    Returns:
        The session, its log level set to ``WARN``.

    Raises:
        SparkSetupError: a jar is missing (when ``conf`` is built here).
    """
    from pyspark.sql import SparkSession

    conf = dict(conf) if conf is not None else spark_conf(**kwargs)
    # PySpark passes the driver's PYSPARK_PYTHON to every executor as the worker interpreter.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    hazard = grpc_fork_hazard()
    if hazard is not None:
        log.warning("%s", hazard)
    builder = SparkSession.builder
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    _point_jvm_at_pgpass()
    return spark
