"""TorchRec's greedy placement, on compact options: the same ranks, without a shard per rank.

TorchRec's :class:`GreedyPerfPartitioner` places a proposal shard by shard: uniform options
(row-wise, data-parallel: shard ``i`` on rank ``i``) first, then the other tables by total
storage, largest first: table-row-wise on the least-loaded host that holds it (its shards
uniformly over the host's ranks), table-column-wise by the device rule within that host, and
table-wise / column-wise shards each on the least-loaded rank (by estimated time, then local
rank, then rank) with room. On 1,024 ranks a row-wise option is 1,024 ``Shard`` objects, and a
proposal of 10,000 tables is millions; the partition then takes seconds and the search needs
dozens.

:class:`CompactPartitioner` runs the same algorithm on options kept as runs of equal shards
(:func:`~embedtrain.sharding.enumerator.shard_runs`): per-rank state in numpy arrays (storage
per tier, the five time components, added in TorchRec's order so ties break the same way), a
uniform option added to all ranks at once, and a heap of ``(time, local rank, rank)`` tuples
for device placement. A test checks it against TorchRec's partitioner rank by rank.

Example:
    >>> part = CompactPartitioner(storage_constraint)
    >>> placed = part.partition([compact(o, enumerator.runs(o)) for o in proposal])
    >>> placed.rating, placed.ranks[0]   # slowest rank's ms; table 0's rank per shard
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional

import numpy as np
from torchrec.distributed.planner.types import PartitionByType, ShardingOption, Topology
from torchrec.distributed.types import ShardingType

from embedtrain.sharding.enumerator import Runs

_PERF = ("fwd_compute", "bwd_compute", "fwd_comms", "bwd_comms", "prefetch_compute",
         "input_dist_comms")  # Perf.total adds the first five in this order
_TIERS = ("hbm", "ddr", "ssd")
_HOST_TYPES = {ShardingType.TABLE_ROW_WISE.value, ShardingType.TABLE_COLUMN_WISE.value}


def supported(option: ShardingOption) -> bool:
    """Whether :class:`CompactPartitioner` places ``option`` as TorchRec would (otherwise use
    TorchRec's partitioner): no grid sharding, no key-value column-wise, no dependencies."""
    return (option.partition_by in (PartitionByType.UNIFORM.value, PartitionByType.HOST.value,
                                    PartitionByType.DEVICE.value)
            and option.dependency is None
            and not (option.compute_kernel == "key_value"
                     and option.sharding_type == ShardingType.COLUMN_WISE.value))


@dataclass
class _Compact:
    """One option as arrays: per distinct shard its storage and perf, and its runs."""

    option: ShardingOption
    kind: str  # partition_by
    storage: np.ndarray  # (distinct, 3) float64 (exact for integers below 2^53)
    perf: np.ndarray  # (distinct, 6) float64
    index: np.ndarray  # per shard in order, its distinct shard's row (int32)
    total_storage: tuple[float, float, float]


@dataclass
class Placed:
    """A placed proposal: each option's rank per shard, each rank's time, the slowest."""

    ranks: list[np.ndarray]  # per option (proposal order), the rank of each shard
    rank_ms: np.ndarray  # per rank, the estimated time (TorchRec's ``Perf.total``)
    rating: float  # the slowest rank's time


def compact(option: ShardingOption, runs: Runs) -> _Compact:
    """``option`` (distinct shards, estimated) with its ``runs``, as arrays."""
    by_size = {tuple(s.size): i for i, s in enumerate(option.shards)}
    storage = np.array([[getattr(s.storage, t) for t in _TIERS] for s in option.shards],
                       dtype=np.float64)
    perf = np.array([[getattr(s.perf, p) for p in _PERF] for s in option.shards],
                    dtype=np.float64)
    index = np.repeat(np.array([by_size[size] for size, _ in runs], dtype=np.int32),
                      [n for _, n in runs])
    counts = np.bincount(index, minlength=len(option.shards))
    total = tuple(float(v) for v in (storage * counts[:, None]).sum(axis=0))
    return _Compact(option, option.partition_by, storage, perf, index, total)


class CompactPartitioner:
    """:class:`GreedyPerfPartitioner` (storage-sorted, TorchRec's default) on compact options.

    Args:
        storage_constraint: the topology with each rank's capacity left after reservations.
    """

    def __init__(self, storage_constraint: Topology) -> None:
        devices = storage_constraint.devices
        self.world = len(devices)
        self.local = storage_constraint.local_world_size
        self.group = storage_constraint.intra_group_size
        self.capacity = np.array([[getattr(d.storage, t) for t in _TIERS] for d in devices],
                                 dtype=np.float64)
        self.base_perf = np.array([[getattr(d.perf, p) for p in _PERF] for d in devices],
                                  dtype=np.float64)

    def partition(self, proposal: list[_Compact]) -> Optional[Placed]:
        """Places ``proposal`` (one compact option per table); ``None`` when it does not fit."""
        free = self.capacity.copy()
        perf = self.base_perf.copy()
        ranks: list[Optional[np.ndarray]] = [None] * len(proposal)
        for i, c in enumerate(proposal):
            if c.kind == PartitionByType.UNIFORM.value:
                if len(c.index) != self.world:
                    return None
                need = c.storage[c.index]
                if (need > free).any():
                    return None
                free -= need
                perf += c.perf[c.index]
                ranks[i] = np.arange(self.world, dtype=np.int32)
        rest = [i for i, c in enumerate(proposal) if c.kind != PartitionByType.UNIFORM.value]
        rest.sort(key=lambda i: proposal[i].total_storage, reverse=True)  # stable, as TorchRec
        state = _State(self, free, perf)
        for i in rest:
            c = proposal[i]
            placed = (state.on_a_host(c) if c.kind == PartitionByType.HOST.value
                      else state.on_devices(c))
            if placed is None:
                return None
            ranks[i] = placed
        rank_ms = self._rank_ms(proposal, ranks)
        return Placed(ranks=ranks, rank_ms=rank_ms, rating=float(rank_ms.max()))

    def _rank_ms(self, proposal: list[_Compact], ranks: list[np.ndarray]) -> np.ndarray:
        """Each rank's time as TorchRec's ``NoopPerfModel`` adds it: shard ``Perf.total``s, in
        proposal order and shard order (so ratings equal its to the last bit)."""
        acc = np.zeros(self.world)
        for c, r in zip(proposal, ranks):
            totals = _totals(c.perf)[c.index]
            if len(r) == self.world and c.kind == PartitionByType.UNIFORM.value:
                acc += totals  # one shard per rank
            else:
                np.add.at(acc, r, totals)  # unbuffered, in order
        return acc


def _totals(perf: np.ndarray) -> np.ndarray:
    """``Perf.total`` per rank, added in its order (fwd, bwd compute, fwd, bwd comms, prefetch)."""
    return perf[:, 0] + perf[:, 1] + perf[:, 2] + perf[:, 3] + perf[:, 4]


def _fits(need: np.ndarray, free: np.ndarray) -> bool:
    return bool(need[0] <= free[0] and need[1] <= free[1] and need[2] <= free[2])


class _State:
    """Each rank's free storage and time, with two heaps kept in step with them: ranks by
    ``(time, local rank, rank)`` (the device rule) and hosts by ``(sum of their ranks' times,
    host)`` (the host rule); entries of changed ranks and hosts are replaced, stale ones skipped
    by their version."""

    def __init__(self, part: CompactPartitioner, free: np.ndarray, perf: np.ndarray) -> None:
        self.free, self.perf = free, perf
        self.local, self.group = part.local, part.group
        self.total = _totals(perf)
        world = len(free)
        self.rank_version = [0] * world
        self.ranks = [(float(self.total[r]), r % self.local, r, 0) for r in range(world)]
        heapq.heapify(self.ranks)
        self.host_version = [0] * (world // self.group)
        self.hosts = [(self._host_ms(h), h, 0) for h in range(world // self.group)]
        heapq.heapify(self.hosts)

    def _host_ms(self, h: int) -> float:
        ms = 0  # TorchRec sums a host's ranks one by one, from 0
        for r in range(h * self.group, (h + 1) * self.group):
            ms += float(self.total[r])
        return ms

    def _changed(self, ranks) -> None:
        hosts = set()
        for r in ranks:
            p = self.perf[r]
            self.total[r] = p[0] + p[1] + p[2] + p[3] + p[4]
            self.rank_version[r] += 1
            heapq.heappush(self.ranks, (float(self.total[r]), r % self.local, r,
                                        self.rank_version[r]))
            if r // self.group < len(self.host_version):  # ranks past the last full group
                hosts.add(r // self.group)                # are not in the host rule (TorchRec)
        for h in hosts:
            self.host_version[h] += 1
            heapq.heappush(self.hosts, (self._host_ms(h), h, self.host_version[h]))

    def on_devices(self, c: _Compact) -> Optional[np.ndarray]:
        """TorchRec's device rule: each shard on the rank with the smallest ``(time, local
        rank, rank)`` that has room."""
        out = np.empty(len(c.index), dtype=np.int32)
        for n, k in enumerate(c.index):
            need = c.storage[k]
            aside = []
            while True:
                if not self.ranks:
                    return None
                entry = heapq.heappop(self.ranks)
                r = entry[2]
                if entry[3] != self.rank_version[r]:
                    continue  # stale
                if _fits(need, self.free[r]):
                    break
                aside.append(entry)
            self.free[r] -= need
            self.perf[r] += c.perf[k]
            out[n] = r
            for entry in aside:
                heapq.heappush(self.ranks, entry)
            self._changed((r,))
        return out

    def on_a_host(self, c: _Compact) -> Optional[np.ndarray]:
        """TorchRec's host rule: the least-loaded host (by the sum of its ranks' times) where
        the option fits: table-row-wise shards one per rank, table-column-wise by the device
        rule among the host's ranks."""
        need_total = np.array(c.total_storage)
        aside, placed = [], None
        while self.hosts:
            entry = heapq.heappop(self.hosts)
            h = entry[1]
            if entry[2] != self.host_version[h]:
                continue  # stale
            aside.append(entry)
            span = slice(h * self.group, (h + 1) * self.group)
            if (need_total > self.free[span].sum(axis=0)).any():
                continue
            placed = self._try_host(c, h * self.group)
            if placed is not None:
                break
        for entry in aside:
            heapq.heappush(self.hosts, entry)
        if placed is not None:
            self._changed(sorted(set(placed.tolist())))
        return placed

    def _try_host(self, c: _Compact, lo: int) -> Optional[np.ndarray]:
        span = slice(lo, lo + self.group)
        if c.option.sharding_type == ShardingType.TABLE_ROW_WISE.value:
            if len(c.index) != self.group:
                return None
            need = c.storage[c.index]
            if (need > self.free[span]).any():
                return None
            self.free[span] -= need
            self.perf[span] += c.perf[c.index]
            return np.arange(lo, lo + self.group, dtype=np.int32)
        free, perf = self.free[span].copy(), self.perf[span].copy()
        total = self.total[span].copy()
        heap = [(float(total[j]), j % self.group, j) for j in range(self.group)]
        heapq.heapify(heap)
        out = np.empty(len(c.index), dtype=np.int32)
        for n, k in enumerate(c.index):
            need = c.storage[k]
            aside = []
            while heap:
                key = heapq.heappop(heap)
                j = key[2]
                if _fits(need, free[j]):
                    free[j] -= need
                    perf[j] += c.perf[k]
                    p = perf[j]
                    heapq.heappush(heap, (float(p[0] + p[1] + p[2] + p[3] + p[4]),
                                          j % self.group, j))
                    out[n] = lo + j
                    break
                aside.append(key)
            else:
                return None
            for key in aside:
                heapq.heappush(heap, key)
        self.free[span], self.perf[span] = free, perf
        return out
