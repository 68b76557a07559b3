"""Spark on the shared Iceberg catalog: jar lookup, session configuration, compaction and the
table maintenance retention needs.

Spark's Iceberg ``JdbcCatalog`` reads and commits to the same SQL catalog database as
pyiceberg's ``SqlCatalog``; ``docs/architecture.md`` explains the SQLite settings both
sides need. pyiceberg cannot compact; :func:`compact_table` runs Iceberg's
``rewrite_data_files`` procedure. :func:`delete_rows_below`, :func:`expire_snapshots` and
:func:`remove_orphan_files` are the Spark side of :mod:`danube_pipeline.lake.retention`;
:func:`load_java_table` and :func:`row_checksum` serve :mod:`danube_pipeline.lake.rewrite`.

None of these touch table properties, so the committed end offset that
:func:`danube_pipeline.lake.iceberg.append_records` keeps in the property
``danube.committed-end-offset`` survives all of them (Iceberg commits carry the table's
properties over from the metadata they replace).

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

import datetime as dt
import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from danube_pipeline import settings
from danube_pipeline.errors import DanubeError
from danube_pipeline.lake.iceberg.layout import day_bounds_ms
from danube_pipeline.names import TopicName

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

__all__ = [
    "CompactionResult",
    "RowChecksum",
    "SparkSetupError",
    "build_spark_session",
    "checksum_of",
    "compact_table",
    "delete_rows_below",
    "expire_snapshots",
    "iceberg_spark_runtime_jar",
    "jdbc_properties",
    "jdbc_uri",
    "load_java_table",
    "postgresql_jdbc_jar",
    "remove_orphan_files",
    "row_checksum",
    "row_hash",
    "spark_conf",
    "spark_master",
    "spark_table_name",
    "sqlite_jdbc_jar",
]

ICEBERG_JAR_ENV = "DANUBE_ICEBERG_SPARK_JAR"
SQLITE_JAR_ENV = "DANUBE_SQLITE_JDBC_JAR"
ICEBERG_JAR_PACKAGE = "snowpark_connect_deps_iceberg"
ICEBERG_JAR_GLOB = "iceberg-spark-runtime-3.5_2.12-*.jar"
DEFAULT_SQLITE_JAR = Path("/usr/share/java/sqlite-jdbc.jar")
POSTGRES_JAR_ENV = "DANUBE_POSTGRESQL_JDBC_JAR"
DEFAULT_POSTGRES_JAR = Path("/usr/share/java/postgresql.jar")
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


def build_spark_session(conf: Mapping[str, str] | None = None, **kwargs: Any) -> SparkSession:
    """Get or create a Spark session.

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
    builder = SparkSession.builder
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


@dataclass(frozen=True, slots=True)
class CompactionResult:
    """What :func:`compact_table` did (counts from ``rewrite_data_files`` and ``.files``).

    Attributes:
        data_files_before: live data files before.
        data_files_after: live data files after.
        rewritten_data_files: input files replaced.
        added_data_files: output files written.
        rewritten_bytes: bytes of the replaced files.
        snapshot_id: the table's current snapshot afterwards (``None`` for an empty table).
    """

    data_files_before: int
    data_files_after: int
    rewritten_data_files: int
    added_data_files: int
    rewritten_bytes: int
    snapshot_id: int | None


def _q(part: str) -> str:
    return f"`{part}`"


