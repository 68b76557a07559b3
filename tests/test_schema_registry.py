"""The Avro schema registry against a real etcd: the ``docs/etcd-layout.md`` §4 keys and JSON values."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import fastavro.schema
import pytest
import pytest_asyncio

from danube_pipeline.errors import InvalidSchemaError, SchemaNotFoundError
from danube_pipeline.dev.localcluster import EtcdServer, etcdctl_binary
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.schema_registry import SchemaRegistry, avro_fingerprint, parse_avro

pytestmark = pytest.mark.integration

# Field names, in the documented order.
METADATA_FIELDS = [  # §4.2
    "compatibility_mode", "created_at", "created_by", "id", "latest_version",
    "subject", "topics_using", "updated_at", "versions",
]  # fmt: skip
VERSION_FIELDS = [  # §4.3 (and the first entry of §4.2 "versions")
    "created_at", "created_by", "version", "fingerprint", "is_deprecated", "schema_def", "tags",
]  # fmt: skip
AVRO_DEF_FIELDS = ["fingerprint", "raw_schema"]  # §4.3 schema_def.Avro
INDEX_FIELDS = ["schema_id", "subject"]  # §4.4

PRODUCT_V1 = json.dumps(
    {
        "type": "record",
        "name": "Product",
        "fields": [{"name": "id", "type": "long"}, {"name": "name", "type": "string"}],
    },
    indent=2,
)
# Same canonical form as V1: other whitespace, a doc, attribute order changed.
PRODUCT_V1_RESTYLED = (
    '{"name":"Product","doc":"a product","type":"record","fields":'
    '[{"type":"long","name":"id"},{"name":"name","type":"string"}]}'
)
PRODUCT_V2 = json.dumps(
    {
        "type": "record",
        "name": "Product",
        "fields": [
            {"name": "id", "type": "long"},
            {"name": "name", "type": "string"},
            {"name": "price", "type": ["null", "double"], "default": None},
        ],
    }
)


@pytest_asyncio.fixture
async def store(etcd_endpoints: list[str]) -> AsyncIterator[MetadataStore]:
    async with await MetadataStore.connect(etcd_endpoints) as s:
        yield s


@pytest.fixture
def registry(store: MetadataStore) -> SchemaRegistry:
    return SchemaRegistry(store)


def raw_json(etcd: EtcdServer, key: str) -> Any:
    """The value at ``key`` as etcdctl sees it, parsed with key order preserved."""
    out = subprocess.run(
        [etcdctl_binary(), f"--endpoints={etcd.client_url}", "get", key, "--print-value-only"],
        check=True,
        capture_output=True,
        env={"ETCDCTL_API": "3"},
    ).stdout
    return json.loads(out, object_pairs_hook=lambda pairs: dict(pairs))


def expected_fingerprint(raw: str) -> str:
    canonical = fastavro.schema.to_parsing_canonical_form(json.loads(raw))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


@pytest.mark.asyncio
async def test_registration_writes_exactly_the_documented_keys_and_fields(
    registry: SchemaRegistry, store: MetadataStore, etcd: EtcdServer
) -> None:
    reg = await registry.register_avro("product-catalog", PRODUCT_V1)
    assert (reg.subject, reg.schema_id, reg.version, reg.schema_type) == (
        "product-catalog", 1, 1, "Avro",
    )  # fmt: skip
    assert reg.raw_schema == PRODUCT_V1
    assert reg.fingerprint == expected_fingerprint(PRODUCT_V1)
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", reg.fingerprint)

    kvs, _ = await store.get_prefix("/")
    assert [kv.key for kv in kvs] == [
        "/schemas/_global/next_schema_id",
        "/schemas/_index/by_id/1",
        "/schemas/product-catalog/metadata",
        "/schemas/product-catalog/versions/1",
    ]
    assert raw_json(etcd, keys.SCHEMA_NEXT_ID) == 2  # §4.1: the NEXT free id

    meta = raw_json(etcd, keys.schema_metadata("product-catalog"))
    assert list(meta) == METADATA_FIELDS
    assert meta["compatibility_mode"] == "Backward"
    assert meta["created_by"] == "danube-client"
    assert (meta["id"], meta["latest_version"], meta["subject"]) == (1, 1, "product-catalog")
    assert meta["topics_using"] == []
    assert isinstance(meta["created_at"], int) and meta["updated_at"] == meta["created_at"]
    assert len(meta["versions"]) == 1 and list(meta["versions"][0]) == VERSION_FIELDS

    version = raw_json(etcd, keys.schema_version("product-catalog", 1))
    assert list(version) == VERSION_FIELDS
    assert version == meta["versions"][0]
    assert version["version"] == 1
    assert version["is_deprecated"] is False and version["tags"] == []
    assert version["fingerprint"] == reg.fingerprint
    assert list(version["schema_def"]) == ["Avro"]
    assert list(version["schema_def"]["Avro"]) == AVRO_DEF_FIELDS
    assert version["schema_def"]["Avro"] == {
        "fingerprint": reg.fingerprint,
        "raw_schema": PRODUCT_V1,
    }

    index = raw_json(etcd, keys.schema_by_id(1))
    assert list(index) == INDEX_FIELDS
    assert index == {"schema_id": 1, "subject": "product-catalog"}


@pytest.mark.asyncio
async def test_same_canonical_schema_is_idempotent_and_writes_nothing(
    registry: SchemaRegistry, store: MetadataStore
) -> None:
    first = await registry.register_avro("product-catalog", PRODUCT_V1)
    _, revision_before = await store.get_prefix("/")
    again = await registry.register_avro("product-catalog", PRODUCT_V1_RESTYLED)
    _, revision_after = await store.get_prefix("/")
    assert again == first  # same id, version, raw schema (the first registration's text)
    assert revision_after == revision_before


@pytest.mark.asyncio
async def test_new_fingerprint_is_the_next_version_of_the_same_id(
    registry: SchemaRegistry, store: MetadataStore, etcd: EtcdServer
) -> None:
    v1 = await registry.register_avro("product-catalog", PRODUCT_V1)
    v2 = await registry.register_avro("product-catalog", PRODUCT_V2, created_by="tester")
    assert (v2.schema_id, v2.version) == (v1.schema_id, 2)
    assert v2.fingerprint != v1.fingerprint
    meta = raw_json(etcd, keys.schema_metadata("product-catalog"))
    assert meta["latest_version"] == 2
    assert [v["version"] for v in meta["versions"]] == [1, 2]
    assert meta["versions"][1]["created_by"] == "tester"
    assert meta["created_by"] == "danube-client"
    assert meta["updated_at"] >= meta["created_at"]
    stored_v2 = raw_json(etcd, keys.schema_version("product-catalog", 2))
    assert stored_v2["fingerprint"] == v2.fingerprint
    assert raw_json(etcd, keys.SCHEMA_NEXT_ID) == 2  # a new version does not take a new id
    # re-registering v1 returns version 1, not a third version
    assert (await registry.register_avro("product-catalog", PRODUCT_V1)).version == 1


@pytest.mark.asyncio
async def test_each_subject_gets_its_own_id(registry: SchemaRegistry, etcd: EtcdServer) -> None:
    a = await registry.register_avro("a", PRODUCT_V1)
    b = await registry.register_avro("b", PRODUCT_V1)
    assert (a.schema_id, b.schema_id) == (1, 2)
    assert raw_json(etcd, keys.SCHEMA_NEXT_ID) == 3
    assert raw_json(etcd, keys.schema_by_id(2)) == {"schema_id": 2, "subject": "b"}


@pytest.mark.asyncio
async def test_get_by_id_and_get_latest(registry: SchemaRegistry) -> None:
    v1 = await registry.register_avro("product-catalog", PRODUCT_V1)
    v2 = await registry.register_avro("product-catalog", PRODUCT_V2)
    assert await registry.get_by_id(v1.schema_id) == v2
    assert await registry.get_by_id(v1.schema_id, version=1) == v1
    assert await registry.get_latest("product-catalog") == v2
    assert await registry.get_version("product-catalog", 1) == v1


@pytest.mark.asyncio
async def test_unknown_schema_raises_schema_not_found(registry: SchemaRegistry) -> None:
    with pytest.raises(SchemaNotFoundError):
        await registry.get_by_id(42)
    with pytest.raises(SchemaNotFoundError):
        await registry.get_latest("nope")
    reg = await registry.register_avro("product-catalog", PRODUCT_V1)
    with pytest.raises(SchemaNotFoundError):
        await registry.get_by_id(reg.schema_id, version=2)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "raw",
    [
        "not json at all",
        '{"type": "record", "name": "P", "fields": [{"name": "a", "type": "no_such_type"}]}',
        '{"type": "record", "fields": []}',
    ],
)
async def test_bad_avro_raises_invalid_schema_and_writes_nothing(
    registry: SchemaRegistry, store: MetadataStore, raw: str
) -> None:
    with pytest.raises(InvalidSchemaError) as info:
        await registry.register_avro("bad", raw)
    assert info.value.subject == "bad"
    assert (await store.get_prefix("/"))[0] == []


def test_parse_avro_and_fingerprint_helpers() -> None:
    assert parse_avro("s", '"string"') == "string"
    assert avro_fingerprint(PRODUCT_V1) == avro_fingerprint(PRODUCT_V1_RESTYLED)
    assert avro_fingerprint(PRODUCT_V1) != avro_fingerprint(PRODUCT_V2)
    assert avro_fingerprint('"string"') == "sha256:" + hashlib.sha256(b'"string"').hexdigest()
    with pytest.raises(InvalidSchemaError):
        avro_fingerprint("{")


@pytest.mark.asyncio
async def test_concurrent_registrations_do_not_lose_versions(
    registry: SchemaRegistry, etcd: EtcdServer
) -> None:
    schemas = [
        json.dumps({"type": "record", "name": "R", "fields": [{"name": f"f{i}", "type": "int"}]})
        for i in range(6)
    ]
    results = await asyncio.gather(*(registry.register_avro("race", s) for s in schemas))
    assert {r.schema_id for r in results} == {1}
    assert sorted(r.version for r in results) == [1, 2, 3, 4, 5, 6]
    meta = raw_json(etcd, keys.schema_metadata("race"))
    assert meta["latest_version"] == 6 and len(meta["versions"]) == 6
    assert raw_json(etcd, keys.SCHEMA_NEXT_ID) == 2

    others = await asyncio.gather(*(registry.register_avro(f"s{i}", schemas[0]) for i in range(5)))
    assert sorted(r.schema_id for r in others) == [2, 3, 4, 5, 6]
    assert raw_json(etcd, keys.SCHEMA_NEXT_ID) == 7
