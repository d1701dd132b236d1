"""The plan search: few, well-chosen proposals, each placed by TorchRec's partitioner.

TorchRec's default planner runs four proposers (grid search, two greedy sweeps, uniform) and
partitions every proposal they make: thousands of partitions for a hundred tables, a number that
grows with the tables, and a partition that grows with them too. The search here keeps the good
proposals and skips the rest:

1. **Seeds**: every table at its fastest option by its slowest shard ("depth", what TorchRec's
   greedy proposer starts from), by its total time, and one *uniform* proposal per sharding
   type (all tables column-wise, all table-row-wise, ...; TorchRec's uniform proposer). Each is
   placed by TorchRec's :class:`GreedyPerfPartitioner` and rated by its slowest rank, as
   TorchRec's ``NoopPerfModel`` does.
2. **Storage repair**: when no seed fits, the table with the largest shard moves to its fastest
   option with a smaller shard, until the proposal fits or no table can shrink (the caller may
   then allow host-memory kernels and search again).
3. **Bottleneck descent**: from the best plan, the tables with shards on the slowest rank are
   moved, heaviest first, to other options; a move is partitioned only if a lower bound on its
   rating (total work spread evenly, or the per-rank work every rank must do anyway) beats the
   best plan so far, and it is kept if the partitioned plan is faster. ``budget`` caps the
   number of partitions spent here.

Example:
    >>> result = search_plan(options, enumerator.expand, storage_constraint, budget=48)
    >>> result.rating, result.stats.partitions
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner
from torchrec.distributed.planner.types import PlannerError, ShardingOption, Topology
from torchrec.distributed.types import ShardingType

from embedtrain.sharding.types import MemoryTier

Choice = tuple[int, ...]  # per table, the index of its option


@dataclass
class SearchStats:
    proposals: int = 0  # distinct proposals considered
    partitions: int = 0  # of those, how many were placed by the partitioner
    pruned_by_bound: int = 0  # proposals skipped because their lower bound could not win
    seconds: float = 0.0
    seeds: dict[str, Optional[float]] = field(default_factory=dict)  # seed -> rating (None: no fit)
    best_seed: str = ""
    improving_moves: int = 0


@dataclass
class SearchResult:
    plan: Optional[list[ShardingOption]]  # full options with shard ranks; None when nothing fits
    rating: float  # estimated time of the slowest rank, ms (inf when nothing fits)
    stats: SearchStats


def _depth(o: ShardingOption) -> float:
    return max(s.perf.total for s in o.shards)


def _stored(o: ShardingOption, tier: MemoryTier) -> float:
    return max(getattr(s.storage, tier.value) for s in o.shards)


class _Evaluator:
    """Partitions proposals (with caching) and remembers the best one."""

    def __init__(self, tables: list[list[ShardingOption]], expand, storage_constraint: Topology,
                 counts: list[list[list[int]]]) -> None:
        self.tables = tables
        self.expand = expand
        self.storage_constraint = storage_constraint
        self.world = storage_constraint.world_size
        self.partitioner = GreedyPerfPartitioner()
        self.cache: dict[Choice, Optional[float]] = {}
        self.expanded: dict[tuple[int, int], ShardingOption] = {}
        self.stats = SearchStats()
        self.best: Optional[Choice] = None
        self.best_rating = float("inf")
        self.best_ranks: list[float] = []
        # Work each option adds: in total, and on every rank regardless of placement.
        self.total = [[sum(s.perf.total * c for s, c in zip(o.shards, n)) for o, n in zip(t, tn)]
                      for t, tn in zip(tables, counts)]
        self.uniform = [[self.total[i][j] / self.world
                         if o.sharding_type in (ShardingType.ROW_WISE.value,
                                                ShardingType.DATA_PARALLEL.value) else 0.0
                         for j, o in enumerate(t)] for i, t in enumerate(tables)]

    def full(self, choice: Choice) -> list[ShardingOption]:
        out = []
        for i, j in enumerate(choice):
            key = (i, j)
            if key not in self.expanded:
                self.expanded[key] = self.expand(self.tables[i][j])
            out.append(self.expanded[key])
        return out

    def lower_bound(self, choice: Choice) -> float:
        total = sum(self.total[i][j] for i, j in enumerate(choice))
        uniform = sum(self.uniform[i][j] for i, j in enumerate(choice))
        return max(total / self.world, uniform)

    def rate(self, choice: Choice, prune: bool = False) -> Optional[float]:
        if choice in self.cache:
            return self.cache[choice]
        self.stats.proposals += 1
        if prune and self.lower_bound(choice) >= self.best_rating:
            self.stats.pruned_by_bound += 1
            self.cache[choice] = float("inf")
            return float("inf")
        proposal = self.full(choice)
        self.stats.partitions += 1
        try:
            plan = self.partitioner.partition(proposal=proposal,
                                              storage_constraint=self.storage_constraint)
        except PlannerError:
            self.cache[choice] = None
            return None
        ranks = [0.0] * self.world
        for option in plan:
            for shard in option.shards:
                ranks[shard.rank] += shard.perf.total
        rating = max(ranks)
        self.cache[choice] = rating
        if rating < self.best_rating:
            self.best, self.best_rating, self.best_ranks = choice, rating, ranks
        return rating

    def place(self, choice: Choice) -> list[ShardingOption]:
        """The partitioned plan of ``choice`` (partitioning is deterministic)."""
        return self.partitioner.partition(proposal=self.full(choice),
                                          storage_constraint=self.storage_constraint)


def search_plan(
    options: list[ShardingOption],
    expand: Callable[[ShardingOption], ShardingOption],
    counts: Callable[[ShardingOption], list[int]],
    storage_constraint: Topology,
    budget: int = 48,
    tier: MemoryTier = MemoryTier.HBM,
) -> SearchResult:
    """Searches for the plan whose slowest rank is fastest.

    Args:
        options: compact, estimated options of all tables (from :class:`CompactEnumerator`).
        expand: rebuilds an option's full shard list.
        counts: for a compact option, how many full shards each of its shards stands for.
        storage_constraint: the topology with capacities left after reservations.
        budget: partitions the bottleneck descent may spend.
        tier: the memory the storage repair shrinks first (HBM, or DDR on CPU).

    Returns:
        The best plan found (ranks assigned), its rating and search statistics.
    """
    start = time.perf_counter()
    by_table: dict[str, list[ShardingOption]] = {}
    for o in options:
        by_table.setdefault(o.fqn, []).append(o)
    tables = [sorted(t, key=lambda o: (_depth(o), o.total_perf)) for t in by_table.values()]
    ev = _Evaluator(tables, expand, storage_constraint, [[counts(o) for o in t] for t in tables])

    seeds: dict[str, Choice] = {
        "fastest_shard": tuple(0 for _ in tables),
        "fastest_total": tuple(min(range(len(t)), key=lambda j: t[j].total_perf) for t in tables),
    }
    types = sorted({o.sharding_type for o in options})
    for st in types:
        seeds[f"uniform_{st}"] = tuple(
            next((j for j, o in enumerate(t) if o.sharding_type == st), 0) for t in tables)
    for name, choice in seeds.items():
        rating = ev.rate(choice)
        ev.stats.seeds[name] = rating
        if rating is not None and ev.best == choice:
            ev.stats.best_seed = name

    if ev.best is None:
        _repair_storage(ev, seeds["fastest_shard"], tier)
        if ev.best is not None:
            ev.stats.best_seed = "storage_repair"
    if ev.best is None:
        ev.stats.seconds = time.perf_counter() - start
        return SearchResult(None, float("inf"), ev.stats)

    _descend(ev, budget)
    plan = ev.place(ev.best)
    ev.stats.seconds = time.perf_counter() - start
    return SearchResult(plan, ev.best_rating, ev.stats)


def _repair_storage(ev: _Evaluator, choice: Choice, tier: MemoryTier) -> None:
    current = list(choice)
    for _ in range(sum(len(t) for t in ev.tables)):
        if ev.rate(tuple(current)) is not None:
            return
        # The table with the largest shard moves to its fastest option with a smaller shard.
        best_i, best_size = None, 0.0
        for i, j in enumerate(current):
            size = _stored(ev.tables[i][j], tier)
            if size > best_size and any(_stored(o, tier) < size for o in ev.tables[i]):
                best_i, best_size = i, size
        if best_i is None:
            return
        current[best_i] = next(j for j, o in enumerate(ev.tables[best_i])
                               if _stored(o, tier) < best_size)


def _descend(ev: _Evaluator, budget: int) -> None:
    spent_at_start = ev.stats.partitions
    improved = True
    while improved and ev.stats.partitions - spent_at_start < budget:
        improved = False
        best = ev.best
        assert best is not None
        plan = ev.place(best)
        slowest = max(range(ev.world), key=lambda r: ev.best_ranks[r])
        load = []  # (work on the slowest rank, table)
        for i, option in enumerate(plan):
            w = sum(s.perf.total for s in option.shards if s.rank == slowest)
            if w > 0:
                load.append((w, i))
        for _, i in sorted(load, reverse=True):
            for j in range(len(ev.tables[i])):
                if j == best[i]:
                    continue
                candidate = best[:i] + (j,) + best[i + 1:]
                rating = ev.rate(candidate, prune=True)
                if rating is not None and ev.best == candidate:
                    ev.stats.improving_moves += 1
                    improved = True
                    break
                if ev.stats.partitions - spent_at_start >= budget:
                    return
            if improved:
                break
