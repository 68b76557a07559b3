"""The cold path (the `[pipeline]` extra): sealed segments to objects and descriptors (`tiering/`),
Iceberg tables (`iceberg/`), the Spark bulk path (`bulk/`), retention (`retention/`), schema
rewrites (`rewrite/`), Spark sessions and procedures (`spark/`), freshness (`freshness`), and
segments read into Arrow columns (`segment_columns`, with the C record walker `_framing`)."""
