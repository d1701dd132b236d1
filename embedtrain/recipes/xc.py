"""Extreme classification: token bags → MLP → a class head of C classes (``datagen xc`` data).

The sharded heads (``full``, ``partial_fc``, ``hard_negatives``) hold a slice of the classes on
each rank, outside TorchRec: the planner sees them as a row-wise table ``class_head`` (its memory
per rank exact), DDP leaves them alone, and their optimizer joins the combined one as ``head``.
Their collectives get their own process group, so they never interleave with DDP's bucket
all-reduces or the tables' all-to-alls on the default one. ``adaptive`` and ``mach`` are
replicated dense heads, all-reduced with the MLP.

An export holds the encoder's MLP as the dense program (``(dense, pooled [B, sum of dims]) ->
features``) and a sharded head's weights; the replicated heads score classes with their own
structure and are not exported.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from embedtrain.config import (
    ClusterConfig,
    HeadConfig,
    HeadDtype,
    HeadKind,
    HeadOptimizer,
    Margin,
    NegativeIndex,
    ShardingType,
    TableConstraint,
)
from embedtrain.data.stats import class_counts
from embedtrain.models.xc import HEAD_TABLE, SHARDED_HEADS, XCModel, build_head
from embedtrain.recipes.base import ModelParts, Oracle, oracle_of
from embedtrain.recipes.export_parts import DenseExport, ExportParts, HeadExport
from embedtrain.recipes.tabular import TabularRecipe
from embedtrain.sharding.planner import PlanResult
from embedtrain.train.optim import head_optimizer_class, sharded_head_optimizer
from embedtrain.train.xc import XCTask
from embedtrain.train.xc_metrics import inverse_propensity


def head_arguments(h: HeadConfig) -> dict[str, Any]:
    """``build_head``'s keyword arguments from the ``xc.head`` section."""
    return dict(sample_rate=h.sample_rate, hard_negatives=h.hard_negatives,
                refresh_every=h.refresh_every, margin=h.margin, margin_value=h.margin_value,
                scale=h.scale, cutoffs=h.cutoffs, div_value=h.div_value,
                mach_buckets=h.mach_buckets, mach_repetitions=h.mach_repetitions, loss=h.loss,
                index=h.index, index_clusters=h.index_clusters, index_probe=h.index_probe,
                dtype=h.dtype, rounding=h.rounding, sample_correction=h.sample_correction)


# head optimizers with one float32 a row, that low-precision rows can be rounded back by
ROW_STATE_OPTIMIZERS = (HeadOptimizer.ROWWISE_ADAGRAD, HeadOptimizer.FACTORED_ADAGRAD)


