"""FBGEMM's CPU table step over torch's intra-op threads.

``fbgemm-gpu-cpu``'s wheel is built without OpenMP, so the ``at::parallel_for`` loops in its CPU
operators run on the calling thread: a TBE's forward and its backward with the fused row-wise
Adagrad use one core, however many threads torch has (``getrusage``: CPU time / wall 1.00 with 2
intra-op threads; no ``GOMP_*`` symbol in its libraries). On a CPU run the other cores wait for
the table step (on 2 cores, half the machine for the largest part of a CTR step).

:func:`install` wraps FBGEMM's row-wise Adagrad lookup (the optimizer embedtrain gives its fused
tables) on a CPU TBE:

- the forward is FBGEMM's own operator (``split_embedding_codegen_forward_cpu``), called once
  on all features as FBGEMM's autograd function calls it. Cut into runs on threads it was
  slower (its JIT kernel prefetches rows; the large config's forward took 14.5-18.1 ms instead
  of 10.5-11.2, its outputs joined by a copy, and the backward after it slowed too);
- the backward with the fused update (``split_embedding_backward_codegen_rowwise_adagrad_cpu``,
  the larger part: sorting each table's ids, summing their gradients, the Adagrad step) runs on
  up to ``torch.get_num_threads()`` contiguous runs of whole tables with about equal lookups,
  each in a worker thread of its own (the operator releases the GIL), on its run's indices and
  offsets (slices) and the whole weights, momentum and output gradient (the run's column
  offsets index into them).

Runs hold distinct tables, so their updates write distinct rows, and each table's arithmetic is
the one FBGEMM does for it: the pooled rows, weights and Adagrad state are bit for bit FBGEMM's
own (``tests/test_fbgemm_threads.py``). Each worker's OpenMP team is the worker alone (the
operator sorts ids with torch's FBGEMM ``radix_sort_parallel``, an OpenMP region; a team per
worker put twice the cores' threads on the machine: the demo's backward took 9.6 ms instead of
5.0).

Everything else takes FBGEMM's own path, unchanged: GPU tables, one thread, a TBE of one table,
weighted (per-sample) ids, variable batch sizes, fp16 weights or outputs, gradient clipping,
global weight decay, ``torch.compile`` / ``torch.export``. ``EMBEDTRAIN_TBE_THREADS=1`` turns it
off (``embedtrain doctor`` says which is in use).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

ENV = "EMBEDTRAIN_TBE_THREADS"

_lock = threading.Lock()
_pool: Optional[ThreadPoolExecutor] = None
_original: Any = None  # FBGEMM's invoke, once wrapped


def max_threads() -> int:
    """The threads a TBE step may use: torch's intra-op threads, or ``EMBEDTRAIN_TBE_THREADS``
    (a positive integer; 1: FBGEMM's own single-thread path)."""
    import torch

    value = os.environ.get(ENV, "").strip()
    if not value:
        return torch.get_num_threads()
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENV}={value!r}: expected a positive integer")
    return int(value)


def _one_openmp_thread() -> None:
    """A worker's OpenMP team is itself: the operators it calls open parallel regions (torch's
    FBGEMM sorts the ids in ``radix_sort_parallel``), and a team per worker would put more
    threads than cores on the machine, spinning after each region. ``omp_set_num_threads``
    from a thread sets that thread's own team size only (torch's own threads keep theirs)."""
    import ctypes

    import torch

    torch.get_num_threads()  # torch's per-thread set-up first, or it would reset the size
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "omp" in line.rsplit("/", 1)[-1]}
    for lib in sorted(libs):
        try:
            ctypes.CDLL(lib, mode=os.RTLD_NOLOAD).omp_set_num_threads(1)
        except (OSError, AttributeError):
            continue


def _forget_pool() -> None:
    """In a forked child: the parent's worker threads do not exist there (a pool that still
    counts them would never run a call)."""
    global _pool
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool._max_workers < workers:  # noqa: SLF001
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="embedtrain-tbe",
                                       initializer=_one_openmp_thread)
        return _pool


