"""Replicated class heads for extreme classification: adaptive softmax and MACH.

Unlike the row-split heads of :mod:`embedtrain.heads.sharded`, these heads are small enough
to live whole on every rank (data-parallel: DDP averages their gradients), because they never
hold a full ``C x D`` matrix at full width or score all ``C`` classes in training:

* :class:`AdaptiveSoftmaxHead` (Grave et al., 2017) for one label per example with Zipfian
  frequencies: the frequent classes (the shortlist) get a full-width softmax, the rare ones are
  grouped into tail clusters of ever narrower projections, reached through one head logit each.
  Built on :class:`torch.nn.AdaptiveLogSoftmaxWithLoss`, with classes renumbered by frequency.
* :class:`MACHHead` (Medini et al., 2019): ``R`` independent hashings of the ``C`` classes into
  ``B`` buckets, one ``B``-way softmax per hashing; memory and training cost ``R x B``, not
  ``C``. Takes one label or several (``[B, L]`` padded with -1) per example.

Every head has the same interface: ``forward(features, targets)`` returns the mean training
loss, ``eval_loss(features, targets)`` the per-example loss, and ``topk(features, k)`` the top-k
classes over all ``C`` with global class ids, scored ``block_rows`` classes at a time (memory
``O(B x block_rows)``, never ``B x C``) and ordered by the tie rule of
:mod:`embedtrain.heads.topk` (score descending, then class id ascending; padding
``(-inf, -1)`` when ``C < k``).

Example:
    >>> counts = torch.bincount(train_labels, minlength=C)
    >>> head = AdaptiveSoftmaxHead(C, dim=128, class_order=frequency_order(counts))
    >>> loss = head(features, labels)                  # labels: [B] class ids
    >>> scores, ids = head.topk(features, k=5)         # [B, 5] each, global class ids
    >>> mach = MACHHead(C, dim=128, num_buckets=16384, num_repetitions=8)
    >>> loss = mach(features, pad_targets(positives))  # multi-label: [B, L] padded with -1
"""

from __future__ import annotations

from itertools import pairwise
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from embedtrain.heads.topk import merge_topk

TopK = tuple[Tensor, Tensor]

_MAX_SHORTLIST = 4096
_MERSENNE_31 = 2 ** 31 - 1  # prime modulus of MACH's hashes; (a c + b) < 2^63 for c < 2^31


