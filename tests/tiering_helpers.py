"""Segment objects, a registry and schema parsers for the tiering tests of
``test_evolution.py`` and ``test_dead_letter.py``.

The objects are real: format-1 segments (``encode_record``) written to an object store with
their completed descriptors in etcd, so :func:`~danube_pipeline.lake.tiering.commit_objects_to_table`
reads, checks and decodes them exactly as after ``tier_sealed_segments``. The registry is a
dictionary with ``SchemaRegistry.get_by_id``'s contract, so a test can register what the real
registry would refuse (an ``int`` to ``string`` change) or leave an id out.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fastavro
from pyiceberg.catalog import Catalog
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2
from google.protobuf.descriptor import Descriptor

from danube_pipeline.lake import iceberg
from danube_pipeline.errors import SchemaNotFoundError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import ObjectDescriptor
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore, segment_object_path
from danube_pipeline.format.batches import batch_from_record
from danube_pipeline.format.records import (
    BATCH_FORMAT_VERSION,
    LEGACY_FORMAT_VERSION,
    Record,
    SegmentHeader,
    encode_record,
    object_id,
)
from danube_pipeline.lake.tiering import TableReport, commit_objects_to_table

TOPIC = TopicName("default", "evolving")

PUBLISH_TIME_US = 1_700_000_000_000_000


def avro_payload(schema: dict[str, Any], value: Any) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), value)
    return buf.getvalue()


def record(offset: int, payload: bytes, schema_id: int = 0, version: int = 0, *, producer: str = "loader") -> Record:
    return Record(
        offset=offset,
        publish_time_us=PUBLISH_TIME_US + offset,
        producer_id=7,
        producer_name=producer,
        schema_id=schema_id,
        schema_version=version,
        payload=payload,
        attributes={"i": str(offset)},
    )


async def put_object(
    store: MetadataStore, objects: ObjectStore, topic: TopicName, records: list[Record], *, batches: bool = False
) -> str:
    """Write ``records`` as one completed segment object of ``topic``; its object id.

    The object is in the per-record format version 1, which keeps no routing key, unless
    ``batches``: then in format version 2, one record batch per record (keys kept).
    """
    start, end = records[0].offset, records[-1].offset
    version = BATCH_FORMAT_VERSION if batches else LEGACY_FORMAT_VERSION
    data = SegmentHeader(start_offset=start, created_at_ms=1, format_version=version).encode()
    data += b"".join((batch_from_record if batches else encode_record)(r) for r in records)
    oid = object_id(start, end)
    objects.put_bytes(segment_object_path(topic, oid), data)
    await store.put(
        keys.object_descriptor(topic, start),
        ObjectDescriptor(
            completed=True, created_at=1, end_offset=end, etag=hashlib.md5(data).hexdigest(),
            object_id=oid, offset_index=[], size=len(data), start_offset=start,
        ),
    )
    return oid


@dataclass
class FakeRegistry:
    """``get_by_id`` over registered ``(schema_id, version)`` pairs (``SchemaLookup``)."""

    schemas: dict[tuple[int, int], SimpleNamespace] = field(default_factory=dict)
    lookups: int = 0

    def add(self, schema_id: int, version: int, schema_type: str, raw_schema: str, subject: str = "subject") -> None:
        self.schemas[(schema_id, version)] = SimpleNamespace(
            subject=subject, schema_id=schema_id, version=version, schema_type=schema_type, raw_schema=raw_schema
        )

    def add_avro(self, schema_id: int, version: int, schema: dict[str, Any], subject: str = "subject") -> None:
        self.add(schema_id, version, "Avro", json.dumps(schema), subject)

    async def get_by_id(self, schema_id: int, *, version: int | None = None) -> Any:
        self.lookups += 1
        if version is None:
            versions = [v for (i, v) in self.schemas if i == schema_id]
            version = max(versions) if versions else 0
        found = self.schemas.get((schema_id, version))
        if found is None:
            raise SchemaNotFoundError(f"schema id {schema_id} version {version}")
        return found


class Protos:
    """Protobuf message types built in a private pool from ``FileDescriptorProto``s, and a
    schema parser that hands them out by name (``raw_schema`` = the message's full name)."""

    _files = itertools.count()

    def __init__(self) -> None:
        self.pool = descriptor_pool.DescriptorPool()
        self.pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)

    def message(self, package: str, name: str, fields: list[tuple[str, int, int, dict[str, Any]]]) -> Descriptor:
        """Add ``message name { fields }`` in its own file; each field is
        ``(name, number, FieldDescriptorProto type, extra FieldDescriptorProto attributes)``."""
        f = descriptor_pb2.FieldDescriptorProto
        proto = descriptor_pb2.FileDescriptorProto(
            name=f"t{next(self._files)}.proto", package=package, syntax="proto3",
            dependency=["google/protobuf/timestamp.proto"],
        )
        message = proto.message_type.add(name=name)
        for field_name, number, field_type, extra in fields:
            extra = dict(extra)
            if extra.pop("optional", False):
                extra["proto3_optional"] = True
                extra["oneof_index"] = len(message.oneof_decl)
                message.oneof_decl.add(name=f"_{field_name}")
            entry = extra.pop("map_entry", None)
            if entry is not None:
                key_type, value_type = entry
                e = message.nested_type.add(name=f"{field_name.capitalize()}Entry")
                e.options.map_entry = True
                e.field.add(name="key", number=1, type=key_type, label=f.LABEL_OPTIONAL)
                e.field.add(name="value", number=2, type=value_type, label=f.LABEL_OPTIONAL)
                extra.update(type_name=f".{package}.{name}.{e.name}", label=f.LABEL_REPEATED)
                field_type = f.TYPE_MESSAGE
            extra.setdefault("label", f.LABEL_OPTIONAL)
            message.field.add(name=field_name, number=number, type=field_type, **extra)
        self.pool.Add(proto)
        return self.pool.FindMessageTypeByName(f"{package}.{name}")

    def encode(self, descriptor: Descriptor, **values: Any) -> bytes:
        cls = message_factory.GetMessageClass(descriptor)
        message = cls()
        for k, v in values.items():
            target = getattr(message, k)
            if hasattr(target, "FromDatetime"):
                target.FromDatetime(v)
            elif isinstance(v, dict) and hasattr(target, "update"):
                target.update(v)
            elif isinstance(v, list):
                target.extend(v)
            else:
                setattr(message, k, v)
        return bytes(message.SerializeToString())

    def parse(self, schema_type: str, raw_schema: str, *, subject: str) -> Any:
        """A ``parse_schema`` for ``commit_objects_to_table``: Avro and JSON Schema from their
        JSON text, Protobuf by message name from this pool."""
        if schema_type == "Protobuf":
            return SimpleNamespace(schema_type=schema_type, message_descriptor=self.pool.FindMessageTypeByName(raw_schema))
        loaded = json.loads(raw_schema)
        return SimpleNamespace(schema_type=schema_type, avro=loaded, json_schema=loaded)


