"""Next-item prediction: the head's loss over (a sample of) the item corpus at every position of
a history, and the whole corpus ranked for each history's next item in evaluation.

The step and the top-k are the XC task's (:class:`~embedtrain.train.xc.XCTask`: the model is an
XC-shaped ``(dense, KJT, targets[, k]) -> loss | (losses, top-k)``); the metrics are renamed for
one target per example: HR@k (the target is in the top k: XC's recall@k with one label) and
NDCG@k (``1 / log2(rank + 1)`` within the top k: XC's nDCG@k with one label). Every item of the
corpus is ranked, with no sampled negatives.

Example:
    >>> task = SeqTask(ks=(10,))
    >>> metrics = task.new_metrics(); metrics.update(task.forward(model, batch), batch)
    >>> metrics.compute()["hr@10"]
"""

from __future__ import annotations

from typing import Sequence

from embedtrain.train.xc import XCTask, XCTaskMetrics


class SeqTaskMetrics(XCTaskMetrics):
    """HR@k and NDCG@k of the top-k items against each example's next item."""

    def compute(self) -> dict[str, float]:
        """``hr@k`` and ``ndcg@k`` for each k, summed over ranks."""
        out = {}
        for key, value in self.metrics.compute().items():
            name, k = key.split("@")
            if name == "recall":
                out[f"hr@{k}"] = value
            elif name == "ndcg":
                out[key] = value
        return out


class SeqTask(XCTask):
    """Next-item prediction on models ``(dense, KJT, next item[, k]) -> loss | (losses, top-k)``."""

    name = "seq"

    def __init__(self, ks: Sequence[int] = (10,)) -> None:
        super().__init__(ks)
        self.main_metric = f"hr@{self.ks[0]}"

    def new_metrics(self) -> SeqTaskMetrics:
        """A fresh HR@k / NDCG@k accumulator for this task's ``ks``."""
        return SeqTaskMetrics(self.ks)
