"""``embedtrain train`` and ``embedtrain eval``: a run directory from a config, and a read-only
evaluation of one of its checkpoints.

``train`` checks the config and the run directory before torch is imported (a typo costs ~0.1 s),
launches ``--nproc`` ranks through torchrun, then builds the run through its recipe
(:func:`embedtrain.recipes.build_run`) and calls :meth:`~embedtrain.train.trainer.Trainer.fit`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from embedtrain.cli.errors import UsageError
from embedtrain.config import (
    RESUME_SAFE_KEYS,
    changed_keys,
    check_world_size,
    dump_config,
    load_cluster,
    load_config,
    load_run_config,
    with_derived_sizes,
)
from embedtrain.runtime import allocator_setting, mark, threads_per_rank, usable_cores
from embedtrain.train.run_dir import LOCK_FILE, RunDir
from embedtrain.utils import check_output_file, write_atomic

EvaluationHook = Callable[[Any, dict], None]  # (trainer, record): see Trainer.on_evaluation


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
    p.set_defaults(func=_eval)


def _train(args: argparse.Namespace, on_evaluation: Optional[EvaluationHook] = None) -> int:
    """``embedtrain train``; ``on_evaluation`` goes to the trainer (``Trainer.on_evaluation``:
    ``embedtrain tune`` reports each evaluation to its scheduler with it)."""
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite exclude each other")
    cfg = load_config(args.config, args.overrides)
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
    # Refusals and "nothing to resume" first, touching nothing (not even the lock file) ...
    if os.environ.get(_LOCKED_ENV) != str(out.resolve()) and _rank() == 0:
        RunDir(out, create=False).check_unlocked()
    if _check_run_dir(cfg, out, resume, args.overwrite) is None:
        return 0
    with _writer_lock(out):  # ... then again as the one writer (held while torchrun runs)
        if launching:
            if _check_run_dir(cfg, out, resume, args.overwrite, quiet=True) is None:
                return 0
            return _launch(args, args.argv)
        return _train_here(args, cfg, cluster, out, resume, on_evaluation)


def _train_here(args: argparse.Namespace, cfg, cluster, out: Path, resume: bool,
                on_evaluation: Optional[EvaluationHook] = None) -> int:
    """This process's part of ``train``: one rank (of torchrun's), or the whole run."""
    changes = _check_run_dir(cfg, out, resume, args.overwrite, quiet=True)
    if changes is None:  # a finished run: said so, nothing changed
        return 0
    if not resume and RunDir(out, create=False).has_run() and _rank() == 0:
        RunDir(out).clear()  # --overwrite (checked above)
    threads = _set_threads(cfg.train.threads_per_rank)
    mark("torch")  # the config checked, torch imported
    from embedtrain.recipes import build_run  # heavy (torchrec): after input checks

    mark("libraries")  # torchrec, fbgemm, torchmetrics, the recipes
    # a resume writes its plan only once its checkpoint is read: a refused one changes nothing
    run = build_run(cfg, out, progress=False if args.no_progress else None, cluster=cluster,
                    record_plan=not resume)
    mark("build")  # the model, its plan, sharding, optimizers, readers
    trainer = run.trainer
    trainer.on_evaluation = on_evaluation
    trainer.extra_summary["threads_per_rank"] = threads[0]
    if changes:
        trainer.resume_note = {"config_changes": {k: list(v) for k, v in changes.items()}}
    if resume:
        trainer.resume()  # before any record changes: an unreadable run fails here, untouched
        run.recipe.write_plan(out)
    if trainer.rank == 0:
        if not (resume and not changes and (out / "config.yaml").is_file()):
            dump_config(cfg, out / "config.yaml")
        print(_banner(run, trainer), file=sys.stderr)
        print(f"threads: {threads[0]} per rank ({threads[1]}); allocator: {allocator_setting()}",
              file=sys.stderr)
    summary = run.fit()
    if trainer.rank == 0:
        _print_summary(summary, out, run.recipe.summary_lines(summary))
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

    from embedtrain.processes import free_port, run_supervised
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
    cmd = [sys.executable, "-m", "embedtrain.train.launch", f"--nproc-per-node={args.nproc}",
           f"--max-restarts={args.max_restarts}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "embedtrain", *rest]
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


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


_LOCKED_ENV = "EMBEDTRAIN_RUN_LOCKED"  # set for the ranks of a run whose launcher holds the lock


@contextlib.contextmanager
def _writer_lock(out: Path) -> Iterator[None]:
    """One writer per run directory: this process (or the launcher above it) holds ``.lock``.

    ``embedtrain train --nproc N`` takes it before launching and keeps it while torchrun and its
    ranks run (they skip it); a rank started by a user's own torchrun takes it on rank 0. A run
    directory this created and that holds nothing else when the command ends (it failed before
    writing anything) is removed.
    """
    key = str(out.resolve())
    if os.environ.get(_LOCKED_ENV) == key or _rank() != 0:
        yield
        return
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    run_dir = RunDir(out)
    run_dir.lock()
    os.environ[_LOCKED_ENV] = key  # inherited by the ranks _launch starts
    try:
        yield
    finally:
        os.environ.pop(_LOCKED_ENV, None)
        run_dir.unlock()
        if created and [p.name for p in out.iterdir()] == [LOCK_FILE]:
            shutil.rmtree(out, ignore_errors=True)


def _set_threads(requested: Optional[int]) -> tuple[int, str]:
    """Sets this rank's torch intra-op threads (:func:`embedtrain.runtime.threads_per_rank`)."""
    threads, source = threads_per_rank(requested)
    import torch

    torch.set_num_threads(threads)
    return threads, source


