"""Hypothesis strategies for the RPCs: every RPC of ``danube.proto`` (from its descriptors, so a
new RPC is fuzzed without edits) and what a client may send on it, as messages with any field
values (ids and names of a :class:`Known` broker mixed in) or as raw bytes that are not one."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from danube_pipeline.dev.fuzzing.formats import (
    U32_MAX,
    U64_MAX,
    BatchSpec,
    batch_specs,
    byte_edits,
    mutations,
    recompute_crc,
    utf8_text,
)
from danube_pipeline.proto import danube_pb2 as pb

T = TypeVar("T")


@dataclass(frozen=True)
class Rpc:
    """One RPC of ``danube.proto``, from the descriptor (so a new RPC is fuzzed without edits)."""

    service: str
    method: str
    request: type[Message]
    client_streaming: bool
    server_streaming: bool

    @property
    def path(self) -> str:
        return f"/danube.v1.{self.service}/{self.method}"

    @property
    def name(self) -> str:
        return f"{self.service}.{self.method}"


DISRUPTIVE_RPCS = frozenset({
    "Admin.DrainBroker", "Admin.UnloadTopic", "Admin.DeleteTopic", "Admin.ResetCursor", "Admin.AbandonUnavailableRange",
})
"""RPCs whose well-formed requests take the broker's topics away (every request of
``DrainBroker`` is well formed: it has no field), delete them, move a subscription's cursor
or give up offsets. They are left out of the fuzzed RPCs; their bad input is tested on its own
(``tests/test_cluster.py``, ``tests/test_topic_admin.py``)."""


def rpcs() -> list[Rpc]:
    """Every RPC of every service in ``danube.proto`` but :data:`DISRUPTIVE_RPCS`."""
    return [
        Rpc(service.name, m.name, getattr(pb, m.input_type.name), m.client_streaming, m.server_streaming)
        for service in pb.DESCRIPTOR.services_by_name.values()
        for m in service.methods
        if f"{service.name}.{m.name}" not in DISRUPTIVE_RPCS
    ]


@dataclass
class Known:
    """Ids and names that exist on the target broker, so fuzzed requests reach past lookups."""

    topics: list[str] = field(default_factory=list)
    producer_ids: list[int] = field(default_factory=list)
    producer_name: str = "fuzz-producer"
    consumer_ids: list[int] = field(default_factory=list)
    subscriptions: list[str] = field(default_factory=list)
    schema_ids: list[int] = field(default_factory=list)
    subjects: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=lambda: [0])


def _or_known(values: Sequence[T], other: st.SearchStrategy[T]) -> st.SearchStrategy[T]:
    return st.one_of(st.sampled_from(list(values)), other) if values else other


_u64 = st.one_of(st.integers(0, U64_MAX), st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, U64_MAX]))
_u32 = st.one_of(st.integers(0, U32_MAX), st.sampled_from([0, 1, 2**31 - 1, 2**31, U32_MAX]))
_i32 = st.integers(-(2**31), 2**31 - 1)
_i64 = st.integers(-(2**63), 2**63 - 1)
_long_text = st.builds(lambda unit, n: unit * n, st.sampled_from(["a", "\x00", "é", "/", "\U0001d11e", "\n", "-"]),
                       st.integers(129, 70_000))
any_text = st.one_of(
    utf8_text(40),
    st.text(st.characters(codec="utf-8", categories=["Cc", "Cf", "Zl", "Zp"]), min_size=1, max_size=8),
    _long_text,
)
"""Strings for any request field: any text, control and format characters, 129..70,000 chars."""
names = st.one_of(
    st.from_regex(r"[A-Za-z0-9_-]{1,24}", fullmatch=True),
    st.builds(lambda c, n: c * n, st.sampled_from("aZ9_-"), st.integers(120, 140)),
    st.builds(lambda n, tail: n + tail, st.from_regex(r"[a-z]{1,8}", fullmatch=True),
              st.sampled_from(["\n", "\x00", "/", "/x", ".", " ", "é", "\r\n", "\u2028"])),
)
"""Names near the grammar ``[A-Za-z0-9_-]{1,128}``: valid, at and over the length limit, with a
bad last character (a trailing newline that ``$`` lets through, NUL, slash, non-ASCII)."""
topic_paths = st.builds(lambda ns, t: f"/{ns}/{t}", st.one_of(st.just("fuzz"), names, any_text), st.one_of(names, any_text))
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | utf8_text(10),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
        utf8_text(8) | st.sampled_from(["type", "name", "fields", "items", "values", "symbols"]), kids, max_size=4),
    max_leaves=12,
)
raw_schemas = st.one_of(
    any_text,
    _json.map(json.dumps),
    st.sampled_from(['"bytes"', '"string"', '{"type": "record", "name": "R", "fields": [{"name": "a", "type": "long"}]}',
                     '{"type": "array", "items": "R"}', '{"type": "enum", "name": "E", "symbols": ["A", "A"]}',
                     '{"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": false}',
                     '{"$ref": "http://example.com/remote.json"}', '{"type": "nope"}',
                     'syntax = "proto3"; message R { int64 a = 1; map<string, R> m = 2; }',
                     'syntax = "proto2"; message R { required int64 a = 1; }', 'syntax = "proto3"; import "x.proto";',
                     'syntax = "proto3"; ' + "message M { " * 70 + "}" * 70]),
    st.builds(lambda n: "[" * n + "]" * n, st.integers(1, 50_000)),
    st.builds(lambda n: '{"type": ' * n + '"int"' + "}" * n, st.integers(1, 5_000)),
)
"""Schema texts of the three types (Avro, JSON Schema, ``.proto``): valid, JSON of any shape, nested
deep enough to stress the parsers; any text is sent with any ``schema_type``."""


def _string_field(name: str, known: Known) -> st.SearchStrategy[str]:
    if name == "topic":
        return _or_known(known.topics, st.one_of(topic_paths, any_text))
    if name == "namespace":
        return st.one_of(st.just("fuzz"), names, any_text)
    if name == "raw_schema":
        return raw_schemas
    if name == "subject":
        return _or_known(known.subjects, st.one_of(names, any_text))
    if name == "subscription":
        return _or_known(known.subscriptions, st.one_of(names, any_text))
    return st.one_of(names, any_text)


def _u64_field(name: str, known: Known) -> st.SearchStrategy[int]:
    hints = {"producer_id": known.producer_ids, "consumer_id": known.consumer_ids, "schema_id": known.schema_ids}
    return _or_known(hints.get(name, known.offsets), _u64)


@st.composite
def request_batches(draw: st.DrawFn, known: Known) -> bytes:
    """``SendBatchRequest.batch``: a valid batch of the known producer or of any producer, a
    mutated or CRC-recomputed one, or any bytes."""
    spec = draw(batch_specs(max_records=4))
    use_known = draw(st.booleans())
    if known.producer_ids and use_known:
        spec = BatchSpec(spec.first_timestamp_us, draw(st.sampled_from(known.producer_ids)), known.producer_name,
                         0, 0, -1, spec.records)
    data = spec.build()
    kind = draw(st.sampled_from(["valid", "mutated", "crafted", "bytes"]))
    if kind == "mutated":
        return draw(mutations(len(data))).apply(data)
    if kind == "crafted":
        edited = bytearray(data)
        for where, mask in draw(byte_edits):
            edited[16 + where % (len(edited) - 16)] ^= mask
        recompute_crc(edited, 0, len(edited), 2)
        return bytes(edited)
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    return data


def _field_values(fd: FieldDescriptor, known: Known, depth: int) -> st.SearchStrategy[Any]:
    t = fd.type
    if t == FieldDescriptor.TYPE_MESSAGE:
        return messages(fd.message_type, known, depth + 1)
    if t == FieldDescriptor.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in fd.enum_type.values]), _i32)
    if t == FieldDescriptor.TYPE_STRING:
        return _string_field(fd.name, known)
    if t == FieldDescriptor.TYPE_BYTES:
        return request_batches(known) if fd.name == "batch" else st.binary(max_size=200)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return _u64_field(fd.name, known)
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return _u32
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return _i32
    if t in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
        return _i64
    return st.floats()


def messages(descriptor: Descriptor, known: Known, depth: int = 0) -> st.SearchStrategy[Message]:
    """A message of ``descriptor`` with any subset of its fields set to fuzzed values (field
    types from the descriptor; ids, topics and subjects of ``known`` mixed in by field name)."""
    cls: type[Message] = getattr(pb, descriptor.name)

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = cls()
        for fd in descriptor.fields:
            if not draw(st.booleans()):
                continue
            values = _field_values(fd, known, depth)
            target = getattr(msg, fd.name)
            if fd.label == FieldDescriptor.LABEL_REPEATED:
                for value in draw(st.lists(values, max_size=0 if depth > 2 else 4)):
                    if fd.type == FieldDescriptor.TYPE_MESSAGE:
                        target.add().CopyFrom(value)
                    else:
                        target.append(value)
            elif fd.type == FieldDescriptor.TYPE_MESSAGE:
                target.CopyFrom(draw(values))
            else:
                setattr(msg, fd.name, draw(values))
        return msg

    return build()


def requests(rpc: Rpc, known: Known) -> st.SearchStrategy[list[Message]]:
    """What a client sends on ``rpc``: one request message, or 0..3 on a client stream."""
    one = messages(rpc.request.DESCRIPTOR, known)
    return st.lists(one, max_size=3) if rpc.client_streaming else one.map(lambda m: [m])


_invalid_utf8 = st.binary(max_size=12).map(lambda b: b"\xff" + b)
garbage = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda f, b: bytes([f << 3 | 2, len(b)]) + b, st.integers(1, 15), _invalid_utf8),
    st.sampled_from([b"\x80", b"\x08", b"\x0a\x05ab", b"\xff" * 11, b"\x0a\xff\xff\xff\xff\x0f", b"\x0b", b"\x0c"]),
)
"""Request payloads that are not a message: any bytes, a string field that is not UTF-8, a
truncated varint or length, a group tag."""


def raw_requests(rpc: Rpc, known: Known) -> st.SearchStrategy[list[bytes]]:
    """Raw payloads for ``rpc``: garbage, or a serialized fuzzed request with one mutation."""
    def mutate(msg: Message) -> st.SearchStrategy[bytes]:
        data = msg.SerializeToString()
        return mutations(len(data)).map(lambda m: m.apply(data)) if data else garbage
    one = st.one_of(garbage, messages(rpc.request.DESCRIPTOR, known).flatmap(mutate))
    return st.lists(one, min_size=1, max_size=3) if rpc.client_streaming else one.map(lambda b: [b])

