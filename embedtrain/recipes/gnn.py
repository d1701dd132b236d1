"""Node classification and link prediction with GraphSAGE on sampled neighbourhoods.

The node-id table is a TorchRec table, so the model is planned by embedtrain's planner (it shows
up in ``plan.json`` as ``t_node``) and sharded by ``DistributedModelParallel`` like DLRM's tables;
the SAGEConv layers are data-parallel. Seed nodes (or edges) are split over the ranks by the
graph loader (:mod:`embedtrain.graph.loader`), each batch's neighbourhood sampled in loader
threads, seeded by ``(seed, epoch, rank, batch)`` so a resumed run sees the same subgraphs.

An export holds the node table (if any) and every node's outputs, computed once at export by
layer-wise full-graph inference (:mod:`embedtrain.models.layerwise`: each SAGE layer over all
nodes in chunks, with full neighbourhoods, no sampling): ``nodes/scores.npy`` (class logits) and
``nodes/embeddings.npy`` (the last layer's output) for node classification,
``nodes/embeddings.npy`` (the embeddings a link is scored by) for link prediction. There is no
dense program: a node's output needs its neighbourhood, not a row, so ``embedtrain predict``
looks the outputs up by node id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from embedtrain.config import Config, GNNModel, TaskKind, dynamic_tables, task_family
from embedtrain.features import FeatureSpec, SparseFeature
from embedtrain.models.layerwise import layerwise_inference
from embedtrain.graph.loader import SeedBatches, link_loader, node_loader
from embedtrain.graph.store import GraphData, load_graph
from embedtrain.models.gnn import NODE_FEATURE, NODE_TABLE, GraphSAGE
from embedtrain.recipes.base import DatasetInfo, Recipe
from embedtrain.recipes.export_parts import ExportParts, NodeOutputsExport
from embedtrain.sharding.planner import PlanResult
from embedtrain.train.gnn import LinkPredictionTask, NodeClassificationTask


class GraphRecipe(Recipe):
    """``task: gnn_node`` and ``gnn_link``: the graph data set, GraphSAGE, the seed loader's
    knobs, and what is the task's (:class:`NodeTarget` or :class:`LinkTarget`: the output, the
    seeds each step reads, the loss and metrics)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        link = task_family(cfg) is TaskKind.GNN_LINK
        self.target = LinkTarget(self) if link else NodeTarget(self)
        self.printed_metrics = self.target.printed_metrics

    def load_dataset(self) -> GraphData:
        """``data.path``'s graph, memory-mapped."""
        return load_graph(self.cfg.data.path, mmap=True, check_ranges=False)

    def dataset_info(self) -> DatasetInfo:
        """The target's splits (:meth:`NodeTarget.splits`, :meth:`LinkTarget.splits`)."""
        g = self.dataset
        return DatasetInfo(g.name, g.root, self.target.splits())

    def planning_model(self) -> nn.Module:
        """``gnn``'s GraphSAGE on ``meta`` (node-id table fused), one layer per hop."""
        g, graph = self.cfg.gnn, self.dataset
        out = self.target.out_dim()
        if len(g.fanouts) != len(g.hidden) and g.model is not GNNModel.APPNP:
            raise ValueError(f"gnn.fanouts ({len(g.fanouts)} hops) and gnn.hidden "
                             f"({len(g.hidden)} layers) must have the same length")
        tables = [NODE_TABLE] if self._has_node_table() else []
        dynamic = dynamic_tables(self.cfg, tables).get(NODE_TABLE)
        model = GraphSAGE(graph.num_nodes, graph.num_features, g.embedding_dim, g.hidden, out,
                          aggr=g.aggr, dropout=g.dropout, device=torch.device("meta"),
                          kind=g.model, dynamic=dynamic, heads=g.heads,
                          hops=len(g.fanouts), alpha=g.alpha)
        return self.fuse_sparse(model)

    def _has_node_table(self) -> bool:
        return self.dataset.num_nodes > 0 and self.cfg.gnn.embedding_dim > 0

    def export_parts(self, model: nn.Module, tables: Sequence[tuple[str, int, int]]
                     ) -> ExportParts:
        """The node table's one feature, the node id (if the model has a table), and every
        node's outputs by layer-wise inference (:meth:`node_arrays`); no dense program."""
        rows = tables[0][1] if tables else 0
        sparse = (SparseFeature(NODE_FEATURE, rows),) if tables else ()
        spec = FeatureSpec("label", (), sparse, num_classes=self.dataset.num_classes or None)
        model.convs.to_empty(device="cpu")  # the layers run at export; the table stays on meta
        model.out.to_empty(device="cpu")
        arrays = self.target.node_arrays()
        nodes = NodeOutputsExport(model, "model.", NODE_TABLE if tables else None,
                                  {name: what for name, (_, what) in arrays.items()},
                                  self._write_node_outputs, self.dataset.id_map)
        return ExportParts("graphsage", spec, nodes=nodes, note=(
            f"no dense program (a node's output needs its neighbourhood, not a row): every "
            f"node's {' and '.join(arrays)} by layer-wise full-graph inference, nodes/*.npy "
            f"(row = node id)"))

    def _write_node_outputs(self, model: nn.Module, node_embeddings, files: dict[str, Path],
                            progress: bool) -> None:
        role = {r: files[name] for name, (r, _) in self.target.node_arrays().items()}
        layerwise_inference(model, self.dataset, node_embeddings=node_embeddings,
                            outputs_file=role["outputs"], embeddings_file=role.get("embeddings"),
                            keep_embeddings="embeddings" in role,
                            scratch_dir=role["outputs"].parent, progress=progress)

    def describe_plan(self, result: PlanResult) -> None:
        """Notes the node features in the report: they are read through the page cache from
        their memory map, not placed by the planner, so their bytes are not in any rank's."""
        g = self.dataset
        if g.features is None:
            return
        nbytes = int(g.features.nbytes)
        result.report.model["node_features"] = {
            "nodes": g.num_nodes, "dim": int(g.features.shape[1]),
            "dtype": str(g.features.dtype), "bytes": nbytes}
        result.report.warnings.append(
            f"node features ({g.num_nodes:,} x {g.features.shape[1]} {g.features.dtype}, "
            f"{nbytes / 2**30:.2f} GiB) are memory-mapped and read through the page cache: not "
            f"in the ranks' bytes; a host holding them in RAM needs that much more")

    def loader_arguments(self, train: bool, rank: int, world_size: int) -> dict[str, Any]:
        """The loader's fanouts, seeds and threads (seeded ``train.seed``, +1 for evaluation)."""
        cfg, g = self.cfg, self.cfg.gnn
        fanouts = g.fanouts if train or not g.eval_fanouts else g.eval_fanouts
        if g.model is GNNModel.MLP:  # the baseline reads no neighbours: sample as little as can be
            fanouts = [1] * len(fanouts)
        return dict(fanouts=fanouts, weighted=g.weighted, shuffle=cfg.data.shuffle and train,
                    seed=cfg.train.seed + (0 if train else 1),
                    rank=rank, world_size=world_size,
                    # auto: 2 threads here; the idle-class read-ahead is the parquet reader's
                    num_workers=2 if cfg.data.num_workers is None else cfg.data.num_workers,
                    drop_last=cfg.data.drop_last and train)

    def pooling_factors(self) -> dict[str, float]:
        """The node table looks up one id per sampled node."""
        return {NODE_TABLE: 1.0}

    def pooling_note(self) -> str:
        return "1 id per node"

    def reader(self, split: str, train: bool, batch_size: int, rank: int,
               world_size: int) -> SeedBatches:
        """This rank's share of the target's seeds with their sampled neighbourhoods."""
        return self.target.reader(split, train, batch_size,
                                  self.loader_arguments(train, rank, world_size))

    def task(self) -> Any:
        """The target's task."""
        return self.target.task()

    def summary_extra(self) -> dict[str, Any]:
        """The synthetic graph's homophily and Bayes accuracies, if it has them."""
        gen = self.dataset.meta.get("generator") or {}
        return {k: gen[k] for k in ("features_only_bayes_accuracy", "one_hop_bayes_accuracy",
                                    "homophily") if k in gen}


