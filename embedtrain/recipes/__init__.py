"""Recipes: the one place where the resolved config meets the library, one per task family.

:data:`RECIPES` maps each ``task`` of the config to its recipe class: it is the only switch on
the task below the CLI. A new family is one recipe (a :class:`~embedtrain.recipes.base.Recipe`
subclass composing its parts: the tabular data, a class head) plus one task
(:class:`~embedtrain.train.task.Task`) and a line here; see the project's ``ARCHITECTURE.md``.
A user's model, task or logger is a component the config names by import path, never a recipe.

Example:
    >>> cfg = load_config("configs/dlrm_synthetic.yaml")
    >>> run = build_run(cfg, "runs/demo")
    >>> summary = run.trainer.fit(test_data=run.test_data)
    >>> plan_model(cfg, load_cluster("configs/clusters/h100-16x8.yaml")).report
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from embedtrain.config import ClusterConfig, Config, TaskKind, load_run_config, task_family
from embedtrain.recipes.base import Recipe
from embedtrain.recipes.run import Run
from embedtrain.recipes.ctr import CTRRecipe
from embedtrain.recipes.gnn import GraphRecipe
from embedtrain.recipes.retrieval import RetrievalRecipe
from embedtrain.recipes.seq import SeqRecipe
from embedtrain.recipes.xc import XCRecipe
from embedtrain.lifecycle import check_start
from embedtrain.runtime import allocator_setting, begin_run, mark, threads_per_rank
from embedtrain.sharding.planner import PlanResult
from embedtrain.features import list_partitions
from embedtrain.train.lineage import LINEAGE_FILE, check_warm_start, consumed, write_lineage
from embedtrain.train.run_dir import RunDir, RunDirError, env_rank
from embedtrain.utils import append_line

RECIPES: dict[TaskKind, type[Recipe]] = {
    TaskKind.CTR: CTRRecipe,
    TaskKind.XC: XCRecipe,
    TaskKind.GNN_NODE: GraphRecipe,
    TaskKind.GNN_LINK: GraphRecipe,
    TaskKind.SEQ: SeqRecipe,
    TaskKind.RETRIEVAL: RetrievalRecipe,
}


def recipe_for(cfg: Config) -> Recipe:
    """The built-in recipe of ``cfg``'s task family, on ``cfg``."""
    return RECIPES[task_family(cfg)](cfg)


def family_recipe(cfg: Config, family: str) -> Recipe:
    """The built-in recipe of ``family`` (an export's ``task``) on ``cfg``: what ``embedtrain
    predict`` scores with, whatever components ``cfg`` names, so that an export never makes it
    import code."""
    return RECIPES[TaskKind(family)](cfg)


def build_run(cfg: Config, out_dir: str | os.PathLike, progress: Optional[bool] = None,
              cluster: Optional[ClusterConfig] = None, record_plan: bool = True) -> Run:
    """``recipe_for(cfg).build_run(...)``: see :meth:`Recipe.build_run`."""
    return recipe_for(cfg).build_run(out_dir, progress, cluster, record_plan)