def labelled_rows(features: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """The examples with at least one label: padding rows (all -1) are dropped (other negative
    ids stay, for the heads' range checks to name)."""
    labelled = targets != -1 if targets.dim() == 1 else (targets != -1).any(dim=1)
    if bool(labelled.all()):
        return features, targets
    return features[labelled], targets[labelled]


def _empty_topk(features: Tensor) -> TopK:
    b = features.shape[0]
    return features.new_empty((b, 0)), torch.zeros(b, 0, dtype=torch.long, device=features.device)


def _update_topk(running: TopK, scores: Tensor, ids: Tensor, k: int) -> TopK:
    """Merges a block of ``scores [B, n]`` of classes ``ids [n]`` into the running top-``k``.

    Only the block's own top-``k`` can make the cut; ``torch.topk`` picks it unless more classes
    share the k-th score than fit, in which case those rows are selected by the tie rule (lower
    class id first, whatever the column order) with a full sort of the block.
    """
    b, n = scores.shape
    if n <= k:
        return merge_topk([running, (scores, ids.expand(b, n))], k)
    vals, cols = torch.topk(scores, k + 1, dim=1)
    top_s, top_i = vals[:, :k], ids[cols[:, :k]]
    tied = (vals[:, k - 1] == vals[:, k]).nonzero(as_tuple=True)[0]
    if tied.numel():
        exact = merge_topk([(scores[tied], ids.expand(tied.numel(), n))], k)
        top_s, top_i = top_s.index_put((tied,), exact[0]), top_i.index_put((tied,), exact[1])
    return merge_topk([running, (top_s, top_i)], k)


def _check_topk_args(k: int, block_rows: int) -> None:
    if k < 0 or block_rows < 1:
        raise ValueError(f"need k >= 0 and block_rows >= 1, got k={k}, block_rows={block_rows}")


def frequency_order(counts: Tensor) -> Tensor:
    """Class ids from most to least frequent: ``counts`` descending, ties by class id ascending.

    Args:
        counts: ``[C]`` training-label count of each class (any real dtype).

    Returns:
        ``LongTensor[C]``, the ``class_order`` of :class:`AdaptiveSoftmaxHead`.
    """
    if counts.dim() != 1:
        raise ValueError(f"counts: expected a 1-D tensor [C], got shape {tuple(counts.shape)}")
    return torch.sort(counts, descending=True, stable=True).indices


def default_cutoffs(num_classes: int, dim: int, div_value: float = 4.0) -> list[int]:
    """Adaptive softmax cutoffs for 10^4..10^7 Zipfian classes.

    The shortlist holds 2% of the classes, at most 4096 (Grave et al. used 2,000-4,000 for
    vocabularies of 10^5..10^6); each further cluster is 10x the previous cutoff, so at
    ``C = 10^6`` the cutoffs are ``[4096, 40960, 409600]``. A cluster is added only while its
    projection width ``dim // div_value ** (i + 1)`` stays >= 1; the last cluster takes all the
    remaining classes (at ``C = 10^7``, ``dim = 128``: ``[409600, 10^7)`` with width 2).

    Returns:
        Strictly increasing cutoffs in ``[1, num_classes - 1]`` (at least one).
    """
    if num_classes < 2:
        raise ValueError(f"num_classes: adaptive softmax needs at least 2 classes, "
                         f"got {num_classes}")
    cutoffs = [min(_MAX_SHORTLIST, max(1, num_classes // 50))]
    while cutoffs[-1] * 10 < num_classes and int(dim // div_value ** (len(cutoffs) + 1)) >= 1:
        cutoffs.append(cutoffs[-1] * 10)
    return cutoffs


class AdaptiveSoftmaxHead(nn.Module):
    """Adaptive softmax over ``num_classes`` single-label classes renumbered by frequency.

    Class ``class_order[r]`` is the ``r``-th most frequent; the wrapped
    :class:`torch.nn.AdaptiveLogSoftmaxWithLoss` (``self.adaptive``) works on these frequency
    ranks, and the head maps targets in (``rank_of``) and top-k ids out (``class_order``). Both
    maps are persistent buffers: the weights mean nothing without the order they were trained in.

    Every tail weight is touched (times zero) by the training loss, so a cluster that no target
    of the batch falls into still has a gradient: DDP with ``find_unused_parameters=False``
    (TorchRec's default) would otherwise fail at the next step.

    Args:
        num_classes: C.
        dim: feature dimension D.
        cutoffs: frequency ranks where the shortlist and each tail cluster end, strictly
            increasing in ``[1, C - 1]``; default :func:`default_cutoffs`.
        div_value: the i-th tail cluster (from 0) projects to ``dim // div_value ** (i + 1)``.
        class_order: ``LongTensor[C]``, a permutation of the class ids, most frequent first
            (:func:`frequency_order`); default: class id order.

    Example:
        >>> head = AdaptiveSoftmaxHead(1_000_000, 128, class_order=frequency_order(counts))
        >>> head(features, labels).backward()
        >>> scores, ids = head.topk(features, k=10)
    """

    def __init__(self, num_classes: int, dim: int, cutoffs: Optional[Sequence[int]] = None,
                 div_value: float = 4.0, class_order: Optional[Tensor] = None) -> None:
        super().__init__()
        cutoffs = default_cutoffs(num_classes, dim, div_value) if cutoffs is None else list(cutoffs)
        if (not cutoffs or any(int(c) != c for c in cutoffs) or cutoffs[0] < 1
                or cutoffs[-1] > num_classes - 1 or any(a >= b for a, b in pairwise(cutoffs))):
            raise ValueError(f"cutoffs: need strictly increasing integers in "
                             f"[1, {num_classes - 1}], got {cutoffs}")
        for i in range(len(cutoffs)):
            if int(dim // div_value ** (i + 1)) < 1:
                raise ValueError(f"cutoffs: tail cluster {i} would project to dim // div_value ** "
                                 f"{i + 1} = 0 features (dim={dim}, div_value={div_value}); "
                                 "use fewer cutoffs or a smaller div_value")
        if class_order is None:
            class_order = torch.arange(num_classes)
        class_order = torch.as_tensor(class_order, dtype=torch.long)
        if (class_order.shape != (num_classes,)
                or class_order.device.type != "meta" and not torch.equal(class_order.sort().values, torch.arange(num_classes))):
            raise ValueError(f"class_order: must be a permutation of 0..{num_classes - 1}, got a "
                             f"tensor of shape {tuple(class_order.shape)} that is not")
        self.num_classes, self.dim = num_classes, dim
        self.adaptive = nn.AdaptiveLogSoftmaxWithLoss(dim, num_classes, [int(c) for c in cutoffs],
                                                      div_value=div_value)
        self.register_buffer("class_order", class_order.clone())
        rank_of = torch.empty_like(class_order)
        rank_of[class_order] = torch.arange(num_classes)
        self.register_buffer("rank_of", rank_of)

    @property
    def cutoffs(self) -> list[int]:
        """Frequency ranks where the shortlist and each tail cluster end (the last one is C)."""
        return list(self.adaptive.cutoffs)

    def _ranks(self, targets: Tensor) -> Tensor:
        if targets.dim() != 1:
            raise ValueError("adaptive softmax takes one label per example; use full/partial_fc "
                             f"for multi-label data (got targets of shape {tuple(targets.shape)})")
        if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= self.num_classes):
            raise ValueError(f"targets: class ids must be in [0, {self.num_classes - 1}], got "
                             f"[{int(targets.min())}, {int(targets.max())}]")
        return self.rank_of[targets]

    def forward(self, features: Tensor, targets: Tensor) -> Tensor:
        """Mean negative log-likelihood of ``targets [B]`` (class ids) given ``features [B, D]``.

        Rows with target -1 (padding) are left out; with none left the loss is 0 (same graph).
        """
        features, targets = labelled_rows(features, targets)
        if not targets.numel():
            return sum(p.sum() for p in self.parameters()) * 0.0 + features.sum() * 0.0
        loss = self.adaptive(features, self._ranks(targets)).loss
        if torch.is_grad_enabled():  # DDP: every tail weight gets a gradient (see the class)
            loss = loss + 0.0 * sum(p.view(-1)[0] for p in self.adaptive.tail.parameters())
        return loss

    @torch.no_grad()
    def eval_loss(self, features: Tensor, targets: Tensor) -> Tensor:
        """Per-example negative log-likelihood ``[B]``; :meth:`forward` is its mean."""
        return -self.adaptive(features, self._ranks(targets)).output

    def _cluster_log_probs(self, features: Tensor, cluster_log_prob: Tensor, cluster: int,
                           block_rows: int) -> Iterator[tuple[Tensor, int, int]]:
        """Log-probabilities of one tail cluster's classes, ``block_rows`` at a time.

        Yields ``(scores [B, n], start, end)`` for frequency ranks ``[start, end)``. A cluster
        wider than ``block_rows`` is read twice: once for its log-sum-exp, once for the scores.
        """
        projection, output = self.adaptive.tail[cluster]
        hidden = projection(features)
        low = self.adaptive.cutoffs[cluster]
        size = output.weight.shape[0]
        if size <= block_rows:  # the same operations as AdaptiveLogSoftmaxWithLoss.log_prob
            yield F.log_softmax(output(hidden), dim=1) + cluster_log_prob[:, None], low, low + size
            return
        blocks = range(0, size, block_rows)
        normaliser = torch.stack([torch.logsumexp(F.linear(hidden, output.weight[s:s + block_rows]),
                                                  dim=1) for s in blocks]).logsumexp(dim=0)
        for s in blocks:
            logits = F.linear(hidden, output.weight[s:s + block_rows])
            yield ((logits - normaliser[:, None]) + cluster_log_prob[:, None], low + s,
                   low + s + logits.shape[1])

    @torch.no_grad()
    def topk(self, features: Tensor, k: int, block_rows: int = 65536) -> TopK:
        """Top-``k`` classes by log-probability, never materialising ``B x C``.

        The shortlist's log-probabilities come from the head; each tail cluster's are its head
        log-probability plus the log-softmax of its projection, computed cluster by cluster and
        ``block_rows`` classes at a time, merged into a running top-k. A class's log-probability
        never exceeds its cluster's, so a cluster is scored only for the examples whose current
        k-th score does not already beat that cluster's log-probability.

        Args:
            features: ``[B, D]``.
            k: classes kept per example.
            block_rows: classes scored at once (memory ``O(B x block_rows)``).

        Returns:
            ``(scores [B, k], ids [B, k])``: log-probabilities and global class ids, by (score
            desc, class id asc); padded with ``(-inf, -1)`` when ``C < k``.
        """
        _check_topk_args(k, block_rows)
        scores, ids = _empty_topk(features)
        if k == 0:
            return scores, ids
        head_log_prob = F.log_softmax(self.adaptive.head(features), dim=1)
        shortlist = self.adaptive.shortlist_size
        for s in range(0, shortlist, block_rows):
            e = min(s + block_rows, shortlist)
            scores, ids = _update_topk((scores, ids), head_log_prob[:, s:e],
                                       self.class_order[s:e], k)
        for cluster in range(self.adaptive.n_clusters):
            cluster_log_prob = head_log_prob[:, shortlist + cluster]
            rows = (cluster_log_prob >= scores[:, -1]).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                continue
            best = scores[rows], ids[rows]
            for block, s, e in self._cluster_log_probs(features[rows], cluster_log_prob[rows],
                                                       cluster, block_rows):
                best = _update_topk(best, block, self.class_order[s:e], k)
            scores[rows], ids[rows] = best
        return scores, ids


class MACHHead(nn.Module):
    """MACH: ``R`` independent hashings of the classes into ``B`` buckets, a softmax per hashing.

    Hash ``r`` maps class ``c`` to ``h_r(c) = ((a_r c + b_r) mod P) mod B`` with ``P = 2^31 - 1``
    (a prime, so the family is 2-universal for ``C < P``; ``a_r c + b_r < 2^63`` never overflows
    int64) and ``a_r in [1, P)``, ``b_r in [0, P)`` drawn from ``seed``. Hashes are computed on
    the fly (``R x n`` integer operations per block of classes), never stored as an ``R x C``
    table; ``hash_a``/``hash_b`` are persistent buffers, since the weights only mean something
    with the hashing they were trained with.

    Training loss per example: the mean over ``r`` of the softmax cross-entropy of the ``B``
    bucket logits of repetition ``r`` against ``h_r(y)``. With several labels (``[B, L]``,
    padded with -1), repetition ``r``'s positives are the distinct buckets ``{h_r(y)}`` and its
    loss is ``logsumexp(logits_r) - mean(logits_r[positive buckets])``; an example without
    labels has loss 0 (and counts in the mean).

    Class score (for :meth:`topk`): the mean over ``r`` of ``log p_r(h_r(c))``, the log of the
    geometric mean of the bucket probabilities. The paper averages the probabilities instead;
    the geometric mean demands agreement of every repetition (one collision-heavy bucket cannot
    carry a class) and is minus the class's own training loss. Classes hashed to the same bucket
    in all ``R`` repetitions score exactly the same (the tie rule orders them by id).

    Args:
        num_classes: C (< 2^31 - 1).
        dim: feature dimension D.
        num_buckets: B, buckets per repetition.
        num_repetitions: R.
        seed: draws the hash functions.

    Example:
        >>> head = MACHHead(1_000_000, 128, num_buckets=16384, num_repetitions=8)
        >>> head(features, labels).backward()       # labels [B] or [B, L] padded with -1
        >>> scores, ids = head.topk(features, k=5)
    """

    def __init__(self, num_classes: int, dim: int, num_buckets: int, num_repetitions: int = 4,
                 seed: int = 0) -> None:
        super().__init__()
        if not 1 <= num_classes < _MERSENNE_31:
            raise ValueError(f"num_classes: must be in [1, 2^31 - 2] for MACH's hash, "
                             f"got {num_classes}")
        if num_buckets < 2 or num_repetitions < 1:
            raise ValueError(f"need num_buckets >= 2 and num_repetitions >= 1, got "
                             f"num_buckets={num_buckets}, num_repetitions={num_repetitions}")
        self.num_classes, self.dim = num_classes, dim
        self.num_buckets, self.num_repetitions = num_buckets, num_repetitions
        self.buckets = nn.Linear(dim, num_repetitions * num_buckets)
        g = torch.Generator().manual_seed(seed)
        a = torch.randint(1, _MERSENNE_31, (num_repetitions,), generator=g)
        b = torch.randint(0, _MERSENNE_31, (num_repetitions,), generator=g)
        self.register_buffer("hash_a", a)
        self.register_buffer("hash_b", b)

    def bucket_ids(self, classes: Tensor) -> Tensor:
        """``h_r(c)`` for every repetition: ``LongTensor[R, *classes.shape]`` in ``[0, B)``."""
        shape = (-1,) + (1,) * classes.dim()
        a, b = self.hash_a.view(shape), self.hash_b.view(shape)
        return (a * classes.long() + b) % _MERSENNE_31 % self.num_buckets

    def bucket_logits(self, features: Tensor) -> Tensor:
        """``[B, R, num_buckets]`` logits of every repetition's buckets."""
        return self.buckets(features).view(-1, self.num_repetitions, self.num_buckets)

    def _losses(self, features: Tensor, targets: Tensor) -> Tensor:
        """Per-example loss ``[B]``: mean over repetitions of the bucket cross-entropy."""
        low = 0 if targets.dim() == 1 else -1
        if targets.dim() not in (1, 2) or targets.shape[0] != features.shape[0]:
            raise ValueError(f"targets: expected [B] or [B, L] with B={features.shape[0]}, got "
                             f"shape {tuple(targets.shape)}")
        if targets.numel() and (int(targets.min()) < low or int(targets.max()) >= self.num_classes):
            raise ValueError(f"targets: class ids must be in [{low}, {self.num_classes - 1}], got "
                             f"[{int(targets.min())}, {int(targets.max())}]")
        logits = self.bucket_logits(features)
        if targets.dim() == 1:
            picked = self.bucket_ids(targets).t().unsqueeze(2)  # [B, R, 1]
            return -F.log_softmax(logits, dim=2).gather(2, picked).squeeze(2).mean(dim=1)
        # Distinct positive buckets per (example, repetition): padding sorts last as bucket B.
        buckets = self.bucket_ids(targets.clamp(min=0)).permute(1, 0, 2)  # [B, R, L]
        buckets = buckets.masked_fill((targets < 0).unsqueeze(1), self.num_buckets)
        buckets = buckets.sort(dim=2).values
        first = torch.ones_like(buckets[..., :1], dtype=torch.bool)
        distinct = (buckets < self.num_buckets) & torch.cat(
            [first, buckets[..., 1:] != buckets[..., :-1]], dim=2)
        count = distinct.sum(dim=2)
        positive = logits.gather(2, buckets.clamp(max=self.num_buckets - 1))
        mean_positive = (positive * distinct).sum(dim=2) / count.clamp(min=1)
        losses = torch.where(count > 0, torch.logsumexp(logits, dim=2) - mean_positive, 0.0)
        return losses.mean(dim=1)

    def forward(self, features: Tensor, targets: Tensor) -> Tensor:
        """Mean loss over the examples; ``targets [B]`` or ``[B, L]`` padded with -1.

        Examples without any label (padding rows) are left out.
        """
        features, targets = labelled_rows(features, targets)
        if not targets.shape[0]:
            return self.buckets(features).sum() * 0.0
        return self._losses(features, targets).mean()

    @torch.no_grad()
    def eval_loss(self, features: Tensor, targets: Tensor) -> Tensor:
        """Per-example loss ``[B]``; :meth:`forward` is its mean."""
        return self._losses(features, targets)

    @torch.no_grad()
    def topk(self, features: Tensor, k: int, block_rows: int = 65536) -> TopK:
        """Top-``k`` classes by mean log bucket probability, ``block_rows`` classes at a time.

        The ``[B, R, num_buckets]`` log-probabilities are computed once; each block of classes
        gathers its ``R`` buckets' columns and is merged into a running top-k.

        Args:
            features: ``[B, D]``.
            k: classes kept per example.
            block_rows: classes scored at once (memory ``O(B x block_rows)``).

        Returns:
            ``(scores [B, k], ids [B, k])``: mean log-probabilities and class ids, by (score
            desc, class id asc); padded with ``(-inf, -1)`` when ``C < k``.
        """
        _check_topk_args(k, block_rows)
        scores, ids = _empty_topk(features)
        if k == 0:
            return scores, ids
        log_probs = F.log_softmax(self.bucket_logits(features), dim=2).transpose(0, 1).contiguous()
        for s in range(0, self.num_classes, block_rows):
            classes = torch.arange(s, min(s + block_rows, self.num_classes), device=features.device)
            buckets = self.bucket_ids(classes)
            block = log_probs[0].index_select(1, buckets[0])
            for r in range(1, self.num_repetitions):
                block += log_probs[r].index_select(1, buckets[r])
            scores, ids = _update_topk((scores, ids), block / self.num_repetitions, classes, k)
        return scores, ids
