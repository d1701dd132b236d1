"""The recipe base: config → data, model, plan → sharded model → optimizers → Trainer.

A recipe is the only library code that reads the resolved config. A family's recipe
(:mod:`~embedtrain.recipes.ctr`, :mod:`~embedtrain.recipes.xc`, :mod:`~embedtrain.recipes.gnn`)
says what is particular to it -- the data set, the model and what the planner sees of it, the
readers of each split, the task and the summary's extra fields -- and :class:`Recipe` does the
rest the same way for all: plan on rank 0 (broadcast), ``DistributedModelParallel``, the dense
all-reduce hook, the combined optimizer, the learning-rate schedule and the trainer.

``data.batch_size`` is the global batch: each of the ``world_size`` ranks reads
``batch_size / world_size`` examples per step from its own share of the data.

Example:
    >>> recipe = recipe_for(load_config("configs/dlrm_synthetic.yaml"))   # embedtrain.recipes
    >>> run = recipe.build_run("runs/demo")
    >>> summary = run.trainer.fit(test_data=run.test_data)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.collective_utils import invoke_on_rank_and_broadcast_result
from torchrec.distributed.model_parallel import (
    DefaultDataParallelWrapper,
    DistributedModelParallel,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer

from embedtrain.config import (
    ClusterConfig,
    Config,
    DeviceKind,
    PipelineKind,
    TableConstraint,
    ConfigError,
    check_world_size,
    task_family,
)
from embedtrain.components import Component, build
from embedtrain.recipes.export_parts import ExportParts
from embedtrain.runtime import fit_allocator
from embedtrain.tables.dynamic import managed_tables, table_stats
from embedtrain.sharding.measure import (
    measure_embedding_bytes,
    measure_head_bytes,
    plan_vs_measured,
)
from embedtrain.sharding.dynamic import settle_dynamic_tables
from embedtrain.sharding.planner import PlanError, PlanResult, plan_sharding
from embedtrain.sharding.report import write_report
from embedtrain.sharding.sharders import embedding_sharders
from embedtrain.train.dist import init_process_group
from embedtrain.train.optim import (
    combined_optimizer,
    dense_lr_schedule,
    dense_optimizer_factory,
    dense_optimizer_slots,
    fuse_sparse_optimizer,
    register_dense_allreduce,
)
from embedtrain.train.loggers import check_loggers
from embedtrain.train.run_dir import RunDir
from embedtrain.utils import write_atomic
from embedtrain.train.options import Selection
from embedtrain.train.task import Task, higher_is_better
from embedtrain.recipes.run import Run
from embedtrain.train.trainer import EpochData, Trainer, TrainerOptions


@dataclass
class ModelParts:
    """What a recipe builds for training, before sharding.

    Attributes:
        model: the model on ``meta`` with its tables' sparse optimizer fused.
        planning_model: what the planner sizes, when it is not ``model`` (an XC model's sharded
            head appears there as the row-wise table ``class_head``).
        sharded_head: ``model.head`` when it is model-parallel outside TorchRec: kept out of
            DDP, measured with the tables.
        head_optimizer: the sharded head's optimizer (joins the combined optimizer as ``head``).
    """

    model: nn.Module
    planning_model: Optional[nn.Module] = None
    sharded_head: Optional[nn.Module] = None
    head_optimizer: Optional[KeyedOptimizer] = None


@dataclass
class DatasetInfo:
    """The data set a run reads: its name, directory and splits."""

    name: str
    root: Path
    splits: Sequence[str]
    # where its metadata.json and vocabularies lie: a partitioned set's newest partition read
    meta_root: Optional[Path] = None


@dataclass(frozen=True)
class Oracle:
    """A data set's best possible value of a metric (synthetic data sets know theirs).

    Attributes:
        key: where ``summary.json`` holds it (copied from ``metadata.json``).
        metric: the metric it bounds (``"auc"``, ``"p@1"``): drawn in ``curves.png`` when it is
            the task's main metric.
        what: what it is, printed after its value.
    """

    key: str
    metric: str
    what: str


class Recipe:
    """One task family's wiring of the config into a run. Subclasses implement the hooks below.

    Attributes:
        oracle: the data set's best possible value of a metric, printed under the final metrics
            and drawn in ``curves.png``.
        printed_metrics: the summary keys printed after a run, in order (``@`` metrics follow,
            sorted, then the loss).
    """

    oracle: ClassVar[Optional[Oracle]] = None
    printed_metrics: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._dataset: Any = None
        # the family's data builder (e.g. recipes.tabular.TabularData: load, info, reader,
        # pooling_factors, pooling_note), which the data hooks below ask; None: the family
        # implements them itself
        self.data: Any = None
        # a class head part (recipes.heads.ClassHeads): the model is then the family's
        # head_model(head) with it (see planning_model), and its planning, reservations, plan
        # notes, export refusal and summary join the hooks' below; None: none
        self.heads: Any = None

    # -- what a family says ------------------------------------------------------------------

    def load_dataset(self) -> Any:
        """Reads the data set's metadata (called once; the result is :attr:`dataset`)."""
        return self.data.load()

    def dataset_info(self) -> DatasetInfo:
        """Name, directory and splits of :attr:`dataset`."""
        return self.data.info(self.dataset)

    def planning_model(self) -> nn.Module:
        """The model on ``meta`` with its sparse optimizers marked: what ``embedtrain plan``
        sizes (no process group needed). With a class head: the family's ``head_model(head)``
        as the planner sees the head (:meth:`ClassHeads.planning_model`)."""
        if self.heads is None:
            raise NotImplementedError
        return self.heads.planning_model(self.head_model)

    def model_parts(self, device: torch.device) -> ModelParts:
        """The training model (and a sharded head, if any), in a joined process group; with a
        class head, its slice and optimizer (:meth:`ClassHeads.model_parts`; the family's
        ``class_counts`` where the head needs them)."""
        if self.heads is None:
            return ModelParts(self.planning_model())
        return self.heads.model_parts(self.head_model, device, lambda: self.class_counts,
                                      self.cfg.train.seed)

    def reader(self, split: str, train: bool, batch_size: int, rank: int,
               world_size: int) -> EpochData:
        """This rank's batches of ``split`` (``batch_size`` per rank)."""
        return self.data.reader(self.dataset, split, train, batch_size, rank, world_size)

    def task(self) -> Task:
        """The task the trainer runs (loss, predictions, metrics)."""
        raise NotImplementedError

    def make_task(self) -> Task:
        """The run's task: ``task: {_component_: ...}`` built with its keys and what the family
        supplies (:meth:`task_supplies`) where its signature takes them, else :meth:`task`.

        Raises:
            ConfigError: the component is not a task (one line).
        """
        spec = self.cfg.task
        if not isinstance(spec, Component):
            return self.task()
        task = build(spec, "task", **self.task_supplies())
        missing = [a for a in ("name", "main_metric", "forward", "new_metrics")
                   if not hasattr(task, a)]
        if missing:
            raise ConfigError(f"task: {spec.path}: has no {', '.join(missing)} (a task has "
                              "name, main_metric, forward(model, batch) and new_metrics())")
        return task

    def task_supplies(self) -> dict[str, Any]:
        """What the family gives a task component whose signature takes it (by name)."""
        return {}

    def summary_extra(self) -> dict[str, Any]:
        """More fields for ``summary.json`` (e.g. the data set's oracle metric)."""
        return {}

    def batch_args(self) -> Optional[Callable[[Any], tuple]]:
        """A batch -> the model's forward arguments, for ``train.pipeline``'s model(batch);
        ``None``: the family's model cannot run in TorchRec's train pipelines."""
        return None

    def check_pipeline(self) -> None:
        """A one-line refusal of ``train.pipeline`` for a family that cannot run in it."""
        kind = self.cfg.train.pipeline
        if kind is PipelineKind.SEMI_SYNC:
            raise ValueError(
                "train.pipeline: semi_sync is not supported yet (TorchRec's "
                "TrainPipelineSemiSync steps the optimizer itself, in its own order, which "
                "embedtrain's loop (gradient accumulation, LR schedule, checkpoints) does not "
                "follow); use sparse_dist")
        if kind is not PipelineKind.NONE and self.batch_args() is None:
            raise ValueError(
                f"train.pipeline: {kind.value} runs task ctr only (TorchRec's pipelines trace "
                f"the model with torch.fx to find its sharded tables' inputs; the "
                f"{task_family(self.cfg).value} model's forward cannot be traced); use "
                f"train.pipeline: none")

    def planning_constraints(self) -> list[TableConstraint]:
        """Constraints the family adds to ``sharding.tables`` (e.g. the class head row-wise)."""
        return self.heads.planning_constraints(self.cfg.sharding.tables) if self.heads else []

    def pooling_factors(self) -> dict[str, float]:
        """Mean ids per example per table, for the planner (default: 1 for every table)."""
        return self.data.pooling_factors(self.dataset) if self.data is not None else {}

    def extra_reservations(self, cluster: ClusterConfig) -> dict[str, int]:
        """More per-rank memory the planner sets aside, by name, in bytes (a sharded head's
        logits)."""
        return self.heads.reservations(cluster) if self.heads else {}

    def describe_plan(self, result: PlanResult) -> None:
        """Adds the family's notes (model section, warnings) to the plan's report."""
        if self.heads is not None:
            self.heads.describe_plan(result)

    def export_refusal(self) -> Optional[str]:
        """Why ``embedtrain export`` cannot export this config's model, in one line (None: it
        can); asked before anything is read or written. Default: refused where the recipe has
        no :meth:`export_parts`, or whose head is not exported."""
        if self.heads is not None and self.heads.export_refusal():
            return self.heads.export_refusal()
        if type(self).export_parts is Recipe.export_parts:
            return (f"task {task_family(self.cfg).value}: {type(self).__name__} does not say what to "
                    f"export (it has no export_parts)")
        return None

    def export_parts(self, model: nn.Module, tables: Sequence[tuple[str, int, int]]
                     ) -> ExportParts:
        """What ``embedtrain export`` writes besides the tables of ``model`` (the
        :meth:`planning_model`), whose ``(name, rows, dim)`` are ``tables``, in the model's
        feature order."""
        raise NotImplementedError

    def predict_pooled(self, pooled: list[torch.Tensor]) -> torch.Tensor:
        """The dense program's ``pooled`` input from the tables' pooled embeddings (``[B, dim]``
        each, in the tables' order), for ``embedtrain predict``."""
        raise NotImplementedError

    def predict_excluded(self, sparse: Any) -> Optional[torch.Tensor]:
        """Class ids ``[B, n]`` (``-1``: none) each row's top-k leaves out at ``predict``, as
        its evaluation does (``seq.exclude_history``); None: none."""
        return None

    # -- shared ------------------------------------------------------------------------------

    @property
    def dataset(self) -> Any:
        """The data set's metadata (:meth:`load_dataset`, read on first use)."""
        if self._dataset is None:
            self._dataset = self.load_dataset()
        return self._dataset

    def plan(self, cluster: ClusterConfig, model: Optional[nn.Module] = None) -> PlanResult:
        """Dry-run plan of the config's model on ``cluster``: built on ``meta``, no GPU."""
        cfg, info = self.cfg, self.dataset_info()
        model = model if model is not None else self.planning_model()
        if not any(isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
                   for m in model.modules()):
            mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
            raise PlanError(f"nothing to plan: the model has no embedding tables (e.g. "
                            f"gnn.embedding_dim: 0); it trains data-parallel, each rank holding "
                            f"its whole {mib:.2f} MiB dense model")
        sharding = cfg.sharding
        extra = self.planning_constraints()
        if extra:
            sharding = dataclasses.replace(sharding, tables=[*sharding.tables, *extra])
        result = plan_sharding(model, cluster, sharding,
                               pooling_factors=self.pooling_factors(),
                               dense_optimizer_slots=dense_optimizer_slots(cfg.optim.dense),
                               extra_reservations=self.extra_reservations(cluster))
        result.report.model = {"task": task_family(cfg).value, "dataset": info.name,
                               "dataset_path": str(info.root),
                               "pooling_factors": self.pooling_note()}
        self.describe_plan(result)
        return result

    def pooling_note(self) -> str:
        """How the plan's pooling factors were found (shown in the report)."""
        return self.data.pooling_note(self.dataset) if self.data is not None else "1.0 (no data)"

    def build_run(self, out_dir: str | os.PathLike, progress: Optional[bool] = None,
                  cluster: Optional[ClusterConfig] = None, record_plan: bool = True) -> Run:
        """Builds the sharded model, optimizers, readers and trainer of a run.

        Args:
            out_dir: the run directory.
            progress: overrides ``train.progress``.
            cluster: the cluster this run is on (its world size must match); default: this
                machine.
            record_plan: write the plan used into ``out_dir`` (``plan.json``, ``plan.md``,
                ``plan_vs_measured.json``); off for read-only commands (``embedtrain eval``).

        Returns:
            The run; call ``run.trainer.fit(test_data=run.test_data)``.
        """
        cfg, d, t = self.cfg, self.cfg.data, self.cfg.train
        quiet_fx_tracing_warning()
        self.check_pipeline()
        check_loggers(cfg.loggers)  # before anything is built or written
        task = self.make_task()
        self.check_selection(task)
        rank, world, device = init_process_group()
        check_world_size(cfg, world)
        if t.grad_accumulation < 1:
            raise ValueError(f"train.grad_accumulation: must be at least 1, got "
                             f"{t.grad_accumulation}")
        if t.grad_accumulation > 1 and t.checkpoint_every % t.grad_accumulation:
            # A checkpoint between micro-batches would lose the gradients accumulated so far.
            raise ValueError(f"train.checkpoint_every: {t.checkpoint_every} is not a multiple "
                             f"of train.grad_accumulation ({t.grad_accumulation})")
        local_batch, local_eval_batch = d.batch_size // world, d.eval_batch_size // world
        if cluster is None:
            cluster = local_cluster(world, device, local_batch)
        else:
            cluster = dataclasses.replace(cluster, batch_size_per_rank=local_batch)
        torch.manual_seed(t.seed)
        os.makedirs(out_dir, exist_ok=True)
        info = self.dataset_info()

        dmp, optimizer, dense = self.sharded_model(cluster, device,
                                                   out_dir if record_plan else None)
        o = cfg.optim

        def reader(split: str, train: bool) -> EpochData:
            return self.reader(split, train, local_batch if train else local_eval_batch,
                               rank, world)

        meta_file = (info.meta_root or info.root) / "metadata.json"
        if "train" not in info.splits:
            raise ValueError(f"{meta_file}: no train split (or an empty one): "
                             "there is nothing to train on; give the ingestion spec's split "
                             "rows for train")
        train_data = reader("train", True)
        check_batch_fits(d.batch_size, train_data, f"the train split of {info.root}")
        valid_data = reader("valid", False) if "valid" in info.splits else None
        if valid_data is None and rank == 0:
            print(f"warning: {meta_file} has no valid split: no periodic "
                  "evaluation and no best-checkpoint selection (train.select: best falls back "
                  "to the last step); ingest with a validation split (e.g. "
                  "split.valid_fraction: 0.1) to have them", file=sys.stderr)
        dynamic = any(True for _ in managed_tables(dmp))
        extra_summary = {**self.summary_extra(),
                         **(self.heads.summary_extra() if self.heads else {})}
        trainer = Trainer(
            task, dmp, optimizer, train_data, valid_data, RunDir(out_dir),
            self.trainer_options(progress), dataset_name=info.name, extra_summary=extra_summary,
            lr_scheduler=dense_lr_schedule(
                dense, self.total_steps(len(train_data)), o.warmup_steps, o.lr_decay,
                o.lr_step_size, o.lr_gamma, o.min_lr_ratio),
            reference=self.reference(extra_summary, task.main_metric),
            batch_args=self.batch_args(),
            model_stats=table_stats if dynamic else None,
            before_checkpoint=settle_dynamic_tables if dynamic else None,
        )
        test = reader("test", False) if "test" in info.splits else None
        return Run(trainer=trainer, recipe=self, test_data=test,
                   eval_reader=lambda split: reader(split, False))

    def sharded_model(self, cluster: ClusterConfig, device: torch.device,
                      out_dir: Optional[str | os.PathLike] = None
                      ) -> tuple[DistributedModelParallel, CombinedOptimizer, KeyedOptimizer]:
        """The model built, planned and sharded, the dense all-reduce hooked, and its optimizers.

        Returns:
            The sharded model, the combined optimizer (fused sparse + dense [+ head]: what the
            trainer steps and checkpoints) and its dense part (what the schedule drives).
        """
        parts = self.model_parts(device)
        dmp = self.shard(parts, cluster, device, out_dir)
        s, o = self.cfg.sharding, self.cfg.optim
        register_dense_allreduce(dmp, s.dense_allreduce, s.powersgd_rank)
        exclude, extra = set(), []
        if parts.sharded_head is not None:
            exclude = {f"head.{n}" for n, _ in parts.sharded_head.named_parameters()}
            extra = [("head", parts.head_optimizer)]
        optimizer, dense = combined_optimizer(
            dmp, dense_optimizer_factory(o.dense, o.dense_lr, o.weight_decay, o.momentum),
            exclude=exclude, extra=extra)
        return dmp, optimizer, dense

    def shard(self, parts: ModelParts, cluster: ClusterConfig, device: torch.device,
              out_dir: Optional[str | os.PathLike] = None) -> DistributedModelParallel:
        """Plans on rank 0 (broadcast to all) and wraps the model in ``DistributedModelParallel``.

        With ``out_dir``, rank 0 writes the plan used (``plan.json``, ``plan.md``) and, after
        sharding, ``plan_vs_measured.json``: the planner's per-rank embedding bytes (with a
        sharded class head) against what each rank holds.
        """
        world = dist.get_world_size()
        if cluster.world_size != world:
            raise ValueError(f"cluster {cluster.name} has {cluster.world_size} ranks "
                             f"({cluster.hosts} x {cluster.devices_per_host}) but this run has "
                             f"{world}")
        model, head = parts.model, parts.sharded_head
        planned = parts.planning_model if parts.planning_model is not None else model
        if any(isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
               for m in model.modules()):
            sharding_plan, report = invoke_on_rank_and_broadcast_result(
                dist.GroupMember.WORLD, 0, _plan_for_broadcast, self, cluster, planned)
        else:  # nothing to shard (e.g. a features-only baseline): plain data parallelism
            sharding_plan, report = ShardingPlan(plan={}), None
        wrapper = None
        if head is not None:  # the head's slice is its own: no DDP all-reduce for it
            sharding_plan.plan.pop("head", None)
            wrapper = DefaultDataParallelWrapper(
                params_to_ignore=[f"head.{n}" for n, _ in head.named_parameters()])
        s = self.cfg.sharding
        dmp = DistributedModelParallel(
            model, device=device, plan=sharding_plan,
            sharders=embedding_sharders(s.forward_comm_precision, s.backward_comm_precision),
            env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
            data_parallel_wrapper=wrapper)
        held = measure_embedding_bytes(dmp)
        if head is not None:
            held = measure_head_bytes(head, parts.head_optimizer, held)
        fit_allocator(held["weights"] + held["optimizer"])  # a head filling memory: unmap blocks
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, held)
        self._plan_record = (report, gathered)
        if out_dir is not None:
            self.write_plan(out_dir)
        return dmp

    def write_plan(self, out_dir: str | os.PathLike) -> None:
        """Rank 0 writes the plan :meth:`shard` used into ``out_dir`` (``plan.json``,
        ``plan.md``, ``plan_vs_measured.json``); a resume calls it once the checkpoint is read."""
        report, gathered = getattr(self, "_plan_record", (None, None))
        if dist.get_rank() == 0 and report is not None:
            write_report(report, out_dir, ("json", "md"))
            write_atomic(os.path.join(out_dir, "plan_vs_measured.json"),
                         json.dumps(plan_vs_measured(report, gathered), indent=2))

    def fuse_sparse(self, model: nn.Module) -> nn.Module:
        """Marks ``model``'s tables for the config's fused sparse optimizer; returns ``model``."""
        fuse_sparse_optimizer(model, self.cfg.optim.sparse, self.cfg.optim.sparse_lr)
        return model

    def trainer_options(self, progress: Optional[bool] = None) -> TrainerOptions:
        """The ``train`` section's schedule for the trainer (``progress`` overrides its own)."""
        t = self.cfg.train
        return TrainerOptions(
            epochs=t.epochs, max_steps=t.max_steps, eval_every=t.eval_every,
            eval_max_batches=t.eval_max_batches, checkpoint_every=t.checkpoint_every,
            keep_checkpoints=t.keep_checkpoints,
            progress=t.progress if progress is None else progress,
            grad_accumulation=t.grad_accumulation, bf16_dense=t.bf16_dense, select=t.select,
            select_metric=t.select_metric,
            early_stopping_patience=t.early_stopping_patience, pipeline=t.pipeline,
            status_every_s=t.status_every_s)

    def check_selection(self, task: Task) -> None:
        """``train.select_metric`` is a metric of the task with a known better direction."""
        t = self.cfg.train
        if t.select is Selection.LAST and t.early_stopping_patience == 0:
            return
        metric = t.select_metric or task.main_metric
        try:
            higher_is_better(metric)
        except ValueError as e:
            raise ValueError(f"train.select_metric: {e}") from None

    def total_steps(self, batches_per_epoch: int) -> int:
        """Steps of the whole run (``train.epochs``, capped by ``train.max_steps``; sized to
        the data where not given, as the trainer sizes them)."""
        t = self.cfg.train.sized(batches_per_epoch)
        steps = t.epochs * batches_per_epoch
        return min(t.max_steps or steps, steps)

    def summary_lines(self, summary: dict[str, Any]) -> list[str]:
        """The final metrics of a run as printed lines (metric, value[, what it is])."""
        keys = [k for k in self.printed_metrics if k in summary]
        keys += sorted((k for k in summary if "@" in k),
                       key=lambda k: (k.split("@")[0], int(k.split("@")[1])))
        if not keys:  # a task of one's own: its metrics, as its evaluations gave them
            keys = [k for k in summary.get("valid", {}) if k != "loss" and k in summary]
        keys += ["loss"] if "loss" in summary else []
        lines = [f"  {k:<12} {summary[k]:.4f}" for k in keys]
        if self.oracle and self.oracle.key in summary:
            o = self.oracle
            lines.append(f"  {'oracle_' + o.metric:<12} {summary[o.key]:.4f}  ({o.what})")
        for name, t in summary.get("tables", {}).items():
            lines.append(f"  {name}: dynamic, {t['occupied']:,} of {t['capacity']:,} rows held "
                         f"({t['occupancy']:.0%}), {t['ids_admitted']:,} ids admitted, "
                         f"{t['evictions']:,} evicted; default row: {t['default_row_share']:.1%} "
                         f"of training lookups, {t['eval_default_row_share']:.1%} of the test's")
        return lines + (self.heads.summary_lines(summary) if self.heads else [])

    def reference(self, summary: dict[str, Any], main_metric: str) -> Optional[float]:
        """The oracle's value when it bounds ``main_metric`` (the line in ``curves.png``)."""
        if self.oracle is None or self.oracle.metric != main_metric:
            return None
        return summary.get(self.oracle.key)


