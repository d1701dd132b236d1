"""Plans how a model's embedding tables shard across a cluster, on ``meta``, with no GPU.

:func:`plan_sharding` is embedtrain's planner: TorchRec's topology, sharders, perf and storage
estimators and partitioner, driven by a faster enumerator (:mod:`.enumerator`) and search
(:mod:`.search`), with an itemised memory reservation (:mod:`.reservation`). It returns TorchRec's
:class:`ShardingPlan` (what ``DistributedModelParallel`` takes) together with the report that
``embedtrain plan`` writes as ``plan.json`` / ``plan.md`` / ``plan.html``.

Example:
    >>> model = dlrm(features, 128, [512, 256, 128], [1024, 1024, 512, 256, 1], device="meta")
    >>> fuse_sparse_optimizer(model, SparseOptimizer.ROWWISE_ADAGRAD, lr=0.05)
    >>> result = plan_sharding(model, load_cluster("configs/clusters/h100-16x8.yaml"))
    >>> result.report["summary"]["embedding_max_rank_ms"]
"""

from __future__ import annotations

import fnmatch
import math
import re
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torchrec.distributed.planner.planners import to_sharding_plan
from torchrec.distributed.planner.shard_estimators import _get_optimizer_multipler
from torchrec.distributed.planner.types import (
    CacheParams,
    ParameterConstraints,
    ShardingOption,
)
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from embedtrain.config import ClusterConfig, DenseAllReduce, ShardingConfig, to_dict
from embedtrain.sharding.cluster import GIB, device_memory_tier, topology
from embedtrain.sharding.enumerator import OFFLOAD_KERNELS, CompactEnumerator, _shardable_modules
from embedtrain.sharding.reservation import ExplicitStorageReservation
from embedtrain.sharding.search import SearchResult, search_plan
from embedtrain.sharding.sharders import embedding_sharders

SCHEMA_VERSION = 1


class PlanError(ValueError):
    """The model cannot be planned on the cluster; the message is one line saying why."""


@dataclass
class PlanResult:
    """A plan: TorchRec's ``ShardingPlan`` for DMP, the placed options, and the report."""

    sharding_plan: ShardingPlan
    options: list[ShardingOption]
    report: dict[str, Any]


@dataclass
class _Table:
    name: str
    param: torch.Tensor
    sharder: ModuleSharder[nn.Module]


