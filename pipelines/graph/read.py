"""The graph job's inputs: edge files and a node table, their checks, the parsed frames.

Columns are checked from each file's CSV header or parquet footer; a value that does not parse
(an id under ``id_type: integer``, a weight, a timestamp, a feature) stops the job naming the
file, line/row and column; rows with a null endpoint, an invalid weight (null, NaN, infinite or
<= 0) or an unselected edge type are marked with their drop reason (:func:`edge_frame`). The
node table is read whole (:func:`read_node_table`): null ids dropped and counted, a repeated id
an error, null feature values 0 and null labels -1, both counted.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from embedtrain.utils import first_line, natural_key
from pipelines.core.errors import IngestError
from pipelines.core.fields import InputFormat, ValueType
from pipelines.core.encode import time_seconds
from pipelines.core.inputs import csv_header, utf8_failure
from pipelines.graph.spec import (
    EXTENSIONS, EdgeTableSpec, GraphIngestSpec, NodeTableSpec, SplitMethod)
from pipelines.graph.splits import NodeTable, check_parquet_type

ROW, FILE_ROW = "__row", "__file_row"
# edge drop reasons, in the order they are tested (a row counts under its first reason)
NULL_ENDPOINT, INVALID_WEIGHT, TYPE_NOT_SELECTED, NOT_IN_NODE_TABLE = (
    "null_endpoint", "invalid_weight", "edge_type_not_selected", "endpoint_not_in_node_table")


# --- inputs --------------------------------------------------------------------------------------

def resolve_inputs(patterns: Sequence[str | os.PathLike], fmt: InputFormat) -> list[Path]:
    files: list[Path] = []
    for pattern in map(str, patterns):
        path = Path(pattern)
        if path.is_dir():
            found = [p for p in path.iterdir() if p.is_file() and p.name.endswith(EXTENSIONS[fmt])]
            what = f"no {'/'.join(EXTENSIONS[fmt])} files in the directory"
        elif glob.has_magic(pattern):
            found = [Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file()]
            what = "no input files match"
        else:
            found, what = ([path] if path.is_file() else []), "input file not found"
        if not found:
            raise IngestError(f"{pattern}: {what}")
        files.extend(p for p in sorted(found, key=natural_key) if p not in files)
    return files


def _schema(path: Path, table: EdgeTableSpec | NodeTableSpec) -> dict[str, Any]:
    """Column name -> type (Arrow type for parquet, None for CSV) from a footer or header."""
    if table.format is InputFormat.PARQUET:
        try:
            return {f.name: f.type for f in pq.read_schema(path)}
        except (pa.ArrowException, OSError) as e:
            raise IngestError(f"{path}: not a readable parquet file: {first_line(e)}") from None
    if path.stat().st_size == 0:
        raise IngestError(f"{path}: empty file (no CSV header)")
    csv_header(path, table.separator)  # not UTF-8, or a column named twice: one line
    try:
        names = pl.scan_csv(path, separator=table.separator or ",", infer_schema=False,
                            n_rows=0).collect_schema().names()
    except pl.exceptions.PolarsError as e:
        raise IngestError(f"{path}: cannot read the CSV header: {first_line(e)}") from None
    return {n: None for n in names}


def _check_columns(files: Sequence[Path], table: EdgeTableSpec | NodeTableSpec,
                   columns: Sequence[str]) -> dict[str, Any]:
    first: Optional[dict[str, Any]] = None
    for path in files:
        schema = _schema(path, table)
        missing = [c for c in columns if c not in schema]
        if missing:
            raise IngestError(f"{path}: missing column(s) {', '.join(missing)} "
                              f"(has: {', '.join(list(schema)[:20])})")
        first = first or schema
    return first or {}


def _scan(files: Sequence[Path], table: EdgeTableSpec | NodeTableSpec,
          columns: Sequence[str]) -> pl.LazyFrame:
    paths = [str(f) for f in files]
    if table.format is InputFormat.PARQUET:
        frame = pl.scan_parquet(paths, row_index_name=ROW, extra_columns="ignore")
    else:
        frame = pl.scan_csv(paths, separator=table.separator or ",", infer_schema=False,
                            null_values=table.null_values or None, row_index_name=ROW,
                            raise_if_empty=False)
    return frame.select(ROW, *columns)


def _where(table: EdgeTableSpec | NodeTableSpec, row: int) -> str:
    return f"row {row}" if table.format is InputFormat.PARQUET else f"line {row + 2}"


def _raise_first(files: Sequence[Path], table: EdgeTableSpec | NodeTableSpec,
                 columns: Sequence[str], bad: pl.Expr, column: str, problem: str) -> None:
    """Finds the first row where ``bad`` holds, file by file, and raises naming it."""
    for path in files:
        hit = _scan([path], table, columns).filter(bad).select(ROW, column).head(1).collect()
        if hit.height:
            raise IngestError(f"{path}: {_where(table, int(hit[ROW][0]))}: column {column}: "
                              f"{problem} (value {hit[column][0]!r})")
    raise IngestError(f"{files[0]}: column {column}: {problem}")  # not reached


def _check_parsing(raw: pl.LazyFrame, files: Sequence[Path], table: EdgeTableSpec | NodeTableSpec,
                   columns: Sequence[str], checks: list[tuple[str, pl.Expr, str]]) -> None:
    """One pass counting unparsable values per check; the first failing check is located."""
    if not checks:
        return
    found = raw.select(bad.sum().alias(str(i)) for i, (_, bad, _) in enumerate(checks)).collect(
        engine="streaming").row(0)
    for (column, bad, problem), n in zip(checks, found):
        if n:
            _raise_first(files, table, columns, bad, column, problem)


def _id_expr(name: str, spec: GraphIngestSpec, arrow_type: Any) -> pl.Expr:
    col = pl.col(name)
    if spec.id_type is ValueType.INTEGER:
        return col.cast(pl.Int64, strict=False) if arrow_type is None else col.cast(pl.Int64)
    return col.cast(pl.String)


@dataclass
class Edges:
    """Parsed edge columns as lazy expressions, with what makes a row unusable."""

    frame: pl.LazyFrame          # ROW, src, dst, [weight], [time], reason (null = kept)
    reasons: list[str]


def edge_frame(spec: GraphIngestSpec, files: Sequence[Path], offset: Optional[int] = None,
               check: bool = True) -> Edges:
    """The edges parsed, ``__row`` numbered from ``offset`` (the rows before ``files``; None:
    ``files`` are all the edge files). ``check``: first the types in parquet footers and one
    pass counting values that do not parse (the first one located: an IngestError); a later
    pass over the same files leaves it out."""
    e = spec.edges
    columns = [c for c in (e.src, e.dst, e.weight, e.edge_type, e.timestamp) if c is not None]
    schema = _check_columns(files, e, columns)
    text = e.format is InputFormat.CSV
    if not text and check:
        for path in files:
            types = {f.name: f.type for f in pq.read_schema(path)}
            if spec.id_type is ValueType.INTEGER:
                check_parquet_type(path, e.src, types[e.src], "integer")
                check_parquet_type(path, e.dst, types[e.dst], "integer")
            if e.weight:
                check_parquet_type(path, e.weight, types[e.weight], "number")
            if e.timestamp:
                check_parquet_type(path, e.timestamp, types[e.timestamp], "time")
    raw = _scan(files, e, columns)
    # parse failures: a value present in the input that does not convert
    checks: list[tuple[str, pl.Expr, str]] = []
    row = pl.col(ROW) if offset is None else (pl.col(ROW).cast(pl.Int64) + offset).alias(ROW)
    exprs = [row, _id_expr(e.src, spec, schema[e.src]).alias("src"),
             _id_expr(e.dst, spec, schema[e.dst]).alias("dst")]
    if text and spec.id_type is ValueType.INTEGER:
        for name in (e.src, e.dst):
            checks.append((name, pl.col(name).is_not_null()
                           & pl.col(name).cast(pl.Int64, strict=False).is_null(),
                           "cannot parse as an integer id (id_type: integer)"))
    if e.weight:
        w = pl.col(e.weight).cast(pl.Float64, strict=False)
        exprs.append(w.alias("weight"))
        if text:
            checks.append((e.weight, pl.col(e.weight).is_not_null() & w.is_null(),
                           "cannot parse as a number"))
    if e.timestamp:
        t = time_seconds(e.timestamp, text, schema[e.timestamp])
        exprs.append(t.alias("time"))
        checks.append((e.timestamp, pl.col(e.timestamp).is_not_null() & t.is_null(),
                       "cannot parse as a number or a date"))
    if e.edge_type:
        exprs.append(pl.col(e.edge_type).cast(pl.String).alias("edge_type"))
    if check:
        _check_parsing(raw, files, e, columns, checks)
    parsed = raw.select(exprs)
    reason = pl.when(pl.col("src").is_null() | pl.col("dst").is_null()).then(pl.lit(NULL_ENDPOINT))
    reasons = [NULL_ENDPOINT]
    if e.weight:
        w = pl.col("weight")
        reason = reason.when(w.is_null() | w.is_nan() | w.is_infinite() | (w <= 0)).then(
            pl.lit(INVALID_WEIGHT))
        reasons.append(INVALID_WEIGHT)
    if e.edge_types is not None:
        reason = reason.when(~pl.col("edge_type").is_in(e.edge_types).fill_null(False)).then(
            pl.lit(TYPE_NOT_SELECTED))
        reasons.append(TYPE_NOT_SELECTED)
    return Edges(parsed.with_columns(reason.otherwise(pl.lit(None)).alias("reason")), reasons)


def read_node_table(spec: GraphIngestSpec, files: list[Path]) -> NodeTable:
    n = spec.nodes
    assert n is not None
    split_column = spec.split.column if spec.split.method is SplitMethod.COLUMN else None
    columns = [n.id, *n.features, *([n.label] if n.label else []),
               *([split_column] if split_column else [])]
    schema = _check_columns(files, n, columns)
    text = n.format is InputFormat.CSV
    list_column = (len(n.features) == 1 and not text and schema[n.features[0]] is not None
                   and (pa.types.is_list(schema[n.features[0]])
                        or pa.types.is_large_list(schema[n.features[0]])
                        or pa.types.is_fixed_size_list(schema[n.features[0]])))
    if not text:
        for path in files:
            types = {f.name: f.type for f in pq.read_schema(path)}
            if spec.id_type is ValueType.INTEGER:
                check_parquet_type(path, n.id, types[n.id], "integer")
            for c in n.features:
                t = types[c].value_type if list_column else types[c]
                check_parquet_type(path, c, t, "number")
            if split_column and pa.types.is_nested(types[split_column]):
                raise IngestError(f"{path}: column {split_column} (split.column): expected "
                                  f"plain values naming the split, got {types[split_column]}")
    raw = _scan(files, n, columns)
    if text:
        checks = []
        for c in ([n.id] if spec.id_type is ValueType.INTEGER else []) + list(n.features):
            kind = pl.Int64 if c == n.id else pl.Float64
            bad = pl.col(c).is_not_null() & pl.col(c).cast(kind, strict=False).is_null()
            checks.append((c, bad,
                           "cannot parse as " + ("an integer id (id_type: integer)" if c == n.id
                                                 else "a number")))
        _check_parsing(raw, files, n, columns, checks)
    table = raw.with_columns(_id_expr(n.id, spec, schema[n.id]).alias("__id")).collect(
        engine="streaming")
    rows_read = table.height
    null_ids = int(table["__id"].null_count())
    table = table.filter(pl.col("__id").is_not_null())
    dup = table.filter(pl.col("__id").is_duplicated()).head(1)
    if dup.height:
        first, again = table.filter(pl.col("__id") == dup["__id"][0])[ROW].head(2).to_list()
        if len(files) == 1:
            where = f"{files[0]}: {_where(n, first)} and {_where(n, again)}"
        else:  # row numbers count through the files in order
            where = f"{files[0]} (+{len(files) - 1} files): rows {first} and {again}"
        raise IngestError(f"{where}: column {n.id}: id {dup[n.id][0]!r} appears more than once; "
                          "node ids must be unique")
    features, filled = None, {}
    if list_column:
        c = n.features[0]
        lengths = table[c].list.len()
        widths = lengths.filter(table[c].is_not_null()).unique()
        if widths.len() > 1:
            bad = table.filter(lengths != widths[0]).head(1)
            raise IngestError(f"{files[0]}: column {c}: row {int(bad[ROW][0])}: list of "
                              f"{int(bad[c].list.len()[0])} values, others have {widths[0]}")
        width = int(widths[0]) if widths.len() else 0
        nulls = int(table[c].null_count())
        inner_nulls = int(table[c].explode().null_count()) - nulls
        if nulls or inner_nulls:
            filled[c] = nulls + inner_nulls
        values = table.select(pl.col(c).list.eval(pl.element().cast(pl.Float64).fill_null(0.0))
                              .fill_null([0.0] * width))[c]
        features = np.asarray(values.explode().to_numpy(), dtype=np.float32).reshape(-1, width)
    elif n.features:
        cast = table.select(pl.col(c).cast(pl.Float64, strict=False) for c in n.features)
        filled = {c: int(cast[c].null_count()) for c in n.features if cast[c].null_count()}
        features = cast.fill_null(0.0).to_numpy().astype(np.float32)
    labels, classes, unlabelled = None, [], 0
    if n.label:
        values = table[n.label]
        if text:  # integers when every label parses as one
            as_int = values.cast(pl.Int64, strict=False)
            if as_int.null_count() == values.null_count():
                values = as_int
        unlabelled = int(values.null_count())
        classes_series = values.drop_nulls().unique().sort()
        classes = classes_series.to_list()
        lookup = pl.DataFrame({"v": classes_series, "k": np.arange(len(classes), dtype=np.int64)})
        labels = (pl.DataFrame({"v": values}).join(lookup, on="v", how="left",
                                                   maintain_order="left")["k"]
                  .fill_null(-1).to_numpy().astype(np.int64))
    split_values = table[split_column].cast(pl.String) if split_column else None
    return NodeTable(ids=table["__id"], features=features, labels=labels, classes=classes,
                      rows_read=rows_read, null_ids=null_ids, filled=filled,
                      unlabelled=unlabelled, split_values=split_values)


def locate_failure(spec: GraphIngestSpec, edge_files: Sequence[Path], node_files: Sequence[Path],
                   error: Exception) -> IngestError:
    """The one-line error for a Polars read failure: the first file that does not read."""
    tables: list[tuple[Path, Any]] = [(f, spec.edges) for f in edge_files]
    tables += [(f, spec.nodes) for f in node_files] if spec.nodes is not None else []
    utf8 = utf8_failure([f for f, t in tables if t.format is InputFormat.CSV], error)
    if utf8 is not None:  # the file and line of the byte, found by a cheap scan
        return utf8
    for path, table in tables:  # the error does not say which file: read them one by one
        try:
            frame = (pl.scan_parquet(path) if table.format is InputFormat.PARQUET else
                     pl.scan_csv(path, separator=table.separator or ",", infer_schema=False))
            frame.select(pl.all().null_count()).collect(engine="streaming")
        except pl.exceptions.PolarsError as e:
            return IngestError(f"{path}: cannot read: {first_line(e)}")
    return IngestError(f"{edge_files[0]}: cannot read: {first_line(error)}")

