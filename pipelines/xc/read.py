"""Inputs of an XC ingestion job: files, headers and column types, and the parse stage.

Everything is checked before any row is processed, from what can be read without scanning a
file (an Extreme Classification Repository header line, a parquet footer, a CSV header), so a
garbled header or a missing column fails at once, in one line naming the file.

:func:`parse_xc` returns one Polars ``LazyFrame`` over all files (a single multi-file scan, never
read into memory here) with, per row: ``__row`` (its 0-based position in the whole input; for
``xc_repository`` the line's, header lines included), ``__file``, the raw tokens (a list, in the
column named like the output token column), the row's distinct raw labels (``__labels``) and how
many it gave (``__labels_given``), parsed dense columns, and ``__drop``: null for a row that may
be kept, else the code of the first reason it cannot (a :class:`DropReason`;
:data:`REPOSITORY_REASONS`). Whether a row keeps a label is decided later, once the label
vocabulary is known (``no_label``, :mod:`pipelines.xc.passes`).

Serving (:mod:`pipelines.xc.serve`) reads the same way rows that may lack the label column
(``label=False``: every row without labels) and carries more input columns (``keep``: as read,
named ``KEEP_PREFIX + name``).

An ``xc_repository`` line is parsed with vectorised string expressions on a frame of lines
(:func:`polars.scan_lines`): the label field is the first whitespace-separated field when it holds
no ``:`` (a line starting with whitespace, or with a feature, has no labels), the features are the
other fields.

Example:
    >>> files = resolve_xc_inputs(["train.txt"], spec)
    >>> layout = check_xc_inputs(files, spec)
    >>> frame, reasons = parse_xc(files, spec, layout)  # doctest: +SKIP
"""

from __future__ import annotations

import fnmatch
import glob
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

import polars as pl
import pyarrow as pa

from embedtrain.utils import natural_key
from pipelines.core.errors import IngestError
from pipelines.core.fields import Cast, Encoding, InputFormat, SplitMethod, ValueType
from pipelines.core.inputs import (
    FILE,
    KEEP_PREFIX,
    ROW,
    check_csv_header,
    parquet_types,
    resolve_inputs,
    value_type,
)
from pipelines.core.report import DROP, unparsed
from pipelines.xc.spec import WHITESPACE, XCFormat, XCIngestSpec

LABELS, LABELS_GIVEN, VALUES = "__labels", "__labels_given", "__values"
_EXTENSIONS = {XCFormat.XC_REPOSITORY: InputFormat.CRITEO_TSV,  # .tsv/.txt
               XCFormat.CSV: InputFormat.CSV, XCFormat.PARQUET: InputFormat.PARQUET}

# Drop reasons in priority order (a row counts under its first); ``no_label`` comes last of all.
REPOSITORY_REASONS = (
    "empty_line",               # nothing on the line
    "header_line",              # three integers and nothing else: a header inside the file
    "unparsable_label",         # a label that is not an integer ("a", "1.5", "1,,2")
    "label_out_of_range",       # a label id outside [0, num_labels) of the header
    "feature_without_colon",    # a feature field that is not id:value
    "unparsable_feature_id",    # id of id:value not an integer
    "unparsable_feature_value",  # value of id:value not a number
    "feature_out_of_range",     # a feature id outside [0, num_features) of the header
)
NO_LABEL = "no_label"  # no label given (an empty or null list), or none left in the vocabulary
# the "column" of a repository line's drop reason: the whole line, its label field, its features
_REPOSITORY_FIELDS = {"empty_line": "line", "header_line": "line", "unparsable_label": "labels",
                      "label_out_of_range": "labels"}


@dataclass(frozen=True)
class DropReason:
    """Why a row is dropped (the code in ``__drop`` indexes a list of these) and where: the
    input column (tables), or ``line``, ``labels`` or ``features`` (a repository line's field)."""

    reason: str
    column: str


