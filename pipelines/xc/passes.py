"""``embedtrain ingest`` with an XC spec: multi-label text/ids to the data set ``task: xc`` reads.

An XC spec is YAML with ``kind: xc`` at the top (:func:`pipelines.kind_of`), read with
:func:`pipelines.xc.spec.load_spec`. The job (:func:`ingest`) is passes over shards of the
input (:mod:`pipelines.engines.base`), each streamed with Polars (a frame of lines for the
Extreme Classification Repository format, a scan for parquet/CSV; never the whole input in
memory). The local engine reads all files as one shard; the Ray engine one file per task,
numbered from the lines (rows) of the files before it, so hash splits of a row's position and
the dropped lines' numbers are the same on both:

1. checks every input from its header line, footer or CSV header
   (:mod:`pipelines.xc.read`); ``xc_repository`` files also get a fast line count (each
   file's line numbers, and the header's row count checked against it: a warning if they
   differ); with several shards and no header lines, a row count per shard instead;
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

The write pass's encoders (:func:`token_feature`, :func:`with_label_ids`, :func:`output_columns`)
and :func:`reading` also serve raw rows (:mod:`pipelines.xc.serve`): one implementation.

Example:
    >>> spec = load_spec("configs/ingest/xc_repository.yaml")
    >>> report = ingest(spec, ["train.txt"], "data/eurlex", progress=False)  # doctest: +SKIP
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from embedtrain.utils import first_line
from pipelines.core.encode import (
    Vocabulary, dense_output, dense_value, sparse_output, sparse_values)
from pipelines.core.errors import IngestError
from pipelines.core.fields import (
    EmptyList, Encoding, NonFinite, SparseSpec, SplitMethod, ValueType)
from pipelines.core.hashing import splitmix64, string_hash, unit_interval
from pipelines.core.inputs import FILE, ROW, csv_lines, file_splits, utf8_failure
from pipelines.core.output import (
    METADATA_FILE, REPORT_FILE, SPLIT, SPLIT_DTYPE, SPLITS, VOCAB_DIR, Phases, check_out_dir,
    clear_out_dir, merge_written, sink_splits)
from pipelines.core.report import DROP, unparsed
from pipelines.core.stats import build_vocabulary
from pipelines.engines.base import Engine, Pass, Shard
from pipelines.engines.local import LocalEngine
from pipelines.xc.read import (
    LABELS, LABELS_GIVEN, NO_LABEL, VALUES, XCLayout, check_xc_inputs, parse_xc,
    resolve_xc_inputs, scan_xc)
from pipelines.xc.report import (
    XCOutputs, XCStats, build_metadata, build_report, dense_statistics, label_name)
from pipelines.xc.spec import XCFormat, XCIngestSpec

LABEL_IDS = "__label_ids"


def ingest(spec: XCIngestSpec, inputs: Sequence[str | os.PathLike],
           out_dir: str | os.PathLike, progress: bool = True, engine: Optional[Engine] = None
           ) -> dict:
    """Runs an XC ingestion job (see the module docstring).

    Args:
        spec: the validated spec (:func:`pipelines.xc.spec.load_spec`).
        inputs: files, directories or globs (``--input``); ``split.files`` globs matching none
            of them add their own files.
        out_dir: output folder; created if missing. An earlier ingest's output there is
            replaced; any other non-empty folder is refused.
        progress: show a progress bar per phase (rows, rows/s) on stderr.
        engine: where the passes run (:func:`pipelines.engines.open_engine`); default: the
            local engine. The outputs are the same on every engine.

    Returns:
        The report written to ``ingest_report.json``.

    Raises:
        IngestError: bad input, one line starting with the file it concerns (and its line).

    Example:
        >>> report = ingest(load_spec("configs/ingest/xc_parquet.yaml"),
        ...                 ["docs.parquet"], "/tmp/xc", progress=False)  # doctest: +SKIP
        >>> sorted(report["rows_written"])
        ['test', 'train', 'valid']
    """
    engine = engine or LocalEngine()
    started = time.perf_counter()
    files = resolve_xc_inputs([str(i) for i in inputs], spec)
    layout = check_xc_inputs(files, spec)
    out = Path(out_dir)
    check_out_dir(out)  # before the long passes, not after them
    log = Phases(progress)
    job = _Job(spec, layout, tuple(files))
    shards = engine.shards(files)
    lines: dict[str, int] = {}
    if spec.repository:
        with log.phase("line counts") as rec:
            counted = engine.map(_line_counts, shards, job)
            lines = {f: n for part, _ in counted for f, n in part.items()}
            rec["rows"] = sum(lines.values())
        shards = _numbered(shards, [sum(part.values()) for part, _ in counted])
        first = {f: (s.offset or 0) + row for s, (_, part) in zip(shards, counted)
                 for f, row in part.items()}
        job = replace(job, first_rows=first)
    elif len(shards) > 1:  # global row numbers: each shard's rows
        with log.phase("row counts") as rec:
            rows = engine.map(_row_count, shards, job)
            rec["rows"] = sum(rows)
        shards = _numbered(shards, rows)
    reasons = _reasons(job) + [NO_LABEL]

    with log.phase("label counts") as rec:
        label_counts = engine.run(Pass("label counts", _label_counts, _merge_label_counts),
                                  shards, job)
        rec["rows"] = None
    label_vocab, label_table, class_counts = _label_vocabulary(spec, layout, label_counts)
    num_classes = len(class_counts)
    if num_classes < 2:
        raise IngestError(f"{files[0]}: the training split gives {num_classes} class(es) "
                          f"(labels.min_frequency {spec.labels.min_frequency}); XC needs at "
                          "least 2")
    job = replace(job, label_vocab=label_vocab, no_label=reasons.index(NO_LABEL),
                  token=token_feature(spec, layout))
    token = job.token

    with log.phase("row statistics") as rec:
        groups = engine.run(Pass("row statistics", _row_statistics, _concat), shards, job)
        rec["rows"] = int(groups["rows"].sum()) if groups.height else 0
    stats = XCStats(groups, reasons, [str(f) for f in files])
    _check_counts(stats, spec, files)
    _check_dense(stats, job)  # NaN/inf dense values: an error unless non_finite: fill

    token_vocab, token_table, token_counts = None, None, None
    if spec.token_encoding is Encoding.VOCAB:
        with log.phase("token counts") as rec:
            token_counts = engine.run(Pass("token counts", _token_counts, _merge_token_counts),
                                      shards, job)
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
    job = replace(job, token_vocab=token_vocab, dense_stats=dense_stats, out=out,
                  several=len(shards) > 1)

    with log.phase("write") as rec:
        written = engine.run(Pass("write", _write, merge_written), shards, job)
        rec["rows"] = sum(n for part in written.values() for _, n in part)
    examples: dict[str, list[dict]] = {}
    if stats.dropped() and spec.dropped_line_examples:
        with log.phase("dropped lines") as rec:
            found = engine.run(Pass("dropped lines", _dropped_rows, _concat), shards, job)
            examples = _dropped_examples(found, spec, stats, job.first_rows)
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


@dataclass(frozen=True)
class _Job:
    """What the passes' tasks share, filled in as the passes learn it."""

    spec: XCIngestSpec
    layout: XCLayout
    files: tuple[Path, ...]                  # every input (split.files matches against them)
    first_rows: Optional[dict[str, int]] = None   # xc_repository: each file's header __row
    label_vocab: Optional[Vocabulary] = None
    no_label: int = 0
    token: Optional[SparseSpec] = None
    token_vocab: Optional[Vocabulary] = None
    dense_stats: Optional[dict[str, dict]] = None
    out: Optional[Path] = None
    several: bool = False                    # several shards: each writes part-<shard>-N files


