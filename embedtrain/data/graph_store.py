"""The on-disk graph data set: a CSR over the nodes, node arrays, splits.

A graph data set is a directory holding ``metadata.json`` and ``.npy`` files written by
:func:`write_graph` (the synthetic generator :mod:`embedtrain.data.datagen_graph` and the ingestion
job :mod:`pipelines.graph` both use it) and read by :func:`load_graph`, which memory-maps the
arrays and checks that they are consistent. :func:`csr_from_edges` turns an edge list into the
CSR, counting what it drops; :func:`hold_out_edges` takes link-prediction positives out of it.

"Neighbours of u" are the nodes u aggregates messages from: for an undirected graph both
directions are stored, for a directed one u's in-neighbours (the sources of edges pointing at u).
Neighbour ids within a row are sorted ascending.

Example:
    >>> indptr, indices, weights, counts = csr_from_edges(
    ...     np.array([0, 1, 1, 2]), np.array([1, 2, 2, 2]), num_nodes=3)
    >>> indptr.tolist(), indices.tolist(), counts.self_loops_dropped, counts.duplicates_dropped
    ([0, 1, 3, 4], [1, 0, 2, 1], 1, 1)
    >>> write_graph("/tmp/g", indptr, indices, name="tiny")  # doctest: +SKIP
    >>> load_graph("/tmp/g").num_edges  # doctest: +SKIP
    4
"""

from __future__ import annotations

import enum
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from embedtrain.features import DatasetError

FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
NODE_SPLITS = ("train", "valid", "test")
EDGE_SPLITS = ("valid", "test")
_SUBDIRS = ("graph", "nodes", "splits")
_CHUNK = 1 << 24                 # entries per chunk of the bounded-memory passes
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


