"""Replicated extreme-classification heads: adaptive softmax and MACH against slow references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from embedtrain.heads.replicated import (AdaptiveSoftmaxHead, MACHHead, default_cutoffs,
                                        frequency_order)
from embedtrain.train.xc_metrics import pad_targets, precision_at_k

C, D, B = 3000, 16, 24
CUTOFFS = [100, 600, 1500]  # shortlist + 3 tail clusters


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: a second OpenMP thread only adds contention (10x slower on a busy host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _brute_topk(scores: torch.Tensor, k: int):
    """All ``[B, C]`` scores (columns = class ids) sorted by the tie rule: a stable sort."""
    s, i = torch.sort(scores, dim=1, descending=True, stable=True)
    s, i = s[:, :k], i[:, :k]
    pad = k - s.shape[1]
    if pad > 0:
        s = torch.cat([s, torch.full((s.shape[0], pad), -math.inf)], dim=1)
        i = torch.cat([i, torch.full((i.shape[0], pad), -1, dtype=torch.long)], dim=1)
    return s, i


def _adaptive(seed: int = 0, num_classes: int = C, cutoffs=CUTOFFS):
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_classes, generator=g)
    torch.manual_seed(seed)
    head = AdaptiveSoftmaxHead(num_classes, D, cutoffs=cutoffs, div_value=2.0, class_order=order)
    # Larger cluster logits and peaked clusters: tail classes make the top-k too.
    with torch.no_grad():
        head.adaptive.head.weight.mul_(3.0)
        head.adaptive.head.weight[cutoffs[0]:].mul_(4.0)
        for _, output in head.adaptive.tail:
            output.weight.mul_(4.0)
    features = torch.randn(B, D, generator=g)
    targets = order[torch.cat([torch.arange(4),  # shortlist
                               torch.randint(0, num_classes, (B - 4,), generator=g)])]
    return head, features, targets


def _adaptive_log_probs(head: AdaptiveSoftmaxHead, features: torch.Tensor) -> torch.Tensor:
    """``[B, C]`` log-probabilities with columns in class id order (brute force)."""
    by_rank = head.adaptive.log_prob(features)
    out = torch.empty_like(by_rank)
    out[:, head.class_order] = by_rank
    return out


def test_frequency_order_by_count_then_id():
    counts = torch.tensor([3, 7, 3, 0, 7, 1])
    assert frequency_order(counts).tolist() == [1, 4, 0, 2, 5, 3]
    with pytest.raises(ValueError, match="counts"):
        frequency_order(counts.view(2, 3))


@pytest.mark.parametrize("num_classes", [2, 100, 10_000, 100_000, 1_000_000, 10_000_000])
def test_default_cutoffs_valid(num_classes):
    cutoffs = default_cutoffs(num_classes, 128)
    assert cutoffs and cutoffs[0] >= 1 and cutoffs[-1] < num_classes
    assert all(a < b for a, b in zip(cutoffs, cutoffs[1:]))
    assert all(128 // 4.0 ** (i + 1) >= 1 for i in range(len(cutoffs)))
    if num_classes <= 100_000:
        assert AdaptiveSoftmaxHead(num_classes, 128).cutoffs == cutoffs + [num_classes]


def test_default_cutoffs_at_a_million():
    assert default_cutoffs(1_000_000, 128) == [4096, 40960, 409600]
    assert default_cutoffs(10_000_000, 8) == [4096]  # 8 // 16 = 0: no second tail cluster


def test_adaptive_forward_is_torch_adaptive_softmax_on_ranks():
    head, features, targets = _adaptive()
    features.requires_grad_(True)
    loss = head(features, targets)
    ref = head.adaptive(features, head.rank_of[targets])
    torch.testing.assert_close(loss, ref.loss)
    torch.testing.assert_close(head.eval_loss(features, targets), -ref.output.detach())
    torch.testing.assert_close(head.eval_loss(features, targets).mean(), loss.detach())
    # The rank maps are inverse permutations.
    assert torch.equal(head.class_order[head.rank_of], torch.arange(C))


def test_adaptive_gradient_reaches_every_parameter():
    head, features, targets = _adaptive()
    features.requires_grad_(True)
    targets = head.class_order[:B]  # shortlist only: the tail clusters see no target
    head(features, targets).backward()
    assert features.grad.abs().sum() > 0
    assert head.adaptive.head.weight.grad.abs().sum() > 0
    for p in head.adaptive.tail.parameters():  # DDP (find_unused_parameters=False) needs these
        assert p.grad is not None and p.grad.abs().sum() == 0


def test_adaptive_gradient_matches_torch():
    head, features, targets = _adaptive()
    head(features, targets).backward()
    grads = [p.grad.clone() for p in head.adaptive.parameters()]
    head.zero_grad()
    head.adaptive(features, head.rank_of[targets]).loss.backward()
    for got, want in zip(grads, head.adaptive.parameters()):
        torch.testing.assert_close(got, want.grad)


@pytest.mark.parametrize("block_rows", [65536, 250, 37])
@pytest.mark.parametrize("k", [1, 5, 40])
def test_adaptive_topk_is_brute_force(block_rows, k):
    head, features, _ = _adaptive()
    scores, ids = head.topk(features, k, block_rows=block_rows)
    ref_s, ref_i = _brute_topk(_adaptive_log_probs(head, features), k)
    assert torch.equal(ids, ref_i)
    torch.testing.assert_close(scores, ref_s)
    ranks = head.rank_of[ids]
    for low, high in zip([0] + CUTOFFS, CUTOFFS + [C]):  # the shortlist and each cluster
        assert ((ranks >= low) & (ranks < high)).any()


def test_adaptive_topk_ties_and_padding():
    head, features, _ = _adaptive(num_classes=50, cutoffs=[10, 30])
    with torch.no_grad():
        for p in head.adaptive.parameters():
            p.zero_()  # the shortlist ties, and so does each cluster (at -log(size) lower)
    for k in (3, 12, 50, 60):
        for block_rows in (65536, 4):
            scores, ids = head.topk(features, k, block_rows=block_rows)
            ref_s, ref_i = _brute_topk(_adaptive_log_probs(head, features), k)
            assert torch.equal(ids, ref_i), (k, block_rows)
            torch.testing.assert_close(scores, ref_s)
    assert (ids[:, 50:] == -1).all() and torch.isinf(scores[:, 50:]).all()
    assert head.topk(features, 0)[1].shape == (B, 0)


def test_adaptive_rejects_bad_targets_and_cutoffs():
    head, features, targets = _adaptive()
    with pytest.raises(ValueError, match="one label per example"):
        head(features, pad_targets([[1, 2]] * B))
    with pytest.raises(ValueError, match="class ids"):
        head(features, torch.full((B,), C))
    with pytest.raises(ValueError, match="cutoffs"):
        AdaptiveSoftmaxHead(C, D, cutoffs=[100, 100])
    with pytest.raises(ValueError, match="cutoffs"):
        AdaptiveSoftmaxHead(C, D, cutoffs=[10, 100, 1000])  # 16 // 64 = 0 features
    with pytest.raises(ValueError, match="class_order"):
        AdaptiveSoftmaxHead(C, D, class_order=torch.zeros(C, dtype=torch.long))


def _mach(seed: int = 0, num_classes: int = C):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = MACHHead(num_classes, D, num_buckets=64, num_repetitions=4, seed=seed)
    return head, torch.randn(B, D, generator=g), torch.randint(0, num_classes, (B,), generator=g)


def test_mach_hashes_deterministic_and_in_range():
    classes = torch.arange(C)
    a = MACHHead(C, D, 64, 4, seed=3).bucket_ids(classes)
    assert a.shape == (4, C) and a.min() >= 0 and a.max() < 64
    assert torch.equal(a, MACHHead(C, D, 64, 4, seed=3).bucket_ids(classes))
    assert not torch.equal(a, MACHHead(C, D, 64, 4, seed=4).bucket_ids(classes))
    assert all(len(set(row.tolist())) == 64 for row in a)  # every bucket used
    big = MACHHead(2 ** 31 - 2, D, 1000, 2).bucket_ids(torch.tensor([2 ** 31 - 3]))
    assert 0 <= int(big.min()) and int(big.max()) < 1000  # no int64 overflow


def test_mach_loss_is_mean_cross_entropy():
    head, features, targets = _mach()
    features.requires_grad_(True)
    logits = head.buckets(features).view(B, 4, 64)
    buckets = head.bucket_ids(targets)
    ref = torch.stack([F.cross_entropy(logits[:, r], buckets[r], reduction="none")
                       for r in range(4)]).mean(dim=0)
    torch.testing.assert_close(head.eval_loss(features, targets), ref.detach())
    loss = head(features, targets)
    torch.testing.assert_close(loss, ref.mean())
    loss.backward()
    assert features.grad.abs().sum() > 0 and head.buckets.weight.grad.abs().sum() > 0


def test_mach_multi_label_loss_is_slow_reference():
    head, features, _ = _mach()
    labels = [[1, 2, 3], [5], [], [7, 7, 9, 2999], [0, 1]] + [[i, i + 100] for i in range(B - 5)]
    targets = pad_targets(labels)
    logits = head.buckets(features).view(B, 4, 64)
    ref = torch.zeros(B)
    for n, positives in enumerate(labels):
        if not positives:
            continue  # no labels: loss 0
        for r in range(4):
            buckets = sorted(set(head.bucket_ids(torch.tensor(positives))[r].tolist()))
            ref[n] += (torch.logsumexp(logits[n, r], 0) - logits[n, r, buckets].mean()) / 4
    torch.testing.assert_close(head.eval_loss(features, targets), ref.detach())
    # Training leaves out rows without any label (padding rows of an epoch's last batch).
    labelled = torch.tensor([bool(positives) for positives in labels])
    torch.testing.assert_close(head(features, targets), ref[labelled].mean())
    # One label per row as [B, 1] is the single-label loss.
    one = torch.randint(0, C, (B,))
    torch.testing.assert_close(head.eval_loss(features, one[:, None]),
                               head.eval_loss(features, one))
    with pytest.raises(ValueError, match="class ids"):
        head(features, torch.full((B, 2), -2))


def _mach_scores(head: MACHHead, features: torch.Tensor) -> torch.Tensor:
    """``[B, C]`` mean log bucket probabilities over all classes (brute force)."""
    log_probs = F.log_softmax(head.buckets(features).view(features.shape[0], 4, 64), dim=2)
    table = head.bucket_ids(torch.arange(head.num_classes))
    return torch.stack([log_probs[:, r, table[r]] for r in range(4)]).mean(dim=0)


@pytest.mark.parametrize("block_rows", [65536, 700, 64])
@pytest.mark.parametrize("k", [1, 10])
def test_mach_topk_is_brute_force(block_rows, k):
    head, features, _ = _mach()
    scores, ids = head.topk(features, k, block_rows=block_rows)
    ref_s, ref_i = _brute_topk(_mach_scores(head, features), k)
    assert torch.equal(ids, ref_i)
    torch.testing.assert_close(scores, ref_s)


def test_mach_topk_ties_and_padding():
    head, features, _ = _mach(num_classes=40)
    with torch.no_grad():
        head.buckets.weight.zero_()
        head.buckets.bias.zero_()
    scores, ids = head.topk(features, 45, block_rows=16)
    assert torch.equal(ids[:, :40], torch.arange(40).expand(B, 40))  # all tie: by class id
    assert (ids[:, 40:] == -1).all() and torch.isinf(scores[:, 40:]).all()


def test_mach_learns_planted_classes():
    """A few hundred Adam steps on noisy planted class embeddings give a high P@1."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    num_classes, dim = 200, 16
    embedding = torch.randn(num_classes, dim, generator=g)
    head = MACHHead(num_classes, dim, num_buckets=64, num_repetitions=4, seed=0)
    opt = torch.optim.Adam(head.parameters(), lr=0.05)
    for _ in range(300):
        y = torch.randint(0, num_classes, (128,), generator=g)
        loss = head(embedding[y] + 0.1 * torch.randn(128, dim, generator=g), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    y = torch.arange(num_classes)
    _, ids = head.topk(embedding[y] + 0.1 * torch.randn(num_classes, dim, generator=g), 1)
    assert precision_at_k(ids, y, 1) > 0.9
