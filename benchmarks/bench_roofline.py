"""The embedding step against the machine's memory bandwidth (a roofline for the tables).

Measures, for each memory setting in one process and in interleaved rounds (so that a busy spell
of the machine hits all alike):

1. **DRAM bandwidth**, STREAM-style, over three fp32 arrays of ``--stream-mib`` MiB each (far
   larger than the caches; the L3 size is recorded), on all cores (torch's ``copy_`` and
   ``add(out=)`` run over ``os.cpu_count()`` intra-op threads): *copy* ``b = a`` counted as
   2 x size bytes (STREAM's convention: one read, one write; write-allocate traffic not
   counted), *triad* ``a = b + s * c`` counted as 3 x size; two of each before every round,
   best of all (STREAM reports the best; the medians are recorded too).
   ``bandwidth_gb_per_s`` is the **triad**: STREAM's headline figure, the mix of two reads to one
   write that is closest to the embedding step (rows gathered, rows read-modify-written), and
   the larger of the two here, so the fraction below is not flattered by a small denominator.
2. **The embedding step the way embedtrain trains it**, for (a) the demo model (the tables of
   ``configs/dlrm_synthetic.yaml`` on ``data/synthetic_ctr``: 26 tables, dim 16, real batches of
   2048 read from the train split) and (b) a large-table config: the recipe's model on ``meta``
   with its tables marked for the fused row-wise Adagrad (``optim.sparse: rowwise_adagrad``),
   planned by embedtrain's planner on this machine (``recipes.base.local_cluster``), sharded by
   ``DistributedModelParallel`` with embedtrain's sharders in a world of one (gloo, in-process
   ``HashStore``: ``embedtrain.train.dist.init_process_group``). A step is the sharded
   ``EmbeddingBagCollection``'s forward (input dist, lookup, output dist), a backward of the
   cheap loss ``(pooled * g).sum()`` (``pooled.backward(g)`` with a fixed gradient ``g``: no
   allocation of its own) and FBGEMM's fused update inside that backward. The dense MLPs never
   run. Hooks split the step: input dist (until the first lookup), lookup forward, output dist,
   the TBE's backward + update, the rest of the backward; minor page faults per step too.
3. **The bare FBGEMM TBE** (``SplitTableBatchedEmbeddingBagsCodegen``, CPU) of the same sharded
   module, called directly on the very ``indices`` / ``offsets`` it received in the sharded step
   (captured by a hook), forward + backward + fused update: the difference to (2) is the sharded
   collection's own cost (KJT permute and splits, the input / output dists, the copies between).
   And, as a reference for the forward, ``torch.index_select`` of the same rows from the TBE's
   own weights (what the machine gathers without FBGEMM).

The large config (``--large-*``): 8 tables x 2^20 rows x dim 128 fp32 = 4.29 GB of rows (+ 32
MiB of row-wise Adagrad state), one id per table per example (one-hot, as Criteo's features),
batch 8192, ids Zipf(1.05)-distributed over each table's rows (rank r drawn with probability
~ r^-1.05, the ranks mapped to rows by a random permutation per table, so hot rows are scattered
as hashed or vocabulary ids are; the demo data set was generated with exponent 1.1). Dim 128 is
DLRM's (MLPerf DLRM-v2's) table width: a row is 512 bytes, eight cache lines, so a lookup is a
short streamed read rather than the single random cache line a dim-16 row is; 8 tables keep the
per-table costs of FBGEMM's kernels visible without dominating. Peak RSS ~6.8 GiB (the 4.3 GB of
rows, the 1.5 GiB STREAM arrays, the demo).

Memory settings (``--memory``): ``embedtrain`` measures the process as every ``embedtrain``
process runs (:func:`embedtrain.runtime.tune_allocator`: transparent huge pages for torch's CPU
allocations, glibc keeping freed memory in its heap instead of unmapping it); ``glibc`` the
libraries' defaults (``EMBEDTRAIN_MALLOC=default``, as embedtrain ran before issue 26);
``both`` (the default) runs ``glibc`` in a child process first, then ``embedtrain`` here, one
table set in memory at a time. The top-level ``fraction_of_bandwidth`` is ``embedtrain``'s, the
other run's result is under ``glibc_defaults``; with ``both``, every fraction is of the better of
the two processes' STREAM triads (each process measures it under its own settings: on some
machines huge pages slow a stream), each process's own under ``bandwidth_own_gb_per_s``.

Bytes counted per step (the formula, also written to the JSON), per table ``t`` with ``L_t``
lookups (ids), ``P_t`` pooled bags (examples), ``U_t`` distinct rows, dimension ``D_t``, fp32::

    bytes = sum_t [ L_t * D_t * 4            # forward: every looked-up row read
                  + P_t * D_t * 4            # backward: the pooled gradient read
                  + 2 * U_t * (D_t + 1) * 4  # fused row-wise Adagrad: each distinct row's
                  ]                          #   weights and its 1 momentum float, read + written

Not counted: the pooled output written (``P_t * D_t * 4``) and the ids and offsets read (8 and
4 bytes each), both given in the JSON as ``uncounted_bytes_per_step``; write-allocate traffic;
the backward's re-reads of a bag's gradient row for its lookups after the first (multi-hot).
Under Zipf ids many lookups hit rows already in cache, so the counted bytes are the work's
logical bytes, not DRAM traffic measured by counters. ``GB/s = bytes / median step time`` and
``fraction_of_bandwidth = GB/s / bandwidth_gb_per_s``.

**The random-row floor** (``random_row_floor``, ``fraction_of_random_row_floor``): STREAM is
the wrong limit for random 512-byte rows, which two cores fetch at the pace of memory latency
and the misses they keep in flight, not at streaming bandwidth. The floor is what this machine
takes for the step's random-row work with nothing else around it: ``torch.index_select`` of
every looked-up row from the TBE's own weights, then ``index_add_`` (of zeros) into each
distinct row's weights and its row-wise Adagrad state (same ids, fp32, all intra-op threads).
``fraction_of_random_row_floor = floor ms / step ms`` (1: the step costs only its random rows;
the goal for the large config is >= 0.5); the STREAM fraction stays beside it.

Noise: the machine's load average before and after is printed and recorded; step figures are
medians over all rounds (bandwidth: the best, and the median in ``stream``), the configs'
order rotated each round.

Usage:
    python benchmarks/bench_roofline.py --json benchmarks/out/roofline.json \
        [--memory both|embedtrain|glibc] [--rounds 5] [--steps 8] [--threads N] \
        [--stream-mib 512] [--large-tables 8] [--large-rows 1048576] [--large-dim 128] \
        [--large-batch 8192] [--large-pooling 1] [--zipf 1.05] [--no-large] [--set key=value]
Prints a table per memory setting (config, lookups/step, unique rows/step, MB/step, step ms,
GB/s, fraction; then the step's parts) and writes ``--json``. About 2.5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import resource
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from embedtrain.runtime import allocator_setting, tune_allocator  # noqa: E402  (torch-free)

tune_allocator()  # before torch: it reads THP_MEM_ALLOC_ENABLE at its first allocation

import torch  # noqa: E402

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

ROOT = Path(__file__).resolve().parent.parent
GOAL = 0.5  # the bound on the large config's step against the random-row floor
FORMULA = ("bytes = sum_t [L_t*D_t*4 (rows read) + P_t*D_t*4 (pooled gradient read) "
           "+ 2*U_t*(D_t+1)*4 (distinct rows' weights + row-wise Adagrad momentum, read and "
           "written)]; L: lookups, P: pooled bags, U: distinct rows, D: dim, fp32")


# -- bandwidth --------------------------------------------------------------------------------

class Stream:
    """STREAM copy and triad over three fp32 arrays of ``mib`` MiB each, on torch's threads."""

    def __init__(self, mib: int) -> None:
        n = mib * 2**20 // 4
        self.n = n
        self.a, self.b, self.c = (torch.empty(n) for _ in range(3))
        for x, v in ((self.a, 1.0), (self.b, 2.0), (self.c, 0.5)):
            x.fill_(v)  # touch every page before timing
        self.copy: list[float] = []
        self.triad: list[float] = []
        self.threads = os.cpu_count() or 1

    def run(self, reps: int = 2) -> None:
        steps_threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)  # all cores, whatever the steps use
        for _ in range(reps):
            t = time.perf_counter()
            self.b.copy_(self.a)
            self.copy.append(2 * self.n * 4 / (time.perf_counter() - t) / 1e9)
            t = time.perf_counter()
            torch.add(self.b, self.c, alpha=3.0, out=self.a)
            self.triad.append(3 * self.n * 4 / (time.perf_counter() - t) / 1e9)
        torch.set_num_threads(steps_threads)

    def result(self) -> dict[str, Any]:
        return {"array_mib": self.n * 4 / 2**20, "arrays": 3, "threads": self.threads,
                "copy_gb_per_s": max(self.copy), "triad_gb_per_s": max(self.triad),
                "copy_median_gb_per_s": statistics.median(self.copy),
                "triad_median_gb_per_s": statistics.median(self.triad),
                "copy_all": self.copy, "triad_all": self.triad}


