"""GNN tasks on sampled neighbourhoods: node classification and link prediction.

A :class:`~embedtrain.graph.batch.GraphBatch` is what the trainer hands a GNN task: the sampled
subgraph's blocks (:class:`~embedtrain.graph.sampler.SampledBlocks`), their features, and the
targets: the seeds' labels, or the positive and negative node pairs. The task adds the nodes' ids
as a ``KeyedJaggedTensor`` for the node-id table (:func:`with_node_ids`: one id per node; under
several ranks the rows are padded to the same count on every rank with empty bags, as TorchRec's
sharded lookups expect equal batch sizes) and calls the model on ``(blocks, node_ids,
features)``.

Batches come from the loaders of :mod:`embedtrain.graph.loader` (every seed once per epoch, split
over ranks; loader -> sampler -> collate -> features); they follow the trainer's ``EpochData``
protocol, so resume restarts on exactly the batch an uninterrupted run would have seen.

Metrics: accuracy and macro-F1 (``torchmetrics``) for nodes; MRR and Hits@K of each positive
ranked against its sampled negatives for links.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedtrain.graph.batch import GraphBatch
from embedtrain.models.gnn import NODE_FEATURE
from embedtrain.train.task import StepOutput


def with_node_ids(batch: GraphBatch) -> GraphBatch:
    """Sets ``batch.node_ids``: one id per sampled node for the node-id table, padded with empty
    bags to the largest subgraph of the step over all ranks; returns ``batch``.

    Runs in the training thread (an all-reduce, which must not run in a loader thread), and again
    at every use: a batch evaluated again (a rank out of evaluation batches keeps the collectives
    matched) must pad to *this* step's largest subgraph.
    """
    batch.node_ids = node_id_kjt(batch.blocks.n_id, padded_rows(batch.num_nodes))
    return batch


def _forward(model: nn.Module, batch: GraphBatch) -> Tensor:
    batch = with_node_ids(batch)
    return model(batch.blocks, batch.node_ids, batch.features)


def node_id_kjt(n_id: Tensor, rows: int) -> KeyedJaggedTensor:
    """The node ids as one-id bags, padded with empty bags to ``rows`` rows."""
    lengths = torch.zeros(rows, dtype=torch.int32)
    lengths[: n_id.numel()] = 1
    return KeyedJaggedTensor(keys=[NODE_FEATURE], values=n_id.long(), lengths=lengths,
                             stride=rows)


def padded_rows(n: int) -> int:
    """Rows every rank uses for this step: the largest subgraph over the ranks."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return n
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


class NodeMetrics:
    """Accuracy and macro-F1 of the seeds' predicted classes (synced across ranks)."""

    def __init__(self, num_classes: int) -> None:
        from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

        self.accuracy = MulticlassAccuracy(num_classes, average="micro")
        self.f1 = MulticlassF1Score(num_classes, average="macro")

    def update(self, output: StepOutput, batch: GraphBatch) -> None:
        """Adds the batch's predicted classes (arg-max of the logits) against its labels."""
        pred = output.predictions.argmax(dim=1)
        self.accuracy.update(pred, batch.labels)
        self.f1.update(pred, batch.labels)

    def compute(self) -> dict[str, float]:
        """``accuracy`` and ``macro_f1`` over all ranks' batches."""
        return {"accuracy": float(self.accuracy.compute()), "macro_f1": float(self.f1.compute())}


class NodeClassificationTask:
    """Softmax cross-entropy on the seeds' labels."""

    name = "gnn_node"
    family = "gnn_node"
    main_metric = "accuracy"

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes

    def forward(self, model: nn.Module, batch: GraphBatch) -> StepOutput:
        """Mean cross-entropy of the seeds' logits; predictions: the logits."""
        logits = _forward(model, batch)
        # A rank may have no seed left in an epoch's last step: it still runs the step (the
        # node table's all-to-all), with a zero loss.
        loss = F.cross_entropy(logits, batch.labels) if len(batch.labels) else logits.sum() * 0.0
        return StepOutput(loss=loss, predictions=logits.detach(), num_examples=batch.num_examples)

    def new_metrics(self) -> NodeMetrics:
        """A fresh accuracy / macro-F1 accumulator."""
        return NodeMetrics(self.num_classes)


class LinkMetrics:
    """MRR and Hits@K of each positive pair ranked against its ``k`` sampled negatives."""

    def __init__(self, ks: Sequence[int] = (1, 3, 10)) -> None:
        self.ks = tuple(ks)
        from torchmetrics import SumMetric

        self.sums = {name: SumMetric() for name in ("rr", "count", *(f"hits@{k}" for k in ks))}

    def update(self, output: StepOutput, batch: GraphBatch) -> None:
        """Adds each positive's rank among its negatives (reciprocal rank, hits at each k)."""
        pos, neg = output.predictions  # [P], [P, k]
        # Rank 1 + the negatives scoring at least as high (ties count against the positive).
        rank = 1 + (neg >= pos[:, None]).sum(dim=1).double()
        self.sums["rr"].update((1.0 / rank).sum())
        self.sums["count"].update(torch.tensor(float(rank.numel()), dtype=torch.float64))
        for k in self.ks:
            self.sums[f"hits@{k}"].update((rank <= k).double().sum())

    def compute(self) -> dict[str, float]:
        """``mrr`` and ``hits@k`` over all ranks' positives (``{}`` if none)."""
        s = {k: float(m.compute()) for k, m in self.sums.items()}
        n = s.pop("count")
        if not n:
            return {}
        return {"mrr": s.pop("rr") / n, **{k: v / n for k, v in s.items()}}


class LinkPredictionTask:
    """Binary cross-entropy of dot-product scores: positives vs sampled negatives."""

    name = "gnn_link"
    family = "gnn_link"
    main_metric = "mrr"

    def __init__(self, ks: Sequence[int] = (1, 3, 10)) -> None:
        self.ks = tuple(ks)

    def forward(self, model: nn.Module, batch: GraphBatch) -> StepOutput:
        """Binary cross-entropy of the pairs' dot products; predictions: (positive scores,
        negative scores per positive)."""
        h = _forward(model, batch)  # [num_seeds, D]
        pos = (h[batch.pairs[0]] * h[batch.pairs[1]]).sum(dim=1)
        neg = (h[batch.negatives[0]] * h[batch.negatives[1]]).sum(dim=1)
        scores = torch.cat([pos, neg])
        target = torch.cat([torch.ones_like(pos), torch.zeros_like(neg)])
        if scores.numel():
            loss = F.binary_cross_entropy_with_logits(scores, target)
        else:  # no positive edge left on this rank in the epoch's last step
            loss = h.sum() * 0.0
        k = max(neg.numel() // max(pos.numel(), 1), 1)
        return StepOutput(loss=loss, predictions=(pos.detach(), neg.detach().view(-1, k)),
                          num_examples=batch.num_examples)

    def new_metrics(self) -> LinkMetrics:
        """A fresh MRR / Hits@K accumulator."""
        return LinkMetrics(self.ks)

