"""Optimizers: sparse ones fused into the embedding backward (FBGEMM), dense ones as usual.

Embedding tables are updated inside their backward pass by FBGEMM's table-batched kernels
(``apply_optimizer_in_backward`` before ``DistributedModelParallel``), so a table's gradient is
never materialised. Dense parameters get an ordinary ``torch.optim`` optimizer. Both are combined
into one keyed optimizer whose ``state_dict`` checkpoints through DCP.

Example:
    >>> fuse_sparse_optimizer(model, SparseOptimizer.ROWWISE_ADAGRAD, lr=0.05)
    >>> dmp = DistributedModelParallel(model, device=torch.device("cpu"))
    >>> opt, dense = combined_optimizer(dmp, dense_optimizer_factory(DenseOptimizer.LAMB, lr=2e-3))
    >>> schedule = dense_lr_schedule(dense, total_steps=10_000, warmup_steps=100)
"""

from __future__ import annotations

from typing import Callable, Collection, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from embedtrain.heads.low_precision import round_rows
from embedtrain.models.options import Rounding
from embedtrain.sharding.types import DenseAllReduce
from embedtrain.train.options import DenseOptimizer, HeadOptimizer, LRDecay, SparseOptimizer

_SPARSE = {
    SparseOptimizer.ROWWISE_ADAGRAD: RowWiseAdagrad,
    SparseOptimizer.ADAGRAD: torch.optim.Adagrad,
    SparseOptimizer.SGD: torch.optim.SGD,
    SparseOptimizer.ADAM: torch.optim.Adam,
}


def dense_optimizer_slots(kind: DenseOptimizer) -> int:
    """Values of optimizer state per dense parameter (for memory planning)."""
    return {DenseOptimizer.ADAM: 2, DenseOptimizer.ADAGRAD: 1, DenseOptimizer.SGD: 1,
            DenseOptimizer.LAMB: 2, DenseOptimizer.LARS: 1}[kind]


def fuse_sparse_optimizer(model: nn.Module, kind: SparseOptimizer, lr: float) -> int:
    """Marks every embedding table of ``model`` for an optimizer fused into its backward.

    Call before wrapping with ``DistributedModelParallel``, which turns the mark into FBGEMM's
    fused kernel. Returns the number of tables marked.
    """
    tables = [
        p
        for m in model.modules()
        if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
        for p in m.parameters()
    ]
    if tables:
        apply_optimizer_in_backward(_SPARSE[kind], tables, {"lr": lr})
    return len(tables)


def dense_optimizer_factory(kind: DenseOptimizer, lr: float, weight_decay: float = 0.0,
                            momentum: float = 0.9
                            ) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """Builds ``kind`` over a list of parameters (what ``KeyedOptimizerWrapper`` calls).

    ``momentum`` applies to SGD and LARS. LAMB and LARS leave 1-D parameters (biases) out of
    weight decay and of the trust ratio, as the large-batch papers do.
    """
    wd = weight_decay
    if kind is DenseOptimizer.ADAM:
        return lambda params: torch.optim.Adam(params, lr=lr, weight_decay=wd)
    if kind is DenseOptimizer.ADAGRAD:
        return lambda params: torch.optim.Adagrad(params, lr=lr, weight_decay=wd)
    if kind is DenseOptimizer.SGD:
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=wd)
    from embedtrain.train import large_batch

    def groups(params: list[torch.Tensor]) -> list[dict]:
        matrices = [p for p in params if p.dim() > 1]
        vectors = [p for p in params if p.dim() <= 1]
        out = [{"params": matrices}] if matrices else []
        if vectors:
            out.append({"params": vectors, "weight_decay": 0.0, "exclude_from_adaptation": True})
        return out

    if kind is DenseOptimizer.LAMB:
        return lambda params: large_batch.LAMB(groups(params), lr=lr, weight_decay=wd)
    return lambda params: large_batch.LARS(groups(params), lr=lr, momentum=momentum,
                                           weight_decay=wd)


