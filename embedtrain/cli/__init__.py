"""The ``embedtrain`` command line: ``train``, ``eval``, ``tune``, ``plan``, ``ingest``,
``datagen``, ``export``, ``predict``, ``report`` and ``doctor``: one module per command
(:mod:`embedtrain.cli.train`, ``tune``, ``plan``, ``ingest``, ``datagen``, ``export``,
``report``, ``doctor``), the error handling in
:mod:`embedtrain.cli.errors`. Importing this package imports no torch: a command imports it
when it needs it (``tune`` imports Ray), and only ``train``, ``eval`` and ``tune`` join a process
group (``tune`` only to test a trial that ASHA stopped; its trials train in Ray's workers).

Examples:
    embedtrain datagen ctr --rows 1000000 --out data/synthetic_ctr
    embedtrain datagen ctr --rows 1000000 --out data/raw_ctr --format tsv
    embedtrain datagen xc --classes 100000 --rows 1000000 --out data/synthetic_xc
    embedtrain datagen graph --nodes 1000000 --avg-degree 20 --out data/synthetic_graph
    embedtrain ingest configs/ingest/criteo_synthetic.yaml --input 'data/raw_ctr/*.tsv' \
        --out data/ctr_ingested
    embedtrain ingest configs/ingest/graph_edges.yaml --input edges.csv --nodes nodes.csv \
        --out data/graph
    embedtrain ingest configs/ingest/xc_repository.yaml --input eurlex/train.txt \
        --set split.files.test=eurlex/test.txt --out data/eurlex
    embedtrain train configs/dlrm_synthetic.yaml --out runs/demo --set train.max_steps=200
    embedtrain train configs/dlrm_synthetic.yaml --out runs/two --nproc 2   # 2 ranks via torchrun
    torchrun --nproc-per-node 2 -m embedtrain train configs/dlrm_synthetic.yaml --out runs/two
    embedtrain train configs/dlrm_synthetic.yaml --out runs/demo --resume  # newest readable ckpt
    embedtrain eval runs/demo --split test     # prints the metrics (JSON); writes nothing
    embedtrain tune configs/dlrm_synthetic.yaml --space configs/tune/ctr_space.yaml \
        --trials 8 --out runs/search              # Ray Tune + ASHA; --resume after a crash
    embedtrain plan configs/dlrm.yaml --cluster configs/clusters/h100-16x8.yaml --out plans/dlrm
    embedtrain export runs/demo --out exports/demo --quantize int8   # tables, dense program
    embedtrain predict exports/demo --input 'data/synthetic_ctr/test/*.parquet' --out preds.parquet
    embedtrain report runs/dlrm runs/dcn --out compare.html   # runs side by side, one page
    embedtrain doctor --nproc 2      # versions against the verified stack, device, threads

Bad input (a config typo, a missing file, a malformed data set, an unreadable checkpoint) ends
with one line naming the file and key or column, and exit status 2. Read-only commands (``eval``,
``plan``, a ``--resume`` of a finished run) change none of a run's files.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from embedtrain.cli import datagen, doctor, export, ingest, plan, report, train, tune
from embedtrain.cli.errors import UsageError, quiet_libraries, run_command
from embedtrain.runtime import mark, tune_allocator

COMMANDS = (train, tune, plan, ingest, datagen, export, report, doctor)


def entry() -> None:
    """The ``embedtrain`` console script and ``python -m embedtrain``: :func:`main`, then exit.

    A process that joined a process group leaves through
    :func:`embedtrain.processes.exit_process` (barrier on success, group destroyed, output
    flushed, no interpreter finalization while gloo's threads run; see that module).
    """
    from embedtrain.processes import exit_process, joined_process_group, start_worker

    if "LOCAL_RANK" in os.environ:  # a torchrun worker: a fatal signal prints every thread
        import faulthandler

        start_worker()  # dies with torchrun; SIGINT ends it as SIGTERM does (torchrun says it)
        faulthandler.enable()
    code, clean = 1, False
    tune_allocator()  # before anything allocates (see embedtrain.runtime)
    try:
        code = main()
        clean = code == 0
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        clean = code == 0
    except BaseException:  # noqa: BLE001 - a bug: show it, then still shut down in order
        import traceback

        traceback.print_exc()
    if joined_process_group():
        exit_process(code, barrier=clean)
    sys.exit(code)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parses ``argv`` (default: ``sys.argv[1:]``) and runs the command; its exit status."""
    mark("imports")  # start-up's first part: the interpreter and embedtrain's light modules
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv
    quiet_libraries()
    return run_command(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="embedtrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


__all__ = ["UsageError", "entry", "main"]
