"""bf16 (and fp8) class heads: stochastic rounding is unbiased and reproducible, row-wise Adagrad follows
its formula, a bf16 step computes what a float32 head holding the same values computes, and a
head split over 2 ranks rounds and updates every row as 1 rank does."""

import pytest
import torch

from embedtrain.heads.sharded import PartialFCHead, ShardedSoftmaxHead
from embedtrain.heads.low_precision import random_bits16, round_rows
from embedtrain.models.options import HeadLoss, Margin, Rounding
from embedtrain.heads.topk import blocked_topk
from embedtrain.processes import spawn
from embedtrain.train.optim import (HeadFactoredAdagrad, HeadRowWiseAdagrad, RowSparseAdagrad,
                                    column_profile_, rowwise_adagrad_rows_)

SR, NEAREST = Rounding.STOCHASTIC, Rounding.NEAREST
C, D, B = 37, 8, 6  # an odd class count: uneven slices


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """bfloat16's spacing at |x| (8 significant bits)."""
    return torch.ldexp(torch.ones_like(x), torch.frexp(x.abs())[1] - 8)


def test_stochastic_rounding_is_unbiased_and_reproducible():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(8, generator=g) * torch.tensor([1e-3, 1, 10, 300, 1, 1, 1e5, 2.0])
    copies = 20_000  # each value on that many rows: 20,000 independent roundings
    x = values.repeat(copies, 1)
    rows = torch.arange(copies)
    out = round_rows(x, rows, torch.bfloat16, SR, seed=5, step=3)
    assert out.dtype == torch.bfloat16
    up = values.to(torch.bfloat16).float()
    # Each result is one of the two bfloat16 neighbours of its value.
    low = torch.where(up > values, up - _ulp(values), up)
    high = low + _ulp(values)
    got = out.float()
    assert bool(((got == low) | (got == high)).all())
    # Unbiased: the mean is the float32 value within 5 standard errors (ulp / 2 / sqrt(n)).
    bias = (got.mean(0) - values).abs()
    assert bool((bias < 5 * _ulp(values) / 2 / copies ** 0.5).all()), bias / _ulp(values)
    # ... where rounding to nearest is off by up to half an ulp, the same way every time.
    nearest = round_rows(x, rows, torch.bfloat16, NEAREST, seed=5, step=3).float()
    assert torch.equal(nearest, up.repeat(copies, 1))
    # Reproducible: the same key draws the same bits; another step or seed draws others; a
    # slice of the rows (a rank's share) rounds as the whole does.
    assert torch.equal(out, round_rows(x, rows, torch.bfloat16, SR, seed=5, step=3))
    assert not torch.equal(out, round_rows(x, rows, torch.bfloat16, SR, seed=5, step=4))
    assert not torch.equal(out, round_rows(x, rows, torch.bfloat16, SR, seed=6, step=3))
    assert torch.equal(out[777:5000], round_rows(x[777:5000], rows[777:5000], torch.bfloat16,
                                                 SR, seed=5, step=3))
    bits = random_bits16(rows[:4096], 128, seed=0, step=0)
    assert int(bits.min()) >= 0 and int(bits.max()) < 2 ** 16
    assert abs(float(bits.float().mean()) / 2 ** 16 - 0.5) < 0.002
    # float32 storage is left alone; non-finite values stay what they are.
    assert round_rows(x, rows, torch.float32, SR, 0, 0) is x
    odd = torch.tensor([[float("inf"), -float("inf"), float("nan"), -2.5]])
    r = round_rows(odd, torch.zeros(1, dtype=torch.long), torch.bfloat16, SR, 0, 0).float()
    assert r[0, 0] == float("inf") and r[0, 1] == -float("inf") and r[0, 2].isnan()
    assert r[0, 3] == -2.5


