"""The ``embedtrain`` command line: ``train``, ``eval``, ``plan``, ``ingest``, ``datagen``,
``export`` and ``predict``.

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
    embedtrain eval runs/demo --split test     # writes runs/demo/eval_test_<step>.json only
    embedtrain plan configs/dlrm.yaml --cluster configs/clusters/h100-16x8.yaml --out plans/dlrm
    embedtrain export runs/demo --out exports/demo --quantize int8   # tables, dense program
    embedtrain predict exports/demo --input 'data/synthetic_ctr/test/*.parquet' --out preds.parquet

Bad input (a config typo, a missing file, a malformed data set, an unreadable checkpoint) ends
with one line naming the file and key or column, and exit status 2. Read-only commands (``eval``,
``plan``, a ``--resume`` of a finished run) change none of a run's files.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

from embedtrain.config import (
    RESUME_SAFE_KEYS,
    ConfigError,
    changed_keys,
    check_world_size,
    dump_config,
    load_cluster,
    load_config,
    load_run_config,
)
from embedtrain.dependencies import MissingDependency
from embedtrain.runtime import (
    allocator_setting, mark, threads_per_rank, tune_allocator, usable_cores)
from embedtrain.train.run_dir import RunDir


class UsageError(Exception):
    """Bad input reported as one line and exit status 2."""


def entry() -> None:
    """The ``embedtrain`` console script and ``python -m embedtrain``: :func:`main`, then exit.

    A process that joined a process group leaves through
    :func:`embedtrain.train.dist.exit_process` (barrier on success, group destroyed, output
    flushed, no interpreter finalization while gloo's threads run; see that module).
    """
    if "LOCAL_RANK" in os.environ:  # a torchrun worker: a fatal signal prints every thread
        import faulthandler

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
    dist = sys.modules.get("embedtrain.train.dist")  # only a command that trains imports it
    if dist is not None and dist.joined_process_group():
        dist.exit_process(code, barrier=clean)
    sys.exit(code)


def main(argv: Optional[Sequence[str]] = None) -> int:
    mark("imports")  # start-up's first part: the interpreter and embedtrain's light modules
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    _quiet_libraries()
    try:
        return args.func(args)
    except (ConfigError, UsageError, ValueError, FileNotFoundError, MissingDependency) as e:
        # ValueError covers DatasetError/DataError and model size checks, all one-line messages.
        print(f"embedtrain {args.command}:{_rank_tag()} error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        checkpoint = sys.modules.get("embedtrain.train.checkpoint")  # not imported by datagen
        if checkpoint is not None and isinstance(e, checkpoint.CheckpointError):
            print(f"embedtrain {args.command}:{_rank_tag()} error: {e}", file=sys.stderr)
            return 2
        if _peer_failed(e):  # another rank stopped (its own error says why): one line here
            print(f"embedtrain {args.command}:{_rank_tag()} error: stopped because another "
                  "rank left the process group (its error says why)", file=sys.stderr)
            return 1
        raise
    except KeyboardInterrupt:
        print(f"embedtrain {args.command}: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="embedtrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

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
    p.add_argument("--checkpoint", help="checkpoint directory (default: the run's newest)")
    p.set_defaults(func=_eval)

    p = sub.add_parser("plan", help="dry-run sharding plan of a config on a target cluster")
    p.add_argument("config", nargs="?", help="training config, YAML (see configs/); not with "
                   "--calibrate")
    p.add_argument("--cluster", required=True, action="append",
                   help="cluster description, YAML (configs/clusters/); repeat it to compare "
                        "clusters (a sweep: one table, sweep.html)")
    p.add_argument("--hosts", help="sweep host counts of each cluster file: N, A..B or A,B,C "
                                   "(e.g. 1..16)")
    p.add_argument("--out", help="report directory (default: plans/<config>-<cluster>)")
    p.add_argument("--format", default="md,json,html",
                   help="comma-separated report formats: md, json, html (default: all three)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set sharding.forward_comm_precision=fp16")
    p.add_argument("--budget", type=int, help="partitions the local search may try "
                   "(default: sharding.search_budget)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (a cpu cluster file's ranks, gloo): lookup and "
                        "collective bandwidths and the fixed cost per sharding type, and write "
                        "the cluster file (to --out, default: the --cluster file itself)")
    p.set_defaults(func=_plan)

    p = sub.add_parser("ingest", help="raw logs (Criteo TSV, CSV, parquet), graph edge lists "
                       "(kind: graph) or multi-label XC data (kind: xc) to a training data set")
    p.add_argument("spec", help="ingestion spec, YAML (see configs/ingest/); kind: graph and "
                   "kind: xc select the graph and extreme-classification jobs")
    p.add_argument("--input", dest="inputs", action="append", required=True, metavar="PATH_OR_GLOB",
                   help="input file, directory or quoted glob (repeatable)")
    p.add_argument("--out", required=True, help="output data set directory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec key, e.g. --set output.rows_per_file=500000 or, for an "
                        "XC spec, --set split.files.test=test.txt (repeatable)")
    p.add_argument("--nodes", dest="node_inputs", action="append", metavar="PATH_OR_GLOB",
                   help="graph specs (kind: graph) only: the node table (repeatable)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--engine", choices=["polars", "ray"], default="polars",
                   help="polars: one process (default); ray: the same passes as Ray tasks, file "
                        "by file, with the same outputs (tabular specs)")
    p.add_argument("--address", default=None,
                   help="--engine ray: a running Ray cluster to join (ray start --head prints "
                        "it); default: a local instance for the job")
    p.add_argument("--num-cpus", type=int, default=None,
                   help="--engine ray, local instance: its CPUs (default: every core)")
    p.set_defaults(func=_ingest)

    p = sub.add_parser("datagen", help="generate a synthetic data set")
    gen = p.add_subparsers(dest="kind", required=True)
    g = gen.add_parser("ctr", help="Criteo-layout CTR data with a planted click model")
    g.add_argument("--rows", type=int, default=1_000_000, help="total rows (default: 1,000,000)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", required=True, help="output directory")
    g.add_argument("--format", choices=["parquet", "tsv"], default="parquet",
                   help="parquet: a split, training-ready data set (default); tsv: the same rows "
                        "as raw Criteo-style TSV logs, for `embedtrain ingest`")
    g.add_argument("--drift", action="store_true",
                   help="a drifting data set instead: raw int64 ids born and dying over time "
                        "periods, split by time (embedtrain.datagen.drift)")
    g.add_argument("--drift-periods", type=int, metavar="N",
                   help="with --drift: time periods (default 20; train 80%%, valid, test 10%%)")
    g.add_argument("--drift-lifetime", type=int, metavar="N",
                   help="with --drift: periods an id stays alive (default 4)")
    g.add_argument("--drift-new-ids", type=int, metavar="N",
                   help="with --drift: new ids per period and feature, before the per-feature "
                        "scale (default 2000)")
    g = gen.add_parser("xc", help="extreme-classification data: Zipfian classes with planted "
                                  "token prototypes, and the Bayes-optimal P@1")
    g.add_argument("--classes", type=int, default=100_000, help="number of classes C")
    g.add_argument("--rows", type=int, default=1_000_000, help="total rows (default: 1,000,000)")
    g.add_argument("--vocab", type=int, default=200_000, help="token vocabulary size")
    g.add_argument("--noise", type=float, default=0.8,
                   help="share of a row's tokens drawn from the background (default 0.8)")
    g.add_argument("--multi-label", action="store_true",
                   help="rows carry 1..4 labels (a list column `labels`)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", required=True, help="output directory")
    g = gen.add_parser("graph", help="a graph with planted communities (degree-corrected SBM) "
                                     "that set the labels, and weakly informative features")
    g.add_argument("--nodes", type=int, default=100_000, help="number of nodes N")
    g.add_argument("--avg-degree", type=float, default=10.0, help="expected neighbours per node")
    g.add_argument("--communities", type=int, default=16, help="communities = classes")
    g.add_argument("--feature-dim", type=int, default=32, help="node feature dimension")
    g.add_argument("--link-fraction", type=float, default=0.0,
                   help="share of edges held out as valid/test link-prediction positives")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=_datagen)

    p = sub.add_parser("export", help="a run's checkpoint as files for inference: embedding "
                       "tables, the dense model (torch.export), model.json")
    p.add_argument("run_dir", help="a run directory written by `embedtrain train`")
    p.add_argument("--checkpoint", help="step (e.g. 500) or checkpoint directory (default: the "
                   "run's newest)")
    p.add_argument("--out", required=True, help="export directory")
    p.add_argument("--quantize", default="none", help="tables as none (float32), int8 or int4 "
                   "(TorchRec/FBGEMM rowwise quantization; default: none)")
    p.add_argument("--format", default="npy", help="table files: npy, parquet or npy,parquet "
                   "(default: npy)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_export)

    p = sub.add_parser("predict", help="score parquet rows with an export (streaming)")
    p.add_argument("export_dir", help="a directory written by `embedtrain export`")
    p.add_argument("--input", dest="inputs", action="append", required=True, metavar="PATH_OR_GLOB",
                   help="parquet file, directory or quoted glob in the data set's layout "
                        "(repeatable)")
    p.add_argument("--out", required=True, help="predictions parquet file")
    p.add_argument("--batch-size", type=int, default=8192, help="rows scored at once "
                   "(default: 8192)")
    p.add_argument("--top-k", type=int, help="XC: classes per row (default: the run's largest "
                   "xc.top_k)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_predict)
    return parser


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "Socket Timeout", "Connection refused")


def _peer_failed(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing because a peer rank is gone (several ranks only)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and any(m in str(e) for m in _PEER_GONE)


def _rank_tag() -> str:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f" [rank {os.environ.get('RANK', '0')}/{world}]" if world > 1 else ""


def _launch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Re-runs this command under ``torchrun`` with ``--nproc`` processes on this machine."""
    from embedtrain.train.dist import free_port

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
    import subprocess

    env = dict(os.environ)
    # torchrun sets 1 thread per rank (and warns) unless told: share this machine's cores (each
    # rank then sets its own count, embedtrain.runtime.threads_per_rank).
    env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // args.nproc)))
    return subprocess.call(cmd, env=env)


def _train(args: argparse.Namespace) -> int:
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite exclude each other")
    cfg = load_config(args.config, args.overrides)
    cluster = load_cluster(args.cluster) if args.cluster else None
    out = Path(args.out) if args.out else Path("runs") / Path(args.config).stem
    if args.nproc is not None and "LOCAL_RANK" not in os.environ:
        if args.nproc < 1:
            raise UsageError(f"--nproc: must be at least 1, got {args.nproc}")
        check_world_size(cfg, args.nproc, str(args.config))  # before launching, not in N ranks
        if _check_run_dir(cfg, out, args.resume, args.overwrite) is None:
            return 0  # a finished run: nothing to launch
        return _launch(args, args.argv)
    # torchrun restarts the workers after a rank dies: they continue from the last checkpoint.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    resume = args.resume or restarted
    changes = _check_run_dir(cfg, out, resume, args.overwrite)
    if changes is None:  # a finished run: said so, nothing changed
        return 0
    if not resume and RunDir(out, create=False).has_run() and _rank() == 0:
        RunDir(out).clear()  # --overwrite (checked above)
    threads = _set_threads(cfg.train.threads_per_rank)
    mark("torch")  # the config checked, torch imported
    from embedtrain.recipes import build_run  # heavy (torchrec): after input checks

    mark("libraries")  # torchrec, fbgemm, torchmetrics, the recipes
    run = build_run(cfg, out, progress=False if args.no_progress else None, cluster=cluster)
    mark("build")  # the model, its plan, sharding, optimizers, readers
    trainer = run.trainer
    trainer.extra_summary["threads_per_rank"] = threads[0]
    if changes:
        trainer.resume_note = {"config_changes": {k: list(v) for k, v in changes.items()}}
    if resume:
        trainer.resume()  # before any record changes: an unreadable run fails here, untouched
    if trainer.rank == 0:
        if not (resume and not changes and (out / "config.yaml").is_file()):
            dump_config(cfg, out / "config.yaml")
        print(_banner(run, trainer), file=sys.stderr)
        print(f"threads: {threads[0]} per rank ({threads[1]}); allocator: {allocator_setting()}",
              file=sys.stderr)
    summary = trainer.fit(test_data=run.test_data)
    if trainer.rank == 0:
        _print_summary(summary, out, run.recipe.summary_lines(summary))
    return 0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _set_threads(requested: Optional[int]) -> tuple[int, str]:
    """Sets this rank's torch intra-op threads (:func:`embedtrain.runtime.threads_per_rank`)."""
    threads, source = threads_per_rank(requested)
    import torch

    torch.set_num_threads(threads)
    return threads, source


def _check_run_dir(cfg, out: Path, resume: bool, overwrite: bool) -> Optional[dict]:
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
    changes = changed_keys(load_run_config(saved_file), cfg)
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
    longer = {"train.epochs", "train.max_steps"} & set(changes)
    if info.get("finished") and not longer and (out / "summary.json").is_file():
        if _rank() == 0:
            total = info.get("total_steps", info["step"])
            print(f"{out}: finished at step {info['step']:,} of {total:,}; nothing to resume "
                  "(to train longer, raise train.max_steps or train.epochs with --set)",
                  file=sys.stderr)
        return None
    return changes


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
    cfg = load_run_config(run_dir / "config.yaml")
    from embedtrain.recipes import build_run

    # Read-only: no plan files, no records; the result goes to a file of its own.
    run = build_run(cfg, run_dir, progress=False, record_plan=False)
    if run.trainer.restore(args.checkpoint) is None:
        raise UsageError(f"{run_dir / 'checkpoints'}: no complete checkpoint to evaluate")
    data = run.eval_reader(args.split)
    step = run.trainer.state.step
    result = {"split": args.split, "step": step, **run.trainer.evaluate(data)}
    if run.trainer.rank == 0:
        path = RunDir(run_dir).write_eval(args.split, step, result)
        print(json.dumps(result, indent=2))
        print(f"written: {path}", file=sys.stderr)
    return 0


def _host_counts(text: str) -> list[int]:
    """``--hosts``: ``N``, ``A..B`` or ``A,B,C``."""
    try:
        if ".." in text:
            low, high = (int(x) for x in text.split(".."))
            counts = list(range(low, high + 1))
        else:
            counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise UsageError(f"--hosts: expected N, A..B or A,B,C of positive integers, got {text!r}")
    return counts


def _sweep(args: argparse.Namespace, cfg) -> int:
    """``embedtrain plan CONFIG --cluster A --cluster B [--hosts 1..16]``: every candidate
    planned; one table (stdout, ``sweep.json``, ``sweep.html``); exit 0 when one fits."""
    import dataclasses

    from embedtrain.recipes import plan_model
    from embedtrain.sharding.planner import PlanError

    candidates = []
    for path in args.cluster:
        base = load_cluster(path)
        for hosts in (_host_counts(args.hosts) if args.hosts else [base.hosts]):
            candidates.append(dataclasses.replace(
                base, hosts=hosts, name=f"{base.name}@{hosts}x{base.devices_per_host}"
                if args.hosts else base.name))
    rows = []
    for cluster in candidates:
        row = {"cluster": cluster.name, "ranks": cluster.world_size, "hosts": cluster.hosts,
               "device": cluster.device.value}
        try:
            s = plan_model(cfg, cluster).report.summary
            row.update(fits=True, peak_rank_gib=s.peak_rank_memory_bytes / 2**30,
                       capacity_gib=s.rank_memory_capacity_bytes / 2**30,
                       step_estimate_ms=s.step_estimate_ms, imbalance=s.imbalance)
        except PlanError as e:
            if not str(e).startswith("does not fit"):
                raise  # a constraint error is the config's, not the cluster's: one line, exit 2
            row.update(fits=False, why=str(e))
        rows.append(row)
    fitting = [r for r in rows if r["fits"]]
    smallest = min(fitting, key=lambda r: (r["ranks"], r["step_estimate_ms"])) if fitting else None
    out = Path(args.out) if args.out else Path("plans") / f"{Path(args.config).stem}-sweep"
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(
        {"config": str(args.config), "candidates": rows,
         "smallest_that_fits": smallest["cluster"] if smallest else None}, indent=2) + "\n")
    head = ["cluster", "ranks", "fits", "peak GiB / rank", "step estimate ms"]
    lines = []
    for r in rows:
        mark = " <- smallest that fits" if r is smallest else ""
        cells = [r["cluster"], str(r["ranks"]), "yes" if r["fits"] else "no",
                 f"{r['peak_rank_gib']:.2f} of {r['capacity_gib']:.2f}" if r["fits"] else "-",
                 f"{r['step_estimate_ms']:.3f}" if r["fits"] else r["why"][:60]]
        lines.append((cells, mark))
    widths = [max(len(h), *(len(c[i]) for c, _ in lines)) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for cells, mark in lines:
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)) + mark)
    from embedtrain.sharding.report import render_sweep_html

    best = next((n for n, (_, mark) in enumerate(lines) if mark), None)
    (out / "sweep.html").write_text(render_sweep_html(str(args.config), head,
                                                      [c for c, _ in lines], best))
    print(f"smallest that fits: {smallest['cluster'] if smallest else 'none'}; "
          f"report: {out / 'sweep.html'}, {out / 'sweep.json'}")
    return 0 if smallest else 1


