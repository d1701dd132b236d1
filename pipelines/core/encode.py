"""The encoders every family shares, as Polars expressions: dense repairs, categorical ids.

- :func:`dense_value` / :func:`dense_output`: a dense feature filled (null, NaN, inf), clipped,
  log1p'd, then standardised with the training split's mean and std, as float32;
- :func:`sparse_output`: a categorical feature (single-valued or a list) as int64 ids in
  ``[0, num_embeddings)``, 0 the null/unknown bucket, by its ``encoding``: a
  :class:`Vocabulary` (``vocab``), a stable hash (``hash``), the ids themselves
  (``pre_encoded``), the values as 63-bit ids (``raw``: :func:`raw_string_ids`,
  :func:`raw_hash_ids`), or numeric buckets (:func:`bucket_ids`);
- :func:`sparse_values`: the parsed values after list truncation, what vocabularies count.

The statistics they need (vocabularies, means, bucket boundaries) come from the families'
statistics passes (:func:`pipelines.core.stats.build_vocabulary`). An XC job's bag of tokens is a
multi-hot :class:`~pipelines.core.fields.SparseSpec` encoded here like a tabular feature.

Example:
    >>> rows.select(dense_output(d, mean, std), sparse_output(s, vocab))  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import polars as pl
import pyarrow as pa

from pipelines.core.fields import DenseSpec, EmptyList, Encoding, SparseSpec, ValueType
from pipelines.core.hashing import string_hash

# encoding: raw ids lie in [0, RAW_ID_LIMIT); 2^63 - 1 itself marks the dynamic tables' empty rows
RAW_ID_LIMIT = 2**63 - 1


@dataclass(frozen=True)
class Vocabulary:
    """A vocab feature's training values; ``values[i]`` has id ``i + 1`` (0 is null/unknown)."""

    values: pl.Series

    def __len__(self) -> int:
        return len(self.values)

    def encode(self, v: pl.Expr) -> pl.Expr:
        """Int64 ids of ``v``'s values, 0 for null and unknown values.

        A cast to an Enum whose categories are the vocabulary in id order: its physical code is
        ``id - 1`` and unknown values become null. Not ``replace_strict``: in the streaming
        engine its memory grew with the rows processed (1.3 GB for 2M rows, against 0.5 GB).
        """
        categories = pl.Enum(self.values.cast(pl.String))
        code = v.cast(pl.String).cast(categories, strict=False).to_physical().cast(pl.Int64)
        return (code + 1).fill_null(0)


def dense_value(d: DenseSpec) -> pl.Expr:
    """Fill (null, NaN, inf), clip, log1p: the value whose training mean/std standardise it."""
    x = pl.col(d.name)
    x = pl.when(x.is_null() | ~x.is_finite()).then(pl.lit(d.fill_null)).otherwise(x)
    if d.clip_min is not None or d.clip_max is not None:
        x = x.clip(d.clip_min, d.clip_max)
    if d.log1p:
        x = x.clip(lower_bound=0.0).log1p()  # counts: negative values (Criteo's -1) count as 0
    return x


def dense_output(d: DenseSpec, mean: float, std: float) -> pl.Expr:
    """The float32 output column; ``mean``/``std`` are the training split's (ignored if not
    standardised)."""
    x = dense_value(d)
    if d.standardize:
        x = (x - mean) / std
    return x.cast(pl.Float32).alias(d.name)


def sparse_values(s: SparseSpec) -> pl.Expr:
    """Parsed values after list truncation: what vocabularies count and encoders encode."""
    x = pl.col(s.name)
    if s.multi_hot and s.max_length is not None:
        x = x.list.head(s.max_length)
    return x


def bucket_ids(s: SparseSpec, boundaries: list[float]) -> pl.Expr:
    """``1 + #{b <= x}`` in ``1..len(boundaries)+1``; 0 for null and NaN."""
    x = pl.col(s.name)
    ids = pl.lit(1, pl.Int64)
    for b in boundaries:
        ids = ids + (x >= b).cast(pl.Int64)
    return pl.when(x.is_null() | x.is_nan()).then(pl.lit(0, pl.Int64)).otherwise(ids)


