"""Which classes a sampled head's step uses: Partial FC's sample (the batch's positives and
uniform negatives) and each sampled class's odds of being in it (the log-q correction).

A sampled softmax over the candidates ``S`` estimates the full one with a bias towards the
classes that are in ``S`` most often: the batch's positives, which are the frequent classes.
Subtracting ``log q_j`` (``q_j``: the probability that class ``j`` is in ``S``) from every
candidate's logit removes it to first order (Bengio & Senecal 2008; Yi et al., RecSys 2019,
"sampling-bias-corrected neural modeling"): :func:`sample_log_q`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def partial_fc_sample(targets: Tensor, start: int, end: int, rate: float,
                      generator: Optional[torch.Generator] = None) -> Tensor:
    """Partial FC's class sample of one rank: its positive classes plus uniform negatives.

    Args:
        targets: the global batch's class ids (any shape; ``-1`` is padding).
        start, end: this rank's classes.
        rate: fraction of this rank's classes to use per step (positives always included).
        generator: seeds the negatives.

    Returns:
        Sorted local row ids (``0 .. end - start``) of the sampled classes.
    """
    local = end - start
    want = min(local, max(1, round(rate * local)))
    positive = positives(targets, start, end)
    owned = positive.nonzero(as_tuple=True)[0]
    need = max(0, want - owned.numel())
    if need + owned.numel() <= local // _SPARSE_SAMPLE:
        negatives = _few_negatives(positive, need, generator)
    else:
        # Negatives: the first classes of a random permutation that are not positives (a topk
        # over random scores would cost ~20x more at 10^6 classes).
        perm = torch.randperm(local, generator=generator)
        head = perm[:need + owned.numel()]  # holds at least ``need`` negatives
        negatives = head[~positive[head]][:need]
    return torch.cat([owned, negatives]).sort().values


_SPARSE_SAMPLE = 16  # below 1/16 of the slice, negatives are drawn, not cut from a permutation


def _few_negatives(positive: Tensor, need: int, generator: Optional[torch.Generator]) -> Tensor:
    """``need`` distinct classes drawn uniformly from those not ``positive``, without a
    permutation of the whole slice (at 2.5 x 10^7 classes a rank, ``randperm`` alone is 200 MB
    and most of a step): draws with replacement, repeats and positives dropped, until there are
    enough distinct ones, then a uniform subset of them of the size wanted (uniform by symmetry).
    """
    local = positive.numel()
    found = torch.zeros(0, dtype=torch.long)
    while found.numel() < need:
        draws = torch.randint(local, (need + need // 8 + 16,), generator=generator)
        found = torch.cat([found, draws[~positive[draws]]]).unique()
    return found[torch.randperm(found.numel(), generator=generator)[:need]]


def positives(targets: Tensor, start: int, end: int) -> Tensor:
    """Mask ``[end - start]`` of this rank's classes that are positives of the batch."""
    positive = torch.zeros(end - start, dtype=torch.bool)
    flat = targets.reshape(-1)
    positive[flat[(flat >= start) & (flat < end)] - start] = True
    return positive


def sample_log_q(candidates: Tensor, targets: Tensor, start: int, end: int, rate: float,
                 frequencies: Tensor) -> Tensor:
    """``log q`` of each of :func:`partial_fc_sample`'s ``candidates`` (sorted local rows).

    Class ``j`` is in the sample if it is a positive of the step's batch, with probability
    ``pi_j = 1 - (1 - f_j)^n`` for its label frequency ``f_j`` and the batch's ``n`` labels, or
    else as one of the uniform negatives, with this step's odds ``u`` (the negatives drawn over
    the classes that are not positives): ``q_j = pi_j + (1 - pi_j) u``.

    Args:
        candidates: this step's sample (local rows).
        targets: the global batch's class ids (``-1``: padding).
        start, end: this rank's classes.
        rate: the sample's share of the slice.
        frequencies: ``[end - start]`` each class's share of the training labels.
    """
    local = end - start
    want = min(local, max(1, round(rate * local)))
    owned = int(positives(targets, start, end).sum())
    uniform = max(0, want - owned) / max(local - owned, 1)
    labels = int((targets >= 0).sum())
    f = frequencies[candidates].double()
    batch = -torch.expm1(labels * torch.log1p(-f.clamp(max=1 - 1e-12)))
    q = batch + (1 - batch) * uniform
    return q.clamp_min(1e-30).log().float()