def compact_table(
    spark: SparkSession,
    topic: TopicName,
    *,
    catalog_name: str | None = None,
    min_input_files: int = 2,
    day: dt.date | None = None,
    rewrite_all: bool = False,
) -> CompactionResult:
    """Rewrite the topic table's small data files into fewer, larger ones, sorted by ``_offset``.

    Runs ``CALL {catalog}.system.rewrite_data_files(table => 'ns.topic', strategy => 'sort',
    options => map('min-input-files', '2'[, 'rewrite-all', ...]), where => ...)``: the ``sort``
    strategy writes each output file in the table's sort order (``_offset``,
    :mod:`danube_pipeline.lake.iceberg.layout`), and with ``day`` only the files holding rows
    published that UTC day are considered, so the other days' partitions are not touched.
    Files written under an older partition spec are rewritten into the current one. The rewrite
    commits a ``replace`` snapshot that carries no ``danube.*`` summary properties and keeps the
    table's properties, among them ``danube.committed-end-offset``, which
    :func:`danube_pipeline.lake.iceberg.committed_end_offset` reads.

    Args:
        spark: a session from :func:`build_spark_session` on the table's catalog.
        topic: the topic whose table to compact.
        catalog_name: the Spark catalog name; default ``settings.catalog_name()``.
        min_input_files: rewrite a file group only when it has at least this many files.
        day: compact only the rows of this UTC day (``_publish_time`` in ``[day, day + 1)``);
            ``None``: the whole table.
        rewrite_all: rewrite every selected file, even a lone one (to move files written under
            an older partition spec into the current one).

    Returns:
        A :class:`CompactionResult` (file counts of the whole table).

    Raises:
        pyspark.errors.AnalysisException: the table does not exist.
    """
    name = catalog_name or settings.catalog_name()
    full = f"{_q(name)}.{_q(topic.namespace)}.{_q(topic.topic)}"
    before = int(spark.sql(f"SELECT count(*) AS n FROM {full}.files").collect()[0]["n"])
    where = ""
    if day is not None:
        # the procedure's where is a string literal: double-quoted, so the timestamp literals
        # inside keep their single quotes
        where = f', where => "{_day_predicate(day)}"'
    options = f"'min-input-files', '{int(min_input_files)}'"
    if rewrite_all:
        options += ", 'rewrite-all', 'true'"
    row = spark.sql(
        f"CALL {_q(name)}.system.rewrite_data_files("
        f"table => '{topic.namespace}.{topic.topic}', strategy => 'sort', "
        f"options => map({options}){where})"
    ).collect()[0]
    result = row.asDict()
    after = int(spark.sql(f"SELECT count(*) AS n FROM {full}.files").collect()[0]["n"])
    snaps = spark.sql(
        f"SELECT snapshot_id FROM {full}.history WHERE is_current_ancestor "
        "ORDER BY made_current_at DESC LIMIT 1"
    ).collect()
    return CompactionResult(
        data_files_before=before,
        data_files_after=after,
        rewritten_data_files=int(result.get("rewritten_data_files_count") or 0),
        added_data_files=int(result.get("added_data_files_count") or 0),
        rewritten_bytes=int(result.get("rewritten_bytes_count") or 0),
        snapshot_id=int(snaps[0]["snapshot_id"]) if snaps else None,
    )


def _table_ref(topic: TopicName, catalog_name: str | None) -> tuple[str, str]:
    """``(catalog, `catalog`.`ns`.`topic`)`` for SQL statements on the topic's table."""
    name = catalog_name or settings.catalog_name()
    return name, f"{_q(name)}.{_q(topic.namespace)}.{_q(topic.topic)}"


def _timestamp_literal(epoch_ms: int) -> str:
    """A Spark SQL ``TIMESTAMP`` literal for ``epoch_ms`` (UTC, millisecond precision), read the
    same whatever the session's time zone."""
    moment = dt.datetime.fromtimestamp(epoch_ms / 1000, tz=dt.UTC)
    return f"TIMESTAMP '{moment.strftime('%Y-%m-%d %H:%M:%S.%f')[:-3]}Z'"


def _day_predicate(day: dt.date) -> str:
    """Spark SQL: ``_publish_time`` within the UTC ``day``."""
    start_ms, end_ms = day_bounds_ms(day)
    return f"_publish_time >= {_timestamp_literal(start_ms)} AND _publish_time < {_timestamp_literal(end_ms)}"


