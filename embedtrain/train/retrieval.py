"""Retrieval: a two-tower model trained with an in-batch sampled softmax, evaluated over the full
item corpus.

Training (:meth:`Retrieval.forward` in ``model.train()``): each row's query is scored against
every row's positive item of the global batch (all-gathered from every rank, with their
gradients) and, with ``mixed_negatives: M``, ``M`` items drawn uniformly from the item table each
step (Yang et al., WWW 2020: mixed negative sampling); the loss is the softmax cross-entropy of
the row's own positive. With ``log_q`` (the default), each candidate's logit is lowered by the log
of its expected count in a step's candidates (Yi et al., RecSys 2019): an in-batch item's
streaming frequency (:class:`~embedtrain.models.retrieval.ItemFrequency`), a uniform negative's
``M / N``. A candidate that is the row's own item elsewhere in the candidates (a duplicate
positive, or a sampled negative equal to it) is masked out. Each rank's loss is its rows' mean,
and the gathered items' gradients sum back to their ranks: the tables' and DDP's averaging over
ranks then give the global batch's gradient, so ``W`` ranks step as one rank does with the whole
batch.

Evaluation (``model.eval()``): every item of the table is embedded by the item tower once per
evaluation, each rank its slice; a row's metrics come from its item's exact rank among all items
(``1 +`` the items scoring strictly higher): ``recall@k`` (one relevant item a row: the item is
in the top ``k``), ``ndcg@k`` (``1 / log2(rank + 1)`` within the top ``k``) and ``mrr``; the loss
is the cross-entropy of the full softmax over the corpus. The predictions are the top-k item ids
(exact, merged over the ranks' slices) and the rank. With ``exclude_seen``, the items of a row's
history (the ``seen_feature`` it was given as a query feature: what a server that filters seen
items knows) are out of its ranking and its top-k; a row whose own item is among them can never
be retrieved and counts as a miss (rank ``num_items + 1``), as a serving filter would make it.

Example:
    >>> task = Retrieval(top_k=[10, 50], mixed_negatives=256)
    >>> out = task.forward(model, batch)          # model.train(): the in-batch loss
    >>> m = task.new_metrics(); m.update(out, batch); m.compute()["recall@10"]
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from embedtrain.data.batching import num_padding
from embedtrain.heads.ops import all_gather_rows, rank_and_world
from embedtrain.heads.sharded import shard_range
from embedtrain.heads.topk import distributed_topk
from embedtrain.models.seq import first_k_outside, history_ids
from embedtrain.train.task import StepOutput

_CORPUS_BLOCK = 16_384  # items embedded (and scored) at a time


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DMP / DDP wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _parts(model: nn.Module, batch) -> tuple[nn.Module, int, int, Tensor, int, int]:
    """``(the unwrapped model, rank, world size, labels, rows, rows but padding)``."""
    labels = batch.labels.long()
    return (unwrap(model), *rank_and_world(None), labels, labels.shape[0],
            labels.shape[0] - num_padding(batch))


def _blocks(queries: Tensor, corpus: Tensor):
    """``(first column, queries @ corpus[block].T)`` over the corpus's column blocks."""
    for lo in range(0, corpus.shape[0], _CORPUS_BLOCK):
        yield lo, queries @ corpus[lo:lo + _CORPUS_BLOCK].T


class RetrievalMetrics:
    """``recall@k``, ``ndcg@k`` and ``mrr`` from each row's rank of its item (summed over ranks
    at :meth:`compute`)."""

    def __init__(self, ks: Sequence[int]) -> None:
        self.ks = tuple(ks)
        self.sums = torch.zeros(2 * len(self.ks) + 2, dtype=torch.float64)

    def update(self, output: StepOutput, batch: object) -> None:
        rank = output.predictions[:, -1].double()
        parts = []
        for k in self.ks:
            hit = rank <= k
            parts += [hit.sum(), torch.where(hit, 1.0 / torch.log2(rank + 1), 0.0).sum()]
        parts += [(1.0 / rank).sum(), torch.tensor(float(rank.numel()))]
        self.sums += torch.stack([p.double() for p in parts])

    def compute(self) -> dict[str, float]:
        sums = self.sums.clone()
        if rank_and_world(None)[1] > 1:
            dist.all_reduce(sums)
        n = float(sums[-1])
        if n == 0:
            return {}
        out = {}
        for i, k in enumerate(self.ks):
            out[f"recall@{k}"] = float(sums[2 * i]) / n
            out[f"ndcg@{k}"] = float(sums[2 * i + 1]) / n
        out["mrr"] = float(sums[-2]) / n
        return out