def combined_optimizer(
    model: DistributedModelParallel,
    dense_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    exclude: Collection[str] = (), extra: Sequence[tuple[str, KeyedOptimizer]] = (),
) -> tuple[CombinedOptimizer, KeyedOptimizerWrapper]:
    """The sharded model's fused sparse optimizer plus a dense one over the dense parameters.

    Args:
        model: the sharded model.
        dense_factory: builds the dense optimizer over a list of parameters
            (:func:`dense_optimizer_factory`).
        exclude: parameter names the dense optimizer leaves to one of ``extra``.
        extra: more ``(name, optimizer)`` pairs (e.g. a sharded class head's).

    Returns:
        The combined optimizer (what the trainer steps and checkpoints) and its dense part (what
        the learning-rate schedule drives).
    """
    dense = {k: p for k, p in in_backward_optimizer_filter(model.named_parameters(), include=False)
             if k not in exclude}
    dense_opt = KeyedOptimizerWrapper(dense, dense_factory)
    combined = CombinedOptimizer([("sparse", model.fused_optimizer), ("dense", dense_opt),
                                  *extra])
    return combined, dense_opt


_ROW_CHUNK = 8192  # rows updated at once by the fused sparse Adagrad (fits in the caches)


@torch.no_grad()
def sparse_adagrad_rows_(param: torch.Tensor, state_sum: torch.Tensor, rows: torch.Tensor,
                         grad: torch.Tensor, lr: float, eps: float) -> None:
    """Adagrad on ``rows`` of ``param`` only: gather, update, scatter, a chunk of rows at a time.

    The math of ``torch.optim.Adagrad``'s sparse step (``sum[rows] += g^2``, ``param[rows] -=
    lr * g / (sqrt(sum[rows]) + eps)``) without its sparse-tensor work (``coalesce``,
    ``sparse_mask``, sparse adds over the whole tensor). ``rows`` must be distinct.
    """
    for start in range(0, rows.numel(), _ROW_CHUNK):
        r, g = rows[start:start + _ROW_CHUNK], grad[start:start + _ROW_CHUNK]
        state_sum.index_add_(0, r, g.pow(2))
        s = state_sum.index_select(0, r).sqrt_().add_(eps)
        # param[rows] + (-lr) * (g / std) as torch's dense add computes it (index_add_ with an
        # alpha takes ~5x as long as this gather, add and copy)
        param.index_copy_(0, r, param.index_select(0, r).add_(torch.div(g, s, out=s), alpha=-lr))


def _closure_loss(closure):
    """What ``Optimizer.step``'s optional closure returns (it re-evaluates the loss)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _sparse_rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, values)`` of a sparse row gradient, coalesced unless its rows already increase."""
    rows, values = grad._indices()[0], grad._values()
    if not (grad.is_coalesced() or bool((rows[1:] > rows[:-1]).all())):
        grad = grad.coalesce()
        rows, values = grad._indices()[0], grad._values()
    return rows, values


class RowSparseAdagrad(torch.optim.Adagrad):
    """``torch.optim.Adagrad`` whose sparse gradients are applied row by row
    (:func:`sparse_adagrad_rows_`); dense gradients take torch's own step.

    The state (``step``, ``sum``) is torch's, so checkpoints load in either. A sparse gradient
    whose rows are strictly increasing (the sampled heads': their sorted sample) is taken as it
    is; another one is coalesced first. Weight decay and ``maximize`` with a sparse gradient
    are left to torch's step, which refuses them.
    """

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - see the class docstring
        loss = _closure_loss(closure)
        held = []
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is None or not grad.is_sparse:
                    continue
                if group["weight_decay"] or group["maximize"] or grad.sparse_dim() != 1:
                    continue  # torch's step (which refuses the first two)
                rows, values = _sparse_rows(grad)
                state = self.state[p]
                state["step"] += 1
                clr = group["lr"] / (1 + (float(state["step"]) - 1) * group["lr_decay"])
                sparse_adagrad_rows_(p, state["sum"], rows, values, clr, group["eps"])
                held.append((p, grad))
                p.grad = None  # torch's step below skips it
        try:
            super().step()
        finally:
            for p, grad in held:
                p.grad = grad
        return loss


