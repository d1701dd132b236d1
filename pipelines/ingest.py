"""``embedtrain ingest``: raw logs (Criteo TSV, CSV, parquet) to a training-ready data set.

The job makes three (for time splits four) streaming passes over the input with Polars' streaming
engine; no pass ever holds the input in memory, only aggregates and one batch at a time:

1. *cut-offs* (time splits only): a row count (row order) or a value count of the time column,
   from which the split boundaries follow;
2. *statistics*: one scan counting rows by split and drop reason with dense statistics, and one
   counting categorical values per split (:mod:`pipelines.stats`); vocabularies and
   standardisation constants are then taken from the training split alone;
3. *write*: the kept rows, encoded, streamed by ``sink_parquet`` into
   ``<split>/part-NNNNN.parquet`` files of at most ``rows_per_file`` rows;
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
    >>> from pipelines.spec import load_spec
    >>> spec = load_spec("configs/ingest/criteo_synthetic.yaml")
    >>> report = ingest(spec, ["data/raw_ctr/*.tsv"], "data/ctr_ingested")  # doctest: +SKIP
    >>> report["rows_read"] == sum(report["rows_written"].values()) + report["rows_dropped_total"]
    True
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import polars as pl
import pyarrow.parquet as pq

from embedtrain.utils import first_line, progress_bar
from pipelines.report import bucket_boundaries, build_metadata, build_report, dense_statistics
from pipelines.sources import (
    ROW, IngestError, check_inputs, check_row_limit, criteo_field_counts, describe_row,
    resolve_inputs, scan_inputs)
from pipelines.spec import (
    CRITEO_COLUMNS, Encoding, IngestSpec, InputFormat, OnInvalid, OutputSpec, SplitMethod)
from pipelines.stats import (
    PassStats, build_vocabulary, raw_id_counts, row_statistics, value_counts)
from pipelines.transforms import (
    DROP, SPLIT, SPLITS, DropReason, Vocabulary, assign_split, dense_output, file_splits, parse,
    sparse_output, time_to_seconds, time_value)

METADATA_FILE, REPORT_FILE, VOCAB_DIR = "metadata.json", "ingest_report.json", "vocab"
ENGINES = ("polars", "ray")


class Phases:
    """Times the job's phases for the report; each is shown on stderr as a tqdm bar that ends with
    the phase's rows and rows/s (or, for a phase without a row count, its time)."""

    def __init__(self, progress: bool) -> None:
        self.progress = progress
        self.phases: list[dict] = []

    @contextlib.contextmanager
    def phase(self, name: str, rows: Optional[int] = None) -> Iterator[dict]:
        record: dict = {"phase": name, "rows": rows}
        with progress_bar(None, f"ingest: {name}", disable=not self.progress,
                          bar_format="{desc} ...") as bar:
            start = time.perf_counter()
            yield record  # the body may fill in record["rows"]
            seconds = time.perf_counter() - start
            record["seconds"] = round(seconds, 3)
            if record["rows"] is not None:
                record["rows_per_s"] = round(record["rows"] / max(seconds, 1e-9))
                bar.bar_format = None  # tqdm's own: "desc: N rows [elapsed, rate rows/s]"
                bar.update(record["rows"])
            else:
                bar.bar_format = "{desc}: {elapsed_s:.1f} s"
            self.phases.append(record)


