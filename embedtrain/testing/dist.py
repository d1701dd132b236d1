"""A spawn harness for multi-rank tests: ``world_size`` processes on one gloo process group.

Like TorchRec's ``distributed/test_utils/multi_process.py``, but returning each rank's result to
the caller. Every rank runs ``fn(rank, world_size, *args)`` inside a freshly initialised gloo
group on 127.0.0.1 (a free port), which is destroyed afterwards (and the rank leaves through
:func:`embedtrain.train.dist.exit_process`). Results travel through
``torch.save`` files in a temporary directory (not a queue: shared-memory tensors would die
with the child), so they should be small and picklable: dicts of tensors, floats, strings.

A rank that raises makes :func:`spawn` terminate the other ranks at once (they would otherwise
wait in a collective) and raise :class:`RankError` with that rank's traceback; a run longer
than ``timeout`` seconds is killed and raises :class:`TimeoutError`.

``fn`` must be importable by the children (a module-level function of an importable module,
e.g. a test module), since they are started with the ``spawn`` method.

Example:
    >>> def _allreduce(rank, world_size, x):
    ...     t = torch.tensor([x * (rank + 1)])
    ...     torch.distributed.all_reduce(t)
    ...     return {"sum": t}
    >>> spawn(_allreduce, 2, 1.0)            # [{'sum': tensor([3.])}, {'sum': tensor([3.])}]
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from embedtrain.train.dist import exit_process, free_port


class RankError(RuntimeError):
    """A rank of :func:`spawn` raised (or died); the message holds its traceback."""


def _run_rank(fn: Callable[..., Any], rank: int, world_size: int, port: int, out_dir: str,
              timeout: float, args: tuple) -> None:
    out = Path(out_dir)
    failed = False
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        torch.save(fn(rank, world_size, *args), out / f"rank{rank}.tmp")
        os.replace(out / f"rank{rank}.tmp", out / f"rank{rank}.pt")
    except BaseException:
        failed = True  # recorded before the group goes down and the peers fail in turn
        when = time.monotonic()  # one clock for all processes: orders the failures
        summary = traceback.format_exception_only(*sys.exc_info()[:2])[0].strip().splitlines()[0]
        (out / f"rank{rank}.err.tmp").write_text(f"{when}\n{summary}\n{traceback.format_exc()}")
        os.replace(out / f"rank{rank}.err.tmp", out / f"rank{rank}.err")  # whole or absent
    # Not a return into multiprocessing's interpreter exit: gloo's worker threads may still
    # release a collective's Python tensors, which aborts a finalizing interpreter (see
    # embedtrain.train.dist). The group is destroyed and the process leaves at once.
    exit_process(1 if failed else 0)


def _failure_report(procs: list, out: Path) -> str:
    """The first failure in full (a crash without traceback, else the oldest traceback): the
    others are usually peers noticing it ("Connection closed by peer")."""
    errors = {r: (out / f"rank{r}.err").read_text().split("\n", 2)
              for r in range(len(procs)) if (out / f"rank{r}.err").exists()}
    crashed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in errors]
    first, *others = crashed + sorted(errors, key=lambda r: float(errors[r][0]))
    text = errors[first][2] if first in errors else (
        f"(died with exit code {procs[first].exitcode}, no traceback: killed or crashed)\n")
    also = "".join(f"rank {r} also failed: {errors[r][1] if r in errors else 'died'}\n"
                   for r in others)
    return f"rank {first} of {len(procs)} failed:\n{text}{also}"


def spawn(fn: Callable[..., Any], world_size: int = 2, *args: Any,
          timeout: float = 300.0) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Args:
        fn: a module-level function (picklable by reference).
        world_size: number of ranks (processes).
        *args: extra positional arguments for ``fn`` (picklable).
        timeout: seconds for the whole run, start-up included; also the gloo timeout.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        RankError: a rank raised or died; names the rank and carries its traceback.
        TimeoutError: the ranks ran longer than ``timeout`` (they are killed).
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="embedtrain-spawn-") as tmp:
        out = Path(tmp)
        port = free_port()
        procs = [ctx.Process(target=_run_rank, name=f"rank{rank}", daemon=True,
                             args=(fn, rank, world_size, port, tmp, timeout, args))
                 for rank in range(world_size)]
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.start()
            while True:
                if any((out / f"rank{r}.err").exists() or p.exitcode not in (None, 0)
                       for r, p in enumerate(procs)):
                    for p in procs:  # fail fast: the others may wait in a collective forever
                        p.join(timeout=1.0)
                    raise RankError(_failure_report(procs, out))
                if all(p.exitcode == 0 for p in procs):
                    break
                if time.monotonic() > deadline:
                    stuck = [r for r, p in enumerate(procs) if p.exitcode is None]
                    raise TimeoutError(f"spawn({getattr(fn, '__name__', fn)}): rank(s) {stuck} "
                                       f"still running after {timeout:.0f} s; killed")
                time.sleep(0.02)
            return [torch.load(out / f"rank{r}.pt", weights_only=False)
                    for r in range(world_size)]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
