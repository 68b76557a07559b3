"""Name grammars: one per kind of name, checked with a full match on client and broker alike.

Every name embeds unescaped in etcd key paths, WAL directory names, object-store paths, Iceberg
identifiers and Dagster partition keys, so each kind has one grammar (``docs/etcd-layout.md``,
"Name grammar"):

==============================================  ==============================  ===============
kind                                            characters                      length (bytes)
==============================================  ==============================  ===============
namespace, topic, subscription, producer,       ``[A-Za-z0-9_-]``               1-128
consumer
schema subject                                  ``[A-Za-z0-9._-]``, first       1-255
                                                character a letter or digit
cluster name                                    ``[A-Za-z0-9_-]``, not one of   1-128
                                                :data:`RESERVED_CLUSTER_NAMES`
==============================================  ==============================  ===============

Names are ASCII, so characters and bytes count the same. Matching uses :func:`re.fullmatch`
(``$`` would also match before a trailing newline). Errors quote a bounded prefix of the bad
input (:func:`danube_pipeline.errors.bounded`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from danube_pipeline.errors import InvalidNameError

MAX_NAME_BYTES: Final = 128
"""Longest namespace, topic, subscription, producer, consumer or cluster name."""

MAX_SUBJECT_BYTES: Final = 255
"""Longest schema subject."""

_PART = re.compile(r"[A-Za-z0-9_-]{1,128}")
_SUBJECT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")

RESERVED_CLUSTER_NAMES: Final = frozenset({"register", "brokers", "unassigned", "load", "leader", "load_balance"})
"""Children of ``/cluster`` other than the cluster name itself (``docs/etcd-layout.md`` §1)."""


def validate_part(kind: str, value: str) -> str:
    """Check one name (namespace, topic, subscription, producer or consumer).

    Returns:
        ``value`` unchanged.

    Raises:
        InvalidNameError: if ``value`` is not 1-128 characters of ``[A-Za-z0-9_-]``.
    """
    if _PART.fullmatch(value) is None:
        raise InvalidNameError(kind, value, "must be 1-128 characters of [A-Za-z0-9_-]")
    return value


def validate_subject(subject: str) -> str:
    """Check a schema subject (``docs/etcd-layout.md`` §4.2).

    Returns:
        ``subject`` unchanged.

    Raises:
        InvalidNameError: if ``subject`` is not 1-255 characters of ``[A-Za-z0-9._-]`` starting
            with a letter or digit (``_global`` and ``_index`` are reserved, §4.1 and §4.4).
    """
    if _SUBJECT.fullmatch(subject) is None:
        raise InvalidNameError(
            "schema subject",
            subject,
            "must be 1-255 characters of [A-Za-z0-9._-], starting with a letter or digit",
        )
    return subject


def validate_cluster_name(name: str) -> str:
    """Check a cluster name (``docs/etcd-layout.md`` §1.1).

    Raises:
        InvalidNameError: if ``name`` is not 1-128 characters of ``[A-Za-z0-9_-]`` or is one of
            :data:`RESERVED_CLUSTER_NAMES`.
    """
    validate_part("cluster", name)
    if name in RESERVED_CLUSTER_NAMES:
        raise InvalidNameError("cluster", name, f"{name!r} is a reserved key under /cluster")
    return name


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
