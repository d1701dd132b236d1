"""A cluster description (:class:`~embedtrain.sharding.types.ClusterConfig`) as TorchRec objects.

Example:
    >>> cluster = load_cluster("configs/clusters/h100-16x8.yaml")
    >>> topology(cluster).world_size
    128
"""

from __future__ import annotations

from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.types import BasicCommsBandwidths, CollectiveType

from embedtrain.sharding.types import ClusterConfig, DeviceKind, MemoryTier

GIB = 1024**3


def _bytes_per_ms(gb_per_s: float) -> float:
    return gb_per_s * GIB / 1000  # TorchRec's planner works in bytes/ms


class CollectiveBandwidths(BasicCommsBandwidths):
    """TorchRec's bandwidths (intra-host, inter-host), with reduce-scatter and all-gather at
    their own rates within a host where a cluster file gives them (bytes/ms; 0: as the
    all-to-all); across hosts they stay at the inter-host rate."""

    def __init__(self, inter_host_bw: float, intra_host_bw: float, reduce_scatter_bw: float,
                 all_gather_bw: float) -> None:
        super().__init__(inter_host_bw=inter_host_bw, intra_host_bw=intra_host_bw)
        self.name = "CollectiveBandwidths"
        self._own = {CollectiveType.REDUCE_SCATTER: reduce_scatter_bw,
                     CollectiveType.ALL_GATHER: all_gather_bw}

    def get_bw(self, local_world_size: int, world_size: int,
               collective_type: CollectiveType) -> float:
        if world_size <= local_world_size and self._own.get(collective_type):
            return self._own[collective_type]  # measured between a host's ranks
        return super().get_bw(local_world_size, world_size, collective_type)

    def __hash__(self) -> int:
        return hash((super().__hash__(), tuple(self._own.values())))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, CollectiveBandwidths) and super().__eq__(other)
                and self._own == other._own)


def topology(cluster: ClusterConfig) -> Topology:
    """The TorchRec :class:`Topology` of ``cluster``: capacities and bandwidths per device.

    On a ``cpu`` cluster a rank's tables live in host memory, so its "device memory" is its DDR.
    Reduce-scatter and all-gather get their own bandwidths where the file gives them.
    """
    cpu = cluster.device is DeviceKind.CPU
    own = cluster.reduce_scatter_gb_per_s or cluster.all_gather_gb_per_s
    comms = CollectiveBandwidths(
        inter_host_bw=_bytes_per_ms(cluster.inter_host_gb_per_s),
        intra_host_bw=_bytes_per_ms(cluster.intra_host_gb_per_s),
        reduce_scatter_bw=_bytes_per_ms(cluster.reduce_scatter_gb_per_s),
        all_gather_bw=_bytes_per_ms(cluster.all_gather_gb_per_s)) if own else None
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
        generalized_comms_bandwidths=comms,
    )


def device_memory_tier(cluster: ClusterConfig) -> MemoryTier:
    """Where a rank's "fast" memory is: HBM on GPU clusters, DDR on CPU ones."""
    return MemoryTier.DDR if cluster.device is DeviceKind.CPU else MemoryTier.HBM


def tier_capacity(cluster: ClusterConfig, tier: MemoryTier) -> int:
    """Bytes of ``tier`` memory one rank of ``cluster`` has (as the cluster file says)."""
    return int((cluster.hbm_gb if tier is MemoryTier.HBM else cluster.ddr_gb) * GIB)
