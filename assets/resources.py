"""Dagster resources: the four systems the assets talk to, plus Spark.

:mod:`assets.definitions` binds every endpoint and path to its ``DANUBE_*`` variable with
``EnvVar`` (``EtcdResource(endpoints=EnvVar("DANUBE_ETCD_ENDPOINTS"))``), so Dagster resolves
them when a run starts and shows them in the UI. A field left unset (a resource built in a
test or a script) falls back to :mod:`danube_pipeline.settings`, which reads the same
variables and fills in local defaults under ``DANUBE_HOME``.

The assets never import ``broker/``: they reach the broker only through its gRPC admin API.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from dagster import ConfigurableResource
from pydantic import Field
from pyiceberg.catalog.sql import SqlCatalog

from danube_pipeline import settings
from danube_pipeline.lake.iceberg import load_catalog
from danube_pipeline.storage.identity import check_store_identity
from danube_pipeline.storage.objectstore import ObjectStore
from danube_pipeline.lake.spark.session import build_spark_session, spark_conf

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from danube_pipeline.client import DanubeClient
    from danube_pipeline.metadata.store import MetadataStore


_T = TypeVar("_T")

ASSETS_STORE_CHECKER = "assets"
"""How the assets name themselves in an object store identity check's error and log."""


def _split(value: str) -> list[str]:
    return [p.strip() for p in value.split(",") if p.strip()]