def _numbered(shards: list[Shard], rows: list[int]) -> list[Shard]:
    """Shards with their ``offset`` (the rows before them), when there are several."""
    if len(shards) == 1:
        return shards
    starts = [0]
    for n in rows[:-1]:
        starts.append(starts[-1] + n)
    return [s.with_(offset=start) for s, start in zip(shards, starts)]


def _frame(shard: Shard, job: _Job) -> pl.LazyFrame:
    """The shard's rows parsed and split (with label ids once the label vocabulary is known)."""
    frame, _ = parse_xc(shard.files, job.spec, job.layout, job.first_rows, shard.offset)
    frame = _assign_split(frame, job.spec, job.files)
    if job.token is None:
        return frame
    return with_label_ids(frame, job.label_vocab, job.no_label)


def _reasons(job: _Job) -> list[str]:
    """The drop reasons (they depend on the spec and layout alone), from a lazy parse."""
    return [r.reason for r in parse_xc(job.files[:1], job.spec, job.layout,
                                       job.first_rows)[1]]


def _concat(parts: list[pl.DataFrame]) -> pl.DataFrame:
    return parts[0] if len(parts) == 1 else pl.concat(parts)


# --- passes --------------------------------------------------------------------------------------

def _line_counts(shard: Shard, job: _Job) -> tuple[dict[str, int], dict[str, int]]:
    """Lines per file and each file's first ``__row`` in the shard (its header), in one fast
    pass."""
    files = shard.files
    with reading(files, job.spec):
        counts = (pl.scan_lines([str(f) for f in files], row_index_name=ROW,
                                include_file_paths=FILE)
                  .group_by(FILE).agg(pl.len().alias("lines"), pl.col(ROW).min().alias("first"))
                  .collect(engine="streaming"))
    lines = dict(zip(counts[FILE].to_list(), counts["lines"].to_list()))
    first = dict(zip(counts[FILE].to_list(), counts["first"].to_list()))
    return ({str(f): int(lines.get(str(f), 0)) for f in files},
            {str(f): int(first[str(f)]) for f in files if str(f) in first})


