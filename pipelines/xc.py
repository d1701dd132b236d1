"""``embedtrain ingest`` with an XC spec: multi-label text/ids to the data set ``task: xc`` reads.

An XC spec is YAML with ``kind: xc`` at the top (:func:`pipelines.xc_spec.is_xc_spec`), read with
:func:`pipelines.xc_spec.load_xc_spec`. The job (:func:`ingest_xc`) streams the input with
Polars (a frame of lines for the Extreme Classification Repository format, one multi-file scan
for parquet/CSV; never the whole input in memory):

1. checks every input from its header line, footer or CSV header
   (:mod:`pipelines.xc_sources`); ``xc_repository`` files also get a fast line count (each
   file's line numbers, and the header's row count checked against it: a warning if they
   differ);
2. *label counts*: the training split's labels (distinct per row) over the rows that parse;
   the label vocabulary (``labels.encoding: vocab``: ids ``0..C-1``, most frequent first, ties
   by value, ``min_frequency``/``max_vocab_size``; no unknown class) follows, and so do the
   per-class counts of the written train split (``class_counts``); labels outside the
   vocabulary are removed from their rows (counted), and a row left without a label is dropped
   (``no_label``, like a row that gave none);
3. *row statistics*: one group-by (file, split, drop reason): rows, labels kept/removed, token
   bag lengths, dense statistics;
4. *token counts* (``tokens.encoding: vocab``): the kept rows' tokens by split, for the token
   vocabulary (ids ``1..V`` by training frequency, 0 the unknown bucket) and out-of-vocabulary
   rates;
5. *write*: ``<split>/part-NNNNN.parquet`` (label ``labels`` list<int64> of sorted distinct class
   ids, or ``label`` int64; optional dense float32 columns; ``tokens`` list<int64>), then the
   first ``dropped_line_examples`` dropped lines (rows) of each reason for the report.

Rows with an empty token bag are kept (the encoder pools them to zeros, so a test row without
tokens still counts in P@k) and counted (``tokens.rows_without_tokens``).

Outputs in ``out_dir``: the split folders (an empty valid/test split is left out, with a
warning; an empty train split stops the job), ``vocab/`` (``tokens.parquet``, ``labels.parquet``:
value, id, count, for the vocab encodings), ``metadata.json`` (as ``embedtrain datagen xc``
writes it, plus ``class_counts``) and ``ingest_report.json``. Rows read equal rows written plus
rows dropped, per file and in total; the job checks it against the written files' footers
before it writes the metadata.

Example:
    >>> spec = load_xc_spec("configs/ingest/xc_repository.yaml")
    >>> report = ingest_xc(spec, ["train.txt"], "data/eurlex", progress=False)  # doctest: +SKIP
    >>> report["rows_read"] == report["rows_written_total"] + report["rows_dropped_total"]
    True
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from embedtrain.utils import first_line
from pipelines.hashing import splitmix64, string_hash, unit_interval
from pipelines.ingest import (
    METADATA_FILE, REPORT_FILE, VOCAB_DIR, Phases, check_out_dir, clear_out_dir, sink_splits)
from pipelines.sources import FILE, ROW, IngestError
from pipelines.spec import EmptyList, Encoding, SparseSpec, SplitMethod, ValueType
from pipelines.stats import build_vocabulary
from pipelines.transforms import (
    DROP, SPLIT, SPLIT_DTYPE, SPLITS, Vocabulary, dense_output, dense_value, file_splits,
    sparse_output, sparse_values, unparsed)
from pipelines.xc_report import (
    XCOutputs, XCStats, build_metadata, build_report, dense_statistics, label_name)
from pipelines.xc_sources import (
    LABELS, LABELS_GIVEN, NO_LABEL, VALUES, XCLayout, check_xc_inputs, parse_xc,
    resolve_xc_inputs, scan_xc)
from pipelines.xc_spec import XCFormat, XCIngestSpec

LABEL_IDS = "__label_ids"


def ingest_xc(spec: XCIngestSpec, inputs: Sequence[str | os.PathLike],
              out_dir: str | os.PathLike, progress: bool = True) -> dict:
    """Runs an XC ingestion job (see the module docstring).

    Args:
        spec: the validated spec (:func:`pipelines.xc_spec.load_xc_spec`).
        inputs: files, directories or globs (``--input``); ``split.files`` globs matching none
            of them add their own files.
        out_dir: output folder; created if missing. An earlier ingest's output there is
            replaced; any other non-empty folder is refused.
        progress: show a progress bar per phase (rows, rows/s) on stderr.

    Returns:
        The report written to ``ingest_report.json``.

    Raises:
        IngestError: bad input, one line starting with the file it concerns (and its line).

    Example:
        >>> report = ingest_xc(load_xc_spec("configs/ingest/xc_parquet.yaml"),
        ...                    ["docs.parquet"], "/tmp/xc", progress=False)  # doctest: +SKIP
        >>> sorted(report["rows_written"])
        ['test', 'train', 'valid']
    """
    started = time.perf_counter()
    files = resolve_xc_inputs([str(i) for i in inputs], spec)
    layout = check_xc_inputs(files, spec)
    out = Path(out_dir)
    check_out_dir(out)  # before the long passes, not after them
    log = Phases(progress)
    first_rows: dict[str, int] = {}
    lines: dict[str, int] = {}
    if spec.repository:
        with log.phase("line counts") as rec, _reading(files, spec):
            lines, first_rows = _line_counts(files)
            rec["rows"] = sum(lines.values())
    frame, reasons = parse_xc(files, spec, layout, first_rows)
    frame = _assign_split(frame, spec, files)
    reasons.append(NO_LABEL)

    with log.phase("label counts") as rec, _reading(files, spec):
        label_counts = _label_counts(frame)
        rec["rows"] = None
    label_vocab, label_table, class_counts = _label_vocabulary(spec, layout, label_counts)
    num_classes = len(class_counts)
    if num_classes < 2:
        raise IngestError(f"{files[0]}: the training split gives {num_classes} class(es) "
                          f"(labels.min_frequency {spec.labels.min_frequency}); XC needs at "
                          "least 2")
    frame = _with_label_ids(frame, label_vocab, reasons.index(NO_LABEL))

    token = _token_feature(spec, layout)
    with log.phase("row statistics") as rec, _reading(files, spec):
        groups = _row_statistics(frame, spec, token)
        rec["rows"] = int(groups["rows"].sum()) if groups.height else 0
    stats = XCStats(groups, reasons, [str(f) for f in files])
    _check_counts(stats, spec, files)

    token_vocab, token_table, token_counts = None, None, None
    if spec.token_encoding is Encoding.VOCAB:
        with log.phase("token counts") as rec, _reading(files, spec):
            token_counts = _token_counts(frame, token, layout)
            rec["rows"] = stats.kept_total
        vocab, token_table = build_vocabulary(token_counts, token)
        token_vocab = vocab

    clear_out_dir(out)
    (out / VOCAB_DIR).mkdir()
    vocab_files = {}
    if token_table is not None:
        token_table.write_parquet(out / VOCAB_DIR / f"{token.name}.parquet")
        vocab_files[token.name] = f"{VOCAB_DIR}/{token.name}.parquet"
    label_column = label_name(spec, layout)
    if label_table is not None:
        label_table.write_parquet(out / VOCAB_DIR / f"{label_column}.parquet")
        vocab_files[label_column] = f"{VOCAB_DIR}/{label_column}.parquet"
    dense_stats = dense_statistics(stats, spec)

    with log.phase("write") as rec, _reading(files, spec):
        columns = _output_columns(spec, layout, token, token_vocab, dense_stats)
        rows = frame.filter(pl.col(DROP).is_null()).select(*columns, SPLIT)
        written = sink_splits(rows, spec.output, out)
        rec["rows"] = sum(n for part in written.values() for _, n in part)
    examples: dict[str, list[dict]] = {}
    if stats.dropped() and spec.dropped_line_examples:
        with log.phase("dropped lines") as rec, _reading(files, spec):
            examples = _dropped_examples(frame, spec, stats, first_rows)
            rec["rows"] = None

    warnings = _warnings(spec, layout, lines, stats, out)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    on_disk = {split: sum(pq.read_metadata(out / f).num_rows for f, _ in written[split])
               for split in SPLITS}
    expected = {split: stats.kept(split) for split in SPLITS}
    dropped = sum(stats.dropped().values())
    if on_disk != expected or stats.rows_read != sum(on_disk.values()) + dropped:
        raise IngestError(f"{out}: rows read ({stats.rows_read:,}) != rows written "
                          f"({on_disk}) + dropped ({dropped:,}); did an input change during the "
                          "job?")
    outputs = XCOutputs(spec, layout, list(files), stats, written, token, token_vocab,
                        token_counts, label_vocab, class_counts, label_column, vocab_files,
                        dense_stats)
    report = build_report(outputs, examples, warnings, log.phases, time.perf_counter() - started)
    meta = build_metadata(outputs)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    # class_counts on one line: indented, C classes would be C lines
    text = json.dumps({**meta, "class_counts": "__class_counts__"}, indent=2).replace(
        '"__class_counts__"', json.dumps(meta["class_counts"]))
    tmp = out / f"{METADATA_FILE}.tmp"
    tmp.write_text(text + "\n")
    os.replace(tmp, out / METADATA_FILE)  # last: a data set without metadata is visibly unfinished
    return report


# --- passes --------------------------------------------------------------------------------------

def _line_counts(files: Sequence[Path]) -> tuple[dict[str, int], dict[str, int]]:
    """Lines per file and each file's first ``__row`` (its header), in one fast pass."""
    counts = (pl.scan_lines([str(f) for f in files], row_index_name=ROW, include_file_paths=FILE)
              .group_by(FILE).agg(pl.len().alias("lines"), pl.col(ROW).min().alias("first"))
              .collect(engine="streaming"))
    lines = dict(zip(counts[FILE].to_list(), counts["lines"].to_list()))
    first = dict(zip(counts[FILE].to_list(), counts["first"].to_list()))
    return ({str(f): int(lines.get(str(f), 0)) for f in files},
            {str(f): int(first[str(f)]) for f in files if str(f) in first})


