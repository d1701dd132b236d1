"""LAMB / LARS vs per-tensor loop references, checkpointing, torchrec wrapping, LR schedules."""

import copy
import json
import math

import pytest
import torch
from torch import nn
from torchrec.optim.keyed import KeyedOptimizerWrapper

from embedtrain.train.large_batch import (
    LAMB,
    LARS,
    lr_multiplier,
    lr_schedule,
    split_decay_groups,
)
from embedtrain.train.options import LRDecay

# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add overhead (several x on a busy 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)



def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3))


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)


def _grads(model: nn.Module, step: int) -> None:
    x, y = _batch(step)
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()


def _is_excluded(p: torch.Tensor, split: bool) -> bool:
    return split and p.ndim <= 1


def _ref_lamb(model, steps, lr, betas, eps, wd, split, clamp=(0.0, 10.0)):
    """Plain per-tensor LAMB straight from the paper's formulas (no foreach, no stacking)."""
    b1, b2 = betas
    state = {}
    for t in range(1, steps + 1):
        _grads(model, t)
        with torch.no_grad():
            for p in model.parameters():
                m, v = state.get(p, (torch.zeros_like(p), torch.zeros_like(p)))
                g = p.grad
                m = b1 * m + (1 - b1) * g
                v = b2 * v + (1 - b2) * g * g
                state[p] = (m, v)
                m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
                decay = 0.0 if _is_excluded(p, split) else wd
                u = m_hat / (v_hat.sqrt() + eps) + decay * p
                w_n, u_n = p.norm().item(), u.norm().item()
                if _is_excluded(p, split) or w_n == 0 or u_n == 0:
                    r = 1.0
                else:
                    r = min(max(w_n / u_n, clamp[0]), clamp[1])
                p -= lr * r * u


def _ref_lars(model, steps, lr, momentum, wd, tc, eps, split, nesterov=False):
    bufs = {}
    for t in range(1, steps + 1):
        _grads(model, t)
        with torch.no_grad():
            for p in model.parameters():
                g = p.grad
                decay = 0.0 if _is_excluded(p, split) else wd
                w_n, g_n = p.norm().item(), g.norm().item()
                if _is_excluded(p, split) or w_n == 0 or g_n == 0:
                    local = 1.0
                else:
                    local = tc * w_n / (g_n + decay * w_n + eps)
                d = (g + decay * p) * local
                b = momentum * bufs.get(p, torch.zeros_like(p)) + d
                bufs[p] = b
                p -= lr * (d + momentum * b if nesterov else b)


def _run(model, opt, steps, start=1):
    for t in range(start, start + steps):
        _grads(model, t)
        opt.step()


def _params(opt_cls, model, split, **kw):
    params = split_decay_groups(model.named_parameters()) if split else model.parameters()
    return opt_cls(params, **kw)


# --------------------------------------------------------------------------- vs references


@pytest.mark.parametrize("split", [False, True])
def test_lamb_matches_reference(split):
    kw = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)
    model, ref = _mlp(), _mlp()
    with torch.no_grad():  # a zero tensor exercises the ||w|| == 0 -> ratio 1 rule
        model[3].bias.zero_()
        ref[3].bias.zero_()
    _run(model, _params(LAMB, model, split, **kw), 5)
    _ref_lamb(ref, 5, kw["lr"], kw["betas"], kw["eps"], kw["weight_decay"], split)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(model[0].weight, _mlp()[0].weight)


def test_lamb_clamp_matches_reference():
    model, ref = _mlp(), _mlp()
    _run(model, LAMB(model.parameters(), lr=0.05, clamp_trust=(0.5, 2.0), weight_decay=0.01), 4)
    _ref_lamb(ref, 4, 0.05, (0.9, 0.999), 1e-6, 0.01, False, clamp=(0.5, 2.0))
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split,nesterov", [(False, False), (True, False), (True, True)])
def test_lars_matches_reference(split, nesterov):
    kw = dict(lr=0.5, momentum=0.9, weight_decay=0.05, trust_coefficient=0.02, eps=1e-8)
    model, ref = _mlp(), _mlp()
    with torch.no_grad():  # ||w|| == 0 -> local lr 1
        model[3].bias.zero_()
        ref[3].bias.zero_()
    _run(model, _params(LARS, model, split, nesterov=nesterov, **kw), 5)
    _ref_lars(ref, 5, kw["lr"], kw["momentum"], kw["weight_decay"], kw["trust_coefficient"],
              kw["eps"], split, nesterov)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [LAMB, LARS])
