"""Statistics of a data set that planning and models need: pooling factors (mean ids per
example) and class frequencies.

Example:
    >>> meta = load_dataset_meta("data/synthetic_ctr")
    >>> measure_pooling_factors(meta)["C24"]
    2.49
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from embedtrain.data.reader import DataError
from embedtrain.features import METADATA_FILE, DatasetError, DatasetMeta


def _unreadable(path, e: BaseException) -> DataError:
    text = str(e).strip().splitlines()
    return DataError(f"{path}: not a readable parquet file (truncated or corrupt?): "
                     f"{text[0] if text else type(e).__name__}")


def _batches(path, batch_size: int, columns: list[str], lists: bool = False):
    """``path``'s record batches of ``columns``; an unreadable file, a missing column or (with
    ``lists``) one that is not a list is a DataError naming the file and column."""
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise _unreadable(path, e) from None
    schema = file.schema_arrow
    for name in columns:  # before reading: metadata.json's columns must be there (and lists)
        if name not in schema.names:
            raise DataError(f"{path}: column {name}: missing (metadata.json names it)")
        if lists and not (pa.types.is_list(schema.field(name).type)
                or pa.types.is_large_list(schema.field(name).type)):
            raise DataError(f"{path}: column {name}: {schema.field(name).type}, not a list "
                            f"(metadata.json says multi_hot: true)")
    try:
        yield from file.iter_batches(batch_size=batch_size, columns=columns)
    except (pa.ArrowException, OSError) as e:
        raise _unreadable(path, e) from None


def measure_pooling_factors(meta: DatasetMeta, split: str = "train",
                            max_rows: int = 200_000) -> dict[str, float]:
    """Mean number of ids per example of every sparse feature, from the first rows of ``split``.

    Single-valued features count 1.0 without reading; list features are measured over up to
    ``max_rows`` rows (a null list counts as empty).

    Returns:
        Feature name -> pooling factor; every sparse feature of ``meta`` is present.
    """
    factors = {f.name: 1.0 for f in meta.features.sparse}
    lists = [f.name for f in meta.features.sparse if f.multi_hot]
    if not lists or not meta.split_files.get(split):
        return factors
    totals = dict.fromkeys(lists, 0)
    rows = 0
    for path in meta.files(split):
        for batch in _batches(path, 65_536, lists, lists=True):
            take = min(batch.num_rows, max_rows - rows)
            batch = batch.slice(0, take)
            for name in lists:
                lengths = pc.fill_null(pc.list_value_length(batch.column(name)), 0)
                totals[name] += pc.sum(lengths).as_py() or 0
            rows += take
            if rows >= max_rows:
                break
        if rows >= max_rows:
            break
    if rows:
        factors.update({name: totals[name] / rows for name in lists})
    return factors


def class_counts(meta: DatasetMeta, split: str = "train",
                 columns: Optional[Sequence[str]] = None) -> np.ndarray:
    """How often each class id occurs in ``split``'s label column (``[num_classes]`` int64), or
    in ``columns`` together (id columns holding class ids, e.g. a sequence's history and target).

    For the train split of a data set whose ``metadata.json`` holds ``class_counts`` (written by
    ``embedtrain ingest`` with a ``kind: xc`` spec: the train split's count of every class, in
    class order) those are returned without reading a file; otherwise only the label column is
    read (a list column counts every label of a row). For adaptive softmax, which sorts classes
    by frequency.

    Raises:
        ValueError: not a classification data set, or a ``class_counts`` that is not
            ``num_classes`` non-negative integers (``metadata.json`` named).
    """
    features = meta.features
    if features.num_classes is None:
        raise ValueError(f"{meta.root}: not a classification data set (no num_classes)")
    stored = meta.extra.get("class_counts") if split == "train" and columns is None else None
    if stored is not None:
        if (not isinstance(stored, list) or len(stored) != features.num_classes
                or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                           for c in stored)):
            raise DatasetError(f"{meta.root / METADATA_FILE}: class_counts: expected "
                               f"{features.num_classes} non-negative integers (num_classes)")
        return np.asarray(stored, dtype=np.int64)
    counts = np.zeros(features.num_classes, np.int64)
    for path in meta.files(split):
        for batch in _batches(path, 262_144, list(columns or [features.label])):
            for column in batch.columns:
                if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
                    column = pc.list_flatten(column)
                ids = column.to_numpy(zero_copy_only=False)
                counts += np.bincount(ids[(ids >= 0) & (ids < len(counts))],
                                      minlength=len(counts))
    return counts
