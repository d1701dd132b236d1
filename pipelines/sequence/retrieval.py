"""``task: retrieval`` of the sequence job: the same event log as ``task: seq``, written as one
row per event for two-tower models, with an item table.

- *Item table* (:func:`read_catalog`): ``items.path`` lists every item, with its categorical
  ``items.features``, items no event names included (the corpus retrieval ranks). Item ids are
  ``0..N-1`` in the file's row order; without ``items.path`` the corpus is the log's items by
  descending event count (ties by value), with no features. An event whose item is not in the
  table is dropped as ``unknown_item`` (counted); an id listed twice stops the job (one line
  naming the file, column and row).
- *Rows* (:func:`event_rows`): every kept event is a row's label, its history the newest
  ``max_length`` events of its user before it. ``leave_last_out``: each user's last event is a
  test row, the one before a valid row, all earlier ones train rows; ``time``: an event's
  period (before ``split.valid_time``, before ``split.test_time``, after) is its split.
- *Columns* (:func:`write_rows`): ``user`` (int64: the user's index ``0..U-1``, users in
  ascending id order), each of ``user_features`` (int64: the value at the row's event,
  vocabulary-encoded), ``history`` (list<int64>, oldest first) and ``item`` (int64). Feature
  vocabularies give ids ``1..K`` by descending count, ties by value, 0 to null and unknown;
  ``vocab/<name>.parquet`` (``value, id, count``) keeps each, ``vocab/user.parquet`` the users'.
- ``items.parquet``: ``item`` and each item feature's ids; ``metadata.json`` is what
  ``embedtrain datagen retrieval`` writes (``task: retrieval``, ``item_table``), so the
  retrieval family trains on it as it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from embedtrain.config_io import to_dict
from pipelines.core.encode import Vocabulary
from pipelines.core.errors import IngestError
from pipelines.core.report import FORMAT_VERSION, dataset_name
from pipelines.sequence.parts import write_parts
from pipelines.sequence.spec import SequenceIngestSpec, SequenceSplit

UNKNOWN_ITEM = "unknown_item"
from pipelines.core.output import ITEMS_FILE
RESERVED = ("user", "history", "item")  # the rows' own columns


@dataclass
class Catalog:
    """The item table: ``values`` (the item ids as the events give them) in id order and each
    feature's raw values (strings, null where missing), or None: the log's items."""

    values: Optional[pl.Series]
    features: dict[str, pl.Series]


def read_catalog(spec: SequenceIngestSpec) -> Catalog:
    """``items.path`` read and checked (one line naming the file, column and row)."""
    if not spec.items.path:
        return Catalog(None, {})
    path = Path(spec.items.path)
    columns = [spec.items.id, *spec.items.features]
    try:
        if path.suffix == ".parquet":
            frame = pl.read_parquet(path, columns=columns)
        else:
            separator = spec.input.separator or ("\t" if path.suffix == ".tsv" else ",")
            frame = pl.read_csv(path, separator=separator, infer_schema=False, columns=columns)
    except FileNotFoundError:
        raise IngestError(f"{path}: no such file (items.path)") from None
    except (pl.exceptions.PolarsError, OSError) as e:
        raise IngestError(f"{path}: cannot read the item table: "
                          f"{str(e).strip().splitlines()[0]}") from None
    ids = frame[spec.items.id]
    integer = spec.id_type.value == "integer"
    try:
        ids = ids.cast(pl.Int64, strict=True) if integer else ids.cast(pl.String)
    except pl.exceptions.PolarsError:
        bad = int(ids.cast(pl.Int64, strict=False).is_null().arg_true()[0])
        raise IngestError(f"{path}: row {bad}: column {spec.items.id}: cannot parse as an "
                          f"integer id (id_type: integer) (value {frame[spec.items.id][bad]!r})"
                          ) from None
    for problem, rows in (("null id", ids.is_null()), ("listed twice", ids.is_duplicated())):
        if rows.any():
            bad = int(rows.arg_true()[-1] if problem == "listed twice" else rows.arg_true()[0])
            raise IngestError(f"{path}: row {bad}: column {spec.items.id}: {problem} "
                              f"(value {ids[bad]!r})")
    return Catalog(ids, {f: frame[f].cast(pl.String) for f in spec.items.features})


def keep_known(kept: pl.DataFrame, catalog: Catalog) -> tuple[pl.DataFrame, int]:
    """The events whose item is in the item table, and how many were not."""
    if catalog.values is None:
        return kept, 0
    known = kept.join(pl.DataFrame({"item": catalog.values}), on="item", how="semi")
    return known, kept.height - known.height


def item_vocabulary(kept: pl.DataFrame, catalog: Catalog) -> pl.DataFrame:
    """``value, id, count``: the corpus in id order (``0..N-1``), each item's event count."""
    counts = kept.group_by("item").len(name="count")
    if catalog.values is None:
        table = counts.sort(["count", "item"], descending=[True, False]).rename({"item": "value"})
    else:
        table = pl.DataFrame({"value": catalog.values}).join(
            counts.rename({"item": "value"}), on="value", how="left", maintain_order="left")
    return table.select("value", pl.int_range(0, table.height, dtype=pl.Int64).alias("id"),
                        pl.col("count").fill_null(0).cast(pl.Int64))