def delete_rows_below(
    spark: SparkSession,
    topic: TopicName,
    offset: int,
    *,
    catalog_name: str | None = None,
    partition: int | None = None,
    day: dt.date | None = None,
) -> None:
    """``DELETE FROM {catalog}.{ns}.{topic} WHERE _offset < {offset}`` (``AND _partition = {i}``
    for partition ``i`` of a partitioned topic's table, ``AND _publish_time`` within ``day``
    for one day's table partitions).

    Iceberg drops a data file from the table without rewriting it when every row of it
    matches (its ``_offset`` upper bound is below ``offset``); a file that holds rows on both
    sides is rewritten without the matching rows (copy-on-write, the default
    ``write.delete.mode``). One commit; a ``delete`` or ``overwrite`` snapshot.

    Args:
        spark: a session from :func:`build_spark_session` on the table's catalog.
        topic: the topic whose table it is (the partitioned topic, for a partition).
        offset: rows with a smaller ``_offset`` are deleted.
        catalog_name: the Spark catalog name; default ``settings.catalog_name()``.
        partition: only rows of this partition (``_partition``), whose offsets are its own
            (``docs/etcd-layout.md`` §3.1); ``None`` for a plain topic's table.
        day: only rows published on this UTC day (the files of that day's table partitions
            are the only ones read or rewritten); ``None``: every day.

    Raises:
        pyspark.errors.AnalysisException: the table does not exist.
        Py4JJavaError: the commit failed (e.g. a conflicting concurrent commit that Iceberg's
            validation refuses).
    """
    _, full = _table_ref(topic, catalog_name)
    where = f"_offset < {int(offset)}"
    if partition is not None:
        where = f"_partition = {int(partition)} AND {where}"
    if day is not None:
        where = f"{_day_predicate(day)} AND {where}"
    spark.sql(f"DELETE FROM {full} WHERE {where}").collect()


def expire_snapshots(
    spark: SparkSession,
    topic: TopicName,
    *,
    older_than_ms: int,
    retain_last: int = 1,
    catalog_name: str | None = None,
) -> int:
    """``CALL {catalog}.system.expire_snapshots(table => 'ns.topic', older_than => …,
    retain_last => …)``: removes the snapshots older than ``older_than_ms`` beyond the newest
    ``retain_last``, and deletes the files only they referenced (so deleted rows are gone from
    storage, not just from the current snapshot). The current snapshot is never expired.

    Args:
        spark: a session from :func:`build_spark_session` on the table's catalog.
        topic: the topic whose table it is.
        older_than_ms: milliseconds since the Unix epoch.
        retain_last: snapshots kept whatever their age (at least 1).
        catalog_name: the Spark catalog name; default ``settings.catalog_name()``.

    Returns:
        Data files deleted (the procedure's ``deleted_data_files_count``).

    Raises:
        pyspark.errors.AnalysisException: the table does not exist.
    """
    name, _ = _table_ref(topic, catalog_name)
    row = spark.sql(
        f"CALL {_q(name)}.system.expire_snapshots("
        f"table => '{topic.namespace}.{topic.topic}', "
        f"older_than => {_timestamp_literal(older_than_ms)}, "
        f"retain_last => {max(1, int(retain_last))})"
    ).collect()[0]
    return int(row.asDict().get("deleted_data_files_count") or 0)


ORPHAN_MIN_AGE_MS = 24 * 3600 * 1000
"""The youngest ``older_than`` Iceberg's ``remove_orphan_files`` procedure accepts: files a
writer has written but not committed yet look like orphans, and deleting them would corrupt
the table once the commit lands."""


def remove_orphan_files(
    spark: SparkSession, topic: TopicName, *, older_than_ms: int, catalog_name: str | None = None
) -> list[str]:
    """``CALL {catalog}.system.remove_orphan_files(table => 'ns.topic', older_than => …)``:
    deletes files under the table's location that no snapshot or metadata file references
    and that were last modified before ``older_than_ms``.

    Orphans come from commits that never landed: a writer that died between writing its files
    and committing them, or a commit that lost the optimistic-concurrency race. Files of a
    commit still in flight look the same, hence the age limit.

    Args:
        spark: a session from :func:`build_spark_session` on the table's catalog.
        topic: the topic whose table it is.
        older_than_ms: milliseconds since the Unix epoch; at least :data:`ORPHAN_MIN_AGE_MS`
            before now, or Iceberg refuses.
        catalog_name: the Spark catalog name; default ``settings.catalog_name()``.

    Returns:
        The deleted files' locations (``file:/…`` for a local warehouse).

    Raises:
        pyspark.errors.AnalysisException: the table does not exist.
        IllegalArgumentException: ``older_than_ms`` is less than 24 hours ago.
    """
    name, _ = _table_ref(topic, catalog_name)
    rows = spark.sql(
        f"CALL {_q(name)}.system.remove_orphan_files("
        f"table => '{topic.namespace}.{topic.topic}', "
        f"older_than => {_timestamp_literal(older_than_ms)})"
    ).collect()
    return [str(r["orphan_file_location"]) for r in rows]


