"""The rows ``embedtrain predict`` scores (:mod:`embedtrain.export.predict`), batch by batch.

- :class:`ParquetRows`: parquet files in the data set's layout (e.g. its split files; the label
  optional), ``batch_size`` rows at a time;
- :class:`RawRows`: raw files as the data set was ingested from (``--raw``), encoded by that
  data set's own ingestion (:func:`pipelines.raw_rows`, from the export's copies of its
  ``metadata.json`` and vocabularies): rows it would drop are not scored, but counted by reason
  and listed (:func:`write_invalid`);
- :class:`PredictResult`: what :func:`~embedtrain.export.predict.predict` wrote;
- :func:`check_rows`: types, nulls and id ranges of a batch (the file, column and row of a bad
  value named); :func:`model_batch`: a batch as the training reader makes it.

Both sources yield ``(file, first row, rows, labels, kept columns)``: the rows an Arrow table in
the data set's layout, the labels cast to the output's label type (or None), the ``--keep``
columns as the input holds them.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Container, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from embedtrain.data.batching import Rows, SparseLayout, is_list_type, to_batch
from embedtrain.data.reader import DataError, first_non_finite
from embedtrain.export.manifest import ExportError
from embedtrain.features import FeatureSpec
from embedtrain.tables.dynamic import EMPTY_ID
from embedtrain.utils import natural_key, partial_output

RAW_ID_LIMIT = EMPTY_ID  # raw ids lie in [0, 2^63 - 1) (the top value marks a free row)


@dataclass
class PredictResult:
    """What :func:`~embedtrain.export.predict.predict` wrote: rows, time, metrics where the input has labels, and (raw
    inputs) the rows not scored."""

    out: Path
    rows: int
    files: int
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    invalid: dict[str, int] = field(default_factory=dict)  # raw rows not scored, by reason
    invalid_file: Optional[Path] = None  # where they are listed


def input_files(inputs: Sequence[str], suffixes: tuple[str, ...] = (".parquet",)
                ) -> list[Path]:
    """The data files of ``--input`` arguments: files, directories (their files ending in one of
    ``suffixes``, any case) or quoted globs, each sorted naturally, in the order given.

    Raises:
        FileNotFoundError: an argument that names no such file.
    """
    kinds = " or ".join(x.lstrip(".").upper() if x != ".parquet" else "parquet"
                        for x in suffixes)
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_file():
            found = [path]
        elif path.is_dir():
            found = sorted((p for p in path.rglob("*") if p.suffix.lower() in suffixes),
                           key=natural_key)
        else:
            found = sorted((Path(p) for p in glob.glob(item, recursive=True)
                            if Path(p).is_file()), key=natural_key)
        if not found:
            raise FileNotFoundError(f"--input {item}: no {kinds} file there")
        files.extend(f for f in found if f not in files)
    return files


class ParquetRows:
    """Parquet rows in the data set's layout, a file at a time, ``batch_size`` rows at once
    (the ids as the data holds them: a dynamic table's raw ids are mapped at lookup)."""

    # nothing is skipped: a bad value is an error (:func:`check_rows`)
    invalid: dict[str, int] = {}
    invalid_tables: list = []

    def __init__(self, files: list[Path], spec: FeatureSpec, keep: Sequence[str]) -> None:
        self.files, self.spec, self.keep = files, spec, list(keep)
        self.schemas = [_schema(f, spec, self.keep) for f in files]
        self.label_type = _label_type(files, self.schemas, spec)
        self.total = sum(pq.ParquetFile(f).metadata.num_rows for f in files)

    def batches(self, batch_size: int):
        """``(file, first row, features, labels, kept columns)`` of each batch."""
        spec = self.spec
        for path, schema in zip(self.files, self.schemas):
            has_label = spec.label in schema.names
            columns = list(dict.fromkeys([*spec.dense, *spec.sparse_names, *self.keep]
                                         + [spec.label] * has_label))
            first = 0
            try:
                source = pq.ParquetFile(path).iter_batches(batch_size=batch_size,
                                                           columns=columns)
                for record_batch in source:
                    table = pa.Table.from_batches([record_batch])
                    labels = None
                    if self.label_type is not None:
                        labels = (table.column(spec.label).combine_chunks().cast(self.label_type)
                                  if has_label else pa.nulls(table.num_rows, self.label_type))
                    yield path, first, table, labels, {c: table.column(c) for c in self.keep}
                    first += table.num_rows
            except pa.ArrowException as e:
                raise DataError(f"{path}: cannot read rows {first:,}..: {e}") from None


class RawRows:
    """Raw rows encoded by the data set's own ingestion (:func:`pipelines.raw_rows`)."""

    def __init__(self, root: Path, spec: FeatureSpec, inputs: Sequence[str],
                 keep: Sequence[str], on_invalid: str) -> None:
        import pipelines

        meta_file = root / "dataset_metadata.json"
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError) as e:
            raise ExportError(f"{meta_file}: cannot read the data set's metadata: {e}") from None
        self.rows = pipelines.raw_rows(meta, root, inputs, keep, on_invalid, meta_file)
        self.files, self.keep, self.spec = self.rows.files, list(keep), spec
        self.total = self.rows.total
        self.label_type = self.rows.label_type

    @property
    def invalid(self) -> dict:
        counts = self.rows.skipped.counts
        return {f"{reason} ({column})": n for (reason, column), n in counts.items()}

    def batches(self, batch_size: int):
        from pipelines import KEEP_PREFIX

        first = 0
        for path, table in self.rows.batches(batch_size):
            labels = (table.column(self.spec.label).combine_chunks().cast(self.label_type)
                      if self.label_type is not None else None)
            kept = {c: table.column(KEEP_PREFIX + c) for c in self.keep}
            yield path, first, table, labels, kept
            first += table.num_rows

    @property
    def invalid_tables(self) -> list:
        """The rows not scored: polars frames of file, row, line, reason, column."""
        return self.rows.skipped.tables


