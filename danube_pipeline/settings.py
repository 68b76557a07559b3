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
``DANUBE_WAREHOUSE``       Iceberg warehouse URL                        ``file://$DANUBE_HOME/warehouse``
``DANUBE_CATALOG_NAME``    Iceberg catalog name (pyiceberg and Spark)   ``danube``
========================== ============================================ =====================
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


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
