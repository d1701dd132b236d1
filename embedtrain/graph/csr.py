"""Building a graph's CSR from an edge list, and holding out edges for link prediction.

:func:`csr_from_edges` turns an edge list into the CSR (vectorised, in bounded memory), counting
what it drops in an :class:`EdgeCounts`; :func:`csr_from_edge_chunks` does the same for edge lists
larger than memory (an external bucket sort by row, written to memory-mapped ``.npy`` files:
identical arrays and counts); :func:`hold_out_edges` takes link-prediction positives
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
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

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


# --- building a CSR larger than memory ------------------------------------------------------

ENTRY_BYTES = 24            # working bytes per entry of a bucket being sorted (keys, order, flags)
WEIGHTED_ENTRY_BYTES = 48   # ... with float64 weights alongside
_BUCKETS = 128              # node-range buckets of the spill pass (two open files each at most)
_SPLIT = 16                 # sub-buckets of a bucket over the memory budget
_SPILL = 1 << 22            # edges spilled at once (~0.3 GB of working memory)


def memory_budget(memory_gb: Optional[float]) -> int:
    """Bytes the CSR build may sort in memory: ``graph.memory_gb``, or a quarter of the RAM."""
    if memory_gb is not None:
        return int(memory_gb * 2**30)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


class ScratchDir:
    """A scratch folder beside an output folder for out-of-core builds, made on first use and
    removed by :meth:`close` (arrays built there are moved into the data set, not copied: one
    file system)."""

    def __init__(self, out: str | os.PathLike) -> None:
        self.out, self._path = Path(out), None

    def path(self) -> Path:
        if self._path is None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self._path = Path(tempfile.mkdtemp(prefix=f".{self.out.name}-scratch-",
                                               dir=self.out.parent))
        return self._path

    def close(self) -> None:
        if self._path is not None:
            shutil.rmtree(self._path, ignore_errors=True)
            self._path = None


def csr_from_edge_chunks(chunks: Iterable[tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]],
                         num_nodes: int, out_dir: str | os.PathLike, weighted: bool = False,
                         undirected: bool = True, self_loops: SelfLoops | str = SelfLoops.DROP,
                         duplicates: Duplicates | str = Duplicates.DROP,
                         memory_budget: int = 1 << 30, progress: Optional[Callable[[str], None]]
                         = None) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray],
                                          EdgeCounts]:
    """:func:`csr_from_edges` for edge lists larger than memory: the same CSR, counts and
    weights, built by an external bucket sort and written straight to memory-mapped files.

    1. *Spill*: each chunk's CSR entries (keys ``row * N + col``, as :func:`csr_from_edges`
       makes them, in input order) go to the file of their row's bucket, one of up to 128 equal
       node ranges, in ``out_dir/buckets`` (appended in input order, so a bucket's stable sort
       orders repeated entries as the in-memory sort does).
    2. *Sort*: bucket by bucket in node order, the entries are sorted, their duplicates dropped,
       kept or summed (:func:`_merge_duplicates`), and appended to ``indices.npy`` (and
       ``weights.npy``); a node's row lies in one bucket, so the rows come out in order. A bucket
       holding more entries than ``memory_budget`` allows is split again into 16 node ranges
       (down to one node a bucket).

    Peak memory: the chunk being spilled, ``indptr`` (8 bytes a node), and one bucket of at most
    ``memory_budget`` bytes (:data:`ENTRY_BYTES` an entry, :data:`WEIGHTED_ENTRY_BYTES` with
    weights); disk: the entries twice (the buckets are deleted as they are read).

    Args:
        chunks: ``(src, dst, weights)`` integer id arrays (weights None unless ``weighted``),
            in input order; each is checked as in :func:`csr_from_edges`.
        num_nodes: ``N``.
        out_dir: where ``indptr.npy``, ``indices.npy`` (and ``weights.npy``) are written (a
            scratch folder: :func:`embedtrain.graph.store.write_graph` moves memory-mapped
            arrays into place rather than copying them); created if missing.
        weighted: the chunks carry weights.
        undirected, self_loops, duplicates: as in :func:`csr_from_edges`.
        memory_budget: bytes a bucket may take while it is sorted.
        progress: called with a short message after each bucket (for a progress bar).

    Returns:
        ``(indptr, indices, weights, counts)`` as :func:`csr_from_edges`, the arrays memory-mapped
        from ``out_dir``.

    Raises:
        ValueError: a chunk as :func:`csr_from_edges` refuses it.

    Example:
        >>> chunks = [(np.array([0, 1]), np.array([1, 2]), None), (np.array([1]), np.array([2]),
        ...           None)]
        >>> indptr, indices, _, counts = csr_from_edge_chunks(chunks, 3, "/tmp/csr",
        ...                                                   memory_budget=64)  # doctest: +SKIP
        >>> indices.tolist(), counts.duplicates_dropped  # doctest: +SKIP
        ([1, 0, 2, 1], 1)
    """
    self_loops, duplicates = SelfLoops(self_loops), Duplicates(duplicates)
    out = Path(out_dir)
    spill = out / "buckets"
    spill.mkdir(parents=True, exist_ok=True)
    big = np.int64(max(num_nodes, 1))
    width = -(-max(num_nodes, 1) // _BUCKETS)  # nodes a bucket
    buckets = [(lo, min(lo + width, num_nodes)) for lo in range(0, max(num_nodes, 1), width)]
    files = [_Bucket(spill / f"b{i}", weighted) for i in range(len(buckets))]
    n = n_loops = 0
    try:
        for src, dst, w in chunks:
            src, dst, m = _check_edges(src, dst, num_nodes, w if weighted else None)
            if weighted and w is None:
                raise ValueError("weighted: every chunk needs weights")
            for a in range(0, m, _SPILL):  # a slice at a time: bounded working memory
                b = min(a + _SPILL, m)
                n_loops += _spill(files, src[a:b], dst[a:b], w[a:b] if weighted else None, big,
                                  big * width, undirected, self_loops is SelfLoops.DROP)
            n += m
            if progress is not None:
                progress(f"spilled {n:,} edges")
    finally:
        for f in files:
            f.close()

    dtype = np.int32 if num_nodes < 2**31 else np.int64
    total = sum(f.entries for f in files)  # an upper bound on the stored entries
    indices = _open_npy(out / "indices.npy.tmp", dtype, total)
    out_w = _open_npy(out / "weights.npy.tmp", np.float32, total) if (
        weighted or duplicates is Duplicates.SUM) else None
    degrees = np.zeros(num_nodes, dtype=np.int64)
    state = _SortState(big, duplicates, weighted, memory_budget, indices, out_w, degrees)
    for (lo, hi), f in zip(buckets, files):
        state.sort_bucket(f, lo, hi)
        if progress is not None:
            progress(f"sorted nodes < {hi:,}")
    spill.rmdir()
    entries = state.written
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(degrees, out=indptr[1:])
    del degrees
    counts = _edge_counts(n, n_loops, entries, state.dup_loop_entries, state.dup_other,
                          undirected, self_loops, duplicates)
    indices = _finish(indices, out / "indices.npy", entries)
    if out_w is not None:
        out_w = _finish(out_w, out / "weights.npy", entries)
    np.save(out / "indptr.npy", indptr)
    return indptr, indices, out_w, counts


def _spill(files: list["_Bucket"], src: np.ndarray, dst: np.ndarray, w: Optional[np.ndarray],
           big: np.int64, span: np.int64, undirected: bool, drop_loops: bool) -> int:
    """Appends a slice of edges' entries to their buckets (``span``: keys a bucket covers, as
    ``row // width == key // (N * width)``); returns its self-loops."""
    keys, ew, loops = _entries(src, dst, w, big, undirected, drop_loops)
    which = keys // span
    order = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[order], np.arange(len(files) + 1))
    del which
    for b in np.flatnonzero(np.diff(bounds)):
        part = order[bounds[b]:bounds[b + 1]]
        files[b].append(keys[part], None if ew is None else ew[part])
    return loops


