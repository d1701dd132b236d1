"""What a rank actually holds after sharding: bytes of embedding weights and optimizer state.

Used to check the planner's estimates against a real ``DistributedModelParallel`` model
(``plan_vs_measured.json`` of a run, ``benchmarks/bench_plan_memory.py``).

Example:
    >>> held = measure_embedding_bytes(dmp)
    >>> held["weights"], held["optimizer"]
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from embedtrain.sharding.report_types import PlanReport

TABLE_KEY = "embedding_bags"  # what TorchRec's sharded modules put in their tables' names


def _local_bytes(value: Any) -> int:
    if isinstance(value, ShardedTensor):
        return sum(s.tensor.numel() * s.tensor.element_size() for s in value.local_shards())
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return 0


def measure_embedding_bytes(model: nn.Module) -> dict[str, int]:
    """This rank's bytes of embedding weights and fused embedding optimizer state.

    Args:
        model: a ``DistributedModelParallel`` model.

    Returns:
        ``{"weights": ..., "optimizer": ...}`` in bytes. Data-parallel tables count in full
        (replicated); their optimizer state belongs to the dense optimizer and appears lazily at
        its first step, so it is not in ``optimizer``.
    """
    weights = sum(_local_bytes(v) for k, v in model.state_dict().items() if TABLE_KEY in k)
    optimizer = 0
    fused = getattr(model, "fused_optimizer", None)
    if fused is not None:
        for state in fused.state_dict()["state"].values():
            optimizer += sum(_local_bytes(v) for v in state.values())
    return {"weights": weights, "optimizer": optimizer}


def measure_head_bytes(head: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                       held: dict[str, int]) -> dict[str, int]:
    """``held`` plus this rank's slice of a model-parallel class head and its optimizer state."""
    weights = sum(_local_bytes(p) for p in head.parameters())
    state = 0
    if optimizer is not None:
        inner = getattr(optimizer, "_optimizer", optimizer)  # the torch optimizer's own tensors
        for param_state in inner.state.values():
            state += sum(_local_bytes(v) for v in param_state.values() if v.dim() > 0)
    return {"weights": held["weights"] + weights, "optimizer": held["optimizer"] + state}


def plan_vs_measured(report: PlanReport, measured: list[dict[str, int]]) -> dict[str, Any]:
    """Per rank: the plan's estimated embedding weights + optimizer bytes against ``measured``.

    The estimate of data-parallel tables' optimizer state (the dense optimizer's, created at its
    first step) is left out of the comparison and reported on its own.

    Args:
        report: the plan the model was sharded with.
        measured: per rank, :func:`measure_embedding_bytes` (or :func:`measure_head_bytes`).

    Returns:
        ``plan_vs_measured.json``'s content: per rank the estimated and measured bytes and their
        ratio, the largest deviation from 1, and the data-parallel optimizer bytes left out.
    """
    tier = report.memory_tier
    replicated_opt = sum(t.optimizer_bytes for t in report.tables
                         if t.sharding_type == "data_parallel")
    ranks = []
    for rank, held in enumerate(measured):
        est = report.ranks[rank].memory[tier]
        weights = est.get("embedding_params")
        optimizer = est.get("embedding_optimizer") - replicated_opt
        estimated = weights + optimizer
        total = held["weights"] + held["optimizer"]
        ranks.append({"rank": rank, "estimated_bytes": estimated, "measured_bytes": total,
                      "estimated_weights": weights,
                      "measured_weights": held["weights"],
                      "estimated_optimizer": optimizer,
                      "measured_optimizer": held["optimizer"],
                      "ratio": estimated / total if total else None})
    deviations = [abs(r["ratio"] - 1) for r in ranks if r["ratio"] is not None]
    return {"ranks": ranks, "max_abs_deviation": max(deviations, default=0.0),
            "data_parallel_optimizer_bytes_not_compared": replicated_opt}