def fit(cfg: Config, out_dir: str | os.PathLike, *, resume: bool = False,
        overwrite: bool = False, progress: Optional[bool] = None,
        cluster: Optional[ClusterConfig] = None,
        on_evaluation: Optional[Callable[[Any, dict], None]] = None,
        warm_start: Optional[str | os.PathLike] = None) -> Optional[dict[str, Any]]:
    """Trains ``cfg`` into the run directory ``out_dir``: the run ``embedtrain train`` makes
    (which calls this on each rank).

    The directory's life is :class:`~embedtrain.train.run_dir.RunDir`'s: one writer at a time
    (its lock held while this runs); an earlier run there is refused unless ``resume`` (continue
    from its newest checkpoint, changing only ``RESUME_SAFE_KEYS``) or ``overwrite`` (replace
    it); ``config.yaml`` records the run (components with their keys), so ``embedtrain eval``,
    ``export``, ``plan`` and ``--resume`` work on it. Sets torch's threads for the run
    (``train.threads_per_rank``, else ``EMBEDTRAIN_THREADS``, else the cores over the local
    ranks: :func:`embedtrain.runtime.threads_per_rank`).

    Args:
        progress: overrides ``train.progress``.
        cluster: the cluster whose plan to train with (default: this machine).
        on_evaluation: ``Trainer.on_evaluation``, called with each validation record.
        warm_start: sets ``train.warm_start``: start from that finished run's selected
            checkpoint (continual training: :mod:`embedtrain.train.lineage`).

    Returns:
        ``summary.json``'s content, or None where ``resume`` found the run finished (said on
        stderr).

    Raises:
        RunDirError: the directory cannot hold this run (one line).
    """
    begin_run()  # start-up counted from here where the process ran something before
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite exclude each other")
    if warm_start is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, warm_start=str(Path(warm_start).resolve())))
    run_dir = RunDir(out_dir, create=False)
    RunDir.check_out(run_dir.root)
    if check_start(run_dir, cfg, resume, overwrite) is None:  # refusals first, touching nothing
        return None
    warm = check_warm_start(cfg)
    with run_dir.writer():  # ... then again as the one writer
        changes = check_start(run_dir, cfg, resume, overwrite, quiet=True)
        if changes is None:
            return None
        threads, source = threads_per_rank(cfg.train.threads_per_rank)
        torch.set_num_threads(threads)
        if not resume and run_dir.has_run() and env_rank() == 0:
            run_dir.clear()  # overwrite (checked above)
        # a resume writes its plan only once its checkpoint is read: a refused one changes nothing
        run = build_run(cfg, out_dir, progress, cluster, record_plan=not resume)
        mark("build")  # the model, its plan, sharding, optimizers, readers
        trainer = run.trainer
        trainer.on_evaluation = on_evaluation
        if changes:
            trainer.resume_note = {"config_changes": {k: list(v) for k, v in changes.items()}}
        restored = trainer.resume() if resume else None  # an unreadable run fails untouched
        if resume:
            run.recipe.write_plan(out_dir)
        if warm is not None and restored is None:  # a resume before any checkpoint: again
            trainer.warm_start(warm[0])
        if trainer.rank == 0:
            if restored is None:
                write_lineage(run_dir.root, cfg, warm)
            if changes:
                run.record_config()
            loader = getattr(trainer.train_data, "num_workers", None)
            tables = run.table_threads()
            print(f"threads: {threads} per rank ({source}); loader threads: {loader}"
                  f"{' (data.num_workers: auto)' if cfg.data.num_workers is None else ''}; "
                  + ("" if tables is None else f"table backward threads: {tables}; ")
                  + f"allocator: {allocator_setting()}\n"
                  f"{_banner(run)}", file=sys.stderr)
        return run.fit()


def _banner(run: Run) -> str:
    """The run's data in one line: rows over all ranks, each rank's share, steps."""
    trainer = run.trainer
    data, info = trainer.train_data, run.recipe.dataset_info()
    shares = data.rank_rows
    split = f" over {len(shares)} ranks ({' + '.join(f'{n:,}' for n in shares)})" \
        if len(shares) > 1 else ""
    per_epoch = len(data)
    padding = sum(data.step_rows(i)[1] for i in range(max(per_epoch - 1, 0), per_epoch))
    extra = f", {padding} padding row(s) in each epoch's last step" if padding else ""
    dropped = data.dropped_rows
    extra += f", {dropped:,} rows dropped per epoch (data.drop_last)" if dropped else ""
    return (f"data: {info.name} ({info.root}), train {data.unit}: {data.total_rows:,}{split}; "
            f"{per_epoch:,} steps per epoch{extra}; steps: {trainer.total_steps:,}")


