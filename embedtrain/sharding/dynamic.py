"""Sharding dynamic (managed-collision) tables: TorchRec's sharder, one fused remap per
collection, and evicted rows reset on CPU.

A dynamic table (:mod:`embedtrain.tables.dynamic`) is a ``ManagedCollisionEmbeddingBagCollection``;
TorchRec shards it row-wise only (each shard remaps the ids of its block of the id range to its
rows). Its managed-collision collection (:class:`ShardedDynamicCollection`) remaps all of a
rank's table shards together when their remappers can be fused (``ManagedTable.fuse``, called by
name: this layer does not import the models): one id mix, one unique, one search and one
admission round for all tables instead of TorchRec's per-table loop, with the same rows,
admissions and counters (:func:`set_fused_remap` switches back to the per-table path, the
reference). TorchRec resets an evicted row's weights and optimizer state with FBGEMM's
``reset_weight_momentum``, which has no CPU kernel; :class:`ShardedDynamicTables` does it through
the table's views instead, on any device, for all tables' rows of a step at once.

Example:
    >>> sharders = [DynamicTablesSharder(ebc_sharder=EmbeddingBagCollectionAllTypesSharder())]
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch
from torch import Tensor, nn
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.mc_embeddingbag import (
    ManagedCollisionEmbeddingBagCollectionSharder,
    ShardedManagedCollisionEmbeddingBagCollection,
)
from torchrec.distributed.sharding.rw_sharding import RwSparseFeaturesDist
from torchrec.distributed.mc_modules import (
    ManagedCollisionCollectionContext,
    ManagedCollisionCollectionSharder,
    ShardedManagedCollisionCollection,
)
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def _bucketize_is_identity(dist: nn.Module) -> bool:
    """Whether a row-wise input distribution's bucketize leaves ids, lengths and order as they
    are: one rank (one bucket: every id stays, in order), the ids kept (TorchRec's managed
    collisions keep them) or one block per shard, no positions."""
    return (isinstance(dist, RwSparseFeaturesDist) and dist._world_size == 1
            and not dist._has_feature_processor and not dist._need_pos
            and (dist._keep_original_indices or not dist._has_multiple_blocks_per_shard)
            and dist.zch_bucketize_row_pos is None)


class _OneRankDist(nn.Module):
    """A row-wise input distribution in a world of one: the all-to-all without the bucketize."""

    def __init__(self, dist: RwSparseFeaturesDist) -> None:
        super().__init__()
        self._rw = dist  # weighted ids (the write path) take TorchRec's own, unchanged
        self.unbucketize_permute_tensor: Optional[Tensor] = None

    def forward(self, features: KeyedJaggedTensor):
        if features.weights_or_none() is not None:
            return self._rw(features)
        return self._rw._dist(features)


class ShardedDynamicCollection(ShardedManagedCollisionCollection):
    """TorchRec's sharded managed-collision collection, remapping this rank's table shards
    together.

    At construction the remappers are fused (``ManagedTable.fuse``, by name: their per-row
    buffers become views of one storage per buffer, before TorchRec wraps them as sharded
    tensors). Then a training or evaluation step mixes the ids of all tables in one call
    (:meth:`input_dist`) and remaps them in one (:meth:`compute`); TorchRec's per-table path
    runs instead when ``fused`` is off (:func:`set_fused_remap`: the reference) or the remappers
    cannot be fused (another policy, a threshold filter, 2D write weights, a lookup tracker).
    """

    fused: bool = True  # per collection: set_fused_remap

    def _initialize_torch_state(self) -> None:
        self.fused_tables = None
        if len(self._sharding_tables) == 1:
            tables = [self._managed_collision_modules[t] for t in self._sharding_tables[0]]
            fuse = getattr(type(tables[0]), "fuse", None) if tables else None
            self.fused_tables = fuse(tables) if fuse is not None else None
        super()._initialize_torch_state()
        if self.fused_tables is not None:
            splits = self._sharding_per_table_feature_splits[0]
            self._one_feature_per_table = all(n == 1 for n in splits)
            self._table_of_feature = torch.repeat_interleave(
                torch.arange(len(splits), device=self._device),
                torch.tensor(splits, device=self._device))
            self._table_index = torch.arange(len(splits), device=self._device)

    def _create_input_dists(self, input_feature_names: list[str]) -> None:
        """TorchRec's row-wise input distributions; in a world of one, without the bucketize
        (every id is in the one rank's block and keeps its value: FBGEMM's block bucketize into
        one bucket is the identity), only the all-to-all over the group of one."""
        super()._create_input_dists(input_feature_names)
        if self._env.world_size == 1:
            self._input_dists = nn.ModuleList(
                _OneRankDist(d) if _bucketize_is_identity(d) else d for d in self._input_dists)

    def _fusing(self, features: Optional[KeyedJaggedTensor] = None) -> bool:
        return (self.fused and self.fused_tables is not None and self.need_preprocess
                and self.post_lookup_tracker_fn is None
                and not (self._use_2d_weights if features is None
                         else self._has_2d_weights(features)))

    def input_dist(self, ctx: ManagedCollisionCollectionContext, features: KeyedJaggedTensor,
                   skip_permute: bool = False):
        """TorchRec's input distribution, the ids of all tables mixed in one call (TorchRec
        mixes them table by table: the same values, as the tables share the mix)."""
        if (not self._fusing(features) or (not skip_permute and self._features_order)
                or features.weights_or_none() is not None):
            return super().input_dist(ctx, features, skip_permute)
        mixed = KeyedJaggedTensor(
            keys=features.keys(), values=self.fused_tables.mix(features.values()),
            lengths=features.lengths(),
            stride_per_key_per_rank=features.stride_per_key_per_rank() or None)
        self.need_preprocess = False  # already mixed: TorchRec's path without its mixing loop
        try:
            return super().input_dist(ctx, mixed, skip_permute=True)
        finally:
            self.need_preprocess = True

    def compute(self, ctx: ManagedCollisionCollectionContext, dist_input: KJTList) -> KJTList:
        """The remapped ids of all tables (local rows), from one fused remap."""
        if not self._fusing():
            if self.fused_tables is not None:  # TorchRec's per-table code needs sorted ids
                self.fused_tables.compact()
            return super().compute(ctx, dist_input)
        (features,) = dist_input
        sharding_ctx = ctx.sharding_contexts[0]
        if not features.variable_stride_per_key():
            sharding_ctx.lengths_after_input_dist = features.lengths().view(-1, features.stride())
        rows = self.fused_tables.remap(features.values(), self._tables_of(features),
                                       self.training)
        if rows is None:  # evaluation of a checkpoint from more ranks: table by table
            return super().compute(ctx, dist_input)
        return KJTList([KeyedJaggedTensor(
            keys=self._sharding_features[0], values=rows, lengths=features.lengths(),
            weights=features.weights_or_none(),
            stride_per_key_per_rank=features._stride_per_key_per_rank)])

    def _tables_of(self, features: KeyedJaggedTensor) -> Tensor:
        """The table (index in the fused order) of each of ``features``' values, without a host
        read when the batch size is the same for every feature."""
        if features.variable_stride_per_key():
            per_feature = torch.tensor(features.length_per_key(), device=self._device)
        else:
            per_feature = features.lengths().view(len(features.keys()), -1).sum(1)
        per_table = per_feature if self._one_feature_per_table else torch.zeros(
            len(self._table_index), dtype=per_feature.dtype, device=self._device).index_add_(
            0, self._table_of_feature, per_feature)
        return torch.repeat_interleave(self._table_index, per_table,
                                       output_size=features.values().numel())

    def settle(self) -> None:
        """Admits every table's pending ids (before a checkpoint: ``ManagedTable.settle``)."""
        if self._fusing():
            self.fused_tables.settle()
        else:
            _settle_each(self._managed_collision_modules.values())


