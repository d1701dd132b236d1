"""Building a graph's CSR from an edge list larger than memory.

:func:`csr_from_edge_chunks` is :func:`embedtrain.graph.csr.csr_from_edges` for edge lists that
do not fit: an external bucket sort by row, written to memory-mapped ``.npy`` files, giving
identical arrays and counts. :func:`memory_budget` reads ``graph.memory_gb``; :class:`ScratchDir`
holds the build's files beside the output folder.

Example:
    >>> chunks = [(np.array([0, 1]), np.array([1, 2]), None), (np.array([1]), np.array([2]),
    ...           None)]
    >>> indptr, indices, _, counts = csr_from_edge_chunks(chunks, 3, "/tmp/csr",
    ...                                                   memory_budget=64)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np

from embedtrain.graph.csr import (
    Duplicates,
    EdgeCounts,
    SelfLoops,
    _check_edges,
    _edge_counts,
    _merge_duplicates,
)

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
