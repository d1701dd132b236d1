"""Row blocks as NumPy arrays, the shuffle buffer, and ``KeyedJaggedTensor`` batch assembly.

A row group becomes a :class:`Rows` block once, in a loader worker: Arrow buffers are gathered
straight into NumPy (permuted on the way when shuffling, so the permutation costs no extra pass)
and the dense transform is applied. Batches are then lists of ``(block, start, stop)`` spans,
written once into the KJT's ``values`` and ``lengths`` by :func:`to_batch`; nothing loops
over rows in Python. Labels are float32 ``[n]``; with ``FeatureSpec.num_classes`` they are int64
class ids, ``[n]``, or ``[n, max_labels]`` padded with -1 when the label column is a list.

The shuffle buffer (:func:`cut_batches`) never gathers rows again: each block is already uniformly
permuted, so a uniform permutation of the whole buffer, cut into batches, is equivalent to drawing
how many rows each batch takes from each block (sequential multivariate hypergeometric draws,
made for all of a buffer's batches at once by shuffling the buffer's block labels) and taking
those rows as the next span of each block. Batches hold the same random sets of rows as with a
full permutation; only the order inside a batch is grouped by block, which no loss depends on.

Padding (:func:`pad_batch`): when the ranks' shares of a split differ by a row, the last batch of
an epoch is topped up so that every rank's has the same size (TorchRec's row-wise all-to-all and
the sharded class heads' all-gathers need equal batch sizes). Padding rows come last in a
:class:`PaddedBatch`: label -1 (every class id -1), zero dense features, an empty bag for every
sparse feature (no embedding row is looked up, so no table or optimizer state is touched). Tasks
leave them out of losses and metrics; the trainer never counts them as examples.

Example:
    >>> layout = SparseLayout.of(table.schema, spec)
    >>> blocks = [Rows.from_table(table, spec, layout, np.random.default_rng(0))]
    >>> batches = [to_batch(parts, layout, spec.sparse_names)
    ...            for parts in cut_batches(blocks, batch_size=1024, buffer_rows=65536,
    ...                                     rng=np.random.default_rng(1), keep_partial=True)]
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Generator, Iterable, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedtrain.features import DenseTransform, FeatureSpec

# A batch made of more slices than this (tiny row groups) is concatenated first: fewer NumPy calls.
_MAX_PARTS = 16


@dataclass
class PaddedBatch(Batch):
    """A ``Batch`` whose last ``padding`` rows are padding (see the module docstring)."""

    padding: int = 0


def num_padding(batch: object) -> int:
    """Trailing padding rows of ``batch`` (0 for anything but a :class:`PaddedBatch`)."""
    return getattr(batch, "padding", 0)


def pad_batch(batch: Batch, rows: int) -> PaddedBatch:
    """``batch`` with ``rows`` padding rows appended (label -1, zero dense, empty bags)."""
    kjt = batch.sparse_features
    keys = kjt.keys()
    n = kjt.stride()
    lengths = torch.cat([kjt.lengths().view(len(keys), n),
                         torch.zeros(len(keys), rows, dtype=kjt.lengths().dtype)], dim=1)
    labels = batch.labels
    return PaddedBatch(
        dense_features=torch.cat([batch.dense_features,
                                  batch.dense_features.new_zeros(rows, batch.dense_features.shape[1])]),
        sparse_features=KeyedJaggedTensor(
            keys=keys, values=kjt.values(), lengths=lengths.view(-1), stride=n + rows,
            length_per_key=kjt.length_per_key(), offset_per_key=kjt.offset_per_key()),
        labels=torch.cat([labels, labels.new_full((rows, *labels.shape[1:]), -1)]),
        padding=num_padding(batch) + rows,
    )


def empty_batch(features: FeatureSpec, layout: SparseLayout) -> Batch:
    """A batch of no rows in ``features``' layout (to be padded: a rank with no rows left)."""
    label_shape = (0, features.max_labels) if layout.label_is_list else (0,)
    label_dtype = torch.float32 if features.num_classes is None else torch.int64
    keys = features.sparse_names
    return Batch(
        dense_features=torch.zeros(0, len(features.dense)),
        sparse_features=KeyedJaggedTensor(
            keys=keys, values=torch.zeros(0, dtype=torch.int64),
            lengths=torch.zeros(0, dtype=torch.int32), stride=0,
            length_per_key=[0] * len(keys), offset_per_key=[0] * (len(keys) + 1)),
        labels=torch.zeros(label_shape, dtype=label_dtype),
    )