class XCRecipe(TabularRecipe):
    """``task: xc``: the ``xc`` section's encoder and head, top-k metrics over all classes."""

    oracle = Oracle("oracle_p_at_1", "p@1", "P@1 of the Bayes-optimal classifier")

    @property
    def sharded(self) -> bool:
        """Whether the head is model-parallel (each rank a slice of the classes)."""
        return self.cfg.xc.head.kind in SHARDED_HEADS

    @property
    def feature_dim(self) -> int:
        """The encoder's feature dimension D: the head's width."""
        return self.cfg.xc.mlp[-1]

    @functools.cached_property
    def class_counts(self) -> torch.Tensor:
        """The train split's label count of every class (read once: the adaptive head's class
        order and PSP@k's propensities)."""
        return torch.from_numpy(class_counts(self.dataset))

    def load_dataset(self):
        """The data set's metadata, checked to be a classification one fit for the head."""
        meta = super().load_dataset()
        where = meta.root / "metadata.json"
        if meta.features.num_classes is None:
            raise ValueError(f"{where}: task xc needs a classification data set "
                             f"(num_classes missing; generate one with: embedtrain datagen xc)")
        if self.cfg.xc.head.kind is HeadKind.ADAPTIVE and meta.features.max_labels > 1:
            raise ValueError(f"xc.head.kind: adaptive takes one label per example, but "
                             f"{where} allows {meta.features.max_labels}")
        h = self.cfg.xc.head
        if h.dtype is not HeadDtype.FP32 and h.optimizer not in ROW_STATE_OPTIMIZERS:
            raise ValueError(f"xc.head.dtype: {h.dtype.value} needs xc.head.optimizer: "
                             f"rowwise_adagrad or factored_adagrad, not {h.optimizer.value} "
                             f"(they keep one float32 a row and round the updated rows back; "
                             f"adagrad's state would be a float32 copy of the head)")
        return meta

    def _model(self, head: Optional[nn.Module]) -> XCModel:
        x = self.cfg.xc
        model = XCModel(self.dataset.features, x.embedding_dim, x.pooling, x.mlp, head,
                        device=torch.device("meta"), dropout=x.dropout,
                        dynamic=self.feature_dynamic_tables(), head_dtype=x.head.dtype)
        self.fuse_sparse(model.encoder)
        return model

    def _head(self, **kwargs: Any) -> nn.Module:
        h = self.cfg.xc.head
        return build_head(h.kind, self.dataset.features.num_classes, self.feature_dim,
                          **head_arguments(h), **kwargs)

    def planning_model(self) -> nn.Module:
        """A sharded head stands in as the row-wise table ``class_head`` carrying the head's
        optimizer (its memory per rank as the head splits it); a replicated head is there as
        itself (dense parameters, as the planner counts them)."""
        if not self.sharded:
            with torch.device("meta"):
                return self._model(self._head())
        model = self._model(None)
        h = self.cfg.xc.head
        apply_optimizer_in_backward(head_optimizer_class(h.optimizer), model.head.parameters(),
                                    {"lr": h.lr})
        return model

    def model_parts(self, device: torch.device) -> ModelParts:
        """Encoder on ``meta`` and the head: a sharded one as this rank's slice (its collectives
        on a process group of their own) with its optimizer, a replicated one on ``device``."""
        h = self.cfg.xc.head
        counts = self.class_counts if h.kind is HeadKind.ADAPTIVE or h.sample_correction else None
        group = dist.new_group(list(range(dist.get_world_size()))) if self.sharded else None
        head = self._head(group=group, class_counts=counts, seed=self.cfg.train.seed)
        self._built_head = head
        if not self.sharded:
            return ModelParts(self._model(head.to(device)), planning_model=self.planning_model())
        model = self._model(head)
        return ModelParts(model, planning_model=self.planning_model(), sharded_head=head,
                          head_optimizer=sharded_head_optimizer(head, h.optimizer, h.lr,
                                                                prefix="head."))

    def task(self) -> XCTask:
        """The head's loss; P@k, nDCG@k, recall@k and PSP@k (propensities from the train
        split's class counts, ``xc.propensity_a`` / ``_b``) for ``xc.top_k`` over all classes."""
        x = self.cfg.xc
        inv_p = inverse_propensity(self.class_counts, self.dataset.split_rows["train"], x.propensity_a,
                                   x.propensity_b)
        return XCTask(x.top_k, inv_p)

    def summary_extra(self) -> dict[str, Any]:
        """The data set's Bayes-optimal P@1 on the test split, if it has one (synthetic data),
        and a clustered hard-negative index's recall at each rebuild (``index_recall``: the
        head's own list, which it extends as training goes)."""
        extra = oracle_of(self.dataset.extra, "oracle_p_at_1")
        head = getattr(self, "_built_head", None)
        if getattr(head, "index_kind", None) is NegativeIndex.CLUSTERED:
            extra["index_recall"] = head.index_recall
        return extra

    def summary_lines(self, summary: dict[str, Any]) -> list[str]:
        """The metrics, then the clustered index's recall over its rebuilds."""
        lines = super().summary_lines(summary)
        recalls = [r["recall"] for r in summary.get("index_recall") or []]
        if recalls:
            k = self.cfg.xc.head.hard_negatives
            lines.append(f"  index recall@{k} {recalls[-1]:.4f} at the last of {len(recalls)} "
                         f"rebuilds (min {min(recalls):.4f}; exact top-{k} on 256 examples)")
        return lines

    def planning_constraints(self) -> list[TableConstraint]:
        """A sharded class head is split row-wise (as the sharded heads split it)."""
        if not self.sharded or any(HEAD_TABLE in c.tables for c in self.cfg.sharding.tables):
            return []
        return [TableConstraint(tables=[HEAD_TABLE], sharding_types=[ShardingType.ROW_WISE])]

    def extra_reservations(self, cluster: ClusterConfig) -> dict[str, int]:
        """Per-rank memory of a sharded class head's logits in a training step.

        Every rank scores the *global* batch (``batch_size_per_rank x ranks`` gathered features)
        against its slice, or against the slice's sample: the logits and the softmax kept for
        the backward pass (one more copy with a margin) are ``B x columns`` floats each.
        """
        h = self.cfg.xc.head
        if not self.sharded:
            return {}
        batch = cluster.batch_size_per_rank * cluster.world_size
        local = -(-self.dataset.features.num_classes // cluster.world_size)
        if h.kind is HeadKind.FULL:
            columns = local
        elif h.kind is HeadKind.PARTIAL_FC:
            columns = max(round(h.sample_rate * local), 1)
        else:  # positives + nearest classes + uniform sample, at most the slice
            columns = min(local, batch * (1 + h.hard_negatives) + round(h.sample_rate * local))
        copies = 3 if h.margin is not Margin.NONE else 2
        return {"class_head_logits": batch * columns * 4 * copies}

    def describe_plan(self, result: PlanResult) -> None:
        """Notes the class head in the report: its size, and that its compute is not estimated."""
        report = result.report
        h, c, d = self.cfg.xc.head, self.dataset.features.num_classes, self.feature_dim
        info = {"kind": h.kind.value, "num_classes": c, "dim": d, "optimizer": h.optimizer.value}
        if self.sharded:
            entry = report.table(HEAD_TABLE)
            info["table"] = HEAD_TABLE
            report.warnings.append(
                f"class head {HEAD_TABLE} ({c:,} classes x {d}, {h.kind.value}) is planned as a "
                f"row-wise table: its memory per rank is exact, its time is not (the head's "
                f"matmul over its slice, about 6 x batch x {c:,} / ranks x {d} flops a step, is "
                f"not estimated); {entry.sharding_type} over {len(entry.shards)} shard(s)")
        else:
            info["table"] = None
            report.warnings.append(
                f"class head ({h.kind.value}, {c:,} classes) is replicated on every rank (dense "
                f"parameters, all-reduced with the MLP)")
        report.model["class_head"] = info

    def export_refusal(self) -> Optional[str]:
        """A replicated head (``adaptive``, ``mach``): its structure is not exported."""
        kind = self.cfg.xc.head.kind
        if kind in SHARDED_HEADS:
            return None
        return (f"xc.head.kind: {kind.value}: export writes the sharded heads' weights (full, "
                f"partial_fc, hard_negatives); a {kind.value} head scores classes with its own "
                f"structure, which is not exported")

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
        return ExportParts("xc", spec, meta.extra, dense, self.head_export())

    def head_export(self) -> HeadExport:
        """The sharded class head as ``embedtrain export`` writes it."""
        spec, h = self.dataset.features, self.cfg.xc.head
        normalised = h.margin is not Margin.NONE
        return HeadExport(h.kind.value, "model.head.weight", spec.num_classes, self.feature_dim,
                          normalised, h.scale if normalised else 1.0, list(self.cfg.xc.top_k),
                          (self.dataset.extra.get("vocab_files") or {}).get(spec.label))

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