def avro(*fields: dict[str, Any], name: str = "R") -> dict[str, Any]:
    return {"type": "record", "name": name, "namespace": "danube.test", "fields": list(fields)}


def avro_records(schema: dict[str, Any], version: int, values: Sequence[tuple[int, dict[str, Any]]], schema_id: int = 1) -> list[Record]:
    return [record(offset, avro_payload(schema, value), schema_id, version) for offset, value in values]


@dataclass
class Env:
    """A catalog, an object store, a registry and a Protobuf pool, with etcd for descriptors:
    ``put`` writes an object, ``tier`` runs ``commit_objects_to_table``, ``rows`` reads back."""

    endpoints: list[str]
    catalog: Any
    objects: ObjectStore
    registry: FakeRegistry
    protos: Protos

    async def put(self, records: list[Record], topic: TopicName = TOPIC, *, batches: bool = False) -> None:
        async with await MetadataStore.connect(self.endpoints) as store:
            await put_object(store, self.objects, topic, records, batches=batches)

    async def tier_exact(self, records: list[Record], topic: TopicName, *, per_object: int) -> TableReport:
        """``records`` as objects of ``per_object`` records each (keys kept), committed to the
        topic's table with the layout's ``raw_payload`` on (exact bytes, §3.9): one data file
        per object."""
        async with await MetadataStore.connect(self.endpoints) as store:
            await store.put(keys.topic_table(topic), {"partition_transform": "day", "raw_payload": True})
        for first in range(0, len(records), per_object):
            await self.put(records[first : first + per_object], topic, batches=True)
        return await self.tier(topic)

    async def tier(self, topic: TopicName = TOPIC, **kwargs: Any) -> TableReport:
        kwargs.setdefault("parse_schema", self.protos.parse)
        async with await MetadataStore.connect(self.endpoints) as store:
            return await commit_objects_to_table(
                topic, store=store, objects=self.objects, catalog=self.catalog, registry=self.registry, **kwargs
            )

    def table(self, topic: TopicName = TOPIC) -> Any:
        return self.catalog.load_table(iceberg.table_identifier(topic))

    def rows(self, *columns: str, topic: TopicName = TOPIC) -> list[dict[str, Any]]:
        arrow = self.table(topic).scan(selected_fields=("_offset", *columns)).to_arrow()
        return sorted(arrow.to_pylist(), key=lambda r: r["_offset"])


def make_env(endpoints: list[str], root: Path) -> Env:
    """An :class:`Env` with its catalog and object store under ``root``."""
    catalog = iceberg.load_catalog(
        name="danube", uri=f"sqlite:///{root / 'catalog.db'}", warehouse=(root / "warehouse").as_uri()
    )
    return Env(endpoints, catalog, ObjectStore((root / "objects").as_uri()), FakeRegistry(), Protos())


@dataclass
class TableStorage:
    """A test's object store (``file://``) and SQLite Iceberg catalog under ``root``, and the
    broker flags and environment that point a broker at both (the table read path's catalog
    comes from ``DANUBE_CATALOG_*``)."""

    root: Path
    catalog_name: str = "danube"

    @property
    def catalog_uri(self) -> str:
        return f"sqlite:///{self.root / 'catalog.db'}"

    @property
    def warehouse(self) -> str:
        return (self.root / "warehouse").as_uri()

    @property
    def objects_url(self) -> str:
        return (self.root / "objects").as_uri()

    @property
    def objects(self) -> ObjectStore:
        return ObjectStore(self.objects_url)

    def broker_args(self, *extra: str) -> list[str]:
        """``--object-store-url`` of this store, local retention only when asked, then ``extra``."""
        return ["--object-store-url", self.objects_url, "--local-retention-check-s", "3600", *extra]

    def broker_env(self) -> dict[str, str]:
        return {
            "DANUBE_CATALOG_URI": self.catalog_uri, "DANUBE_WAREHOUSE": self.warehouse,
            "DANUBE_CATALOG_NAME": self.catalog_name,
        }  # fmt: skip

    def catalog(self) -> Catalog:
        """The catalog (pyiceberg's ``SqlCatalog``)."""
        return iceberg.load_catalog(uri=self.catalog_uri, warehouse=self.warehouse, name=self.catalog_name)
