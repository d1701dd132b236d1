"""One remap over all dynamic tables of a collection: the fused path of :class:`ManagedTable`.

TorchRec's managed-collision collection remaps table by table: per table a history copy,
``torch.unique``, an admission round, a ``searchsorted`` remap, counters and row resets, a
handful of small tensor ops each (about 0.8 ms a table a step on the demo model). Here the
tables of one collection on one rank (its shards of them) are remapped together, with the same
rows, admissions, evictions and counters as the per-table path, step by step:

- **One storage per buffer.** Each table's remapper buffers (sorted ids, their rows, the
  policy's counters, the statistics, the step) become views of one tensor per buffer, table after
  table (``Tensor.set_``): the modules, their state dicts and checkpoints keep their buffers, and
  TorchRec's per-table code keeps working on them.
- **One sorted key array** over all tables. A table's ids are 63 bits, so ``(table, id)`` does
  not fit one int64: ``_coarse`` holds ``2 table + 1`` above the top bits of each stored id, and
  a marker ``2 table + 2`` for the rows that are not (yet) in the table's sorted run; it is
  sorted, so one ``searchsorted`` finds every ``(table, id)``. The rare ids whose top bits
  another id of the same table shares are settled by a short exact binary search on the ids.
- **Tails.** New ids take the free rows after the held ones, as TorchRec's admission does, but
  stay there unsorted (the table's tail) and enter a small sorted index instead of being merged
  into the table's sorted ids at once: a merge moves every held id, so it waits until the tail
  is an eighth of the sorted run (or the table's policy must rank it, or a checkpoint is taken:
  :meth:`FusedTables.settle`). The free rows, and so which row an id gets, are the same.
- **One unique, one admission:** a stable sort of the step's ids (grouped by table) gives the
  distinct ``(table, id)`` pairs with their counts; one search matches them; the tables with a
  free row for each new id take them together. A table without room ranks its ids by the
  eviction policy itself (:meth:`ManagedTable._update_and_evict` on its views, after its tail is
  merged).
- **Host reads:** one per admission (new ids and held rows per table: which tables have room,
  where their new ids go), none in a step without one; a table that ranks its ids runs its own
  code (with its reads) and is read once after.

The rows handed out are kept (:meth:`FusedTables.take_handouts`) for the sharded module's row
reset, which draws their vectors for all tables at once (:meth:`FusedTables.initial_vectors`).

Example:
    >>> fused = ManagedTable.fuse(tables)        # this rank's remappers of one collection
    >>> rows = fused.remap(mixed_ids, table_of_each_id, training=True)   # local rows
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from embedtrain.tables.ids import EMPTY_ID, column_keys, id_uniforms, table_salt
from embedtrain.tables.policies import (
    LFUEvictionPolicy, LRUEvictionPolicy, TTLEvictionPolicy)
from embedtrain.tables.sorted import (
    distinct_pairs,
    exclusive_sums,
    insert_sorted,
    merge_runs,
    pair_runs,
    search_pairs,
)

# Per-row buffers of a remapper (as long as its rows), bound to one storage each.
_PER_ROW = ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_last_access_iter",
            "_mch_counts", "_stat_lookups", "_stat_admissions")
_INT64_MAX = torch.iinfo(torch.int64).max


def unfusable(tables: Sequence) -> Optional[str]:
    """Why ``tables`` (one collection's :class:`~embedtrain.tables.dynamic.ManagedTable`
    remappers) cannot be remapped together, or None."""
    if not tables:
        return "no tables"
    if len({(t._input_hash_func, t._input_hash_size) for t in tables}) != 1:
        return "the tables mix their ids differently"
    for t in tables:
        policy = t._eviction_policy
        if not isinstance(policy, (LRUEvictionPolicy, LFUEvictionPolicy)):
            return f"table {t._name}: eviction policy {type(policy).__name__}"
        if policy._threshold_filtering_func is not None:
            return f"table {t._name}: a threshold filter"
        if t._enable_per_feature_lookups:
            return f"table {t._name}: per-feature lookups"
    if len({t._mch_sorted_raw_ids.device for t in tables}) != 1:
        return "tables on several devices"
    return None


class FusedTables:
    """The remappers of one collection (this rank's shards), remapped together.

    Args:
        tables: the remappers (:class:`~embedtrain.tables.dynamic.ManagedTable`), in the order
            their ids come in the collection's features.

    Raises:
        ValueError: the tables cannot be fused (:func:`unfusable`).
    """

    # a tail is merged into its table's sorted ids past this share of them (plus the floor)
    TAIL_SHARE, TAIL_FLOOR = 8, 64

    def __init__(self, tables: Sequence) -> None:
        why = unfusable(tables)
        if why:
            raise ValueError(f"dynamic tables cannot be remapped together: {why}")
        self.tables = list(tables)
        k = len(self.tables)
        self.mix: Callable[[Tensor], Tensor] = _hash_function(self.tables[0])
        self._sizes = [t._zch_size for t in self.tables]
        self._starts = [0]
        for size in self._sizes:
            self._starts.append(self._starts[-1] + size)
        self._lru = [isinstance(t._eviction_policy, LRUEvictionPolicy) for t in self.tables]
        self._ttl = [t._eviction_policy.ttl_steps
                     if isinstance(t._eviction_policy, TTLEvictionPolicy) else 0
                     for t in self.tables]
        self._bits = (2 * k).bit_length()  # table keys 2t + 1 (ids) and 2t + 2 (markers) < 2^bits
        self._shift = 63 - self._bits
        self.device = device = self.tables[0]._mch_sorted_raw_ids.device

        def tensor(values) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        index = torch.arange(k, dtype=torch.int64, device=device)
        self._start = tensor(self._starts[:-1])
        self._goff = tensor([t._output_global_offset for t in self.tables])
        self._delta = self._start - self._goff  # a global row + delta: its index in the storage
        self._default_row = self._goff + tensor(self._sizes) - 1
        self._default_pos = self._start + tensor(self._sizes) - 1
        self._key_base = (2 * index + 1) << self._shift
        self._max_key = (2 * index + 2) << self._shift  # rows outside the sorted run
        self._lru_mask = torch.tensor(self._lru, device=device)
        self._all_lru, self._no_lru = all(self._lru), not any(self._lru)
        self._bind()
        self._coarse = torch.empty(self._starts[-1], dtype=torch.int64, device=device)
        self._main, self._tail = [0] * k, [0] * k  # per table: ids in its sorted run, in its tail
        # the tails' ids, sorted by (table, id), with their positions; a sentinel last
        self._index = (tensor([_INT64_MAX]), tensor([EMPTY_ID]), tensor([-1]))
        self._refresh(range(k))
        # per step since an admission: its distinct (table, id) pairs, their counts, the steps
        self._history: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
        self._handouts: list[tuple[Tensor, Tensor, Tensor, list[int]]] = []
        self._keys_by_dim: dict[int, Tensor] = {}
        self._ranges: dict[tuple, tuple[Tensor, Tensor]] = {}

    # -- storage ---------------------------------------------------------------------------

    @torch.no_grad()
    def _bind(self) -> None:
        """Makes every table's per-row buffers views of one tensor per buffer (and its step and
        evaluation counts views of one small tensor each)."""
        arrays: dict[str, Tensor] = {}
        bound: list[tuple[dict, str, Tensor]] = []
        for name in _PER_ROW:
            present = [t._buffers.get(name) for t in self.tables]
            like = next((b for b in present if b is not None), None)
            if like is None:
                continue
            # one more slot in the step counters: where an admission writes what it skips
            size = self._starts[-1] + (name == "_mch_last_access_iter")
            arrays[name] = torch.zeros(size, dtype=like.dtype, device=like.device)
            for k, buffer in enumerate(present):
                if buffer is not None:
                    bound.append(self._place(self.tables[k], name, arrays[name], self._starts[k]))
        for name, width in (("_current_iter_tensor", 1), ("_eval_counts", 2)):
            arrays[name] = torch.cat([t._buffers[name].reshape(-1) for t in self.tables])
            for k, t in enumerate(self.tables):
                bound.append(self._place(t, name, arrays[name], k * width))
        self._watch = bound
        self._ids = arrays["_mch_sorted_raw_ids"]
        self._rows = arrays["_mch_remapped_ids_mapping"]
        self._last = arrays.get("_mch_last_access_iter")
        self._counts = arrays.get("_mch_counts")
        self._lookups = arrays["_stat_lookups"]
        self._admissions = arrays["_stat_admissions"]
        self._steps = arrays["_current_iter_tensor"]
        self._eval = arrays["_eval_counts"].view(len(self.tables), 2)

    @staticmethod
    def _place(table, name: str, big: Tensor, at: int) -> tuple[dict, str, Tensor]:
        buffer = table._buffers[name]
        big[at:at + buffer.numel()] = buffer.reshape(-1)
        buffer.set_(big.untyped_storage(), at, buffer.shape, buffer.stride())
        return table._buffers, name, buffer

    def bound(self) -> bool:
        """Whether every table still holds the buffers bound to the shared storage (a module
        moved to another device, or given new buffers, does not)."""
        for buffers, name, buffer in self._watch:
            if buffers.get(name) is not buffer:
                return False
        return True

    @torch.no_grad()
    def _refresh(self, tables) -> None:
        """Rebuilds the sorted keys of ``tables`` from their ids (at the start, and after their
        ids changed outside this class, sorted: a checkpoint loaded, a table's own round)."""
        tables = list(tables)
        self._drop_tails([k for k in tables if self._tail[k]])
        for k in tables:
            start, end = self._starts[k], self._starts[k + 1]
            ids = self._ids[start:end]
            keys = (ids >> self._bits) | int(self._key_base[k])
            self._coarse[start:end] = keys.masked_fill_(ids == EMPTY_ID, int(self._max_key[k]))
        main = (torch.searchsorted(self._coarse, self._max_key) - self._start).tolist()
        for k in tables:
            self._main[k] = main[k]
        self._versions = [t._mch_sorted_raw_ids._version for t in self.tables]

    def _check(self) -> None:
        if not self.bound():
            raise RuntimeError("dynamic tables: a remapper's buffers were replaced after they "
                               "were bound for the fused remap; rebuild the fused tables")
        changed = [k for k, t in enumerate(self.tables)
                   if t._mch_sorted_raw_ids._version != self._versions[k]]
        if changed:
            self._refresh(changed)

    # -- lookups ---------------------------------------------------------------------------

    def _find(self, tables: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Where ``(table, id)`` is held (a global position: in the table's sorted run or its
        tail) and whether it is."""
        keys = self._key_base.index_select(0, tables) | (ids >> self._bits)
        pos, found = search_pairs(self._coarse, self._ids, keys, ids, self._bits)
        if self._index[0].numel() > 1:
            miss = (~found).nonzero().squeeze(1)
            tail_keys, tail_ids, tail_pos = self._index
            at, there = search_pairs(tail_keys, tail_ids, keys[miss], ids[miss], self._bits)
            pos[miss] = torch.where(there, tail_pos.index_select(0, at), pos[miss])
            found[miss] = there
        return pos, found

    def _rows_of(self, tables: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        pos, found = self._find(tables, ids)
        return torch.where(found, self._rows.index_select(0, pos),
                           self._default_row.index_select(0, tables)), found

    @torch.no_grad()
    def remap(self, ids: Tensor, tables: Tensor, training: bool) -> Optional[Tensor]:
        """The local rows of ``ids`` (mixed, grouped by table), ``tables[i]`` the table of
        ``ids[i]``: in training after the step's profile and admission (as each table's
        ``profile`` then ``remap``), in evaluation a lookup that counts default-row hits.

        Returns:
            The rows, or None: evaluate table by table (a checkpoint resharded from more ranks,
            whose unseen ids look up their old shards' default rows); the tails are merged.
        """
        self._check()
        k = len(self.tables)
        if not training and any(t._saved_segments is not None for t in self.tables):
            self.compact()
            return None
        uid, utab, counts, group, order = distinct_pairs(ids, tables)
        if not training:
            rows, found = self._rows_of(utab, uid)
            self._eval[:, 0] += torch.bincount(tables, minlength=k)
            self._eval[:, 1] += torch.bincount(utab, weights=counts * ~found, minlength=k).long()
        else:
            due, steps = self._profile()
            if len(due) == k and not self._history:  # this step's ids are what is admitted
                rows = self._admit(due, uid, utab, counts, steps.index_select(0, utab))
            else:
                self._history.append((uid, utab, counts, steps))
                if due:
                    self._admit(due, *self._take_history(due))
                rows, _ = self._rows_of(utab, uid)
            self._lookups.index_add_(0, rows + self._delta.index_select(0, utab), counts)
        local = (rows - self._goff.index_select(0, utab)).index_select(0, group)
        return torch.empty_like(local).index_copy_(0, order, local)

    def _profile(self) -> tuple[list[int], Tensor]:
        """TorchRec's profile of every table: the step counted.

        Returns:
            The tables whose admission is due this step, and each table's step.
        """
        steps, due = [], []
        for k, t in enumerate(self.tables):
            state = t.__dict__  # plain attributes: around nn.Module's slower __setattr__
            if state["_current_iter"] == -1:  # the first step after construction or a load
                state["_current_iter"] = state["_last_eviction_iter"] = int(
                    t._current_iter_tensor.item())
            state["_current_iter"] += 1
            state["_saved_segments"] = None  # training goes on in this layout
            steps.append(state["_current_iter"])
            if state["_current_iter"] - state["_last_eviction_iter"] == t._eviction_interval:
                due.append(k)
        self._steps += 1
        return due, torch.tensor(steps, device=self.device)

    @torch.no_grad()
    def settle(self) -> None:
        """Admits the ids seen since each table's last admission now (``ManagedTable.settle``)
        and merges the tails: the layout a checkpoint holds is the per-table path's."""
        self._check()
        if self._history:
            seen = torch.zeros(len(self.tables), dtype=torch.int64, device=self.device)
            for _, tables, _, _ in self._history:
                seen += torch.bincount(tables, minlength=len(self.tables))
            due = [k for k, n in enumerate(seen.tolist())
                   if n and self.tables[k]._current_iter >= 0]
            if due:
                self._admit(due, *self._take_history(due))
        self.compact()

    def pending(self) -> bool:
        """Whether ids wait for their admission (seen since their table's last one)."""
        return any(chunk[0].numel() for chunk in self._history)

    @torch.no_grad()
    def compact(self) -> None:
        """Merges every tail into its table's sorted ids (TorchRec's layout: what the per-table
        code and a checkpoint expect)."""
        self._merge_tails(list(range(len(self.tables))))

    # -- admission -------------------------------------------------------------------------

    def _take_history(self, due: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The distinct ``(table, id)`` pairs seen by ``due`` since their last admission, by
        table then id, their counts and last steps (TorchRec's ``_coalesce_history``); the
        other tables' history stays."""
        chunks, k = self._history, len(self.tables)
        if len(due) == k:
            self._history = []
        else:
            mask = self._table_mask(due)
            taken, kept = [], []
            for chunk in chunks:
                m = mask[chunk[1]]
                taken.append(tuple(c[m] for c in chunk[:3]) + (chunk[3],))
                kept.append(tuple(c[~m] for c in chunk[:3]) + (chunk[3],))
            chunks, self._history = taken, kept
        ids = torch.cat([c[0] for c in chunks])
        tables = torch.cat([c[1] for c in chunks])
        counts = torch.cat([c[2] for c in chunks])
        steps = torch.cat([c[3].index_select(0, c[1]) for c in chunks])
        by_id = torch.argsort(ids, stable=True)
        order = by_id[torch.argsort(tables[by_id], stable=True)]  # by (table, id)
        ids, tables = ids[order], tables[order]
        group, first = pair_runs(ids, tables)
        total = torch.zeros(first.numel(), dtype=counts.dtype, device=self.device)
        last = torch.zeros_like(total).scatter_reduce_(0, group, steps[order], reduce="amax",
                                                       include_self=False)
        return (ids.index_select(0, first), tables.index_select(0, first),
                total.index_add_(0, group, counts[order]), last)

    def _admit(self, due: list[int], uid: Tensor, utab: Tensor, counts: Tensor, last: Tensor
               ) -> Tensor:
        """The admission round of the ``due`` tables (:meth:`ManagedTable._update_and_evict`,
        for all of them at once), given the distinct ``(table, id)`` pairs seen since their
        last one (in id order within a table), how often each was seen and the last step.

        Returns:
            The rows of the pairs after the round.
        """
        k = len(self.tables)
        for j in due:
            self.tables[j].__dict__["_last_eviction_iter"] = self.tables[j]._current_iter
        pos, found = self._find(utab, uid)
        row_u = self._rows.index_select(0, pos)
        new = ~found
        main = torch.searchsorted(self._coarse, self._max_key) - self._start
        host = torch.cat([torch.bincount(utab[new], minlength=k), main]).tolist()  # the one read
        new_per_table, self._main = host[:k], host[k:]
        held = [m + t for m, t in zip(self._main, self._tail)]
        room = [j for j in due if new_per_table[j] <= self._sizes[j] - 1 - held[j]]
        full = [j for j in due if new_per_table[j] > self._sizes[j] - 1 - held[j]]
        if room:
            sel = None if len(room) == k else self._table_mask(room)[utab]
            rows, index = self._admit_with_room(room, sel, pos, found, uid, utab, counts, last,
                                                new_per_table, held)
            row_u[index] = rows
        # tails past their share are merged, and those of tables about to rank their ids
        own = full + [j for j in room if self._ttl[j]]
        self._merge_tails(sorted(set(own) | {
            j for j in room if self._tail[j] > self._main[j] // self.TAIL_SHARE + self.TAIL_FLOOR}))
        for j in full:  # no room: the policy ranks the table's ids (on its own views)
            mine = (utab == j).nonzero().squeeze(1)
            meta = {"last_access_iter": last[mine]} if self._lru[j] else {}
            self._own_round(j, lambda t: t._update_and_evict(uid[mine], counts[mine], meta))
        for j in room:
            if self._ttl[j]:
                self._own_round(j, lambda t, ttl=self._ttl[j]: t._expire(ttl))
        if own:
            self._check()
        if full:
            mine = self._table_mask(full)[utab].nonzero().squeeze(1)
            row_u[mine] = self._rows_of(utab[mine], uid[mine])[0]
        return row_u

    def _table_mask(self, tables: list[int]) -> Tensor:
        mask = torch.zeros(len(self.tables), dtype=torch.bool, device=self.device)
        mask[tables] = True
        return mask

    def _own_round(self, k: int, run: Callable) -> None:
        """Runs a table's own round (its policy's ranking, TTL expiry) and keeps the rows it
        handed out for the reset (the table keeps its record too, as after ``evict()``)."""
        table = self.tables[k]
        table._evicted, table._fresh_rows, table._fresh_ids = False, None, None
        run(table)
        if table._evicted and table._fresh_rows is not None:
            rows = table._fresh_rows
            counts = [0] * len(self.tables)
            counts[k] = rows.numel()
            self._handouts.append((torch.full_like(rows, k), rows, table._fresh_ids, counts))
        table._evicted = False  # its rows are the fused reset's

    def _admit_with_room(self, room: list[int], sel: Optional[Tensor], pos: Tensor, found: Tensor,
                         uid: Tensor, utab: Tensor, counts: Tensor, last: Tensor,
                         new_per_table: list[int], held: list[int]) -> tuple[Tensor, Tensor]:
        """Tables with a free row for every new id (``_room_for_all`` and the block write of
        :meth:`ManagedTable._update_and_evict`, for all of them): counters of the ids they hold,
        and new ids into the free rows after the held ones, in the policy's order (counts
        descending, then ids); they join the tables' tails.

        Returns:
            The rows the new ids got, and where each new id is in ``uid``.
        """
        k, device = len(self.tables), self.device
        matched = found if sel is None else found & sel
        lru = None if self._all_lru or self._no_lru else self._lru_mask.index_select(0, utab)
        if self._last is not None:  # LRU: the step of the last lookup (others: to the spare)
            m = matched if lru is None else matched & lru
            self._last.index_put_((torch.where(m, pos, self._starts[-1]),), last)
        if self._counts is not None:  # LFU: the counts since admission
            m = matched if lru is None else matched & ~lru
            self._counts.index_put_((pos,), torch.where(m, counts, 0), accumulate=True)
        room_t = torch.tensor(room, device=device)
        lru_room = self._lru_mask[room_t]
        if self._last is not None:  # the default row: as recent as the step (LRU)
            steps = torch.tensor([t._current_iter for t in self.tables], device=device)
            self._last[self._default_pos[room_t[lru_room]]] = steps[room_t[lru_room]]
        if self._counts is not None:  # the default row: never the least frequent (LFU)
            self._counts[self._default_pos[room_t[~lru_room]]] = _INT64_MAX
        by_id = (~found if sel is None else ~found & sel).nonzero().squeeze(1)  # in id order
        total = by_id.numel()
        by_id_tab = utab[by_id]
        # the policy's order per table: counts descending, ties in id order (TorchRec's stable
        # argsort of the counts of torch.unique's sorted ids)
        rank = torch.argsort(by_id_tab * (total + 1) + (total - counts[by_id]), stable=True)
        index = by_id[rank]
        tab, nid, cnt = utab[index], uid[index], counts[index]
        rooms = set(room)
        per_table = [new_per_table[j] if j in rooms else 0 for j in range(k)]
        before = exclusive_sums(per_table)
        base = torch.tensor([self._starts[j] + held[j] - before[j] for j in range(k)],
                            device=device)
        free = base[tab] + torch.arange(total, device=device)  # after the held ids, in order
        rows = self._rows.index_select(0, free)
        self._admissions.index_add_(0, rows + self._delta[tab],
                                    torch.ones_like(rows, dtype=self._admissions.dtype))
        self._handouts.append((tab, rows, nid, per_table))
        self._ids.index_copy_(0, free, nid)
        if self._last is not None:
            self._last.index_copy_(0, free, last[index])
        if self._counts is not None:
            self._counts.index_copy_(0, free, cnt)
        # into the tails' index by (table, id): the new ids in id order, grouped by table
        by_table = torch.argsort(by_id_tab, stable=True)
        free_by_id = torch.empty_like(free).index_copy_(0, rank, free)[by_table]
        self._add_to_tails(by_id_tab[by_table], uid[by_id[by_table]], free_by_id)
        for j in room:
            self._tail[j] += per_table[j]
        return rows, index

    # -- tails -----------------------------------------------------------------------------

    def _add_to_tails(self, tables: Tensor, ids: Tensor, positions: Tensor) -> None:
        """Puts new ids (by table, then id; just written at ``positions``) into the tails'
        sorted index."""
        keys = self._key_base.index_select(0, tables) | (ids >> self._bits)
        at, _ = search_pairs(self._index[0], self._index[1], keys, ids, self._bits)
        self._index = insert_sorted(self._index, at, (keys, ids, positions))

    def _tail_ranges(self) -> list[int]:
        """Where each table's tail starts in the tails' index (grouped by table)."""
        return exclusive_sums(self._tail)

    def _drop_tails(self, tables: list[int]) -> None:
        """Takes ``tables``' ids out of the tails' index (their tails are gone)."""
        if not tables:
            return
        starts, drop = self._tail_ranges(), set(tables)
        keep, at = [], 0
        for j in range(len(self.tables)):
            if j in drop:
                keep.append((at, starts[j]))
                at = starts[j] + self._tail[j]
        keep.append((at, self._index[0].numel()))  # and the sentinel
        self._index = tuple(torch.cat([a[s:e] for s, e in keep]) for a in self._index)
        for j in tables:
            self._tail[j] = 0

    def _merge_tails(self, tables: list[int]) -> None:
        """Merges ``tables``' tails into their sorted ids (``_merge_block`` of each)."""
        tables = [j for j in tables if self._tail[j]]
        if not tables:
            return
        starts = self._tail_ranges()
        take = torch.cat([torch.arange(starts[j], starts[j] + self._tail[j], device=self.device)
                          for j in tables])
        keys, ids, positions = (a.index_select(0, take) for a in self._index)
        # insertion points into the sorted runs: ascending (the index is by table, then id)
        below, _ = search_pairs(self._coarse, self._ids, keys, ids, self._bits)
        chosen = set(tables)
        per_table = [self._tail[j] if j in chosen else 0 for j in range(len(self.tables))]
        arrays = [(self._ids, ids), (self._coarse, keys),
                  (self._rows, self._rows.index_select(0, positions))]
        for array in (self._last, self._counts):
            if array is not None:
                arrays.append((array, array.index_select(0, positions)))
        merge_runs(arrays, below, self._starts, self._main, per_table)
        for j in tables:
            self._main[j] += self._tail[j]
        self._drop_tails(tables)

    # -- row resets ------------------------------------------------------------------------

    def take_handouts(self) -> Optional[tuple[Tensor, Tensor, Tensor, list[int]]]:
        """The rows handed out since the last call, for their reset: ``(table of each, local
        row, id (mixed; EMPTY_ID for a freed row), rows per table)``, grouped by table, each row
        once with its latest id (as ``ManagedTable.initial_vectors`` reads them); None if none."""
        chunks, self._handouts = self._handouts, []
        if not chunks:
            return None
        if len(chunks) == 1:
            tables, rows, ids, counts = chunks[0]
            return tables, rows - self._goff[tables], ids, counts
        tables = torch.cat([c[0] for c in chunks])
        rows = torch.cat([c[1] for c in chunks])
        ids = torch.cat([c[2] for c in chunks])
        slot = rows + self._delta[tables]
        order = torch.argsort(slot, stable=True)
        slot = slot[order]
        latest = torch.ones_like(slot, dtype=torch.bool)
        latest[:-1] = slot[1:] != slot[:-1]
        keep = order[latest]
        tables, rows, ids = tables[keep], rows[keep], ids[keep]
        counts = torch.bincount(tables, minlength=len(self.tables)).tolist()
        return tables, rows - self._goff[tables], ids, counts

    def initial_vectors(self, tables: Tensor, ids: Tensor, dim: int, low: Sequence[float],
                        high: Sequence[float]) -> Tensor:
        """``ManagedTable.initial_vectors`` of rows of several tables at once: row ``i`` of table
        ``tables[i]`` given id ``ids[i]``, uniform in that table's ``[low, high)``.

        Args:
            tables, ids: per row, its table (index into :attr:`tables`) and id.
            dim: the tables' embedding dimension.
            low, high: each table's initial range.

        Returns:
            ``[rows, dim]`` float32, bit for bit what each table's own method draws.
        """
        keys = self._keys_by_dim.get(dim)
        if keys is None:
            keys = torch.stack([column_keys(dim, table_salt(t._name))
                                for t in self.tables]).to(self.device)
            self._keys_by_dim[dim] = keys
        unit = id_uniforms(ids[:, None], keys[tables])
        # as the per-table method computes it: float32 low + float32 (high - low) * unit
        ranges = self._ranges.get((tuple(low), tuple(high)))
        if ranges is None:
            ranges = (torch.tensor(low, dtype=torch.float32, device=self.device)[:, None],
                      torch.tensor([h - lo for lo, h in zip(low, high)], dtype=torch.float32,
                                   device=self.device)[:, None])
            self._ranges[(tuple(low), tuple(high))] = ranges
        return ranges[0][tables] + ranges[1][tables] * unit


def _hash_function(table) -> Callable[[Tensor], Tensor]:
    """A remapper's input hash (the id mix) as a function of the ids alone."""
    fn, size = table._input_hash_func, table._input_hash_size
    return (lambda ids: ids) if fn is None else (lambda ids: fn(ids, size))
