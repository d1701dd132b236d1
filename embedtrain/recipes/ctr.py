"""Click-through rate: DLRM or DCNv2 on a tabular data set (``datagen ctr``, ``ingest``).

The table sizes come from the data set (:mod:`~embedtrain.recipes.tabular`); the loss is binary
cross-entropy on the model's logit; AUC, NE, log loss and calibration are reported. An export's
dense program is the model after its sparse arch: ``(dense, pooled [B, tables, D]) -> logit``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from embedtrain.components import Component, build
from embedtrain.config import ConfigError, Interaction
from embedtrain.models.dlrm import ctr_model, embedding_penalty
from embedtrain.models.options import DynamicTable
from embedtrain.recipes.base import Oracle, Recipe, oracle_of
from embedtrain.recipes.export_parts import DenseExport, ExportParts
from embedtrain.recipes.tabular import TabularData
from embedtrain.train.ctr import CTRTask
from embedtrain.train.optim import fuse_sparse_optimizer


class CTRRecipe(Recipe):
    """``task: ctr``: DLRM (``model.interaction: dot``) or DCNv2 (``dcn``), binary cross-entropy."""

    oracle = Oracle("oracle_auc", "auc", "AUC of the true click probability")
    printed_metrics = ("auc", "ne", "logloss", "calibration")

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.data = TabularData(cfg)

    def feature_dynamic_tables(self) -> dict[str, DynamicTable]:
        """The ``tables`` entries' dynamic tables among the features' (``t_<feature>``)."""
        return self.data.dynamic_tables(self.dataset)

    def planning_model(self) -> nn.Module:
        """``model``'s DLRM (``interaction: dot``) or DCNv2 (``dcn``) on ``meta``, tables fused;
        or the model ``model: {_component_: ...}`` names, built with the data set's
        ``features``, ``device`` (``meta``) and its own keys: ``(dense, KeyedJaggedTensor) ->
        logit``, its tables TorchRec modules (:func:`embedtrain.models.dlrm.
        embedding_bag_collection` makes the data set's)."""
        m, features = self.cfg.model, self.dataset.features
        if isinstance(m, Component):
            if self.feature_dynamic_tables():
                raise ConfigError("tables: dynamic tables are built by the built-in CTR model; "
                                  f"model: {m.path} builds its own tables")
            return self.fuse_sparse(build(m, "model", features=features,
                                          device=torch.device("meta")))
        model = ctr_model(features, m.interaction, m.embedding_dim, m.bottom_mlp, m.top_mlp,
                          m.dcn_num_layers, m.dcn_low_rank_dim, torch.device("meta"), m.dropout,
                          self.feature_dynamic_tables(), self.linear,
                          self.cfg.optim.embedding_l2)
        if model.linear_arch is None:
            return self.fuse_sparse(model)
        o = self.cfg.optim
        fuse_sparse_optimizer(model.sparse_arch, o.sparse, o.sparse_lr)
        fuse_sparse_optimizer(model.linear_arch, o.sparse, self.linear_lr)
        return model

    @property
    def linear_lr(self) -> float:
        """The first-order tables' learning rate: ``optim.linear_lr``, unset: a tenth of
        ``optim.sparse_lr``. An adaptive optimizer's first step of an id is about its learning
        rate whatever the gradient, and a first-order weight reaches the logit directly (no MLP
        learns to discount a noise feature's): at ``sparse_lr`` the rare ids of noise features
        add that much noise to every logit (``benchmarks/RESULTS.md``, "CTR model terms")."""
        o = self.cfg.optim
        return o.linear_lr if o.linear_lr is not None else o.sparse_lr / 10

    @property
    def linear(self) -> bool:
        """Whether the model has the first-order term (``model.linear``; unset: with ``fm``)."""
        m = self.cfg.model
        if isinstance(m, Component):
            return False  # a model of one's own has the terms it builds
        return m.linear if m.linear is not None else m.interaction is Interaction.FM

    def export_refusal(self) -> Optional[str]:
        """A model given by import path exports when it says what follows its tables'
        lookups: ``forward_pooled(dense [B, n_dense], pooled [B, tables, D]) -> logit [B]``
        (its tables in their order), which export writes as the dense program."""
        m = self.cfg.model
        if isinstance(m, Component) and not callable(
                getattr(type(self.planning_model()), "forward_pooled", None)):
            return (f"model: {m.path}: has no forward_pooled(dense, pooled) (the model after its "
                    "tables' lookups), which export writes as the dense program")
        return super().export_refusal()

    def task(self) -> CTRTask:
        """Binary cross-entropy (plus the model's embedding penalty); AUC, NE, log loss,
        calibration."""
        return CTRTask(penalty=embedding_penalty)

    def task_supplies(self) -> dict[str, Any]:
        """``penalty``: the model's embedding penalty (``optim.embedding_l2``)."""
        return {"penalty": embedding_penalty}

    def summary_extra(self) -> dict[str, Any]:
        """The data set's oracle AUC on the test split, if it has one (synthetic data)."""
        return oracle_of(self.dataset.extra, "oracle_auc")

    def batch_args(self) -> Callable[[Any], tuple]:
        """TorchRec's DLRM takes ``(dense_features, sparse_features)`` (train.pipeline)."""
        return _dlrm_args

    def export_parts(self, model: nn.Module, tables: Sequence[tuple[str, int, int]]
                     ) -> ExportParts:
        """The data set's features and the dense program, the model after its tables
        (``(dense [B, n_dense], pooled [B, tables, D]) -> logit [B]``): DLRM / DCNv2's bottom
        MLP, interaction and top MLP (:class:`DLRMDense`), or a model of one's own's
        ``forward_pooled`` (:class:`AfterLookup`)."""
        meta = self.dataset
        n = len(tables) - self._linear_tables(tables)
        n_dense, dim = len(meta.features.dense), tables[0][2]  # the model's, not a config key
        example = (torch.randn(4, n_dense), torch.randn(4, n, dim))
        inputs = [f"dense: float32 [B, {n_dense}] (features.dense, in order)",
                  f"pooled: float32 [B, {n}, {dim}] (the pooled embeddings of the first {n} "
                  f"tables, in the order of tables)"]
        if n < len(tables):
            example += (torch.randn(4, len(tables) - n),)
            inputs.append(f"linear: float32 [B, {len(tables) - n}] (column 0 of the pooled "
                          f"first-order tables l_*, the last {len(tables) - n} of tables)")
        own = isinstance(self.cfg.model, Component)
        module = AfterLookup(model) if own else DLRMDense(model)
        score = getattr(self.make_task(), "score", "sigmoid")
        dense = DenseExport(module, "model.", example, inputs, "logit: float32 [B] (" + (
            "click probability = sigmoid(logit))" if score == "sigmoid" else "the prediction)"))
        name = type(model).__name__  # a model of one's own: its class
        if not own:
            name = self.cfg.model.interaction.value
            name = {"dot": "dlrm", "fm": "deepfm"}.get(name, name)
        return ExportParts(name, meta.features, meta.extra, dense, score=score)

    @staticmethod
    def _linear_tables(tables: Sequence[tuple[str, int, int]]) -> int:
        """How many of ``tables`` (the model's order: the first-order ones last) are first-order
        tables."""
        return sum(1 for name, _, _ in tables if name.startswith("l_"))

    def predict_pooled(self, pooled: list[torch.Tensor]) -> torch.Tensor | tuple:
        """Stacked: ``[B, tables, D]``; with first-order tables (``dim`` 4, listed last), the
        tuple of that and their weights ``[B, F]`` (column 0 of each)."""
        n = len(self.dataset.features.sparse)
        if len(pooled) == n or not self.linear:
            return torch.stack(pooled, dim=1)
        return torch.stack(pooled[:n], dim=1), torch.stack([p[:, 0] for p in pooled[n:]], dim=1)


class DLRMDense(nn.Module):
    """DLRM / DCNv2 / DeepFM without its tables: ``(dense [B, n_dense], pooled [B, F, D][,
    linear [B, F]]) -> logit [B]`` (:class:`~embedtrain.models.dlrm.CTRModel`'s forward after
    the lookups; ``linear``: the first-order weights, summed into the logit)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.dense_arch, self.inter_arch, self.over_arch = (model.dense_arch, model.inter_arch,
                                                            model.over_arch)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor,
                linear: Optional[torch.Tensor] = None) -> torch.Tensor:
        features = self.inter_arch(dense_features=self.dense_arch(dense), sparse_features=pooled)
        logit = self.over_arch(features).squeeze(-1)
        return logit if linear is None else logit + linear.sum(dim=1)


class AfterLookup(nn.Module):
    """A model of one's own without its tables: its ``forward_pooled(dense, pooled)`` over its
    other layers (on CPU, filled from the checkpoint) and plain attributes (feature names,
    sizes), the tables' modules left out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        for name, value in vars(model).items():
            if not name.startswith("_") and name != "training":
                setattr(self, name, value)
        for name, child in model.named_children():
            if any(isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
                   for m in child.modules()):
                continue
            meta = any(t.is_meta for t in [*child.parameters(), *child.buffers()])
            setattr(self, name, child.to_empty(device="cpu") if meta else child)
        self._pooled = type(model).forward_pooled

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self._pooled(self, dense, pooled)


def _dlrm_args(batch: Any) -> tuple:
    return batch.dense_features, batch.sparse_features
