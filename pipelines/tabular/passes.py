"""``embedtrain ingest``: raw logs (Criteo TSV, CSV, parquet) to a training-ready data set.

The job is passes over shards of the input (:mod:`pipelines.engines.base`), each a Polars
streaming scan of the shard's files; no pass ever holds the input in memory, only aggregates and
one batch at a time. The local engine reads the whole input as one shard; the Ray engine one
file per task, each numbered from the rows of the files before it:

0. *field counts* (Criteo TSV: each shard's lines without 40 fields) and *row counts* (several
   shards and a split by row position: where each shard's rows start; parquet footers need no
   read);
1. *cut-offs* (time splits only): a row count (row order) or a value count of the time column,
   from which the split boundaries follow;
2. *statistics*: one scan counting rows by split and drop reason with dense statistics, and one
   counting categorical values per split (:mod:`pipelines.tabular.stats`); vocabularies and
   standardisation constants are then taken from the training split alone;
3. *write*: the kept rows, encoded, streamed by ``sink_parquet`` into
   ``<split>/part-NNNNN.parquet`` files of at most ``rows_per_file`` rows (one shard of
   several: ``part-<shard>-NNNNN.parquet``);
4. *raw ids* (``encoding: raw`` features only): their distinct ids by split, read back from the
   written files, for ``num_embeddings`` (a capacity hint) and the report.

Outputs in ``out_dir``: the split folders (a valid or test split that receives no rows gets no
folder and no ``metadata.json`` entry, with a warning; a train split without rows stops the job),
``vocab/<feature>.parquet`` (value, id, count; vocab features only),
``metadata.json`` (what the trainer reads: :func:`embedtrain.features.load_dataset_meta`) and
``ingest_report.json`` (rows read, written per split, dropped and repaired by reason, null and
out-of-vocabulary rates). Rows read always equal rows written plus rows dropped; the job checks it
against the written files' footers before it writes the metadata.

Example:
    >>> from pipelines.tabular.spec import load_spec
    >>> spec = load_spec("configs/ingest/criteo_synthetic.yaml")
    >>> report = ingest(spec, ["data/raw_ctr/*.tsv"], "data/ctr_ingested")  # doctest: +SKIP
    >>> report["rows_read"] == sum(report["rows_written"].values()) + report["rows_dropped_total"]
    True
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import polars as pl
import pyarrow.parquet as pq

from pipelines.core.encode import Vocabulary
from pipelines.core.errors import IngestError
from pipelines.core.fields import Encoding, InputFormat, SplitMethod
from pipelines.core.inputs import ROW, file_splits, resolve_inputs
from pipelines.core.output import (
    METADATA_FILE, REPORT_FILE, SPLIT, SPLITS, VOCAB_DIR, Phases, check_out_dir, clear_out_dir,
    merge_written, sink_splits)
from pipelines.core.report import DROP
from pipelines.core.stats import build_vocabulary
from pipelines.engines.base import Engine, Pass, Shard
from pipelines.engines.local import LocalEngine
from pipelines.tabular.checks import check_values, dropped_values, split_warning
from pipelines.tabular.extend import Base, base_constants, base_of, extend_vocabulary, is_vocab
from pipelines.tabular.read import (
    MAX_ROWS, check_inputs, check_row_limit, criteo_field_counts, describe_row, reading,
    scan_inputs)
from pipelines.tabular.report import (
    bucket_boundaries, build_metadata, build_report, check_counts, dense_statistics,
    empty_split_warnings)
from pipelines.tabular.spec import CRITEO_COLUMNS, IngestSpec, OnInvalid
from pipelines.tabular.stats import (
    PassStats, merge_counts, merge_kept, merge_values, raw_id_counts, row_statistics,
    value_counts)
from pipelines.tabular.transforms import (
    DropReason, assign_split, feature_columns, parse, time_to_seconds, time_value)


def ingest(spec: IngestSpec, inputs: Sequence[str | os.PathLike], out_dir: str | os.PathLike,
           progress: bool = True, engine: Optional[Engine] = None,
           extend: Optional[Path] = None) -> dict:
    """Runs an ingestion job.

    Args:
        spec: the validated spec (:func:`pipelines.tabular.spec.load_spec`).
        inputs: files, directories or globs (``--input``); a directory means its files with the
            format's extensions.
        out_dir: output folder; created if missing. If it holds an earlier ingest's output
            (``ingest_report.json``), that output is replaced; any other non-empty folder is
            refused.
        progress: show a progress bar per phase (rows, rows/s) on stderr.
        engine: where the passes run (:func:`pipelines.engines.open_engine`); default: the
            local engine. The outputs are the same on every engine.
        extend: the data set this one continues (:mod:`pipelines.tabular.extend`): its
            vocabularies extended, its constants reused.

    Returns:
        The report written to ``ingest_report.json``.

    Raises:
        IngestError: bad input, one line starting with the file it concerns.

    Example:
        >>> report = ingest(load_spec("configs/ingest/criteo_synthetic.yaml"),
        ...                 ["/tmp/raw/*.tsv"], "/tmp/ingested", progress=False)  # doctest: +SKIP
        >>> sorted(report["rows_written"])
        ['test', 'train', 'valid']
    """
    engine = engine or LocalEngine()
    started = time.perf_counter()
    files = resolve_inputs(inputs, spec)
    spec = check_inputs(files, spec)  # with each sparse dtype resolved from the input
    base = base_of(extend, spec) if extend is not None else None  # refused before any pass
    out = Path(out_dir)
    # a 0-byte text file adds no rows (and a scan of it alone fails): no shard reads it
    shards = engine.shards([f for f in files
                            if spec.input.format is InputFormat.PARQUET or f.stat().st_size])
    if len(shards) > 1:
        for s in spec.sparse:
            if s.quantiles is not None:
                raise IngestError(f"sparse[{spec.sparse.index(s)}].quantiles: not on --engine "
                                  f"{engine.name} (exact training quantiles need every value in "
                                  "one task); use bucketize with boundaries, or --engine polars")
    for shard in shards:
        check_row_limit(list(shard.files), spec)
    check_out_dir(out)  # before the long passes, not after them
    log = Phases(progress)
    shards, rows = _count(engine, shards, spec, log)

    cutoffs = None
    if spec.split.method is SplitMethod.TIME:
        with log.phase("split cut-offs") as rec:
            cutoffs, rec["rows"] = _split_cutoffs(engine, shards, spec, rows)
    by_file = file_splits(files, spec) if spec.split.method is SplitMethod.FILES else None
    split = (spec, cutoffs, by_file)

    reasons = _reasons(spec, shards)
    with log.phase("row statistics") as rec:
        counts, kept = engine.run(Pass("row statistics", _row_stats, _merge_stats), shards, split)
        stats = PassStats(counts, kept, {}, reasons)
        rec["rows"] = stats.rows_read
    check_values(files, spec, stats)  # NaN/inf dense values, lists in the wrong kind of column
    check_counts(stats, spec, files, inputs, values=lambda reason, column: dropped_values(
        files, spec, reasons, reason, column))
    if spec.on_invalid is OnInvalid.ERROR and stats.dropped():
        raise_first_invalid(files, spec, reasons)
    if any(s.encoding is Encoding.VOCAB and not s.bucketized for s in spec.sparse):
        with log.phase("value counts") as rec:
            stats.values = engine.run(Pass("value counts", _value_counts, merge_values), shards,
                                      split)
            rec["rows"] = stats.rows_read

    def write(vocabs, dense_stats, boundaries):
        return engine.run(Pass("write", _write, merge_written), shards,
                          (*split, vocabs, dense_stats, boundaries, out, len(shards) > 1))

    return finish(spec, files, out, stats, cutoffs, log, started, write, engine, base)


# --- the passes' tasks (module level: an engine may run them in another process) -------------

def _count(engine: Engine, shards: list[Shard], spec: IngestSpec, log: Phases
           ) -> tuple[list[Shard], Optional[list[int]]]:
    """Criteo's malformed lines per shard (``Shard.extra``) and, when shards need global row
    numbers (a split by row position), each shard's rows and its ``offset``."""
    criteo = spec.input.format is InputFormat.CRITEO_TSV
    positional = (len(shards) > 1 and spec.split.column is None
                  and spec.split.method in (SplitMethod.HASH, SplitMethod.TIME))
    if not (criteo or positional):
        return shards, None
    name = "field counts" if criteo else "row counts"
    with log.phase(name) as rec:
        counted = engine.run(Pass(name, _count_rows), shards, (spec, positional))
        rows = [n for n, _ in counted] if positional else None
        rec["rows"] = sum(rows) if rows is not None else None
    shards = [s.with_(extra=wrong) for s, (_, wrong) in zip(shards, counted)]
    if rows is not None:
        starts = [0]
        for n in rows[:-1]:
            starts.append(starts[-1] + n)
        shards = [s.with_(offset=start) for s, start in zip(shards, starts)]
    return shards, rows


