"""Blocked / merged / distributed top-k over a row-split class head, and the XC metrics."""

from __future__ import annotations

import math

import pytest
import torch

from embedtrain.heads.topk import blocked_topk, distributed_topk, merge_topk
from embedtrain.processes import spawn
from embedtrain.train.xc_metrics import (XCMetrics, ndcg_at_k, pad_targets, precision_at_k,
                                         recall_at_k)


def _reference(scores: torch.Tensor, k: int, offset: int = 0):
    """Brute force with the documented tie rule: a stable sort keeps lower ids first."""
    s, i = torch.sort(scores, dim=1, descending=True, stable=True)
    s, i = s[:, :k], i[:, :k] + offset
    pad = k - s.shape[1]
    if pad > 0:
        s = torch.cat([s, torch.full((s.shape[0], pad), -math.inf, dtype=s.dtype)], dim=1)
        i = torch.cat([i, torch.full((i.shape[0], pad), -1, dtype=torch.long)], dim=1)
    return s, i


def _random(b: int, c: int, d: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, d, generator=g, dtype=dtype), torch.randn(c, d, generator=g, dtype=dtype),
            torch.randn(c, generator=g, dtype=dtype))


def _tied(b: int, c: int, seed: int):
    """Small integers (exact float sums, whatever the blocking): many equal scores."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-2, 3, (b, 3), generator=g).float(),
            torch.randint(-1, 2, (c, 3), generator=g).float())


@pytest.mark.parametrize("block_rows", [1, 3, 7, 16, 50, 1000])
@pytest.mark.parametrize("use_bias", [False, True])
def test_blocked_topk_matches_torch_topk(block_rows, use_bias):
    x, w, bias = _random(9, 50, 12, seed=0)
    bias = bias if use_bias else None
    logits = x @ w.T + (bias if use_bias else 0)
    want_s, want_i = torch.topk(logits, 5, dim=1)
    s, i = blocked_topk(x, w, 5, block_rows=block_rows, class_offset=1000, bias=bias)
    torch.testing.assert_close(s, want_s)
    assert torch.equal(i, want_i + 1000)
    assert s.shape == i.shape == (9, 5) and i.dtype == torch.long


@pytest.mark.parametrize("block_rows", [1, 2, 5, 13, 64])
def test_blocked_topk_ties_go_to_lower_class_id(block_rows):
    x, w = _tied(11, 40, seed=1)
    logits = x @ w.T
    # The setup really has ties straddling the k-th place.
    kth = torch.sort(logits, dim=1, descending=True).values[:, 7]
    assert ((logits == kth[:, None]).sum(dim=1) > 1).any()
    s, i = blocked_topk(x, w, 8, block_rows=block_rows, class_offset=7)
    want_s, want_i = _reference(logits, 8, offset=7)
    assert torch.equal(s, want_s) and torch.equal(i, want_i)


@pytest.mark.parametrize("block_rows", [300, 700, 3000])
def test_blocked_topk_over_wide_blocks_keeps_the_tie_rule(block_rows):
    # Blocks wider than the spans whose maxima are checked against the running k-th score
    # (after the first block only the spans reaching it are looked at): ties at the k-th place
    # still go to the lower class id, across blocks, spans and the blocks' tails.
    x, w = _tied(12, 3000, seed=5)
    logits = x @ w.T
    s, i = blocked_topk(x, w, 9, block_rows=block_rows, class_offset=3)
    want_s, want_i = _reference(logits, 9, offset=3)
    assert torch.equal(s, want_s) and torch.equal(i, want_i)
    xr, wr, bias = _random(7, 2500, 16, seed=6)
    s, i = blocked_topk(xr, wr, 6, block_rows=block_rows, bias=bias)
    want_s, want_i = torch.topk(xr @ wr.T + bias, 6, dim=1)
    torch.testing.assert_close(s, want_s)
    assert torch.equal(i, want_i)
    wr[2222, 0] = float("nan")  # a NaN in a later block, seen by the span maxima
    with pytest.raises(ValueError, match="NaN"):
        blocked_topk(xr, wr, 6, block_rows=block_rows)


def test_blocked_topk_pads_when_fewer_classes_than_k():
    x, w, _ = _random(4, 3, 6, seed=2)
    s, i = blocked_topk(x, w, 5, block_rows=2, class_offset=10)
    want_s, want_i = _reference(x @ w.T, 5, offset=10)
    assert torch.equal(i, want_i) and (i[:, 3:] == -1).all() and torch.isinf(s[:, 3:]).all()
    torch.testing.assert_close(s, want_s)
    s, i = blocked_topk(x, w[:0], 2)  # an empty shard: all padding
    assert (i == -1).all() and (s == -math.inf).all()


def test_blocked_topk_float32_and_nan():
    x, w, _ = _random(5, 30, 4, seed=3, dtype=torch.float32)
    s, i = blocked_topk(x, w, 4, block_rows=8)
    want_s, want_i = torch.topk(x @ w.T, 4)
    torch.testing.assert_close(s, want_s)
    assert torch.equal(i, want_i)
    w[3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        blocked_topk(x, w, 4, block_rows=8)


@pytest.mark.parametrize("tied", [False, True])
def test_merge_topk_equals_top_k_over_all_shards(tied):
    x, w = _tied(10, 45, seed=4) if tied else _random(10, 45, 8, seed=4)[:2]
    bounds = [0, 12, 13, 30, 45]  # a one-class shard too
    parts = [blocked_topk(x, w[a:b], 6, block_rows=4, class_offset=a)
             for a, b in zip(bounds, bounds[1:])]
    want_s, want_i = _reference(x @ w.T, 6)
    for order in (parts, parts[::-1]):  # the shards' order does not matter
        s, i = merge_topk(order)
        assert torch.equal(i, want_i)
        torch.testing.assert_close(s, want_s)


def test_merge_topk_padding_sorts_after_real_minus_inf():
    parts = [(torch.tensor([[1.0, -math.inf]]), torch.tensor([[4, -1]])),
             (torch.tensor([[-math.inf, -math.inf]]), torch.tensor([[9, 8]]))]
    s, i = merge_topk(parts, k=4)
    assert i.tolist() == [[4, 8, 9, -1]] and s[0, 0] == 1.0
    s, i = merge_topk(parts, k=5)
    assert i.tolist() == [[4, 8, 9, -1, -1]]


def test_distributed_topk_without_process_group_is_blocked_topk():
    x, w, _ = _random(3, 20, 5, seed=5)
    s, i = distributed_topk(x, w, 4, class_offset=3, block_rows=6)
    ws, wi = blocked_topk(x, w, 4, block_rows=6, class_offset=3)
    assert torch.equal(s, ws) and torch.equal(i, wi)


# -- metrics, by hand ---------------------------------------------------------------------------

def test_single_label_metrics_by_hand():
    topk = torch.tensor([[7, 1, 2, 3, 4],    # hit at position 1
                         [1, 2, 9, 3, 4],    # hit at position 3
                         [1, 2, 3, 4, 5]])   # no hit
    y = torch.tensor([7, 9, 8])
    assert precision_at_k(topk, y, 1) == pytest.approx(1 / 3)
    assert precision_at_k(topk, y, 5) == pytest.approx((0.2 + 0.2 + 0) / 3)
    # DCG: 1/log2(2) = 1 and 1/log2(4) = 0.5; IDCG = 1 (one positive).
    assert ndcg_at_k(topk, y, 5) == pytest.approx((1 + 0.5 + 0) / 3)
    assert ndcg_at_k(topk, y, 1) == pytest.approx(1 / 3)
    assert recall_at_k(topk, y, 5) == pytest.approx(2 / 3)
    assert recall_at_k(topk, y, 1) == pytest.approx(1 / 3)
    per = ndcg_at_k(topk, y, 5, reduction="none")
    assert per.tolist() == pytest.approx([1.0, 0.5, 0.0])


def test_multi_label_metrics_by_hand():
    topk = torch.tensor([[3, 8, 5, 9, 1],     # positives {3, 5}: rel 1 0 1 0 0
                         [0, 1, 4, 7, 6],     # positives {2, 4, 6}: rel 0 0 1 0 1
                         [1, 2, 3, 4, 5],     # positive {10}: no hit
                         [1, 2, 3, 4, 5]])    # no positives at all
    y = pad_targets([[3, 5], [2, 4, 6], [10], []])
    assert y.tolist() == [[3, 5, -1], [2, 4, 6], [10, -1, -1], [-1, -1, -1]]
    assert precision_at_k(topk, y, 1) == pytest.approx(1 / 4)
    assert precision_at_k(topk, y, 5) == pytest.approx((2 / 5 + 2 / 5) / 4)
    # ex0: DCG = 1/log2(2) + 1/log2(4) = 1.5; IDCG (2 positives < k) = 1 + 1/log2(3) = 1.6309298
    ndcg0 = 1.5 / (1 + 1 / math.log2(3))
    assert ndcg0 == pytest.approx(0.9197208)
    # ex1: DCG = 1/log2(4) + 1/log2(6) = 0.5 + 0.3868528; IDCG = 1 + 0.6309298 + 0.5 = 2.1309298
    ndcg1 = (0.5 + 1 / math.log2(6)) / (1 + 1 / math.log2(3) + 0.5)
    assert ndcg1 == pytest.approx(0.4161812)  # 0.8868528 / 2.1309298
    assert ndcg_at_k(topk, y, 5, reduction="none").tolist() == pytest.approx([ndcg0, ndcg1, 0, 0])
    assert ndcg_at_k(topk, y, 5) == pytest.approx((ndcg0 + ndcg1) / 4)
    assert recall_at_k(topk, y, 5) == pytest.approx((2 / 2 + 2 / 3 + 0 + 0) / 4)
    assert recall_at_k(topk, y, 1) == pytest.approx((1 / 2) / 4)
    # nDCG@3 of ex1: rel 0 0 1 -> (1/log2(4)) / (1 + 1/log2(3) + 1/log2(4)); IDCG capped by k.
    assert ndcg_at_k(topk[1:2], y[1:2], 3) == pytest.approx(0.5 / (1 + 1 / math.log2(3) + 0.5))


def test_metric_edge_cases():
    # Padding ids (-1) in the top-k never hit the targets' padding; duplicate targets count once.
    topk = torch.tensor([[4, -1, -1]])
    assert precision_at_k(topk, torch.tensor([[-1, 4]]), 3) == pytest.approx(1 / 3)
    assert recall_at_k(topk, torch.tensor([[4, 4, 6]]), 3) == pytest.approx(1 / 2)
    assert ndcg_at_k(topk, torch.tensor([[7]]), 3) == 0.0
    with pytest.raises(ValueError):
        precision_at_k(topk, torch.tensor([4]), 5)  # fewer predictions than k


def _xc_union_case():
    g = torch.Generator().manual_seed(6)
    topk = torch.stack([torch.randperm(30, generator=g)[:5] for _ in range(13)])
    labels = [torch.randperm(30, generator=g)[:int(n)].tolist()
              for n in torch.randint(0, 5, (13,), generator=g)]
    return topk, pad_targets(labels)


def test_xc_metrics_accumulates_like_one_batch():
    topk, y = _xc_union_case()
    m = XCMetrics(ks=(1, 5))
    assert m.compute() == {}
    m.update(topk[:6], y[:6])
    m.update(topk[6:], y[6:])
    got = m.compute()
    assert set(got) >= {"p@1", "p@5", "ndcg@5", "recall@5"}
    assert got["p@1"] == pytest.approx(precision_at_k(topk, y, 1))
    assert got["p@5"] == pytest.approx(precision_at_k(topk, y, 5))
    assert got["ndcg@5"] == pytest.approx(ndcg_at_k(topk, y, 5))
    assert got["recall@5"] == pytest.approx(recall_at_k(topk, y, 5))


# -- two gloo ranks -----------------------------------------------------------------------------

SPLIT = (37, 64)


def _two_ranks(rank, world_size, x, w, bias, xt, wt, topk, y):
    lo = sum(SPLIT[:rank])
    hi = lo + SPLIT[rank]
    out = {"random": distributed_topk(x, w[lo:hi], 7, class_offset=lo, block_rows=10,
                                      bias=bias[lo:hi]),
           "tied": distributed_topk(xt, wt[lo:hi], 7, class_offset=lo, block_rows=6)}
    m = XCMetrics(ks=(1, 5))
    mine = slice(0, 5) if rank == 0 else slice(5, None)  # uneven: 5 and 8 examples
    m.update(topk[mine], y[mine])
    out["metrics"] = m.compute()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    x, w, bias = _random(6, sum(SPLIT), 8, seed=7)
    xt, wt = _tied(6, sum(SPLIT), seed=8)
    topk, y = _xc_union_case()
    results = spawn(_two_ranks, 2, x, w, bias, xt, wt, topk, y, timeout=120)
    return results, (x, w, bias, xt, wt, topk, y)


@pytest.mark.slow
def test_distributed_topk_on_two_ranks(two_ranks):
    results, (x, w, bias, xt, wt, _, _) = two_ranks
    want_s, want_i = torch.topk(x @ w.T + bias, 7)
    tied_s, tied_i = _reference(xt @ wt.T, 7)
    for r in results:
        s, i = r["random"]
        torch.testing.assert_close(s, want_s)
        assert torch.equal(i, want_i)
        assert torch.equal(r["tied"][0], tied_s) and torch.equal(r["tied"][1], tied_i)


@pytest.mark.slow
def test_xc_metrics_on_two_ranks_equals_union(two_ranks):
    results, (*_, topk, y) = two_ranks
    one = XCMetrics(ks=(1, 5))
    one.update(topk, y)
    want = one.compute()
    for r in results:
        assert r["metrics"].keys() == want.keys()
        for key in want:
            assert r["metrics"][key] == pytest.approx(want[key]), key


def test_metrics_of_a_column_slice_warn_nothing():
    """The top-k ids the task passes are a column slice (non-contiguous): no searchsorted
    warning (an extra copy on the hot path) from embedtrain's own code."""
    import warnings

    top = torch.randint(0, 50, (64, 10))
    m = XCMetrics(ks=(1, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.update(top, torch.randint(0, 50, (64, 3)))
    assert m.compute()["p@5"] >= 0


def test_psp_at_k_matches_a_slow_reference():
    """Normalised PSP@k as pyxclib's ``psprecision``: propensity-weighted hits over the best
    achievable propensity-weighted hits, both summed over examples; propensities by hand."""
    from embedtrain.train.xc_metrics import inverse_propensity

    topk, y = _xc_union_case()
    g = torch.Generator().manual_seed(5)
    counts = torch.randint(0, 50, (int(max(topk.max(), y.max())) + 1,), generator=g)
    n, a, b = 400, 0.55, 1.5
    c = (math.log(n) - 1) * (b + 1) ** a
    inv_p = [1 + c * (float(m) + b) ** -a for m in counts]  # 1 / p_l, Jain et al. 2016
    torch.testing.assert_close(inverse_propensity(counts, n), torch.tensor(inv_p,
                                                                           dtype=torch.float64))
    m = XCMetrics(ks=(1, 3, 5), inv_propensity=inverse_propensity(counts, n))
    m.update(topk[:4], y[:4])  # two batches add up as one
    m.update(topk[4:], y[4:])
    got = m.compute()
    for k in (1, 3, 5):
        gained = best = 0.0
        for row, labels in zip(topk.tolist(), y.tolist()):
            positives = {x for x in (labels if isinstance(labels, list) else [labels]) if x >= 0}
            gained += sum(inv_p[x] for x in row[:k] if x in positives)
            best += sum(sorted((inv_p[x] for x in positives), reverse=True)[:k])
        assert got[f"psp@{k}"] == pytest.approx(gained / best)
    # A tail label is worth more than a head label: the rarer the hit, the higher PSP.
    assert inverse_propensity(torch.tensor([1, 1000]), n).tolist()[0] > 2
    assert XCMetrics(ks=(1,)).compute() == {}
