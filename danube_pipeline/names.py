"""Topic, namespace and subscription names.

A topic name is ``/{namespace}/{topic}`` (``docs/etcd-layout.md``, "Conventions").
Both parts are 1 to 128 characters from ``[A-Za-z0-9_-]`` so they embed unescaped in etcd key
paths, object-store paths, Iceberg identifiers and Dagster partition keys.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from danube_pipeline.errors import InvalidNameError

_PART = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def validate_part(kind: str, value: str) -> str:
    """Check one name part (namespace, topic, subscription, producer or consumer name).

    Raises:
        InvalidNameError: if ``value`` is empty, longer than 128 characters or has a character
            outside ``[A-Za-z0-9_-]``.
    """
    if not _PART.match(value):
        raise InvalidNameError(kind, value, "must be 1-128 characters of [A-Za-z0-9_-]")
    return value


@dataclass(frozen=True, slots=True)
class TopicName:
    """A parsed topic name.

    Attributes:
        namespace: e.g. ``"default"``.
        topic: e.g. ``"flights"``.
    """

    namespace: str
    topic: str

    @classmethod
    def parse(cls, name: str) -> TopicName:
        """Parse ``"/{namespace}/{topic}"``.

        Raises:
            InvalidNameError: if the shape is not ``/ns/topic`` or a part is invalid.
        """
        parts = name.split("/")
        if len(parts) != 3 or parts[0] != "":
            raise InvalidNameError("topic", name, "expected the form /{namespace}/{topic}")
        return cls(validate_part("namespace", parts[1]), validate_part("topic", parts[2]))

    @classmethod
    def from_partition_key(cls, key: str) -> TopicName:
        """Parse a Dagster partition key ``"{namespace}.{topic}"`` (``/`` is unsafe there).

        Raises:
            InvalidNameError: if the key is not ``ns.topic`` with valid parts.
        """
        ns, sep, topic = key.partition(".")
        if not sep:
            raise InvalidNameError("partition key", key, "expected {namespace}.{topic}")
        return cls(validate_part("namespace", ns), validate_part("topic", topic))

    @property
    def path(self) -> str:
        """``"/{namespace}/{topic}"``."""
        return f"/{self.namespace}/{self.topic}"

    @property
    def partition_key(self) -> str:
        """``"{namespace}.{topic}"``, the Dagster dynamic partition key."""
        return f"{self.namespace}.{self.topic}"

    def __str__(self) -> str:
        return self.path
