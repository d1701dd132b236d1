"""The on-disk graph data set: reading and writing its directory of ``.npy`` files.

A graph data set is a directory holding ``metadata.json`` and ``.npy`` files written by
:func:`write_graph` (the synthetic generator :mod:`embedtrain.datagen.graph` and the ingestion
job :mod:`pipelines.graph.passes` both use it) and read by :func:`load_graph` into a
:class:`GraphData`, which memory-maps the arrays and checks that they are consistent. Building
the CSR from an edge list and holding out link-prediction edges is :mod:`embedtrain.graph.csr`.

Data flow: edges -> :func:`~embedtrain.graph.csr.csr_from_edges` -> :func:`write_graph` ->
:func:`load_graph` -> :class:`GraphData` -> the loaders of :mod:`embedtrain.graph.loader`.

"Neighbours of u" are the nodes u aggregates messages from: for an undirected graph both
directions are stored, for a directed one u's in-neighbours (the sources of edges pointing at u).
Neighbour ids within a row are sorted ascending.

Node features are stored as float32 or float16 (:class:`FeatureDtype`, ``metadata.json``
``feature_dtype``; absent in older data sets, which are float32). The loaders never convert the
file: the collate (:func:`embedtrain.graph.batch.node_features`) reads the sampled nodes' rows
from the memory map and casts only those to float32, so the page cache is the feature cache, at
half the bytes with float16. The features' map is advised ``MADV_RANDOM`` (see
:func:`advise_random_reads`).

A ``metadata.json`` with ``"sizes_only": true`` (``configs/datasets/graph_100m``) describes a
graph by its sizes alone, for ``embedtrain plan``: :func:`load_graph` returns an edgeless graph of
that many nodes whose arrays are zeros that take no memory, and no splits, so it cannot be
trained on.

Example:
    >>> from embedtrain.graph.csr import csr_from_edges
    >>> indptr, indices, _, _ = csr_from_edges(np.array([0, 1]), np.array([1, 2]), num_nodes=3)
    >>> write_graph("/tmp/g", indptr, indices, name="tiny")  # doctest: +SKIP
    >>> load_graph("/tmp/g").num_edges  # doctest: +SKIP
    4
"""

from __future__ import annotations

import enum
import json
import mmap
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from embedtrain.features import DatasetError
from embedtrain.graph.csr import CHUNK, EDGE_SPLITS, chunked_min_max
from embedtrain.utils import is_int

FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
NODE_SPLITS = ("train", "valid", "test")
_SUBDIRS = ("graph", "nodes", "splits")
FEATURES_FILE = "nodes/features.npy"


class FeatureDtype(enum.Enum):
    """The node features' type on disk (``metadata.json`` ``feature_dtype``).

    float16 halves the file and the page cache that holds it; its range (``|x| <= 65504``) and
    11 significant bits suit normalised features (a value of unit scale is off by at most
    ``2**-11`` relative). A finite value beyond the range is refused (:func:`cast_features`), not
    written as ``inf``. bfloat16 is not offered: NumPy has no bfloat16, so the ``.npy`` file would
    hold raw 16-bit words that other readers take for integers, and its 8 significant bits lose
    eight times more than float16 on features of unit scale; features beyond float16's range
    are better scaled, or kept float32.
    """

    FLOAT32 = "float32"
    FLOAT16 = "float16"

    @property
    def numpy(self) -> np.dtype:
        """The NumPy dtype of the stored array."""
        return np.dtype(self.value)


class FeatureRangeError(ValueError):
    """A finite feature value that the on-disk type cannot hold (it would be stored as inf).

    Attributes:
        row: the node (row) of the first such value.
        column: its feature column.
        value: the value.
        dtype: the type it does not fit.
    """

    def __init__(self, row: int, column: int, value: float, dtype: FeatureDtype):
        self.row, self.column, self.value, self.dtype = row, column, value, dtype
        super().__init__(f"features: node {row}, column {column}: {value:g} is outside "
                         f"{dtype.value}'s range (|x| <= {float(np.finfo(dtype.numpy).max):g})")


