"""A pruning, compact enumerator for TorchRec's planner.

TorchRec's :class:`EmbeddingEnumerator` builds every (sharding type × compute kernel) option of
every table, estimates the perf and storage of every shard, and deep-copies the result. With 128
ranks a row-wise option has 128 shards, and estimating one shard costs about a millisecond, so
1,000 tables take minutes before the search even starts. This enumerator gives the *same*
estimates (a test compares them shard by shard) at a fraction of the cost:

* **Compact estimation.** A shard's estimate depends only on its size and on option-wide
  inputs, and the shards of an option come in at most a few distinct sizes (row-wise: 127 equal
  blocks and a remainder). Each option is estimated with one representative shard per distinct
  size; :meth:`CompactEnumerator.expand` rebuilds the full shard list when the search needs it.
* **Pruning before estimating.** Options that cannot win are never built: host-memory kernels
  (``fused_uvm``, ``fused_uvm_caching``) are only offered for tables named in
  ``offload_tables`` (the planner adds the largest tables there when the model does not fit in
  device memory; slower than ``fused`` otherwise), and ``data_parallel`` only for tables whose
  constraints list it: a replicated table costs an all-reduce of its whole gradient every step,
  and TorchRec hands it to the *dense* optimizer (its lookup is a DDP module), so choosing it
  silently would change how the table trains.
* **No deep copy** of the search space (the stock enumerator caches one; most of its time).

Options come out in a deterministic order (the stock enumerator iterates over sets of strings,
whose order changes between processes).

Example:
    >>> enum = CompactEnumerator(topology, batch_size=512, constraints=constraints)
    >>> options = enum.enumerate(model, sharders)       # compact: distinct shard sizes only
    >>> full = enum.expand(options[0])                   # every shard, with its estimates
"""

from __future__ import annotations

import copy
from typing import Iterable, Optional

from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.enumerators import (
    EmbeddingEnumerator,
    _extract_constraints_for_param,
    get_partition_by_type,
)
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    Shard,
    ShardingOption,
    Topology,
)
from torchrec.distributed.planner.utils import build_sharder_data_map, sharder_name
from torchrec.distributed.sharding_plan import calculate_shard_sizes_and_offsets
from torchrec.distributed.types import ModuleSharder, ShardingType

SHARDING_TYPE_ORDER = [
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
    ShardingType.DATA_PARALLEL.value,
]
KERNEL_ORDER = [
    EmbeddingComputeKernel.FUSED.value,
    EmbeddingComputeKernel.DENSE.value,
    EmbeddingComputeKernel.FUSED_UVM_CACHING.value,
    EmbeddingComputeKernel.FUSED_UVM.value,
]
OFFLOAD_KERNELS = {EmbeddingComputeKernel.FUSED_UVM.value,
                   EmbeddingComputeKernel.FUSED_UVM_CACHING.value}

OptionKey = tuple[str, str, str]  # (fqn, sharding type, compute kernel)


def option_key(option: ShardingOption) -> OptionKey:
    return (option.fqn, option.sharding_type, option.compute_kernel)


