"""Secrets reach Dagster's resources through ``EnvVar`` only: the resource configuration the UI
shows and a run's stored config and event log hold the variable's name, never its value.
"""

from __future__ import annotations

from typing import Any

import pytest
from dagster import DagsterInstance, asset, materialize
from dagster._core.remote_representation.external_data import RepositorySnap

from assets.definitions import default_resources, defs
from assets.resources import ObjectStoreResource

pytestmark = pytest.mark.unit

PASSWORD = "pg-Secr3t-4711"
CATALOG_URI = f"postgresql://danube:{PASSWORD}@db.example:5432/catalog"
AWS_SECRET = "aws-Secr3t-0815"


@pytest.fixture
def secret_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("DANUBE_CATALOG_URI", CATALOG_URI)
    monkeypatch.setenv("DANUBE_CATALOG_NAME", "danube")
    monkeypatch.setenv("DANUBE_WAREHOUSE", (tmp_path / "warehouse").as_uri())
    monkeypatch.setenv("DANUBE_ETCD_ENDPOINTS", "127.0.0.1:2379")
    monkeypatch.setenv("DANUBE_BROKER_ADDRESSES", "127.0.0.1:6650")
    monkeypatch.setenv("DANUBE_OBJECT_STORE_URL", (tmp_path / "objects").as_uri())
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)


# Dagster's own snapshot code reads a deprecated ScheduleDefinition property.
@pytest.mark.filterwarnings("ignore:Property `ScheduleDefinition.environment_vars` is deprecated:DeprecationWarning")
def test_the_ui_shows_env_var_names_not_secrets(secret_env: None) -> None:
    snap = RepositorySnap.from_def(defs.get_repository_def())
    shown = {r.name: r.configured_values for r in snap.resources or []}
    assert "DANUBE_CATALOG_URI" in repr(shown["iceberg_catalog"]["uri"])
    assert "DANUBE_CATALOG_URI" in repr(shown["spark"]["catalog_uri"])
    text = repr(shown)
    assert PASSWORD not in text and AWS_SECRET not in text


def test_no_resource_takes_s3_credentials_as_config() -> None:
    fields = set(ObjectStoreResource.model_fields)
    assert not {f for f in fields if "key" in f or "secret" in f}, fields
    assert ObjectStoreResource(s3_region="us-east-1").storage_options() == {"client_kwargs": {"region_name": "us-east-1"}}


def test_a_run_resolves_the_secret_but_stores_and_logs_none(secret_env: None) -> None:
    seen: dict[str, str] = {}

    @asset(required_resource_keys={"iceberg_catalog", "spark", "object_store"})
    def probe(context) -> None:  # type: ignore[no-untyped-def]  # Dagster reads the annotation
        seen["catalog"] = context.resources.iceberg_catalog.uri
        seen["spark"] = context.resources.spark.catalog_uri
        context.log.info("catalog %s", context.resources.iceberg_catalog.name)

    with DagsterInstance.ephemeral() as instance:
        result = materialize([probe], resources=default_resources(), instance=instance)
        assert result.success
        run = instance.get_run_by_id(result.run_id)
        assert run is not None
        stored = repr(run.run_config) + repr(run.job_snapshot_id)
        logged = "".join(repr(e) for e in instance.all_logs(result.run_id))
    assert seen == {"catalog": CATALOG_URI, "spark": CATALOG_URI}  # the resources did get the secret
    for text in (stored, logged):
        assert PASSWORD not in text and AWS_SECRET not in text