def ingest(spec: IngestSpec, inputs: Sequence[str | os.PathLike], out_dir: str | os.PathLike,
           progress: bool = True, engine: str = "polars", address: Optional[str] = None,
           num_cpus: Optional[int] = None) -> dict:
    """Runs an ingestion job.

    Args:
        spec: the validated spec (:func:`pipelines.spec.load_spec`).
        inputs: files, directories or globs (``--input``); a directory means its files with the
            format's extensions.
        out_dir: output folder; created if missing. If it holds an earlier ingest's output
            (``ingest_report.json``), that output is replaced; any other non-empty folder is
            refused.
        progress: show a progress bar per phase (rows, rows/s) on stderr.
        engine: ``polars`` (one process, Polars' streaming engine) or ``ray`` (the same passes
            as Ray tasks, file by file, on a local Ray instance or the cluster at ``address``:
            :mod:`pipelines.ray_engine`); the outputs are the same.
        address: ``ray`` only: a running cluster's address (``ray start --head``); None starts
            a local instance for the job (``num_cpus`` workers, default: every core).
        num_cpus: ``ray`` only, local instance: its CPUs.

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
    if engine not in ENGINES:
        raise IngestError(f"--engine: {engine!r} is not one of {', '.join(ENGINES)}")
    if engine == "polars" and (address is not None or num_cpus is not None):
        raise IngestError("--address and --num-cpus are for --engine ray")
    started = time.perf_counter()
    files = resolve_inputs(inputs, spec)
    spec = check_inputs(files, spec)  # with each sparse dtype resolved from the input
    out = Path(out_dir)
    if engine == "ray":
        from pipelines import ray_engine

        with ray_engine.cluster(address, num_cpus):
            check_out_dir(out)
            return ray_engine.run(spec, files, inputs, out, Phases(progress), started)
    check_row_limit(files, spec)
    check_out_dir(out)  # before the long passes, not after them
    log = Phases(progress)
    wrong_fields = None
    if spec.input.format is InputFormat.CRITEO_TSV:
        with log.phase("field counts") as rec:
            wrong_fields = criteo_field_counts(files)
            rec["rows"] = None
    raw = time_to_seconds(scan_inputs(files, spec, wrong_fields), spec)
    parsed, reasons = parse(raw, spec)

    cutoffs = None
    if spec.split.method is SplitMethod.TIME:
        with log.phase("split cut-offs") as rec, _reading(files, spec):
            cutoffs, rec["rows"] = _split_cutoffs(spec, parsed)
    by_file = file_splits(files, spec) if spec.split.method is SplitMethod.FILES else None
    frame = assign_split(parsed, spec, cutoffs, by_file)

    with log.phase("row statistics") as rec, _reading(files, spec):
        counts, kept = row_statistics(frame, spec)
        stats = PassStats(counts, kept, {}, reasons)
        rec["rows"] = stats.rows_read
    _check_counts(stats, spec, files, inputs)
    if spec.on_invalid is OnInvalid.ERROR and stats.dropped():
        _raise_first_invalid(files, spec, reasons)
    if any(s.encoding is Encoding.VOCAB and not s.bucketized for s in spec.sparse):
        with log.phase("value counts") as rec, _reading(files, spec):
            stats.values = value_counts(frame, spec)
            rec["rows"] = stats.rows_read

    def write(vocabs, dense_stats, boundaries):
        with _reading(files, spec):
            return _write_splits(frame, spec, vocabs, dense_stats, boundaries, out)

    return finish(spec, files, out, stats, cutoffs, log, started, write)


def finish(spec: IngestSpec, files: Sequence[Path], out: Path, stats: PassStats,
           cutoffs: Optional[tuple[float, float]], log: Phases, started: float,
           write: Callable[[dict, dict, dict], dict[str, list[tuple[str, int]]]],
           engine: Optional[dict] = None) -> dict:
    """What every engine does after the statistics: vocabularies and constants from the
    training split, the write (``write(vocabs, dense_stats, boundaries)``: the engine's),
    raw-id counts, the report, the rows read = written + dropped check, ``metadata.json``.
    ``engine``: the report's ``engine`` section (filled in by the engine until the report is
    written)."""
    clear_out_dir(out)
    vocabs: dict[str, Vocabulary] = {}
    (out / VOCAB_DIR).mkdir()
    for s in spec.sparse:
        if s.encoding is Encoding.VOCAB and not s.bucketized:
            vocabs[s.name], table = build_vocabulary(stats.values[s.name], s)
            table.write_parquet(out / VOCAB_DIR / f"{s.name}.parquet")
    dense_stats = dense_statistics(stats, spec)
    boundaries = bucket_boundaries(stats, spec)

    with log.phase("write") as rec:
        written = write(vocabs, dense_stats, boundaries)
        rec["rows"] = sum(rows for part in written.values() for _, rows in part)
    if any(s.encoding is Encoding.RAW for s in spec.sparse):
        with log.phase("raw ids") as rec:
            stats.raw_ids = raw_id_counts(out, written, spec)
            rec["rows"] = sum(rows for part in written.values() for _, rows in part)

    warnings = [f"{out}: {w}" for w in _empty_split_warnings(stats, spec)]
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    report = build_report(spec, files, stats, written, vocabs, dense_stats, cutoffs,
                          log.phases, time.perf_counter() - started, boundaries, warnings)
    report["engine"] = engine or {"name": "polars"}
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
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    tmp = out / f"{METADATA_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / METADATA_FILE)  # last: a data set without metadata is visibly unfinished
    return report


def _split_cutoffs(spec: IngestSpec, parsed: pl.LazyFrame
                   ) -> tuple[tuple[float, float], Optional[int]]:
    """Time-split boundaries ``(valid_start, test_start)`` and the rows counted (row order)."""
    split = spec.split
    if split.boundaries is not None:
        return (split.boundaries[0], split.boundaries[1]), None
    train_share = 1 - split.valid_fraction - split.test_fraction
    if split.column is None:  # row order: the cut-offs are row numbers
        n = parsed.select(pl.len()).collect(engine="streaming").item()
        return (round(train_share * n), round((1 - split.test_fraction) * n)), n
    t = time_value(spec)
    counts = parsed.select(t.alias("t")).drop_nulls().group_by("t").agg(pl.len().alias("n"))
    counts = counts.collect(engine="streaming").sort("t")
    return _quantile_cutoffs(counts, train_share, 1 - split.test_fraction), None


def _quantile_cutoffs(counts: pl.DataFrame, *shares: float) -> tuple[float, float]:
    """Smallest times with at least ``share`` of the rows strictly before them (inf if none)."""
    total = int(counts["n"].sum())
    before = counts["n"].cum_sum() - counts["n"]
    out = []
    for share in shares:
        hit = counts.filter(before >= share * total)
        out.append(float(hit["t"][0]) if hit.height and total else float("inf"))
    return out[0], out[1]


def _check_counts(stats: PassStats, spec: IngestSpec, files: Sequence[Path],
                  inputs: Sequence[str | os.PathLike]) -> None:
    where = files[0] if len(files) == 1 else ", ".join(map(str, inputs))
    if stats.rows_read == 0:
        raise IngestError(f"{where}: no rows to ingest ({len(files)} file(s), all empty)")
    kept = sum(stats.kept_rows(s) for s in SPLITS)
    if kept == 0:
        dropped = ", ".join(f"{k} {v:,}" for k, v in stats.dropped().items()) or "none"
        raise IngestError(f"{where}: no training rows to build vocabularies and statistics on "
                          f"({stats.rows_read:,} rows read; dropped: {dropped})")
    if stats.kept_rows("train") == 0:
        others = ", ".join(f"{s} {stats.kept_rows(s):,}" for s in SPLITS if s != "train")
        raise IngestError(f"{where}: split train receives no rows ({others}); "
                          f"{_SPLIT_FIX[spec.split.method]('train')}")


_SPLIT_FIX = {
    SplitMethod.HASH: lambda split: "lower split.valid_fraction/split.test_fraction",
    SplitMethod.TIME: lambda split: ("lower split.valid_fraction/split.test_fraction (or move "
                                     "split.boundaries)"),
    SplitMethod.COLUMN: lambda split: (f"list the column's values of {split} in "
                                       f"split.values.{split}"),
    SplitMethod.FILES: lambda split: (f"give {split} files matching split.files.{split}"
                                      if split != "train" else
                                      "leave some files unmatched by split.files (they are train)"),
}


def _empty_split_warnings(stats: PassStats, spec: IngestSpec) -> list[str]:
    """A line per empty valid/test split (left out of metadata.json): what training loses."""
    loses = {"valid": "training will not evaluate periodically or select a best checkpoint",
             "test": "training will report no final test metrics"}
    out = []
    for split in ("valid", "test"):
        if stats.kept_rows(split) == 0:
            if spec.split.method in (SplitMethod.HASH, SplitMethod.TIME):
                fix = f"set split.{split}_fraction > 0 to have one"
                if spec.split.method is SplitMethod.TIME and spec.split.boundaries is not None:
                    fix = "move split.boundaries to have one"
            else:
                fix = _SPLIT_FIX[spec.split.method](split) + " to have one"
            out.append(f"no {split} split: {loses[split]}; {fix}")
    return out


def _raise_first_invalid(files: Sequence[Path], spec: IngestSpec, reasons: list[DropReason]
                         ) -> None:
    """``on_invalid: error``: names the first invalid row's file, line/row, column and value."""
    for path in files:
        raw = time_to_seconds(scan_inputs([path], spec), spec)
        parsed, _ = parse(raw, spec)
        first = parsed.filter(pl.col(DROP).is_not_null()).select(ROW, DROP).head(1).collect(
            engine="streaming")
        if first.height:
            row, code = int(first[ROW][0]), int(first[DROP][0])
            r = reasons[code]
            value = scan_inputs([path], spec).filter(pl.col(ROW) == row).select(r.column).collect(
                engine="streaming").item()
            if isinstance(value, pl.Series):  # a list column's value: shown as a list, one line
                value = value.to_list()
            if r.reason == "wrong_field_count":
                raise IngestError(f"{path}: {describe_row(spec, row)}: {value} tab-separated "
                                  f"field(s), criteo_tsv expects {len(CRITEO_COLUMNS)} (on_invalid: "
                                  "drop would drop and count such lines)")
            limits = (", raw ids must lie in [0, 2^63 - 1)" if r.reason == "raw_id_out_of_range"
                      else "")
            raise IngestError(f"{path}: {describe_row(spec, row)}: column {r.column}: "
                              f"{r.reason.replace('_', ' ')} (value {value!r}{limits}; on_invalid: "
                              "drop would drop and count such rows)")


