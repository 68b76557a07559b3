"""Protobuf compatibility: can one ``.proto`` message read what another wrote?

**Protobuf** follows Confluent's Protobuf rules, on the compiled ``FileDescriptorProto``:

===================================  =========================================================
rule                                 when (reader vs writer)
===================================  =========================================================
``MESSAGE_REMOVED``                  a message of the writer's file is not in the reader's
                                     (names relative to the package, so a package change is fine)
``MESSAGE_NAME_CHANGED``             the record message (the first one) has another name
``FIELD_SCALAR_KIND_CHANGED``        a field number's scalar type changes group; the groups
                                     read each other's bytes: int32/uint32/int64/uint64/bool;
                                     sint32/sint64; fixed32/sfixed32; fixed64/sfixed64;
                                     string/bytes (float and double stand alone)
``FIELD_KIND_CHANGED``               scalar to message or enum (or back), message to enum, map
                                     to non-map
``FIELD_NAMED_TYPE_CHANGED``         another message or enum type
``FIELD_LABEL_CHANGED``              singular to ``repeated`` or back (Confluent accepts this
                                     for numeric and string/bytes scalars; refused here, as the
                                     value's shape changes)
``ONEOF_FIELD_REMOVED``              a field leaves a ``oneof`` that both have
``MULTIPLE_FIELDS_MOVED_TO_ONEOF``   a new ``oneof`` takes in more than one existing field
===================================  =========================================================

Accepted: adding or removing a field, renaming a field (the number is what counts), adding a
``oneof`` or a field to a ``oneof``, removing a ``oneof``, enum value changes, package
changes. Fields are compared along the record message and every message type its fields
reach (proto3 ``optional`` is not a ``oneof`` here).
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2

from danube_pipeline.schemas.compatibility.findings import Found, Side, join_path


_FDP = descriptor_pb2.FieldDescriptorProto
_SCALAR_GROUPS: dict[int, str] = {
    _FDP.TYPE_INT32: "varint", _FDP.TYPE_UINT32: "varint", _FDP.TYPE_INT64: "varint", _FDP.TYPE_UINT64: "varint",
    _FDP.TYPE_BOOL: "varint", _FDP.TYPE_SINT32: "zigzag", _FDP.TYPE_SINT64: "zigzag",
    _FDP.TYPE_FIXED32: "fixed32", _FDP.TYPE_SFIXED32: "fixed32", _FDP.TYPE_FIXED64: "fixed64",
    _FDP.TYPE_SFIXED64: "fixed64", _FDP.TYPE_STRING: "length-delimited", _FDP.TYPE_BYTES: "length-delimited",
    _FDP.TYPE_FLOAT: "float", _FDP.TYPE_DOUBLE: "double",
}  # fmt: skip
_NAMED_KINDS = {_FDP.TYPE_MESSAGE: "message", _FDP.TYPE_ENUM: "enum", _FDP.TYPE_GROUP: "group"}


def _proto_type(field: descriptor_pb2.FieldDescriptorProto) -> str:
    if field.type in _NAMED_KINDS:
        return f"{_NAMED_KINDS[field.type]} {field.type_name.lstrip('.')}"
    type_name: str = _FDP.Type.Name(field.type)
    return type_name.removeprefix("TYPE_").lower()


class _ProtoFile:
    """A ``FileDescriptorProto``'s messages by name relative to its package (``Outer.Inner``)."""

    def __init__(self, file: descriptor_pb2.FileDescriptorProto) -> None:
        self.package = file.package
        self.messages: dict[str, descriptor_pb2.DescriptorProto] = {}
        self.map_entries: set[str] = set()
        self.root = file.message_type[0].name if file.message_type else ""
        stack = [("", m) for m in file.message_type]
        while stack:
            prefix, message = stack.pop()
            name = f"{prefix}{message.name}"
            self.messages[name] = message
            if message.options.map_entry:
                self.map_entries.add(name)
            stack.extend((f"{name}.", nested) for nested in message.nested_type)

    def relative(self, type_name: str) -> str:
        name = type_name.lstrip(".")
        return name[len(self.package) + 1 :] if self.package and name.startswith(self.package + ".") else name


