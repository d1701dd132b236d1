"""The tabular families' data (CTR, XC, seq): a parquet data set and its streaming readers.

The data set's ``metadata.json`` sizes the tables (one per sparse feature); pooling factors for
the planner are measured from the training split; each split is read by the streaming
:class:`~embedtrain.data.reader.ParquetBatchReader`, every row once per epoch on any number of
ranks (the last step padded with marked rows where the ranks' shares differ). A recipe composes
it (``self.data = TabularData(cfg)``); :class:`~embedtrain.recipes.base.Recipe`'s data hooks ask it.
"""

from __future__ import annotations

import torch

from embedtrain.config import Config, dynamic_tables
from embedtrain.data.reader import LastBatch, ParquetBatchReader
from embedtrain.data.stats import measure_pooling_factors
from embedtrain.features import DatasetMeta, load_dataset_meta
from embedtrain.tables.dynamic import table_name
from embedtrain.models.options import DynamicTable
from embedtrain.recipes.base import DatasetInfo
from embedtrain.runtime import idle_read_ahead, loader_threads


class TabularData:
    """A parquet data set (``data.path``) and its readers, for a recipe to compose."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def load(self) -> DatasetMeta:
        """``data.path``'s ``metadata.json`` (or ``data.partitions`` of it)."""
        return load_dataset_meta(self.cfg.data.path, self.cfg.data.partitions)

    def info(self, meta: DatasetMeta) -> DatasetInfo:
        """The data set's splits that hold rows (an empty one is as good as none)."""
        splits = [s for s, files in meta.split_files.items()
                  if files and meta.split_rows.get(s, -1) != 0]
        return DatasetInfo(meta.name, meta.root, splits,
                           meta.root / meta.partitions[-1] if meta.partitions else None)

    def reader(self, meta: DatasetMeta, split: str, train: bool, batch_size: int, rank: int,
               world_size: int) -> ParquetBatchReader:
        """This rank's share of ``split``'s rows in batches of ``batch_size`` (shuffled for
        training, with ``train.seed``)."""
        d = self.cfg.data
        # Every row once per epoch, the same number of equal-sized batches on every rank: an
        # epoch's last step is padded (marked rows, left out of losses and metrics) where the
        # ranks' shares differ by a row. drop_last leaves the last partial step out (counted).
        last = (LastBatch.DROP if d.drop_last else LastBatch.PAD) if train else LastBatch.PAD
        threads = loader_threads(d.num_workers, torch.cuda.is_available(),
                                 torch.get_num_threads())
        return ParquetBatchReader(
            meta.files(split), meta.features, batch_size=batch_size,
            shuffle=d.shuffle and train, seed=self.cfg.train.seed, last_batch=last,
            shuffle_buffer_rows=d.shuffle_buffer_rows, rank=rank, world_size=world_size,
            num_workers=threads, prefetch_batches=d.prefetch_batches,
            read_ahead=idle_read_ahead(d.num_workers, threads))

    def dynamic_tables(self, meta: DatasetMeta) -> dict[str, DynamicTable]:
        """The ``tables`` entries' dynamic tables among the features' (``t_<feature>``)."""
        return dynamic_tables(self.cfg, [table_name(f.name) for f in meta.features.sparse])

    def _measured(self, meta: DatasetMeta) -> bool:
        return self.cfg.sharding.pooling_factors_from_data and bool(meta.split_files.get("train"))

    def pooling_factors(self, meta: DatasetMeta) -> dict[str, float]:
        """Mean ids per example of each table, measured from the train split (when
        ``sharding.pooling_factors_from_data`` and the split exists)."""
        if not self._measured(meta):
            return {}
        return {table_name(f): v for f, v in measure_pooling_factors(meta).items()}

    def pooling_note(self, meta: DatasetMeta) -> str:
        return "measured from the train split" if self._measured(meta) else "1.0 (no data)"
