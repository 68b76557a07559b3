"""The staged table's column roles for one spec (:class:`RewriteShape`): which columns a
rewrite writes and which it keeps, the rows still to convert, the rows in the target shape as
Spark column expressions, and the spec's expressions checked against the table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from danube_pipeline.lake.rewrite.errors import RewriteSpecError
from danube_pipeline.lake.rewrite.properties import REWRITE_VERSION_COLUMN
from danube_pipeline.lake.rewrite.spec import RewriteSpec, spark_sql_type
from danube_pipeline.lake.rewrite.staging import RewriteState

if TYPE_CHECKING:
    from pyiceberg.table import Table
    from pyspark.sql import Column, DataFrame, SparkSession

__all__ = [
    "RewriteShape",
    "quoted",
    "shape_of",
    "validate_before_staging",
    "validate_expressions",
]

_CURRENT = "__danube_current__"
_CONVERT = "__danube_convert__"


def quoted(name: str) -> str:
    """``name`` as a Spark SQL identifier: in back quotes, a back quote inside doubled."""
    return "`" + name.replace("`", "``") + "`"


@dataclass(frozen=True, slots=True)
class RewriteShape:
    """The column roles of the staged table, for one spec.

    Attributes:
        columns: the current schema's top-level columns, in order.
        spec: the staged spec.
        retired: target column → its retired column.
    """

    columns: tuple[str, ...]
    spec: RewriteSpec
    retired: Mapping[str, str]

    @property
    def rewritten(self) -> tuple[str, ...]:
        """Columns a rewrite may change: the targets and ``_rewrite_version``."""
        touched = {c.name for c in self.spec.columns} | {REWRITE_VERSION_COLUMN}
        return tuple(c for c in self.columns if c in touched)

    @property
    def untouched(self) -> tuple[str, ...]:
        """Every other column, the retired ones included (their values are kept)."""
        touched = set(self.rewritten)
        return tuple(c for c in self.columns if c not in touched)

    def pre_rewrite_view(self, df: DataFrame, *, extra: Sequence[str] = ()) -> DataFrame:
        """``df`` (current schema) with the columns named as before staging: a retired column
        under its old name, the target that replaced it under a private name; the ``extra``
        columns (e.g. ``_file``) pass through first."""
        from pyspark.sql import functions as F

        back = {new: old for old, new in self.retired.items()}
        cols = [F.col(quoted(c)) for c in extra]
        for c in self.columns:
            if c in back:
                cols.append(F.col(quoted(c)).alias(back[c]))
            elif c in self.retired:
                cols.append(F.col(quoted(c)).alias(_CURRENT + c))
            else:
                cols.append(F.col(quoted(c)))
        return df.select(*cols)

    def _targets(self) -> list[tuple[str, Column, Column]]:
        """``(name, current value, converted value)`` per target, over :meth:`pre_rewrite_view`."""
        from pyspark.sql import functions as F

        out = []
        for target in self.spec.columns:
            name = _CURRENT + target.name if target.name in self.retired else target.name
            current = F.col(quoted(name))
            value = F.expr(f"CAST(({target.expr}) AS {spark_sql_type(target.type)})")
            out.append((target.name, current, value))
        return out

    def eligible(self) -> Column:
        """Over :meth:`pre_rewrite_view`: ``where`` holds (null counts as false)."""
        from pyspark.sql import functions as F

        return F.coalesce(F.expr(self.spec.where), F.lit(False))

    def work_condition(self) -> Column:
        """Over :meth:`pre_rewrite_view`: the row is eligible and a target column is null
        where its expression gives a value, or where (a type change) its old value is set. The
        latter keeps a conversion that loses values (a ``CAST`` that overflows to null) from
        passing for done: the rewrite then fails its check instead, and the old column is never
        dropped."""
        from functools import reduce

        from pyspark.sql import functions as F

        fillable = []
        for name, current, value in self._targets():
            has_value = value.isNotNull()
            if name in self.retired:
                has_value = has_value | F.col(quoted(name)).isNotNull()  # the pre-rewrite column
            fillable.append(current.isNull() & has_value)
        if not fillable:  # a partition-spec-only rewrite converts no values
            return F.lit(False)
        return self.eligible() & reduce(lambda a, b: a | b, fillable)

    def project(self, df: DataFrame, *, work_flag: str | None = None) -> DataFrame:
        """The rows of ``df`` (current schema) in the target shape: in eligible rows each
        target column that is null gets its expression's value (a value already there, e.g.
        written by tiering in the new shape, is kept); every row gets ``_rewrite_version`` =
        the version (unless already higher); every other column is kept as it is. With
        ``work_flag``, a last boolean column of that name tells the rows that changed
        (:meth:`work_condition`)."""
        from pyspark.sql import functions as F

        pre = self.pre_rewrite_view(df).withColumn(_CONVERT, self.eligible())
        eligible = F.col(_CONVERT)
        back = {new: old for old, new in self.retired.items()}
        targets = {name: (current, value) for name, current, value in self._targets()}
        out = []
        for c in self.columns:
            if c in targets:
                current, value = targets[c]
                out.append(F.when(eligible, F.coalesce(current, value)).otherwise(current).alias(c))
            elif c == REWRITE_VERSION_COLUMN:
                marker = F.col(quoted(c))
                settled = marker.isNotNull() & (marker >= F.lit(self.spec.version))
                out.append(F.when(settled, marker).otherwise(F.lit(self.spec.version)).cast("int").alias(c))
            elif c in back:
                out.append(F.col(quoted(back[c])).alias(c))
            else:
                out.append(F.col(quoted(c)))
        if work_flag is not None:
            out.append(self.work_condition().alias(work_flag))
        return pre.select(*out)


def shape_of(table: Table, spec: RewriteSpec, state: RewriteState) -> RewriteShape:
    """The :class:`RewriteShape` of the staged ``table`` (its current schema's top-level
    columns) for ``spec`` and what staging retired (``state``)."""
    return RewriteShape(tuple(f.name for f in table.schema().fields), spec, dict(state.retired))


def validate_expressions(spark: SparkSession, name: str, shape: RewriteShape) -> None:
    """Analyze the spec's expressions against the table (no rows read).

    Raises:
        RewriteSpecError: an expression or ``where`` does not analyze (unknown column, bad
            syntax, a type Spark cannot cast).
    """
    from pyspark.errors import AnalysisException, ParseException

    try:
        shape.project(spark.table(name).limit(0)).schema  # noqa: B018 - analysis only
    except (AnalysisException, ParseException) as e:
        raise RewriteSpecError(name, f"expressions do not analyze against the table: {e}") from e


def validate_before_staging(spark: SparkSession, name: str, spec: RewriteSpec) -> None:
    """Analyze ``where`` and every expression against the table as it is before staging (the
    names they are written against), reading no rows.

    Raises:
        RewriteSpecError: one does not analyze (unknown column, bad syntax, a cast Spark
            refuses).
    """
    from pyspark.errors import AnalysisException, ParseException
    from pyspark.sql import functions as F

    df = spark.table(name).limit(0)
    for what, text in [("where", spec.where)] + [
        (f"columns.{c.name}.expr", f"CAST(({c.expr}) AS {spark_sql_type(c.type)})") for c in spec.columns
    ]:
        try:
            df.select(F.expr(text)).schema  # noqa: B018 - analysis only
        except (AnalysisException, ParseException) as e:
            raise RewriteSpecError(name, f"{what}: {text!r} does not analyze against the table: {e}") from e
