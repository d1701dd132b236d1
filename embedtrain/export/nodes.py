"""A GNN export's per-node outputs: reading them, and ``embedtrain predict`` by node id.

An export of a GNN run (:mod:`embedtrain.export.export`) holds every node's outputs, computed at
export by layer-wise full-graph inference (:mod:`embedtrain.models.layerwise`; ``model.json``'s
``nodes``, :class:`~embedtrain.export.manifest.NodeOutputs`): ``nodes/scores.npy`` (class
logits) and ``nodes/embeddings.npy`` (node classification), ``nodes/embeddings.npy`` (link
prediction), float32, row = dense node id; and ``nodes/ids.parquet``, the data set's original
node ids, where it has them. :class:`ExportedNodes` memory-maps the arrays.

:func:`predict_nodes` (``embedtrain predict`` of such an export) reads node ids from parquet or
CSV files, a batch at a time -- column ``node``: dense ids ``0 .. N-1``; else column ``id``: the
data set's original ids, mapped through the export's ``nodes/ids.parquet`` (a hash lookup; the
map is read whole) -- and writes, one row per input row in order: ``node`` (int64, the dense
id); node classification: ``class`` (int64, the arg-max) and ``scores`` (``list<float32>``, the
class logits); link prediction: ``embedding`` (``list<float32>``); then the input's ``label``
column, if it has one (node classification: the accuracy of ``class`` against it is returned;
labels below 0 and nulls are not counted), and the ``--keep`` columns. A null, a non-integer
node id, or one the export does not have is a one-line error naming the file, column and row.

Example:
    >>> nodes = ExportedNodes("exports/gnn")
    >>> nodes.rows("scores", np.array([0, 42])).argmax(axis=1)  # the predicted classes
    >>> predict("exports/gnn", ["nodes.parquet"], "preds.parquet").metrics  # embedtrain predict
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from embedtrain.data.reader import DataError
from embedtrain.export.manifest import MANIFEST_FILE, ExportError, load_manifest
from embedtrain.export.rows import PredictResult, input_files, parquet_output
from embedtrain.export.tables import read_table
from embedtrain.utils import check_output_file, progress_bar

NODE_COLUMN, ID_COLUMN = "node", "id"  # dense node ids; the data set's original ids
_COLUMNS = {"scores": "scores", "embeddings": "embedding"}  # output column of each array


class ExportedNodes:
    """A GNN export's per-node arrays (memory-mapped) and its node id map.

    Args:
        root: the export directory.

    Raises:
        ExportError: not an export, one without node outputs, or a missing or mismatched file
            (named).

    Example:
        >>> nodes = ExportedNodes("exports/gnn_link")
        >>> e = nodes.rows("embeddings", np.array([3, 9]))
        >>> float(e[0] @ e[1])  # the link 3 -- 9's logit
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        m = self.manifest = load_manifest(self.root)
        where = self.root / MANIFEST_FILE
        if m.nodes is None:
            raise ExportError(f"{where}: task {m.task}: no per-node outputs (a GNN export "
                              f"made before they existed: export the run again)")
        self.num_nodes, self.output = m.nodes.num_nodes, m.nodes.output
        self.arrays: dict[str, np.ndarray] = {}
        for a in m.nodes.arrays:
            try:
                self.arrays[a.name] = read_table(self.root, a.file, None, (a.rows, a.dim),
                                                 np.float32)
            except ValueError as e:
                raise ExportError(str(e)) from None
        if self.output not in self.arrays:
            raise ExportError(f"{where}: nodes.output: {self.output!r} is not one of its arrays "
                              f"({', '.join(self.arrays)})")
        self._ids: Optional[pa.Array] = None

    def rows(self, name: str, nodes: np.ndarray) -> np.ndarray:
        """Array ``name``'s rows of the dense node ids ``nodes`` (checked by the caller)."""
        return np.asarray(self.arrays[name][nodes])

    @property
    def id_file(self) -> Optional[Path]:
        """The data set's original node ids (``nodes/ids.parquet``), if the export has them."""
        ids = self.manifest.nodes.ids
        return None if ids is None else self.root / ids

    def original_ids(self) -> pa.Array:
        """Column ``id`` of :attr:`id_file` (row = dense id), read on first use."""
        if self._ids is None:
            path = self.id_file
            if path is None:
                raise ExportError(f"{self.root / MANIFEST_FILE}: nodes.ids: the export has no "
                                  f"node id map (its data set's nodes are the dense ids)")
            try:
                column = pq.read_table(path, columns=[ID_COLUMN]).column(ID_COLUMN)
            except (OSError, pa.ArrowException, KeyError) as e:
                raise ExportError(f"{path}: unreadable: {e}") from None
            if len(column) != self.num_nodes:
                raise ExportError(f"{path}: {len(column):,} ids for {self.num_nodes:,} nodes")
            self._ids = column.combine_chunks()
        return self._ids


