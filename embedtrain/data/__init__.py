"""Data: parquet readers producing TorchRec batches, and synthetic data generators."""

from embedtrain.data.reader import DataError, ParquetBatchReader

__all__ = ["DataError", "ParquetBatchReader"]
