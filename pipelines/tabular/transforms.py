"""Row-wise stages of a tabular ingestion job, as Polars expressions (so they run inside the
streaming engine, one batch at a time): parse, classify rows that must be dropped, split.

- :func:`parse` turns raw columns into typed values and adds ``__drop``: ``null`` for a kept row,
  else the code of the first reason it cannot be kept (:class:`DropReason`, in priority order).
- :func:`assign_split` adds ``__split`` (train/valid/test) from a hash or a time order.

The per-feature repairs and encodings (``dense_output``, ``sparse_output``) are the ones every
family shares, :mod:`pipelines.core.encode`; the statistics they need (vocabularies, means) come
from the statistics pass.

Example:
    >>> frame = assign_split(parse(scan_inputs(files, spec), spec)[0], spec, cutoffs=None)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

import polars as pl

from pipelines.core.encode import RAW_ID_LIMIT, Vocabulary, dense_output, sparse_output
from pipelines.core.fields import Encoding, InputFormat, SparseSpec, SplitMethod, ValueType
from pipelines.core.hashing import splitmix64, string_hash, unit_interval
from pipelines.core.inputs import FILE, ROW
from pipelines.core.output import SPLIT, SPLIT_DTYPE, SPLITS
from pipelines.core.report import DROP, unparsed
from pipelines.tabular.read import FIELDS
from pipelines.tabular.spec import CRITEO_COLUMNS, IngestSpec


LIST_IN_SINGLE, SEPARATOR_MISMATCH = "list_in_single_valued_column", "list_separator_mismatch"
LIST_SEPARATORS = ",;|"  # what joins ids into a list in text, besides the spec's separators


@dataclass(frozen=True)
class DropReason:
    """Why a row was dropped (its code is the value of ``__drop``) and the column that said so.

    Reasons: ``wrong_field_count`` (a Criteo TSV line without its 40 tab-separated fields),
    ``null_label``, ``label_out_of_range`` (not in ``label_range``, [0, 1] by default), ``null_split_key`` (no time or key to
    split by), ``split_value_not_listed`` (a column split's value in none of its lists),
    ``unparsable_value`` (text that is not a number/integer; dense features with ``cast`` and
    bucketized features are repaired instead), ``null_id`` and ``id_out_of_range`` (pre-encoded
    ids), ``raw_id_out_of_range`` (an ``encoding: raw`` integer outside ``[0, 2^63 - 1)``).
    ``column`` is the input column.

    Two reasons are never drops but errors (:mod:`pipelines.tabular.checks` stops the job at
    the first such row): ``list_in_single_valued_column`` (CSV inputs: a single-valued
    feature's value that reads as a list, two or more ids joined by ``,`` ``;`` ``|`` or a
    ``separator`` of the spec, e.g. ``a1,b2``) and ``list_separator_mismatch`` (a ``multi_hot``
    value without its ``separator`` that reads as a list joined by another of them).
    """

    reason: str
    column: str


def label_in_range(spec: IngestSpec, y: pl.Expr) -> pl.Expr:
    """Whether the parsed label ``y`` is finite and within ``spec.label_range``."""
    low, high = spec.label_range or (-math.inf, math.inf)
    return y.is_finite() & (y >= low) & (y <= high)


def parse(frame: pl.LazyFrame, spec: IngestSpec, checks: bool = True, label: bool = True
          ) -> tuple[pl.LazyFrame, list[DropReason]]:
    """Parses raw columns in place and adds the ``__drop`` code (UInt16, null when kept).

    Text values that do not parse (``"abc"`` in a number column) become a drop reason, never a
    silent null. List columns of text inputs are split on their separator; empty elements
    (``"a,,b"``) are skipped, and so are null elements of parquet lists.

    Args:
        frame: from :func:`pipelines.tabular.read.scan_inputs`.
        spec: the job's spec.
        checks: test the values for the reasons that stop the job (lists in the wrong kind of
            column); a pass after the row statistics, which found none, leaves them out (same
            codes, no cost).
        label: parse the label and drop the rows without a usable one; serving
            (:mod:`pipelines.tabular.serve`) scores rows whose label is unknown, and leaves it
            alone (the frame may lack it).

    Returns:
        ``(frame, reasons)``: ``reasons[code]`` explains each ``__drop`` code.
    """
    text = spec.is_text
    schema = frame.collect_schema()
    # parsed columns are keyed by output name; each is computed from its input column
    parsed: dict[str, pl.Expr] = {spec.label: number(spec.label, text)} if label else {}
    source: dict[str, str] = {spec.label: spec.label}
    for d in spec.dense:
        as_text = text or (d.cast is not None and schema[d.name] == pl.String)
        parsed[d.name], source[d.name] = number(d.name, as_text), d.name
    for s in spec.sparse:
        parsed[s.name] = (number(s.source, text) if s.bucketized else _categorical(s, text))
        source[s.name] = s.source
    if spec.split.column is not None and spec.split.column not in parsed:
        parsed[spec.split.column] = _split_key(spec, text)
        source[spec.split.column] = spec.split.column
    tmp = {name: f"__p:{name}" for name in parsed}
    exprs = [expr.alias(tmp[name]) for name, expr in parsed.items()]
    # dense features with cast: values that do not parse become nulls (filled, counted)
    # and so do bucketized features' (bucket 0, counted)
    lenient = [d.name for d in spec.dense if d.cast is not None]
    lenient += [f.name for f in spec.sparse if f.bucketized and text]
    exprs += [(pl.col(source[n]).is_not_null() & parsed[n].is_null()).alias(unparsed(n))
              for n in lenient]
    frame = frame.with_columns(exprs)

    def p(name: str) -> pl.Expr:
        return pl.col(tmp[name])

    def unparsable(name: str) -> pl.Expr:
        return pl.col(source[name]).is_not_null() & p(name).is_null()

    conditions: list[tuple[pl.Expr, DropReason]] = []
    if spec.input.format is InputFormat.CRITEO_TSV:  # before anything read from its fields
        conditions.append((pl.col(FIELDS) != len(CRITEO_COLUMNS),
                           DropReason("wrong_field_count", FIELDS)))
    if spec.input.format is InputFormat.CSV:  # criteo_tsv: tokens by the format's definition
        conditions += _list_shape_conditions(spec, checks)
    if label:
        conditions.append((pl.col(spec.label).is_null(),
                           DropReason("null_label", spec.label)))
        if text:
            conditions.append((unparsable(spec.label),
                               DropReason("unparsable_value", spec.label)))
        conditions.append((~label_in_range(spec, p(spec.label)),
                           DropReason("label_out_of_range", spec.label)))
    if spec.split.column is not None:
        conditions.append((pl.col(spec.split.column).is_null(),
                           DropReason("null_split_key", spec.split.column)))
        if (text and spec.split.method is SplitMethod.TIME
                and spec.split.column not in spec.source_columns):
            conditions.append((unparsable(spec.split.column),
                               DropReason("unparsable_value", spec.split.column)))
        if spec.split.method is SplitMethod.COLUMN:
            listed = [v for values in (spec.split.values or {}).values() for v in values]
            key = _split_text(spec, text)
            conditions.append((~key.is_in(pl.lit(listed, dtype=pl.List(pl.String)).explode()),
                               DropReason("split_value_not_listed", spec.split.column)))
    if text:
        conditions += [(unparsable(d.name), DropReason("unparsable_value", d.name))
                       for d in spec.dense if d.cast is None]
    for s in spec.sparse:
        if text and s.dtype is ValueType.INTEGER:
            bad = (p(s.name).list.eval(pl.element().is_null()).list.any() if s.multi_hot
                   else unparsable(s.name))
            if s.encoding is Encoding.RAW and not s.multi_hot:  # blank is null (id 0) for raw
                bad = bad & (pl.col(s.source).str.strip_chars() != "")
            conditions.append((bad, DropReason("unparsable_value", s.source)))
        if s.encoding is Encoding.RAW and s.dtype is ValueType.INTEGER:
            low, high = (p(s.name).list.min(), p(s.name).list.max()) if s.multi_hot else (
                p(s.name), p(s.name))
            conditions.append(((low < 0) | (high >= RAW_ID_LIMIT),
                               DropReason("raw_id_out_of_range", s.source)))
        if s.encoding is Encoding.PRE_ENCODED:
            if not s.multi_hot:
                conditions.append((p(s.name).is_null(), DropReason("null_id", s.source)))
            low, high = (p(s.name).list.min(), p(s.name).list.max()) if s.multi_hot else (
                p(s.name), p(s.name))
            conditions.append(((low < 0) | (high >= s.num_embeddings),
                               DropReason("id_out_of_range", s.source)))
    code = pl.lit(None, dtype=pl.UInt16)
    if conditions:
        chain = pl.when(conditions[0][0]).then(pl.lit(0, dtype=pl.UInt16))
        for i, (cond, _) in enumerate(conditions[1:], start=1):
            chain = chain.when(cond).then(pl.lit(i, dtype=pl.UInt16))
        code = chain.otherwise(pl.lit(None, dtype=pl.UInt16))
    frame = frame.with_columns(code.alias(DROP))
    frame = frame.drop(list(tmp), strict=False).rename({v: k for k, v in tmp.items()})
    return frame, [reason for _, reason in conditions]


def feature_columns(spec: IngestSpec, vocabs: dict[str, Vocabulary],
                    dense_stats: dict[str, dict], boundaries: dict[str, list[float]]
                    ) -> list[pl.Expr]:
    """The encoded feature columns of parsed rows, dense then sparse: what the job writes
    (with the training split's ``vocabs``, ``dense_stats`` and bucket ``boundaries``) and what
    serving scores (:mod:`pipelines.tabular.serve`, the same constants from ``metadata.json``)."""
    columns = [dense_output(d, dense_stats[d.name]["mean"], dense_stats[d.name]["std"])
               for d in spec.dense]
    return columns + [sparse_output(s, vocabs.get(s.name), boundaries.get(s.name))
                      for s in spec.sparse]


def list_like(x: pl.Expr, separators: str) -> pl.Expr:
    """Text that reads as two or more ids (letters, digits, ``_.+-``) joined by one of
    ``separators``, nothing else: ``a1,b2``, ``3|7``; not ``Smith, John`` or ``1.5``."""
    if not separators:
        return pl.lit(False)
    ids, seps = r"[\w.+-]+", "[" + "".join(re.escape(c) for c in separators) + "]"
    return x.str.contains(f"^{ids}(?:{seps}{ids})+$")


def _list_shape_conditions(spec: IngestSpec, checks: bool = True
                           ) -> list[tuple[pl.Expr, DropReason]]:
    """CSV inputs: a single-valued feature holding lists, a list feature holding lists joined by
    another separator than its own (each stops the job; never a silent category). Without
    ``checks`` the same reasons, never true."""
    declared = "".join(s.separator for s in spec.sparse
                       if s.multi_hot and s.separator and len(s.separator) == 1)
    known = "".join(dict.fromkeys(LIST_SEPARATORS + declared))
    out: list[tuple[pl.Expr, DropReason]] = []
    for s in spec.sparse:
        if s.bucketized:
            continue
        col = pl.col(s.source)
        if not s.multi_hot:
            bad = list_like(col, known) if checks else pl.lit(False)
            out.append((bad, DropReason(LIST_IN_SINGLE, s.source)))
        elif s.separator:
            others = "".join(c for c in known if c not in s.separator)
            bad = (~col.str.contains(s.separator, literal=True) & list_like(col, others)
                   if checks else pl.lit(False))
            out.append((bad, DropReason(SEPARATOR_MISMATCH, s.source)))
    return out


def _split_text(spec: IngestSpec, text: bool) -> pl.Expr:
    """A column split's key as text, as its listed values are written."""
    col = pl.col(spec.split.column).cast(pl.String)
    return col.str.strip_chars() if text else col


def time_value(spec: IngestSpec) -> pl.Expr:
    """The time a time split orders rows by: the split column, or the row's input position."""
    if spec.split.column is not None:
        return pl.col(spec.split.column).cast(pl.Float64)
    return pl.col(ROW).cast(pl.Float64)


def assign_split(frame: pl.LazyFrame, spec: IngestSpec, cutoffs: Optional[tuple[float, float]],
                 files: Optional[dict[str, str]] = None) -> pl.LazyFrame:
    """Adds ``__split``.

    Hash splits: ``u = unit_interval(hash)`` of the key column's text (so one user's rows share a
    split), or of the row's position in the input without one; ``u < test_fraction`` is test, the
    next ``valid_fraction`` valid, the rest train. Time splits: ``time < cutoffs[0]`` is train,
    ``< cutoffs[1]`` valid, the rest test. Column splits: the split whose ``values`` list the
    column's text. File splits: ``files[path]`` (:func:`file_splits`), train if absent.

    Args:
        frame: from :func:`parse`.
        spec: the job's spec.
        cutoffs: ``(valid_start, test_start)`` for a time split, else ignored.
        files: input path -> split for a file split, else ignored.
    """
    split = spec.split
    if split.method is SplitMethod.COLUMN:
        # the split column is the raw column here unless a feature of that name parsed it
        key = pl.col(split.column).cast(pl.String)
        if spec.is_text:
            key = key.str.strip_chars()
        name = pl.lit(None, dtype=pl.String)
        for part in reversed(SPLITS):
            values = (split.values or {}).get(part)
            if values:
                name = pl.when(key.is_in(pl.lit(values, dtype=pl.List(pl.String)).explode())
                               ).then(pl.lit(part)).otherwise(name)
        name = name.fill_null(pl.lit("train"))  # rows in no list are dropped (__drop) anyway
    elif split.method is SplitMethod.FILES:
        assert files is not None
        name = pl.col(FILE).replace_strict(list(files), list(files.values()),
                                           default=pl.lit("train"), return_dtype=pl.String)
    elif split.method is SplitMethod.TIME:
        assert cutoffs is not None
        t = time_value(spec)
        name = pl.when(t < cutoffs[0]).then(pl.lit("train")).when(t < cutoffs[1]).then(
            pl.lit("valid")).otherwise(pl.lit("test"))
    else:
        if split.column is not None:
            h = string_hash(pl.col(split.column).cast(pl.String), split.hash_seed)
        else:
            h = splitmix64(pl.col(ROW), split.hash_seed)
        u = unit_interval(h)
        name = pl.when(u < split.test_fraction).then(pl.lit("test")).when(
            u < split.test_fraction + split.valid_fraction).then(pl.lit("valid")).otherwise(
            pl.lit("train"))
    return frame.with_columns(name.cast(SPLIT_DTYPE).alias(SPLIT))


def _raw_integer(x: pl.Expr) -> pl.Expr:
    """A parquet integer (any width, signed or not) as Int64; a value beyond int64 (uint64 from
    2^63) becomes ``RAW_ID_LIMIT``, so that parse drops it as out of range, never as null."""
    n = x.cast(pl.Int64, strict=False)
    return pl.when(x.is_not_null() & n.is_null()).then(pl.lit(RAW_ID_LIMIT, pl.Int64)).otherwise(n)


def _parse_integer(x: pl.Expr, raw: bool) -> pl.Expr:
    """Integer text as Int64, null when it does not parse. Raw features: integer text beyond
    int64 becomes ``RAW_ID_LIMIT`` (out of range, not unparsable), and blank text null (id 0)."""
    t = x.str.strip_chars()
    n = t.cast(pl.Int64, strict=False)
    if not raw:
        return n
    too_long = n.is_null() & t.str.contains(r"^[+-]?[0-9]+$")
    return pl.when(too_long).then(pl.lit(RAW_ID_LIMIT, pl.Int64)).otherwise(n)


def number(name: str, text: bool) -> pl.Expr:
    """A label or dense column as Float64 (text: stripped, null where it does not parse)."""
    col = pl.col(name)
    return col.str.strip_chars().cast(pl.Float64, strict=False) if text else col.cast(pl.Float64)


def _categorical(s: SparseSpec, text: bool) -> pl.Expr:
    """A categorical column's parsed values. Raw features: empty strings are null (id 0; skipped
    in lists, as null elements are), parquet integers of any width become Int64."""
    col = pl.col(s.source)
    integer = s.dtype is ValueType.INTEGER
    raw = s.encoding is Encoding.RAW
    if not text:
        if not raw:
            return col.list.drop_nulls() if s.multi_hot else col
        if integer:
            return (col.list.drop_nulls().list.eval(_raw_integer(pl.element())) if s.multi_hot
                    else _raw_integer(col))
        return (col.list.eval(pl.element().filter(pl.element() != "")) if s.multi_hot
                else pl.when(col != "").then(col))
    if s.multi_hot:
        items = col.str.split(s.separator).list.eval(pl.element().filter(pl.element() != ""))
        if integer:
            if raw:  # blank elements are skipped, as empty ones are
                items = items.list.eval(pl.element().filter(pl.element().str.strip_chars() != ""))
            items = items.list.eval(_parse_integer(pl.element(), raw))
        return items
    if integer:
        return _parse_integer(col, raw)
    return pl.when(col != "").then(col) if raw else col


def _split_key(spec: IngestSpec, text: bool) -> pl.Expr:
    col = pl.col(spec.split.column)
    if spec.split.method in (SplitMethod.HASH, SplitMethod.COLUMN):
        return col.cast(pl.String)
    if text:
        return col.str.strip_chars().cast(pl.Float64, strict=False)
    return col  # numeric or temporal, converted below once its type is known


def time_to_seconds(frame: pl.LazyFrame, spec: IngestSpec) -> pl.LazyFrame:
    """Date/datetime split columns of parquet inputs become Unix seconds (Float64)."""
    column = spec.split.column
    if (spec.split.method is not SplitMethod.TIME or column is None
            or spec.input.format is not InputFormat.PARQUET):
        return frame
    dtype = frame.collect_schema()[column]
    if dtype.is_temporal():
        return frame.with_columns(pl.col(column).dt.epoch("s").cast(pl.Float64))
    return frame.with_columns(pl.col(column).cast(pl.Float64))
