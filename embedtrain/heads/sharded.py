"""Class heads of millions of classes, split by rows (classes) across ranks.

The model-parallel softmax of the 100-million-class training systems: the batch's features are
all-gathered (data-parallel encoder, model-parallel head), every rank multiplies them with its own
slice of the class weights, and the softmax normaliser is assembled with two all-reduces (the max,
then the sum of exponentials); the target logits come from the ranks that own the classes. The
backward pass is written out (:mod:`embedtrain.heads.ops`): each rank gets the gradient
of its own slice only, and the features' gradient goes back to the rank the example came from
through the all-gather's backward. With one rank it is plain softmax cross-entropy.

Heads (all share :class:`ShardedSoftmaxHead`'s interface, see :class:`ClassHead`):

* :class:`ShardedSoftmaxHead` (``full``): the exact softmax over all classes.
* :class:`PartialFCHead` (``partial_fc``): per rank, the batch's positive classes plus a uniform
  sample of the other classes at rate ``r`` (Partial FC); rows not sampled get no gradient at all
  (a sparse gradient of the sampled rows, never a dense ``C x D`` buffer).
* :class:`HardNegativeHead` (``hard_negatives``): dynamic class selection: per rank, the positives
  plus the classes whose weights score highest against the batch's features (found by an exact
  blocked top-k over a snapshot of the class weights, the *index*, rebuilt every ``K`` steps),
  plus an optional uniform sample.

Targets are global class ids, ``[B]`` (one per example) or ``[B, L]`` padded with ``-1``
(multi-label: the loss is the softmax over the positives, ``logsumexp - mean positive logit``).
An example without any label (all ``-1``: a padding row of an epoch's last batch) is left out of
the training loss.
Optional margins for embedding learning (features and class weights L2-normalised, logits
``s cos``): CosFace (``s (cos - m)`` for the positives) and ArcFace (``s cos(theta + m)``).

A slice may be stored in bfloat16 (``dtype``): a training step gathers the rows it uses in
float32 and leaves their float32 gradient in ``weight.main_grad``; the head's optimizer
(:class:`~embedtrain.train.optim.HeadRowWiseAdagrad`) rounds the updated rows back,
stochastically or to nearest (:mod:`embedtrain.heads.low_precision`). Evaluation, the
hard-negative index and export widen a block of rows at a time: no float32 copy of the slice.

Slices follow TorchRec's row-wise sharding (and ``DTensor``'s ``Shard(0)``): rank ``r`` holds
rows ``[r * ceil(C / W), ...)``, so the planner's row-wise estimate of the head is what each rank
holds. In ``state_dict`` the slice is a ``DTensor`` (``Shard(0)`` over the head's ranks), so DCP
checkpoints write each rank's rows once and reshard them on load (N ranks save, M ranks load).

Gradient convention: ``forward`` returns the mean loss over the *global* batch (the same value on
every rank); the class slice gets the gradient of that mean, while the features get ``world_size``
times it, because the encoder's data-parallel wrappers (DDP, TorchRec's sharded tables) average
their gradients over ranks as if each rank's loss were its local mean.

Example:
    >>> head = PartialFCHead(num_classes=1_000_000, dim=128, sample_rate=0.1)  # this rank's rows
    >>> loss = head(features, labels)          # local batch in, global-batch mean loss out
    >>> scores, ids = head.topk(features, 5)   # exact top-5 over all classes, in blocks
"""

from __future__ import annotations

import math
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from embedtrain.heads.ops import (
    all_gather_rows,
    all_gather_uneven,
    gather_rows,
    rank_and_world,
    scale_grad,
    sharded_binary_cross_entropy,
    sharded_softmax_cross_entropy,
)
from embedtrain.heads.index import ClusteredIndex, default_clusters, recall_at_k
from embedtrain.heads.sample import partial_fc_sample, positives, sample_log_q
from embedtrain.heads.low_precision import DTYPES
from embedtrain.models.options import HeadLoss, Margin, NegativeIndex, Rounding
from embedtrain.heads.topk import blocked_topk, distributed_topk

