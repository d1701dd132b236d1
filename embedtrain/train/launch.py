"""``torchrun`` for ``embedtrain ... --nproc N``: the same launcher, its failure said in one line.

TorchElastic reports a failed worker with a traceback of its own agent and a framed table, after
each rank has already printed its error; a user who mistyped a column then reads 40 lines for
one. This runs ``torch.distributed.run`` unchanged and turns its ``ChildFailedError`` into one
line naming the first rank that failed and how, exiting with that rank's exit status (2 for bad
input, as a single process would).

Example:
    python -m embedtrain.train.launch --nproc-per-node=2 -m embedtrain train cfg.yaml --out runs/x
"""

from __future__ import annotations

import logging
import signal
import sys


def main() -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args()
    # The agent's own records of a failure ("failed (exitcode: 2) local_rank: 1", "Sending
    # process ... SIGTERM") repeat what the ranks and the line below say.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as e:
        # The root cause: a rank that stopped on bad input (status 2; its peers then fail in
        # their collectives), else the first to fail.
        bad_input = {r: f for r, f in e.failures.items() if f.exitcode == 2}
        if bad_input:
            rank = min(bad_input, key=lambda r: bad_input[r].timestamp)
            failure = bad_input[rank]
        else:
            rank, failure = e.get_first_failure()
        code = failure.exitcode
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0
               else f"exited with status {code}")
        others = len(e.failures) - 1
        also = f"; {others} other rank(s) stopped after it" if others else ""
        print(f"embedtrain: rank {rank} of {args.nproc_per_node} {how}{also} (its error is "
              "above)", file=sys.stderr)
        return code if code > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