class GraphTarget:
    """What a graph task says to its :class:`GraphRecipe`: ``splits()``, ``out_dim()``,
    ``node_arrays()`` (``{name: (role, what it is)}`` of the per-node arrays an export writes,
    the model's output first; role ``outputs``, ``model.out``, or ``embeddings``, its input),
    ``reader(split, train, batch_size, loader arguments)`` and ``task()``."""

    printed_metrics: tuple[str, ...] = ()

    def __init__(self, recipe: GraphRecipe) -> None:
        self.recipe = recipe

    @property
    def dataset(self) -> GraphData:
        return self.recipe.dataset


class NodeTarget(GraphTarget):
    """``task: gnn_node``: the classes of a split's nodes, cross-entropy, accuracy and macro-F1."""

    printed_metrics = ("accuracy", "macro_f1")

    def splits(self) -> list[str]:
        """The graph's node splits that hold nodes (an empty one is as good as none)."""
        return [s for s, ids in self.dataset.splits.items() if len(ids)]

    def out_dim(self) -> int:
        """The data set's number of classes (it must have node labels)."""
        graph = self.dataset
        if graph.labels is None or not graph.num_classes:
            raise ValueError(f"{graph.root / 'metadata.json'}: task gnn_node needs node labels")
        return graph.num_classes

    def node_arrays(self) -> dict[str, tuple[str, str]]:
        """Class logits, and the last SAGE layer's output they are computed from."""
        k, width = self.dataset.num_classes, self.recipe.cfg.gnn.hidden[-1]
        return {"scores": ("outputs", f"float32 [N, {k}]: class logits (predicted class: the "
                                      f"arg-max)"),
                "embeddings": ("embeddings", f"float32 [N, {width}]: the last SAGE layer's "
                                             f"output, which the class layer scores")}

    def reader(self, split: str, train: bool, batch_size: int, args: dict[str, Any]
               ) -> SeedBatches:
        """The split's nodes with their sampled neighbourhoods (``args``: the loader's)."""
        graph = self.dataset
        if split not in graph.splits:
            raise ValueError(f"{graph.root / 'metadata.json'}: no {split} split")
        return node_loader(graph, graph.splits[split], batch_size, args.pop("fanouts"), **args)

    def task(self) -> NodeClassificationTask:
        """Cross-entropy over the classes; accuracy and macro-F1."""
        return NodeClassificationTask(self.dataset.num_classes)