def _run_to_end(coroutine: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coroutine`` to its end: here when no event loop runs in this thread, else on a
    loop of its own in another thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


class EtcdResource(ConfigurableResource[Any]):
    """The etcd cluster holding Danube's metadata (key layout: ``docs/etcd-layout.md``)."""

    endpoints: str | None = Field(
        default=None,
        description="Comma-separated host:port etcd endpoints; default $DANUBE_ETCD_ENDPOINTS or 127.0.0.1:2379.",
    )
    connect_timeout_s: float = Field(default=5.0, description="Seconds to wait for etcd when connecting.")

    def endpoint_list(self) -> list[str]:
        """The endpoints to connect to.

        Returns:
            ``host:port`` strings: :attr:`endpoints` split at commas, or
            ``settings.etcd_endpoints()`` when it is unset.
        """
        return _split(self.endpoints) if self.endpoints else settings.etcd_endpoints()

    async def connect(self) -> MetadataStore:
        """Connect to etcd; use it as ``async with await etcd.connect() as store``.

        Returns:
            A connected :class:`MetadataStore`.

        Raises:
            MetadataStoreError: no endpoint answered within :attr:`connect_timeout_s` seconds.
        """
        from danube_pipeline.metadata.store import MetadataStore

        return await MetadataStore.connect(self.endpoint_list(), connect_timeout_s=self.connect_timeout_s)


class BrokerResource(ConfigurableResource[Any]):
    """Bootstrap brokers for the admin gRPC API (list and read sealed segments).

    The client learns the whole cluster from whichever bootstrap broker answers first.
    """

    bootstrap_addresses: str | None = Field(
        default=None,
        description=(
            "Comma-separated host:port bootstrap brokers; default $DANUBE_BROKER_ADDRESSES or 127.0.0.1:6650."
        ),
    )

    def address_list(self) -> list[str]:
        """The bootstrap addresses.

        Returns:
            ``host:port`` strings: :attr:`bootstrap_addresses` split at commas, or
            ``settings.broker_addresses()`` when it is unset.
        """
        return _split(self.bootstrap_addresses) if self.bootstrap_addresses else settings.broker_addresses()

    def client(self) -> DanubeClient:
        """A new client; use it as ``async with broker.client() as client``.

        Returns:
            A :class:`DanubeClient` on :meth:`address_list`, not connected until entered.
        """
        from danube_pipeline.client import DanubeClient

        return DanubeClient(self.address_list())


class ObjectStoreResource(ConfigurableResource[Any]):
    """Where sealed segments are tiered: ``file://`` by default, ``s3://`` for S3 or MinIO."""

    root_url: str | None = Field(
        default=None,
        description="fsspec URL of the store's root; default $DANUBE_OBJECT_STORE_URL or file://$DANUBE_HOME/objects.",
    )
    # No credential fields: a config value shows in Dagster's run config and UI. S3 credentials
    # come from the standard AWS chain that s3fs's botocore reads (AWS_ACCESS_KEY_ID and
    # AWS_SECRET_ACCESS_KEY, AWS_PROFILE and ~/.aws/credentials, an instance or pod role).
    s3_endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint (MinIO, moto).")
    s3_region: str | None = Field(default=None, description="S3 region.")

    def storage_options(self) -> dict[str, Any]:
        """fsspec ``storage_options`` for the configured backend.

        Returns:
            ``endpoint_url`` and ``client_kwargs.region_name`` for the S3 fields that are set;
            empty when none is. Credentials are left to the AWS chain.
        """
        options: dict[str, Any] = {}
        if self.s3_endpoint_url:
            options["endpoint_url"] = self.s3_endpoint_url
        if self.s3_region:
            options["client_kwargs"] = {"region_name": self.s3_region}
        return options

    def store(self) -> ObjectStore:
        """Open the object store.

        Returns:
            An :class:`ObjectStore` on :attr:`root_url` (or ``settings.object_store_url()``),
            with :meth:`storage_options` for ``s3://`` URLs.
        """
        url = self.root_url or settings.object_store_url()
        return ObjectStore(url, storage_options=self.storage_options() if url.startswith("s3") else None)

    def checked_store(self, etcd: EtcdResource) -> ObjectStore:
        """Open the object store after checking that it is the one the brokers use (its
        identity marker equals the id recorded in etcd; the first process to check creates
        both: :mod:`danube_pipeline.storage.identity`).

        Args:
            etcd: the run's etcd resource.

        Returns:
            The :class:`ObjectStore` of :meth:`store`.

        Raises:
            ObjectStoreMismatchError: the store is not the cluster's; the run must not go on.
            MetadataStoreError: etcd failed.
            OSError: the store cannot be read or written.
        """
        objects = self.store()

        async def check() -> None:
            async with await etcd.connect() as store:
                await check_store_identity(store, objects, who=ASSETS_STORE_CHECKER)

        _run_to_end(check())
        return objects


class IcebergCatalogResource(ConfigurableResource[Any]):
    """The Iceberg SQL catalog shared by pyiceberg and Spark (see :mod:`danube_pipeline.lake.spark`)."""

    name: str | None = Field(default=None, description="Catalog name; default $DANUBE_CATALOG_NAME or danube.")
    uri: str | None = Field(
        default=None, description="SQLAlchemy URI; default $DANUBE_CATALOG_URI or sqlite:///$DANUBE_HOME/catalog.db."
    )
    warehouse: str | None = Field(
        default=None, description="Warehouse URL; default $DANUBE_WAREHOUSE or file://$DANUBE_HOME/warehouse."
    )

    def catalog_name(self) -> str:
        """The catalog name: :attr:`name`, or ``settings.catalog_name()`` when unset."""
        return self.name or settings.catalog_name()

    def catalog_uri(self) -> str:
        """The SQLAlchemy URI: :attr:`uri`, or ``settings.catalog_uri()`` when unset."""
        return self.uri or settings.catalog_uri()

    def warehouse_url(self) -> str:
        """The warehouse URL: :attr:`warehouse`, or ``settings.warehouse_url()`` when unset."""
        return self.warehouse or settings.warehouse_url()

    def load(self) -> SqlCatalog:
        """Open the catalog.

        Returns:
            The pyiceberg ``SqlCatalog`` (see :func:`danube_pipeline.lake.iceberg.load_catalog`).
        """
        return load_catalog(name=self.catalog_name(), uri=self.catalog_uri(), warehouse=self.warehouse_url())


class SparkResource(ConfigurableResource[Any]):
    """A local Spark session with Iceberg's ``SparkCatalog`` on the shared JDBC catalog.

    Catalog fields default like :class:`IcebergCatalogResource`'s, so both see the same tables.
    Jars come from :func:`danube_pipeline.lake.spark.session.iceberg_spark_runtime_jar` and
    :func:`danube_pipeline.lake.spark.session.sqlite_jdbc_jar` (``DANUBE_ICEBERG_SPARK_JAR``,
    ``DANUBE_SQLITE_JDBC_JAR``).
    """

    catalog_name: str | None = Field(default=None, description="Spark catalog name = the pyiceberg catalog name.")
    catalog_uri: str | None = Field(default=None, description="pyiceberg SQLAlchemy URI (converted to JDBC).")
    warehouse: str | None = Field(default=None, description="Warehouse URL.")
    master: str | None = Field(
        default=None,
        description="Spark master URL (local[2], spark://host:7077); default $DANUBE_SPARK_MASTER or local[*].",
    )
    shuffle_partitions: int = Field(default=4, description="spark.sql.shuffle.partitions.")
    stop_after_use: bool = Field(default=True, description="Stop the session when the asset is done.")

    def resolved_catalog_name(self) -> str:
        """The Spark catalog name: :attr:`catalog_name`, or ``settings.catalog_name()``."""
        return self.catalog_name or settings.catalog_name()

    def conf(self) -> dict[str, str]:
        """The Spark configuration.

        Returns:
            :func:`danube_pipeline.lake.spark.session.spark_conf` of this resource's fields.

        Raises:
            SparkSetupError: a jar Spark needs is missing.
        """
        return spark_conf(
            catalog_name=self.resolved_catalog_name(),
            catalog_uri=self.catalog_uri or settings.catalog_uri(),
            warehouse=self.warehouse or settings.warehouse_url(),
            master=self.master,
            shuffle_partitions=self.shuffle_partitions,
        )

    @contextmanager
    def session(self) -> Iterator[SparkSession]:
        """A Spark session for the duration of the block, stopped afterwards if
        :attr:`stop_after_use`.

        Yields:
            The session.

        Raises:
            SparkSetupError: a jar Spark needs is missing.
        """
        spark = build_spark_session(self.conf())
        try:
            yield spark
        finally:
            if self.stop_after_use:
                spark.stop()
