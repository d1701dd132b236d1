"""The XC ingestion spec: ``kind: xc`` YAML (``configs/ingest/xc_repository.yaml``,
``configs/ingest/xc_parquet.yaml``).

An extreme-classification (multi-label) job reads a bag of tokens and one or more labels per row
from one of two layouts:

- ``format: xc_repository``: the Extreme Classification Repository's sparse text files (Bibtex,
  Delicious, EURLex-4K, ...): line 1 the header ``num_rows num_features num_labels``, then one
  row per line, ``l1,l2,... f:v f:v ...`` (labels comma-separated, possibly none; features
  ``id:value``, ids 0-based). Labels are class ids in ``[0, num_labels)``; a row's tokens are
  its feature ids + 1 (id 0 stays the unknown bucket: ``num_embeddings = num_features + 1``).
  The values are checked but not used: the encoder sum/mean-pools token embeddings, so a token
  counts once per occurrence whatever its value (``tokens.values_column`` keeps them as a
  ``list<float32>`` column beside the tokens, which training ignores);
- ``format: parquet`` / ``csv``: a token column (a list of strings or integers, or a text
  column split on ``tokens.separator``) and a label column (one id or string per row, or a list:
  a parquet list column, or a text cell split on ``labels.separator``).

:func:`pipelines.kind_of` tells an XC spec from the others; :func:`load_spec` reads it into an
:class:`XCIngestSpec` (through :mod:`embedtrain.config_io`: one-line errors naming the file and
key) and checks what spans keys. The job itself is :mod:`pipelines.xc.passes`.

Example:
    >>> spec = load_spec("configs/ingest/xc_repository.yaml")
    >>> spec.input.format, spec.split.resolved_method
    (<XCFormat.XC_REPOSITORY: 'xc_repository'>, <SplitMethod.HASH: 'hash'>)
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Optional


from embedtrain.config_io import ConfigError, load_dataclass
from pipelines.core.fields import DenseSpec, Encoding, OutputSpec, SplitMethod, ValueType

WHITESPACE = " "  # tokens.separator " ": split on runs of whitespace (spaces, tabs, newlines)


class XCFormat(enum.Enum):
    XC_REPOSITORY = "xc_repository"  # header line, then "l1,l2 f:v f:v" per line
    CSV = "csv"                      # header line; separator configurable
    PARQUET = "parquet"


@dataclass
class XCInputSpec:
    # xc_repository, csv or parquet
    format: XCFormat = XCFormat.XC_REPOSITORY
    separator: Optional[str] = None  # csv only (default ","): the field separator
    null_values: list[str] = field(default_factory=list)  # csv: extra null markers


@dataclass
class TokenSpec:
    """The token bag of each row (the encoder's one sparse feature).

    ``column`` is the input column (tables only; default ``tokens``), ``name`` the output column
    (``token_column`` in ``metadata.json``). ``encoding: vocab`` gives the training split's
    tokens seen at least ``min_frequency`` times ids ``1..V`` (most frequent first, ties by
    value; ``max_vocab_size`` keeps the V most frequent), every other token id 0; ``hash`` maps a
    token to ``1 + stable_hash(token) mod (hash_buckets - 1)``; ``pre_encoded`` integer ids are
    kept and must lie in ``[0, num_embeddings)``. ``xc_repository`` tokens are always the feature
    ids + 1 (leave these keys out).
    """

    column: Optional[str] = None          # input column (tables; default "tokens")
    name: str = "tokens"                  # output column
    dtype: Optional[ValueType] = None     # None: parquet's type; csv: integer iff pre_encoded
    separator: Optional[str] = None       # a text column's token separator (" ": whitespace)
    lowercase: bool = False               # text tokens lowercased before counting
    encoding: Optional[Encoding] = None   # None: vocab (xc_repository: the feature ids + 1)
    # vocab: tokens seen fewer times than this in the train split are id 0
    min_frequency: int = 1
    # vocab: keep only the most frequent tokens
    max_vocab_size: Optional[int] = None
    hash_buckets: Optional[int] = None    # hash: num_embeddings, bucket 0 included
    num_embeddings: Optional[int] = None  # pre_encoded: ids must lie in [0, num_embeddings)
    max_length: Optional[int] = None      # longer bags are truncated (counted)
    values_column: Optional[str] = None   # xc_repository: keep the feature values here

    @property
    def source(self) -> str:
        return self.column if self.column is not None else "tokens"


@dataclass
class LabelSpec:
    """The labels of each row: one class (a scalar column) or several (a list, or a text cell
    split on ``separator``; multi-label).

    ``encoding: vocab`` gives the training split's labels seen at least ``min_frequency`` times
    class ids ``0..C-1`` (most frequent first, ties by value; ``max_vocab_size`` keeps the C most
    frequent); there is no unknown class: any other label is removed from its row (counted as
    ``label_out_of_vocabulary``), and a row left without a label is dropped (``no_label``).
    ``pre_encoded`` integer ids must lie in ``[0, num_classes)`` (else the row is dropped,
    ``label_out_of_range``). ``xc_repository`` labels are the header's ``num_labels`` classes.
    """

    column: Optional[str] = None          # input column (tables; default "labels")
    name: Optional[str] = None            # output column (default: labels, or label if single)
    dtype: Optional[ValueType] = None     # None: parquet's type; csv: integer iff pre_encoded
    separator: Optional[str] = None       # a text cell holding a list: its separator
    encoding: Optional[Encoding] = None   # vocab | pre_encoded (None: vocab; xc_repository: ids)
    # vocab: labels seen fewer times than this in the train split are removed (counted)
    min_frequency: int = 1
    # vocab: keep only the most frequent labels as classes
    max_vocab_size: Optional[int] = None
    num_classes: Optional[int] = None     # pre_encoded: ids must lie in [0, num_classes)

    @property
    def source(self) -> str:
        return self.column if self.column is not None else "labels"


@dataclass
class XCSplitSpec:
    """How rows are split.

    ``method: hash`` (the default without ``files``): ``u = unit_interval(hash)`` of the key
    ``column``'s text (tables only), or of the row's position in the input (lines, for
    ``xc_repository``, in file order); ``u < test_fraction`` is test, the next ``valid_fraction``
    valid, the rest train. ``method: files`` (the default with ``files``):
    ``files: {test: GLOB, valid: GLOB}``, matched against each input file's path or name; a glob
    that matches no ``--input`` file names files of its own (relative to the working directory),
    which are read too. Rows of the other files are train, except that a split without a glob
    takes its ``*_fraction`` of them by the hash (``valid_fraction: 0``: no valid split).
    """

    method: Optional[SplitMethod] = None  # hash | files (None: files if files are given)
    column: Optional[str] = None          # hash key column (tables; None: the row position)
    # hash: the share of rows for valid (files: of the train files' rows, without a valid glob)
    valid_fraction: float = 0.1
    # hash: the share of rows for test (files: as valid_fraction)
    test_fraction: float = 0.1
    seed: Optional[int] = None            # of the hash (None: 0)
    # files: {test: GLOB, valid: GLOB} matched against the input files' paths or names
    files: Optional[dict[str, str]] = None

    @property
    def hash_seed(self) -> int:
        return self.seed or 0

    @property
    def resolved_method(self) -> SplitMethod:
        if self.method is not None:
            return self.method
        return SplitMethod.FILES if self.files else SplitMethod.HASH

    def fraction(self, split: str) -> float:
        """The share of the train files' rows that ``split`` takes by the hash."""
        if self.resolved_method is SplitMethod.FILES and split in (self.files or {}):
            return 0.0
        return self.valid_fraction if split == "valid" else self.test_fraction


@dataclass
class XCIngestSpec:
    """A whole XC ingestion job.

    ``dense`` features (tables only) are the shared :class:`~pipelines.core.fields.DenseSpec`: a
    NaN or infinite value stops the job naming its file, line (parquet: 0-based row) and column,
    unless ``non_finite: fill`` replaces it with ``fill_null`` (counted in the report's
    ``repairs.dense_non_finite_filled``).
    """

    # this spec's family (pipelines.kind_of reads it)
    kind: str = "xc"
    name: Optional[str] = None            # default: the first input file's name
    # the input files' layout
    input: XCInputSpec = field(default_factory=XCInputSpec)
    tokens: TokenSpec = field(default_factory=TokenSpec)
    labels: LabelSpec = field(default_factory=LabelSpec)
    dense: list[DenseSpec] = field(default_factory=list)  # optional float columns (tables)
    split: XCSplitSpec = field(default_factory=XCSplitSpec)
    # the written parquet files' layout
    output: OutputSpec = field(default_factory=OutputSpec)
    dropped_line_examples: int = 20       # per drop reason: the report's first N lines (rows)

    @property
    def repository(self) -> bool:
        return self.input.format is XCFormat.XC_REPOSITORY

    @property
    def is_text(self) -> bool:
        return self.input.format is not XCFormat.PARQUET

    @property
    def token_encoding(self) -> Encoding:
        if self.repository:
            return Encoding.PRE_ENCODED
        return self.tokens.encoding or Encoding.VOCAB

    @property
    def label_encoding(self) -> Encoding:
        if self.repository:
            return Encoding.PRE_ENCODED
        return self.labels.encoding or Encoding.VOCAB



def load_spec(path: str | os.PathLike, overrides: Optional[list[str]] = None
                 ) -> XCIngestSpec:
    """Reads and validates an XC ingestion spec.

    Args:
        path: the YAML file.
        overrides: ``key.path=value`` strings (``split.files.test=test.txt``).

    Raises:
        ConfigError: one line naming the file and key path.

    Example:
        >>> load_spec("configs/ingest/xc_parquet.yaml").labels.separator is None
        True
    """
    spec = load_dataclass(path, XCIngestSpec, overrides)
    validate_xc_spec(spec, str(path))
    s = spec.split
    if s.fraction("valid") == 0 and s.fraction("test") == 0:  # nothing is split by the hash
        for key in ("seed", "column"):
            if getattr(s, key) is not None:
                raise ConfigError(f"{path}: split.{key}: no row is split by the hash (the files "
                                  f"name both test and valid, or both fractions are 0); remove "
                                  f"it")
    return spec


def validate_xc_spec(spec: XCIngestSpec, source: str = "<spec>") -> None:
    """Checks what the types alone cannot: keys that only some formats take, ranges, names.

    Raises:
        ConfigError: naming ``source`` and the offending key path.
    """
    def fail(key: str, message: str) -> None:
        raise ConfigError(f"{source}: {key}: {message}")

    if spec.kind != "xc":
        fail("kind", f"expected 'xc', got {spec.kind!r}")
    t, lab = spec.tokens, spec.labels
    if spec.input.separator is not None and (spec.input.format is not XCFormat.CSV
                                             or len(spec.input.separator) != 1):
        fail("input.separator", "one character, for format: csv only")
    if spec.input.null_values and spec.input.format is not XCFormat.CSV:
        fail("input.null_values", "for format: csv only")
    if spec.repository:
        _validate_repository(spec, fail)
    else:
        if t.values_column is not None:
            fail("tokens.values_column", "only for format: xc_repository (feature values)")
        _validate_tokens(spec, fail)
        _validate_labels(spec, fail)
    # the label column's default name: labels (a list per row), or label (one per row)
    outputs = ([("labels.name", lab.name)] if lab.name is not None else
               [("labels.name (default)", "labels"), ("labels.name (default)", "label")])
    outputs.append(("tokens.name", t.name))
    if t.values_column is not None:
        outputs.append(("tokens.values_column", t.values_column))
    outputs += [(f"dense[{i}].name", d.name) for i, d in enumerate(spec.dense)]
    seen: dict[str, str] = {}
    for key, name in outputs:
        if not name:
            fail(key, "must not be empty")
        if name.startswith("__"):
            fail(key, f"names starting with '__' are reserved, got {name!r}")
        if name in seen:
            fail(key, f"column {name!r} is named twice (also {seen[name]})")
        seen[name] = key
    inputs = {lab.source, *(d.name for d in spec.dense), spec.split.column} - {None}
    if not spec.repository and t.name != t.source and t.name in inputs:
        fail("tokens.name", f"{t.name!r} is another input column; name the output otherwise")
    for i, d in enumerate(spec.dense):
        if not spec.repository and d.name in (t.source, lab.source):
            fail(f"dense[{i}].name", f"{d.name!r} is the token or label column")
        if d.clip_min is not None and d.clip_max is not None and d.clip_min > d.clip_max:
            fail(f"dense[{i}].clip_min", f"{d.clip_min} is above clip_max {d.clip_max}")
    _validate_split(spec, fail)
    if spec.output.rows_per_file < 1:
        fail("output.rows_per_file", f"must be >= 1, got {spec.output.rows_per_file}")
    if spec.output.rows_per_row_group < 1:
        fail("output.rows_per_row_group", f"must be >= 1, got {spec.output.rows_per_row_group}")
    if spec.dropped_line_examples < 0:
        fail("dropped_line_examples", f"must be >= 0, got {spec.dropped_line_examples}")


def _validate_repository(spec: XCIngestSpec, fail) -> None:
    t, lab = spec.tokens, spec.labels
    why = ("xc_repository tokens are the feature ids + 1 (num_embeddings = num_features + 1) and "
           "labels the header's num_labels classes")
    for key, value in [("tokens.column", t.column), ("tokens.dtype", t.dtype),
                       ("tokens.separator", t.separator), ("tokens.encoding", t.encoding),
                       ("tokens.max_vocab_size", t.max_vocab_size),
                       ("tokens.hash_buckets", t.hash_buckets),
                       ("tokens.num_embeddings", t.num_embeddings),
                       ("labels.column", lab.column), ("labels.dtype", lab.dtype),
                       ("labels.separator", lab.separator), ("labels.encoding", lab.encoding),
                       ("labels.max_vocab_size", lab.max_vocab_size),
                       ("labels.num_classes", lab.num_classes)]:
        if value is not None:
            fail(key, f"not for format: xc_repository ({why}); remove it")
    for key, value in [("tokens.lowercase", t.lowercase), ("tokens.min_frequency",
                                                           t.min_frequency != 1),
                       ("labels.min_frequency", lab.min_frequency != 1)]:
        if value:
            fail(key, f"not for format: xc_repository ({why}); remove it")
    if spec.dense:
        fail("dense", "xc_repository files have no dense columns")
    if spec.split.column is not None:
        fail("split.column", "xc_repository rows have no columns; the hash is of the line's "
             "position (leave split.column out)")
    if t.max_length is not None and t.max_length < 1:
        fail("tokens.max_length", f"must be >= 1, got {t.max_length}")


def _validate_tokens(spec: XCIngestSpec, fail) -> None:
    t = spec.tokens
    enc = spec.token_encoding
    if t.column is not None and not t.column:
        fail("tokens.column", "must not be empty")
    if enc is Encoding.RAW:
        fail("tokens.encoding", "raw ids are for kind: ctr specs; XC tokens are vocab, hash "
             "or pre_encoded (a dynamic table can still take pre_encoded token ids)")
    if enc is Encoding.HASH and (t.hash_buckets is None or t.hash_buckets < 2):
        fail("tokens.hash_buckets", f"hash encoding needs hash_buckets >= 2, got {t.hash_buckets}")
    if enc is not Encoding.HASH and t.hash_buckets is not None:
        fail("tokens.hash_buckets", f"only for encoding: hash (tokens are {enc.value})")
    if enc is Encoding.PRE_ENCODED:
        if t.dtype is ValueType.STRING:
            fail("tokens.dtype", "pre_encoded ids must be dtype: integer (or left out)")
        if t.num_embeddings is None or t.num_embeddings < 1:
            fail("tokens.num_embeddings", f"pre_encoded needs num_embeddings >= 1, got "
                 f"{t.num_embeddings}")
        if t.lowercase:
            fail("tokens.lowercase", "only for text tokens (these are pre_encoded ids)")
    elif t.num_embeddings is not None:
        fail("tokens.num_embeddings", "only for encoding: pre_encoded (else it is computed)")
    if enc is not Encoding.VOCAB:
        if t.min_frequency != 1 or t.max_vocab_size is not None:
            fail("tokens.min_frequency" if t.min_frequency != 1 else "tokens.max_vocab_size",
                 f"only for encoding: vocab (tokens are {enc.value})")
    _check_vocab_limits(t.min_frequency, t.max_vocab_size, "tokens", fail)
    if t.max_length is not None and t.max_length < 1:
        fail("tokens.max_length", f"must be >= 1, got {t.max_length}")
    if spec.input.format is XCFormat.CSV and not t.separator:
        fail("tokens.separator", "a csv token column is text: give the separator of its tokens "
             "(' ' splits on whitespace)")


def _validate_labels(spec: XCIngestSpec, fail) -> None:
    lab = spec.labels
    enc = spec.label_encoding
    if lab.column is not None and not lab.column:
        fail("labels.column", "must not be empty")
    if lab.source == spec.tokens.source:
        fail("labels.column", f"{lab.source!r} is also the token column")
    if enc in (Encoding.HASH, Encoding.RAW):
        fail("labels.encoding", "labels are vocab (ids by training frequency) or pre_encoded; "
             f"{'hashing would merge classes' if enc is Encoding.HASH else 'class ids index the head'}")
    if enc is Encoding.PRE_ENCODED:
        if lab.dtype is ValueType.STRING:
            fail("labels.dtype", "pre_encoded class ids must be dtype: integer (or left out)")
        if lab.num_classes is None or lab.num_classes < 2:
            fail("labels.num_classes", f"pre_encoded needs num_classes >= 2, got "
                 f"{lab.num_classes}")
        if lab.min_frequency != 1 or lab.max_vocab_size is not None:
            fail("labels.min_frequency" if lab.min_frequency != 1 else "labels.max_vocab_size",
                 "only for encoding: vocab (labels are pre_encoded)")
    elif lab.num_classes is not None:
        fail("labels.num_classes", "only for encoding: pre_encoded (else it is computed)")
    _check_vocab_limits(lab.min_frequency, lab.max_vocab_size, "labels", fail)
    if lab.separator is not None and lab.separator == "":
        fail("labels.separator", "must not be empty")


def _check_vocab_limits(min_frequency: int, max_size: Optional[int], key: str, fail) -> None:
    if min_frequency < 1:
        fail(f"{key}.min_frequency", f"must be >= 1, got {min_frequency}")
    if max_size is not None and max_size < 1:
        fail(f"{key}.max_vocab_size", f"must be >= 1, got {max_size}")


def _validate_split(spec: XCIngestSpec, fail) -> None:
    s = spec.split
    method = s.resolved_method
    if method not in (SplitMethod.HASH, SplitMethod.FILES):
        fail("split.method", f"kind: xc splits by hash or files, got {method.value}")
    if s.files is not None and method is not SplitMethod.FILES:
        fail("split.files", "only for method: files (leave split.method out to imply it)")
    if method is SplitMethod.FILES:
        if not s.files:
            fail("split.files", "method: files needs files: {test: GLOB, valid: GLOB}")
        for name in s.files:
            if name not in ("valid", "test"):
                fail(f"split.files.{name}", "expected valid or test (train is every file no "
                     "other split's glob matches)")
    for key in ("valid_fraction", "test_fraction"):
        value = getattr(s, key)
        if not 0 <= value < 1:
            fail(f"split.{key}", f"must be in [0, 1), got {value}")
    if s.fraction("valid") + s.fraction("test") >= 1:
        fail("split.test_fraction", "valid_fraction + test_fraction must be < 1")
    if s.column is not None:
        if not s.column:
            fail("split.column", "must not be empty")
        if s.column in (spec.tokens.source, spec.labels.source):
            fail("split.column", f"{s.column!r} is the token or label column; a split key needs "
                 "one value per row")
