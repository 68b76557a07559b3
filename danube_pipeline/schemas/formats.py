"""The three schema formats of the registry: Avro, JSON Schema and Protobuf.

:func:`parse_schema` turns a schema text into a :class:`ParsedSchema`, which knows its
fingerprint, validates payloads (the broker, for every message of a producer with a schema) and
decodes them (tiering). The registry stores the text exactly as registered
(``docs/etcd-layout.md`` §4.3, ``schema_def`` is ``{"<type>": {"fingerprint", "raw_schema"}}``).

=============  ====================================  =========================================
format         ``raw_schema``                        fingerprint (``"sha256:<hex>"`` of ...)
=============  ====================================  =========================================
``Avro``       Avro schema JSON (Avro spec 1.11)     the Parsing Canonical Form (Avro spec,
                                                     "Parsing Canonical Form for Schemas")
``JsonSchema`` a JSON Schema object; draft 2020-12   the canonical JSON: keys sorted, no
               unless ``$schema`` names draft 7      spaces, UTF-8 (non-ASCII kept as is)
``Protobuf``   ``.proto`` source, ``syntax =         the serialized ``FileDescriptorProto``
               "proto3"``; the FIRST top-level       of the file (deterministic
               message is the record type            serialization; comments are not in it)
=============  ====================================  =========================================

JSON Schema: only drafts 2020-12 (the default) and 7 are accepted; the schema must be a JSON
object, must pass its draft's meta-schema, and may use only local ``$ref`` (``#...``), so
validating never fetches anything. Formats (``"format"``) are not asserted.

Protobuf: the text is compiled at run time by ``protoc`` (``python -m grpc_tools.protoc``, in a
subprocess and a temporary directory, with a time limit) into a ``FileDescriptorSet``; its
files are added to a private ``DescriptorPool`` and the message class is built with
``google.protobuf.message_factory``. Nothing generated is written to the package or imported
from disk. The file may import Google's well-known types (``google/protobuf/*.proto``) and no
other file.

Every format refuses a schema text over :data:`MAX_SCHEMA_BYTES` or nested deeper than
:data:`MAX_SCHEMA_DEPTH`. Parsed schemas are cached (:func:`cached_schema`,
:func:`schema_for_fingerprint`): the broker compiles a Protobuf schema once, not per producer.
"""

from __future__ import annotations

import abc
import collections
import hashlib
import io
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, Final

import fastavro
import fastavro.schema
from google.protobuf import (
    descriptor_pb2,
    descriptor_pool,
    message_factory,
    unknown_fields,
)
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from danube_pipeline.errors import InvalidSchemaError

__all__ = [
    "AVRO",
    "JSON_SCHEMA",
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "PROTOBUF",
    "SCHEMA_TYPES",
    "ParsedAvro",
    "ParsedJsonSchema",
    "ParsedProtobuf",
    "ParsedSchema",
    "Payload",
    "cached_schema",
    "parse_schema",
    "schema_for_fingerprint",
]

AVRO: Final = "Avro"
JSON_SCHEMA: Final = "JsonSchema"
PROTOBUF: Final = "Protobuf"
SCHEMA_TYPES: Final = (AVRO, JSON_SCHEMA, PROTOBUF)
"""The schema types, spelled as the key of ``schema_def`` (``docs/etcd-layout.md`` §4.3)."""

MAX_SCHEMA_BYTES: Final = 256 * 1024
"""Largest schema definition accepted, in bytes of UTF-8 (``docs/etcd-layout.md`` §4)."""
MAX_SCHEMA_DEPTH: Final = 64
"""Deepest nesting accepted: of JSON objects and arrays (Avro, JSON Schema), of ``{}`` blocks
(Protobuf)."""

PROTOC_TIMEOUT_S: Final = 30.0
"""Longest a ``protoc`` run may take, in seconds."""
PROTO_FILE_NAME: Final = "schema.proto"
"""The name the ``.proto`` text is compiled under (it is part of the ``FileDescriptorProto``,
so of the fingerprint)."""

Payload = bytes | bytearray | memoryview
"""A message payload as the broker or a decoder holds it."""

