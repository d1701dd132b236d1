"""The extreme-classification metrics P@k, nDCG@k, recall@k over top-k predictions.

Predictions are the top-k class ids of :mod:`embedtrain.heads.topk` (score descending, then class
id ascending; padding ``-1``). Targets: a ``LongTensor[B]`` (one class per example) or a
``LongTensor[B, L]`` of positive class ids padded with ``-1`` (multi-label; :func:`pad_targets`
builds it from lists). Never ``B x C``.

Metrics (the Extreme Classification Repository's definitions; ``rel_i`` = 1 if the i-th
prediction is a positive, ``P`` = the example's set of positives):

* ``P@k = |topk ∩ P| / k``
* ``nDCG@k = DCG@k / IDCG@k``, ``DCG@k = sum_{i<k} rel_i / log2(i + 2)``,
  ``IDCG@k = sum_{i < min(k, |P|)} 1 / log2(i + 2)``
* ``recall@k = |topk ∩ P| / |P|``

each averaged over examples; an example without positives scores 0 on all three (and counts).
With inverse propensities ``1 / p_l`` (:func:`inverse_propensity`, Jain et al. 2016), also the
repository's normalised propensity-scored precision, which credits tail labels more:

* ``PSP@k = sum_examples sum_{i<k} rel_i / p_{pred_i}  /  sum_examples (the same sum for the
  example's best k positives by 1 / p_l)`` (as ``pyxclib``'s ``psprecision``)

Example:
    >>> m = XCMetrics(ks=(1, 5)); m.update(topk_ids, targets); m.compute()["p@1"]
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor


def pad_targets(labels: Sequence[Sequence[int]]) -> Tensor:
    """Multi-label targets from per-example lists: a ``LongTensor[B, L]`` padded with -1."""
    width = max((len(x) for x in labels), default=0)
    out = torch.full((len(labels), width), -1, dtype=torch.long)
    for row, x in enumerate(labels):
        out[row, :len(x)] = torch.as_tensor(list(x), dtype=torch.long)
    return out


def _sorted_positives(targets: Tensor) -> tuple[Tensor, Tensor]:
    """``targets [B, L]`` sorted per row (padding -1 first; O(B L log L), not B x C) and the
    mask of each row's distinct positives."""
    tgt = torch.sort(targets, dim=1).values
    distinct = (tgt >= 0) & torch.cat([torch.ones_like(tgt[:, :1], dtype=torch.bool),
                                       tgt[:, 1:] != tgt[:, :-1]], dim=1)
    return tgt, distinct


