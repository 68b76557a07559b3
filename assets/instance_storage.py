"""Dagster instance storage chosen by one setting: a directory (SQLite) or a PostgreSQL URL.

``dagster_home/dagster.yaml`` names these two classes and gives both the value of
``DANUBE_DAGSTER_STORAGE``:

* a directory (``.danube/dev/dagster``): Dagster's SQLite storage (runs, event logs,
  schedules) and its local artifacts there, as Dagster's own ``storage: sqlite`` does;
* a ``postgresql://user:password@host:port/database`` URL: ``dagster-postgres``'s
  ``DagsterPostgresStorage`` on that database (as ``storage: postgres: postgres_url`` does),
  shared by every host that runs the webserver, the daemon or runs; local artifacts (compute
  logs' neighbours, run files) then go to ``$DANUBE_HOME/dagster``.

Dagster's YAML cannot pick a storage by a variable's value, hence these ``ConfigurableClass``
wrappers whose ``from_config_value`` returns Dagster's own storage object for the value.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from dagster import StringSource
from dagster._core.storage.base_storage import DagsterStorage
from dagster._core.storage.root import LocalArtifactStorage
from dagster._core.storage.sqlite_storage import DagsterSqliteStorage
from dagster._serdes.config_class import ConfigurableClass, ConfigurableClassData

from danube_pipeline import settings

__all__ = ["DanubeArtifactStorage", "DanubeInstanceStorage", "storage_is_url"]


def storage_is_url(value: str) -> bool:
    """Whether a ``DANUBE_DAGSTER_STORAGE`` value is a database URL rather than a directory.

    Args:
        value: the setting's value.

    Returns:
        True for ``scheme://…``.

    Raises:
        DatabaseUrlError: a URL, but not a PostgreSQL one (the only database Dagster's storage
            is offered on here).
    """
    if "://" not in value:
        return False
    if not settings.is_postgres_url(value):
        raise settings.DatabaseUrlError(
            value, "DANUBE_DAGSTER_STORAGE must be a directory or a postgresql://user:password@host:port/db URL"
        )
    return True


class DanubeInstanceStorage(DagsterStorage, ConfigurableClass):
    """``storage: custom`` in ``dagster.yaml``: Dagster's SQLite storage in a directory, or
    ``DagsterPostgresStorage`` for a PostgreSQL URL (config ``{"storage": <dir or URL>}``).

    Never instantiated itself: :meth:`from_config_value` returns the chosen storage.
    """

    @classmethod
    def config_type(cls) -> dict[str, Any]:
        """``{"storage": StringSource}``: a directory or a PostgreSQL URL (``env:`` allowed)."""
        return {"storage": StringSource}

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData | None, config_value: dict[str, Any]) -> DagsterStorage:  # type: ignore[override]
        """The storage for ``config_value["storage"]``.

        Args:
            inst_data: this class's configuration as Dagster stored it; the returned storage
                keeps it, so a run worker rebuilding the instance resolves the value again.
            config_value: ``{"storage": <dir or URL>}``.

        Returns:
            A ``DagsterPostgresStorage`` (tables created when missing) or a
            ``DagsterSqliteStorage``.

        Raises:
            DatabaseUrlError: a URL that is not PostgreSQL, lacks its host or database, or
                ``dagster-postgres`` is not installed (the ``postgres`` extra).
        """
        value = str(config_value["storage"])
        if not storage_is_url(value):
            return DagsterSqliteStorage.from_local(value, inst_data=inst_data)
        url = settings.sqlalchemy_postgres_url(value)
        if importlib.util.find_spec("dagster_postgres") is None:
            raise settings.DatabaseUrlError(
                url, "Dagster storage on PostgreSQL needs dagster-postgres: pip install 'danube-pipeline[postgres]'"
            )
        from dagster_postgres import DagsterPostgresStorage

        return DagsterPostgresStorage(postgres_url=url, inst_data=inst_data)


class DanubeArtifactStorage(LocalArtifactStorage):
    """``local_artifact_storage`` in ``dagster.yaml``: the directory ``DANUBE_DAGSTER_STORAGE``
    names, or ``$DANUBE_HOME/dagster`` when it is a PostgreSQL URL (config
    ``{"storage": <dir or URL>}``)."""

    @classmethod
    def config_type(cls) -> dict[str, Any]:
        """``{"storage": StringSource}``, the same value :class:`DanubeInstanceStorage` takes."""
        return {"storage": StringSource}

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData | None, config_value: dict[str, Any]) -> LocalArtifactStorage:  # type: ignore[override]
        """A ``LocalArtifactStorage`` in the directory for ``config_value["storage"]``.

        Raises:
            DatabaseUrlError: a URL that is not PostgreSQL.
        """
        value = str(config_value["storage"])
        base_dir = str(settings.danube_home() / "dagster") if storage_is_url(value) else value
        return LocalArtifactStorage(base_dir=base_dir, inst_data=inst_data)