class DynamicCollectionSharder(ManagedCollisionCollectionSharder):
    """TorchRec's managed-collision collection sharder, building
    :class:`ShardedDynamicCollection`."""

    def shard(self, module, params, env, embedding_shardings,
              device: Optional[torch.device] = None, use_index_dedup: bool = False
              ) -> ShardedDynamicCollection:
        return ShardedDynamicCollection(module, params, env=env,
                                        device=device or torch.device("cpu"),
                                        embedding_shardings=embedding_shardings,
                                        use_index_dedup=use_index_dedup)


def set_fused_remap(model: nn.Module, enabled: bool) -> None:
    """Remap each collection of dynamic tables of ``model`` (sharded) together (the default) or
    table by table (TorchRec's path: the reference a test compares with).

    Raises:
        ValueError: a collection has ids waiting for their admission (the two paths keep them
            apart): switch before the first step, or right after a checkpoint's settle.
    """
    for module in model.modules():
        if not isinstance(module, ShardedDynamicCollection) or module.fused == enabled:
            continue
        fused = module.fused_tables
        waiting = (fused is not None and fused.pending()) or any(
            getattr(m, "_current_history_buffer_offset", 0)
            for m in module._managed_collision_modules.values())
        if waiting:
            raise ValueError("dynamic tables: ids wait for admission; switch the remap path "
                             "before the first step or right after a checkpoint")
        if fused is not None and not enabled:
            fused.compact()  # TorchRec's per-table code needs each table's ids sorted
        module.fused = enabled

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
        mcc = self._managed_collision_collection
        fused = getattr(mcc, "fused_tables", None)
        handouts = fused.take_handouts() if fused is not None else None
        if handouts is not None:
            self._reset_handouts(fused, handouts, cached, views)
        for table, rows in evictions_per_table.items():
            if rows is None or rows.numel() == 0:
                continue
            weights, states = self._views(table, cached, rows, views)
            if weights is not None:
                self._reset_rows(table, weights, states, rows.long())
        if cached:
            super()._evict(cached)

    def _views(self, table: str, cached: dict, rows: Tensor, views: dict):
        """``table``'s weights and optimizer-state views (built once per table batch a step),
        or None for a table with a cache (its rows go to TorchRec's reset, in ``cached``)."""
        tbe, index = self._table_to_tbe_and_index[table]
        if getattr(tbe, "lxu_cache_weights", torch.empty(0)).numel():
            cached[table] = rows
            return None, None
        if id(tbe) not in views:  # each call builds every table's views: once a step
            views[id(tbe)] = (tbe.split_embedding_weights(), tbe.split_optimizer_states())
        weights, states = views[id(tbe)]
        i = self._table_index(table, index)
        return weights[i], states[i] if i < len(states) else ()

    def _flat_rows(self, names: list[str]) -> Optional[tuple]:
        """Where the rows of ``names`` (one collection's tables, in the fused order) live in
        their table batch's storages, for one write per storage (:func:`_flat_layout`), kept
        while the storages stay. None when the tables are not all uncached, in one table
        batch, of one dimension, with contiguous rows (then table by table)."""
        tbes = {id(self._table_to_tbe_and_index[n][0]) for n in names}
        if len(tbes) != 1:
            return None
        tbe = self._table_to_tbe_and_index[names[0]][0]
        key = tuple(getattr(tbe, a).data_ptr() for a in _TBE_STORAGES if hasattr(tbe, a))
        kept = self.__dict__.get("_flat")
        if kept is not None and kept[0] == key:
            return kept[1]
        flat = None
        if not getattr(tbe, "lxu_cache_weights", torch.empty(0)).numel():
            weights = tbe.split_embedding_weights()
            states = tbe.split_optimizer_states()
            idx = [self._table_index(n, self._table_to_tbe_and_index[n][1]) for n in names]
            flat = _flat_layout([weights[i] for i in idx],
                                [states[i] if i < len(states) else () for i in idx])
        self.__dict__["_flat"] = (key, flat)
        return flat

    def _table_index(self, table: str, index: Tensor) -> int:
        cache = self.__dict__.setdefault("_table_indices", {})
        if table not in cache:
            cache[table] = int(index.item())
        return cache[table]

    @torch.no_grad()
    def _reset_handouts(self, fused, handouts, cached: dict, views: dict) -> None:
        """Fresh rows for what the fused remap handed out (:meth:`_reset_rows` for every table
        at once: the vectors of all rows drawn in one call per embedding dimension)."""
        tables, rows, ids, counts = handouts
        names = self._managed_collision_collection._sharding_tables[0]
        configs = self._embedding_module._table_name_to_config
        dims = {configs[n].embedding_dim for n in names}
        lows = [configs[n].get_weight_init_min() for n in names]
        highs = [configs[n].get_weight_init_max() for n in names]
        fresh = (fused.initial_vectors(tables, ids, dims.pop(), lows, highs)
                 if len(dims) == 1 else None)
        flat = self._flat_rows(names) if fresh is not None else None
        if flat is not None:  # every table's rows in one write per storage
            weights, first_rows, states = flat
            at = (first_rows.index_select(0, tables) + rows).to(weights.device)
            weights.index_put_((at,), fresh.to(device=weights.device, dtype=weights.dtype))
            for state, offsets, strides in states:
                at = offsets.index_select(0, tables) + rows * strides.index_select(0, tables)
                state.index_put_((at.to(state.device),), torch.zeros((), dtype=state.dtype,
                                                                     device=state.device))
            return
        for k, (part, n) in enumerate(zip(torch.split(rows, counts), counts)):
            if not n:
                continue
            weights, states = self._views(names[k], cached, part, views)
            if weights is None:
                continue
            start = sum(counts[:k])
            vectors = (fresh[start:start + n] if fresh is not None else fused.initial_vectors(
                tables[start:start + n], ids[start:start + n], weights.shape[1], lows, highs))
            self._write_rows(weights, states, part, vectors)

    @staticmethod
    def _write_rows(weights: Tensor, states, rows: Tensor, fresh: Tensor) -> None:
        rows = rows.to(weights.device)
        weights[rows] = fresh.to(device=weights.device, dtype=weights.dtype)
        for state in states:
            if state.dim() and state.shape[0] == weights.shape[0]:
                state[rows] = 0

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
        self._write_rows(weights, states, rows, fresh)

    def settle(self) -> None:
        """Admits every table's pending ids and resets the rows they got (before a checkpoint:
        see ``ManagedTable.settle``)."""
        mcc = self._managed_collision_collection
        if isinstance(mcc, ShardedDynamicCollection):
            mcc.settle()
        else:
            _settle_each(mcc._managed_collision_modules.values())
        self._evict(mcc.evict())