def encoded(values: pl.Series) -> tuple[np.ndarray, pl.DataFrame]:
    """A categorical column's ids (``1..K`` by descending count, 0 null) and its vocabulary."""
    counts = values.drop_nulls().value_counts(name="count").sort(
        ["count", values.name], descending=[True, False])
    vocab = Vocabulary(counts[values.name])
    ids = pl.select(vocab.encode(pl.lit(values))).to_series().to_numpy().astype(np.int64)
    table = counts.select(pl.col(values.name).alias("value"),
                          pl.int_range(1, counts.height + 1, dtype=pl.Int64).alias("id"), "count")
    return ids, table


@dataclass
class Rows:
    """One split's rows: the user (its index), the history ``[lo, hi)`` of its sorted events
    and the label's event (``hi``)."""

    user: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


def event_rows(spec: SequenceIngestSpec, counts: np.ndarray, starts: np.ndarray,
               times: np.ndarray) -> dict[str, Rows]:
    """Every event as a row of its split (the module docstring)."""
    user = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    position = np.arange(len(user), dtype=np.int64) - np.repeat(starts, counts)
    if spec.split.method is SequenceSplit.LEAVE_LAST_OUT:
        back = np.repeat(counts, counts) - position  # 1: the last event, 2: the one before
        split = np.where(back == 1, 2, np.where(back == 2, 1, 0))
    else:
        valid_time, test_time = spec.split_times()
        split = np.where(times < valid_time, 0, np.where(times < test_time, 1, 2))
    out = {}
    for i, name in enumerate(("train", "valid", "test")):
        mine = split == i
        pos = position[mine]
        out[name] = Rows(user[mine], np.maximum(0, pos - spec.max_length), pos)
    return out


def write_rows(out: Path, split: str, rows: Rows, starts: np.ndarray, items: np.ndarray,
               features: dict[str, np.ndarray], spec: SequenceIngestSpec
               ) -> list[tuple[str, int]]:
    """``<split>/part-NNNNN.parquet`` files (:func:`~pipelines.sequence.parts.write_parts`);
    ``features``: each user feature's id at every sorted event."""

    def columns(part: slice, history: pa.Array) -> dict[str, pa.Array]:
        event = starts[rows.user[part]] + rows.hi[part]
        return {"user": pa.array(rows.user[part]),
                **{name: pa.array(ids[event]) for name, ids in features.items()},
                "history": history, "item": pa.array(items[event])}

    return write_parts(out, split, rows, starts, items, spec.output, columns)


def write_items(out: Path, catalog: Catalog, n: int) -> list[dict]:
    """``items.parquet`` and each item feature's vocabulary; returns the features' entries."""
    columns = {"item": pa.array(np.arange(n, dtype=np.int64))}
    entries = []
    for name, values in catalog.features.items():
        ids, table = encoded(values.rename(name))
        columns[name] = pa.array(ids)
        table.write_parquet(out / "vocab" / f"item_{name}.parquet")
        entries.append({"name": name, "num_embeddings": table.height + 1})
    tmp = out / (ITEMS_FILE + ".tmp")
    pq.write_table(pa.table(columns), tmp)
    os.replace(tmp, out / ITEMS_FILE)
    return entries


def retrieval_metadata(spec: SequenceIngestSpec, report: dict, files: Sequence[Path],
                       user_features: list[dict], item_features: list[dict]) -> dict:
    """``metadata.json``: the layout of :mod:`embedtrain.datagen.retrieval`'s data sets."""
    n, rows = report["num_items"], report["rows_written"]
    vocab = {"item": "vocab/item.parquet", "user": "vocab/user.parquet",
             **{f["name"]: f"vocab/{f['name']}.parquet" for f in user_features},
             **{f"item.{f['name']}": f"vocab/item_{f['name']}.parquet" for f in item_features}}
    return {
        "format_version": FORMAT_VERSION,
        "name": dataset_name(spec, files, "retrieval"),
        "task": "retrieval",
        "label": "item", "dense": [], "num_classes": n,
        "sparse": [{"name": "user", "num_embeddings": report["users"]["kept"]}, *user_features,
                   {"name": "history", "num_embeddings": n, "multi_hot": True,
                    "max_length": spec.max_length}],
        "item_table": {"file": ITEMS_FILE, "id": "item", "features": item_features},
        "num_users": report["users"]["kept"],
        "events": report["events_used"],
        "split_method": spec.split.method.value,
        "splits": {s: {"files": report["files"][s], "rows": rows[s]}
                   for s in report["files"] if s == "train" or rows[s]},
        "vocab_files": vocab,
        "source": {"format": spec.input.format.value, "files": [str(f) for f in files],
                   "rows_read": report["rows_read"]},
        "spec": to_dict(spec),
    }
