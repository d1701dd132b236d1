"""Extreme classification: token bags → MLP → a class head of C classes (``datagen xc`` data).

The head is a :class:`~embedtrain.recipes.heads.ClassHeads` (the ``head`` section: sharded
or replicated, its optimizer, plan, reservations and export), the data a
:class:`~embedtrain.recipes.tabular.TabularData`.

An export holds the encoder's MLP as the dense program (``(dense, pooled [B, sum of dims]) ->
features``) and a sharded head's weights; the replicated heads score classes with their own
structure and are not exported.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
from torch import nn

from embedtrain.config import HeadKind
from embedtrain.data.stats import class_counts
from embedtrain.models.xc import XCModel
from embedtrain.recipes.base import Oracle, Recipe, oracle_of
from embedtrain.recipes.export_parts import DenseExport, ExportParts
from embedtrain.recipes.heads import ClassHeads
from embedtrain.recipes.tabular import TabularData
from embedtrain.train.xc import XCTask
from embedtrain.train.xc_metrics import inverse_propensity


class XCRecipe(Recipe):
    """``task: xc``: the ``xc`` section's encoder and head, top-k metrics over all classes."""

    oracle = Oracle("oracle_p_at_1", "p@1", "P@1 of the Bayes-optimal classifier")

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.data = TabularData(cfg)
        self.heads = ClassHeads(cfg.head, lambda: self.dataset.features.num_classes,
                                cfg.xc.mlp[-1])

    @functools.cached_property
    def class_counts(self) -> torch.Tensor:
        """The train split's label count of every class (read once: the adaptive head's class
        order and PSP@k's propensities)."""
        return torch.from_numpy(class_counts(self.dataset))

    def load_dataset(self):
        """The data set's metadata, checked to be a classification one fit for the head."""
        meta = self.data.load()
        where = meta.root / "metadata.json"
        if meta.features.num_classes is None:
            raise ValueError(f"{where}: task xc needs a classification data set "
                             f"(num_classes missing; generate one with: embedtrain datagen xc)")
        if self.cfg.head.kind is HeadKind.ADAPTIVE and meta.features.max_labels > 1:
            raise ValueError(f"head.kind: adaptive takes one label per example, but "
                             f"{where} allows {meta.features.max_labels}")
        self.heads.check()
        return meta

    def head_model(self, head: Optional[nn.Module]) -> XCModel:
        """The ``xc`` encoder on ``meta`` around ``head`` (None: the planner's table)."""
        x = self.cfg.xc
        model = XCModel(self.dataset.features, x.embedding_dim, x.pooling, x.mlp, head,
                        device=torch.device("meta"), dropout=x.dropout,
                        dynamic=self.data.dynamic_tables(self.dataset),
                        head_dtype=self.cfg.head.dtype)
        self.fuse_sparse(model.encoder)
        return model

    def task(self) -> XCTask:
        """The head's loss; P@k, nDCG@k, recall@k and PSP@k (propensities from the train
        split's class counts, ``xc.propensity_a`` / ``_b``) for ``head.top_k`` over all classes."""
        x = self.cfg.xc
        inv_p = inverse_propensity(self.class_counts, self.dataset.split_rows["train"], x.propensity_a,
                                   x.propensity_b)
        return XCTask(self.cfg.head.top_k, inv_p)

    def summary_extra(self) -> dict[str, Any]:
        """The data set's Bayes-optimal P@1 on the test split, if it has one (synthetic data)."""
        return oracle_of(self.dataset.extra, "oracle_p_at_1")

    def export_parts(self, model: nn.Module, tables: Sequence[tuple[str, int, int]]
                     ) -> ExportParts:
        """The data set's features, the encoder's MLP (:class:`XCDense`) and the class head."""
        meta = self.dataset
        spec = meta.features
        encoder = model.encoder
        width = sum(dim for _, _, dim in tables)
        example = (torch.randn(4, len(spec.dense)), torch.randn(4, width))
        inputs = [f"dense: float32 [B, {len(spec.dense)}] (features.dense, in order)",
                  f"pooled: float32 [B, {width}] (the tables' pooled embeddings, concatenated "
                  f"in the order of tables)"]
        dense = DenseExport(XCDense(encoder.mlp.to_empty(device="cpu"), bool(spec.dense)),
                            "model.encoder.", example, inputs,
                            f"features: float32 [B, {encoder.dim}] (class scores: features @ "
                            f"head.weight.T)")
        head = self.heads.export(self.cfg.head.top_k,
                                 (meta.extra.get("vocab_files") or {}).get(spec.label))
        return ExportParts("xc", spec, meta.extra, dense, head)

    def predict_pooled(self, pooled: list[torch.Tensor]) -> torch.Tensor:
        """Concatenated: ``[B, sum of dims]``."""
        return torch.cat(pooled, dim=1)


class XCDense(nn.Module):
    """The XC encoder's MLP: ``(dense [B, n_dense], pooled [B, sum of dims]) -> [B, D]``."""

    def __init__(self, mlp: nn.Module, has_dense: bool) -> None:
        super().__init__()
        self.mlp, self.has_dense = mlp, has_dense

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([pooled, dense], dim=1) if self.has_dense else pooled)
