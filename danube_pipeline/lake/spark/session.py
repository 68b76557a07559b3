"""The Spark session on the shared Iceberg catalog: jar lookup, master, JDBC catalog
configuration.

Jars: the Iceberg Spark runtime comes from the ``snowpark-connect-deps-iceberg`` 1.0.1 wheel
(``jars/iceberg-spark-runtime-3.5_2.12-1.9.2.jar``) unless ``DANUBE_ICEBERG_SPARK_JAR`` names
another; the SQLite JDBC driver from Debian's ``libxerial-sqlite-jdbc-java`` unless
``DANUBE_SQLITE_JDBC_JAR`` names another; the PostgreSQL JDBC driver (for a catalog on
PostgreSQL) from Debian's ``libpostgresql-jdbc-java`` unless ``DANUBE_POSTGRESQL_JDBC_JAR`` names
another.

Master: ``local[*]`` (every core of this host) unless ``DANUBE_SPARK_MASTER`` names another
(``spark://host:7077`` for a standalone cluster; :func:`spark_master`). Python workers run
the driver's own interpreter unless ``PYSPARK_PYTHON`` is set (:func:`build_spark_session`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
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
    belong in ``jdbc.user``/``jdbc.password``: :func:`jdbc_properties`); a ``jdbc:`` URI is
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
            URI's user and password become ``jdbc.user`` and ``jdbc.password``
            (:func:`jdbc_properties`). The JDBC driver it needs must exist; the other one is
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
        conf[f"{prefix}.jdbc.{key}"] = value
    return conf


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
    return spark