def _settle_each(modules) -> None:
    """``settle()`` of each remapper that has one (embedtrain's ``ManagedTable``)."""
    for module in modules:
        settle = getattr(module, "settle", None)
        if settle is not None:
            settle()


# a table batch's tensors that hold rows (a new one of them: the kept row layout is stale)
_TBE_STORAGES = tuple(f"{name}_{where}" for name in ("weights", "momentum1", "momentum2")
                      for where in ("dev", "host", "uvm"))


def _flat_layout(weights: list[Tensor], states: list) -> Optional[tuple]:
    """The tables' rows as rows of one ``[rows, dim]`` tensor over their storage (with each
    table's first row in it), and the storage, element offset and row stride of each row-indexed
    optimizer state; None unless every kind shares one storage, rows are contiguous and of one
    dimension."""
    def storage(views: list[Tensor]):
        if any(v.dim() != 1 and v.stride(-1) != 1 for v in views):
            return None
        if len({v.untyped_storage().data_ptr() for v in views}) != 1:
            return None
        base = torch.empty(0, dtype=views[0].dtype, device=views[0].device).set_(
            views[0].untyped_storage())
        device = views[0].device
        return (base, torch.tensor([v.storage_offset() for v in views], device=device),
                torch.tensor([v.stride(0) for v in views], device=device))

    dim = weights[0].shape[1]
    if any(w.shape[1] != dim or w.stride() != (dim, 1) or w.storage_offset() % dim
           for w in weights):
        return None
    rows = storage(weights)
    kinds = [[s for s in table if s.dim() and s.shape[0] == w.shape[0]]
             for table, w in zip(states, weights)]
    if rows is None or len({len(k) for k in kinds}) != 1 or any(
            s.dim() != 1 for k in kinds for s in k):  # row-wise states only (else per table)
        return None
    flats = [storage([k[j] for k in kinds]) for j in range(len(kinds[0]))]
    if any(f is None for f in flats):
        return None
    base, offsets, _ = rows
    as_rows = base[:base.numel() - base.numel() % dim].view(-1, dim)
    return as_rows, offsets // dim, flats


def settle_dynamic_tables(model: nn.Module) -> None:
    """:meth:`ShardedDynamicTables.settle` of every dynamic table of a sharded model (each rank
    its own shards; no collective)."""
    for module in model.modules():
        if isinstance(module, ShardedDynamicTables):
            module.settle()


class DynamicTablesSharder(ManagedCollisionEmbeddingBagCollectionSharder):
    """TorchRec's managed-collection sharder (row-wise only), building
    :class:`ShardedDynamicTables`."""

    def __init__(self, ebc_sharder=None, mc_sharder: Optional[ManagedCollisionCollectionSharder]
                 = None, fused_params=None, qcomm_codecs_registry=None) -> None:
        super().__init__(ebc_sharder, mc_sharder or DynamicCollectionSharder(), fused_params,
                         qcomm_codecs_registry)

    def shard(self, module: ManagedCollisionEmbeddingBagCollection, params, env,
              device: Optional[torch.device] = None, module_fqn: Optional[str] = None
              ) -> ShardedDynamicTables:
        return ShardedDynamicTables(module, params, ebc_sharder=self._e_sharder,
                                    mc_sharder=self._mc_sharder, env=env,
                                    device=device or torch.device("cpu"))
