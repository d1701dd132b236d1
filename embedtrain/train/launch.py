"""``torchrun`` for ``embedtrain ... --nproc N``: the same launcher, its failure said in one line.

TorchElastic reports a failed worker with a traceback of its own agent and a framed table, after
each rank has already printed its error; a user who mistyped a column then reads 40 lines for
one. This runs ``torch.distributed.run`` unchanged and turns its ``ChildFailedError`` into one
line naming the first rank that failed and how, exiting with that rank's exit status (2 for bad
input, as a single process would; 1 for a rank killed by a signal, which prints nothing itself:
``embedtrain: rank 1 of 2 was killed by SIGKILL (after 3 restarts)``).

Signals: SIGTERM, SIGINT or SIGHUP to this process stops every worker (torchrun sends the
signal on to each worker's session, then SIGKILL after its ``--shutdown-timeout``) and ends in
one line, ``embedtrain: stopped by SIGTERM; continue the run in runs/x with --resume``, and exit
status 128 + the signal's number (143 for SIGTERM, 130 for SIGINT) instead of torch's
``SignalException`` traceback. This process dies with its parent (a SIGTERM when
``embedtrain train`` ends, even by SIGKILL: :func:`embedtrain.processes.die_with_parent`) and
its workers with it (:func:`embedtrain.processes.start_worker`).

Example:
    python -m embedtrain.train.launch --nproc-per-node=2 -m embedtrain train cfg.yaml --out runs/x
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Optional, Sequence

RUN_DIR_ENV = "EMBEDTRAIN_RUN_DIR"  # the run directory, named in the stop line


class Stopped(BaseException):
    """A stop signal before torch's own handlers are in place (not an ``Exception``: torch's
    ``except Exception`` clauses let it through)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def stopped_line(signum: int, run_dir: Optional[str]) -> str:
    """The one line of a run stopped by ``signum`` (every process of it gone)."""
    where = f" in {run_dir}" if run_dir else ""
    return (f"embedtrain: stopped by {signal.Signals(signum).name}; continue the run{where} "
            "with --resume")


def run_dir_of(script_args: Sequence[str]) -> Optional[str]:
    """The run directory of a worker command line: ``$EMBEDTRAIN_RUN_DIR``, else its ``--out``."""
    if os.environ.get(RUN_DIR_ENV):
        return os.environ[RUN_DIR_ENV]
    args = list(script_args)
    for i, a in enumerate(args):
        if a == "--out" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--out="):
            return a[len("--out="):]
    return None


def _stop(signum: int, frame) -> None:
    raise Stopped(signum)


def main() -> int:
    from embedtrain.processes import PARENT_PID_ENV, STOP_SIGNALS, die_with_parent

    die_with_parent(signal.SIGTERM)  # `embedtrain` gone: stop the workers as on a SIGTERM
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # each worker's check (start_worker)
    for sig in STOP_SIGNALS:  # until torch's handlers replace these (when workers start)
        signal.signal(sig, _stop)
    script_args: list[str] = sys.argv
    try:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import get_args_parser, run

        args = get_args_parser().parse_args()
        script_args = args.training_script_args
        # The agent's own records of a failure ("failed (exitcode: 2) local_rank: 1", "Sending
        # process ... SIGTERM", "Received SIGTERM death signal") repeat the ranks and this line.
        # Each of torch's elastic modules sets its own logger's level: set theirs too.
        for name in ["torch.distributed.elastic", *logging.Logger.manager.loggerDict]:
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
        try:
            run(args)
        except ChildFailedError as e:
            return _failed(e, args)
        except SignalException as e:  # the agent has stopped every worker (its _shutdown)
            signum = int(e.sigval)
        else:
            return 0
    except Stopped as e:  # before the workers started (or while torch was imported)
        signum = e.signum
    except KeyboardInterrupt:  # a SIGINT delivered while Python's default handler was in place
        signum = signal.SIGINT
    print(stopped_line(signum, run_dir_of(script_args)), file=sys.stderr)
    return 128 + int(signum)


def _failed(e, args) -> int:
    """One line for torchrun's ``ChildFailedError``; the exit status."""
    # The root cause: a rank that stopped on bad input (status 2; its peers then fail in
    # their collectives), else the first to fail.
    bad_input = {r: f for r, f in e.failures.items() if f.exitcode == 2}
    if bad_input:
        rank = min(bad_input, key=lambda r: bad_input[r].timestamp)
        failure = bad_input[rank]
    else:
        rank, failure = e.get_first_failure()
    code = failure.exitcode
    if code < 0:  # killed: the rank printed nothing (a crash: faulthandler printed its stacks)
        name = signal.Signals(-code).name
        crashed = -code in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE,
                            signal.SIGILL)
        how = f"crashed with {name}" if crashed else f"was killed by {name}"
        above = " (its stacks are above)" if crashed else ""
    else:
        how, above = f"exited with status {code}", " (its error is above)"
    restarts = getattr(args, "max_restarts", 0) or 0
    after = f" (after {restarts} restart{'s' if restarts != 1 else ''})" if restarts else ""
    others = len(e.failures) - 1
    also = f"; {others} other rank(s) stopped after it" if others else ""
    print(f"embedtrain: rank {rank} of {args.nproc_per_node} {how}{after}{also}{above}",
          file=sys.stderr)
    return code if code > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
