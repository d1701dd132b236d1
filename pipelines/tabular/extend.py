"""``embedtrain ingest --extend BASE``: a partition encoded as the one before it, its
vocabularies extended.

Continual training reads a folder of day partitions as one data set
(:func:`embedtrain.features.load_dataset_meta`); a warm start grows yesterday's tables for
today's vocabulary (:meth:`embedtrain.train.trainer.Trainer.warm_start`). That needs stable ids:
a value keeps the id the base gave it, so yesterday's rows stay the rows of the same values.
With ``extend``, the job:

- keeps each vocabulary feature's base vocabulary (``value, id``) as it is, and appends the values
  this partition's training split brings (at least ``min_frequency`` times) that the base lacks,
  by descending count then value, ids ``V + 1, V + 2, ...`` (up to ``max_vocab_size`` in all:
  values past it map to 0, the unknown id, as always); a value's ``count`` adds this partition's
  count to the base's;
- standardises dense features with the base's mean and std and buckets with the base's
  boundaries (the same input means the same encoded value on every day);
- refuses, in one line, a base ingested by another spec (other columns or encodings), or that is
  not an ingested data set.

``BASE`` is a data set (``metadata.json``) or a partitioned data set (its newest partition).
Hash, raw and bucketized features are encoded as always (their ids do not depend on the data).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import polars as pl

from pipelines.core.encode import Vocabulary
from pipelines.core.errors import IngestError
from pipelines.core.fields import Encoding
from pipelines.core.output import METADATA_FILE
from pipelines.core.stats import build_vocabulary
from pipelines.tabular.report import spec_dict
from pipelines.tabular.spec import IngestSpec, SparseSpec


@dataclass
class Base:
    """The data set a partition extends: its root and ``metadata.json``."""

    root: Path
    meta: dict

    def vocabulary(self, name: str) -> pl.DataFrame:
        """Feature ``name``'s base vocabulary (``value, id, count``)."""
        return pl.read_parquet(self.root / self.meta["vocab_files"][name])


def base_of(path: Path, spec: IngestSpec) -> Base:
    """The base ``path`` names, checked against ``spec`` (one-line :class:`IngestError`)."""
    root = path
    if not (root / METADATA_FILE).is_file():
        parts = sorted(d for d in path.iterdir() if (d / METADATA_FILE).is_file()) \
            if path.is_dir() else []
        if not parts:
            raise IngestError(f"--extend {path}: not a data set (no {METADATA_FILE})")
        root = parts[-1]
    try:
        meta = json.loads((root / METADATA_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise IngestError(f"--extend {root / METADATA_FILE}: unreadable: {e}") from None
    given = meta.get("spec")
    if not isinstance(given, dict):
        raise IngestError(f"--extend {root / METADATA_FILE}: not written by embedtrain ingest "
                          f"(no spec)")

    def shape(d: dict) -> tuple:
        return (d.get("label"), [(s.get("name"), s.get("encoding")) for s in d.get("sparse", [])],
                [x.get("name") for x in d.get("dense", [])])

    if shape(given) != shape(spec_dict(spec)):
        raise IngestError(f"--extend {root / METADATA_FILE}: ingested by a spec with other "
                          f"columns or encodings; a partition extends one of its own spec's")
    return Base(root, meta)


def extend_vocabulary(counts: pl.DataFrame, s: SparseSpec, base: pl.DataFrame
                      ) -> tuple[Vocabulary, pl.DataFrame]:
    """The base vocabulary with this partition's new training values appended (see the
    module docstring); ``(vocabulary, table)`` as :func:`build_vocabulary` returns them."""
    _, today = build_vocabulary(counts, dataclasses.replace(s, max_vocab_size=None))
    base = base.select("value", pl.col("id").cast(pl.Int64), pl.col("count").cast(pl.Int64))
    values = today.select("value", pl.col("count").alias("today"))
    if values.schema["value"] != base.schema["value"]:
        values = values.with_columns(pl.col("value").cast(base.schema["value"]))
    kept = base.join(values, on="value", how="left").select(
        "value", "id", (pl.col("count") + pl.col("today").fill_null(0)).alias("count"))
    new = values.join(base.select("value"), on="value", how="anti").sort(
        ["today", "value"], descending=[True, False])
    room = None if s.max_vocab_size is None else max(0, s.max_vocab_size - base.height)
    if room is not None:
        new = new.head(room)
    new = new.select("value", pl.int_range(base.height + 1, base.height + new.height + 1,
                                           dtype=pl.Int64).alias("id"),
                     pl.col("today").cast(pl.Int64).alias("count"))
    table = pl.concat([kept.sort("id"), new])
    return Vocabulary(table["value"]), table


def base_constants(base: Optional[Base], spec: IngestSpec, dense: dict, boundaries: dict
                   ) -> tuple[dict, dict]:
    """The dense statistics and bucket boundaries to encode with: the base's where extending."""
    if base is None:
        return dense, boundaries
    dense = {d.name: base.meta.get("dense_stats", {}).get(d.name, dense.get(d.name))
             for d in spec.dense}
    given = base.meta.get("bucket_boundaries", {})
    boundaries = {s.name: given.get(s.name, boundaries.get(s.name)) for s in spec.sparse
                  if s.name in boundaries}
    return dense, boundaries


def is_vocab(s: SparseSpec) -> bool:
    return s.encoding is Encoding.VOCAB and not s.bucketized
