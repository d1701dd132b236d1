"""Wiring: a resolved :class:`~embedtrain.config.Config` into a ready :class:`Trainer`.

This is the only place where config sections meet library objects: the data set's metadata sizes
the tables, the model is built on ``meta`` and handed to ``DistributedModelParallel`` (a world of
one on a laptop, many ranks under ``torchrun``), the sparse optimizer is fused into the tables'
backward and the dense one wraps the rest.

Example:
    >>> cfg = load_config("configs/dlrm_synthetic.yaml")
    >>> run = build_ctr_run(cfg, "runs/demo")
    >>> summary = run.trainer.fit(test_data=run.test_data)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel

from embedtrain.config import ClusterConfig, Config, Interaction
from embedtrain.data.reader import ParquetBatchReader
from embedtrain.data.stats import measure_pooling_factors
from embedtrain.features import DatasetMeta, load_dataset_meta
from embedtrain.models.dlrm import dcn, dlrm, table_name
from embedtrain.sharding.planner import PlanResult, plan_sharding
from embedtrain.train.ctr import CTRTask
from embedtrain.train.dist import init_process_group
from embedtrain.train.optim import (
    combined_optimizer,
    dense_optimizer_slots,
    fuse_sparse_optimizer,
)
from embedtrain.train.run_dir import RunDir
from embedtrain.train.trainer import Trainer, TrainerOptions


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


def plan_ctr(cfg: Config, cluster: ClusterConfig) -> PlanResult:
    """Dry-run plan of ``cfg``'s model on ``cluster``: built on ``meta``, no memory, no GPU.

    Pooling factors are measured from the training split when the data set has one and
    ``cfg.sharding.pooling_factors_from_data`` is set; otherwise every table counts 1 id.
    """
    meta = load_dataset_meta(cfg.data.path)
    model = ctr_model(cfg, meta, device=torch.device("meta"))
    fuse_sparse_optimizer(model, cfg.optim.sparse, cfg.optim.sparse_lr)
    measured = cfg.sharding.pooling_factors_from_data and bool(meta.split_files.get("train"))
    pooling = measure_pooling_factors(meta) if measured else {}
    result = plan_sharding(
        model,
        cluster,
        cfg.sharding,
        pooling_factors={table_name(f): v for f, v in pooling.items()},
        dense_optimizer_slots=dense_optimizer_slots(cfg.optim.dense),
    )
    result.report["model"] = {
        "task": cfg.task.value,
        "dataset": meta.name,
        "dataset_path": str(meta.root),
        "pooling_factors": "measured from the train split" if measured else "1.0 (no data)",
    }
    return result


def build_ctr_run(cfg: Config, out_dir: str | os.PathLike, progress: Optional[bool] = None) -> Run:
    """Builds the sharded model, optimizers, readers and trainer of a CTR run.

    Args:
        cfg: the resolved config.
        out_dir: the run directory.
        progress: overrides ``cfg.train.progress``.

    Returns:
        The run; call ``run.trainer.fit(test_data=run.test_data)``.
    """
    rank, world, device = init_process_group()
    torch.manual_seed(cfg.train.seed)
    meta = load_dataset_meta(cfg.data.path)
    model = ctr_model(cfg, meta, device=torch.device("meta"))
    fuse_sparse_optimizer(model, cfg.optim.sparse, cfg.optim.sparse_lr)
    dmp = DistributedModelParallel(model, device=device)
    optimizer = combined_optimizer(dmp, cfg.optim.dense, cfg.optim.dense_lr, cfg.optim.weight_decay)

    def reader(split: str, train: bool) -> ParquetBatchReader:
        return ParquetBatchReader(
            meta.files(split),
            meta.features,
            batch_size=cfg.data.batch_size if train else cfg.data.eval_batch_size,
            shuffle=cfg.data.shuffle and train,
            seed=cfg.train.seed,
            drop_last=cfg.data.drop_last and train,
            shuffle_buffer_rows=cfg.data.shuffle_buffer_rows,
            rank=rank,
            world_size=world,
            num_workers=cfg.data.num_workers,
            prefetch_batches=cfg.data.prefetch_batches,
        )

    t = cfg.train
    options = TrainerOptions(
        epochs=t.epochs,
        max_steps=t.max_steps,
        eval_every=t.eval_every,
        eval_max_batches=t.eval_max_batches,
        checkpoint_every=t.checkpoint_every,
        keep_checkpoints=t.keep_checkpoints,
        progress=t.progress if progress is None else progress,
    )
    extra: dict[str, Any] = {}
    oracle = meta.extra.get("oracle_auc", {})
    if isinstance(oracle, dict) and "test" in oracle:
        extra["oracle_auc"] = oracle["test"]
    trainer = Trainer(
        CTRTask(),
        dmp,
        optimizer,
        reader("train", train=True),
        reader("valid", train=False),
        RunDir(out_dir),
        options,
        dataset_name=meta.name,
        extra_summary=extra,
    )
    test = reader("test", train=False) if "test" in meta.split_files else None
    return Run(trainer=trainer, meta=meta, test_data=test,
               eval_reader=lambda split: reader(split, train=False))