def _write_splits(frame: pl.LazyFrame, spec: IngestSpec, vocabs: dict[str, Vocabulary],
                  dense_stats: dict[str, dict], boundaries: dict[str, list[float]], out: Path,
                  prefix: str = "part") -> dict[str, list[tuple[str, int]]]:
    """Streams the kept rows into ``<split>/part-NNNNN.parquet``; returns (file, rows) by split.

    A valid or test split without rows gets no file (and no entry in metadata.json); train
    always has rows (:func:`_check_counts`)."""
    columns = [pl.col(spec.label).cast(pl.Float32)]
    columns += [dense_output(d, dense_stats[d.name]["mean"], dense_stats[d.name]["std"])
                for d in spec.dense]
    columns += [sparse_output(s, vocabs.get(s.name), boundaries.get(s.name))
                for s in spec.sparse]
    rows = frame.filter(pl.col(DROP).is_null()).select(*columns, SPLIT)
    return sink_splits(rows, spec.output, out, prefix)


def sink_splits(rows: pl.LazyFrame, output: OutputSpec, out: Path, prefix: str = "part"
                ) -> dict[str, list[tuple[str, int]]]:
    """Streams ``rows`` (output columns and ``__split``) into ``<split>/part-NNNNN.parquet`` files
    of at most ``output.rows_per_file`` rows; returns (file relative to ``out``, rows) by split,
    sorted. Shared by the tabular and the XC job (:mod:`pipelines.xc`); the Ray engine writes
    each input file's rows under its own ``prefix`` (``part-<file>``)."""

    def file_path(args) -> str:
        return f"{args.partition_keys.item(0, 0)}/{prefix}-{args.index_in_partition:05d}.parquet"

    sinked: list = []
    rows.sink_parquet(
        pl.PartitionBy(out, key=SPLIT, include_key=False, file_path_provider=file_path,
                       max_rows_per_file=output.rows_per_file,
                       approximate_bytes_per_file=None),
        row_group_size=output.rows_per_row_group,
        compression=output.compression,
        mkdir=True,
        engine="streaming",
        sinked_paths_callback=lambda args: sinked.extend(args.paths),
    )
    written: dict[str, list[tuple[str, int]]] = {split: [] for split in SPLITS}
    for p in sinked:
        rel = Path(p.path).resolve().relative_to(out.resolve()).as_posix()
        written[rel.split("/")[0]].append((rel, int(p.num_rows)))
    for split in SPLITS:
        written[split].sort()
    return written


