"""Click-through rate: DLRM or DCNv2 on a tabular data set (``embedtrain datagen ctr`` / ``ingest``).

The data set's ``metadata.json`` sizes the tables (one per sparse feature); pooling factors for
the planner are measured from the training split; each split is read by the streaming
:class:`~embedtrain.data.reader.ParquetBatchReader`, every row once per epoch on any number of
ranks (the last step padded with marked rows where the ranks' shares differ).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from embedtrain.config import Interaction
from embedtrain.data.reader import LastBatch, ParquetBatchReader
from embedtrain.data.stats import measure_pooling_factors
from embedtrain.features import DatasetMeta, load_dataset_meta
from embedtrain.models.dlrm import dcn, dlrm, table_name
from embedtrain.recipes.base import DatasetInfo, Recipe, oracle_of
from embedtrain.train.ctr import CTRTask


class TabularRecipe(Recipe):
    """What the tabular families (CTR, XC) share: a parquet data set and its readers."""

    def load_dataset(self) -> DatasetMeta:
        return load_dataset_meta(self.cfg.data.path)

    def dataset_info(self) -> DatasetInfo:
        meta = self.dataset
        return DatasetInfo(meta.name, meta.root, list(meta.split_files), meta.extra)

    def reader(self, split: str, train: bool, batch_size: int, rank: int,
               world_size: int) -> ParquetBatchReader:
        d = self.cfg.data
        # Every row once per epoch, the same number of equal-sized batches on every rank: an
        # epoch's last step is padded (marked rows, left out of losses and metrics) where the
        # ranks' shares differ by a row. drop_last leaves the last partial step out (counted).
        last = (LastBatch.DROP if d.drop_last else LastBatch.PAD) if train else LastBatch.PAD
        return ParquetBatchReader(
            self.dataset.files(split), self.dataset.features, batch_size=batch_size,
            shuffle=d.shuffle and train, seed=self.cfg.train.seed, last_batch=last,
            shuffle_buffer_rows=d.shuffle_buffer_rows, rank=rank, world_size=world_size,
            num_workers=d.num_workers, prefetch_batches=d.prefetch_batches)

    def _measured_pooling(self) -> bool:
        return (self.cfg.sharding.pooling_factors_from_data
                and bool(self.dataset.split_files.get("train")))

    def pooling_factors(self) -> dict[str, float]:
        if not self._measured_pooling():
            return {}
        return {table_name(f): v for f, v in measure_pooling_factors(self.dataset).items()}

    def pooling_note(self) -> str:
        return "measured from the train split" if self._measured_pooling() else "1.0 (no data)"


class CTRRecipe(TabularRecipe):
    """``task: ctr``: DLRM (``model.interaction: dot``) or DCNv2 (``dcn``), binary cross-entropy."""

    oracle = ("oracle_auc", "oracle_auc", "AUC of the true click probability")
    printed_metrics = ("auc", "ne", "logloss", "calibration")

    def planning_model(self) -> nn.Module:
        m, features = self.cfg.model, self.dataset.features
        meta_device = torch.device("meta")
        if m.interaction is Interaction.DCN:
            model = dcn(features, m.embedding_dim, m.bottom_mlp, m.top_mlp, m.dcn_num_layers,
                        m.dcn_low_rank_dim, device=meta_device)
        else:
            model = dlrm(features, m.embedding_dim, m.bottom_mlp, m.top_mlp, device=meta_device)
        return self.fuse_sparse(model)

    def task(self) -> CTRTask:
        return CTRTask()

    def summary_extra(self) -> dict[str, Any]:
        return oracle_of(self.dataset.extra, "oracle_auc")
