"""Feature specs: what a data set's columns are and how they map onto embedding tables.

A data set directory (from ``embedtrain datagen`` or ``embedtrain ingest``) holds ``metadata.json``;
:func:`load_dataset_meta` reads it into a :class:`DatasetMeta`. Models are built from the
:class:`FeatureSpec` inside it, loaders from the same spec, so the two can never disagree.
The label is a number (CTR clicks) unless the metadata gives ``num_classes``: then it holds class
ids, one per row or a list of at most ``max_labels`` (extreme classification).

Example:
    >>> meta = load_dataset_meta("data/synthetic_ctr")
    >>> [t.name for t in meta.features.sparse][:2]
    ['C1', 'C2']
"""

from __future__ import annotations

import enum
import json
import os
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from embedtrain.config_io import ConfigError, config_field, from_dict

METADATA_FILE = "metadata.json"
# The index a generator of day partitions writes (embedtrain.datagen.drift_days); partitions are
# found without it: the sub-folders holding a metadata.json.
PARTITIONS_FILE = "partitions.json"


class DenseTransform(enum.Enum):
    NONE = "none"
    LOG1P = "log1p"  # Criteo-style counts: log(1 + max(x, 0))


@dataclass(frozen=True)
class SparseFeature:
    """A categorical feature: integer ids in ``[0, num_embeddings)``, one per row or a list.

    ``raw``: the ids are raw int64 values in ``[0, 2^63)`` (``encoding: raw`` ingestion, no
    vocabulary); ``num_embeddings`` then only counts the training split's distinct values, and
    the feature needs a dynamic table (``tables: [{kind: dynamic, capacity: N}]``) to be looked up.
    ``max_length``: the most ids a row's list may hold (0: no bound given); a single-valued
    feature's rows hold one id each, or a list of at most one.
    """

    name: str
    num_embeddings: int
    multi_hot: bool = False
    max_length: int = 1
    raw: bool = False


@dataclass(frozen=True)
class FeatureSpec:
    """The columns a model consumes: one label, dense floats, sparse id features.

    ``num_classes=None``: the label is a number (read as float32) in ``label_range`` (a click
    in [0, 1] by default; None: any finite number). An int: the label column holds class ids in
    ``[0, num_classes)`` (read as int64), one per row, or, in a list column, at most
    ``max_labels`` per row (multi-label).
    """

    label: str
    dense: tuple[str, ...]
    sparse: tuple[SparseFeature, ...]
    dense_transform: DenseTransform = DenseTransform.NONE
    num_classes: Optional[int] = None
    max_labels: int = 1
    label_range: Optional[tuple[float, float]] = (0.0, 1.0)

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse]

    @property
    def columns(self) -> list[str]:
        return [self.label, *self.dense, *self.sparse_names]


@dataclass(frozen=True)
class DatasetMeta:
    """A data set directory: its name, feature spec and split files."""

    root: Path
    name: str
    features: FeatureSpec
    split_files: dict[str, tuple[Path, ...]]
    split_rows: dict[str, int]
    extra: dict[str, Any] = field(default_factory=dict)
    # a partitioned data set's partitions read (in order), each a data set under ``root``
    partitions: tuple[str, ...] = ()

    def files(self, split: str) -> tuple[Path, ...]:
        if split not in self.split_files:
            raise ValueError(
                f"{self.root / METADATA_FILE}: no split {split!r} (has: {', '.join(self.split_files)})"
            )
        return self.split_files[split]


class DatasetError(ValueError):
    """A data set directory or its metadata is unusable; the message names the file and key."""


@dataclass
class _SparseEntry:
    """One entry of ``metadata.json``'s ``sparse`` list."""

    name: str
    num_embeddings: int = config_field(check=(lambda v: 0 < v < 2**63,
                                              "must be positive and fit an int64 id"))
    multi_hot: bool = False
    # the longest list a row may hold (single-valued: 1); a multi-hot entry without it has no
    # bound (0 in SparseFeature)
    max_length: Optional[int] = config_field(None, check=(lambda v: v >= 1,
                                                          "expected an integer >= 1"))
    raw: bool = False  # raw int64 ids (encoding: raw): num_embeddings counts distinct values


@dataclass
class _SplitEntry:
    """One entry of ``metadata.json``'s ``splits``: its files (relative to the data set) and rows."""

    files: list[str]
    rows: int = -1


@dataclass
class _MetadataFile:
    """The keys of ``metadata.json`` that :func:`load_dataset_meta` reads (loaded through
    :func:`embedtrain.config_io.from_dict`); every other key stays in ``DatasetMeta.extra``."""

    label: str
    dense: list[str]
    sparse: list[_SparseEntry]
    splits: dict[str, _SplitEntry]
    name: Optional[str] = None
    format_version: int = 1
    dense_transform: DenseTransform = DenseTransform.NONE
    num_classes: Optional[int] = config_field(None, check=(lambda v: v >= 2,
                                                           "expected an integer >= 2"))
    max_labels: Optional[int] = config_field(None, check=(lambda v: v >= 1,
                                                          "expected an integer >= 1"))
    labels_per_row: Optional[list[int]] = config_field(
        None, check=(lambda v: v >= 1, "expected [lo, hi] with 1 <= lo <= hi"))
    label_range: Optional[list[float]] = config_field(factory=lambda: [0.0, 1.0])