def _row_count(shard: Shard, job: _Job) -> int:
    with reading(shard.files, job.spec):
        return scan_xc(shard.files, job.spec).select(pl.len()).collect(engine="streaming").item()


def _assign_split(frame: pl.LazyFrame, spec: XCIngestSpec, files: Sequence[Path]
                  ) -> pl.LazyFrame:
    """``__split``: the file's split (``method: files``), else (and within train files) the
    stable hash of the key column's text or of the row's position, as tabular hash splits."""
    s = spec.split
    h = (string_hash(pl.col(s.column).cast(pl.String), s.hash_seed) if s.column is not None
         else splitmix64(pl.col(ROW), s.hash_seed))
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


def _label_counts(shard: Shard, job: _Job) -> pl.DataFrame:
    """``value, count`` of the training split's labels (distinct per row) in rows that parse."""
    with reading(shard.files, job.spec):
        frame = _frame(shard, job)
        train = frame.filter(pl.col(DROP).is_null() & (pl.col(SPLIT) == "train"))
        return (train.select(pl.col(LABELS).alias("value")).explode("value").drop_nulls("value")
                .group_by("value").agg(pl.len().cast(pl.Int64).alias("count"))
                .collect(engine="streaming"))


def _merge_label_counts(parts: list[pl.DataFrame]) -> pl.DataFrame:
    if len(parts) == 1:
        return parts[0]
    return pl.concat(parts).group_by("value").agg(pl.col("count").sum())


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


