"""How a training run shows that it is alive: a progress bar on a terminal, else status lines.

A run whose stderr is a log file (or that was asked for no bar: ``--no-progress``,
``train.progress: false``) still says how it goes: :class:`StatusLines` prints one line every
``train.status_every_s`` seconds (30 by default) and at the end of each epoch, with the step,
the epoch, examples/s, the mean training loss since the last evaluation and the estimated time
left (from the steps this process has trained so far)::

    step 1,200/7,900 (epoch 2/10): 1,840 examples/s, loss 0.4512, 9m41s left

:func:`progress_display` picks one of the two; both take ``set_postfix``, ``update`` and
``close``, as the trainer's loop calls them. Rank 0 only: the other ranks show nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional, TextIO

from tqdm import tqdm


class StatusLines:
    """A line of status every ``every_s`` seconds and at each epoch's end (see the module).

    Args:
        total: the run's last step.
        initial: the step it starts from (a resumed run's).
        steps_per_epoch: steps of an epoch (the epoch of step ``s`` is ``ceil(s / this)``).
        epochs: the epochs planned.
        every_s: seconds between lines (0: at epoch ends only).
        out: where the lines go (stderr).
        clock: monotonic seconds (tests give their own).
    """

    def __init__(self, total: int, initial: int, steps_per_epoch: int, epochs: int,
                 every_s: float, out: Optional[TextIO] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.step, self.first = total, initial, initial
        self.steps_per_epoch, self.epochs = max(steps_per_epoch, 1), epochs
        self.every_s, self.out, self.clock = every_s, out, clock
        self.started = self.last = clock()
        self.postfix: dict[str, Any] = {}

    def set_postfix(self, refresh: bool = False, **values: Any) -> None:
        del refresh  # a bar's argument
        self.postfix = values

    def update(self, n: int = 1) -> None:
        self.step += n
        now = self.clock()
        epoch_end = self.step % self.steps_per_epoch == 0 or self.step == self.total
        if epoch_end or (self.every_s and now - self.last >= self.every_s):
            self.last = now
            print(self.line(now), file=self.out or sys.stderr, flush=True)

    def line(self, now: float) -> str:
        epoch = -(-self.step // self.steps_per_epoch)
        parts = [f"step {self.step:,}/{self.total:,} (epoch {epoch}/{self.epochs})"]
        if "ex_per_s" in self.postfix:
            parts.append(f"{self.postfix['ex_per_s']} examples/s")
        if "loss" in self.postfix:
            parts.append(f"loss {self.postfix['loss']}")
        done = self.step - self.first
        if done > 0 and self.step < self.total:
            parts.append(f"{_duration((now - self.started) / done * (self.total - self.step))} "
                         f"left")
        return parts[0] + ": " + ", ".join(parts[1:]) if len(parts) > 1 else parts[0]

    def close(self) -> None:
        pass


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, m = s // 3600, s // 60 % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s % 60:02d}s" if m else f"{s}s"


def progress_display(total: int, initial: int, steps_per_epoch: int, epochs: int,
                     progress: bool, every_s: float, rank: int):
    """A tqdm bar (``progress`` and stderr a terminal), else :class:`StatusLines` (rank 0;
    ``every_s`` 0 and no bar: a disabled bar, silent)."""
    if progress and sys.stderr.isatty():
        return tqdm(total=total, initial=initial, unit="step", disable=bool(rank),
                    dynamic_ncols=True, mininterval=0.1)
    if rank or not every_s:
        return tqdm(total=total, initial=initial, disable=True)
    return StatusLines(total, initial, steps_per_epoch, epochs, every_s)
