"""Recipes: the one place where the resolved config meets the library, one per task family.

:data:`RECIPES` maps each ``task`` of the config to its recipe class: it is the only switch on
the task below the CLI. A new family is one recipe (a :class:`~embedtrain.recipes.base.Recipe`
subclass) plus one task (:class:`~embedtrain.train.task.Task`) and a line here; see the project's
``ARCHITECTURE.md`` for a worked example. A user's own recipe needs no line here: the config
names it by import path (``recipe: mypkg.towers:TwoTowerRecipe``, see :func:`recipe_class`) and
its runs get the same run directory, ``eval``, ``plan`` and ``export`` as a built-in one.

Example:
    >>> cfg = load_config("configs/dlrm_synthetic.yaml")
    >>> run = build_run(cfg, "runs/demo")
    >>> summary = run.trainer.fit(test_data=run.test_data)
    >>> plan_model(cfg, load_cluster("configs/clusters/h100-16x8.yaml")).report
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from embedtrain.components import resolve
from embedtrain.config import ClusterConfig, Config, ConfigError, TaskKind, load_run_config
from embedtrain.recipes.base import Recipe, Run
from embedtrain.recipes.ctr import CTRRecipe
from embedtrain.recipes.gnn import LinkPredictionRecipe, NodeClassificationRecipe
from embedtrain.recipes.seq import SeqRecipe
from embedtrain.recipes.xc import XCRecipe
from embedtrain.sharding.planner import PlanResult

RECIPES: dict[TaskKind, type[Recipe]] = {
    TaskKind.CTR: CTRRecipe,
    TaskKind.XC: XCRecipe,
    TaskKind.GNN_NODE: NodeClassificationRecipe,
    TaskKind.GNN_LINK: LinkPredictionRecipe,
    TaskKind.SEQ: SeqRecipe,
}


def recipe_for(cfg: Config) -> Recipe:
    """The recipe of ``cfg`` (:func:`recipe_class`), on ``cfg``."""
    return recipe_class(cfg)(cfg)


def recipe_class(cfg: Config) -> type[Recipe]:
    """``cfg.recipe``'s class when the config names one (``package.module:Class``, imported from
    the Python path or the current directory, as ``python -m`` would), else ``cfg.task``'s.

    Raises:
        ConfigError: the module does not import, has no such class, or the class is not a
            :class:`Recipe` subclass (the ``recipe`` key named).
    """
    if cfg.recipe is None:
        return RECIPES[cfg.task]
    cls = resolve(cfg.recipe, "recipe")
    if not (isinstance(cls, type) and issubclass(cls, Recipe)):
        raise ConfigError(f"recipe: {cfg.recipe}: {type(cls).__name__}, not a Recipe subclass")
    return cls


def family_recipe(cfg: Config) -> Recipe:
    """The built-in recipe of ``cfg.task`` on ``cfg``, whatever ``cfg.recipe`` names: what
    ``embedtrain predict`` scores with, so that an export never makes it import code."""
    return RECIPES[cfg.task](cfg)


def serving_refusal(recipe: Recipe) -> Optional[str]:
    """Why an export of ``recipe``'s run could not be served without its code (None: it can).

    Predict rebuilds the serving inputs with the built-in recipe of the run's task
    (:func:`family_recipe`); a user's recipe that changes how they are built
    (``predict_pooled``, ``predict_excluded``) would need its own code imported there.
    """
    family = RECIPES[recipe.cfg.task]
    changed = [name for name in ("predict_pooled", "predict_excluded")
               if getattr(type(recipe), name) is not getattr(family, name)]
    if not changed:
        return None
    return (f"recipe: {recipe.cfg.recipe}: overrides {', '.join(changed)}; predict runs from the "
            f"export alone, with the {family.__name__}'s, and imports no code from a run")


def build_run(cfg: Config, out_dir: str | os.PathLike, progress: Optional[bool] = None,
              cluster: Optional[ClusterConfig] = None, record_plan: bool = True) -> Run:
    """``recipe_for(cfg).build_run(...)``: see :meth:`Recipe.build_run`."""
    return recipe_for(cfg).build_run(out_dir, progress, cluster, record_plan)


def fit(cfg: Config, out_dir: str | os.PathLike, progress: Optional[bool] = None
        ) -> dict[str, Any]:
    """Trains ``cfg`` into run directory ``out_dir`` (``build_run(...).fit()``) and returns the
    summary; the run is one like ``embedtrain train`` makes (``config.yaml`` recorded)."""
    return build_run(cfg, out_dir, progress).fit()


def evaluate(run_dir: str | os.PathLike, split: str = "test",
             checkpoint: Optional[str] = None) -> dict[str, Any]:
    """A run's checkpoint (default: the newest complete one) evaluated on ``split`` of its data
    set. Read-only: no plan files, records or result file are written into the run.

    Returns:
        ``{"split", "step", <the task's metrics>}``.

    Raises:
        ValueError: not a run directory, or no complete checkpoint (one line).
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"{run_dir}: not a run directory (no config.yaml)")
    run = build_run(load_run_config(run_dir / "config.yaml"), run_dir, progress=False,
                    record_plan=False)
    if run.trainer.restore(checkpoint) is None:
        raise ValueError(f"{run_dir / 'checkpoints'}: no complete checkpoint to evaluate")
    data = run.eval_reader(split)
    return {"split": split, "step": run.trainer.state.step, **run.trainer.evaluate(data)}


def plan_model(cfg: Config, cluster: ClusterConfig) -> PlanResult:
    """Dry-run plan of ``cfg``'s model on ``cluster`` (no GPU, no process group)."""
    return recipe_for(cfg).plan(cluster)


__all__ = ["RECIPES", "Recipe", "Run", "build_run", "evaluate", "family_recipe", "fit", "plan_model",
           "recipe_class", "recipe_for", "serving_refusal"]