def is_list_type(tp: pa.DataType) -> bool:
    return pa.types.is_list(tp) or pa.types.is_large_list(tp)


@dataclass(frozen=True)
class SparseLayout:
    """Which sparse features are list columns, and the runs the KJT's values are written in.

    Single-valued ids live in one feature-major ``[n_single, rows]`` matrix, so a run of
    consecutive single features is one 2-D copy into the KJT's key-major ``values``; list features
    keep Arrow's ``offsets``/``values`` form.

    Args:
        is_list: per sparse feature, in the spec's order, whether its column is a list.
        label_is_list: whether the label column is a list of class ids (multi-label; only with
            ``FeatureSpec.num_classes``).
    """

    is_list: tuple[bool, ...]
    label_is_list: bool = False

    @staticmethod
    def of(schema: pa.Schema, features: FeatureSpec) -> "SparseLayout":
        """The layout of ``schema``'s sparse and label columns (which must all be present)."""
        label_is_list = (features.num_classes is not None
                         and is_list_type(schema.field(features.label).type))
        return SparseLayout(tuple(is_list_type(schema.field(f.name).type) for f in features.sparse),
                            label_is_list)

    @functools.cached_property
    def segments(self) -> list[tuple[bool, int, int]]:
        """``(is_list, first, stop)`` runs in key order; indices count within singles or lists."""
        out: list[tuple[bool, int, int]] = []
        n_single = n_list = 0
        for is_list in self.is_list:
            if is_list:
                out.append((True, n_list, n_list + 1))
                n_list += 1
            elif out and not out[-1][0] and out[-1][2] == n_single:
                out[-1] = (False, out[-1][1], n_single + 1)
                n_single += 1
            else:
                out.append((False, n_single, n_single + 1))
                n_single += 1
        return out


