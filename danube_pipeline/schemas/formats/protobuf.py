"""Protobuf schemas (proto3 ``.proto`` texts): compiling with ``protoc``, validating and decoding payloads.

The text is compiled at run time by ``python -m grpc_tools.protoc`` in a subprocess and a
temporary directory, with a time limit (:data:`PROTOC_TIMEOUT_S`); its files go into a private
``DescriptorPool``. The first top-level message is the record type; the fingerprint hashes the
serialized ``FileDescriptorProto``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Final

from google.protobuf import (
    descriptor_pb2,
    descriptor_pool,
    message_factory,
    unknown_fields,
)
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from danube_pipeline.errors import InvalidSchemaError
from danube_pipeline.schemas.formats.parsed_schema import (
    PROTOBUF,
    Payload,
    ParsedSchema,
    check_size,
    nesting_depth,
    sha256_fingerprint,
)

PROTOC_TIMEOUT_S: Final = 30.0
"""Longest a ``protoc`` run may take, in seconds."""
PROTO_FILE_NAME: Final = "schema.proto"
"""The name the ``.proto`` text is compiled under (it is part of the ``FileDescriptorProto``,
so of the fingerprint)."""

_PROTO_NOISE = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|//[^\n]*|/\*.*?\*/', re.DOTALL)
_PROTO_DEPTH_STEP = {"{": 1, "}": -1}


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
        self.fingerprint = sha256_fingerprint(self.file_descriptor_proto.SerializeToString(deterministic=True))
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


def parse_protobuf_schema(subject: str, raw_schema: str) -> ParsedProtobuf:
    """Compile a proto3 ``.proto`` text and build its record message class.

    Raises:
        InvalidSchemaError: too large or deep, a NUL character, ``protoc`` refused it or took
            too long, not proto3, or no message.
    """
    check_size(subject, raw_schema, nesting_depth(raw_schema, _PROTO_NOISE, _PROTO_DEPTH_STEP))
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