def _hits(topk_indices: Tensor, targets: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``rel [B, k]`` (bool: prediction i is a positive) and ``|P| [B]`` (distinct positives)."""
    if topk_indices.dim() != 2 or topk_indices.shape[1] < k:
        raise ValueError(f"need topk_indices [B, >={k}], got {tuple(topk_indices.shape)}")
    pred = topk_indices[:, :k].long()
    tgt = targets.long().view(-1, 1) if targets.dim() == 1 else targets.long()
    if tgt.shape[0] != pred.shape[0]:
        raise ValueError(f"{tgt.shape[0]} targets for {pred.shape[0]} examples")
    if tgt.shape[1] == 0:
        return torch.zeros_like(pred, dtype=torch.bool), pred.new_zeros(pred.shape[0])
    tgt, distinct = _sorted_positives(tgt)
    # pred is a column slice of the top-k ids (non-contiguous): one copy here, not a warning
    # and a hidden copy inside searchsorted.
    pos = torch.searchsorted(tgt, pred.contiguous()).clamp(max=tgt.shape[1] - 1)
    rel = (tgt.gather(1, pos) == pred) & (pred >= 0)
    return rel, distinct.sum(dim=1)


def inverse_propensity(counts: Tensor, examples: int, a: float = 0.55, b: float = 1.5) -> Tensor:
    """``1 / p_l`` of every class from its training count ``N_l`` (float64 ``[C]``).

    ``p_l = 1 / (1 + c (N_l + b)^-a)``, ``c = (ln N - 1) (b + 1)^a``, ``N`` the training
    examples (Jain, Prabhu and Varma, KDD 2016; the repository's defaults ``a = 0.55``,
    ``b = 1.5``; Wikipedia-LSHTC uses 0.5 / 0.4, Amazon 0.6 / 2.6).
    """
    c = (math.log(max(examples, 1)) - 1.0) * (b + 1.0) ** a
    return 1.0 + c * (counts.double() + b) ** -a


def _propensity_scored(topk_indices: Tensor, targets: Tensor, k: int, inv_p: Tensor
                       ) -> tuple[Tensor, Tensor]:
    """Per example: ``sum_{i<k} rel_i / p_{pred_i}`` and its best value (``[B]`` each)."""
    rel, _ = _hits(topk_indices, targets, k)
    pred = topk_indices[:, :k].long()
    gained = (rel.double() * inv_p[pred.clamp(min=0)]).sum(dim=1)
    tgt, distinct = _sorted_positives(
        targets.long().view(-1, 1) if targets.dim() == 1 else targets.long())
    weights = torch.where(distinct, inv_p[tgt.clamp(min=0)], 0.0)
    best = weights.topk(min(k, weights.shape[1]), dim=1).values.sum(dim=1)
    return gained, best


def _per_example(topk_indices: Tensor, targets: Tensor, k: int) -> dict[str, Tensor]:
    """Per-example ``p``, ``ndcg``, ``recall`` at ``k`` (float64 ``[B]`` each)."""
    rel, npos = _hits(topk_indices, targets, k)
    rel = rel.double()
    discount = 1.0 / torch.log2(torch.arange(k, dtype=torch.float64, device=rel.device) + 2.0)
    ideal = torch.cat([discount.new_zeros(1), discount.cumsum(0)])  # ideal[m] = IDCG of m hits
    idcg = ideal[npos.clamp(max=k)]
    hits = rel.sum(dim=1)
    safe = torch.where(npos > 0, npos.double(), torch.ones_like(hits))
    return {
        "p": hits / k,
        "ndcg": torch.where(idcg > 0, (rel * discount).sum(dim=1) / idcg.clamp(min=1e-300), 0.0),
        "recall": torch.where(npos > 0, hits / safe, 0.0),
    }


def _reduce(values: Tensor, reduction: str) -> Union[float, Tensor]:
    if reduction == "none":
        return values
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    return float(values.mean()) if values.numel() else 0.0


def precision_at_k(topk_indices: Tensor, targets: Tensor, k: int,
                   reduction: str = "mean") -> Union[float, Tensor]:
    """``P@k = |topk ∩ P| / k``, averaged over examples (``reduction="none"``: per example)."""
    return _reduce(_per_example(topk_indices, targets, k)["p"], reduction)


def ndcg_at_k(topk_indices: Tensor, targets: Tensor, k: int,
              reduction: str = "mean") -> Union[float, Tensor]:
    """``nDCG@k = sum_{i<k} rel_i / log2(i+2)  /  sum_{i<min(k,|P|)} 1 / log2(i+2)``."""
    return _reduce(_per_example(topk_indices, targets, k)["ndcg"], reduction)


def recall_at_k(topk_indices: Tensor, targets: Tensor, k: int,
                reduction: str = "mean") -> Union[float, Tensor]:
    """``recall@k = |topk ∩ P| / |P|`` (0 for an example without positives)."""
    return _reduce(_per_example(topk_indices, targets, k)["recall"], reduction)


class XCMetrics:
    """Sums of per-example P@k, nDCG@k, recall@k and the example count over evaluation batches.

    :meth:`compute` all-reduces the sums over ``group`` when a process group of world size > 1
    is initialised (a collective: every rank must call it), and returns ``p@k``, ``ndcg@k`` and
    ``recall@k`` for each ``k`` in ``ks`` (``{}`` if no example was seen), and ``psp@k`` when
    built with ``inv_propensity`` (``[C]``, :func:`inverse_propensity`). The task's
    ``Metrics.update(output, batch)`` adapter passes the top-k ids and the batch's targets.
    """

    _NAMES = ("p", "ndcg", "recall")

    def __init__(self, ks: Sequence[int] = (1, 5), group: Optional[dist.ProcessGroup] = None,
                 inv_propensity: Optional[Tensor] = None):
        self.ks = tuple(ks)
        self.group = group
        self.inv_propensity = None if inv_propensity is None else inv_propensity.double().cpu()
        self.reset()

    def reset(self) -> None:
        extra = 2 * len(self.ks) if self.inv_propensity is not None else 0
        self.sums = torch.zeros(len(self.ks) * len(self._NAMES) + extra + 1, dtype=torch.float64)

    def update(self, topk_indices: Tensor, targets: Tensor) -> None:
        """Adds a batch: ``topk_indices [B, >= max(ks)]`` and targets (``[B]`` or ``[B, L]``)."""
        topk_indices, targets = topk_indices.detach().cpu(), targets.detach().cpu()
        values = []
        for k in self.ks:
            per = _per_example(topk_indices, targets, k)
            values += [per[n].sum() for n in self._NAMES]
            if self.inv_propensity is not None:
                values += [x.sum() for x in _propensity_scored(topk_indices, targets, k,
                                                               self.inv_propensity)]
        self.sums += torch.stack(values + [torch.tensor(float(topk_indices.shape[0]),
                                                        dtype=torch.float64)])

    def compute(self) -> dict[str, float]:
        sums = self.sums.clone()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            if dist.get_backend(self.group) == "nccl":  # NCCL reduces device tensors only
                sums = sums.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(sums, group=self.group)
        count = float(sums[-1])
        if count == 0:
            return {}
        it = iter(sums[:-1].tolist())
        out = {}
        for k in self.ks:
            out.update({f"{n}@{k}": next(it) / count for n in self._NAMES})
            if self.inv_propensity is not None:
                gained, best = next(it), next(it)
                out[f"psp@{k}"] = gained / best if best > 0 else 0.0
        return out
