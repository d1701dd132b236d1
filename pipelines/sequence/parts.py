"""The sequence job's part files: a split's rows (each a user's history window ``[lo, hi)`` of
its sorted events) written as ``<split>/part-NNNNN.parquet``, for both tasks."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# (the rows' slice of the split, their histories as a list array) -> the file's columns
Columns = Callable[[slice, pa.Array], dict[str, Any]]


def list_array(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    """list<int64> (int32 offsets; large_list past 2^31 values in one file)."""
    if offsets[-1] < 2**31:
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))


def write_parts(out: Path, split: str, rows: Any, starts: np.ndarray, items: np.ndarray,
                output: Any, columns: Columns) -> list[tuple[str, int]]:
    """``<split>/part-NNNNN.parquet`` files of at most ``output.rows_per_file`` rows (``rows``:
    ``user``, ``lo``, ``hi`` arrays; ``starts``: each user's first sorted event); returns (file
    relative to ``out``, rows). A split without rows writes no file."""
    (out / split).mkdir(parents=True, exist_ok=True)
    written = []
    per_file = output.rows_per_file
    for part, a in enumerate(range(0, len(rows.user), per_file)):
        b = min(a + per_file, len(rows.user))
        u, lo, hi = rows.user[a:b], rows.lo[a:b], rows.hi[a:b]
        lengths = hi - lo
        offsets = np.zeros(b - a + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        take = np.repeat(starts[u] + lo - offsets[:-1], lengths) + np.arange(offsets[-1])
        rel = f"{split}/part-{part:05d}.parquet"
        pq.write_table(pa.table(columns(slice(a, b), list_array(offsets, items[take]))),
                       out / rel, row_group_size=output.rows_per_row_group,
                       compression=output.compression)
        written.append((rel, b - a))
    return written
