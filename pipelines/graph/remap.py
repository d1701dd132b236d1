"""The out-of-core id remap of integer ids: sorted arrays and binary search, not hash joins.

At 10^8 nodes a Polars hash table of the ids (the first-appearance group-by, then the two
left joins of the in-memory remap) is the ingest's largest allocation: 7.4 GiB at 79M ids. This
path holds the id map as two sorted ``int64`` arrays (16 bytes an id; ~1.6 GiB at 10^8, twice
that while a batch's new ids are merged in) and streams the edges through it twice:

1. each shard's usable edges are streamed to a scratch parquet file (Polars' streaming engine,
   input order kept): :func:`sink_kept`;
2. one pass over them builds the map (:class:`IntegerIdMap`): node-table ids first (in table
   order), then each batch's endpoints not seen before, in order of first appearance (src before
   dst within a row): the first batch an id is in holds its first appearance, so the dense ids
   come out as the Polars path numbers them;
3. a second pass remaps each batch by ``searchsorted`` and writes ``s, d`` (null where an
   endpoint is not in the map, ``missing_nodes: drop``) with the weight and time, the files the
   out-of-core CSR build reads: :func:`remap_parts`.

The result equals the Polars path's, file for file (``tests/test_csr_external.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

BATCH_ROWS = 1 << 22


def sink_kept(kept: pl.LazyFrame, columns: Sequence[str], path: Path) -> Path:
    """Streams a shard's usable edges (``columns``, input order) to ``path``; never collected."""
    kept.select(list(columns)).sink_parquet(path, row_group_size=1 << 20)
    return path


def read_batches(paths: Sequence[Path], columns: Sequence[str],
                 batch_size: int = BATCH_ROWS) -> Iterator[pa.RecordBatch]:
    """The files' rows a batch at a time, in order. Arrow's ``pre_buffer`` keeps the coalesced
    reads of every row group read until the file is closed (+0.4 GiB anonymous a 100M rows of
    a 1B-row file, measured): off."""
    for path in paths:
        yield from pq.ParquetFile(path, pre_buffer=False).iter_batches(
            batch_size=batch_size, columns=columns)


