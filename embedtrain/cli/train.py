"""``embedtrain train`` and ``embedtrain eval``: a run directory from a config, and a read-only
evaluation of one of its checkpoints.

``train`` checks the config and the run directory before torch is imported (a typo costs ~0.1 s),
launches ``--nproc`` ranks through torchrun, then runs :func:`embedtrain.recipes.fit` (the run
directory's life: lock, resume policy, records) on each rank.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from embedtrain.cli.errors import UsageError
from embedtrain.config import check_world_size, load_cluster, load_config
from embedtrain.lifecycle import check_start
from embedtrain.runtime import mark, usable_cores
from embedtrain.train.lineage import check_warm_start
from embedtrain.train.run_dir import RunDir, env_rank
from embedtrain.utils import check_output_file, write_atomic


def register(sub) -> None:
    """Adds the ``train`` and ``eval`` commands to the subparsers ``sub``."""
    p = sub.add_parser("train", help="train a model from a YAML config")
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.max_steps=100 (repeatable)")
    p.add_argument("--out", help="run directory (default: runs/<config name>)")
    p.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in a run directory that holds an earlier run (deletes it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--cluster", help="cluster description (configs/clusters/) whose plan to train "
                   "with; its world size must match (default: this machine)")
    p.add_argument("--nproc", type=int, help="launch this many processes on this machine through "
                   "torchrun (gloo on CPU, nccl on GPUs)")
    p.add_argument("--warm-start", metavar="RUN",
                   help="start from that finished run's selected checkpoint (weights and optimizer "
                        "state; tables grown to a larger vocabulary): continual training, "
                        "train.warm_start")
    p.add_argument("--partitions", metavar="P[,P...]",
                   help="of a partitioned data set (a folder of data sets, e.g. day=001/), the "
                        "partitions to train on, in order: data.partitions (default: all)")
    p.add_argument("--follow", metavar="RUNS",
                   help="continuous mode: train each partition of the data set once, in order, "
                        "as it appears, each run (RUNS/<partition>) warm-started from the one "
                        "before and first evaluated on it (RUNS/follow.jsonl); one process")
    p.add_argument("--max-partitions", type=int, metavar="N",
                   help="with --follow: stop after N partitions")
    p.add_argument("--wait-s", type=float, default=0.0, metavar="S",
                   help="with --follow: stop when no new partition appeared for S seconds "
                        "(default 0: when none is left)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="with --nproc: restarts torchrun may make after a rank dies; a restarted "
                        "job resumes from the last checkpoint")
    p.set_defaults(func=_train)

    p = sub.add_parser("eval", help="evaluate a run's checkpoint on a split")
    p.add_argument("run_dir", help="a run directory written by `embedtrain train`")
    p.add_argument("--split", default="test", help="data split to evaluate (default: test)")
    p.add_argument("--checkpoint", help="checkpoint directory or step number (default: the run's "
                                        "newest)")
    p.add_argument("--out", help="also write the result (JSON) to this file; nothing is ever "
                                 "written into the run directory")
    p.add_argument("--partitions", metavar="P[,P...]",
                   help="of the run's partitioned data set, evaluate these partitions' split "
                        "(e.g. --split train --partitions day=004: the next day's rows)")
    p.set_defaults(func=_eval)


def _partitions(text: Optional[str]) -> Optional[list[str]]:
    if text is None:
        return None
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise UsageError("--partitions: expected partition names, e.g. day=002,day=003")
    return names


def _data_overrides(args: argparse.Namespace) -> list[str]:
    """``--warm-start`` and ``--partitions`` as the config keys they set."""
    extra = []
    if args.warm_start is not None:
        extra.append(f"train.warm_start={args.warm_start}")
    partitions = _partitions(args.partitions)
    if partitions is not None:
        extra.append(f"data.partitions=[{','.join(partitions)}]")
    return [*args.overrides, *extra]


def _train(args: argparse.Namespace) -> int:
    """``embedtrain train``: :func:`embedtrain.recipes.fit` on this process's rank, or a launch
    of ``--nproc`` ranks through torchrun that each do so."""
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite exclude each other")
    if args.follow is not None:
        return _follow(args)
    cfg = load_config(args.config, _data_overrides(args))
    cluster = load_cluster(args.cluster) if args.cluster else None
    out = Path(args.out) if args.out else Path("runs") / Path(args.config).stem
    RunDir.check_out(out)
    launching = args.nproc is not None and "LOCAL_RANK" not in os.environ
    if launching:
        if args.nproc < 1:
            raise UsageError(f"--nproc: must be at least 1, got {args.nproc}")
        check_world_size(cfg, args.nproc, str(args.config))  # before launching, not in N ranks
    # torchrun restarts the workers after a rank dies: they continue from the last checkpoint.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    resume = args.resume or restarted
    # Refusals and "nothing to resume" first, touching nothing (not even the lock file), before
    # torch is imported ...
    run_dir = RunDir(out, create=False)
    if check_start(run_dir, cfg, resume, args.overwrite) is None:
        return 0
    check_warm_start(cfg)  # a consumed partition, an unfinished source: refused here, once
    if launching:
        with run_dir.writer():  # ... held while torchrun runs (the ranks skip it)
            if check_start(run_dir, cfg, resume, args.overwrite, quiet=True) is None:
                return 0
            return _launch(args, args.argv)
    importlib.import_module("torch")
    mark("torch")  # the config checked, torch imported
    from embedtrain.recipes import fit  # heavy (torchrec): after input checks

    mark("libraries")  # torchrec, fbgemm, torchmetrics, the recipes
    summary = fit(cfg, out, resume=resume, overwrite=args.overwrite,
                  progress=False if args.no_progress else None, cluster=cluster)
    if summary is not None and env_rank() == 0:
        _print_summary(summary, out, cfg)
    return 0


def _follow(args: argparse.Namespace) -> int:
    """``embedtrain train CONFIG --follow RUNS``: :func:`embedtrain.recipes.follow`."""
    given = [f for f, v in (("--out", args.out), ("--resume", args.resume),
                            ("--overwrite", args.overwrite), ("--warm-start", args.warm_start),
                            ("--partitions", args.partitions), ("--nproc", args.nproc),
                            ("--cluster", args.cluster)) if v]
    if given:
        raise UsageError(f"--follow: not with {given[0]} (the runs are RUNS/<partition>, each "
                         f"warm-started from the one before, on one process)")
    cfg = load_config(args.config, args.overrides)
    importlib.import_module("torch")
    from embedtrain.recipes import follow

    records = follow(cfg, args.follow, max_partitions=args.max_partitions, wait_s=args.wait_s,
                     progress=False if args.no_progress else None)
    for r in records:
        before = r.get("before") or {}
        score = "".join(f" {k} {before[k]:.4f}" for k in ("auc", "loss") if k in before)
        print(f"{r['partition']}: trained into {r['run']}"
              f"{f'; the run before on it:{score}' if score else ''}")
    print(f"{len(records)} partition(s) trained; records: {Path(args.follow) / 'follow.jsonl'}")
    return 0


def _launch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Re-runs this command under ``torchrun`` with ``--nproc`` processes on this machine.

    torchrun runs in a process group of its own, so SIGTERM, SIGINT or SIGHUP to this process
    or to its group reaches it once, passed on here; it stops every worker, and whatever still
    runs 8 s later (or after a second signal) is SIGKILLed. Such a run ends with one line,
    ``embedtrain: stopped by SIGTERM; continue the run in runs/x with --resume``, and exit
    status 128 + the signal's number (143, 130, 129). torchrun dies with this process and each
    worker with torchrun, even when this process is SIGKILLed (a parent-death signal, see
    :func:`embedtrain.processes.die_with_parent`).
    """
    import signal

    import uuid

    from embedtrain.processes import run_supervised
    from embedtrain.train.launch import RUN_DIR_ENV, stopped_line

    rest, skip = [], False
    for a in argv:  # drop --nproc N / --max-restarts K (and their = forms)
        if skip:
            skip = False
            continue
        if a in ("--nproc", "--max-restarts"):
            skip = True
            continue
        if a.startswith(("--nproc=", "--max-restarts=")):
            continue
        rest.append(a)
    # The c10d rendezvous on port 0 (torchrun's --standalone, on 127.0.0.1): torchrun's store
    # binds a free port itself; a port chosen here and bound later could be taken in between.
    cmd = [sys.executable, "-m", "embedtrain.train.launch", f"--nproc-per-node={args.nproc}",
           f"--max-restarts={args.max_restarts}", "--rdzv-backend=c10d",
           "--rdzv-endpoint=127.0.0.1:0", f"--rdzv-id={uuid.uuid4().hex}", "-m", "embedtrain",
           *rest]
    print(f"launching {args.nproc} processes: torchrun --nproc-per-node={args.nproc} "
          f"--max-restarts={args.max_restarts} -m embedtrain {' '.join(rest)}", file=sys.stderr)
    out = str(args.out) if args.out else str(Path("runs") / Path(args.config).stem)
    env = {**os.environ, RUN_DIR_ENV: out}
    # torchrun sets 1 thread per rank (and warns) unless told: share this machine's cores (each
    # rank then sets its own count, embedtrain.runtime.threads_per_rank).
    env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // args.nproc)))
    code, signum = run_supervised(cmd, env=env, grace=8.0)
    if signum is not None and code not in (0, 128 + signum):  # torchrun did not say it
        print(stopped_line(signum, out), file=sys.stderr)
        return 128 + signum
    if code < 0:  # torchrun itself killed (its workers die with it)
        print(f"embedtrain: torchrun was killed by {signal.Signals(-code).name}; continue the "
              f"run in {out} with --resume", file=sys.stderr)
        return 128 - code
    return code


