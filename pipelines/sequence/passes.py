"""The sequence ingestion job: an event log to one row per user (and target) with the items in
time order.

1. *Read* (a pass over the engine's shards, :func:`pipelines.sequence.read.events`): each file's
   user, item and time parsed (a value that does not parse stops the job, naming the file, line
   and column); rows with a null user, item or time are marked with their reason.
2. *Group*: the kept events sorted by user, then time, then input position (file, row): ties in
   time keep the input's order. Users with fewer than ``min_length`` events are dropped (their
   events counted as ``short_history``).
3. *Vocabulary*: item ids ``1..V`` by descending event count, ties by value (0 is padding and
   unknown), over every kept event: the corpus a model ranks is every item of the log, as the
   standard protocol does. Saved as ``vocab/item.parquet`` (``value, id, count``).
4. *Rows* (numpy over the sorted events, vectorised). A user with events ``x_0..x_{n-1}`` and
   ``L = max_length``:

   - ``leave_last_out``: ``train`` = history ``x[max(0, n-3-L) : n-3]``, target ``x[n-3]`` (the
     newest ``L + 1`` items before the valid item: a model predicts each next one, ``items[1:]``
     and then ``target``; users with ``n >= 4``), ``valid`` = history ``x[max(0, n-2-L) : n-2]``,
     target ``x[n-2]``; ``test`` = history ``x[max(0, n-1-L) : n-1]``, target ``x[n-1]``.
   - ``time``: events before ``split.valid_time`` are the train period; ``train`` = its last
     event as the target of the newest ``L`` before it (at least one); every later event with an
     earlier event of its user is a target, ``valid`` before ``split.test_time``, else ``test``,
     its history the newest ``L`` events before it (train-period and earlier valid events alike).

   Rows are in ascending user order (``time``: then target time). Columns ``user`` (the id as
   given), ``items`` (list<int64>, the history, oldest first) and ``target`` (int64): every split
   alike.

Every event read is used (in some row) or dropped by reason: ``null_user``, ``null_item``,
``null_time``, ``short_history`` (a user under ``min_length``) and ``truncated`` (older than
every row's history window). Memory: the kept events in memory (about 40 bytes an event).

Example:
    >>> report = ingest(load_spec("configs/ingest/sequence_events.yaml"), ["events.csv"],
    ...                 "/tmp/seq", progress=False)  # doctest: +SKIP
    >>> report["rows_read"] == report["events_used"] + sum(report["events_dropped"].values())
    True
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import polars as pl
import pyarrow as pa

from pipelines.core.encode import Vocabulary
from pipelines.core.errors import IngestError
from pipelines.core.inputs import ROW, resolve_inputs
from pipelines.core.output import (
    METADATA_FILE,
    REPORT_FILE,
    SPLITS,
    VOCAB_DIR,
    Phases,
    clear_out_dir,
)
from pipelines.engines.base import Engine, Pass, Shard
from pipelines.engines.local import LocalEngine
from pipelines.sequence import retrieval as ret
from pipelines.sequence.parts import write_parts
from pipelines.sequence.read import FEATURE, FILE_INDEX, ROW_REASONS, check_inputs, events
from pipelines.sequence.report import build_metadata, build_report
from pipelines.sequence.spec import SequenceIngestSpec, SequenceSplit

SHORT_HISTORY, TRUNCATED = "short_history", "truncated"
REASONS = (*ROW_REASONS, SHORT_HISTORY, TRUNCATED)


@dataclass(frozen=True)
class _Job:
    spec: SequenceIngestSpec
    files: tuple[Path, ...]
    schemas: tuple[dict, ...]


@dataclass
class Rows:
    """One split's rows over the sorted events: the user (its index), the history window
    ``[lo, hi)`` of the user's events and the target's event (``hi``: the next one)."""

    user: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    target: np.ndarray


def ingest(spec: SequenceIngestSpec, inputs: Sequence[str | os.PathLike],
           out_dir: str | os.PathLike, progress: bool = True, engine: Optional[Engine] = None
           ) -> dict:
    """Runs a sequence ingestion job (see the module docstring).

    Args:
        spec: the validated spec (:func:`pipelines.sequence.spec.load_spec`).
        inputs: event files, directories or globs (``--input``).
        out_dir: output folder; an earlier ingest's output there is replaced, any other
            non-empty folder is refused.
        progress: a progress line per phase on stderr.
        engine: where the read pass runs (default: the local engine); the output is the same on
            every engine.

    Returns:
        The report written to ``ingest_report.json``.

    Raises:
        IngestError: bad input, one line naming the file (and its line and column).
    """
    engine = engine or LocalEngine()
    started = time.perf_counter()
    files = resolve_inputs([str(i) for i in inputs], spec)
    schemas = tuple(check_inputs([f], spec) for f in files)
    out = Path(out_dir)
    clear_out_dir(out)
    log = Phases(progress)
    job = _Job(spec, tuple(files), schemas)

    with log.phase("read") as rec:
        frame = engine.run(Pass("read", _read, _concat), engine.shards(files), job)
        rec["rows"] = frame.height
    per_file = frame.group_by(FILE_INDEX).len()
    file_rows = dict(zip(per_file[FILE_INDEX].to_list(), per_file["len"].to_list()))
    dropped = {r: 0 for r in REASONS}
    for reason, n in frame.group_by("reason").len().iter_rows():
        if reason is not None:
            dropped[reason] = n
    kept = frame.filter(pl.col("reason").is_null()).drop("reason")
    retrieval = spec.task == "retrieval"
    catalog = ret.read_catalog(spec) if retrieval else None
    if catalog is not None:
        kept, dropped[ret.UNKNOWN_ITEM] = ret.keep_known(kept, catalog)

    with log.phase("group", rows=kept.height):
        lengths = kept.group_by("user").len()
        short = lengths.filter(pl.col("len") < spec.min_length)
        dropped[SHORT_HISTORY] = int(short["len"].sum()) if short.height else 0
        kept = kept.join(short.select("user"), on="user", how="anti")
        kept = kept.sort(["user", "time", FILE_INDEX, ROW])
    if kept.height == 0:
        raise IngestError(f"{files[0]}: no user has at least min_length ({spec.min_length}) "
                          f"events with a user, item and time ({frame.height:,} rows read)")

    with log.phase("vocabulary"):
        if catalog is not None:  # ids 0..N-1: the item table's
            table = ret.item_vocabulary(kept, catalog)
            items = kept.select(Vocabulary(table["value"]).encode(pl.col("item")) - 1)
        else:
            table = kept.group_by("item").len(name="count").sort(
                ["count", "item"], descending=[True, False])
            table = table.select(pl.col("item").alias("value"),
                                 pl.int_range(1, table.height + 1, dtype=pl.Int64).alias("id"),
                                 "count")
            items = kept.select(Vocabulary(table["value"]).encode(pl.col("item")))
        items = items.to_series().to_numpy().astype(np.int64)
        users = kept.group_by("user", maintain_order=True).len()
        counts = users["len"].to_numpy().astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        times = kept["time"].to_numpy()

    with log.phase("rows") as rec:
        if retrieval:
            splits = ret.event_rows(spec, counts, starts, times)
        elif spec.split.method is SequenceSplit.LEAVE_LAST_OUT:
            splits = leave_last_out_rows(counts, spec.max_length)
        else:
            splits = time_rows(counts, starts, times, spec.max_length, *spec.split_times())
        earliest = counts.copy()
        for rows in splits.values():
            np.minimum.at(earliest, rows.user, rows.lo)
        dropped[TRUNCATED] = int(earliest.sum())
        used = int((counts - earliest).sum())
        (out / VOCAB_DIR).mkdir(parents=True, exist_ok=True)
        table.write_parquet(out / VOCAB_DIR / "item.parquet")
        if catalog is not None:
            written, user_features, item_features = _write_retrieval(
                out, spec, splits, catalog, kept, users, starts, items, table.height)
        else:
            written = {s: write_split(out, s, splits[s], users["user"], starts, items, spec)
                       for s in SPLITS}
        rec["rows"] = sum(len(r.user) for r in splits.values())

    read = frame.height
    if read != used + sum(dropped.values()):  # the accounting rule, checked on every job
        raise AssertionError(f"events: {read} read != {used} used + {dropped} dropped")
    inputs_report = [{"file": str(f), "rows": int(file_rows.get(i, 0))}
                     for i, f in enumerate(files)]
    report = build_report(spec, engine.describe(), inputs_report, read, used, dropped,
                          users=int(lengths.height), kept_users=int(users.height),
                          num_items=table.height, splits=splits, written=written,
                          phases=log.phases, seconds=time.perf_counter() - started)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    meta = (ret.retrieval_metadata(spec, report, files, user_features, item_features)
            if catalog is not None else build_metadata(spec, report, files))
    tmp = out / f"{METADATA_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / METADATA_FILE)
    return report


def _write_retrieval(out: Path, spec: SequenceIngestSpec, splits: dict, catalog: ret.Catalog,
                     kept: pl.DataFrame, users: pl.DataFrame, starts: np.ndarray,
                     items: np.ndarray, n_items: int) -> tuple[dict, list[dict], list[dict]]:
    """``task: retrieval``'s rows, vocabularies and item table (:mod:`pipelines.sequence.
    retrieval`): (the written files by split, the user and the item features' entries)."""
    users.select(pl.col("user").alias("value"),
                 pl.int_range(0, users.height, dtype=pl.Int64).alias("id"),
                 pl.col("len").alias("count")).write_parquet(out / VOCAB_DIR / "user.parquet")
    features, user_features = {}, []
    for name in spec.user_features:
        features[name], vocab = ret.encoded(kept[FEATURE + name].rename(name))
        vocab.write_parquet(out / VOCAB_DIR / f"{name}.parquet")
        user_features.append({"name": name, "num_embeddings": vocab.height + 1})
    written = {s: ret.write_rows(out, s, splits[s], starts, items, features, spec)
               for s in SPLITS}
    return written, user_features, ret.write_items(out, catalog, n_items)


def _read(shard: Shard, job: _Job) -> pl.DataFrame:
    parts = []
    for path in shard.files:
        index = job.files.index(path)
        parts.append(events(path, index, job.spec, job.schemas[index]))
    return _concat(parts)


def _concat(parts: list[pl.DataFrame]) -> pl.DataFrame:
    if len(parts) == 1:
        return parts[0]
    return pl.concat(parts, how="vertical_relaxed")


def leave_last_out_rows(counts: np.ndarray, max_length: int) -> dict[str, Rows]:
    """The rows of the leave-last-out protocol for users of ``counts`` events (each >= 3)."""
    n, big = counts, max_length
    user = np.arange(len(n), dtype=np.int64)
    out = {}
    for split, end in (("train", n - 3), ("valid", n - 2), ("test", n - 1)):
        rows = end >= 1  # a history of at least one item (train: users of 4 events or more)
        out[split] = Rows(user[rows], np.maximum(0, end - big)[rows], end[rows], end[rows])
    return out


def time_rows(counts: np.ndarray, starts: np.ndarray, times: np.ndarray, max_length: int,
              valid_time: float, test_time: float) -> dict[str, Rows]:
    """The rows of a split by time for users of ``counts`` events starting at ``starts`` of the
    sorted events (``times`` ascending within a user)."""
    user_of = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    position = np.arange(len(times), dtype=np.int64) - np.repeat(starts, counts)
    period = np.where(times < valid_time, 0, np.where(times < test_time, 1, 2))
    in_train = np.bincount(user_of, weights=(period == 0), minlength=len(counts)).astype(np.int64)
    has_train = in_train >= 2
    users = np.arange(len(counts), dtype=np.int64)
    last = in_train[has_train] - 1  # the train period's last event: the train row's target
    out = {"train": Rows(users[has_train], np.maximum(0, last - max_length), last, last)}
    for split, p in (("valid", 1), ("test", 2)):
        target = (period == p) & (position >= 1)
        pos = position[target]
        out[split] = Rows(user_of[target], np.maximum(0, pos - max_length), pos, pos)
    return out


def write_split(out: Path, split: str, rows: Rows, users: pl.Series, starts: np.ndarray,
                items: np.ndarray, spec: SequenceIngestSpec) -> list[tuple[str, int]]:
    """``<split>/part-NNNNN.parquet`` files (:func:`~pipelines.sequence.parts.write_parts`):
    the user as given, its history window and the target."""
    user_values = users.to_arrow()

    def columns(part: slice, history: pa.Array) -> dict[str, Any]:
        u = rows.user[part]
        return {"user": user_values.take(pa.array(u)), "items": history,
                "target": pa.array(items[starts[u] + rows.target[part]])}

    return write_parts(out, split, rows, starts, items, spec.output, columns)
