"""The object store identity check (``danube_pipeline.storage.identity``) with a real etcd and
real broker processes: brokers and assets on one store start and run; a broker or an asset run
pointed at another store is refused with a clear error."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import eventually_sync

from assets.resources import EtcdResource, ObjectStoreResource
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.errors import ObjectStoreMismatchError
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.storage.identity import MARKER_PATH, STORE_ID_KEY, check_store_identity, read_marker
from danube_pipeline.storage.objectstore import ObjectStore

pytestmark = pytest.mark.integration


def _recorded(endpoints: list[str]) -> dict[str, object] | None:
    async def get() -> dict[str, object] | None:
        async with await MetadataStore.connect(endpoints) as store:
            kv = await store.get(STORE_ID_KEY)
            return kv.value if kv is not None and isinstance(kv.value, dict) else None

    return asyncio.run(get())


def test_brokers_and_assets_on_one_store_pass_and_another_store_is_refused(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    shared = (tmp_path / "objects").as_uri()
    first = start_broker(extra_args=["--object-store-url", shared])
    recorded = _recorded(etcd_endpoints)
    assert recorded is not None and recorded["marked"] is True
    assert recorded["created_by"] == f"broker {first.broker_id}"
    store_id = recorded["store_id"]
    assert read_marker(ObjectStore(shared)) == store_id
    assert (tmp_path / "objects" / MARKER_PATH).is_file()

    # a second broker and the assets on the same store (reached under another spelling of its URL)
    start_broker(extra_args=["--object-store-url", str(tmp_path / "objects")])
    etcd = EtcdResource(endpoints=",".join(etcd_endpoints))
    assert ObjectStoreResource(root_url=shared).checked_store(etcd).root_url == shared
    assert _recorded(etcd_endpoints) == recorded

    # a broker on another, empty directory does not start, and says why
    other = (tmp_path / "other-objects").as_uri()
    stray = BrokerProcess(
        etcd_endpoints=etcd_endpoints, data_dir=tmp_path / "stray", extra_args=["--object-store-url", other]
    )
    try:
        with pytest.raises(RuntimeError):
            stray.start(timeout_s=30.0)
        eventually_sync(lambda: not stray.running, timeout_s=10.0, what="the refused broker's exit")
        text = stray.log_path.read_text(encoding="utf-8")
        assert "ObjectStoreMismatchError" in text
        assert other in text and "has no store id marker" in text and str(store_id) in text
    finally:
        stray.stop()
    assert read_marker(ObjectStore(other)) is None  # nothing written into the wrong store

    # the assets on that store are refused too, naming it and both ids
    with pytest.raises(ObjectStoreMismatchError) as refused:
        ObjectStoreResource(root_url=other).checked_store(etcd)
    assert refused.value.object_store == other and refused.value.found_id is None
    assert refused.value.expected_id == store_id and not refused.value.retriable

    # a store marked by another cluster is refused as well
    ObjectStore(other).put_bytes(MARKER_PATH, b"0123456789abcdef0123456789abcdef")
    with pytest.raises(ObjectStoreMismatchError, match="0123456789abcdef0123456789abcdef"):
        ObjectStoreResource(root_url=other).checked_store(etcd)
    assert _recorded(etcd_endpoints) == recorded


def test_concurrent_first_checks_agree_on_one_id(etcd_endpoints: list[str], tmp_path: Path) -> None:
    """Eight processes' worth of first checks at once (one event loop, real etcd): the first
    create-if-absent wins, every check returns its id, and the store's marker holds it."""
    objects = ObjectStore((tmp_path / "objects").as_uri())

    async def one(i: int) -> str:
        async with await MetadataStore.connect(etcd_endpoints) as store:
            return await check_store_identity(store, objects, who=f"checker {i}")

    async def all_of_them() -> list[str]:
        return list(await asyncio.gather(*(one(i) for i in range(8))))

    ids = asyncio.run(all_of_them())
    assert len(set(ids)) == 1
    assert read_marker(objects) == ids[0]
    recorded = _recorded(etcd_endpoints)
    assert recorded is not None and recorded["store_id"] == ids[0] and recorded["marked"] is True


def test_an_existing_marker_is_adopted_when_etcd_has_none(etcd_endpoints: list[str], tmp_path: Path) -> None:
    """etcd replaced under a store that has a marker: the store keeps its id."""
    objects = ObjectStore((tmp_path / "objects").as_uri())
    objects.put_bytes(MARKER_PATH, b"fedcba9876543210fedcba9876543210")
    etcd = EtcdResource(endpoints=",".join(etcd_endpoints))
    ObjectStoreResource(root_url=objects.root_url).checked_store(etcd)
    recorded = _recorded(etcd_endpoints)
    assert recorded is not None
    assert recorded["store_id"] == "fedcba9876543210fedcba9876543210" and recorded["marked"] is True
