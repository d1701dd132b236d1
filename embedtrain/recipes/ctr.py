"""Click-through rate: DLRM or DCNv2 on a tabular data set (``datagen ctr``, ``ingest``).

The table sizes come from the data set (:mod:`~embedtrain.recipes.tabular`); the loss is binary
cross-entropy on the model's logit; AUC, NE, log loss and calibration are reported. An export's
dense program is the model after its sparse arch: ``(dense, pooled [B, tables, D]) -> logit``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from embedtrain.config import Interaction
from embedtrain.models.dlrm import dcn, dlrm
from embedtrain.recipes.base import DenseExport, ExportParts, Oracle, oracle_of
from embedtrain.recipes.tabular import TabularRecipe
from embedtrain.train.ctr import CTRTask


class CTRRecipe(TabularRecipe):
    """``task: ctr``: DLRM (``model.interaction: dot``) or DCNv2 (``dcn``), binary cross-entropy."""

    oracle = Oracle("oracle_auc", "auc", "AUC of the true click probability")
    printed_metrics = ("auc", "ne", "logloss", "calibration")

    def planning_model(self) -> nn.Module:
        """``model``'s DLRM (``interaction: dot``) or DCNv2 (``dcn``) on ``meta``, tables fused."""
        m, features = self.cfg.model, self.dataset.features
        meta_device = torch.device("meta")
        dynamic = self.feature_dynamic_tables()
        if m.interaction is Interaction.DCN:
            model = dcn(features, m.embedding_dim, m.bottom_mlp, m.top_mlp, m.dcn_num_layers,
                        m.dcn_low_rank_dim, device=meta_device, dropout=m.dropout,
                        dynamic=dynamic)
        else:
            model = dlrm(features, m.embedding_dim, m.bottom_mlp, m.top_mlp, device=meta_device,
                         dropout=m.dropout, dynamic=dynamic)
        return self.fuse_sparse(model)

    def task(self) -> CTRTask:
        """Binary cross-entropy; AUC, NE, log loss, calibration."""
        return CTRTask()

    def summary_extra(self) -> dict[str, Any]:
        """The data set's oracle AUC on the test split, if it has one (synthetic data)."""
        return oracle_of(self.dataset.extra, "oracle_auc")

    def batch_args(self) -> Callable[[Any], tuple]:
        """TorchRec's DLRM takes ``(dense_features, sparse_features)`` (train.pipeline)."""
        return _dlrm_args

    def export_parts(self, model: nn.Module, tables: Sequence[tuple[str, int, int]]
                     ) -> ExportParts:
        """The data set's features and the dense program (:meth:`after_lookup`: DLRM / DCNv2's
        bottom MLP, interaction and top MLP)."""
        meta = self.dataset
        n_dense, dim = len(meta.features.dense), self.cfg.model.embedding_dim
        example = (torch.randn(4, n_dense), torch.randn(4, len(tables), dim))
        inputs = [f"dense: float32 [B, {n_dense}] (features.dense, in order)",
                  f"pooled: float32 [B, {len(tables)}, {dim}] (the tables' pooled embeddings, "
                  f"in the order of tables)"]
        module, prefix = self.after_lookup(model)
        dense = DenseExport(module, prefix, example, inputs,
                            "logit: float32 [B] (click probability = sigmoid(logit))")
        name = type(model).__name__  # a user recipe's model: its class
        if isinstance(module, DLRMDense):
            name = "dcn" if self.cfg.model.interaction is Interaction.DCN else "dlrm"
        return ExportParts(name, meta.features, meta.extra, dense)

    def after_lookup(self, model: nn.Module) -> tuple[nn.Module, str]:
        """The model after its tables, ``(dense [B, n_dense], pooled [B, tables, D]) -> logit
        [B]`` (what export writes as the dense program), and what the checkpoint's keys of its
        parameters start with: :class:`DLRMDense` of DLRM / DCNv2. A recipe with another model
        overrides this alone to export and predict."""
        return DLRMDense(model), "model."

    def predict_pooled(self, pooled: list[torch.Tensor]) -> torch.Tensor:
        """Stacked: ``[B, tables, D]``."""
        return torch.stack(pooled, dim=1)


class DLRMDense(nn.Module):
    """DLRM / DCNv2 without its tables: ``(dense [B, n_dense], pooled [B, F, D]) -> logit [B]``
    (TorchRec's ``DLRM.forward`` after the sparse arch)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.dense_arch, self.inter_arch, self.over_arch = (model.dense_arch, model.inter_arch,
                                                            model.over_arch)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        features = self.inter_arch(dense_features=self.dense_arch(dense), sparse_features=pooled)
        return self.over_arch(features).squeeze(-1)


def _dlrm_args(batch: Any) -> tuple:
    return batch.dense_features, batch.sparse_features
