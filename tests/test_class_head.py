"""The model-parallel class heads: 2 ranks give the loss and gradients of 1 rank; sampling heads
touch only their sampled rows; evaluation (loss, top-k) over shards equals a brute-force pass."""

import math

import pytest
import torch
import torch.nn.functional as F

from embedtrain.heads.sharded import (
    HardNegativeHead,
    HeadLoss,
    Margin,
    NegativeIndex,
    PartialFCHead,
    ShardedSoftmaxHead,
    shard_range,
)
from embedtrain.heads.index import ClusteredIndex
from embedtrain.heads.topk import blocked_topk
from embedtrain.processes import spawn

C, D, B = 37, 8, 6  # an odd class count: uneven slices


def _reference(seed: int = 0, multi: bool = False):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(C, D, generator=g)
    features = torch.randn(2 * B, D, generator=g, requires_grad=True)
    labels = torch.randint(0, C, (2 * B,), generator=g)
    labels[0], labels[1] = 0, C - 1  # both ends of the class range
    if multi:  # up to 3 distinct positives per example, -1 padded
        extra = torch.randint(0, C, (2 * B, 2), generator=g)
        labels = torch.cat([labels[:, None], extra], dim=1)
        labels[labels[:, 1] == labels[:, 0], 1] = -1
        labels[(labels[:, 2] == labels[:, 0]) | (labels[:, 2] == labels[:, 1]), 2] = -1
        labels[::3, 1:] = -1  # some single-label rows
    return weight, features, labels


def _softmax_over_positives(logits, labels):
    """Slow reference: mean over each example's positives of -log softmax."""
    logp = logits.log_softmax(dim=1)
    losses = []
    for i, row in enumerate(labels.view(len(labels), -1)):
        pos = row[row >= 0]
        losses.append(-logp[i, pos].mean())
    return torch.stack(losses)


def _margin_reference(features, weight, labels, margin, m, s):
    cos = F.normalize(features, dim=1) @ F.normalize(weight, dim=1).t()
    target = cos.gather(1, labels[:, None])
    if margin == "cosface":
        moved = target - m
    else:
        theta = target.clamp(-1 + 1e-7, 1 - 1e-7).acos()
        moved = torch.where(theta + m < math.pi, (theta + m).cos(),
                            target - math.sin(math.pi - m) * m)
    logits = (cos * s).scatter(1, labels[:, None], moved * s)
    return F.cross_entropy(logits, labels)


def test_shard_range_matches_torchrec_row_wise():
    for world in (1, 2, 3, 5, 40):
        ranges = [shard_range(C, r, world) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == C
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        block = math.ceil(C / world)  # TorchRec's row-wise block and torch.chunk's
        assert [e - s for s, e in ranges] == [len(c) for c in torch.arange(C).chunk(world)] + \
            [0] * (world - len(torch.arange(C).chunk(world)))
        assert all(e - s <= block for s, e in ranges)


def test_one_rank_is_plain_softmax():
    weight, features, labels = _reference()
    head = ShardedSoftmaxHead(C, D)
    with torch.no_grad():
        head.weight.copy_(weight)
    loss = head(features, labels)
    ref_features = features.detach().clone().requires_grad_(True)
    ref_weight = weight.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_features @ ref_weight.t(), labels)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(head.weight.grad, ref_weight.grad)
    torch.testing.assert_close(features.grad, ref_features.grad)


def test_multi_label_is_softmax_over_positives():
    weight, features, labels = _reference(multi=True)
    head = ShardedSoftmaxHead(C, D)
    with torch.no_grad():
        head.weight.copy_(weight)
    loss = head(features, labels)
    ref_weight = weight.clone().requires_grad_(True)
    ref_features = features.detach().clone().requires_grad_(True)
    ref = _softmax_over_positives(ref_features @ ref_weight.t(), labels).mean()
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(head.weight.grad, ref_weight.grad)
    torch.testing.assert_close(features.grad, ref_features.grad)


# (multi-label, margin, loss)
_CASES = [(False, "none", "softmax"), (True, "none", "softmax"), (False, "arcface", "softmax"),
          (True, "none", "bce"), (False, "cosface", "bce")]