def _calibrate(args: argparse.Namespace) -> int:
    """``embedtrain plan --calibrate --cluster FILE [--out FILE]``."""
    if args.config or len(args.cluster) != 1 or args.hosts:
        raise UsageError("--calibrate: give one --cluster file and no config or --hosts")
    from embedtrain.sharding.calibrate import calibrate, write_cluster_yaml

    path = args.cluster[0]
    calibration = calibrate(load_cluster(path))
    out = args.out or path
    try:
        write_cluster_yaml(calibration, out, template=path)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot write the cluster file ({e.strerror or e})")
    for line in calibration.header():
        print(line)
    print(f"wrote {out}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _calibrate(args)
    if not args.config:
        raise UsageError("plan: give a training config (or --calibrate)")
    cfg = load_config(args.config, args.overrides)
    if len(args.cluster) > 1 or args.hosts:
        if args.budget is not None:
            cfg.sharding.search_budget = args.budget
        return _sweep(args, cfg)
    cluster = load_cluster(args.cluster[0])
    from embedtrain.sharding.report import FORMATS, write_report

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:  # checked before planning, which can take a while
        raise UsageError(f"--format: unknown {', '.join(unknown) or '(empty)'} "
                         f"(use {', '.join(FORMATS)})")
    if args.budget is not None:
        cfg.sharding.search_budget = args.budget
    out = Path(args.out) if args.out else Path("plans") / f"{Path(args.config).stem}-{cluster.name}"
    from embedtrain.recipes import plan_model

    result = plan_model(cfg, cluster)
    report = result.report
    report.model = {**(report.model or {}), "config": str(args.config)}
    paths = write_report(report, out, formats)
    s = report.summary
    print(f"plan of {args.config} on {cluster.name} ({cluster.world_size} ranks, "
          f"{cluster.device.value}): {s.tables} tables, "
          f"{(s.embedding_weight_bytes + s.embedding_optimizer_bytes) / 2**30:.2f} GiB "
          f"of weights and optimizer state")
    for w in report.warnings:
        print(f"  warning: {w}")
    print(f"  sharding: {', '.join(f'{k} x{v}' for k, v in s.sharding_types.items())}")
    print(f"  slowest rank {s.embedding_max_rank_ms:.3f} ms of embedding work per step "
          f"(mean {s.embedding_mean_rank_ms:.3f}, imbalance {s.imbalance:.2f}); "
          f"dense all-reduce {s.dense_allreduce_ms:.3f} ms")
    print(f"  peak {s.memory_tier.value.upper()} per rank "
          f"{s.peak_rank_memory_bytes / 2**30:.2f} of {s.rank_memory_capacity_bytes / 2**30:.2f} GiB")
    print(f"  planned in {report.planner.seconds:.2f} s ({report.planner.partitions} partitions)")
    print(f"report: {', '.join(str(p) for p in paths)}")
    return 0


def _ingest(args: argparse.Namespace) -> int:
    from pipelines.graph_spec import is_graph_spec
    from pipelines.ingest import ingest
    from pipelines.spec import load_spec
    from pipelines.xc_spec import is_xc_spec

    graph, xc = is_graph_spec(args.spec), is_xc_spec(args.spec)
    if args.engine != "polars" and (graph or xc):
        raise UsageError(f"--engine {args.engine}: tabular specs only; kind: "
                         f"{'graph' if graph else 'xc'} runs on the polars engine (see README, "
                         f"Ingesting beyond one machine)")
    if graph:
        return _ingest_graph(args)
    if args.node_inputs:
        raise UsageError("--nodes: only for graph specs (kind: graph)")
    if xc:
        return _ingest_xc(args)
    spec = load_spec(args.spec, args.overrides)
    report = ingest(spec, args.inputs, args.out, progress=not args.quiet, engine=args.engine,
                    address=args.address, num_cpus=args.num_cpus)
    written = ", ".join(f"{k} {v:,}" for k, v in report["rows_written"].items())
    dropped = ", ".join(f"{k} {v:,}" for k, v in report["rows_dropped"].items()) or "none"
    repaired = ", ".join(f"{k} {sum(v.values()):,}" for k, v in report["repairs"].items()) or "none"
    print(f"read {report['rows_read']:,} rows from {len(report['inputs'])} file(s) in "
          f"{report['wall_seconds']:.1f} s ({args.engine} engine)")
    print(f"written: {written}")
    print(f"dropped: {dropped}")
    print(f"repaired values: {repaired}")
    print(f"data set: {args.out}/ (metadata.json, ingest_report.json, train/ valid/ test/, vocab/)")
    return 0


def _ingest_graph(args: argparse.Namespace) -> int:
    from pipelines.graph import ingest_graph
    from pipelines.graph_spec import load_graph_spec

    spec = load_graph_spec(args.spec, args.overrides)
    report = ingest_graph(spec, args.inputs, args.out, nodes=args.node_inputs,
                          progress=not args.quiet)
    e, n = report["edges"], report["nodes"]
    dropped = ", ".join(f"{k} {v:,}" for k, v in e["rows_dropped"].items() if v) or "none"
    held = ", ".join(f"{k} {v:,}" for k, v in e["held_out"].items()) or "none"
    print(f"read {e['rows_read']:,} edge rows from {len(report['inputs']['edges'])} file(s) in "
          f"{report['wall_seconds']:.1f} s")
    print(f"graph: {n['num_nodes']:,} nodes, {e['csr_entries']:,} CSR entries "
          f"({'directed' if e['directed'] else 'undirected'}), held-out edges: {held}")
    print(f"dropped: {dropped}; duplicates merged: {e['duplicates_merged']:,}")
    print(f"data set: {args.out}/ (metadata.json, ingest_report.json, graph/, nodes/, splits/)")
    return 0


def _ingest_xc(args: argparse.Namespace) -> int:
    from pipelines.xc import ingest_xc
    from pipelines.xc_spec import load_xc_spec

    spec = load_xc_spec(args.spec, args.overrides)
    report = ingest_xc(spec, args.inputs, args.out, progress=not args.quiet)
    written = ", ".join(f"{k} {v:,}" for k, v in report["rows_written"].items())
    dropped = ", ".join(f"{k} {v:,}" for k, v in report["rows_dropped"].items()) or "none"
    labels = report["labels"]
    removed = ", ".join(f"{k} {v:,}" for k, v in labels["labels_removed"].items()) or "none"
    print(f"read {report['rows_read']:,} rows from {len(report['inputs'])} file(s) in "
          f"{report['wall_seconds']:.1f} s ({args.engine} engine)")
    print(f"written: {written}")
    print(f"dropped: {dropped}")
    print(f"labels: {labels['num_classes']:,} classes, {labels['labels_per_row'][0]}-"
          f"{labels['labels_per_row'][1]} per row; removed: {removed}")
    print(f"tokens: {report['tokens']['num_embeddings']:,} ids (0: unknown), "
          f"{report['tokens']['rows_without_tokens']:,} row(s) without tokens")
    print(f"data set: {args.out}/ (metadata.json, ingest_report.json, train/ valid/ test/, vocab/)")
    return 0


def _datagen(args: argparse.Namespace) -> int:
    from embedtrain.datagen import CTRDataSpec, generate_ctr

    if args.kind == "xc":
        return _datagen_xc(args)
    if args.kind == "graph":
        return _datagen_graph(args)
    if args.drift:
        return _datagen_drift(args)
    knobs = [f for f in ("periods", "lifetime", "new_ids") if getattr(args, f"drift_{f}") is not None]
    if knobs:
        raise UsageError(f"--drift-{knobs[0].replace('_', '-')}: only with --drift")
    if args.format == "tsv":
        from embedtrain.datagen import generate_ctr_tsv

        info = generate_ctr_tsv(CTRDataSpec(rows=args.rows, seed=args.seed), args.out)
        print(f"wrote {args.out}: {info['rows']:,} rows of raw TSV in {len(info['files'])} file(s) "
              "(ingest with configs/ingest/criteo_synthetic.yaml)")
        return 0
    meta = generate_ctr(CTRDataSpec(rows=args.rows, seed=args.seed), args.out)
    rows = ", ".join(f"{k} {v['rows']:,}" for k, v in meta["splits"].items())
    oracle = meta["oracle_auc"].get("test")
    note = f", oracle AUC on test {oracle:.4f}" if oracle is not None else ""
    print(f"wrote {args.out}: rows: {rows}{note}")
    return 0


def _datagen_drift(args: argparse.Namespace) -> int:
    from embedtrain.datagen import DriftDataSpec, generate_ctr_drift

    if args.format == "tsv":
        raise UsageError("--format tsv: not with --drift (the drifting data set is parquet only)")
    flags = {"periods": "--drift-periods", "lifetime": "--drift-lifetime",
             "new_ids_per_period": "--drift-new-ids"}
    knobs = {"periods": args.drift_periods, "lifetime": args.drift_lifetime,
             "new_ids_per_period": args.drift_new_ids}
    try:
        spec = DriftDataSpec(rows=args.rows, seed=args.seed,
                             **{k: v for k, v in knobs.items() if v is not None})
        meta = generate_ctr_drift(spec, args.out)
    except ValueError as e:  # "DriftDataSpec.lifetime must be ..." -> the flag's name
        raise UsageError(re.sub(r"DriftDataSpec\.(\w+)",
                                lambda m: flags.get(m.group(1), "--" + m.group(1).replace("_", "-")),
                                str(e))) from None
    except FileExistsError as e:
        raise UsageError(str(e)) from None
    rows = ", ".join(f"{k} {v['rows']:,}" for k, v in meta["splits"].items())
    oracle = meta["oracle_auc"].get("test")
    note = f", oracle AUC on test {oracle:.4f}" if oracle is not None else ""
    ids = " ".join(f"{s['num_embeddings']:,}" for s in meta["sparse"])
    unseen = meta["drift"]["unseen_in_train_share"]["test"]
    seen = f", {unseen:.1%} of test lookups unseen in train" if unseen is not None else ""
    print(f"wrote {args.out}: rows: {rows}{note}; {meta['drift']['periods']} periods, "
          f"distinct train ids per feature: {ids}{seen}")
    return 0


def _datagen_xc(args: argparse.Namespace) -> int:
    from embedtrain.datagen import XCDataSpec, generate_xc

    try:
        spec = XCDataSpec(classes=args.classes, rows=args.rows, vocab=args.vocab, noise=args.noise,
                          multi_label=args.multi_label, seed=args.seed)
    except ValueError as e:  # "XCDataSpec.classes must be ..." -> the flag's name
        raise UsageError(re.sub(r"XCDataSpec\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"),
                                str(e))) from None
    meta = generate_xc(spec, args.out)
    rows = ", ".join(f"{k} {v['rows']:,}" for k, v in meta["splits"].items())
    oracle = meta.get("oracle_p_at_1", {}).get("test")
    note = f", Bayes-optimal P@1 on test {oracle:.4f}" if oracle is not None else ""
    print(f"wrote {args.out}: {spec.classes:,} classes, rows: {rows}{note}")
    return 0


