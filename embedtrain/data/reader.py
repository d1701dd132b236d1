"""Parquet row groups to TorchRec batches, streamed by background threads (no per-row Python).

A :class:`ParquetBatchReader` walks the row groups of a split's parquet files and yields
``torchrec.datasets.utils.Batch`` objects: ``dense_features`` (float32 ``[B, n_dense]``),
``sparse_features`` (a ``KeyedJaggedTensor`` with one key per sparse feature, single ids or lists)
and ``labels``: float32 ``[B]``, or, when ``FeatureSpec.num_classes`` is set, int64 class ids,
``[B]`` from an integer column or ``[B, max_labels]`` padded with -1 from a list column.

How an epoch is made:

1. Rows over ranks. Every file's footer lists its row groups; their rows, in file order, are
   cut into ``world_size`` contiguous ranges of ``N // world_size`` or one more rows (``N``:
   rows of all files), so every row belongs to exactly
   one rank whatever the row groups' sizes, and a row group on a boundary is shared by row ranges
   (:attr:`ParquetBatchReader.row_groups` are this rank's, trimmed). The split is fixed across
   epochs, so ``len()`` is too; with ``shuffle`` the order of the rank's row groups is permuted by
   ``(seed, epoch)``.
2. Workers. ``num_workers`` threads split the rank's units round-robin (worker ``w`` reads units
   ``w, w + num_workers, ...`` of the epoch's order), decode them from the memory-mapped files
   (:class:`ParquetFiles`), validate them and convert each row group to
   NumPy once (:class:`~embedtrain.data.batching.Rows`), its rows permuted by a generator seeded
   with ``(seed, epoch, position)``. Threads, not processes: Arrow decoding and NumPy release the
   GIL, and blocks reach the assembler without pickling or shared-memory copies.
3. Assembly. One more thread takes the workers' row groups round-robin, i.e. in the epoch's order
   whatever the timing, mixes them in the shuffle buffer (``shuffle_buffer_rows``, seeded by
   ``(seed, epoch)``) and builds ``KeyedJaggedTensor`` batches into a queue of
   ``prefetch_batches``; training only dequeues. Batches are therefore the same for every
   ``num_workers`` (0 does all of it in the iterating thread), which makes ``skip_batches`` resume
   exact and lets evaluation, training and tests share one definition of an epoch.

The last batch (:class:`LastBatch`): ``PAD`` (what training and evaluation on several ranks use):
every rank yields ``ceil(ceil(N / world_size) / batch_size)`` batches of equal size on all ranks;
since the ranks' shares differ by at most one row, only the last batch of an epoch can need
padding, at most one row per rank (``world_size - 1`` in all, or a whole one-row batch for a rank
with no row left), and padding rows are marked (:class:`~embedtrain.data.batching.PaddedBatch`:
label -1, zero dense, empty bags) so that tasks leave them out of losses and metrics. ``KEEP``:
each rank's last batch as short as it is (ranks may then run different numbers of batches: one
process, or no collectives). ``DROP``: only full batches, as many on every rank; the rest of the
epoch's rows (:attr:`ParquetBatchReader.dropped_rows`) is not read. :meth:`~ParquetBatchReader.
step_rows` says how many real and padding rows a step holds over all ranks, so a trainer counts
examples exactly: over an epoch they sum to ``N`` (``PAD``, ``KEEP``).

Validation (types, nulls, ids in ``[0, num_embeddings)``, class ids in ``[0, num_classes)`` and
1 to ``max_labels`` of them per row) runs on every row group as it is read and raises
:class:`DataError` naming file, column and row, in the iterating thread. Id ranges come from the
parquet row-group statistics where the writer recorded them; otherwise the ids are scanned.

Inputs with no rows at all raise :class:`DataError` when the reader is built: an empty split is an
ingestion mistake, and an empty epoch would let training silently do nothing.

Memory is bounded by the knobs, not the data set: about ``2 x (shuffle_buffer_rows + one row
group)`` rows (the buffer, and the workers' read-ahead of one buffer's worth of row groups) plus
``prefetch_batches x batch_size`` rows of ready batches.

Example:
    >>> meta = load_dataset_meta("data/synthetic_ctr")
    >>> reader = ParquetBatchReader(meta.files("train"), meta.features, batch_size=1024,
    ...                             shuffle=True, num_workers=2, last_batch=LastBatch.PAD)
    >>> batch = next(iter(reader))
    >>> batch.sparse_features.keys()[:2]
    ['C1', 'C2']
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from torchrec.datasets.utils import Batch

from embedtrain.data.batching import (
    Rows, SparseLayout, cut_batches, empty_batch, is_list_type, pad_batch, to_batch)
from embedtrain.data.prefetch import IdleReadAhead, OrderedPrefetcher
from embedtrain.features import FeatureSpec, SparseFeature


class DataError(ValueError):
    """Bad input data; the message names the file, column and (where known) row."""


class LastBatch(enum.Enum):
    """What happens to an epoch's last, short batch (see the module docstring)."""

    DROP = "drop"
    KEEP = "keep"
    PAD = "pad"


