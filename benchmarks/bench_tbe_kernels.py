"""FBGEMM's CPU table kernels against torch's primitives on the same rows (the random-row floor).

``bench_roofline.py`` puts the large-table step at ~0.27 of this machine's random-row floor
(``index_select`` of the looked-up rows + ``index_add_`` into the distinct rows' weights and
row-wise Adagrad state). Its own parts (input and output dist, the rest of the backward) are
~1.3 ms of a ~23 ms step; the rest is FBGEMM's two CPU operators. This benchmark measures them
one by one, on one FBGEMM TBE of the roofline's large config (``--tables`` x ``--rows`` x
``--dim`` fp32, batch ``--batch``, one Zipf(``--zipf``) id per table per example, the hot rows
scattered by a permutation per table: ``bench_roofline._zipf_kjts``), the kinds alternating
within each of ``--rounds`` rounds, medians over every round's ``--steps`` calls:

- ``forward``: ``split_embedding_codegen_forward_cpu`` on all tables, after another forward
  (``after forward``) and after a backward with the fused update (``after backward``, as in
  training: the update's writes and the gradient's reads stand between two forwards);
- ``index_select``: the same rows, gathered by ``torch.index_select`` on one thread and on all
  of torch's threads (the floor's gather);
- ``backward + update``: ``split_embedding_backward_codegen_rowwise_adagrad_cpu`` one table at a
  time on one thread (the CPU wheel runs it on one thread; ``embedtrain.fbgemm_threads`` runs
  runs of tables side by side), summed over the tables;
- ``index_add``: ``index_add_`` (of zeros) into each table's distinct rows' weights and their
  momentum, one thread and all threads (the floor's update);
- ``torch update``: the same fused row-wise Adagrad composed of torch operators (distinct rows
  by ``torch.unique``, their gradients by ``index_add_``, momentum and weights updated by
  ``index_select`` / ``index_copy_`` / ``index_add_``) on all threads; its result is checked
  against FBGEMM's (``max_rel_diff``: summation order only).

Usage: python benchmarks/bench_tbe_kernels.py --json benchmarks/out/tbe_kernels.json
    [--rounds 3] [--steps 12] [--tables 8] [--rows 1048576] [--dim 128] [--batch 8192]
Prints a table (median ms a step, all tables) and writes the JSON (``ms[kind]``, the counts,
``max_rel_diff``). About 4.5 GiB of rows; ~2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

# embedtrain's allocator settings before torch, and embedtrain (its FBGEMM CPU kernel binding,
# embedtrain.fbgemm_cpu) before fbgemm_gpu: as bench_roofline and every embedtrain process
from bench_roofline import _zipf_kjts, torch


class Tables:
    """One FBGEMM TBE (row-wise Adagrad, CPU) and what its kernels are called with."""

    def __init__(self, args: argparse.Namespace) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, EmbeddingLocation, SplitTableBatchedEmbeddingBagsCodegen)

        self.t, self.rows, self.d, self.b = args.tables, args.rows, args.dim, args.batch
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(self.rows, self.d, EmbeddingLocation.HOST, ComputeDevice.CPU)] * self.t,
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01, eps=1e-8)
        self.weights = self.tbe.weights_host.detach()
        self.momentum = self.tbe.momentum1_host.detach()
        self.ids = [kjt.values() for kjt in _zipf_kjts(self.t, self.rows, self.b, 1, args.zipf,
                                                       args.inputs)]
        self.offsets = torch.arange(self.t * self.b + 1, dtype=torch.int64)
        self.grad = torch.randn(self.b, self.t * self.d, generator=torch.Generator().manual_seed(1))
        # the rows of the flat weights, per input: looked up, and distinct per table
        base = torch.arange(self.t).repeat_interleave(self.b) * self.rows
        self.looked_up = [ids + base for ids in self.ids]
        self.distinct = [[r[i * self.b:(i + 1) * self.b].unique() for i in range(self.t)]
                         for r in self.looked_up]
        # the floor's update adds zeros made beforehand (its traffic is the rows' alone)
        self.zeros = [[(torch.zeros(u.numel(), self.d), torch.zeros(u.numel())) for u in d]
                      for d in self.distinct]

    def forward(self, i: int) -> Any:
        m = self.tbe
        return torch.ops.fbgemm.split_embedding_codegen_forward_cpu(
            m.weights_host, m.weights_offsets, m.D_offsets, self.t * self.d, m.hash_size_cumsum,
            self.ids[i], self.offsets, 0, None, 0)

    def backward(self, i: int, tables: range) -> None:
        """FBGEMM's backward with the fused update, one call per table in ``tables``."""
        m, op = self.tbe, torch.ops.fbgemm.split_embedding_backward_codegen_rowwise_adagrad_cpu
        for t in tables:
            lo = t * self.b
            op(self.grad, m.weights_host, m.weights_placements[t:t + 1],
               m.weights_offsets[t:t + 1], m.D_offsets[t:t + 2], self.d,
               m.hash_size_cumsum[t:t + 2], m.total_hash_size_bits,
               self.ids[i][lo:lo + self.b], self.offsets[lo:lo + self.b + 1] - lo, 0, None,
               False, m.momentum1_host, m.momentum1_placements[t:t + 1],
               m.momentum1_offsets[t:t + 1], m.learning_rate_tensor, eps=1e-8)

    def index_select(self, i: int) -> None:
        torch.index_select(self.weights.view(-1, self.d), 0, self.looked_up[i])

    def index_add(self, i: int) -> None:
        rows = self.weights.view(-1, self.d)
        for u, (zero_rows, zero_state) in zip(self.distinct[i], self.zeros[i]):
            rows.index_add_(0, u, zero_rows)
            self.momentum.index_add_(0, u, zero_state)

    def torch_update(self, i: int, weights: Any = None, momentum: Any = None) -> None:
        """The fused row-wise Adagrad step of FBGEMM's backward, in torch operators."""
        w = (self.weights if weights is None else weights).view(-1, self.d)
        mom = self.momentum if momentum is None else momentum
        lr, eps = 0.01, 1e-8
        rows = self.looked_up[i]
        # lookup j of table t is example j % b: its gradient is grad[j % b, t*d:(t+1)*d]
        j = torch.arange(rows.numel())
        g = self.grad.view(self.b * self.t, self.d)[(j % self.b) * self.t + j // self.b]
        distinct, inverse = torch.unique(rows, return_inverse=True)
        summed = torch.zeros(distinct.numel(), self.d).index_add_(0, inverse, g)
        m = mom.index_select(0, distinct).add_(summed.square().mean(1))
        mom.index_copy_(0, distinct, m)
        w.index_add_(0, distinct, summed.mul_((-lr / m.sqrt_().add_(eps)).unsqueeze(1)))


def _one_thread(fn: Callable[[int], Any]) -> Callable[[int], Any]:
    def call(i: int) -> Any:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(i)
        finally:
            torch.set_num_threads(threads)
    return call


def max_rel_diff(tables: Tables) -> float:
    """FBGEMM's update against the torch composition's, from the same weights and momentum:
    the largest difference in weights or momentum over the largest value of each."""
    w, m = tables.weights.clone(), tables.momentum.clone()
    tables.torch_update(0, w, m)
    tables.backward(0, range(tables.t))
    return max(float((a - b).abs().max() / b.abs().max())
               for a, b in ((w, tables.weights), (m, tables.momentum)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="timed calls per kind per round")
    parser.add_argument("--inputs", type=int, default=6, help="distinct batches, cycled")
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=2**20)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--zipf", type=float, default=1.05)
    args = parser.parse_args()

    tables = Tables(args)
    everything = range(tables.t)
    diff = max_rel_diff(tables)
    n = args.inputs
    # each kind: (what runs before it, untimed; what is timed)
    kinds: dict[str, tuple[Callable[[int], Any], Callable[[int], Any]]] = {
        "forward, after forward": (tables.forward, tables.forward),
        "forward, after backward": (_one_thread(lambda i: tables.backward(i, everything)),
                                    tables.forward),
        "index_select, 1 thread": (tables.forward, _one_thread(tables.index_select)),
        "index_select, all threads": (tables.forward, tables.index_select),
        "backward + update, 1 thread": (tables.forward,
                                        _one_thread(lambda i: tables.backward(i, everything))),
        "index_add, 1 thread": (tables.forward, _one_thread(tables.index_add)),
        "index_add, all threads": (tables.forward, tables.index_add),
        "torch update, all threads": (tables.forward, tables.torch_update),
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for name, (before, timed) in kinds.items():
            for s in range(args.steps):
                i = (r * args.steps + s) % n
                before((i + 1) % n)
                start = time.perf_counter()
                timed(i)
                times[name].append(time.perf_counter() - start)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    distinct = statistics.mean(sum(u.numel() for u in d) for d in tables.distinct)
    result = {"tables": args.tables, "rows": args.rows, "dim": args.dim, "batch": args.batch,
              "zipf": args.zipf, "threads": torch.get_num_threads(),
              "lookups_per_step": args.tables * args.batch, "distinct_rows_per_step": distinct,
              "ms": ms, "max_rel_diff": diff, "all_s": times}
    print(f"{args.tables} tables x {args.rows:,} x {args.dim} fp32, batch {args.batch}, "
          f"{args.tables * args.batch:,} lookups, {distinct:,.0f} distinct rows a step; "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'kernel (all tables)':<32} {'median ms':>10}")
    for name, value in ms.items():
        print(f"{name:<32} {value:>10.2f}")
    print(f"torch update vs FBGEMM's: max relative difference {diff:.1e}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
