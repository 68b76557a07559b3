"""Order-free row checksums computed in Spark: a 64-bit hash per row, summed exactly, so
equal multisets of rows give equal results whatever their order or file layout
(:mod:`danube_pipeline.lake.rewrite` verifies its rewrites with them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

__all__ = [
    "RowChecksum",
    "checksum_of",
    "row_checksum",
    "row_hash",
]


@dataclass(frozen=True, slots=True)
class RowChecksum:
    """An order-free fingerprint of a set of rows (:func:`row_checksum`).

    Attributes:
        rows: the number of rows.
        checksum: the exact sum (no overflow: summed as ``DECIMAL(38,0)``) of each row's
            64-bit ``xxhash64``; 0 for no rows.
    """

    rows: int
    checksum: int


def row_hash(df: DataFrame, columns: tuple[str, ...] | list[str]) -> Column:
    """A 64-bit hash of each row's ``columns`` (a Spark column expression over ``df``).

    ``xxhash64(isnull(c1), c1, isnull(c2), c2, …)`` (Spark's xxHash64, seed 42): the null flags
    keep ``(null, 1)`` and ``(1, null)`` apart (``xxhash64`` skips nulls); maps, arrays and
    structs are hashed as their ``to_json`` text, since Spark does not hash maps. No columns
    hash to 0.

    Args:
        df: the DataFrame whose columns are hashed.
        columns: the column names.

    Returns:
        A ``LongType`` column.
    """
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    kinds = {f.name: f.dataType for f in df.schema.fields}
    args = []
    for name in columns:
        column = F.col(f"`{name}`")
        value = F.to_json(column) if isinstance(kinds.get(name), T.MapType | T.ArrayType | T.StructType) else column
        args += [F.isnull(column), value]
    return F.xxhash64(*args) if args else F.lit(0).cast("long")


def checksum_of(row_hashes: Column) -> Column:
    """The order-free aggregate of :func:`row_hash` values: their exact sum, as
    ``DECIMAL(38,0)`` (no overflow below 10**19 rows), 0 for no rows."""
    from pyspark.sql import functions as F

    return F.coalesce(F.sum(row_hashes.cast("decimal(38,0)")), F.lit(0).cast("decimal(38,0)"))


def row_checksum(df: DataFrame, columns: tuple[str, ...] | list[str]) -> RowChecksum:
    """Row count and an order-free checksum of ``columns``, computed in Spark (one job).

    Each row hashes with :func:`row_hash`; the hashes are summed exactly
    (:func:`checksum_of`). Equal multisets of rows give equal results whatever their order or
    file layout.

    Args:
        df: the rows.
        columns: the columns to fingerprint, by name; an empty list counts rows only.

    Returns:
        A :class:`RowChecksum`.

    Raises:
        pyspark.errors.AnalysisException: a column does not exist.
    """
    from pyspark.sql import functions as F

    row = df.agg(F.count(F.lit(1)).alias("rows"), checksum_of(row_hash(df, columns)).alias("checksum")).collect()[0]
    return RowChecksum(int(row["rows"]), int(row["checksum"]))