def spark_table_name(topic: TopicName, catalog_name: str | None = None) -> str:
    """The topic table's multi-part name for Spark: ``danube.default.flights``, each of the
    three parts in back quotes.

    Args:
        topic: the topic whose table it is.
        catalog_name: the Spark catalog name; default ``settings.catalog_name()``.

    Returns:
        The name, usable in SQL, in ``spark.table`` and in ``DataFrameReader.load``.
    """
    return _table_ref(topic, catalog_name)[1]


def load_java_table(spark: SparkSession, name: str) -> Any:
    """The Iceberg Java ``Table`` behind a Spark catalog table (``Spark3Util.loadIcebergTable``),
    for the Iceberg API calls Spark SQL has no statement for (``newRewrite``, ``planFiles``).

    Each call loads the table's current metadata from the catalog (the session's catalog
    cache is off: :func:`spark_conf`).

    Args:
        spark: a session from :func:`build_spark_session`.
        name: ``catalog.ns.table`` (parts may be back-quoted), e.g. :func:`spark_table_name`.

    Returns:
        A Py4J proxy of ``org.apache.iceberg.Table``.

    Raises:
        Py4JJavaError: the table does not exist (``NoSuchTableException``) or is not Iceberg.
    """
    jvm: Any = getattr(spark, "_jvm")  # noqa: B009 - Py4J's view of the JVM, untyped
    return jvm.org.apache.iceberg.spark.Spark3Util.loadIcebergTable(spark._jsparkSession, name)


@dataclass(frozen=True, slots=True)
class RowChecksum:
    """An order-free fingerprint of a set of rows (:func:`row_checksum`).

    Attributes:
        rows: the number of rows.
        checksum: the exact sum (no overflow: summed as ``DECIMAL(38,0)``) of each row's
            64-bit ``xxhash64``; 0 for no rows.
    """

    rows: int
    checksum: int


def row_hash(df: DataFrame, columns: tuple[str, ...] | list[str]) -> Column:
    """A 64-bit hash of each row's ``columns`` (a Spark column expression over ``df``).

    ``xxhash64(isnull(c1), c1, isnull(c2), c2, …)`` (Spark's xxHash64, seed 42): the null flags
    keep ``(null, 1)`` and ``(1, null)`` apart (``xxhash64`` skips nulls); maps, arrays and
    structs are hashed as their ``to_json`` text, since Spark does not hash maps. No columns
    hash to 0.

    Args:
        df: the DataFrame whose columns are hashed.
        columns: the column names.

    Returns:
        A ``LongType`` column.
    """
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    kinds = {f.name: f.dataType for f in df.schema.fields}
    args = []
    for name in columns:
        column = F.col(f"`{name}`")
        value = F.to_json(column) if isinstance(kinds.get(name), T.MapType | T.ArrayType | T.StructType) else column
        args += [F.isnull(column), value]
    return F.xxhash64(*args) if args else F.lit(0).cast("long")


def checksum_of(row_hashes: Column) -> Column:
    """The order-free aggregate of :func:`row_hash` values: their exact sum, as
    ``DECIMAL(38,0)`` (no overflow below 10**19 rows), 0 for no rows."""
    from pyspark.sql import functions as F

    return F.coalesce(F.sum(row_hashes.cast("decimal(38,0)")), F.lit(0).cast("decimal(38,0)"))


def row_checksum(df: DataFrame, columns: tuple[str, ...] | list[str]) -> RowChecksum:
    """Row count and an order-free checksum of ``columns``, computed in Spark (one job).

    Each row hashes with :func:`row_hash`; the hashes are summed exactly
    (:func:`checksum_of`). Equal multisets of rows give equal results whatever their order or
    file layout.

    Args:
        df: the rows.
        columns: the columns to fingerprint, by name; an empty list counts rows only.

    Returns:
        A :class:`RowChecksum`.

    Raises:
        pyspark.errors.AnalysisException: a column does not exist.
    """
    from pyspark.sql import functions as F

    row = df.agg(F.count(F.lit(1)).alias("rows"), checksum_of(row_hash(df, columns)).alias("checksum")).collect()[0]
    return RowChecksum(int(row["rows"]), int(row["checksum"]))
