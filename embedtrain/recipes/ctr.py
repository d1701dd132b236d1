"""Click-through rate: DLRM or DCNv2 on a tabular data set (``datagen ctr``, ``ingest``).

The table sizes come from the data set (:mod:`~embedtrain.recipes.tabular`); the loss is binary
cross-entropy on the model's logit; AUC, NE, log loss and calibration are reported.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from embedtrain.config import Interaction
from embedtrain.models.dlrm import dcn, dlrm
from embedtrain.recipes.base import Oracle, oracle_of
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


def _dlrm_args(batch: Any) -> tuple:
    return batch.dense_features, batch.sparse_features
