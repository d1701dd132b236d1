"""``embedtrain report RUN [RUN ...] --out FILE.html``: runs (and ``tune`` directories' trials)
side by side in one self-contained HTML page (:mod:`embedtrain.train.report`); the runs' files
are only read.

Example:
    embedtrain report runs/dlrm runs/dcn --out compare.html
"""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    """Adds the ``report`` command to the subparsers ``sub``."""
    p = sub.add_parser("report", help="runs side by side in one HTML page: curves, config "
                                      "differences, final metrics, throughput, plans, trials")
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="run directories, or embedtrain tune directories (their trials)")
    p.add_argument("--out", required=True, help="the HTML file to write")
    p.set_defaults(func=_report)


def _report(args) -> int:
    from embedtrain.train.report import load_runs, render_report
    from embedtrain.utils import write_atomic

    out = Path(args.out)
    for run in map(Path, args.runs):
        if not run.is_dir():
            raise ValueError(f"{run}: no such directory")
    runs, searches = load_runs(args.runs)
    for run in (*runs, *searches):
        if run.path.resolve() in out.resolve().parents:
            raise ValueError(f"--out {out}: inside {run.path}; the report writes nothing into "
                             "a run")
    if not runs:
        raise ValueError(f"{', '.join(args.runs)}: no run to report (a search without trials)")
    write_atomic(out, render_report(runs, searches))
    print(f"report of {len(runs)} run(s) written to {out}")
    return 0