class CompactEnumerator(EmbeddingEnumerator):
    """Enumerates pruned sharding options with compact (distinct-size) shard lists.

    Args:
        topology: the target cluster.
        batch_size: examples per rank per step.
        constraints: TorchRec per-table constraints (sharding types, kernels, pooling factors).
        offload_tables: tables also offered host-memory kernels (``fused_uvm*``).
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        constraints: Optional[dict[str, ParameterConstraints]] = None,
        offload_tables: Iterable[str] = (),
    ) -> None:
        super().__init__(topology=topology, batch_size=batch_size, constraints=constraints)
        self.offload_tables = set(offload_tables)
        self._layouts: dict[OptionKey, list[tuple[list[int], list[int]]]] = {}
        self.num_estimated_shards = 0

    def enumerate(
        self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]
    ) -> list[ShardingOption]:
        """Estimated, compact sharding options of every shardable table of ``module``."""
        self._sharder_map = {sharder_name(s.module_type): s for s in sharders}
        self._sharder_data_map = build_sharder_data_map(self._sharder_map)
        options: list[ShardingOption] = []
        for path, child in _shardable_modules(module, self._sharder_map):
            sharder_key = sharder_name(type(child))
            sharder = self._sharder_map[sharder_key]
            is_pooled = ShardingOption.module_pooled(child, path)
            for name, param in sharder.shardable_parameters(child).items():
                options.extend(self._table_options(
                    name, param, path, child, sharder, sharder_key, is_pooled))
        self.populate_estimates(options)
        return options

    def _table_options(self, name, param, path, child, sharder, sharder_key, is_pooled):
        (input_lengths, col_wise_shard_dim, cache_params, enforce_hbm, stochastic_rounding,
         bounds_check_mode, feature_names, output_dtype, device_group,
         key_value_params) = _extract_constraints_for_param(self._constraints, name)
        if device_group and device_group != self._compute_device:
            return []
        types = self._filter_sharding_types(
            name, sharder.sharding_types(self._compute_device), sharder_key)
        options = []
        for sharding_type in _ordered(types, SHARDING_TYPE_ORDER):
            if (sharding_type == ShardingType.DATA_PARALLEL.value
                    and not self._explicit(name, "sharding_types", sharding_type)):
                continue
            kernels = self._filter_compute_kernels(
                name, sharder.compute_kernels(sharding_type, self._compute_device), sharding_type)
            for kernel in _ordered(kernels, KERNEL_ORDER):
                if (kernel in OFFLOAD_KERNELS and name not in self.offload_tables
                        and not self._explicit(name, "compute_kernels", kernel)):
                    continue
                if kernel not in KERNEL_ORDER and not self._explicit(name, "compute_kernels", kernel):
                    continue  # key-value / SSD kernels only when asked for by name
                sizes, offsets = calculate_shard_sizes_and_offsets(
                    tensor=param, world_size=self._world_size,
                    local_world_size=self._local_world_size, sharding_type=sharding_type,
                    col_wise_shard_dim=col_wise_shard_dim,
                    device_memory_sizes=self._device_memory_sizes)
                option = ShardingOption(
                    name=name, tensor=param, module=(path, child), input_lengths=input_lengths,
                    batch_size=self._batch_size, compute_kernel=kernel,
                    sharding_type=sharding_type, partition_by=get_partition_by_type(sharding_type),
                    shards=_distinct_shards(sizes, offsets), cache_params=cache_params,
                    enforce_hbm=enforce_hbm, stochastic_rounding=stochastic_rounding,
                    bounds_check_mode=bounds_check_mode, is_pooled=is_pooled,
                    feature_names=feature_names, output_dtype=output_dtype,
                    key_value_params=key_value_params)
                self._layouts[option_key(option)] = list(zip(sizes, offsets))
                options.append(option)
        return options

    def _explicit(self, name: str, field: str, value: str) -> bool:
        c = (self._constraints or {}).get(name)
        return bool(c and getattr(c, field) and value in getattr(c, field))

    def populate_estimates(self, sharding_options: list[ShardingOption]) -> None:
        self.num_estimated_shards += sum(len(o.shards) for o in sharding_options)
        super().populate_estimates(sharding_options)

    def shard_counts(self, option: ShardingOption) -> list[int]:
        """How many shards of the full option each compact shard stands for."""
        counts: dict[tuple[int, ...], int] = {}
        for size, _ in self._layouts[option_key(option)]:
            counts[tuple(size)] = counts.get(tuple(size), 0) + 1
        return [counts[tuple(s.size)] for s in option.shards]

    def expand(self, option: ShardingOption) -> ShardingOption:
        """A copy of compact ``option`` with all its shards, each carrying its estimates."""
        by_size = {tuple(s.size): s for s in option.shards}
        full = copy.copy(option)
        full.shards = []
        for size, offset in self._layouts[option_key(option)]:
            rep = by_size[tuple(size)]
            full.shards.append(Shard(size=list(size), offset=list(offset),
                                     storage=rep.storage, perf=rep.perf))
        return full


def _shardable_modules(module: nn.Module, sharder_map: dict) -> list[tuple[str, nn.Module]]:
    found, queue = [], [("", module)]
    while queue:
        path, child = queue.pop(0)
        if sharder_name(type(child)) in sharder_map:
            found.append((path, child))
            continue
        queue.extend((f"{path}.{n}" if path else n, m) for n, m in child.named_children())
    return found


def _ordered(values: Iterable[str], order: list[str]) -> list[str]:
    rank = {v: i for i, v in enumerate(order)}
    return sorted(values, key=lambda v: (rank.get(v, len(order)), v))


def _distinct_shards(sizes: list[list[int]], offsets: list[list[int]]) -> list[Shard]:
    seen: dict[tuple[int, ...], Shard] = {}
    for size, offset in zip(sizes, offsets):
        seen.setdefault(tuple(size), Shard(size=list(size), offset=list(offset)))
    return list(seen.values())