def evaluate(run_dir: str | os.PathLike, split: str = "test",
             checkpoint: Optional[str] = None,
             partitions: Optional[list[str]] = None) -> dict[str, Any]:
    """A run's checkpoint (default: the newest complete one) evaluated on ``split`` of its data
    set. Read-only: no plan files, records or result file are written into the run.

    ``partitions``: of a partitioned data set, these partitions' ``split`` instead of the run's
    (e.g. the next day's rows for a model trained up to the day before); tables are sized for
    their vocabulary, values the run never had a row for looking up a fresh table's rows (as a
    warm start onto them would give them).

    Returns:
        ``{"split", "step", <the task's metrics>}``.

    Raises:
        ValueError: not a run directory, or no complete checkpoint (one line).
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"{run_dir}: not a run directory (no config.yaml)")
    cfg = load_run_config(run_dir / "config.yaml")
    if partitions is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data,
                                                                partitions=list(partitions)))
    run = build_run(cfg, run_dir, progress=False, record_plan=False)
    trainer = run.trainer
    if partitions is None:
        if trainer.restore(checkpoint) is None:
            raise ValueError(f"{run_dir / 'checkpoints'}: no complete checkpoint to evaluate")
        step = trainer.state.step
    else:  # tables grown to the partitions' vocabulary
        ckpt = trainer.checkpoints.find(checkpoint) if checkpoint is not None \
            else trainer.checkpoints.latest()
        if ckpt is None:
            raise ValueError(f"{run_dir / 'checkpoints'}: no complete checkpoint to evaluate")
        trainer.warm_start(ckpt)
        step = trainer.checkpoints.info(ckpt)["step"]
    return {"split": split, "step": step, **trainer.evaluate(run.eval_reader(split))}


def follow(cfg: Config, runs: str | os.PathLike, *, max_partitions: Optional[int] = None,
           wait_s: float = 0.0, poll_s: float = 10.0, progress: Optional[bool] = None,
           sleep: Callable[[float], None] = time.sleep) -> list[dict[str, Any]]:
    """Continuous mode: trains each partition of ``cfg``'s partitioned data set once, in name
    order, as it appears, each run warm-started from the one before (``runs/<partition>``).

    The line continues from the run in ``runs`` whose line consumed the most partitions (a
    finished one; an unfinished run of the next partition is resumed). Before a partition is
    trained on, the run before it is evaluated on it (its ``train`` split: the rows it has not
    seen). One JSON line a partition goes to ``runs/follow.jsonl``: the partition, its run,
    that evaluation (``before``), the run's summary metrics. Stops after ``max_partitions``
    partitions, or when no new partition has appeared for ``wait_s`` seconds (polled every
    ``poll_s``; 0: stop at once).

    Returns:
        The records written.
    """
    runs = Path(runs)
    runs.mkdir(parents=True, exist_ok=True)
    finished = [r for r in sorted(runs.iterdir()) if (r / "summary.json").is_file()
                and (r / LINEAGE_FILE).is_file()]
    previous = max(finished, key=lambda r: len(consumed(r)), default=None)
    records: list[dict[str, Any]] = []
    waited = 0.0
    while max_partitions is None or len(records) < max_partitions:
        done = {c["partition"] for c in consumed(previous)} if previous is not None else set()
        todo = [p for p in list_partitions(cfg.data.path) if p not in done]
        if not todo:
            if waited >= wait_s:
                break
            sleep(poll_s)
            waited += poll_s
            continue
        waited, part, out = 0.0, todo[0], runs / todo[0]
        record: dict[str, Any] = {"partition": part, "run": str(out.resolve())}
        if previous is not None:
            record["before"] = {"run": str(previous.resolve()), **evaluate(
                previous, split="train", partitions=[part])}
        resume = (out / "config.yaml").is_file()
        summary = fit(dataclasses.replace(cfg, data=dataclasses.replace(
            cfg.data, partitions=[part])), out, resume=resume, progress=progress,
            warm_start=previous)
        record["summary"] = summary or json.loads((out / "summary.json").read_text())
        if env_rank() == 0:
            append_line(runs / "follow.jsonl", json.dumps(record))
        records.append(record)
        previous = out
    return records


def plan_model(cfg: Config, cluster: ClusterConfig) -> PlanResult:
    """Dry-run plan of ``cfg``'s model on ``cluster`` (no GPU, no process group)."""
    return recipe_for(cfg).plan(cluster)


__all__ = ["RECIPES", "Recipe", "Run", "build_run", "evaluate", "family_recipe", "fit", "plan_model",
           "recipe_for"]