_EVAL_BLOCK = 65_536  # classes scored at once in evaluation (bounds memory at B x this)
_RANK_TIE = 1e-5  # target_rank: scores this close (relative) to the target's are ties


class ClassHead(Protocol):
    """What the XC task needs from a head (sharded or replicated)."""

    num_classes: int

    def forward(self, features: Tensor, targets: Tensor) -> Tensor:
        """Training loss (scalar) of this rank's ``features [B, D]`` and ``targets``."""
        ...

    def topk(self, features: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """``(scores [B, k], class ids [B, k])`` over all classes (collective if sharded)."""
        ...

    def eval_loss(self, features: Tensor, targets: Tensor) -> Tensor:
        """Per-example loss ``[B]`` (no margin, no sampling)."""
        ...


def shard_range(num_classes: int, rank: int, world_size: int) -> tuple[int, int]:
    """Classes ``[start, end)`` of ``rank``: blocks of ``ceil(C / W)``, the last ones smaller.

    The same split as TorchRec's row-wise sharding and ``torch.chunk`` (trailing ranks may hold
    fewer rows, or none when ``C < W``).
    """
    block = -(-num_classes // world_size)
    start = min(rank * block, num_classes)
    return start, min(start + block, num_classes)


@torch.no_grad()
def init_rows_(weight: Tensor, start: int, std: float, seed: int = 0, block: int = 65_536) -> None:
    """Fills a slice of a class head (global rows ``start ..``) with ``N(0, std^2)``.

    Row blocks of ``block`` classes have their own seed, so a class's initial weights are the
    same whatever the number of ranks (2 ranks start where 1 rank starts).
    """
    if weight.device.type == "meta":
        return
    end = start + weight.shape[0]
    for b in range(start // block, -(-end // block)):
        lo, hi = max(b * block, start), min((b + 1) * block, end)
        g = torch.Generator().manual_seed(seed * 1_000_003 + b)
        rows = torch.randn(hi - b * block, weight.shape[1], generator=g)
        weight[lo - start:hi - start] = rows[lo - b * block:] * std


def as_targets(targets: Tensor) -> Tensor:
    """``[B]`` or ``[B, L]`` class ids as ``[B, L]`` int64 (``-1`` padding)."""
    targets = targets.long()
    return targets[:, None] if targets.dim() == 1 else targets


def _mean_over_labelled(losses: Tensor, labelled: Tensor) -> Tensor:
    """Mean of ``losses`` over the examples that have a label: rows without any (padding rows
    of an epoch's last batch, all -1) add nothing to the loss or the gradient."""
    if bool(labelled.all()):
        return losses.mean()
    return (losses * labelled).sum() / labelled.sum().clamp(min=1)


def apply_margin(cosine: Tensor, rows: Tensor, cols: Tensor, margin: Margin, m: float,
                 scale: float) -> Tensor:
    """``scale * cosine`` with the positives ``(rows, cols)`` moved by the margin (differentiable)."""
    logits = cosine * scale
    if margin is Margin.NONE or rows.numel() == 0:
        return logits
    c = cosine[rows, cols]
    if margin is Margin.COSFACE:
        moved = c - m
    else:  # ArcFace: cos(theta + m), continued by a CosFace-like penalty where theta + m > pi
        sine = (1.0 - c * c).clamp(min=1e-12).sqrt()
        phi = c * math.cos(m) - sine * math.sin(m)
        moved = torch.where(c > math.cos(math.pi - m), phi, c - math.sin(math.pi - m) * m)
    return logits.index_put((rows, cols), moved * scale)


class ShardedSoftmaxHead(nn.Module):
    """A ``num_classes x dim`` softmax head holding only this rank's slice of classes (``full``).

    Args:
        num_classes: C, over all ranks.
        dim: feature dimension D.
        group: ranks sharing the head (default: the world, or no one outside torch.distributed).
        device: where this rank's slice lives.
        margin: CosFace/ArcFace margin (normalises features and weights); ``NONE``: plain logits.
        margin_value: ``m``.
        scale: ``s``, the logit scale of the normalised (margin) heads.
        seed: seeds the head's sampling (Partial FC, hard negatives).
        loss: ``softmax`` (over the step's classes: ``logsumexp - mean positive logit``) or
            ``bce`` (one-vs-all: the sum of the step's classes' sigmoid cross-entropies of
            ``logit - log C``, the multi-label loss of PECOS/DEXML-style training with sampled
            negatives; the shift makes every class start at the prior ``1 / C``).
        dtype: how the slice is stored: ``float32``, or ``bfloat16`` / ``float8_e4m3fn`` (no
            float32 copy: a step
            gathers its rows in float32, leaves their float32 gradient in ``weight.main_grad``
            for :class:`~embedtrain.train.optim.HeadRowWiseAdagrad`, which rounds the updated
            rows back by ``rounding``; evaluation casts a block of rows at a time).
        rounding: ``stochastic`` or ``nearest`` (:mod:`embedtrain.heads.low_precision`).

    ``forward(features, targets)`` takes this rank's examples (the same count on every rank) and
    returns the mean loss over the global batch (see the module docstring for the gradients).
    """

    def __init__(self, num_classes: int, dim: int, group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, margin: Margin = Margin.NONE,
                 margin_value: float = 0.35, scale: float = 30.0, seed: int = 0,
                 loss: HeadLoss = HeadLoss.SOFTMAX, dtype: torch.dtype = torch.float32,
                 rounding: Rounding = Rounding.STOCHASTIC) -> None:
        super().__init__()
        self.loss = HeadLoss(loss)
        # One-vs-all logits are shifted by -log C: every class starts at probability ~1/C, the
        # prior of one label among C (as a bias initialised to the prior); without it the
        # C - 1 negatives at probability 1/2 drown the positives for the first epochs.
        self.bce_offset = math.log(max(num_classes, 2))
        self.group = group
        self.rank, self.world_size = rank_and_world(group)
        self.num_classes, self.dim = num_classes, dim
        self.start, self.end = shard_range(num_classes, self.rank, self.world_size)
        if dtype not in DTYPES.values():
            raise ValueError(f"class head dtype: float32, bfloat16 or float8_e4m3fn, got {dtype}")
        self.weight = nn.Parameter(torch.empty(self.end - self.start, dim, device=device,
                                               dtype=dtype))
        init_rows_(self.weight, self.start, std=dim ** -0.5, seed=seed)
        self.rounding = Rounding(rounding)
        self.margin, self.margin_value, self.scale = Margin(margin), margin_value, scale
        self.seed = seed
        # Training steps taken; seeds each step's sample so a resumed run draws the same ones.
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self._register_state_dict_hook(_weight_as_dtensor)

    @property
    def normalised(self) -> bool:
        return self.margin is not Margin.NONE

    @property
    def low_precision(self) -> bool:
        """Rows stored below float32: a step gathers the rows it uses (all of them for full)."""
        return self.weight.dtype != torch.float32

    def _candidates(self, targets: Tensor, features: Tensor) -> Optional[Tensor]:
        """Sorted local rows taking part in this training step (None: all of them)."""
        return None

    def _local_targets(self, targets: Tensor, candidates: Optional[Tensor]) -> Tensor:
        """Global ids ``[B, L]`` -> columns of this step's logits, ``-1`` where not ours."""
        owned = (targets >= self.start) & (targets < self.end)
        local = (targets - self.start).clamp(min=0)
        if candidates is not None:
            local = torch.searchsorted(candidates, local)
        return torch.where(owned, local, torch.full_like(local, -1))

    def _logits(self, features: Tensor, weight: Tensor, local_targets: Tensor) -> Tensor:
        if not self.normalised:
            return features @ weight.t()
        cosine = F.normalize(features, dim=1) @ F.normalize(weight, dim=1).t()
        rows, slot = (local_targets >= 0).nonzero(as_tuple=True)
        return apply_margin(cosine, rows, local_targets[rows, slot], self.margin,
                            self.margin_value, self.scale)

    def forward(self, features: Tensor, targets: Tensor) -> Tensor:
        if not self.training:
            return self.eval_loss(features, targets).mean()
        targets = as_targets(targets)
        gathered = all_gather_rows(scale_grad(features, float(self.world_size)), self.group)
        targets = all_gather_rows(targets, self.group)
        counts = (targets >= 0).sum(dim=1)
        candidates = self._candidates(targets, gathered.detach())
        if candidates is None and self.low_precision:
            candidates = torch.arange(self.end - self.start)
        if candidates is None:
            weight = self.weight
        else:  # a sparse gradient: only the candidate rows are touched
            weight = gather_rows(self.weight, candidates, self._workspace(candidates))
        local_targets = self._local_targets(targets, candidates)
        labelled = counts > 0
        if not bool(labelled.all()) and bool(labelled.any()):
            # rows without a label (a history's padded positions: about half a seq step's rows)
            # add nothing to the loss or the gradient: left out before the logits, not after
            rows = labelled.nonzero(as_tuple=True)[0]
            gathered, local_targets, counts = gathered[rows], local_targets[rows], counts[rows]
        logits = self._correct(self._logits(gathered, weight, local_targets), targets, candidates)
        self.steps += 1
        if self.loss is HeadLoss.BCE:
            losses = sharded_binary_cross_entropy(logits - self.bce_offset, local_targets,
                                                  self.group)
        else:
            losses = sharded_softmax_cross_entropy(logits, local_targets, counts, self.group)
        return _mean_over_labelled(losses, counts > 0)

    def _correct(self, logits: Tensor, targets: Tensor, candidates: Optional[Tensor]) -> Tensor:
        """The step's logits as the loss takes them (a sampled head may correct them)."""
        return logits

    def _workspace(self, rows: Tensor) -> Tensor:
        """``[len(rows), D]`` of a buffer kept across steps (grown when a step samples more)."""
        n = rows.numel()
        buf = getattr(self, "_gathered", None)
        if buf is None or buf.shape[0] < n:
            buf = self._gathered = self.weight.new_empty((max(n, 1), self.dim),
                                                         dtype=torch.float32)
        return buf[:n]

    @torch.no_grad()
    def _eval_rows(self, start: int, end: int) -> Tensor:
        """Rows ``[start, end)`` of the slice as evaluation scores them: float32, normalised
        under a margin."""
        rows = self.weight[start:end].float()
        return F.normalize(rows, dim=1) if self.normalised else rows

    @torch.no_grad()
    def _snapshot(self) -> Tensor:
        """A copy of the slice as evaluation scores it (normalised under a margin), in the
        slice's dtype, made ``_EVAL_BLOCK`` rows at a time (no float32 copy of a bf16 slice)."""
        if not self.normalised:
            return self.weight.detach().clone()
        out = torch.empty_like(self.weight)
        for start in range(0, out.shape[0], _EVAL_BLOCK):
            out[start:start + _EVAL_BLOCK] = self._eval_rows(start, start + _EVAL_BLOCK)
        return out

    @torch.no_grad()
    def topk(self, features: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """This rank's examples' top-k over all classes (every rank must call; any batch sizes)."""
        gathered, first = all_gather_uneven(features, self.group)
        if self.normalised:
            gathered = F.normalize(gathered, dim=1) * self.scale
        scores, ids = distributed_topk(gathered, self.weight.detach(), k, self.start,
                                       _EVAL_BLOCK, self.group, normalize_rows=self.normalised)
        return scores[first:first + features.shape[0]], ids[first:first + features.shape[0]]

    @torch.no_grad()
    def target_rank(self, features: Tensor, targets: Tensor,
                    exclude: Optional[Tensor] = None) -> Tensor:
        """1-based rank of each of this rank's examples' target (``[B]`` class ids) among all
        classes by score, ties to the smaller id: what MRR reads. One blocked pass over the
        slice, as :meth:`eval_loss`; every rank must call (any batch sizes). ``exclude``
        (``[B, L]``, ``-1`` padding; repeats once): classes out of each example's ranking (a
        user's history); a target among its own is unrankable: rank 0. The target's score is
        its row's dot product, which may differ from the blocked product in the last bits: a
        class is ahead when greater by more than ``_RANK_TIE`` (relative), or within it (a tie)
        with a smaller id (the target, its own tie, never counts)."""
        gathered, first = all_gather_uneven(features, self.group)
        targets, _ = all_gather_uneven(targets.long().reshape(-1), self.group)
        if self.normalised:
            gathered = F.normalize(gathered, dim=1) * self.scale
        owned = ((targets >= self.start) & (targets < self.end)).nonzero(as_tuple=True)[0]
        score = torch.zeros(gathered.shape[0])
        if owned.numel():
            row = self.weight[targets[owned] - self.start].float()
            if self.normalised:
                row = F.normalize(row, dim=1)
            score[owned] = (gathered[owned] * row).sum(1)
        if self.world_size > 1:  # each target's score from the rank holding its row
            dist.all_reduce(score, group=self.group)
        ahead = torch.zeros(gathered.shape[0], dtype=torch.long)
        tolerance = _RANK_TIE * score.abs().clamp(min=1.0)
        for start in range(0, self.weight.shape[0], _EVAL_BLOCK):
            logits = gathered @ self._eval_rows(start, start + _EVAL_BLOCK).t()
            ids = torch.arange(logits.shape[1]) + self.start + start
            gap = logits - score[:, None]
            tie = gap.abs() <= tolerance[:, None]
            before = (gap > tolerance[:, None]) | (tie & (ids[None] < targets[:, None]))
            ahead += before.sum(1)  # the target is its own tie, not before itself
        hidden = None
        if exclude is not None:
            excluded, _ = all_gather_uneven(exclude.long(), self.group)
            excluded, _ = excluded.sort(dim=1)
            excluded[:, 1:][excluded[:, 1:] == excluded[:, :-1]] = -1  # repeats once
            hidden = (excluded == targets[:, None]).any(1)
            excluded[excluded == targets[:, None]] = -1
            rows, slot = ((excluded >= self.start) & (excluded < self.end)).nonzero(as_tuple=True)
            if rows.numel():  # the excluded classes this rank holds, and whether they were ahead
                ids = excluded[rows, slot]
                row = self.weight[ids - self.start].float()
                if self.normalised:
                    row = F.normalize(row, dim=1)
                gap = (gathered[rows] * row).sum(1) - score[rows]
                before = (gap > tolerance[rows]) | (
                    (gap.abs() <= tolerance[rows]) & (ids < targets[rows]))
                ahead -= torch.zeros_like(ahead).index_add_(0, rows, before.long())
        if self.world_size > 1:
            dist.all_reduce(ahead, group=self.group)
        rank = ahead + 1
        if hidden is not None:
            rank[hidden] = 0
        return rank[first:first + features.shape[0]]

    @torch.no_grad()
    def eval_loss(self, features: Tensor, targets: Tensor) -> Tensor:
        """Per-example loss of this rank's examples over all classes, ``_EVAL_BLOCK`` at a time."""
        gathered, first = all_gather_uneven(features, self.group)
        targets, _ = all_gather_uneven(as_targets(targets), self.group)
        if self.normalised:
            gathered = F.normalize(gathered, dim=1) * self.scale
        b = gathered.shape[0]
        bce = self.loss is HeadLoss.BCE
        peak = torch.full((b,), -math.inf)
        total = torch.zeros(b)
        for start in range(0, self.weight.shape[0], _EVAL_BLOCK):  # online log-sum-exp
            logits = gathered @ self._eval_rows(start, start + _EVAL_BLOCK).t()
            if bce:
                total += F.softplus(logits - self.bce_offset).sum(1)
                continue
            new_peak = torch.maximum(peak, logits.max(dim=1).values)
            total = total * (peak - new_peak).exp() + (logits - new_peak[:, None]).exp().sum(1)
            peak = new_peak
        local = self._local_targets(targets, None)
        rows, slot = (local >= 0).nonzero(as_tuple=True)
        counts = (targets >= 0).sum(dim=1).clamp(min=1).float()
        positive = self.weight[local[rows, slot]].float()
        if self.normalised:
            positive = F.normalize(positive, dim=1)
        positive = (gathered[rows] * positive).sum(1)
        if bce:
            positive = positive - self.bce_offset
        picked = torch.zeros(b).index_add_(0, rows, positive if bce else positive / counts[rows])
        if bce:  # sum of softplus(z) over all classes - sum of the positives' z
            both = torch.stack([total, picked])
            if self.world_size > 1:
                dist.all_reduce(both, group=self.group)
            return (both[0] - both[1])[first:first + features.shape[0]]
        if self.world_size > 1:
            global_peak = peak.clone()
            dist.all_reduce(global_peak, op=dist.ReduceOp.MAX, group=self.group)
            scaled = torch.where(peak > -math.inf, total * (peak - global_peak).exp(),
                                 torch.zeros_like(total))
            both = torch.stack([scaled, picked])
            dist.all_reduce(both, group=self.group)
            peak, total, picked = global_peak, both[0], both[1]
        loss = peak + total.log() - picked
        return loss[first:first + features.shape[0]]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        key = prefix + "weight"
        value = state_dict.get(key)
        if value is not None and hasattr(value, "to_local"):  # DTensor from a checkpoint
            state_dict[key] = value.to_local()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _weight_as_dtensor(module: ShardedSoftmaxHead, state_dict: dict, prefix: str,
                       local_metadata: Any) -> None:
    key = prefix + "weight"
    if key in state_dict and dist.is_initialized():
        state_dict[key] = rows_as_dtensor(state_dict[key], module.num_classes, module.group)


def rows_as_dtensor(local: Tensor, num_rows: int, group: Optional[dist.ProcessGroup] = None):
    """This rank's rows of a ``[num_rows, ...]`` tensor split by :func:`shard_range`, as a
    ``DTensor`` (``Shard(0)`` over ``group``) sharing ``local``'s storage."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, local.device.type)
    shape = torch.Size([num_rows, *local.shape[1:]])
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


class PartialFCHead(ShardedSoftmaxHead):
    """Partial FC: the softmax over the batch's positive classes and a uniform sample of the rest.

    Each step, every rank draws ``sample_rate`` of its classes (its positives always in), so only
    those rows take part in the logits and only they receive a gradient. ``sample_rate=1`` is the
    exact softmax; ``0``, the global batch's positives alone: in-batch negatives (a rank whose
    slice holds none of them draws one class). Evaluation scores all classes.
    """

    def __init__(self, num_classes: int, dim: int, sample_rate: float = 0.1,
                 class_counts: Optional[Tensor] = None, **kwargs: Any) -> None:
        super().__init__(num_classes, dim, **kwargs)
        if not 0 <= sample_rate <= 1:
            raise ValueError(f"sample_rate: must be in [0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self.last_sample: Optional[Tensor] = None
        # class_counts: the log-q correction (class_sample.sample_log_q) from their frequencies,
        # a class never seen counted once (its odds are not 0: it may be a label)
        self.frequencies = None if class_counts is None else (
            class_counts[self.start:self.end].double().clamp(min=1)
            / max(float(class_counts.sum()), 1.0))

    def _correct(self, logits: Tensor, targets: Tensor, candidates: Optional[Tensor]) -> Tensor:
        if self.frequencies is None or candidates is None:
            return logits
        return logits - sample_log_q(candidates, targets, self.start, self.end,
                                     self.sample_rate, self.frequencies)

    def _generator(self) -> torch.Generator:
        # Seeded by (seed, first class, step): independent across ranks and steps, and the same
        # draw after a resume (the step counter is in the checkpoint).
        return torch.Generator().manual_seed(
            (self.seed * 1_000_003 + self.start) * 1_000_033 + int(self.steps))

    def _candidates(self, targets: Tensor, features: Tensor) -> Optional[Tensor]:
        self.last_sample = partial_fc_sample(targets, self.start, self.end, self.sample_rate,
                                             self._generator())
        return self.last_sample


class HardNegativeHead(PartialFCHead):
    """Dynamic class selection: positives, the batch's nearest classes, and a uniform sample.

    Every ``refresh_every`` training steps the *index* (a copy of this rank's class weights,
    normalised under a margin) is rebuilt; each step, the ``negatives`` classes of this rank
    scoring highest against each example's features in the index (the hardest negatives, as the
    model's own logits would rank them) join the positives and a uniform sample at
    ``sample_rate`` (which may be 0). Only those rows get gradients.

    ``index``: ``exact`` (blocked top-k over the whole slice: ``B x n x D`` flops a step) or
    ``clustered`` (:class:`~embedtrain.heads.index.ClusteredIndex`: k-means over this
    rank's slice into ``index_clusters`` lists, default ``ceil(sqrt(n))``, each query searching
    its ``index_probe`` nearest, default a quarter of them). At each rebuild of a clustered
    index its recall@``negatives`` against the exact top-k is measured on up to 256 of the
    step's examples (averaged over ranks) and appended to ``index_recall`` as
    ``{"step", "recall", "clusters", "probe"}``.

    For a resume to draw the same classes as an uninterrupted run, checkpoint at multiples of
    ``refresh_every`` (the index is rebuilt, not saved).
    """

    def __init__(self, num_classes: int, dim: int, negatives: int = 10, refresh_every: int = 100,
                 sample_rate: float = 0.0, index: NegativeIndex = NegativeIndex.EXACT,
                 index_clusters: int = 0, index_probe: int = 0, **kwargs: Any) -> None:
        super().__init__(num_classes, dim, sample_rate=sample_rate, **kwargs)
        if negatives < 1 or refresh_every < 1 or index_clusters < 0 or index_probe < 0:
            raise ValueError(f"need negatives >= 1, refresh_every >= 1, index_clusters and "
                             f"index_probe >= 0 (0: automatic), got {negatives}, {refresh_every}, "
                             f"{index_clusters} and {index_probe}")
        self.negatives, self.refresh_every = negatives, refresh_every
        self.index_kind = NegativeIndex(index)
        local = self.end - self.start
        self.index_clusters = min(index_clusters or default_clusters(local), max(local, 1))
        self.index_probe = min(index_probe or max(1, -(-self.index_clusters // 4)),
                               self.index_clusters)
        self.index_recall: list[dict[str, Any]] = []
        self._index: Optional[Tensor] = None
        self._clustered: Optional[ClusteredIndex] = None
        self._index_step = -1

    @torch.no_grad()
    def _refresh(self, query: Tensor) -> None:
        step = int(self.steps) - int(self.steps) % self.refresh_every
        if self._index_step == step:
            return
        self._index = self._snapshot()
        self._index_step = step
        if self.index_kind is NegativeIndex.CLUSTERED:
            g = torch.Generator().manual_seed(
                (self.seed * 1_000_003 + self.start) * 1_000_033 + step)
            self._clustered = ClusteredIndex(self._index, self.index_clusters, self.index_probe,
                                             generator=g)
            self._index = None  # the clustered index holds the one copy
            self._measure_recall(query, step)

    @torch.no_grad()
    def _measure_recall(self, query: Tensor, step: int) -> None:
        index = self._clustered
        k = min(self.negatives, index.rows)
        sample = query[:256]
        recall = torch.tensor([1.0, 1.0])
        if k:
            exact = blocked_topk(sample, index.sorted, k, _EVAL_BLOCK)[1]
            found = index.search(sample, k)[1]
            # Both in the index's row order: exact's columns index the sorted copy.
            recall[0] = recall_at_k(found, index.ids[exact])
        if self.world_size > 1:
            dist.all_reduce(recall, group=self.group)
        self.index_recall.append({"step": step, "recall": float(recall[0] / self.world_size),
                                  "clusters": index.clusters, "probe": index.probe})

    @torch.no_grad()
    def _candidates(self, targets: Tensor, features: Tensor) -> Optional[Tensor]:
        query = F.normalize(features, dim=1) if self.normalised else features
        self._refresh(query)
        chosen = positives(targets, self.start, self.end)
        k = min(self.negatives, self.end - self.start)
        if k:
            if self._clustered is not None:
                nearest = self._clustered.search(query, k)[1]
                nearest = nearest[nearest >= 0]
            else:
                nearest = blocked_topk(query, self._index, k, _EVAL_BLOCK)[1].reshape(-1)
            chosen[nearest] = True
        if self.sample_rate > 0:
            chosen[partial_fc_sample(targets, self.start, self.end, self.sample_rate,
                                     self._generator())] = True
        self.last_sample = chosen.nonzero(as_tuple=True)[0]
        return self.last_sample