def _count_rows(shard: Shard, shared) -> tuple[Optional[int], Optional[pl.DataFrame]]:
    spec, count = shared
    files = list(shard.files)
    with reading(files, spec):
        wrong = criteo_field_counts(files) if spec.input.format is InputFormat.CRITEO_TSV else None
        if not count:
            return None, wrong
        if spec.input.format is InputFormat.PARQUET:
            n = sum(pq.read_metadata(f).num_rows for f in files)
        else:
            n = scan_inputs(files, spec, wrong).select(pl.len()).collect(engine="streaming").item()
    if n > MAX_ROWS:  # per file, Polars numbers rows in 32 bits
        raise IngestError(f"{files[0]}: {n:,} rows in one file, over the {MAX_ROWS:,} Polars "
                          "can number; split the file")
    return int(n), wrong


def _parsed(shard: Shard, spec: IngestSpec, checks: bool = False) -> pl.LazyFrame:
    """The shard's rows parsed, numbered from its offset; ``checks``: with the value checks
    that stop the job (the row statistics pass: :mod:`pipelines.tabular.checks`)."""
    raw = scan_inputs(list(shard.files), spec, shard.extra)
    if shard.offset is not None:
        raw = raw.with_columns((pl.col(ROW).cast(pl.Int64) + shard.offset).alias(ROW))
    return parse(time_to_seconds(raw, spec), spec, checks)[0]


