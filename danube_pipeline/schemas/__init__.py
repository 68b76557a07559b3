"""The schema registry (`registry`), its compatibility rules (`compatibility/`) and the schema
formats Avro, JSON Schema and Protobuf (`formats/`). Needs the `[broker]` or the `[pipeline]`
extra (fastavro, jsonschema, grpcio-tools); keys under `/schemas/` (`docs/etcd-layout.md` §4)."""