@dataclass(frozen=True)
class RowGroup:
    file: Path
    index: int
    num_rows: int
    first_row: int  # row number of the group's first row within its file, for error messages
    # (min, max) of each sparse (and class-id label) column's ids from the file's row-group
    # statistics, where written.
    id_ranges: dict[str, tuple[int, int]] = field(default_factory=dict, compare=False, repr=False)
    offset: int = 0  # a part of a row group (shared by two ranks): its rows start this far in


class ParquetBatchReader:
    """Streams a split's parquet files as ``Batch``es, prefetched by background threads.

    Args:
        files: parquet files of one split (same schema).
        features: which columns are label, dense and sparse (from the data set's metadata).
        batch_size: rows per batch (per rank).
        shuffle: shuffle row-group order and rows within a buffer, seeded by ``(seed, epoch)``.
        seed: base seed of the shuffle.
        drop_last: shorthand for ``last_batch=LastBatch.DROP`` (else ``KEEP``).
        shuffle_buffer_rows: rows mixed together before batches are cut (with ``shuffle``).
        rank: this reader's rank among ``world_size`` readers; each gets its own rows.
        world_size: number of readers sharing the files.
        last_batch: drop, keep or pad the last short batch (module docstring); overrides
            ``drop_last``.
        num_workers: threads reading row groups, plus one assembling batches (0: no threads,
            everything in the iterating thread; the batches are the same either way).
        prefetch_batches: assembled batches that may wait for the consumer.
        read_ahead: with ``num_workers`` 0, one thread in the lowest scheduling class reads row
            groups ahead on CPU time nothing else wants; the iterating thread reads any row
            group that thread has not finished itself, so it never waits for it
            (:class:`~embedtrain.data.prefetch.IdleReadAhead`). For a training step that takes
            every core, where a loader thread could only preempt it.

    Raises:
        DataError: a file is missing or unreadable, lacks a column, or the files have no rows.

    Example:
        >>> reader = ParquetBatchReader(files, spec, 2048, shuffle=True, rank=r, world_size=w,
        ...                             last_batch=LastBatch.PAD)
        >>> for batch in reader.iter_epoch(3, skip_batches=100):  # resume epoch 3 at batch 100
        ...     loss = step(batch)
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
        last_batch: Optional[LastBatch] = None,
        num_workers: int = 2,
        prefetch_batches: int = 8,
        read_ahead: bool = False,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if num_workers < 0 or prefetch_batches < 1:
            raise ValueError(f"need num_workers >= 0 and prefetch_batches >= 1, got {num_workers} "
                             f"and {prefetch_batches}")
        if not files:
            raise DataError("no parquet files given")
        self.features = features
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.last_batch = last_batch or (LastBatch.DROP if drop_last else LastBatch.KEEP)
        self.drop_last = self.last_batch is LastBatch.DROP
        self.shuffle_buffer_rows = max(shuffle_buffer_rows, batch_size)
        self.num_workers = num_workers
        self.prefetch_batches = prefetch_batches
        self.read_ahead = read_ahead and num_workers == 0
        self.rank, self.world_size = rank, world_size
        self.unit = "rows"  # what the counts count, for messages
        self._keys = features.sparse_names
        units: list[RowGroup] = []
        layouts: list[tuple[Path, SparseLayout]] = []
        for f in map(Path, files):
            file_units, layout = _row_groups(f, features)
            if layouts and layout != layouts[0][1]:
                raise DataError(_layout_mismatch(f, layout, *layouts[0], features))
            units.extend(file_units)
            layouts.append((f, layout))
        if not units:
            names = ", ".join(str(f) for f in files)
            raise DataError(f"{names}: no rows (no non-empty row groups)")
        self.layout = layouts[0][1]
        self.total_rows = sum(u.num_rows for u in units)
        base, extra = divmod(self.total_rows, world_size)
        #: Rows of every rank (``N // world_size``, the first ``N % world_size`` ranks one more).
        self.rank_rows = [base + (r < extra) for r in range(world_size)]
        first = base * rank + min(rank, extra)
        self.row_groups = _row_range(units, first, first + self.rank_rows[rank])

    @property
    def num_rows(self) -> int:
        """Rows this rank owns (before padding)."""
        return self.rank_rows[self.rank]

    def __len__(self) -> int:
        """Batches per epoch (the same every epoch; with ``PAD``/``DROP`` the same on every rank)."""
        b = self.batch_size
        if self.last_batch is LastBatch.PAD:
            return -(-max(self.rank_rows) // b)
        if self.last_batch is LastBatch.DROP:
            return min(self.rank_rows) // b
        return -(-self.num_rows // b)

    @property
    def _last_batch_rows(self) -> int:
        """With ``PAD``: the size of every rank's last batch, padding included."""
        return max(self.rank_rows) - (len(self) - 1) * self.batch_size

    def step_rows(self, index: int) -> tuple[int, int]:
        """``(examples, padding rows)`` of batch ``index`` of an epoch, summed over all ranks."""
        b, n = self.batch_size, len(self)
        if index >= n:
            return 0, 0
        if index < n - 1 or self.last_batch is LastBatch.DROP:  # shares differ by <= 1 row:
            return b * self.world_size, 0                      # only the last batch can be short
        real = sum(min(b, max(0, rows - index * b)) for rows in self.rank_rows)
        if self.last_batch is LastBatch.PAD:
            return real, self._last_batch_rows * self.world_size - real
        return real, 0

    @property
    def dropped_rows(self) -> int:
        """Rows of every epoch that ``DROP`` leaves out, over all ranks (0 otherwise)."""
        if self.last_batch is not LastBatch.DROP:
            return 0
        return self.total_rows - len(self) * self.batch_size * self.world_size

    def __iter__(self) -> Iterator[Batch]:
        """The batches of epoch 0 (:meth:`iter_epoch` for any other)."""
        return self.iter_epoch(0)

    def iter_epoch(self, epoch: int, skip_batches: int = 0) -> Iterator[Batch]:
        """Yields the batches of ``epoch``, starting after the first ``skip_batches``.

        Args:
            epoch: seeds the shuffle together with ``seed``.
            skip_batches: batches to leave out from the start (resume mid-epoch); they are cut but
                never assembled, so the rest is exactly what an uninterrupted epoch yields.

        Returns:
            An iterator; with workers, ``close()`` it (or drop it, e.g. ``break``) to stop the
            threads early. Worker errors (e.g. :class:`DataError`) are raised by ``next()``.
        """
        rng = np.random.default_rng([self.seed, epoch])
        plan = self._plan(rng)
        # Arrow's decode threads parallelise one row group's columns; once two or more of our
        # workers decode row groups side by side they would only oversubscribe the cores.
        load = functools.partial(_load_rows, features=self.features, layout=self.layout,
                                 seed=(self.seed, epoch) if self.shuffle else None,
                                 arrow_threads=self.num_workers < 2, files=ParquetFiles())
        pad_to = self._last_batch_rows if self.last_batch is LastBatch.PAD else 0
        assemble = functools.partial(
            _assemble, features=self.features, layout=self.layout, keys=self._keys,
            batch_size=self.batch_size, buffer_rows=self.shuffle_buffer_rows,
            rng=rng if self.shuffle else None,
            keep_partial=self.last_batch is not LastBatch.DROP, skip=skip_batches,
            num_batches=len(self), pad_to=pad_to)
        if self.num_workers == 0 or not plan:
            if not self.read_ahead:
                return assemble(map(load, plan))
            # Arrow's decode threads would run at normal priority: the idle thread decodes alone
            alone = functools.partial(load, arrow_threads=False)
            return assemble(IdleReadAhead(
                plan, load, ahead=self._buffer_row_groups() + 1,
                background_load=alone, name=f"loader-rank{self.rank}-read-ahead"))
        # The shuffle buffer takes a buffer's worth of row groups at once, then cuts batches for a
        # while: workers may read that far ahead, or they would idle while it cuts and it would
        # idle while they refill it.
        ahead = self._buffer_row_groups() if self.shuffle else 1
        workers = self.num_workers  # each also holds the row group it is reading
        return OrderedPrefetcher(plan, load, assemble, num_workers=workers,
                                 max_ready=self.prefetch_batches,
                                 max_loaded=max(1, math.ceil((ahead - workers) / workers)),
                                 name=f"loader-rank{self.rank}")

    def _buffer_row_groups(self) -> int:
        """Row groups (of this rank's mean size) that fill the shuffle buffer."""
        group_rows = self.num_rows / max(len(self.row_groups), 1)
        return math.ceil(self.shuffle_buffer_rows / group_rows)

    def _plan(self, rng: np.random.Generator) -> list[tuple[int, RowGroup, int]]:
        """The epoch's ``(position, row group, rows to use from its start)`` in reading order."""
        units = self.row_groups
        order = rng.permutation(len(units)) if self.shuffle else range(len(units))
        return [(p, units[i], units[i].num_rows) for p, i in enumerate(order)]