def _entries(src: np.ndarray, dst: np.ndarray, w: Optional[np.ndarray], big: np.int64,
             undirected: bool, drop_loops: bool
             ) -> tuple[np.ndarray, Optional[np.ndarray], int]:
    """One chunk's CSR entry keys in :func:`csr_from_edges`' order (undirected: forward and
    backward interleaved), excluded entries left out; their float64 weights; its self-loops."""
    loops = src == dst
    n_loops = int(np.count_nonzero(loops))
    if undirected:
        keys = np.empty(2 * src.shape[0], dtype=np.int64)
        keys[0::2] = src.astype(np.int64) * big + dst
        keys[1::2] = dst.astype(np.int64) * big + src
        keep = np.ones(keys.shape[0], dtype=bool)
        keep[1::2] = ~loops          # a self-loop is stored once
        if drop_loops:
            keep[0::2] = ~loops
        ew = None if w is None else np.repeat(np.asarray(w, dtype=np.float64), 2)
    else:
        keys = dst.astype(np.int64) * big + src
        keep = ~loops if drop_loops else None
        ew = None if w is None else np.asarray(w, dtype=np.float64)
    if keep is not None:
        keys = keys[keep]
        ew = None if ew is None else ew[keep]
    return keys, ew, n_loops


class _Bucket:
    """A spill file of entry keys (and float64 weights), appended in input order."""

    def __init__(self, path: Path, weighted: bool) -> None:
        self.path, self.weighted, self.entries = path, weighted, 0
        self._keys = self._w = None

    def append(self, keys: np.ndarray, w: Optional[np.ndarray]) -> None:
        if self._keys is None:
            self._keys = open(self.path.with_suffix(".keys"), "ab")
            self._w = open(self.path.with_suffix(".w"), "ab") if self.weighted else None
        keys.tofile(self._keys)
        if self._w is not None:
            w.tofile(self._w)
        self.entries += keys.shape[0]

    def close(self) -> None:
        for f in (self._keys, self._w):
            if f is not None:
                f.close()
        self._keys = self._w = None

    def read(self, start: int = 0, count: int = -1
             ) -> tuple[np.ndarray, Optional[np.ndarray]]:
        if not self.entries:
            return np.empty(0, np.int64), (np.empty(0, np.float64) if self.weighted else None)
        keys = np.fromfile(self.path.with_suffix(".keys"), np.int64, count, offset=8 * start)
        w = np.fromfile(self.path.with_suffix(".w"), np.float64, count, offset=8 * start) if (
            self.weighted) else None
        return keys, w

    def remove(self) -> None:
        self.path.with_suffix(".keys").unlink(missing_ok=True)
        self.path.with_suffix(".w").unlink(missing_ok=True)


