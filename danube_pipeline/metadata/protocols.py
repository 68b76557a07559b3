"""The narrow read and write interfaces that parts of a broker need from the metadata layer.

:class:`~danube_pipeline.metadata.store.MetadataStore` satisfies :class:`MetadataWriter` and
:class:`~danube_pipeline.metadata.cache.LocalCache` satisfies :class:`MetadataReader`; a part
that needs only these (a topic storing cursors, reading its policy) takes them, so an in-process
test can hand it a typed stand-in.
"""

from __future__ import annotations

from typing import Protocol

from danube_pipeline.metadata.values import JsonRecord, JsonValue


class MetadataWriter(Protocol):
    """Writes or deletes one key (``MetadataStore.put``, ``MetadataStore.delete``)."""

    async def put(self, key: str, value: JsonValue | JsonRecord) -> int:
        """Write ``value`` at ``key``; return the etcd revision of the write."""
        ...

    async def delete(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        ...


class MetadataReader(Protocol):
    """Reads keys from memory (``LocalCache.get``, ``LocalCache.get_prefix``)."""

    def get(self, key: str) -> JsonValue | None:
        """The value of ``key``, or ``None`` if absent."""
        ...

    def get_prefix(self, prefix: str) -> dict[str, JsonValue]:
        """Every ``key -> value`` whose key starts with ``prefix``, sorted by key."""
        ...