def _check_run_dir(cfg, out: Path, resume: bool, overwrite: bool,
                   quiet: bool = False) -> Optional[dict]:
    """What ``train`` may do with ``out`` (read-only checks, before anything is built).

    Returns:
        The config keys a resume changes (``{}`` for a fresh run), or None when the run is
        finished and there is nothing to do (printed).

    Raises:
        UsageError: an earlier run without --resume/--overwrite, or a resume whose config changes
            the model, the data or the optimizer (the keys named).
    """
    run_dir = RunDir(out, create=False)
    if not run_dir.has_run():
        return {}
    if not resume:
        if not overwrite:
            raise UsageError(f"{out}: holds an earlier run; pass --resume to continue it, "
                             "--overwrite to replace it, or choose another --out")
        return {}
    saved_file = out / "config.yaml"
    if not saved_file.is_file():
        return {}
    saved = load_run_config(saved_file)
    changes = changed_keys(with_derived_sizes(saved), with_derived_sizes(cfg))
    unsafe = {k: v for k, v in changes.items() if k not in RESUME_SAFE_KEYS}
    if unsafe:
        shown = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in list(unsafe.items())[:4])
        more = f" (and {len(unsafe) - 4} more)" if len(unsafe) > 4 else ""
        raise UsageError(f"{out}: --resume with a config that differs from {saved_file} in "
                         f"{shown}{more}; a resumed run may change only its length, its "
                         f"evaluation and checkpoint cadence and loader threads "
                         f"({', '.join(sorted(RESUME_SAFE_KEYS))}): start a new run (--out)")
    from embedtrain.train.checkpoint import CheckpointError, CheckpointManager

    checkpoints = CheckpointManager(run_dir.checkpoints)
    latest = checkpoints.latest()
    try:
        info = checkpoints.info(latest) if latest else {}
    except CheckpointError:
        info = {}  # unreadable: the trainer falls back to an older checkpoint
    step, total = info.get("step"), _resumed_total(info, saved, cfg)
    if total is not None and step is not None and total < step:
        raise UsageError(f"{out}: --resume would shorten the run to {total:,} steps, below its "
                         f"checkpoint at step {step:,} (train.max_steps / train.epochs); the run's "
                         "files are untouched: start a new run (--out) to train fewer steps")
    longer = {"train.epochs", "train.max_steps"} & set(changes) and (total is None or total > step)
    if info.get("finished") and not longer and (out / "summary.json").is_file():
        if _rank() == 0 and not quiet:
            total = info.get("total_steps", info["step"])
            print(f"{out}: finished at step {info['step']:,} of {total:,}; nothing to resume "
                  "(to train longer, raise train.max_steps or train.epochs with --set)",
                  file=sys.stderr)
        return None
    return changes


def _resumed_total(info: dict, saved, cfg) -> Optional[int]:
    """The steps a resumed run would end at under ``cfg`` (None where it cannot be known without
    the data: the saved run was bounded by ``max_steps`` and ``cfg`` counts in epochs)."""
    total = info.get("total_steps")
    if not isinstance(total, int):
        return None
    old_max, epochs = saved.train.max_steps, saved.train.epochs
    per_epoch = total // epochs if (old_max is None or old_max > total) and epochs else None
    bounds = [b for b in (cfg.train.max_steps,
                          cfg.train.epochs * per_epoch if per_epoch is not None else None)
              if b is not None]
    return min(bounds) if bounds else None


def _banner(run, trainer) -> str:
    """The run's data in one line: rows over all ranks, each rank's share, steps."""
    data, info = trainer.train_data, run.recipe.dataset_info()
    what = f"train {data.unit}"
    shares = data.rank_rows
    split = f" over {len(shares)} ranks ({' + '.join(f'{n:,}' for n in shares)})" \
        if len(shares) > 1 else ""
    per_epoch = len(data)
    padding = sum(data.step_rows(i)[1] for i in range(max(per_epoch - 1, 0), per_epoch))
    extra = f", {padding} padding row(s) in each epoch's last step" if padding else ""
    dropped = data.dropped_rows
    extra += f", {dropped:,} rows dropped per epoch (data.drop_last)" if dropped else ""
    return (f"data: {info.name} ({info.root}), {what}: {data.total_rows:,}{split}; "
            f"{per_epoch:,} steps per epoch{extra}; steps: {trainer.total_steps:,}")


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
    result = evaluate(run_dir, args.split, args.checkpoint)
    if _rank() == 0:
        text = json.dumps(result, indent=2) + "\n"
        if out is not None:
            write_atomic(out, text)
            print(f"written: {out}", file=sys.stderr)
        sys.stdout.write(text)
    return 0


def _print_summary(summary: dict, out: Path, metric_lines: list[str]) -> None:
    print(f"\nfinal metrics on {summary['split']} ({summary['dataset']}):")
    for line in metric_lines:
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
