"""``embedtrain ingest --engine ray``: the ingestion job's passes as Ray tasks, file by file.

The same spec, the same Polars code and the same outputs as the one-process engine
(:mod:`pipelines.ingest`), split the way a distributed engine splits work:

1. *row counts* (only when the split hashes or orders rows by their position): a task per
   input file counts its rows (parquet footers need none) and, for Criteo TSV, finds its lines
   without 40 fields; a file's rows are numbered from the rows of the files before it, so row
   numbers are global (int64: no 2^32-row limit; each file is numbered by Polars on its own);
2. *split cut-offs* (time splits on a column): a task per file counts its time values; the
   counts are summed and the cut-offs taken as the one-process job takes them;
3. *statistics*: a task per file runs the statistics pass on its rows (rows by split and drop
   reason, dense statistics, categorical value counts); each file's value counts are cut into
   partitions by a hash of the value and every partition is summed by its own task over all
   files (a hash-partitioned reduce: no task holds every distinct value of every feature); row
   statistics are merged (counts summed, maxima taken; means and standard deviations combined
   from the per-file ones, equal to the one-pass values to ~1e-14), vocabularies ranked by the
   same function, ties broken the same way;
4. *write*: a task per file encodes its kept rows and writes them by split, to
   ``<split>/part-<file>-<n>.parquet``;
5. the raw-id counts, the report (rows read = written + dropped, checked against the written
   files' footers) and ``metadata.json`` as the one-process job makes them.

Without ``address`` the job starts a local Ray instance of ``num_cpus`` CPUs and stops it; with
one it joins a running cluster (``ray start --head`` on one machine, ``ray start --address`` on
the others), whose nodes must all see the input files and the output directory (a shared or
network file system) and have embedtrain installed. Ray Core tasks, not Ray Data's operators:
each pass is a handful of per-file tasks whose results are small frames, which Ray Data's
streaming executor would schedule with seconds of overhead per stage on this scale of work.

Not on this engine (one line each): ``quantiles`` bucketization (exact training quantiles need
every value in one place; ``bucketize`` with given boundaries works), and graph specs
(``kind: graph``: the id remap and the CSR build are global sorts over all edges; see README).
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import polars as pl
import pyarrow.parquet as pq

from pipelines import ingest as job
from pipelines.hashing import string_hash
from pipelines.ingest import _reading, _write_splits
from pipelines.sources import MAX_ROWS, ROW, IngestError, criteo_field_counts, scan_inputs
from pipelines.spec import Encoding, IngestSpec, InputFormat, OnInvalid, SplitMethod
from pipelines.stats import PassStats, row_statistics, value_counts
from pipelines.transforms import (
    SPLIT,
    SPLITS,
    assign_split,
    file_splits,
    parse,
    time_to_seconds,
    time_value,
)

RAY_REQUIREMENT = "ray[data]==2.60.0"


def _ray():
    try:
        import ray
    except ImportError:
        raise IngestError(f"--engine ray needs Ray: pip install '{RAY_REQUIREMENT}' (or "
                          f"requirements/cpu.txt)") from None
    return ray


@contextlib.contextmanager
def cluster(address: Optional[str], num_cpus: Optional[int]) -> Iterator[None]:
    """A Ray instance for the job: joins ``address``, or starts a local one (and stops it)."""
    ray = _ray()
    if num_cpus is not None and num_cpus < 1:
        raise IngestError(f"--num-cpus: must be at least 1, got {num_cpus}")
    if address is not None and num_cpus is not None:
        raise IngestError("--num-cpus is for a local instance; a cluster at --address has its "
                          "own CPUs")
    started = False
    if not ray.is_initialized():
        # one Polars thread per task: the tasks, one per CPU, are the parallelism
        env = {"env_vars": {"POLARS_MAX_THREADS": "1"}}
        try:
            ray.init(address=address, num_cpus=num_cpus, include_dashboard=False,
                     log_to_driver=False, configure_logging=False, runtime_env=env)
        except (ConnectionError, RuntimeError, ValueError) as e:
            what = (f"--address {address}: cannot join the Ray cluster" if address else
                    "cannot start a local Ray instance (RAY_ADDRESS set? it points ray.init at "
                    "a cluster)")
            raise IngestError(f"{what}: {str(e).strip().splitlines()[0]}") from None
        started = True
    elif address is not None or num_cpus is not None:
        raise IngestError("--address/--num-cpus: this process already runs Ray; the job uses "
                          "that instance (leave them out)")
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def _unwrap(refs):
    """``ray.get`` that re-raises a task's :class:`IngestError` as itself (one line)."""
    ray = _ray()
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, IngestError):
            raise IngestError(str(cause)) from None
        raise


