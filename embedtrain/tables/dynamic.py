"""Dynamic embedding tables: raw int64 ids remapped collision-free to rows, with eviction.

Built on TorchRec's managed-collision modules: a table marked dynamic becomes a
``ManagedCollisionEmbeddingBagCollection`` whose :class:`ManagedTable` (a
``MCHManagedCollisionModule``) keeps the ids that own a row sorted beside their rows, so a lookup
is a binary search and two distinct ids never share a row while the table has room. Ids seen in
a training step are admitted at the end of every ``eviction_interval`` steps, before that step's
lookup (interval 1: in the step they first appear); a full table gives up the ids its policy ranks
lowest (LRU, LFU, or TTL: LRU plus expiry after ``ttl_steps`` without a lookup), and their rows and
optimizer state are reset. Ids without a row -- never seen (every id of an evaluation that
training did not admit), or evicted -- look up the table's default row (the last row of each
row-wise shard), which is trained like any other.

Why MCH and not TorchRec's ``HashZchManagedCollisionModule``: MCH is exact (a sorted id list, no
probe limit, so "distinct ids get distinct rows below capacity" holds without exception) and its
policies count training steps, so a resumed run evicts exactly as the uninterrupted one; the
zero-collision hash's TTL reads the wall clock (``time.time()``), which no resume can replay, and
it gives up on an id after ``max_probe`` probes even with free rows. MCH's cost is a sort of the
shard's ids at each admission (``bench_dynamic_tables.py`` measures it).

Ids pass through :func:`mix_ids` first, a bijection of ``[0, 2^63)``: the row-wise shards split
the id range into equal blocks, and the mix spreads ids given in any pattern (small integers,
timestamps) evenly over them. :func:`unmix_ids` inverts it (the exported id -> row map).

Sharding: row-wise only, by :class:`embedtrain.sharding.dynamic.DynamicTablesSharder` (which also
resets evicted rows on CPU, where FBGEMM has no kernel for it). Sharded, a collection's tables
are remapped together (:meth:`ManagedTable.fuse`, :mod:`embedtrain.tables.fused`: one
sort, search and admission for all tables, the same rows as table by table); this module's
per-table path stays TorchRec's loop, the reference. The id mix lives in
:mod:`embedtrain.tables.ids` (re-exported here).

Example:
    >>> bags = embedding_bags(configs, {"t_user": DynamicTable(capacity=1_000_000)})
    >>> pooled = bags(kjt)                        # a KeyedTensor, keys in the configs' order
"""

from __future__ import annotations

from typing import Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (
    ManagedCollisionCollection, MCHEvictionPolicy, MCHManagedCollisionModule)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from embedtrain.features import SparseFeature
from embedtrain.tables.ids import (  # noqa: F401  (re-exported: the ids' module)
    EMPTY_ID,
    MIX_VERSION,
    checkpoint_default_rows,
    column_keys,
    id_uniforms,
    mix_ids,
    table_salt,
    unmix_ids,
)
from embedtrain.tables.fused import FusedTables, unfusable
from embedtrain.tables.policies import TTLEvictionPolicy, eviction_policy
from embedtrain.models.options import DynamicTable


def table_name(feature: str) -> str:
    """The embedding table of sparse feature ``feature``."""
    return f"t_{feature}"


