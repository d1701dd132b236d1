"""A cluster description (:class:`~embedtrain.sharding.types.ClusterConfig`) as TorchRec objects.

Example:
    >>> cluster = load_cluster("configs/clusters/h100-16x8.yaml")
    >>> topology(cluster).world_size
    128
"""

from __future__ import annotations

from torchrec.distributed.planner import Topology

from embedtrain.sharding.types import ClusterConfig, DeviceKind, MemoryTier

GIB = 1024**3


def _bytes_per_ms(gb_per_s: float) -> float:
    return gb_per_s * GIB / 1000  # TorchRec's planner works in bytes/ms


def topology(cluster: ClusterConfig) -> Topology:
    """The TorchRec :class:`Topology` of ``cluster``: capacities and bandwidths per device.

    On a ``cpu`` cluster a rank's tables live in host memory, so its "device memory" is its DDR.
    """
    cpu = cluster.device is DeviceKind.CPU
    return Topology(
        world_size=cluster.world_size,
        local_world_size=cluster.devices_per_host,
        compute_device=cluster.device.value,
        hbm_cap=0 if cpu else int(cluster.hbm_gb * GIB),
        ddr_cap=int(cluster.ddr_gb * GIB),
        hbm_mem_bw=_bytes_per_ms(cluster.hbm_bandwidth_gb_per_s),
        ddr_mem_bw=_bytes_per_ms(cluster.ddr_bandwidth_gb_per_s),
        intra_host_bw=_bytes_per_ms(cluster.intra_host_gb_per_s),
        inter_host_bw=_bytes_per_ms(cluster.inter_host_gb_per_s),
    )


def device_memory_tier(cluster: ClusterConfig) -> MemoryTier:
    """Where a rank's "fast" memory is: HBM on GPU clusters, DDR on CPU ones."""
    return MemoryTier.DDR if cluster.device is DeviceKind.CPU else MemoryTier.HBM


def tier_capacity(cluster: ClusterConfig, tier: MemoryTier) -> int:
    """Bytes of ``tier`` memory one rank of ``cluster`` has (as the cluster file says)."""
    return int((cluster.hbm_gb if tier is MemoryTier.HBM else cluster.ddr_gb) * GIB)