class ProtobufCheck:
    """Whether a Protobuf reader file reads what a writer file wrote, with the rules of this
    module, along the record message (the first one) and every message type it reaches.

    Args:
        side: how the reader and the writer are named in messages.
        reader: the reader's compiled file.
        writer: the writer's compiled file.
    """

    def __init__(
        self, side: Side, reader: descriptor_pb2.FileDescriptorProto, writer: descriptor_pb2.FileDescriptorProto
    ) -> None:
        self.side = side
        self.reader = _ProtoFile(reader)
        self.writer = _ProtoFile(writer)
        self.seen: set[tuple[str, str]] = set()

    def found(self, out: list[Found], path: str, rule: str, what: str) -> None:
        out.append(Found(path, rule, f"{self.side.reader} cannot read {self.side.writer}: {what}"))

    def run(self) -> list[Found]:
        """Every incompatibility of the reader with the writer."""
        out: list[Found] = []
        renamed = self.reader.root != self.writer.root
        if renamed:
            self.found(out, "", "MESSAGE_NAME_CHANGED",
                       f"the record message is {self.reader.root!r} in the reader and {self.writer.root!r} "
                       "in the writer")  # fmt: skip
        for name in self.writer.messages:
            missing = name not in self.reader.messages and name not in self.writer.map_entries
            if missing and not (renamed and name == self.writer.root):
                self.found(out, name, "MESSAGE_REMOVED", f"message {name!r} is missing from the reader")
        self.message(self.writer.messages[self.writer.root], self.reader.messages[self.reader.root], "", out)
        return out

    def _name(self, r: descriptor_pb2.FieldDescriptorProto | None, w: descriptor_pb2.FieldDescriptorProto | None) -> str:
        """The field's name in the new schema (or in whichever side has it)."""
        new, old = (r, w) if self.side.reader_is_new else (w, r)
        chosen = new if new is not None else old
        assert chosen is not None
        name: str = chosen.name
        return name

    @staticmethod
    def _real_oneofs(message: descriptor_pb2.DescriptorProto) -> dict[str, set[int]]:
        members: dict[int, list[descriptor_pb2.FieldDescriptorProto]] = {}
        for field in message.field:
            if field.HasField("oneof_index"):
                members.setdefault(field.oneof_index, []).append(field)
        return {
            message.oneof_decl[i].name: {f.number for f in fields}
            for i, fields in members.items()
            if not (len(fields) == 1 and fields[0].proto3_optional)
        }

    def message(
        self, w: descriptor_pb2.DescriptorProto, r: descriptor_pb2.DescriptorProto, path: str, out: list[Found]
    ) -> None:
        w_fields = {f.number: f for f in w.field}
        r_fields = {f.number: f for f in r.field}
        for number, wf in w_fields.items():
            rf = r_fields.get(number)
            if rf is not None:
                self.field(wf, rf, join_path(path, self._name(rf, wf)), out)
        w_oneofs, r_oneofs = self._real_oneofs(w), self._real_oneofs(r)
        in_w_oneof = set().union(*w_oneofs.values()) if w_oneofs else set()
        for name, r_numbers in r_oneofs.items():
            if name in w_oneofs:
                for number in sorted(w_oneofs[name] - r_numbers):
                    field_name = self._name(r_fields.get(number), w_fields.get(number))
                    self.found(out, join_path(path, field_name), "ONEOF_FIELD_REMOVED",
                               f"field {field_name!r} is in the writer's oneof {name!r} and not in the "
                               "reader's")  # fmt: skip
            else:
                moved = sorted(n for n in r_numbers if n in w_fields and n not in in_w_oneof)
                if len(moved) > 1:
                    names = ", ".join(self._name(r_fields[n], w_fields[n]) for n in moved)
                    self.found(out, join_path(path, name), "MULTIPLE_FIELDS_MOVED_TO_ONEOF",
                               f"fields {names} moved into the new oneof {name!r}")  # fmt: skip

    def _map_entry(self, file: _ProtoFile, field: descriptor_pb2.FieldDescriptorProto) -> descriptor_pb2.DescriptorProto | None:
        if field.type != _FDP.TYPE_MESSAGE:
            return None
        name = file.relative(field.type_name)
        return file.messages.get(name) if name in file.map_entries else None

    def field(
        self, wf: descriptor_pb2.FieldDescriptorProto, rf: descriptor_pb2.FieldDescriptorProto, path: str, out: list[Found]
    ) -> None:
        w_map, r_map = self._map_entry(self.writer, wf), self._map_entry(self.reader, rf)
        if (w_map is None) != (r_map is None):
            self.found(out, path, "FIELD_KIND_CHANGED",
                       f"{path!r} is {'a map' if r_map else _proto_type(rf)} in the reader and "
                       f"{'a map' if w_map else _proto_type(wf)} in the writer")  # fmt: skip
            return
        if w_map is not None and r_map is not None:
            w_entry = {f.number: f for f in w_map.field}
            r_entry = {f.number: f for f in r_map.field}
            if 1 in w_entry and 1 in r_entry:
                self.types(w_entry[1], r_entry[1], path, out, what="map key")
            if 2 in w_entry and 2 in r_entry:
                self.types(w_entry[2], r_entry[2], join_path(path, "{}"), out, what="map value")
            return
        w_repeated = wf.label == _FDP.LABEL_REPEATED
        if w_repeated != (rf.label == _FDP.LABEL_REPEATED):
            self.found(out, path, "FIELD_LABEL_CHANGED",
                       f"{path!r} is {'repeated' if not w_repeated else 'singular'} in the reader and "
                       f"{'repeated' if w_repeated else 'singular'} in the writer")  # fmt: skip
            return
        self.types(wf, rf, join_path(path, "[]") if w_repeated and wf.type == _FDP.TYPE_MESSAGE else path, out)

    def types(
        self,
        wf: descriptor_pb2.FieldDescriptorProto,
        rf: descriptor_pb2.FieldDescriptorProto,
        path: str,
        out: list[Found],
        *,
        what: str = "field",
    ) -> None:
        w_named, r_named = wf.type in _NAMED_KINDS, rf.type in _NAMED_KINDS
        if not w_named and not r_named:
            if _SCALAR_GROUPS.get(wf.type) != _SCALAR_GROUPS.get(rf.type):
                self.found(out, path, "FIELD_SCALAR_KIND_CHANGED",
                           f"{what} {path!r} is {_proto_type(rf)} in the reader and {_proto_type(wf)} in the writer, "
                           "whose encodings differ")  # fmt: skip
            return
        if w_named != r_named or wf.type != rf.type:
            self.found(out, path, "FIELD_KIND_CHANGED",
                       f"{what} {path!r} is {_proto_type(rf)} in the reader and {_proto_type(wf)} in the writer")  # fmt: skip
            return
        w_name, r_name = self.writer.relative(wf.type_name), self.reader.relative(rf.type_name)
        if w_name != r_name:
            self.found(out, path, "FIELD_NAMED_TYPE_CHANGED",
                       f"{what} {path!r} is {_proto_type(rf)} in the reader and {_proto_type(wf)} in the writer")  # fmt: skip
            return
        if wf.type == _FDP.TYPE_MESSAGE and (w_name, r_name) not in self.seen:
            self.seen.add((w_name, r_name))
            w_message, r_message = self.writer.messages.get(w_name), self.reader.messages.get(r_name)
            if w_message is not None and r_message is not None:
                self.message(w_message, r_message, path, out)