def _assign_split(frame: pl.LazyFrame, spec: XCIngestSpec, files: Sequence[Path]
                  ) -> pl.LazyFrame:
    """``__split``: the file's split (``method: files``), else (and within train files) the
    stable hash of the key column's text or of the row's position, as tabular hash splits."""
    s = spec.split
    h = (string_hash(pl.col(s.column).cast(pl.String), s.seed) if s.column is not None
         else splitmix64(pl.col(ROW), s.seed))
    u = unit_interval(h)
    test, valid = s.fraction("test"), s.fraction("valid")
    name = pl.when(u < test).then(pl.lit("test")).when(u < test + valid).then(
        pl.lit("valid")).otherwise(pl.lit("train"))
    if s.resolved_method is SplitMethod.FILES:
        by_file = file_splits(list(files), spec)  # reads spec.split.files only
        chosen = pl.col(FILE).replace_strict(list(by_file), list(by_file.values()),
                                             default=pl.lit("train"), return_dtype=pl.String)
        name = pl.when(chosen == "train").then(name).otherwise(chosen)
    return frame.with_columns(name.cast(SPLIT_DTYPE).alias(SPLIT))


def _label_counts(frame: pl.LazyFrame) -> pl.DataFrame:
    """``value, count`` of the training split's labels (distinct per row) in rows that parse."""
    train = frame.filter(pl.col(DROP).is_null() & (pl.col(SPLIT) == "train"))
    return (train.select(pl.col(LABELS).alias("value")).explode("value").drop_nulls("value")
            .group_by("value").agg(pl.len().cast(pl.Int64).alias("count"))
            .collect(engine="streaming"))


