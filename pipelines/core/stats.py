"""Statistics every family shares: vocabularies from value counts, out-of-vocabulary rates.

- :func:`build_vocabulary`: a vocab feature's ids ``1..V`` from the training split's value counts
  (most frequent first, ties by value, so the result does not depend on row order);
- :func:`oov_rates`: per split, the share of values that map to the unknown bucket;
- :func:`finite`: a float made JSON-safe for a report.

The families' statistics passes (:mod:`pipelines.tabular.stats`, :mod:`pipelines.xc.passes`)
count the values; only aggregates reach these functions, never rows.

Example:
    >>> vocab, table = build_vocabulary(counts, s)  # counts: __split, value, count
    >>> oov_rates(counts, table)  # doctest: +SKIP
    {'train': 0.0, 'valid': 0.012, 'test': 0.011}
"""

from __future__ import annotations

import math

import polars as pl

from pipelines.core.encode import Vocabulary
from pipelines.core.fields import SparseSpec
from pipelines.core.output import SPLIT, SPLITS


def build_vocabulary(counts: pl.DataFrame, s: SparseSpec) -> tuple[Vocabulary, pl.DataFrame]:
    """The vocabulary of one feature from the training split's value counts.

    Values seen at least ``min_frequency`` times in train get ids ``1..V`` by descending count
    (ties by value, so the result does not depend on row order); ``max_vocab_size`` keeps the V
    most frequent. Everything else, and null, maps to 0.

    Args:
        counts: ``__split, value, count`` from the statistics pass.
        s: the feature's spec.

    Returns:
        ``(vocabulary, table)``; ``table`` has ``value, id, count`` (saved for serving).
    """
    train = counts.filter(pl.col(SPLIT) == "train").select("value", "count")
    table = train.filter(pl.col("count") >= s.min_frequency).sort(
        ["count", "value"], descending=[True, False])
    if s.max_vocab_size is not None:
        table = table.head(s.max_vocab_size)
    table = table.with_columns(pl.int_range(1, table.height + 1, dtype=pl.Int64).alias("id"))
    table = table.select("value", "id", "count")
    return Vocabulary(table["value"]), table


def oov_rates(counts: pl.DataFrame, table: pl.DataFrame) -> dict[str, float | None]:
    """Per split: the share of non-null values (list elements) that map to the unknown bucket."""
    known = counts.join(table.select("value", pl.lit(True).alias("known")), on="value", how="left")
    out: dict[str, float | None] = {}
    for split in SPLITS:
        part = known.filter(pl.col(SPLIT) == split)
        total = int(part["count"].sum())
        unknown = int(part.filter(pl.col("known").is_null())["count"].sum())
        out[split] = round(unknown / total, 6) if total else None
    return out


def finite(x: float | None, digits: int = 6) -> float | None:
    """A JSON-safe float: rounded, and None for NaN/inf/missing."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return None
    return round(float(x), digits)
