"""Recipes: the one place where the resolved config meets the library, one per task family.

:data:`RECIPES` maps each ``task`` of the config to its recipe class: it is the only switch on
the task below the CLI. A new family is one recipe (a :class:`~embedtrain.recipes.base.Recipe`
subclass) plus one task (:class:`~embedtrain.train.task.Task`) and a line here; see the project's
``ARCHITECTURE.md`` for a worked example.

Example:
    >>> cfg = load_config("configs/dlrm_synthetic.yaml")
    >>> run = build_run(cfg, "runs/demo")
    >>> summary = run.trainer.fit(test_data=run.test_data)
    >>> plan_model(cfg, load_cluster("configs/clusters/h100-16x8.yaml")).report
"""

from __future__ import annotations

import os
from typing import Optional

from embedtrain.config import ClusterConfig, Config, TaskKind
from embedtrain.recipes.base import Recipe, Run
from embedtrain.recipes.ctr import CTRRecipe
from embedtrain.recipes.gnn import LinkPredictionRecipe, NodeClassificationRecipe
from embedtrain.recipes.xc import XCRecipe
from embedtrain.sharding.planner import PlanResult

RECIPES: dict[TaskKind, type[Recipe]] = {
    TaskKind.CTR: CTRRecipe,
    TaskKind.XC: XCRecipe,
    TaskKind.GNN_NODE: NodeClassificationRecipe,
    TaskKind.GNN_LINK: LinkPredictionRecipe,
}


def recipe_for(cfg: Config) -> Recipe:
    """The recipe of ``cfg.task``, on ``cfg``."""
    return RECIPES[cfg.task](cfg)


def build_run(cfg: Config, out_dir: str | os.PathLike, progress: Optional[bool] = None,
              cluster: Optional[ClusterConfig] = None, record_plan: bool = True) -> Run:
    """``recipe_for(cfg).build_run(...)``: see :meth:`Recipe.build_run`."""
    return recipe_for(cfg).build_run(out_dir, progress, cluster, record_plan)


def plan_model(cfg: Config, cluster: ClusterConfig) -> PlanResult:
    """Dry-run plan of ``cfg``'s model on ``cluster`` (no GPU, no process group)."""
    return recipe_for(cfg).plan(cluster)


__all__ = ["RECIPES", "Recipe", "Run", "build_run", "plan_model", "recipe_for"]
