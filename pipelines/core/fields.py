"""The field specs every family shares: input formats, value types, encodings, splits, features.

An ingestion spec of any family (:mod:`pipelines.tabular.spec`, :mod:`pipelines.xc.spec`,
:mod:`pipelines.graph.spec`) is typed dataclasses loaded by ``embedtrain.config_io``; the enums
and field dataclasses here are the parts they have in common, so that one ``encoding: vocab``,
one ``dense`` feature or one ``output`` section means the same in every family:

- :class:`InputFormat`, :class:`ValueType`, :class:`Cast`: how input files and their values are
  read;
- :class:`Encoding`, :class:`EmptyList`: how a categorical value (list) becomes ids (id 0 is the
  null/unknown bucket; the id conventions are in :mod:`pipelines.tabular.spec`);
- :class:`SplitMethod`: how rows are split into train/valid/test;
- :class:`NonFinite`: what a dense feature's NaN or infinite value does (an error unless the
  spec asks for ``fill``);
- :class:`DenseSpec`, :class:`SparseSpec`, :class:`OutputSpec`: a dense feature, a categorical
  feature (single-valued or a list), the written files' layout.

Each family checks these in its own ``validate_spec`` (key paths differ); nothing here reads a
file.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class InputFormat(enum.Enum):
    CRITEO_TSV = "criteo_tsv"  # no header, tab-separated: label, I1..I13, C1..C26
    CSV = "csv"                # header line; separator configurable
    PARQUET = "parquet"


class ValueType(enum.Enum):
    """How a categorical column's values are typed (in text inputs: how they are parsed)."""

    STRING = "string"
    INTEGER = "integer"


class Encoding(enum.Enum):
    VOCAB = "vocab"              # ids from a vocabulary built on the training split
    HASH = "hash"                # stable hash into hash_buckets
    PRE_ENCODED = "pre_encoded"  # already integer ids in [0, num_embeddings)
    RAW = "raw"                  # no vocabulary: integers kept (in [0, 2^63 - 1)), strings
    #                              hashed to 63 bits as for hash; null is 0 (dynamic tables)


class EmptyList(enum.Enum):
    """What a list feature's empty (or null) list becomes."""

    KEEP = "keep"  # an empty bag (the model pools it to zeros)
    OOV = "oov"    # [0]: one id of the null/unknown bucket


class SplitMethod(enum.Enum):
    HASH = "hash"      # by a stable hash of a key column (or of file and row number)
    TIME = "time"      # by a time column (or by row order), oldest rows train, newest test
    COLUMN = "column"  # by a column's value: split.values lists each split's values
    FILES = "files"    # by input file: split.files gives a glob per split, the rest train


class NonFinite(enum.Enum):
    """What a NaN or infinite value of a dense feature does (the model cannot take one)."""

    ERROR = "error"  # the job stops naming the file, row (line) and column of the first one
    FILL = "fill"    # replaced with fill_null, counted (repairs: dense_non_finite_filled)


class Cast(enum.Enum):
    """How a dense column stored as text (parquet strings, CSV) is read as numbers."""

    FLOAT = "float"  # parse as a float; an unparsable value becomes fill_null (counted)


@dataclass
class DenseSpec:
    """A dense column. Applied in this order: fill nulls, clip, log1p, standardise.

    A NaN or infinite value (``nan``/``inf`` text, a parquet float) stops the job, one line
    naming the file, row (line) and column, unless ``non_finite: fill`` asks to replace it with
    ``fill_null`` (counted in the report as ``dense_non_finite_filled``).
    """

    # the input column, and the output feature's name
    name: str
    fill_null: float = 0.0           # a null value becomes this (counted); NaN/inf: non_finite
    cast: Optional[Cast] = None      # float: numbers stored as strings; unparsable -> fill_null
    # smaller values are raised to it (counted)
    clip_min: Optional[float] = None
    # larger values are lowered to it (counted)
    clip_max: Optional[float] = None
    log1p: bool = False              # log(1 + max(x, 0)), as for Criteo's counts
    standardize: bool = False        # (x - mean) / std with the training split's mean and std
    non_finite: NonFinite = NonFinite.ERROR  # NaN/inf: error | fill (with fill_null, counted)


@dataclass
class SparseSpec:
    """A categorical feature, single-valued or a list (``multi_hot``).

    ``name`` is the output feature; ``column`` the input column it reads (default: ``name``), so
    one column may feed several features (``{name: age_bucket, column: age, bucketize: [...]}``).
    ``dtype`` (None: the input's type -- parquet's Arrow type, CSV's inferred type; Criteo TSV is
    text) overrides how values are typed. ``bucketize`` (ascending boundaries b1..bk) or
    ``quantiles: N`` (boundaries at the training split's i/N quantiles) turn a numeric column
    into ids ``1 + #{b_i <= x}`` in ``1..k+1``, 0 for null/NaN: ``num_embeddings = k + 2``.

    In a CSV input a value's shape is checked against ``multi_hot``: a single-valued feature's
    value that reads as a list (two or more ids joined by ``,`` ``;`` ``|`` or a list
    ``separator`` of the spec, e.g. ``a1,b2``) stops the job naming the file, line and column,
    and so does a ``multi_hot`` value without its ``separator`` that reads as a list joined by
    another of them. (Parquet list columns are checked against ``multi_hot`` from the footer.)
    """

    # the output feature; also the input column it reads unless column is given
    name: str
    column: Optional[str] = None          # input column (default: name)
    dtype: Optional[ValueType] = None     # None: from the input's schema
    # how values become ids: vocab, hash, pre_encoded, raw
    encoding: Encoding = Encoding.VOCAB
    # a list of ids a row: a parquet list column, or text split on separator
    multi_hot: bool = False
    separator: Optional[str] = None       # text inputs: separator of a list's elements
    max_length: Optional[int] = None      # longer lists are truncated (counted)
    # multi_hot: what an empty or null list becomes: keep (an empty bag) or oov ([0])
    empty_list: EmptyList = EmptyList.KEEP
    min_frequency: int = 1                # vocab: rarer training values go to bucket 0
    max_vocab_size: Optional[int] = None  # vocab: keep only the most frequent values
    hash_buckets: Optional[int] = None    # hash: num_embeddings, bucket 0 included
    num_embeddings: Optional[int] = None  # pre_encoded: ids must lie in [0, num_embeddings)
    #                                        (raw: computed, the training split's distinct ids)
    bucketize: Optional[list[float]] = None  # numeric column: ids by these boundaries
    quantiles: Optional[int] = None          # numeric column: N buckets by training quantiles

    @property
    def source(self) -> str:
        """The input column this feature reads."""
        return self.column if self.column is not None else self.name

    @property
    def bucketized(self) -> bool:
        return self.bucketize is not None or self.quantiles is not None


@dataclass
class OutputSpec:
    # rows a parquet part file holds at most
    rows_per_file: int = 1_000_000
    # rows a parquet row group holds
    rows_per_row_group: int = 65_536
    # the parquet files' compression codec (zstd, snappy, ...)
    compression: str = "zstd"