def _load_rows(item: tuple[int, RowGroup, int], features: FeatureSpec, layout: SparseLayout,
               seed: Optional[tuple[int, int]], arrow_threads: bool, files: ParquetFiles) -> Rows:
    """One plan item as a block; shuffled by a generator of its own, so workers need no order."""
    position, unit, rows = item
    table = _read_row_group(unit, features, arrow_threads, files)
    if unit.offset or rows < table.num_rows:
        table = table.slice(unit.offset, rows)
    rng = np.random.default_rng([*seed, position]) if seed is not None else None
    return Rows.from_table(table, features, layout, rng)


def _assemble(blocks: Iterable[Rows], features: FeatureSpec, layout: SparseLayout,
              keys: list[str], batch_size: int, buffer_rows: int,
              rng: Optional[np.random.Generator], keep_partial: bool, skip: int,
              num_batches: int, pad_to: int) -> Iterator[Batch]:
    """Batches ``skip .. num_batches - 1`` of the epoch; with ``pad_to``, the last one is padded
    to ``pad_to`` rows (or, when this rank has no row left for it, made of padding alone)."""
    index = skip
    for parts in cut_batches(blocks, batch_size, buffer_rows, rng, keep_partial, skip):
        if index >= num_batches:  # DROP: the other ranks have no more full batches
            return
        batch = to_batch(parts, layout, keys)
        if pad_to and index == num_batches - 1 and len(batch.labels) < pad_to:
            batch = pad_batch(batch, pad_to - len(batch.labels))
        yield batch
        index += 1
    if pad_to and index == num_batches - 1:
        yield pad_batch(empty_batch(features, layout), pad_to)