@dataclass(frozen=True)
class RepositoryHeader:
    """Line 1 of an Extreme Classification Repository file."""

    rows: int
    features: int
    labels: int


@dataclass
class XCLayout:
    """What the inputs hold, resolved from the spec and the files' headers/schemas.

    Tokens come from a parquet list column (``token_list``) or from text split on
    ``tokens.separator``; labels from a parquet list column (``label_list``), text split on
    ``labels.separator``, or one value per row. Text is parsed into integers when the dtype is
    ``integer``; list and single-valued parquet columns already hold their dtype.
    """

    token_dtype: ValueType = ValueType.INTEGER
    token_list: bool = True
    label_dtype: ValueType = ValueType.INTEGER
    label_list: bool = True
    multi_label: bool = True
    headers: dict[str, RepositoryHeader] = field(default_factory=dict)  # xc_repository, by file


def resolve_xc_inputs(patterns: Sequence[str], spec: XCIngestSpec) -> list[Path]:
    """``--input`` files (paths, directories, globs), then the files of ``split.files`` globs
    that match none of them (globs relative to the working directory).

    Raises:
        IngestError: a pattern matching no file.
    """
    # resolve_inputs reads only spec.input.format (a directory's file extensions)
    files = resolve_inputs(patterns, SimpleNamespace(
        input=SimpleNamespace(format=_EXTENSIONS[spec.input.format])))
    if spec.split.resolved_method is SplitMethod.FILES:
        for split, pattern in (spec.split.files or {}).items():
            if any(_matches(f, pattern) for f in files):
                continue
            found = sorted((Path(p) for p in glob.glob(pattern, recursive=True)
                            if Path(p).is_file()), key=natural_key)
            if not found:
                raise IngestError(f"{pattern}: split.files.{split}: matches no --input file and "
                                  "no file (relative to the working directory)")
            files.extend(p for p in found if p not in files)
    return files


def _matches(path: Path, pattern: str) -> bool:
    return fnmatch.fnmatch(str(path), pattern) or fnmatch.fnmatch(path.name, pattern)


# --- checks --------------------------------------------------------------------------------------

def read_header(path: Path) -> RepositoryHeader:
    """Line 1 of an Extreme Classification Repository file: ``num_rows num_features num_labels``.

    Raises:
        IngestError: ``<file>: line 1: ...`` for an empty file or a header that is not three
            integers (rows >= 0, features >= 1, labels >= 2).
    """
    with open(path, "rb") as f:
        raw = f.readline(1 << 16)
    want = "expected the header 'num_rows num_features num_labels' (format: xc_repository)"
    if not raw.strip():
        what = "empty file" if not raw else "empty line"
        raise IngestError(f"{path}: line 1: {want}, got an {what}")
    text = raw.decode("utf-8", errors="replace").strip()
    parts = text.split()
    shown = text if len(text) <= 60 else text[:57] + "..."
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise IngestError(f"{path}: line 1: {want}, got {shown!r}")
    rows, features, labels = map(int, parts)
    if features < 1 or labels < 2:
        raise IngestError(f"{path}: line 1: header {shown!r} gives {features} feature(s) and "
                          f"{labels} label(s); XC needs at least 1 feature and 2 labels")
    return RepositoryHeader(rows, features, labels)


