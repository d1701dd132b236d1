"""What each rank of a calibration measures, and the timings and cluster figures it gives.

:func:`measure_rank` runs on every rank (spawned by :func:`embedtrain.sharding.calibrate.calibrate`,
or in the caller's process for one device per host): FBGEMM's CPU TBE forward + backward, the
gloo collectives TorchRec's shardings run, then a tiny sharded ``EmbeddingBagCollection`` per
sharding type. :func:`calibrated` and :func:`group_timing` turn the ranks' results into
:class:`LookupTiming`, :class:`CommTiming`, :class:`GroupTiming` and the cluster's bandwidths;
:mod:`embedtrain.sharding.calibrate` says what each figure is and how it is measured.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from embedtrain.sharding.types import ClusterConfig

GIB = 1024**3
TINY_BATCH = 8  # examples (per rank) of the "nearly empty" calls that measure fixed costs
TINY_MESSAGE_BYTES = 64  # bytes per rank of the all-to-all that measures a collective's latency
GROUP_TABLE_ROWS = 1000  # rows of each table of the tiny models measuring sharding_group_ms


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


def _gb_per_s(nbytes: float, ms: float) -> float:
    return nbytes / (ms / 1000) / GIB


def rounded(value: float) -> float:
    """``value`` to three significant digits, as the cluster files hold the measured figures."""
    return float(f"{value:.3g}")


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


def measure_rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
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
    cluster = calibrated(spec["base"], spec, everyone)[0]
    result["groups"] = _measure_groups(rank, world, spec, cluster)
    return result


def tiny_model(tables: int, dim: int, device: Any) -> Any:
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


def group_cluster(cluster: ClusterConfig, world: int) -> ClusterConfig:
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
    tiny = group_cluster(cluster, world)
    env = ShardingEnv.from_process_group(dist.GroupMember.WORLD)
    generator = torch.Generator().manual_seed(spec["seed"] * 1000 + rank)
    inputs = [KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(tables)],
        values=torch.randint(0, GROUP_TABLE_ROWS, (tables * TINY_BATCH,), generator=generator),
        lengths=torch.ones(tables * TINY_BATCH, dtype=torch.int32)) for _ in range(4)]
    models, estimated = {}, {}
    for kind in spec["group_sharding_types"]:
        plan = plan_sharding(tiny_model(tables, dim, torch.device("meta")), tiny,
                             PlannerOptions(sharding_types=[ShardingType(kind)]))
        estimated[kind] = plan.report.ranks[rank].time_ms.embedding_total
        torch.manual_seed(spec["seed"])
        dmp = DistributedModelParallel(tiny_model(tables, dim, torch.device("meta")),
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


def measure_spawned_rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """:func:`measure_rank` on a rank of :func:`embedtrain.processes.spawn`, without TorchRec's
    set-up chatter (warnings and log records below errors, in that process only)."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    return measure_rank(rank, world, spec)


def group_timing(per_rank: list[dict[str, dict[str, float]]], embedding_dim: int
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


def calibrated(base: ClusterConfig, spec: dict[str, Any], measured: list[dict[str, Any]]
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
    changes = {"ddr_bandwidth_gb_per_s": rounded(lookup.gb_per_s)}
    comms = None
    if ranks > 1:
        a2a = mean("all_to_all_ms")
        comms = CommTiming(ranks=ranks, message_bytes=message, all_to_all_ms=a2a,
                           gb_per_s=_gb_per_s(message, a2a), latency_ms=mean("latency_ms"),
                           row_wise_bytes=spec["row_wise_bytes"],
                           reduce_scatter_ms=mean("reduce_scatter_ms"),
                           all_gather_ms=mean("all_gather_ms"))
        changes.update(intra_host_gb_per_s=rounded(comms.gb_per_s),
                       reduce_scatter_gb_per_s=rounded(comms.reduce_scatter_gb_per_s),
                       all_gather_gb_per_s=rounded(comms.all_gather_gb_per_s))
    return dataclasses.replace(base, **changes), lookup, comms