@torch.no_grad()
def rowwise_adagrad_rows_(param: torch.Tensor, state_sum: torch.Tensor, rows: torch.Tensor,
                          grad: torch.Tensor, lr: float, eps: float, rounding: Rounding,
                          seed: int, step: int, row_offset: int,
                          columns: Optional[torch.Tensor] = None) -> None:
    """Row-wise Adagrad on ``rows`` of ``param`` (distinct): FBGEMM's rule for tables.

    ``sum[r] += mean(g_r^2)``, ``param[r] -= lr * g_r / (sqrt(sum[r]) + eps)``, in float32 a
    chunk of rows at a time; a low-precision ``param`` gets the new rows rounded back by
    ``rounding`` (:func:`~embedtrain.heads.low_precision.round_rows`, keyed by ``seed``,
    ``step`` and the global row ``row_offset + r``). With ``columns`` (a ``[D]`` profile of
    mean 1), the row's accumulator is spread over its coordinates as Adafactor factors a second
    moment: ``param[r, j] -= lr * g_rj / (sqrt(sum[r] * columns[j]) + eps)``.
    """
    for start in range(0, rows.numel(), _ROW_CHUNK):
        r, g = rows[start:start + _ROW_CHUNK], grad[start:start + _ROW_CHUNK].float()
        state_sum.index_add_(0, r, g.pow(2).mean(dim=1))
        s = state_sum.index_select(0, r)[:, None]
        s = (s if columns is None else s * columns).sqrt_().add_(eps)
        new = param.index_select(0, r).float().add_(g / s, alpha=-lr)
        # index_put_, not index_copy_: CPU has no index_copy_ for float8
        param.index_put_((r,), round_rows(new, r + row_offset, param.dtype, rounding, seed, step))


@torch.no_grad()
def column_profile_(state_cols: torch.Tensor, grad: Optional[torch.Tensor],
                    group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Adds the step's column sums of squares (``grad``'s, summed over the head's ranks) to
    ``state_cols [D]`` and returns them as a profile of mean 1 (all ones before any gradient).

    Every rank of ``group`` calls it every step, with ``grad=None`` where it has none.
    """
    step = torch.zeros_like(state_cols)
    for start in range(0, 0 if grad is None else grad.shape[0], _ROW_CHUNK):
        step += grad[start:start + _ROW_CHUNK].float().pow(2).sum(dim=0)
    if dist.is_initialized() and dist.get_world_size(group) > 1:  # None: the default group
        dist.all_reduce(step, group=group)
    state_cols += step
    mean = state_cols.mean()
    return state_cols / mean if mean > 0 else torch.ones_like(state_cols)


class HeadRowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad for class heads: one float32 accumulator per row, whatever the weights'
    dtype, and low-precision rows rounded back by ``rounding`` (:func:`rowwise_adagrad_rows_`).

    Takes a sparse row gradient (the sampled heads'), a dense one (all rows), or, first, a
    parameter's ``main_grad``: the float32 gradient a low-precision head's rows leave there
    (autograd would cast a gradient to the parameter's dtype;
    :func:`~embedtrain.heads.ops.gather_rows` bypasses it, as Megatron-LM's bf16
    parameters keep theirs). The state (``step``, ``sum [rows]``) is made up front, so a
    checkpoint loads in place; ``step`` counts every ``step()``, and keys the rounding's bits.

    Args:
        params: the head's row slices.
        lr, eps: as ``torch.optim.Adagrad``'s.
        rounding: ``stochastic`` or ``nearest`` (low-precision rows only).
        seed, row_offset: the rounding's key: the run's seed, and the global row of row 0.
    """

    row_state_bytes = 4  # the planner's count of its state: one float32 a row
    factored = False  # HeadFactoredAdagrad: a column profile beside the rows' accumulators

    def __init__(self, params, lr: float = 0.05, eps: float = 1e-10,
                 rounding: str = Rounding.STOCHASTIC.value, seed: int = 0,
                 row_offset: int = 0, group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__(params, dict(lr=lr, eps=eps, rounding=Rounding(rounding).value,
                                      seed=seed, row_offset=row_offset))
        self.group = group
        for group_ in self.param_groups:
            for p in group_["params"]:
                self.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                 "sum": torch.zeros(p.shape[0], dtype=torch.float32,
                                                    device=p.device)}
                if self.factored:
                    self.state[p]["columns"] = torch.zeros(p.shape[1], dtype=torch.float32,
                                                           device=p.device)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - see the class docstring
        loss = _closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] += 1
                grad = getattr(p, "main_grad", None)
                grad = p.grad if grad is None else grad
                rows = values = columns = None
                if grad is not None and grad.is_sparse:
                    rows, values = _sparse_rows(grad)
                elif grad is not None:
                    rows, values = torch.arange(p.shape[0], device=p.device), grad
                if "columns" in state:
                    columns = column_profile_(state["columns"], values, self.group)
                if grad is not None:
                    rowwise_adagrad_rows_(p, state["sum"], rows, values, group["lr"],
                                          group["eps"], Rounding(group["rounding"]),
                                          group["seed"], int(state["step"]),
                                          group["row_offset"], columns)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=True)
        for group in self.param_groups:
            for p in group["params"]:
                p.main_grad = None