def check_xc_inputs(files: Sequence[Path], spec: XCIngestSpec, label: bool = True,
                    keep: Sequence[str] = ()) -> XCLayout:
    """Checks every file's header (xc_repository), footer (parquet) or header line (CSV) and
    resolves the token and label types.

    ``label`` and ``keep`` (tables): the columns read, as for :func:`input_columns`; without the
    label, a list column of nulls (:func:`scan_xc`) and a placeholder ``multi_label``.

    Raises:
        IngestError: ``<file>: ...`` for the first bad file.
    """
    if spec.repository:
        headers = {str(f): read_header(f) for f in files}
        first = headers[str(files[0])]
        for f in files[1:]:
            h = headers[str(f)]
            if (h.features, h.labels) != (first.features, first.labels):
                raise IngestError(f"{f}: line 1: header gives {h.features:,} features and "
                                  f"{h.labels:,} labels, {files[0]} gives {first.features:,} "
                                  f"and {first.labels:,}; the files of one job share them")
        return XCLayout(headers=headers)
    if spec.input.format is XCFormat.PARQUET:
        layouts = [(f, _parquet_layout(f, spec, label, keep)) for f in files]
        for f, layout in layouts[1:]:
            if layout != layouts[0][1]:
                raise IngestError(f"{f}: token/label column types differ from {files[0]}'s; "
                                  "files of one job must agree")
        return layouts[0][1]
    header: Optional[list[str]] = None
    for f in files:
        names = check_csv_header(f, spec.input.separator, input_columns(spec, label, keep))
        if names is None:
            raise IngestError(f"{f}: empty file (0 bytes: no CSV header, no rows); remove it "
                              "from --input")
        if names is not None and header is not None and names != header:
            raise IngestError(f"{f}: header differs from {files[0]}'s; files of one job must "
                              "share their columns and their order")
        header = header or names
    return XCLayout(token_dtype=_text_dtype(spec.tokens.dtype, spec.token_encoding),
                    token_list=False,
                    label_dtype=_text_dtype(spec.labels.dtype, spec.label_encoding),
                    label_list=not label, multi_label=spec.labels.separator is not None)


def _text_dtype(dtype: Optional[ValueType], encoding: Encoding) -> ValueType:
    """Text values are strings unless ``dtype`` says otherwise or the ids are pre-encoded."""
    if dtype is not None:
        return dtype
    return ValueType.INTEGER if encoding is Encoding.PRE_ENCODED else ValueType.STRING


def input_columns(spec: XCIngestSpec, label: bool = True, keep: Sequence[str] = ()
                  ) -> list[str]:
    """The columns a table job reads: tokens, labels, dense, the split key; serving reads rows
    that may lack the labels (``label`` False) and may ask for more columns (``keep``)."""
    columns = [spec.tokens.source, *[spec.labels.source] * label, *(d.name for d in spec.dense)]
    if spec.split.column is not None and spec.split.column not in columns:
        columns.append(spec.split.column)
    return columns + [c for c in keep if c not in columns]


def _parquet_layout(path: Path, spec: XCIngestSpec, label: bool = True,
                    keep: Sequence[str] = ()) -> XCLayout:
    types = parquet_types(path, input_columns(spec, label, keep))
    kinds = []
    for what, sub, encoding in (("tokens", spec.tokens, spec.token_encoding),
                                ("labels", spec.labels, spec.label_encoding)):
        if what == "labels" and not label:  # a list column of nulls (scan_xc)
            kinds.append((_text_dtype(sub.dtype, encoding), True, True))
            continue
        t = types[sub.source]
        is_list = pa.types.is_list(t) or pa.types.is_large_list(t)
        held = value_type(t.value_type if is_list else t)
        if held is None:
            raise IngestError(f"{path}: column {sub.source}: {what} must be integers or strings "
                              f"(or lists of them), got {t}")
        if is_list and sub.separator is not None:
            raise IngestError(f"{path}: column {sub.source} is a list column ({t}); remove "
                              f"{what}.separator")
        if not is_list and what == "tokens" and sub.separator is None:
            raise IngestError(f"{path}: column {sub.source} holds one value per row ({t}); a "
                              "token bag is a list column, or text split on tokens.separator "
                              "(' ' splits on whitespace)")
        split = not is_list and sub.separator is not None
        if split and held is not ValueType.STRING:
            raise IngestError(f"{path}: column {sub.source}: {what}.separator splits text, "
                              f"got {t}")
        if split:
            dtype = _text_dtype(sub.dtype, encoding)
        else:
            if sub.dtype is not None and sub.dtype is not held:
                raise IngestError(f"{path}: column {sub.source} holds {t}, spec says dtype: "
                                  f"{sub.dtype.value}; remove {what}.dtype to use the file's "
                                  f"type, or set dtype: {held.value}")
            dtype = held
        if encoding is Encoding.PRE_ENCODED and dtype is not ValueType.INTEGER:
            raise IngestError(f"{path}: column {sub.source}: holds text, but pre_encoded ids "
                              f"must be integers ({what}.encoding: vocab encodes text)")
        kinds.append((dtype, is_list, is_list or split))
    cast = {d.name for d in spec.dense if d.cast is Cast.FLOAT}
    for d in spec.dense:
        t = types[d.name]
        numeric = pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
        if not numeric and not (d.name in cast and value_type(t) is ValueType.STRING):
            hint = ("; numbers stored as strings: set cast: float on the dense feature"
                    if value_type(t) is ValueType.STRING else "")
            raise IngestError(f"{path}: column {d.name}: expected numbers, got {t}{hint}")
    return XCLayout(token_dtype=kinds[0][0], token_list=kinds[0][1], label_dtype=kinds[1][0],
                    label_list=kinds[1][1], multi_label=kinds[1][2])