def split_features(lookups: list[int], table_starts: list[bool], parts: int) -> list[int]:
    """Cuts features ``0..T-1`` into at most ``parts`` contiguous runs of about equal lookups,
    only where a table starts; returns the cut points ``[0, c1, ..., T]``.

    Args:
        lookups: ids looked up per feature.
        table_starts: per feature, whether a table starts there (``table_starts[0]`` is true).
        parts: runs wanted.

    >>> split_features([4, 4, 4, 4], [True] * 4, 2)
    [0, 2, 4]
    >>> split_features([9, 1, 1, 1], [True] * 4, 2)
    [0, 1, 4]
    >>> split_features([4, 4, 4, 4], [True, False, False, False], 2)
    [0, 4]
    """
    prefix = [0]
    for n in lookups:
        prefix.append(prefix[-1] + n)
    total, starts = prefix[-1], [f for f in range(1, len(lookups)) if table_starts[f]]
    cuts = [0]
    for i in range(1, parts):
        # the table start nearest to an i-th of the lookups, leaving no run without ids
        later = [f for f in starts if f > cuts[-1] and prefix[cuts[-1]] < prefix[f] < total]
        if later:
            cuts.append(min(later, key=lambda f: abs(prefix[f] - total * i / parts)))
    return cuts + [len(lookups)]


_PLAIN = ()  # torch.Tensor and nn.Parameter, once torch is imported


def _runs(common_args: Any, momentum1: Any,
          threads: int) -> Optional[tuple[list[tuple[int, int]], int, list[int]]]:
    """The feature runs a step is cut into, the batch size and the features' first ids; ``None``
    where FBGEMM's own path applies."""
    import torch

    global _PLAIN
    _PLAIN = _PLAIN or (torch.Tensor, torch.nn.Parameter)
    a = common_args
    if (threads < 2 or a.host_weights.numel() == 0 or a.host_weights.dtype != torch.float32
            or a.indice_weights is not None or a.vbe_metadata.B_offsets is not None
            or a.output_dtype != 0 or a.pooling_mode == 2 or momentum1 is None
            or torch.compiler.is_compiling() or not torch.is_grad_enabled()
            or not a.placeholder_autograd_tensor.requires_grad
            or any(type(t) not in _PLAIN or t.device.type != "cpu"  # fake, traced
                   for t in (a.host_weights, a.indices, a.offsets))):
        return None
    features = a.D_offsets.numel() - 1
    if features < 2:
        return None
    batch = (a.offsets.numel() - 1) // features
    bounds = a.offsets[::batch].tolist() if batch > 0 else []
    if len(bounds) != features + 1:
        return None
    hashes = a.hash_size_cumsum.tolist()
    starts = [f == 0 or hashes[f] != hashes[f - 1] for f in range(features)]
    # each table's features adjacent (FBGEMM's own grouping); else runs could share rows
    offsets = a.weights_offsets.tolist()
    tables = [offsets[f] for f in range(features) if starts[f]]
    if len(set(tables)) != len(tables):
        return None
    cuts = split_features([bounds[f + 1] - bounds[f] for f in range(features)], starts, threads)
    if len(cuts) < 3:
        return None
    return [(cuts[i], cuts[i + 1]) for i in range(len(cuts) - 1)], batch, bounds


def _run_all(calls: list[Any]) -> list[Any]:
    """Runs ``calls`` (no-argument functions) each in a worker thread of its own (whose OpenMP
    team is itself) and returns their results in order; an error raised in any is raised here."""
    pool = _executor(len(calls))
    return [f.result() for f in [pool.submit(c) for c in calls]]