# -- the tables, as embedtrain builds and shards them ------------------------------------------

def _synthetic_recipe(cfg: Any, tables: int, rows: int, pooling: int) -> Any:
    """A CTR recipe whose data set is ``tables`` features of ``rows`` ids (no files): the
    model, planning and sharding are the recipe's own."""
    from embedtrain.features import DatasetMeta, FeatureSpec, SparseFeature
    from embedtrain.recipes.ctr import CTRRecipe

    class SyntheticTables(CTRRecipe):
        def load_dataset(self) -> DatasetMeta:
            sparse = tuple(SparseFeature(f"C{i}", rows, multi_hot=pooling > 1,
                                         max_length=pooling) for i in range(tables))
            return DatasetMeta(Path("synthetic-large-tables"), "large_tables",
                               FeatureSpec("label", ("I1",), sparse), {}, {})

        def pooling_factors(self) -> dict[str, float]:
            return {f"t_C{i}": float(pooling) for i in range(tables)}

    return SyntheticTables(cfg)


def _sharded_ebc(recipe: Any, batch_size: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The recipe's model planned for this machine and sharded (world of one); its sharded
    ``EmbeddingBagCollection`` and the plan's sharding types."""
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    from embedtrain.recipes.base import ModelParts, local_cluster

    device = torch.device("cpu")
    cluster = local_cluster(1, device, batch_size)
    dmp = recipe.shard(ModelParts(recipe.planning_model()), cluster, device)
    found = [m for m in dmp.modules() if isinstance(m, ShardedEmbeddingBagCollection)]
    if len(found) != 1:
        raise SystemExit(f"bench_roofline: expected one sharded EmbeddingBagCollection, found "
                         f"{len(found)}")
    types: dict[str, int] = {}
    for p in dmp.plan.plan.values():
        for ps in p.values():
            types[ps.sharding_type] = types.get(ps.sharding_type, 0) + 1
    return found[0], {"sharding_types": types, "sharding_groups": len(found[0]._lookups)}


def _tbes(ebc: torch.nn.Module) -> list[torch.nn.Module]:
    """The FBGEMM TBE modules under a sharded EBC's lookups."""
    return [m._emb_module for lookup in ebc._lookups for m in lookup.modules()
            if hasattr(m, "_emb_module")]


def _zipf_kjts(tables: int, rows: int, batch: int, pooling: int, exponent: float, n: int,
               seed: int = 0) -> list[Any]:
    """``n`` KJTs of ``tables`` features, ``pooling`` ids per example each; the ids are
    Zipf(``exponent``) ranks over ``rows`` mapped through a random permutation per table (the
    hot rows scattered over the table, as hashed or vocabulary ids are)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, rows + 1, dtype=torch.float64).pow_(-exponent)
    cdf = torch.cumsum(weights, 0)
    cdf /= cdf[-1].item()
    perms = [torch.randperm(rows, generator=g) for _ in range(tables)]
    out = []
    for _ in range(n):
        values = torch.cat([
            perms[t][torch.searchsorted(cdf, torch.rand(batch * pooling, generator=g,
                                                        dtype=torch.float64)).clamp_(max=rows - 1)]
            for t in range(tables)])
        out.append(KeyedJaggedTensor(
            keys=[f"C{i}" for i in range(tables)], values=values,
            lengths=torch.full((tables * batch,), pooling, dtype=torch.int32), stride=batch))
    return out


def _demo_kjts(recipe: Any, batch_size: int, n: int) -> list[Any]:
    from embedtrain.data.reader import ParquetBatchReader

    meta = recipe.dataset
    reader = ParquetBatchReader(meta.files("train"), meta.features, batch_size=batch_size,
                                num_workers=0)
    kjts = []
    for batch in reader.iter_epoch(0):
        kjts.append(batch.sparse_features)
        if len(kjts) >= n:
            break
    return kjts


def _counts(kjts: list[Any], dims: dict[str, int]) -> dict[str, float]:
    """Per step (mean over ``kjts``): lookups, bags, distinct rows, counted and uncounted bytes."""
    lookups = bags = unique = counted = output = ids = gathered = 0.0
    for kjt in kjts:
        for key, jt in kjt.to_dict().items():
            d, v = dims[key], jt.values()
            u = torch.unique(v).numel()
            p = jt.lengths().numel()
            lookups += v.numel()
            bags += p
            unique += u
            counted += v.numel() * d * 4 + p * d * 4 + 2 * u * (d + 1) * 4
            gathered += v.numel() * d * 4
            output += p * d * 4
            ids += v.numel() * v.element_size() + (p + 1) * jt.lengths().element_size()
    n = len(kjts)
    return {"lookups": lookups / n, "bags": bags / n, "unique_rows": unique / n,
            "bytes": counted / n, "lookups_x_row_bytes": gathered / n,
            "uncounted_bytes_per_step": {"pooled_output_written": output / n,
                                         "ids_and_offsets_read": ids / n}}


# -- timing ------------------------------------------------------------------------------------

class _PartTimer:
    """Hooks on a sharded EBC: its lookups' forward (the TBE forward), the first lookup's start
    (everything before: the input dist) and the TBE autograd nodes (backward + fused update)."""

    def __init__(self, ebc: torch.nn.Module) -> None:
        for lookup in ebc._lookups:
            lookup.register_forward_pre_hook(self._lookup_start)
            lookup.register_forward_hook(self._lookup_end)
        for tbe in _tbes(ebc):
            tbe.register_forward_hook(self._tbe_output)
        self.reset()

    def reset(self) -> None:
        self.first_lookup: Optional[float] = None
        self.lookup_fwd = self.tbe_bwd = 0.0

    def _lookup_start(self, module, inputs) -> None:
        self._start = time.perf_counter()
        if self.first_lookup is None:
            self.first_lookup = self._start

    def _lookup_end(self, module, inputs, output) -> None:
        self.lookup_fwd += time.perf_counter() - self._start

    def _tbe_output(self, module, inputs, output) -> None:
        node = output.grad_fn
        if node is None:
            return
        started = []
        node.register_prehook(lambda grads: started.append(time.perf_counter()))

        def after(grad_inputs, grad_outputs):
            self.tbe_bwd += time.perf_counter() - started[-1]

        node.register_hook(after)


@dataclass
class Config:
    """One measured table set: the sharded EBC, its inputs, the bare TBE calls on them."""

    name: str
    ebc: torch.nn.Module
    kjts: list[Any]
    info: dict[str, Any]
    timer: _PartTimer = field(init=False)
    grads: list[torch.Tensor] = field(default_factory=list)
    bare_calls: list[list[tuple[torch.nn.Module, dict, torch.Tensor]]] = field(
        default_factory=list)
    sharded: list[dict[str, float]] = field(default_factory=list)
    bare: list[dict[str, float]] = field(default_factory=list)
    gathers: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = field(
        default_factory=list)
    gather: list[float] = field(default_factory=list)
    scatters: list[list[tuple[torch.Tensor, ...]]] = field(default_factory=list)
    scatter: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.timer = _PartTimer(self.ebc)

    def prepare(self) -> None:
        """One sharded step per input (warms the input dist up), capturing what each TBE gets;
        the fixed gradients of the cheap loss."""
        captured: list[tuple[torch.nn.Module, dict]] = []
        hooks = [tbe.register_forward_pre_hook(
            lambda m, args, kwargs: captured.append((m, dict(kwargs))), with_kwargs=True)
            for tbe in _tbes(self.ebc)]
        g = torch.Generator().manual_seed(1)
        for kjt in self.kjts:
            captured.clear()
            pooled = self.ebc(kjt).wait().values()
            grad = torch.randn(pooled.shape, generator=g) * 1e-3
            pooled.backward(grad)
            self.grads.append(grad)
            calls = []
            for m, kw in captured:  # a TBE's output: [examples, its tables' dims summed]
                width = int(m.D_offsets[-1].item())
                calls.append((m, kw, torch.randn((pooled.shape[0], width), generator=g) * 1e-3))
            self.bare_calls.append(calls)
            self.gathers.append([_gather_args(m, kw) for m, kw in captured])
            self.scatters.append([_scatter_args(m, weights, rows) for (m, _), (weights, rows, _)
                                  in zip(captured, self.gathers[-1])])
        for h in hooks:
            h.remove()

    def sharded_step(self, i: int, record: bool) -> None:
        k = i % len(self.kjts)
        self.timer.reset()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        pooled = self.ebc(self.kjts[k]).wait().values()
        t1 = time.perf_counter()
        pooled.backward(self.grads[k])
        t2 = time.perf_counter()
        if record:
            t = self.timer
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            self.sharded.append({"total": t2 - t0, "fwd": t1 - t0, "bwd": t2 - t1,
                                 "page_faults": faults,
                                 "input_dist": t.first_lookup - t0, "lookup_fwd": t.lookup_fwd,
                                 "output_dist": t1 - t0 - t.lookup_fwd - (t.first_lookup - t0),
                                 "tbe_bwd": t.tbe_bwd, "other_bwd": t2 - t1 - t.tbe_bwd})

    def bare_step(self, i: int, record: bool) -> None:
        calls = self.bare_calls[i % len(self.kjts)]
        t0 = time.perf_counter()
        outs = [m(**kw) for m, kw, _ in calls]
        t1 = time.perf_counter()
        torch.autograd.backward(outs, [g for _, _, g in calls])
        t2 = time.perf_counter()
        if record:
            self.bare.append({"total": t2 - t0, "fwd": t1 - t0, "bwd": t2 - t1})

    def gather_step(self, i: int) -> None:
        t0 = time.perf_counter()
        for weights, rows, out in self.gathers[i % len(self.kjts)]:
            torch.index_select(weights, 0, rows, out=out)
        t1 = time.perf_counter()
        for weights, state, unique, update, update_state in self.scatters[i % len(self.kjts)]:
            weights.index_add_(0, unique, update)
            state.index_add_(0, unique, update_state)
        self.gather.append(t1 - t0)
        self.scatter.append(time.perf_counter() - t1)


def _gather_args(tbe: torch.nn.Module, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor,
                                                               torch.Tensor]:
    """The reference gather of what ``tbe`` looks up: its rows (one table's rows after the
    other in ``weights_host``, all of one dim here) picked by ``torch.index_select``."""
    dims = (tbe.D_offsets[1:] - tbe.D_offsets[:-1]).unique()
    if dims.numel() != 1:
        raise SystemExit("bench_roofline: the gather reference needs tables of one dim per TBE")
    d = int(dims.item())
    weights = tbe.weights_host.detach().view(-1, d)
    offsets, indices = kwargs["offsets"], kwargs["indices"].long()
    features = len(tbe.feature_table_map)
    per_feature = (offsets[1:] - offsets[:-1]).view(features, -1).sum(1)
    first_row = (tbe.weights_offsets[torch.tensor(tbe.feature_table_map)] // d)
    rows = indices + torch.repeat_interleave(first_row, per_feature)
    return weights, rows, torch.empty(rows.numel(), d)


def _scatter_args(tbe: torch.nn.Module, weights: torch.Tensor,
                  rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The reference update of the rows ``tbe`` looks up (``weights`` and ``rows`` as
    :func:`_gather_args` gives them): each distinct row's weights and its row-wise Adagrad state
    (one float a row, at the same row number) read and written once, by ``index_add_`` of zeros
    (the values stay; the traffic is the fused update's)."""
    state = tbe.momentum1_host.detach()
    if state.numel() != weights.shape[0]:
        raise SystemExit("bench_roofline: the update reference needs row-wise Adagrad state")
    unique = rows.unique()
    return (weights, state, unique, torch.zeros(unique.numel(), weights.shape[1]),
            torch.zeros(unique.numel()))


def _median_ms(steps: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in steps) * (1 if k == "page_faults" else 1000)
            for k in steps[0]}