def _frame(shard: Shard, shared, checks: bool = False) -> pl.LazyFrame:
    """The shard's rows parsed and split, as every pass after the cut-offs reads them."""
    spec, cutoffs, by_file = shared[:3]
    return assign_split(_parsed(shard, spec, checks), spec, cutoffs, by_file)


def _reasons(spec: IngestSpec, shards: list[Shard]) -> list[DropReason]:
    """The drop reasons of the spec (they depend on the spec alone), from a lazy parse."""
    if not shards:
        return []
    first = Shard(shards[0].files[:1], extra=pl.DataFrame(schema={ROW: pl.UInt32,
                                                                  "__fields": pl.UInt32}))
    with reading(list(first.files), spec):
        return parse(time_to_seconds(scan_inputs(list(first.files), spec, first.extra), spec),
                     spec)[1]


def _split_cutoffs(engine: Engine, shards: list[Shard], spec: IngestSpec,
                   rows: Optional[list[int]]) -> tuple[tuple[float, float], Optional[int]]:
    """Time-split boundaries ``(valid_start, test_start)`` and the rows counted (row order)."""
    split = spec.split
    if split.boundaries is not None:
        return (split.boundaries[0], split.boundaries[1]), None
    train_share = 1 - split.valid_fraction - split.test_fraction
    if split.column is None:  # row order: the cut-offs are row numbers
        n = sum(rows) if rows is not None else sum(engine.map(_parsed_rows, shards, spec))
        return (round(train_share * n), round((1 - split.test_fraction) * n)), n
    counts = engine.run(Pass("split cut-offs", _time_counts, _merge_time_counts), shards, spec)
    return _quantile_cutoffs(counts, train_share, 1 - split.test_fraction), None


