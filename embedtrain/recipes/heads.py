"""A class head as a recipe's part: what the classification families (XC over its classes, seq
over its items) build, plan, reserve, describe and export of the ``head`` section's head.

The sharded heads (``full``, ``partial_fc``, ``hard_negatives``) hold a slice of the classes on
each rank, outside TorchRec: the planner sees them as a row-wise table ``class_head`` (its memory
per rank exact), DDP leaves them alone, and their optimizer joins the combined one as ``head``.
Their collectives get their own process group, so they never interleave with DDP's bucket
all-reduces or the tables' all-to-alls on the default one. ``adaptive`` and ``mach`` are
replicated dense heads, all-reduced with the encoder.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from embedtrain.config import (
    ClusterConfig,
    HeadConfig,
    HeadKind,
    Margin,
    NegativeIndex,
    ShardingType,
    TableConstraint,
)
from embedtrain.heads.build import HEAD_TABLE, SHARDED_HEADS, build_head
from embedtrain.recipes.base import ModelParts
from embedtrain.recipes.export_parts import HeadExport
from embedtrain.sharding.planner import PlanResult
from embedtrain.train.optim import head_optimizer_class, sharded_head_optimizer



def head_arguments(h: HeadConfig) -> dict[str, Any]:
    """``build_head``'s keyword arguments from the ``head`` section: all its keys but the head's
    kind, the top-k and the optimizer's; ``sample_correction`` where it applies
    (:attr:`~embedtrain.config.HeadConfig.corrects_sample`)."""
    args = {k: v for k, v in vars(h).items() if k not in ("kind", "top_k", "optimizer", "lr")}
    return {**args, "sample_correction": h.corrects_sample}


class ClassHeads:
    """The head ``h`` over ``num_classes`` classes of width ``dim`` (the encoder's features)."""

    def __init__(self, h: HeadConfig, num_classes: Callable[[], int], dim: int) -> None:
        self.h, self._num_classes, self.dim = h, num_classes, dim
        self.built: Optional[nn.Module] = None  # the training head, once built

    @property
    def num_classes(self) -> int:
        return self._num_classes()

    @property
    def sharded(self) -> bool:
        """Whether the head is model-parallel (each rank a slice of the classes)."""
        return self.h.kind in SHARDED_HEADS

    def check(self) -> None:
        """One line (rank 0) where ``head.sample_correction`` is ignored: only partial_fc with
        softmax samples classes. The keys that cannot go together are refused when the config
        loads (``HeadConfig.__post_init__``)."""
        h = self.h
        if h.sample_correction and not h.corrects_sample and os.environ.get("RANK", "0") == "0":
            print(f"head.sample_correction: ignored: only partial_fc with loss softmax samples "
                  f"classes (this head: {h.kind.value}, loss {h.loss.value})", file=sys.stderr)

    def build(self, **kwargs: Any) -> nn.Module:
        return build_head(self.h.kind, self.num_classes, self.dim, **head_arguments(self.h),
                          **kwargs)

    def planning_model(self, model_of: Callable[[Optional[nn.Module]], nn.Module]) -> nn.Module:
        """``model_of(head)`` as the planner sees it: a sharded head stands in as the row-wise
        table ``class_head`` carrying the head's optimizer (its memory per rank as the head
        splits it); a replicated head is there as itself (dense parameters)."""
        if not self.sharded:
            with torch.device("meta"):
                return model_of(self.build())
        model = model_of(None)
        apply_optimizer_in_backward(head_optimizer_class(self.h.optimizer),
                                    model.head.parameters(), {"lr": self.h.lr})
        return model

    def model_parts(self, model_of: Callable[[Optional[nn.Module]], nn.Module],
                    device: torch.device, class_counts: Callable[[], torch.Tensor],
                    seed: int) -> ModelParts:
        """Encoder on ``meta`` and the head: a sharded one as this rank's slice (its collectives
        on a process group of their own) with its optimizer, a replicated one on ``device``."""
        h = self.h
        counts = class_counts() if h.kind is HeadKind.ADAPTIVE or h.corrects_sample else None
        group = dist.new_group(list(range(dist.get_world_size()))) if self.sharded else None
        head = self.built = self.build(group=group, class_counts=counts, seed=seed)
        if not self.sharded:
            return ModelParts(model_of(head.to(device)),
                              planning_model=self.planning_model(model_of))
        model = model_of(head)
        return ModelParts(model, planning_model=self.planning_model(model_of), sharded_head=head,
                          head_optimizer=sharded_head_optimizer(head, h.optimizer, h.lr,
                                                                prefix="head."))

    def summary_extra(self) -> dict[str, Any]:
        """A clustered hard-negative index's recall at each rebuild (``index_recall``: the
        head's own list, which it extends as training goes)."""
        if getattr(self.built, "index_kind", None) is NegativeIndex.CLUSTERED:
            return {"index_recall": self.built.index_recall}
        return {}

    def summary_lines(self, summary: dict[str, Any]) -> list[str]:
        """The clustered index's recall over its rebuilds."""
        recalls = [r["recall"] for r in summary.get("index_recall") or []]
        if not recalls:
            return []
        k = self.h.hard_negatives
        return [f"  index recall@{k} {recalls[-1]:.4f} at the last of {len(recalls)} rebuilds "
                f"(min {min(recalls):.4f}; exact top-{k} on 256 examples)"]

    def planning_constraints(self, given: list[TableConstraint]) -> list[TableConstraint]:
        """A sharded class head is split row-wise (as the sharded heads split it)."""
        if not self.sharded or any(HEAD_TABLE in c.tables for c in given):
            return []
        return [TableConstraint(tables=[HEAD_TABLE], sharding_types=[ShardingType.ROW_WISE])]

    def reservations(self, cluster: ClusterConfig, rows_per_example: int = 1) -> dict[str, int]:
        """Per-rank memory of a sharded class head's logits in a training step.

        Every rank scores the *global* batch (``batch_size_per_rank x ranks`` gathered features,
        ``rows_per_example`` each) against its slice, or against the slice's sample: the
        logits and the softmax kept for the backward pass (one more copy with a margin) are
        ``B x columns`` floats each.
        """
        h = self.h
        if not self.sharded:
            return {}
        batch = cluster.batch_size_per_rank * cluster.world_size
        local = -(-self.num_classes // cluster.world_size)
        if h.kind is HeadKind.FULL:
            columns = local
        elif h.kind is HeadKind.PARTIAL_FC:  # 0: the slice's share of the batch's positives
            columns = max(round(h.sample_rate * local),
                          1 if h.sample_rate else
                          min(local, -(-batch * rows_per_example // cluster.world_size)))
        else:  # positives + nearest classes + uniform sample, at most the slice
            columns = min(local, batch * (1 + h.hard_negatives) + round(h.sample_rate * local))
        copies = 3 if h.margin is not Margin.NONE else 2
        return {"class_head_logits": batch * columns * 4 * copies * rows_per_example}

    def describe_plan(self, result: PlanResult) -> None:
        """Notes the class head in the report: its size, and that its compute is not estimated."""
        report = result.report
        h, c, d = self.h, self.num_classes, self.dim
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
        kind = self.h.kind
        if kind in SHARDED_HEADS:
            return None
        return (f"head.kind: {kind.value}: export writes the sharded heads' weights (full, "
                f"partial_fc, hard_negatives); a {kind.value} head scores classes with its own "
                f"structure, which is not exported")

    def export(self, top_k: list[int], vocab: Optional[str]) -> HeadExport:
        """The sharded class head as ``embedtrain export`` writes it (``vocab``: the classes'
        vocabulary file, if ingested)."""
        h = self.h
        normalised = h.margin is not Margin.NONE
        return HeadExport(h.kind.value, "model.head.weight", self.num_classes, self.dim,
                          normalised, h.scale if normalised else 1.0, list(top_k), vocab)