def run(spec: IngestSpec, files: Sequence[Path], inputs: Sequence[Any], out: Path, log,
        started: float) -> dict:
    """The job on the Ray instance of :func:`cluster` (see the module docstring)."""
    ray = _ray()
    for s in spec.sparse:
        if s.quantiles is not None:
            raise IngestError(f"sparse[{spec.sparse.index(s)}].quantiles: not on --engine ray "
                              f"(exact training quantiles need every value in one task); use "
                              f"bucketize with boundaries, or --engine polars")
    files = list(files)
    for f in files:  # per file, Polars numbers rows in 32 bits
        if spec.input.format is InputFormat.PARQUET and pq.read_metadata(f).num_rows > MAX_ROWS:
            raise IngestError(f"{f}: {pq.read_metadata(f).num_rows:,} rows in one file, over "
                              f"the {MAX_ROWS:,} Polars can number; split the file")
    by_file = file_splits(files, spec) if spec.split.method is SplitMethod.FILES else None
    # a 0-byte text file adds no rows (the one-process scan reads it as none): no task for it
    given = files  # the report lists every input
    files = [f for f in files if spec.input.format is InputFormat.PARQUET or f.stat().st_size]
    positional = spec.split.column is None and spec.split.method in (SplitMethod.HASH,
                                                                     SplitMethod.TIME)
    criteo = spec.input.format is InputFormat.CRITEO_TSV
    spec_ref = ray.put(spec)

    # 1. rows per file (global row numbers) and Criteo's short/long lines
    wrong: list[Any] = [None] * len(files)
    rows = [None] * len(files)
    if positional or criteo:
        with log.phase("row counts") as rec:
            if spec.input.format is InputFormat.PARQUET:
                rows = [pq.read_metadata(f).num_rows for f in files]
            else:
                counted = _unwrap([_count_rows.remote(spec_ref, str(f), criteo) for f in files])
                rows = [n for n, _ in counted]
                wrong = [ray.put(w) for _, w in counted]
            rec["rows"] = sum(rows)
    offsets = [0] * len(files)
    if positional:
        for i in range(1, len(files)):
            offsets[i] = offsets[i - 1] + rows[i - 1]

    # 2. time-split cut-offs
    cutoffs = None
    if spec.split.method is SplitMethod.TIME:
        split = spec.split
        train_share = 1 - split.valid_fraction - split.test_fraction
        with log.phase("split cut-offs") as rec:
            if split.boundaries is not None:
                cutoffs = (split.boundaries[0], split.boundaries[1])
            elif split.column is None:
                n = sum(rows)
                cutoffs = (round(train_share * n), round((1 - split.test_fraction) * n))
                rec["rows"] = n
            else:
                counts = _unwrap([_time_counts.remote(spec_ref, str(f), wrong[i])
                                  for i, f in enumerate(files)])
                merged = pl.concat(counts).group_by("t").agg(pl.col("n").sum()).sort("t")
                cutoffs = job._quantile_cutoffs(merged, train_share, 1 - split.test_fraction)

    # 3. statistics: per file, then value counts reduced by hash partition
    vocab_features = [s.name for s in spec.sparse
                      if s.encoding is Encoding.VOCAB and not s.bucketized]
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    partitions = max(1, min(64, 2 * cpus)) if vocab_features else 0
    with log.phase("statistics") as rec:
        per_file = [_file_stats.options(num_returns=3 + len(vocab_features) * partitions).remote(
            spec_ref, str(f), offsets[i], cutoffs, by_file, wrong[i], vocab_features,
            partitions) for i, f in enumerate(files)]
        reduced = {name: [_reduce_counts.remote(*[refs[2 + k * partitions + p]
                                                  for refs in per_file])
                          for p in range(partitions)]
                   for k, name in enumerate(vocab_features)}
        counts = _unwrap([refs[0] for refs in per_file])
        kept = _unwrap([refs[1] for refs in per_file])
        reasons = _reasons(spec, files)
        stats = PassStats(_merge_counts(counts), _merge_kept(kept), {}, reasons)
        rec["rows"] = stats.rows_read
        stats.values = {name: pl.concat(_unwrap(parts)) for name, parts in reduced.items()}
    job._check_counts(stats, spec, given, inputs)
    if spec.on_invalid is OnInvalid.ERROR and stats.dropped():
        job._raise_first_invalid(files, spec, reasons)

    # 4. write, file by file
    engine = {"name": "ray", "cpus": cpus, "files": len(files), "value_partitions": partitions,
              "worker_peak_rss_bytes": {}}
    peaks = engine["worker_peak_rss_bytes"]
    for pid, peak in _unwrap([refs[-1] for refs in per_file]):
        peaks[str(pid)] = max(peaks.get(str(pid), 0), peak)

    def write(vocabs, dense_stats, boundaries) -> dict[str, list[tuple[str, int]]]:
        shared = ray.put((vocabs, dense_stats, boundaries))
        parts = _unwrap([_file_write.remote(spec_ref, str(f), i, offsets[i], cutoffs, by_file,
                                            wrong[i], shared, str(out))
                         for i, f in enumerate(files)])
        written: dict[str, list[tuple[str, int]]] = {split: [] for split in SPLITS}
        for part, (pid, peak) in parts:
            peaks[str(pid)] = max(peaks.get(str(pid), 0), peak)
            for split, entries in part.items():
                written.setdefault(split, []).extend(entries)
        return {split: sorted(entries) for split, entries in written.items()}

    return job.finish(spec, given, out, stats, cutoffs, log, started, write, engine)