def _parsed_rows(shard: Shard, spec: IngestSpec) -> int:
    with reading(list(shard.files), spec):
        return _parsed(shard, spec).select(pl.len()).collect(engine="streaming").item()


def _time_counts(shard: Shard, spec: IngestSpec) -> pl.DataFrame:
    with reading(list(shard.files), spec):
        t = time_value(spec)
        return (_parsed(shard, spec).select(t.alias("t")).drop_nulls().group_by("t")
                .agg(pl.len().alias("n")).collect(engine="streaming"))


def _merge_time_counts(parts: list[pl.DataFrame]) -> pl.DataFrame:
    counts = parts[0] if len(parts) == 1 else pl.concat(parts).group_by("t").agg(pl.col("n").sum())
    return counts.sort("t")


def _quantile_cutoffs(counts: pl.DataFrame, *shares: float) -> tuple[float, float]:
    """Smallest times with at least ``share`` of the rows strictly before them (inf if none)."""
    total = int(counts["n"].sum())
    before = counts["n"].cum_sum() - counts["n"]
    out = []
    for share in shares:
        hit = counts.filter(before >= share * total)
        out.append(float(hit["t"][0]) if hit.height and total else float("inf"))
    return out[0], out[1]


def _row_stats(shard: Shard, shared) -> tuple[pl.DataFrame, pl.DataFrame]:
    with reading(list(shard.files), shared[0]):
        return row_statistics(_frame(shard, shared, checks=True), shared[0])


def _merge_stats(parts: list[tuple[pl.DataFrame, pl.DataFrame]]
                 ) -> tuple[pl.DataFrame, pl.DataFrame]:
    return merge_counts([c for c, _ in parts]), merge_kept([k for _, k in parts])


def _value_counts(shard: Shard, shared) -> dict[str, pl.DataFrame]:
    with reading(list(shard.files), shared[0]):
        return value_counts(_frame(shard, shared), shared[0])


def _write(shard: Shard, shared) -> dict[str, list[tuple[str, int]]]:
    """Streams the shard's kept rows into ``<split>/part[-<shard>]-NNNNN.parquet``; returns
    (file, rows) by split."""
    spec, _, _, vocabs, dense_stats, boundaries, out, several = shared
    columns = [pl.col(spec.label).cast(pl.Float32),
               *feature_columns(spec, vocabs, dense_stats, boundaries)]
    with reading(list(shard.files), spec):
        rows = _frame(shard, shared).filter(pl.col(DROP).is_null()).select(*columns, SPLIT)
        return sink_splits(rows, spec.output, out,
                           f"part-{shard.index:05d}" if several else "part")


# --- after the statistics --------------------------------------------------------------------