@pytest.mark.parametrize("multi,margin,loss", _CASES)
def test_rows_without_a_label_change_nothing(multi, margin, loss):
    """Unlabelled rows (all -1: a history's padded positions, an epoch's last padding rows) leave
    the loss and the class weights' gradient as the labelled rows alone give them, and get no
    gradient themselves (the head leaves them out before its logits)."""
    weight, features, labels = _reference(multi=multi)
    labels[2::3] = -1

    def run(rows):
        head = ShardedSoftmaxHead(C, D, margin=Margin(margin), margin_value=0.3, scale=8.0,
                                  loss=HeadLoss(loss))
        with torch.no_grad():
            head.weight.copy_(weight)
        x = features.detach()[rows].clone().requires_grad_(True)
        out = head(x, labels[rows])
        out.backward()
        return out, head.weight.grad, x.grad

    labelled = (labels.view(len(labels), -1) >= 0).any(dim=1).nonzero().squeeze(1)
    loss_all, grad_all, x_grad_all = run(torch.arange(len(labels)))
    loss_some, grad_some, x_grad_some = run(labelled)
    torch.testing.assert_close(loss_all, loss_some)
    torch.testing.assert_close(grad_all, grad_some)
    torch.testing.assert_close(x_grad_all[labelled], x_grad_some)
    assert not x_grad_all[2::3].any()


@pytest.mark.parametrize("margin", ["cosface", "arcface"])
def test_margins_match_their_formulas(margin):
    weight, features, labels = _reference()
    m = 0.35 if margin == "cosface" else 0.5
    head = ShardedSoftmaxHead(C, D, margin=Margin(margin), margin_value=m, scale=16.0)
    with torch.no_grad():
        head.weight.copy_(weight)
    ref_weight = weight.clone().requires_grad_(True)
    loss = head(features, labels)
    ref = _margin_reference(features, ref_weight, labels, margin, m, 16.0)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(head.weight.grad, ref_weight.grad)
    # The margin makes the positives harder: the loss is above the margin-free one.
    plain = F.cross_entropy(16.0 * F.normalize(features, dim=1)
                            @ F.normalize(weight, dim=1).t(), labels)
    assert loss > plain




def _bce_reference(logits, labels, classes=C):
    """Slow reference: per example, the sum over all classes of the sigmoid cross-entropy of
    ``logit - log C`` (every class starting near the prior 1 / C)."""
    targets = torch.zeros_like(logits)
    for i, row in enumerate(labels.view(len(labels), -1)):
        targets[i, row[row >= 0]] = 1.0
    return F.binary_cross_entropy_with_logits(logits - math.log(classes), targets,
                                              reduction="none").sum(1)


def _rank_case(rank, multi, margin, loss):
    weight, features, labels = _reference(multi=multi)
    head = ShardedSoftmaxHead(C, D, margin=Margin(margin), scale=16.0, loss=HeadLoss(loss))
    with torch.no_grad():
        head.weight.copy_(weight[head.start:head.end])
    local = features.detach()[rank * B:(rank + 1) * B].clone().requires_grad_(True)
    loss = head(local, labels[rank * B:(rank + 1) * B])
    loss.backward()
    head.eval()
    # Evaluation with uneven batches: rank 0 has B examples, rank 1 has B - 2.
    n = B if rank == 0 else B - 2
    eval_features = features.detach()[rank * B:rank * B + n]
    eval_loss = head.eval_loss(eval_features, labels[rank * B:rank * B + n])
    scores, ids = head.topk(eval_features, 5)
    return {"loss": loss.detach(), "start": head.start, "end": head.end,
            "weight_grad": head.weight.grad, "feature_grad": local.grad,
            "eval_loss": eval_loss, "topk": ids, "scores": scores}


