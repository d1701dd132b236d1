"""Device memory set aside before tables are placed: dense model, its optimizer, inputs, slack.

TorchRec's default (``HeuristicalStorageReservation``) keeps 15 % of HBM plus a dense-model
estimate that its own log calls unreliable on ``meta``. This reservation counts each part from
the model and the run settings, and keeps the figures so the report can show them per rank:

* ``dense_model`` / ``dense_gradients`` / ``dense_optimizer``: every parameter outside the
  sharded embedding modules is replicated on every rank (data parallel), with a gradient and
  the dense optimizer's state (Adam: 2 values per parameter, Adagrad: 1, SGD: 0);
* ``kjt_buffers``: the sparse input of ``pipeline_batches`` batches in flight (ids as int64 plus
  int32 lengths), from the per-table pooling factors;
* ``reserved``: ``reserved_fraction`` of the device memory (allocator, activations, context).

Example:
    >>> reservation = ExplicitStorageReservation(0.1, dense_optimizer_slots=2)
    >>> left = reservation.reserve(topology, 512, model, sharders, constraints)
"""

from __future__ import annotations

import copy
from typing import Optional

from torch import nn
from torchrec.distributed.planner.constants import POOLING_FACTOR
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    StorageReservation,
    Topology,
)
from torchrec.distributed.planner.utils import sharder_name
from torchrec.distributed.types import ModuleSharder

from embedtrain.sharding.types import MemoryTier

ID_BYTES = 8  # int64 ids (TBE converts int32 ids to int64 anyway)
LENGTH_BYTES = 4


class ExplicitStorageReservation(StorageReservation):
    """Reserves per-rank memory for the dense model, inputs and slack, itemised.

    Args:
        reserved_fraction: share of each device's memory kept free.
        dense_optimizer_slots: optimizer values per dense parameter (Adam 2, Adagrad 1, SGD 0).
        pipeline_batches: sparse input batches resident at once (the sparse-dist pipeline keeps
            three: the one computing, the one being distributed, the one being copied in).
        extra: more named per-rank reservations (e.g. a class head's logits), bytes.
    """

    def __init__(self, reserved_fraction: float, dense_optimizer_slots: int,
                 pipeline_batches: int = 3, extra: Optional[dict[str, int]] = None) -> None:
        self.reserved_fraction = reserved_fraction
        self.extra = dict(extra or {})
        self.dense_optimizer_slots = dense_optimizer_slots
        self.pipeline_batches = pipeline_batches
        self.breakdown: dict[str, int] = {}
        self.dense_shapes: list[tuple[int, ...]] = []  # of the data-parallel dense parameters
        self.tier = MemoryTier.HBM  # where the dense model lives (DDR on CPU), set by reserve()
        self._last: Optional[Topology] = None

    def reserve(
        self,
        topology: Topology,
        batch_size: int,
        module: nn.Module,
        sharders: list[ModuleSharder[nn.Module]],
        constraints: Optional[dict[str, ParameterConstraints]] = None,
    ) -> Topology:
        sharder_map = {sharder_name(s.module_type): s for s in sharders}
        sharded: set[int] = set()
        pooling: list[float] = []
        for m in module.modules():
            sharder = sharder_map.get(sharder_name(type(m)))
            if sharder is None:
                continue
            for p in m.parameters():
                sharded.add(id(p))
            for name in sharder.shardable_parameters(m):
                c = (constraints or {}).get(name)
                pooling.append(sum(c.pooling_factors) if c and c.pooling_factors else POOLING_FACTOR)
        dense_params = [p for p in module.parameters() if id(p) not in sharded]
        self.dense_shapes = [tuple(p.shape) for p in dense_params]
        dense = sum(p.numel() * p.element_size() for p in dense_params)
        kjt = int(batch_size * (sum(pooling) * ID_BYTES + len(pooling) * LENGTH_BYTES)
                  * self.pipeline_batches)
        self.tier = MemoryTier.DDR if topology.compute_device == "cpu" else MemoryTier.HBM
        capacity = getattr(topology.devices[0].storage, self.tier.value)
        self.breakdown = {
            "dense_model": dense,
            "dense_gradients": dense,
            "dense_optimizer": dense * self.dense_optimizer_slots,
            "kjt_buffers": kjt,
            **self.extra,
            "reserved": int(capacity * self.reserved_fraction),
        }
        total = sum(self.breakdown.values())
        left = copy.deepcopy(topology)
        for device in left.devices:
            tier = self.tier.value
            setattr(device.storage, tier, max(0, getattr(device.storage, tier) - total))
        self._last = left
        return left

    def last_reserved_topology(self) -> Optional[Topology]:
        """The topology the last :meth:`reserve` left (TorchRec's ``StorageReservation``)."""
        return self._last