CACHE_ENTRIES: Final = 512
"""Parsed schemas kept by :func:`parse_schema` (least recently used dropped first)."""

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_DEPTH_STEP = {"{": 1, "[": 1, "}": -1, "]": -1}
_PROTO_NOISE = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|//[^\n]*|/\*.*?\*/', re.DOTALL)
_PROTO_DEPTH_STEP = {"{": 1, "}": -1}


def _depth(text: str, noise: re.Pattern[str], steps: dict[str, int]) -> int:
    """The deepest nesting of ``steps`` brackets in ``text`` once ``noise`` (strings,
    comments) is removed, found without recursion (malformed text gets some number, and fails
    to parse later)."""
    brackets = (steps[ch] for ch in noise.sub("", text) if ch in steps)
    return max(itertools.accumulate(brackets, initial=0))


def json_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in JSON ``text`` (0 for a scalar)."""
    return _depth(text, _JSON_STRING, _JSON_DEPTH_STEP)


def _check_size(subject: str, raw_schema: str, depth: int) -> None:
    size = len(raw_schema.encode("utf-8", errors="surrogatepass"))
    if size > MAX_SCHEMA_BYTES:
        raise InvalidSchemaError(subject, f"{size} bytes, more than the {MAX_SCHEMA_BYTES} allowed")
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidSchemaError(subject, f"nested {depth} levels deep, more than the {MAX_SCHEMA_DEPTH} allowed")


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _load_json(text: str) -> Any:
    """``json.loads`` refusing ``NaN`` and ``Infinity`` (not JSON).

    Raises:
        ValueError: not JSON (or nested past Python's recursion limit).
    """
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError as exc:
        raise ValueError("nested too deeply") from exc


class ParsedSchema(abc.ABC):
    """A parsed, valid schema of one of :data:`SCHEMA_TYPES`; immutable and shared (cached).

    Attributes:
        schema_type: ``"Avro"``, ``"JsonSchema"`` or ``"Protobuf"``.
        raw_schema: the schema text as registered.
        fingerprint: ``"sha256:<hex>"`` (see the module docstring for what is hashed).

    The format-specific views raise ``AttributeError`` on a schema of another type:
    :attr:`avro` (Avro), :attr:`json_schema` (JSON Schema), :attr:`message_descriptor`
    (Protobuf).
    """

    schema_type: ClassVar[str]
    raw_schema: str
    fingerprint: str

    def _not(self, what: str) -> AttributeError:
        return AttributeError(f"a {self.schema_type} schema has no {what}")

    @property
    def avro(self) -> Any:
        """The Avro schema JSON as loaded (``dict`` for a record, ``str`` for a primitive,
        ``list`` for a union); Avro only."""
        raise self._not("avro")

    @property
    def json_schema(self) -> dict[str, Any]:
        """The JSON Schema object as loaded; JsonSchema only."""
        raise self._not("json_schema")

    @property
    def message_descriptor(self) -> Descriptor:
        """The record message's descriptor (the first top-level message); Protobuf only."""
        raise self._not("message_descriptor")

    @abc.abstractmethod
    def validate(self, payload: Payload) -> None:
        """Check that ``payload`` is one value of this schema.

        * Avro: decodes with the schema (``fastavro.schemaless_reader``) and no byte is left.
        * JsonSchema: UTF-8 JSON that validates against the schema.
        * Protobuf: parses as the record message and carries no unknown field (at any depth).

        Raises:
            ValueError: the payload is not a value of the schema; the message says why (and
                where, for JSON Schema and Protobuf).
        """

    @abc.abstractmethod
    def decode(self, payload: Payload) -> Any:
        """Decode one payload (which :meth:`validate` accepts).

        Returns:
            * Avro: fastavro's value: a ``dict`` for a record.
            * JsonSchema: the JSON value: a ``dict`` for an object.
            * Protobuf: a ``dict`` keyed by field name (see :meth:`ParsedProtobuf.decode`).

        Raises:
            ValueError: the payload does not decode.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fingerprint})"


class ParsedAvro(ParsedSchema):
    """An Avro schema (Avro specification 1.11).

    Attributes:
        fastavro_schema: fastavro's parsed form, for ``schemaless_reader`` / ``schemaless_writer``.
    """

    schema_type = AVRO

    def __init__(self, raw_schema: str, loaded: Any, parsed: Any) -> None:
        self.raw_schema = raw_schema
        self._loaded = loaded
        self.fastavro_schema = parsed
        canonical = fastavro.schema.to_parsing_canonical_form(parsed)
        self.fingerprint = _sha256(canonical.encode("utf-8"))

    @property
    def avro(self) -> Any:
        return self._loaded

    def validate(self, payload: Payload) -> None:
        buf = io.BytesIO(payload)
        try:
            fastavro.schemaless_reader(buf, self.fastavro_schema, None)
        except Exception as exc:  # noqa: BLE001 - fastavro raises many types
            raise ValueError(f"{type(exc).__name__}: {exc}") from exc
        left = len(payload) - buf.tell()
        if left:
            raise ValueError(f"{left} bytes left after decoding")

    def decode(self, payload: Payload) -> Any:
        try:
            return fastavro.schemaless_reader(io.BytesIO(payload), self.fastavro_schema, None)
        except Exception as exc:  # noqa: BLE001 - fastavro raises many types
            raise ValueError(f"{type(exc).__name__}: {exc}") from exc


def _json_pointer(path: Iterable[Any]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "(root)"


class ParsedJsonSchema(ParsedSchema):
    """A JSON Schema (draft 2020-12, or draft 7 when ``$schema`` names it)."""

    schema_type = JSON_SCHEMA

    def __init__(self, raw_schema: str, loaded: dict[str, Any], validator: Any) -> None:
        self.raw_schema = raw_schema
        self._loaded = loaded
        self._validator = validator
        canonical = json.dumps(loaded, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        self.fingerprint = _sha256(canonical.encode("utf-8"))

    @property
    def json_schema(self) -> dict[str, Any]:
        return self._loaded

    @property
    def draft(self) -> str:
        """``"2020-12"`` or ``"7"``."""
        return "7" if type(self._validator).__name__ == "Draft7Validator" else "2020-12"

    def decode(self, payload: Payload) -> Any:
        try:
            return _load_json(bytes(payload).decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"not UTF-8: {exc}") from exc
        except ValueError as exc:
            raise ValueError(f"not JSON: {exc}") from exc

    def validate(self, payload: Payload) -> None:
        value = self.decode(payload)
        try:
            error = next(iter(self._validator.iter_errors(value)), None)
        except RecursionError as exc:
            raise ValueError("the schema's references recurse without end on this value") from exc
        except Exception as exc:  # noqa: BLE001 - referencing errors and the like
            raise ValueError(f"cannot be validated: {type(exc).__name__}: {exc}") from exc
        if error is not None:
            from jsonschema.exceptions import best_match

            error = best_match([error, *itertools.islice(self._validator.iter_errors(value), 20)]) or error
            raise ValueError(f"at {_json_pointer(error.absolute_path)}: {error.message}")


class ParsedProtobuf(ParsedSchema):
    """A proto3 ``.proto`` file whose first top-level message is the record type.

    Attributes:
        file_descriptor_proto: the compiled file (its serialized form is the fingerprint).
        file_descriptor_set: the file and every file it imports (well-known types).
        message_class: the record message's class, built in a private descriptor pool.
    """

    schema_type = PROTOBUF

    def __init__(self, raw_schema: str, fds: descriptor_pb2.FileDescriptorSet) -> None:
        self.raw_schema = raw_schema
        self.file_descriptor_set = fds
        self.file_descriptor_proto = fds.file[-1]
        self.fingerprint = _sha256(self.file_descriptor_proto.SerializeToString(deterministic=True))
        pool = descriptor_pool.DescriptorPool()
        for file in fds.file:
            pool.Add(file)
        main = self.file_descriptor_proto
        name = ".".join(p for p in (main.package, main.message_type[0].name) if p)
        self._descriptor = pool.FindMessageTypeByName(name)
        self.message_class: type[Message] = message_factory.GetMessageClass(self._descriptor)

    @property
    def message_descriptor(self) -> Descriptor:
        return self._descriptor

    def _parse(self, payload: Payload) -> Message:
        message = self.message_class()
        try:
            message.ParseFromString(bytes(payload))
        except (DecodeError, RuntimeError, ValueError) as exc:
            raise ValueError(f"does not parse as {self._descriptor.full_name}: {exc}") from exc
        return message

    def validate(self, payload: Payload) -> None:
        where = _unknown_field_path(self._parse(payload), "")
        if where is not None:
            raise ValueError(f"unknown field {where} (not in {self._descriptor.full_name})")

    def decode(self, payload: Payload) -> dict[str, Any]:
        """Decode one payload into a ``dict`` keyed by field name (the ``.proto`` names).

        Every field of the message is a key. Values keep Python's native types, not the
        Protobuf JSON mapping: integers of every width are ``int`` (64-bit ones too), ``bytes``
        stay ``bytes``, ``float``/``double`` are ``float``, ``bool`` is ``bool``, an enum is its
        symbol name (``int`` for a number the enum does not declare), a message is a ``dict``
        of the same shape, a ``repeated`` field a ``list``, a ``map`` a ``dict``. A field that
        has presence and is not set (a message field, a proto3 ``optional`` field, a member of
        a ``oneof`` that is not the one set) is ``None``; other scalars not set have their
        proto3 default (0, ``""``, ``b""``, ``False``, the enum's first symbol).
        ``message_descriptor.fields_by_name[name].number`` gives the field number of each key.

        Raises:
            ValueError: the payload does not parse.
        """
        return _message_dict(self._parse(payload))


def _unknown_field_path(message: Message, prefix: str) -> str | None:
    """The path of the first unknown field in ``message`` or its sub-messages, else ``None``."""
    unknown = unknown_fields.UnknownFieldSet(message)
    if len(unknown):
        return f"{prefix}#{unknown[0].field_number}"
    for fd, value in message.ListFields():
        if fd.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        path = f"{prefix}{fd.name}"
        if fd.message_type.GetOptions().map_entry:
            items: Any = ((f"{path}[{k!r}]", v) for k, v in value.items()) if _map_has_messages(fd) else ()
        elif fd.label == FieldDescriptor.LABEL_REPEATED:
            items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
        else:
            items = ((path, value),)
        for sub_path, sub in items:
            found = _unknown_field_path(sub, sub_path + ".")
            if found is not None:
                return found
    return None


def _map_has_messages(fd: FieldDescriptor) -> bool:
    return bool(fd.message_type.fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE)


def _scalar(fd: FieldDescriptor, value: Any) -> Any:
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        return _message_dict(value)
    if fd.type == FieldDescriptor.TYPE_ENUM:
        symbol = fd.enum_type.values_by_number.get(value)
        return symbol.name if symbol is not None else value
    return value


def _message_dict(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fd in message.DESCRIPTOR.fields:
        value = getattr(message, fd.name)
        if fd.type == FieldDescriptor.TYPE_MESSAGE and fd.message_type.GetOptions().map_entry:
            value_fd = fd.message_type.fields_by_name["value"]
            out[fd.name] = {k: _scalar(value_fd, v) for k, v in value.items()}
        elif fd.label == FieldDescriptor.LABEL_REPEATED:
            out[fd.name] = [_scalar(fd, v) for v in value]
        elif fd.has_presence and not message.HasField(fd.name):
            out[fd.name] = None
        else:
            out[fd.name] = _scalar(fd, value)
    return out


# ---------------------------------------------------------------- parsing


def _parse_avro(subject: str, raw_schema: str) -> ParsedAvro:
    _check_size(subject, raw_schema, json_depth(raw_schema))
    try:
        loaded = _load_json(raw_schema)
    except ValueError as exc:
        raise InvalidSchemaError(subject, f"not JSON: {exc}") from exc
    try:
        parsed = fastavro.schema.parse_schema(loaded)
    except Exception as exc:  # noqa: BLE001 - fastavro raises many unrelated types
        raise InvalidSchemaError(subject, f"{type(exc).__name__}: {exc}") from exc
    return ParsedAvro(raw_schema, loaded, parsed)


def _json_refs(value: Any) -> Iterator[str]:
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref is not None:
                yield ref
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def resolve_json_pointer(root: Any, ref: str) -> Any:
    """The part of ``root`` a local reference ``#/a/b`` names (RFC 6901 escapes honoured).

    Raises:
        KeyError: the reference is not local, or names nothing.
    """
    if not ref.startswith("#"):
        raise KeyError(ref)
    node = root
    for part in (p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/")[1:]):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise KeyError(ref)
    return node


def _parse_json_schema(subject: str, raw_schema: str) -> ParsedJsonSchema:
    from jsonschema import exceptions, validators
    from jsonschema_specifications import REGISTRY

    _check_size(subject, raw_schema, json_depth(raw_schema))
    try:
        loaded = _load_json(raw_schema)
    except ValueError as exc:
        raise InvalidSchemaError(subject, f"not JSON: {exc}") from exc
    if not isinstance(loaded, dict):
        raise InvalidSchemaError(subject, f"a JSON Schema must be a JSON object here, not {type(loaded).__name__}")
    dialect = loaded.get("$schema")
    if dialect is None:
        cls: Any = validators.Draft202012Validator
    else:
        cls = validators.validator_for(loaded, default=None) if isinstance(dialect, str) else None
        if cls not in (validators.Draft202012Validator, validators.Draft7Validator):
            raise InvalidSchemaError(
                subject, f"$schema {dialect!r}: only JSON Schema draft 2020-12 (the default) and draft 7 are accepted"
            )
    try:
        cls.check_schema(loaded)
    except exceptions.SchemaError as exc:
        where = _json_pointer(exc.absolute_path)
        raise InvalidSchemaError(subject, f"not a valid JSON Schema at {where}: {exc.message}") from exc
    except RecursionError as exc:
        raise InvalidSchemaError(subject, "nested too deeply") from exc
    for ref in _json_refs(loaded):
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise InvalidSchemaError(subject, f"$ref {ref!r}: only local references (#...) are accepted")
        try:
            resolve_json_pointer(loaded, ref)
        except KeyError:
            raise InvalidSchemaError(subject, f"$ref {ref!r} names nothing in the schema") from None
    return ParsedJsonSchema(raw_schema, loaded, cls(loaded, registry=REGISTRY))


def _protoc_include() -> str:
    import grpc_tools

    return os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")


_ABSL_LOG_LINE = re.compile(r"^(WARNING: All log messages before absl|[IWEF]\d{4} \d)")


def _protoc_errors(stderr: str) -> str:
    """protoc's error lines, without the log lines of its logging library."""
    return "\n".join(line for line in stderr.strip().splitlines() if not _ABSL_LOG_LINE.match(line))


def _compile_proto(subject: str, raw_schema: str) -> descriptor_pb2.FileDescriptorSet:
    """Compile ``raw_schema`` with ``protoc`` into a ``FileDescriptorSet`` (imports included,
    the schema's own file last)."""
    with tempfile.TemporaryDirectory(prefix="danube-proto-") as tmp:
        source = os.path.join(tmp, PROTO_FILE_NAME)
        out = os.path.join(tmp, "schema.desc")
        with open(source, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(raw_schema)
        command = [
            sys.executable, "-m", "grpc_tools.protoc", f"--proto_path={tmp}", f"--proto_path={_protoc_include()}",
            "--include_imports", f"--descriptor_set_out={out}", PROTO_FILE_NAME,
        ]  # fmt: skip
        try:
            run = subprocess.run(command, cwd=tmp, capture_output=True, timeout=PROTOC_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as exc:
            raise InvalidSchemaError(subject, f"protoc took more than {PROTOC_TIMEOUT_S} s") from exc
        if run.returncode != 0:
            errors = _protoc_errors(run.stderr.decode("utf-8", errors="replace").replace(f"{tmp}{os.sep}", ""))
            raise InvalidSchemaError(subject, f"protoc: {errors or f'exit status {run.returncode}'}")
        with open(out, "rb") as f:
            return descriptor_pb2.FileDescriptorSet.FromString(f.read())


def _parse_protobuf(subject: str, raw_schema: str) -> ParsedProtobuf:
    _check_size(subject, raw_schema, _depth(raw_schema, _PROTO_NOISE, _PROTO_DEPTH_STEP))
    if "\x00" in raw_schema:
        raise InvalidSchemaError(subject, "a .proto text cannot contain NUL characters")
    fds = _compile_proto(subject, raw_schema)
    main = fds.file[-1]
    if main.name != PROTO_FILE_NAME:
        raise InvalidSchemaError(subject, "protoc did not compile the schema's file")
    if main.syntax != "proto3":
        raise InvalidSchemaError(subject, f'syntax {main.syntax or "proto2"!r}: only syntax = "proto3" is accepted')
    if not main.message_type:
        raise InvalidSchemaError(subject, "the .proto file declares no message (its first message is the record type)")
    try:
        return ParsedProtobuf(raw_schema, fds)
    except Exception as exc:  # noqa: BLE001 - descriptor pool errors
        raise InvalidSchemaError(subject, f"{type(exc).__name__}: {exc}") from exc


_PARSERS = {AVRO: _parse_avro, JSON_SCHEMA: _parse_json_schema, PROTOBUF: _parse_protobuf}

_lock = threading.Lock()
_by_text: collections.OrderedDict[tuple[str, str], ParsedSchema] = collections.OrderedDict()
_by_fingerprint: dict[tuple[str, str], ParsedSchema] = {}


def _text_key(schema_type: str, raw_schema: str) -> tuple[str, str]:
    return schema_type, hashlib.sha256(raw_schema.encode("utf-8", errors="surrogatepass")).hexdigest()


def cached_schema(schema_type: str, raw_schema: str) -> ParsedSchema | None:
    """The parsed schema of exactly this text, if :func:`parse_schema` parsed it recently."""
    key = _text_key(schema_type, raw_schema)
    with _lock:
        parsed = _by_text.get(key)
        if parsed is not None:
            _by_text.move_to_end(key)
        return parsed


def schema_for_fingerprint(schema_type: str, fingerprint: str) -> ParsedSchema | None:
    """A cached parsed schema with this fingerprint (any text of it), or ``None``."""
    with _lock:
        return _by_fingerprint.get((schema_type, fingerprint))


def parse_schema(schema_type: str, raw_schema: str, *, subject: str) -> ParsedSchema:
    """Parse and validate a schema of ``schema_type`` (see the module docstring).

    Cached: the same text of the same type is parsed (and a Protobuf one compiled) once while
    it stays among the last :data:`CACHE_ENTRIES` parsed. Compiling Protobuf runs ``protoc``
    in a subprocess (about 0.1-0.2 s): call this in a worker thread from async code when
    :func:`cached_schema` misses.

    Args:
        schema_type: one of :data:`SCHEMA_TYPES`.
        raw_schema: the schema text.
        subject: the subject, named in errors.

    Returns:
        The parsed schema (shared: do not mutate it).

    Raises:
        InvalidSchemaError: an unknown type, a text over :data:`MAX_SCHEMA_BYTES` or nested
            deeper than :data:`MAX_SCHEMA_DEPTH`, or a text that is not a valid schema of its
            type; ``reason`` says why.
    """
    parser = _PARSERS.get(schema_type)
    if parser is None:
        raise InvalidSchemaError(subject, f"unknown schema type {schema_type!r}; one of {', '.join(SCHEMA_TYPES)}")
    found = cached_schema(schema_type, raw_schema)
    if found is not None:
        return found
    parsed = parser(subject, raw_schema)
    key = _text_key(schema_type, raw_schema)
    with _lock:
        _by_text[key] = parsed
        _by_fingerprint[(schema_type, parsed.fingerprint)] = parsed
        while len(_by_text) > CACHE_ENTRIES:
            _, dropped = _by_text.popitem(last=False)
            if _by_fingerprint.get((dropped.schema_type, dropped.fingerprint)) is dropped:
                del _by_fingerprint[(dropped.schema_type, dropped.fingerprint)]
    return parsed

