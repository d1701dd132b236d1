"""Large-batch dense optimizers (LAMB, LARS) and warmup + decay learning-rate schedules.

With large data-parallel batches the learning rate has to grow with the batch, and a single global
rate then blows up some layers while it under-trains others. Both optimizers here rescale each
parameter tensor's ("layer's") step by a trust ratio ``||w|| / ||update||``, so every layer moves
by a similar *relative* amount:

* :class:`LAMB` (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in
  76 minutes", arXiv:1904.00962) is Adam plus the trust ratio. Use it where you would use Adam /
  AdamW: transformers, DLRM/DCN dense towers, anything that trains well with Adam.
* :class:`LARS` (You et al. 2017, "Large Batch Training of Convolutional Networks",
  arXiv:1708.03888) is SGD with momentum plus the trust ratio. Use it where SGD-momentum is the
  baseline (convnets, ResNet-style models) and Adam's extra state is unwanted.

Biases and normalisation weights (1-D tensors) are usually kept out of weight decay and of the
trust-ratio scaling: :func:`split_decay_groups` builds such param groups (group flag
``exclude_from_adaptation``). Both optimizers want a warmup; :func:`lr_schedule` gives linear
warmup followed by constant, cosine or step decay, and :func:`lr_multiplier` is its pure formula.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    >>> opt = LAMB(split_decay_groups(model.named_parameters()), lr=2e-3, weight_decay=0.01)
    >>> sched = lr_schedule(opt, warmup_steps=100, total_steps=1000, decay=LRDecay.COSINE)
    >>> # per step: loss.backward(); opt.step(); opt.zero_grad(); sched.step()
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR

from embedtrain.train.options import LRDecay

__all__ = ["LAMB", "LARS", "split_decay_groups", "lr_multiplier", "lr_schedule"]

_Params = Iterable[torch.Tensor] | Iterable[dict[str, Any]]
_NamedParams = (
    Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[torch.Tensor]
)


def split_decay_groups(named_params: _NamedParams) -> list[dict[str, Any]]:
    """Param groups that keep 1-D tensors (biases, norm weights) out of decay and trust ratios.

    Args:
        named_params: ``model.named_parameters()``, a ``{name: param}`` dict (what
            ``KeyedOptimizerWrapper(..., pass_params_dict=True)`` hands its factory), or plain
            parameters; only the tensors' ``ndim`` matters.

    Returns:
        Up to two groups, empty ones dropped: ``{"params": [>=2-D tensors]}`` (optimizer
        defaults) and ``{"params": [<=1-D tensors], "weight_decay": 0.0,
        "exclude_from_adaptation": True}``.
    """
    items = named_params.values() if isinstance(named_params, Mapping) else named_params
    adapted: list[torch.Tensor] = []
    excluded: list[torch.Tensor] = []
    for item in items:
        p = item[1] if isinstance(item, tuple) else item
        (excluded if p.ndim <= 1 else adapted).append(p)
    groups: list[dict[str, Any]] = []
    if adapted:
        groups.append({"params": adapted})
    if excluded:
        groups.append({"params": excluded, "weight_decay": 0.0, "exclude_from_adaptation": True})
    return groups


class _LayerWise(torch.optim.Optimizer):
    """Closure handling and per-(device, dtype) bucketing, so foreach ops and ``stack`` apply."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Performs one update; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError(f"{type(self).__name__} needs dense gradients")
                    buckets.setdefault((p.device, p.dtype), []).append(p)
            for ps in buckets.values():
                self._update(group, ps, [p.grad for p in ps])
        return loss

    def _update(self, group: dict[str, Any], ps: list[Tensor], gs: list[Tensor]) -> None:
        raise NotImplementedError


