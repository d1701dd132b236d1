"""A CPU cluster file whose bandwidths and fixed costs are measured here, in the estimator's units.

The planner's per-rank times come from TorchRec's ``EmbeddingPerfEstimator``, which charges a
shard of a ``cpu`` cluster (``fused`` kernel, one host)::

    fwd_compute = lookup bytes / ddr_bandwidth        (kernel_bw_lookup: cpu + fused -> 1 x DDR)
    bwd_compute = 2 x fwd_compute                     (BWD_COMPUTE_MULTIPLIER)
    fwd_comms   = output bytes / intra_host_bandwidth (table_wise: the all-to-all of its pooled
    bwd_comms   = output bytes / intra_host_bandwidth  outputs; row_wise: a reduce-scatter, then
                                                       an all-gather plus a 2.455x batched copy)

where a table_wise shard's "lookup bytes" are ``(8 ids + 4 x max(dim, 32) rows + 4 x dim
outputs)`` per id of the global batch, times a block-usage penalty for narrow tables (1.15 below
dim 128, 1.75 below 64: GPU warp occupancy, applied on CPU too), and its "output bytes" are ``4 x
dim`` per example of the global batch. The cluster file's GB/s are therefore not hardware
datasheet figures but the rates that make these formulas reproduce measured times; as the
formulas differ by sharding type (row_wise has no block penalty), one bandwidth cannot make them
all exact, and table_wise (the planner's usual choice for small tables) is the reference.
:func:`calibrate` measures them on this machine:

* ``ddr_bandwidth_gb_per_s``: FBGEMM's CPU TBE (the kernel ``DistributedModelParallel`` runs for
  a ``fused`` table on CPU) holding one rank's tables (``table_rows`` x ``embedding_dim``, fp32),
  forward plus backward with the fused row-wise Adagrad update, ``batch_size`` examples of
  ``pooling`` Zipf-distributed ids per table; all local ranks at once (as in training, each with
  its training thread count). Bandwidth = the bytes TorchRec's own table_wise formula charges
  those tables for forward + backward, divided by the measured forward + backward time. The
  kernel's time depends on how many distinct rows a batch touches (the row-wise Adagrad update
  is per distinct row), so the table sizes and the id skew should resemble the workload's: the
  defaults are one rank's share of the demo DLRM's tables (every other one of its 26, sorted).
* ``intra_host_gb_per_s``: gloo ``all_to_all_single`` between ``devices_per_host`` local
  processes, each sending the pooled outputs of those tables (``batch_size x embedding_dim x 4``
  bytes per table, what TorchRec charges a rank's table_wise forward all-to-all). Bandwidth =
  those bytes / measured time. The collectives are timed interleaved (each repetition runs all
  four in turn), so that, as in a training step, a collective's buffers are not still in cache
  from its previous call (alone, the same all-to-all runs about 1.7x faster here).
* ``reduce_scatter_gb_per_s`` / ``all_gather_gb_per_s``: the collectives TorchRec's row_wise
  sharding runs on gloo (``reduce_scatter_tensor`` of the pooled outputs forward,
  ``all_gather_into_tensor`` of their gradients backward), sized as a rank's row_wise share of
  the same tables (every rank holds rows of every table: ``devices_per_host x`` the all-to-all's
  message, the bytes TorchRec charges). Bandwidth = those bytes / measured time. The planner
  charges row_wise's collectives at these rates instead of the all-to-all's.
* ``sharding_group_ms``: the fixed cost, per step and on every rank, of one sharding type a plan
  uses (TorchRec runs each as its own group: input all-to-alls of the ids, one TBE call,
  output collective, their backward). Measured with TorchRec itself: for each sharding type
  (:data:`GROUP_SHARDING_TYPES`), a synthetic ``EmbeddingBagCollection`` of ``devices_per_host``
  tables of :data:`GROUP_TABLE_ROWS` rows (as the planner places them with only that sharding
  type allowed: every rank gets a shard, so does one lookup), sharded by
  ``DistributedModelParallel`` with embedtrain's sharders, fused row-wise Adagrad, forward +
  backward at :data:`TINY_BATCH` examples per rank: the median step, minus the planner's own
  estimate for that tiny plan (a few microseconds), averaged over ranks. The field is the median
  of those per-type costs (robust to one noisy type); the per-type values are in
  :class:`GroupTiming` and the header. On the 2-core development VM (seven calibrations) the
  table/column based types cost 4.0-4.3 ms each on average, row_wise about 15% more (4.7) and
  table_row_wise about 45% more (5.9, and the noisiest: 4.7-6.9), so the one figure fits the
  planner's usual choices and underestimates row-based groups by 0.5-1.5 ms.

It also measures what TorchRec's model still has no term for, reported in the file's header and
in :class:`Calibration`: the time of a nearly empty TBE call (8 examples) and of a 64-byte
all-to-all (fixed costs per kernel call and per collective, part of ``sharding_group_ms``) and
the real backward / forward ratio of the lookup (TorchRec assumes 2). The other fields of the
cluster (capacities, ``inter_host_gb_per_s`` of a one-host cluster, ``hbm_*``) are kept.

Example:
    >>> base = load_cluster("configs/clusters/cpu-1x2.yaml")
    >>> cal = calibrate(base)
    >>> cal.cluster.ddr_bandwidth_gb_per_s, cal.cluster.intra_host_gb_per_s
    (5.99, 1.54)
    >>> cal.cluster.sharding_group_ms, cal.cluster.reduce_scatter_gb_per_s
    (4.41, 0.629)
    >>> write_cluster_yaml(cal, "configs/clusters/cpu-1x2.yaml",
    ...                    template="configs/clusters/cpu-1x2.yaml")
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import platform
import re
import socket
import statistics
import tempfile
import textwrap
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from embedtrain.config_io import to_dict
from embedtrain.sharding.types import ClusterConfig, DeviceKind, ShardingType

GIB = 1024**3
TINY_BATCH = 8  # examples (per rank) of the "nearly empty" calls that measure fixed costs
TINY_MESSAGE_BYTES = 64  # bytes per rank of the all-to-all that measures a collective's latency
HEADER = "# Calibrated "  # first line of the header block write_cluster_yaml writes
_HEADER_CONT = "#   "  # its following lines
# one rank's share of the demo DLRM's 26 tables (every other one, sorted by size)
DEMO_RANK_TABLE_ROWS = (4, 10, 23, 54, 128, 303, 1111, 2639, 6271, 14903, 35416, 84161, 200000)
# the sharding types whose fixed cost per step sharding_group_ms is the median of (data_parallel
# has none: no input or output dist), and the rows of each table of the tiny model measuring it
GROUP_SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise",
                        "table_column_wise")
GROUP_TABLE_ROWS = 1000


class CalibrationError(ValueError):
    """The cluster cannot be calibrated here; the message is one line saying why."""


@dataclass
class LookupTiming:
    """The TBE forward + backward measurement behind ``ddr_bandwidth_gb_per_s``."""

    table_rows: list[int]  # one TBE table per entry
    embedding_dim: int
    batch_size: int  # examples per table per call (a table_wise shard sees the global batch)
    pooling: float  # ids per example
    zipf_exponent: Optional[float]  # id skew (None: uniform)
    ranks: int  # processes measuring at once
    threads: int  # torch threads per process
    forward_ms: float  # medians over steps, averaged over ranks
    backward_ms: float  # backward incl. the fused row-wise Adagrad update
    estimator_bytes: float  # what TorchRec's table_wise formula charges for forward + backward
    gb_per_s: float  # estimator_bytes / (forward_ms + backward_ms), 1 GB = 2^30 bytes
    tiny_call_ms: float  # forward + backward of the same TBE with TINY_BATCH examples

    @property
    def total_ms(self) -> float:
        return self.forward_ms + self.backward_ms


@dataclass
class CommTiming:
    """The gloo collectives behind ``intra_host_gb_per_s`` (ms: medians, averaged over ranks)."""

    ranks: int
    message_bytes: int  # bytes each rank sends in the all-to-all (table_wise's pooled outputs)
    all_to_all_ms: float
    gb_per_s: float  # message_bytes / all_to_all_ms
    latency_ms: float  # an all-to-all of TINY_MESSAGE_BYTES per rank
    row_wise_bytes: int  # reduce-scatter input = all-gather output per rank (ranks x message)
    reduce_scatter_ms: float  # reduce_scatter_tensor of row_wise_bytes (row_wise forward)
    all_gather_ms: float  # all_gather_into_tensor to row_wise_bytes (row_wise backward)

    @property
    def reduce_scatter_gb_per_s(self) -> float:
        return _gb_per_s(self.row_wise_bytes, self.reduce_scatter_ms)

    @property
    def all_gather_gb_per_s(self) -> float:
        return _gb_per_s(self.row_wise_bytes, self.all_gather_ms)


@dataclass
class GroupTiming:
    """The tiny sharded models behind ``sharding_group_ms`` (ms: per sharding type, the median
    step of each rank, averaged over ranks)."""

    ranks: int
    tables: int  # of GROUP_TABLE_ROWS x embedding_dim each (one per rank)
    embedding_dim: int
    batch_size: int  # examples per rank (TINY_BATCH)
    measured_ms: dict[str, float]  # forward + backward of the sharded EBC
    estimated_ms: dict[str, float]  # the planner's embedding_total for that plan
    sharding_group_ms: float  # median over types of measured - estimated

    @property
    def fixed_ms(self) -> dict[str, float]:
        """Per sharding type: measured - estimated, the fixed cost of one group of that type."""
        return {t: self.measured_ms[t] - self.estimated_ms[t] for t in self.measured_ms}


@dataclass
class Calibration:
    """A calibrated cluster and the measurements it comes from."""

    cluster: ClusterConfig
    lookup: LookupTiming
    comms: Optional[CommTiming]  # None for one device per host (nothing to measure)
    groups: Optional[GroupTiming]  # likewise
    measured_at: str  # ISO 8601, UTC
    machine: str  # host name, CPU model and cores
    software: str  # torch / fbgemm versions
    steps: int  # timed steps per measurement (after warm-up)

    def header(self) -> list[str]:
        """The comment lines :func:`write_cluster_yaml` puts above the fields (at most 100
        characters each; the first starts with ``# Calibrated``, the others with ``#   ``)."""
        lk, c, g = self.lookup, self.comms, self.groups
        zipf = f"Zipf {lk.zipf_exponent:g}" if lk.zipf_exponent else "uniform"
        paragraphs = [
            f"{self.measured_at} on {self.machine} ({self.software}) by "
            f"embedtrain.sharding.calibrate: medians of {self.steps} steps after warm-up, averaged "
            f"over {lk.ranks} rank(s) running at once, {lk.threads} thread(s) each; "
            "1 GB = 2^30 bytes.",
            f"ddr_bandwidth_gb_per_s {self.cluster.ddr_bandwidth_gb_per_s:g}: FBGEMM CPU TBE of "
            f"{len(lk.table_rows)} tables of {_rows_text(lk.table_rows)} x dim "
            f"{lk.embedding_dim} (fp32), "
            f"{lk.batch_size} examples x {lk.pooling:g} id(s) ({zipf}) per table: forward "
            f"{lk.forward_ms:.3f} ms + backward with fused row-wise Adagrad {lk.backward_ms:.3f} "
            f"ms; TorchRec's table_wise formula charges {lk.estimator_bytes / 1e6:.2f} MB for "
            f"them. Not in its model: the same TBE with {TINY_BATCH} examples takes "
            f"{lk.tiny_call_ms:.3f} ms (a fixed cost per call); backward / forward is "
            f"{lk.backward_ms / lk.forward_ms:.1f} (it assumes 2).",
        ]
        cl = self.cluster
        if c is None:
            paragraphs.append(f"intra_host_gb_per_s {cl.intra_host_gb_per_s:g}, "
                              f"reduce_scatter_gb_per_s {cl.reduce_scatter_gb_per_s:g}, "
                              f"all_gather_gb_per_s {cl.all_gather_gb_per_s:g}: not measured "
                              "(one device per host).")
        else:
            paragraphs += [
                f"intra_host_gb_per_s {cl.intra_host_gb_per_s:g}: gloo all_to_all_single of "
                f"{c.message_bytes / 2**20:.2f} MiB per rank (those tables' pooled outputs) "
                f"between {c.ranks} local processes: {c.all_to_all_ms:.3f} ms. Not in "
                f"TorchRec's model: a {TINY_MESSAGE_BYTES}-byte all-to-all takes "
                f"{c.latency_ms:.3f} ms (a latency per collective).",
                f"reduce_scatter_gb_per_s {cl.reduce_scatter_gb_per_s:g}, all_gather_gb_per_s "
                f"{cl.all_gather_gb_per_s:g}: row_wise's collectives (gloo "
                f"reduce_scatter_tensor forward, all_gather_into_tensor backward, as TorchRec "
                f"calls them) of {c.row_wise_bytes / 2**20:.2f} MiB per rank (input, resp. "
                f"output: a rank's row_wise share of those tables' pooled outputs): "
                f"{c.reduce_scatter_ms:.3f} ms, {c.all_gather_ms:.3f} ms.",
            ]
        if g is None:
            paragraphs.append(f"sharding_group_ms {cl.sharding_group_ms:g}: not measured (one "
                              "device per host).")
        else:
            per_type = ", ".join(f"{t} {ms:.2f}" for t, ms in g.fixed_ms.items())
            paragraphs.append(
                f"sharding_group_ms {cl.sharding_group_ms:g}: the fixed cost per step of one "
                f"sharding type a plan uses, on every rank: TorchRec EmbeddingBagCollection of "
                f"{g.tables} tables of {GROUP_TABLE_ROWS:,} rows x dim {g.embedding_dim} sharded "
                f"by DistributedModelParallel with only that type allowed (every rank one "
                f"shard), {g.batch_size} examples per rank, forward + backward, median step "
                f"minus the planner's estimate for it (at most "
                f"{max(g.estimated_ms.values()):.3f} ms); per type (ms): {per_type}; the median "
                "of these.")
        lines = []
        for i, text in enumerate(paragraphs):
            lines += textwrap.wrap(text, width=100, initial_indent=HEADER if i == 0 else
                                   _HEADER_CONT, subsequent_indent=_HEADER_CONT)
        return lines


def _gb_per_s(nbytes: float, ms: float) -> float:
    return nbytes / (ms / 1000) / GIB


def _round(value: float) -> float:
    return float(f"{value:.3g}")


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node() or 'this host'}, {model}, {os.cpu_count() or 1} cores"


