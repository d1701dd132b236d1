"""Raw rows at serving time: new rows in a data set's raw layout (Criteo TSV, CSV, parquet)
encoded by that data set's own ingestion, for ``embedtrain predict --raw``.

The spec (resolved), vocabularies, standardisation constants and bucket boundaries are the data
set's: its ``metadata.json`` and ``vocab/`` files, which ``embedtrain export`` copies into an
export. The rows then go through the very functions the job's write pass runs --
:func:`~pipelines.tabular.read.check_inputs`, :func:`~pipelines.tabular.read.scan_inputs`,
:func:`~pipelines.tabular.transforms.parse` and
:func:`~pipelines.tabular.transforms.feature_columns` (fill, clip, log1p, standardise;
vocabulary, hash, raw and bucket ids) -- so that a row scores exactly as it would once ingested
(no second implementation to drift: training-serving skew). What serving does differently is
only what it has no use for:

- no split: every row is scored;
- no label needed: a label column, where the input has one, is carried along (parsed as
  ingestion parses it, null where it is outside ``label_range``) for metrics, never a reason to
  skip a row;
- a row ingestion would drop (a Criteo line without 40 fields, an unparsable number, a raw id
  out of range, ...; :class:`~pipelines.tabular.transforms.DropReason`) or stop the job on (a
  NaN/inf dense value with ``non_finite: error``: reason ``non_finite_value``) is *invalid*:
  not scored, counted by reason and column, and listed with its file and line
  (:attr:`RawRows.skipped`, a :class:`pipelines.core.serve.InvalidRows`); with
  ``on_invalid="error"`` the first one stops, in one line.

Rows come out in batches of exactly ``batch_size`` valid rows (fewer at a file's end), in input
order, as Arrow tables in the data set's layout (dense float32, sparse int64 or list<int64>,
the label as float32 where the input has it), plus the ``keep`` columns as the input holds
them, named ``KEEP_PREFIX + name``.

Example:
    >>> rows = RawRows(json.load(open("exports/demo/dataset_metadata.json")), "exports/demo",
    ...                ["logs/today.tsv"])  # doctest: +SKIP
    >>> for path, table in rows.batches(8192): ...  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Iterator, Optional, Sequence

import polars as pl
import pyarrow as pa

from embedtrain.config_io import ConfigError, from_dict
from pipelines.core.encode import Vocabulary
from pipelines.core.errors import IngestError
from pipelines.core.fields import Encoding, InputFormat, NonFinite
from pipelines.core.inputs import KEEP_PREFIX, ROW, csv_lines, parquet_types, resolve_inputs
from pipelines.core.report import DROP
from pipelines.core.serve import InvalidRows, valid_batches
from pipelines.tabular.read import check_inputs, describe_row, reading, scan_inputs
from pipelines.tabular.spec import IngestSpec, OnInvalid, SplitSpec
from pipelines.tabular.transforms import (DropReason, feature_columns, label_in_range, number,
                                          parse)

NON_FINITE = "non_finite_value"


class RawRows:
    """A data set's ingestion, fitted, applied to raw input files.

    Args:
        meta: the data set's ``metadata.json`` (tabular).
        root: where its ``vocab_files`` lie (the data set, or an export of a run on it).
        inputs: raw files, directories or globs in the spec's input format.
        keep: input columns to carry to the output (an id to join the scores on).
        on_invalid: ``drop`` (skip and count invalid rows) or ``error`` (stop at the first).

    Raises:
        IngestError: an input that cannot be read as the data set's raw layout (a missing
            column, a wrong type), a keep column that is not in it; one line naming the file.
    """

    def __init__(self, meta: dict, root: str | Path, inputs: Sequence[str],
                 keep: Sequence[str] = (), on_invalid: str = "drop") -> None:
        self.root = Path(root)
        try:
            spec = from_dict(IngestSpec, meta["spec"], "metadata.json: spec")
        except (ConfigError, KeyError, TypeError) as e:
            raise IngestError(f"{self.root}: the data set's ingestion spec cannot be read "
                              f"({e}); was it ingested by embedtrain ingest?") from None
        # no split (nothing to read for one); invalid rows by the caller's choice
        self.spec = dataclasses.replace(spec, split=SplitSpec(), on_invalid=OnInvalid(on_invalid))
        self.files = resolve_inputs(inputs, self.spec)
        self.keep = tuple(keep)
        if self.spec.label in self.keep:
            raise IngestError(f"--keep {self.spec.label}: the label is kept where the input has "
                              "it")
        self.label = self._has_label(self.files[0])
        self.label_type = pa.float32() if self.label else None  # of the label column
        check_inputs(self.files, self.spec, self.label, self.keep)
        self.vocabs = {name: _vocabulary(self.root / path, name)
                       for name, path in (meta.get("vocab_files") or {}).items()}
        self.dense_stats = meta.get("dense_stats") or {}
        self.boundaries = meta.get("bucket_boundaries") or {}
        missing = [s.name for s in self.spec.sparse if s.encoding is Encoding.VOCAB
                   and not s.bucketized and s.name not in self.vocabs]
        if missing:
            raise IngestError(f"{self.root}: no vocabulary for {', '.join(missing)} in "
                              "metadata.json's vocab_files")
        self.skipped = InvalidRows()  # not scored: counted, listed

    @property
    def total(self) -> Optional[int]:
        """Rows of the inputs where their footers say (parquet), else None."""
        if self.spec.input.format is not InputFormat.PARQUET:
            return None
        import pyarrow.parquet as pq

        return sum(pq.read_metadata(f).num_rows for f in self.files)

    def _has_label(self, path: Path) -> bool:
        if self.spec.input.format is InputFormat.CRITEO_TSV:
            return True  # the first of the format's 40 fields, empty where unknown
        if self.spec.input.format is InputFormat.PARQUET:
            return self.spec.label in parquet_types(path, [])
        with open(path, encoding="utf-8", errors="replace") as f:
            header = f.readline().rstrip("\r\n").split(self.spec.input.separator or ",")
        return self.spec.label in [h.strip().strip('"') for h in header]

    def _frame(self, path: Path) -> tuple[pl.LazyFrame, list[DropReason]]:
        """A file's rows: ``__row``, ``__drop`` (invalid: a reason's code), the encoded
        columns (and the label, the kept columns)."""
        spec = self.spec
        raw = scan_inputs([path], spec, label=self.label, keep=self.keep)
        raw = raw.with_columns(pl.col(c).alias(KEEP_PREFIX + c) for c in self.keep)
        frame, reasons = parse(raw, spec, checks=True, label=False)
        for d in spec.dense:  # what stops an ingestion job makes a served row invalid
            if d.non_finite is NonFinite.ERROR:
                x = pl.col(d.name)
                frame = frame.with_columns(pl.when(pl.col(DROP).is_null() & ~x.is_finite())
                                           .then(pl.lit(len(reasons), pl.UInt16))
                                           .otherwise(pl.col(DROP)).alias(DROP))
                reasons.append(DropReason(NON_FINITE, d.name))
        columns = feature_columns(spec, self.vocabs, self.dense_stats, self.boundaries)
        if self.label:
            y = number(spec.label, spec.is_text)
            columns.insert(0, pl.when(label_in_range(spec, y)).then(y).cast(pl.Float32)
                           .alias(spec.label))
        return frame.select(ROW, DROP, *columns, *(KEEP_PREFIX + c for c in self.keep)), reasons

    def batches(self, batch_size: int) -> Iterator[tuple[Path, pa.Table]]:
        """``(file, rows)``: each file's valid rows, encoded, ``batch_size`` at a time."""
        for path in self.files:
            if self.spec.is_text and not path.stat().st_size:
                continue  # a 0-byte text file: no rows (and a scan of it alone fails)
            frame, reasons = self._frame(path)
            stop = (functools.partial(self._raise, path, reasons=reasons)
                    if self.spec.on_invalid is OnInvalid.ERROR else None)
            with reading([path], self.spec):
                for table in valid_batches(frame, batch_size,
                                           functools.partial(self._count, path, reasons=reasons),
                                           stop):
                    yield path, table

    def _count(self, path: Path, bad: pl.DataFrame, reasons: list[DropReason]) -> None:
        rows = bad[ROW].to_list()
        if self.spec.input.format is InputFormat.CSV:
            found = csv_lines(path, self.spec.input.separator, rows)
            lines = [found[r] for r in rows]
        elif self.spec.input.format is InputFormat.CRITEO_TSV:
            lines = [r + 1 for r in rows]
        else:
            lines = [None] * len(rows)
        self.skipped.add(path, rows, lines,
                         [(reasons[c].reason, reasons[c].column) for c in bad[DROP].to_list()])

    def _raise(self, path: Path, invalid: pl.DataFrame, reasons: list[DropReason]) -> None:
        row, r = int(invalid[ROW][0]), reasons[int(invalid[DROP][0])]
        value = ""
        if r.column in scan_inputs([path], self.spec, label=self.label).collect_schema():
            v = (scan_inputs([path], self.spec, label=self.label).filter(pl.col(ROW) == row)
                 .select(r.column).collect(engine="streaming").item())
            value = f" (value {v.to_list() if isinstance(v, pl.Series) else v!r})"
        raise IngestError(f"{path}: {describe_row(self.spec, row, path)}: column {r.column}: "
                          f"{r.reason.replace('_', ' ')}{value}; --on-invalid drop would skip "
                          "and count such rows")


def _vocabulary(path: Path, name: str) -> Vocabulary:
    """A feature's vocabulary from its ``vocab/<feature>.parquet`` (value, id, count)."""
    try:
        table = pl.read_parquet(path, columns=["value", "id"]).sort("id")
    except (OSError, pl.exceptions.PolarsError) as e:
        raise IngestError(f"{path}: feature {name}'s vocabulary cannot be read: "
                          f"{str(e).splitlines()[0]}") from None
    if not table["id"].equals(pl.Series("id", range(1, table.height + 1), dtype=pl.Int64)):
        raise IngestError(f"{path}: feature {name}'s vocabulary ids are not 1..{table.height}")
    return Vocabulary(table["value"])
