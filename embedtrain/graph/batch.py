"""GNN batches: a sampled subgraph with its nodes' features and the targets (PyG's collate step).

The collate functions here run once per batch (in a loader thread of
:class:`~embedtrain.graph.loader.SeedBatches`) with the batch's seed ids and its generator:

- :func:`node_batch`: seed nodes -> :class:`~embedtrain.graph.sampler.NeighborSampler` ->
  blocks; then the features of the sampled nodes (:func:`node_features`) and the seeds' labels;
- :func:`link_batch`: positive edge ids -> :class:`~embedtrain.graph.link.LinkSampler` (pairs and
  negatives over the distinct endpoints) -> the neighbour sampler on the endpoints -> blocks;
  then the features.

Both return a :class:`GraphBatch`, which the GNN tasks (:mod:`embedtrain.train.gnn`) feed to the
model. The same ``(ids, rng)`` always gives the same batch. Features stored as float16
(``metadata.json`` ``feature_dtype``) are read from the memory map for the sampled nodes only and
cast to float32 as they are copied (exact: every float16 is a float32); no float32 copy of the
whole feature array is ever made.

Example:
    >>> sampler = NeighborSampler(graph.indptr, graph.indices, [15, 10])
    >>> batch = node_batch(graph.splits["train"][:1024], np.random.default_rng(0), sampler, graph)
    >>> batch.features.shape[0] == batch.num_nodes == len(batch.blocks.n_id)
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
from torch import Tensor

from embedtrain.graph.link import LinkSampler
from embedtrain.graph.sampler import NeighborSampler, SampledBlocks
from embedtrain.graph.store import GraphData

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass
class GraphBatch:
    """One training/evaluation batch of a GNN task.

    Attributes:
        blocks: the sampled subgraph; ``blocks.n_id[:num_seeds]`` are the seeds (the batch's
            nodes, or a link batch's distinct endpoints).
        num_nodes: sampled nodes, ``len(blocks.n_id)``.
        features: float ``[num_nodes, F]`` in ``blocks.n_id`` order, or None (no node features).
        labels: int64 ``[num_seeds]`` (node classification), else None.
        pairs: int64 ``[2, P]``: positive pairs as seed positions (link prediction), else None.
        negatives: int64 ``[2, P * k]``: negative pairs as seed positions (link prediction).
        node_ids: the node-id table's input for this step (one id per sampled node, padded over
            the ranks); set by the task in the training thread, None until then.
    """

    blocks: SampledBlocks
    num_nodes: int
    features: Optional[Tensor]
    labels: Optional[Tensor]
    pairs: Optional[Tensor] = None
    negatives: Optional[Tensor] = None
    node_ids: Optional["KeyedJaggedTensor"] = None

    @property
    def num_examples(self) -> int:
        """Seeds with a label (nodes) or positive pairs (links) in this batch."""
        return int(self.labels.numel()) if self.labels is not None else int(self.pairs.shape[1])


def gather_rows(array: np.ndarray, ids: np.ndarray, dtype: Optional[np.dtype] = None
                ) -> Tensor:
    """``array[ids]`` as a tensor, reading the rows in ascending order (on a memory-mapped array
    it reads only those rows, sequentially).

    Args:
        array: ``[N, ...]`` (e.g. node features), a NumPy array or memory map.
        ids: int row ids ``[n]`` (any order, duplicates allowed).
        dtype: the output's dtype, the rows cast as they are copied (default: ``array``'s).

    Returns:
        ``[n, ...]`` tensor, rows in ``ids`` order.

    Example:
        >>> gather_rows(np.eye(3, dtype=np.float16), np.array([2, 0]), np.float32)
        tensor([[0., 0., 1.],
                [1., 0., 0.]])
    """
    order = np.argsort(ids, kind="stable")  # sorted reads are sequential on a memory map
    out = np.empty((len(ids), *array.shape[1:]), array.dtype if dtype is None else dtype)
    out[order] = array[ids[order]]
    return torch.from_numpy(out)


def node_features(graph: GraphData, n_id: Tensor) -> Optional[Tensor]:
    """The float32 features of the nodes ``n_id``, in that order, or None (no node features).

    Only these rows are read from the (memory-mapped) feature array, in whatever type it is
    stored (float32 or float16), and cast to float32.

    Args:
        graph: the data set.
        n_id: int64 node ids (a batch's ``blocks.n_id``).

    Returns:
        float32 ``[len(n_id), F]``.

    Example:
        >>> node_features(graph, torch.tensor([5, 1])).dtype  # doctest: +SKIP
        torch.float32
    """
    if graph.features is None:
        return None
    return gather_rows(graph.features, n_id.numpy(), np.float32)


def node_batch(ids: np.ndarray, rng: np.random.Generator, sampler: NeighborSampler,
               graph: GraphData) -> GraphBatch:
    """One node-classification batch: the seeds' sampled neighbourhood, features and labels.

    Args:
        ids: int64 seed node ids.
        rng: the batch's generator (drives the neighbour sample).
        sampler: the neighbour sampler over ``graph``'s CSR.
        graph: supplies ``features`` (optional) and ``labels`` (required).

    Returns:
        A :class:`GraphBatch` with ``labels`` = ``graph.labels[ids]``.
    """
    blocks = sampler.sample(ids, rng)
    return GraphBatch(
        blocks=blocks,
        num_nodes=len(blocks.n_id),
        features=node_features(graph, blocks.n_id),
        labels=torch.from_numpy(np.asarray(graph.labels[ids], dtype=np.int64)),
    )


def link_batch(edge_ids: np.ndarray, rng: np.random.Generator, link: LinkSampler,
               sampler: NeighborSampler, graph: GraphData, pairs: Optional[np.ndarray]
               ) -> GraphBatch:
    """One link-prediction batch: positive edges, their negatives, the endpoints' subgraph.

    Args:
        edge_ids: int64 positions of the batch's positive edges: CSR positions when ``pairs`` is
            None, else columns of ``pairs``.
        rng: the batch's generator (draws the negatives, then the neighbour sample).
        link: draws the negatives.
        sampler: the neighbour sampler, run on the distinct endpoints.
        graph: supplies ``features`` (optional).
        pairs: ``[2, M]`` positive pairs (a split's held-out edges), or None for the CSR's edges.

    Returns:
        A :class:`GraphBatch` with ``pairs`` and ``negatives`` as seed positions.
    """
    pos = link.csr_edges(edge_ids) if pairs is None else pairs[:, edge_ids]
    lb = link.sample(pos, rng)
    blocks = sampler.sample(lb.node_ids.numpy(), rng)
    return GraphBatch(
        blocks=blocks, num_nodes=len(blocks.n_id), features=node_features(graph, blocks.n_id),
        labels=None, pairs=lb.pos_index, negatives=lb.neg_index)
