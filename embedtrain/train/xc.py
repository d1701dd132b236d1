"""Extreme classification: softmax over (a sample of) C classes, top-k metrics over all of them.

Training: the model returns its head's loss (sharded heads: the global batch's mean). Evaluation:
the model returns every example's loss over all classes and its top-k class ids (computed per
shard in blocks and merged), which :class:`XCTaskMetrics` turns into P@k, nDCG@k and recall@k
(summed over ranks at ``compute``).

Example:
    >>> task = XCTask(ks=(1, 5))
    >>> out = task.forward(model, batch)        # model.train(): loss; model.eval(): top-k too
    >>> metrics = task.new_metrics(); metrics.update(out, batch); metrics.compute()["p@1"]
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn
from torchrec.datasets.utils import Batch

from embedtrain.data.batching import num_padding
from embedtrain.train.task import StepOutput
from embedtrain.train.xc_metrics import XCMetrics


class XCTaskMetrics:
    """P@k, nDCG@k, recall@k of the top-k predictions against the batch's class ids."""

    def __init__(self, ks: Sequence[int], inv_propensity: Optional[torch.Tensor] = None) -> None:
        self.metrics = XCMetrics(ks, inv_propensity=inv_propensity)

    def update(self, output: StepOutput, batch: Batch) -> None:
        """Adds the batch's top-k class ids against its labels (padding rows left out)."""
        self.metrics.update(output.predictions, batch.labels[: output.num_examples])

    def compute(self) -> dict[str, float]:
        """``p@k``, ``ndcg@k``, ``recall@k`` (and ``psp@k``) for each k, summed over ranks."""
        return self.metrics.compute()


class XCTask:
    """Extreme classification on models ``(dense, KJT, class ids[, k]) -> loss | (losses, top-k)``."""

    name = "xc"
    main_metric = "p@1"
    family = "xc"

    def __init__(self, ks: Sequence[int] = (1, 5),
                 inv_propensity: Optional[torch.Tensor] = None) -> None:
        if not ks or min(ks) < 1:
            raise ValueError(f"head.top_k: needs positive k values, got {list(ks)}")
        self.ks = tuple(sorted(set(ks)))
        self.inv_propensity = inv_propensity  # [C]: PSP@k too
        self.main_metric = f"p@{self.ks[0]}"

    def forward(self, model: nn.Module, batch: Batch) -> StepOutput:
        """Training: the head's loss. Evaluation: mean loss over all classes and the top-k ids."""
        # Padding rows (label -1, last) run through the model, whose heads leave them out of
        # the loss; they are left out of the metrics here.
        n = batch.labels.shape[0] - num_padding(batch)
        if model.training:
            loss = model(batch.dense_features, batch.sparse_features, batch.labels)
            return StepOutput(loss=loss, predictions=torch.empty(0), num_examples=n)
        losses, top = model(batch.dense_features, batch.sparse_features, batch.labels,
                            max(self.ks))
        loss = losses[:n].mean() if n else losses.sum() * 0.0
        return StepOutput(loss=loss, predictions=top[:n], num_examples=n)

    def new_metrics(self) -> XCTaskMetrics:
        """A fresh top-k metrics accumulator for this task's ``ks``."""
        return XCTaskMetrics(self.ks, self.inv_propensity)
