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
    >>> write_cluster_yaml(cal, "configs/clusters/cpu-1x2.yaml",  # from calibrate_file
    ...                    template="configs/clusters/cpu-1x2.yaml")

What each rank measures and the figures it gives are in
:mod:`embedtrain.sharding.calibrate_measure` (its ranks run on :func:`embedtrain.processes.spawn`);
the cluster-file writer, :func:`~embedtrain.sharding.calibrate_file.write_cluster_yaml`, in
:mod:`embedtrain.sharding.calibrate_file`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from embedtrain.processes import RankError, spawn
from embedtrain.sharding.calibrate_measure import (
    GROUP_TABLE_ROWS,
    TINY_BATCH,
    TINY_MESSAGE_BYTES,
    CommTiming,
    GroupTiming,
    LookupTiming,
    calibrated,
    group_timing,
    measure_rank,
    measure_spawned_rank,
    rounded,
)
from embedtrain.sharding.types import ClusterConfig, DeviceKind, ShardingType

HEADER = "# Calibrated "  # first line of the header block write_cluster_yaml writes
HEADER_CONT = "#   "  # its following lines
# one rank's share of the demo DLRM's 26 tables (every other one, sorted by size)
DEMO_RANK_TABLE_ROWS = (4, 10, 23, 54, 128, 303, 1111, 2639, 6271, 14903, 35416, 84161, 200000)
# the sharding types whose fixed cost per step sharding_group_ms is the median of (data_parallel
# has none: no input or output dist)
GROUP_SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise",
                        "table_column_wise")


class CalibrationError(ValueError):
    """The cluster cannot be calibrated here; the message is one line saying why."""


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
                                   HEADER_CONT, subsequent_indent=HEADER_CONT)
        return lines


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


def _spawn_ranks(world: int, spec: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """:func:`measure_rank` on ``world`` spawned gloo processes on 127.0.0.1, in rank order."""
    try:
        return spawn(measure_spawned_rank, world, spec, timeout=timeout)
    except RankError as e:
        raise CalibrationError(f"calibrate: rank {e.rank} failed: {e.summary}") from None
    except TimeoutError:
        raise CalibrationError(f"calibrate: timed out after {timeout:g} s") from None


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
    measured = ([measure_rank(0, 1, spec)] if ranks == 1
                else _spawn_ranks(ranks, spec, timeout))
    cluster, lookup, comms = calibrated(base, spec, measured)
    groups = None
    if ranks > 1:
        groups = group_timing([m["groups"] for m in measured], embedding_dim)
        cluster = dataclasses.replace(cluster,
                                      sharding_group_ms=rounded(max(0.0, groups.sharding_group_ms)))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return Calibration(cluster=cluster, lookup=lookup, comms=comms, groups=groups,
                       measured_at=when, machine=_machine(),
                       software=f"torch {torch.__version__}, fbgemm_gpu {fbgemm_gpu.__version__}",
                       steps=steps)