def _e4m3_values() -> torch.Tensor:
    """Every finite float8 e4m3 value, sorted (from its 256 bit patterns)."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.unique(every[torch.isfinite(every)])


def test_stochastic_rounding_to_e4m3_is_unbiased_and_reproducible():
    """fp8 rows: each rounding lands on one of the two e4m3 neighbours of its value (normal,
    subnormal, negative), unbiased; 448 and above saturate; the same key draws the same bits."""
    values = torch.tensor([0.3, -0.0913, 1e-3, -0.0123, 5.1, 300.0, 0.0, 2.0 ** -9 * 2.5])
    copies = 20_000
    x = values.repeat(copies, 1)
    rows = torch.arange(copies)
    out = round_rows(x, rows, torch.float8_e4m3fn, SR, seed=5, step=3)
    assert out.dtype == torch.float8_e4m3fn
    grid = _e4m3_values()
    above = torch.searchsorted(grid, values, right=False)  # the first grid value >= x
    high = grid[above]
    low = torch.where(high == values, high, grid[(above - 1).clamp(min=0)])
    got = out.float()
    assert bool(((got == low) | (got == high)).all())
    bias = (got.mean(0) - values).abs()
    assert bool((bias <= 5 * (high - low) / 2 / copies ** 0.5).all()), bias / (high - low)
    assert bool((bias[high == values] == 0).all())  # representable values stay put
    nearest = round_rows(x, rows, torch.float8_e4m3fn, NEAREST, seed=5, step=3)
    assert torch.equal(nearest.float(), values.to(torch.float8_e4m3fn).float().repeat(copies, 1))
    assert torch.equal(out.view(torch.uint8), round_rows(
        x, rows, torch.float8_e4m3fn, SR, seed=5, step=3).view(torch.uint8))
    assert not torch.equal(out.view(torch.uint8), round_rows(
        x, rows, torch.float8_e4m3fn, SR, seed=5, step=4).view(torch.uint8))
    big = torch.tensor([[448.0, 1000.0, -1e6, float("nan")]])
    for rounding in (SR, NEAREST):
        r = round_rows(big, torch.zeros(1, dtype=torch.long), torch.float8_e4m3fn, rounding,
                       0, 0).float()
        assert r[0, :3].tolist() == [448.0, 448.0, -448.0] and r[0, 3].isnan()


def test_small_updates_move_a_stochastically_rounded_weight_and_not_a_nearest_one():
    """Why stochastic rounding: an update under half an ulp is lost by rounding to nearest
    every time, and kept on average by stochastic rounding (no float32 master copy needed)."""
    w = {r: torch.ones(64, 16, dtype=torch.bfloat16) for r in (SR, NEAREST)}
    rows = torch.arange(64)
    for step in range(1, 1001):  # 1,000 steps of +1e-4 each; bfloat16's ulp at 1 is 2^-7
        for r in w:
            w[r] = round_rows(w[r].float() + 1e-4, rows, torch.bfloat16, r, seed=0, step=step)
    assert bool((w[NEAREST] == 1).all())
    assert abs(float(w[SR].float().mean()) - 1.1) < 0.01


def _reference_rowwise(weight, state, rows, grad, lr, eps):
    """FBGEMM's row-wise Adagrad, one row at a time in float32."""
    weight, state = weight.clone(), state.clone()
    for r, g in zip(rows.tolist(), grad):
        state[r] += (g * g).sum() / g.numel()
        weight[r] -= lr * g / (state[r].sqrt() + eps)
    return weight, state