# --- parse ---------------------------------------------------------------------------------------

def scan_xc(files: Sequence[Path], spec: XCIngestSpec, label: bool = True,
            keep: Sequence[str] = ()) -> pl.LazyFrame:
    """The raw multi-file scan: ``__row``, ``__file`` and the line (xc_repository) or the
    :func:`input_columns` (as read: CSV all text); without ``label``, a label column of nulls
    (``list<str>``: no label on any row); the ``keep`` columns as read, named
    ``KEEP_PREFIX + name``."""
    paths = [str(f) for f in files]
    if spec.repository:
        return pl.scan_lines(paths, row_index_name=ROW, include_file_paths=FILE)
    if spec.input.format is XCFormat.PARQUET:
        frame = pl.scan_parquet(paths, row_index_name=ROW, include_file_paths=FILE,
                                extra_columns="ignore",
                                cast_options=pl.ScanCastOptions(integer_cast="upcast",
                                                                float_cast="upcast"))
    else:
        frame = pl.scan_csv(paths, has_header=True, separator=spec.input.separator or ",",
                            infer_schema=False, quote_char='"',
                            null_values=spec.input.null_values or None, row_index_name=ROW,
                            raise_if_empty=False, include_file_paths=FILE)
    labels = [] if label else [pl.lit(None, dtype=pl.List(pl.String)).alias(spec.labels.source)]
    return frame.select(ROW, FILE, *input_columns(spec, label), *labels,
                        *(pl.col(c).alias(KEEP_PREFIX + c) for c in keep))


def parse_xc(files: Sequence[Path], spec: XCIngestSpec, layout: XCLayout,
             first_rows: Optional[dict[str, int]] = None, offset: Optional[int] = None,
             label: bool = True, keep: Sequence[str] = ()
             ) -> tuple[pl.LazyFrame, list[DropReason]]:
    """The parsed frame (see the module docstring) and the reason of each ``__drop`` code.

    Args:
        files: the inputs, in order.
        spec: the job's spec.
        layout: from :func:`check_xc_inputs`.
        first_rows: xc_repository: each file's first ``__row`` (its header line, left out).
        offset: the rows (lines) before ``files`` in the whole input, added to ``__row``
            (int64); None: ``files`` are the whole input.
        label, keep: tables, serving: as for :func:`scan_xc`.
    """
    raw = scan_xc(files, spec, label, keep)
    if offset is not None:
        raw = raw.with_columns((pl.col(ROW).cast(pl.Int64) + offset).alias(ROW))
    if spec.repository:
        assert first_rows is not None
        frame, conditions = _parse_repository(raw, spec, layout, first_rows)
    else:
        frame, conditions = _parse_table(raw, spec, layout)
    code = pl.lit(None, dtype=pl.UInt16)
    for i, (cond, _) in reversed(list(enumerate(conditions))):
        code = pl.when(cond).then(pl.lit(i, dtype=pl.UInt16)).otherwise(code)
    return frame.with_columns(code.alias(DROP)), [r for _, r in conditions]


