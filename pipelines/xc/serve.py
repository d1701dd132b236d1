"""Raw rows at serving time: new rows in an XC data set's raw layout (Extreme Classification
Repository text, parquet, CSV) encoded by that data set's own ingestion, for
``embedtrain predict --raw``.

The spec (resolved), the token and label vocabularies and the dense standardisation constants
are the data set's: its ``metadata.json`` and ``vocab/`` files, which ``embedtrain export``
copies into an export. The rows then go through the very functions the job's write pass runs --
:func:`~pipelines.xc.read.check_xc_inputs`, :func:`~pipelines.xc.read.parse_xc` (the same drop
reasons), :func:`~pipelines.xc.passes.with_label_ids` (labels through the label vocabulary),
:func:`~pipelines.xc.passes.token_feature` (truncation, the token table's size) and
:func:`~pipelines.xc.passes.output_columns` (the token ids, dense values, the label column) --
so that a row scores exactly as it would once ingested (no second implementation to drift:
training-serving skew). What serving does differently is only what it has no use for:

- no split: every row is scored;
- no label needed: a row without a label, or whose labels are all outside the label vocabulary,
  is scored (ingestion drops it: ``no_label``); the label column holds the row's kept class ids
  for metrics, null where none is left (a parquet/CSV input without the label column gives no
  label column);
- an ``xc_repository`` file's header does not set the ranges: feature and label ids are checked
  against the training data's (the token table's ``num_embeddings - 1`` features,
  ``num_classes`` labels), and a header declaring more than those is refused;
- any other row ingestion would drop (an unparsable label, a feature without ``:``, an id out of
  range, an unparsable dense value; :data:`~pipelines.xc.read.REPOSITORY_REASONS`) or stop the
  job on (a NaN/inf dense value with ``non_finite: error``: reason ``non_finite_value``) is
  *invalid*: not scored, counted by reason and column (for repository lines: ``line``,
  ``labels`` or ``features``), and listed with its file and line (:attr:`RawRows.skipped`);
  with ``on_invalid="error"`` the first one stops, in one line.

Rows come out in batches of exactly ``batch_size`` valid rows (fewer at a file's end), in input
order, as Arrow tables in the data set's layout (the label ``list<int64>`` or ``int64``, dense
float32, the tokens ``list<int64>``), plus the ``keep`` columns (tables only) as the input holds
them, named ``KEEP_PREFIX + name``.

Example:
    >>> rows = RawRows(json.load(open("exports/xc/dataset_metadata.json")), "exports/xc",
    ...                ["eurlex/new.txt"])  # doctest: +SKIP
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
from pipelines.core.fields import Encoding, NonFinite
from pipelines.core.inputs import KEEP_PREFIX, ROW, check_csv_header, csv_lines, parquet_types
from pipelines.core.report import DROP
from pipelines.core.serve import InvalidRows, valid_batches
from pipelines.xc.passes import LABEL_IDS, output_columns, reading, token_feature, with_label_ids
from pipelines.xc.read import (
    DropReason, RepositoryHeader, XCLayout, check_xc_inputs, parse_xc,
    resolve_xc_inputs, scan_xc)
from pipelines.xc.report import label_name
from pipelines.xc.spec import XCFormat, XCIngestSpec, XCSplitSpec, validate_xc_spec

NON_FINITE = "non_finite_value"
__all__ = ["KEEP_PREFIX", "NON_FINITE", "RawRows"]


class RawRows:
    """An XC data set's ingestion, fitted, applied to raw input files.

    Args:
        meta: the data set's ``metadata.json`` (``task: xc``, made by ``embedtrain ingest``).
        root: where its ``vocab_files`` lie (the data set, or an export of a run on it).
        inputs: raw files, directories or globs in the spec's input format.
        keep: input columns to carry to the output (an id to join the scores on; parquet and
            CSV inputs: repository lines have no columns).
        on_invalid: ``drop`` (skip and count invalid rows) or ``error`` (stop at the first).

    Raises:
        IngestError: an input that cannot be read as the data set's raw layout (a bad header,
            a missing column, a wrong type), a repository header declaring more features or
            labels than training had, a keep column that is not in it; one line naming the file.
    """

    def __init__(self, meta: dict, root: str | Path, inputs: Sequence[str],
                 keep: Sequence[str] = (), on_invalid: str = "drop") -> None:
        self.root = Path(root)
        try:
            spec = from_dict(XCIngestSpec, meta["spec"], "metadata.json: spec")
            validate_xc_spec(spec, "metadata.json: spec")
            label, token_column = meta["label"], meta["token_column"]
            table = next(s for s in meta["sparse"] if s["name"] == token_column)
            self.num_features, self.num_classes = table["num_embeddings"] - 1, meta["num_classes"]
        except (ConfigError, KeyError, TypeError, StopIteration) as e:
            raise IngestError(f"{self.root}: the data set's XC ingestion spec cannot be read "
                              f"({e}); was it ingested by embedtrain ingest?") from None
        if on_invalid not in ("drop", "error"):
            raise IngestError(f"--on-invalid {on_invalid}: expected drop or error")
        self.on_invalid = on_invalid
        self.spec = dataclasses.replace(spec, split=XCSplitSpec())  # no split: nothing to read
        self.keep = tuple(keep)
        if self.keep and spec.repository:
            raise IngestError(f"--keep {self.keep[0]}: xc_repository lines have no columns to "
                              "keep (the output rows follow the valid input lines in order)")
        if label in self.keep:
            raise IngestError(f"--keep {label}: the label is kept where the input has it")
        self.files = resolve_xc_inputs([str(i) for i in inputs], self.spec)
        self.label = self._has_label(self.files[0])
        layout = check_xc_inputs(self.files, self.spec, self.label, self.keep)
        self.layout = self._training_layout(layout, bool(meta.get("multi_label", True)))
        if label_name(self.spec, self.layout) != label:
            raise IngestError(f"{self.files[0]}: the rows' label column would be "
                              f"{label_name(self.spec, self.layout)}, the data set's is {label}")
        self.label_type = (None if not self.label else
                           pa.list_(pa.int64()) if self.layout.multi_label else pa.int64())
        self.token = token_feature(self.spec, self.layout)
        vocab_files = meta.get("vocab_files") or {}
        self.token_vocab = self.label_vocab = None
        if self.spec.token_encoding is Encoding.VOCAB:
            self.token_vocab = self._vocabulary(vocab_files, token_column, first=1)
        if self.spec.label_encoding is Encoding.VOCAB:
            self.label_vocab = self._vocabulary(vocab_files, label, first=0)
            if len(self.label_vocab) != self.num_classes:
                raise IngestError(f"{self.root / vocab_files[label]}: {len(self.label_vocab):,} "
                                  f"labels, the data set has {self.num_classes:,} classes")
        self.dense_stats = meta.get("dense_stats") or {}
        missing = [d.name for d in self.spec.dense if d.name not in self.dense_stats]
        if missing:
            raise IngestError(f"{self.root}: no dense_stats for {', '.join(missing)} in "
                              "metadata.json")
        self.skipped = InvalidRows()  # not scored: counted, listed

    @property
    def total(self) -> Optional[int]:
        """Rows of the inputs where their footers say (parquet), else None (a repository
        header's row count is the file's word, not a count)."""
        if self.spec.input.format is not XCFormat.PARQUET:
            return None
        import pyarrow.parquet as pq

        return sum(pq.read_metadata(f).num_rows for f in self.files)

    def _has_label(self, path: Path) -> bool:
        source = self.spec.labels.source
        if self.spec.repository:
            return True  # each line's first field (possibly empty)
        if self.spec.input.format is XCFormat.PARQUET:
            return source in parquet_types(path, [])
        return source in (check_csv_header(path, self.spec.input.separator, []) or [])

    def _training_layout(self, layout: XCLayout, multi_label: bool) -> XCLayout:
        """The inputs' layout with the training data's id ranges (repository headers) and
        label kind (inputs without labels)."""
        if self.spec.repository:
            f, c = self.num_features, self.num_classes
            for path, h in layout.headers.items():
                if h.features > f or h.labels > c:
                    raise IngestError(f"{path}: line 1: the header gives {h.features:,} features "
                                      f"and {h.labels:,} labels, the model was trained on "
                                      f"{f:,} and {c:,}; ids beyond those have no embedding or "
                                      "class")
            return dataclasses.replace(layout, headers={
                path: RepositoryHeader(h.rows, f, c) for path, h in layout.headers.items()})
        if not self.label:
            return dataclasses.replace(layout, multi_label=multi_label)
        if layout.multi_label != multi_label:
            kind = {True: "a list of labels", False: "one label"}
            raise IngestError(f"{self.files[0]}: column {self.spec.labels.source}: "
                              f"{kind[layout.multi_label]} per row, the data set has "
                              f"{kind[multi_label]}")
        return layout

    def _vocabulary(self, files: dict, name: str, first: int) -> Vocabulary:
        """A vocabulary from its ``vocab/<column>.parquet`` (value, id, count): tokens have
        ids ``1..V``, classes ``0..C-1``."""
        if name not in files:
            raise IngestError(f"{self.root}: no vocabulary for {name} in metadata.json's "
                              "vocab_files")
        path = self.root / files[name]
        try:
            table = pl.read_parquet(path, columns=["value", "id"]).sort("id")
        except (OSError, pl.exceptions.PolarsError) as e:
            raise IngestError(f"{path}: {name}'s vocabulary cannot be read: "
                              f"{str(e).splitlines()[0]}") from None
        ids = pl.Series("id", range(first, first + table.height), dtype=pl.Int64)
        if not table["id"].equals(ids):
            raise IngestError(f"{path}: {name}'s vocabulary ids are not {first}.."
                              f"{first + table.height - 1}")
        return Vocabulary(table["value"])

    def _frame(self, path: Path) -> tuple[pl.LazyFrame, list[DropReason]]:
        """A file's rows: ``__row``, ``__drop`` (invalid: a reason's code), the encoded
        columns (and the kept columns)."""
        spec = self.spec
        first = {str(path): 0} if spec.repository else None  # the header line
        frame, reasons = parse_xc([path], spec, self.layout, first, label=self.label,
                                  keep=self.keep)
        for d in spec.dense:  # what stops an ingestion job makes a served row invalid
            if d.non_finite is NonFinite.ERROR:
                x = pl.col(d.name)
                frame = frame.with_columns(
                    pl.when(pl.col(DROP).is_null() & (x.is_nan() | x.is_infinite()))
                    .then(pl.lit(len(reasons), pl.UInt16)).otherwise(pl.col(DROP)).alias(DROP))
                reasons.append(DropReason(NON_FINITE, d.name))
        # labels as ingestion keeps them; a row left without one is scored (label null)
        no_label = len(reasons)
        frame = with_label_ids(frame, self.label_vocab, no_label)
        ids = pl.col(LABEL_IDS)
        frame = frame.with_columns(
            pl.when(pl.col(DROP) != no_label).then(pl.col(DROP)).alias(DROP),
            pl.when(ids.list.len() > 0).then(ids).alias(LABEL_IDS))
        columns = output_columns(spec, self.layout, self.token, self.token_vocab,
                                 self.dense_stats)
        if not self.label:
            columns = columns[1:]  # the label column comes first
        return frame.select(ROW, DROP, *columns, *(KEEP_PREFIX + c for c in self.keep)), reasons

    def batches(self, batch_size: int) -> Iterator[tuple[Path, pa.Table]]:
        """``(file, rows)``: each file's valid rows, encoded, ``batch_size`` at a time."""
        for path in self.files:
            frame, reasons = self._frame(path)
            stop = (functools.partial(self._raise, path, reasons=reasons)
                    if self.on_invalid == "error" else None)
            with reading([path], self.spec):
                for table in valid_batches(frame, batch_size,
                                           functools.partial(self._count, path, reasons=reasons),
                                           stop):
                    yield path, table

    def _lines(self, path: Path, rows: list[int]) -> tuple[list[int], list[Optional[int]]]:
        """The 0-based data rows and 1-based lines (None for parquet) of ``__row`` values."""
        if self.spec.repository:  # __row is the line's index, the header's 0
            return [r - 1 for r in rows], [r + 1 for r in rows]
        if self.spec.input.format is XCFormat.CSV:
            found = csv_lines(path, self.spec.input.separator, rows)
            return rows, [found[r] for r in rows]
        return rows, [None] * len(rows)

    def _count(self, path: Path, bad: pl.DataFrame, reasons: list[DropReason]) -> None:
        rows, lines = self._lines(path, bad[ROW].to_list())
        self.skipped.add(path, rows, lines,
                         [(reasons[c].reason, reasons[c].column) for c in bad[DROP].to_list()])

    def _raise(self, path: Path, invalid: pl.DataFrame, reasons: list[DropReason]) -> None:
        row, r = int(invalid[ROW][0]), reasons[int(invalid[DROP][0])]
        (data_row,), (line,) = self._lines(path, [row])
        where = f"row {data_row}" if line is None else f"line {line}"
        column = "line" if self.spec.repository else r.column
        scan = scan_xc([path], self.spec, label=self.label)
        value = scan.filter(pl.col(ROW) == row).select(column).collect(engine="streaming").item()
        if isinstance(value, str) and len(value) > 60:
            value = value[:57] + "..."
        field = "" if self.spec.repository else f"column {r.column}: "
        what = "line" if self.spec.repository else "value"
        raise IngestError(f"{path}: {where}: {field}{r.reason.replace('_', ' ')} ({what} "
                          f"{value.to_list() if isinstance(value, pl.Series) else value!r}); "
                          "--on-invalid drop would skip and count such rows")