@dataclass
class _SortState:
    """The sort pass: output arrays, how far they are written, and the duplicate tallies."""

    big: np.int64
    duplicates: Duplicates
    weighted: bool
    memory_budget: int
    indices: np.ndarray
    weights: Optional[np.ndarray]
    degrees: np.ndarray
    written: int = 0
    dup_loop_entries: int = 0
    dup_other: int = 0

    def sort_bucket(self, bucket: _Bucket, lo: int, hi: int) -> None:
        """Sorts a bucket of the rows ``[lo, hi)`` into the output (splitting it if too big)."""
        per_entry = WEIGHTED_ENTRY_BYTES if self.weighted else ENTRY_BYTES
        if bucket.entries * per_entry > self.memory_budget and hi - lo > 1:
            self._split(bucket, lo, hi, per_entry)
            return
        keys, w = bucket.read()
        bucket.remove()
        if w is not None:
            order = np.argsort(keys, kind="stable")
            keys, w = keys[order], w[order]
            del order
        else:
            keys.sort()
        keys, out_w, loops, other = _merge_duplicates(
            keys, w, self.big, self.duplicates,
            count_only=not self.weighted and self.duplicates is Duplicates.SUM)
        self.dup_loop_entries += loops
        self.dup_other += other
        rows = keys // self.big
        a, b = self.written, self.written + keys.shape[0]
        self.indices[a:b] = keys - rows * self.big
        if self.weights is not None:
            self.weights[a:b] = out_w
        if keys.shape[0]:
            self.degrees[lo:hi] += np.bincount(rows - lo, minlength=hi - lo)
        self.written = b

    def _split(self, bucket: _Bucket, lo: int, hi: int, per_entry: int) -> None:
        width = -(-(hi - lo) // _SPLIT)
        ranges = [(a, min(a + width, hi)) for a in range(lo, hi, width)]
        parts = [_Bucket(bucket.path.with_name(f"{bucket.path.name}_{i}"), self.weighted)
                 for i in range(len(ranges))]
        step = max(1, self.memory_budget // per_entry)
        try:
            for start in range(0, bucket.entries, step):
                keys, w = bucket.read(start, min(step, bucket.entries - start))
                which = (keys // self.big - lo) // width
                order = np.argsort(which, kind="stable")
                bounds = np.searchsorted(which[order], np.arange(len(ranges) + 1))
                for i in np.flatnonzero(np.diff(bounds)):
                    part = order[bounds[i]:bounds[i + 1]]
                    parts[i].append(keys[part], None if w is None else w[part])
        finally:
            for p in parts:
                p.close()
        bucket.remove()
        for (a, b), p in zip(ranges, parts):
            self.sort_bucket(p, a, b)


_HEADER = 128  # bytes of the .npy header of the sort pass's outputs (room for any 1-D shape)


def _open_npy(path: Path, dtype: type, length: int) -> np.memmap:
    """A writable 1-D memory map of ``length`` entries behind a ``.npy`` header of
    :data:`_HEADER` bytes (a sparse file: disk is used as entries are written)."""
    with open(path, "wb") as f:
        f.write(_npy_header(np.dtype(dtype), length))
        f.truncate(_HEADER + max(length, 1) * np.dtype(dtype).itemsize)  # an empty map fails
    return np.memmap(path, dtype=dtype, mode="r+", offset=_HEADER, shape=(max(length, 1),))


def _finish(array: np.memmap, path: Path, length: int) -> np.ndarray:
    """The first ``length`` entries of a :func:`_open_npy` map as the ``.npy`` file ``path``:
    header rewritten for the new shape, file truncated, renamed; memory-mapped read-only."""
    tmp, dtype = Path(array.filename), array.dtype
    array.flush()
    del array
    with open(tmp, "r+b") as f:
        f.write(_npy_header(dtype, length))
        f.truncate(_HEADER + length * dtype.itemsize)
    os.replace(tmp, path)
    return np.load(path, mmap_mode="r" if length else None)  # an empty file cannot be mapped


def _npy_header(dtype: np.dtype, length: int) -> bytes:
    """The ``.npy`` header ``np.save`` writes for a 1-D array (numpy pads it for the shape to
    grow, so it is :data:`_HEADER` bytes whatever ``length``: checked)."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {
        "descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (length,)})
    header = buf.getvalue()
    if len(header) != _HEADER:
        raise RuntimeError(f"numpy's .npy header is {len(header)} bytes, expected {_HEADER}")
    return header


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
    """``(min, max)`` of a non-empty 1-D array, a chunk at a time (bounded memory on mmaps)."""
    lo, hi = None, None
    for start in range(0, a.shape[0], CHUNK):
        part = a[start:start + CHUNK]
        pmin, pmax = part.min(), part.max()
        lo = pmin if lo is None else min(lo, pmin)
        hi = pmax if hi is None else max(hi, pmax)
    return int(lo), int(hi)


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