def cast_features(values: np.ndarray, dtype: FeatureDtype, first_row: int = 0) -> np.ndarray:
    """``values`` (``[n, F]``) in ``dtype``, refusing finite values that the type cannot hold.

    NaN and infinite values stay as they are (they are not range errors of the cast).

    Args:
        values: float features (any float dtype).
        dtype: the stored type.
        first_row: the node id of ``values``' first row (for the error).

    Returns:
        ``values`` itself if it is already ``dtype``, else a cast copy.

    Raises:
        FeatureRangeError: naming the node and column of the first value out of range.

    Example:
        >>> cast_features(np.array([[0.5, -2.0]]), FeatureDtype.FLOAT16).dtype
        dtype('float16')
        >>> cast_features(np.array([[1.0, 7e4]]), FeatureDtype.FLOAT16)  # doctest: +SKIP
        FeatureRangeError: features: node 0, column 1: 70000 is outside float16's range ...
    """
    values = np.asarray(values)
    if values.dtype == dtype.numpy:
        return values
    with np.errstate(over="ignore"):  # the overflow is found below, with where it happened
        out = values.astype(dtype.numpy)
    bad = np.isinf(out)
    if bad.any():
        bad &= np.isfinite(values)
        if bad.any():
            row, column = (int(i) for i in np.argwhere(bad)[0])
            raise FeatureRangeError(first_row + row, column, float(values[row, column]), dtype)
    return out


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


# --- writing ---------------------------------------------------------------------------------

