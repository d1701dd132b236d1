"""The task seam: what the trainer loop needs from a task family (CTR, extreme classification, GNN).

The loop never branches on the kind of task. A task turns a batch into a loss and predictions with
the (possibly sharded) model it is given, and makes fresh metric accumulators; a new task family
plugs in by implementing :class:`Task`, never by editing the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


@dataclass
class StepOutput:
    """What one forward pass of a task produces."""

    loss: torch.Tensor  # scalar, mean over the batch, differentiable
    predictions: torch.Tensor  # what the metrics consume (e.g. click probabilities)
    num_examples: int


class Metrics(Protocol):
    """An accumulator over evaluation batches; ``compute`` syncs across ranks if distributed."""

    def update(self, output: StepOutput, batch: Any) -> None:
        """Adds one evaluation batch: the task's ``output`` for ``batch`` (padding excluded)."""
        ...

    def compute(self) -> dict[str, float]:
        """The metrics over every batch added so far, on all ranks (a collective when
        distributed: every rank calls it); ``{}`` when no example was added."""
        ...


class Task(Protocol):
    """A task family: its model's forward/loss and its metrics.

    Attributes:
        name: short name, recorded in the run's summary.
        main_metric: the metric plotted and reported first (e.g. ``"auc"``).

    A task given by import path (``task: {_component_: ...}``) may also say, as class
    attributes, ``family`` (the data and model it runs on: ``"ctr"``, the default, ``"xc"``,
    ``"seq"``, ...) and, in the CTR family, ``score`` (``"sigmoid"``, the default, or
    ``"identity"``: how predict turns the exported model's output into a row's score).
    """

    name: str
    main_metric: str

    def forward(self, model: nn.Module, batch: Any) -> StepOutput:
        """Runs ``model`` on ``batch`` and returns the mean loss and predictions."""
        ...

    def new_metrics(self) -> Metrics:
        """A fresh accumulator for one evaluation pass."""
        ...


# Metrics where lower is better; the others named here are better higher. A metric in neither
# (e.g. ``calibration``, best at 1) cannot select a checkpoint.
LOWER_IS_BETTER = frozenset({"loss", "ne", "logloss", "mse", "rmse", "mae"})
HIGHER_IS_BETTER = frozenset({"auc", "accuracy", "macro_f1", "mrr"})
_HIGHER_PREFIXES = ("p@", "psp@", "ndcg@", "recall@", "hits@", "hr@")


def higher_is_better(metric: str) -> bool:
    """Whether a larger value of ``metric`` is better (to select checkpoints by it).

    Raises:
        ValueError: a metric with no better direction (``calibration``) or an unknown one.
    """
    if metric in LOWER_IS_BETTER:
        return False
    if metric in HIGHER_IS_BETTER or metric.startswith(_HIGHER_PREFIXES):
        return True
    known = sorted(LOWER_IS_BETTER | HIGHER_IS_BETTER) + [p + "k" for p in _HIGHER_PREFIXES]
    raise ValueError(f"{metric!r} cannot select a checkpoint (no better direction known); "
                     f"use one of {', '.join(known)}")