def describe_invalid(invalid: dict[str, int]) -> str:
    """``reason (column): N, ...`` of the rows not scored."""
    return ", ".join(f"{k}: {n:,}" for k, n in invalid.items()) or "none invalid"


def write_invalid(out: Path, tables: list) -> Optional[Path]:
    """The rows not scored (``tables``: file, row, line, reason, column) in
    ``<out>.invalid.parquet``, written whole or not at all (temp + rename); None when there are
    none, and then an earlier run's list beside ``out`` is removed (it described another
    ``out``)."""
    path = out.with_name(out.name.removesuffix(".parquet") + ".invalid.parquet")
    if not tables:
        path.unlink(missing_ok=True)
        return None
    import polars as pl

    with partial_output(path) as partial:  # removed on an error, a SIGTERM or SIGINT
        pl.concat(tables).write_parquet(partial)
        os.replace(partial, path)
    return path


@contextlib.contextmanager
def parquet_output(out: Path, empty: Callable[[], str]) -> Iterator[Callable[[pa.Table], None]]:
    """Writes the parquet file ``out`` whole or not at all (:func:`partial_output`: removed on
    an error, a SIGTERM or SIGINT; a full disk names ``out``): yields ``write(table)``; a body
    that writes nothing raises ``ValueError(empty())``."""
    with partial_output(out) as partial:
        writer: Optional[pq.ParquetWriter] = None

        def write(table: pa.Table) -> None:
            nonlocal writer
            if writer is None:
                writer = pq.ParquetWriter(partial, table.schema)
            writer.write_table(table)
        try:
            yield write
        finally:
            if writer is not None:
                writer.close()
        if writer is None:
            raise ValueError(empty())
        os.replace(partial, out)


def _schema(path: Path, spec: FeatureSpec, keep: Sequence[str] = ()) -> pa.Schema:
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file: {e}") from None
    missing = [c for c in (*spec.dense, *spec.sparse_names) if c not in schema.names]
    if missing:
        raise DataError(f"{path}: missing column(s): {', '.join(missing)} (the export's "
                        f"features: see model.json)")
    missing = [c for c in keep if c not in schema.names]
    if missing:
        raise DataError(f"{path}: --keep {missing[0]}: no such column (has: "
                        f"{', '.join(schema.names[:20])})")
    return schema