def test_mixed_dtypes_in_one_group(cls):
    torch.manual_seed(0)
    mixed = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5, dtype=torch.float64)),
             nn.Parameter(torch.randn(2, 2))]
    alone = [nn.Parameter(p.detach().clone()) for p in mixed]
    opts = [cls(mixed, lr=0.1, weight_decay=0.01)] + [cls([p], lr=0.1, weight_decay=0.01)
                                                       for p in alone]
    for t in range(3):
        for p, q in zip(mixed, alone):
            p.grad = torch.sin(p.detach() * (t + 1))
            q.grad = p.grad.clone()
        for o in opts:
            o.step()
    for p, q in zip(mixed, alone):
        assert p.dtype == q.dtype
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_split_decay_groups():
    model = _mlp()
    groups = split_decay_groups(model.named_parameters())
    assert [len(g["params"]) for g in groups] == [2, 4]
    assert all(p.ndim == 2 for p in groups[0]["params"]) and len(groups[0]) == 1
    assert groups[1]["weight_decay"] == 0.0 and groups[1]["exclude_from_adaptation"] is True
    by_dict = split_decay_groups(dict(model.named_parameters()))
    assert [len(g["params"]) for g in by_dict] == [2, 4]
    assert split_decay_groups([model[0].weight]) == [{"params": [model[0].weight]}]


# --------------------------------------------------------------------------- properties


def test_lamb_with_unit_trust_is_adam():
    model, ref = _mlp(), _mlp()
    _run(model, LAMB(model.parameters(), lr=0.01, eps=1e-6, clamp_trust=(1.0, 1.0)), 4)
    _run(ref, torch.optim.Adam(ref.parameters(), lr=0.01, eps=1e-6), 4)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # ... and the default clamp really does rescale (so the check above can fail)
    other = _mlp()
    _run(other, LAMB(other.parameters(), lr=0.01, eps=1e-6), 4)
    assert not torch.allclose(other[0].weight, ref[0].weight, rtol=1e-3, atol=1e-4)


def test_lars_step_is_proportional_to_weight_norm():
    x, y = _batch()
    steps = []
    for c in (1.0, 4.0):
        model = _mlp()
        with torch.no_grad():
            model[0].weight.mul_(c)
        before = model[0].weight.detach().clone()
        nn.functional.mse_loss(model(x), y).backward()
        LARS(model.parameters(), lr=1.0, momentum=0.0, weight_decay=0.0, eps=0.0).step()
        steps.append((model[0].weight - before).norm().item())
        # step norm is exactly trust_coefficient * ||w||, independent of the gradient scale
        assert steps[-1] == pytest.approx(0.001 * before.norm().item(), rel=1e-5)
    assert steps[1] / steps[0] == pytest.approx(4.0, rel=1e-5)


def test_closure_returns_loss():
    for cls in (LAMB, LARS):
        model = _mlp()
        opt = cls(model.parameters())
        x, y = _batch()

        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        loss = opt.step(closure)
        assert torch.is_tensor(loss) and loss.item() > 0


@pytest.mark.parametrize("cls,kw", [(LAMB, dict(lr=0.1)),
                                    (LARS, dict(lr=5.0, trust_coefficient=0.01))])
def test_trains_logistic_regression(cls, kw):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 10, generator=g)
    y = (x @ torch.randn(10, generator=g) > 0).float()
    torch.manual_seed(0)
    model = nn.Linear(10, 1)
    opt = cls(split_decay_groups(model.named_parameters()), weight_decay=1e-4, **kw)

    def loss_fn():
        return nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)

    initial = loss_fn().item()
    for _ in range(50):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    assert loss_fn().item() < 0.7 * initial


def test_bad_optimizer_arguments():
    p = [nn.Parameter(torch.ones(2, 2))]
    with pytest.raises(ValueError, match="betas"):
        LAMB(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="clamp_trust"):
        LAMB(p, clamp_trust=(2.0, 1.0))
    with pytest.raises(ValueError, match="trust_coefficient"):
        LARS(p, trust_coefficient=0.0)
    with pytest.raises(ValueError, match="nesterov"):
        LARS(p, momentum=0.0, nesterov=True)


# --------------------------------------------------------------------------- checkpointing


