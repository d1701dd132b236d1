"""Layer-wise full-graph inference: every node's GraphSAGE output, no sampling, bounded memory.

PyG's ``inference`` pattern (its ``SAGE.inference`` examples): instead of sampling each seed's
multi-hop neighbourhood, the model runs one layer at a time over all nodes, each layer over
chunks of target nodes with their *full* neighbourhoods (every CSR entry of their rows), reading
the previous layer's output at the neighbours. Each layer then costs one pass over the CSR,
where per-seed sampling recomputes the neighbourhoods that seeds share; and the result is exact:
it equals the sampled model's output (:meth:`~embedtrain.models.gnn.GraphSAGE.forward`) when the
fanouts cover every neighbour. Both run the same
:meth:`~embedtrain.models.gnn.GraphSAGE.layer` (eval mode: no dropout).

How, for a model of ``L`` layers, ``h_0 = [id embedding | features]`` (features cast to float32)
and ``h_{l+1} = layer_l(h_l)``:

- ``h_0`` is never stored: a chunk reads its nodes' rows of the node-id table (the model's own
  table, or ``node_embeddings``: e.g. an exported table) and of the feature array when it needs
  them;
- layer ``l`` walks the target nodes in chunks (:func:`~embedtrain.graph.csr.row_blocks`: at most
  ``chunk_entries`` CSR entries, and at most ``chunk_entries`` nodes, per chunk; a node of larger
  degree is a chunk of its own). A chunk's sources are the distinct neighbours of its targets
  (``np.unique`` of their CSR entries); its bipartite ``edge_index`` has row 0 = the source's
  position among them, row 1 = the target's position in the chunk (row ``v`` of the CSR lists the
  nodes ``v`` aggregates from, as in :mod:`embedtrain.graph.sampler`); the chunk's
  ``layer(l, (h_l[sources], h_l[targets]), edge_index)`` rows are written to ``h_{l+1}``;
- ``h_1 .. h_{L-1}`` are float32 arrays of ``[nodes, width]``: in memory up to
  ``max_ram_bytes``, else memory-mapped ``.npy`` files in a scratch folder (removed at the end),
  so the page cache holds them, not the process;
- the last layer's rows ``h_L`` (``embeddings``: what ``model.out`` takes) and ``model.out(h_L)``
  (``outputs``: class logits, or the embeddings a link is scored by) go to arrays in memory or to
  ``.npy`` files (``embeddings_file``, ``outputs_file``), chunk by chunk.

Memory: a chunk holds at most ``chunk_entries`` entries and targets, and its tensors take about
``4 x width x (sources + 2 x entries + 2 x targets)`` bytes, at most ``20 x width x
chunk_entries`` (the gathered sources, the messages SAGEConv gathers per edge, the aggregate, the
targets' rows and the output; ``width`` the widest layer), plus ``~40`` bytes of indices an
entry. The default ``chunk_entries`` keeps that near :data:`CHUNK_BYTES` (128 MiB). Add the
intermediate layers held in memory (``<= max_ram_bytes`` each) and, with ``nodes``, a byte per
node of the graph (the mask that finds what the subset needs).

``nodes``: only what those nodes' outputs need is computed: layer ``L - 1`` runs on ``nodes``,
layer ``l`` on the nodes of layer ``l + 1`` and their neighbours (found by a pass over those
nodes' CSR rows), so a sample of ``S`` seeds costs its ``L - 1``-hop neighbourhood, not the
graph. The rows come back in ascending node id, duplicates dropped.

Edge weights (``gnn.weighted``) only steer the sampler (neighbours drawn in proportion to the
weight); the SAGE layers take no edge weights, so inference aggregates every neighbour,
unweighted, as the sampled model does once its fanouts cover the neighbourhood. A multigraph's
repeated entries count as often as they are stored (as in sampling). The ``mlp`` kind reads no
neighbours: each node's layers run on its own row.

Example:
    >>> out = layerwise_inference(model, load_graph("data/synthetic_graph"), progress=True)
    >>> out.outputs.shape, out.embeddings.shape  # [N, classes], [N, hidden[-1]]
    >>> sample = layerwise_inference(model, graph, nodes=np.array([7, 3, 7]))
    >>> sample.nodes  # array([3, 7]): rows of sample.outputs
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

import numpy as np
import torch
from torch import Tensor, nn

from embedtrain.graph.csr import row_blocks
from embedtrain.graph.sampler import ArrayLike, as_numpy
from embedtrain.graph.store import GraphData
from embedtrain.models.options import GNNModel
from embedtrain.utils import progress_bar

CHUNK_BYTES = 128 << 20  # a chunk's float32 tensors, about (see the module docstring)
RAM_BYTES = 256 << 20  # intermediate layers up to this size stay in memory
NodeEmbeddings = Callable[[Tensor], Tensor]  # int64 node ids [n] -> float32 rows [n, dim]
Rows = Union[np.ndarray, np.memmap]


@dataclass
class LayerwiseOutputs:
    """What :func:`layerwise_inference` computed.

    Attributes:
        nodes: the node ids of the rows (ascending, distinct), or None: every node, row = node
            id.
        outputs: float32 ``[rows, out_dim]``: ``model.out`` of the last layer (node
            classification: class logits; link prediction: the embeddings scored by dot
            products). An ``np.memmap`` when written to a file.
        embeddings: float32 ``[rows, hidden[-1]]``: the last layer's output, the input of
            ``model.out``; None when not kept.
    """

    nodes: Optional[np.ndarray]
    outputs: Rows
    embeddings: Optional[Rows]


def layerwise_inference(model: nn.Module, graph: GraphData, nodes: Optional[ArrayLike] = None,
                        *, node_embeddings: Optional[NodeEmbeddings] = None,
                        outputs_file: Optional[str | Path] = None,
                        embeddings_file: Optional[str | Path] = None,
                        keep_embeddings: bool = True, chunk_entries: Optional[int] = None,
                        scratch_dir: Optional[str | Path] = None,
                        max_ram_bytes: int = RAM_BYTES, progress: bool = False
                        ) -> LayerwiseOutputs:
    """Every node's (or ``nodes``') output of a GraphSAGE, layer by layer over the whole graph,
    with full neighbourhoods (see the module docstring).

    Args:
        model: a :class:`~embedtrain.models.gnn.GraphSAGE` on CPU, unsharded (or a wrapper whose
            ``.module`` chain leads to one); it runs in eval mode (its mode is restored after).
        graph: the graph it was trained on (CSR, and features when the model takes them).
        nodes: int node ids to compute; None: all. Rows come back in ascending id, distinct.
        node_embeddings: int64 ids -> float32 ``[n, embedding_dim]`` rows of the node-id table
            (e.g. read from an export); None: the model's own table
            (:meth:`~embedtrain.models.gnn.GraphSAGE.embed_nodes`). Unused without a table.
        outputs_file: write ``outputs`` to this ``.npy`` (memory-mapped) instead of memory.
        embeddings_file: the same for ``embeddings``.
        keep_embeddings: keep the last layer's output (``embeddings``); False: not stored.
        chunk_entries: CSR entries (and target nodes) per chunk; None: as many as keep a chunk's
            tensors near :data:`CHUNK_BYTES`.
        scratch_dir: where intermediate layers larger than ``max_ram_bytes`` are memory-mapped
            (a temporary folder inside it, removed at the end); None: the system's temp folder.
        max_ram_bytes: intermediate layers up to this size stay in memory.
        progress: show a progress bar (rows of all layers, rows/s).

    Returns:
        :class:`LayerwiseOutputs`.

    Raises:
        ValueError: a model whose features do not fit the graph's, node ids outside the
            graph, a bad ``chunk_entries``.

    Example:
        >>> out = layerwise_inference(model, graph, outputs_file="nodes/scores.npy",
        ...                           keep_embeddings=False, scratch_dir="nodes")
        >>> out.outputs.shape
        (1000000, 8)
    """
    sage = _graphsage(model)
    n = graph.num_nodes
    inputs = _InputRows(sage, graph, node_embeddings)
    widths = [sage.input_width, *sage.layer_widths]
    if chunk_entries is None:
        chunk_entries = max(1, CHUNK_BYTES // (20 * max(widths)))
    if chunk_entries < 1:
        raise ValueError(f"chunk_entries: must be at least 1, got {chunk_entries}")
    mlp = sage.kind is GNNModel.MLP
    wanted = None
    if nodes is not None:
        wanted = np.unique(as_numpy(nodes, "nodes").astype(np.int64))
        if len(wanted) and (wanted[0] < 0 or wanted[-1] >= n):
            bad = wanted[0] if wanted[0] < 0 else wanted[-1]
            raise ValueError(f"nodes: node id {bad} outside [0, {n}) (the graph "
                             f"{graph.root} has {n:,} nodes)")
    # sets[l]: the nodes whose h_l is computed (None: all), l = 1 .. L
    layers = sage.num_layers
    sets: list[Optional[np.ndarray]] = [None] * (layers + 1)
    sets[layers] = wanted
    for l in range(layers - 1, 0, -1):
        sets[l] = sets[l + 1] if mlp else _with_neighbours(graph, sets[l + 1], chunk_entries)
    rows = n if wanted is None else len(wanted)
    outputs = _new_rows(outputs_file, rows, sage.out.out_features)
    embeddings = (_new_rows(embeddings_file, rows, widths[-1]) if keep_embeddings else None)
    was_training = sage.training
    scratch, previous, current = None, None, None
    sage.eval()
    try:
        total = rows + (0 if mlp else sum(n if s is None else len(s) for s in sets[1:layers]))
        with torch.no_grad(), progress_bar(total, "layer-wise inference",
                                           disable=not progress) as bar:
            if mlp:
                for lo, hi in _chunks(None, rows, chunk_entries):
                    x = inputs.rows(_targets(wanted, lo, hi))
                    for i in range(layers):
                        x = sage.layer(i, x)
                    _write(outputs, embeddings, sage, x, lo, hi)
                    bar.update(hi - lo)
                return LayerwiseOutputs(wanted, outputs, embeddings)
            for l in range(layers):
                last = l == layers - 1
                targets = sets[l + 1]
                count = n if targets is None else len(targets)
                if not last and count * widths[l + 1] * 4 <= max_ram_bytes:
                    current = np.empty((count, widths[l + 1]), dtype=np.float32)
                elif not last:  # memory-mapped: the page cache holds it, not the process
                    if scratch is None:
                        scratch = Path(tempfile.mkdtemp(prefix="layerwise-", dir=scratch_dir))
                    current = _new_rows(scratch / f"h{l + 1}.npy", count, widths[l + 1])
                for lo, hi in _chunks(graph.indptr if targets is None else
                                      _degree_offsets(graph.indptr, targets), count,
                                      chunk_entries):
                    t = _targets(targets, lo, hi)
                    h = _layer_chunk(sage, l, graph, t, inputs.rows if l == 0 else (
                        lambda ids, rows=previous, nodes=sets[l]: _read(rows, nodes, ids)))
                    if last:
                        _write(outputs, embeddings, sage, h, lo, hi)
                    else:
                        current[lo:hi] = h.numpy()
                    bar.update(hi - lo)
                if not last:
                    previous = current
            return LayerwiseOutputs(wanted, outputs, embeddings)
    finally:
        sage.train(was_training)
        for array in (outputs, embeddings):
            if isinstance(array, np.memmap):
                array.flush()
        if scratch is not None:
            del previous, current  # unmapped before their files go
            shutil.rmtree(scratch, ignore_errors=True)


def _layer_chunk(model: nn.Module, layer: int, graph: GraphData, targets: np.ndarray,
                 rows: Callable[[np.ndarray], Tensor]) -> Tensor:
    """Layer ``layer``'s output at ``targets`` (ascending) from the layer's input ``rows`` of
    the targets and of their neighbours (every CSR entry of their rows). GCN, GAT and APPNP
    take the targets as the first sources (their self-loops pair source ``i`` with target
    ``i``, as in the sampler's blocks)."""
    neighbours, degrees = _csr_rows(graph, targets)
    sources, position = np.unique(neighbours, return_inverse=True)
    if model.kind in (GNNModel.GCN, GNNModel.GAT, GNNModel.APPNP):
        sources = np.concatenate([targets, sources[~np.isin(sources, targets)]])
        order = np.argsort(sources, kind="stable")
        position = order[np.searchsorted(sources[order], neighbours)]
    # row 0: the message's source (a neighbour, by its place among the sources); row 1: the
    # target it is aggregated into, as in the sampler's blocks
    edge_index = torch.from_numpy(np.stack([
        position.reshape(-1).astype(np.int64),
        np.repeat(np.arange(len(targets), dtype=np.int64), degrees)]))
    return model.layer(layer, (rows(sources), rows(targets)), edge_index)


def _graphsage(model: nn.Module) -> nn.Module:
    """The GraphSAGE inside ``model`` (itself, or down a chain of ``.module`` wrappers)."""
    from embedtrain.models.gnn import GraphSAGE

    seen = model
    for _ in range(8):
        if isinstance(seen, GraphSAGE):
            return seen
        seen = getattr(seen, "module", None)
        if seen is None:
            break
    raise TypeError(f"layerwise_inference: expected a GraphSAGE, got {type(model).__name__}")


class _InputRows:
    """``h_0`` of any nodes: ``[id embedding | features as float32]``, read on demand."""

    def __init__(self, model: nn.Module, graph: GraphData,
                 node_embeddings: Optional[NodeEmbeddings]) -> None:
        self.model, self.features = model, None
        if model.num_features:
            if graph.num_features != model.num_features:
                raise ValueError(f"{graph.root}: the graph has {graph.num_features} node "
                                 f"feature(s), the model takes {model.num_features}")
            self.features = graph.features
        self.lookup = None
        if model.ebc is not None:
            self.lookup = node_embeddings or model.embed_nodes
        if model.input_width == 0:
            raise ValueError("the model has no input (no node table and no features)")

    def rows(self, ids: np.ndarray) -> Tensor:
        """``h_0`` of ``ids`` (ascending int64 node ids)."""
        if not len(ids):
            return torch.zeros((0, self.model.input_width))
        embeddings = None
        if self.lookup is not None:
            embeddings = self.lookup(torch.from_numpy(ids)).float()
        features = None
        if self.features is not None:  # float16 or float32 on disk: only these rows, as float32
            features = torch.from_numpy(np.asarray(self.features[ids], dtype=np.float32))
        x = self.model.node_inputs(embeddings, features)
        if x.shape[1] != self.model.input_width:
            raise ValueError(f"node inputs are {x.shape[1]} wide, the model's first layer takes "
                             f"{self.model.input_width} (node_embeddings of the wrong width?)")
        return x


def _with_neighbours(graph: GraphData, nodes: Optional[np.ndarray], chunk_entries: int
                     ) -> Optional[np.ndarray]:
    """``nodes`` and all their neighbours (ascending), or None (all nodes) for None or when
    that is every node."""
    if nodes is None:
        return None
    mask = np.zeros(graph.num_nodes, dtype=bool)
    mask[nodes] = True
    offsets = _degree_offsets(graph.indptr, nodes)
    for lo, hi in _chunks(offsets, len(nodes), chunk_entries):
        neighbours, _ = _csr_rows(graph, nodes[lo:hi])
        mask[neighbours] = True
    found = np.flatnonzero(mask)
    return None if len(found) == graph.num_nodes else found


def _degree_offsets(indptr: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """The CSR offsets of the sub-CSR of ``nodes``' rows: ``[0, d_0, d_0 + d_1, ...]``."""
    degrees = np.take(indptr, nodes + 1) - np.take(indptr, nodes)
    return np.concatenate([[0], np.cumsum(degrees)]).astype(np.int64)


def _chunks(offsets: Optional[np.ndarray], count: int, chunk_entries: int
            ) -> Iterator[tuple[int, int]]:
    """Ranges ``[lo, hi)`` of ``count`` rows with at most ``chunk_entries`` CSR entries (by
    ``offsets``; None: none) and ``chunk_entries`` rows each, or a single row."""
    blocks = [(0, count)] if offsets is None else row_blocks(offsets, chunk_entries)
    for lo, hi in blocks:
        for start in range(lo, hi, chunk_entries):
            yield start, min(hi, start + chunk_entries)


def _targets(nodes: Optional[np.ndarray], lo: int, hi: int) -> np.ndarray:
    return np.arange(lo, hi, dtype=np.int64) if nodes is None else nodes[lo:hi]


def _csr_rows(graph: GraphData, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The neighbours of ``targets`` (their CSR entries, row after row, int64) and their
    degrees."""
    indptr = graph.indptr
    starts = np.take(indptr, targets)
    degrees = np.take(indptr, targets + 1) - starts
    if len(targets) and targets[-1] - targets[0] == len(targets) - 1:  # consecutive: a slice
        a, b = int(starts[0]), int(starts[0] + degrees.sum())
        return np.asarray(graph.indices[a:b]).astype(np.int64), degrees
    ends = np.cumsum(degrees)
    positions = np.repeat(starts - (ends - degrees), degrees) + np.arange(
        int(ends[-1]) if len(ends) else 0, dtype=np.int64)
    return np.take(graph.indices, positions).astype(np.int64), degrees


def _read(rows: Rows, nodes: Optional[np.ndarray], ids: np.ndarray) -> Tensor:
    """Rows of ``ids`` (ascending) from a layer array over ``nodes`` (None: all)."""
    at = ids if nodes is None else np.searchsorted(nodes, ids)
    return torch.from_numpy(np.asarray(rows[at]))


def _new_rows(path: Optional[str | Path], rows: int, width: int) -> Rows:
    if path is None:
        return np.empty((rows, width), dtype=np.float32)
    return np.lib.format.open_memmap(Path(path), mode="w+", dtype=np.float32,
                                     shape=(rows, width))


def _write(outputs: Rows, embeddings: Optional[Rows], model: nn.Module, h: Tensor, lo: int,
           hi: int) -> None:
    outputs[lo:hi] = model.out(h).numpy()
    if embeddings is not None:
        embeddings[lo:hi] = h.numpy()