def _label_type(files: list[Path], schemas: list[pa.Schema], spec: FeatureSpec
                ) -> Optional[pa.DataType]:
    """The output's label type: float32 clicks, int64 class ids or lists of them; None where
    no input has the label (files without it get nulls)."""
    found = [(f, s.field(spec.label).type) for f, s in zip(files, schemas)
             if spec.label in s.names]
    if not found:
        return None
    if spec.num_classes is None:
        return pa.float32()
    lists = {is_list_type(t) for _, t in found}
    if len(lists) > 1:
        raise DataError(f"{found[0][0]}: column {spec.label}: a list column in some input "
                        f"files, single values in others")
    return pa.list_(pa.int64()) if lists.pop() else pa.int64()


def model_batch(table: pa.Table, spec: FeatureSpec):
    """A TorchRec batch of rows in the data set's layout, exactly as training's reader makes it
    (same dense transform; a placeholder label: scoring needs none)."""
    layout = SparseLayout(tuple(is_list_type(table.schema.field(f.name).type)
                                for f in spec.sparse))
    n = table.num_rows
    dummy = pa.float32() if spec.num_classes is None else pa.int64()
    features = table.select([*spec.dense, *spec.sparse_names]).append_column(
        spec.label, pa.array(np.zeros(n, dummy.to_pandas_dtype()), dummy))
    rows = Rows.from_table(features, spec, layout)
    return to_batch([(rows, 0, n)], layout, spec.sparse_names)


def check_rows(table: pa.Table, spec: FeatureSpec, path: Path, first: int,
           dynamic: Container[str] = ()) -> None:
    """Types, nulls and id ranges of a batch; errors name the file, column and row. Features
    in ``dynamic`` (their table has an id map) take any raw id in ``[0, 2^63 - 1)``."""
    for name in spec.dense:
        column = table.column(name)
        if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)
                or pa.types.is_boolean(column.type)):
            raise DataError(f"{path}: column {name}: expected a number, got {column.type}")
        _no_nulls(column, name, path, first)
        position = first_non_finite(column)
        if position is not None:
            raise DataError(f"{path}: column {name}: row {first + position}: value "
                            f"{column[position].as_py()} is not finite (NaN or infinite)")
    for feat in spec.sparse:
        column = table.column(feat.name)
        _no_nulls(column, feat.name, path, first)
        values = pc.list_flatten(column) if is_list_type(column.type) else column
        if not pa.types.is_integer(values.type):
            raise DataError(f"{path}: column {feat.name}: expected integer ids, got "
                            f"{column.type}")
        if values.null_count:
            row = _row_of(column, _first(pc.is_null(values)))
            raise DataError(f"{path}: column {feat.name}: row {first + row}: a null id in the "
                            f"list")
        if len(values) == 0:
            continue
        raw = feat.name in dynamic
        limit = RAW_ID_LIMIT if raw else feat.num_embeddings
        bounds = pc.min_max(values)
        low, high = bounds["min"].as_py(), bounds["max"].as_py()
        if low < 0 or high >= limit:
            bad = pc.or_(pc.less(values, 0), pc.greater_equal(values, limit))
            position = _first(bad)
            row = _row_of(column, position) if is_list_type(column.type) else position
            value = values[position].as_py()
            why = ("2^63 - 1): raw ids of a dynamic table, mapped to rows by its id map" if raw
                   else f"{feat.num_embeddings}) (the export's table has "
                        f"{feat.num_embeddings:,} rows)")
            raise DataError(f"{path}: column {feat.name}: row {first + row}: id {value} outside "
                            f"[0, {why}")


def _first(mask) -> int:
    """Position of the first true value of a boolean array."""
    return int(np.flatnonzero(mask.to_numpy(zero_copy_only=False))[0])


def _row_of(column: pa.ChunkedArray, position: int) -> int:
    """The row of a list column holding its flattened values' ``position``."""
    lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False)
    return int(np.searchsorted(np.cumsum(lengths), position, side="right"))


def _no_nulls(column: pa.ChunkedArray, name: str, path: Path, first: int) -> None:
    if column.null_count:
        row = _first(pc.is_null(column))
        raise DataError(f"{path}: column {name}: row {first + row}: null value")