def finish(spec: IngestSpec, files: Sequence[Path], out: Path, stats: PassStats,
           cutoffs: Optional[tuple[float, float]], log: Phases, started: float,
           write, engine: Engine, base: Optional[Base] = None) -> dict:
    """Vocabularies and constants from the training split (or ``base``'s, extended), the write
    (``write(vocabs, dense_stats, boundaries)``), raw-id counts, the report, the rows read =
    written + dropped check, ``metadata.json``."""
    clear_out_dir(out)
    vocabs: dict[str, Vocabulary] = {}
    (out / VOCAB_DIR).mkdir()
    for s in spec.sparse:
        if is_vocab(s):
            vocabs[s.name], table = (
                extend_vocabulary(stats.values[s.name], s, base.vocabulary(s.name)) if base
                else build_vocabulary(stats.values[s.name], s))
            table.write_parquet(out / VOCAB_DIR / f"{s.name}.parquet")
    dense_stats, boundaries = base_constants(base, spec, dense_statistics(stats, spec),
                                             bucket_boundaries(stats, spec))

    with log.phase("write") as rec:
        written = write(vocabs, dense_stats, boundaries)
        rec["rows"] = sum(rows for part in written.values() for _, rows in part)
    if any(s.encoding is Encoding.RAW for s in spec.sparse):
        with log.phase("raw ids") as rec:
            stats.raw_ids = raw_id_counts(out, written, spec)
            rec["rows"] = sum(rows for part in written.values() for _, rows in part)

    warnings = [f"{out}: {w}" for w in empty_split_warnings(stats, spec)]
    split = split_warning(files, spec, stats)  # on stderr only: the report counts the rows
    for w in ([split] if split else []) + warnings:
        print(f"warning: {w}", file=sys.stderr)
    report = build_report(spec, files, stats, written, vocabs, dense_stats, cutoffs,
                          log.phases, time.perf_counter() - started, boundaries, warnings)
    report["engine"] = engine.describe()
    # Nothing is lost silently: what the files' footers hold plus what was dropped is what was read.
    on_disk = {split: sum(pq.read_metadata(out / f).num_rows for f, _ in written[split])
               for split in SPLITS}
    dropped = sum(stats.dropped().values())
    expected = {split: stats.kept_rows(split) for split in SPLITS}
    if on_disk != expected or stats.rows_read != sum(on_disk.values()) + dropped:
        raise IngestError(f"{out}: rows read ({stats.rows_read:,}) != rows written "
                          f"({on_disk}) + dropped ({dropped:,}); did an input change during the "
                          "job?")
    meta = build_metadata(spec, files, stats, written, vocabs, dense_stats, boundaries)
    if base is not None:
        meta["extends"] = report["extends"] = str(base.root.resolve())
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    tmp = out / f"{METADATA_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / METADATA_FILE)  # last: a data set without metadata is visibly unfinished
    return report


def raise_first_invalid(files: Sequence[Path], spec: IngestSpec, reasons: list[DropReason]
                         ) -> None:
    """``on_invalid: error``: names the first invalid row's file, line/row, column and value."""
    for path in files:
        if spec.is_text and not path.stat().st_size:
            continue  # a 0-byte text file: no rows (and a scan of it alone fails)
        with reading([path], spec):
            raw = time_to_seconds(scan_inputs([path], spec), spec)
            parsed, _ = parse(raw, spec)
            first = parsed.filter(pl.col(DROP).is_not_null()).select(ROW, DROP).head(1).collect(
                engine="streaming")
        if first.height:
            row, code = int(first[ROW][0]), int(first[DROP][0])
            r = reasons[code]
            with reading([path], spec):
                value = scan_inputs([path], spec).filter(pl.col(ROW) == row).select(
                    r.column).collect(engine="streaming").item()
            if isinstance(value, pl.Series):  # a list column's value: shown as a list, one line
                value = value.to_list()
            if r.reason == "wrong_field_count":
                raise IngestError(f"{path}: {describe_row(spec, row)}: {value} tab-separated "
                                  f"field(s), criteo_tsv expects {len(CRITEO_COLUMNS)} "
                                  "(on_invalid: drop would drop and count such lines)")
            limits = (", raw ids must lie in [0, 2^63 - 1)" if r.reason == "raw_id_out_of_range"
                      else "")
            raise IngestError(f"{path}: {describe_row(spec, row, path)}: column {r.column}: "
                              f"{r.reason.replace('_', ' ')} (value {value!r}{limits}; on_invalid: "
                              "drop would drop and count such rows)")
