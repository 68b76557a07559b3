"""``load_catalog()`` with no catalog named refuses to create an empty one.

A reader who forgot the running stack's environment (``eval "$(danube-pipeline env)"``) would
otherwise get a fresh, empty ``.danube/catalog.db`` and a ``NoSuchNamespaceError`` later.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from danube_pipeline.lake.iceberg import CatalogNotFoundError, load_catalog

pytestmark = pytest.mark.unit


def test_default_catalog_that_does_not_exist_is_refused_and_not_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DANUBE_CATALOG_URI", raising=False)
    monkeypatch.delenv("DANUBE_WAREHOUSE", raising=False)
    monkeypatch.setenv("DANUBE_HOME", str(tmp_path / "state"))
    with pytest.raises(CatalogNotFoundError, match="danube-pipeline env"):
        load_catalog()
    assert not (tmp_path / "state").exists()


def test_a_named_catalog_is_created_and_then_the_default_opens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DANUBE_CATALOG_URI", raising=False)
    monkeypatch.setenv("DANUBE_HOME", str(tmp_path))
    uri = f"sqlite:///{tmp_path / 'catalog.db'}"
    load_catalog(uri=uri, warehouse=(tmp_path / "warehouse").as_uri()).create_namespace("default")
    assert load_catalog().list_namespaces() == [("default",)]  # the default file exists now
    monkeypatch.setenv("DANUBE_CATALOG_URI", f"sqlite:///{tmp_path / 'other.db'}")
    assert load_catalog().list_namespaces() == []  # named by the environment: created
