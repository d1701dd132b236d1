"""Checks of a tabular job that look at values: each stops the job (or warns) in one line naming
the file, the row (line) and the column.

They run where the job runs, after the row statistics, which count on every engine what they
look for (``<dense>:non_finite``, the ``list_*`` drop reasons of
:func:`pipelines.tabular.transforms.parse`, the rows dropped by reason), so a job with good
input pays nothing for them; only when a count says there is something to report are the files
read again, one by one, for the first such row:

- :func:`check_values`: a NaN or infinite dense value (``non_finite: error``, the default), a
  list in a single-valued column, a list feature's value joined by another separator than its
  own;
- :func:`dropped_values`: a few of the values that made rows drop (the "no training rows"
  message names them);
- :func:`split_warning`: a column split whose value lists leave out more than
  :data:`SPLIT_DROP_WARNING` of the rows read: one line with the count and the values to list.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import polars as pl

from pipelines.core.errors import IngestError
from pipelines.core.fields import NonFinite, SplitMethod
from pipelines.core.inputs import ROW
from pipelines.core.report import DROP
from pipelines.tabular.read import describe_row, reading, scan_inputs
from pipelines.tabular.spec import IngestSpec
from pipelines.tabular.stats import PassStats
from pipelines.tabular.transforms import (
    LIST_IN_SINGLE, LIST_SEPARATORS, SEPARATOR_MISMATCH, DropReason, parse, time_to_seconds)

SPLIT_DROP_WARNING = 0.10  # a column split dropping more than this share of the rows warns
_RAW = "__raw_value"


def check_values(files: Sequence[Path], spec: IngestSpec, stats: PassStats) -> None:
    """Stops the job at the first list-shaped value in the wrong kind of column, then at the
    first NaN/inf value of a dense feature with ``non_finite: error``.

    Raises:
        IngestError: ``<file>: line N: column C: ...`` (parquet: ``row N``, 0-based).
    """
    dropped = stats.dropped()
    for reason in (LIST_IN_SINGLE, SEPARATOR_MISMATCH):
        if dropped.get(reason):
            codes = [i for i, r in enumerate(stats.reasons) if r.reason == reason]
            path, row, code = _first(files, spec, pl.col(DROP).is_in(codes))
            _raise_list_shape(spec, path, row, stats.reasons[code])
    for i, d in enumerate(spec.dense):
        n = int(stats.total(f"{d.name}:non_finite"))
        if not n or d.non_finite is not NonFinite.ERROR:
            continue
        x = pl.col(d.name)
        path, row, _ = _first(files, spec, pl.col(DROP).is_null() & (x.is_nan() | x.is_infinite()))
        raise IngestError(f"{path}: {describe_row(spec, row, path)}: column {d.name}: value "
                          f"{_value(path, spec, row, d.name)!r} is not finite (NaN or infinite; "
                          f"{n:,} such value(s) in all); fix the input, or set "
                          f"dense[{i}].non_finite: fill to replace them with fill_null "
                          f"({d.fill_null:g}), counted in the report")


def _raise_list_shape(spec: IngestSpec, path: Path, row: int, reason: DropReason) -> None:
    value = str(_value(path, spec, row, reason.column))
    where = f"{path}: {describe_row(spec, row, path)}: column {reason.column}: value {value!r}"
    i, s = next((i, s) for i, s in enumerate(spec.sparse) if s.source == reason.column
                and not s.bucketized and s.multi_hot == (reason.reason == SEPARATOR_MISMATCH))
    others = LIST_SEPARATORS + "".join(f.separator or "" for f in spec.sparse if f.multi_hot)
    sep = next((c for c in value if c in others and c not in (s.separator or "")), ",")
    if reason.reason == LIST_IN_SINGLE:
        fix = (f"set multi_hot: true and separator: {sep!r} to read it as a list"
               if sep != (spec.input.separator or ",") else
               "a list separator may not be the field separator: write the lists with another "
               "(e.g. '|') and set multi_hot: true, separator: '|'")
        raise IngestError(f"{where} is a list ({len(value.split(sep))} values separated by "
                          f"{sep!r}), but feature {s.name} is single-valued (sparse[{i}]: "
                          f"multi_hot: false); {fix}")
    raise IngestError(f"{where} is a list separated by {sep!r}, but feature {s.name} splits on "
                      f"{s.separator!r} (sparse[{i}].separator), so it would be one element; "
                      f"set separator: {sep!r}")


def dropped_values(files: Sequence[Path], spec: IngestSpec, reasons: list[DropReason],
                   reason: str, column: str, n: int = 3) -> list:
    """Up to ``n`` distinct input values of ``column`` in the rows dropped for ``reason``."""
    codes = [i for i, r in enumerate(reasons) if r.reason == reason and r.column == column]
    seen: list = []
    for path in _readable(files, spec):
        with reading([path], spec):
            part = (_parsed(path, spec, column).filter(pl.col(DROP).is_in(codes))
                    .select(_RAW).unique(maintain_order=True).head(n)
                    .collect(engine="streaming")[_RAW].to_list())
        seen += [v for v in part if v not in seen]
        if len(seen) >= n:
            break
    return seen[:n]


def split_warning(files: Sequence[Path], spec: IngestSpec, stats: PassStats) -> Optional[str]:
    """The warning of a column split dropping over :data:`SPLIT_DROP_WARNING` of the rows read
    as ``split_value_not_listed``: the count, the column and the most frequent values missing
    from ``split.values`` (None when it drops fewer)."""
    split = spec.split
    n = stats.dropped().get("split_value_not_listed", 0)
    if split.method is not SplitMethod.COLUMN or n <= SPLIT_DROP_WARNING * stats.rows_read:
        return None
    codes = [i for i, r in enumerate(stats.reasons) if r.reason == "split_value_not_listed"]
    key = pl.col(_RAW).cast(pl.String)
    key = key.str.strip_chars() if spec.is_text else key
    parts = []
    for path in _readable(files, spec):
        with reading([path], spec):
            parts.append(_parsed(path, spec, split.column).filter(pl.col(DROP).is_in(codes))
                         .group_by(key.alias("v")).agg(pl.len().alias("n"))
                         .collect(engine="streaming"))
    counts = pl.concat(parts).group_by("v").agg(pl.col("n").sum()).sort(
        ["n", "v"], descending=[True, False])
    shown = ", ".join(f"{v!r} {c:,}" for v, c in counts.head(5).iter_rows())
    more = f" and {counts.height - 5:,} more" if counts.height > 5 else ""
    where = files[0] if len(files) == 1 else f"{files[0]} (+{len(files) - 1} files)"
    return (f"{where}: split.values: {n:,} of {stats.rows_read:,} rows "
            f"({n / stats.rows_read:.0%}, over {SPLIT_DROP_WARNING:.0%}) dropped as "
            f"split_value_not_listed (column {split.column}); values not listed: {shown}{more}; "
            "list them in split.values.train, .valid or .test to keep their rows")


# --- reading the files again, one by one ---------------------------------------------------------

def _readable(files: Sequence[Path], spec: IngestSpec) -> list[Path]:
    """The files a scan can read alone (a 0-byte text file has no header and no rows)."""
    return [f for f in files if not spec.is_text or f.stat().st_size]


def _parsed(path: Path, spec: IngestSpec, raw: Optional[str] = None) -> pl.LazyFrame:
    """One file's rows parsed (``__row`` from 0 in the file), with the input value of column
    ``raw`` kept beside them as ``__raw_value``."""
    frame = scan_inputs([path], spec)
    if raw is not None:
        frame = frame.with_columns(pl.col(raw).alias(_RAW))
    return parse(time_to_seconds(frame, spec), spec)[0]


def _first(files: Sequence[Path], spec: IngestSpec, condition: pl.Expr
           ) -> tuple[Path, int, int]:
    """``(file, row in it, drop code)`` of the first row where ``condition`` holds."""
    for path in _readable(files, spec):
        with reading([path], spec):
            hit = _parsed(path, spec).filter(condition).select(ROW, DROP).head(1).collect(
                engine="streaming")
        if hit.height:
            code = hit[DROP][0]
            return path, int(hit[ROW][0]), -1 if code is None else int(code)
    raise IngestError(f"{files[0]}: an input changed during the job (a counted value is gone)")


def _value(path: Path, spec: IngestSpec, row: int, column: str):
    """The input value of ``column`` at ``row`` of the file (a list column's as a list)."""
    with reading([path], spec):
        value = scan_inputs([path], spec).filter(pl.col(ROW) == row).select(column).collect(
            engine="streaming").item()
    return value.to_list() if isinstance(value, pl.Series) else value
