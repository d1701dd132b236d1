"""Wiring: a resolved :class:`~embedtrain.config.Config` into a ready :class:`Trainer`.

This is the only place where config sections meet library objects: the data set's metadata sizes
the tables, the model is built on ``meta``, planned by embedtrain's planner for the cluster (the
same plan ``embedtrain plan`` prints for that cluster file) and handed to
``DistributedModelParallel`` (a world of one on a laptop, many ranks under ``torchrun``); the sparse
optimizer is fused into the tables' backward and the dense one wraps the rest, with its schedule
and the dense all-reduce's compression.

``data.batch_size`` is the global batch: each of the ``world_size`` ranks reads
``batch_size / world_size`` examples per step from its own share of the data.

Example:
    >>> cfg = load_config("configs/dlrm_synthetic.yaml")
    >>> run = build_run(cfg, "runs/demo")
    >>> summary = run.trainer.fit(test_data=run.test_data)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

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
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from embedtrain.config import (
    ClusterConfig,
    Config,
    DeviceKind,
    HeadKind,
    Interaction,
    ShardingConfig,
    ShardingType,
    TableConstraint,
    TaskKind,
    check_world_size,
)
from embedtrain.data.reader import LastBatch, ParquetBatchReader
from embedtrain.data.stats import class_counts, measure_pooling_factors
from embedtrain.features import DatasetMeta, load_dataset_meta
from embedtrain.models.dlrm import dcn, dlrm, table_name
from embedtrain.models.xc import HEAD_TABLE, SHARDED_HEADS, XCModel, build_head
from embedtrain.sharding.measure import (
    measure_embedding_bytes,
    measure_head_bytes,
    plan_vs_measured,
)
from embedtrain.sharding.planner import PlanResult, plan_sharding
from embedtrain.sharding.report import write_report
from embedtrain.sharding.sharders import embedding_sharders
from embedtrain.train.ctr import CTRTask
from embedtrain.train.dist import init_process_group
from embedtrain.train.optim import (
    combined_optimizer,
    dense_lr_schedule,
    dense_optimizer_slots,
    fuse_sparse_optimizer,
    head_optimizer_class,
    register_dense_allreduce,
    sharded_head_optimizer,
)
from embedtrain.train.run_dir import RunDir
from embedtrain.train.trainer import Trainer, TrainerOptions
from embedtrain.train.xc import XCTask


@dataclass
class Run:
    """Everything a CTR run needs, built and connected."""

    trainer: Trainer
    meta: DatasetMeta
    test_data: Optional[ParquetBatchReader]
    eval_reader: Callable[[str], ParquetBatchReader]  # evaluation reader of any split, cfg.data knobs


def ctr_model(cfg: Config, meta: DatasetMeta, device: Optional[torch.device] = None) -> nn.Module:
    """The DLRM or DCNv2 model that ``cfg.model`` describes, sized by the data set."""
    m = cfg.model
    if m.interaction is Interaction.DCN:
        return dcn(meta.features, m.embedding_dim, m.bottom_mlp, m.top_mlp,
                   m.dcn_num_layers, m.dcn_low_rank_dim, device=device)
    return dlrm(meta.features, m.embedding_dim, m.bottom_mlp, m.top_mlp, device=device)


GNN_TASKS = (TaskKind.GNN_NODE, TaskKind.GNN_LINK)


def local_cluster(world_size: int, device: torch.device, batch_size_per_rank: int) -> ClusterConfig:
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
        cluster = dataclasses.replace(cluster, ddr_bandwidth_gb_per_s=8.0, intra_host_gb_per_s=4.0,
                                      inter_host_gb_per_s=4.0)
    return cluster


def model_for_planning(cfg: Config, meta: DatasetMeta) -> nn.Module:
    """``cfg``'s model on ``meta`` with its sparse optimizers marked: what the planner sizes.

    An XC model's sharded class head stands in as a row-wise table (``class_head``) carrying the
    head's optimizer, so the plan shows its memory per rank as the head splits it.
    """
    if cfg.task is TaskKind.XC:
        return _xc_model_for_planning(cfg, meta)
    model = ctr_model(cfg, meta, device=torch.device("meta"))
    fuse_sparse_optimizer(model, cfg.optim.sparse, cfg.optim.sparse_lr)
    return model


def _xc_model_for_planning(cfg: Config, meta: DatasetMeta) -> nn.Module:
    _check_xc_data(cfg, meta)
    h = cfg.xc.head
    head = None
    if h.kind not in SHARDED_HEADS:  # replicated: dense parameters, as the planner counts them
        with torch.device("meta"):
            head = build_head(h, meta.features.num_classes, cfg.xc.mlp[-1])
    model = XCModel(meta.features, cfg.xc, head, device=torch.device("meta"))
    fuse_sparse_optimizer(model.encoder, cfg.optim.sparse, cfg.optim.sparse_lr)
    if head is None:
        apply_optimizer_in_backward(head_optimizer_class(h.optimizer), model.head.parameters(),
                                    {"lr": h.lr})
    return model


def _check_xc_data(cfg: Config, meta: DatasetMeta) -> None:
    if meta.features.num_classes is None:
        raise ValueError(f"{meta.root / 'metadata.json'}: task xc needs a classification data set "
                         f"(num_classes missing; generate one with: embedtrain datagen xc)")
    if cfg.xc.head.kind is HeadKind.ADAPTIVE and meta.features.max_labels > 1:
        raise ValueError(f"xc.head.kind: adaptive takes one label per example, but "
                         f"{meta.root / 'metadata.json'} allows {meta.features.max_labels}")


def _planning_sharding(cfg: Config) -> ShardingConfig:
    """``cfg.sharding``, plus: an XC class head is split row-wise (as the sharded heads split it)."""
    if cfg.task is not TaskKind.XC or cfg.xc.head.kind not in SHARDED_HEADS:
        return cfg.sharding
    if any(HEAD_TABLE in c.tables for c in cfg.sharding.tables):
        return cfg.sharding
    head = TableConstraint(tables=[HEAD_TABLE], sharding_types=[ShardingType.ROW_WISE])
    return dataclasses.replace(cfg.sharding, tables=[*cfg.sharding.tables, head])


def plan_model(cfg: Config, cluster: ClusterConfig, model: Optional[nn.Module] = None) -> PlanResult:
    """Dry-run plan of ``cfg``'s model on ``cluster``: built on ``meta``, no memory, no GPU.

    Pooling factors are measured from the training split when the data set has one and
    ``cfg.sharding.pooling_factors_from_data`` is set; otherwise every table counts 1 id.
    """
    if cfg.task in GNN_TASKS:
        return _plan_gnn(cfg, cluster, model)
    meta = load_dataset_meta(cfg.data.path)
    model = model if model is not None else model_for_planning(cfg, meta)
    measured = cfg.sharding.pooling_factors_from_data and bool(meta.split_files.get("train"))
    pooling = measure_pooling_factors(meta) if measured else {}
    result = plan_sharding(
        model,
        cluster,
        _planning_sharding(cfg),
        pooling_factors={table_name(f): v for f, v in pooling.items()},
        dense_optimizer_slots=dense_optimizer_slots(cfg.optim.dense),
        extra_reservations=head_activation_bytes(cfg, meta, cluster),
    )
    result.report["model"] = {
        "task": cfg.task.value,
        "dataset": meta.name,
        "dataset_path": str(meta.root),
        "pooling_factors": "measured from the train split" if measured else "1.0 (no data)",
    }
    if cfg.task is TaskKind.XC:
        _describe_head(result.report, cfg, meta)
    return result


def head_activation_bytes(cfg: Config, meta: DatasetMeta, cluster: ClusterConfig) -> dict[str, int]:
    """Per-rank memory of a sharded class head's logits in a training step (``{}``: none).

    Every rank scores the *global* batch (``batch_size_per_rank x ranks`` gathered features)
    against its slice, or against the slice's sample: the logits and the softmax kept for the
    backward pass (one more copy with a margin) are ``B x columns`` floats each.
    """
    h = cfg.xc.head
    if cfg.task is not TaskKind.XC or h.kind not in SHARDED_HEADS:
        return {}
    batch = cluster.batch_size_per_rank * cluster.world_size
    local = -(-meta.features.num_classes // cluster.world_size)
    if h.kind is HeadKind.FULL:
        columns = local
    elif h.kind is HeadKind.PARTIAL_FC:
        columns = max(round(h.sample_rate * local), 1)
    else:  # positives + nearest classes + uniform sample, at most the slice
        columns = min(local, batch * (1 + h.hard_negatives) + round(h.sample_rate * local))
    copies = 3 if h.margin.value != "none" else 2
    return {"class_head_logits": batch * columns * 4 * copies}


def _plan_gnn(cfg: Config, cluster: ClusterConfig, model: Optional[nn.Module]) -> PlanResult:
    from embedtrain.train import gnn_recipe

    graph = gnn_recipe.load_gnn_graph(cfg)
    if model is None:
        model = gnn_recipe.gnn_model(cfg, graph, device=torch.device("meta"))
        fuse_sparse_optimizer(model, cfg.optim.sparse, cfg.optim.sparse_lr)
    result = plan_sharding(model, cluster, cfg.sharding,
                           pooling_factors=gnn_recipe.gnn_pooling_factors(graph),
                           dense_optimizer_slots=dense_optimizer_slots(cfg.optim.dense))
    result.report["model"] = {"task": cfg.task.value, "dataset": graph.name,
                              "dataset_path": str(graph.root), "pooling_factors": "1 id per node"}
    return result


def _describe_head(report: dict[str, Any], cfg: Config, meta: DatasetMeta) -> None:
    """Notes the class head in the report: its size, and that its compute is not estimated."""
    h, c, d = cfg.xc.head, meta.features.num_classes, cfg.xc.mlp[-1]
    info = {"kind": h.kind.value, "num_classes": c, "dim": d, "optimizer": h.optimizer.value}
    if h.kind in SHARDED_HEADS:
        entry = next(t for t in report["tables"] if t["name"] == HEAD_TABLE)
        info["table"] = HEAD_TABLE
        report["warnings"].append(
            f"class head {HEAD_TABLE} ({c:,} classes x {d}, {h.kind.value}) is planned as a "
            f"row-wise table: its memory per rank is exact, its time is not (the head's matmul "
            f"over its slice, about 6 x batch x {c:,} / ranks x {d} flops a step, is not "
            f"estimated); {entry['sharding_type']} over {len(entry['shards'])} shard(s)")
    else:
        info["table"] = None
        report["warnings"].append(
            f"class head ({h.kind.value}, {c:,} classes) is replicated on every rank (dense "
            f"parameters, all-reduced with the MLP)")
    report["model"]["class_head"] = info


def shard_model(cfg: Config, model: nn.Module, cluster: ClusterConfig, device: torch.device,
                out_dir: Optional[str | os.PathLike] = None,
                planning_model: Optional[nn.Module] = None,
                sharded_head: Optional[nn.Module] = None,
                head_optimizer: Optional[torch.optim.Optimizer] = None) -> DistributedModelParallel:
    """Plans on rank 0 (broadcast to all) and wraps ``model`` in ``DistributedModelParallel``.

    Args:
        cfg, model, cluster, device: the run's config, model, cluster and device.
        out_dir: rank 0 writes the plan used (``plan.json``, ``plan.md``) and, after sharding,
            ``plan_vs_measured.json``: the planner's per-rank embedding bytes (with a sharded
            class head) against what each rank holds.
        planning_model: what the planner sees, when it is not ``model`` (an XC model's sharded
            head appears there as the row-wise table ``class_head``).
        sharded_head: ``model``'s model-parallel class head (at ``model.head``): kept out of
            DDP, measured with the tables (with ``head_optimizer``'s state).
    """
    world = dist.get_world_size()
    if cluster.world_size != world:
        raise ValueError(f"cluster {cluster.name} has {cluster.world_size} ranks "
                         f"({cluster.hosts} x {cluster.devices_per_host}) but this run has {world}")
    tables = any(isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
                 for m in model.modules())
    if tables:
        sharding_plan, report = invoke_on_rank_and_broadcast_result(
            dist.GroupMember.WORLD, 0, _plan_for_broadcast, cfg, cluster,
            planning_model if planning_model is not None else model)
    else:  # nothing to shard (e.g. a features-only baseline): plain data parallelism
        sharding_plan, report = ShardingPlan(plan={}), None
    wrapper = None
    if sharded_head is not None:  # the head's slice is its own: no DDP all-reduce for it
        sharding_plan.plan.pop("head", None)
        wrapper = DefaultDataParallelWrapper(
            params_to_ignore=[f"head.{n}" for n, _ in sharded_head.named_parameters()])
    dmp = DistributedModelParallel(model, device=device, plan=sharding_plan,
                                   sharders=embedding_sharders(cfg.sharding),
                                   env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                   data_parallel_wrapper=wrapper)
    held = measure_embedding_bytes(dmp)
    if sharded_head is not None:
        held = measure_head_bytes(sharded_head, head_optimizer, held)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, held)
    if out_dir is not None and dist.get_rank() == 0 and report is not None:
        write_report(report, out_dir, ("json", "md"))
        comparison = plan_vs_measured(report, gathered)
        with open(os.path.join(out_dir, "plan_vs_measured.json"), "w") as f:
            json.dump(comparison, f, indent=2)
    return dmp


def _plan_for_broadcast(cfg: Config, cluster: ClusterConfig, model: nn.Module):
    result = plan_model(cfg, cluster, model)
    return result.sharding_plan, result.report


def build_run(cfg: Config, out_dir: str | os.PathLike, progress: Optional[bool] = None,
              cluster: Optional[ClusterConfig] = None, record_plan: bool = True) -> Run:
    """Builds the sharded model, optimizers, readers and trainer of a run of ``cfg.task``.

    Args:
        cfg: the resolved config.
        out_dir: the run directory.
        progress: overrides ``cfg.train.progress``.
        cluster: the cluster this run is on (its world size must match); default: this machine.
        record_plan: write the plan used into ``out_dir`` (``plan.json``, ``plan.md``,
            ``plan_vs_measured.json``); off for read-only commands (``embedtrain eval``).

    Returns:
        The run; call ``run.trainer.fit(test_data=run.test_data)``.
    """
    rank, world, device = init_process_group()
    d = cfg.data
    check_world_size(cfg, world)
    plan_dir = out_dir if record_plan else None
    local_batch, local_eval_batch = d.batch_size // world, d.eval_batch_size // world
    k = cfg.train.grad_accumulation
    if k < 1:
        raise ValueError(f"train.grad_accumulation: must be at least 1, got {k}")
    if k > 1 and cfg.train.checkpoint_every % k:
        # A checkpoint between micro-batches would lose the gradients accumulated so far.
        raise ValueError(f"train.checkpoint_every: {cfg.train.checkpoint_every} is not a multiple "
                         f"of train.grad_accumulation ({k})")
    if cluster is None:
        cluster = local_cluster(world, device, local_batch)
    else:
        cluster = dataclasses.replace(cluster, batch_size_per_rank=local_batch)
    torch.manual_seed(cfg.train.seed)
    os.makedirs(out_dir, exist_ok=True)
    if cfg.task in GNN_TASKS:
        return _build_gnn_run(cfg, out_dir, progress, cluster, rank, world, device,
                              local_batch, local_eval_batch, plan_dir)
    meta = load_dataset_meta(d.path)
    if cfg.task is TaskKind.XC:
        dmp, optimizer, dense, task = _xc_model(cfg, meta, cluster, device, plan_dir)
        oracle_key = "oracle_p_at_1"
    else:
        dmp = shard_model(cfg, model_for_planning(cfg, meta), cluster, device, plan_dir)
        register_dense_allreduce(dmp, cfg.sharding.dense_allreduce, cfg.sharding.powersgd_rank)
        optimizer, dense = combined_optimizer(dmp, cfg.optim)
        task, oracle_key = CTRTask(), "oracle_auc"
    if cfg.train.pipeline and rank == 0:
        where = ("on cpu there are no CUDA streams to overlap the input all-to-all with"
                 if device.type == "cpu" else "the CUDA path is not wired into the trainer yet")
        print(f"train.pipeline: TorchRec's TrainPipelineSparseDist is not used ({where}); "
              "the plain loop runs, with the same results", file=sys.stderr)

    # Every row once per epoch, the same number of equal-sized batches on every rank: an
    # epoch's last step is padded (marked rows, left out of losses and metrics) where the ranks'
    # shares differ by a row. drop_last leaves the last partial step out instead (counted).
    train_last = LastBatch.DROP if d.drop_last else LastBatch.PAD

    def reader(split: str, train: bool) -> ParquetBatchReader:
        return ParquetBatchReader(
            meta.files(split),
            meta.features,
            batch_size=local_batch if train else local_eval_batch,
            shuffle=d.shuffle and train,
            seed=cfg.train.seed,
            last_batch=train_last if train else LastBatch.PAD,
            shuffle_buffer_rows=d.shuffle_buffer_rows,
            rank=rank,
            world_size=world,
            num_workers=d.num_workers,
            prefetch_batches=d.prefetch_batches,
        )

    train_data = reader("train", train=True)
    check_batch_fits(d.batch_size, train_data, f"the train split of {meta.root}")
    trainer = Trainer(
        task,
        dmp,
        optimizer,
        train_data,
        reader("valid", train=False),
        RunDir(out_dir),
        _trainer_options(cfg, progress),
        dataset_name=meta.name,
        extra_summary=_oracle(meta.extra, oracle_key),
        lr_scheduler=dense_lr_schedule(dense, cfg.optim, _total_steps(cfg.train, len(train_data))),
    )
    test = reader("test", train=False) if "test" in meta.split_files else None
    return Run(trainer=trainer, meta=meta, test_data=test,
               eval_reader=lambda split: reader(split, train=False))


def check_batch_fits(global_batch: int, train_data: Any, what: str) -> None:
    """A global batch larger than the training split is a config mistake (a run of 0 or 1 steps)."""
    rows = train_data.total_rows
    if global_batch > rows:
        raise ValueError(f"data.batch_size: {global_batch:,} (the global batch) is larger than "
                         f"{what} ({rows:,} rows); lower data.batch_size")
    if len(train_data) == 0:  # drop_last with fewer rows per rank than a local batch
        raise ValueError(f"data.batch_size: {global_batch:,} leaves no full batch of {what} "
                         f"({rows:,} rows) with data.drop_last: true")


def _oracle(extra: dict[str, Any], key: str) -> dict[str, Any]:
    oracle = extra.get(key, {})
    return {key: oracle["test"]} if isinstance(oracle, dict) and "test" in oracle else {}


def _trainer_options(cfg: Config, progress: Optional[bool]) -> TrainerOptions:
    t = cfg.train
    return TrainerOptions(
        epochs=t.epochs,
        max_steps=t.max_steps,
        eval_every=t.eval_every,
        eval_max_batches=t.eval_max_batches,
        checkpoint_every=t.checkpoint_every,
        keep_checkpoints=t.keep_checkpoints,
        progress=t.progress if progress is None else progress,
        grad_accumulation=t.grad_accumulation,
        bf16_dense=t.bf16_dense,
    )


def _build_gnn_run(cfg: Config, out_dir, progress, cluster, rank, world, device, local_batch,
                   local_eval_batch, plan_dir) -> Run:
    """Node classification / link prediction on a graph data set (``embedtrain datagen graph``)."""
    from embedtrain.train import gnn_recipe

    graph = gnn_recipe.load_gnn_graph(cfg)
    model = gnn_recipe.gnn_model(cfg, graph, device=torch.device("meta"))
    fuse_sparse_optimizer(model, cfg.optim.sparse, cfg.optim.sparse_lr)
    dmp = shard_model(cfg, model, cluster, device, plan_dir)
    register_dense_allreduce(dmp, cfg.sharding.dense_allreduce, cfg.sharding.powersgd_rank)
    optimizer, dense = combined_optimizer(dmp, cfg.optim)

    def data(split: str, train: bool):
        return gnn_recipe.gnn_data(cfg, graph, split, train,
                                   local_batch if train else local_eval_batch, rank, world)

    train_data = data("train", True)
    check_batch_fits(cfg.data.batch_size, train_data, f"the train split of {graph.root}")
    trainer = Trainer(
        gnn_recipe.gnn_task(cfg, graph), dmp, optimizer, train_data, data("valid", False),
        RunDir(out_dir), _trainer_options(cfg, progress), dataset_name=graph.name,
        extra_summary=gnn_recipe.gnn_summary_extra(graph),
        lr_scheduler=dense_lr_schedule(dense, cfg.optim, _total_steps(cfg.train, len(train_data))),
    )
    test = data("test", False) if "test" in graph.splits else None
    return Run(trainer=trainer, meta=graph, test_data=test,
               eval_reader=lambda split: data(split, False))


def _xc_model(cfg: Config, meta: DatasetMeta, cluster: ClusterConfig, device: torch.device,
              out_dir: Optional[str | os.PathLike]):
    """The sharded XC model, its optimizers (fused sparse + dense [+ head]) and task."""
    _check_xc_data(cfg, meta)
    h, num_classes, dim = cfg.xc.head, meta.features.num_classes, cfg.xc.mlp[-1]
    sharded = h.kind in SHARDED_HEADS
    counts = None
    if h.kind is HeadKind.ADAPTIVE:
        counts = torch.from_numpy(class_counts(meta))
    # The head's collectives get their own process group, so they never interleave with DDP's
    # bucket all-reduces or the tables' all-to-alls on the default one.
    group = dist.new_group(list(range(dist.get_world_size()))) if sharded else None
    head = build_head(h, num_classes, dim, group=group, class_counts=counts, seed=cfg.train.seed)
    if not sharded:
        head = head.to(device)
    model = XCModel(meta.features, cfg.xc, head, device=torch.device("meta"))
    fuse_sparse_optimizer(model.encoder, cfg.optim.sparse, cfg.optim.sparse_lr)
    head_opt = None
    if sharded:
        head_opt = sharded_head_optimizer(head, h, prefix="head.")
    dmp = shard_model(cfg, model, cluster, device, out_dir,
                      planning_model=model_for_planning(cfg, meta),
                      sharded_head=head if sharded else None, head_optimizer=head_opt)
    register_dense_allreduce(dmp, cfg.sharding.dense_allreduce, cfg.sharding.powersgd_rank)
    exclude = {f"head.{n}" for n, _ in head.named_parameters()} if sharded else set()
    optimizer, dense = combined_optimizer(dmp, cfg.optim, exclude=exclude,
                                          extra=[("head", head_opt)] if head_opt else [])
    return dmp, optimizer, dense, XCTask(cfg.xc.top_k)


def _total_steps(t, batches_per_epoch: int) -> int:
    steps = t.epochs * batches_per_epoch
    return min(t.max_steps or steps, steps)