def _row_range(units: list[RowGroup], first: int, stop: int) -> list[RowGroup]:
    """The parts of ``units`` (in order) holding rows ``[first, stop)`` of their concatenation."""
    out, start = [], 0
    for u in units:
        lo, hi = max(first, start), min(stop, start + u.num_rows)
        if hi > lo:
            out.append(dataclasses.replace(u, num_rows=hi - lo, offset=u.offset + lo - start))
        start += u.num_rows
    return out


def _row_groups(path: Path, features: FeatureSpec) -> tuple[list[RowGroup], SparseLayout]:
    if not path.is_file():
        raise DataError(f"{path}: parquet file not found")
    try:
        metadata = pq.read_metadata(path)
        schema = metadata.schema.to_arrow_schema()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file: {e}") from None
    missing = [c for c in features.columns if c not in schema.names]
    if missing:
        raise DataError(f"{path}: missing column(s): {', '.join(missing)}")
    units, first = [], 0
    for index in range(metadata.num_row_groups):
        row_group = metadata.row_group(index)
        if row_group.num_rows:
            ranges = _id_ranges(row_group, features)
            units.append(RowGroup(path, index, row_group.num_rows, first, ranges))
        first += row_group.num_rows
    return units, SparseLayout.of(schema, features)


def _id_ranges(row_group: Any, features: FeatureSpec) -> dict[str, tuple[int, int]]:
    """Sparse (and class-id label) columns' id ranges from parquet statistics (a list's one leaf
    for list columns).

    They let validation skip a scan of every id when the writer recorded them (Arrow, Polars and
    Spark do); a column without them, or outside its table, is scanned and the bad row named.
    """
    leaves: dict[str, list[Any]] = {}
    for j in range(row_group.num_columns):
        column = row_group.column(j)
        leaves.setdefault(column.path_in_schema.split(".")[0], []).append(column)
    names = features.sparse_names
    if features.num_classes is not None:
        names.append(features.label)
    ranges = {}
    for name in names:
        found = leaves.get(name, [])
        stats = found[0].statistics if len(found) == 1 else None
        if (stats is not None and stats.has_min_max
                and found[0].physical_type in ("INT32", "INT64")):
            ranges[name] = (stats.min, stats.max)
    return ranges


