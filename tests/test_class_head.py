"""The model-parallel softmax head: 2 ranks give the loss and gradients of 1 rank."""

import torch
import torch.nn.functional as F

from embedtrain.models.class_head import ShardedSoftmaxHead, shard_range
from embedtrain.testing.dist import spawn

C, D, B = 37, 8, 6  # an odd class count: uneven slices


def _reference(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(C, D, generator=g)
    features = torch.randn(2 * B, D, generator=g, requires_grad=True)
    labels = torch.randint(0, C, (2 * B,), generator=g)
    labels[0], labels[1] = 0, C - 1  # both ends of the class range
    return weight, features, labels


def test_shard_range_covers_all_classes():
    for world in (1, 2, 3, 5):
        ranges = [shard_range(C, r, world) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == C
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        sizes = [e - s for s, e in ranges]
        assert max(sizes) - min(sizes) <= 1


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


def _rank(rank, world):
    weight, features, labels = _reference()
    head = ShardedSoftmaxHead(C, D)
    with torch.no_grad():
        head.weight.copy_(weight[head.start:head.end])
    local = features.detach()[rank * B:(rank + 1) * B].clone().requires_grad_(True)
    loss = head(local, labels[rank * B:(rank + 1) * B])
    loss.backward()
    return {"loss": loss.detach(), "start": head.start, "end": head.end,
            "weight_grad": head.weight.grad, "feature_grad": local.grad}


def test_two_ranks_equal_one():
    weight, features, labels = _reference()
    weight = weight.requires_grad_(True)
    ref = F.cross_entropy(features @ weight.t(), labels)
    ref.backward()
    results = spawn(_rank, 2)
    assert [r["start"] for r in results] == [0, 19] and results[1]["end"] == C
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["loss"], ref.detach())
        torch.testing.assert_close(r["weight_grad"], weight.grad[r["start"]:r["end"]])
        torch.testing.assert_close(r["feature_grad"], features.grad[rank * B:(rank + 1) * B])


def test_partial_fc_touches_only_sampled_rows():
    from embedtrain.models.class_head import PartialFCHead

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


def test_partial_fc_rate_one_is_the_full_softmax():
    from embedtrain.models.class_head import PartialFCHead

    weight, features, labels = _reference()
    full, sampled = ShardedSoftmaxHead(C, D), PartialFCHead(C, D, sample_rate=1.0)
    with torch.no_grad():
        full.weight.copy_(weight)
        sampled.weight.copy_(weight)
    torch.testing.assert_close(sampled(features.detach(), labels), full(features.detach(), labels))