@pytest.mark.parametrize("cls,kw", [
    (LAMB, dict(lr=0.05, weight_decay=0.1)),
    (LARS, dict(lr=0.5, weight_decay=0.05, trust_coefficient=0.02)),
])
def test_state_dict_round_trip(cls, kw):
    model = _mlp()
    opt = cls(split_decay_groups(model.named_parameters()), **kw)
    _run(model, opt, 3)
    clone = copy.deepcopy(model)
    sd = copy.deepcopy(opt.state_dict())
    fresh = cls(split_decay_groups(clone.named_parameters()), lr=123.0)  # hyperparams come from sd
    fresh.load_state_dict(sd)
    assert fresh.param_groups[0]["lr"] == kw["lr"]
    _run(model, opt, 2, start=4)
    _run(clone, fresh, 2, start=4)
    for a, b in zip(model.parameters(), clone.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if cls is LAMB:
        st = fresh.state[clone[0].weight]
        assert torch.is_tensor(st["step"]) and st["step"].item() == 5.0
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("cls", [LAMB, LARS])
def test_inside_keyed_optimizer_wrapper(cls):
    model = _mlp()
    keyed = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda p: cls(p, lr=0.01))
    before = model[0].weight.detach().clone()
    _run(model, keyed, 2)
    assert not torch.equal(before, model[0].weight)
    sd = keyed.state_dict()
    assert set(sd["state"]) == {n for n, _ in model.named_parameters()}
    # checkpoint path: init_state() creates the lazy state, then load copies into it in place
    clone = copy.deepcopy(model)
    other = KeyedOptimizerWrapper(dict(clone.named_parameters()), lambda p: cls(p, lr=0.01))
    other.init_state()
    other.load_state_dict(copy.deepcopy(sd))
    _run(model, keyed, 2, start=3)
    _run(clone, other, 2, start=3)
    for a, b in zip(model.parameters(), clone.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # split groups through the dict-passing factory
    split = KeyedOptimizerWrapper(dict(clone.named_parameters()),
                                  lambda p: cls(split_decay_groups(p), lr=0.01, weight_decay=0.1),
                                  pass_params_dict=True)
    assert [g["exclude_from_adaptation"] for g in split.param_groups] == [False, True]
    _run(clone, split, 1)
    assert len(split.state_dict()["state"]) == 6


# --------------------------------------------------------------------------- schedules

SCHED = dict(warmup_steps=10, total_steps=110, step_size=20, gamma=0.5, min_lr_ratio=0.2)


def test_lr_multiplier_values():
    f = {d: (lambda s, d=d: lr_multiplier(s, decay=d, **SCHED)) for d in LRDecay}
    for d in f:
        warm = [f[d](s) for s in range(10)]
        assert warm[0] == pytest.approx(0.1) and warm[-1] == 1.0
        assert all(a < b for a, b in zip(warm, warm[1:]))
        assert f[d](10) == 1.0
    assert f[LRDecay.NONE](10_000) == 1.0
    assert f[LRDecay.COSINE](60) == pytest.approx((1 + 0.2) / 2)
    assert f[LRDecay.COSINE](110) == pytest.approx(0.2) and f[LRDecay.COSINE](500) == pytest.approx(0.2)
    assert f[LRDecay.COSINE](35) > f[LRDecay.COSINE](85)
    assert f[LRDecay.STEP](29) == 1.0 and f[LRDecay.STEP](30) == 0.5
    assert f[LRDecay.STEP](10 + 2 * 20) == pytest.approx(0.25)
    assert lr_multiplier(0, warmup_steps=0, total_steps=10, decay=LRDecay.COSINE) == 1.0
    assert lr_multiplier(5, warmup_steps=0, total_steps=10, decay=LRDecay.COSINE) == pytest.approx(0.5)


@pytest.mark.parametrize("kwargs,name", [
    (dict(decay="linear"), "decay"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(total_steps=-5), "total_steps"),
    (dict(decay=LRDecay.COSINE, warmup_steps=200), "total_steps"),
    (dict(step_size=0), "step_size"),
    (dict(gamma=0.0), "gamma"),
    (dict(min_lr_ratio=1.5), "min_lr_ratio"),
])
def test_bad_schedule_arguments(kwargs, name):
    args = {**SCHED, "decay": LRDecay.STEP, **kwargs}
    with pytest.raises(ValueError, match=name):
        lr_multiplier(0, **args)
    with pytest.raises(ValueError, match=name):
        lr_schedule(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0), **args)


def test_negative_step_rejected():
    with pytest.raises(ValueError, match="step"):
        lr_multiplier(-1, **SCHED)


def test_scheduler_round_trip():
    def make():
        model = _mlp()
        opt = LAMB(model.parameters(), lr=0.1)
        return opt, lr_schedule(opt, decay=LRDecay.COSINE, **SCHED)

    opt, sched = make()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)  # step 0 of warmup
    for _ in range(37):
        opt.step()
        sched.step()
    sd = json.loads(json.dumps(sched.state_dict()))  # the trainer keeps it in trainer_state.json
    opt2, sched2 = make()
    sched2.load_state_dict(sd)
    assert sched2.last_epoch == 37
    sched.step()
    sched2.step()
    expected = 0.1 * lr_multiplier(38, decay=LRDecay.COSINE, **SCHED)
    assert opt.param_groups[0]["lr"] == pytest.approx(expected)
    assert opt2.param_groups[0]["lr"] == pytest.approx(expected)
    assert not math.isclose(expected, 0.1 * lr_multiplier(1, decay=LRDecay.COSINE, **SCHED))
