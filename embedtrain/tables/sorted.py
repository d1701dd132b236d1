"""Sorted arrays of ``(table, id)`` pairs, for the fused remap of dynamic tables.

A table's ids are 63 bits, so a pair does not fit one int64: a pair's key holds the table above
the top bits of the id (:class:`~embedtrain.tables.fused.FusedTables` builds them), and
arrays are sorted by key, then id. A search is one ``searchsorted`` on the keys; the ids of a
table whose top bits tie (a run of equal keys: at most ``2^run_bits`` ids) are settled by a short
exact binary search on the ids. The other functions build such arrays: the distinct pairs of a
batch, insertions, and the merge of new ids into each table's sorted run.

Example:
    >>> pos, found = search_pairs(keys_sorted, ids_sorted, query_keys, query_ids, run_bits=6)
"""

from __future__ import annotations

import torch
from torch import Tensor


def search_pairs(sorted_keys: Tensor, sorted_ids: Tensor, keys: Tensor, ids: Tensor,
                 run_bits: int) -> tuple[Tensor, Tensor]:
    """Where each query pair is in a sorted array of pairs.

    Args:
        sorted_keys, sorted_ids: the array, sorted by key, then id; its last key above every
            query's (a marker or sentinel), so every lower bound is inside it.
        keys, ids: the queries.
        run_bits: at most ``2^run_bits`` pairs share a key (ids that differ in fewer bits than
            the key drops).

    Returns:
        Each query's lower bound (the first pair not below it) and whether it is that pair.
    """
    pos = torch.searchsorted(sorted_keys, keys)
    same_key = sorted_keys.index_select(0, pos) == keys  # the key holds the table
    found = (sorted_ids.index_select(0, pos) == ids) & same_key
    # ids of the table with the same top bits: count those below exactly (a run of equal
    # keys holds at most 2^run_bits ids, so that many halving steps find the place)
    odd = (~found & same_key).nonzero().squeeze(1)
    if odd.numel():
        p, k, x = pos[odd], keys[odd], ids[odd]
        step, last = 1 << run_bits, sorted_keys.numel() - 1
        while step:
            j = (p + (step - 1)).clamp_(max=last)
            p = torch.where((sorted_keys[j] == k) & (sorted_ids[j] < x), p + step, p)
            step >>= 1
        pos[odd] = p
        found[odd] = (sorted_ids[p] == x) & (sorted_keys[p] == k)
    return pos, found


def pair_runs(ids: Tensor, tables: Tensor) -> tuple[Tensor, Tensor]:
    """For ``(table, id)`` pairs ordered so that equal ones are neighbours: each pair's run of
    equal pairs (0, 1, ...) and where each run starts."""
    head = torch.ones(ids.numel(), dtype=torch.bool, device=ids.device)
    torch.ne(ids[1:], ids[:-1], out=head[1:])
    head[1:] |= tables[1:] != tables[:-1]
    return head.to(torch.int64).cumsum_(0).sub_(1), head.nonzero().squeeze(1)


def distinct_pairs(ids: Tensor, tables: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The distinct ``(table, id)`` pairs of a batch.

    Args:
        ids, tables: each id and its table, grouped by table (so that a stable sort by id puts
            equal pairs next to each other: one sort for all tables).

    Returns:
        ``(ids, tables, counts)`` of the distinct pairs, in id order; for each id in sorted
        order its pair, and the sort order (``ids[order[i]]`` belongs to pair ``group[i]``).
    """
    n = ids.numel()
    sorted_ids, order = torch.sort(ids, stable=True)
    sorted_tables = tables.index_select(0, order)
    group, starts = pair_runs(sorted_ids, sorted_tables)
    counts = torch.diff(starts, append=torch.tensor([n], device=ids.device))
    return (sorted_ids.index_select(0, starts), sorted_tables.index_select(0, starts), counts,
            group, order)


def insert_sorted(arrays: tuple[Tensor, ...], at: Tensor, values: tuple[Tensor, ...]
                  ) -> tuple[Tensor, ...]:
    """``arrays`` (sorted alike) with ``values`` inserted before positions ``at`` (ascending,
    as ``searchsorted`` gives them), as new tensors."""
    old, count = arrays[0].numel(), at.numel()
    new_at = at + torch.arange(count, device=at.device)
    is_new = torch.zeros(old + count, dtype=torch.int64, device=at.device)
    is_new[new_at] = 1
    source = torch.arange(old + count, device=at.device) - is_new.cumsum_(0)
    source[new_at] = torch.arange(old, old + count, device=at.device)
    return tuple(torch.cat([a, v]).index_select(0, source) for a, v in zip(arrays, values))


def merge_runs(arrays: list[tuple[Tensor, Tensor]], below: Tensor, starts: list[int],
               held: list[int], new_per_table: list[int]) -> None:
    """Merges new ids into each table's sorted run, in place (``_merge_block`` of every table
    at once). A changed table's sorted and new ids then fill its first ``held + new``
    positions: the region of all changed tables is gathered once, permuted by one index, and
    written back slice by slice (contiguous copies, not a scatter of every held id).

    Args:
        arrays: ``(array, the new ids' values)`` per array laid out by position (ids, rows,
            keys, counters), the values in ``below``'s order.
        below: the new ids' insertion points (global positions, ascending: by table, then id).
        starts, held: each table's first position and the length of its sorted run.
        new_per_table: the new ids of each table.
    """
    device = below.device
    k = len(new_per_table)
    changed = [(starts[j], held[j], new_per_table[j]) for j in range(k) if new_per_table[j]]
    offset, at = [0] * k, 0  # a table's region: global position = compact + offset
    before = exclusive_sums(new_per_table)
    for j in range(k):
        offset[j] = starts[j] - at + before[j]
        if new_per_table[j]:
            at += held[j] + new_per_table[j]
    region, n_held = at, sum(h for _, h, _ in changed)
    count = below.numel()
    shift = torch.repeat_interleave(
        torch.tensor([offset[j] for j in range(k) if new_per_table[j]], device=device),
        torch.tensor([n for _, _, n in changed], device=device), output_size=count)
    new_at = below - shift + torch.arange(count, device=device)  # compact positions
    is_new = torch.zeros(region, dtype=torch.int64, device=device)
    is_new[new_at] = 1
    # a position's source: its held id (those before it moved up), or the k-th new id
    source = torch.arange(region, device=device) - is_new.cumsum_(0)
    source[new_at] = torch.arange(n_held, n_held + count, device=device)
    for array, values in arrays:
        final = torch.cat([array[s:s + h] for s, h, _ in changed] + [values]).index_select(
            0, source)
        at = 0
        for s, h, n in changed:
            array[s:s + h + n] = final[at:at + h + n]
            at += h + n


def exclusive_sums(values: list[int]) -> list[int]:
    """The sum of the values before each (and so where each one's share starts)."""
    out, total = [], 0
    for v in values:
        out.append(total)
        total += v
    return out