class Retrieval:
    """The retrieval task (``task: retrieval``, or ``task: {_component_:
    embedtrain.tasks:Retrieval, ...}`` with these keys).

    Args:
        top_k: the cut-offs of recall@k and ndcg@k (the first is the main metric).
        log_q: correct the sampled softmax for how often each candidate is sampled.
        mixed_negatives: items drawn uniformly from the item table each step (over all ranks;
            rounded up to a multiple of the ranks), beside the in-batch ones.
        seed: the negatives' draws (with the step number: a resumed run draws the same).
        exclude_seen: evaluation ranks only the items outside a row's ``seen_feature``.
        seen_feature: the query feature holding a row's seen items (its history).
    """

    name = "retrieval"
    family = "retrieval"

    def __init__(self, top_k: Sequence[int] = (10, 50), log_q: bool = True,
                 mixed_negatives: int = 0, seed: int = 0, exclude_seen: bool = False,
                 seen_feature: str = "history") -> None:
        if not top_k or min(top_k) < 1:
            raise ValueError(f"task.top_k: expected cut-offs >= 1, got {list(top_k)}")
        if mixed_negatives < 0:
            raise ValueError(f"task.mixed_negatives: must be >= 0, got {mixed_negatives}")
        self.ks = tuple(top_k)
        self.main_metric = f"recall@{self.ks[0]}"
        self.log_q = log_q
        self.mixed_negatives = mixed_negatives
        self.seed = seed
        self.exclude_seen = exclude_seen
        self.seen_feature = seen_feature

    def new_metrics(self) -> RetrievalMetrics:
        return RetrievalMetrics(self.ks)

    def forward(self, model: nn.Module, batch) -> StepOutput:
        if model.training:
            return self.train_step(model, batch)
        return self.evaluate(model, batch)

    # -- training ----------------------------------------------------------------------------

    def negatives(self, core: nn.Module, world: int, rank: int) -> tuple[Tensor, Tensor]:
        """This step's uniform negatives: all ranks' (the same draw everywhere) and this rank's."""
        per_rank = -(-self.mixed_negatives // world)
        step = int(core.frequency.step)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        every = torch.randint(core.num_items, (per_rank * world,), generator=g)
        return every, every[rank * per_rank:(rank + 1) * per_rank]

    def train_step(self, model: nn.Module, batch) -> StepOutput:
        core, rank, world, labels, b, n = _parts(model, batch)
        every_neg, my_neg = self.negatives(core, world, rank)
        ids = torch.cat([labels.clamp(min=0), my_neg])
        queries, items = model(batch.dense_features, batch.sparse_features, ids)
        positives = all_gather_rows(items[:b])
        mine = labels.clone()
        mine[n:] = -1
        every_label = all_gather_rows(mine)
        candidates, candidate_ids = positives, every_label
        if self.mixed_negatives:
            candidates = torch.cat([positives, all_gather_rows(items[b:])])
            candidate_ids = torch.cat([every_label, every_neg])
        core.frequency.update(every_label[every_label >= 0])
        logits = queries @ candidates.T / core.temperature
        if self.log_q:
            correction = core.frequency.log_p(every_label.clamp(min=0))
            if self.mixed_negatives:
                uniform = math.log(len(every_neg) / core.num_items)
                correction = torch.cat([correction, correction.new_full((len(every_neg),),
                                                                        uniform)])
            logits = logits - correction
        own = torch.arange(b) + rank * b
        masked = (candidate_ids[None, :] == labels[:, None]) | (candidate_ids < 0)[None, :]
        masked[torch.arange(b), own] = False
        logits = logits.masked_fill(masked, float("-inf"))
        losses = torch.nn.functional.cross_entropy(logits[:n], own[:n], reduction="none")
        loss = losses.mean() if n else queries.sum() * 0.0
        return StepOutput(loss=loss, predictions=losses.detach(), num_examples=n)

    # -- evaluation --------------------------------------------------------------------------

    @torch.no_grad()
    def corpus(self, model: nn.Module) -> tuple[Tensor, int]:
        """This rank's slice of every item's embedding and where it starts (cached on the
        model until its next ``train()`` / ``eval()``)."""
        core = unwrap(model)
        if core.corpus is None:
            rank, world = rank_and_world(None)
            start, end = shard_range(core.num_items, rank, world)
            block = -(-core.num_items // world)  # every rank makes the same calls
            parts = []
            for lo in range(0, block, _CORPUS_BLOCK):
                ids = torch.arange(start + lo, start + min(lo + _CORPUS_BLOCK, block))
                parts.append(model(None, None, ids.clamp(max=core.num_items - 1))[1])
            core.corpus = (torch.cat(parts)[: max(end - start, 0)], start)
        return core.corpus

    def seen(self, sparse, world: int) -> Tensor:
        """Each row's seen items ``[B, L]`` (``-1``: none; ``L`` the longest over the ranks)."""
        try:
            jt = sparse[self.seen_feature]
        except KeyError:
            raise ValueError(f"task.exclude_seen: no query feature {self.seen_feature!r} "
                             f"(task.seen_feature: the feature of a row's seen items)") from None
        lengths = jt.lengths().long()
        width = torch.tensor([int(lengths.max()) if lengths.numel() else 0])
        if world > 1:
            dist.all_reduce(width, op=dist.ReduceOp.MAX)
        return history_ids(jt.values(), lengths, max(int(width), 1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch) -> StepOutput:
        core, rank, world, labels, b, n = _parts(model, batch)
        queries = model(batch.dense_features, batch.sparse_features)[0]
        corpus, start = self.corpus(model)
        every_q = all_gather_rows(queries)
        every_label = all_gather_rows(labels.clamp(min=0))
        seen = all_gather_rows(self.seen(batch.sparse_features, world)) \
            if self.exclude_seen else None
        # the label's score, from the same products the ranking compares (the rank holding its
        # row), and each row's largest scaled score
        scale = 1.0 / core.temperature
        target = torch.zeros(every_q.shape[0])
        peak = torch.full((every_q.shape[0],), float("-inf"))
        for lo, scores in _blocks(every_q, corpus):
            col = every_label - (start + lo)
            rows = ((col >= 0) & (col < scores.shape[1])).nonzero(as_tuple=True)[0]
            target[rows] = scores[rows, col[rows]]
            peak = torch.maximum(peak, scores.max(1).values * scale)
        if world > 1:
            dist.all_reduce(target)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        # items ranked before the label (a higher score, or the same and a smaller id, as the
        # top-k's order), and the full softmax's normaliser
        above = torch.zeros(every_q.shape[0])
        total = torch.zeros(every_q.shape[0], dtype=torch.float64)
        for lo, scores in _blocks(every_q, corpus):
            ids = torch.arange(start + lo, start + lo + scores.shape[1])
            before = (scores > target[:, None]) | (
                (scores == target[:, None]) & (ids[None, :] < every_label[:, None]))
            if seen is not None:  # seen items are not ranked
                col = seen - (start + lo)
                r, c = ((col >= 0) & (col < scores.shape[1])).nonzero(as_tuple=True)
                before[r, col[r, c]] = False
            above += torch.count_nonzero(before, dim=1)
            total += (scores * scale - peak[:, None]).exp_().sum(1).double()
        if world > 1:
            dist.all_reduce(above)
            dist.all_reduce(total)
        losses = peak + total.log().float() - target * scale
        k = max(self.ks)
        if seen is None:
            top = distributed_topk(every_q, corpus, k, class_offset=start)[1]
        else:
            wide = distributed_topk(every_q, corpus, min(k + seen.shape[1], core.num_items),
                                    class_offset=start)
            top = first_k_outside(*wide, seen, min(k, wide[1].shape[1]))[1]
            if top.shape[1] < k:  # a corpus of fewer than k unseen items
                top = torch.cat([top, top.new_full((top.shape[0], k - top.shape[1]), -1)], 1)
            above[(seen == every_label[:, None]).any(1)] = core.num_items  # unretrievable
        mine = slice(rank * b, rank * b + n)
        predictions = torch.cat([top[mine], (above[mine] + 1).long()[:, None]], 1)
        loss = losses[mine].mean() if n else losses.sum() * 0.0
        return StepOutput(loss=loss, predictions=predictions, num_examples=n)