def write_graph(out_dir: str | os.PathLike, indptr: np.ndarray, indices: np.ndarray,
                weights: Optional[np.ndarray] = None, features: Optional[np.ndarray] = None,
                labels: Optional[np.ndarray] = None, num_classes: Optional[int] = None,
                splits: Optional[Mapping[str, np.ndarray]] = None,
                edge_splits: Optional[Mapping[str, np.ndarray]] = None, directed: bool = False,
                name: str = "graph", extra_meta: Optional[Mapping[str, Any]] = None,
                ids: Any = None, feature_dtype: Optional[FeatureDtype] = None) -> dict:
    """Writes a graph data set; ``metadata.json`` last (atomically), so a crash is visible.

    An earlier graph data set in ``out_dir`` is replaced (its metadata first). Any other
    non-empty directory, apart from an ``ingest_report.json``, is refused.

    Args:
        out_dir: the data set directory (created if missing).
        indptr, indices, weights: the CSR (:func:`csr_from_edges`).
        features: float ``[N, F]``, stored as ``feature_dtype`` (cast in chunks of rows).
        labels: int ``[N]``, ``-1`` for unlabelled nodes; needs ``num_classes``.
        num_classes: ``K``; labels lie in ``[-1, K)``.
        splits: ``train``/``valid``/``test`` node ids.
        edge_splits: ``valid``/``test`` ``[2, M]`` held-out edges.
        directed: recorded in the metadata.
        name: the data set's name.
        extra_meta: more metadata keys (``generator``, ``ingest_report``, ...).
        ids: the original node ids in dense-id order (a Polars Series or Arrow array), written
            to ``nodes/ids.parquet`` as column ``id``.
        feature_dtype: the features' type on disk (``metadata.json`` ``feature_dtype``); None:
            ``features``' own dtype if it is one of :class:`FeatureDtype`'s, else float32.

    Returns:
        The metadata written.

    Raises:
        FeatureRangeError: a finite feature value beyond ``feature_dtype``'s range (the
            metadata is not written, so the directory is not a data set).
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
        "csr": csr, "node_features": None, "num_features": 0, "feature_dtype": None,
        "labels": None,
        "num_classes": None, "splits": None, "edge_splits": None, "id_map": None,
    }
    if features is not None:
        if feature_dtype is None:
            kept = {d.numpy: d for d in FeatureDtype}
            feature_dtype = kept.get(np.asarray(features).dtype, FeatureDtype.FLOAT32)
        meta["node_features"] = _save_features(out, features, feature_dtype)
        meta["num_features"] = int(features.shape[1])
        meta["feature_dtype"] = feature_dtype.value
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


def _move_npy(array: Any, dtype: type, dest: Path) -> bool:
    """Moves a memory-mapped ``.npy`` file of ``dtype`` (a whole file, e.g. from
    :func:`~embedtrain.graph.csr_external.csr_from_edge_chunks`) to ``dest`` instead of copying it: a
    CSR of 10^9 entries is not written twice. False where it cannot (another dtype, a map of
    part of a file, another file system)."""
    if not isinstance(array, np.memmap) or array.dtype != dtype or not array.filename:
        return False
    src = Path(array.filename)
    if src.suffix != ".npy" or src.stat().st_size != array.offset + array.nbytes:
        return False
    array.flush()
    try:
        os.replace(src, dest)
    except OSError:  # another file system: copy instead
        return False
    return True


def _save(out: Path, rel: str, array: np.ndarray, dtype: type) -> str:
    if _move_npy(array, dtype, out / rel):
        return rel
    array = np.asarray(array)
    if array.dtype != dtype:
        array = array.astype(dtype)
    tmp = out / f"{rel}.tmp"
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, out / rel)
    return rel


def _save_features(out: Path, features: np.ndarray, dtype: FeatureDtype) -> str:
    """The features as ``dtype``, cast and range-checked a block of rows at a time (bounded
    memory besides the caller's array)."""
    if not isinstance(features, np.ndarray):  # a memory map stays one (_save may move its file)
        features = np.asarray(features)
    if features.dtype == dtype.numpy:
        return _save(out, FEATURES_FILE, features, dtype.numpy)
    tmp = out / f"{FEATURES_FILE}.tmp"
    stored = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype.numpy, shape=features.shape)
    rows = max(1, CHUNK // max(1, features.shape[1]))
    for lo in range(0, features.shape[0], rows):
        stored[lo:lo + rows] = cast_features(features[lo:lo + rows], dtype, first_row=lo)
    stored.flush()
    del stored
    os.replace(tmp, out / FEATURES_FILE)
    return FEATURES_FILE


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
    edge or node; the features' dtype is the metadata's ``feature_dtype`` (any float without
    one); labels lie in ``[-1, num_classes)``; split node ids and held-out edges lie in
    ``[0, N)``. A memory-mapped features array is advised for random reads
    (:func:`advise_random_reads`).

    A sizes-only ``metadata.json`` (``"sizes_only": true``: ``num_nodes``, ``num_features``,
    ``feature_dtype``, ``num_classes``, no files) gives a planning stand-in: an edgeless graph
    whose indptr, features and labels are zeros broadcast to their shapes (no memory), with no
    splits.

    Args:
        root: the data set directory.
        mmap: memory-map the arrays (``np.load(mmap_mode="r")``) instead of reading them.
        check_ranges: check that indptr never decreases. It reads every page of indptr
            once, which a memory map then counts in the RSS until the kernel reclaims it. The
            ids' ranges (neighbours, labels, splits) are always checked, whole mapped files
            through ``read`` calls that leave the RSS as it was.

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
    if not is_int(n, least=0):
        raise DatasetError(f"{meta_path}: num_nodes: expected an int >= 0, got {n!r}")
    feature_dtype = _feature_dtype(meta, meta_path)
    if meta.get("sizes_only") is True:
        return _sizes_only(root, meta_path, meta, n, feature_dtype)
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
    if is_int(meta.get("num_edges")) and meta["num_edges"] != indices.shape[0]:
        raise DatasetError(f"{meta_path}: num_edges: {meta['num_edges']} but {p_indices} has "
                           f"{indices.shape[0]} entries")
    # always: a neighbour outside the graph fails only when sampled, far from its cause (read
    # through the file, this pass adds nothing to the RSS)
    _check_range(indices, 0, n, p_indices, "node id")

    weights = None
    if csr.get("weights") is not None:
        weights = loader.array(csr["weights"], "csr.weights", ndim=1, kind="f")
        _check_length(weights, indices.shape[0], loader.path(csr["weights"]), "edges")
    features = None
    if meta.get("node_features") is not None:
        features = loader.array(meta["node_features"], "node_features", ndim=2, kind="f")
        p_features = loader.path(meta["node_features"])
        _check_length(features, n, p_features, "nodes")
        if meta.get("feature_dtype") is not None and features.dtype != feature_dtype.numpy:
            raise DatasetError(f"{p_features}: dtype {features.dtype}, but metadata.json "
                               f"feature_dtype is {feature_dtype.value}")
        advise_random_reads(features)
        if is_int(meta.get("num_features")) and meta["num_features"] != features.shape[1]:
            raise DatasetError(f"{loader.path(meta['node_features'])}: has {features.shape[1]} "
                               f"columns, metadata num_features is {meta['num_features']}")
    labels, num_classes = None, meta.get("num_classes")
    if meta.get("labels") is not None:
        labels = loader.array(meta["labels"], "labels", ndim=1, kind="i")
        p_labels = loader.path(meta["labels"])
        _check_length(labels, n, p_labels, "nodes")
        if not is_int(num_classes, least=1):
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


def advise_random_reads(array: np.ndarray) -> bool:
    """Advises the kernel that ``array``'s memory map is read at random (``MADV_RANDOM``).

    The collate reads the rows of a batch's sampled nodes: sorted, but spread over the whole
    file (a 1,024-seed batch with fanouts [15, 10] touches ~100k of 100M nodes, one row of
    64-256 bytes every ~1,000 rows). With the default read-ahead, each page fault on a part of
    the file not in the page cache reads the device's read-ahead window around the page (128 KiB
    by default, 8 MiB on the virtio disk this was measured on) where the row needs 4 KiB: the
    I/O is hundreds of times the rows, and on a file larger than the page cache the unread
    neighbours evict the pages of nodes that are sampled again. ``MADV_RANDOM`` makes a fault read
    its own page only. Measured cold (page cache dropped with ``POSIX_FADV_DONTNEED``), 64
    float16 features, a 4M-node file (488 MiB), sorted random rows: 500 rows read 487 MiB in
    793 ms by default, 1.9 MiB in 21 ms advised; 5,000 rows 488 MiB in 1,049 ms against 19 MiB
    in 349 ms. Where a batch touches a large share of the pages (20,000 rows: 15% of them),
    reading the whole file is faster (361 ms against 1,406 ms on that disk's ~13k random
    reads/s); but a batch samples ~10^5 nodes, so a file that densely read is at most a few GiB,
    which the page cache keeps after the first batches: only the first pass pays. Nothing is
    done where the platform lacks ``madvise`` (or the array is not a memory map).

    Args:
        array: a memory map from ``np.load(..., mmap_mode="r")``.

    Returns:
        Whether the advice was given.

    Example:
        >>> features = np.load("data/g/nodes/features.npy", mmap_mode="r")  # doctest: +SKIP
        >>> advise_random_reads(features)  # doctest: +SKIP
        True
    """
    mapping = getattr(array, "_mmap", None)  # np.memmap keeps its mmap.mmap here
    if mapping is None or not hasattr(mmap, "MADV_RANDOM") or not hasattr(mapping, "madvise"):
        return False
    mapping.madvise(mmap.MADV_RANDOM)
    return True


def _feature_dtype(meta: dict, meta_path: Path) -> FeatureDtype:
    value = meta.get("feature_dtype")
    if value is None:
        return FeatureDtype.FLOAT32  # data sets written before the key was added
    try:
        return FeatureDtype(value)
    except ValueError:
        allowed = ", ".join(d.value for d in FeatureDtype)
        raise DatasetError(f"{meta_path}: feature_dtype: expected one of {allowed}, got "
                           f"{value!r}") from None


def _sizes_only(root: Path, meta_path: Path, meta: dict, n: int, feature_dtype: FeatureDtype
                ) -> GraphData:
    """The planning stand-in of a sizes-only ``metadata.json``: zeros broadcast to the shapes."""
    f, k = meta.get("num_features", 0), meta.get("num_classes")
    if not is_int(f, least=0):
        raise DatasetError(f"{meta_path}: num_features: expected an int >= 0, got {f!r}")
    if k is not None and not is_int(k, least=1):
        raise DatasetError(f"{meta_path}: num_classes: expected an int >= 1 or null, got {k!r}")

    def zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return np.broadcast_to(np.zeros((), dtype), shape)

    return GraphData(root=root, name=str(meta.get("name", root.name)), num_nodes=n,
                     directed=bool(meta.get("directed", False)), indptr=zeros((n + 1,), np.int64),
                     indices=np.zeros(0, np.int32),
                     features=zeros((n, f), feature_dtype.numpy) if f else None,
                     labels=zeros((n,), np.int64) if k else None, num_classes=k, meta=meta)


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
    for start in range(0, indptr.shape[0] - 1, CHUNK):
        part = np.asarray(indptr[start:start + CHUNK + 1])
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
        where = int(np.flatnonzero(np.asarray(a) == value)[0]) if a.shape[0] <= CHUNK else None
        at = f" at position {where}" if where is not None else ""
        raise DatasetError(f"{path}: {what} {value}{at} outside [{lo}, {hi})")


def _check_length(a: np.ndarray, n: int, path: Path, what: str) -> None:
    if a.shape[0] != n:
        raise DatasetError(f"{path}: has {a.shape[0]} rows, expected one per {what[:-1]} ({n})")