def _rows_text(rows: list[int]) -> str:
    if min(rows) == max(rows):
        return f"{rows[0]:,} rows"
    return f"{min(rows):,} to {max(rows):,} rows ({sum(rows):,} in all)"


def estimator_lookup_bytes(table_rows: Sequence[int], embedding_dim: int, batch_size: int,
                           pooling: float) -> float:
    """Bytes TorchRec's perf estimator charges these tables (table_wise ``fused`` shards) for
    forward + backward compute when each sees ``batch_size`` examples of ``pooling`` ids: its
    compute time at a device bandwidth of 1 byte/ms (time is bytes / bandwidth)."""
    from torchrec.distributed.planner.constants import DEFAULT_PERF_ESTIMATOR
    from torchrec.distributed.planner.estimator.estimator import (
        EmbeddingPerfEstimatorFactory,
        get_embedding_perf_sharding_evaluator,
    )
    from torchrec.distributed.planner.estimator.types import ShardPerfContext

    config = EmbeddingPerfEstimatorFactory._registry[DEFAULT_PERF_ESTIMATOR.lower()]()
    evaluator = get_embedding_perf_sharding_evaluator("table_wise")
    total = 0.0
    for rows in table_rows:
        ctx = ShardPerfContext(sharding_type="table_wise", compute_kernel="fused",
                               hash_size=rows, emb_dim=embedding_dim, batch_sizes=[batch_size],
                               num_poolings=[1.0], input_lengths=[pooling], world_size=1,
                               local_world_size=1, device_bw=1.0)
        total += evaluator.compute_fwd_comp(ctx, config) + evaluator.compute_bwd_comp(ctx, config)
    return total