class HeadFactoredAdagrad(HeadRowWiseAdagrad):
    """Row-wise Adagrad with a column profile: Adafactor's factoring of the second moment.

    A class row's gradient is a sum of ``error x feature`` outer products, so its accumulated
    squares are close to rank one: ``V[r, j] ~ sum[r] * columns[j]``, with ``sum`` row-wise
    Adagrad's (one float32 a row) and ``columns`` the ``[D]`` column sums of squares over every
    updated row of every rank (one ``D``-float all-reduce a step), as a profile of mean 1. It
    gives each coordinate its own step size, as full Adagrad does, for ``C + D`` floats of
    state instead of ``C x D``.
    """

    factored = True


def head_optimizer_class(kind: HeadOptimizer) -> type[torch.optim.Optimizer]:
    """The torch optimizer of a sharded class head (all take sparse gradients)."""
    return {HeadOptimizer.ADAGRAD: RowSparseAdagrad, HeadOptimizer.SGD: torch.optim.SGD,
            HeadOptimizer.ROWWISE_ADAGRAD: HeadRowWiseAdagrad,
            HeadOptimizer.FACTORED_ADAGRAD: HeadFactoredAdagrad}[kind]


def _by_row(name: str, value, param: torch.Tensor) -> bool:
    """Whether an optimizer state value is split by rows as ``param`` is (``columns``, one
    value a coordinate and the same on every rank, is not, whatever its length)."""
    return name != "columns" and isinstance(value, torch.Tensor) and (
        value.shape == param.shape or value.shape == param.shape[:1])


class ShardedRowsOptimizer(KeyedOptimizerWrapper):
    """A keyed optimizer over parameters that are row slices of a bigger tensor (class heads).

    The optimizer runs on the local slices. Seen through ``state`` (hence in ``state_dict``),
    every state tensor shaped like its parameter, or one value per row (row-wise Adagrad's
    ``sum``), is a ``DTensor`` (``Shard(0)``) sharing the
    local tensor's storage: DCP writes each rank's rows once, reshards them on load, and loading
    copies straight into the optimizer's own tensors.

    Args:
        params: name -> local slice.
        optimizer_factory: builds the torch optimizer over the slices.
        num_rows: name -> rows of the whole tensor.
        group: ranks sharing the slices.
    """

    def __init__(self, params: dict[str, torch.Tensor], optimizer_factory: Callable,
                 num_rows: dict[str, int], group: Optional[dist.ProcessGroup] = None) -> None:
        self._num_rows, self._group = num_rows, group
        super().__init__(params, optimizer_factory)

    @property
    def state(self):  # noqa: D102 - see the class docstring
        raw = self.__dict__["_local_state"]
        if not dist.is_initialized():
            return raw
        from embedtrain.heads.sharded import rows_as_dtensor

        names = {p: k for k, p in self.params.items()}
        return {p: {n: rows_as_dtensor(v, self._num_rows[names[p]], self._group)
                    if _by_row(n, v, p) else v for n, v in st.items()}
                for p, st in raw.items()}

    @state.setter
    def state(self, value) -> None:
        self.__dict__["_local_state"] = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Always to None: a zeroed gradient kept from one step to the next would turn the
        # sampled heads' sparse gradients dense (zeros + sparse = dense), and with them the
        # optimizer step over every row.
        self._optimizer.zero_grad(set_to_none=True)

    def init_state(self, sparse_grad_parameter_names=None) -> None:
        # The heads' optimizers make their state up front (Adagrad, row-wise Adagrad) or have
        # none (SGD without momentum): KeyedOptimizer's dummy step would only allocate a dense
        # zero gradient the size of the slice (and count a step).
        if isinstance(self._optimizer, (torch.optim.Adagrad, HeadRowWiseAdagrad, torch.optim.SGD)):
            return
        super().init_state(sparse_grad_parameter_names)
        self.zero_grad()


