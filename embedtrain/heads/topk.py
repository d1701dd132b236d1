"""Top-k over millions of classes, without materialising ``B x C`` logits.

The class head ``W`` (``C x D``) is split by rows across ranks: rank ``r`` holds the contiguous
classes ``[start_r, end_r)``. :func:`blocked_topk` finds a shard's top-k (``block_rows`` classes
at a time, with a running top-k); :func:`merge_topk` merges per-shard candidates;
:func:`distributed_topk` does both across a process group. The class heads
(:mod:`embedtrain.heads.sharded`, :mod:`embedtrain.heads.replicated`) use these kernels for
evaluation and hard-negative mining.

Tie rule (everywhere here): results are ordered by score descending, then by global class id
ascending, so among equal scores the lower class id wins and comes first. Padding (a shard with
fewer than ``k`` classes) has score ``-inf`` and index ``-1`` and sorts after every real class,
even one scoring ``-inf``. Scores must not be NaN (a ``ValueError`` is raised).

Example:
    >>> scores, idx = blocked_topk(features, W_local, k=5, class_offset=start)   # one shard
    >>> scores, idx = distributed_topk(features, W_local, 5, class_offset=start)  # all shards
"""


from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

TopK = tuple[Tensor, Tensor]
_LAST = torch.iinfo(torch.int64).max  # sort key of the padding index -1: after every class
_SPAN = 256  # columns whose maximum is checked at once against the running k-th score


