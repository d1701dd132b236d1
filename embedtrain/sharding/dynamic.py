"""Sharding dynamic (managed-collision) tables: TorchRec's sharder, resetting evicted rows on CPU.

A dynamic table (:mod:`embedtrain.models.dynamic`) is a ``ManagedCollisionEmbeddingBagCollection``;
TorchRec shards it row-wise only (each shard remaps the ids of its block of the id range to its
rows). TorchRec resets an evicted row's weights and optimizer state with FBGEMM's
``reset_weight_momentum``, which has no CPU kernel; :class:`ShardedDynamicTables` does it through
the table's views instead, on any device.

Example:
    >>> sharders = [DynamicTablesSharder(ebc_sharder=EmbeddingBagCollectionAllTypesSharder())]
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch
from torch import Tensor, nn
from torchrec.distributed.mc_embeddingbag import (
    ManagedCollisionEmbeddingBagCollectionSharder,
    ShardedManagedCollisionEmbeddingBagCollection,
)
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection

class ShardedDynamicTables(ShardedManagedCollisionEmbeddingBagCollection):
    """TorchRec's sharded managed collection, resetting evicted rows on any device.

    TorchRec resets an evicted row's weights and optimizer state with FBGEMM's
    ``reset_weight_momentum``, which has no CPU kernel. Here the rows are reset through the
    table's views (``split_embedding_weights`` / ``split_optimizer_states``): every row an id is
    given (a free one, or an evicted id's) starts from the table's initial uniform range, drawn
    by the remapper from a hash of the id (``ManagedTable.initial_vectors``), so an id starts
    alike on any number of ranks and in a resumed run; its optimizer state starts at zero. A
    table with a cache (``fused_uvm_caching``, GPU only) keeps TorchRec's reset (untested here:
    no GPU; it draws fresh rows from the global RNG and resets only rowwise Adagrad's state).
    """

    def _evict(self, evictions_per_table: dict[str, Optional[Tensor]]) -> None:
        cached, views = {}, {}
        for table, rows in evictions_per_table.items():
            if rows is None or rows.numel() == 0:
                continue
            tbe, index = self._table_to_tbe_and_index[table]
            if getattr(tbe, "lxu_cache_weights", torch.empty(0)).numel():
                cached[table] = rows
                continue
            if id(tbe) not in views:  # each call builds every table's views: once a step
                views[id(tbe)] = (tbe.split_embedding_weights(), tbe.split_optimizer_states())
            weights, states = views[id(tbe)]
            i = int(index.item())
            self._reset_rows(table, weights[i], states[i] if i < len(states) else (),
                             rows.long())
        if cached:
            super()._evict(cached)

    @torch.no_grad()
    def _reset_rows(self, table: str, weights: Tensor, states, rows: Tensor) -> None:
        """Fresh weights for ``rows`` of ``table`` (its view ``weights``) and zero optimizer
        state (``states``: its views; none for plain SGD)."""
        config = self._embedding_module._table_name_to_config[table]
        mcm = self._managed_collision_collection._managed_collision_modules[table]
        low, high = config.get_weight_init_min(), config.get_weight_init_max()
        initial = getattr(mcm, "initial_vectors", None)  # embedtrain's remapper: by id
        if initial is not None:
            fresh = initial(rows, weights.shape[1], low, high)
        else:  # a plain MCH module: by table, shard and step
            seed = (zlib.crc32(table.encode()) * 1_000_003 + mcm._current_iter * 7919
                    + mcm._output_global_offset) % 2**63
            fresh = torch.empty(rows.numel(), weights.shape[1]).uniform_(
                low, high, generator=torch.Generator().manual_seed(seed))
        rows = rows.to(weights.device)
        weights[rows] = fresh.to(device=weights.device, dtype=weights.dtype)
        for state in states:
            if state.dim() and state.shape[0] == weights.shape[0]:
                state[rows] = 0


    def settle(self) -> None:
        """Admits every table's pending ids and resets the rows they got (before a checkpoint:
        see ``ManagedTable.settle``)."""
        for module in self._managed_collision_collection._managed_collision_modules.values():
            settle = getattr(module, "settle", None)
            if settle is not None:
                settle()
        self._evict(self._managed_collision_collection.evict())


def settle_dynamic_tables(model: nn.Module) -> None:
    """:meth:`ShardedDynamicTables.settle` of every dynamic table of a sharded model (each rank
    its own shards; no collective)."""
    for module in model.modules():
        if isinstance(module, ShardedDynamicTables):
            module.settle()


class DynamicTablesSharder(ManagedCollisionEmbeddingBagCollectionSharder):
    """TorchRec's managed-collection sharder (row-wise only), building
    :class:`ShardedDynamicTables`."""

    def shard(self, module: ManagedCollisionEmbeddingBagCollection, params, env,
              device: Optional[torch.device] = None, module_fqn: Optional[str] = None
              ) -> ShardedDynamicTables:
        return ShardedDynamicTables(module, params, ebc_sharder=self._e_sharder,
                                    mc_sharder=self._mc_sharder, env=env,
                                    device=device or torch.device("cpu"))