def sharded_head_optimizer(head: nn.Module, kind: HeadOptimizer, lr: float,
                           prefix: str = "") -> ShardedRowsOptimizer:
    """The optimizer (``kind`` at ``lr``) of a model-parallel class head's slice.

    Sampled heads produce sparse gradients: Adagrad and SGD then touch only the sampled rows
    (SGD without momentum; Adagrad's accumulator stays put for rows without gradient).
    """
    cls = head_optimizer_class(kind)
    params = {prefix + n: p for n, p in head.named_parameters()}
    kwargs: dict = {"lr": lr}
    if issubclass(cls, HeadRowWiseAdagrad):
        kwargs.update(rounding=head.rounding.value, seed=head.seed, row_offset=head.start,
                      group=head.group)
    else:
        kwargs["foreach"] = False
    return ShardedRowsOptimizer(params, lambda ps: cls(ps, **kwargs),
                                {k: head.num_classes for k in params}, head.group)


def dense_lr_schedule(dense: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                      decay: LRDecay = LRDecay.NONE, step_size: int = 1000, gamma: float = 0.1,
                      min_lr_ratio: float = 0.0) -> Optional[torch.optim.lr_scheduler.LambdaLR]:
    """Linear warmup then cosine/step decay of the dense learning rate (None: constant).

    Arguments as :func:`embedtrain.train.large_batch.lr_multiplier`'s.
    """
    if warmup_steps == 0 and decay is LRDecay.NONE:
        return None
    from embedtrain.train.large_batch import lr_schedule

    return lr_schedule(dense, warmup_steps=warmup_steps, total_steps=max(total_steps, 1),
                       decay=decay, step_size=step_size, gamma=gamma, min_lr_ratio=min_lr_ratio)


def compressed_allreduce_hook(dtype: torch.dtype):
    """A DDP hook all-reducing each gradient bucket in ``dtype`` (half the bytes of fp32).

    The same as ``torch``'s ``bf16_compress_hook`` / ``fp16_compress_hook``, which refuse to run
    without CUDA/NCCL; this one also runs on gloo (CPU).
    """

    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(group.size())
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut):
            buffer.copy_(fut.value()[0])
            return buffer

        return future.then(decompress)

    return hook


def register_dense_allreduce(model: nn.Module, mode: DenseAllReduce, powersgd_rank: int = 2) -> int:
    """Installs a DDP communication hook compressing the dense gradients' all-reduce.

    ``DistributedModelParallel`` wraps the dense part in ``DistributedDataParallel``; its
    all-reduce is what a slow inter-host link pays for every step. Returns the number of DDP
    modules hooked (0 in a world of one, where there is nothing to reduce).
    """
    if mode is DenseAllReduce.FP32:
        return 0
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    hooked, group = 0, None
    for module in model.modules():
        if not isinstance(module, DistributedDataParallel):
            continue
        if mode in (DenseAllReduce.BF16, DenseAllReduce.FP16):
            dtype = torch.bfloat16 if mode is DenseAllReduce.BF16 else torch.float16
            module.register_comm_hook(None, compressed_allreduce_hook(dtype))
        else:
            # PowerSGD issues its second all-reduce from the first one's completion callback,
            # on gloo's thread, while backward goes on to TorchRec's all-to-alls: on the one
            # default group the two ranks could issue them in different orders and hang (seen
            # in CI). Its own group keeps the two streams of collectives apart.
            group = group or dist.new_group(backend=dist.get_backend())
            state = powerSGD_hook.PowerSGDState(process_group=group,
                                                matrix_approximation_rank=powersgd_rank,
                                                start_powerSGD_iter=2)
            module.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        hooked += 1
    return hooked
