"""Storage shared by the broker (tiered reads) and the pipeline (tiering): the object store, one
fsspec URL for `file://` and `s3://` (`objectstore`, its identity in `identity`), and the Iceberg
side both read: the SQL catalog (`catalog`), the reserved column names (`table_columns`), the
committed end offset (`table_properties`) and reading a topic's history back from its table
(`table_reader`). Needs the `[broker]` or the `[pipeline]` extra."""
