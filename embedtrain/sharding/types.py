"""The sharding layer's vocabulary: sharding types, kernels, clusters, constraints, options.

Plain enums and dataclasses with no torch import: the config schema, the cluster files
(``configs/clusters/*.yaml``) and the planner share them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from embedtrain.config_io import FRACTION, NON_NEGATIVE, POSITIVE, PROBABILITY, config_field


class ShardingType(enum.Enum):
    """How one embedding table (or class head) is split across ranks (TorchRec's names)."""

    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_ROW_WISE = "table_row_wise"
    TABLE_COLUMN_WISE = "table_column_wise"
    DATA_PARALLEL = "data_parallel"


class ComputeKernel(enum.Enum):
    """Where a shard's rows live and which kernel looks them up (TorchRec's names)."""

    DENSE = "dense"  # plain tensor; only for data_parallel
    FUSED = "fused"  # FBGEMM TBE with the optimizer fused, rows in device memory (HBM)
    FUSED_UVM = "fused_uvm"  # rows in host memory (UVM), read over PCIe
    FUSED_UVM_CACHING = "fused_uvm_caching"  # rows in host memory, hot rows cached in HBM


class CommPrecision(enum.Enum):
    """Precision of the embedding all-to-all (TorchRec qcomms); lower halves the bytes sent."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"


class DenseAllReduce(enum.Enum):
    """How the dense gradients are all-reduced (DDP communication hooks)."""

    FP32 = "fp32"  # plain all-reduce
    BF16 = "bf16"  # compress to bfloat16 for the wire (half the bytes)
    FP16 = "fp16"  # compress to float16
    POWERSGD = "powersgd"  # low-rank PowerSGD compression (with error feedback)


class DeviceKind(enum.Enum):
    """The kind of device a cluster's ranks compute on."""

    CUDA = "cuda"
    CPU = "cpu"


class MemoryTier(enum.Enum):
    """Where a rank's embedding rows live: device memory (GPU) or host memory."""

    HBM = "hbm"
    DDR = "ddr"


@dataclass
class ClusterConfig:
    """A target cluster for planning and training (``configs/clusters/*.yaml``).

    Memory sizes are GiB per device; bandwidths are GB/s (1 GB = 2^30 bytes, as TorchRec's
    planner counts), so a 25 Gbit/s network is ``inter_host_gb_per_s: 2.9``.
    """

    # shown in plans and sweeps; plan's default --out is plans/<config>-<name>
    name: str = "local"
    # machines (plan --hosts overrides it)
    hosts: int = config_field(1, check=POSITIVE)
    # ranks per host: GPUs, or processes on cpu
    devices_per_host: int = config_field(1, check=POSITIVE)
    # what the ranks compute on: cuda or cpu
    device: DeviceKind = DeviceKind.CUDA
    hbm_gb: float = config_field(80.0, check=POSITIVE)  # device memory per GPU (unused for cpu)
    ddr_gb: float = config_field(128.0, check=POSITIVE)  # host memory per device (per rank)
    hbm_bandwidth_gb_per_s: float = config_field(897.0, check=POSITIVE)  # device memory
    ddr_bandwidth_gb_per_s: float = config_field(51.0, check=POSITIVE)  # host memory
    intra_host_gb_per_s: float = config_field(600.0, check=POSITIVE)  # a host's GPUs (NVLink)
    inter_host_gb_per_s: float = config_field(12.5, check=POSITIVE)  # network, per device
    # examples per rank a step, for plan's estimates (train: data.batch_size / ranks)
    batch_size_per_rank: int = config_field(512, check=POSITIVE)
    reserved_fraction: float = config_field(0.1, check=PROBABILITY)  # device memory kept free
    # What TorchRec's time model has no term for (0: none; set by `embedtrain plan --calibrate`):
    # the fixed time per step, on every rank, of each sharding type a plan uses (its input
    # distribution, lookup call and output distribution, however small the batch), and the
    # bandwidths of row-wise's reduce-scatter / all-gather within a host where they differ from
    # the all-to-all's (across hosts: inter_host_gb_per_s).
    sharding_group_ms: float = config_field(0.0, check=NON_NEGATIVE)
    # row_wise's reduce-scatter within a host (0: as the all-to-all)
    reduce_scatter_gb_per_s: float = config_field(0.0, check=NON_NEGATIVE)
    # row_wise's all-gather within a host (0: as the all-to-all)
    all_gather_gb_per_s: float = config_field(0.0, check=NON_NEGATIVE)

    @property
    def world_size(self) -> int:
        return self.hosts * self.devices_per_host


@dataclass
class TableConstraint:
    """Constraints for the tables whose names match ``tables`` (names or globs, e.g. ``t_C*``).

    Empty lists mean "no constraint"; ``pooling_factor`` overrides the one measured from data.
    """

    # the tables this entry is for: names or globs
    tables: list[str] = field(default_factory=list)
    # the sharding types the planner may give them (empty: any)
    sharding_types: list[ShardingType] = field(default_factory=list)
    # the kernels the planner may give them (empty: any)
    compute_kernels: list[ComputeKernel] = field(default_factory=list)
    # fraction of rows cached in HBM (uvm_caching)
    cache_load_factor: Optional[float] = config_field(None, check=FRACTION)
    pooling_factor: Optional[float] = config_field(None, check=POSITIVE)  # mean ids per example


@dataclass
class PlannerOptions:
    """What the planner may choose from, and how the embedding all-to-all is encoded.

    These are the fields of a training config's ``sharding:`` section, in its order (the plan
    report echoes them as ``plan.json``'s ``sharding``), so the config schema can use this class
    for that section as it does :class:`ClusterConfig` and :class:`TableConstraint`.
    ``pooling_factors_from_data`` is the caller's: whether it measured the pooling factors it
    passes to the planner; the planner only records it.
    """

    # Empty: all but data_parallel, which is used only where listed (globally or per table): it
    # replicates the table, all-reduces its gradient every step and hands it to the dense optimizer.
    sharding_types: list[ShardingType] = field(default_factory=list)
    compute_kernels: list[ComputeKernel] = field(default_factory=list)  # empty: all
    tables: list[TableConstraint] = field(default_factory=list)  # later entries win
    # the embedding all-to-all's precision in the forward pass (TorchRec qcomms)
    forward_comm_precision: CommPrecision = CommPrecision.FP32
    # the embedding all-to-all's precision in the backward pass (TorchRec qcomms)
    backward_comm_precision: CommPrecision = CommPrecision.FP32
    pooling_factors_from_data: bool = True  # measure mean ids per example from the train split
    # how DDP all-reduces the dense gradients: fp32, bf16, fp16 or powersgd
    dense_allreduce: DenseAllReduce = DenseAllReduce.FP32
    powersgd_rank: int = config_field(2, check=POSITIVE)  # matrix rank of PowerSGD's approximation
    # extra partitions the planner's local search may try
    search_budget: int = config_field(48, check=NON_NEGATIVE)
    # a table whose weights are smaller is placed whole on one rank (table_wise) unless its
    # sharding types are given: spreading a few rows over many ranks only adds messages
    tiny_table_bytes: int = config_field(1 << 20, check=NON_NEGATIVE)