def _datagen_graph(args: argparse.Namespace) -> int:
    from embedtrain.datagen import GraphDataSpec, generate_graph

    try:
        spec = GraphDataSpec(nodes=args.nodes, avg_degree=args.avg_degree,
                             communities=args.communities, feature_dim=args.feature_dim,
                             link_fraction=args.link_fraction, seed=args.seed)
        meta = generate_graph(spec, args.out)
    except ValueError as e:  # "GraphDataSpec.avg_degree must be ..." -> the flag's name
        raise UsageError(re.sub(r"GraphDataSpec\.(\w+)",
                                lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from None
    except FileExistsError as e:
        raise UsageError(str(e)) from None
    g = meta["generator"]
    bayes = g["feature_bayes_accuracy"]["test"] or g["feature_bayes_accuracy"]["all"]
    print(f"wrote {args.out}: {meta['num_nodes']:,} nodes, {meta['num_edges']:,} CSR entries, "
          f"homophily {g['homophily']:.3f}, feature-only Bayes accuracy {bayes:.3f} "
          f"(one-hop Bayes {g['one_hop_bayes_accuracy']['test']:.3f})")
    return 0


def _export(args: argparse.Namespace) -> int:
    from embedtrain.export.export import export_run

    result = export_run(args.run_dir, args.out, checkpoint=args.checkpoint,
                        quantize=args.quantize, formats=args.format.split(","),
                        overwrite=args.overwrite, progress=not args.no_progress)
    m, mib = result.manifest, 2**20
    print(f"exported step {m.source.step:,} of {args.run_dir} ({m.source.world_size} rank(s), "
          f"{m.task}) to {result.out} in {result.seconds:.1f} s")
    rows = sum(t.rows for t in m.tables)
    sizes = f"{m.float32_bytes / mib:,.1f} MiB float32"
    if m.quantize != "none":
        sizes += (f" -> {m.table_bytes / mib:,.1f} MiB {m.quantize} "
                  f"({m.float32_bytes / max(m.table_bytes, 1):.2f}x smaller)")
    print(f"  tables       {len(m.tables)}, {rows:,} rows, {sizes}")
    dynamic = [t for t in m.tables if t.dynamic]
    if dynamic:
        held = sum(t.ids_held or 0 for t in dynamic)
        print(f"  id maps      {len(dynamic)} dynamic table(s): {held:,} ids -> rows "
              f"(tables/<table>.ids.parquet; other ids take their shard's default row)")
    if m.head is not None:
        print(f"  class head   {m.head.num_classes:,} x {m.head.dim} ({m.head.kind}), "
              f"{m.head.bytes / mib:,.1f} MiB float32, {len(m.head.shards)} shard(s)")
    if m.dense_program is not None:
        print(f"  dense model  {m.dense_program.file} ({m.dense_program.format}), "
              f"{m.dense_program.parameters:,} parameters")
    else:
        print(f"  dense model  none ({m.note})")
    if result.peak_over_baseline is not None:
        print(f"  memory       peak RSS {result.peak_over_baseline / mib:,.1f} MiB over the "
              f"{result.baseline_rss / mib:,.0f} MiB before the tables (largest table "
              f"{result.largest_table / mib:,.1f} MiB)")
    print(f"files: {result.out}/ (model.json, tables/, "
          f"{m.dense_program.file + ', ' if m.dense_program else ''}config.yaml)")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from embedtrain.export.predict import predict

    result = predict(args.export_dir, args.inputs, args.out, batch_size=args.batch_size,
                     top_k=args.top_k, progress=not args.no_progress)
    rate = result.rows / max(result.seconds, 1e-9)
    print(f"scored {result.rows:,} rows from {result.files} file(s) in {result.seconds:.1f} s "
          f"({rate:,.0f} rows/s)")
    for k, v in result.metrics.items():
        print(f"  {k:<12} {v:.6f}" if isinstance(v, float) else f"  {k:<12} {v:,}")
    print(f"written: {result.out}")
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


def _quiet_libraries() -> None:
    # TorchRec and FBGEMM log planner tables and warnings at import/shard time; users want the run.
    warnings.filterwarnings("ignore", module="torchrec")
    warnings.filterwarnings("ignore", module="fbgemm_gpu")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch")  # DCP deprecations
    logging.getLogger().setLevel(logging.ERROR)  # torchrec's sharders warn on the root logger
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger("torch").setLevel(logging.ERROR)
    logging.getLogger("fbgemm_gpu").setLevel(logging.ERROR)


if __name__ == "__main__":
    entry()
