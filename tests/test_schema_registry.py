"""The schema registry against a real etcd: the ``docs/etcd-layout.md`` §4 keys and JSON values;
then the three schema types, compatibility, ``topics_using``, the cache and the topics' schema
settings (§3.7) through a real broker."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import fastavro.schema
import pytest
import pytest_asyncio

from danube_pipeline.client import (
    AvroSchema,
    DanubeClient,
    InitialPosition,
    JsonSchema,
    ProtobufSchema,
    TopicSchemaPolicy,
)
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer, etcdctl_binary
from danube_pipeline.errors import (
    IncompatibleSchemaError,
    InvalidSchemaError,
    MalformedRequestError,
    SchemaMismatchError,
    SchemaNotFoundError,
    SchemaRequiredError,
)
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.schemas.formats import ParsedProtobuf, parse_schema
from danube_pipeline.schemas.registry import SchemaRegistry, avro_fingerprint, parse_avro

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
        json.dumps({"type": "record", "name": "R", "fields": [{"name": f"f{i}", "type": "int", "default": 0}]})
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


# ------------------------------------------------------------------ JSON Schema and Protobuf

FLIGHT_JSON = json.dumps(
    {
        "type": "object",
        "properties": {"carrier": {"type": "string"}, "flight": {"type": "integer"}},
        "required": ["carrier", "flight"],
        "additionalProperties": False,
    }
)
FLIGHT_JSON_STRING_FLIGHT = FLIGHT_JSON.replace('"flight": {"type": "integer"}', '"flight": {"type": "string"}')
FLIGHT_PROTO = """syntax = "proto3";
package demo;
message Flight {
  string carrier = 1;
  int32 flight = 2;
  Delay delay = 3;
}
message Delay { double minutes = 1; }
"""
FLIGHT_PROTO_STRING_FLIGHT = FLIGHT_PROTO.replace("int32 flight = 2;", "string flight = 2;")
ADMIN = Path(sys.executable).parent / "danube-admin"


def etcdctl_put(etcd: EtcdServer, key: str, value: Any) -> None:
    subprocess.run(
        [etcdctl_binary(), f"--endpoints={etcd.client_url}", "put", key, json.dumps(value)],
        check=True, capture_output=True, env={"ETCDCTL_API": "3"},
    )  # fmt: skip


@pytest.mark.asyncio
async def test_json_schema_and_protobuf_are_stored_like_avro(registry: SchemaRegistry, etcd: EtcdServer) -> None:
    js = await registry.register("flights-json", "JsonSchema", FLIGHT_JSON, compatibility_mode="FULL_TRANSITIVE")
    pb_ = await registry.register("flights-proto", "Protobuf", FLIGHT_PROTO)
    assert (js.schema_type, js.schema_id, pb_.schema_type, pb_.schema_id) == ("JsonSchema", 1, "Protobuf", 2)
    canonical = json.dumps(json.loads(FLIGHT_JSON), sort_keys=True, separators=(",", ":"))
    assert js.fingerprint == "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
    parsed = parse_schema("Protobuf", FLIGHT_PROTO, subject="s")
    assert isinstance(parsed, ParsedProtobuf)
    expected = hashlib.sha256(parsed.file_descriptor_proto.SerializeToString(deterministic=True)).hexdigest()
    assert pb_.fingerprint == "sha256:" + expected
    meta = raw_json(etcd, keys.schema_metadata("flights-json"))
    assert meta["compatibility_mode"] == "FullTransitive"
    assert raw_json(etcd, keys.schema_metadata("flights-proto"))["compatibility_mode"] == "Backward"
    for subject, kind, raw, reg in (("flights-json", "JsonSchema", FLIGHT_JSON, js), ("flights-proto", "Protobuf", FLIGHT_PROTO, pb_)):
        version = raw_json(etcd, keys.schema_version(subject, 1))
        assert list(version) == VERSION_FIELDS
        assert version["schema_def"] == {kind: {"fingerprint": reg.fingerprint, "raw_schema": raw}}
    # the same schema again (other whitespace, same canonical JSON) is the same version
    assert await registry.register("flights-json", "JsonSchema", json.dumps(json.loads(FLIGHT_JSON), indent=4)) == js
    with pytest.raises(MalformedRequestError):  # the subject's mode is FullTransitive
        await registry.register("flights-json", "JsonSchema", FLIGHT_JSON_STRING_FLIGHT, compatibility_mode="NONE")
    with pytest.raises(InvalidSchemaError):
        await registry.register("bad", "Protobuf", 'syntax = "proto3"; message {')


@pytest.mark.asyncio
async def test_topics_using_lists_each_topic_once(registry: SchemaRegistry, etcd: EtcdServer) -> None:
    await registry.register("t", "JsonSchema", FLIGHT_JSON)
    topics = [f"/default/t{i}" for i in range(5)]
    added = await asyncio.gather(*(registry.add_topic("t", t) for t in topics + topics))
    assert sorted(added) == [False] * 5 + [True] * 5
    assert sorted(raw_json(etcd, keys.schema_metadata("t"))["topics_using"]) == topics
    assert await registry.remove_topic("t", "/default/t0") and not await registry.remove_topic("t", "/default/t0")
    assert sorted(raw_json(etcd, keys.schema_metadata("t"))["topics_using"]) == topics[1:]
    with pytest.raises(SchemaNotFoundError):
        await registry.add_topic("nope", "/default/x")


@pytest.mark.asyncio
async def test_lookups_come_from_the_cache_and_follow_etcd(store: MetadataStore, etcd: EtcdServer) -> None:
    async with LocalCache(store) as cache:
        registry = SchemaRegistry(store, cache=cache)
        reg = await registry.register("cached", "JsonSchema", FLIGHT_JSON)
        meta = raw_json(etcd, keys.schema_metadata("cached"))
        meta["compatibility_mode"] = "None"
        etcdctl_put(etcd, keys.schema_metadata("cached"), meta)  # a change made straight in etcd
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while (await registry.get_metadata("cached")).compatibility_mode != "None":
            assert loop.time() < deadline, "the cache did not follow the change in etcd"
            await asyncio.sleep(0.05)

        reads: list[str] = []
        direct = store.get

        async def counted(key: str) -> Any:
            reads.append(key)
            return await direct(key)

        store.get = counted  # type: ignore[method-assign]
        try:
            assert await registry.get_by_id(reg.schema_id) == reg
            assert await registry.get_latest("cached") == reg
            assert reads == []  # served from memory
            with pytest.raises(SchemaNotFoundError):
                await registry.get_by_id(99)
            assert reads == [keys.schema_by_id(99)]  # a miss asks etcd
        finally:
            store.get = direct  # type: ignore[method-assign]
        # the mode set in etcd applies: an incompatible change is now accepted
        v2 = await registry.register("cached", "JsonSchema", FLIGHT_JSON_STRING_FLIGHT)
        assert v2.version == 2


@pytest.mark.integration
@pytest.mark.asyncio
async def test_three_formats_through_a_broker(start_broker: Callable[..., BrokerProcess], etcd: EtcdServer) -> None:
    broker = start_broker()
    proto = parse_schema("Protobuf", FLIGHT_PROTO, subject="s")
    assert isinstance(proto, ParsedProtobuf)
    good_proto = proto.message_class(carrier="UA", flight=1545)
    good_proto.delay.minutes = 2.5
    async with DanubeClient([broker.address]) as client:
        avro = await client.schemas.register(AvroSchema("f-avro", PRODUCT_V1), compatibility_mode="FULL")
        js = await client.schemas.register(JsonSchema("f-json", FLIGHT_JSON))
        pb_ = await client.schemas.register(ProtobufSchema("f-proto", FLIGHT_PROTO))
        assert [(s.schema_id, s.version, s.schema_type) for s in (avro, js, pb_)] == [
            (1, 1, "Avro"), (2, 1, "JsonSchema"), (3, 1, "Protobuf"),
        ]  # fmt: skip
        got = await client.schemas.get(pb_.schema_id)
        assert (got.subject, got.schema_type, got.raw_schema) == ("f-proto", "Protobuf", FLIGHT_PROTO)
        assert raw_json(etcd, keys.schema_metadata("f-avro"))["compatibility_mode"] == "Full"

        # incompatible versions are refused, naming the field and the rule
        with pytest.raises(IncompatibleSchemaError) as refused:
            await client.schemas.register(JsonSchema("f-json", FLIGHT_JSON_STRING_FLIGHT))
        err = refused.value
        assert (err.subject, err.mode, err.version, err.path, err.rule) == ("f-json", "Backward", 1, "flight", "TYPE_CHANGED")
        assert "'flight'" in str(err) and "TYPE_CHANGED" in str(err)
        with pytest.raises(IncompatibleSchemaError) as refused:
            await client.schemas.register(ProtobufSchema("f-proto", FLIGHT_PROTO_STRING_FLIGHT))
        assert (refused.value.path, refused.value.rule) == ("flight", "FIELD_SCALAR_KIND_CHANGED")
        with pytest.raises(IncompatibleSchemaError) as refused:
            await client.schemas.register(AvroSchema("f-json", PRODUCT_V1))
        assert refused.value.rule == "SCHEMA_TYPE_CHANGED"
        assert raw_json(etcd, keys.schema_metadata("f-json"))["latest_version"] == 1
        assert await client.schemas.set_compatibility_mode("f-json", "NONE") == "None"
        assert (await client.schemas.register(JsonSchema("f-json", FLIGHT_JSON_STRING_FLIGHT))).version == 2

        # producers on two topics: both in topics_using, once each
        for topic in ("/default/j1", "/default/j2", "/default/j1"):
            async with client.producer(topic, producer_name="j", schema=JsonSchema("f-json", FLIGHT_JSON)) as producer:
                assert (producer.schema_id, producer.schema_version) == (js.schema_id, 1)
        assert raw_json(etcd, keys.schema_metadata("f-json"))["topics_using"] == ["/default/j1", "/default/j2"]

        # payloads are validated with the producer's schema; a refused batch writes nothing
        async with client.producer("/default/j1", producer_name="j", schema=JsonSchema("f-json", FLIGHT_JSON)) as producer:
            assert await producer.send(b'{"carrier": "UA", "flight": 1545}') == 0
            for bad, why in ((b'{"carrier": "UA", "flight": "1545"}', "flight"), (b'{"carrier": "UA"', "not JSON")):
                with pytest.raises(SchemaMismatchError) as mismatch:
                    await producer.send(bad)
                assert mismatch.value.subject == "f-json" and why in mismatch.value.reason
            assert await producer.send(b'{"carrier": "AA", "flight": 1141}') == 1
        async with client.producer("/default/p", producer_name="p", schema=ProtobufSchema("f-proto", FLIGHT_PROTO)) as producer:
            assert await producer.send(good_proto.SerializeToString()) == 0
            unknown_field = good_proto.SerializeToString() + b"\x20\x01"  # field 4, a varint: not in Flight
            for bad, why in ((unknown_field, "unknown field #4"), (b"\xff\xff\xff", "does not parse")):
                with pytest.raises(SchemaMismatchError) as mismatch:
                    await producer.send(bad)
                assert why in mismatch.value.reason
            assert await producer.send(good_proto.SerializeToString()) == 1
        assert (await client.admin.describe_topic("/default/j1")).next_offset == 2
        assert (await client.admin.describe_topic("/default/p")).next_offset == 2
        assert raw_json(etcd, keys.schema_metadata("f-proto"))["topics_using"] == ["/default/p"]


@pytest.mark.integration
@pytest.mark.asyncio
async def test_producer_without_schema_is_refused_until_the_topic_allows_raw(
    start_broker: Callable[..., BrokerProcess], etcd: EtcdServer
) -> None:
    broker = start_broker()
    topic = "/default/mixed"
    async with DanubeClient([broker.address], metadata_retries=0) as client:
        async with client.producer(topic, producer_name="typed", schema=JsonSchema("mixed-value", FLIGHT_JSON)) as typed:
            assert await typed.send(b'{"carrier": "UA", "flight": 1}') == 0
            assert raw_json(etcd, keys.topic_schema(TopicName.parse(topic))) == {"subject": "mixed-value", "allow_raw": False}
            with pytest.raises(SchemaRequiredError) as refused:
                await client.producer(topic, producer_name="raw").open()
            assert (refused.value.topic, refused.value.subject) == (topic, "mixed-value")
            assert "allow-raw" in str(refused.value)

            policies = await client.admin.set_topic_schema_policy(topic, allow_raw=True)
            assert policies == [TopicSchemaPolicy(topic, "mixed-value", True)]
            async with client.producer(topic, producer_name="raw") as raw:
                assert await raw.send(b"\x02") == 1
            assert await typed.send(b'{"carrier": "AA", "flight": 2}') == 2
        async with client.consumer(topic, subscription="s", initial_position=InitialPosition.EARLIEST) as consumer:
            got = [await consumer.receive(timeout_ms=10_000) for _ in range(3)]
        assert [(m.schema_id, m.payload) for m in got] == [
            (1, b'{"carrier": "UA", "flight": 1}'), (0, b"\x02"), (1, b'{"carrier": "AA", "flight": 2}'),
        ]  # fmt: skip

        proc = await asyncio.create_subprocess_exec(
            str(ADMIN), "--brokers", broker.address, "--output", "json", "topics", "set-schema-policy", topic,
            "--no-allow-raw", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err
        assert json.loads(out) == {"topic": topic, "policies": [{"topic": topic, "subject": "mixed-value", "allow_raw": False}]}
        with pytest.raises(SchemaRequiredError):
            await client.producer(topic, producer_name="raw").open()