@dataclass
class Rows:
    """A block of rows as NumPy arrays; ``slice`` makes views, :func:`to_batch` builds a batch.

    List offsets are absolute positions into their (unsliced) values, so slices stay views.
    """

    labels: np.ndarray  # float32 [n]; class ids: int64 [n], or [n, max_labels] padded with -1
    dense: np.ndarray  # float32 [n_dense, n], feature-major like `single`
    single: np.ndarray  # int64 [n_single, n], feature-major
    list_offsets: list[np.ndarray]  # per list feature: int32/int64 [n + 1], into list_values
    list_lengths: list[np.ndarray]  # per list feature: int32 [n]
    list_values: list[np.ndarray]  # per list feature: int64 ids

    @property
    def num_rows(self) -> int:
        return len(self.labels)

    @staticmethod
    def from_table(table: pa.Table, features: FeatureSpec, layout: SparseLayout,
                   rng: Optional[np.random.Generator] = None) -> "Rows":
        """Converts a validated (null-free) table, rows permuted by ``rng`` if given.

        Arrow buffers are read in place (``to_numpy`` views) and gathered once into the block.

        Args:
            table: one row group with the spec's columns.
            features: label, dense and sparse columns and the dense transform.
            layout: which sparse columns are lists (checked by the reader for every file).
            rng: draws the block's row permutation; ``None`` keeps the file's order.

        Returns:
            The block, with the dense transform applied.
        """
        n = table.num_rows
        order = rng.permutation(n) if rng is not None else None
        labels = _labels(table.column(features.label), features, layout, order)
        dense = _dense_block(table, features, order)
        single = np.empty((layout.is_list.count(False), n), np.int64)
        offsets, lengths, values = [], [], []
        j = 0
        for feat, is_list in zip(features.sparse, layout.is_list):
            if is_list:
                off, lens, vals = _list_column(table.column(feat.name), order)
                offsets.append(off)
                lengths.append(lens)
                values.append(vals)
            else:
                _gather_into(single[j], _numpy(table.column(feat.name)), order)
                j += 1
        return Rows(labels, dense, single, offsets, lengths, values)

    def slice(self, start: int, stop: int) -> "Rows":
        """Rows ``[start, stop)`` as views."""
        return Rows(self.labels[start:stop], self.dense[:, start:stop], self.single[:, start:stop],
                    [o[start : stop + 1] for o in self.list_offsets],
                    [n[start:stop] for n in self.list_lengths], self.list_values)

    @staticmethod
    def concat(parts: list["Rows"]) -> "Rows":
        """One block holding ``parts`` in order (a copy, unless there is one part)."""
        if len(parts) == 1:
            return parts[0]
        offsets, values = [], []
        for i in range(len(parts[0].list_offsets)):
            pieces, shifted, shift = [], [], 0
            for p in parts:
                off = p.list_offsets[i]
                pieces.append(p.list_values[i][off[0] : off[-1]])
                shifted.append(off[:-1] - off[0] + shift)
                shift += int(off[-1] - off[0])
            shifted.append(np.array([shift], np.int64))
            offsets.append(np.concatenate(shifted))
            values.append(np.concatenate(pieces))
        lengths = [np.concatenate([p.list_lengths[i] for p in parts])
                   for i in range(len(parts[0].list_lengths))]
        return Rows(np.concatenate([p.labels for p in parts]),
                    np.concatenate([p.dense for p in parts], axis=1),
                    np.concatenate([p.single for p in parts], axis=1), offsets, lengths, values)


Span = tuple["Rows", int, int]  # rows [start, stop) of a block: a part of a batch


def to_batch(parts: Sequence[Span], layout: SparseLayout, keys: list[str]) -> Batch:
    """A TorchRec ``Batch`` of the rows of ``parts`` (``(block, start, stop)`` spans), in order.

    The KJT's ``values`` and ``lengths`` are each allocated once and written a run of keys at a
    time, one copy per span (lengths come from the blocks' Arrow offsets); ``stride``,
    ``length_per_key`` and ``offset_per_key`` are passed too, which spares the training thread
    a sync to compute them. ``offsets`` are left to the KJT (one fused cumsum, when a kernel
    needs them).

    Args:
        parts: spans of blocks making up the batch.
        layout: the blocks' sparse layout.
        keys: the sparse feature names, in the spec's order.

    Returns:
        The batch.
    """
    if len(parts) > _MAX_PARTS:
        block = Rows.concat([b.slice(lo, hi) for b, lo, hi in parts])
        parts = [(block, 0, block.num_rows)]
    n = sum(hi - lo for _, lo, hi in parts)
    first = parts[0][0]
    n_single = first.single.shape[0]
    list_sizes = [sum(int(b.list_offsets[i][hi] - b.list_offsets[i][lo]) for b, lo, hi in parts)
                  for i in range(len(first.list_values))]
    values = np.empty(n * n_single + sum(list_sizes), np.int64)
    lengths = np.empty(n * len(keys), np.int32)
    length_per_key: list[int] = []
    pos = lpos = 0  # write positions in values and in lengths
    for is_list, lo_key, hi_key in layout.segments:  # one copy per span and run of keys
        if is_list:
            i = lo_key
            for b, lo, hi in parts:
                off = b.list_offsets[i]
                a, z = int(off[lo]), int(off[hi])
                values[pos : pos + z - a] = b.list_values[i][a:z]
                lengths[lpos : lpos + hi - lo] = b.list_lengths[i][lo:hi]
                pos, lpos = pos + z - a, lpos + hi - lo
            length_per_key.append(list_sizes[i])
        else:
            m = hi_key - lo_key
            out = values[pos : pos + m * n].reshape(m, n)
            col = 0
            for b, lo, hi in parts:
                out[:, col : col + hi - lo] = b.single[lo_key:hi_key, lo:hi]
                col += hi - lo
            lengths[lpos : lpos + m * n] = 1
            pos, lpos = pos + m * n, lpos + m * n
            length_per_key.extend([n] * m)
    # row-major for the model; labels (a matrix for multi-label) in one array
    dense = np.empty((n, first.dense.shape[0]), np.float32)
    labels = np.empty((n, *first.labels.shape[1:]), first.labels.dtype)
    row = 0
    for b, lo, hi in parts:
        dense[row : row + hi - lo] = b.dense[:, lo:hi].T
        labels[row : row + hi - lo] = b.labels[lo:hi]
        row += hi - lo
    return Batch(
        dense_features=torch.from_numpy(dense),
        sparse_features=KeyedJaggedTensor(
            keys=keys,
            values=torch.from_numpy(values),
            lengths=torch.from_numpy(lengths),
            stride=n,
            length_per_key=length_per_key,
            offset_per_key=[0, *itertools.accumulate(length_per_key)],
        ),
        labels=torch.from_numpy(labels),
    )


