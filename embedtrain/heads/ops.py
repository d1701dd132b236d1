"""The collectives and autograd functions of the class heads (:mod:`embedtrain.heads.sharded`).

The sharded losses (:func:`sharded_softmax_cross_entropy`, :func:`sharded_binary_cross_entropy`)
take the logits of this rank's classes and assemble the softmax normaliser, or the one-vs-all
sum, with all-reduces; their backward passes are written out, so each rank gets the gradient of
its own columns only. :func:`gather_rows` gives a sparse gradient of the rows a sampling head
uses, :func:`scale_grad` scales a gradient on its way back (the features' ``world_size`` factor
of the heads' gradient convention), :func:`all_gather_rows` / :func:`all_gather_uneven`
concatenate every rank's examples. Outside ``torch.distributed`` (or with one rank) they are the
plain single-process operations.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


def rank_and_world(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _ShardedSoftmaxCrossEntropy(torch.autograd.Function):
    """Per-example softmax cross-entropy over logits split by columns (classes) across ranks.

    ``targets [B, L]`` hold this rank's *column* of each positive or ``-1`` (padding, or a class
    owned by another rank); ``counts [B]`` the number of positives of each example (all ranks).
    Loss: ``logsumexp(all logits) - mean over positives of their logits``.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, counts: Tensor,
                group: Optional[dist.ProcessGroup]) -> Tensor:
        distributed = rank_and_world(group)[1] > 1
        logits = logits.float()
        if logits.shape[1]:
            peak = logits.max(dim=1).values
        else:  # a rank without classes
            peak = logits.new_full((logits.shape[0],), -math.inf)
        if distributed:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - peak[:, None]).exp_()
        total = exp.sum(dim=1)
        rows, slot = (targets >= 0).nonzero(as_tuple=True)
        cols = targets[rows, slot]
        weights = 1.0 / counts[rows].clamp(min=1).to(logits.dtype)
        picked = torch.zeros_like(total).index_add_(0, rows, (logits[rows, cols] - peak[rows]) * weights)
        if distributed:
            both = torch.stack([total, picked])
            dist.all_reduce(both, group=group)
            total, picked = both[0], both[1]
        exp.div_(total[:, None])  # now this rank's slice of the softmax
        ctx.save_for_backward(exp, rows, cols, weights)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        softmax, rows, cols, weights = ctx.saved_tensors
        grad = softmax
        grad.index_put_((rows, cols), -weights, accumulate=True)
        grad.mul_(grad_loss[:, None])
        return grad, None, None, None


class _ShardedBinaryCrossEntropy(torch.autograd.Function):
    """Per-example one-vs-all loss over logits split by columns (classes) across ranks.

    ``targets [B, L]`` hold this rank's column of each positive or ``-1``. Loss: the sum over
    every column (of every rank) of the sigmoid cross-entropy, ``softplus(z) - y z``.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, group: Optional[dist.ProcessGroup]
                ) -> Tensor:
        logits = logits.float()
        rows, slot = (targets >= 0).nonzero(as_tuple=True)
        cols = targets[rows, slot]
        losses = F.softplus(logits).sum(dim=1).index_add_(0, rows, -logits[rows, cols])
        if rank_and_world(group)[1] > 1:
            dist.all_reduce(losses, group=group)
        grad = logits.sigmoid()  # d loss / d logit = sigmoid(z) - y
        grad.index_put_((rows, cols), torch.full_like(cols, -1, dtype=grad.dtype),
                        accumulate=True)
        ctx.save_for_backward(grad)
        return losses

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_loss[:, None]), None, None


def sharded_softmax_cross_entropy(logits: Tensor, local_targets: Tensor, counts: Tensor,
                                  group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """Per-example cross-entropy of a softmax whose classes are split across ``group``.

    Args:
        logits: ``[B, C_local]``, this rank's classes, for the same ``B`` examples on every rank.
        local_targets: ``[B, L]`` columns of ``logits`` holding a positive, ``-1`` elsewhere.
        counts: ``[B]`` positives per example over all ranks.
        group: the ranks sharing the head (default: the world; none when not distributed).

    Returns:
        ``[B]`` losses, identical on every rank.
    """
    return _ShardedSoftmaxCrossEntropy.apply(logits, local_targets, counts, group)


def sharded_binary_cross_entropy(logits: Tensor, local_targets: Tensor,
                                 group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """Per-example sum of sigmoid cross-entropies over classes split across ``group``.

    Args as :func:`sharded_softmax_cross_entropy`; an example's positives are distinct.

    Returns:
        ``[B]`` losses, identical on every rank.
    """
    return _ShardedBinaryCrossEntropy.apply(logits, local_targets, group)


class _GatherRows(torch.autograd.Function):
    """``weight[rows]`` into ``out`` (a workspace kept from step to step, so the rows are not
    copied into freshly mapped memory each step); the gradient is sparse, as ``F.embedding``'s
    with ``sparse=True``.

    A ``weight`` stored in a lower precision than ``out`` (a bfloat16 head) is gathered into
    ``out``'s float32, and its gradient goes to ``weight.main_grad`` in float32 instead of
    through autograd, which would cast it to bfloat16 (:class:`~embedtrain.train.optim.
    HeadRowWiseAdagrad` reads it there)."""

    @staticmethod
    def forward(ctx, weight: Tensor, rows: Tensor, out: Tensor) -> Tensor:
        ctx.save_for_backward(rows)
        ctx.shape = weight.shape
        ctx.low_precision = weight if weight.dtype != out.dtype else None
        if ctx.low_precision is not None:
            return out.copy_(weight.index_select(0, rows))
        return torch.index_select(weight, 0, rows, out=out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (rows,) = ctx.saved_tensors
        sparse = torch.sparse_coo_tensor(rows[None], grad, ctx.shape, check_invariants=False)
        param = ctx.low_precision
        if param is None:
            return sparse, None, None
        held = getattr(param, "main_grad", None)
        param.main_grad = sparse if held is None else held + sparse
        return None, None, None


class _ScaleGrad(torch.autograd.Function):
    """The identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None


def gather_rows(weight: Tensor, rows: Tensor, out: Tensor) -> Tensor:
    """``weight[rows]``, written into ``out``, with a sparse gradient of ``weight`` (the rows)."""
    return _GatherRows.apply(weight, rows, out)


def scale_grad(x: Tensor, scale: float) -> Tensor:
    """``x``, whose gradient is multiplied by ``scale`` on the way back."""
    return _ScaleGrad.apply(x, scale)


def all_gather_rows(local: Tensor, group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """Concatenates every rank's ``local`` rows (equal counts); differentiable (sums back)."""
    world = rank_and_world(group)[1]
    if world == 1:
        return local
    if local.requires_grad:
        from torch.distributed.nn.functional import all_gather

        return torch.cat(all_gather(local.contiguous(), group=group or dist.group.WORLD))
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


@torch.no_grad()
def all_gather_uneven(local: Tensor, group: Optional[dist.ProcessGroup] = None
                      ) -> tuple[Tensor, int]:
    """Every rank's rows (counts may differ) and where this rank's rows start in them."""
    rank, world = rank_and_world(group)
    if world == 1:
        return local, 0
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([local.shape[0]]), group=group)
    counts = [int(s) for s in sizes]
    padded = local.new_zeros((max(counts), *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, counts)]), sum(counts[:rank])