def quiet_fx_tracing_warning() -> None:
    """Spends torch's once-per-process ``is_fx_tracing`` warning without printing it.

    TorchRec's modules call ``torch.fx._symbolic_trace.is_fx_tracing()`` in every forward; torch
    2.13 and 2.14 log a deprecation warning (once, through an ``lru_cache``) addressed to
    TorchRec, not to users. Only that one message is swallowed: the logger is disabled just for
    the call.
    """
    try:
        from torch.fx import _symbolic_trace as fx_trace
    except ImportError:  # pragma: no cover - a torch without the module: nothing to silence
        return
    warn = getattr(fx_trace, "is_fx_tracing_warning", None)
    if warn is None:
        return
    log = fx_trace.log
    disabled, log.disabled = log.disabled, True
    try:
        warn()
    finally:
        log.disabled = disabled


def _plan_for_broadcast(recipe: Recipe, cluster: ClusterConfig, model: nn.Module):
    result = recipe.plan(cluster, model)
    return result.sharding_plan, result.report


def local_cluster(world_size: int, device: torch.device, batch_size_per_rank: int
                  ) -> ClusterConfig:
    """The machine(s) this run is on, as a cluster description (used when none is given)."""
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    ram_gb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    cuda = device.type == "cuda"
    cluster = ClusterConfig(
        name="local",
        hosts=max(1, world_size // per_host),
        devices_per_host=per_host,
        device=DeviceKind.CUDA if cuda else DeviceKind.CPU,
        hbm_gb=torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else 0.0,
        ddr_gb=ram_gb / per_host,
        batch_size_per_rank=batch_size_per_rank,
    )
    if not cuda:  # processes on one host talk through gloo over loopback, not NVLink
        # sharding_group_ms: each sharding type a plan uses costs a CPU step its own input dist,
        # TBE calls and output dist: ~2 ms in a world of one (a tiny 2-table sharded EBC step on
        # the 2-core dev VM; 4.4 ms calibrated for 2 ranks, cpu-1x2.yaml). At 0, the planner split
        # the demo's tables table_wise + row_wise on one rank: +5 ms a step (bench_roofline.py).
        cluster = dataclasses.replace(cluster, ddr_bandwidth_gb_per_s=8.0, intra_host_gb_per_s=4.0,
                                      inter_host_gb_per_s=4.0, sharding_group_ms=2.0)
    return cluster


def check_batch_fits(global_batch: int, train_data: Any, what: str) -> None:
    """A global batch larger than the training split is a config mistake (a run of 0 or 1 steps)."""
    rows = train_data.total_rows
    if global_batch > rows:
        raise ValueError(f"data.batch_size: {global_batch:,} (the global batch) is larger than "
                         f"{what} ({rows:,} rows); lower data.batch_size")
    if len(train_data) == 0:  # drop_last with fewer rows per rank than a local batch
        raise ValueError(f"data.batch_size: {global_batch:,} leaves no full batch of {what} "
                         f"({rows:,} rows) with data.drop_last: true")


def oracle_of(extra: dict[str, Any], key: str) -> dict[str, Any]:
    """``{key: test value}`` of a data set's oracle metric in ``metadata.json`` (``{}``: none)."""
    oracle = extra.get(key, {})
    return {key: oracle["test"]} if isinstance(oracle, dict) and "test" in oracle else {}
