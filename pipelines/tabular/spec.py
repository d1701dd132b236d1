"""Ingestion specs: what the raw input looks like and how each column becomes a model feature.

A spec is YAML read with :func:`load_spec` into an :class:`IngestSpec` (typed dataclasses,
loaded by ``embedtrain.config.load_dataclass``; the feature specs and enums it shares with the
other families are in :mod:`pipelines.core.fields`), then checked as a whole by
:func:`validate_spec`. Every problem is a one-line :class:`~embedtrain.config.ConfigError` naming
the file and key path, e.g.
``configs/ingest/x.yaml: sparse[3].name: column 'C1' is named twice (also sparse[0].name)``.

Id conventions of the output (shared by every categorical feature): id 0 is the null/unknown
bucket. ``vocab`` features map the training split's values seen at least ``min_frequency`` times to
ids ``1..V`` (most frequent first), so ``num_embeddings = V + 1``; ``hash`` features map a value to
``1 + stable_hash(value) mod (hash_buckets - 1)``, so ``num_embeddings = hash_buckets``;
``pre_encoded`` integer features keep their ids, which must lie in ``[0, num_embeddings)``.

``raw`` features have no vocabulary and no table size: their ids are int64 values for a dynamic
(hash-table) embedding. Integer values (parquet integer columns, ``dtype: integer`` or inferred
integers in text inputs) are their own ids and must lie in ``[0, 2^63 - 1)``: a negative value, or
one of ``2^63 - 1`` or more (uint64 inputs, long integer text), makes the row invalid
(``raw_id_out_of_range``; dropped and counted, or an error with ``on_invalid: error``). ``2^63 - 1``
is reserved: the dynamic tables mark their empty rows with it. Strings become
``string_hash(value) & (2^63 - 1)``, the ``hash`` encoding's stable 64-bit hash
(:func:`pipelines.core.hashing.string_hash`: FNV-1a of the UTF-8 bytes, then splitmix64) masked to 63
bits, with the reserved ``2^63 - 1`` moved to ``2^63 - 2``. Null and empty values (and the input's
``null_values``) are id 0, like every encoding's null (so the integer 0, and the rare string whose
masked hash is 0, share id 0 with null); in lists null and empty elements are skipped.
``metadata.json`` marks the feature ``raw: true``, with ``num_embeddings`` the training split's
distinct ids (at least 1): a capacity hint, not a bound.

Example:
    >>> spec = load_spec("configs/ingest/criteo_synthetic.yaml")
    >>> spec.input.format
    <InputFormat.CRITEO_TSV: 'criteo_tsv'>
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Optional

from embedtrain.config_io import ConfigError, load_dataclass
from pipelines.core.fields import (
    DenseSpec, Encoding, InputFormat, OutputSpec, SparseSpec, SplitMethod, ValueType)

CRITEO_COLUMNS = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]


class OnInvalid(enum.Enum):
    """What a row that cannot be repaired (null label, unparsable value, bad id) does."""

    DROP = "drop"    # dropped and counted by reason in ingest_report.json
    ERROR = "error"  # the job stops with the first such row's file, line and column


@dataclass
class InputSpec:
    # criteo_tsv, csv or parquet
    format: InputFormat = InputFormat.CRITEO_TSV
    separator: Optional[str] = None  # csv only (default ","); criteo_tsv is always a tab
    null_values: list[str] = field(default_factory=list)  # text inputs: extra null markers


@dataclass
class SplitSpec:
    """How rows are split. ``column: null`` means the row's position in the input (files in order).

    Time splits use ``boundaries: [valid_start, test_start]`` in the column's units (row numbers
    for row order; Unix seconds for date/datetime columns) when given, else cut-offs at the
    quantiles that leave ``valid_fraction`` and ``test_fraction`` of the rows to the two later
    splits (rows sharing a time value stay together, so the fractions are approximate).

    Column splits: ``values: {train: [...], valid: [...], test: [...]}`` (strings, compared with
    the column's text; ``valid``/``test`` optional); rows whose value is in no list are dropped
    (``split_value_not_listed``); when they are more than 10% of the rows read
    (:data:`pipelines.tabular.checks.SPLIT_DROP_WARNING`) the job prints one warning line on
    stderr with the count and the most frequent values not listed. File splits:
    ``files: {test: GLOB, valid: GLOB}``, matched against each input file's path or name; files
    matching none go to train.
    """

    # hash, time, column or files
    method: SplitMethod = SplitMethod.HASH
    # hash: the key column; time: the time column; column: the split column
    column: Optional[str] = None
    # hash and time: the share of rows for valid
    valid_fraction: float = 0.1
    # hash and time: the share of rows for test
    test_fraction: float = 0.1
    # time: [valid_start, test_start] in the column's units (else cut at the fractions)
    boundaries: Optional[list[float]] = None
    seed: Optional[int] = None  # method: hash (None: 0); refused with the others

    @property
    def hash_seed(self) -> int:
        return self.seed or 0
    values: Optional[dict[str, list[str]]] = None  # method: column
    files: Optional[dict[str, str]] = None         # method: files


@dataclass
class IngestSpec:
    """A whole ingestion job: input layout, label, features, split, output layout."""

    # the data set's name in metadata.json (what a run prints)
    name: str = "dataset"
    # the input files' layout
    input: InputSpec = field(default_factory=InputSpec)
    # the label column (a click: 0 or 1; see label_range)
    label: str = "label"
    # the label's allowed values, rows outside dropped (label_out_of_range): [0, 1] for clicks,
    # e.g. [1, 5] for ratings; null: any finite number
    label_range: Optional[list[float]] = field(default_factory=lambda: [0.0, 1.0])
    dense: list[DenseSpec] = field(default_factory=list)
    sparse: list[SparseSpec] = field(default_factory=list)
    split: SplitSpec = field(default_factory=SplitSpec)
    # the written parquet files' layout
    output: OutputSpec = field(default_factory=OutputSpec)
    # a row that cannot be repaired: drop (counted) or error (stop at the first)
    on_invalid: OnInvalid = OnInvalid.DROP

    @property
    def columns(self) -> list[str]:
        """Output column order: label, dense, sparse."""
        return [self.label, *(d.name for d in self.dense), *(s.name for s in self.sparse)]

    @property
    def source_columns(self) -> list[str]:
        """Input columns the features read (each once): label, dense, sparse sources."""
        out: list[str] = []
        for c in [self.label, *(d.name for d in self.dense), *(s.source for s in self.sparse)]:
            if c not in out:
                out.append(c)
        return out

    @property
    def is_text(self) -> bool:
        return self.input.format is not InputFormat.PARQUET


def load_spec(path: str | os.PathLike, overrides: Optional[list[str]] = None) -> IngestSpec:
    """Reads and validates an ingestion spec.

    Args:
        path: the YAML file.
        overrides: ``key.path=value`` strings, as for training configs
            (``output.rows_per_file=10``).

    Returns:
        The validated spec.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type, or an inconsistent spec.

    Example:
        >>> load_spec("configs/ingest/criteo.yaml").sparse[0].name
        'C1'
    """
    spec = load_dataclass(path, IngestSpec, overrides)
    validate_spec(spec, str(path))
    return spec


def validate_spec(spec: IngestSpec, source: str = "<spec>") -> None:
    """Checks what the types alone cannot: unique names, encoding parameters, ranges.

    Raises:
        ConfigError: naming ``source`` and the offending key path.
    """
    def fail(key: str, message: str) -> None:
        raise ConfigError(f"{source}: {key}: {message}")

    if spec.label_range is not None and (len(spec.label_range) != 2
                                         or spec.label_range[0] > spec.label_range[1]):
        fail("label_range", f"[low, high] with low <= high (or null: any finite number), got "
                            f"{spec.label_range}")
    seen: dict[str, str] = {}
    keys = [("label", spec.label)]
    keys += [(f"dense[{i}].name", d.name) for i, d in enumerate(spec.dense)]
    keys += [(f"sparse[{i}].name", s.name) for i, s in enumerate(spec.sparse)]
    for key, name in keys:
        if not name:
            fail(key, "must not be empty")
        if name.startswith("__"):
            fail(key, f"names starting with '__' are reserved, got {name!r}")
        if name in seen:
            fail(key, f"column {name!r} is named twice (also {seen[name]})")
        seen[name] = key
        if (spec.input.format is InputFormat.CRITEO_TSV and name not in CRITEO_COLUMNS
                and not key.startswith("sparse")):
            fail(key, f"{name!r} is not a Criteo column (label, I1..I13, C1..C26)")
    readers = {spec.label: spec.label, **{d.name: d.name for d in spec.dense},
               **{s.name: s.source for s in spec.sparse}}
    for i, s in enumerate(spec.sparse):
        key = f"sparse[{i}].column" if s.column is not None else f"sparse[{i}].name"
        if spec.input.format is InputFormat.CRITEO_TSV and s.source not in CRITEO_COLUMNS:
            fail(key, f"{s.source!r} is not a Criteo column (label, I1..I13, C1..C26)")
    # a feature named like an input column must read that column (else two meanings of one name)
    sources = [("label", spec.label), *((f"dense[{i}].name", d.name) for i, d in
                                        enumerate(spec.dense)),
               *((f"sparse[{i}].column", s.source) for i, s in enumerate(spec.sparse))]
    if spec.split.column is not None:
        sources.append(("split.column", spec.split.column))
    for key, column in sources:
        if column in readers and readers[column] != column:
            fail(key, f"column {column!r} is also the name of the feature at {seen[column]}, "
                 f"which reads column {readers[column]!r}; rename that feature")
    if not spec.dense and not spec.sparse:
        fail("sparse", "declare at least one dense or sparse feature")
    if spec.input.separator is not None:
        if spec.input.format is not InputFormat.CSV:
            fail("input.separator", "only for format: csv (criteo_tsv is always tab-separated)")
        if len(spec.input.separator) != 1:
            fail("input.separator", f"must be one character, got {spec.input.separator!r}")
    for i, d in enumerate(spec.dense):
        if d.cast is not None and spec.input.format is InputFormat.CRITEO_TSV:
            fail(f"dense[{i}].cast", "criteo_tsv dense columns are always parsed as numbers")
        if d.clip_min is not None and d.clip_max is not None and d.clip_min > d.clip_max:
            fail(f"dense[{i}].clip_min", f"{d.clip_min} is above clip_max {d.clip_max}")
    for i, s in enumerate(spec.sparse):
        _validate_sparse(spec, s, f"sparse[{i}]", fail)
    _validate_split(spec, fail)
    if spec.output.rows_per_file < 1:
        fail("output.rows_per_file", f"must be >= 1, got {spec.output.rows_per_file}")
    if spec.output.rows_per_row_group < 1:
        fail("output.rows_per_row_group", f"must be >= 1, got {spec.output.rows_per_row_group}")


def _validate_sparse(spec: IngestSpec, s: SparseSpec, key: str, fail) -> None:
    if s.encoding is Encoding.RAW:
        _validate_raw(s, key, fail)
    if s.encoding is Encoding.HASH and (s.hash_buckets is None or s.hash_buckets < 2):
        fail(f"{key}.hash_buckets", f"hash encoding needs hash_buckets >= 2, got {s.hash_buckets}")
    if s.encoding is not Encoding.HASH and s.hash_buckets is not None:
        fail(f"{key}.hash_buckets", f"only for encoding: hash (this feature is {s.encoding.value})")
    if s.column is not None and not s.column:
        fail(f"{key}.column", "must not be empty")
    if s.bucketized:
        _validate_buckets(s, key, fail)
    if s.encoding is Encoding.PRE_ENCODED:
        if s.dtype is ValueType.STRING:
            fail(f"{key}.dtype", "pre_encoded ids must be dtype: integer (or left out)")
        if s.num_embeddings is None or s.num_embeddings < 1:
            fail(f"{key}.num_embeddings", f"pre_encoded needs num_embeddings >= 1, got "
                 f"{s.num_embeddings}")
    elif s.num_embeddings is not None:
        fail(f"{key}.num_embeddings", "only for encoding: pre_encoded (else it is computed)")
    if s.min_frequency < 1:
        fail(f"{key}.min_frequency", f"must be >= 1, got {s.min_frequency}")
    if s.max_vocab_size is not None and s.max_vocab_size < 1:
        fail(f"{key}.max_vocab_size", f"must be >= 1, got {s.max_vocab_size}")
    if s.max_length is not None and (not s.multi_hot or s.max_length < 1):
        fail(f"{key}.max_length", "only for multi_hot features, and >= 1")
    if s.multi_hot and spec.is_text:
        if not s.separator:
            fail(f"{key}.separator", "a multi_hot column in a text input needs a list separator")
        field_sep = "\t" if spec.input.format is InputFormat.CRITEO_TSV else (
            spec.input.separator or ",")
        if s.separator == field_sep:
            fail(f"{key}.separator", f"{s.separator!r} is also the input's field separator")
    elif s.separator is not None:
        fail(f"{key}.separator", "only for multi_hot columns of text inputs")


def _validate_raw(s: SparseSpec, key: str, fail) -> None:
    """``encoding: raw`` takes its ids from the values: no vocabulary, buckets or table size."""
    if s.bucketize is not None or s.quantiles is not None:
        what = "bucketize" if s.bucketize is not None else "quantiles"
        fail(f"{key}.{what}", "encoding: raw keeps the values as ids; bucketized features take "
             "their ids from the boundaries (remove one of the two)")
    if s.min_frequency != 1:
        fail(f"{key}.min_frequency", "only for encoding: vocab (this feature is raw: every value "
             "keeps its own id)")
    if s.max_vocab_size is not None:
        fail(f"{key}.max_vocab_size", "only for encoding: vocab (this feature is raw: every "
             "value keeps its own id)")
    if s.hash_buckets is not None:
        fail(f"{key}.hash_buckets", "only for encoding: hash (this feature is raw: strings hash "
             "to 63-bit ids, not into buckets)")
    if s.num_embeddings is not None:
        fail(f"{key}.num_embeddings", "not for encoding: raw (ids are not bounded by a table "
             "size; metadata.json gives the training split's distinct ids as a capacity hint)")


def _validate_buckets(s: SparseSpec, key: str, fail) -> None:
    if s.bucketize is not None and s.quantiles is not None:
        fail(f"{key}.quantiles", "set bucketize (fixed boundaries) or quantiles, not both")
    if s.bucketize is not None and (not s.bucketize or any(
            a >= b for a, b in zip(s.bucketize, s.bucketize[1:]))):
        fail(f"{key}.bucketize", f"expected ascending boundaries [b1, b2, ...], got {s.bucketize}")
    if s.quantiles is not None and s.quantiles < 2:
        fail(f"{key}.quantiles", f"must be >= 2 (buckets), got {s.quantiles}")
    if s.multi_hot:
        fail(f"{key}.multi_hot", "bucketized features are single-valued")
    if s.dtype is not None:
        fail(f"{key}.dtype", "bucketized features read numbers; remove dtype")
    if s.encoding is not Encoding.VOCAB or s.min_frequency != 1 or s.max_vocab_size is not None:
        fail(f"{key}.encoding", "bucketized features take their ids from the boundaries; "
             "remove encoding/min_frequency/max_vocab_size")


def _validate_split(spec: IngestSpec, fail) -> None:
    split = spec.split
    if split.seed is not None and split.method is not SplitMethod.HASH:
        fail("split.seed", f"only for method: hash (method: {split.method.value} draws no "
             f"hash; remove it)")
    if split.values is not None and split.method is not SplitMethod.COLUMN:
        fail("split.values", "only for method: column")
    if split.files is not None and split.method is not SplitMethod.FILES:
        fail("split.files", "only for method: files")
    if split.method is SplitMethod.COLUMN:
        if split.column is None or not split.values:
            fail("split.values" if split.column else "split.column",
                 "method: column needs column: NAME and values: {train: [...], valid: [...]}")
        _check_split_keys(split.values, "split.values", fail)
        if "train" not in split.values:
            fail("split.values", "list the values of the train split (values.train)")
        owner: dict[str, str] = {}
        for name, values in split.values.items():
            for v in values:
                if v in owner and owner[v] != name:
                    fail(f"split.values.{name}", f"value {v!r} is also listed for {owner[v]}")
                owner[v] = name
    if split.method is SplitMethod.FILES:
        if not split.files:
            fail("split.files", "method: files needs files: {test: GLOB, valid: GLOB}")
        _check_split_keys(split.files, "split.files", fail)
        if "train" in split.files:
            fail("split.files.train", "train is every file no other split's glob matches")
        if split.column is not None:
            fail("split.column", "not used by method: files")
    lists = {s.source for s in spec.sparse if s.multi_hot}
    if split.column is not None and split.column in lists:
        fail("split.column", f"{split.column!r} is a list column; a split needs one value per row")
    if split.column is not None and split.column == spec.label:
        fail("split.column", "the label cannot be the split column")
    if (split.column is not None and spec.input.format is InputFormat.CRITEO_TSV
            and split.column not in CRITEO_COLUMNS):
        fail("split.column", f"{split.column!r} is not a Criteo column")
    for key in ("valid_fraction", "test_fraction"):
        value = getattr(split, key)
        if not 0 <= value < 1:
            fail(f"split.{key}", f"must be in [0, 1), got {value}")
    if split.valid_fraction + split.test_fraction >= 1:
        fail("split.test_fraction", "valid_fraction + test_fraction must be < 1")
    if split.boundaries is not None:
        if split.method is not SplitMethod.TIME:
            fail("split.boundaries", "only for method: time")
        b = split.boundaries
        if len(b) != 2 or b[0] > b[1]:
            fail("split.boundaries", f"expected [valid_start, test_start] ascending, got {b}")


def _check_split_keys(mapping: dict, key: str, fail) -> None:
    for name in mapping:
        if name not in ("train", "valid", "test"):
            fail(f"{key}.{name}", "expected train, valid or test")
