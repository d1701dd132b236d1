"""The plan search: few, well-chosen proposals, each placed by TorchRec's greedy rule.

TorchRec's default planner runs four proposers (grid search, two greedy sweeps, uniform) and
partitions every proposal they make: thousands of partitions for a hundred tables, a number that
grows with the tables, and a partition that grows with them too. The search here keeps the good
proposals and skips the rest:

1. **Seeds**: every table at its fastest option by its slowest shard ("depth", what TorchRec's
   greedy proposer starts from), by its total time, and one *uniform* proposal per sharding
   type (all tables column-wise, all table-row-wise, ...; TorchRec's uniform proposer). Each is
   placed by TorchRec's :class:`GreedyPerfPartitioner` rule (run on compact options by
   :class:`~embedtrain.sharding.partition.CompactPartitioner`, the same ranks) and rated by its
   slowest rank, as TorchRec's ``NoopPerfModel`` does.
2. **Storage repair**: when no seed fits, the table with the largest shard moves to its fastest
   option with a smaller shard, until the proposal fits or no table can shrink (the caller may
   then allow host-memory kernels and search again).
   Where the cluster has a fixed cost per sharding type (``sharding_group_ms``, calibrated on
   CPU clusters), every rank pays it once for each sharding type a proposal uses, so a rating
   is the slowest rank plus that cost times the number of types.
3. **Bottleneck descent**: from the best plan, the tables with shards on the slowest rank are
   moved, heaviest first, to other options; a move is partitioned only if a lower bound on its
   rating (total work spread evenly, or the per-rank work every rank must do anyway) beats the
   best plan so far, and it is kept if the partitioned plan is faster. ``budget`` caps the
   number of partitions spent here.

Example:
    >>> result = search_plan(options, enumerator.expand, enumerator.shard_counts,
    ...                      storage_constraint, budget=48, runs=enumerator.runs)
    >>> result.rating, result.stats.partitions
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner
from torchrec.distributed.planner.types import PlannerError, ShardingOption, Storage, Topology
from torchrec.distributed.types import ShardingType

from embedtrain.sharding.partition import CompactPartitioner, Placed, compact, supported
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
                 counts: list[list[list[int]]], runs=None, group_ms: float = 0.0) -> None:
        self.tables = tables
        self.counts = counts
        self.group_ms = group_ms
        self.expand = expand
        self.storage_constraint = storage_constraint
        self.world = storage_constraint.world_size
        # Compact placement where every option allows it; TorchRec's partitioner otherwise.
        self.runs = runs if runs and all(supported(o) for t in tables for o in t) else None
        self.partitioner = (CompactPartitioner(storage_constraint) if self.runs
                            else GreedyPerfPartitioner())
        self.cache: dict[Choice, Optional[float]] = {}
        self.compact: dict[tuple[int, int], object] = {}
        self.stats = SearchStats()
        self.best: Optional[Choice] = None
        self.best_rating = float("inf")
        self.best_ranks: list[float] = []
        self.best_placed: Optional[Placed] = None
        self.last: tuple[Optional[Choice], Optional[Placed]] = (None, None)
        # Work each option adds: in total, and on every rank regardless of placement.
        self.total = [[sum(s.perf.total * c for s, c in zip(o.shards, n)) for o, n in zip(t, tn)]
                      for t, tn in zip(tables, counts)]
        self.uniform = [[self.total[i][j] / self.world
                         if o.sharding_type in (ShardingType.ROW_WISE.value,
                                                ShardingType.DATA_PARALLEL.value) else 0.0
                         for j, o in enumerate(t)] for i, t in enumerate(tables)]

    def _compact(self, i: int, j: int):
        key = (i, j)
        if key not in self.compact:
            option = self.tables[i][j]
            self.compact[key] = compact(option, self.runs(option))
        return self.compact[key]

    def full(self, choice: Choice) -> list[ShardingOption]:
        return [self.expand(self.tables[i][j]) for i, j in enumerate(choice)]

    def groups_ms(self, choice: Choice) -> float:
        """The fixed cost every rank pays for the sharding types ``choice`` uses."""
        if not self.group_ms:
            return 0.0
        return self.group_ms * sharding_groups(self.tables[i][j] for i, j in enumerate(choice))

    def lower_bound(self, choice: Choice) -> float:
        total = sum(self.total[i][j] for i, j in enumerate(choice))
        uniform = sum(self.uniform[i][j] for i, j in enumerate(choice))
        return max(total / self.world, uniform) + self.groups_ms(choice)

    def _placed(self, choice: Choice) -> Optional[Placed]:
        """``choice`` placed: each table's rank per shard and each rank's time, or None."""
        if self.runs:
            return self.partitioner.partition([self._compact(i, j) for i, j in enumerate(choice)])
        try:
            plan = self.partitioner.partition(proposal=self.full(choice),
                                              storage_constraint=self.storage_constraint)
        except PlannerError:
            return None
        ranks = np.zeros(self.world)
        for option in plan:
            for shard in option.shards:
                ranks[shard.rank] += shard.perf.total
        return Placed(ranks=[np.array([s.rank for s in o.shards]) for o in plan],
                      rank_ms=ranks, rating=float(ranks.max()))

    def rate(self, choice: Choice, bound: Optional[float] = None) -> Optional[float]:
        """``choice``'s rating (None: it does not fit); ``inf`` without partitioning it when its
        lower bound is at least ``bound``."""
        if choice in self.cache:
            return self.cache[choice]
        self.stats.proposals += 1
        if bound is not None and self.lower_bound(choice) >= bound:
            self.stats.pruned_by_bound += 1
            return float("inf")
        self.stats.partitions += 1
        placed = self._placed(choice)
        self.last = (choice, placed)
        if placed is None:
            self.cache[choice] = None
            return None
        rating = placed.rating + self.groups_ms(choice)
        self.cache[choice] = rating
        if rating < self.best_rating:
            self.best, self.best_rating = choice, rating
            self.best_ranks, self.best_placed = placed.rank_ms.tolist(), placed
        return rating

    def placed_of(self, choice: Choice) -> Placed:
        """The placement of a rated ``choice`` (partitioned again if it is not at hand)."""
        if choice == self.best and self.best_placed is not None:
            return self.best_placed
        if self.last[0] == choice and self.last[1] is not None:
            return self.last[1]
        self.stats.partitions += 1
        placed = self._placed(choice)
        assert placed is not None
        return placed

    def work_on(self, rank: int, choice: Choice, placed: Placed) -> list[tuple[float, int]]:
        """``choice``'s tables with work on ``rank``: (their time there, table)."""
        out = []
        for i, (j, ranks) in enumerate(zip(choice, placed.ranks)):
            option = self.tables[i][j]
            if self.runs:
                c = self._compact(i, j)
                mine = c.index[ranks == rank]
                w = float(sum(option.shards[k].perf.total for k in mine))
            else:
                w = sum(s.perf.total for s, r in zip(self.expand(option).shards, ranks)
                        if r == rank)
            if w > 0:
                out.append((w, i))
        return out

    def place(self, choice: Choice) -> list[ShardingOption]:
        """The partitioned plan of ``choice``: full options, each shard with its rank."""
        placed = self.best_placed if choice == self.best else self._placed(choice)
        assert placed is not None
        plan = self.full(choice)
        for option, ranks in zip(plan, placed.ranks):
            for shard, r in zip(option.shards, ranks.tolist()):
                shard.rank = r
        return plan


