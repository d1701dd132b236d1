"""A built run: the trainer, its recipe and readers; what ``fit`` records in the run directory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from embedtrain.config import dump_config
from embedtrain.config_io import to_dict, with_absolute_paths
from embedtrain.fbgemm_threads import max_threads
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
        self.trainer.extra_summary["loader_threads_per_rank"] = getattr(
            self.trainer.train_data, "num_workers", None)
        self.trainer.extra_summary["table_backward_threads_per_rank"] = self.table_threads()
        if self.trainer.rank == 0:
            if not (self.trainer.run_dir.root / "config.yaml").is_file():
                self.record_config()
            cfg = self.recipe.cfg
            self.trainer.loggers = build_loggers(cfg.loggers, self.trainer.run_dir.root,
                                                 to_dict(cfg))
        return self.trainer.fit(test_data=self.test_data)

    def table_threads(self) -> Optional[int]:
        """The threads a CPU rank's fused tables take for their backward and update
        (``embedtrain.fbgemm_threads``); ``None`` on a GPU."""
        return max_threads() if self.trainer.device_type == "cpu" else None

    def record_config(self) -> None:
        """Writes the run's ``config.yaml``: paths absolute, components with their keys."""
        dump_config(with_absolute_paths(self.recipe.cfg),
                    self.trainer.run_dir.root / "config.yaml")