def list_partitions(root: str | os.PathLike) -> list[str]:
    """The partitions of a partitioned data set: ``root``'s sub-folders holding a
    ``metadata.json``, in name order (``day=001`` ..., ``dt=2026-12-01`` ...); [] for none."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if (d / METADATA_FILE).is_file())


def load_dataset_meta(root: str | os.PathLike,
                      partitions: Optional[Sequence[str]] = None) -> DatasetMeta:
    """Reads ``root/metadata.json``, or a partitioned data set's partitions.

    A partitioned data set is a folder of data sets (``root/<partition>/metadata.json``, each
    ingested by the same spec or written by ``datagen ctr --drift --days``). Read with
    ``partitions`` (default: all, in name order), its splits hold the partitions' files in that
    order, its features are theirs (the same columns in each; a table is sized by the largest
    partition's ``num_embeddings``: an extended vocabulary keeps earlier ids and appends).

    Args:
        root: the data set directory.
        partitions: the partitions to read (names of sub-folders of ``root``).

    Returns:
        The parsed metadata.

    Raises:
        DatasetError: missing directory/file or a missing/invalid key (named in the message).
    """
    root = Path(root)
    path = root / METADATA_FILE
    found = list_partitions(root) if not path.is_file() else []
    if found or partitions is not None:
        return _load_partitions(root, found, partitions)
    if not path.is_file():
        hint = " (generate one with: embedtrain datagen ctr|xc --out DIR)" if not root.exists() else ""
        raise DatasetError(f"{path}: data set metadata not found{hint}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    try:
        m = from_dict(_MetadataFile, raw, source=str(path), ignore_unknown=True)
    except ConfigError as e:
        raise DatasetError(str(e)) from None
    sparse = [SparseFeature(e.name, e.num_embeddings, e.multi_hot,
                            e.max_length or (0 if e.multi_hot else 1), e.raw)
              for e in m.sparse]
    names = [m.label, *m.dense, *[f.name for f in sparse]]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise DatasetError(f"{path}: column(s) named twice: {', '.join(dupes)}")
    max_labels = m.max_labels
    if max_labels is None and m.labels_per_row is not None:
        per_row = m.labels_per_row
        if len(per_row) != 2 or per_row[1] < per_row[0]:
            raise DatasetError(
                f"{path}: labels_per_row: expected [lo, hi] with 1 <= lo <= hi, got {per_row!r}")
        max_labels = per_row[1]
    features = FeatureSpec(
        label=m.label, dense=tuple(m.dense), sparse=tuple(sparse),
        dense_transform=m.dense_transform, num_classes=m.num_classes,
        max_labels=max_labels or 1,
        label_range=tuple(m.label_range) if m.label_range is not None else None,
    )
    split_files = {split: tuple(root / f for f in e.files) for split, e in m.splits.items()}
    split_rows = {split: e.rows for split, e in m.splits.items()}
    # num_classes, max_labels and labels_per_row stay in `extra` too: code reads them from there.
    known = {"format_version", "name", "label", "dense", "dense_transform", "sparse", "splits",
             "label_range"}
    return DatasetMeta(
        root=root,
        name=m.name if m.name is not None else root.name,
        features=features,
        split_files=split_files,
        split_rows=split_rows,
        extra={k: v for k, v in raw.items() if k not in known},
    )


def _load_partitions(root: Path, found: list[str], partitions: Optional[Sequence[str]]
                     ) -> DatasetMeta:
    """The partitions' data sets read as one (see :func:`load_dataset_meta`)."""
    if not found:
        raise DatasetError(f"{root}: data.partitions given, but {root} is not a partitioned data "
                           f"set (no sub-folder holds a {METADATA_FILE})")
    names = list(found if partitions is None else partitions)
    if not names:
        raise DatasetError(f"{root}: data.partitions: empty (has: {', '.join(found)})")
    unknown = [n for n in names if n not in found]
    if unknown:
        raise DatasetError(f"{root}: no partition {unknown[0]!r} (has: {', '.join(found)})")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DatasetError(f"{root}: partition {twice[0]!r} named twice")
    parts = [load_dataset_meta(root / n) for n in names]
    first = parts[0].features

    def shape(f: FeatureSpec) -> tuple:
        return (f.label, f.dense, [(s.name, s.multi_hot, s.raw) for s in f.sparse],
                f.dense_transform, f.num_classes)

    for part in parts[1:]:
        if shape(part.features) != shape(first):
            raise DatasetError(f"{part.root / METADATA_FILE}: its columns differ from "
                               f"{parts[0].root / METADATA_FILE}'s: the partitions of one data "
                               f"set are ingested by one spec")
    sparse = tuple(dataclasses.replace(
        s, num_embeddings=max(p.features.sparse[i].num_embeddings for p in parts),
        max_length=0 if s.multi_hot and any(p.features.sparse[i].max_length == 0 for p in parts)
        else max(p.features.sparse[i].max_length for p in parts))
        for i, s in enumerate(first.sparse))
    splits = list(dict.fromkeys(s for p in parts for s in p.split_files))
    return DatasetMeta(
        root=root, name=root.name,
        features=dataclasses.replace(parts[-1].features, sparse=sparse),
        split_files={s: tuple(f for p in parts for f in p.split_files.get(s, ()))
                     for s in splits},
        split_rows={s: (-1 if any(p.split_rows.get(s, 0) < 0 for p in parts)
                        else sum(p.split_rows.get(s, 0) for p in parts)) for s in splits},
        extra=parts[-1].extra, partitions=tuple(names))  # the newest's other keys
