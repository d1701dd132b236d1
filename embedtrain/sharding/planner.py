"""Plans how a model's embedding tables shard across a cluster, on ``meta``, with no GPU.

:func:`plan_sharding` is embedtrain's planner: TorchRec's topology, sharders, perf and storage
estimators and partitioner, driven by a faster enumerator (:mod:`.enumerator`) and search
(:mod:`.search`), with an itemised memory reservation (:mod:`.reservation`). It returns TorchRec's
:class:`ShardingPlan` (what ``DistributedModelParallel`` takes) together with the report that
``embedtrain plan`` writes as ``plan.json`` / ``plan.md`` / ``plan.html``.

Example:
    >>> model = dlrm(features, 128, [512, 256, 128], [1024, 1024, 512, 256, 1], device="meta")
    >>> fuse_sparse_optimizer(model, SparseOptimizer.ROWWISE_ADAGRAD, lr=0.05)
    >>> result = plan_sharding(model, load_cluster("configs/clusters/h100-16x8.yaml"),
    ...                        PlannerOptions(sharding_types=[ShardingType.ROW_WISE]))
    >>> result.report.summary.embedding_max_rank_ms
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torchrec.distributed.planner.planners import to_sharding_plan
from torchrec.distributed.planner.types import (
    CacheParams,
    ParameterConstraints,
    ShardingOption,
)
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from embedtrain.sharding.cluster import GIB, device_memory_tier, tier_capacity, topology
from embedtrain.sharding.enumerator import (
    OFFLOAD_KERNELS,
    CompactEnumerator,
    _shardable_modules,
    optimizer_slots,
)
from embedtrain.sharding.report_types import (
    PlannerInfo,
    PlanReport,
    PlanSummary,
    RankLoad,
    RankTime,
    ShardPlan,
    TablePlan,
    TierMemory,
)
from embedtrain.sharding.reservation import ExplicitStorageReservation
from embedtrain.sharding.search import SearchResult, search_plan, sharding_groups
from embedtrain.sharding.sharders import embedding_sharders
from embedtrain.sharding.types import (
    ClusterConfig,
    DenseAllReduce,
    MemoryTier,
    PlannerOptions,
    ShardingType,
)
from embedtrain.utils import natural_key

TIERS = (MemoryTier.HBM, MemoryTier.DDR)
EMBEDDING_PARTS = ("embedding_params", "embedding_optimizer", "embedding_remap", "io_and_cache")
# A dynamic table's remapper buffers that are not per row (a shard's output ranges, its step).
_REMAP_SCALARS = ("_output_segments_tensor", "_current_iter_tensor")


class PlanError(ValueError):
    """The model cannot be planned on the cluster; the message is one line saying why."""


@dataclass
class PlanResult:
    """A plan: TorchRec's ``ShardingPlan`` for DMP, the placed options, and the report."""

    sharding_plan: ShardingPlan
    options: list[ShardingOption]
    report: PlanReport


@dataclass
class _Table:
    name: str
    param: torch.Tensor
    sharder: ModuleSharder[nn.Module]
    remap_bytes_per_row: int = 0  # a dynamic table's id -> row state, per row


def remap_bytes_per_row(module: nn.Module, table: str) -> int:
    """Bytes per row of dynamic table ``table``'s checkpointed remapping state in ``module`` (a
    managed-collision collection; 0 for a plain one): every per-row buffer of its remapper
    (sorted ids, their rows, the eviction policy's counters, the statistics)."""
    mcc = getattr(module, "_managed_collision_collection", None)
    if mcc is None:
        return 0
    mcm = mcc._managed_collision_modules[table]
    rows = mcm.output_size()
    return sum(b.element_size() for n, b in mcm.named_buffers()
               if n not in _REMAP_SCALARS and n not in mcm._non_persistent_buffers_set
               and b.dim() == 1 and b.shape[0] == rows)