def check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise IngestError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / REPORT_FILE).exists():
        raise IngestError(f"{out}: not empty and not an earlier ingest output; "
                          "choose another --out")


def clear_out_dir(out: Path) -> None:
    """Removes an earlier ingest's outputs (only those: :func:`check_out_dir` vouched for it)."""
    check_out_dir(out)
    for name in (METADATA_FILE, REPORT_FILE, f"{METADATA_FILE}.tmp"):
        (out / name).unlink(missing_ok=True)
    for name in (*SPLITS, VOCAB_DIR):
        shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def _reading(files: Sequence[Path], spec: IngestSpec) -> Iterator[None]:
    """Turns a Polars read failure (a malformed line, a corrupt page) into a one-line error
    naming the file that causes it."""
    try:
        yield
    except pl.exceptions.PolarsError as e:
        raise _locate_failure(files, spec, e) from None


def _locate_failure(files: Sequence[Path], spec: IngestSpec, error: Exception) -> IngestError:
    if len(files) > 1:  # the error does not say which file: read them one by one to find out
        for path in files:
            try:
                scan_inputs([path], spec).select(pl.all().null_count()).collect(engine="streaming")
            except pl.exceptions.PolarsError as e:
                return IngestError(f"{path}: cannot read: {first_line(e)}")
    where = files[0] if len(files) == 1 else files[0].parent
    return IngestError(f"{where}: cannot read: {first_line(error)}")
