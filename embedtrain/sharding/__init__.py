"""Sharding: cluster files → TorchRec topology, sharders, planning and dry-run reports.

Everything here works on the ``meta`` device with no GPU.
"""

from embedtrain.sharding.cluster import topology
from embedtrain.sharding.planner import PlanError, PlanResult, plan_sharding
from embedtrain.sharding.sharders import embedding_sharders

__all__ = ["PlanError", "PlanResult", "embedding_sharders", "plan_sharding", "topology"]
