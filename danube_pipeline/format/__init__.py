"""The record and segment formats (base install): producer-framed record batches (`batches`),
the segment header and version-1 records (`records`), and whole segments of either version
(`segments`). The wire and disk layout is specified in `docs/architecture.md`, "The dnb1 segment
format"."""
