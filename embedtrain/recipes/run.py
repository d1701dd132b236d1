"""A built run: the trainer, its recipe and readers; what ``fit`` records in the run directory."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from embedtrain.config import Config, dump_config
from embedtrain.config_io import to_dict, with_absolute_paths
from embedtrain.train.loggers import build_loggers
from embedtrain.train.trainer import EpochData, Trainer

@dataclass
class Run:
    """Everything a run needs, built and connected."""

    trainer: Trainer
    recipe: Any
    test_data: Optional[EpochData]
    eval_reader: Callable[[str], EpochData]  # the evaluation reader of any split

    def fit(self) -> dict[str, Any]:
        """Trains to the end and returns ``summary.json``'s content, after recording the run's
        ``config.yaml`` where it has none: a run started from Python is then evaluated,
        exported, planned and resumed like one ``embedtrain train`` made."""
        self.trainer.extra_summary["threads_per_rank"] = torch.get_num_threads()
        if self.trainer.rank == 0:
            if not (self.trainer.run_dir.root / "config.yaml").is_file():
                self.record_config()
            cfg = self.recipe.cfg
            self.trainer.loggers = build_loggers(cfg.loggers, self.trainer.run_dir.root,
                                                 to_dict(cfg))
        return self.trainer.fit(test_data=self.test_data)

    def record_config(self) -> None:
        """Writes the run's ``config.yaml``: paths absolute, components with their keys, a
        user's recipe by import path (:func:`recorded_config`)."""
        dump_config(with_absolute_paths(recorded_config(self.recipe)),
                    self.trainer.run_dir.root / "config.yaml")


def recorded_config(recipe: Any) -> Config:
    """``recipe.cfg`` as a run records it: a recipe class of the user's given by import path
    (``recipe: module:Class``), so that ``embedtrain eval``/``export`` rebuild it; one defined
    in ``__main__`` cannot be imported again, and is said so (once, on stderr)."""
    cfg, cls = recipe.cfg, type(recipe)
    if cfg.recipe is not None or cls.__module__.startswith("embedtrain.recipes."):
        return cfg  # named already, or a built-in one (the task's)
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        print(f"warning: recipe {cls.__qualname__} is defined in {cls.__module__}: the run's "
              "config.yaml cannot name it, and `embedtrain eval/export` will use the task's "
              "built-in recipe; define it in a module to record it", file=sys.stderr)
        return cfg
    return dataclasses.replace(cfg, recipe=f"{cls.__module__}:{cls.__qualname__}")
