"""Data: the streaming parquet loader producing TorchRec batches, and synthetic data generators."""

from embedtrain.data.reader import DataError, LastBatch, ParquetBatchReader

__all__ = ["DataError", "LastBatch", "ParquetBatchReader"]
