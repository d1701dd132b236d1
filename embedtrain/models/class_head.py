"""Class heads of millions of classes, split by rows (classes) across ranks.

The model-parallel exact softmax of the 100-million-class training systems: the batch's features
are all-gathered (data-parallel encoder, model-parallel head), every rank multiplies them with
its own slice of the class weights, and the softmax normaliser is assembled with two all-reduces
(the max, then the sum of exponentials); the target logit comes from the rank that owns the
class. The backward pass is written out (:class:`_ShardedSoftmaxCrossEntropy`): each rank gets the
gradient of its own slice only, and the features' gradient is summed back to the rank the example
came from by the all-gather's backward (a reduce-scatter). With one rank it is plain softmax
cross-entropy.

Example:
    >>> head = ShardedSoftmaxHead(num_classes=1_000_000, dim=128)   # this rank's slice only
    >>> loss = head(features, labels)          # local batch; loss is the global-batch mean
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn


def shard_range(num_classes: int, rank: int, world_size: int) -> tuple[int, int]:
    """Classes ``[start, end)`` of ``rank``: contiguous, sizes differing by at most one."""
    base, extra = divmod(num_classes, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _world(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _ShardedSoftmaxCrossEntropy(torch.autograd.Function):
    """Per-example softmax cross-entropy over logits split by columns (classes) across ranks."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, start: int,
                group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        distributed = _world(group)[1] > 1
        logits = logits.float()
        peak = logits.max(dim=1).values
        if distributed:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - peak[:, None]).exp_()
        total = exp.sum(dim=1)
        local = (target >= start) & (target < start + logits.shape[1])
        rows = local.nonzero(as_tuple=True)[0]
        cols = target[rows] - start
        picked = torch.zeros_like(total)
        picked[rows] = logits[rows, cols] - peak[rows]
        if distributed:
            both = torch.stack([total, picked])
            dist.all_reduce(both, group=group)
            total, picked = both[0], both[1]
        exp.div_(total[:, None])  # now this rank's slice of the softmax
        ctx.save_for_backward(exp, rows, cols)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, rows, cols = ctx.saved_tensors
        grad = softmax
        grad[rows, cols] -= 1.0
        grad.mul_(grad_loss[:, None])
        return grad, None, None, None


def sharded_softmax_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int,
                                  group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Per-example cross-entropy of a softmax whose classes are split across ``group``.

    Args:
        logits: ``[B, C_local]``, this rank's classes ``[start, start + C_local)`` for the same
            ``B`` examples on every rank.
        target: ``[B]`` global class ids (the same on every rank).
        start: first class of this rank.
        group: the ranks sharing the head (default: the world; none when not distributed).

    Returns:
        ``[B]`` losses, identical on every rank.
    """
    return _ShardedSoftmaxCrossEntropy.apply(logits, target, start, group)


def all_gather_rows(local: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Concatenates every rank's ``local`` rows (equal counts); differentiable (reduce-scatter back)."""
    if _world(group)[1] == 1:
        return local
    if local.requires_grad:
        from torch.distributed.nn.functional import all_gather

        return torch.cat(all_gather(local, group=group or dist.group.WORLD))
    parts = [torch.empty_like(local) for _ in range(_world(group)[1])]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


class ShardedSoftmaxHead(nn.Module):
    """A ``num_classes x dim`` softmax head holding only this rank's slice of classes.

    Args:
        num_classes: C, over all ranks.
        dim: feature dimension D.
        group: ranks sharing the head (default: the world, or no one outside torch.distributed).
        device: where this rank's slice lives.

    ``forward(features, labels)`` takes this rank's examples (the same count on every rank) and
    returns the mean loss over the global batch (identical on every rank).
    """

    def __init__(self, num_classes: int, dim: int, group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.group = group
        rank, world = _world(group)
        self.num_classes, self.dim = num_classes, dim
        self.start, self.end = shard_range(num_classes, rank, world)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, dim, device=device))
        nn.init.normal_(self.weight, std=dim ** -0.5)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, C_local]`` logits of ``features`` against this rank's classes."""
        return features @ self.weight.t()

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        gathered = all_gather_rows(features, self.group)
        targets = all_gather_rows(labels, self.group)
        losses = sharded_softmax_cross_entropy(self.logits(gathered), targets, self.start,
                                               self.group)
        return losses.mean()


def partial_fc_sample(targets: torch.Tensor, start: int, end: int, rate: float,
                      generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Partial FC's class sample of one rank: its positive classes plus uniform negatives.

    Args:
        targets: the global batch's class ids.
        start, end: this rank's classes.
        rate: fraction of this rank's classes to use per step (positives always included).
        generator: seeds the negatives.

    Returns:
        Sorted local row ids (``0 .. end - start``) of the sampled classes.
    """
    local = end - start
    want = min(local, max(1, round(rate * local)))
    positive = torch.zeros(local, dtype=torch.bool)
    positive[targets[(targets >= start) & (targets < end)] - start] = True
    owned = positive.nonzero(as_tuple=True)[0]
    # Negatives: the first classes of a random permutation that are not positives (a topk over
    # random scores would cost ~20x more at 10^6 classes).
    perm = torch.randperm(local, generator=generator)
    negatives = perm[~positive[perm]][: max(0, want - owned.numel())]
    return torch.cat([owned, negatives]).sort().values


class PartialFCHead(ShardedSoftmaxHead):
    """Partial FC: the softmax over the batch's positive classes and a uniform sample of the rest.

    Each step, every rank draws ``sample_rate`` of its classes (its positives always in), so only
    those rows take part in the logits and only they receive a gradient. ``sample_rate=1`` is the
    exact softmax.
    """

    def __init__(self, num_classes: int, dim: int, sample_rate: float = 0.1,
                 group: Optional[dist.ProcessGroup] = None, device: Optional[torch.device] = None,
                 seed: int = 0) -> None:
        super().__init__(num_classes, dim, group, device)
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate: must be in (0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + self.start)
        self.last_sample: Optional[torch.Tensor] = None

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(features, labels)
        gathered = all_gather_rows(features, self.group)
        targets = all_gather_rows(labels, self.group)
        sample = partial_fc_sample(targets, self.start, self.end, self.sample_rate, self.generator)
        self.last_sample = sample
        # Targets in this rank's sampled space: position in ``sample``, or -1 (owned elsewhere).
        owned = (targets >= self.start) & (targets < self.end)
        position = torch.searchsorted(sample, (targets - self.start).clamp(min=0))
        mapped = torch.where(owned, position, torch.full_like(targets, -1))
        # A sparse gradient: only the sampled rows are touched, never a dense C x D buffer.
        rows = torch.nn.functional.embedding(sample, self.weight, sparse=True)
        logits = gathered @ rows.t()
        return sharded_softmax_cross_entropy(logits, mapped, 0, self.group).mean()
