"""What a rewrite run did: :class:`UnitResult` per partition and :class:`RewriteReport` for
the table."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "RewriteReport",
    "UnitResult",
]


@dataclass(frozen=True, slots=True)
class UnitResult:
    """What happened to one partition.

    Attributes:
        partition: ``{partition}@spec-{id}``.
        status: ``rewritten`` or ``skipped`` (every row converted and the files in the
            current spec already).
        files_before: data files of the partition the run looked at.
        files_after: data files that replaced them (``files_before`` when skipped).
        rows: rows in the rewritten files (all of the partition's rows when skipped).
        rows_converted: rows the expressions converted (the others kept their values).
        checksum_before: untouched-column checksum over the old files (rewritten units).
        checksum_after: the same over the new files (equal, or nothing was committed).
        snapshot_id: the ``replace`` snapshot (rewritten units).
    """

    partition: str
    status: str
    files_before: int
    files_after: int
    rows: int
    rows_converted: int = 0
    checksum_before: int | None = None
    checksum_after: int | None = None
    snapshot_id: int | None = None


@dataclass(frozen=True, slots=True)
class RewriteReport:
    """What :func:`rewrite_table` did.

    Attributes:
        table: ``ns.topic``.
        version: the spec's version (``None`` when no spec is declared).
        day: the UTC day the run was limited to (``None``: the whole table).
        staged: this run staged the schema and spec.
        finalized: this run finalized the rewrite.
        already_finalized: the version was finalized before this run (nothing to do).
        retired: target column → its retired column (``{"flight": "flight__pre_v2"}``).
        units: per-partition results, in commit order.
        snapshot_before: the current snapshot when the run started.
        snapshot_after: the current snapshot when it ended.
        table_data_files_before: live data files when the run started.
        table_data_files_after: live data files when it ended.
        remaining_files: files anywhere in the table still needing a rewrite afterwards.
    """

    table: str
    version: int | None
    day: dt.date | None
    staged: bool = False
    finalized: bool = False
    already_finalized: bool = False
    retired: Mapping[str, str] = field(default_factory=dict)
    units: tuple[UnitResult, ...] = ()
    snapshot_before: int | None = None
    snapshot_after: int | None = None
    table_data_files_before: int = 0
    table_data_files_after: int = 0
    remaining_files: int = 0

    @property
    def rewritten(self) -> list[UnitResult]:
        return [u for u in self.units if u.status == "rewritten"]

    @property
    def skipped(self) -> list[UnitResult]:
        return [u for u in self.units if u.status == "skipped"]

    @property
    def snapshot_ids(self) -> list[int]:
        return [u.snapshot_id for u in self.units if u.snapshot_id is not None]
