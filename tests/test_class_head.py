"""The model-parallel class heads: 2 ranks give the loss and gradients of 1 rank; sampling heads
touch only their sampled rows; evaluation (loss, top-k) over shards equals a brute-force pass."""

import math

import pytest
import torch
import torch.nn.functional as F

from embedtrain.models.class_head import (
    HardNegativeHead,
    Margin,
    PartialFCHead,
    ShardedSoftmaxHead,
    shard_range,
)
from embedtrain.testing.dist import spawn
from embedtrain.models.topk import blocked_topk

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


_CASES = [(False, "none"), (True, "none"), (False, "arcface")]  # (multi-label, margin)


def _rank_case(rank, multi, margin):
    weight, features, labels = _reference(multi=multi)
    head = ShardedSoftmaxHead(C, D, margin=Margin(margin), scale=16.0)
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

    results = [_rank_case(rank, multi, margin) for multi, margin in _CASES]
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
    multi, margin = _CASES[case]
    weight, features, labels = _reference(multi=multi)
    weight = weight.requires_grad_(True)
    if margin == "none":
        logits = features @ weight.t()
        eval_logits = logits.detach()
        ref = _softmax_over_positives(logits, labels).mean()
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
        torch.testing.assert_close(r["eval_loss"],
                                   _softmax_over_positives(eval_logits[rows], labels[rows]))
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
