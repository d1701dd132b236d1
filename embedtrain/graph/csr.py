"""Building a graph's CSR from an edge list, and holding out edges for link prediction.

:func:`csr_from_edges` turns an edge list into the CSR (vectorised, in bounded memory), counting
what it drops in an :class:`EdgeCounts` (:func:`embedtrain.graph.csr_external.csr_from_edge_chunks`
does the same for edge lists larger than memory); :func:`hold_out_edges` takes link-prediction positives
out of it; :func:`edge_pairs` and :func:`row_blocks` walk a CSR in bounded memory. The result is
written by :func:`embedtrain.graph.store.write_graph`.

"Neighbours of u" are the nodes u aggregates messages from: for an undirected graph both
directions are stored, for a directed one u's in-neighbours (the sources of edges pointing at u).
Neighbour ids within a row are sorted ascending.

Example:
    >>> indptr, indices, weights, counts = csr_from_edges(
    ...     np.array([0, 1, 1, 2]), np.array([1, 2, 2, 2]), num_nodes=3)
    >>> indptr.tolist(), indices.tolist(), counts.self_loops_dropped, counts.duplicates_dropped
    ([0, 1, 3, 4], [1, 0, 2, 1], 1, 1)
"""

from __future__ import annotations

import enum
import mmap
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Optional

import numpy as np

EDGE_SPLITS = ("valid", "test")   # the held-out edge sets, in the order they are returned
CHUNK = 1 << 24                 # entries per chunk of the bounded-memory passes
_MAX_NODES = 3_037_000_499       # row * N + col must fit in int64


class SelfLoops(enum.Enum):
    """What :func:`csr_from_edges` does with an edge from a node to itself."""

    DROP = "drop"  # counted in ``self_loops_dropped``
    KEEP = "keep"  # stored once in the node's row (also in an undirected graph)


class Duplicates(enum.Enum):
    """What :func:`csr_from_edges` does with an edge given more than once."""

    DROP = "drop"  # the first one is kept (with its weight); the others are counted and dropped
    KEEP = "keep"  # all are stored (a multigraph); still counted
    SUM = "sum"    # merged into one edge whose weight is the sum (without weights: the count)


@dataclass(frozen=True)
class EdgeCounts:
    """What :func:`csr_from_edges` made of its input edges.

    ``input_edges == edges + self_loops_dropped + duplicates_dropped + duplicates_merged``, where
    ``edges`` counts stored edges (an undirected edge once, although stored in two rows).
    """

    input_edges: int
    edges: int
    csr_entries: int
    self_loops: int            # input edges u -> u
    self_loops_dropped: int
    duplicates: int            # input edges repeating an earlier one (among those not dropped)
    duplicates_dropped: int
    duplicates_merged: int     # duplicates whose weight was added to the first one's

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# --- building a CSR --------------------------------------------------------------------------