def _reasons(spec: IngestSpec, files: Sequence[Path]) -> list:
    """The drop reasons of the spec (they depend on the spec alone), from a lazy parse."""
    if not files:
        return []
    wrong = pl.DataFrame(schema={ROW: pl.UInt32, "__fields": pl.UInt32})
    with _reading(files[:1], spec):
        return parse(time_to_seconds(scan_inputs(files[:1], spec, wrong), spec), spec)[1]


def _frame(spec: IngestSpec, file: str, offset: int, cutoffs, by_file,
           wrong: Optional[pl.DataFrame]) -> pl.LazyFrame:
    """One file's rows as the one-process job sees them: parsed, numbered from ``offset``,
    split."""
    raw = scan_inputs([Path(file)], spec, wrong)
    raw = raw.with_columns((pl.col(ROW).cast(pl.Int64) + offset).alias(ROW))
    parsed, _ = parse(time_to_seconds(raw, spec), spec)
    return assign_split(parsed, spec, cutoffs, by_file)


def _count_rows_impl(spec: IngestSpec, file: str, criteo: bool):
    with _reading([Path(file)], spec):
        wrong = criteo_field_counts([Path(file)]) if criteo else None
        n = scan_inputs([Path(file)], spec, wrong).select(pl.len()).collect(
            engine="streaming").item()
    return int(n), wrong


def _time_counts_impl(spec: IngestSpec, file: str, wrong) -> pl.DataFrame:
    with _reading([Path(file)], spec):
        raw = time_to_seconds(scan_inputs([Path(file)], spec, wrong), spec)
        parsed, _ = parse(raw, spec)
        return parsed.select(time_value(spec).alias("t")).drop_nulls().group_by("t").agg(
            pl.len().alias("n")).collect(engine="streaming")


def _file_stats_impl(spec: IngestSpec, file: str, offset: int, cutoffs, by_file, wrong,
                     features: list[str], partitions: int):
    with _reading([Path(file)], spec):
        frame = _frame(spec, file, offset, cutoffs, by_file, wrong)
        counts, kept = row_statistics(frame, spec)
        values = value_counts(frame, spec) if features else {}
    out: list[Any] = [counts, kept]
    for name in features:
        # the project's own stable hash: every node (any Polars build) cuts a value alike
        part = values[name].with_columns(
            (string_hash(pl.col("value").cast(pl.String)) % partitions).alias("__part"))
        out += [part.filter(pl.col("__part") == p).drop("__part") for p in range(partitions)]
    return (*out, (os.getpid(), worker_peak_rss_bytes()))