@dataclass
class GraphData:
    """A loaded graph data set; arrays are read-only memory maps unless loaded with ``mmap=False``.

    ``splits`` maps ``train``/``valid``/``test`` to int64 node ids; ``edge_splits`` maps
    ``valid``/``test`` to int64 ``[2, M]`` held-out positive edges (not in the CSR).
    """

    root: Path
    name: str
    num_nodes: int
    directed: bool
    indptr: np.ndarray
    indices: np.ndarray
    weights: Optional[np.ndarray] = None
    features: Optional[np.ndarray] = None
    labels: Optional[np.ndarray] = None
    num_classes: Optional[int] = None
    splits: dict[str, np.ndarray] = field(default_factory=dict)
    edge_splits: dict[str, np.ndarray] = field(default_factory=dict)
    id_map: Optional[Path] = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_edges(self) -> int:
        """CSR entries (an undirected edge counts twice, a self-loop once)."""
        return int(self.indices.shape[0])

    @property
    def num_features(self) -> int:
        return 0 if self.features is None else int(self.features.shape[1])

    def degrees(self) -> np.ndarray:
        """Neighbours per node (in-degree for a directed graph)."""
        return np.diff(self.indptr)


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
    if order is not None:
        order = order[:m]

    first = np.empty(m, dtype=bool)
    first[:1] = True
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    dup_keys = keys[~first]
    dup_loop_entries = int(np.count_nonzero(dup_keys // big == dup_keys % big))
    dup_other = dup_keys.shape[0] - dup_loop_entries
    n_dups = dup_loop_entries + (dup_other // 2 if undirected else dup_other)
    del dup_keys

    out_w: Optional[np.ndarray] = None
    if order is None and duplicates is Duplicates.SUM:  # no weights: the multiplicities
        out_w = np.diff(np.append(np.flatnonzero(first), m)).astype(np.float32)
    elif order is not None:
        w = np.asarray(weights, dtype=np.float64)[order // 2 if undirected else order]
        del order
        if duplicates is Duplicates.SUM:
            out_w = np.add.reduceat(w, np.flatnonzero(first)).astype(np.float32) if m else (
                np.empty(0, dtype=np.float32))
        elif duplicates is Duplicates.DROP:
            out_w = w[first].astype(np.float32)
        else:
            out_w = w.astype(np.float32)
        del w
    if duplicates is not Duplicates.KEEP:
        keys = _compact(keys, first)
    del first

    indptr, indices = _csr_from_sorted_keys(keys, num_nodes)
    loop_entries = 0 if drop_loops else n_loops - (
        dup_loop_entries if duplicates is not Duplicates.KEEP else 0)
    stored = (indices.shape[0] - loop_entries) // 2 + loop_entries if undirected else (
        indices.shape[0])
    counts = EdgeCounts(
        input_edges=n, edges=int(stored), csr_entries=int(indices.shape[0]),
        self_loops=n_loops, self_loops_dropped=n_loops if drop_loops else 0,
        duplicates=n_dups,
        duplicates_dropped=n_dups if duplicates is Duplicates.DROP else 0,
        duplicates_merged=n_dups if duplicates is Duplicates.SUM else 0)
    return indptr, indices, out_w, counts


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
    for start in range(0, a.shape[0], _CHUNK):
        part = a[start:start + _CHUNK]
        pmin, pmax = part.min(), part.max()
        lo = pmin if lo is None else min(lo, pmin)
        hi = pmax if hi is None else max(hi, pmax)
    return int(lo), int(hi)


def _compact(keys: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``keys[keep]`` in place, a chunk at a time (writes never pass the chunk being read)."""
    w = 0
    for start in range(0, keys.shape[0], _CHUNK):
        part = keys[start:start + _CHUNK][keep[start:start + _CHUNK]]
        keys[w:w + part.shape[0]] = part
        w += part.shape[0]
    return keys[:w]


def _csr_from_sorted_keys(keys: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    big = np.int64(max(num_nodes, 1))
    dtype = np.int32 if num_nodes < 2**31 else np.int64
    indices = np.empty(keys.shape[0], dtype=dtype)
    degrees = np.zeros(num_nodes, dtype=np.int64)
    for start in range(0, keys.shape[0], _CHUNK):
        part = keys[start:start + _CHUNK]
        rows = part // big
        indices[start:start + part.shape[0]] = part - rows * big
        first = int(rows[0])  # rows are sorted: count into the chunk's row range only
        counts = np.bincount(rows - first)
        degrees[first:first + counts.shape[0]] += counts
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(degrees, out=indptr[1:])
    return indptr, indices


def row_blocks(indptr: np.ndarray, max_entries: int = _CHUNK) -> list[tuple[int, int]]:
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


# --- writing ---------------------------------------------------------------------------------

def write_graph(out_dir: str | os.PathLike, indptr: np.ndarray, indices: np.ndarray,
                weights: Optional[np.ndarray] = None, features: Optional[np.ndarray] = None,
                labels: Optional[np.ndarray] = None, num_classes: Optional[int] = None,
                splits: Optional[Mapping[str, np.ndarray]] = None,
                edge_splits: Optional[Mapping[str, np.ndarray]] = None, directed: bool = False,
                name: str = "graph", extra_meta: Optional[Mapping[str, Any]] = None,
                ids: Any = None) -> dict:
    """Writes a graph data set; ``metadata.json`` last (atomically), so a crash is visible.

    An earlier graph data set in ``out_dir`` is replaced (its metadata first). Any other
    non-empty directory, apart from an ``ingest_report.json``, is refused.

    Args:
        out_dir: the data set directory (created if missing).
        indptr, indices, weights: the CSR (:func:`csr_from_edges`).
        features: float32-castable ``[N, F]``.
        labels: int ``[N]``, ``-1`` for unlabelled nodes; needs ``num_classes``.
        num_classes: ``K``; labels lie in ``[-1, K)``.
        splits: ``train``/``valid``/``test`` node ids.
        edge_splits: ``valid``/``test`` ``[2, M]`` held-out edges.
        directed: recorded in the metadata.
        name: the data set's name.
        extra_meta: more metadata keys (``generator``, ``ingest_report``, ...).
        ids: the original node ids in dense-id order (a Polars Series or Arrow array), written
            to ``nodes/ids.parquet`` as column ``id``.

    Returns:
        The metadata written.
    """
    out = Path(out_dir)
    n = int(indptr.shape[0]) - 1
    _check_shapes(n, indptr, indices, weights, features, labels)
    _prepare_out_dir(out)
    for sub in _SUBDIRS:
        (out / sub).mkdir(parents=True, exist_ok=True)
    index_dtype = np.int32 if n < 2**31 else np.int64
    csr = {"indptr": _save(out, "graph/indptr.npy", indptr, np.int64),
           "indices": _save(out, "graph/indices.npy", indices, index_dtype),
           "weights": None if weights is None else _save(out, "graph/weights.npy", weights,
                                                         np.float32)}
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION, "name": name, "task": "graph",
        "num_nodes": n, "num_edges": int(indices.shape[0]), "directed": bool(directed),
        "csr": csr, "node_features": None, "num_features": 0, "labels": None,
        "num_classes": None, "splits": None, "edge_splits": None, "id_map": None,
    }
    if features is not None:
        meta["node_features"] = _save(out, "nodes/features.npy", features, np.float32)
        meta["num_features"] = int(features.shape[1])
    if labels is not None:
        meta["labels"] = _save(out, "nodes/labels.npy", labels, np.int64)
        meta["num_classes"] = None if num_classes is None else int(num_classes)
    if splits:
        meta["splits"] = {k: _save(out, f"splits/{k}_nodes.npy", splits[k], np.int64)
                          for k in NODE_SPLITS if k in splits}
    if edge_splits:
        meta["edge_splits"] = {k: _save(out, f"splits/{k}_edges.npy", edge_splits[k], np.int64)
                               for k in EDGE_SPLITS if k in edge_splits}
    if ids is not None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        tmp = out / "nodes/ids.parquet.tmp"
        pq.write_table(pa.table({"id": ids}), tmp)
        os.replace(tmp, out / "nodes/ids.parquet")
        meta["id_map"] = "nodes/ids.parquet"
    meta.update(extra_meta or {})
    tmp = out / f"{METADATA_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / METADATA_FILE)
    return meta


def _check_shapes(n: int, indptr: np.ndarray, indices: np.ndarray, weights: Any, features: Any,
                  labels: Any) -> None:
    if n < 0 or int(indptr[-1]) != indices.shape[0]:
        raise ValueError(f"indptr must have N + 1 entries ending at len(indices) = "
                         f"{indices.shape[0]}, got {indptr.shape[0]} ending at {int(indptr[-1])}")
    for what, a, want in (("weights", weights, indices.shape[0]), ("features", features, n),
                          ("labels", labels, n)):
        if a is not None and np.shape(a)[0] != want:
            raise ValueError(f"{what}: expected {want} rows, got {np.shape(a)[0]}")


def _save(out: Path, rel: str, array: np.ndarray, dtype: type) -> str:
    array = np.asarray(array)
    if array.dtype != dtype:
        array = array.astype(dtype)
    tmp = out / f"{rel}.tmp"
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, out / rel)
    return rel


def _prepare_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a directory")
    if not out.exists():
        return
    ours = {METADATA_FILE, f"{METADATA_FILE}.tmp", "ingest_report.json", *_SUBDIRS}
    foreign = sorted(p.name for p in out.iterdir() if p.name not in ours)
    if foreign:
        raise FileExistsError(f"{out}: holds files not written by a graph job "
                              f"({', '.join(foreign[:5])}); refusing to overwrite, choose "
                              "another directory")
    had_meta = (out / METADATA_FILE).exists()
    (out / METADATA_FILE).unlink(missing_ok=True)  # first: a half-rewritten set is unfinished
    (out / f"{METADATA_FILE}.tmp").unlink(missing_ok=True)
    for sub in _SUBDIRS:
        if (out / sub).is_dir() and not had_meta and any(
                not p.name.endswith((".npy", ".parquet", ".tmp")) for p in (out / sub).iterdir()):
            raise FileExistsError(f"{out / sub}: holds files not written by a graph job; refusing "
                                  "to overwrite")
        shutil.rmtree(out / sub, ignore_errors=True)


# --- loading ---------------------------------------------------------------------------------

def load_graph(root: str | os.PathLike, mmap: bool = True, check_ranges: bool = True
               ) -> GraphData:
    """Reads a graph data set and checks its arrays against each other.

    Checks: every referenced file exists and is a readable ``.npy``; ``indptr`` has ``N + 1``
    entries, starts at 0, never decreases and ends at ``len(indices)``; indices lie in
    ``[0, N)`` (chunked min/max, bounded memory); weights, features and labels have one entry per
    edge or node; labels lie in ``[-1, num_classes)``; split node ids and held-out edges lie in
    ``[0, N)``.

    Args:
        root: the data set directory.
        mmap: memory-map the arrays (``np.load(mmap_mode="r")``) instead of reading them.
        check_ranges: run the O(E) checks (indptr monotone, index range). They read every
            page of the CSR once, which a memory map then counts in the RSS until the kernel
            reclaims it; a benchmark measuring memory may skip them on a trusted data set.

    Returns:
        The :class:`GraphData`.

    Raises:
        DatasetError: one line naming the file and what is wrong with it.

    Example:
        >>> g = load_graph("data/synthetic_graph")  # doctest: +SKIP
        >>> g.indices[g.indptr[0]:g.indptr[1]]      # node 0's neighbours  # doctest: +SKIP
    """
    root = Path(root)
    meta_path = root / METADATA_FILE
    if not meta_path.is_file():
        hint = "" if root.exists() else " (generate one with: embedtrain datagen graph --out DIR)"
        raise DatasetError(f"{meta_path}: graph metadata not found{hint}")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise DatasetError(f"{meta_path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if not isinstance(meta, dict) or meta.get("task") != "graph":
        raise DatasetError(f"{meta_path}: task: expected 'graph', got "
                           f"{meta.get('task') if isinstance(meta, dict) else meta!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise DatasetError(f"{meta_path}: format_version: expected {FORMAT_VERSION}, got "
                           f"{meta.get('format_version')!r}")
    n = meta.get("num_nodes")
    if not _is_int(n) or n < 0:
        raise DatasetError(f"{meta_path}: num_nodes: expected an int >= 0, got {n!r}")
    csr = meta.get("csr")
    if not isinstance(csr, dict):
        raise DatasetError(f"{meta_path}: csr: expected a mapping with indptr, indices, weights")
    loader = _Loader(root, meta_path, mmap)

    indptr = loader.array(csr.get("indptr"), "csr.indptr", ndim=1, kind="i")
    indices = loader.array(csr.get("indices"), "csr.indices", ndim=1, kind="i")
    p_indptr, p_indices = loader.path(csr["indptr"]), loader.path(csr["indices"])
    if indptr.shape[0] != n + 1:
        raise DatasetError(f"{p_indptr}: has {indptr.shape[0]} entries, expected num_nodes + 1 = "
                           f"{n + 1}")
    if indptr[0] != 0:
        raise DatasetError(f"{p_indptr}: must start at 0, starts at {int(indptr[0])}")
    bad = _first_decrease(indptr) if check_ranges else None
    if bad is not None:
        raise DatasetError(f"{p_indptr}: decreases at node {bad} (indptr[{bad}] = "
                           f"{int(indptr[bad])} > indptr[{bad + 1}] = {int(indptr[bad + 1])})")
    if indptr[-1] != indices.shape[0]:
        raise DatasetError(f"{p_indptr}: ends at {int(indptr[-1])} but {p_indices} has "
                           f"{indices.shape[0]} entries")
    if _is_int(meta.get("num_edges")) and meta["num_edges"] != indices.shape[0]:
        raise DatasetError(f"{meta_path}: num_edges: {meta['num_edges']} but {p_indices} has "
                           f"{indices.shape[0]} entries")
    if check_ranges:
        _check_range(indices, 0, n, p_indices, "node id")

    weights = None
    if csr.get("weights") is not None:
        weights = loader.array(csr["weights"], "csr.weights", ndim=1, kind="f")
        _check_length(weights, indices.shape[0], loader.path(csr["weights"]), "edges")
    features = None
    if meta.get("node_features") is not None:
        features = loader.array(meta["node_features"], "node_features", ndim=2, kind="f")
        _check_length(features, n, loader.path(meta["node_features"]), "nodes")
        if _is_int(meta.get("num_features")) and meta["num_features"] != features.shape[1]:
            raise DatasetError(f"{loader.path(meta['node_features'])}: has {features.shape[1]} "
                               f"columns, metadata num_features is {meta['num_features']}")
    labels, num_classes = None, meta.get("num_classes")
    if meta.get("labels") is not None:
        labels = loader.array(meta["labels"], "labels", ndim=1, kind="i")
        p_labels = loader.path(meta["labels"])
        _check_length(labels, n, p_labels, "nodes")
        if not _is_int(num_classes) or num_classes < 1:
            raise DatasetError(f"{meta_path}: num_classes: expected an int >= 1 with labels, got "
                               f"{num_classes!r}")
        _check_range(labels, -1, num_classes, p_labels, "label")
    splits: dict[str, np.ndarray] = {}
    for key, rel in (meta.get("splits") or {}).items():
        if rel is None:
            continue
        splits[key] = loader.array(rel, f"splits.{key}", ndim=1, kind="i")
        _check_range(splits[key], 0, n, loader.path(rel), "node id")
    edge_splits: dict[str, np.ndarray] = {}
    for key, rel in (meta.get("edge_splits") or {}).items():
        if rel is None:
            continue
        edges = loader.array(rel, f"edge_splits.{key}", ndim=2, kind="i")
        if edges.shape[0] != 2:
            raise DatasetError(f"{loader.path(rel)}: expected shape [2, M], got "
                               f"{list(edges.shape)}")
        _check_range(edges.reshape(-1), 0, n, loader.path(rel), "node id")
        edge_splits[key] = edges
    id_map = None
    if meta.get("id_map") is not None:
        id_map = loader.path(meta["id_map"])
        if not id_map.is_file():
            raise DatasetError(f"{id_map}: missing (metadata.json id_map)")
    return GraphData(root=root, name=str(meta.get("name", root.name)), num_nodes=n,
                     directed=bool(meta.get("directed", False)), indptr=indptr, indices=indices,
                     weights=weights, features=features, labels=labels,
                     num_classes=num_classes if labels is not None else None, splits=splits,
                     edge_splits=edge_splits, id_map=id_map, meta=meta)


class _Loader:
    def __init__(self, root: Path, meta_path: Path, mmap: bool):
        self.root, self.meta_path, self.mmap = root, meta_path, mmap

    def path(self, rel: str) -> Path:
        return self.root / rel

    def array(self, rel: Any, key: str, ndim: int, kind: str) -> np.ndarray:
        if not isinstance(rel, str):
            raise DatasetError(f"{self.meta_path}: {key}: expected a relative path, got {rel!r}")
        path = self.path(rel)
        if not path.is_file():
            raise DatasetError(f"{path}: missing (metadata.json {key})")
        try:
            a = np.load(path, mmap_mode="r" if self.mmap else None, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            text = str(e).strip().splitlines()
            raise DatasetError(f"{path}: not a readable .npy file: "
                               f"{text[0] if text else type(e).__name__}") from None
        if a.ndim != ndim:
            raise DatasetError(f"{path}: expected {ndim}-D, got shape {list(a.shape)}")
        ok = np.issubdtype(a.dtype, np.integer) if kind == "i" else np.issubdtype(
            a.dtype, np.floating)
        if not ok:
            want = "integers" if kind == "i" else "floats"
            raise DatasetError(f"{path}: expected {want}, got dtype {a.dtype}")
        return a


def _first_decrease(indptr: np.ndarray) -> Optional[int]:
    for start in range(0, indptr.shape[0] - 1, _CHUNK):
        part = np.asarray(indptr[start:start + _CHUNK + 1])
        bad = np.flatnonzero(part[1:] < part[:-1])
        if bad.shape[0]:
            return start + int(bad[0])
    return None


def _check_range(a: np.ndarray, lo: int, hi: int, path: Path, what: str) -> None:
    if a.shape[0] == 0:
        return
    amin, amax = chunked_min_max(a)
    if amin < lo or amax >= hi:
        value = amin if amin < lo else amax
        where = int(np.flatnonzero(np.asarray(a) == value)[0]) if a.shape[0] <= _CHUNK else None
        at = f" at position {where}" if where is not None else ""
        raise DatasetError(f"{path}: {what} {value}{at} outside [{lo}, {hi})")


def _check_length(a: np.ndarray, n: int, path: Path, what: str) -> None:
    if a.shape[0] != n:
        raise DatasetError(f"{path}: has {a.shape[0]} rows, expected one per {what[:-1]} ({n})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