def _rank(rank, world, checkpoint):
    import torch.distributed.checkpoint as dcp

    results = [_rank_case(rank, *case) for case in _CASES]
    head = PartialFCHead(C, D, sample_rate=0.5)  # a checkpoint saved by 2 ranks
    weight, _, _ = _reference()
    with torch.no_grad():
        head.weight.copy_(weight[head.start:head.end])
    head.steps.fill_(7)
    state = head.state_dict()
    dcp.save({"model": state}, checkpoint_id=checkpoint)
    return results, type(state["weight"]).__name__


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("head_ckpt")
    return spawn(_rank, 2, str(path)), path


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(_CASES)))
def test_two_ranks_equal_one(two_ranks, case):
    multi, margin, loss = _CASES[case]
    weight, features, labels = _reference(multi=multi)
    weight = weight.requires_grad_(True)
    per_example = _bce_reference if loss == "bce" else _softmax_over_positives
    if margin == "none":
        logits = features @ weight.t()
        eval_logits = logits.detach()
        ref = per_example(logits, labels).mean()
    elif loss == "bce":  # CosFace: s (cos - m) on the positives
        cos = F.normalize(features, dim=1) @ F.normalize(weight, dim=1).t()
        eval_logits = 16.0 * cos.detach()
        ref = _bce_reference(16.0 * (cos - 0.35 * F.one_hot(labels, C)), labels).mean()
    else:
        ref = _margin_reference(features, weight, labels, margin, 0.35, 16.0)
        eval_logits = 16.0 * F.normalize(features.detach(), dim=1) @ F.normalize(
            weight.detach(), dim=1).t()
    ref.backward()
    results = [r[0][case] for r in two_ranks[0]]
    assert [r["start"] for r in results] == [0, 19] and results[1]["end"] == C
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["loss"], ref.detach())
        torch.testing.assert_close(r["weight_grad"], weight.grad[r["start"]:r["end"]])
        # Features get world_size x the global-mean gradient (DDP averages the encoder's).
        torch.testing.assert_close(r["feature_grad"], 2 * features.grad[rank * B:(rank + 1) * B])
        n = B if rank == 0 else B - 2
        rows = slice(rank * B, rank * B + n)
        torch.testing.assert_close(r["eval_loss"], per_example(eval_logits[rows], labels[rows]))
        ref_scores, ref_ids = blocked_topk(eval_logits[rows], torch.eye(C), 5)
        assert torch.equal(r["topk"], ref_ids)
        torch.testing.assert_close(r["scores"], ref_scores)


@pytest.mark.slow
def test_checkpoint_of_two_ranks_loads_on_one(two_ranks):
    import torch.distributed.checkpoint as dcp

    assert {r[1] for r in two_ranks[0]} == {"DTensor"}  # each rank saved only its rows
    weight, _, _ = _reference()
    head = PartialFCHead(C, D, sample_rate=0.5)
    state = {"model": head.state_dict()}
    dcp.load(state, checkpoint_id=two_ranks[1])
    head.load_state_dict(state["model"])
    assert torch.equal(head.weight.detach(), weight) and int(head.steps) == 7


def test_partial_fc_touches_only_sampled_rows():
    weight, features, labels = _reference()
    head = PartialFCHead(C, D, sample_rate=0.3, seed=1)
    with torch.no_grad():
        head.weight.copy_(weight)
    loss = head(features.detach(), labels)
    loss.backward()
    sample = head.last_sample
    assert set(labels.tolist()) <= set(sample.tolist())  # every positive is in the sample
    assert len(sample) == max(round(0.3 * C), len(set(labels.tolist())))
    untouched = torch.ones(C, dtype=torch.bool)
    untouched[sample] = False
    assert head.weight.grad.is_sparse  # no dense C x D gradient is ever built
    grad = head.weight.grad.to_dense()
    assert torch.count_nonzero(grad[untouched]) == 0
    # The sampled rows get the gradient of the softmax over the sampled classes only.
    sub = weight[sample].clone().requires_grad_(True)
    mapped = torch.searchsorted(sample, labels)
    ref = F.cross_entropy(features.detach() @ sub.t(), mapped)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad[sample], sub.grad)
    # The next step draws another sample; the same step count draws the same one (resume).
    first = sample.clone()
    head(features.detach(), labels)
    assert not torch.equal(head.last_sample, first)
    head.steps.fill_(0)
    head(features.detach(), labels)
    assert torch.equal(head.last_sample, first)


def test_partial_fc_rate_zero_is_the_in_batch_softmax():
    # sample_rate 0: the batch's positives alone are the classes (in-batch negatives); the loss
    # is the softmax over them
    weight, features, labels = _reference()
    head = PartialFCHead(C, D, sample_rate=0.0, seed=1)
    with torch.no_grad():
        head.weight.copy_(weight)
    loss = head(features.detach(), labels)
    assert head.last_sample.tolist() == sorted(set(labels.tolist()))
    classes = head.last_sample
    ref = F.cross_entropy(features @ weight[classes].t(), torch.searchsorted(classes, labels))
    torch.testing.assert_close(loss, ref)