def sharding_groups(options) -> int:
    """How many sharding groups (input and output distributions) a plan of ``options`` runs:
    one per sharding type per sharded module, data-parallel tables having none."""
    return len({(o.path, o.sharding_type) for o in options
                if o.sharding_type != ShardingType.DATA_PARALLEL.value})


def search_plan(
    options: list[ShardingOption],
    expand: Callable[[ShardingOption], ShardingOption],
    counts: Callable[[ShardingOption], list[int]],
    storage_constraint: Topology,
    budget: int = 48,
    tier: MemoryTier = MemoryTier.HBM,
    runs: Optional[Callable[[ShardingOption], list]] = None,
    group_ms: float = 0.0,
) -> SearchResult:
    """Searches for the plan whose slowest rank is fastest.

    Args:
        options: compact, estimated options of all tables (from :class:`CompactEnumerator`).
        expand: rebuilds an option's full shard list.
        counts: for a compact option, how many full shards each of its shards stands for.
        storage_constraint: the topology with capacities left after reservations.
        budget: partitions the bottleneck descent may spend.
        tier: the memory the storage repair shrinks first (HBM, or DDR on CPU).
        runs: an option's shards as runs of equal shards (:meth:`CompactEnumerator.runs`):
            proposals are then placed on compact options; without it, on expanded ones by
            TorchRec's partitioner (the same ranks, slower).
        group_ms: the fixed cost per step, on every rank, of each sharding type a plan uses.

    Returns:
        The best plan found (ranks assigned), its rating and search statistics.
    """
    start = time.perf_counter()
    by_table: dict[str, list[ShardingOption]] = {}
    for o in options:
        by_table.setdefault(o.fqn, []).append(o)
    tables = [sorted(t, key=lambda o: (_depth(o), o.total_perf)) for t in by_table.values()]
    ev = _Evaluator(tables, expand, storage_constraint, [[counts(o) for o in t] for t in tables],
                    runs, group_ms)

    seeds: dict[str, Choice] = {
        "fastest_shard": tuple(0 for _ in tables),
        "fastest_total": tuple(min(range(len(t)), key=lambda j: t[j].total_perf) for t in tables),
    }
    types = sorted({o.sharding_type for o in options})
    devices = storage_constraint.devices
    room = Storage(hbm=max(d.storage.hbm for d in devices),  # an upper bound per tier: an
                   ddr=max(d.storage.ddr for d in devices),  # option fitting no rank is out
                   ssd=max(d.storage.ssd for d in devices))

    def fits(o: ShardingOption) -> bool:
        return all(s.storage.fits_in(room) for s in o.shards)

    def fallback(t: list[ShardingOption], by_total: bool) -> int:
        ok = [j for j, o in enumerate(t) if fits(o)] or [0]
        return min(ok, key=lambda j: t[j].total_perf) if by_total else ok[0]

    for st in types:
        # every table of type st where its shards fit a rank, else its fastest option that does
        # (by its slowest shard, or by its total work: few tables or many)
        for by_total, suffix in ((False, ""), (True, "_else_least_work")):
            choice = tuple(
                next((j for j, o in enumerate(t) if o.sharding_type == st and fits(o)),
                     None) if any(o.sharding_type == st and fits(o) for o in t)
                else fallback(t, by_total) for t in tables)
            if choice not in seeds.values():
                seeds[f"uniform_{st}{suffix}"] = choice
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

    # Descend from the best proposal, then with what is left of the budget from the best seed
    # of another shape (the best seed's descent can stall where the slowest ranks tie).
    spent = ev.stats.partitions
    starts = [ev.best] + sorted(
        (c for c in dict.fromkeys(seeds.values()) if c != ev.best and ev.cache.get(c) is not None
         and ev.cache[c] < float("inf")), key=lambda c: ev.cache[c])[:1]
    for origin in starts:
        left = budget - (ev.stats.partitions - spent)
        if left <= 0:
            break
        _descend(ev, left, origin)
    plan = ev.place(ev.best)
    ev.stats.seconds = time.perf_counter() - start
    return SearchResult(plan, ev.best_rating, ev.stats)