class LAMB(_LayerWise):
    """Adam with a layer-wise trust ratio (You et al. 2019), for large-batch training.

    Per tensor ``w``: Adam moments ``m, v``; ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay*w``;
    ``r = clamp(||w|| / ||u||, *clamp_trust)``, or exactly 1.0 (not clamped) when either norm is 0
    or the group has ``exclude_from_adaptation=True``; then ``w -= lr * r * u``.

    Args:
        params: Parameters or param-group dicts (see :func:`split_decay_groups`).
        lr: Learning rate.
        betas: Decay rates of the first and second moment averages.
        eps: Added to ``sqrt(v_hat)`` (outside the square root).
        weight_decay: Decoupled weight decay added to the Adam update before the trust ratio.
        bias_correction: Divide the moments by ``1 - beta**step`` as Adam does.
        clamp_trust: ``(low, high)`` bounds of the trust ratio.
    """

    def __init__(self, params: _Params, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, bias_correction: bool = True,
                 clamp_trust: tuple[float, float] = (0.0, 10.0)) -> None:
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"lr, eps, weight_decay must be >= 0, got {lr}, {eps}, "
                             f"{weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not 0.0 <= clamp_trust[0] <= clamp_trust[1]:
            raise ValueError("clamp_trust must be (low, high) with 0 <= low <= high, "
                             f"got {clamp_trust}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, clamp_trust=tuple(clamp_trust),
                        exclude_from_adaptation=False)
        super().__init__(params, defaults)

    def _update(self, group: dict[str, Any], ps: list[Tensor], gs: list[Tensor]) -> None:
        b1, b2 = group["betas"]
        states = [self.state[p] for p in ps]
        for p, st in zip(ps, states):
            if not st:  # same layout as torch.optim.Adam: a CPU float tensor ``step``
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        steps = [st["step"] for st in states]
        m = [st["exp_avg"] for st in states]
        v = [st["exp_avg_sq"] for st in states]
        torch._foreach_add_(steps, 1.0)
        torch._foreach_lerp_(m, gs, 1.0 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, gs, gs, value=1.0 - b2)
        denom = torch._foreach_sqrt(v)
        if group["bias_correction"]:
            n = [s.item() for s in steps]
            torch._foreach_div_(denom, [math.sqrt(1.0 - b2**k) for k in n])
            torch._foreach_add_(denom, group["eps"])
            upd = torch._foreach_div(m, denom)
            torch._foreach_div_(upd, [1.0 - b1**k for k in n])
        else:
            torch._foreach_add_(denom, group["eps"])
            upd = torch._foreach_div(m, denom)
        if group["weight_decay"] != 0.0:
            torch._foreach_add_(upd, ps, alpha=group["weight_decay"])
        if not group["exclude_from_adaptation"]:
            w_norm = torch.stack(torch._foreach_norm(ps))
            u_norm = torch.stack(torch._foreach_norm(upd))
            ok = (w_norm > 0) & (u_norm > 0)
            r = (w_norm / torch.where(ok, u_norm, 1.0)).clamp(*group["clamp_trust"])
            torch._foreach_mul_(upd, list(torch.where(ok, r, 1.0).unbind()))
        torch._foreach_add_(ps, upd, alpha=-float(group["lr"]))


class LARS(_LayerWise):
    """SGD-momentum with a layer-wise trust ratio (You et al. 2017), for large-batch training.

    Per tensor ``w`` with gradient ``g``: ``local_lr = trust_coefficient * ||w|| /
    (||g|| + weight_decay*||w|| + eps)``, or 1.0 when ``||w||`` or ``||g||`` is 0 or the group has
    ``exclude_from_adaptation=True``; ``d = (g + weight_decay*w) * local_lr``;
    ``b = momentum*b + d``; ``w -= lr * b`` (``lr * (d + momentum*b)`` with ``nesterov``).

    Args:
        params: Parameters or param-group dicts (see :func:`split_decay_groups`).
        lr: Global learning rate.
        momentum: Momentum factor (the buffer is kept, and checkpointed, even when 0).
        weight_decay: L2 penalty added to the gradient, inside the trust ratio.
        trust_coefficient: The paper's ``eta``, how far a layer may move relative to its norm.
        eps: Guards the trust-ratio denominator.
        nesterov: Nesterov momentum (needs ``momentum > 0``).
    """

    def __init__(self, params: _Params, lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001, eps: float = 1e-8,
                 nesterov: bool = False) -> None:
        if min(lr, momentum, weight_decay, eps) < 0.0:
            raise ValueError("lr, momentum, weight_decay, eps must be >= 0, got "
                             f"{lr}, {momentum}, {weight_decay}, {eps}")
        if trust_coefficient <= 0.0:
            raise ValueError(f"trust_coefficient must be > 0, got {trust_coefficient}")
        if nesterov and momentum <= 0.0:
            raise ValueError("nesterov=True needs momentum > 0")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov,
                        exclude_from_adaptation=False)
        super().__init__(params, defaults)

    def _update(self, group: dict[str, Any], ps: list[Tensor], gs: list[Tensor]) -> None:
        wd, mom = group["weight_decay"], group["momentum"]
        d = torch._foreach_add(gs, ps, alpha=wd) if wd != 0.0 else [g.clone() for g in gs]
        if not group["exclude_from_adaptation"]:
            w_norm = torch.stack(torch._foreach_norm(ps))
            g_norm = torch.stack(torch._foreach_norm(gs))
            local = group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm + group["eps"])
            ok = (w_norm > 0) & (g_norm > 0)
            torch._foreach_mul_(d, list(torch.where(ok, local, 1.0).unbind()))
        for p in ps:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        bufs = [self.state[p]["momentum_buffer"] for p in ps]
        torch._foreach_mul_(bufs, mom)
        torch._foreach_add_(bufs, d)
        if group["nesterov"]:
            torch._foreach_add_(d, bufs, alpha=mom)
        torch._foreach_add_(ps, d if group["nesterov"] else bufs, alpha=-float(group["lr"]))