class ManagedTable(MCHManagedCollisionModule):
    """TorchRec's MCH remapper with the counters a user reads, and TTL expiry.

    Per row (so they shard, checkpoint and reshard with the rows): ``_stat_lookups`` (training
    lookups that landed on the row; the last row's are default-row lookups) and
    ``_stat_admissions`` (ids given the row). Admitted minus occupied rows is the ids that lost
    their row (evicted or expired). Evaluation lookups are counted apart (``eval_lookups``,
    ``eval_default_lookups``, reset when the module enters eval mode), never in the checkpoint.
    """

    def __init__(self, zch_size: int, device: torch.device, eviction_policy: MCHEvictionPolicy,
                 eviction_interval: int, **kwargs) -> None:
        super().__init__(zch_size, device, eviction_policy, eviction_interval, **kwargs)
        self.register_buffer("_stat_lookups",
                             torch.zeros(zch_size, dtype=torch.int64, device=device))
        self.register_buffer("_stat_admissions",
                             torch.zeros(zch_size, dtype=torch.int32, device=device))
        self.register_buffer("_eval_counts", torch.zeros(2, dtype=torch.int64, device=device),
                             persistent=False)
        self._saved_segments: Optional[Tensor] = None  # a loaded checkpoint's, if it had more
        self._layout = self._output_segments_tensor.clone()  # this module's shard starts
        # (row, id) pairs handed out since the last evict(): what initial_vectors draws from
        self._fresh_rows: Optional[Tensor] = None
        self._fresh_ids: Optional[Tensor] = None

    @classmethod
    def fuse(cls, tables: Sequence["ManagedTable"]) -> Optional["FusedTables"]:
        """The remap of ``tables`` (one collection's, in its feature order) together
        (:class:`~embedtrain.tables.fused.FusedTables`: the same rows, admissions and
        counters as each table's own path, in a few ops for all), or None when they cannot be
        fused (another policy, a threshold filter: :func:`~embedtrain.tables.fused.
        unfusable`). The sharding layer calls it by name."""
        if any(type(t) is not cls for t in tables):
            return None  # a subclass may remap differently: each table on its own path
        return None if unfusable(tables) else FusedTables(tables)

    @property
    def default_row(self) -> int:
        """The (global) row of ids without one: this shard's last."""
        return self._output_global_offset + self._zch_size - 1

    def train(self, mode: bool = True) -> "ManagedTable":
        if not mode and self.training and self._eval_counts.device.type != "meta":
            self._eval_counts.zero_()
        return super().train(mode)

    def profile(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        """MCH's profile, with a history buffer that grows to hold every id of the interval.

        TorchRec sizes the buffer from the first batch (its ids x interval x 1.25) and drops the
        ids of later, larger batches that do not fit, which then never get a row: a shard of a
        row-wise table sees a different number of ids every step.
        """
        if self.training:
            self._saved_segments = None  # training goes on in this layout: its default rows
            if self._input_history_buffer_size == -1:
                self._init_history_buffers(features)
            need = self._current_history_buffer_offset + sum(
                jt.values().numel() for jt in features.values())
            if need > self._input_history_buffer_size:
                self._grow_history(max(need, 2 * self._input_history_buffer_size))
        return super().profile(features)

    def _grow_history(self, size: int) -> None:
        used = self._current_history_buffer_offset
        grown = torch.empty(size, dtype=torch.int64, device=self.device)
        grown[:used] = self._history_accumulator[:used]
        self._history_accumulator = grown
        for name, buffer in list(self._history_metadata.items()):
            bigger = torch.zeros(size, dtype=buffer.dtype, device=buffer.device)
            bigger[:used] = buffer[:used]
            setattr(self, "_history_" + name, bigger)  # the registered (non-persistent) buffer
            self._history_metadata[name] = bigger
        self._input_history_buffer_size = size

    def remap(self, features: dict[str, JaggedTensor], mutate_miss_lengths: bool = True,
              write_weights: Optional[Tensor] = None) -> dict[str, JaggedTensor]:
        out = super().remap(features, mutate_miss_lengths, write_weights)
        with torch.no_grad():
            for name, jt in out.items():
                rows = jt.values()
                if self.training:
                    local = rows - self._output_global_offset
                    self._stat_lookups.index_add_(0, local, torch.ones_like(local))
                    continue
                miss = rows == self.default_row
                self._eval_counts[0] += rows.numel()
                self._eval_counts[1] += miss.sum()
                if self._saved_segments is not None and bool(miss.any()):
                    # resharded from more ranks: an id without a row looks up the default row
                    # of the shard it had in the checkpoint's run, as it did there
                    rows[miss] = checkpoint_default_rows(features[name].values()[miss],
                                                         self._saved_segments)
        return out

    def validate_state(self) -> None:
        """After a checkpoint is loaded: TorchRec's check (and re-sort of the ids), and the
        checkpoint's shard layout kept when it had more shards, for :meth:`remap`.

        Raises:
            ValueError: the checkpoint's shards do not merge into this module's (a table
                resharded onto more ranks, or onto shards whose rows or id blocks cut old ones).
        """
        saved = [int(v) for v in self._output_segments_tensor.tolist() if v >= 0]
        mine = [int(v) for v in self._layout.tolist() if v >= 0]
        if saved != mine:
            start, end = self._output_global_offset, self._output_global_offset + self._zch_size
            old, new = len(saved) - 1, len(mine) - 1
            # every new shard must hold whole old ones: its id block a union of theirs
            merged = new <= old and old % new == 0 and all(
                k * -(-EMPTY_ID // new) == k * (old // new) * -(-EMPTY_ID // old)
                for k in range(1, new))
            if start not in saved or end not in saved or not merged:
                raise ValueError(
                    f"dynamic table {self._name}: a checkpoint of {old} row-wise shard(s) loads "
                    f"onto {new} only where each of these shards holds whole shards of the "
                    f"checkpoint's, rows and id range alike (as 2 -> 1 does; each shard owns one "
                    f"block of the id range); load it on {old} rank(s)")
        # TorchRec restores its construction-time segments, but that tensor is the buffer the
        # checkpoint was just loaded into: this module's own layout is put back from a copy
        self._output_segments_tensor.copy_(self._layout)
        super().validate_state()
        self._saved_segments = (torch.tensor(saved, dtype=torch.int64) if saved != mine
                                else None)
        if self._saved_segments is not None:
            self._release_old_default_rows(saved)

    @torch.no_grad()
    def _release_old_default_rows(self, saved: list[int]) -> None:
        """After a merge of shards: their default rows (all but this shard's last) become free
        rows -- free-row metadata (the policy protected them as default rows) and their lookups
        counted as this shard's default row's."""
        start = self._output_global_offset
        old = torch.tensor([end - 1 - start for end in saved[1:]
                            if start <= end - 1 < start + self._zch_size - 1], dtype=torch.int64)
        if old.numel():
            lookups = self._stat_lookups
            lookups[-1] += lookups[old.to(lookups.device)].sum()
            lookups[old.to(lookups.device)] = 0
        free = self._mch_sorted_raw_ids == EMPTY_ID
        free[-1] = False
        for buffer in self._mch_metadata.values():
            buffer[free] = 0

    @torch.no_grad()
    def _update_and_evict(self, uniq_ids: Tensor, uniq_ids_counts: Tensor,
                          uniq_ids_metadata: dict[str, Tensor]) -> None:
        """TorchRec's admission round (``MCHManagedCollisionModule._update_and_evict``), with the
        ids kept sorted by merging the few that changed instead of re-sorting the table, the
        admitted ``(row, id)`` pairs recorded (:meth:`initial_vectors`) and counted, and TTL
        expiry after it."""
        if not self._evicted:  # the rows handed out earlier were consumed by evict()
            self._fresh_rows = self._fresh_ids = None
        order = torch.argsort(uniq_ids_counts, descending=True, stable=True)
        ids, counts = uniq_ids[order], uniq_ids_counts[order]
        matching, matched = self._match_indices(self._mch_sorted_raw_ids, ids)
        new_ids = ids[~matching]
        held = int(torch.searchsorted(self._mch_sorted_raw_ids, self._delimiter))
        if new_ids.numel() <= self._zch_size - 1 - held:
            # Room for every new id: the policy has nothing to rank (TorchRec would score the
            # whole table to find the free rows, which come first). Its counters by hand.
            evicted = torch.arange(held, held + new_ids.numel(), device=ids.device)
            self._room_for_all(order, counts, matching, matched, evicted, uniq_ids_metadata)
            self._mch_sorted_raw_ids[evicted] = new_ids
            if evicted.numel():
                self._hand_out(evicted, block=True)
        else:
            evicted, selected = self._eviction_policy.update_metadata_and_generate_eviction_scores(
                self._current_iter, self._zch_size, order, counts, matching, matched,
                self._mch_metadata, uniq_ids_metadata)
            self._mch_sorted_raw_ids[evicted] = new_ids[selected]
            if evicted.numel():
                self._hand_out(evicted)
        policy = self._eviction_policy
        if isinstance(policy, TTLEvictionPolicy):
            self._expire(policy.ttl_steps)

    def _room_for_all(self, order: Tensor, counts: Tensor, matching: Tensor, matched: Tensor,
                      free: Tensor, history: dict[str, Tensor]) -> None:
        """The policy's counters when every new id gets a free row (positions ``free``): what
        ``update_metadata_and_generate_eviction_scores`` of LFU and LRU set, for these rows only.
        """
        meta = self._mch_metadata
        if "counts" in meta:  # LFU: counts since admission
            meta["counts"][matched] += counts[matching]
            meta["counts"][free] = counts[~matching]
            meta["counts"][-1] = torch.iinfo(torch.int64).max
        if "last_access_iter" in meta:  # LRU, TTL: the step of the last lookup
            last = history["last_access_iter"][order]
            meta["last_access_iter"][matched] = last[matching]
            meta["last_access_iter"][free] = last[~matching]
            meta["last_access_iter"][-1] = self._current_iter

    @torch.no_grad()
    def settle(self) -> None:
        """Admits the ids seen since the last admission now (before a checkpoint): the id history
        is not part of the state, so a checkpoint must fall on an admission boundary for a
        resumed run to admit and evict exactly as the uninterrupted one. The rows handed out
        still need their reset (``evict()``: the sharded module's ``settle`` does it)."""
        if self._current_history_buffer_offset and self._current_iter >= 0:
            self._coalesce_history()
            self._last_eviction_iter = self._current_iter

    def _hand_out(self, positions: Tensor, block: bool = False) -> None:
        """Records that the ids now at ``positions`` (of the sorted list) got their rows: rows to
        reset, admissions counted, the list made sorted again (``block``: they are the free rows
        right after the held ids, :meth:`_merge_block`)."""
        rows = self._mch_remapped_ids_mapping[positions]
        ids = self._mch_sorted_raw_ids[positions]
        self._evicted_emb_indices = (torch.unique(torch.cat([self._evicted_emb_indices, rows]))
                                     if self._evicted else rows)
        self._evicted = True
        local = rows[ids != EMPTY_ID] - self._output_global_offset  # freed rows admit no id
        self._stat_admissions.index_add_(0, local, torch.ones_like(local, dtype=torch.int32))
        if self._fresh_rows is not None:
            rows, ids = torch.cat([self._fresh_rows, rows]), torch.cat([self._fresh_ids, ids])
        self._fresh_rows, self._fresh_ids = rows, ids
        if block:
            self._merge_block(int(positions[0]), positions.numel())
        else:
            self._merge_sorted(positions)

    def _merge_sorted(self, changed: Tensor) -> None:
        """Sorts the id list again, where only the ids at ``changed`` moved: the others stay in
        order, the changed ones are inserted where they belong (empty markers before the
        existing ones, so the default row stays last); their rows and metadata move with them."""
        raw = self._mch_sorted_raw_ids
        keep = torch.ones(raw.numel(), dtype=torch.bool, device=raw.device)
        keep[changed] = False
        kept = torch.nonzero(keep).squeeze(1)
        values, order = torch.sort(raw[changed], stable=True)
        moved = changed[order]
        at = torch.searchsorted(raw[kept], values) + torch.arange(moved.numel(),
                                                                  device=raw.device)
        perm = torch.empty(raw.numel(), dtype=torch.int64, device=raw.device)
        slots = torch.ones_like(keep)
        slots[at] = False
        perm[slots] = kept
        perm[at] = moved
        for buffer in (raw, self._mch_remapped_ids_mapping, *self._mch_metadata.values()):
            buffer.copy_(buffer[perm])

    def _merge_block(self, first: int, count: int) -> None:
        """:meth:`_merge_sorted` when new ids were written to the free rows' positions
        ``first .. first + count``, right after the ``first`` ids the table held (the rest are
        free): only that prefix moves, each old id by the number of new ones below it."""
        raw = self._mch_sorted_raw_ids
        end = first + count
        values, order = torch.sort(raw[first:end], stable=True)
        below = torch.searchsorted(raw[:first], values)  # old ids ahead of each new one
        at = below + torch.arange(count, device=raw.device)
        shift = torch.zeros(first + 1, dtype=torch.int64, device=raw.device)
        shift.index_add_(0, below, torch.ones_like(below))
        perm = torch.empty(end, dtype=torch.int64, device=raw.device)
        perm[torch.arange(first, device=raw.device) + torch.cumsum(shift, 0)[:first]] = \
            torch.arange(first, device=raw.device)
        perm[at] = first + order
        for buffer in (raw, self._mch_remapped_ids_mapping, *self._mch_metadata.values()):
            buffer[:end] = buffer[:end][perm]

    def _expire(self, ttl: int) -> None:
        """Frees the rows of ids last looked up more than ``ttl`` steps ago."""
        last = self._mch_metadata["last_access_iter"]
        expired = (last < self._current_iter - ttl) & (self._mch_sorted_raw_ids != EMPTY_ID)
        expired[-1] = False  # the default row
        positions = torch.nonzero(expired).squeeze(1)
        if positions.numel():
            self._mch_sorted_raw_ids[positions] = EMPTY_ID
            last[positions] = 0  # the first to be taken again
            self._hand_out(positions)

    @torch.no_grad()
    def initial_vectors(self, rows: Tensor, dim: int, low: float, high: float) -> Tensor:
        """Fresh vectors for ``rows`` (this shard's, local; handed out since the last
        ``evict()``): uniform in ``[low, high)``, drawn from a hash of (table, id, column). An id
        starts from the same vector on any number of shards and in a resumed run; a freed row
        from the empty id's."""
        ids = torch.full((rows.numel(),), EMPTY_ID, dtype=torch.int64, device=rows.device)
        if self._fresh_rows is not None:
            fresh_rows = self._fresh_rows - self._output_global_offset
            order = torch.argsort(fresh_rows, stable=True)
            fresh_rows, fresh_ids = fresh_rows[order], self._fresh_ids[order]
            # a row handed out twice since the last evict(): its latest id (last in the record)
            at = (torch.searchsorted(fresh_rows, rows, right=True) - 1).clamp(min=0)
            found = fresh_rows[at] == rows
            ids[found] = fresh_ids[at[found]]
        keys = column_keys(dim, table_salt(self._name)).to(rows.device)
        return low + (high - low) * id_uniforms(ids[:, None], keys[None, :])

    def counters(self) -> Tensor:
        """``[capacity, occupied, admitted, lookups, default lookups, eval lookups, eval default
        lookups]`` of this shard (int64), to be summed over shards."""
        rows = self._zch_size
        occupied = rows - 1 - int(self.open_slots().item())
        lookups = self._stat_lookups
        return torch.tensor([rows, occupied, int(self._stat_admissions.sum()),
                             int(lookups.sum()), int(lookups[-1]),
                             int(self._eval_counts[0]), int(self._eval_counts[1])],
                            dtype=torch.int64)

    def id_map(self) -> tuple[Tensor, Tensor]:
        """This shard's ``(raw ids, rows)`` of the ids that own a row, ids ascending."""
        keep = self._mch_sorted_raw_ids != EMPTY_ID
        keep[-1] = False
        ids = unmix_ids(self._mch_sorted_raw_ids[keep])
        rows = self._mch_remapped_ids_mapping[keep]
        order = torch.argsort(ids)
        return ids[order], rows[order]


def managed_table(name: str, table: DynamicTable, device: Optional[torch.device] = None
                  ) -> ManagedTable:
    """The remapper of dynamic table ``name`` (its ids mixed by :func:`mix_ids` first)."""
    if table.capacity < 2:
        raise ValueError(f"tables: {name}: capacity must be at least 2 (one row is the default "
                         f"row), got {table.capacity}")
    if table.eviction_interval < 1:
        raise ValueError(f"tables: {name}: eviction_interval must be at least 1, got "
                         f"{table.eviction_interval}")
    return ManagedTable(zch_size=table.capacity, device=device or torch.device("cpu"),
                        eviction_policy=eviction_policy(table),
                        eviction_interval=table.eviction_interval, input_hash_func=mix_ids,
                        name=name)


class EmbeddingBags(nn.Module):
    """An ``EmbeddingBagCollection`` whose dynamic tables are managed: static tables in
    ``static`` (an EBC), dynamic ones in ``dynamic`` (a ``ManagedCollisionEmbeddingBagCollection``);
    the pooled output has the configs' keys in their order, as one EBC's would."""

    def __init__(self, configs: Sequence[EmbeddingBagConfig], dynamic: Mapping[str, DynamicTable],
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self._configs = list(configs)
        static = [c for c in configs if c.name not in dynamic]
        managed = [c for c in configs if c.name in dynamic]
        self.static = EmbeddingBagCollection(tables=static, device=device) if static else None
        mcc = ManagedCollisionCollection(
            {c.name: managed_table(c.name, dynamic[c.name], device) for c in managed}, managed)
        self.dynamic = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=managed, device=device), mcc)
        self._keys = [f for c in configs for f in c.feature_names]
        self._static_keys = [f for c in static for f in c.feature_names]
        self._dynamic_keys = [f for c in managed for f in c.feature_names]

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if self.static is None:
            return self.dynamic(features)[0]
        parts = {**self.static(_select(features, self._static_keys)).to_dict(),
                 **self.dynamic(_select(features, self._dynamic_keys))[0].to_dict()}
        values = torch.cat([parts[k] for k in self._keys], dim=1)
        return KeyedTensor(keys=self._keys, length_per_key=[parts[k].shape[1] for k in self._keys],
                           values=values)


def _select(features: KeyedJaggedTensor, keys: list[str]) -> KeyedJaggedTensor:
    index = {k: i for i, k in enumerate(features.keys())}
    return features.permute([index[k] for k in keys])


def embedding_bags(configs: Sequence[EmbeddingBagConfig],
                   dynamic: Optional[Mapping[str, DynamicTable]] = None,
                   device: Optional[torch.device] = None) -> nn.Module:
    """The tables of ``configs``: a plain ``EmbeddingBagCollection``, or, when any is named in
    ``dynamic`` (its ``num_embeddings`` then is the capacity), :class:`EmbeddingBags`."""
    dynamic = {name: t for name, t in (dynamic or {}).items()
               if any(c.name == name for c in configs)}
    if not dynamic:
        return EmbeddingBagCollection(tables=list(configs), device=device)
    return EmbeddingBags(configs, dynamic, device)


def managed_tables(model: nn.Module) -> Iterator[tuple[str, ManagedTable]]:
    """``(table name, this rank's remapper)`` of every dynamic table of a (sharded) model."""
    for module in model.modules():
        if isinstance(module, ManagedTable):
            yield module._name, module




def feature_tables(features: Sequence[SparseFeature], embedding_dim: int, pooling: PoolingType,
                   dynamic: Optional[Mapping[str, DynamicTable]] = None,
                   device: Optional[torch.device] = None) -> nn.Module:
    """One table ``t_<feature>`` per sparse feature, sized by its vocabulary or, when dynamic,
    its capacity (:func:`embedding_bags`).

    Raises:
        ValueError: a feature of raw ids (``encoding: raw``) without a dynamic table.
    """
    dynamic = dynamic or {}
    configs = []
    for f in features:
        name = table_name(f.name)
        if f.raw and name not in dynamic:
            raise ValueError(
                f"feature {f.name} holds raw ids (encoding: raw), which only a dynamic table "
                f"can look up: add tables: [{{tables: [{name}], kind: dynamic, capacity: N}}] "
                f"(its training split has {f.num_embeddings:,} distinct ids)")
        rows = dynamic[name].capacity if name in dynamic else f.num_embeddings
        configs.append(EmbeddingBagConfig(name=name, embedding_dim=embedding_dim,
                                          num_embeddings=rows, feature_names=[f.name],
                                          pooling=pooling))
    return embedding_bags(configs, dynamic, device)


_COUNTERS = ("rows", "occupied", "ids_admitted", "lookups", "default_row_lookups",
             "eval_lookups", "eval_default_row_lookups")


def table_stats(model: nn.Module) -> dict[str, dict[str, float]]:
    """Every dynamic table's counters, summed over its shards on all ranks (a collective when
    distributed: every rank calls it).

    Per table: ``capacity`` (rows), ``default_rows`` (one per shard), ``occupied`` rows and
    ``occupancy`` (of the rows an id can own), ``ids_admitted`` (ids given a row in training,
    again when an evicted id comes back), ``evictions`` (ids that lost their row: evicted or
    expired), training ``lookups`` and the share that hit a default row
    (``default_row_share``), and the same share over the last evaluation
    (``eval_default_row_share``: ids training never admitted).
    """
    tables: dict[str, list[Tensor]] = {}
    for name, module in managed_tables(model):
        tables.setdefault(name, []).append(torch.cat([module.counters(), torch.ones(1,
                                                                                   dtype=torch.int64)]))
    if not tables:
        return {}
    names = sorted(tables)
    totals = torch.stack([torch.stack(tables[n]).sum(0) for n in names])
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        # on the tables' device: a CUDA run's process group is NCCL, which reduces no CPU tensor
        device = next(m for _, m in managed_tables(model))._mch_sorted_raw_ids.device
        totals = totals.to(device)
        torch.distributed.all_reduce(totals)
        totals = totals.cpu()
    out = {}
    for name, row in zip(names, totals.tolist()):
        c = dict(zip(_COUNTERS, row))
        shards = row[-1]
        usable = max(c["rows"] - shards, 1)
        out[name] = {
            "capacity": c["rows"], "default_rows": shards, "occupied": c["occupied"],
            "occupancy": c["occupied"] / usable, "ids_admitted": c["ids_admitted"],
            "evictions": c["ids_admitted"] - c["occupied"], "lookups": c["lookups"],
            "default_row_share": c["default_row_lookups"] / max(c["lookups"], 1),
            "eval_lookups": c["eval_lookups"],
            "eval_default_row_share": c["eval_default_row_lookups"] / max(c["eval_lookups"], 1),
        }
    return out