def node_input_files(inputs: Sequence[str]) -> list[Path]:
    """The parquet and CSV files of ``--input`` arguments (:func:`~embedtrain.export.rows.
    input_files`: files, directories or quoted globs, sorted naturally, in the order given).

    Raises:
        FileNotFoundError: an argument that names no parquet or CSV file.
    """
    return input_files(inputs, (".parquet", ".csv"))


def _batches(path: Path, batch_size: int) -> Iterator[pa.RecordBatch]:
    """The file's rows, about ``batch_size`` at a time (CSV: its reader's blocks)."""
    try:
        if path.suffix.lower() == ".csv":
            reader = pacsv.open_csv(path)
            for batch in reader:
                for start in range(0, batch.num_rows, batch_size):
                    yield batch.slice(start, batch_size)
        else:
            yield from pq.ParquetFile(path).iter_batches(batch_size)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: unreadable: {str(e).strip().splitlines()[0]}") from None


def _rows_of(path: Path) -> Optional[int]:
    return None if path.suffix.lower() == ".csv" else pq.ParquetFile(path).metadata.num_rows


def dense_node_ids(nodes: ExportedNodes, batch: pa.RecordBatch, path: Path, first: int
                   ) -> np.ndarray:
    """The batch's dense node ids (int64): its ``node`` column, or its ``id`` column mapped
    through the export's id map; one-line :class:`DataError` naming the file, column and row of
    a null, a non-integer or an unknown id."""
    names = batch.schema.names
    name = NODE_COLUMN if NODE_COLUMN in names else ID_COLUMN if ID_COLUMN in names else None
    if name is None:
        raise DataError(f"{path}: no column {NODE_COLUMN} (dense node ids 0..{nodes.num_nodes - 1})"
                        f" or {ID_COLUMN} (the data set's original node ids)")
    column = batch.column(name)
    if column.null_count:
        row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{path}: column {name}: row {first + row}: null value")
    if name == NODE_COLUMN:
        if not pa.types.is_integer(column.type):
            raise DataError(f"{path}: column {name}: integer node ids expected, got "
                            f"{column.type}")
        dense = column.to_numpy().astype(np.int64)
        bad = np.flatnonzero((dense < 0) | (dense >= nodes.num_nodes))
        if len(bad):
            raise DataError(f"{path}: column {name}: row {first + int(bad[0])}: node "
                            f"{int(dense[bad[0]])} outside [0, {nodes.num_nodes:,}) (the export's "
                            f"graph has {nodes.num_nodes:,} nodes)")
        return dense
    if nodes.id_file is None:
        raise DataError(f"{path}: column {name}: the export has no node id map (its data set's "
                        f"nodes are the dense ids): give dense ids in a column {NODE_COLUMN}")
    ids = nodes.original_ids()
    try:
        values = column.cast(ids.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        values = None
    found = (pc.index_in(values, value_set=ids) if values is not None
             else pa.nulls(len(column), pa.int32()))
    if found.null_count:
        row = int(np.flatnonzero(found.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{path}: column {name}: row {first + row}: id "
                        f"{column[row].as_py()!r} is not a node of the data set "
                        f"({nodes.id_file})")
    return found.to_numpy().astype(np.int64)


def predict_nodes(export_dir: str | os.PathLike, inputs: Sequence[str], out: str | os.PathLike,
                  batch_size: int = 8192, progress: bool = True, keep: Sequence[str] = ()
                  ) -> PredictResult:
    """Writes the export's per-node outputs of the node ids in ``inputs`` to parquet ``out``
    (the columns are in the module docstring).

    Args:
        export_dir: an ``embedtrain export`` directory of a GNN run.
        inputs: parquet or CSV files, directories or globs with a ``node`` (dense ids) or ``id``
            (original ids) column.
        out: the predictions file (written anew).
        batch_size: rows at once.
        progress: show a progress bar (rows).
        keep: input columns copied to the output as they are.

    Returns:
        A :class:`~embedtrain.export.predict.PredictResult`; ``metrics``: ``accuracy`` where
        the input has labels and the export class scores.

    Raises:
        ExportError, DataError, FileNotFoundError: one line naming the file (column, row).
    """
    start = time.perf_counter()
    if batch_size < 1:
        raise ValueError(f"--batch-size: must be at least 1, got {batch_size}")
    nodes = ExportedNodes(export_dir)
    files = node_input_files(inputs)
    out = Path(out)
    check_output_file(out, "--out", example="predictions.parquet", inputs=files)
    out.parent.mkdir(parents=True, exist_ok=True)
    sizes = [_rows_of(f) for f in files]
    total = None if None in sizes else sum(sizes)
    rows = hits = labelled = 0
    shown = files[0] if len(files) == 1 else f"{len(files)} input files"
    with parquet_output(out, lambda: f"{shown}: no rows to score; nothing written to {out}"
                        ) as write, progress_bar(total, "predict", disable=not progress) as bar:
        for path in files:
            first = 0
            for batch in _batches(path, batch_size):
                missing = [c for c in keep if c not in batch.schema.names]
                if missing:
                    raise DataError(f"{path}: --keep {missing[0]}: no such column")
                dense = dense_node_ids(nodes, batch, path, first)
                columns = _node_columns(nodes, dense)
                if "label" in batch.schema.names:
                    labels = batch.column("label")
                    columns["label"] = labels
                    if "class" in columns:
                        hit, count = _hits(columns["class"], labels)
                        hits, labelled = hits + hit, labelled + count
                columns.update({c: batch.column(c) for c in keep})
                write(pa.table(columns))
                first += batch.num_rows
                rows += batch.num_rows
                bar.update(batch.num_rows)
    metrics = {"accuracy": hits / labelled} if labelled else {}
    return PredictResult(out, rows, len(files), time.perf_counter() - start, metrics)


def _node_columns(nodes: ExportedNodes, dense: np.ndarray) -> dict[str, pa.Array]:
    """``node`` and the model's output of the nodes ``dense``."""
    values = nodes.rows(nodes.output, dense)
    n, dim = values.shape
    vectors = pa.ListArray.from_arrays(pa.array(np.arange(0, (n + 1) * dim, dim, dtype=np.int32)),
                                       pa.array(values.reshape(-1)))
    columns: dict[str, pa.Array] = {NODE_COLUMN: pa.array(dense)}
    if nodes.output == "scores":
        columns["class"] = pa.array(values.argmax(axis=1).astype(np.int64))
    columns[_COLUMNS.get(nodes.output, nodes.output)] = vectors
    return columns


def _hits(predicted: pa.Array, labels: pa.Array) -> tuple[int, int]:
    """Correct predictions and labelled rows (labels null or below 0 are not counted)."""
    if not pa.types.is_integer(labels.type):
        return 0, 0
    y = labels.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    counted = y >= 0
    p = predicted.to_numpy()
    return int((p[counted] == y[counted]).sum()), int(counted.sum())
