"""Click-through-rate prediction: binary cross-entropy on a DLRM-style model's logit.

Metrics: AUC (exact, ``torchmetrics.classification.BinaryAUROC``), normalised entropy (NE, via
``torchrec.metrics.ne.compute_ne``), log loss and calibration (predicted CTR / observed CTR).
All accumulators are torchmetrics states, so ``compute()`` syncs across ranks.

Example:
    >>> task = CTRTask()
    >>> out = task.forward(model, batch)      # out.loss, out.predictions (probabilities)
    >>> metrics = task.new_metrics(); metrics.update(out, batch); metrics.compute()["auc"]
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.datasets.utils import Batch

from embedtrain.data.batching import num_padding
from embedtrain.train.task import StepOutput

_ETA = 1e-12  # torchrec's default clamp for NE


class CTRMetrics:
    """AUC, NE, log loss and calibration over the batches given to :meth:`update`."""

    def __init__(self) -> None:
        # torchmetrics (and torchrec.metrics, which imports it) cost ~1.5 s to import: at the
        # first evaluation, not before the first training step
        from torchmetrics import SumMetric
        from torchmetrics.classification import BinaryAUROC

        self.auc = BinaryAUROC(thresholds=None)  # exact: keeps all predictions of the pass
        self.sums = {k: SumMetric() for k in ("ce", "count", "positives", "predicted")}

    def update(self, output: StepOutput, batch: Batch) -> None:
        """Adds the batch's click probabilities and labels (padding rows left out)."""
        p = output.predictions.detach().double()
        y = batch.labels[: len(p)].double()  # padding rows (see ParquetBatchReader) come last
        ce = F.binary_cross_entropy(p.clamp(_ETA, 1 - _ETA), y, reduction="sum")
        self.auc.update(p, y.long())
        self.sums["ce"].update(ce)
        self.sums["count"].update(torch.tensor(float(y.numel()), dtype=torch.float64))
        self.sums["positives"].update(y.sum())
        self.sums["predicted"].update(p.sum())

    def compute(self) -> dict[str, float]:
        """``auc``, ``ne``, ``logloss``, ``calibration``, ``ctr`` over all ranks' batches."""
        from torchrec.metrics.ne import compute_ne

        s = {k: m.compute().double() for k, m in self.sums.items()}
        if s["count"] == 0:
            return {}
        # torchrec's NE normaliser is in bits; our cross-entropy sum is in nats.
        ne = compute_ne(s["ce"] / math.log(2), s["count"], s["positives"], s["count"] - s["positives"], eta=_ETA)
        calibration = s["predicted"] / s["positives"] if s["positives"] > 0 else torch.tensor(0.0)
        return {
            "auc": float(self.auc.compute()),
            "ne": float(ne),
            "logloss": float(s["ce"] / s["count"]),
            "calibration": float(calibration),
            "ctr": float(s["positives"] / s["count"]),
        }


class CTRTask:
    """Binary click prediction on models mapping ``(dense, KeyedJaggedTensor)`` to one logit.

    Attributes:
        family: the family whose data and model it runs on (``task: {_component_: ...}``).
        score: how a served row's score follows from the model's output (``sigmoid``: the
            click probability; ``identity``): recorded in an export, applied by predict.
    """

    name = "ctr"
    main_metric = "auc"
    family = "ctr"
    score = "sigmoid"

    def __init__(self, penalty: Optional[Callable[[nn.Module], Optional[torch.Tensor]]] = None
                 ) -> None:
        """``penalty``: the model -> a regulariser of its last forward to add to the training
        loss, or None (e.g. :func:`embedtrain.models.dlrm.embedding_penalty`)."""
        self.penalty = penalty

    def forward(self, model: nn.Module, batch: Batch) -> StepOutput:
        """Mean binary cross-entropy of the real rows; predictions: their click probabilities."""
        logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
        n = logits.numel() - num_padding(batch)  # padding rows take part in the forward only
        real = logits[:n]
        if n:
            loss = F.binary_cross_entropy_with_logits(real, batch.labels[:n])
        else:  # a rank with only padding in the epoch's last step: no gradient, same graph
            loss = logits.sum() * 0.0
        penalty = self.penalty(model) if self.penalty is not None else None
        if penalty is not None:
            loss = loss + penalty
        return StepOutput(loss=loss, predictions=torch.sigmoid(real), num_examples=n)

    def new_metrics(self) -> CTRMetrics:
        """A fresh AUC / NE / log-loss / calibration accumulator."""
        return CTRMetrics()


class RegressionMetrics:
    """MSE, RMSE and MAE (torchmetrics states: ``compute()`` syncs across ranks)."""

    def __init__(self) -> None:
        from torchmetrics import MeanAbsoluteError, MeanSquaredError

        self.mse, self.mae = MeanSquaredError(), MeanAbsoluteError()

    def update(self, output: StepOutput, batch: Batch) -> None:
        """Adds the batch's predictions against its labels (padding rows left out)."""
        y = batch.labels[: output.num_examples].double()
        self.mse.update(output.predictions.detach().double(), y)
        self.mae.update(output.predictions.detach().double(), y)

    def compute(self) -> dict[str, float]:
        """``mse``, ``rmse``, ``mae`` over all ranks' batches (``{}`` with none)."""
        mse, mae = float(self.mse.compute()), float(self.mae.compute())
        return {} if math.isnan(mse) else {"mse": mse, "rmse": math.sqrt(mse), "mae": mae}


class Regression:
    """A number per row (the data set's label) from a CTR-family model's one output: mean
    squared error; MSE, RMSE and MAE. ``task: {_component_: embedtrain.tasks:Regression}``."""

    name = "regression"
    main_metric = "rmse"
    family = "ctr"
    score = "identity"

    def forward(self, model: nn.Module, batch: Batch) -> StepOutput:
        """Mean squared error of the real rows; predictions: the model's outputs."""
        out = model(batch.dense_features, batch.sparse_features).squeeze(-1)
        n = out.numel() - num_padding(batch)
        loss = F.mse_loss(out[:n], batch.labels[:n]) if n else out.sum() * 0.0
        return StepOutput(loss=loss, predictions=out[:n], num_examples=n)

    def new_metrics(self) -> RegressionMetrics:
        """A fresh MSE / RMSE / MAE accumulator."""
        return RegressionMetrics()