def _summary(c: Config, bandwidth: float) -> dict[str, Any]:
    sharded, bare = _median_ms(c.sharded), _median_ms(c.bare)
    counts = c.info["counts"]
    gbps = counts["bytes"] / (sharded["total"] / 1000) / 1e9
    bare_gbps = counts["bytes"] / (bare["total"] / 1000) / 1e9
    totals = sorted(s["total"] * 1000 for s in c.sharded)
    gather_ms = statistics.median(c.gather) * 1000
    floor_ms = statistics.median(g + s for g, s in zip(c.gather, c.scatter)) * 1000
    gathered = counts["lookups_x_row_bytes"]
    return {**c.info, "steps_timed": len(c.sharded),
            "sharded_ms": sharded, "sharded_total_p25_p75_ms": [totals[len(totals) // 4],
                                                                totals[3 * len(totals) // 4]],
            "bare_tbe_ms": bare,
            "sharded_overhead_ms": sharded["total"] - bare["total"],
            "gb_per_s": gbps, "fraction_of_bandwidth": gbps / bandwidth,
            "bare_tbe_gb_per_s": bare_gbps, "bare_tbe_fraction_of_bandwidth": bare_gbps / bandwidth,
            # the machine's floor for random rows: the gather above, then each distinct row's
            # weights and state read and written by index_add_ (what latency-bound rows cost)
            "random_row_floor": {
                "what": "index_select of the looked-up rows + index_add_ into the distinct rows' "
                        "weights and row-wise state (same ids, fp32, all intra-op threads)",
                "ms": floor_ms, "gather_ms": gather_ms,
                "scatter_ms": statistics.median(c.scatter) * 1000},
            "fraction_of_random_row_floor": floor_ms / sharded["total"],
            "bare_tbe_fraction_of_random_row_floor": floor_ms / bare["total"],
            # what the machine gathers: the same rows by torch.index_select into a buffer
            # (rows read + written), vs the bare TBE forward reading them (and writing the bags)
            "gather_reference": {
                "what": "torch.index_select of the step's rows from the TBE's own weights",
                "ms": gather_ms, "rows_read_gb_per_s": gathered / (gather_ms / 1000) / 1e9,
                "read_plus_write_gb_per_s": 2 * gathered / (gather_ms / 1000) / 1e9,
                "bare_tbe_forward_rows_read_gb_per_s": gathered / (bare["fwd"] / 1000) / 1e9,
                "gather_ms_over_bare_tbe_forward_ms": gather_ms / bare["fwd"]}}


def _print_table(stream: dict[str, Any], rows: dict[str, dict[str, Any]], title: str) -> None:
    print(f"== {title}")
    print(f"DRAM bandwidth (STREAM, {stream['arrays']} x {stream['array_mib']:.0f} MiB fp32, "
          f"{stream['threads']} threads, best of {len(stream['copy_all'])}): copy "
          f"{stream['copy_gb_per_s']:.2f} GB/s, triad {stream['triad_gb_per_s']:.2f} GB/s "
          f"(used: triad; medians {stream['copy_median_gb_per_s']:.2f}, "
          f"{stream['triad_median_gb_per_s']:.2f})")
    print(f"{'config':<7} {'what':<12} {'lookups/step':>12} {'unique/step':>11} "
          f"{'MB/step':>8} {'step ms':>8} {'GB/s':>6} {'fraction':>8} {'floor ms':>8} "
          f"{'of floor':>8}")
    for name, r in rows.items():
        c, floor = r["counts"], r["random_row_floor"]["ms"]
        for what, ms, gbps, frac in (
                ("sharded EBC", r["sharded_ms"]["total"], r["gb_per_s"],
                 r["fraction_of_bandwidth"]),
                ("bare TBE", r["bare_tbe_ms"]["total"], r["bare_tbe_gb_per_s"],
                 r["bare_tbe_fraction_of_bandwidth"])):
            print(f"{name:<7} {what:<12} {c['lookups']:>12,.0f} {c['unique_rows']:>11,.0f} "
                  f"{c['bytes'] / 1e6:>8.1f} {ms:>8.2f} {gbps:>6.2f} {frac:>8.3f} "
                  f"{floor:>8.2f} {floor / ms:>8.3f}")
    print(f"{'config':<7} sharded step, median ms: input dist / lookup fwd / output dist | TBE "
          f"bwd+update / rest of bwd | page faults || bare TBE fwd / bwd+update || "
          f"index_select of the rows")
    for name, r in rows.items():
        s, b, g = r["sharded_ms"], r["bare_tbe_ms"], r["gather_reference"]
        print(f"{name:<7} {s['input_dist']:.2f} / {s['lookup_fwd']:.2f} / {s['output_dist']:.2f}"
              f" | {s['tbe_bwd']:.2f} / {s['other_bwd']:.2f} | {s['page_faults']:,.0f} || "
              f"{b['fwd']:.2f} / {b['bwd']:.2f} || {g['ms']:.2f}   ({r['sharding_groups']} "
              f"sharding group(s): {r['sharding_types']})")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Bandwidth, then the configs' steps, interleaved in rounds; the result (JSON-ready)."""
    from embedtrain.config import load_config
    from embedtrain.recipes.ctr import CTRRecipe
    from embedtrain.train.dist import init_process_group

    load_before = os.getloadavg()
    init_process_group()
    stream = Stream(args.stream_mib)
    stream.run(1)  # warm-up

    configs: list[Config] = []
    start = time.perf_counter()
    cfg = load_config(args.config, [f"data.path={args.data}", *args.overrides])
    recipe = CTRRecipe(cfg)
    ebc, info = _sharded_ebc(recipe, cfg.data.batch_size)
    kjts = _demo_kjts(recipe, cfg.data.batch_size, args.inputs)
    dims = {f.name: cfg.model.embedding_dim for f in recipe.dataset.features.sparse}
    tables = recipe.dataset.features.sparse
    configs.append(Config("demo", ebc, kjts, {
        **info, "tables": len(tables), "rows": sum(f.num_embeddings for f in tables),
        "dim": cfg.model.embedding_dim, "batch": cfg.data.batch_size,
        "table_bytes": sum(f.num_embeddings for f in tables) * cfg.model.embedding_dim * 4,
        "ids": f"real batches of {_shown(args.data)} (train split)",
        "counts": _counts(kjts, dims)}))
    if not args.no_large:
        d = args.large_dim
        large = load_config(args.config, [f"data.path={args.data}", f"model.embedding_dim={d}",
                                          f"model.bottom_mlp=[{d}]", *args.overrides])
        recipe = _synthetic_recipe(large, args.large_tables, args.large_rows,
                                   args.large_pooling)
        t = time.perf_counter()
        ebc, info = _sharded_ebc(recipe, args.large_batch)
        shard_s = time.perf_counter() - t
        kjts = _zipf_kjts(args.large_tables, args.large_rows, args.large_batch,
                          args.large_pooling, args.zipf, args.inputs)
        dims = {f"C{i}": d for i in range(args.large_tables)}
        configs.append(Config("large", ebc, kjts, {
            **info, "tables": args.large_tables, "rows": args.large_tables * args.large_rows,
            "dim": d, "batch": args.large_batch, "pooling": args.large_pooling,
            "table_bytes": args.large_tables * args.large_rows * d * 4,
            "optimizer_state_bytes": args.large_tables * args.large_rows * 4,
            "ids": f"Zipf exponent {args.zipf} over each table's rows, permuted per table",
            "shard_seconds": shard_s, "counts": _counts(kjts, dims)}))
    setup_s = time.perf_counter() - start

    for c in configs:
        c.prepare()
        for i in range(args.warmup):
            c.sharded_step(i, record=False)
            c.bare_step(i, record=False)
    gc.collect()
    gc.disable()  # no collector pauses inside the timed steps
    for r in range(args.rounds):
        stream.run(2)
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for c in order:
            for i in range(args.steps):
                c.sharded_step(r * args.steps + i, record=True)
                c.bare_step(r * args.steps + i, record=True)
            for i in range(args.steps):
                c.gather_step(r * args.steps + i)
    gc.enable()

    bw = stream.result()
    bandwidth = bw["triad_gb_per_s"]
    rows = {c.name: _summary(c, bandwidth) for c in configs}
    return {
        "bandwidth_gb_per_s": bandwidth,
        "bandwidth_used": "STREAM triad, best of the rounds (3 x array bytes per triad)",
        "fraction_of_bandwidth": {n: r["fraction_of_bandwidth"] for n, r in rows.items()},
        "fraction_of_median_bandwidth": {
            n: r["gb_per_s"] / bw["triad_median_gb_per_s"] for n, r in rows.items()},
        "fraction_of_random_row_floor": {
            n: r["fraction_of_random_row_floor"] for n, r in rows.items()},
        "stream": bw, "configs": rows,
        "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(), "rounds": args.rounds, "steps_per_round": args.steps,
        "environment": {k: os.environ.get(k) for k in (
            "OMP_NUM_THREADS", "THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_MAX_",
            "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")},
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "l3_cache": _read("/sys/devices/system/cpu/cpu0/cache/index3/size"),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "setup_seconds": setup_s,
    }


def _rebase(result: dict[str, Any], bandwidth: float) -> None:
    """``result``'s fractions against ``bandwidth`` (the machine's best of both processes: the
    STREAM arrays are allocated under each process's memory settings, and huge pages can slow
    a stream on some machines), its own process's figure kept as ``bandwidth_own_gb_per_s``."""
    result["bandwidth_own_gb_per_s"] = result["bandwidth_gb_per_s"]
    result["bandwidth_gb_per_s"] = bandwidth
    result["bandwidth_used"] += "; the best of the two processes' (--memory both)"
    for row in result["configs"].values():
        row["fraction_of_bandwidth"] = row["gb_per_s"] / bandwidth
        row["bare_tbe_fraction_of_bandwidth"] = row["bare_tbe_gb_per_s"] / bandwidth
    result["fraction_of_bandwidth"] = {
        n: r["fraction_of_bandwidth"] for n, r in result["configs"].items()}


def _report(result: dict[str, Any], title: str) -> None:
    _print_table(result["stream"], result["configs"], title)
    fr = result["fraction_of_bandwidth"]
    print("fraction of bandwidth: " + ", ".join(f"{k} {v:.3f}" for k, v in fr.items()))
    ff = result["fraction_of_random_row_floor"]
    print("fraction of the random-row floor: " + ", ".join(f"{k} {v:.3f}" for k, v in ff.items())
          + (f" (goal for large: >= {GOAL})" if "large" in ff else ""))
    print(f"load average (1, 5, 15 min) before "
          f"{tuple(round(x, 2) for x in result['load_average_before'])}, after "
          f"{tuple(round(x, 2) for x in result['load_average_after'])}; peak RSS "
          f"{result['peak_rss_gib']:.2f} GiB; {result['threads']} thread(s) for the steps\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--config", default=str(ROOT / "configs/dlrm_synthetic.yaml"))
    parser.add_argument("--data", default=str(ROOT / "data/synthetic_ctr"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per config per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--inputs", type=int, default=6, help="distinct batches, cycled")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's)")
    parser.add_argument("--stream-mib", type=int, default=512, help="MiB per STREAM array")
    parser.add_argument("--large-tables", type=int, default=8)
    parser.add_argument("--large-rows", type=int, default=2**20)
    parser.add_argument("--large-dim", type=int, default=128)
    parser.add_argument("--large-batch", type=int, default=8192)
    parser.add_argument("--large-pooling", type=int, default=1, help="ids per example per table")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids")
    parser.add_argument("--no-large", action="store_true", help="the demo tables only")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="config override for both configs (key.path=value)")
    parser.add_argument("--memory", choices=("both", "embedtrain", "glibc"), default="both",
                        help="process memory settings measured: embedtrain's (as every "
                             "embedtrain process), glibc's and torch's defaults, or both "
                             "(glibc's in a child process first, then embedtrain's here)")
    args = parser.parse_args()
    glibc_env = {"EMBEDTRAIN_MALLOC": "default"}
    if args.memory == "glibc" and os.environ.get("EMBEDTRAIN_MALLOC") != "default":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **glibc_env})
    if args.threads:
        torch.set_num_threads(args.threads)
    from embedtrain.processes import exit_process

    other = None
    if args.memory == "both":  # before this process holds any tables: one set in memory
        import subprocess
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            child = Path(tmp) / "glibc.json"
            argv = [a for a in sys.argv[1:]]
            argv[argv.index("--json") + 1] = str(child)
            subprocess.run([sys.executable, __file__, *argv, "--memory", "glibc"], check=True,
                           env={**os.environ, **glibc_env})
            other = json.loads(child.read_text())
    settings = allocator_setting()
    result = measure(args)
    if other is not None:
        best = max(result["bandwidth_gb_per_s"], other["bandwidth_gb_per_s"])
        print(f"STREAM triad: {other['bandwidth_gb_per_s']:.1f} GB/s with glibc's defaults, "
              f"{result['bandwidth_gb_per_s']:.1f} GB/s with embedtrain's settings: fractions "
              f"below (both processes) are of the best, {best:.1f} GB/s")
        _rebase(result, best)
        _rebase(other, best)
    _report(result, f"process memory settings: {settings}")
    if other is not None:
        print("(glibc's and torch's defaults, printed above by their own process, -> "
              "embedtrain's:)")
        for name in result["configs"]:
            a, b = other["configs"][name], result["configs"][name]
            print(f"  {name}: sharded step {a['sharded_ms']['total']:.2f} -> "
                  f"{b['sharded_ms']['total']:.2f} ms, fraction {a['fraction_of_bandwidth']:.3f}"
                  f" -> {b['fraction_of_bandwidth']:.3f}")
    result = {"command": " ".join(["python", *sys.argv]), "memory": args.memory,
              "memory_settings": settings, **result,
              "goal": f"fraction_of_random_row_floor.large >= {GOAL}",
              "goal_met": (result["fraction_of_random_row_floor"]["large"] >= GOAL
                           if "large" in result["fraction_of_random_row_floor"] else None),
              "bytes_formula": FORMULA,
              "transparent_hugepage": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
              "software": {"torch": torch.__version__, "fbgemm_gpu": _version("fbgemm_gpu"),
                           "torchrec": _version("torchrec")}}
    if other is not None:
        result["glibc_defaults"] = other
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    exit_process(0)


def _shown(path: str) -> str:
    """``path`` relative to the repository when it is inside it."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path


def _read(path: str) -> Optional[str]:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _version(package: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
