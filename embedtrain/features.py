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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

METADATA_FILE = "metadata.json"


class DenseTransform(enum.Enum):
    NONE = "none"
    LOG1P = "log1p"  # Criteo-style counts: log(1 + max(x, 0))


@dataclass(frozen=True)
class SparseFeature:
    """A categorical feature: integer ids in ``[0, num_embeddings)``, one per row or a list."""

    name: str
    num_embeddings: int
    multi_hot: bool = False
    max_length: int = 1


@dataclass(frozen=True)
class FeatureSpec:
    """The columns a model consumes: one label, dense floats, sparse id features.

    ``num_classes=None``: the label is a number (read as float32). An int: the label column holds
    class ids in ``[0, num_classes)`` (read as int64), one per row, or, in a list column, at most
    ``max_labels`` per row (multi-label).
    """

    label: str
    dense: tuple[str, ...]
    sparse: tuple[SparseFeature, ...]
    dense_transform: DenseTransform = DenseTransform.NONE
    num_classes: Optional[int] = None
    max_labels: int = 1

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

    def files(self, split: str) -> tuple[Path, ...]:
        if split not in self.split_files:
            raise ValueError(
                f"{self.root / METADATA_FILE}: no split {split!r} (has: {', '.join(self.split_files)})"
            )
        return self.split_files[split]


class DatasetError(ValueError):
    """A data set directory or its metadata is unusable; the message names the file and key."""


def load_dataset_meta(root: str | os.PathLike) -> DatasetMeta:
    """Reads ``root/metadata.json``.

    Args:
        root: the data set directory.

    Returns:
        The parsed metadata.

    Raises:
        DatasetError: missing directory/file or a missing/invalid key (named in the message).
    """
    root = Path(root)
    path = root / METADATA_FILE
    if not path.is_file():
        hint = " (generate one with: embedtrain datagen ctr|xc --out DIR)" if not root.exists() else ""
        raise DatasetError(f"{path}: data set metadata not found{hint}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None

    def get(obj: dict, key: str, typ: type, where: str) -> Any:
        if key not in obj:
            raise DatasetError(f"{path}: {where}{key}: missing")
        if not isinstance(obj[key], typ):
            raise DatasetError(f"{path}: {where}{key}: expected {typ.__name__}, got {obj[key]!r}")
        return obj[key]

    sparse = []
    for i, item in enumerate(get(raw, "sparse", list, "")):
        where = f"sparse[{i}]."
        num = get(item, "num_embeddings", int, where)
        if num <= 0:
            raise DatasetError(f"{path}: {where}num_embeddings: must be positive, got {num}")
        sparse.append(
            SparseFeature(
                name=get(item, "name", str, where),
                num_embeddings=num,
                multi_hot=bool(item.get("multi_hot", False)),
                max_length=int(item.get("max_length", 1)),
            )
        )
    names = [get(raw, "label", str, ""), *get(raw, "dense", list, ""), *[s.name for s in sparse]]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise DatasetError(f"{path}: column(s) named twice: {', '.join(dupes)}")
    try:
        transform = DenseTransform(raw.get("dense_transform", "none"))
    except ValueError:
        raise DatasetError(f"{path}: dense_transform: unknown {raw['dense_transform']!r}") from None
    num_classes = raw.get("num_classes")
    if num_classes is not None and not _is_int(num_classes, 2):
        raise DatasetError(f"{path}: num_classes: expected an int >= 2, got {num_classes!r}")
    if "max_labels" in raw:
        max_labels = raw["max_labels"]
        if not _is_int(max_labels, 1):
            raise DatasetError(f"{path}: max_labels: expected an int >= 1, got {max_labels!r}")
    elif "labels_per_row" in raw:
        per_row = raw["labels_per_row"]
        if not (isinstance(per_row, list) and len(per_row) == 2 and _is_int(per_row[0], 1)
                and _is_int(per_row[1], per_row[0])):
            raise DatasetError(
                f"{path}: labels_per_row: expected [lo, hi] with 1 <= lo <= hi, got {per_row!r}")
        max_labels = per_row[1]
    else:
        max_labels = 1
    features = FeatureSpec(
        label=raw["label"], dense=tuple(raw["dense"]), sparse=tuple(sparse),
        dense_transform=transform, num_classes=num_classes, max_labels=max_labels,
    )
    split_files, split_rows = {}, {}
    for split, info in get(raw, "splits", dict, "").items():
        files = tuple(root / f for f in get(info, "files", list, f"splits.{split}."))
        split_files[split] = files
        split_rows[split] = int(info.get("rows", -1))
    # num_classes, max_labels and labels_per_row stay in `extra` too: code reads them from there.
    known = {"format_version", "name", "label", "dense", "dense_transform", "sparse", "splits"}
    return DatasetMeta(
        root=root,
        name=str(raw.get("name", root.name)),
        features=features,
        split_files=split_files,
        split_rows=split_rows,
        extra={k: v for k, v in raw.items() if k not in known},
    )


def _is_int(value: Any, least: int) -> bool:
    """Whether a JSON value is an integer (not a bool) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
