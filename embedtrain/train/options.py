"""Choices of the training layer: optimizers and learning-rate schedules.

No torch import: the config schema imports these without building anything.
"""

from __future__ import annotations

import enum


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
