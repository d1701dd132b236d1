"""``embedtrain ingest``: an ingestion spec run over raw files (the jobs live in ``pipelines/``).

The data set is written into a temporary folder beside ``--out`` that replaces ``--out`` only
when complete (:func:`pipelines.run_ingest`): a failed or killed ingest leaves ``--out`` as it
was, and the next one removes a killed one's leftovers (one line). An earlier ingest output at
``--out`` is replaced; ``--overwrite`` replaces any earlier data set there (one that
``embedtrain datagen`` wrote, an unfinished ingest output, one holding other files too). A folder
that is not a data set, a file, or a path under a file is refused in one line (exit status 2),
as is a full disk while writing (naming ``--out``; the earlier data set stays).

Ctrl-C (SIGINT) ends the ingest with one line on stderr and exit status 130,
``embedtrain ingest: interrupted; OUT not written`` (``(earlier output kept)`` when OUT held
something): the temporary folder is removed and ``--out`` keeps what it held, byte for byte (or, when the signal came as the new
data set took its place, ``...; OUT is written, complete``). Polars stops its query at once (its
own SIGINT hook, which also keeps its threads' interrupt panics off stderr) and raises
``KeyboardInterrupt``."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path


def register(sub) -> None:
    """Adds the ``ingest`` command to the subparsers ``sub``."""
    p = sub.add_parser("ingest", help="raw logs (Criteo TSV, CSV, parquet), graph edge lists "
                       "(kind: graph), multi-label XC data (kind: xc) or event logs (kind: "
                       "sequence) to a training data set")
    p.add_argument("spec", help="ingestion spec, YAML (see configs/ingest/); kind: graph, "
                   "kind: xc and kind: sequence select the graph, extreme-classification and "
                   "event-log jobs")
    p.add_argument("--input", dest="inputs", action="append", required=True, metavar="PATH_OR_GLOB",
                   help="input file, directory or quoted glob (repeatable)")
    p.add_argument("--out", required=True,
                   help="output data set directory; an earlier ingest output there is replaced "
                        "once the new one is complete")
    p.add_argument("--overwrite", action="store_true",
                   help="also replace another data set at --out (one from embedtrain datagen, "
                        "an unfinished ingest output, one holding other files too); a folder "
                        "that is not a data set is never replaced")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec key, e.g. --set output.rows_per_file=500000 or, for an "
                        "XC spec, --set split.files.test=test.txt (repeatable)")
    p.add_argument("--nodes", dest="node_inputs", action="append", metavar="PATH_OR_GLOB",
                   help="graph specs (kind: graph) only: the node table (repeatable)")
    p.add_argument("--extend", metavar="DATASET",
                   help="tabular specs: the data set (or partitioned data set: its newest "
                        "partition) this one continues, e.g. yesterday's partition: its "
                        "vocabularies keep their ids and gain the new values, its dense "
                        "constants are reused (continual training)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--engine", choices=["polars", "ray"], default="polars",
                   help="polars: one process (default); ray: the same passes as Ray tasks, file "
                        "by file, with the same outputs (every kind of spec)")
    p.add_argument("--address", default=None,
                   help="--engine ray: a running Ray cluster to join (ray start --head prints "
                        "it); default: a local instance for the job")
    p.add_argument("--num-cpus", type=int, default=None,
                   help="--engine ray, local instance: its CPUs (default: every core)")
    p.set_defaults(func=_ingest)


def _ingest(args: argparse.Namespace) -> int:
    from pipelines import run_ingest

    try:
        _, lines = run_ingest(args.spec, args.inputs, args.out, overrides=args.overrides,
                              nodes=args.node_inputs or (), engine=args.engine,
                              address=args.address, num_cpus=args.num_cpus,
                              progress=not args.quiet, overwrite=args.overwrite,
                              extend=args.extend)
    except KeyboardInterrupt as e:
        while True:  # Python's own KeyboardInterrupt for the signal may come now: again
            try:
                return _stop(_interrupted(args.out, e))
            except KeyboardInterrupt:
                continue
    print("\n".join(lines))
    return 0


def _stop(line: str) -> int:
    """Says ``line``, with SIGINT ignored from now on; the exit status, 130."""
    main = threading.current_thread() is threading.main_thread()
    if main:  # a handler that does nothing first: a pending signal must find a handler (with
        # SIG_IGN, Python would report it as "ignored due to race condition")
        signal.signal(signal.SIGINT, lambda signum, frame: None)
    print(line, file=sys.stderr, flush=True)
    if main:  # and while the interpreter ends (it restores SIG_DFL for handlers of its own)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return 130


def _interrupted(out: str, e: KeyboardInterrupt) -> str:
    """The one line for an ingest interrupted by ``e``."""
    if getattr(e, "published", False):
        return f"embedtrain ingest: interrupted; {out} is written, complete"
    try:
        earlier = Path(out).is_dir() and any(Path(out).iterdir())
    except OSError:
        earlier = False
    kept = " (earlier output kept)" if earlier else ""
    return f"embedtrain ingest: interrupted; {out} not written{kept}"
