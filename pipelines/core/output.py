"""The output side every family shares: phase timing, the split writer, the output folder.

A data set folder holds ``metadata.json`` (written last: a folder without it is visibly
unfinished), ``ingest_report.json`` and the family's own files. :func:`pipelines.run_ingest`
runs a job in a temporary folder beside ``--out`` that replaces ``--out`` only once complete
(:func:`pipelines.core.atomic.atomic_output`); :func:`ingest_refusal` says which existing
``--out`` it may replace. Inside that folder (or called directly, with a folder of its own) a
family checks it with :func:`check_out_dir` (a non-empty folder that is not an earlier ingest
output is refused) and clears it with :func:`clear_out_dir`.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path
from typing import Iterator, Optional

import polars as pl

from embedtrain.utils import progress_bar
from pipelines.core.atomic import foreign_entries
from pipelines.core.errors import IngestError

METADATA_FILE, REPORT_FILE, VOCAB_DIR = "metadata.json", "ingest_report.json", "vocab"
ITEMS_FILE = "items.parquet"  # kind: sequence, task: retrieval: the item table
SPLIT = "__split"
SPLITS = ("train", "valid", "test")
SPLIT_DTYPE = pl.Enum(list(SPLITS))


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


def sink_splits(rows: pl.LazyFrame, output, out: Path, prefix: str = "part"
                ) -> dict[str, list[tuple[str, int]]]:
    """Streams ``rows`` (output columns and ``__split``) into ``<split>/<prefix>-NNNNN.parquet``
    files of at most ``output.rows_per_file`` rows (``output``: a spec's ``OutputSpec``);
    returns (file relative to ``out``, rows) by split, sorted. A job that writes each input
    shard on its own gives every shard its own ``prefix`` (``part-<shard>``)."""

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


def merge_written(parts: list[dict[str, list[tuple[str, int]]]]
                  ) -> dict[str, list[tuple[str, int]]]:
    """The (file, rows) lists by split of several shards' writes, as one sorted list per split."""
    if len(parts) == 1:
        return parts[0]
    written: dict[str, list[tuple[str, int]]] = {split: [] for split in SPLITS}
    for part in parts:
        for split, entries in part.items():
            written.setdefault(split, []).extend(entries)
    return {split: sorted(entries) for split, entries in written.items()}


def check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise IngestError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / REPORT_FILE).exists():
        raise IngestError(f"{out}: not empty and not an earlier ingest output; "
                          "choose another --out")


def clear_out_dir(out: Path) -> None:
    """Removes an earlier ingest's outputs (only those: :func:`check_out_dir` vouched for it)."""
    check_out_dir(out)
    for name in (METADATA_FILE, REPORT_FILE, f"{METADATA_FILE}.tmp", ITEMS_FILE):
        (out / name).unlink(missing_ok=True)
    for name in (*SPLITS, VOCAB_DIR):
        shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)


# what an ingest writes at the top of --out: name -> whether it is a folder (of data files)
INGEST_ENTRIES = {METADATA_FILE: False, f"{METADATA_FILE}.tmp": False, REPORT_FILE: False,
                  ITEMS_FILE: False,
                  **{split: True for split in SPLITS}, VOCAB_DIR: True,
                  "graph": True, "nodes": True, "splits": True}


def ingest_refusal(out: Path, overwrite: bool = False) -> Optional[str]:
    """Why an ingest may not replace the existing non-empty folder ``out`` (the end of a one-line
    message), or None.

    Replaced without ``overwrite``: an earlier ingest output (an ``ingest_report.json`` and only
    what an ingest writes). With ``overwrite`` also: a data set ingest did not write (a
    ``metadata.json``, e.g. from ``embedtrain datagen``), an unfinished ingest output (only
    ingest's folders), an earlier output holding other files too. Never: a folder with neither
    ``metadata.json`` nor ``ingest_report.json`` that holds other files.
    """
    foreign = foreign_entries(out, INGEST_ENTRIES)
    report, meta = (out / REPORT_FILE).is_file(), (out / METADATA_FILE).is_file()
    if foreign and not (report or meta):
        return "not empty and not an earlier ingest output; choose another --out"
    if overwrite:
        return None
    if foreign:
        return (f"an earlier data set that also holds other files ({', '.join(foreign[:5])}); "
                "pass --overwrite to replace all of it, or choose another --out")
    if not report:
        what = ("a data set that ingest did not write (no ingest_report.json)" if meta else
                "an unfinished ingest output (no ingest_report.json)")
        return f"holds {what}; pass --overwrite to replace it, or choose another --out"
    return None
