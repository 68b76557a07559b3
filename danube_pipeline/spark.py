"""Spark on the shared Iceberg catalog: jar lookup, session configuration, compaction and the
table maintenance retention needs.

Spark's Iceberg ``JdbcCatalog`` reads and commits to the same SQL catalog database as
pyiceberg's ``SqlCatalog``; ``docs/architecture.md`` explains the SQLite settings both
sides need. pyiceberg cannot compact; :func:`compact_table` runs Iceberg's
``rewrite_data_files`` procedure. :func:`delete_rows_below`, :func:`expire_snapshots` and
:func:`remove_orphan_files` are the Spark side of :mod:`danube_pipeline.retention`;
:func:`load_java_table` and :func:`row_checksum` serve :mod:`danube_pipeline.rewrite`.

None of these touch table properties, so the committed end offset that
:func:`danube_pipeline.iceberg.append_records` keeps in the property
``danube.committed-end-offset`` survives all of them (Iceberg commits carry the table's
properties over from the metadata they replace).

Jars: the Iceberg Spark runtime comes from the ``snowpark-connect-deps-iceberg`` 1.0.1 wheel
(``jars/iceberg-spark-runtime-3.5_2.12-1.9.2.jar``) unless ``DANUBE_ICEBERG_SPARK_JAR`` names
another; the SQLite JDBC driver from Debian's ``libxerial-sqlite-jdbc-java`` unless
``DANUBE_SQLITE_JDBC_JAR`` names another.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from danube_pipeline import settings
from danube_pipeline.errors import DanubeError
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
    "jdbc_uri",
    "load_java_table",
    "remove_orphan_files",
    "row_checksum",
    "row_hash",
    "spark_conf",
    "spark_table_name",
    "sqlite_jdbc_jar",
]

ICEBERG_JAR_ENV = "DANUBE_ICEBERG_SPARK_JAR"
SQLITE_JAR_ENV = "DANUBE_SQLITE_JDBC_JAR"
ICEBERG_JAR_PACKAGE = "snowpark_connect_deps_iceberg"
ICEBERG_JAR_GLOB = "iceberg-spark-runtime-3.5_2.12-*.jar"
DEFAULT_SQLITE_JAR = Path("/usr/share/java/sqlite-jdbc.jar")


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


def jdbc_uri(catalog_uri: str) -> str:
    """Turn pyiceberg's SQLAlchemy URI into a JDBC one.

    ``sqlite:////abs/catalog.db`` → ``jdbc:sqlite:/abs/catalog.db``;
    ``postgresql+psycopg2://u:p@h:5432/db`` → ``jdbc:postgresql://h:5432/db`` (credentials
    belong in ``jdbc.user``/``jdbc.password``); a ``jdbc:`` URI is returned unchanged.

    Args:
        catalog_uri: a SQLAlchemy URI (``sqlite:///…``, ``postgresql…://…``) or a JDBC URI.

    Returns:
        The JDBC URI.

    Raises:
        ValueError: the URI is neither SQLite, PostgreSQL nor JDBC.
    """
    if catalog_uri.startswith("jdbc:"):
        return catalog_uri
    if catalog_uri.startswith("sqlite:///"):
        return "jdbc:sqlite:" + catalog_uri[len("sqlite:///") :]
    m = re.match(r"^postgres(?:ql)?(?:\+\w+)?://(?:[^@/]*@)?(.*)$", catalog_uri)
    if m:
        return f"jdbc:postgresql://{m.group(1)}"
    raise ValueError(f"cannot convert catalog URI {catalog_uri!r} to JDBC")


def spark_conf(
    *,
    catalog_name: str | None = None,
    catalog_uri: str | None = None,
    warehouse: str | None = None,
    master: str = "local[2]",
    shuffle_partitions: int = 4,
    extra_jars: tuple[str, ...] = (),
) -> dict[str, str]:
    """Spark settings for a session on the shared Iceberg catalog.

    Args:
        catalog_name: Spark catalog name (``spark.sql.catalog.<name>``); defaults to
            ``settings.catalog_name()``, the same name pyiceberg uses.
        catalog_uri: pyiceberg's SQLAlchemy URI, converted with :func:`jdbc_uri`.
        warehouse: the warehouse URL pyiceberg uses.
        master: Spark master URL.
        shuffle_partitions: ``spark.sql.shuffle.partitions`` (small: local data).
        extra_jars: more jars for ``spark.jars`` (e.g. ``iceberg-aws-bundle`` for S3).

    Returns:
        ``{spark conf key: value}``, e.g. ``spark.sql.catalog.danube.uri``.

    Raises:
        SparkSetupError: a jar is missing.
        ValueError: the catalog URI cannot be converted to JDBC.
    """
    name = catalog_name or settings.catalog_name()
    uri = catalog_uri or settings.catalog_uri()
    wh = warehouse or settings.warehouse_url()
    jars = [str(iceberg_spark_runtime_jar()), str(sqlite_jdbc_jar()), *extra_jars]
    prefix = f"spark.sql.catalog.{name}"
    conf = {
        "spark.master": master,
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
    if uri.startswith("postgres"):
        m = re.match(r"^postgres(?:ql)?(?:\+\w+)?://([^:@/]*)(?::([^@/]*))?@", uri)
        if m:
            conf[f"{prefix}.jdbc.user"] = m.group(1)
            if m.group(2):
                conf[f"{prefix}.jdbc.password"] = m.group(2)
    return conf


def build_spark_session(conf: Mapping[str, str] | None = None, **kwargs: Any) -> SparkSession:
    """Get or create a Spark session.

    Jars are fixed when the JVM starts: a second call in one process with different jars
    gets the first session's jars.

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
) -> CompactionResult:
    """Rewrite the topic table's small data files into fewer, larger ones.

    Runs ``CALL {catalog}.system.rewrite_data_files(table => 'ns.topic',
    options => map('min-input-files', '2'))``. The rewrite commits a ``replace`` snapshot that
    carries no ``danube.*`` summary properties and keeps the table's properties, among them
    ``danube.committed-end-offset``, which :func:`danube_pipeline.iceberg.committed_end_offset`
    reads.

    Args:
        spark: a session from :func:`build_spark_session` on the table's catalog.
        topic: the topic whose table to compact.
        catalog_name: the Spark catalog name; default ``settings.catalog_name()``.
        min_input_files: rewrite a file group only when it has at least this many files.

    Returns:
        A :class:`CompactionResult`.

    Raises:
        pyspark.errors.AnalysisException: the table does not exist.
    """
    name = catalog_name or settings.catalog_name()
    full = f"{_q(name)}.{_q(topic.namespace)}.{_q(topic.topic)}"
    before = int(spark.sql(f"SELECT count(*) AS n FROM {full}.files").collect()[0]["n"])
    row = spark.sql(
        f"CALL {_q(name)}.system.rewrite_data_files("
        f"table => '{topic.namespace}.{topic.topic}', "
        f"options => map('min-input-files', '{int(min_input_files)}'))"
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


def delete_rows_below(
    spark: SparkSession,
    topic: TopicName,
    offset: int,
    *,
    catalog_name: str | None = None,
    partition: int | None = None,
) -> None:
    """``DELETE FROM {catalog}.{ns}.{topic} WHERE _offset < {offset}`` (``AND _partition = {i}``
    for partition ``i`` of a partitioned topic's table).

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

    Raises:
        pyspark.errors.AnalysisException: the table does not exist.
        Py4JJavaError: the commit failed (e.g. a conflicting concurrent commit that Iceberg's
            validation refuses).
    """
    _, full = _table_ref(topic, catalog_name)
    where = f"_offset < {int(offset)}"
    if partition is not None:
        where = f"_partition = {int(partition)} AND {where}"
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