def cut_batches(
    blocks: Iterable[Rows],
    batch_size: int,
    buffer_rows: int,
    rng: Optional[np.random.Generator],
    keep_partial: bool,
    skip: int = 0,
) -> Iterator[list[Span]]:
    """Cuts a stream of blocks into batches (lists of block spans), shuffled through a buffer.

    Shuffled (``rng`` given; blocks must be permuted already): blocks gather until
    ``buffer_rows`` rows, then the buffer's full batches draw their rows from its blocks (see the
    module docstring); the rest (< ``batch_size`` rows) starts the next buffer, and at the end of
    the stream the rest is drawn likewise. In order (``rng=None``): consecutive rows. Memory: the
    buffer, i.e. about ``buffer_rows`` + one block.

    Args:
        blocks: the epoch's blocks, in order.
        batch_size: rows per batch.
        buffer_rows: rows mixed together before batches are cut (shuffled only).
        rng: the epoch's generator; ``None`` keeps the row order.
        keep_partial: yield the last batch if it is short.
        skip: batches to drop from the start (exact resume; the caller never assembles them).

    Returns:
        An iterator of batches, each a list of ``(block, start, stop)`` spans.
    """
    cut = (_cut_in_order(blocks, batch_size) if rng is None
           else _cut_shuffled(blocks, batch_size, max(buffer_rows, batch_size), rng))
    for i, parts in enumerate(cut):
        if not keep_partial and sum(hi - lo for _, lo, hi in parts) < batch_size:
            return
        if i >= skip:
            yield parts