def _check_schedule(warmup_steps: int, total_steps: int, decay: LRDecay, step_size: int,
                    gamma: float, min_lr_ratio: float) -> None:
    if not isinstance(decay, LRDecay):
        raise ValueError(f"decay must be an LRDecay ({', '.join(d.value for d in LRDecay)}), "
                         f"got {decay!r}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if total_steps < 0:
        raise ValueError(f"total_steps must be >= 0, got {total_steps}")
    if decay is LRDecay.COSINE and total_steps <= warmup_steps:
        raise ValueError(f"total_steps ({total_steps}) must be > warmup_steps ({warmup_steps}) "
                         "for cosine decay")
    if step_size <= 0:
        raise ValueError(f"step_size must be > 0, got {step_size}")
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, decay: LRDecay = LRDecay.NONE,
                  step_size: int = 1000, gamma: float = 0.1, min_lr_ratio: float = 0.0) -> float:
    """The factor on the base learning rate at 0-based ``step`` (what :func:`lr_schedule` applies).

    Args:
        step: 0-based step (the scheduler's ``last_epoch``).
        warmup_steps: Steps of linear warmup; step ``s < warmup_steps`` gives
            ``(s + 1) / warmup_steps``, so the factor reaches 1 on the last warmup step.
        total_steps: Length of the run; cosine decay reaches ``min_lr_ratio`` there and stays.
        decay: After warmup: ``NONE`` (1), ``COSINE`` (half cosine from 1 to ``min_lr_ratio``)
            or ``STEP`` (``gamma ** ((step - warmup_steps) // step_size)``).
        step_size: Steps between multiplications by ``gamma`` (``STEP`` decay).
        gamma: Factor per ``step_size`` steps (``STEP`` decay), in (0, 1].
        min_lr_ratio: Final factor of cosine decay, in [0, 1].

    Raises:
        ValueError: On a negative ``step`` or invalid schedule arguments; the message names the
            argument.
    """
    _check_schedule(warmup_steps, total_steps, decay, step_size, gamma, min_lr_ratio)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay is LRDecay.COSINE:
        progress = min(1.0, max(0.0, (step - warmup_steps) / (total_steps - warmup_steps)))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if decay is LRDecay.STEP:
        return gamma ** ((step - warmup_steps) // step_size)
    return 1.0


def lr_schedule(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                decay: LRDecay = LRDecay.NONE, step_size: int = 1000, gamma: float = 0.1,
                min_lr_ratio: float = 0.0) -> LambdaLR:
    """A ``LambdaLR`` applying :func:`lr_multiplier` to every param group of ``optimizer``.

    Call ``scheduler.step()`` once per optimizer step. Construction already sets the step-0 rate.
    The schedule's shape is not checkpointed (the lambda is a ``functools.partial`` whose
    arguments come from the config again on resume); ``state_dict()`` carries the counter
    ``last_epoch`` and base rates, so a loaded scheduler continues where the run stopped.

    Args:
        optimizer: Any ``torch.optim.Optimizer`` (also torchrec keyed optimizers).
        warmup_steps, total_steps, decay, step_size, gamma, min_lr_ratio: See :func:`lr_multiplier`.

    Raises:
        ValueError: On invalid schedule arguments.
    """
    _check_schedule(warmup_steps, total_steps, decay, step_size, gamma, min_lr_ratio)
    fn = functools.partial(lr_multiplier, warmup_steps=warmup_steps, total_steps=total_steps,
                           decay=decay, step_size=step_size, gamma=gamma,
                           min_lr_ratio=min_lr_ratio)
    return LambdaLR(optimizer, fn)