def _tables(model: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> dict[str, _Table]:
    from torchrec.distributed.planner.utils import sharder_name

    sharder_map = {sharder_name(s.module_type): s for s in sharders}
    out = {}
    for _, module in _shardable_modules(model, sharder_map):
        sharder = sharder_map[sharder_name(type(module))]
        for name, param in sharder.shardable_parameters(module).items():
            out[name] = _Table(name, param, sharder)
    return out


def table_constraints(
    tables: list[str],
    sharding: ShardingConfig,
    pooling_factors: Optional[dict[str, float]] = None,
) -> dict[str, ParameterConstraints]:
    """TorchRec constraints per table from the config's ``sharding`` section.

    Later ``sharding.tables`` entries override earlier ones and the global lists. A pattern that
    matches no table is an error (a typo would otherwise constrain nothing).
    """
    for i, tc in enumerate(sharding.tables):
        for pattern in tc.tables:
            if not any(fnmatch.fnmatchcase(t, pattern) for t in tables):
                shown = ", ".join(tables[:8]) + (", ..." if len(tables) > 8 else "")
                raise PlanError(f"sharding.tables[{i}].tables: {pattern!r} matches no table "
                                f"(tables: {shown})")
    out = {}
    for name in tables:
        types = [t.value for t in sharding.sharding_types]
        kernels = [k.value for k in sharding.compute_kernels]
        pooling = (pooling_factors or {}).get(name, 1.0)
        clf = None
        for tc in sharding.tables:
            if any(fnmatch.fnmatchcase(name, p) for p in tc.tables):
                types = [t.value for t in tc.sharding_types] or types
                kernels = [k.value for k in tc.compute_kernels] or kernels
                pooling = tc.pooling_factor if tc.pooling_factor is not None else pooling
                clf = tc.cache_load_factor if tc.cache_load_factor is not None else clf
        out[name] = ParameterConstraints(
            sharding_types=types or None,
            compute_kernels=kernels or None,
            pooling_factors=[pooling],
            cache_params=CacheParams(load_factor=clf) if clf is not None else None,
        )
    return out


def _check_constraints(tables: dict[str, _Table], constraints: dict[str, ParameterConstraints],
                       device: str) -> None:
    """Names the first table whose allowed sharding types and kernels have nothing in common."""
    for name, t in tables.items():
        c = constraints[name]
        offered = t.sharder.sharding_types(device)
        types = [s for s in (c.sharding_types or offered) if s in offered]
        if not types:
            raise PlanError(f"sharding: table {name}: sharding type(s) "
                            f"{', '.join(c.sharding_types or [])} not available on {device} "
                            f"(available: {', '.join(offered)})")
        kernels_by_type = {s: t.sharder.compute_kernels(s, device) for s in types}
        if c.compute_kernels and not any(k in ks for ks in kernels_by_type.values()
                                         for k in c.compute_kernels):
            can = "; ".join(f"{s} takes {', '.join(ks)}" for s, ks in kernels_by_type.items())
            raise PlanError(f"sharding: table {name}: compute kernel(s) "
                            f"{', '.join(c.compute_kernels)} cannot do sharding type(s) "
                            f"{', '.join(types)} on {device} ({can})")


def plan_sharding(
    model: nn.Module,
    cluster: ClusterConfig,
    sharding: Optional[ShardingConfig] = None,
    pooling_factors: Optional[dict[str, float]] = None,
    dense_optimizer_slots: int = 2,
    budget: Optional[int] = None,
    extra_reservations: Optional[dict[str, int]] = None,
) -> PlanResult:
    """Plans ``model``'s tables on ``cluster``.

    Args:
        model: the unsharded model, ideally on ``meta``; sparse optimizers already fused
            (``fuse_sparse_optimizer``) so optimizer state is counted.
        cluster: the target cluster.
        sharding: allowed sharding types/kernels, per-table constraints, qcomms precision.
        pooling_factors: mean ids per example per table (default 1.0).
        dense_optimizer_slots: dense optimizer values per dense parameter (Adam 2).
        budget: partitions for the local search (default ``sharding.search_budget``).
        extra_reservations: more per-rank memory to set aside, by name, in bytes (e.g. an XC
            class head's logits); itemised in the report's ranks like the dense model.

    Returns:
        The plan and its report.

    Raises:
        PlanError: inconsistent constraints, or the model does not fit (says by how much,
            on which memory, and which tables are largest).
    """
    start = time.perf_counter()
    sharding = sharding or ShardingConfig()
    topo = topology(cluster)
    tier = device_memory_tier(cluster)
    sharders = embedding_sharders(sharding)
    tables = _tables(model, sharders)
    if not tables:
        raise PlanError("the model has no embedding tables to shard")
    constraints = table_constraints(list(tables), sharding, pooling_factors)
    _check_constraints(tables, constraints, topo.compute_device)

    reservation = ExplicitStorageReservation(cluster.reserved_fraction, dense_optimizer_slots,
                                             extra=extra_reservations)
    left = reservation.reserve(topo, cluster.batch_size_per_rank, model, sharders, constraints)
    if getattr(left.devices[0].storage, tier) <= 0:
        need = sum(reservation.breakdown.values()) / GIB
        raise PlanError(f"does not fit: the dense model, its optimizer, input buffers, "
                        f"{''.join(k + ', ' for k in (extra_reservations or {}))}and the "
                        f"{cluster.reserved_fraction:.0%} reserve need {need:.2f} GiB of {tier.upper()} "
                        f"per rank, more than the {_capacity(cluster, tier) / GIB:.2f} GiB a rank has")
    enum = CompactEnumerator(topo, cluster.batch_size_per_rank, constraints)
    options = enum.enumerate(model, sharders)
    budget = sharding.search_budget if budget is None else budget
    result = search_plan(options, enum.expand, enum.shard_counts, left, budget, tier)
    offloaded = False
    if result.plan is None and topo.compute_device == "cuda":
        # Allow host-memory kernels for every table and search again.
        enum = CompactEnumerator(topo, cluster.batch_size_per_rank, constraints,
                                 offload_tables=list(tables))
        options = enum.enumerate(model, sharders)
        result = search_plan(options, enum.expand, enum.shard_counts, left, budget, tier)
        offloaded = True
    if result.plan is None:
        raise PlanError(_no_fit_message(options, enum, left, cluster, tier, tables))

    sharding_plan = to_sharding_plan(result.plan, topo)
    report = _report(result, cluster, sharding, reservation, tables, constraints, tier,
                     dense_optimizer_slots,
                     seconds=time.perf_counter() - start, estimated_shards=enum.num_estimated_shards,
                     num_options=len(options), offloaded=offloaded)
    return PlanResult(sharding_plan=sharding_plan, options=result.plan, report=report)


def _natural(name: str) -> list:
    """Sort key that puts t_C2 before t_C10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _capacity(cluster: ClusterConfig, tier: str) -> int:
    return int((cluster.hbm_gb if tier == "hbm" else cluster.ddr_gb) * GIB)


def _no_fit_message(options, enum, left, cluster: ClusterConfig, tier: str, tables) -> str:
    by_table: dict[str, list[ShardingOption]] = {}
    for o in options:
        by_table.setdefault(o.name, []).append(o)

    def total(o: ShardingOption, tiers: tuple[str, ...]) -> float:
        return sum(getattr(s.storage, t) * c for s, c in zip(o.shards, enum.shard_counts(o))
                   for t in tiers)

    sizes = sorted(((t.param.numel() * t.param.element_size(), n) for n, t in tables.items()),
                   reverse=True)[:3]
    largest = ", ".join(f"{n} ({b / GIB:.1f} GiB of weights)" for b, n in sizes)
    where = f"on {cluster.world_size} rank(s) of {cluster.name}"
    # Device memory alone, then device and host memory together (host-memory kernels).
    checks = [((tier,), tier.upper())]
    if tier == "hbm":
        checks.append((("hbm", "ddr"), "HBM + host DDR"))
    for tiers, label in reversed(checks):
        need = sum(min(total(o, tiers) for o in opts) for opts in by_table.values())
        have = sum(getattr(d.storage, t) for d in left.devices for t in tiers)
        if need > have:
            return (f"does not fit: the tables need at least {need / GIB:.1f} GiB of {label} "
                    f"{where}, {have / GIB:.1f} GiB are left after reservations (short by "
                    f"{(need - have) / GIB:.1f} GiB); largest tables: {largest}")
    rank = left.devices[0].storage
    for name, opts in by_table.items():
        if not any(all(s.storage.fits_in(rank) for s in o.shards) for o in opts):
            o = min(opts, key=lambda o: max(getattr(s.storage, tier) for s in o.shards))
            shard = max(getattr(s.storage, tier) for s in o.shards)
            room = getattr(rank, tier)
            return (f"does not fit: table {name}'s smallest shard needs {shard / GIB:.1f} GiB of "
                    f"{tier.upper()}, a rank of {cluster.name} has {room / GIB:.1f} GiB left after "
                    f"reservations (short by {max(0.0, shard - room) / GIB:.1f} GiB); "
                    f"largest tables: {largest}")
    return (f"does not fit: no placement packs the tables' shards into the {tier.upper()} {where} "
            f"(try more ranks or fewer constraints); largest tables: {largest}")


def _optimizer_slots(param: torch.Tensor) -> float:
    """Optimizer values per weight of a fused table: TorchRec's storage estimator's own rule."""
    cls = getattr(param, "_optimizer_classes", [None])[0]
    return float(_get_optimizer_multipler(cls, param.shape))


def dense_allreduce_bytes(shapes: list[tuple[int, ...]], mode: DenseAllReduce,
                          powersgd_rank: int = 2) -> int:
    """Bytes each rank all-reduces per step for the dense gradients (fp32 values, compressed).

    bf16/fp16 halve them; PowerSGD sends rank-``r`` factors ``P (n x r)`` and ``Q (m x r)`` of
    every matrix instead of its ``n x m`` values (vectors go uncompressed).
    """
    total = 0
    for shape in shapes:
        numel = math.prod(shape)
        if mode is DenseAllReduce.POWERSGD and len(shape) > 1:
            n = shape[0]
            total += 4 * min(numel, powersgd_rank * (n + numel // n))
        elif mode in (DenseAllReduce.BF16, DenseAllReduce.FP16):
            total += 2 * numel
        else:
            total += 4 * numel
    return total


def _report(result: SearchResult, cluster: ClusterConfig, sharding: ShardingConfig,
            reservation: ExplicitStorageReservation, tables: dict[str, _Table],
            constraints: dict[str, ParameterConstraints], tier: str, dense_slots: int,
            seconds: float,
            estimated_shards: int, num_options: int, offloaded: bool) -> dict[str, Any]:
    world = cluster.world_size
    per_host = cluster.devices_per_host
    kinds = ("embedding_params", "embedding_optimizer", "io_and_cache")
    memory = [{t: dict.fromkeys(kinds, 0) for t in ("hbm", "ddr")} for _ in range(world)]
    times = [dict.fromkeys(("fwd_compute", "fwd_comms", "bwd_compute", "bwd_comms", "prefetch"), 0.0)
             for _ in range(world)]
    table_rows = []
    for option in sorted(result.plan or [], key=lambda o: _natural(o.name)):
        param = tables[option.name].param
        elem = param.element_size()
        # A data-parallel table is replicated and stepped by the dense optimizer (TorchRec's DP
        # lookup is a DDP module whose parameters carry no fused optimizer).
        dp = option.sharding_type == "data_parallel"
        slots = float(dense_slots) if dp else _optimizer_slots(param)
        home = "ddr" if option.compute_kernel in OFFLOAD_KERNELS or tier == "ddr" else "hbm"
        shards = []
        for s in option.shards:
            weights = math.prod(s.size) * elem
            opt = math.ceil(weights * slots)
            mem = memory[s.rank]
            mem[home]["embedding_params"] += weights
            mem[home]["embedding_optimizer"] += opt
            for t in ("hbm", "ddr"):
                own = weights + opt if t == home else 0
                mem[t]["io_and_cache"] += max(0, getattr(s.storage, t) - own)
            p = s.perf
            tm = times[s.rank]
            tm["fwd_compute"] += p.fwd_compute
            tm["fwd_comms"] += p.fwd_comms
            tm["bwd_compute"] += p.bwd_compute
            tm["bwd_comms"] += p.bwd_comms
            tm["prefetch"] += p.prefetch_compute
            shards.append({"rank": s.rank, "offset": list(s.offset), "size": list(s.size),
                           "hbm_bytes": int(s.storage.hbm), "ddr_bytes": int(s.storage.ddr),
                           "perf_ms": p.total})
        table_rows.append({
            "name": option.name,
            "rows": int(param.shape[0]),
            "dim": int(param.shape[1]),
            "pooling_factor": float(sum(constraints[option.name].pooling_factors)),
            "sharding_type": option.sharding_type,
            "compute_kernel": option.compute_kernel,
            "ranks": sorted({s.rank for s in option.shards}),
            "weight_bytes": int(param.numel() * elem),
            "optimizer_bytes": int(math.ceil(param.numel() * elem * slots)),
            "perf_ms_all_shards": sum(s.perf.total for s in option.shards),
            "slowest_shard_ms": max(s.perf.total for s in option.shards),
            "shards": shards,
        })

    dense = reservation.breakdown
    dense_bytes = dense["dense_model"]
    wire = dense_allreduce_bytes(reservation.dense_shapes, sharding.dense_allreduce,
                                 sharding.powersgd_rank)
    bw = cluster.inter_host_gb_per_s if cluster.hosts > 1 else cluster.intra_host_gb_per_s
    allreduce_ms = (2 * (world - 1) / world * wire / (bw * GIB) * 1000) if world > 1 else 0.0
    ranks = []
    for r in range(world):
        mem = memory[r]
        for k, v in dense.items():
            mem[reservation.tier][k] = v
        for t in ("hbm", "ddr"):
            mem[t]["total"] = sum(v for k, v in mem[t].items())
            mem[t]["capacity"] = _capacity(cluster, t) if not (t == "hbm" and tier == "ddr") else 0
        tm = times[r]
        tm["embedding_total"] = sum(tm.values())
        tm["dense_allreduce"] = allreduce_ms
        tm["total"] = tm["embedding_total"] + allreduce_ms
        ranks.append({"rank": r, "host": r // per_host, "memory": mem, "time_ms": tm})

    emb = [r["time_ms"]["embedding_total"] for r in ranks]
    used = [r["memory"][tier]["total"] for r in ranks]
    slowest = max(range(world), key=lambda r: (round(emb[r], 9), -r))
    fullest = max(range(world), key=lambda r: (used[r], -r))
    peak = used[fullest]
    capacity = _capacity(cluster, tier)
    warnings = []
    mean = sum(emb) / world
    imbalance = max(1.0, round(max(emb) / mean, 6)) if mean > 0 else 1.0
    if imbalance > 1.5:
        warnings.append(f"rank {slowest} is the bottleneck: {max(emb):.2f} ms vs {mean:.2f} ms "
                        f"mean embedding time ({imbalance:.2f}x imbalance)")
    if peak > 0.9 * capacity:
        warnings.append(f"peak {tier.upper()} use is {peak / capacity:.0%} of capacity (rank {fullest})")
    mean_used = sum(used) / world
    if mean_used > 0 and peak / mean_used > 1.5 and peak > 0.25 * capacity:
        warnings.append(f"memory is uneven: rank {fullest} uses {peak / GIB:.1f} GiB of "
                        f"{tier.upper()}, the mean rank {mean_used / GIB:.1f} GiB")
    if offloaded:
        warnings.append("the tables do not fit in device memory: host-memory (UVM) kernels "
                        "were allowed, which are slower")
    if allreduce_ms > max(emb, default=0):
        warnings.append(f"the dense gradient all-reduce ({allreduce_ms:.2f} ms) costs more than "
                        "the embeddings; consider compressed all-reduce or a faster network")
    types: dict[str, int] = {}
    for t in table_rows:
        key = f"{t['sharding_type']}/{t['compute_kernel']}"
        types[key] = types.get(key, 0) + 1
    stats = result.stats
    return {
        "schema_version": SCHEMA_VERSION,
        "cluster": {**to_dict(cluster), "world_size": world,
                    **({"hbm_gb": 0.0} if tier == "ddr" else {})},
        "sharding": to_dict(sharding),
        "summary": {
            "tables": len(table_rows),
            "embedding_weight_bytes": sum(t["weight_bytes"] for t in table_rows),
            "embedding_optimizer_bytes": sum(t["optimizer_bytes"] for t in table_rows),
            "dense_parameter_bytes": dense_bytes,
            "dense_allreduce_bytes": wire,
            "embedding_max_rank_ms": max(emb),
            "embedding_mean_rank_ms": mean,
            "imbalance": imbalance,
            "slowest_rank": slowest,
            "peak_memory_rank": fullest,
            "dense_allreduce_ms": allreduce_ms,
            "step_estimate_ms": max(emb) + allreduce_ms,
            "memory_tier": tier,
            "peak_rank_memory_bytes": peak,
            "rank_memory_capacity_bytes": capacity,
            "sharding_types": types,
        },
        "warnings": warnings,
        "planner": {
            "seconds": seconds,
            "search_seconds": stats.seconds,
            "options": num_options,
            "estimated_shards": estimated_shards,
            "proposals": stats.proposals,
            "partitions": stats.partitions,
            "pruned_by_bound": stats.pruned_by_bound,
            "improving_moves": stats.improving_moves,
            "best_seed": stats.best_seed,
            "seed_ratings_ms": stats.seeds,
        },
        "tables": table_rows,
        "ranks": ranks,
    }