def with_label_ids(frame: pl.LazyFrame, vocab: Optional[Vocabulary], no_label: int
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


def token_feature(spec: XCIngestSpec, layout: XCLayout) -> SparseSpec:
    """The tokens as a multi-hot :class:`~pipelines.core.fields.SparseSpec`, so the shared
    encoders (vocabulary, hash, truncation) apply unchanged."""
    t = spec.tokens
    num_embeddings = t.num_embeddings
    if spec.repository:
        num_embeddings = next(iter(layout.headers.values())).features + 1
    return SparseSpec(name=t.name, dtype=layout.token_dtype, encoding=spec.token_encoding,
                      multi_hot=True, max_length=t.max_length, empty_list=EmptyList.KEEP,
                      min_frequency=t.min_frequency, max_vocab_size=t.max_vocab_size,
                      hash_buckets=t.hash_buckets, num_embeddings=num_embeddings)


def _row_statistics(shard: Shard, job: _Job) -> pl.DataFrame:
    """One streaming group-by (file, split, drop code): rows and the kept rows' statistics."""
    spec, token = job.spec, job.token
    with reading(shard.files, spec):
        frame = _frame(shard, job)
        return _group_statistics(frame, spec, token)


def _group_statistics(frame: pl.LazyFrame, spec: XCIngestSpec, token: SparseSpec
                      ) -> pl.DataFrame:
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


def _token_counts(shard: Shard, job: _Job) -> pl.DataFrame:
    """``__split, value, count`` of the kept rows' tokens (after truncation)."""
    with reading(shard.files, job.spec):
        kept = _frame(shard, job).filter(pl.col(DROP).is_null())
        counts = (kept.select(SPLIT, sparse_values(job.token).alias("value")).explode("value")
                  .drop_nulls("value").group_by(SPLIT, "value")
                  .agg(pl.len().cast(pl.Int64).alias("count")).collect(engine="streaming"))
    inner = pl.Int64 if job.layout.token_dtype is ValueType.INTEGER else pl.String
    return counts.with_columns(pl.col(SPLIT).cast(pl.String), pl.col("value").cast(inner))


def _merge_token_counts(parts: list[pl.DataFrame]) -> pl.DataFrame:
    if len(parts) == 1:
        return parts[0]
    return pl.concat(parts).group_by(SPLIT, "value").agg(pl.col("count").sum())


def _write(shard: Shard, job: _Job) -> dict[str, list[tuple[str, int]]]:
    """The shard's kept rows, encoded, into ``<split>/part[-<shard>]-NNNNN.parquet``."""
    with reading(shard.files, job.spec):
        columns = output_columns(job.spec, job.layout, job.token, job.token_vocab,
                                 job.dense_stats)
        rows = _frame(shard, job).filter(pl.col(DROP).is_null()).select(*columns, SPLIT)
        return sink_splits(rows, job.spec.output, job.out,
                           f"part-{shard.index:05d}" if job.several else "part")


def _dropped_rows(shard: Shard, job: _Job) -> pl.DataFrame:
    """Per drop code, the shard's first ``dropped_line_examples`` dropped ``__row`` values."""
    with reading(shard.files, job.spec):
        return (_frame(shard, job).filter(pl.col(DROP).is_not_null()).group_by(DROP)
                .agg(pl.col(ROW).cast(pl.Int64).bottom_k(job.spec.dropped_line_examples))
                .collect(engine="streaming"))


def output_columns(spec: XCIngestSpec, layout: XCLayout, token: SparseSpec,
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


def _dropped_examples(found: pl.DataFrame, spec: XCIngestSpec, stats: XCStats,
                      first_rows: Optional[dict[str, int]]) -> dict[str, list[dict]]:
    """Per reason, the first ``dropped_line_examples`` dropped lines (parquet: rows) by file:
    ``[{"file": ..., "lines": [1-based line numbers]}]`` (``"rows"``: 0-based, for parquet),
    from the shards' first dropped rows (``found``: ``__drop``, list of ``__row``)."""
    n = spec.dropped_line_examples
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
    if spec.input.format is XCFormat.CSV:  # a quoted field spanning lines moves the rows after it
        for entries in out.values():
            for e in entries:
                lines = csv_lines(Path(e["file"]), spec.input.separator, [x - 2 for x in e[key]])
                e[key] = [lines[x - 2] for x in e[key]]
    return out


@contextlib.contextmanager
def reading(files: Sequence[Path], spec: XCIngestSpec) -> Iterator[None]:
    """Turns a Polars read failure (a malformed CSV, a corrupt page) into one line naming the
    file that causes it."""
    try:
        yield
    except pl.exceptions.PolarsError as e:
        utf8 = utf8_failure(files, e) if spec.input.format is not XCFormat.PARQUET else None
        if utf8 is not None:  # the file and line of the byte, found by a cheap scan
            raise utf8 from None
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


def _check_dense(stats: XCStats, job: _Job) -> None:
    """A NaN or infinite dense value of a kept row stops the job (``non_finite: error``), naming
    the first one's file, line (parquet: 0-based row) and column."""
    for i, d in enumerate(job.spec.dense):
        n = stats.kept(key=f"{d.name}:non_finite")
        if not n or d.non_finite is not NonFinite.ERROR:
            continue
        x = pl.col(d.name)
        for path in job.files:
            with reading([path], job.spec):
                hit = (_frame(Shard((path,)), job)
                       .filter(pl.col(DROP).is_null() & (x.is_nan() | x.is_infinite()))
                       .select(ROW).head(1).collect(engine="streaming"))
                if not hit.height:
                    continue
                row = int(hit[ROW][0])
                value = scan_xc([path], job.spec).filter(pl.col(ROW) == row).select(
                    d.name).collect().item()
            csv = job.spec.input.format is XCFormat.CSV
            where = (f"line {csv_lines(path, job.spec.input.separator, [row])[row]}" if csv
                     else f"row {row}")
            raise IngestError(f"{path}: {where}: column {d.name}: value {value!r} is not finite "
                              f"(NaN or infinite; {n:,} such value(s) in all); fix the input, or "
                              f"set dense[{i}].non_finite: fill to replace them with fill_null "
                              f"({d.fill_null:g}), counted in the report")


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