class IntegerIdMap:
    """``id -> dense`` for ``int64`` ids: a direct table over the ids' range where it fits
    (``id_range``; one ``int64`` per id in the range, -1 where unmapped: one gather a lookup), else
    two sorted arrays (``keys`` ascending and the dense id of each; a batch is sorted, then
    binary-searched, ~10x slower).

    Args:
        head: ids numbered first, in order (the node table's); must be distinct.
        id_range: ``(lo, hi)``, inclusive, holding every id looked up or added; None: sorted
            arrays.
    """

    def __init__(self, head: Optional[np.ndarray] = None,
                 id_range: Optional[tuple[int, int]] = None) -> None:
        head = np.zeros(0, np.int64) if head is None else np.asarray(head, np.int64)
        self.size = int(head.shape[0])
        self.table = None
        if id_range is not None:
            self.lo = id_range[0]
            self.table = np.full(id_range[1] - id_range[0] + 1, -1, np.int64)
            self.table[head - self.lo] = np.arange(self.size)
        else:
            order = np.argsort(head, kind="stable")
            self.keys, self.dense = head[order], order.astype(np.int64)

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(dense, found)``: each id's dense id (0 where not found) and whether it is mapped."""
        if self.table is not None:
            inside = (ids >= self.lo) & (ids < self.lo + self.table.shape[0])
            dense = self.table[np.where(inside, ids - self.lo, 0)]
            found = inside & (dense >= 0)
            return np.where(found, dense, 0), found
        order = np.argsort(ids)
        dense, found = self._find_sorted(ids[order])
        out, mask = np.empty_like(dense), np.empty_like(found)
        out[order], mask[order] = dense, found
        return out, mask

    def _find_sorted(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not self.keys.shape[0]:
            return np.zeros(ids.shape, np.int64), np.zeros(ids.shape, bool)
        at = np.minimum(np.searchsorted(self.keys, ids), self.keys.shape[0] - 1)
        found = self.keys[at] == ids
        return np.where(found, self.dense[at], 0), found

    def add_first_seen(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Numbers the endpoints not yet mapped by first appearance (row order, src first)."""
        endpoints = np.empty(2 * src.shape[0], np.int64)
        endpoints[0::2], endpoints[1::2] = src, dst
        if self.table is not None:
            endpoints = endpoints[self.table[endpoints - self.lo] < 0]  # order kept
        unique, first = np.unique(endpoints, return_index=True)
        if self.table is None:
            new = ~self._find_sorted(unique)[1]
            unique, first = unique[new], first[new]
        if not unique.shape[0]:
            return
        dense = np.empty(unique.shape[0], np.int64)
        dense[np.argsort(first, kind="stable")] = np.arange(self.size, self.size + unique.shape[0])
        self.size += int(unique.shape[0])
        if self.table is not None:
            self.table[unique - self.lo] = dense
            return
        at = np.searchsorted(self.keys, unique)
        self.keys, self.dense = np.insert(self.keys, at, unique), np.insert(self.dense, at, dense)

    def truncate(self, n: int) -> None:
        """Keeps the ids numbered below ``n`` (``missing_nodes: drop``: the node table's)."""
        self.size = min(self.size, n)
        if self.table is not None:
            self.table[self.table >= n] = -1
            return
        keep = self.dense < n
        self.keys, self.dense = self.keys[keep], self.dense[keep]

    def ids(self) -> np.ndarray:
        """The ids in dense order."""
        out = np.empty(self.size, np.int64)
        if self.table is not None:
            at = np.flatnonzero(self.table >= 0)
            out[self.table[at]] = at + self.lo
        else:
            out[self.dense] = self.keys
        return out


def id_range(kept: Sequence[Path], head: Optional[np.ndarray]) -> Optional[tuple[int, int]]:
    """The smallest and largest id among the ``kept`` files' endpoints and ``head`` (None: no
    ids)."""
    both = pl.scan_parquet(list(kept)).select(
        pl.min_horizontal(pl.col("src").min(), pl.col("dst").min()).alias("lo"),
        pl.max_horizontal(pl.col("src").max(), pl.col("dst").max()).alias("hi")).collect().row(0)
    lo, hi = both
    if head is not None and head.shape[0]:
        lo = int(head.min()) if lo is None else min(lo, int(head.min()))
        hi = int(head.max()) if hi is None else max(hi, int(head.max()))
    return None if lo is None else (int(lo), int(hi))


def build_id_map(kept: Sequence[Path], head: Optional[np.ndarray], budget: int,
                 progress: Callable[[str], None] = lambda _: None) -> IntegerIdMap:
    """The id map of :mod:`this module <pipelines.graph.remap>`'s step 2: ``head``, then every
    other endpoint of the ``kept`` files; a direct table if the ids' range fits ``budget``
    bytes."""
    span = id_range(kept, head)
    direct = span is not None and (span[1] - span[0] + 1) * 8 <= budget
    ids = IntegerIdMap(head, span if direct else None)
    rows = 0
    for batch in read_batches(kept, ["src", "dst"]):
        ids.add_first_seen(batch.column(0).to_numpy(), batch.column(1).to_numpy())
        rows += batch.num_rows
        progress(f"id map: {rows / 1e6:,.0f}M rows, {ids.size:,} ids")
    return ids


def remap_parts(kept: Sequence[Path], ids: IntegerIdMap, columns: Sequence[str],
                out: Sequence[Path], progress: Callable[[str], None] = lambda _: None) -> None:
    """Step 3: each ``kept[i]`` remapped into ``out[i]`` (``s, d`` and the other ``columns``),
    then deleted."""
    rows = 0
    for path, target in zip(kept, out):
        writer = None
        for batch in read_batches([path], list(columns)):
            arrays = {}
            for name, col in (("s", "src"), ("d", "dst")):
                dense, found = ids.find(batch.column(columns.index(col)).to_numpy())
                arrays[name] = pa.array(dense, mask=~found)
            for name in columns[2:]:
                arrays[name] = batch.column(columns.index(name))
            table = pa.table(arrays)
            if writer is None:
                writer = pq.ParquetWriter(target, table.schema)
            writer.write_table(table, row_group_size=1 << 20)
            rows += batch.num_rows
            progress(f"remap: {rows / 1e6:,.0f}M rows")
        if writer is None:  # no usable rows in this shard: an empty file of the same columns
            schema = pq.read_schema(path)
            empty = {n: pa.array([], pa.int64()) for n in ("s", "d")}
            empty.update({n: pa.array([], schema.field(n).type) for n in columns[2:]})
            pq.write_table(pa.table(empty), target)
        else:
            writer.close()
        path.unlink()