def _eval(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise UsageError(f"{run_dir}: not a run directory (no config.yaml)")
    out = Path(args.out) if args.out else None
    if out is not None:
        check_output_file(out, "--out")
    from embedtrain.recipes import evaluate

    # Read-only: no plan files, no records, no result file in the run (a reader of a training
    # run must not race its writer); the result goes to stdout and, with --out, to that file.
    result = evaluate(run_dir, args.split, args.checkpoint, _partitions(args.partitions))
    if env_rank() == 0:
        text = json.dumps(result, indent=2) + "\n"
        if out is not None:
            write_atomic(out, text)
            print(f"written: {out}", file=sys.stderr)
        sys.stdout.write(text)
    return 0


def _print_summary(summary: dict, out: Path, cfg: Any) -> None:
    from embedtrain.recipes import recipe_for

    if summary["split"] is None:  # e.g. a day partition: tomorrow's rows are its test
        print(f"\nno valid or test split in {summary['dataset']}: nothing evaluated (embedtrain "
              f"eval {out} --split SPLIT [--partitions P]):")
    else:
        print(f"\nfinal metrics on {summary['split']} ({summary['dataset']}):")
    for line in recipe_for(cfg).summary_lines(summary):
        print(line)
    selected = summary.get("selected") or {}
    if selected.get("metric"):
        early = ", stopped early" if summary.get("stopped_early") else ""
        print(f"  selected     step {selected['step']:,} of {summary['steps']:,} (best valid "
              f"{selected['metric']} {selected['value']:.4f}{early})")
    elif summary.get("stopped_early"):
        print(f"  stopped      early, at step {summary['steps']:,}")
    rate = summary.get("train_examples_per_s")
    if rate:
        print(f"  training     {rate:,.0f} examples/s over {summary['steps']:,} steps")
    rss = summary.get("peak_rss_gb_per_rank")
    if rss:
        print(f"  memory       peak RSS per rank: {', '.join(f'{x:.2f}' for x in rss)} GiB")
    print(f"run files: {out}/ (config.yaml, metrics.jsonl, summary.json, curves.png, checkpoints/)")