class LinkTarget(GraphTarget):
    """``task: gnn_link``: edges against sampled negatives, dot-product scores, MRR and Hits@K."""

    printed_metrics = ("mrr",)

    def splits(self) -> list[str]:
        """Training on every CSR edge; valid and test where the graph holds out edges."""
        g = self.dataset
        return ["train", *(s for s in ("valid", "test")
                           if s in g.edge_splits and g.edge_splits[s].shape[1])]

    def out_dim(self) -> int:
        """``gnn.out_dim``: the node embedding size scored by dot products."""
        return self.recipe.cfg.gnn.out_dim

    def node_arrays(self) -> dict[str, tuple[str, str]]:
        """The node embeddings whose dot products score a link."""
        return {"embeddings": ("outputs", f"float32 [N, {self.out_dim()}]: node "
                                          f"embeddings; a link (u, v) scores "
                                          f"embeddings[u] @ embeddings[v]")}

    def reader(self, split: str, train: bool, batch_size: int, args: dict[str, Any]
               ) -> SeedBatches:
        """Every CSR edge for training, the held-out positive edges (``edge_splits``) for
        evaluation, each with ``gnn.negatives`` sampled negatives (``args``: the loader's)."""
        graph, g = self.dataset, self.recipe.cfg.gnn
        pairs = None if train else graph.edge_splits.get(split)
        if not train and pairs is None:
            raise ValueError(f"{graph.root / 'metadata.json'}: no held-out {split} edges for link "
                             f"prediction (embedtrain datagen graph --link-fraction 0.1)")
        return link_loader(graph, batch_size, args.pop("fanouts"), edges=pairs,
                           num_negatives=g.negatives, negative=g.negative_sampling, **args)

    def task(self) -> LinkPredictionTask:
        """Binary cross-entropy of positives against negatives; MRR and Hits@K."""
        return LinkPredictionTask(self.recipe.cfg.gnn.link_ks)