def _label_vocabulary(spec: XCIngestSpec, layout: XCLayout, counts: pl.DataFrame
                      ) -> tuple[Optional[Vocabulary], Optional[pl.DataFrame], np.ndarray]:
    """The label vocabulary and its table (``value, id, count``; vocab encoding), and the
    per-class counts of the training split (``[num_classes]`` int64)."""
    if spec.label_encoding is Encoding.PRE_ENCODED:
        c = (next(iter(layout.headers.values())).labels if spec.repository
             else spec.labels.num_classes)
        class_counts = np.zeros(c, np.int64)
        ids = counts["value"].cast(pl.Int64).to_numpy()
        class_counts[ids] = counts["count"].to_numpy()
        return None, None, class_counts
    lab = spec.labels
    feature = SparseSpec(name="labels", min_frequency=lab.min_frequency,
                         max_vocab_size=lab.max_vocab_size)
    vocab, table = build_vocabulary(counts.with_columns(pl.lit("train").alias(SPLIT)), feature)
    table = table.with_columns(pl.col("id") - 1)  # classes 0..C-1: there is no unknown class
    return vocab, table, table["count"].to_numpy().astype(np.int64)


def _with_label_ids(frame: pl.LazyFrame, vocab: Optional[Vocabulary], no_label: int
                    ) -> pl.LazyFrame:
    """``__label_ids`` (sorted distinct class ids; labels outside the vocabulary removed) and
    the ``no_label`` drop code for a row that parses but keeps no label."""
    raw = pl.col(LABELS)
    if vocab is None:
        ids = raw.cast(pl.List(pl.Int64))
    else:  # Vocabulary.encode: id + 1, 0 for unknown values; classes have no unknown id
        ids = raw.list.eval(vocab.encode(pl.element()) - 1).list.eval(
            pl.element().filter(pl.element() >= 0))
    frame = frame.with_columns(ids.list.sort().alias(LABEL_IDS))
    drop = pl.when(pl.col(DROP).is_null() & (pl.col(LABEL_IDS).list.len() == 0)).then(
        pl.lit(no_label, dtype=pl.UInt16)).otherwise(pl.col(DROP))
    return frame.with_columns(drop.alias(DROP))


