"""What the training loop works on and keeps: the data it reads (:class:`EpochData`), its
schedule (:class:`TrainerOptions`) and where it stands (:class:`TrainState`, saved with every
checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Protocol

from embedtrain.train.options import PipelineKind, Selection


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
    """How long to train and how often to evaluate and checkpoint (0: only at the end)."""

    epochs: int = 1
    max_steps: Optional[int] = None
    eval_every: int = 500
    eval_max_batches: Optional[int] = None
    checkpoint_every: int = 1000
    keep_checkpoints: int = 2
    progress: bool = True
    grad_accumulation: int = 1  # micro-batches per dense optimizer step
    pipeline: PipelineKind = PipelineKind.NONE  # a TorchRec train pipeline drives the steps
    bf16_dense: bool = False  # forward under bfloat16 autocast (TorchRec's kernels stay fp32)
    select: Selection = Selection.LAST  # the checkpoint the final (test) metrics come from
    select_metric: Optional[str] = None  # validation metric of BEST (None: the task's main one)
    early_stopping_patience: int = 0  # stop after this many evaluations without a better one
    status_every_s: float = 30.0  # without a bar: seconds between status lines (0: none)


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