def _layout_mismatch(path: Path, layout: SparseLayout, first: Path, first_layout: SparseLayout,
                     features: FeatureSpec) -> str:
    if layout.label_is_list != first_layout.label_is_list:
        kind = lambda is_list: (  # noqa: E731
            "a list column (multi-label)" if is_list else "a single-label column")
        return (f"{path}: column {features.label}: {kind(layout.label_is_list)} here but "
                f"{kind(first_layout.label_is_list)} in {first}")
    i = next(i for i, (a, b) in enumerate(zip(layout.is_list, first_layout.is_list)) if a != b)
    kind = lambda is_list: "a list column" if is_list else "a single-id column"  # noqa: E731
    return (f"{path}: column {features.sparse[i].name}: {kind(layout.is_list[i])} here but "
            f"{kind(first_layout.is_list[i])} in {first}")


class ParquetFiles:
    """Open, memory-mapped ``pyarrow.parquet.ParquetFile`` readers, one per file and thread.

    A row group is decoded straight from the page cache through the mapping (no read into a
    buffer first), and the footer is parsed once per file rather than once per row group: ~25%
    less CPU per row group than a ``pyarrow.dataset`` fragment's ``to_table`` (RESULTS.md,
    issue 26). Arrow's file readers are not meant to be shared by threads, so each thread gets
    its own; they close with this object (one per epoch's iterator).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[int, Path], pq.ParquetFile] = {}

    def get(self, path: Path) -> pq.ParquetFile:
        key = (threading.get_ident(), path)
        reader = self._open.get(key)
        if reader is None:
            reader = pq.ParquetFile(path, memory_map=True)
            with self._lock:
                self._open[key] = reader
        return reader


def _read_row_group(unit: RowGroup, features: FeatureSpec, arrow_threads: bool = True,
                    files: Optional[ParquetFiles] = None) -> pa.Table:
    try:
        reader = (files or ParquetFiles()).get(unit.file)
        table = reader.read_row_group(unit.index, columns=features.columns,
                                      use_threads=arrow_threads)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{unit.file}: row group {unit.index}: cannot read: {e}") from None
    _validate(table, unit, features)
    return table


def _validate(table: pa.Table, unit: RowGroup, features: FeatureSpec) -> None:
    """Checks types, nulls and id ranges of one row group, naming file, column and row."""
    if features.num_classes is None:
        numbers = [features.label, *features.dense]
    else:
        _check_class_labels(table.column(features.label), features, unit)
        numbers = list(features.dense)
    for name in numbers:
        column = table.column(name)
        if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)
                or pa.types.is_boolean(column.type)):
            raise DataError(f"{unit.file}: column {name}: expected a number, got {column.type}")
        _check_no_nulls(column, name, unit)
        if name != features.label:  # a label's own check names what a click is
            _check_finite(column, name, unit)
    if features.num_classes is None:
        _check_number_labels(table.column(features.label), features, unit)
    for feat in features.sparse:
        # raw ids (encoding: raw) lie anywhere in [0, 2^63 - 1): the int64 range but the top
        # value, which the dynamic tables keep for their empty rows
        limit = RAW_ID_LIMIT if feat.raw else feat.num_embeddings
        column = table.column(feat.name)
        _check_ids(column, feat.name, limit, unit)
        if is_list_type(column.type):
            _check_list_lengths(column, feat, unit)


RAW_ID_LIMIT = 2**63 - 1  # raw ids lie in [0, RAW_ID_LIMIT)


def _check_ids(column: pa.ChunkedArray, name: str, limit: int, unit: RowGroup,
               what: str = "id") -> None:
    """Checks a column of integer ids (or lists of them): no nulls, all in ``[0, limit)``."""
    _check_no_nulls(column, name, unit)
    is_list = is_list_type(column.type)
    ids = pc.list_flatten(column) if is_list else column
    if not pa.types.is_integer(ids.type):
        raise DataError(f"{unit.file}: column {name}: expected integer {what}s, got {column.type}")
    if ids.null_count:
        row = _first_row(column, pc.is_null(ids), is_list, unit)
        raise DataError(f"{unit.file}: column {name}: null {what} inside a list at row {row}")
    known = unit.id_ranges.get(name)
    if known is not None and known[0] >= 0 and known[1] < limit:
        return  # the statistics prove the range: no need to scan the ids
    bounds = pc.min_max(ids)
    lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
    if lo is not None and (lo < 0 or hi >= limit):
        bad = pc.or_(pc.less(ids, 0), pc.greater_equal(ids, limit))
        raise DataError(
            f"{unit.file}: column {name}: {what} {lo if lo < 0 else hi} outside "
            f"[0, {limit}) at row {_first_row(column, bad, is_list, unit)}"
        )


def _check_list_lengths(column: pa.ChunkedArray, feat: SparseFeature, unit: RowGroup) -> None:
    """A list holds at most ``max_length`` ids (multi-hot; 0: no bound) or one (single-valued):
    a longer one would be pooled (or a history cut) silently, into something metadata.json does
    not describe."""
    bound = feat.max_length if feat.multi_hot else 1
    if not bound or not len(column):
        return
    counts = pc.list_value_length(column)
    if pc.max(counts).as_py() <= bound:
        return
    row = _first_row(counts, pc.greater(counts, bound), False, unit)
    said = (f"max_length: {bound}" if feat.multi_hot
            else "multi_hot: false (one id a row)")
    raise DataError(f"{unit.file}: column {feat.name}: row {row} holds "
                    f"{counts[row - unit.first_row].as_py()} ids, but metadata.json says {said}")


def _check_number_labels(column: pa.ChunkedArray, features: FeatureSpec, unit: RowGroup) -> None:
    """Number labels lie in the data set's ``label_range``: clicks, 0 or 1, or click
    probabilities in [0, 1] by default; finite numbers where metadata.json says null."""
    name = features.label
    if pa.types.is_boolean(column.type) or not len(column):
        return
    low, high = features.label_range or (-math.inf, math.inf)
    floating = pa.types.is_floating(column.type)
    bounds = pc.min_max(column)  # NaN is not a min or max: looked for apart
    lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
    if lo is not None and lo >= low and hi <= high and not (
            floating and not pc.all(pc.is_finite(column)).as_py()):
        return
    values = pc.cast(column, pa.float64())
    bad = pc.or_(pc.or_(pc.less(values, low), pc.greater(values, high)),
                 pc.invert(pc.is_finite(values)))
    row = _first_row(column, bad, False, unit)
    value = values[row - unit.first_row].as_py()
    if features.label_range == (0.0, 1.0):
        raise DataError(f"{unit.file}: column {name}: label {value:g} at row {row} is not a "
                        f"click (CTR labels are 0 or 1, or a probability in [0, 1])")
    raise DataError(f"{unit.file}: column {name}: label {value:g} at row {row} is outside "
                    f"metadata.json's label_range {list(features.label_range or ())}")


def _check_class_labels(column: pa.ChunkedArray, features: FeatureSpec, unit: RowGroup) -> None:
    """Checks class-id labels: ids in ``[0, num_classes)``; lists hold 1 to ``max_labels``."""
    name = features.label
    _check_ids(column, name, features.num_classes, unit, what="class id")
    if not is_list_type(column.type) or not len(column):
        return
    counts = pc.list_value_length(column)
    bounds = pc.min_max(counts)
    if bounds["min"].as_py() == 0:
        row = _first_row(counts, pc.equal(counts, 0), False, unit)
        raise DataError(f"{unit.file}: column {name}: row {row} has no label")
    if bounds["max"].as_py() > features.max_labels:
        row = _first_row(counts, pc.greater(counts, features.max_labels), False, unit)
        raise DataError(
            f"{unit.file}: column {name}: row {row} has {counts[row - unit.first_row].as_py()} "
            f"labels, more than max_labels {features.max_labels} of metadata.json")


def _first_row(column: pa.ChunkedArray, mask: Any, is_list: bool, unit: RowGroup) -> int:
    """The file row of the first true ``mask`` entry (an element of the flattened lists if so)."""
    position = pc.index(mask, True).as_py()
    if is_list:
        position = pc.list_parent_indices(column)[position].as_py()
    return unit.first_row + position


def first_non_finite(column: pa.ChunkedArray) -> Optional[int]:
    """The position of a float column's first NaN or infinite value (None: all finite, or not a
    float column). A model trains on such a value and evaluation fails later, far from it."""
    if not pa.types.is_floating(column.type):
        return None
    finite = pc.is_finite(column)
    return None if pc.all(finite).as_py() else pc.index(finite, False).as_py()


def _check_finite(column: pa.ChunkedArray, name: str, unit: RowGroup) -> None:
    position = first_non_finite(column)
    if position is not None:
        count = len(column) - pc.sum(pc.is_finite(column)).as_py()
        raise DataError(
            f"{unit.file}: column {name}: {count} value(s) not finite (NaN or infinite) in row "
            f"group {unit.index}, first at row {unit.first_row + position} "
            f"({column[position].as_py()}) (`embedtrain ingest` refuses them, or replaces and "
            f"counts them with non_finite: fill)")


def _check_no_nulls(column: pa.ChunkedArray, name: str, unit: RowGroup) -> None:
    if column.null_count:
        row = unit.first_row + pc.index(pc.is_null(column), True).as_py()
        raise DataError(
            f"{unit.file}: column {name}: {column.null_count} null value(s) in row group "
            f"{unit.index}, first at row {row} (`embedtrain ingest` fills or drops and counts them)"
        )
