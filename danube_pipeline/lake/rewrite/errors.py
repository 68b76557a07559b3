"""The schema-rewrite errors: one root, :class:`RewriteError`, and a subclass per way a
rewrite stops (invalid spec, conflicting staged state, failed verification, concurrent change)."""

from __future__ import annotations

from danube_pipeline.errors import DanubeError
from danube_pipeline.lake.rewrite.properties import REWRITE_PROPERTY

__all__ = [
    "RewriteConflictError",
    "RewriteError",
    "RewriteSpecError",
    "RewriteStateError",
    "RewriteVerificationError",
]


class RewriteError(DanubeError):
    """Root of the schema-rewrite errors."""


class RewriteSpecError(RewriteError, ValueError):
    """The declared rewrite spec (table property ``danube.rewrite``) is invalid.

    Attributes:
        table: the table's identifier, ``ns.topic``.
        reason: what is wrong, naming the field.
    """

    def __init__(self, table: str, reason: str) -> None:
        self.table = table
        self.reason = reason
        super().__init__(f"{table}: invalid {REWRITE_PROPERTY}: {reason}")


class RewriteStateError(RewriteError):
    """The declared spec conflicts with the rewrite already staged on the table (an older
    version, an unfinished previous version, or the same version edited after staging).

    Attributes:
        table: the table's identifier.
        staged_version: the version recorded in ``danube.rewrite-state``.
        declared_version: the version of ``danube.rewrite``.
        reason: what conflicts and what to do.
    """

    def __init__(self, table: str, staged_version: int, declared_version: int, reason: str) -> None:
        self.table = table
        self.staged_version = staged_version
        self.declared_version = declared_version
        self.reason = reason
        super().__init__(
            f"{table}: declared rewrite version {declared_version} vs staged version "
            f"{staged_version}: {reason}"
        )


class RewriteVerificationError(RewriteError):
    """A partition's rewritten files do not hold the rows its old files held; nothing was
    committed and the new files were deleted.

    Attributes:
        table: the table's identifier.
        partition: the partition (``{partition}@spec-{id}``).
        what: ``rows``, ``rows in the new files' metadata``, ``untouched checksum``,
            ``rewritten checksum`` or ``values of {column}`` (old values set, new ones null).
        before: the value over the old files (for ``rewritten checksum``, over the rows as
            converted; for ``values of``, rows whose retired column is set).
        after: the value read back from the new files (for ``values of``, those rows whose
            new column is set too).
    """

    def __init__(self, table: str, partition: str, what: str, before: int, after: int) -> None:
        self.table = table
        self.partition = partition
        self.what = what
        self.before = before
        self.after = after
        super().__init__(
            f"{table} partition {partition}: {what} differs after the rewrite "
            f"({before} before, {after} after); nothing was committed"
        )


class RewriteConflictError(RewriteError):
    """A partition changed while it was being rewritten (compaction, retention or another
    rewrite replaced one of its files, or added delete files against them); nothing was
    committed. Running again rewrites it from its new files.

    Attributes:
        table: the table's identifier.
        partition: ``{partition}@spec-{id}``.
        cause: the Iceberg exception's message.
    """

    retriable = True

    def __init__(self, table: str, partition: str, cause: str) -> None:
        self.table = table
        self.partition = partition
        self.cause = cause
        super().__init__(f"{table} partition {partition} changed during its rewrite; nothing committed: {cause}")
