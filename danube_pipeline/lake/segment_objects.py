"""A segment object read back from the object store and checked against its descriptor.

Tiering's table commit and a bulk load's Spark tasks read the objects the same way: the
bytes must have the size and MD5 etag the completed descriptor records
(``docs/etcd-layout.md`` §5.1) before they are decoded into columns.
"""

from __future__ import annotations

import hashlib

from danube_pipeline.errors import CorruptRecordError
from danube_pipeline.format.segments import DecodedSegment
from danube_pipeline.lake.segment_columns import RecordColumns, decode_segment_columns
from danube_pipeline.storage.objectstore import ObjectStore

__all__ = ["read_segment_object"]


def read_segment_object(
    objects: ObjectStore, path: str, *, size_bytes: int, etag: str | None, where: str
) -> DecodedSegment[RecordColumns]:
    """Read a segment object, check it against its descriptor and decode it.

    Args:
        objects: the object store holding it.
        path: the object's path (:func:`~danube_pipeline.storage.objectstore.segment_object_path`).
        size_bytes: the size its descriptor records.
        etag: the MD5 hex its descriptor records, or ``None`` (not checked).
        where: names the object in errors, ``/ns/topic/data-{start}-{end}.dnb1``.

    Returns:
        The decoded segment (:func:`~danube_pipeline.lake.segment_columns.decode_segment_columns`).

    Raises:
        CorruptRecordError: the size or MD5 differs from the descriptor's, or decoding fails.
        FileNotFoundError: the object is missing.
    """
    data = objects.get_bytes(path)
    if len(data) != size_bytes:
        raise CorruptRecordError(where, len(data), f"object is {len(data)} bytes, descriptor says {size_bytes}")
    if etag and hashlib.md5(data).hexdigest() != etag:
        raise CorruptRecordError(where, 0, f"MD5 does not match the descriptor's etag {etag}")
    return decode_segment_columns(data, where=where)
