"""Pipelined training steps: TorchRec's train pipelines behind the task seam.

``train.pipeline: sparse_dist`` drives each step with TorchRec's ``TrainPipelineSparseDist``:
while batch ``i`` runs forward and backward, the input all-to-all of batch ``i + 1`` (the ids
each rank sends to the ranks that own its tables) is already in flight, and batch ``i + 2`` is
being copied to the device. The results are the plain loop's, bit for bit: only the ids move
early, the lookups and updates keep their order. ``semi_sync`` would be
``TrainPipelineSemiSync`` (batch ``i + 1``'s embeddings looked up before batch ``i`` updates
the tables); it steps the optimizer itself, so the recipes refuse it for now.

How it fits the trainer without the trainer knowing the model:

* The pipeline calls ``model(batch)``. The sharded model's inner module (what
  ``DistributedModelParallel`` wraps) gets a subclass of its own class whose ``forward`` takes
  the batch and calls the original with the recipe's ``batch_args(batch)``; parameter names
  (and so checkpoints) do not change. TorchRec traces that ``forward`` (torch.fx) to find the
  sharded modules whose inputs are attributes of the batch: those are the ones pipelined.
* The step itself stays the task's: the pipeline's forward function runs
  ``task.forward(model, batch)`` with ``model`` standing for "the sharded model on this batch",
  so the task still turns the model's output into the loss and predictions.
* The optimizer step is the trainer's: the pipeline gets an optimizer that does nothing, so
  gradient accumulation, the LR schedule and the step count stay in the loop.
* Evaluation and checkpoints run on the plain model (:meth:`PipelinedSteps.reset`: the
  pipeline detached, the class restored, the batches fetched ahead dropped); the trainer's step
  source (:mod:`embedtrain.train.steps`) then restarts the loader at the current step, so those
  batches are read again. A checkpoint records the steps trained, so a resumed run reads the
  same batches: resuming is bit-identical.

Example:
    >>> steps = PipelinedSteps(PipelineKind.SPARSE_DIST, dmp, task, batch_args, device)
    >>> out = steps.step(batches)      # one training step (forward and backward); StepOutput
    >>> steps.reset()                  # before evaluating or saving: the plain model back
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from embedtrain.train.options import PipelineKind
from embedtrain.train.task import StepOutput, Task

BatchArgs = Callable[[Any], tuple]  # batch -> the model's positional arguments


class _NoStep:
    """The optimizer handed to the pipeline: the trainer steps and zeroes the real one."""

    def step(self, closure=None) -> None:  # noqa: D102
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        return None


class _OnBatch:
    """Stands for the sharded model applied to one batch (what the task calls)."""

    def __init__(self, model: nn.Module, batch: Any) -> None:
        self.model, self.batch = model, batch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(self.batch)

    @property
    def module(self) -> nn.Module:
        """The model (what a task reads its state from, e.g. a penalty, as through a wrapper)."""
        return self.model


def _batch_class(cls: type, batch_args: BatchArgs) -> type:
    def forward(self, batch):
        return cls.forward(self, *batch_args(batch))

    return type(f"{cls.__name__}OnBatch", (cls,), {"forward": forward, "_plain_class": cls})


class PipelinedSteps:
    """Training steps of ``model`` (a ``DistributedModelParallel``) through a TorchRec pipeline.

    Args:
        kind: ``SPARSE_DIST`` or ``SEMI_SYNC``.
        model: the sharded model.
        task: turns the model's output on a batch into the step's loss and predictions.
        batch_args: a batch -> the inner model's forward arguments.
        device: where the batches go.
        bf16: the forward under bfloat16 autocast.
        loss_scale: the loss is multiplied by it before backward (1 / gradient accumulation).
    """

    def __init__(self, kind: PipelineKind, model: nn.Module, task: Task, batch_args: BatchArgs,
                 device: torch.device, bf16: bool = False, loss_scale: float = 1.0) -> None:
        from torchrec.distributed.train_pipeline.train_pipelines import (
            TrainPipelineSemiSync,
            TrainPipelineSparseDist,
        )

        self.model, self.task, self.device = model, task, device
        self.bf16, self.loss_scale = bf16, loss_scale
        self._inner = model.module if hasattr(model, "module") else model
        self._plain = type(self._inner)
        self._on_batch = _batch_class(self._plain, batch_args)
        cls = TrainPipelineSemiSync if kind is PipelineKind.SEMI_SYNC else TrainPipelineSparseDist
        self.pipeline = cls(model, _NoStep(), device, execute_all_batches=True,
                            custom_model_fwd=self._forward)
        self._running = False
        self.modules: list[str] = []  # the sharded modules the pipeline runs (their FQNs)

    def _forward(self, batch: Any) -> tuple[torch.Tensor, StepOutput]:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            out = self.task.forward(_OnBatch(self.model, batch), batch)
        loss = out.loss * self.loss_scale if self.loss_scale != 1 else out.loss
        return loss, out

    def _resume(self) -> None:
        if not self._running:
            self._inner.__class__ = self._on_batch
            self.pipeline.attach(self.model)
            self._running = True

    def step(self, batches: Iterator[Any]) -> Optional[StepOutput]:
        """One training step (forward and backward) on the pipeline's next batch, fetching
        from ``batches`` ahead; ``None`` when ``batches`` and the pipeline are exhausted."""
        self._resume()
        try:
            out = self.pipeline.progress(batches)
        except StopIteration:
            return None
        if not self.modules:
            self.modules = sorted(getattr(m.forward, "_name", type(m).__name__)
                                  for m in self.pipeline._pipelined_modules)
            if not self.modules:
                warnings.warn("train.pipeline: TorchRec found no sharded module whose input is "
                              "an attribute of the batch: nothing is pipelined (the steps are "
                              "still correct)", stacklevel=2)
        return out

    def reset(self) -> None:
        """The plain model back (for evaluation, checkpoints, the end of training) and the
        batches fetched ahead dropped: the next :meth:`step` starts on its own iterator."""
        if self._running:
            self.pipeline.detach()
            self._inner.__class__ = self._plain
            self._running = False
        self.pipeline.reset()