def _parse_repository(lines: pl.LazyFrame, spec: XCIngestSpec, layout: XCLayout,
                      first_rows: dict[str, int]) -> tuple[pl.LazyFrame, list]:
    header = next(iter(layout.headers.values()))
    first = pl.col(FILE).replace_strict(list(first_rows), list(first_rows.values()),
                                        return_dtype=pl.Int64)
    lines = lines.filter(pl.col(ROW).cast(pl.Int64) != first)  # the header lines
    line = pl.col("line").str.strip_chars_end()
    # labels: a first field without ':' ("" when the line starts with whitespace or a feature)
    label_field = r"^([^\s:]*)(?:\s|$)"
    labels_text = line.str.extract(label_field, 1).fill_null("")
    features = (line.str.replace(label_field, "").str.replace_all(r"\s+", " ").str.split(" ")
                .list.eval(pl.element().filter(pl.element() != "")))
    labels = pl.when(labels_text == "").then(pl.lit([], dtype=pl.List(pl.String))).otherwise(
        labels_text.str.split(",")).list.eval(pl.element().cast(pl.Int64, strict=False))
    frame = lines.with_columns(line.alias("__line"), labels.alias("__ids"),
                               features.alias("__features"))
    f = pl.col("__features")
    frame = frame.with_columns(
        f.list.eval(pl.element().str.extract(r"^([^:]*):", 1).cast(pl.Int64, strict=False))
        .alias("__feature_ids"),
        f.list.eval(pl.element().str.extract(r"^[^:]*:(.*)$", 1).cast(pl.Float64, strict=False))
        .alias(VALUES))
    ids, fids = pl.col("__ids"), pl.col("__feature_ids")

    def any_(lst: pl.Expr, cond: pl.Expr) -> pl.Expr:
        return lst.list.eval(cond).list.any()

    conditions = [
        (pl.col("__line") == "", "empty_line"),
        (pl.col("__line").str.contains(r"^\d+\s+\d+\s+\d+$"), "header_line"),
        (any_(ids, pl.element().is_null()), "unparsable_label"),
        ((ids.list.min() < 0) | (ids.list.max() >= header.labels), "label_out_of_range"),
        (any_(f, ~pl.element().str.contains(":", literal=True)), "feature_without_colon"),
        (any_(fids, pl.element().is_null()), "unparsable_feature_id"),
        (any_(pl.col(VALUES), pl.element().is_null()), "unparsable_feature_value"),
        ((fids.list.min() < 0) | (fids.list.max() >= header.features), "feature_out_of_range"),
    ]
    assert [r for _, r in conditions] == list(REPOSITORY_REASONS)
    conditions = [(c, DropReason(r, _REPOSITORY_FIELDS.get(r, "features")))
                  for c, r in conditions]
    frame = frame.with_columns(
        fids.list.eval(pl.element() + 1).alias(spec.tokens.name),  # id 0: the unknown bucket
        ids.list.unique().alias(LABELS), ids.list.len().alias(LABELS_GIVEN))
    return frame, conditions


