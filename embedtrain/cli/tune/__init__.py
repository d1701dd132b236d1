"""``embedtrain tune``: hyperparameter search over a config on Ray Tune, with ASHA early stopping.

Every trial is a normal run directory (``DIR/trials/trial_000/``, ...: ``embedtrain eval`` and
``export`` take it), trained in-process by a Ray worker; each validation evaluation is reported
to ASHA as the trainer logs it, and ASHA stops the trials that fall behind. The config, ``--set``
and the search space are checked before any trial starts (one line naming the file and the key).
At the end the command prints a table of the trials and writes into ``DIR``:

- ``trials.json``: per trial its ``config`` (the searched keys' values), ``best_value`` (the best
  validation value of the metric over its evaluations) and its ``step``, ``status`` (``done``,
  ``stopped`` by ASHA, ``error`` with the one-line ``error``), ``run_dir``;
- ``best.yaml``: the whole winning config, for ``embedtrain train DIR/best.yaml``;
- ``best.json``: the best trial's ``run_dir``, ``valid_value`` and the ``test`` metrics of its
  selected checkpoint (from its summary; a trial ASHA stopped is evaluated on the test split),
  ``trials`` and ``failed_trials``, and a ``warning`` (also above the table) where more than a
  quarter of the trials failed;
- ``search.png``: the metric against the trial number and against each searched key.

Also ``base.yaml`` (the config every trial starts from), ``search.json`` (the search's settings,
checked by ``--resume``), ``logs/<trial>.log`` (each trial's console output) and ``ray/`` (Ray
Tune's experiment state, for ``--resume``).

Examples:
    embedtrain tune configs/dlrm_synthetic.yaml --space configs/tune/ctr_space.yaml \\
        --trials 8 --out runs/search --set train.max_steps=600 --set train.eval_every=100
    embedtrain tune configs/dlrm_synthetic.yaml --space configs/tune/ctr_space.yaml \\
        --trials 8 --out runs/search --resume          # after a crash or Ctrl-C: go on
    embedtrain tune configs/dlrm_synthetic.yaml --space configs/tune/ctr_space.yaml \\
        --trials 64 --out /shared/search --engine ray --address head:6379 --cpus-per-trial 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from embedtrain.cli.errors import UsageError
from embedtrain.config import changed_keys, dump_config, load_config, load_run_config
from embedtrain.config_io import SafeLoader
from embedtrain.train.run_dir import RunDirError
from embedtrain.cli.tune.options import Engine, Scheduler, SearchOptions
from embedtrain.cli.tune.space import SearchSpace, check_space, load_space
from embedtrain.utils import write_atomic

SEARCH_FILE = "search.json"


def register(sub) -> None:
    """Adds the ``tune`` command to the subparsers ``sub``."""
    p = sub.add_parser(
        "tune", help="hyperparameter search over a config (Ray Tune, ASHA early stopping)",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Space file (YAML; keys as --set takes them; each a fixed value or one "
               "distribution):\n"
               "  optim.sparse_lr: {loguniform: [0.005, 0.2]}\n"
               "  optim.dense_lr: {uniform: [0.0005, 0.003]}\n"
               "  model.embedding_dim: {choice: [8, 16]}\n"
               "  optim.warmup_steps: {randint: [0, 100]}     # hi excluded\n"
               "  train.max_steps: 600                         # the same for every trial\n\n"
               "Trials train with train.select: best (their selected checkpoint is their best "
               "evaluation)\nunless the config or --set says train.select. Guide: "
               "docs/guides/tuning.md (make docs builds the site).")
    p.add_argument("config", help="YAML config file the trials start from (see configs/)")
    p.add_argument("--space", required=True, help="search space YAML (see configs/tune/)")
    p.add_argument("--trials", type=int, default=8, help="configurations to try (default: 8)")
    p.add_argument("--out", help="search directory (default: runs/tune_<config name>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key for every trial, as `embedtrain train --set` "
                        "(repeatable)")
    p.add_argument("--resume", action="store_true",
                   help="continue the search in --out (after a crash or Ctrl-C): trials that "
                        "ended are not run again, running ones continue from their checkpoint")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sampler: the same seed tries the same configurations "
                        "(default: 0; the trials' own train.seed is the config's)")
    p.add_argument("--metric", help="validation metric to search on, with its own direction "
                   "(auc, accuracy, mrr, p@k, ... higher; loss, ne, logloss lower); it is also "
                   "the trials' train.select_metric (default: the config's train.select_metric, "
                   "else the task's main metric: auc for ctr)")
    p.add_argument("--scheduler", choices=[s.value for s in Scheduler], default="asha",
                   help="asha: stop trials that fall behind at each rung (default); none: "
                        "train every trial to the end")
    p.add_argument("--grace-steps", type=int, help="ASHA: training steps before a trial can "
                   "be stopped (default: a pass over the training data)")
    p.add_argument("--reduction-factor", type=int, default=3,
                   help="ASHA: about 1 in this many trials goes on at each rung (default: 3)")
    p.add_argument("--engine", choices=[e.value for e in Engine], default="local",
                   help="local: a Ray instance on this machine, one trial at a time on all its "
                        "cores (default); ray: a running Ray cluster (--address), trials side "
                        "by side")
    p.add_argument("--address", help="--engine ray: the cluster's address (default: "
                   "$RAY_ADDRESS, else a cluster started on this machine with `ray start`)")
    p.add_argument("--cpus-per-trial", type=int, help="--engine ray: CPUs per trial, also its "
                   "torch threads (default: 1)")
    p.add_argument("--gpus-per-trial", type=float, default=0.0, help="GPUs per trial "
                   "(default: 0)")
    p.add_argument("--max-concurrent", type=int, default=0,
                   help="--engine ray: trials at once (default: 0, as many as fit)")
    p.set_defaults(func=_tune)


def _tune(args: argparse.Namespace) -> int:
    options = _options_checked(args)
    space = load_space(args.space)
    search_overrides = [*args.overrides, *_trial_defaults(args, space)]
    space = check_space(space, args.config, search_overrides)
    cfg = load_config(args.config, [*search_overrides, *space.fixed_overrides()])
    out = Path(args.out or Path("runs") / f"tune_{Path(args.config).stem}").resolve()
    resume = _check_out(out, args.resume, cfg, space, options)
    out.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, out / "base.yaml")
    write_atomic(out / SEARCH_FILE, json.dumps(_search_record(args, space, options), indent=2)
                 + "\n")
    _print_header(args, out, space, options, cfg)

    from embedtrain.cli.tune.search import run_search  # Ray: only now

    run = run_search(out, space, options, resume, metric=args.metric or cfg.train.select_metric)
    return _finish(args, out, space, run)


def _options_checked(args: argparse.Namespace) -> SearchOptions:
    checks = [("--trials", args.trials, 1), ("--reduction-factor", args.reduction_factor, 2),
              ("--max-concurrent", args.max_concurrent, 0)]
    if args.grace_steps is not None:
        checks.append(("--grace-steps", args.grace_steps, 1))
    if args.cpus_per_trial is not None:
        checks.append(("--cpus-per-trial", args.cpus_per_trial, 1))
    for name, value, least in checks:
        if value < least:
            raise UsageError(f"{name}: must be at least {least}, got {value}")
    if args.gpus_per_trial < 0:
        raise UsageError(f"--gpus-per-trial: must be at least 0, got {args.gpus_per_trial}")
    if args.engine == "local":
        for name, given in (("--address", args.address), ("--cpus-per-trial",
                                                          args.cpus_per_trial),
                            ("--max-concurrent", args.max_concurrent)):
            if given:
                raise UsageError(f"{name}: only with --engine ray (--engine local runs one "
                                 "trial at a time on all of this machine's cores)")
    return SearchOptions(trials=args.trials, seed=args.seed, scheduler=Scheduler(args.scheduler),
                         grace_steps=args.grace_steps, reduction_factor=args.reduction_factor,
                         engine=Engine(args.engine), address=args.address,
                         cpus_per_trial=args.cpus_per_trial or 1,
                         gpus_per_trial=args.gpus_per_trial, max_concurrent=args.max_concurrent)


def _trial_defaults(args: argparse.Namespace, space: SearchSpace) -> list[str]:
    """``train.select=best`` unless the config, ``--set`` or the space says ``train.select``;
    ``train.select_metric`` from ``--metric``."""
    given = {o.split("=", 1)[0].strip() for o in args.overrides} | set(space.keys) \
        | set(space.fixed)
    try:
        raw = yaml.load(Path(args.config).read_text(), Loader=SafeLoader)
    except (OSError, yaml.YAMLError):
        raw = None  # load_config says what is wrong with it
    train = raw.get("train") if isinstance(raw, dict) else None
    if isinstance(train, dict) and "select" in train:
        given.add("train.select")
    extra = [] if "train.select" in given else ["train.select=best"]
    if args.metric:
        if "train.select_metric" in set(space.keys) | set(space.fixed):
            raise UsageError(f"--metric: {args.space} sets train.select_metric too; keep one")
        extra.append(f"train.select_metric={json.dumps(args.metric)}")
    return extra


def _search_record(args: argparse.Namespace, space: SearchSpace, options: SearchOptions
                   ) -> dict[str, Any]:
    """``search.json``: what the search was asked (a ``--resume`` must ask the same)."""
    return {"config": str(Path(args.config).resolve()),
            "space_file": str(Path(args.space).resolve()), "overrides": list(args.overrides),
            "metric": args.metric, "space": space.to_dict(), **options.search_settings()}


def _check_out(out: Path, resume: bool, cfg, space: SearchSpace, options: SearchOptions
               ) -> bool:
    """What the search may do with ``out``; whether there is a search to continue.

    Raises:
        UsageError: an earlier search without --resume, one with other settings, or a folder
            of other files.
    """
    record_file = out / SEARCH_FILE
    if out.exists() and not out.is_dir():
        raise RunDirError(f"{out}: is a file, not a search directory; choose another --out")
    if record_file.is_file() and not any((out / d).exists() for d in ("ray", "trials")):
        return False  # set up, but no trial ever started (Ray did not start): begin afresh
    if not record_file.is_file():
        others = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
        if others:
            shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more"
                                             if len(others) > 3 else "")
            raise UsageError(f"{out}: not empty and not a search directory (holds {shown}); "
                             "choose another --out")
        if resume:
            print(f"tune: nothing to resume in {out}: starting the search", file=sys.stderr)
        return False
    if not resume:
        raise UsageError(f"{out}: holds an earlier search; pass --resume to continue it, or "
                         "choose another --out")
    try:
        saved = json.loads(record_file.read_text())
    except ValueError:
        raise UsageError(f"{record_file}: unreadable; choose another --out") from None
    differs = [f"--{k.replace('_', '-')}: {saved.get(k)!r} -> {v!r}"
               for k, v in options.search_settings().items() if saved.get(k) != v]
    if saved.get("space") != json.loads(json.dumps(space.to_dict())):
        differs.append(f"the space ({saved.get('space_file')})")
    base = out / "base.yaml"
    if base.is_file():
        differs += [f"{k}: {old!r} -> {new!r}"
                    for k, (old, new) in changed_keys(load_run_config(base), cfg).items()]
    if differs:
        raise UsageError(f"{out}: --resume with other settings than the search's "
                         f"({'; '.join(differs[:4])}{' and more' if len(differs) > 4 else ''});"
                         " resume with the same command, or start a new search (--out)")
    return True


def _print_header(args: argparse.Namespace, out: Path, space: SearchSpace,
                  options: SearchOptions, cfg) -> None:
    searched = ", ".join(f"{p.key} ({p.describe()})" for p in space.params)
    metric = args.metric or cfg.train.select_metric
    metric = f"valid {metric}" if metric else "the task's main validation metric"
    if options.scheduler is Scheduler.ASHA:
        how = (f"ASHA on {metric}: grace {options.describe_grace()}, reduction factor "
               f"{options.reduction_factor}")
        if cfg.train.eval_every == 0:
            how += " (train.eval_every is 0: one evaluation per trial, so none is stopped)"
    else:
        how = f"no early stopping; on {metric}"
    where = (f"local Ray, one trial at a time on {options.trial_cpus()} cores"
             if options.engine is Engine.LOCAL else
             f"Ray cluster {options.address or 'auto'}, {options.trial_cpus()} CPU(s) per trial")
    print(f"tune: {options.trials} trials of {args.config} over {searched}; {how}; {where}; "
          f"run directories in {out / 'trials'}, logs in {out / 'logs'}", file=sys.stderr)


def _finish(args: argparse.Namespace, out: Path, space: SearchSpace, run) -> int:
    """Writes the search's files and prints its table; the exit status."""
    from embedtrain.cli.tune import results

    metric, higher = args.metric, True
    for t in run.trials:
        if t.last_result.get("metric"):
            metric, higher = t.last_result["metric"], t.last_result.get("mode", "max") == "max"
            break
    outcomes = [results.trial_outcome(t.name, t.index, t.config, out / "trials" / t.name,
                                      metric, higher, t.ended, t.error) for t in run.trials]
    results.write_trials(out, outcomes)
    print(results.format_table(outcomes, space.keys, metric))
    best = results.best_outcome(outcomes, higher)
    if best is not None:
        results.write_best_config(out, out / "base.yaml", space, best)
        summary = results.write_best(out, best, metric, higher, outcomes)
        results.plot_search(out / "search.png", outcomes, space, metric, higher)
        test = summary["test"] or {}
        shown = f"; test {metric} {test[metric]:.4f}" if metric in test else ""
        print(f"\nbest: {best.name}, valid {metric} {best.best_value:.4f} at step {best.step:,}"
              f"{shown}\nsearch files: {out}/ (trials.json, best.yaml, best.json, search.png, "
              f"trials/)")
    if run.interrupted:
        ended = sum(t.ended for t in run.trials)
        print(f"embedtrain tune: interrupted with {ended} of {args.trials} trials ended; "
              f"continue the search with the same command and --resume", file=sys.stderr)
        return 130
    if best is None:
        print(f"embedtrain tune: error: no trial reached a validation value of "
              f"{metric or 'the metric'} (see {out / 'trials.json'} and {out / 'logs'})",
              file=sys.stderr)
        return 1
    return 0


__all__ = ["register"]
