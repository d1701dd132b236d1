"""Choices of the training layer: optimizers, learning-rate schedules, and the schedule of a run
sized to its data (:func:`sized_schedule`).

No torch import: the config schema imports these without building anything.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Optional


class SparseOptimizer(enum.Enum):
    """Optimizers fused into the embedding backward pass (FBGEMM TBE)."""

    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAGRAD = "adagrad"
    SGD = "sgd"
    ADAM = "adam"


class DenseOptimizer(enum.Enum):
    ADAM = "adam"
    ADAGRAD = "adagrad"
    SGD = "sgd"
    LAMB = "lamb"  # Adam with a layer-wise trust ratio, for large batches
    LARS = "lars"  # SGD-momentum with a layer-wise trust ratio, for large batches


class LRDecay(enum.Enum):
    """Learning-rate decay after the linear warmup."""

    NONE = "none"
    COSINE = "cosine"
    STEP = "step"


class HeadOptimizer(enum.Enum):
    """Optimizer of a sharded class head (sparse-capable: sampled heads update sampled rows)."""

    ADAGRAD = "adagrad"  # torch's Adagrad: one accumulator per weight
    SGD = "sgd"
    # one accumulator per class row (the mean of the row's squared gradient), as FBGEMM's tables
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    # row-wise Adagrad's accumulators times a [D] column profile (Adafactor's factoring)
    FACTORED_ADAGRAD = "factored_adagrad"


class Selection(enum.Enum):
    """Which checkpoint a run's final (test) metrics come from."""

    LAST = "last"  # the end of training
    BEST = "best"  # the evaluation with the best validation value of the selected metric


class PipelineKind(enum.Enum):
    """How a training step is driven (``train.pipeline``)."""

    NONE = "none"  # the trainer's loop: forward, backward, step on a batch already distributed
    SPARSE_DIST = "sparse_dist"  # TorchRec's TrainPipelineSparseDist (input dist of i+1 overlaps i)
    SEMI_SYNC = "semi_sync"  # TorchRec's TrainPipelineSemiSync (embeddings of i+1 looked up early)


# A schedule sized to the data (the train options left None): a run of at least MIN_STEPS steps
# (at most MAX_AUTO_EPOCHS passes), or max_steps' worth; EVALS_PER_EPOCH evaluations a pass, at
# most EVAL_EVERY_CAP steps apart, but no closer than the training steps whose rows number an
# evaluation's (on 1,000 users an evaluation reads as many rows as a pass trains on: evaluating
# four times a pass took half the run) and at least once a pass. A data set whose pass is
# shorter than MIN_STEPS steps is small: a run of it whose length is sized too (neither epochs
# nor max_steps given) keeps the best evaluation's checkpoint and stops after PATIENCE_EPOCHS
# passes without a better one: the sized length is a bound, early stopping its end. A length
# the user gives is trained to.
MIN_STEPS = 1000
MAX_AUTO_EPOCHS = 100
EVALS_PER_EPOCH = 4
EVAL_EVERY_CAP = 500
PATIENCE_EPOCHS = 3
MIN_PATIENCE = 4  # evaluations
SIZED = ("epochs", "eval_every", "select", "early_stopping_patience")


def sized_schedule(given: dict[str, Any], max_steps: Optional[int],
                   steps_per_epoch: int, eval_steps: int = 0) -> dict[str, Any]:
    """The :data:`SIZED` options (``given``: their values, None where left to the data) of a run
    over a training split of ``steps_per_epoch`` batches, with ``max_steps`` (or None);
    ``eval_steps``: the training steps whose rows number an evaluation's
    (:func:`evaluation_steps`)."""
    per = max(1, steps_per_epoch)
    small = per < MIN_STEPS and max_steps is None and given["epochs"] is None
    epochs = given["epochs"]
    if epochs is None:
        epochs = math.ceil((max_steps or MIN_STEPS) / per)
        epochs = epochs if max_steps is not None else min(epochs, MAX_AUTO_EPOCHS)
    every = given["eval_every"]
    if every is None:
        every = min(EVAL_EVERY_CAP, per, max(math.ceil(per / EVALS_PER_EPOCH), eval_steps))
    select = given["select"]
    if select is None:
        select = Selection.BEST if small else Selection.LAST
    patience = given["early_stopping_patience"]
    if patience is None:
        patience = (max(MIN_PATIENCE, round(PATIENCE_EPOCHS * per / every))
                    if small and every else 0)
    return {"epochs": epochs, "eval_every": every, "select": select,
            "early_stopping_patience": patience}


def evaluation_steps(train_rows: int, train_batches: int, valid_rows: int,
                     valid_batches: int, max_batches: Optional[int]) -> int:
    """The training steps (of ``train_batches`` over ``train_rows``) whose rows number one
    evaluation's: the first ``max_batches`` (None or 0: all) of ``valid_batches`` over
    ``valid_rows``; 0 without validation data."""
    if not (train_rows and train_batches and valid_rows and valid_batches):
        return 0
    batches = min(valid_batches, max_batches or valid_batches)
    return math.ceil(valid_rows * batches / valid_batches / (train_rows / train_batches))


def sizing_line(derived: list[str], sized: dict[str, Any], steps_per_epoch: int
                ) -> Optional[str]:
    """One line saying what :func:`sized_schedule` chose (``sized``) for the options it was
    left (``derived``), or None when it was left none."""
    if not derived:
        return None
    patience = sized["early_stopping_patience"]
    epochs = sized["epochs"]
    said = {"epochs": f"{epochs} epoch{'s' if epochs != 1 else ''}",
            "eval_every": f"evaluation every {sized['eval_every']:,} steps",
            "select": f"select: {sized['select'].value}",
            "early_stopping_patience": (f"early stopping after {patience} evaluations without a "
                                        "better one" if patience else "no early stopping")}
    kind = "small" if steps_per_epoch < MIN_STEPS else "large"
    return (f"train: {', '.join(said[k] for k in derived)} (sized to the data: "
            f"{steps_per_epoch:,} steps a pass, a {kind} data set; set "
            f"{', '.join('train.' + k for k in derived)} to choose)")