def _tables(model: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> dict[str, _Table]:
    from torchrec.distributed.planner.utils import sharder_name

    sharder_map = {sharder_name(s.module_type): s for s in sharders}
    out = {}
    for _, module in _shardable_modules(model, sharder_map):
        sharder = sharder_map[sharder_name(type(module))]
        for name, param in sharder.shardable_parameters(module).items():
            out[name] = _Table(name, param, sharder, remap_bytes_per_row(module, name))
    return out


def _add_remap_storage(options: list[ShardingOption], tables: dict[str, _Table],
                       tier: MemoryTier) -> None:
    """Adds each dynamic table shard's remapping state to its storage estimate (in the compute
    device's memory, where TorchRec keeps it), so the search packs it with the rows."""
    for option in options:
        per_row = tables[option.name].remap_bytes_per_row
        for shard in option.shards if per_row else ():
            extra = shard.size[0] * per_row
            if tier is MemoryTier.HBM:
                shard.storage.hbm += extra
            else:
                shard.storage.ddr += extra


def table_constraints(
    tables: list[str],
    sharding: PlannerOptions,
    pooling_factors: Optional[dict[str, float]] = None,
    tiny: Optional[set[str]] = None,
) -> dict[str, ParameterConstraints]:
    """TorchRec constraints per table from the planner's options.

    Later ``sharding.tables`` entries override earlier ones and the global lists. A pattern that
    matches no table is an error (a typo would otherwise constrain nothing).

    Args:
        tables: the model's table names.
        sharding: the allowed sharding types and kernels, and the per-table constraints.
        pooling_factors: mean ids per example by table (default 1.0; a constraint's wins).
        tiny: tables under ``sharding.tiny_table_bytes`` that can be table_wise: without
            sharding types of their own (globally or per table) they get ``table_wise`` only.

    Returns:
        One :class:`ParameterConstraints` per table name.

    Raises:
        PlanError: a ``sharding.tables`` pattern matches no table.
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
        explicit = bool(sharding.sharding_types) or any(
            tc.sharding_types and any(fnmatch.fnmatchcase(name, p) for p in tc.tables)
            for tc in sharding.tables)
        if tiny and name in tiny and not explicit:
            types = [ShardingType.TABLE_WISE.value]
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


def _largest_reservation(breakdown: dict[str, int], cluster: ClusterConfig) -> str:
    """What to change when the reservations do not fit: the input buffers grow with the batch
    (a key the user set), the dense parts with the model."""
    name, size = max(breakdown.items(), key=lambda kv: kv[1])
    if name != "kjt_buffers":
        return f"; the largest part: {name.replace('_', ' ')}, {size / GIB:.2f} GiB"
    return (f"; the input buffers of {cluster.batch_size_per_rank:,} rows per rank take "
            f"{size / GIB:.2f} GiB: lower the batch size (train: data.batch_size, the global "
            f"batch; plan: the cluster's batch_size_per_rank)")


def plan_sharding(
    model: nn.Module,
    cluster: ClusterConfig,
    sharding: Optional[PlannerOptions] = None,
    *,
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
        sharding: allowed sharding types/kernels, per-table constraints, qcomms precision, the
            dense all-reduce (for its time), the search budget (default ``PlannerOptions()``);
            echoed in the report.
        pooling_factors: mean ids per example per table (default 1.0).
        dense_optimizer_slots: dense optimizer values per dense parameter (Adam 2).
        budget: partitions for the local search (default ``sharding.search_budget``).
        extra_reservations: more per-rank memory to set aside, by name, in bytes (e.g. an XC
            class head's logits); itemised in the report's ranks like the dense model.

    Returns:
        The plan: TorchRec's ``ShardingPlan``, the placed options, and the :class:`PlanReport`.

    Raises:
        PlanError: inconsistent constraints, or the model does not fit (says by how much,
            on which memory, and which tables are largest).
    """
    start = time.perf_counter()
    sharding = sharding or PlannerOptions()
    topo = topology(cluster)
    tier = device_memory_tier(cluster)
    sharders = embedding_sharders(sharding.forward_comm_precision, sharding.backward_comm_precision)
    tables = _tables(model, sharders)
    if not tables:
        raise PlanError("the model has no embedding tables to shard")
    tiny = {n for n, t in tables.items()
            if t.param.numel() * t.param.element_size() < sharding.tiny_table_bytes
            and ShardingType.TABLE_WISE.value in t.sharder.sharding_types(topo.compute_device)}
    constraints = table_constraints(list(tables), sharding, pooling_factors, tiny)
    _check_constraints(tables, constraints, topo.compute_device)

    reservation = ExplicitStorageReservation(cluster.reserved_fraction, dense_optimizer_slots,
                                             extra=extra_reservations)
    left = reservation.reserve(topo, cluster.batch_size_per_rank, model, sharders, constraints)
    if getattr(left.devices[0].storage, tier.value) <= 0:
        need = sum(reservation.breakdown.values()) / GIB
        raise PlanError(f"does not fit: the dense model, its optimizer, input buffers, "
                        f"{''.join(k + ', ' for k in (extra_reservations or {}))}and the "
                        f"{cluster.reserved_fraction:.0%} reserve need {need:.2f} GiB of "
                        f"{_label(tier)} per rank, more than the "
                        f"{tier_capacity(cluster, tier) / GIB:.2f} GiB a rank has"
                        f"{_largest_reservation(reservation.breakdown, cluster)}")
    enum = CompactEnumerator(topo, cluster.batch_size_per_rank, constraints)
    options = enum.enumerate(model, sharders)
    _add_remap_storage(options, tables, tier)
    budget = sharding.search_budget if budget is None else budget
    result = search_plan(options, enum.expand, enum.shard_counts, left, budget, tier,
                         runs=enum.runs, group_ms=cluster.sharding_group_ms)
    offloaded = False
    if result.plan is None and topo.compute_device == "cuda":
        # Allow host-memory kernels for every table and search again.
        enum = CompactEnumerator(topo, cluster.batch_size_per_rank, constraints,
                                 offload_tables=list(tables))
        options = enum.enumerate(model, sharders)
        _add_remap_storage(options, tables, tier)
        result = search_plan(options, enum.expand, enum.shard_counts, left, budget, tier,
                             runs=enum.runs, group_ms=cluster.sharding_group_ms)
        offloaded = True
    if result.plan is None:
        raise PlanError(_no_fit_message(options, enum, left, cluster, tier, tables))

    sharding_plan = to_sharding_plan(result.plan, topo)
    planner = _planner_info(result, time.perf_counter() - start, len(options),
                            enum.num_estimated_shards)
    report = _build_report(result, cluster, sharding, reservation, tables, constraints,
                           dense_optimizer_slots, planner, offloaded)
    return PlanResult(sharding_plan=sharding_plan, options=result.plan, report=report)


def _label(tier: MemoryTier) -> str:
    return tier.value.upper()  # "HBM", "DDR"


def _no_fit_message(options, enum, left, cluster: ClusterConfig, tier: MemoryTier,
                    tables) -> str:
    by_table: dict[str, list[ShardingOption]] = {}
    for o in options:
        by_table.setdefault(o.name, []).append(o)

    def total(o: ShardingOption, tiers: tuple[MemoryTier, ...]) -> float:
        return sum(getattr(s.storage, t.value) * c for s, c in zip(o.shards, enum.shard_counts(o))
                   for t in tiers)

    sizes = sorted(((t.param.numel() * t.param.element_size(), n) for n, t in tables.items()),
                   reverse=True)[:3]
    largest = ", ".join(f"{n} ({b / GIB:.1f} GiB of weights)" for b, n in sizes)
    where = f"on {cluster.world_size} rank(s) of {cluster.name}"
    # Device memory alone, then device and host memory together (host-memory kernels).
    checks = [((tier,), _label(tier))]
    if tier is MemoryTier.HBM:
        checks.append(((MemoryTier.HBM, MemoryTier.DDR), "HBM + host DDR"))
    for tiers, label in reversed(checks):
        need = sum(min(total(o, tiers) for o in opts) for opts in by_table.values())
        have = sum(getattr(d.storage, t.value) for d in left.devices for t in tiers)
        if need > have:
            return (f"does not fit: the tables need at least {need / GIB:.1f} GiB of {label} "
                    f"{where}, {have / GIB:.1f} GiB are left after reservations (short by "
                    f"{(need - have) / GIB:.1f} GiB); largest tables: {largest}")
    rank = left.devices[0].storage
    for name, opts in by_table.items():
        if not any(all(s.storage.fits_in(rank) for s in o.shards) for o in opts):
            o = min(opts, key=lambda o: max(getattr(s.storage, tier.value) for s in o.shards))
            shard = max(getattr(s.storage, tier.value) for s in o.shards)
            room = getattr(rank, tier.value)
            return (f"does not fit: table {name}'s smallest shard needs {shard / GIB:.1f} GiB of "
                    f"{_label(tier)}, a rank of {cluster.name} has {room / GIB:.1f} GiB left after "
                    f"reservations (short by {max(0.0, shard - room) / GIB:.1f} GiB); "
                    f"largest tables: {largest}")
    return (f"does not fit: no placement packs the tables' shards into the {_label(tier)} {where} "
            f"(try more ranks or fewer constraints); largest tables: {largest}")


def dense_allreduce_bytes(shapes: list[tuple[int, ...]], mode: DenseAllReduce,
                          powersgd_rank: int = 2) -> int:
    """Bytes each rank all-reduces per step for the dense gradients (fp32 values, compressed).

    bf16/fp16 halve them; PowerSGD sends rank-``r`` factors ``P (n x r)`` and ``Q (m x r)`` of
    every matrix instead of its ``n x m`` values (vectors go uncompressed).

    Args:
        shapes: the dense (data-parallel) parameters' shapes.
        mode: the all-reduce's compression.
        powersgd_rank: the rank ``r`` of PowerSGD's factors.

    Returns:
        The bytes sent, per rank and step.
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




def _build_report(result: SearchResult, cluster: ClusterConfig, sharding: PlannerOptions,
                  reservation: ExplicitStorageReservation, tables: dict[str, _Table],
                  constraints: dict[str, ParameterConstraints], dense_slots: int,
                  planner: PlannerInfo, offloaded: bool) -> PlanReport:
    """The report of a found plan: its tables (in natural name order), ranks, summary, warnings."""
    tier = device_memory_tier(cluster)
    usage = _RankUsage(cluster.world_size)
    table_plans = []
    for option in sorted(result.plan or [], key=lambda o: natural_key(o.name)):
        param, remap = tables[option.name].param, tables[option.name].remap_bytes_per_row
        # A data-parallel table is replicated and stepped by the dense optimizer (TorchRec's DP
        # lookup is a DDP module whose parameters carry no fused optimizer).
        dp = option.sharding_type == "data_parallel"
        slots = float(dense_slots) if dp else optimizer_slots(param)
        offload = option.compute_kernel in OFFLOAD_KERNELS or tier is MemoryTier.DDR
        table_plans.append(_table_plan(option, param, constraints[option.name], slots, remap))
        usage.add(option, param.element_size(), slots, MemoryTier.DDR if offload else MemoryTier.HBM,
                  remap, tier)
    wire, allreduce_ms = _dense_allreduce(reservation, sharding, cluster)
    groups_ms = cluster.sharding_group_ms * sharding_groups(result.plan or [])
    ranks = _rank_loads(usage, reservation, cluster, allreduce_ms, groups_ms)
    summary = _summary(table_plans, ranks, reservation.breakdown["dense_model"], wire,
                       allreduce_ms, tier_capacity(cluster, tier), tier)
    planned = dataclasses.replace(cluster, **({"hbm_gb": 0.0} if tier is MemoryTier.DDR else {}))
    return PlanReport(cluster=planned, sharding=copy.deepcopy(sharding), summary=summary,
                      warnings=_warnings(summary, ranks, offloaded), planner=planner,
                      tables=table_plans, ranks=ranks)


def _planner_info(result: SearchResult, seconds: float, num_options: int,
                  estimated_shards: int) -> PlannerInfo:
    stats = result.stats
    return PlannerInfo(seconds=seconds, search_seconds=stats.seconds, options=num_options,
                       estimated_shards=estimated_shards, proposals=stats.proposals,
                       partitions=stats.partitions, pruned_by_bound=stats.pruned_by_bound,
                       improving_moves=stats.improving_moves, best_seed=stats.best_seed,
                       seed_ratings_ms=dict(stats.seeds))


def _table_plan(option: ShardingOption, param: torch.Tensor, constraint: ParameterConstraints,
                slots: float, remap_per_row: int = 0) -> TablePlan:
    """One placed table: its shards (as placed), sizes and estimated times."""
    elem = param.element_size()
    shards = [ShardPlan(rank=s.rank, offset=list(s.offset), size=list(s.size),
                        hbm_bytes=int(s.storage.hbm), ddr_bytes=int(s.storage.ddr),
                        perf_ms=s.perf.total) for s in option.shards]
    return TablePlan(
        name=option.name,
        rows=int(param.shape[0]),
        dim=int(param.shape[1]),
        pooling_factor=float(sum(constraint.pooling_factors)),
        sharding_type=option.sharding_type,
        compute_kernel=option.compute_kernel,
        ranks=sorted({s.rank for s in option.shards}),
        weight_bytes=int(param.numel() * elem),
        optimizer_bytes=int(math.ceil(param.numel() * elem * slots)),
        perf_ms_all_shards=sum(s.perf.total for s in option.shards),
        slowest_shard_ms=max(s.perf.total for s in option.shards),
        shards=shards,
        remap_bytes=int(param.shape[0]) * remap_per_row,
    )


class _RankUsage:
    """Per rank: embedding bytes by tier and component, and estimated times, over placed shards."""

    def __init__(self, world: int) -> None:
        self.memory = [{t: dict.fromkeys(EMBEDDING_PARTS, 0) for t in TIERS} for _ in range(world)]
        self.times = [RankTime() for _ in range(world)]

    def add(self, option: ShardingOption, elem: int, slots: float, home: MemoryTier,
            remap_per_row: int = 0, device_tier: MemoryTier = MemoryTier.HBM) -> None:
        """Adds ``option``'s shards: weights and optimizer state in ``home``, a dynamic table's
        remapping state in ``device_tier`` (``embedding_remap``), the rest of each shard's
        storage estimate (IO buffers, cache) as ``io_and_cache``."""
        for s in option.shards:
            weights = math.prod(s.size) * elem
            opt = math.ceil(weights * slots)
            remap = s.size[0] * remap_per_row
            mem = self.memory[s.rank]
            mem[home]["embedding_params"] += weights
            mem[home]["embedding_optimizer"] += opt
            mem[device_tier]["embedding_remap"] += remap
            for t in TIERS:
                own = (weights + opt if t is home else 0) + (remap if t is device_tier else 0)
                mem[t]["io_and_cache"] += max(0, getattr(s.storage, t.value) - own)
            p, tm = s.perf, self.times[s.rank]
            tm.fwd_compute += p.fwd_compute
            tm.fwd_comms += p.fwd_comms
            tm.bwd_compute += p.bwd_compute
            tm.bwd_comms += p.bwd_comms
            tm.prefetch += p.prefetch_compute


def _dense_allreduce(reservation: ExplicitStorageReservation, sharding: PlannerOptions,
                     cluster: ClusterConfig) -> tuple[int, float]:
    """Bytes each rank all-reduces for the dense gradients per step, and the ring's time (ms)."""
    world = cluster.world_size
    wire = dense_allreduce_bytes(reservation.dense_shapes, sharding.dense_allreduce,
                                 sharding.powersgd_rank)
    bw = cluster.inter_host_gb_per_s if cluster.hosts > 1 else cluster.intra_host_gb_per_s
    ms = (2 * (world - 1) / world * wire / (bw * GIB) * 1000) if world > 1 else 0.0
    return wire, ms


def _rank_loads(usage: _RankUsage, reservation: ExplicitStorageReservation,
                cluster: ClusterConfig, allreduce_ms: float,
                groups_ms: float = 0.0) -> list[RankLoad]:
    """Each rank's memory (the reservation's items in the dense model's tier) and time (with
    ``groups_ms``, the fixed cost of the plan's sharding groups, in its embedding time)."""
    cpu = device_memory_tier(cluster) is MemoryTier.DDR
    ranks = []
    for r in range(cluster.world_size):
        memory = {}
        for t in TIERS:
            parts = usage.memory[r][t]
            if t is reservation.tier:
                parts.update(reservation.breakdown)
            capacity = 0 if (t is MemoryTier.HBM and cpu) else tier_capacity(cluster, t)
            memory[t] = TierMemory(parts, total=sum(parts.values()), capacity=capacity)
        tm = usage.times[r]
        tm.sharding_groups = groups_ms
        tm.embedding_total = sum((tm.fwd_compute, tm.fwd_comms, tm.bwd_compute, tm.bwd_comms,
                                  tm.prefetch, tm.sharding_groups))
        tm.dense_allreduce = allreduce_ms
        tm.total = tm.embedding_total + allreduce_ms
        ranks.append(RankLoad(rank=r, host=r // cluster.devices_per_host, memory=memory,
                              time_ms=tm))
    return ranks


def _summary(tables: list[TablePlan], ranks: list[RankLoad], dense_bytes: int, wire: int,
             allreduce_ms: float, capacity: int, tier: MemoryTier) -> PlanSummary:
    world = len(ranks)
    emb = [r.time_ms.embedding_total for r in ranks]
    used = [r.memory[tier].total for r in ranks]
    slowest = max(range(world), key=lambda r: (round(emb[r], 9), -r))
    fullest = max(range(world), key=lambda r: (used[r], -r))
    mean = sum(emb) / world
    types: dict[str, int] = {}
    for t in tables:
        key = f"{t.sharding_type}/{t.compute_kernel}"
        types[key] = types.get(key, 0) + 1
    return PlanSummary(
        tables=len(tables),
        embedding_weight_bytes=sum(t.weight_bytes for t in tables),
        embedding_optimizer_bytes=sum(t.optimizer_bytes for t in tables),
        dense_parameter_bytes=dense_bytes,
        dense_allreduce_bytes=wire,
        embedding_max_rank_ms=max(emb),
        embedding_mean_rank_ms=mean,
        imbalance=max(1.0, round(max(emb) / mean, 6)) if mean > 0 else 1.0,
        slowest_rank=slowest,
        peak_memory_rank=fullest,
        dense_allreduce_ms=allreduce_ms,
        step_estimate_ms=max(emb) + allreduce_ms,
        memory_tier=tier,
        peak_rank_memory_bytes=used[fullest],
        rank_memory_capacity_bytes=capacity,
        sharding_types=types,
    )


def _warnings(s: PlanSummary, ranks: list[RankLoad], offloaded: bool) -> list[str]:
    """What a reader should look at: imbalance, (uneven) memory pressure, offload, all-reduce."""
    tier, label = s.memory_tier, _label(s.memory_tier)
    peak, capacity = s.peak_rank_memory_bytes, s.rank_memory_capacity_bytes
    warnings = []
    if s.imbalance > 1.5:
        warnings.append(f"rank {s.slowest_rank} is the bottleneck: {s.embedding_max_rank_ms:.2f} "
                        f"ms vs {s.embedding_mean_rank_ms:.2f} ms mean embedding time "
                        f"({s.imbalance:.2f}x imbalance)")
    if peak > 0.9 * capacity:
        warnings.append(f"peak {label} use is {peak / capacity:.0%} of capacity "
                        f"(rank {s.peak_memory_rank})")
    # the embedding part of each rank's memory (the dense model and reserve are alike on all)
    emb = [sum(r.memory[tier].get(p) for p in EMBEDDING_PARTS) for r in ranks]
    mean_emb = sum(emb) / len(ranks)
    # (a skew of a few MiB on a large device is noise: only above 1% of a rank's memory)
    if mean_emb > 0 and max(emb) / mean_emb > 1.5 and max(emb) > 0.01 * capacity:
        heavy = max(range(len(ranks)), key=lambda r: (emb[r], -r))
        warnings.append(f"memory is uneven: rank {heavy} holds {max(emb) / GIB:.3g} GiB of "
                        f"embeddings in {label}, {max(emb) / mean_emb:.1f}x the mean rank's "
                        f"{mean_emb / GIB:.3g} GiB")
    if offloaded:
        warnings.append("the tables do not fit in device memory: host-memory (UVM) kernels "
                        "were allowed, which are slower")
    if s.dense_allreduce_ms > s.embedding_max_rank_ms:
        warnings.append(f"the dense gradient all-reduce ({s.dense_allreduce_ms:.2f} ms) costs more "
                        "than the embeddings; consider compressed all-reduce or a faster network")
    return warnings
