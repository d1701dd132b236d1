"""Tabular input files: checking each file cheaply, scanning them lazily.

Paths and globs are resolved by :func:`pipelines.core.inputs.resolve_inputs`, which also holds
the footer and header checks every family shares. Every file is checked before any row is
processed, from what can be read without scanning it (a parquet footer, a CSV header line, the
first line of a Criteo TSV), so that a missing column, a wrong type or a truncated parquet file
fails at once with the file's name.

:func:`scan_inputs` returns one Polars ``LazyFrame`` over all files, a single multi-file scan (never
read into memory here), each row tagged with ``__row``, its 0-based position in the whole input,
for split keys and row-order splits. One scan, not one per file concatenated: Polars starts every
scan of a concatenation at once and each buffers ~250 MB ahead (2.2 GB for 8 files of 300 MB,
against 0.4 GB as one scan). The row number is Polars' 32-bit row index, so one job reads at most
2**32 - 1 rows (:func:`check_row_limit`); Criteo 1TB (4.4e9 rows) takes two jobs or Polars' 64-bit
index runtime (``polars[rt64]``). An engine that reads a shard per file (Ray) checks and numbers
each file on its own (int64 offsets). :func:`reading` turns a Polars read failure into one line
naming the file.

Example:
    >>> files = resolve_inputs(["data/raw/*.tsv"], spec)
    >>> check_inputs(files, spec)
    >>> scan_inputs(files, spec).select(pl.len()).collect(engine="streaming")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Iterator, Optional, Sequence

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from embedtrain.utils import first_line
from pipelines.core.errors import IngestError
from pipelines.core.fields import Encoding, InputFormat, SplitMethod, ValueType
from pipelines.core.inputs import (
    FILE, ROW, check_csv_header, csv_lines, parquet_types, utf8_failure, value_type)
from pipelines.tabular.spec import CRITEO_COLUMNS, IngestSpec, SparseSpec

FIELDS = "__fields"  # Criteo TSV: tab-separated fields of the line (a wrong count is dropped)
MAX_ROWS = 2**32 - 1  # Polars' row index is 32-bit (IdxSize) in the default runtime
_MIN_TSV_ROW_BYTES = 40  # a Criteo line is at least 39 tabs and a newline


def input_columns(spec: IngestSpec, label: bool = True, keep: Sequence[str] = ()) -> list[str]:
    """The raw columns the job reads: label, dense, sparse, then a split column if it is extra.

    Serving (:mod:`pipelines.tabular.serve`) reads rows that may lack the label (``label``
    False) and may ask for more columns (``keep``: carried to the output as they are)."""
    columns = [c for c in spec.source_columns if label or c != spec.label]
    if spec.split.column is not None and spec.split.column not in columns:
        columns.append(spec.split.column)
    return columns + [c for c in keep if c not in columns]


def check_inputs(files: Sequence[Path], spec: IngestSpec, label: bool = True,
                 keep: Sequence[str] = ()) -> IngestSpec:
    """Checks every file's layout (columns present, types) from its footer or first line, and
    resolves each sparse feature's ``dtype`` left out of the spec from the input's types.

    ``label`` and ``keep``: the columns read, as for :func:`input_columns`.

    Returns:
        The spec with every sparse ``dtype`` set (parquet: the Arrow type of the first file;
        CSV: Polars' type inferred from the first rows of the first file with rows, Int64 meaning
        integer; Criteo TSV: string).

    Raises:
        IngestError: ``<file>: ...`` for the first bad file.
    """
    resolved: dict[str, tuple[ValueType, Path]] = {}
    first_header: Optional[list[str]] = None
    for path in files:
        if spec.input.format is InputFormat.PARQUET:
            _check_parquet(path, spec, resolved, label, keep)
        elif spec.input.format is InputFormat.CSV:
            header = check_csv_header(path, spec.input.separator,
                                      input_columns(spec, label, keep))
            if header is not None and first_header is not None and header != first_header:
                # one multi-file scan reads every file with the first one's columns
                raise IngestError(f"{path}: header differs from {files[0]}'s; files of one job "
                                  "must share their columns and their order")
            if header is not None and not resolved:
                resolved = _infer_csv_types(path, spec)
            first_header = first_header or header
        else:
            _check_criteo_line(path, spec)
    sparse = []
    for s in spec.sparse:
        if s.dtype is None and not s.bucketized:
            dtype = resolved[s.name][0] if s.name in resolved else ValueType.STRING
            s = dataclasses.replace(s, dtype=dtype)
        if s.encoding is Encoding.PRE_ENCODED and s.dtype is not ValueType.INTEGER:
            where = resolved[s.name][1] if s.name in resolved else files[0]
            raise IngestError(f"{where}: column {s.source}: holds text, but pre_encoded ids "
                              "must be integers (encoding: vocab or hash encodes text)")
        sparse.append(s)
    return dataclasses.replace(spec, sparse=sparse)


def check_row_limit(files: Sequence[Path], spec: IngestSpec) -> None:
    """Refuses inputs of more than :data:`MAX_ROWS` rows before Polars' row index overflows.

    Parquet footers give row counts for free; text inputs are counted (one fast pass) only when
    their size allows that many rows (over ~170 GB of Criteo TSV).

    Raises:
        IngestError: naming the input and the limit.
    """
    if spec.input.format is InputFormat.PARQUET:
        rows = sum(pq.read_metadata(f).num_rows for f in files)
    elif sum(f.stat().st_size for f in files) > MAX_ROWS * _MIN_TSV_ROW_BYTES:
        frame = (pl.scan_lines([str(f) for f in files])
                 if spec.input.format is InputFormat.CRITEO_TSV else scan_inputs(files, spec))
        rows = frame.select(pl.len()).collect(engine="streaming").item()
    else:
        return
    if rows > MAX_ROWS:
        raise IngestError(f"{files[0]}: {len(files)} input file(s) hold {rows:,} rows, over the "
                          f"{MAX_ROWS:,} one job can number; ingest the files in several jobs or "
                          "install Polars' 64-bit index runtime (polars[rt64])")


def scan_inputs(files: Sequence[Path], spec: IngestSpec,
                wrong_fields: Optional[pl.DataFrame] = None, label: bool = True,
                keep: Sequence[str] = ()) -> pl.LazyFrame:
    """One lazy frame over all files: ``__row`` and :func:`input_columns` (of ``label`` and
    ``keep``), in file order.

    Criteo TSV inputs also give ``__fields``, the line's field count (from ``wrong_fields``,
    :func:`criteo_field_counts` of the same files, computed here when not given). Text inputs
    give every column as String (parsing, and counting what fails to parse, is the
    next stage's job); parquet inputs give label/dense as Float64 and categorical values as String
    or Int64 (or lists of them); a date/datetime split column is left for the split stage.
    """
    columns = input_columns(spec, label)
    kept = [c for c in input_columns(spec, label, keep) if c not in columns]  # as they are
    paths = [str(f) for f in files]
    by_file = spec.split.method is SplitMethod.FILES
    extra = [FILE] if by_file else []
    files_kw = {"include_file_paths": FILE} if by_file else {}
    if spec.input.format is InputFormat.PARQUET:
        frame = pl.scan_parquet(
            paths, row_index_name=ROW, extra_columns="ignore", **files_kw,
            # files may differ in widths (int32 here, int64 there): the parse stage casts anyway
            cast_options=pl.ScanCastOptions(integer_cast="upcast", float_cast="upcast"))
        return frame.select(ROW, *(_parquet_column(c, spec) for c in columns), *kept, *extra)
    if spec.input.format is InputFormat.CRITEO_TSV:
        if wrong_fields is None:
            wrong_fields = criteo_field_counts(files)
        return _scan_criteo(paths, columns + kept, spec.input.null_values, wrong_fields,
                            files_kw)
    frame = pl.scan_csv(
        paths,
        has_header=True,
        separator=spec.input.separator or ",",
        infer_schema=False,  # all String: parse failures are counted, not guessed around
        quote_char='"',
        null_values=spec.input.null_values or None,
        row_index_name=ROW,
        raise_if_empty=False,
        **files_kw,
    )
    return frame.select(ROW, *columns, *kept, *extra)


def criteo_field_counts(files: Sequence[Path]) -> pl.DataFrame:
    """``(__row, __fields)`` of every Criteo TSV line without its 40 tab-separated fields.

    One fast pass over the lines (a tab count each, no parsing); it numbers lines exactly as the
    CSV scan numbers rows (an empty line is a row of both), so the parse stage can drop and
    count each such line, which the CSV scan alone would pad with nulls or stop the job on.
    """
    tabs = pl.col("line").str.count_matches("\t", literal=True)
    return (pl.scan_lines([str(f) for f in files], row_index_name=ROW)
            .filter(tabs != len(CRITEO_COLUMNS) - 1)
            .select(ROW, (tabs + 1).cast(pl.UInt32).alias(FIELDS))
            .collect(engine="streaming"))


def _scan_criteo(paths: list[str], columns: list[str], null_values: list[str],
                 wrong_fields: pl.DataFrame, files_kw: Optional[dict] = None) -> pl.LazyFrame:
    """Criteo TSV through Polars' CSV reader (fast), with each line's field count in ``FIELDS``.

    Ragged lines are read leniently (a short one padded with nulls, a long one cut) so that one
    of them never stops the job; ``wrong_fields`` (:func:`criteo_field_counts`) gives their true
    counts, and the parse stage drops them (``wrong_field_count``).
    """
    frame = pl.scan_csv(
        paths, has_header=False, separator="\t",
        schema={c: pl.String for c in CRITEO_COLUMNS},
        infer_schema=False,  # all String: parse failures are counted, not guessed around
        quote_char=None, null_values=null_values or None, row_index_name=ROW,
        raise_if_empty=False, truncate_ragged_lines=True, **(files_kw or {}))
    fields = pl.lit(len(CRITEO_COLUMNS), dtype=pl.UInt32)
    if wrong_fields.height:
        fields = pl.col(ROW).replace_strict(wrong_fields[ROW], wrong_fields[FIELDS],
                                            default=fields, return_dtype=pl.UInt32)
    return frame.select(ROW, fields.alias(FIELDS), *columns, *([FILE] if files_kw else []))


def describe_row(spec: IngestSpec, row: int, path: Optional[Path] = None) -> str:
    """How a user finds a row in a file: a 1-based line for text, a 0-based row for parquet.
    With the CSV file's ``path``, the line counts the line breaks inside quoted fields before
    the row (:func:`pipelines.core.inputs.csv_lines`)."""
    if spec.input.format is InputFormat.PARQUET:
        return f"row {row}"
    if spec.input.format is InputFormat.CSV:
        line = csv_lines(path, spec.input.separator, [row])[row] if path else row + 2
        return f"line {line}"
    return f"line {row + 1}"


def _parquet_column(name: str, spec: IngestSpec) -> pl.Expr:
    col = pl.col(name)
    # a column read by a categorical feature takes its type; numbers are cast from it later
    sparse = {s.source: s for s in reversed(spec.sparse) if not s.bucketized}
    readers = [s for s in spec.sparse if s.source == name and not s.bucketized]
    if readers and all(s.encoding is Encoding.RAW and s.dtype is ValueType.INTEGER
                       for s in readers):
        return col  # raw integers keep their width: parse casts them, and drops uint64 >= 2^63
    if name in sparse:
        inner = pl.Int64 if sparse[name].dtype is ValueType.INTEGER else pl.String
        return col.cast(pl.List(inner) if sparse[name].multi_hot else inner)
    if name == spec.split.column and name not in spec.source_columns:
        return col  # converted by the split stage, which knows the method
    if any(d.name == name and d.cast is not None for d in spec.dense):
        return col  # numbers or strings: the parse stage parses strings
    return col.cast(pl.Float64)


# --- per-file checks -----------------------------------------------------------------------------

def _check_parquet(path: Path, spec: IngestSpec, resolved: dict[str, tuple[ValueType, Path]],
                   label: bool = True, keep: Sequence[str] = ()) -> None:
    types = parquet_types(path, input_columns(spec, label, keep))
    def numeric(t: pa.DataType) -> bool:
        return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)

    cast = {d.name for d in spec.dense if d.cast is not None}
    for name in [spec.label] * label + [d.name for d in spec.dense]:
        t = types[name]
        if name in cast and value_type(t) is ValueType.STRING:
            continue
        if not numeric(t):
            hint = ("; numbers stored as strings: set cast: float on the dense feature"
                    if value_type(t) is ValueType.STRING and name != spec.label else "")
            raise IngestError(f"{path}: column {name}: expected numbers, got {t}{hint}")
    for s in spec.sparse:
        t = types[s.source]
        if s.bucketized:
            if not numeric(t):
                raise IngestError(f"{path}: column {s.source}: feature {s.name} bucketizes "
                                  f"numbers, got {t}")
            continue
        is_list = pa.types.is_list(t) or pa.types.is_large_list(t)
        if is_list != s.multi_hot:
            want = "a list column (multi_hot: true)" if s.multi_hot else "single values"
            raise IngestError(f"{path}: column {s.source}: expected {want}, got {t}")
        inner = t.value_type if is_list else t
        if pa.types.is_uint64(inner) and s.encoding is not Encoding.RAW:
            _refuse_wide_uint64(path, s)  # raw ids drop (and count) what int64 cannot hold
        held = value_type(inner)
        if held is None:
            hint = ("; to use numbers as a categorical feature, bucketize them "
                    "(bucketize: [...] or quantiles: N)" if numeric(inner) else "")
            raise IngestError(f"{path}: column {s.source}: categorical values must be integers "
                              f"or strings, got {t}{hint}")
        if s.dtype is not None and held is not s.dtype:
            raise IngestError(f"{path}: column {s.source} holds {t}, spec says dtype: "
                              f"{s.dtype.value}; remove dtype to use the file's type, or set "
                              f"dtype: {held.value}")
        if s.dtype is None:
            first = resolved.setdefault(s.name, (held, path))
            if first[0] is not held:
                raise IngestError(f"{path}: column {s.source} holds {t}, but {first[1]} holds "
                                  f"{first[0].value} values; files of one job must agree "
                                  "(or set dtype on the feature)")
    column = spec.split.column
    if column is not None and column not in spec.source_columns:
        t = types[column]
        ok = pa.types.is_integer(t) or pa.types.is_floating(t)
        if spec.split.method is SplitMethod.TIME:
            ok = ok or pa.types.is_temporal(t)
        else:
            ok = ok or pa.types.is_string(t) or pa.types.is_large_string(t)
        if not ok:
            raise IngestError(f"{path}: column {column}: unsupported type {t} for a "
                              f"{spec.split.method.value} split")


INFER_ROWS = 10_000  # CSV rows whose values decide a categorical column's type


def _infer_csv_types(path: Path, spec: IngestSpec) -> dict[str, tuple[ValueType, Path]]:
    """Sparse features without ``dtype``: integer if the first rows' non-null values (list
    elements) all parse as integers, else string. A later value that does not parse is dropped
    and counted (``unparsable_value``), as for an explicit ``dtype: integer``."""
    todo = [s for s in spec.sparse if s.dtype is None and not s.bucketized]
    if not todo:
        return {}
    try:
        head = pl.read_csv(path, separator=spec.input.separator or ",", infer_schema=False,
                           n_rows=INFER_ROWS, quote_char='"',
                           null_values=spec.input.null_values or None,
                           columns=sorted({s.source for s in todo}))
    except pl.exceptions.PolarsError as e:
        raise utf8_failure([path], e) or IngestError(
            f"{path}: cannot read the first rows: {first_line(e)}") from None
    out: dict[str, tuple[ValueType, Path]] = {}
    for s in todo:
        v = head[s.source]
        if s.multi_hot:
            v = v.str.split(s.separator).explode()
            v = v.filter(v != "")
        v = v.drop_nulls().str.strip_chars()
        ints = v.cast(pl.Int64, strict=False)
        integer = len(v) > 0 and ints.null_count() == 0
        if not integer and len(v) and v.str.contains(r"^[+-]?\d+$").all():
            _refuse_wide_integer(path, spec, s, head[s.source])
        out[s.name] = (ValueType.INTEGER if integer else ValueType.STRING, path)
    return out


def _refuse_wide_integer(path: Path, spec: IngestSpec, s: SparseSpec, column: pl.Series) -> None:
    """A column of integers one of which does not fit int64 would silently become a column of
    text (another vocabulary, other ids at serving): the user says which it is."""
    for row, cell in enumerate(column):
        for value in (cell.split(s.separator) if s.multi_hot and cell else [cell or ""]):
            value = value.strip()
            if value and not -2**63 <= int(value) < 2**63:
                raise IngestError(
                    f"{path}: {describe_row(spec, row, path)}: column {s.source}: integer "
                    f"{value} does not fit int64 ids; set dtype: string on feature {s.name} to "
                    "encode the column as text, or dtype: integer to drop such rows (counted)")


def _refuse_wide_uint64(path: Path, s: SparseSpec) -> None:
    """uint64 ids above int64's range: the row of the first, or nothing if there is none (the
    footer's statistics say so without a read when the writer kept them)."""
    meta = pq.read_metadata(path)
    leaves = [j for j in range(meta.num_columns)
              if meta.schema.column(j).path.split(".")[0] == s.source]
    stats = [meta.row_group(i).column(j).statistics
             for i in range(meta.num_row_groups) for j in leaves]
    if all(st is not None and st.has_min_max and st.max < 2**63 for st in stats):
        return
    column = pq.read_table(path, columns=[s.source]).column(s.source)
    is_list = pa.types.is_list(column.type) or pa.types.is_large_list(column.type)
    ids = pc.list_flatten(column) if is_list else column
    wide = pc.greater(ids, pa.scalar(2**63 - 1, pa.uint64()))
    if not pc.any(wide).as_py():
        return
    at = pc.index(wide, True).as_py()
    row = pc.list_parent_indices(column)[at].as_py() if is_list else at
    raise IngestError(f"{path}: row {row}: column {s.source}: uint64 id {ids[at].as_py()} does "
                      "not fit int64 ids; write the column as strings (vocab and hash encode "
                      f"text), or set encoding: raw on feature {s.name} (drops and counts such "
                      "rows)")