def _repair_storage(ev: _Evaluator, choice: Choice, tier: MemoryTier) -> None:
    """From ``choice``, the table with the largest shard moves to its fastest option with a
    smaller shard, until a proposal fits or no table can shrink. A proposal whose tables need
    more memory in all than the ranks have is not partitioned; none is tried when even each
    table's smallest option would not fit in all."""
    tiers = ("hbm", "ddr", "ssd")
    have = [sum(getattr(d.storage, t) for d in ev.storage_constraint.devices) for t in tiers]
    need = [[[sum(getattr(s.storage, t) * c for s, c in zip(o.shards, n)) for t in tiers]
             for o, n in zip(opts, tn)] for opts, tn in zip(ev.tables, ev.counts)]
    if any(sum(min(n[k] for n in table) for table in need) > have[k] for k in range(3)):
        return  # cannot fit whatever the options
    current = list(choice)
    used = [sum(need[i][j][k] for i, j in enumerate(current)) for k in range(3)]
    largest = [(-_stored(ev.tables[i][j], tier), i) for i, j in enumerate(current)]
    heapq.heapify(largest)
    for _ in range(sum(len(t) for t in ev.tables)):
        if all(u <= h for u, h in zip(used, have)) and ev.rate(tuple(current)) is not None:
            return
        while largest:  # the table with the largest shard that has a smaller option
            size, i = heapq.heappop(largest)
            j = next((j for j, o in enumerate(ev.tables[i]) if _stored(o, tier) < -size), None)
            if j is not None:
                break
        else:
            return
        used = [u - a + b for u, a, b in zip(used, need[i][current[i]], need[i][j])]
        current[i] = j
        heapq.heappush(largest, (-_stored(ev.tables[i][j], tier), i))


def _descend(ev: _Evaluator, budget: int, start: Choice) -> None:
    """From ``start``, moves a table with work on the slowest rank to another option while that
    makes the proposal faster, heaviest table first, within ``budget`` partitions."""
    spent_at_start = ev.stats.partitions
    current, rating = start, ev.cache[start]
    placed = ev.placed_of(current)
    improved = True
    while improved and ev.stats.partitions - spent_at_start < budget:
        improved = False
        slowest = int(np.argmax(placed.rank_ms))
        for _, i in sorted(ev.work_on(slowest, current, placed), reverse=True):
            for j in range(len(ev.tables[i])):
                if j == current[i]:
                    continue
                candidate = current[:i] + (j,) + current[i + 1:]
                r = ev.rate(candidate, bound=rating)
                if r is not None and r < rating:
                    current, rating = candidate, r
                    placed = ev.placed_of(current)
                    ev.stats.improving_moves += 1
                    improved = True
                    break
                if ev.stats.partitions - spent_at_start >= budget:
                    return
            if improved:
                break