def test_partial_fc_rate_one_is_the_full_softmax():
    weight, features, labels = _reference()
    full, sampled = ShardedSoftmaxHead(C, D), PartialFCHead(C, D, sample_rate=1.0)
    with torch.no_grad():
        full.weight.copy_(weight)
        sampled.weight.copy_(weight)
    torch.testing.assert_close(sampled(features.detach(), labels), full(features.detach(), labels))


def test_hard_negatives_are_the_highest_scoring_classes():
    weight, features, labels = _reference()
    head = HardNegativeHead(C, D, negatives=3, refresh_every=2)
    with torch.no_grad():
        head.weight.copy_(weight)
    loss = head(features.detach(), labels)
    loss.backward()
    expected = set(labels.tolist()) | set(
        (features.detach() @ weight.t()).topk(3, dim=1).indices.reshape(-1).tolist())
    assert set(head.last_sample.tolist()) == expected
    grad = head.weight.grad.to_dense()
    untouched = torch.ones(C, dtype=torch.bool)
    untouched[head.last_sample] = False
    assert torch.count_nonzero(grad[untouched]) == 0 and torch.count_nonzero(grad) > 0
    # The index is a snapshot: it changes only every refresh_every steps.
    with torch.no_grad():
        head.weight.mul_(-1)
    head(features.detach(), labels)  # step 1: same index (built at step 0)
    assert set(head.last_sample.tolist()) == expected
    head(features.detach(), labels)  # step 2: rebuilt from the flipped weights
    flipped = set(labels.tolist()) | set(
        (-(features.detach() @ weight.t())).topk(3, dim=1).indices.reshape(-1).tolist())
    assert set(head.last_sample.tolist()) == flipped


def test_bce_over_the_sample_is_one_vs_all_over_the_sampled_classes():
    weight, features, labels = _reference(multi=True)
    head = PartialFCHead(C, D, sample_rate=0.4, seed=3, loss=HeadLoss.BCE)
    with torch.no_grad():
        head.weight.copy_(weight)
    loss = head(features.detach(), labels)
    loss.backward()
    sample = head.last_sample
    assert set(labels[labels >= 0].tolist()) <= set(sample.tolist())
    sub = weight[sample].clone().requires_grad_(True)
    mapped = torch.where(labels >= 0, torch.searchsorted(sample, labels.clamp(min=0)), -1)
    ref = _bce_reference(features.detach() @ sub.t(), mapped).mean()  # the offset is log C
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(head.weight.grad.to_dense()[sample], sub.grad)
    # Rate 1: the one-vs-all loss over all classes, as the full head computes it.
    full = ShardedSoftmaxHead(C, D, loss=HeadLoss.BCE)
    every = PartialFCHead(C, D, sample_rate=1.0, loss=HeadLoss.BCE)
    with torch.no_grad():
        full.weight.copy_(weight)
        every.weight.copy_(weight)
    torch.testing.assert_close(every(features.detach(), labels), full(features.detach(), labels))
    torch.testing.assert_close(full(features.detach(), labels),
                               _bce_reference(features.detach() @ weight.t(), labels).mean())


def _planted_classes(n_classes=600, dim=16, topics=12, seed=0):
    """Class vectors in tight topic clusters and queries near a class: what a trained head has."""
    g = torch.Generator().manual_seed(seed)
    centres = 4 * torch.randn(topics, dim, generator=g)
    weight = centres[torch.arange(n_classes) % topics] + 0.3 * torch.randn(n_classes, dim,
                                                                              generator=g)
    labels = torch.randint(0, n_classes, (40,), generator=g)
    return weight, weight[labels] + 0.1 * torch.randn(40, dim, generator=g), labels


