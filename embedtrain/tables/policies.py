"""The eviction policies of dynamic tables: TorchRec's MCH policies (LRU, LFU) with a linear-time
choice of the ids that keep a row, and TTL (LRU plus expiry). Used by the per-table remapper
(:class:`~embedtrain.tables.dynamic.ManagedTable`) and the fused one
(:mod:`~embedtrain.tables.fused`), which reads the policy of each table."""

from __future__ import annotations

import torch
from torch import Tensor
from torchrec.modules.mc_modules import LFU_EvictionPolicy, LRU_EvictionPolicy, MCHEvictionPolicy

from embedtrain.models.options import DynamicTable, Eviction


class _SelectByKth:
    """MCH's choice of which ids keep a row, without sorting the whole table.

    TorchRec ranks the table's ids and the new ones together with a stable argsort of all
    ``capacity + new`` scores and keeps the top ``capacity`` (ties to the lower index: ids in the
    table before new ones). Only the ``new`` lowest scores can lose, so their threshold
    (``kthvalue``) and the ties at it decide the same sets in linear time.
    """

    def _compute_selected_eviction_and_replacement_indices(
            self, pivot: int, eviction_scores: Tensor) -> tuple[Tensor, Tensor]:
        new = eviction_scores.numel() - pivot
        if new <= 0:
            empty = torch.empty(0, dtype=torch.int64, device=eviction_scores.device)
            return empty, empty
        threshold = torch.kthvalue(eviction_scores, new).values
        dropped = eviction_scores < threshold
        ties = torch.nonzero(eviction_scores == threshold).squeeze(1)
        need = new - int(dropped.sum())
        if need > 0:  # among equal scores the highest indices lose, as in the stable sort
            dropped[ties[ties.numel() - need:]] = True
        evicted = torch.nonzero(dropped[:pivot]).squeeze(1)
        selected = torch.nonzero(~dropped[pivot:]).squeeze(1)
        return evicted, selected


class LRUEvictionPolicy(_SelectByKth, LRU_EvictionPolicy):
    """TorchRec's LRU policy with the linear-time selection."""


class LFUEvictionPolicy(_SelectByKth, LFU_EvictionPolicy):
    """TorchRec's LFU policy with the linear-time selection."""


class TTLEvictionPolicy(LRUEvictionPolicy):
    """LRU, and rows of ids not looked up for ``ttl_steps`` training steps are freed."""

    def __init__(self, ttl_steps: int) -> None:
        super().__init__()
        if ttl_steps <= 0:
            raise ValueError(f"eviction ttl needs ttl_steps > 0, got {ttl_steps}")
        self.ttl_steps = ttl_steps


def eviction_policy(table: DynamicTable) -> MCHEvictionPolicy:
    """TorchRec's MCH policy for ``table.eviction`` (``ttl``: :class:`TTLEvictionPolicy`)."""
    if table.eviction is Eviction.LFU:
        return LFUEvictionPolicy()
    if table.eviction is Eviction.TTL:
        return TTLEvictionPolicy(table.ttl_steps)
    return LRUEvictionPolicy()