def _token_feature(spec: XCIngestSpec, layout: XCLayout) -> SparseSpec:
    """The tokens as a multi-hot :class:`~pipelines.spec.SparseSpec`, so the tabular encoders
    (vocabulary, hash, truncation) apply unchanged."""
    t = spec.tokens
    num_embeddings = t.num_embeddings
    if spec.repository:
        num_embeddings = next(iter(layout.headers.values())).features + 1
    return SparseSpec(name=t.name, dtype=layout.token_dtype, encoding=spec.token_encoding,
                      multi_hot=True, max_length=t.max_length, empty_list=EmptyList.KEEP,
                      min_frequency=t.min_frequency, max_vocab_size=t.max_vocab_size,
                      hash_buckets=t.hash_buckets, num_embeddings=num_embeddings)


def _row_statistics(frame: pl.LazyFrame, spec: XCIngestSpec, token: SparseSpec) -> pl.DataFrame:
    """One streaming group-by (file, split, drop code): rows and the kept rows' statistics."""
    n = pl.col(token.name).list.len()
    kept_labels = pl.col(LABEL_IDS).list.len()
    distinct = pl.col(LABELS).list.len()
    aggs = [
        pl.len().cast(pl.Int64).alias("rows"),
        kept_labels.sum().alias("labels"), kept_labels.min().alias("labels_min"),
        kept_labels.max().alias("labels_max"),
        (distinct - kept_labels).sum().alias("labels_out_of_vocabulary"),
        (pl.col(LABELS_GIVEN) - distinct).sum().alias("labels_duplicate"),
        (pl.col(LABELS_GIVEN) == 0).sum().alias("labels_none_given"),
        (n == 0).sum().alias("tokens_empty"),
        sparse_values(token).list.len().sum().alias("tokens"),
        sparse_values(token).list.len().max().alias("tokens_max"),
    ]
    if token.max_length is not None:
        aggs.append((n > token.max_length).sum().alias("tokens_truncated"))
    for d in spec.dense:
        x = pl.col(d.name)
        aggs += [x.is_null().sum().alias(f"{d.name}:null"),
                 (x.is_nan() | x.is_infinite()).sum().alias(f"{d.name}:non_finite"),
                 dense_value(d).mean().alias(f"{d.name}:mean"),
                 dense_value(d).std(ddof=0).alias(f"{d.name}:std")]
        if unparsed(d.name) in frame.collect_schema():
            aggs.append(pl.col(unparsed(d.name)).sum().alias(f"{d.name}:unparsable"))
    groups = frame.group_by(FILE, SPLIT, DROP).agg(aggs).collect(engine="streaming")
    return groups.with_columns(pl.col(SPLIT).cast(pl.String))


def _token_counts(frame: pl.LazyFrame, token: SparseSpec, layout: XCLayout) -> pl.DataFrame:
    """``__split, value, count`` of the kept rows' tokens (after truncation)."""
    kept = frame.filter(pl.col(DROP).is_null())
    counts = (kept.select(SPLIT, sparse_values(token).alias("value")).explode("value")
              .drop_nulls("value").group_by(SPLIT, "value")
              .agg(pl.len().cast(pl.Int64).alias("count")).collect(engine="streaming"))
    inner = pl.Int64 if layout.token_dtype is ValueType.INTEGER else pl.String
    return counts.with_columns(pl.col(SPLIT).cast(pl.String), pl.col("value").cast(inner))


def _output_columns(spec: XCIngestSpec, layout: XCLayout, token: SparseSpec,
                    vocab: Optional[Vocabulary], dense_stats: dict[str, dict]) -> list[pl.Expr]:
    """label, dense, tokens (and the feature values): the layout of ``embedtrain datagen xc``."""
    name = label_name(spec, layout)
    ids = pl.col(LABEL_IDS)
    columns = [(ids if layout.multi_label else ids.list.first()).cast(
        pl.List(pl.Int64) if layout.multi_label else pl.Int64).alias(name)]
    columns += [dense_output(d, dense_stats[d.name]["mean"], dense_stats[d.name]["std"])
                for d in spec.dense]
    columns.append(sparse_output(token, vocab))
    if spec.tokens.values_column is not None:
        values = pl.col(VALUES)
        if token.max_length is not None:
            values = values.list.head(token.max_length)
        columns.append(values.cast(pl.List(pl.Float32)).alias(spec.tokens.values_column))
    return columns