def sparse_output(s: SparseSpec, vocab: Optional[Vocabulary],
                  boundaries: Optional[list[float]] = None) -> pl.Expr:
    """Int64 ids (or a list of them) in ``[0, num_embeddings)``; 0 is the null/unknown bucket."""
    if s.bucketized:
        assert boundaries is not None
        return bucket_ids(s, boundaries).alias(s.name)
    x = sparse_values(s)

    def encode(v: pl.Expr) -> pl.Expr:
        if s.encoding is Encoding.VOCAB:
            assert vocab is not None
            return vocab.encode(v)
        if s.encoding is Encoding.HASH:
            assert s.hash_buckets is not None
            bucket = string_hash(v.cast(pl.String)) % pl.lit(s.hash_buckets - 1, pl.UInt64)
            return pl.when(v.is_null()).then(pl.lit(0, pl.Int64)).otherwise(
                (bucket + 1).cast(pl.Int64))
        if s.encoding is Encoding.RAW and s.dtype is not ValueType.INTEGER:
            return raw_string_ids(v)
        return v.cast(pl.Int64)  # pre_encoded and raw integers: checked by parse

    if not s.multi_hot:
        return encode(x).fill_null(0).alias(s.name)
    ids = x.list.eval(encode(pl.element()))
    if s.empty_list is EmptyList.OOV:
        ids = pl.when(ids.is_null() | (ids.list.len() == 0)).then(
            pl.lit([0], dtype=pl.List(pl.Int64))).otherwise(ids)
    else:
        ids = ids.fill_null(pl.lit([], dtype=pl.List(pl.Int64)))
    return ids.cast(pl.List(pl.Int64)).alias(s.name)


def raw_string_ids(v: pl.Expr) -> pl.Expr:
    """``encoding: raw`` ids of strings: the ``hash`` encoding's stable hash
    (:func:`pipelines.core.hashing.string_hash`: FNV-1a of the UTF-8 bytes, then splitmix64) masked to
    63 bits (:func:`raw_hash_ids`); 0 for null. With the finaliser, not FNV-1a alone: FNV-1a
    leaves short strings' ids close together (``"x"`` and ``"y"`` share their top 16 bits), and
    not every consumer of the ids mixes them as the dynamic tables do (``mix_ids``)."""
    h = string_hash(v.cast(pl.String))
    return pl.when(v.is_null()).then(pl.lit(0, pl.Int64)).otherwise(raw_hash_ids(h))


def raw_hash_ids(h: pl.Expr) -> pl.Expr:
    """A UInt64 hash as a raw id: ``h & (2^63 - 1)``, with the reserved ``2^63 - 1`` (the dynamic
    tables' empty-row marker) moved to ``2^63 - 2``; Int64 in ``[0, 2^63 - 1)``."""
    masked = h & pl.lit(RAW_ID_LIMIT, pl.UInt64)
    return pl.when(masked == RAW_ID_LIMIT).then(pl.lit(RAW_ID_LIMIT - 1, pl.UInt64)).otherwise(
        masked).cast(pl.Int64)


def time_seconds(name: str, text: bool, arrow_type: Any) -> pl.Expr:
    """Column ``name`` as float seconds: numbers as they are (e.g. Unix s), dates and datetimes
    (Arrow temporal types, or text that parses as one) as seconds since the epoch (UTC for naive
    values); null where a text value is neither (the caller counts or refuses those)."""
    col = pl.col(name)
    if not text:
        if pa.types.is_temporal(arrow_type):
            return col.dt.epoch("ms").cast(pl.Float64) / 1000.0
        return col.cast(pl.Float64)
    as_date = col.str.to_datetime(strict=False).dt.epoch("ms").cast(pl.Float64) / 1000.0
    return pl.coalesce(col.cast(pl.Float64, strict=False), as_date)