def test_rowwise_adagrad_follows_its_formula(monkeypatch):
    import embedtrain.train.optim as optim

    monkeypatch.setattr(optim, "_ROW_CHUNK", 2)  # 5 rows in 3 chunks: each chunk written back
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(C, D, generator=g)
    state = torch.rand(C, generator=g)
    rows = torch.tensor([0, 3, 4, 20, 36])
    grad = torch.randn(len(rows), D, generator=g)
    ref_w, ref_s = _reference_rowwise(weight, state, rows, grad, 0.1, 1e-10)
    w, s = weight.clone(), state.clone()
    rowwise_adagrad_rows_(w, s, rows, grad, 0.1, 1e-10, SR, seed=0, step=1, row_offset=0)
    torch.testing.assert_close(s, ref_s, rtol=1e-6, atol=0)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)
    untouched = torch.ones(C, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(w[untouched], weight[untouched]) and torch.equal(s[untouched],
                                                                        state[untouched])
    # bf16 rows: the update, rounded back: to nearest within half an ulp of the reference,
    # stochastically to one of its two bfloat16 neighbours, with bits keyed by the global row.
    low = weight.to(torch.bfloat16)
    ref, _ = _reference_rowwise(low.double(), state.double(), rows, grad.double(), 0.1, 1e-10)
    ref = ref[rows]
    results = {}
    for rounding, offset in ((NEAREST, 100), (SR, 100), (SR, 0)):
        w16, s16 = low.clone(), state.clone()
        rowwise_adagrad_rows_(w16, s16, rows, grad, 0.1, 1e-10, rounding, seed=0, step=1,
                              row_offset=offset)
        assert w16.dtype == torch.bfloat16 and torch.equal(w16[untouched], low[untouched])
        got, ulp = w16[rows].double(), _ulp(ref.float()).double()
        assert bool(((got - ref).abs() < ulp * (0.5 if rounding is NEAREST else 1) + 1e-6).all())
        results[rounding, offset] = w16
    assert not torch.equal(results[SR, 100], results[SR, 0])
    assert not torch.equal(results[SR, 100], results[NEAREST, 100])


def test_factored_adagrad_follows_its_formula():
    """Row-wise Adagrad's accumulator times the columns' profile (sums of squares over every
    updated row so far, mean 1), one row at a time in float64, over three sparse steps."""
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(C, D, generator=g)
    param = torch.nn.Parameter(weight.clone())
    opt = HeadFactoredAdagrad([param], lr=0.1)
    ref_w, ref_s, ref_c = weight.double(), torch.zeros(C, dtype=torch.float64), torch.zeros(D)
    ref_c = ref_c.double()
    for step in range(3):
        rows = torch.randperm(C, generator=g)[:5 + step]
        grad = torch.randn(len(rows), D, generator=g)
        param.grad = torch.sparse_coo_tensor(rows[None], grad, (C, D))
        opt.step()
        ref_c += grad.double().pow(2).sum(0)
        profile = ref_c / ref_c.mean()
        for r, row_grad in zip(rows.tolist(), grad.double()):
            ref_s[r] += row_grad.pow(2).mean()
            ref_w[r] -= 0.1 * row_grad / ((ref_s[r] * profile).sqrt() + 1e-10)
    torch.testing.assert_close(param.detach().double(), ref_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[param]["sum"].double(), ref_s, rtol=1e-5, atol=0)
    torch.testing.assert_close(opt.state[param]["columns"].double(), ref_c, rtol=1e-5, atol=0)
    # no gradient yet: a flat profile, and nothing accumulated
    cols = torch.zeros(D)
    assert torch.equal(column_profile_(cols, None, None), torch.ones(D))


def test_factored_adagrad_is_full_adagrad_on_outer_product_gradients():
    """A class row's gradient is ``error x feature``; while every step's feature has the same
    squared profile, the accumulated squares are exactly rank one and the factored step is full
    Adagrad's (one accumulator a weight) to rounding, where row-wise Adagrad's is not."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(C, D, generator=g)
    feature = torch.randn(D, generator=g) * torch.logspace(-2, 1, D)  # uneven coordinates
    params = {k: torch.nn.Parameter(weight.clone()) for k in ("full", "factored", "rowwise")}
    opts = {"full": RowSparseAdagrad([params["full"]], lr=0.1, eps=1e-10),
            "factored": HeadFactoredAdagrad([params["factored"]], lr=0.1),
            "rowwise": HeadRowWiseAdagrad([params["rowwise"]], lr=0.1)}
    for _ in range(4):
        rows = torch.randperm(C, generator=g)[:9]
        errors = torch.randn(len(rows), 1, generator=g)
        signs = torch.randint(0, 2, (D,), generator=g) * 2 - 1  # same squares, other signs
        grad = errors * feature * signs
        for k, p in params.items():
            p.grad = torch.sparse_coo_tensor(rows[None], grad, (C, D))
            opts[k].step()
    torch.testing.assert_close(params["factored"].detach(), params["full"].detach(),
                               rtol=1e-5, atol=1e-6)
    assert not torch.allclose(params["rowwise"].detach(), params["full"].detach(), atol=1e-3)


def _reference(seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(C, D, generator=g).to(torch.bfloat16)  # bf16-representable values
    features = torch.randn(2 * B, D, generator=g)
    labels = torch.randint(0, C, (2 * B,), generator=g)
    return weight, features, labels


@pytest.mark.parametrize("margin", ["none", "cosface"])
def test_a_bf16_step_is_the_float32_step_of_the_same_values(margin):
    """A bf16 head gathers its rows in float32: the loss, the features' gradient and the rows'
    gradient (in ``main_grad``, float32) are those of a float32 head holding the same values."""
    weight, features, labels = _reference()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        head = PartialFCHead(C, D, sample_rate=0.4, seed=3, dtype=dtype, margin=Margin(margin),
                             scale=16.0)
        with torch.no_grad():
            head.weight.copy_(weight)
        x = features.clone().requires_grad_(True)
        loss = head(x, labels)
        loss.backward()
        grad = head.weight.grad if dtype == torch.float32 else head.weight.main_grad
        assert (head.weight.grad is None) == (dtype == torch.bfloat16)
        out[dtype] = (loss.detach(), x.grad, grad.to_dense(), head.last_sample)
        head.eval()
        ref = blocked_topk(features, weight.float(), 5, normalize_rows=margin != "none")
        scale = 16.0 if margin != "none" else 1.0
        q = torch.nn.functional.normalize(features, dim=1) * scale if scale != 1 else features
        scores, ids = head.topk(features, 5)
        assert torch.equal(ids, blocked_topk(q, weight.float(), 5,
                                             normalize_rows=margin != "none")[1]), ref
        out[dtype] += (scores, head.eval_loss(features, labels))
    for a, b in zip(out[torch.float32], out[torch.bfloat16]):
        assert torch.equal(a, b)


def _rank_step(rank, world, kind="rowwise_adagrad", dtype=torch.bfloat16):
    """Each rank: a bf16 (``dtype``) full head's slice, one step of 2 of the reference's
    examples each."""
    from embedtrain.train.optim import sharded_head_optimizer
    from embedtrain.train.options import HeadOptimizer

    weight, features, labels = _reference()
    head = ShardedSoftmaxHead(C, D, dtype=dtype, seed=4, loss=HeadLoss.SOFTMAX)
    with torch.no_grad():
        head.weight.copy_(weight[head.start:head.end])
    opt = sharded_head_optimizer(head, HeadOptimizer(kind), 0.5)
    part = slice(rank * B, (rank + 1) * B)
    head(features[part].clone().requires_grad_(True), labels[part]).backward()
    grad = head.weight.main_grad.to_dense()
    opt.step()
    opt.zero_grad()
    head.eval()
    n = B if rank == 0 else B - 2  # uneven evaluation batches
    ids = head.topk(features[rank * B:rank * B + n], 5)[1]
    state = opt.state_dict()["state"]["weight"]
    sums = state["sum"]
    return {"start": head.start, "grad": grad, "weight": head.weight.detach().clone(),
            "topk": ids, "sum": sums.to_local().clone(), "sum_shape": tuple(sums.shape),
            "columns": state.get("columns")}


def _one_rank_step(kind, dtype=torch.bfloat16):
    """The reference's head whole on 1 rank (bf16 or ``dtype``, ``kind``'s optimizer at 0.5),
    after the backward of the global batch; and the reference data."""
    from embedtrain.train.optim import sharded_head_optimizer
    from embedtrain.train.options import HeadOptimizer

    weight, features, labels = _reference()
    head = ShardedSoftmaxHead(C, D, dtype=dtype, seed=4)
    with torch.no_grad():
        head.weight.copy_(weight)
    opt = sharded_head_optimizer(head, HeadOptimizer(kind), 0.5)
    head(features.clone().requires_grad_(True), labels).backward()
    return head, opt, (weight, features, labels)

@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_a_bf16_head_on_two_ranks_steps_as_on_one(dtype):
    """The slices' float32 gradients are the 1-rank head's; given them, the update (its
    stochastic rounding keyed by global rows) is bit for bit the 1-rank update."""
    ranks = spawn(_rank_step, 2, "rowwise_adagrad", dtype)
    assert [r["start"] for r in ranks] == [0, 19]
    assert all(r["weight"].dtype == dtype for r in ranks)
    assert ranks[0]["sum_shape"] == (C,)  # the row-wise state is saved as one [C] tensor
    head, opt, (weight, features, labels) = _one_rank_step("rowwise_adagrad", dtype)
    grads = torch.cat([r["grad"] for r in ranks])
    torch.testing.assert_close(head.weight.main_grad.to_dense(), grads)
    head.weight.main_grad = grads.to_sparse(1)  # the ranks' own gradients, to compare updates
    opt.step()
    assert torch.equal(head.weight.detach(), torch.cat([r["weight"] for r in ranks]))
    sums = opt.state[head.weight]["sum"]  # a DTensor where this process joined a group
    sums = sums.to_local() if hasattr(sums, "to_local") else sums
    assert torch.equal(sums, torch.cat([r["sum"] for r in ranks]))
    head.eval()
    ids = head.topk(features, 5)[1]
    assert torch.equal(torch.cat([ranks[0]["topk"], ranks[1]["topk"]]),
                       torch.cat([ids[:B], ids[B:2 * B - 2]]))


@pytest.mark.slow
def test_a_factored_head_on_two_ranks_steps_as_on_one():
    """The column profile is summed over both slices (one all-reduce), so each rank holds the
    1-rank head's columns and updates its rows as the 1-rank head does (to the rounding of a
    sum taken in another order: stochastic rounding may then pick the other neighbour of a
    value within an ulp)."""
    ranks = spawn(_rank_step, 2, "factored_adagrad")
    head, opt, (weight, features, labels) = _one_rank_step("factored_adagrad")
    head.weight.main_grad = torch.cat([r["grad"] for r in ranks]).to_sparse(1)
    opt.step()
    columns = opt.state[head.weight]["columns"]
    for r in ranks:
        torch.testing.assert_close(r["columns"], columns, rtol=1e-6, atol=0)
    assert torch.equal(ranks[0]["columns"], ranks[1]["columns"])
    ulp = _ulp(head.weight.detach().float())
    got = torch.cat([r["weight"] for r in ranks]).float()
    assert bool(((got - head.weight.detach().float()).abs() <= ulp).all())
    changed = (got != weight.float()).any(dim=1)
    assert int(changed.sum()) == C  # a full head's step moves every row