def test_clustered_index_probing_every_cluster_is_the_exact_search():
    from embedtrain.heads.index import ClusteredIndex, recall_at_k

    weight, queries, _ = _planted_classes()
    index = ClusteredIndex(weight, clusters=12, probe=12,
                           generator=torch.Generator().manual_seed(0))
    assert int(index.sizes.sum()) == len(weight) and sorted(index.ids.tolist()) == list(
        range(len(weight)))
    scores, rows = index.search(queries, 7)
    ref_scores, ref_rows = blocked_topk(queries, weight, 7)
    torch.testing.assert_close(scores, ref_scores)
    assert recall_at_k(rows, ref_rows) == 1.0
    # Probing a few clusters of well-separated topics still finds the nearest classes; the
    # same generator builds the same index (a resumed run rebuilds what it had).
    few = ClusteredIndex(weight, clusters=24, probe=4, generator=torch.Generator().manual_seed(1))
    assert recall_at_k(few.search(queries, 7)[1], ref_rows) >= 0.95
    one = ClusteredIndex(weight, clusters=24, probe=1, generator=torch.Generator().manual_seed(1))
    assert recall_at_k(one.search(queries, 7)[1], ref_rows) < 0.95  # probing fewer loses some
    again = ClusteredIndex(weight, clusters=24, probe=4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again.ids, few.ids) and torch.equal(again.centroids, few.centroids)
    # Fewer classes in the probed clusters than k: padded with (-inf, -1).
    tiny = ClusteredIndex(weight[:5], clusters=5, probe=1,
                          generator=torch.Generator().manual_seed(0))
    s, r = tiny.search(queries[:3], 4)
    assert ((r == -1) == torch.isinf(s)).all() and (r >= 0).any()


def _probed_topk(index, queries, k):
    """The slow reference of ``ClusteredIndex.search``: every member of each query's probed
    clusters scored, one query at a time, and a full top-k."""
    probes = (queries @ index.centroids.t() - index.half_norms).topk(index.probe, dim=1).indices
    scores = torch.full((len(queries), k), -math.inf)
    rows = torch.full((len(queries), k), -1)
    offsets = index.offsets.tolist()
    for i, q in enumerate(queries):
        members = torch.cat([torch.arange(offsets[c], offsets[c + 1]) for c in probes[i].tolist()])
        top = (index.sorted[members].float() @ q).topk(min(k, len(members)))
        scores[i, :len(members)] = top.values
        rows[i, :len(members)] = index.ids[members[top.indices]]
    return scores, rows


@pytest.mark.parametrize("clusters,probe,k,dtype", [
    (24, 4, 7, torch.float32), (24, 1, 7, torch.float32), (50, 12, 20, torch.float32),
    (24, 6, 5, torch.bfloat16), (400, 40, 3, torch.float32)])
