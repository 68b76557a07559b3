"""Danube Pipeline: the shared core that the broker (`broker/`) and the Dagster assets (`assets/`) use.

The folders show what each install role holds (`docs/architecture.md`, "The tree"):

* the base install (`pip install danube-pipeline`): `errors`, `error_codec`, `names`, `modes`,
  `settings`, `outages`, `partitions`, `faults`, and the packages `format/` (record batches and
  segments), `metadata/` (etcd keys, values, store, cache), `client/` (the client library),
  `proto/` (the gRPC API) and `admin/` (`danube-admin`);
* `schemas/` (the schema registry and its formats) and `storage/` (the object store): with the
  `[broker]` or the `[pipeline]` extra;
* `lake/` (tiering, the Spark bulk path, retention, rewrites, Spark, Iceberg): with `[pipeline]`;
* `dev/` (launchers, the demo, fuzzing strategies): development only.

`tests/test_layers.py` checks that no layer imports one above it.
"""
