"""Data: the streaming parquet loader producing TorchRec batches (synthetic data sets:
:mod:`embedtrain.datagen`)."""

from embedtrain.data.reader import DataError, LastBatch, ParquetBatchReader

__all__ = ["DataError", "LastBatch", "ParquetBatchReader"]