def test_clustered_search_is_the_exact_top_k_of_the_probed_clusters(clusters, probe, k, dtype):
    # The search skips clusters and scores by a lower bound of each query's k-th best: what it
    # returns must still be the top k of every member of the probed clusters, as scoring them all
    # finds (400 clusters of 600 classes: many with fewer than k members, some empty).
    weight, queries, _ = _planted_classes()
    g = torch.Generator().manual_seed(3)
    queries = torch.cat([queries, torch.randn(24, weight.shape[1], generator=g)])
    index = ClusteredIndex(weight.to(dtype), clusters=clusters, probe=probe,
                           generator=torch.Generator().manual_seed(0))
    scores, rows = index.search(queries, k)
    ref_scores, ref_rows = _probed_topk(index, queries, k)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-4)
    assert torch.equal(rows == -1, ref_rows == -1)
    # each row's score is its class's (ties may order rows differently from the reference)
    found = rows.clamp(min=0)
    torch.testing.assert_close(
        torch.where(rows >= 0, (weight.to(dtype).float()[found] * queries[:, None]).sum(-1),
                    -math.inf), scores, rtol=1e-5, atol=1e-4)
    assert all(len(set(r[r >= 0].tolist())) == int((r >= 0).sum()) for r in rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clustered_hard_negatives_use_the_index_and_report_its_recall(dtype):
    weight, queries, labels = _planted_classes()
    n = len(weight)
    head = HardNegativeHead(n, weight.shape[1], negatives=5, refresh_every=3,
                            index=NegativeIndex.CLUSTERED, index_clusters=24, index_probe=4,
                            dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
    weight = head.weight.detach().float()  # a bf16 head holds the rounded values
    head(queries, labels).backward()
    found = head._clustered.search(queries, 5)[1]
    assert set(head.last_sample.tolist()) == set(labels.tolist()) | set(found[found >= 0].tolist())
    assert head._index is None  # the clustered index holds the only copy of the slice
    exact = set(blocked_topk(queries, weight, 5)[1].reshape(-1).tolist())
    assert len(exact & set(head.last_sample.tolist())) >= 0.9 * len(exact)
    [first] = head.index_recall
    assert first["step"] == 0 and first["clusters"] == 24 and first["probe"] == 4
    assert 0.9 <= first["recall"] <= 1.0
    head(queries, labels)
    head(queries, labels)
    assert len(head.index_recall) == 1  # rebuilt only every refresh_every steps
    head(queries, labels)
    assert [r["step"] for r in head.index_recall] == [0, 3]


@pytest.mark.parametrize("lr_decay", [0.0, 0.01])
def test_fused_row_adagrad_is_torch_adagrad_on_the_sampled_rows(lr_decay):
    """Partial FC's optimizer (gather, update, scatter of the sampled rows) against torch's
    sparse Adagrad on the same gradients: the same weights and accumulators, bit for bit."""
    from embedtrain.train.optim import RowSparseAdagrad

    weight, features, labels = _reference(multi=True)
    heads, optimizers = [], []
    for cls in (torch.optim.Adagrad, RowSparseAdagrad):
        head = PartialFCHead(C, D, sample_rate=0.3, seed=2)
        with torch.no_grad():
            head.weight.copy_(weight)
        heads.append(head)
        optimizers.append(cls(head.parameters(), lr=0.1, lr_decay=lr_decay, foreach=False))
    for _ in range(4):
        for head, opt in zip(heads, optimizers):
            head(features.detach(), labels).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert torch.equal(heads[0].last_sample, heads[1].last_sample)
        assert torch.equal(heads[0].weight, heads[1].weight)
    torch_state, fused_state = (o.state[h.weight] for o, h in zip(optimizers, heads))
    assert torch.equal(torch_state["sum"], fused_state["sum"])
    assert float(torch_state["step"]) == float(fused_state["step"]) == 4
    untouched = torch_state["sum"].sum(1) == 0  # rows never sampled keep their state
    assert untouched.any() and torch.equal(heads[1].weight[untouched], weight[untouched])
    # Uncoalesced gradients (a row twice) and dense ones take torch's math too.
    p, q = (torch.nn.Parameter(weight.clone()) for _ in range(2))
    o1, o2 = torch.optim.Adagrad([p], lr=0.1), RowSparseAdagrad([q], lr=0.1)
    rows, values = torch.tensor([[5, 2, 5]]), torch.randn(3, D)
    p.grad = torch.sparse_coo_tensor(rows, values, (C, D))
    q.grad = torch.sparse_coo_tensor(rows, values, (C, D))
    o1.step(), o2.step()
    assert torch.equal(p, q)
    p.grad, q.grad = torch.ones(C, D), torch.ones(C, D)
    o1.step(), o2.step()
    assert torch.equal(p, q)


def test_partial_fc_small_samples_are_drawn_uniformly_without_a_permutation():
    """Below 1/16 of the slice the negatives are drawn (no randperm of the slice): exactly the
    size wanted, distinct, never a positive, each other class equally likely (binomial counts)."""
    from embedtrain.heads.sharded import partial_fc_sample

    positives, n, rate, trials = torch.tensor([3, 7, 7]), 1000, 0.05, 2000
    counts = torch.zeros(n)
    for i in range(trials):
        sample = partial_fc_sample(positives, 0, n, rate, torch.Generator().manual_seed(i))
        assert sample.numel() == 50 and torch.equal(sample, sample.unique())
        counts[sample] += 1
    assert counts[3] == counts[7] == trials
    others = counts[torch.isin(torch.arange(n), positives, invert=True)]
    p = 48 / 998
    mean, std = trials * p, (trials * p * (1 - p)) ** 0.5
    assert abs(float(others.mean()) - mean) < 1e-3
    assert abs(float(others.std()) / std - 1) < 0.1
    assert float(others.min()) > mean - 5 * std and float(others.max()) < mean + 5 * std
    # The same generator state draws the same sample (a resumed run's).
    g = [torch.Generator().manual_seed(5) for _ in range(2)]
    assert torch.equal(partial_fc_sample(positives, 100, 100 + n, rate, g[0]),
                       partial_fc_sample(positives, 100, 100 + n, rate, g[1]))