class _Lookup:
    """The per-run arguments of one step (built in the calling thread: slices and small
    tensors; the worker threads only call FBGEMM's operators)."""

    def __init__(self, common_args: Any, optimizer_args: Any, momentum1: Any,
                 runs: list[tuple[int, int]], batch: int, bounds: list[int]) -> None:
        a = common_args
        self.a, self.opt, self.m = a, optimizer_args, momentum1
        self.runs = []
        for f0, f1 in runs:
            i0, i1 = bounds[f0], bounds[f1]
            self.runs.append({
                "features": (f0, f1),
                "indices": a.indices[i0:i1],
                "offsets": a.offsets[f0 * batch:f1 * batch + 1] - i0,
                "weights_offsets": a.weights_offsets[f0:f1],
                "D_offsets": a.D_offsets[f0:f1 + 1],
                "hash_size_cumsum": a.hash_size_cumsum[f0:f1 + 1]})

    def forward(self) -> Any:
        import torch

        a = self.a
        return torch.ops.fbgemm.split_embedding_codegen_forward_cpu(
            a.host_weights, a.weights_offsets, a.D_offsets, a.total_D, a.hash_size_cumsum,
            a.indices, a.offsets, a.pooling_mode, None, a.output_dtype)

    def backward(self, grad_output: Any) -> None:
        import torch

        a, opt, m = self.a, self.opt, self.m
        op = torch.ops.fbgemm.split_embedding_backward_codegen_rowwise_adagrad_cpu
        grad_output = grad_output.contiguous()

        def one(r: dict[str, Any]) -> Any:
            f0, f1 = r["features"]
            return lambda: op(
                grad_output, a.host_weights, a.weights_placements[f0:f1], r["weights_offsets"],
                r["D_offsets"], a.max_D, r["hash_size_cumsum"], a.total_hash_size_bits,
                r["indices"], r["offsets"], a.pooling_mode, None, opt.stochastic_rounding,
                m.host, m.placements[f0:f1], m.offsets[f0:f1], a.learning_rate_tensor,
                eps=opt.eps, weight_decay=opt.weight_decay,
                weight_decay_mode=opt.weight_decay_mode, max_norm=opt.max_norm,
                output_dtype=a.output_dtype)

        _run_all([one(r) for r in self.runs])


def _function() -> Any:
    import torch

    class ThreadedRowwiseAdagrad(torch.autograd.Function):
        """Forward: the pooled rows; backward: the fused update (no gradient is returned: the
        update is applied, as FBGEMM's own function does)."""

        @staticmethod
        def forward(ctx: Any, placeholder: Any, lookup: _Lookup) -> Any:
            ctx.lookup = lookup
            return lookup.forward()

        @staticmethod
        def backward(ctx: Any, grad_output: Any) -> tuple[None, None]:
            ctx.lookup.backward(grad_output)
            return None, None

    return ThreadedRowwiseAdagrad


_FUNCTION: Any = None


def _invoke(common_args: Any, optimizer_args: Any, momentum1: Any, iter: int = 0,
            apply_global_weight_decay: bool = False, prev_iter_dev: Any = None,
            gwd_lower_bound: float = 0.0, mixed_D: bool = True) -> Any:
    """FBGEMM's ``lookup_rowwise_adagrad.invoke``, over threads where :func:`_runs` allows."""
    global _FUNCTION
    plain = (not apply_global_weight_decay and prev_iter_dev is None
             and not optimizer_args.gradient_clipping)
    cut = _runs(common_args, momentum1, max_threads()) if plain else None
    if cut is None:
        return _original(common_args, optimizer_args, momentum1, iter=iter,
                         apply_global_weight_decay=apply_global_weight_decay,
                         prev_iter_dev=prev_iter_dev, gwd_lower_bound=gwd_lower_bound,
                         mixed_D=mixed_D)
    lookup = _Lookup(common_args, optimizer_args, momentum1, *cut)
    if _FUNCTION is None:
        _FUNCTION = _function()
    return _FUNCTION.apply(common_args.placeholder_autograd_tensor, lookup)


def install() -> None:
    """Wraps FBGEMM's row-wise Adagrad invoker (once; imports ``fbgemm_gpu``).

    Raises:
        ValueError: ``EMBEDTRAIN_TBE_THREADS`` set to something else than a positive integer.
    """
    global _original
    max_threads()  # a bad EMBEDTRAIN_TBE_THREADS is said before training, not at its first step
    from fbgemm_gpu.split_embedding_codegen_lookup_invokers import lookup_rowwise_adagrad

    with _lock:
        if _original is None:
            _original = lookup_rowwise_adagrad.invoke
            lookup_rowwise_adagrad.invoke = _invoke


def describe(threads: int) -> str:
    """One line for ``embedtrain doctor``: how a CPU table step of a rank with ``threads``
    intra-op threads runs (``EMBEDTRAIN_TBE_THREADS``, where set, decides)."""
    if os.environ.get(ENV, "").strip():
        threads = max_threads()
    if threads < 2:
        return "FBGEMM's own, one thread"
    return (f"forward FBGEMM's own; backward + fused update over up to {threads} threads, "
            f"one run of tables each")