def _dropped_examples(frame: pl.LazyFrame, spec: XCIngestSpec, stats: XCStats,
                      first_rows: dict[str, int]) -> dict[str, list[dict]]:
    """Per reason, the first ``dropped_line_examples`` dropped lines (parquet: rows) by file:
    ``[{"file": ..., "lines": [1-based line numbers]}]`` (``"rows"``: 0-based, for parquet)."""
    n = spec.dropped_line_examples
    found = (frame.filter(pl.col(DROP).is_not_null()).group_by(DROP)
             .agg(pl.col(ROW).bottom_k(n)).collect(engine="streaming"))
    by_reason: dict[str, list[int]] = {}
    for code, rows in found.iter_rows():
        by_reason.setdefault(stats.reasons[code], []).extend(rows)
    # where each file starts in __row: its header line (xc_repository), else the rows before it
    if spec.repository:
        starts = [(first_rows[f], f, 1) for f in stats.files if f in first_rows]
    else:
        offset, starts = 0, []
        for f in stats.files:
            starts.append((offset, f, 2 if spec.input.format is XCFormat.CSV else 0))
            offset += stats.file_rows(f)
    starts.sort()
    keys = [s[0] for s in starts]
    key = "rows" if spec.input.format is XCFormat.PARQUET else "lines"
    out: dict[str, list[dict]] = {}
    for reason, rows in sorted(by_reason.items()):
        entries: list[dict] = []
        for row in sorted(rows)[:n]:
            start, path, base = starts[bisect.bisect_right(keys, row) - 1]
            if not entries or entries[-1]["file"] != path:
                entries.append({"file": path, key: []})
            entries[-1][key].append(int(row - start + base))
        out[reason] = entries
    return out


@contextlib.contextmanager
def _reading(files: Sequence[Path], spec: XCIngestSpec) -> Iterator[None]:
    """Turns a Polars read failure (a malformed CSV, a corrupt page) into one line naming the
    file that causes it."""
    try:
        yield
    except pl.exceptions.PolarsError as e:
        for path in files if len(files) > 1 else []:  # the error does not say which file
            try:
                scan_xc([path], spec).select(pl.len()).collect(engine="streaming")
            except pl.exceptions.PolarsError as err:
                raise IngestError(f"{path}: cannot read: {first_line(err)}") from None
        raise IngestError(f"{files[0]}: cannot read: {first_line(e)}") from None


# --- checks --------------------------------------------------------------------------------------

def _check_counts(stats: XCStats, spec: XCIngestSpec, files: Sequence[Path]) -> None:
    where = files[0]
    if stats.rows_read == 0:
        raise IngestError(f"{where}: no rows to ingest ({len(files)} file(s), all empty)")
    if stats.kept_total == 0:
        dropped = ", ".join(f"{k} {v:,}" for k, v in stats.dropped().items()) or "none"
        raise IngestError(f"{where}: no rows left to write ({stats.rows_read:,} rows read; "
                          f"dropped: {dropped})")
    if stats.kept("train") == 0:
        others = ", ".join(f"{s} {stats.kept(s):,}" for s in SPLITS if s != "train")
        fix = ("leave some files unmatched by split.files (they are train)"
               if spec.split.resolved_method is SplitMethod.FILES
               else "lower split.valid_fraction/split.test_fraction")
        raise IngestError(f"{where}: split train receives no rows ({others}); {fix}")


def _warnings(spec: XCIngestSpec, layout: XCLayout, lines: dict[str, int], stats: XCStats,
              out: Path) -> list[str]:
    """Header row counts that disagree with the file, and empty valid/test splits."""
    warnings = []
    for path, header in layout.headers.items():
        data_lines = max(lines.get(path, 0) - 1, 0)
        if header.rows != data_lines:
            warnings.append(f"{path}: line 1: the header says {header.rows:,} rows, the file "
                            f"has {data_lines:,} data lines")
    loses = {"valid": "training will not evaluate periodically or select a best checkpoint",
             "test": "training will report no final test metrics"}
    for split in ("valid", "test"):
        if stats.kept(split) == 0:
            fix = (f"give {split} files matching split.files.{split} or set "
                   f"split.{split}_fraction > 0 to have one"
                   if spec.split.resolved_method is SplitMethod.FILES
                   else f"set split.{split}_fraction > 0 to have one")
            warnings.append(f"{out}: no {split} split: {loses[split]}; {fix}")
    return warnings
