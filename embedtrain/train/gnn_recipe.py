"""Wiring of the GNN tasks: a graph data set, the neighbour sampler and GraphSAGE into a Trainer.

The node-id table is a TorchRec table, so the model is planned by embedtrain's planner (it shows
up in ``plan.json`` as ``t_node``) and sharded by ``DistributedModelParallel`` like DLRM's tables;
the SAGEConv layers are data-parallel. Seed nodes are split over the ranks by
:class:`~embedtrain.graph.sampler.SeedBatches`, each batch's neighbourhood sampled in loader
threads, seeded by ``(seed, epoch, rank, batch)`` so a resumed run sees the same subgraphs.

Example:
    >>> run = build_gnn_run(load_config("configs/gnn_node.yaml"), "runs/gnn")
    >>> run.trainer.fit(test_data=run.test_data)
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from embedtrain.config import Config, TaskKind
from embedtrain.data.graph_store import GraphData, load_graph
from embedtrain.graph.sampler import LinkSampler, NegativeSampling, NeighborSampler, SeedBatches
from embedtrain.models.gnn import NODE_TABLE, GraphSAGE
from embedtrain.train.gnn import (
    GraphBatch,
    LinkPredictionTask,
    NodeClassificationTask,
    gather_rows,
)


def gnn_model(cfg: Config, graph: GraphData, device: Optional[torch.device] = None) -> nn.Module:
    g = cfg.gnn
    if cfg.task is TaskKind.GNN_NODE:
        if graph.labels is None or not graph.num_classes:
            raise ValueError(f"{graph.root / 'metadata.json'}: task gnn_node needs node labels")
        out = graph.num_classes
    else:
        out = g.out_dim
    if len(g.fanouts) != len(g.hidden):
        raise ValueError(f"gnn.fanouts ({len(g.fanouts)} hops) and gnn.hidden "
                         f"({len(g.hidden)} layers) must have the same length")
    if g.model not in ("sage", "mlp"):
        raise ValueError(f"gnn.model: {g.model!r} is not one of sage, mlp")
    return GraphSAGE(graph.num_nodes, graph.num_features, g.embedding_dim, g.hidden, out,
                     aggr=g.aggr, dropout=g.dropout, device=device, use_graph=g.model == "sage")


def node_batch(ids: np.ndarray, rng: np.random.Generator, sampler: NeighborSampler,
               graph: GraphData) -> GraphBatch:
    """One node-classification batch: ``ids``' sampled neighbourhood, features and labels."""
    blocks = sampler.sample(ids, rng)
    n_id = blocks.n_id.numpy()
    return GraphBatch(
        blocks=blocks,
        num_nodes=len(n_id),
        features=gather_rows(graph.features, n_id) if graph.features is not None else None,
        labels=torch.from_numpy(np.asarray(graph.labels[ids], dtype=np.int64)),
    )


def link_batch(edge_ids: np.ndarray, rng: np.random.Generator, link: LinkSampler,
               sampler: NeighborSampler, graph: GraphData, pairs: Optional[np.ndarray]
               ) -> GraphBatch:
    """One link-prediction batch: positive edges, their negatives, the endpoints' subgraph."""
    pos = link.csr_edges(edge_ids) if pairs is None else pairs[:, edge_ids]
    lb = link.sample(pos, rng)
    blocks = sampler.sample(lb.node_ids.numpy(), rng)
    n_id = blocks.n_id.numpy()
    return GraphBatch(
        blocks=blocks, num_nodes=len(n_id),
        features=gather_rows(graph.features, n_id) if graph.features is not None else None,
        labels=None, pairs=lb.pos_index, negatives=lb.neg_index)


def gnn_data(cfg: Config, graph: GraphData, split: str, train: bool, batch_size: int, rank: int,
             world: int) -> SeedBatches:
    """Seed batches of ``split`` with their sampled neighbourhoods (this rank's share).

    Node classification: the split's nodes. Link prediction: every CSR edge for training, the
    held-out positive edges (``edge_splits``) for evaluation, each with ``gnn.negatives``
    sampled negatives.
    """
    g = cfg.gnn
    fanouts = g.fanouts if train or not g.eval_fanouts else g.eval_fanouts
    if g.model == "mlp":  # the baseline reads no neighbours: sample as little as possible
        fanouts = [1] * len(fanouts)
    sampler = NeighborSampler(graph.indptr, graph.indices, fanouts,
                              weights=graph.weights if g.weighted else None, seed=cfg.train.seed)
    seed = cfg.train.seed + (0 if train else 1)
    if cfg.task is TaskKind.GNN_LINK:
        pairs = None if train else graph.edge_splits.get(split)
        if not train and pairs is None:
            raise ValueError(f"{graph.root / 'metadata.json'}: no held-out {split} edges for link "
                             f"prediction (embedtrain datagen graph --link-fraction 0.1)")
        link = LinkSampler(graph.indptr, graph.indices, num_negatives=g.negatives,
                           negative=NegativeSampling(g.negative_sampling.value))
        count = link.num_edges if pairs is None else pairs.shape[1]
        return SeedBatches(count, batch_size, shuffle=cfg.data.shuffle and train, seed=seed,
                           rank=rank, world_size=world, num_workers=cfg.data.num_workers,
                           drop_last=cfg.data.drop_last and train, unit="edges",
                           collate=lambda ids, rng: link_batch(ids, rng, link, sampler, graph,
                                                               pairs))
    if split not in graph.splits:
        raise ValueError(f"{graph.root / 'metadata.json'}: no {split} split")
    return SeedBatches(graph.splits[split], batch_size, shuffle=cfg.data.shuffle and train,
                       seed=seed, rank=rank, world_size=world,
                       num_workers=cfg.data.num_workers, drop_last=cfg.data.drop_last and train,
                       unit="nodes",
                       collate=lambda ids, rng: node_batch(ids, rng, sampler, graph))


def gnn_task(cfg: Config, graph: GraphData) -> Any:
    if cfg.task is TaskKind.GNN_NODE:
        return NodeClassificationTask(graph.num_classes)
    return LinkPredictionTask(cfg.gnn.link_ks)


def gnn_pooling_factors(graph: GraphData) -> dict[str, float]:
    """The node table looks up one id per sampled node."""
    return {NODE_TABLE: 1.0}


def load_gnn_graph(cfg: Config) -> GraphData:
    return load_graph(cfg.data.path, mmap=True, check_ranges=False)


def gnn_summary_extra(graph: GraphData) -> dict[str, Any]:
    gen = graph.meta.get("generator") or {}
    extra = {}
    for key in ("features_only_bayes_accuracy", "one_hop_bayes_accuracy", "homophily"):
        if key in gen:
            extra[key] = gen[key]
    return extra