def _reduce_counts_impl(*parts: pl.DataFrame) -> pl.DataFrame:
    """One hash partition of one feature's value counts, summed over the files."""
    return pl.concat(parts).group_by(SPLIT, "value").agg(pl.col("count").sum())


def _file_write_impl(spec: IngestSpec, file: str, index: int, offset: int, cutoffs, by_file,
                     wrong, shared, out: str) -> dict[str, list[tuple[str, int]]]:
    vocabs, dense_stats, boundaries = shared
    with _reading([Path(file)], spec):
        frame = _frame(spec, file, offset, cutoffs, by_file, wrong)
        written = _write_splits(frame, spec, vocabs, dense_stats, boundaries, Path(out),
                                prefix=f"part-{index:05d}")
    return ({split: entries for split, entries in written.items() if entries},
            (os.getpid(), worker_peak_rss_bytes()))


class _Lazy:
    """A Ray remote function made on first use (so importing this module needs no Ray)."""

    def __init__(self, fn) -> None:
        self.fn, self.remote_fn = fn, None

    def _get(self):
        if self.remote_fn is None:
            self.remote_fn = _ray().remote(self.fn)
        return self.remote_fn

    def remote(self, *args):
        return self._get().remote(*args)

    def options(self, **kwargs):
        return self._get().options(**kwargs)


_count_rows = _Lazy(_count_rows_impl)
_time_counts = _Lazy(_time_counts_impl)
_file_stats = _Lazy(_file_stats_impl)
_reduce_counts = _Lazy(_reduce_counts_impl)
_file_write = _Lazy(_file_write_impl)


def _merge_counts(parts: list[pl.DataFrame]) -> pl.DataFrame:
    """Rows by (split, drop code), summed over the files."""
    if not parts:  # every input empty: the job's "no rows to ingest"
        return pl.DataFrame(schema={SPLIT: pl.String, "__drop": pl.Int32, "rows": pl.Int64})
    return pl.concat(parts).group_by(SPLIT, "__drop").agg(pl.col("rows").sum())


def _merge_kept(parts: list[pl.DataFrame]) -> pl.DataFrame:
    """The kept rows' statistics by split over all files, as one pass over them gives them:
    counts summed, maxima taken, means and (population) standard deviations combined."""
    if not parts:
        return pl.DataFrame(schema={SPLIT: pl.String, "rows": pl.Int64})
    frame = pl.concat(parts, how="diagonal_relaxed")
    rows = []
    for split, group in frame.group_by(SPLIT):
        n = group["rows"].cast(pl.Float64)
        total = float(n.sum())
        row: dict[str, Any] = {SPLIT: split[0], "rows": int(group["rows"].sum())}
        for column in group.columns:
            if column in (SPLIT, "rows"):
                continue
            values = group[column]
            if column.endswith(":mean"):
                std_col = column[: -len(":mean")] + ":std"
                means = values.cast(pl.Float64)
                mean = float((means * n).sum() / total) if total else None
                row[column] = mean
                if std_col in group.columns:
                    stds = group[std_col].cast(pl.Float64).fill_null(0.0)
                    var = float(((stds ** 2 + (means - mean) ** 2) * n).sum() / total) \
                        if total else None
                    row[std_col] = math.sqrt(max(var, 0.0)) if var is not None else None
            elif column.endswith(":std"):
                continue  # with its mean
            elif column.endswith(":max_length"):
                row[column] = values.max()
            else:
                row[column] = values.sum()
        rows.append(row)
    if not rows:  # no kept row anywhere: the job's "no training rows"
        return frame.clear()
    return pl.DataFrame(rows).select(frame.columns)


def worker_peak_rss_bytes() -> int:
    """This process's peak resident memory (``VmHWM``): the report's per-worker figure."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0

