"""The training steps ``Trainer.fit`` asks for, from where the run stands to the schedule's end.

:func:`train_steps` reads the training batches from where the run stands (``epoch``,
``batch_in_epoch``), rolls over epochs and stops at ``total_steps``; each item is one trained
step, its bookkeeping done. A step driven by a TorchRec pipeline
(:class:`~embedtrain.train.pipeline.PipelinedSteps`) has fetched batches ahead: before handing out
a step the loop evaluates or checkpoints at, the source resets the pipeline (the plain model
back, the batches fetched ahead dropped) and then restarts the loader at the current step, so
those batches are read again and a checkpoint's loader position is the steps trained. The plain
loop needs no pause: its loader goes on.

Example:
    >>> steps = train_steps(train_data, state, total_steps, step, pipelined, pause_due)
    >>> with contextlib.closing(steps):
    ...     for _ in steps:                 # state.step: the step just trained
    ...         ...                         # evaluate, checkpoint, log
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Generator, Iterator, Optional

from embedtrain.train.pipeline import PipelinedSteps


def train_steps(data: Any, state: Any, total_steps: int,
                step: Callable[[Iterator[Any]], bool], pipeline: Optional[PipelinedSteps],
                pause_due: Callable[[], bool]) -> Generator[None, None, None]:
    """The steps of a run, one per item, from its loader position to ``total_steps``.

    Args:
        data: the training batches (an :class:`~embedtrain.train.trainer.EpochData`).
        state: where the run stands (the trainer's :class:`~embedtrain.train.trainer.
            TrainState`): ``step`` and ``batch_in_epoch`` are advanced by ``step``, ``epoch``
            (and ``batch_in_epoch`` back to 0) here at an epoch's end.
        total_steps: the step the schedule ends at.
        step: trains one step on the next of an epoch's batches; False when there is none.
        pipeline: the TorchRec pipeline ``step`` goes through, if any.
        pause_due: whether the loop evaluates or checkpoints at the step just trained (asked
            with a pipeline only, before the step is handed out).

    Closing the generator closes the loader iterator (its threads stopped and joined) and
    resets the pipeline.
    """
    try:
        while state.step < total_steps:
            with closing_iterator(data.iter_epoch(state.epoch, state.batch_in_epoch)) as batches:
                while step(batches):
                    end = state.step >= total_steps
                    pause = pipeline is not None and (end or pause_due())
                    if pause:  # the plain model for the loop; the loader restarts at this step
                        pipeline.reset()
                    yield
                    if end or pause:
                        break
                else:
                    state.epoch, state.batch_in_epoch = state.epoch + 1, 0
    finally:
        if pipeline is not None:
            pipeline.reset()


@contextlib.contextmanager
def closing_iterator(iterator: Iterator[Any]) -> Iterator[Iterator[Any]]:
    """``iterator``, closed on leaving the block (loader threads stopped and joined)."""
    try:
        yield iterator
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
