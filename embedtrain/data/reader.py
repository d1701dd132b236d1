"""Parquet row groups to TorchRec batches, vectorised with Arrow and NumPy (no per-row Python).

A :class:`ParquetBatchReader` walks the row groups of a split's parquet files and yields
``torchrec.datasets.utils.Batch`` objects: ``dense_features`` (float32 ``[B, n_dense]``),
``sparse_features`` (a ``KeyedJaggedTensor`` with one key per sparse feature, single ids or lists)
and ``labels`` (float32 ``[B]``).

The unit of work is the row group: the reader lists ``(file, row_group)`` units, optionally
shuffles their order and keeps a shuffle buffer of rows, and gives rank ``r`` of ``world_size`` the
units ``r, r + world_size, ...``. Everything is a pure function of ``(seed, epoch)``, which makes
resuming mid-epoch exact (``iter_epoch(epoch, skip_batches=k)``).

Example:
    >>> meta = load_dataset_meta("data/synthetic_ctr")
    >>> reader = ParquetBatchReader(meta.files("train"), meta.features, batch_size=1024)
    >>> batch = next(iter(reader))
    >>> batch.sparse_features.keys()[:2]
    ['C1', 'C2']
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedtrain.features import DenseTransform, FeatureSpec


class DataError(ValueError):
    """Bad input data; the message names the file, column and (where known) row."""


@dataclass(frozen=True)
class RowGroup:
    file: Path
    index: int
    num_rows: int
    first_row: int  # row number of the group's first row within its file, for error messages


class _Columns:
    """One shuffled chunk of rows as NumPy arrays, cheap to slice into batches."""

    def __init__(self, table: pa.Table, features: FeatureSpec) -> None:
        self.num_rows = table.num_rows
        self.labels = table.column(features.label).to_numpy().astype(np.float32)
        dense = [table.column(name).to_numpy() for name in features.dense]
        self.dense = (
            np.stack(dense, axis=1).astype(np.float32)
            if dense
            else np.zeros((self.num_rows, 0), np.float32)
        )
        if features.dense_transform is DenseTransform.LOG1P:
            self.dense = np.log1p(np.maximum(self.dense, 0.0))
        # Per sparse feature: ids (int64) and, for list features, row offsets into them.
        self.ids: list[np.ndarray] = []
        self.offsets: list[Optional[np.ndarray]] = []
        for feat in features.sparse:
            column = table.column(feat.name)
            if _is_list(column.type):
                arr = column.combine_chunks()
                offsets = arr.offsets.to_numpy().astype(np.int64)
                values = arr.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
                self.offsets.append(offsets - offsets[0])
            else:
                values = column.to_numpy()
                self.offsets.append(None)
            self.ids.append(values.astype(np.int64, copy=False))

    def batch(self, start: int, stop: int, keys: list[str]) -> Batch:
        values, lengths = [], []
        for ids, offsets in zip(self.ids, self.offsets):
            if offsets is None:
                values.append(ids[start:stop])
                lengths.append(np.ones(stop - start, np.int32))
            else:
                window = offsets[start : stop + 1]
                values.append(ids[window[0] : window[-1]])
                lengths.append(np.diff(window).astype(np.int32))
        return Batch(
            dense_features=torch.from_numpy(self.dense[start:stop]),
            sparse_features=KeyedJaggedTensor(
                keys=keys,
                values=torch.from_numpy(np.concatenate(values)),
                lengths=torch.from_numpy(np.concatenate(lengths)),
            ),
            labels=torch.from_numpy(self.labels[start:stop]),
        )


class ParquetBatchReader:
    """Iterates a split's parquet files as ``Batch``es.

    Args:
        files: parquet files of one split (same schema).
        features: which columns are label, dense and sparse (from the data set's metadata).
        batch_size: rows per batch (per rank).
        shuffle: shuffle row-group order and rows within a buffer, seeded by ``(seed, epoch)``.
        seed: base seed of the shuffle.
        drop_last: drop the last partial batch of an epoch (keep it for evaluation).
        shuffle_buffer_rows: rows mixed together before batches are cut (with ``shuffle``).
        rank: this reader's rank among ``world_size`` readers; each gets disjoint row groups.
        world_size: number of readers sharing the files.
    """

    def __init__(
        self,
        files: Sequence[str | os.PathLike],
        features: FeatureSpec,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        shuffle_buffer_rows: int = 262_144,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not files:
            raise DataError("no parquet files given")
        self.features = features
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.shuffle_buffer_rows = max(shuffle_buffer_rows, batch_size)
        self._keys = features.sparse_names
        self._epoch = 0
        units = []
        for f in map(Path, files):
            units.extend(_row_groups(f, features))
        self.row_groups = units[rank::world_size]

    @property
    def num_rows(self) -> int:
        return sum(u.num_rows for u in self.row_groups)

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_rows, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_epoch(self._epoch)

    def iter_epoch(self, epoch: int, skip_batches: int = 0) -> Iterator[Batch]:
        """Yields the batches of ``epoch``, starting after the first ``skip_batches``."""
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.row_groups)) if self.shuffle else range(len(self.row_groups))
        buffer_rows = self.shuffle_buffer_rows if self.shuffle else self.batch_size
        pending: list[pa.Table] = []
        pending_rows = 0
        emitted = 0
        for i, idx in enumerate(order):
            unit = self.row_groups[idx]
            pending.append(_read_row_group(unit, self.features))
            pending_rows += unit.num_rows
            last = i == len(self.row_groups) - 1
            if pending_rows < buffer_rows and not last:
                continue
            table = pa.concat_tables(pending) if len(pending) > 1 else pending[0]
            if self.shuffle:
                table = table.take(pa.array(rng.permutation(table.num_rows)))
            usable = table.num_rows if last else table.num_rows - table.num_rows % self.batch_size
            cols = _Columns(table.slice(0, usable), self.features)
            for start in range(0, usable, self.batch_size):
                stop = min(start + self.batch_size, usable)
                if stop - start < self.batch_size and self.drop_last:
                    break
                if emitted >= skip_batches:
                    yield cols.batch(start, stop, self._keys)
                emitted += 1
            pending = [table.slice(usable)] if usable < table.num_rows else []
            pending_rows = table.num_rows - usable


def _row_groups(path: Path, features: FeatureSpec) -> list[RowGroup]:
    if not path.is_file():
        raise DataError(f"{path}: parquet file not found")
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file: {e}") from None
    meta = pf.metadata
    names = set(pf.schema_arrow.names)
    missing = [c for c in features.columns if c not in names]
    if missing:
        raise DataError(f"{path}: missing column(s): {', '.join(missing)}")
    units, first = [], 0
    for i in range(meta.num_row_groups):
        n = meta.row_group(i).num_rows
        if n:
            units.append(RowGroup(path, i, n, first))
        first += n
    return units


def _read_row_group(unit: RowGroup, features: FeatureSpec) -> pa.Table:
    try:
        table = pq.ParquetFile(unit.file).read_row_group(unit.index, columns=features.columns)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{unit.file}: row group {unit.index}: cannot read: {e}") from None
    _validate(table, unit, features)
    return table


def _validate(table: pa.Table, unit: RowGroup, features: FeatureSpec) -> None:
    """Checks types, nulls and id ranges of one row group, naming file, column and row."""
    for name in [features.label, *features.dense]:
        column = table.column(name)
        if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)
                or pa.types.is_boolean(column.type)):
            raise DataError(f"{unit.file}: column {name}: expected a number, got {column.type}")
        _check_no_nulls(column, name, unit)
    for feat in features.sparse:
        column = table.column(feat.name)
        _check_no_nulls(column, feat.name, unit)
        ids = pc.list_flatten(column) if _is_list(column.type) else column
        if not pa.types.is_integer(ids.type):
            raise DataError(f"{unit.file}: column {feat.name}: expected integer ids, got {column.type}")
        if ids.null_count:
            raise DataError(f"{unit.file}: column {feat.name}: null id inside a list")
        bounds = pc.min_max(ids)
        lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
        if lo is not None and (lo < 0 or hi >= feat.num_embeddings):
            values = column if not _is_list(column.type) else None
            row = ""
            if values is not None:
                bad = pc.or_(pc.less(values, 0), pc.greater_equal(values, feat.num_embeddings))
                row = f" at row {unit.first_row + pc.index(bad, True).as_py()}"
            raise DataError(
                f"{unit.file}: column {feat.name}: id {lo if lo < 0 else hi} outside "
                f"[0, {feat.num_embeddings}){row}"
            )


def _is_list(tp: pa.DataType) -> bool:
    return pa.types.is_list(tp) or pa.types.is_large_list(tp)


def _check_no_nulls(column: pa.ChunkedArray, name: str, unit: RowGroup) -> None:
    if column.null_count:
        row = unit.first_row + pc.index(pc.is_null(column), True).as_py()
        raise DataError(
            f"{unit.file}: column {name}: {column.null_count} null value(s) in row group "
            f"{unit.index}, first at row {row} (`embedtrain ingest` fills or drops and counts them)"
        )
