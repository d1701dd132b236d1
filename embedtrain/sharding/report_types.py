"""The typed plan report: what :func:`~embedtrain.sharding.planner.plan_sharding` returns as
``PlanResult.report`` and ``embedtrain plan`` writes as ``plan.json`` / ``plan.md`` / ``plan.html``.

A :class:`PlanReport` holds the cluster and options planned for, a :class:`PlanSummary`, the
warnings, how the planner searched (:class:`PlannerInfo`), one :class:`TablePlan` per table (with
its :class:`ShardPlan` shards) and one :class:`RankLoad` per rank (memory by tier and component,
estimated time). :meth:`PlanReport.to_dict` is ``plan.json``'s content (its keys and order are a
format users script against: ``SCHEMA_VERSION``); :meth:`PlanReport.from_dict` reads it back.

No torch here: a saved plan can be loaded and rendered anywhere.

Example:
    >>> report = PlanReport.from_dict(json.loads(Path("plans/dlrm/plan.json").read_text()))
    >>> report.table("t_C1").sharding_type, report.summary.memory_tier
    ('table_row_wise', <MemoryTier.HBM: 'hbm'>)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from embedtrain.config_io import from_dict, to_dict
from embedtrain.sharding.types import ClusterConfig, MemoryTier, PlannerOptions

SCHEMA_VERSION = 1
TOTAL, CAPACITY = "total", "capacity"  # the keys plan.json adds to a tier's components


@dataclass
class ShardPlan:
    """One shard of a table: its rank, where it sits in the table, its memory and time."""

    rank: int
    offset: list[int]  # (row, column) of its first weight
    size: list[int]  # (rows, columns)
    hbm_bytes: int  # TorchRec's storage estimate: weights, optimizer state, IO, cache
    ddr_bytes: int
    perf_ms: float  # estimated time per step (forward + backward + prefetch)


@dataclass
class TablePlan:
    """How one table is sharded, its size, and its estimated cost.

    ``sharding_type`` and ``compute_kernel`` are TorchRec's names (``"row_wise"``, ``"fused"``).
    """

    name: str
    rows: int
    dim: int
    pooling_factor: float  # mean ids per example
    sharding_type: str
    compute_kernel: str
    ranks: list[int]  # the ranks holding a shard, ascending
    weight_bytes: int
    optimizer_bytes: int
    perf_ms_all_shards: float
    slowest_shard_ms: float
    shards: list[ShardPlan] = field(default_factory=list)
    remap_bytes: int = 0  # a dynamic table's id -> row state (sorted ids, rows, counters)


@dataclass
class TierMemory:
    """One rank's bytes in one memory tier, by component, with their total and the capacity.

    ``parts`` holds the embedding components (``embedding_params``, ``embedding_optimizer``,
    ``embedding_remap`` (dynamic tables' id -> row state), ``io_and_cache``) and, in the tier the dense model lives in, the reservation's items
    (``dense_model``, ..., any extra reservation such as ``class_head_logits``, ``reserved``).
    """

    parts: dict[str, int]
    total: int = 0
    capacity: int = 0  # 0: the rank has none of this tier (HBM on a CPU cluster)

    def get(self, part: str) -> int:
        """The bytes of component ``part``, 0 when the rank has none."""
        return self.parts.get(part, 0)

    def to_dict(self) -> dict[str, int]:
        """``plan.json``'s form: the components, then ``total`` and ``capacity``."""
        return {**self.parts, TOTAL: self.total, CAPACITY: self.capacity}

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> TierMemory:
        """Reads :meth:`to_dict`'s form."""
        parts = {k: v for k, v in data.items() if k not in (TOTAL, CAPACITY)}
        return cls(parts, data[TOTAL], data[CAPACITY])


@dataclass
class RankTime:
    """One rank's estimated time per step, ms: the embedding phases, the fixed cost of the
    plan's sharding groups (``ClusterConfig.sharding_group_ms`` per sharding type), their sum,
    the dense all-reduce, and the step total."""

    fwd_compute: float = 0.0
    fwd_comms: float = 0.0
    bwd_compute: float = 0.0
    bwd_comms: float = 0.0
    prefetch: float = 0.0
    embedding_total: float = 0.0
    dense_allreduce: float = 0.0
    total: float = 0.0
    sharding_groups: float = 0.0  # (last: plan.json's earlier keys keep their order)

    def part(self, name: str) -> float:
        """The value of the component named ``name`` (0.0 for one it does not have)."""
        return getattr(self, name, 0.0)


@dataclass
class RankLoad:
    """What one rank holds (per memory tier) and how long its step is estimated to take."""

    rank: int
    host: int
    memory: dict[MemoryTier, TierMemory]  # both tiers, HBM first
    time_ms: RankTime

    def to_dict(self) -> dict[str, Any]:
        """``plan.json``'s form (tiers keyed by ``"hbm"`` / ``"ddr"``)."""
        return {"rank": self.rank, "host": self.host,
                "memory": {t.value: m.to_dict() for t, m in self.memory.items()},
                "time_ms": to_dict(self.time_ms)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankLoad:
        """Reads :meth:`to_dict`'s form."""
        return cls(data["rank"], data["host"],
                   {MemoryTier(t): TierMemory.from_dict(m) for t, m in data["memory"].items()},
                   RankTime(**data["time_ms"]))


@dataclass
class PlanSummary:
    """The plan in numbers: sizes, the slowest and fullest rank, the step estimate."""

    tables: int
    embedding_weight_bytes: int
    embedding_optimizer_bytes: int
    dense_parameter_bytes: int
    dense_allreduce_bytes: int  # per rank and step, after compression
    embedding_max_rank_ms: float
    embedding_mean_rank_ms: float
    imbalance: float  # slowest / mean embedding time, at least 1
    slowest_rank: int
    peak_memory_rank: int
    dense_allreduce_ms: float
    step_estimate_ms: float  # slowest embeddings + dense all-reduce
    memory_tier: MemoryTier  # the "device memory" the plan fills: HBM, or DDR on CPU
    peak_rank_memory_bytes: int
    rank_memory_capacity_bytes: int
    sharding_types: dict[str, int]  # "sharding_type/kernel" -> tables, in table order


@dataclass
class PlannerInfo:
    """How the plan was found: time taken, options estimated, partitions tried."""

    seconds: float
    search_seconds: float
    options: int
    estimated_shards: int
    proposals: int
    partitions: int
    pruned_by_bound: int
    improving_moves: int
    best_seed: str
    seed_ratings_ms: dict[str, Optional[float]]  # seed -> slowest rank (None: did not fit)


@dataclass
class PlanReport:
    """A sharding plan's report; ``to_dict()`` is ``plan.json``.

    ``cluster`` is the cluster as planned (``hbm_gb`` 0 on a CPU cluster), ``sharding`` the
    planner's options. ``model`` is the caller's description of what was planned (task, data
    set, ...; ``embedtrain plan`` fills it in), ``None`` when there is none.
    """

    cluster: ClusterConfig
    sharding: PlannerOptions
    summary: PlanSummary
    warnings: list[str]
    planner: PlannerInfo
    tables: list[TablePlan]
    ranks: list[RankLoad]
    model: Optional[dict[str, Any]] = None
    schema_version: int = SCHEMA_VERSION

    @property
    def memory_tier(self) -> MemoryTier:
        """The device memory the plan fills (``summary.memory_tier``)."""
        return self.summary.memory_tier

    def table(self, name: str) -> TablePlan:
        """The plan of table ``name``.

        Raises:
            KeyError: no table of that name.
        """
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"the plan has no table {name!r}")

    def to_dict(self) -> dict[str, Any]:
        """``plan.json``'s content: plain data (enums as their values), keys in schema order."""
        out = {
            "schema_version": self.schema_version,
            "cluster": {**to_dict(self.cluster), "world_size": self.cluster.world_size},
            "sharding": to_dict(self.sharding),
            "summary": to_dict(self.summary),
            "warnings": list(self.warnings),
            "planner": to_dict(self.planner),
            "tables": [to_dict(t) for t in self.tables],
            "ranks": [r.to_dict() for r in self.ranks],
        }
        if self.model is not None:
            out["model"] = to_dict(self.model)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "plan.json") -> PlanReport:
        """Reads :meth:`to_dict`'s form (e.g. a loaded ``plan.json``).

        Raises:
            ConfigError: the cluster or sharding section is malformed (naming ``source``).
            KeyError, TypeError: another section lacks a key or has an unknown one.
        """
        cluster = {k: v for k, v in data["cluster"].items() if k != "world_size"}
        summary = {**data["summary"], "memory_tier": MemoryTier(data["summary"]["memory_tier"])}
        return cls(
            cluster=from_dict(ClusterConfig, cluster, source, "cluster."),
            sharding=from_dict(PlannerOptions, data["sharding"], source, "sharding."),
            summary=PlanSummary(**summary),
            warnings=list(data["warnings"]),
            planner=PlannerInfo(**data["planner"]),
            tables=[_table_from_dict(t) for t in data["tables"]],
            ranks=[RankLoad.from_dict(r) for r in data["ranks"]],
            model=data.get("model"),
            schema_version=data["schema_version"],
        )


def _table_from_dict(data: dict[str, Any]) -> TablePlan:
    return dataclasses.replace(TablePlan(**data), shards=[ShardPlan(**s) for s in data["shards"]])
