"""Sharding: cluster files → TorchRec topology, sharders, planning and dry-run reports.

Everything here works on the ``meta`` device with no GPU. The names below load on first use, so
that ``embedtrain.sharding.types`` (what the config schema needs) imports no torch.
"""

from embedtrain.utils import lazy_exports

_EXPORTS = {
    "topology": "embedtrain.sharding.cluster",
    "PlanError": "embedtrain.sharding.planner",
    "PlanResult": "embedtrain.sharding.planner",
    "plan_sharding": "embedtrain.sharding.planner",
    "PlanReport": "embedtrain.sharding.report_types",
    "embedding_sharders": "embedtrain.sharding.sharders",
    "PlannerOptions": "embedtrain.sharding.types",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
