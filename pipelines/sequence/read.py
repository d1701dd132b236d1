"""The sequence job's input: event files (CSV or parquet), their checks, the parsed events.

Columns are checked from each file's CSV header or parquet footer (:func:`check_inputs`); a value
that does not parse (an id under ``id_type: integer``, a time that is neither a number nor a
date) stops the job naming the file, line (parquet: 0-based row) and column. Rows with a null
user, item or time are marked with their drop reason and counted (:func:`events`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import polars as pl
import pyarrow as pa

from pipelines.core.encode import time_seconds
from pipelines.core.errors import IngestError
from pipelines.core.fields import InputFormat, ValueType
from pipelines.core.inputs import ROW, check_csv_header, csv_lines, parquet_types, utf8_failure
from pipelines.sequence.spec import SequenceIngestSpec

FILE_INDEX = "__file_index"
FEATURE = "__feature:"  # the prefix of a user feature's column in the parsed events
# drop reasons of an input row, in the order they are tested (a row counts under its first)
NULL_USER, NULL_ITEM, NULL_TIME = "null_user", "null_item", "null_time"
ROW_REASONS = (NULL_USER, NULL_ITEM, NULL_TIME)


def check_inputs(files: Sequence[Path], spec: SequenceIngestSpec) -> dict[str, Any]:
    """Every file holds the user, item and time columns, of usable types (parquet); returns
    the first file's column types (Arrow types; None for CSV). One line naming the file."""
    columns = [spec.user, spec.item, spec.time, *spec.user_features]
    first: Optional[dict[str, Any]] = None
    for path in files:
        if spec.input.format is InputFormat.PARQUET:
            types = parquet_types(path, columns)
            for column, ok, want in (
                    (spec.user, _id_type_ok(spec), _id_want(spec)),
                    (spec.item, _id_type_ok(spec), _id_want(spec)),
                    (spec.time, _time_ok, "numbers, dates or datetimes")):
                if not ok(types[column]):
                    raise IngestError(f"{path}: column {column}: expected {want}, got "
                                      f"{types[column]}")
            schema = {c: types[c] for c in columns}
            for column in spec.user_features:
                t = types[column]
                if not (pa.types.is_integer(t) or pa.types.is_string(t)
                        or pa.types.is_large_string(t) or pa.types.is_dictionary(t)):
                    raise IngestError(f"{path}: column {column}: expected categorical values "
                                      f"(integers or strings), got {t}")
        else:  # an empty file (no header) has no rows: _scan reads it as none
            check_csv_header(path, spec.input.separator, columns)
            schema = {c: None for c in columns}
        first = first or schema
    return first or {c: None for c in columns}


def _id_want(spec: SequenceIngestSpec) -> str:
    return "integer ids (id_type: integer)" if spec.id_type is ValueType.INTEGER else \
        "string or integer ids"


def _id_type_ok(spec: SequenceIngestSpec):
    if spec.id_type is ValueType.INTEGER:
        return pa.types.is_integer
    return lambda t: (pa.types.is_integer(t) or pa.types.is_string(t)
                      or pa.types.is_large_string(t))


def _time_ok(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_temporal(t)


def _scan(path: Path, spec: SequenceIngestSpec) -> pl.LazyFrame:
    columns = [spec.user, spec.item, spec.time, *spec.user_features]
    if spec.input.format is InputFormat.PARQUET:
        frame = pl.scan_parquet(str(path), row_index_name=ROW, extra_columns="ignore")
    elif path.stat().st_size == 0:
        return pl.LazyFrame({ROW: [], **{c: [] for c in columns}},
                            schema={ROW: pl.UInt32, **{c: pl.String for c in columns}})
    else:
        frame = pl.scan_csv(str(path), separator=spec.input.separator or ",", infer_schema=False,
                            null_values=spec.input.null_values or None, row_index_name=ROW,
                            raise_if_empty=False)
    return frame.select(ROW, *columns)


def _id(name: str, spec: SequenceIngestSpec, text: bool) -> pl.Expr:
    col = pl.col(name)
    if spec.id_type is ValueType.INTEGER:
        return col.cast(pl.Int64, strict=False) if text else col.cast(pl.Int64)
    return col.cast(pl.String)


def events(path: Path, index: int, spec: SequenceIngestSpec, schema: dict[str, Any]
           ) -> pl.DataFrame:
    """One file's events: ``__file_index``, ``__row`` (the file's 0-based row), ``user``,
    ``item``, ``time`` (float seconds or the column's numbers), each of ``user_features`` as
    strings (``__feature:<name>``) and ``reason`` (null: kept).

    Raises:
        IngestError: a value that does not parse, naming the file, line/row and column.
    """
    text = spec.input.format is InputFormat.CSV
    raw = _scan(path, spec)
    t = time_seconds(spec.time, text, schema.get(spec.time))
    checks = [(spec.time, pl.col(spec.time).is_not_null() & t.is_null(),
               "cannot parse as a number or a date")]
    if text and spec.id_type is ValueType.INTEGER:
        for name in (spec.user, spec.item):
            checks.insert(0, (name, pl.col(name).is_not_null()
                              & pl.col(name).cast(pl.Int64, strict=False).is_null(),
                              "cannot parse as an integer id (id_type: integer)"))
    parsed = raw.select(
        pl.lit(index, dtype=pl.Int32).alias(FILE_INDEX), pl.col(ROW).cast(pl.Int64),
        _id(spec.user, spec, text).alias("user"), _id(spec.item, spec, text).alias("item"),
        t.cast(pl.Float64).alias("time"),
        *[pl.col(f).cast(pl.String).alias(FEATURE + f) for f in spec.user_features],
        *[bad.alias(f"__bad{i}") for i, (_, bad, _) in enumerate(checks)])
    try:
        frame = parsed.collect()
    except pl.exceptions.PolarsError as e:
        raise utf8_failure([path], e) or IngestError(
            f"{path}: cannot read: {str(e).strip().splitlines()[0]}") from None
    for i, (column, _, problem) in enumerate(checks):
        bad = frame.filter(pl.col(f"__bad{i}"))
        if bad.height:
            row = int(bad[ROW][0])
            value = _scan(path, spec).filter(pl.col(ROW) == row).select(column).collect()
            where = (f"line {csv_lines(path, spec.input.separator, [row])[row]}" if text
                     else f"row {row}")
            raise IngestError(f"{path}: {where}: column {column}: {problem} "
                              f"(value {value[column][0]!r})")
    reason = (pl.when(pl.col("user").is_null()).then(pl.lit(NULL_USER))
              .when(pl.col("item").is_null()).then(pl.lit(NULL_ITEM))
              .when(pl.col("time").is_null() | pl.col("time").is_nan()).then(pl.lit(NULL_TIME))
              .otherwise(pl.lit(None, dtype=pl.String)))
    return frame.select(FILE_INDEX, ROW, "user", "item", "time",
                        *[FEATURE + f for f in spec.user_features], reason.alias("reason"))
