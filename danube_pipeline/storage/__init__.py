"""Object storage shared by the broker (tiered reads) and the pipeline (tiering): one fsspec URL for
`file://` and `s3://` (`objectstore`). Needs the `[broker]` or the `[pipeline]` extra."""
