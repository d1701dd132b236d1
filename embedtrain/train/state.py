"""What the training loop works on and keeps: the data it reads (:class:`EpochData`), its
schedule (:class:`TrainerOptions`) and where it stands (:class:`TrainState`, saved with every
checkpoint)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Protocol

from embedtrain.train.options import (
    SIZED, PipelineKind, Selection, sized_schedule, sizing_line,
)


class EpochData(Protocol):
    """A source of batches that can restart at any batch of any epoch.

    ``len()`` is the number of batches per epoch, the same on every rank (the ranks step
    together). ``step_rows(i)`` is ``(examples, padding rows)`` of batch ``i`` summed over all
    ranks: the trainer counts examples with it, so an epoch counts every row of the split once
    and padding (equal batch sizes in an epoch's last step) never.

    Attributes:
        unit: what a row is (``"rows"``, ``"nodes"``, ``"edges"``), for messages.
        total_rows: rows of the split over all ranks.
        rank_rows: each rank's share of them.
        dropped_rows: rows left out per epoch (``drop_last``), counted in the summary.
    """

    unit: str
    total_rows: int
    rank_rows: list[int]
    dropped_rows: int

    def __len__(self) -> int: ...

    def iter_epoch(self, epoch: int, skip_batches: int = 0) -> Iterator[Any]: ...

    def step_rows(self, index: int) -> tuple[int, int]: ...


@dataclass
class TrainerOptions:
    """How long to train and how often to evaluate and checkpoint (0: only at the end).

    ``epochs``, ``eval_every``, ``select`` and ``early_stopping_patience`` left None are sized
    to the data by :meth:`sized` (the trainer calls it with its training data's batches): a
    small data set trains for enough steps, evaluates a few times a pass, keeps its best
    checkpoint and stops when validation stops improving; a large one trains one pass and keeps
    the last.
    """

    epochs: Optional[int] = None  # None: sized to the data
    max_steps: Optional[int] = None
    eval_every: Optional[int] = None  # None: sized to the data
    eval_max_batches: Optional[int] = None
    checkpoint_every: int = 1000
    keep_checkpoints: int = 2
    progress: bool = True
    grad_accumulation: int = 1  # micro-batches per dense optimizer step
    pipeline: PipelineKind = PipelineKind.NONE  # a TorchRec train pipeline drives the steps
    bf16_dense: bool = False  # forward under bfloat16 autocast (TorchRec's kernels stay fp32)
    # the checkpoint the final (test) metrics come from (None: sized to the data)
    select: Optional[Selection] = None
    select_metric: Optional[str] = None  # validation metric of BEST (None: the task's main one)
    # stop after this many evaluations without a better one (0: never; None: sized to the data)
    early_stopping_patience: Optional[int] = None
    status_every_s: float = 30.0  # without a bar: seconds between status lines (0: none)

    @property
    def derived(self) -> list[str]:
        """The options still to be sized to the data (None)."""
        return [k for k in SIZED if getattr(self, k) is None]

    def sized(self, steps_per_epoch: int, eval_steps: int = 0) -> "TrainerOptions":
        """These options with every one left None sized to a training split of
        ``steps_per_epoch`` batches, whose evaluation reads as many rows as ``eval_steps``
        training steps (:func:`embedtrain.train.options.sized_schedule`)."""
        return dataclasses.replace(self, **sized_schedule(
            {k: getattr(self, k) for k in SIZED}, self.max_steps, steps_per_epoch, eval_steps))

    def sizing_line(self, sized: "TrainerOptions", steps_per_epoch: int) -> Optional[str]:
        """One line saying what :meth:`sized` chose (``sized``: its result) for the options
        these left None, or None when every one was given."""
        return sizing_line(self.derived, {k: getattr(sized, k) for k in SIZED}, steps_per_epoch)


@dataclass
class TrainState:
    """Where training stands; saved with every checkpoint as ``trainer_state.json``."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of ``epoch`` already consumed: the loader position
    examples: int = 0  # global (all ranks), padding rows excluded
    padded_rows: int = 0  # global padding rows trained on (equal batches in an epoch's last step)
    train_time_s: float = 0.0  # time spent in training steps only
    loss_sum: float = 0.0  # training loss summed since the last evaluation
    loss_steps: int = 0
    best_step: Optional[int] = None  # the evaluation with the best selected metric so far
    best_value: Optional[float] = None
    best_valid: dict[str, float] = field(default_factory=dict)  # its validation metrics
    evals_since_best: int = 0
    stopped_early: bool = False
