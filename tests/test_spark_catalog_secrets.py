"""A PostgreSQL catalog's password stays out of Spark's configuration.

``spark_conf`` keeps ``jdbc.user`` only and writes the password to a private password file
that the JVM's ``org.postgresql.pgpassfile`` property names; Spark still reads the catalog on a
real PostgreSQL server (``postgres_server.py``) that requires that password.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pyarrow as pa
import pytest
from helpers import RegisterCatalog
from postgres_server import PostgresServer
from pyiceberg.schema import Schema
from pyiceberg.types import LongType, NestedField

from danube_pipeline import settings
from danube_pipeline.lake import iceberg
from danube_pipeline.lake.spark.session import PGPASSFILE_PROPERTY, pgpass_file, spark_conf

CATALOG = "danube_pg_secret"


@pytest.mark.unit
def test_spark_conf_holds_the_user_but_not_the_password() -> None:
    url = "postgresql+psycopg2://ice%40berg:p%40ss%3Aw%2F%5Crd@db.example:5433/cat%20alog"
    conf = spark_conf(catalog_name="c1", catalog_uri=url, warehouse="file:///w")
    assert conf["spark.sql.catalog.c1.jdbc.user"] == "ice@berg"
    assert not any("password" in key for key in conf)
    assert not any("p@ss" in value for value in conf.values())
    path = pgpass_file()
    assert path is not None
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    # the .pgpass format, with ':' and '\' escaped
    assert "db.example:5433:cat alog:ice@berg:p@ss\\:w/\\\\rd\n" in path.read_text()


@pytest.mark.spark
def test_spark_reads_a_postgres_catalog_without_the_password_in_its_conf(
    postgres: PostgresServer, postgres_url: str, tmp_path: Path, spark_on_catalog: RegisterCatalog
) -> None:
    warehouse = (tmp_path / "warehouse").as_uri()
    catalog = iceberg.load_catalog(name=CATALOG, uri=postgres_url, warehouse=warehouse)
    catalog.create_namespace("default")
    table = catalog.create_table(
        ("default", "readings"), schema=Schema(NestedField(1, "id", LongType(), required=False))
    )
    table.append(pa.table({"id": pa.array(range(10), pa.int64())}))

    spark = spark_on_catalog(name=CATALOG, uri=postgres_url, warehouse=warehouse)
    row = spark.sql(f"SELECT count(*) AS n, sum(id) AS s FROM `{CATALOG}`.`default`.`readings`").collect()[0]
    assert (row["n"], row["s"]) == (10, sum(range(10)))

    # the URL carries the password the server requires; Spark's settings must not
    assert settings.parse_postgres_url(postgres_url).password == postgres.password
    static_conf = spark.sparkContext.getConf().getAll()
    runtime_conf = [(r["key"], r["value"]) for r in spark.sql("SET -v").collect()]
    runtime_conf += [(r["key"], r["value"]) for r in spark.sql("SET").collect()]
    assert any(key == f"spark.sql.catalog.{CATALOG}.jdbc.user" for key, _ in runtime_conf)
    for key, value in [*static_conf, *runtime_conf]:
        assert postgres.password not in str(value), key
        assert not key.endswith("jdbc.password"), key
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    assert jvm.java.lang.System.getProperty(PGPASSFILE_PROPERTY) == str(pgpass_file())
