"""Next-item prediction: the head's loss over (a sample of) the item corpus at every position of
a history, and the whole corpus ranked for each history's next item in evaluation.

The step is the XC task's (:class:`~embedtrain.train.xc.XCTask`: the model is an XC-shaped
``(dense, KJT, targets[, k]) -> loss | (losses, top-k, ranks)``); the metrics are those of one
target per example over every item of the corpus, with no sampled negatives: HR@k (the target
is in the top k: XC's recall@k with one label), NDCG@k (``1 / log2(rank + 1)`` within the top k:
XC's nDCG@k with one label) and MRR (the mean of ``1 / rank`` of the target among all items;
sharded heads, which rank every item: :meth:`~embedtrain.heads.sharded.ShardedSoftmaxHead.
target_rank`).

Example:
    >>> task = SeqTask(ks=(10,))
    >>> metrics = task.new_metrics(); metrics.update(task.forward(model, batch), batch)
    >>> metrics.compute()["hr@10"], metrics.compute()["mrr"]
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch

from embedtrain.data.batching import num_padding
from embedtrain.train.task import StepOutput
from embedtrain.train.xc import XCTask, XCTaskMetrics


class SeqTaskMetrics(XCTaskMetrics):
    """HR@k and NDCG@k of the top-k items, and MRR of the target's rank, against each
    example's next item. Predictions are ``[B, max k]`` item ids, with the target's rank as one
    more column when the head ranks every item."""

    def __init__(self, ks: Sequence[int]) -> None:
        super().__init__(ks)
        self.k = max(ks)
        self.reciprocal = torch.zeros(2, dtype=torch.float64)  # sum of 1 / rank, examples

    def update(self, output: StepOutput, batch: Batch) -> None:
        predictions = output.predictions
        if predictions.shape[1] > self.k:  # the ranks' column
            ranks = predictions[:, self.k].double()  # 0: the target could not be ranked
            reciprocal = torch.where(ranks > 0, 1.0 / ranks.clamp(min=1), torch.zeros_like(ranks))
            self.reciprocal += torch.stack([reciprocal.sum(),
                                            torch.tensor(float(ranks.numel()), dtype=torch.float64)])
            predictions = predictions[:, :self.k]
        self.metrics.update(predictions, batch.labels[: output.num_examples])

    def compute(self) -> dict[str, float]:
        """``hr@k`` and ``ndcg@k`` for each k, and ``mrr``, summed over ranks."""
        out = {}
        for key, value in self.metrics.compute().items():
            name, k = key.split("@")
            if name == "recall":
                out[f"hr@{k}"] = value
            elif name == "ndcg":
                out[key] = value
        sums = self.reciprocal.clone()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        if sums[1] > 0:
            out["mrr"] = float(sums[0] / sums[1])
        return out


class SeqTask(XCTask):
    """Next-item prediction on models ``(dense, KJT, next item[, k]) -> loss | (losses, top-k,
    ranks)``."""

    name = "seq"
    family = "seq"

    def __init__(self, ks: Sequence[int] = (10,)) -> None:
        super().__init__(ks)
        self.main_metric = f"hr@{self.ks[0]}"

    def forward(self, model: nn.Module, batch: Batch) -> StepOutput:
        """Training: the head's loss. Evaluation: mean loss over every item, the top-k ids and
        the targets' ranks (one more column of the predictions)."""
        if model.training:
            return super().forward(model, batch)
        n = batch.labels.shape[0] - num_padding(batch)
        losses, top, ranks = model(batch.dense_features, batch.sparse_features, batch.labels,
                                   max(self.ks))
        loss = losses[:n].mean() if n else losses.sum() * 0.0
        predictions = top[:n] if ranks is None else torch.cat([top[:n], ranks[:n, None]], 1)
        return StepOutput(loss=loss, predictions=predictions, num_examples=n)

    def new_metrics(self) -> SeqTaskMetrics:
        """A fresh HR@k / NDCG@k / MRR accumulator for this task's ``ks``."""
        return SeqTaskMetrics(self.ks)