def _parse_table(frame: pl.LazyFrame, spec: XCIngestSpec, layout: XCLayout
                 ) -> tuple[pl.LazyFrame, list]:
    t, lab = spec.tokens, spec.labels
    schema = frame.collect_schema()
    tokens = _bag(pl.col(t.source), layout.token_dtype, layout.token_list, t.separator)
    parse_tokens = not layout.token_list and layout.token_dtype is ValueType.INTEGER
    if t.lowercase and layout.token_dtype is ValueType.STRING:
        tokens = tokens.list.eval(pl.element().str.to_lowercase())
    label_text = not layout.label_list and schema[lab.source] == pl.String
    labels = _bag(pl.col(lab.source), layout.label_dtype, layout.label_list, lab.separator,
                  single=not layout.multi_label, text=label_text)
    parse_labels = label_text and layout.label_dtype is ValueType.INTEGER
    if parse_tokens:
        tokens = tokens.list.eval(pl.element().cast(pl.Int64, strict=False))
    if parse_labels:
        labels = labels.list.eval(pl.element().cast(pl.Int64, strict=False))
    columns = [tokens.alias(t.name), labels.alias("__ids")]
    bad: dict[str, pl.Expr] = {}
    for d in spec.dense:  # parsed in place; what did not parse is marked beside it
        col = pl.col(d.name)
        as_text = schema[d.name] == pl.String
        number = col.str.strip_chars().cast(pl.Float64, strict=False) if as_text else col.cast(
            pl.Float64)
        columns.append(number.alias(d.name))
        if as_text:
            columns.append((col.is_not_null() & number.is_null()).alias(unparsed(d.name)))
            bad[d.name] = pl.col(unparsed(d.name))
    frame = frame.with_columns(columns)
    toks, ids = pl.col(t.name), pl.col(LABELS)  # the distinct labels: same checks, fewer ids
    conditions: list[tuple[pl.Expr, DropReason]] = []
    if spec.split.column is not None:
        conditions.append((pl.col(spec.split.column).is_null(),
                           DropReason("null_split_key", spec.split.column)))
    if parse_tokens:
        conditions.append((toks.list.eval(pl.element().is_null()).list.any(),
                           DropReason("unparsable_token", t.source)))
    if spec.token_encoding is Encoding.PRE_ENCODED:
        conditions.append(((toks.list.min() < 0) | (toks.list.max() >= t.num_embeddings),
                           DropReason("token_out_of_range", t.source)))
    if parse_labels:
        conditions.append((ids.list.eval(pl.element().is_null()).list.any(),
                           DropReason("unparsable_label", lab.source)))
    if spec.label_encoding is Encoding.PRE_ENCODED:
        conditions.append(((ids.list.min() < 0) | (ids.list.max() >= lab.num_classes),
                           DropReason("label_out_of_range", lab.source)))
    # a dense value that does not parse drops its row, unless cast: float repairs it (counted)
    conditions += [(bad[d.name], DropReason("unparsable_value", d.name)) for d in spec.dense
                   if d.name in bad and d.cast is not Cast.FLOAT]
    given = pl.col("__ids")
    frame = frame.with_columns(given.list.unique().alias(LABELS),
                               given.list.len().alias(LABELS_GIVEN))
    return frame.drop("__ids"), conditions


def _bag(col: pl.Expr, dtype: ValueType, is_list: bool, separator: Optional[str],
         single: bool = False, text: bool = True) -> pl.Expr:
    """A row's values as a list: a list column without its nulls, a text cell split on
    ``separator`` (elements stripped, empty ones skipped; ``" "``: runs of whitespace), or the
    row's one value (``single``; none for a null or blank one; ``text``: the column holds text).
    A null cell is an empty list."""
    inner = pl.Int64 if dtype is ValueType.INTEGER else pl.String
    if is_list:
        return col.cast(pl.List(inner)).list.drop_nulls().fill_null(
            pl.lit([], dtype=pl.List(inner)))
    if single:
        if text:
            value = col.cast(pl.String).str.strip_chars()
            blank, inner = value.is_null() | (value == ""), pl.String
        else:
            value = col.cast(inner)
            blank = value.is_null()
        return pl.when(blank).then(pl.lit([], dtype=pl.List(inner))).otherwise(
            pl.concat_list(value))
    col = col.cast(pl.String)
    if separator == WHITESPACE:
        items = col.str.replace_all(r"\s+", " ").str.split(" ")
    else:
        items = col.str.split(separator).list.eval(pl.element().str.strip_chars())
    items = items.list.eval(pl.element().filter(pl.element() != ""))
    return items.fill_null(pl.lit([], dtype=pl.List(pl.String)))
