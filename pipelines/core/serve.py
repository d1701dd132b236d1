"""What the families' serving modules share (``pipelines.<family>.serve``: raw rows encoded by a
data set's own ingestion for ``embedtrain predict --raw``): cutting a parsed file's valid rows
into batches of an exact size, and keeping account of the rows that are not scored.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import polars as pl
import pyarrow as pa

from pipelines.core.inputs import ROW
from pipelines.core.report import DROP


def valid_batches(frame: pl.LazyFrame, batch_size: int,
                  record: Callable[[pl.DataFrame], None],
                  stop: Optional[Callable[[pl.DataFrame], None]] = None) -> Iterator[pa.Table]:
    """The rows of one file's ``frame`` (``__row``, ``__drop``, the encoded columns) whose
    ``__drop`` is null, streamed, in batches of exactly ``batch_size`` (fewer at the end),
    without those two columns. The other rows (``__row``, ``__drop``) go to ``stop`` as each
    streamed chunk shows them (``on_invalid: error``: it raises), and all of them to ``record``
    once the file is read."""
    pending: list[pl.DataFrame] = []
    invalid: list[pl.DataFrame] = []
    held = 0
    for chunk in frame.collect_batches(chunk_size=batch_size, engine="streaming"):
        bad = chunk.filter(pl.col(DROP).is_not_null())
        if bad.height:
            if stop is not None:
                stop(bad)
            invalid.append(bad.select(ROW, DROP))
        valid = chunk.filter(pl.col(DROP).is_null()).drop(ROW, DROP)
        pending.append(valid)
        held += valid.height
        while held >= batch_size:
            rows = pl.concat(pending)
            yield rows.head(batch_size).to_arrow()
            pending, held = [rows.slice(batch_size)], held - batch_size
    if held:
        yield pl.concat(pending).to_arrow()
    if invalid:
        record(pl.concat(invalid))


class InvalidRows:
    """The rows a serving job did not score: ``counts`` by (reason, column), and ``tables``
    listing each (file, row, line, reason, column)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.tables: list[pl.DataFrame] = []

    def add(self, path: Path, rows: Sequence[int], lines: Sequence[Optional[int]],
            why: Sequence[tuple[str, str]]) -> None:
        """Rows of ``path`` (0-based; ``lines`` 1-based, None for parquet) and their
        (reason, column)."""
        self.counts.update(why)
        self.tables.append(pl.DataFrame({
            "file": [str(path)] * len(rows), "row": pl.Series(rows, dtype=pl.Int64),
            "line": pl.Series(lines, dtype=pl.Int64), "reason": [w[0] for w in why],
            "column": [w[1] for w in why]}))