def _ordered(scores: Tensor, pos: Tensor) -> TopK:
    """Sorts each row by score descending, keeping the given order among equal scores."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    return scores.gather(1, order), pos.gather(1, order)


def _select(scores: Tensor, k: int) -> TopK:
    """The top-``min(k, n)`` columns of each row of ``scores [B, n]``, ties to the lower column.

    ``torch.topk`` picks an arbitrary subset of the entries equal to the k-th value; when a row
    has more of them than fit (rare with real-valued logits), the leftmost ones are taken
    instead (a cumulative count). Returns (scores, columns), unordered.
    """
    b, n = scores.shape
    kk = min(k, n)
    if kk == 0:
        return scores[:, :0], torch.zeros(b, 0, dtype=torch.long, device=scores.device)
    # One more than needed: the top-kk set is unambiguous unless the next value equals the k-th.
    vals, cols = torch.topk(scores, min(kk + 1, n), dim=1)
    if torch.isnan(vals).any():  # topk ranks NaN highest, so any NaN in the row shows up here
        raise ValueError("scores contain NaN")
    kth = vals[:, kk - 1:kk]
    if kk == n:
        return vals[:, :kk], cols[:, :kk]
    tied = (vals[:, kk] >= kth[:, 0]).nonzero(as_tuple=True)[0]
    vals, cols = vals[:, :kk], cols[:, :kk]
    if len(tied):  # only those rows are scanned again (a B x n cumulative count is slow)
        sub, sub_kth = scores[tied], kth[tied]
        equal = sub == sub_kth
        need = kk - (sub > sub_kth).sum(dim=1, keepdim=True)
        take = (sub > sub_kth) | (equal & (equal.cumsum(dim=1) <= need))
        picked = take.nonzero()[:, 1].view(len(tied), kk)  # row-major: ascending columns
        vals, cols = vals.clone(), cols.clone()
        vals[tied], cols[tied] = sub.gather(1, picked), picked
    return vals, cols


def _merge(scores: Tensor, indices: Tensor, k: int) -> TopK:
    """The first ``k`` of each row by (score desc, id asc, padding -1 last); no padding added."""
    if torch.isnan(scores).any():
        raise ValueError("scores contain NaN")
    key = torch.where(indices < 0, torch.full_like(indices, _LAST), indices)
    by_id = torch.sort(key, dim=1, stable=True).indices  # then a stable sort by score
    scores, indices = _ordered(scores.gather(1, by_id), indices.gather(1, by_id))
    return scores[:, :k], indices[:, :k]


def _pad(scores: Tensor, indices: Tensor, k: int) -> TopK:
    missing = k - scores.shape[1]
    if missing <= 0:
        return scores, indices
    b = scores.shape[0]
    return (torch.cat([scores, scores.new_full((b, missing), -math.inf)], dim=1),
            torch.cat([indices, indices.new_full((b, missing), -1)], dim=1))


@torch.no_grad()
def blocked_topk(features: Tensor, weight: Tensor, k: int, block_rows: int = 65536,
                 class_offset: int = 0, bias: Optional[Tensor] = None,
                 normalize_rows: bool = False) -> TopK:
    """Top-k of ``features @ weight.T (+ bias)`` computed ``block_rows`` classes at a time.

    Peak extra memory is O(B x (block_rows + k)): each block's logits are merged with the running
    top-k and dropped. Runs under ``no_grad`` (evaluation).

    Args:
        features: ``[B, D]``.
        weight: ``[C_local, D]``, this shard's rows of the class head, in any float dtype: each
            block is cast to ``features``' dtype (a bfloat16 head is never copied whole).
        k: how many classes to keep per example.
        block_rows: classes scored at once.
        class_offset: global class id of ``weight``'s row 0.
        bias: optional ``[C_local]``.
        normalize_rows: L2-normalise each block's rows (after the cast) before scoring them.

    Returns:
        ``(scores [B, k], indices [B, k])``: global class ids, by (score desc, class id asc);
        padded with ``(-inf, -1)`` when ``C_local < k``.
    """
    if k < 0 or block_rows < 1:
        raise ValueError(f"need k >= 0 and block_rows >= 1, got k={k}, block_rows={block_rows}")
    b = features.shape[0]
    run_s = features.new_empty((b, 0))
    run_i = torch.zeros(b, 0, dtype=torch.long, device=features.device)
    for start in range(0, weight.shape[0], block_rows):
        rows = weight[start:start + block_rows].to(features.dtype)
        if normalize_rows:
            rows = torch.nn.functional.normalize(rows, dim=1)
        logits = features @ rows.T
        if bias is not None:
            logits = logits + bias[start:start + block_rows]
        if run_s.shape[1] < k:  # fewer than k so far: any column may enter
            top_s, cols = _select(logits, k)
        else:  # only what reaches the running k-th can enter (ties: the merge's rule)
            top_s, cols = _reaching(logits, run_s[:, k - 1])
            if cols.shape[1] == 0:
                continue
        ids = torch.where(cols >= 0, cols + (class_offset + start), cols)
        run_s, run_i = _merge(torch.cat([run_s, top_s], dim=1), torch.cat([run_i, ids], dim=1), k)
    return _pad(run_s, run_i, k)


def _reaching(scores: Tensor, floor: Tensor) -> TopK:
    """The columns of ``scores [B, n]`` at or above each row's ``floor [B]``, as ``(scores,
    columns)`` ``[B, m]`` padded with ``(-inf, -1)`` (``m``: the most any row has).

    Found without a top-k over the block (on CPU, as slow as the products that made it): the
    maxima of ``_SPAN``-column spans first, then only the spans reaching the floor.
    """
    b, n = scores.shape
    full = n - n % _SPAN
    spans = scores[:, :full].view(b, full // _SPAN, _SPAN)
    peaks = spans.amax(dim=2)
    if torch.isnan(peaks).any() or torch.isnan(scores[:, full:]).any():
        raise ValueError("scores contain NaN")
    row, span = (peaks >= floor[:, None]).nonzero(as_tuple=True)
    reached = spans[row, span]
    i, j = (reached >= floor[row, None]).nonzero(as_tuple=True)
    t_row, t_col = (scores[:, full:] >= floor[:, None]).nonzero(as_tuple=True)
    rows = torch.cat([row[i], t_row])
    cols = torch.cat([span[i] * _SPAN + j, t_col + full])
    counts = torch.bincount(rows, minlength=b)
    width = int(counts.max()) if rows.numel() else 0
    order = torch.sort(rows, stable=True).indices
    rows, cols = rows[order], cols[order]
    place = torch.arange(len(rows), device=rows.device) - (counts.cumsum(0) - counts)[rows]
    out_s = scores.new_full((b, width), -math.inf)
    out_c = torch.full((b, width), -1, dtype=torch.long, device=scores.device)
    out_s[rows, place] = scores[rows, cols]
    out_c[rows, place] = cols
    return out_s, out_c


@torch.no_grad()
def merge_topk(parts: Sequence[TopK], k: Optional[int] = None) -> TopK:
    """Merges per-shard ``(scores [B, k_i], indices [B, k_i])`` into the global top-k.

    Same tie rule as :func:`blocked_topk` (padding ``-1`` last). ``k`` defaults to the first
    part's width; the result is padded with ``(-inf, -1)`` if the parts hold fewer classes.
    """
    if not parts:
        raise ValueError("merge_topk needs at least one part")
    k = parts[0][0].shape[1] if k is None else k
    scores, indices = _merge(torch.cat([s for s, _ in parts], dim=1),
                             torch.cat([i for _, i in parts], dim=1), k)
    return _pad(scores, indices, k)


def _world(group: Optional[dist.ProcessGroup]) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


@torch.no_grad()
def distributed_topk(features: Tensor, local_weight: Tensor, k: int, class_offset: int = 0,
                     block_rows: int = 65536, group: Optional[dist.ProcessGroup] = None,
                     bias: Optional[Tensor] = None, normalize_rows: bool = False) -> TopK:
    """Global top-k over a class head split by rows across the ranks of ``group``.

    ``features`` must be the SAME ``[B, D]`` tensor on every rank (the caller all-gathers the
    batch's features first, as the model-parallel head does). Each rank takes the blocked top-k
    of its slice (global ids via ``class_offset``), the ``B x k`` candidates (scores and ids) are
    all-gathered and merged, so every rank returns the same global top-k (``normalize_rows``
    and the weight's dtype as :func:`blocked_topk`'s). Without a process
    group (or with world size 1) this is :func:`blocked_topk`. Collective: all ranks must call.
    """
    local = blocked_topk(features, local_weight, k, block_rows, class_offset, bias,
                         normalize_rows)
    world = _world(group)
    if world == 1:
        return local
    gathered: list[TopK] = []
    for t in local:  # every rank's part is [B, k] thanks to the padding
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t.contiguous(), group=group)
        gathered.append(out)
    return merge_topk(list(zip(*gathered)), k)