def _check_criteo_line(path: Path, spec: IngestSpec, lines: int = 5) -> None:
    """Refuses a file none of whose first ``lines`` lines has Criteo's 40 fields (not Criteo TSV
    at all); single malformed lines are the parse stage's to drop and count."""
    counts = []
    with open(path, "rb") as f:
        for _ in range(lines):
            line = f.readline(1 << 20)
            if not line:
                break
            counts.append(line.rstrip(b"\r\n").count(b"\t") + 1)
    if counts and len(CRITEO_COLUMNS) not in counts:
        raise IngestError(f"{path}: not Criteo TSV: line 1 has {counts[0]} tab-separated "
                          f"fields, and none of the first {len(counts)} line(s) has the "
                          f"{len(CRITEO_COLUMNS)} criteo_tsv expects (label, I1..I13, C1..C26)")


@contextlib.contextmanager
def reading(files: Sequence[Path], spec: IngestSpec) -> Iterator[None]:
    """Turns a Polars read failure (a malformed line, a corrupt page) into a one-line error
    naming the file that causes it."""
    try:
        yield
    except pl.exceptions.PolarsError as e:
        raise _locate_failure(files, spec, e) from None


def _locate_failure(files: Sequence[Path], spec: IngestSpec, error: Exception) -> IngestError:
    if spec.is_text:  # a 0-byte file has no rows (and a scan of it alone fails): never the one
        files = [f for f in files if f.stat().st_size] or list(files)
        utf8 = utf8_failure(files, error)  # the file and line of the byte, by a cheap scan
        if utf8 is not None:
            return utf8
    if len(files) > 1:  # the error does not say which file: read them one by one to find out
        for path in files:
            try:
                scan_inputs([path], spec).select(pl.all().null_count()).collect(engine="streaming")
            except pl.exceptions.PolarsError as e:
                return _ragged(path, spec, e) or IngestError(f"{path}: cannot read: {first_line(e)}")
    where = files[0] if len(files) == 1 else files[0].parent
    return (len(files) == 1 and _ragged(files[0], spec, error)
            or IngestError(f"{where}: cannot read: {first_line(error)}"))


def _ragged(path: Path, spec: IngestSpec, error: Exception) -> Optional[IngestError]:
    """For a CSV read that failed on a line with more fields than the header: that line (Python's
    csv module, as Polars splits: only on the failure path)."""
    if spec.input.format is not InputFormat.CSV or "more fields" not in str(error):
        return None
    import csv

    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        rows = csv.reader(f, delimiter=spec.input.separator or ",", quotechar='"')
        header = len(next(rows, []))
        for row in rows:
            if len(row) > header:
                return IngestError(f"{path}: line {rows.line_num}: {len(row)} fields, the header "
                                   f"has {header}; quote fields that hold the separator "
                                   f"{spec.input.separator or ','!r}")
    return None