def csr_from_edges(src: np.ndarray, dst: np.ndarray, num_nodes: int,
                   weights: Optional[np.ndarray] = None, undirected: bool = True,
                   self_loops: SelfLoops | str = SelfLoops.DROP,
                   duplicates: Duplicates | str = Duplicates.DROP,
                   ) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray], EdgeCounts]:
    """Builds the CSR of an edge list, vectorised (one sort of the edge keys).

    Args:
        src: source node ids, integer, in ``[0, num_nodes)``.
        dst: destination node ids, same length.
        num_nodes: ``N``.
        weights: optional positive edge weights, same length.
        undirected: store each edge in both rows; ``(u, v)`` and ``(v, u)`` are duplicates.
            Else row ``v`` holds the sources of the edges pointing at ``v``.
        self_loops: :class:`SelfLoops` (or its value).
        duplicates: :class:`Duplicates` (or its value). ``sum`` without weights gives weights
            holding each edge's multiplicity.

    Returns:
        ``(indptr, indices, weights, counts)``: int64 ``[N + 1]``; int32 (int64 from 2**31
        nodes) ``[E]``, rows sorted ascending; float32 ``[E]`` or None; :class:`EdgeCounts`.

    Raises:
        ValueError: mismatched lengths, non-integer ids, or ids outside ``[0, num_nodes)``.

    Example:
        >>> indptr, indices, _, _ = csr_from_edges(np.array([2, 0]), np.array([0, 1]), 3,
        ...                                        undirected=False)  # 2 -> 0, 0 -> 1
        >>> indptr.tolist(), indices.tolist()  # row v: the sources of edges into v
        ([0, 1, 2, 2], [2, 0])
    """
    self_loops, duplicates = SelfLoops(self_loops), Duplicates(duplicates)
    src, dst, n = _check_edges(src, dst, num_nodes, weights)
    big = np.int64(num_nodes)
    loops = src == dst
    n_loops = int(np.count_nonzero(loops))
    drop_loops = self_loops is SelfLoops.DROP
    # Entries keyed row * N + col. Undirected edges are interleaved (forward, backward) so that a
    # stable sort keeps the input order for both directions of an edge; excluded entries get the
    # largest key and end up past the cut after the sort.
    sentinel = np.iinfo(np.int64).max
    if undirected:
        keys = np.empty(2 * n, dtype=np.int64)
        forward, backward = keys[0::2], keys[1::2]
        forward[:] = src
        forward *= big
        forward += dst
        backward[:] = dst
        backward *= big
        backward += src
        backward[loops] = sentinel   # a self-loop is stored once
        excluded = n_loops
    else:
        keys = dst.astype(np.int64)  # row = destination: in-neighbours
        keys *= big
        keys += src
        forward, excluded = keys, 0
    if drop_loops:
        forward[loops] = sentinel
        excluded += n_loops
    del loops, forward
    order = None
    if weights is None:
        keys.sort()
    else:
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
    m = keys.shape[0] - excluded
    keys = keys[:m]
    w = None
    if order is not None:
        w = np.asarray(weights, dtype=np.float64)[order[:m] // 2 if undirected else order[:m]]
        del order
    keys, out_w, dup_loop_entries, dup_other = _merge_duplicates(
        keys, w, big, duplicates, count_only=weights is None and duplicates is Duplicates.SUM)
    del w
    indptr, indices = _csr_from_sorted_keys(keys, num_nodes)
    counts = _edge_counts(n, n_loops, int(indices.shape[0]), dup_loop_entries, dup_other,
                          undirected, self_loops, duplicates)
    return indptr, indices, out_w, counts


def _edge_counts(n: int, n_loops: int, entries: int, dup_loop_entries: int, dup_other: int,
                 undirected: bool, self_loops: SelfLoops, duplicates: Duplicates) -> EdgeCounts:
    """The :class:`EdgeCounts` of a build from its tallies (duplicate entries found among the
    kept ones: those on the diagonal, and the others, which an undirected graph has twice)."""
    drop_loops = self_loops is SelfLoops.DROP
    n_dups = dup_loop_entries + (dup_other // 2 if undirected else dup_other)
    loop_entries = 0 if drop_loops else n_loops - (
        dup_loop_entries if duplicates is not Duplicates.KEEP else 0)
    stored = (entries - loop_entries) // 2 + loop_entries if undirected else entries
    return EdgeCounts(
        input_edges=n, edges=int(stored), csr_entries=entries,
        self_loops=n_loops, self_loops_dropped=n_loops if drop_loops else 0,
        duplicates=n_dups,
        duplicates_dropped=n_dups if duplicates is Duplicates.DROP else 0,
        duplicates_merged=n_dups if duplicates is Duplicates.SUM else 0)


def _merge_duplicates(keys: np.ndarray, w: Optional[np.ndarray], big: np.int64,
                      duplicates: Duplicates, count_only: bool
                      ) -> tuple[np.ndarray, Optional[np.ndarray], int, int]:
    """Sorted entry keys (and their weights, float64, in the same order) -> the stored keys and
    float32 weights after ``duplicates``; with the duplicate entries on the diagonal and off it.

    ``count_only``: no input weights but ``sum``: the weights become the multiplicities."""
    m = keys.shape[0]
    first = np.empty(m, dtype=bool)
    first[:1] = True
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    dup_keys = keys[~first]
    dup_loop_entries = int(np.count_nonzero(dup_keys // big == dup_keys % big))
    dup_other = dup_keys.shape[0] - dup_loop_entries
    del dup_keys
    out_w: Optional[np.ndarray] = None
    if count_only:
        out_w = np.diff(np.append(np.flatnonzero(first), m)).astype(np.float32)
    elif w is not None:
        if duplicates is Duplicates.SUM:
            out_w = np.add.reduceat(w, np.flatnonzero(first)).astype(np.float32) if m else (
                np.empty(0, dtype=np.float32))
        elif duplicates is Duplicates.DROP:
            out_w = w[first].astype(np.float32)
        else:
            out_w = w.astype(np.float32)
    if duplicates is not Duplicates.KEEP:
        keys = _compact(keys, first)
    return keys, out_w, dup_loop_entries, dup_other


def _check_edges(src: Any, dst: Any, num_nodes: int, weights: Any
                 ) -> tuple[np.ndarray, np.ndarray, int]:
    src, dst = np.asarray(src), np.asarray(dst)
    if src.ndim != 1 or src.shape != dst.shape:
        raise ValueError(f"src and dst must be 1-D of one length, got shapes {src.shape} and "
                         f"{dst.shape}")
    if src.shape[0] and not (np.issubdtype(src.dtype, np.integer)
                             and np.issubdtype(dst.dtype, np.integer)):
        raise ValueError(f"src and dst must hold integers, got {src.dtype} and {dst.dtype}")
    if not 0 <= int(num_nodes) <= _MAX_NODES:
        raise ValueError(f"num_nodes must be in [0, {_MAX_NODES}], got {num_nodes}")
    if weights is not None and np.shape(weights) != src.shape:
        raise ValueError(f"weights must have the edges' shape {src.shape}, got "
                         f"{np.shape(weights)}")
    for name, ids in (("src", src), ("dst", dst)):
        if ids.shape[0]:
            lo, hi = chunked_min_max(ids)
            if lo < 0 or hi >= num_nodes:
                raise ValueError(f"{name}: ids must be in [0, {num_nodes}), got "
                                 f"{lo if lo < 0 else hi}")
    return src, dst, src.shape[0]


def chunked_min_max(a: np.ndarray) -> tuple[int, int]:
    """``(min, max)`` of a non-empty 1-D array, a chunk at a time (bounded memory on mmaps).

    A whole memory-mapped file is read through ``read`` calls rather than its mapping: the
    pages it passes stay in the page cache, out of the process's RSS (a mapping's pages count
    there until the kernel reclaims them)."""
    lo, hi = None, None
    for part in _chunks(a):
        pmin, pmax = part.min(), part.max()
        lo = pmin if lo is None else min(lo, pmin)
        hi = pmax if hi is None else max(hi, pmax)
    return int(lo), int(hi)


def _chunks(a: np.ndarray) -> Iterator[np.ndarray]:
    """``a`` a chunk at a time; read from the file for a whole mapped file (its base the mapping
    itself, not a view of another memmap, whose ``offset`` would not be its own)."""
    if isinstance(a, np.memmap) and isinstance(a.base, mmap.mmap) and a.filename:
        with open(a.filename, "rb") as f:
            f.seek(a.offset)
            for start in range(0, a.shape[0], CHUNK):
                yield np.fromfile(f, dtype=a.dtype, count=min(CHUNK, a.shape[0] - start))
        return
    for start in range(0, a.shape[0], CHUNK):
        yield a[start:start + CHUNK]


def _compact(keys: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``keys[keep]`` in place, a chunk at a time (writes never pass the chunk being read)."""
    w = 0
    for start in range(0, keys.shape[0], CHUNK):
        part = keys[start:start + CHUNK][keep[start:start + CHUNK]]
        keys[w:w + part.shape[0]] = part
        w += part.shape[0]
    return keys[:w]


def _csr_from_sorted_keys(keys: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    big = np.int64(max(num_nodes, 1))
    dtype = np.int32 if num_nodes < 2**31 else np.int64
    indices = np.empty(keys.shape[0], dtype=dtype)
    degrees = np.zeros(num_nodes, dtype=np.int64)
    for start in range(0, keys.shape[0], CHUNK):
        part = keys[start:start + CHUNK]
        rows = part // big
        indices[start:start + part.shape[0]] = part - rows * big
        first = int(rows[0])  # rows are sorted: count into the chunk's row range only
        counts = np.bincount(rows - first)
        degrees[first:first + counts.shape[0]] += counts
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(degrees, out=indptr[1:])
    return indptr, indices


def row_blocks(indptr: np.ndarray, max_entries: int = CHUNK) -> list[tuple[int, int]]:
    """Consecutive node ranges ``[lo, hi)`` covering all nodes, each holding at most
    ``max_entries`` CSR entries or a single node, for passes over the CSR in bounded memory."""
    n = indptr.shape[0] - 1
    if n == 0:
        return []
    # the nodes holding entry max_entries * k each get a block of their own
    big = np.searchsorted(indptr, np.arange(0, int(indptr[-1]), max_entries), side="right") - 1
    bounds = np.unique(np.clip(np.concatenate([[0, n], big, big + 1]), 0, n))
    return [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]


# --- held-out edges (link prediction) --------------------------------------------------------

def edge_pairs(indptr: np.ndarray, indices: np.ndarray, directed: bool
               ) -> tuple[np.ndarray, np.ndarray]:
    """The distinct non-loop edges of a CSR as int64 ``(src, dst)``, sorted by ``(row, col)``.

    Undirected: ``src < dst``, each edge once. Directed: the edge ``src -> dst`` (row ``dst``).
    """
    rows_out, cols_out = [], []
    for lo, hi in row_blocks(indptr):  # a node's entries never straddle two blocks
        rows = np.repeat(np.arange(lo, hi, dtype=np.int64), np.diff(indptr[lo:hi + 1]))
        cols = np.asarray(indices[indptr[lo]:indptr[hi]]).astype(np.int64)
        keep = rows < cols if not directed else rows != cols
        rows, cols = rows[keep], cols[keep]
        if rows.shape[0]:
            first = np.ones(rows.shape[0], dtype=bool)
            first[1:] = (rows[1:] != rows[:-1]) | (cols[1:] != cols[:-1])
            rows, cols = rows[first], cols[first]
        rows_out.append(rows)
        cols_out.append(cols)
    rows = np.concatenate(rows_out) if rows_out else np.empty(0, dtype=np.int64)
    cols = np.concatenate(cols_out) if cols_out else np.empty(0, dtype=np.int64)
    return (rows, cols) if not directed else (cols, rows)


def hold_out_edges(indptr: np.ndarray, indices: np.ndarray, weights: Optional[np.ndarray],
                   directed: bool, valid_fraction: float, test_fraction: float, seed: int = 0,
                   rank: Optional[np.ndarray] = None,
                   ) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray], dict[str, np.ndarray]]:
    """Moves shares of the distinct non-loop edges out of the CSR into valid/test edge sets.

    Every stored copy of a held-out edge leaves the CSR (both directions when undirected), so a
    model never sees the edge it is asked to predict.

    Args:
        indptr, indices, weights: the CSR.
        directed: as in :func:`csr_from_edges`.
        valid_fraction, test_fraction: shares of the distinct edges (:func:`edge_pairs`).
        seed: random choice of the held-out edges (without ``rank``).
        rank: optional score per :func:`edge_pairs` edge (e.g. its time): the highest go to
            test, the next to valid, instead of a random choice.

    Returns:
        ``(indptr, indices, weights, {"valid": [2, M], "test": [2, M]})``, edges int64 in
        ``(src, dst)`` rows, sorted.
    """
    src, dst = edge_pairs(indptr, indices, directed)
    p = src.shape[0]
    n_test, n_valid = round(test_fraction * p), round(valid_fraction * p)
    if rank is None:
        order = np.random.default_rng(np.random.SeedSequence([seed, 7])).permutation(p)
    else:
        if np.shape(rank) != (p,):
            raise ValueError(f"rank must have one entry per distinct edge ({p}), got "
                             f"{np.shape(rank)}")
        order = np.argsort(-np.asarray(rank, dtype=np.float64), kind="stable")
    held = {"test": np.sort(order[:n_test]), "valid": np.sort(order[n_test:n_test + n_valid])}
    del order
    edges = {k: np.stack([src[held[k]], dst[held[k]]]).astype(np.int64) for k in EDGE_SPLITS}
    del src, dst
    # The held-out edges as row-major keys row * N + col of the entries storing them: the CSR's
    # own keys are sorted, so the membership test is a search with sorted queries (fast).
    big = np.int64(indptr.shape[0] - 1)
    parts = [e[1] * big + e[0] for e in edges.values()]  # row = dst, col = src
    if not directed:
        parts += [e[0] * big + e[1] for e in edges.values()]
    out_keys = np.sort(np.concatenate(parts))
    keep = np.ones(indices.shape[0], dtype=bool)
    degrees = np.diff(indptr)
    for lo, hi in row_blocks(indptr):
        a, b = int(indptr[lo]), int(indptr[hi])
        rows = np.repeat(np.arange(lo, hi, dtype=np.int64), degrees[lo:hi])
        keys = rows * big + np.asarray(indices[a:b])
        pos = np.minimum(np.searchsorted(out_keys, keys), max(out_keys.shape[0] - 1, 0))
        if out_keys.shape[0]:
            keep[a:b] = out_keys[pos] != keys
        degrees[lo:hi] = np.bincount(rows[keep[a:b]] - lo, minlength=hi - lo)
    new_indptr = np.zeros_like(indptr)
    np.cumsum(degrees, out=new_indptr[1:])
    new_w = None if weights is None else np.asarray(weights)[keep]
    return new_indptr, np.asarray(indices)[keep], new_w, edges
