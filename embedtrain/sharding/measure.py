"""What a rank actually holds after sharding: bytes of embedding weights and optimizer state.

Used to check the planner's estimates against a real ``DistributedModelParallel`` model
(``plan_vs_measured.json`` of a run, ``benchmarks/bench_plan_memory.py``).

Example:
    >>> held = measure_embedding_bytes(dmp, data_parallel_tables={"t_C1"})
    >>> held["weights"], held["optimizer"]
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

TABLE_KEY = "embedding_bags"  # what TorchRec's sharded modules put in their tables' names


def _local_bytes(value: Any) -> int:
    if isinstance(value, ShardedTensor):
        return sum(s.tensor.numel() * s.tensor.element_size() for s in value.local_shards())
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return 0


def measure_embedding_bytes(model: nn.Module, data_parallel_tables: Iterable[str] = ()) -> dict[str, int]:
    """This rank's bytes of embedding weights and embedding optimizer state.

    Args:
        model: a ``DistributedModelParallel`` model.
        data_parallel_tables: names of the tables sharded ``data_parallel`` (replicated: counted in
            full; their optimizer runs in backward, outside the fused optimizer).

    Returns:
        ``{"weights": ..., "optimizer": ...}`` in bytes.
    """
    weights = sum(_local_bytes(v) for k, v in model.state_dict().items() if TABLE_KEY in k)
    optimizer = 0
    fused = getattr(model, "fused_optimizer", None)
    if fused is not None:
        for state in fused.state_dict()["state"].values():
            optimizer += sum(_local_bytes(v) for v in state.values())
    replicated = set(data_parallel_tables)
    for name, param in model.named_parameters():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in replicated:
            for opt in getattr(param, "_in_backward_optimizers", []):
                optimizer += sum(_local_bytes(v) for st in opt.state.values() for v in st.values()
                                 if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"weights": weights, "optimizer": optimizer}


def plan_vs_measured(report: dict[str, Any], measured: list[dict[str, int]]) -> dict[str, Any]:
    """Per rank: the plan's estimated embedding weights + optimizer bytes against ``measured``."""
    tier = report["summary"]["memory_tier"]
    ranks = []
    for rank, held in enumerate(measured):
        est = report["ranks"][rank]["memory"][tier]
        estimated = est["embedding_params"] + est["embedding_optimizer"]
        total = held["weights"] + held["optimizer"]
        ranks.append({"rank": rank, "estimated_bytes": estimated, "measured_bytes": total,
                      "estimated_weights": est["embedding_params"],
                      "measured_weights": held["weights"],
                      "estimated_optimizer": est["embedding_optimizer"],
                      "measured_optimizer": held["optimizer"],
                      "ratio": estimated / total if total else None})
    deviations = [abs(r["ratio"] - 1) for r in ranks if r["ratio"] is not None]
    return {"ranks": ranks, "max_abs_deviation": max(deviations, default=0.0)}