class _Ids:
    """Ids in ``[0, rows)`` of one table: rank ``k`` drawn with probability ~ ``k ** -a`` (the
    synthetic CTR generator's law) and mapped to a row by a fixed permutation, or uniform."""

    def __init__(self, rng: Any, rows: int, zipf_exponent: Optional[float]) -> None:
        import numpy as np

        self.rng, self.rows = rng, rows
        self.cdf = (np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -zipf_exponent)
                    if zipf_exponent else None)
        self.perm = rng.permutation(rows)

    def draw(self, count: int) -> Any:
        import numpy as np

        if self.cdf is None:
            return self.rng.integers(0, self.rows, size=count)
        ranks = np.searchsorted(self.cdf, self.rng.random(count) * self.cdf[-1])
        return self.perm[np.minimum(ranks, self.rows - 1)]


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def _measure_rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One spawned rank: the TBE timings (all ranks at once), then the collectives, then (with
    the bandwidths they give, the same on every rank) the tiny sharded models."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    steps, warmup = spec["steps"], spec["warmup"]
    table_rows, dim = spec["table_rows"], spec["embedding_dim"]
    tables = len(table_rows)
    torch.manual_seed(rank)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows in table_rows],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05,
        pooling_mode=PoolingMode.SUM)
    rng = np.random.default_rng([spec["seed"], rank])
    samplers = [_Ids(rng, rows, spec["zipf_exponent"]) for rows in table_rows]

    def batches(batch: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for _ in range(count):
            lengths = rng.poisson(spec["pooling"] - 1, size=tables * batch) + 1 \
                if spec["pooling"] > 1 else np.ones(tables * batch, dtype=np.int64)
            ids = np.concatenate([ids.draw(int(n)) for ids, n in
                                  zip(samplers, lengths.reshape(tables, batch).sum(1))])
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            out.append((torch.from_numpy(ids.astype(np.int64)),
                        torch.from_numpy(offsets.astype(np.int64))))
        return out

    def lookups(data: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        fwd, bwd = [], []
        for i in range(warmup + steps):
            ids, offsets = data[i % len(data)]
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            out = tbe(ids, offsets)
            t1 = time.perf_counter()
            out.sum().backward()
            t2 = time.perf_counter()
            if i >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        return _median_ms(fwd), _median_ms(bwd)

    fwd_ms, bwd_ms = lookups(batches(spec["batch_size"], 8))
    tiny_fwd, tiny_bwd = lookups(batches(TINY_BATCH, 8))
    result = {"forward_ms": fwd_ms, "backward_ms": bwd_ms, "tiny_call_ms": tiny_fwd + tiny_bwd,
              "threads": torch.get_num_threads()}
    if world == 1:
        return result

    # fp32 values in rows of dim, evenly split over the ranks; the async calls TorchRec makes
    n = max(world, spec["message_bytes"] // 4 // world * world)
    send, recv = torch.randn(n), torch.empty(n)
    tiny = torch.randn(max(world, TINY_MESSAGE_BYTES // 4))
    rows = max(world, spec["row_wise_bytes"] // 4 // dim // world * world)
    partial, reduced = torch.randn(rows, dim), torch.empty(rows // world, dim)
    grads, gathered = torch.randn(rows // world, dim), torch.empty(rows, dim)
    ops = {"all_to_all_ms": (dist.all_to_all_single, recv, send),
           "latency_ms": (dist.all_to_all_single, torch.empty_like(tiny), tiny),
           "reduce_scatter_ms": (dist.reduce_scatter_tensor, reduced, partial),
           "all_gather_ms": (dist.all_gather_into_tensor, gathered, grads)}
    times: dict[str, list[float]] = {key: [] for key in ops}
    for i in range(warmup + steps):  # interleaved, so that a slow moment hits them all alike
        for key, (op, *tensors) in ops.items():
            dist.barrier()
            t0 = time.perf_counter()
            op(*tensors, async_op=True).wait()
            if i >= warmup:
                times[key].append(time.perf_counter() - t0)
        if i % 8 == 7:  # gloo may reduce in place: keep the values from growing
            partial.copy_(torch.randn(rows, dim))
    result.update({key: _median_ms(samples) for key, samples in times.items()})

    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, result)
    cluster = _calibrated(spec["base"], spec, everyone)[0]
    result["groups"] = _measure_groups(rank, world, spec, cluster)
    return result


def _tiny_model(tables: int, dim: int, device: Any) -> Any:
    """An ``EmbeddingBagCollection`` ``ebc`` of ``tables`` tables (``t<i>``, feature ``f<i>``)
    of GROUP_TABLE_ROWS x ``dim``, in a module (what DistributedModelParallel wraps), with the
    row-wise Adagrad update fused into its backward (as embedtrain trains tables)."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    model = torch.nn.Module()
    model.ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=GROUP_TABLE_ROWS,
                            feature_names=[f"f{i}"]) for i in range(tables)], device=device)
    apply_optimizer_in_backward(RowWiseAdagrad, list(model.ebc.parameters()), {"lr": 0.05})
    return model


def _group_cluster(cluster: ClusterConfig, world: int) -> ClusterConfig:
    """The cluster the tiny models are planned on: ``world`` local ranks, TINY_BATCH examples
    per rank, no fixed group cost of its own (what is being measured)."""
    return dataclasses.replace(cluster, hosts=1, devices_per_host=world,
                               batch_size_per_rank=TINY_BATCH, sharding_group_ms=0.0)


def _measure_groups(rank: int, world: int, spec: dict[str, Any],
                    cluster: ClusterConfig) -> dict[str, dict[str, float]]:
    """Per sharding type: this rank's median forward + backward of a tiny model planned with
    only that type allowed and sharded by DistributedModelParallel, and the planner's estimate
    of this rank's time for it (``cluster``: the calibrated bandwidths)."""
    import gc

    import torch
    import torch.distributed as dist
    from torchrec import KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    from embedtrain.sharding.planner import plan_sharding
    from embedtrain.sharding.sharders import embedding_sharders
    from embedtrain.sharding.types import PlannerOptions, ShardingType

    steps, warmup, dim = spec["steps"], spec["warmup"], spec["embedding_dim"]
    tables = world  # one per rank: every rank gets a shard (a lookup) in each type's plan
    tiny = _group_cluster(cluster, world)
    env = ShardingEnv.from_process_group(dist.GroupMember.WORLD)
    generator = torch.Generator().manual_seed(spec["seed"] * 1000 + rank)
    inputs = [KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(tables)],
        values=torch.randint(0, GROUP_TABLE_ROWS, (tables * TINY_BATCH,), generator=generator),
        lengths=torch.ones(tables * TINY_BATCH, dtype=torch.int32)) for _ in range(4)]
    models, estimated = {}, {}
    for kind in spec["group_sharding_types"]:
        plan = plan_sharding(_tiny_model(tables, dim, torch.device("meta")), tiny,
                             PlannerOptions(sharding_types=[ShardingType(kind)]))
        estimated[kind] = plan.report.ranks[rank].time_ms.embedding_total
        torch.manual_seed(spec["seed"])
        dmp = DistributedModelParallel(_tiny_model(tables, dim, torch.device("meta")),
                                       device=torch.device("cpu"), plan=plan.sharding_plan,
                                       sharders=embedding_sharders(), env=env)
        models[kind] = dmp.module.ebc

    def step(kind: str, i: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        models[kind](inputs[i % len(inputs)]).wait().values().sum().backward()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {kind: [] for kind in models}
    for kind in models:
        for i in range(warmup):
            step(kind, i)
    rounds = 5  # interleaved (order rotated), so that a slow moment hits all types alike
    kinds = list(models)
    gc.collect()
    gc.disable()  # no collector pauses inside the timed steps
    try:
        for r in range(rounds):
            for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                for i in range(-(-steps // rounds)):
                    times[kind].append(step(kind, i))
    finally:
        gc.enable()
    return {kind: {"ms": _median_ms(times[kind]), "estimated_ms": estimated[kind]}
            for kind in kinds}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, spec: dict[str, Any], out: str,
           timeout: float) -> None:
    """A spawned rank: joins the gloo group, measures, writes ``rank<r>.json`` (or ``.err``)."""
    import torch
    import torch.distributed as dist

    code = 0
    warnings.filterwarnings("ignore")  # this process only: TorchRec's set-up chatter
    logging.disable(logging.WARNING)
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # a training rank's share
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout))
        result = _measure_rank(rank, world, spec)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        code = 1
        Path(out, f"rank{rank}.err").write_text(f"{type(e).__name__}: {e}".splitlines()[0])
    # gloo's worker threads may still hold Python objects: leave without interpreter
    # finalization, which would abort on them (see embedtrain.train.dist)
    os._exit(code)


def _spawn_ranks(world: int, spec: dict[str, Any], timeout: float) -> list[dict[str, float]]:
    """:func:`_measure_rank` on ``world`` spawned gloo processes on 127.0.0.1, in rank order."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="embedtrain-calibrate-") as out:
        port = _free_port()
        procs = [ctx.Process(target=_child, daemon=True, name=f"calibrate-rank{r}",
                             args=(r, world, port, spec, out, timeout)) for r in range(world)]
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.start()
            while any(proc.exitcode is None for proc in procs):
                failed = [proc for proc in procs if proc.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for proc in procs:
                if proc.exitcode is None:
                    proc.kill()
                proc.join()
        for r, proc in enumerate(procs):
            err = Path(out, f"rank{r}.err")
            if err.exists():
                raise CalibrationError(f"calibrate: rank {r} failed: {err.read_text()}")
        for r, proc in enumerate(procs):
            if proc.exitcode != 0:
                why = (f"timed out after {timeout:g} s" if time.monotonic() > deadline
                       else f"died with exit code {proc.exitcode}")
                raise CalibrationError(f"calibrate: rank {r} {why}")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def calibrate(
    base: ClusterConfig,
    *,
    table_rows: Sequence[int] = DEMO_RANK_TABLE_ROWS,
    embedding_dim: int = 16,
    pooling: float = 1.0,
    batch_size: Optional[int] = None,
    zipf_exponent: Optional[float] = 1.1,
    steps: int = 50,
    warmup: int = 5,
    seed: int = 0,
    group_sharding_types: Sequence[str] = GROUP_SHARDING_TYPES,
    timeout: float = 300.0,
) -> Calibration:
    """Measures ``base``'s lookup and collective bandwidths and its fixed cost per sharding
    group on this machine (a CPU cluster).

    Spawns ``base.devices_per_host`` gloo processes on 127.0.0.1 (each with the thread count a
    training rank gets: cores // ranks), times an FBGEMM TBE forward + backward on all of them at
    once, then the collectives between them, and converts the medians into the GB/s that make
    TorchRec's estimator formulas reproduce them; then times a tiny sharded
    ``EmbeddingBagCollection`` per sharding type for ``sharding_group_ms`` (see the module
    docstring). With one device per host only the lookups are timed, in this process. The
    defaults are one rank's share of the demo DLRM (13 of its 26 tables, dim 16, the global
    batch of 2048); about 10 seconds on 2 ranks.

    The caller's main module must be importable without side effects (``if __name__ ==
    "__main__":``), as for any spawned process.

    Args:
        base: the cluster to calibrate; only ``device: cpu`` clusters can be measured here.
        table_rows, embedding_dim: the tables one rank holds (rows of each; fp32, one TBE):
            ideally about one rank's share of the model's tables.
        pooling: ids per example per table (> 1: Poisson-distributed bag sizes of that mean).
        batch_size: examples per table per call (default ``base.batch_size_per_rank x
            base.world_size``, the global batch a table_wise shard looks up).
        zipf_exponent: skew of the ids (the synthetic CTR data's 1.1); ``None``: uniform.
        steps, warmup: timed and untimed repetitions of every measurement.
        seed: of the ids and weights.
        group_sharding_types: the sharding types whose tiny models ``sharding_group_ms`` is the
            median of (not ``data_parallel``).
        timeout: seconds for the whole measurement (the processes are then killed).

    Returns:
        The :class:`Calibration`: ``base`` with ``ddr_bandwidth_gb_per_s`` (and, with several
        devices per host, ``intra_host_gb_per_s``, ``reduce_scatter_gb_per_s``,
        ``all_gather_gb_per_s`` and ``sharding_group_ms``) measured, and the figures behind them.

    Raises:
        CalibrationError: ``base`` is not a CPU cluster, or an argument is out of range.
    """
    if base.device is not DeviceKind.CPU:
        raise CalibrationError(f"cluster {base.name}: only device: cpu clusters can be calibrated "
                               f"on this machine (device: {base.device.value})")
    table_rows = [int(r) for r in table_rows]
    for name, value in (("table_rows", min(table_rows, default=0)),
                        ("embedding_dim", embedding_dim), ("steps", steps)):
        if value < 1:
            raise CalibrationError(f"calibrate: {name} must be at least 1, got {value}")
    if not pooling >= 1 or warmup < 0 or (batch_size is not None and batch_size < 1):
        raise CalibrationError(f"calibrate: pooling must be >= 1, warmup >= 0 and batch_size >= 1 "
                               f"(got {pooling}, {warmup}, {batch_size})")
    try:
        kinds = [ShardingType(t).value for t in group_sharding_types]
    except ValueError as e:
        raise CalibrationError(f"calibrate: group_sharding_types: {e}") from None
    if not kinds or ShardingType.DATA_PARALLEL.value in kinds:
        raise CalibrationError(f"calibrate: group_sharding_types must name at least one sharding "
                               f"type other than data_parallel (got {kinds})")
    import fbgemm_gpu
    import torch

    batch = batch_size or base.batch_size_per_rank * base.world_size
    ranks = base.devices_per_host
    message = batch * embedding_dim * 4 * len(table_rows)
    spec = dict(base=base, table_rows=table_rows, embedding_dim=embedding_dim, pooling=pooling,
                batch_size=batch, zipf_exponent=zipf_exponent, steps=steps, warmup=warmup,
                seed=seed, message_bytes=message, row_wise_bytes=ranks * message,
                group_sharding_types=kinds)
    # one device per host: no collective to time, the lookups run in this process
    measured = ([_measure_rank(0, 1, spec)] if ranks == 1
                else _spawn_ranks(ranks, spec, timeout))
    cluster, lookup, comms = _calibrated(base, spec, measured)
    groups = None
    if ranks > 1:
        groups = _group_timing([m["groups"] for m in measured], embedding_dim)
        cluster = dataclasses.replace(cluster,
                                      sharding_group_ms=_round(max(0.0, groups.sharding_group_ms)))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return Calibration(cluster=cluster, lookup=lookup, comms=comms, groups=groups,
                       measured_at=when, machine=_machine(),
                       software=f"torch {torch.__version__}, fbgemm_gpu {fbgemm_gpu.__version__}",
                       steps=steps)


def _group_timing(per_rank: list[dict[str, dict[str, float]]], embedding_dim: int
                  ) -> GroupTiming:
    """The ranks' :func:`_measure_groups` results averaged over ranks, per sharding type, and
    their ``sharding_group_ms``: the median over the types of measured - estimated."""
    kinds = list(per_rank[0])
    mean = {key: {k: statistics.fmean(r[k][key] for r in per_rank) for k in kinds}
            for key in ("ms", "estimated_ms")}
    groups = GroupTiming(ranks=len(per_rank), tables=len(per_rank), embedding_dim=embedding_dim,
                         batch_size=TINY_BATCH, measured_ms=mean["ms"],
                         estimated_ms=mean["estimated_ms"], sharding_group_ms=0.0)
    groups.sharding_group_ms = statistics.median(groups.fixed_ms.values())
    return groups


def _calibrated(base: ClusterConfig, spec: dict[str, Any], measured: list[dict[str, Any]]
                ) -> tuple[ClusterConfig, LookupTiming, Optional[CommTiming]]:
    """``base`` with the bandwidths the ranks' lookup and collective timings give (not yet
    ``sharding_group_ms``), and those timings averaged over the ranks. Also run by every rank
    (on all ranks' timings), to plan the tiny models with the calibrated bandwidths."""

    def mean(key: str) -> float:
        return statistics.fmean(m[key] for m in measured)

    ranks, message = len(measured), spec["message_bytes"]
    charged = estimator_lookup_bytes(spec["table_rows"], spec["embedding_dim"],
                                     spec["batch_size"], spec["pooling"])
    lookup = LookupTiming(table_rows=spec["table_rows"], embedding_dim=spec["embedding_dim"],
                          batch_size=spec["batch_size"], pooling=spec["pooling"],
                          zipf_exponent=spec["zipf_exponent"], ranks=ranks,
                          threads=int(measured[0]["threads"]), forward_ms=mean("forward_ms"),
                          backward_ms=mean("backward_ms"), estimator_bytes=charged,
                          gb_per_s=0.0, tiny_call_ms=mean("tiny_call_ms"))
    lookup.gb_per_s = _gb_per_s(charged, lookup.total_ms)
    changes = {"ddr_bandwidth_gb_per_s": _round(lookup.gb_per_s)}
    comms = None
    if ranks > 1:
        a2a = mean("all_to_all_ms")
        comms = CommTiming(ranks=ranks, message_bytes=message, all_to_all_ms=a2a,
                           gb_per_s=_gb_per_s(message, a2a), latency_ms=mean("latency_ms"),
                           row_wise_bytes=spec["row_wise_bytes"],
                           reduce_scatter_ms=mean("reduce_scatter_ms"),
                           all_gather_ms=mean("all_gather_ms"))
        changes.update(intra_host_gb_per_s=_round(comms.gb_per_s),
                       reduce_scatter_gb_per_s=_round(comms.reduce_scatter_gb_per_s),
                       all_gather_gb_per_s=_round(comms.all_gather_gb_per_s))
    return dataclasses.replace(base, **changes), lookup, comms


def calibrate_cluster(base: ClusterConfig, **kwargs: Any) -> ClusterConfig:
    """``base`` with its bandwidths measured on this machine: :func:`calibrate`'s cluster
    (same keyword arguments)."""
    return calibrate(base, **kwargs).cluster


def measured_fields(calibration: Calibration) -> set[str]:
    """The cluster fields ``calibration`` measured (the others are ``base``'s)."""
    fields = {"ddr_bandwidth_gb_per_s"}
    if calibration.comms is not None:
        fields |= {"intra_host_gb_per_s", "reduce_scatter_gb_per_s", "all_gather_gb_per_s"}
    if calibration.groups is not None:
        fields.add("sharding_group_ms")
    return fields


_KEY_LINE = re.compile(r"^(?P<key>[A-Za-z_]\w*):(?P<value>[^#]*?)\s*(?P<comment>#.*)?$")
_COMMENT_COLUMN = 31  # where the cluster files' end-of-line comments start (0-based)


def cluster_yaml(calibration: Calibration, template: Optional[str] = None) -> str:
    """The calibrated cluster as YAML text, its header saying when and how it was measured.

    Args:
        calibration: what :func:`calibrate` returned.
        template: an existing cluster file's text to keep (its comments, key order and any
            keys it leaves out): the calibrated keys' values are replaced in place (those it
            lacks are added at its end), an earlier calibration header is replaced, the new one
            goes after its leading comment lines.
            ``None``: every field of :class:`ClusterConfig`, in order.

    Returns:
        The file's text (loadable by :func:`embedtrain.config.load_cluster`).
    """
    header = calibration.header()
    values = to_dict(calibration.cluster)
    if template is None:
        body = [f"{k}: {_yaml_scalar(v)}" for k, v in values.items()]
        return "\n".join(header + body) + "\n"
    lines = template.splitlines()
    kept: list[str] = []
    skipping = False
    for line in lines:  # drop an earlier calibration header
        if line.startswith(HEADER):
            skipping = True
            continue
        if skipping and line.startswith(_HEADER_CONT):
            continue
        skipping = False
        kept.append(line)
    lead = 0
    while lead < len(kept) and kept[lead].startswith("#"):
        lead += 1
    measured = measured_fields(calibration)
    seen = set()
    body = []
    for line in kept[lead:]:
        m = _KEY_LINE.match(line)
        if m and m["key"] in measured:
            seen.add(m["key"])
            comment = m["comment"] or ""
            column = line.index(comment) if comment else _COMMENT_COLUMN
            if "calibrated" not in comment:
                comment = (comment + "; " if comment else "# ") + "calibrated, see the header"
            text = f"{m['key']}: {_yaml_scalar(values[m['key']])}"
            line = f"{text.ljust(column - 1)} {comment}"
        body.append(line)
    for key in [k for k in values if k in measured and k not in seen]:  # in field order
        body.append(f"{f'{key}: {_yaml_scalar(values[key])}'.ljust(_COMMENT_COLUMN - 1)} "
                    "# calibrated, see the header")
    return "\n".join(kept[:lead] + header + body) + "\n"


def _yaml_scalar(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def write_cluster_yaml(calibration: Calibration, path: str | os.PathLike,
                       template: Optional[str | os.PathLike] = None) -> None:
    """Writes :func:`cluster_yaml` to ``path`` (``template``: a cluster file whose comments and
    layout to keep, read before ``path`` is written, so it may be ``path`` itself)."""
    text = Path(template).read_text() if template is not None else None
    Path(path).write_text(cluster_yaml(calibration, text))