def _cut_shuffled(blocks: Iterable[Rows], batch_size: int, buffer_rows: int,
                  rng: np.random.Generator) -> Iterator[list[Span]]:
    pending: list[Span] = []
    count = 0
    for block in blocks:
        pending.append((block, 0, block.num_rows))
        count += block.num_rows
        if count >= buffer_rows:
            pending = yield from _draw(pending, count // batch_size, batch_size, rng)
            count = sum(hi - lo for _, lo, hi in pending)
    if count:
        yield from _draw(pending, -(-count // batch_size), batch_size, rng)


def _draw(pending: list[Span], num_batches: int, batch_size: int,
          rng: np.random.Generator) -> Generator[list[Span], None, list[Span]]:
    """Yields ``num_batches`` random batches from uniformly permuted blocks; returns the rest.

    How many rows each batch takes from each block, for all of the buffer's batches at once:
    the buffer's rows, labelled by block, in a uniformly random order, cut into batches (the
    sequential multivariate hypergeometric draws, one vectorised shuffle and count).
    """
    sizes = np.array([hi - lo for _, lo, hi in pending], np.int64)
    k = len(pending)
    owner = np.repeat(np.arange(k, dtype=np.int32), sizes)
    rng.shuffle(owner)
    taken = min(len(owner), num_batches * batch_size)
    batch_of = np.arange(taken, dtype=np.int64) // batch_size
    counts = np.bincount(batch_of * k + owner[:taken], minlength=num_batches * k)
    # each block's rows are taken from its start on: a batch's span of block i starts where
    # the previous batches' spans of block i ended
    ends = np.cumsum(counts.reshape(num_batches, k), axis=0) + [lo for _, lo, _ in pending]
    starts = ends - counts.reshape(num_batches, k)
    for b_starts, b_ends in zip(starts.tolist(), ends.tolist()):
        yield [(pending[i][0], lo, hi) for i, (lo, hi) in enumerate(zip(b_starts, b_ends))
               if hi > lo]
    last = ends[-1].tolist() if num_batches else [lo for _, lo, _ in pending]
    return [(block, lo, hi) for (block, _, hi), lo in zip(pending, last) if lo < hi]


def _cut_in_order(blocks: Iterable[Rows], batch_size: int) -> Iterator[list[Span]]:
    pending: list[Span] = []  # the first one may be partly used
    count = 0
    for block in blocks:
        pending.append((block, 0, block.num_rows))
        count += block.num_rows
        while count >= batch_size:
            parts, need = [], batch_size
            while need:
                head, lo, hi = pending[0]
                take = min(need, hi - lo)
                parts.append((head, lo, lo + take))
                need -= take
                if lo + take == hi:
                    pending.pop(0)
                else:
                    pending[0] = (head, lo + take, hi)
            count -= batch_size
            yield parts
    if count:
        yield pending


def _gather_into(out: np.ndarray, source: np.ndarray, order: Optional[np.ndarray]) -> None:
    """``out[:] = source[order]`` (or ``source``), gathering straight into ``out`` when it can."""
    if order is None:
        out[...] = source
        return
    _warm(source)
    if source.dtype == out.dtype:
        # mode="clip": with "raise" NumPy gathers into a temporary and copies that to `out`;
        # `order` is a permutation, always in range.
        np.take(source, order, out=out, mode="clip")
    else:
        out[...] = source.take(order)


def _warm(array: np.ndarray) -> None:
    """Reads ``array`` once in order, ahead of a random gather from it.

    Decoding a row group evicts its first columns from the caches; a sequential pass brings one
    back at full bandwidth (the hardware prefetcher follows it), so the gather that follows hits
    L2 instead of waiting on memory for every row: ~30% less time for the two together.
    """
    if array.size:
        array.max()


# log1p of the counts 0 .. 65535, for a table lookup instead of a logarithm per value (NumPy's
# float32 log1p is scalar, ~18 ns a value; a lookup in this 256 KB table is ~2 ns).
_LOG1P_COUNTS = np.log1p(np.arange(1 << 16, dtype=np.float64)).astype(np.float32)


def _dense_block(table: pa.Table, features: FeatureSpec, order: Optional[np.ndarray]) -> np.ndarray:
    """The dense columns as float32 ``[n_dense, n]``, transform applied, rows in ``order``.

    Feature-major, so that every write is contiguous: storing into a column of a row-major
    ``[n, n_dense]`` block costs more than the gather and transform together. Each column is
    transformed in file order first (the lookups then walk the table sequentially) and gathered
    after, 4-byte values instead of the source's 8.
    """
    n = table.num_rows
    dense = np.empty((len(features.dense), n), np.float32)
    log1p = features.dense_transform is DenseTransform.LOG1P
    column = np.empty(n, np.float32)
    for j, name in enumerate(features.dense):
        source = _numpy(table.column(name))
        target = dense[j] if order is None else column
        if log1p and source.dtype.kind in "iu" and np.can_cast(source.dtype, np.intp):
            top = source.max() if n else 0  # also pulls the column into cache for the lookups
            # Negative counts index entry 0, log1p(0): the transform's max(x, 0) for free.
            np.take(_LOG1P_COUNTS, source, out=target, mode="clip")
            if top >= len(_LOG1P_COUNTS):
                large = source >= len(_LOG1P_COUNTS)
                target[large] = np.log1p(source[large])
        else:
            target[...] = source
            if log1p:
                np.log1p(np.maximum(target, 0.0, out=target), out=target)
        if order is not None:
            np.take(column, order, out=dense[j], mode="clip")
    return dense


def _labels(column: pa.ChunkedArray, features: FeatureSpec, layout: SparseLayout,
            order: Optional[np.ndarray]) -> np.ndarray:
    """The label column in ``order``: float32 numbers, or int64 class ids (a matrix if lists)."""
    if layout.label_is_list:
        return _label_matrix(column, features.max_labels, order)
    labels = np.empty(len(column), np.float32 if features.num_classes is None else np.int64)
    _gather_into(labels, _numpy(column), order)
    return labels


def _label_matrix(column: pa.ChunkedArray, max_labels: int, order: Optional[np.ndarray]
                  ) -> np.ndarray:
    """A list column of class ids as int64 ``[n, max_labels]``, padded with -1, rows in ``order``.

    One scatter from Arrow's offsets: the ``t``-th id of file row ``r`` goes to flat position
    ``dest[r] * max_labels + t`` of the matrix (``dest`` inverts ``order``), and as ``t`` is the
    id's position minus its row's start offset, every position is one ``np.repeat`` plus one
    ``arange`` away. The ids are read in file order. Rows must hold at most ``max_labels`` ids
    (checked by the reader).
    """
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy()[offsets[0] : offsets[-1]]
    n = len(offsets) - 1
    if order is None:
        dest = np.arange(n, dtype=np.int64)
    else:
        dest = np.empty(n, np.int64)
        dest[order] = np.arange(n)
    shift = dest * max_labels - (offsets[:-1] - offsets[0])
    position = np.repeat(shift, np.diff(offsets))
    position += np.arange(len(values), dtype=np.int64)
    out = np.full((n, max_labels), -1, np.int64)
    out.reshape(-1)[position] = values
    return out


def _list_column(column: pa.ChunkedArray, order: Optional[np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A list column as ``(offsets, lengths, values)``, rows in ``order``; no loop over rows.

    Offsets stay in Arrow's width (int32 for ``list``), which halves the index traffic. Gathering
    rows: output position ``t`` reads ``values[starts[r] + t - new_offsets[r]]`` for the row ``r``
    holding ``t``, i.e. one ``np.repeat`` and one gather.
    """
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy().astype(np.int64, copy=False)
    lengths = np.diff(offsets).astype(np.int32, copy=False)
    if order is None:
        return offsets, lengths, values
    _warm(offsets)
    lengths = lengths.take(order)
    starts = offsets.take(order)
    new_offsets = np.zeros(len(order) + 1, offsets.dtype)
    np.cumsum(lengths, out=new_offsets[1:])
    source = np.repeat(starts - new_offsets[:-1], lengths)
    source += np.arange(new_offsets[-1], dtype=source.dtype)
    _warm(values)
    return new_offsets, lengths, values.take(source)


def _numpy(column: pa.ChunkedArray) -> np.ndarray:
    """A column as NumPy: a view of the Arrow buffer when it is one null-free chunk."""
    if column.num_chunks == 1:
        return column.chunk(0).to_numpy(zero_copy_only=False)
    return column.to_numpy()
