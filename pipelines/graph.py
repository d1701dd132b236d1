"""``embedtrain ingest`` with a graph spec: edge lists (and a node table) to the graph format.

A graph spec is YAML with ``kind: graph`` at the top (:func:`pipelines.graph_spec.is_graph_spec`);
it is read with :func:`pipelines.graph_spec.load_graph_spec` into a
:class:`~pipelines.graph_spec.GraphIngestSpec`. The job (:func:`ingest_graph`):

1. checks every input's columns from its CSV header or parquet footer;
2. *checks and counts* (one streaming pass over the edges): unparsable ids, weights or
   timestamps stop the job with the file, line/row and column; rows with a null endpoint, an
   invalid weight (null, NaN, infinite or <= 0) or an unselected edge type are dropped and
   counted;
3. reads the node table (if any): null ids are dropped and counted, a repeated id is an error,
   null feature values become 0 and null labels -1 (unlabelled), both counted;
4. *remaps* ids of any type to dense int64 with Polars joins: node-table ids first (in table
   order), then edge endpoints not in the table in order of first appearance (``missing_nodes:
   add``; with ``drop`` their edges are dropped and counted);
5. builds the CSR (:func:`embedtrain.graph.csr.csr_from_edges`): self-loops and
   repeated edges dropped, kept or summed as configured, and counted;
6. optionally holds out edges for link prediction (the newest by ``timestamp`` if given, else
   random) and makes the node splits (``split.method``): random fractions over the labelled
   nodes (all nodes without labels), a split column of the node table, or one id list per split
   (parquet/CSV/.npy, ids through the same remap as the edges; an unknown id is an error).
   With labels, user-chosen splits keep only labelled nodes; every node is in one split or
   counted in ``nodes_in_no_split`` by reason. An empty train split with labels is an error;
   empty valid/test splits are left out of ``metadata.json`` (a one-line warning on stderr);
7. writes the graph format (:mod:`embedtrain.graph.store`, with ``nodes/ids.parquet`` mapping dense
   ids back to the original ones), ``ingest_report.json``, and ``metadata.json`` last.

Every edge row read is accounted for: ``rows_read == rows_dropped_total + duplicates_merged +
edges_stored`` (an undirected edge stored in both rows counts once); every node too:
``sum(splits.nodes) + sum(splits.nodes_in_no_split) == num_nodes``.

Example:
    >>> spec = load_graph_spec("configs/ingest/graph_edges.yaml")
    >>> report = ingest_graph(spec, ["edges.csv"], "data/graph",
    ...                       nodes=["nodes.csv"])  # doctest: +SKIP
    >>> report["edges"]["rows_dropped"]["self_loop"]  # doctest: +SKIP
    3
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from embedtrain.config_io import to_dict
from embedtrain.graph.csr import Duplicates, csr_from_edges, edge_pairs, hold_out_edges
from embedtrain.graph.store import write_graph
from embedtrain.utils import first_line, natural_key, phase_bar
from pipelines.graph_spec import (
    EXTENSIONS,
    EdgeTableSpec,
    GraphIngestSpec,
    MissingNodes,
    NodeTableSpec,
    SplitMethod,
)
from pipelines.graph_splits import NodeTable, check_parquet_type, choose_node_splits, id_files
from pipelines.sources import IngestError
from pipelines.spec import InputFormat, ValueType

REPORT_FILE = "ingest_report.json"
ROW, FILE_ROW = "__row", "__file_row"
# edge drop reasons, in the order they are tested (a row counts under its first reason)
NULL_ENDPOINT, INVALID_WEIGHT, TYPE_NOT_SELECTED, NOT_IN_NODE_TABLE = (
    "null_endpoint", "invalid_weight", "edge_type_not_selected", "endpoint_not_in_node_table")


# --- inputs --------------------------------------------------------------------------------------

def _resolve(patterns: Sequence[str | os.PathLike], fmt: InputFormat) -> list[Path]:
    files: list[Path] = []
    for pattern in map(str, patterns):
        path = Path(pattern)
        if path.is_dir():
            found = [p for p in path.iterdir() if p.is_file() and p.name.endswith(EXTENSIONS[fmt])]
            what = f"no {'/'.join(EXTENSIONS[fmt])} files in the directory"
        elif glob.has_magic(pattern):
            found = [Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file()]
            what = "no input files match"
        else:
            found, what = ([path] if path.is_file() else []), "input file not found"
        if not found:
            raise IngestError(f"{pattern}: {what}")
        files.extend(p for p in sorted(found, key=natural_key) if p not in files)
    return files


def _schema(path: Path, table: EdgeTableSpec | NodeTableSpec) -> dict[str, Any]:
    """Column name -> type (Arrow type for parquet, None for CSV) from a footer or header."""
    if table.format is InputFormat.PARQUET:
        try:
            return {f.name: f.type for f in pq.read_schema(path)}
        except (pa.ArrowException, OSError) as e:
            raise IngestError(f"{path}: not a readable parquet file: {first_line(e)}") from None
    if path.stat().st_size == 0:
        raise IngestError(f"{path}: empty file (no CSV header)")
    try:
        names = pl.scan_csv(path, separator=table.separator or ",", infer_schema=False,
                            n_rows=0).collect_schema().names()
    except pl.exceptions.PolarsError as e:
        raise IngestError(f"{path}: cannot read the CSV header: {first_line(e)}") from None
    return {n: None for n in names}


def _check_columns(files: Sequence[Path], table: EdgeTableSpec | NodeTableSpec,
                   columns: Sequence[str]) -> dict[str, Any]:
    first: Optional[dict[str, Any]] = None
    for path in files:
        schema = _schema(path, table)
        missing = [c for c in columns if c not in schema]
        if missing:
            raise IngestError(f"{path}: missing column(s) {', '.join(missing)} "
                              f"(has: {', '.join(list(schema)[:20])})")
        first = first or schema
    return first or {}


def _scan(files: Sequence[Path], table: EdgeTableSpec | NodeTableSpec,
          columns: Sequence[str]) -> pl.LazyFrame:
    paths = [str(f) for f in files]
    if table.format is InputFormat.PARQUET:
        frame = pl.scan_parquet(paths, row_index_name=ROW, extra_columns="ignore")
    else:
        frame = pl.scan_csv(paths, separator=table.separator or ",", infer_schema=False,
                            null_values=table.null_values or None, row_index_name=ROW,
                            raise_if_empty=False)
    return frame.select(ROW, *columns)


def _where(table: EdgeTableSpec | NodeTableSpec, row: int) -> str:
    return f"row {row}" if table.format is InputFormat.PARQUET else f"line {row + 2}"


def _raise_first(files: Sequence[Path], table: EdgeTableSpec | NodeTableSpec,
                 columns: Sequence[str], bad: pl.Expr, column: str, problem: str) -> None:
    """Finds the first row where ``bad`` holds, file by file, and raises naming it."""
    for path in files:
        hit = _scan([path], table, columns).filter(bad).select(ROW, column).head(1).collect()
        if hit.height:
            raise IngestError(f"{path}: {_where(table, int(hit[ROW][0]))}: column {column}: "
                              f"{problem} (value {hit[column][0]!r})")
    raise IngestError(f"{files[0]}: column {column}: {problem}")  # not reached


def _check_parsing(raw: pl.LazyFrame, files: Sequence[Path], table: EdgeTableSpec | NodeTableSpec,
                   columns: Sequence[str], checks: list[tuple[str, pl.Expr, str]]) -> None:
    """One pass counting unparsable values per check; the first failing check is located."""
    if not checks:
        return
    found = raw.select(bad.sum().alias(str(i)) for i, (_, bad, _) in enumerate(checks)).collect(
        engine="streaming").row(0)
    for (column, bad, problem), n in zip(checks, found):
        if n:
            _raise_first(files, table, columns, bad, column, problem)


def _id_expr(name: str, spec: GraphIngestSpec, arrow_type: Any) -> pl.Expr:
    col = pl.col(name)
    if spec.id_type is ValueType.INTEGER:
        return col.cast(pl.Int64, strict=False) if arrow_type is None else col.cast(pl.Int64)
    return col.cast(pl.String)


# --- the job -----------------------------------------------------------------------------------

@dataclass
class _Edges:
    """Parsed edge columns as lazy expressions, with what makes a row unusable."""

    frame: pl.LazyFrame          # ROW, src, dst, [weight], [time], reason (null = kept)
    reasons: list[str]


def _edge_frame(spec: GraphIngestSpec, files: list[Path]) -> _Edges:
    e = spec.edges
    columns = [c for c in (e.src, e.dst, e.weight, e.edge_type, e.timestamp) if c is not None]
    schema = _check_columns(files, e, columns)
    text = e.format is InputFormat.CSV
    if not text:
        for path in files:
            types = {f.name: f.type for f in pq.read_schema(path)}
            if spec.id_type is ValueType.INTEGER:
                check_parquet_type(path, e.src, types[e.src], "integer")
                check_parquet_type(path, e.dst, types[e.dst], "integer")
            if e.weight:
                check_parquet_type(path, e.weight, types[e.weight], "number")
            if e.timestamp:
                check_parquet_type(path, e.timestamp, types[e.timestamp], "time")
    raw = _scan(files, e, columns)
    # parse failures: a value present in the input that does not convert
    checks: list[tuple[str, pl.Expr, str]] = []
    exprs = [pl.col(ROW), _id_expr(e.src, spec, schema[e.src]).alias("src"),
             _id_expr(e.dst, spec, schema[e.dst]).alias("dst")]
    if text and spec.id_type is ValueType.INTEGER:
        for name in (e.src, e.dst):
            checks.append((name, pl.col(name).is_not_null()
                           & pl.col(name).cast(pl.Int64, strict=False).is_null(),
                           "cannot parse as an integer id (id_type: integer)"))
    if e.weight:
        w = pl.col(e.weight).cast(pl.Float64, strict=False)
        exprs.append(w.alias("weight"))
        if text:
            checks.append((e.weight, pl.col(e.weight).is_not_null() & w.is_null(),
                           "cannot parse as a number"))
    if e.timestamp:
        t = _time_expr(e.timestamp, text, schema[e.timestamp])
        exprs.append(t.alias("time"))
        checks.append((e.timestamp, pl.col(e.timestamp).is_not_null() & t.is_null(),
                       "cannot parse as a number or a date"))
    if e.edge_type:
        exprs.append(pl.col(e.edge_type).cast(pl.String).alias("edge_type"))
    _check_parsing(raw, files, e, columns, checks)
    parsed = raw.select(exprs)
    reason = pl.when(pl.col("src").is_null() | pl.col("dst").is_null()).then(pl.lit(NULL_ENDPOINT))
    reasons = [NULL_ENDPOINT]
    if e.weight:
        w = pl.col("weight")
        reason = reason.when(w.is_null() | w.is_nan() | w.is_infinite() | (w <= 0)).then(
            pl.lit(INVALID_WEIGHT))
        reasons.append(INVALID_WEIGHT)
    if e.edge_types is not None:
        reason = reason.when(~pl.col("edge_type").is_in(e.edge_types).fill_null(False)).then(
            pl.lit(TYPE_NOT_SELECTED))
        reasons.append(TYPE_NOT_SELECTED)
    return _Edges(parsed.with_columns(reason.otherwise(pl.lit(None)).alias("reason")), reasons)


def _time_expr(name: str, text: bool, arrow_type: Any) -> pl.Expr:
    col = pl.col(name)
    if not text:
        if pa.types.is_temporal(arrow_type):
            return col.dt.epoch("ms").cast(pl.Float64) / 1000.0
        return col.cast(pl.Float64)
    as_date = col.str.to_datetime(strict=False).dt.epoch("ms").cast(pl.Float64) / 1000.0
    return pl.coalesce(col.cast(pl.Float64, strict=False), as_date)


def _read_node_table(spec: GraphIngestSpec, files: list[Path]) -> NodeTable:
    n = spec.nodes
    assert n is not None
    split_column = spec.split.column if spec.split.method is SplitMethod.COLUMN else None
    columns = [n.id, *n.features, *([n.label] if n.label else []),
               *([split_column] if split_column else [])]
    schema = _check_columns(files, n, columns)
    text = n.format is InputFormat.CSV
    list_column = (len(n.features) == 1 and not text and schema[n.features[0]] is not None
                   and (pa.types.is_list(schema[n.features[0]])
                        or pa.types.is_large_list(schema[n.features[0]])
                        or pa.types.is_fixed_size_list(schema[n.features[0]])))
    if not text:
        for path in files:
            types = {f.name: f.type for f in pq.read_schema(path)}
            if spec.id_type is ValueType.INTEGER:
                check_parquet_type(path, n.id, types[n.id], "integer")
            for c in n.features:
                t = types[c].value_type if list_column else types[c]
                check_parquet_type(path, c, t, "number")
            if split_column and pa.types.is_nested(types[split_column]):
                raise IngestError(f"{path}: column {split_column} (split.column): expected "
                                  f"plain values naming the split, got {types[split_column]}")
    raw = _scan(files, n, columns)
    if text:
        checks = []
        for c in ([n.id] if spec.id_type is ValueType.INTEGER else []) + list(n.features):
            kind = pl.Int64 if c == n.id else pl.Float64
            bad = pl.col(c).is_not_null() & pl.col(c).cast(kind, strict=False).is_null()
            checks.append((c, bad,
                           "cannot parse as " + ("an integer id (id_type: integer)" if c == n.id
                                                 else "a number")))
        _check_parsing(raw, files, n, columns, checks)
    table = raw.with_columns(_id_expr(n.id, spec, schema[n.id]).alias("__id")).collect(
        engine="streaming")
    rows_read = table.height
    null_ids = int(table["__id"].null_count())
    table = table.filter(pl.col("__id").is_not_null())
    dup = table.filter(pl.col("__id").is_duplicated()).head(1)
    if dup.height:
        first, again = table.filter(pl.col("__id") == dup["__id"][0])[ROW].head(2).to_list()
        if len(files) == 1:
            where = f"{files[0]}: {_where(n, first)} and {_where(n, again)}"
        else:  # row numbers count through the files in order
            where = f"{files[0]} (+{len(files) - 1} files): rows {first} and {again}"
        raise IngestError(f"{where}: column {n.id}: id {dup[n.id][0]!r} appears more than once; "
                          "node ids must be unique")
    features, filled = None, {}
    if list_column:
        c = n.features[0]
        lengths = table[c].list.len()
        widths = lengths.filter(table[c].is_not_null()).unique()
        if widths.len() > 1:
            bad = table.filter(lengths != widths[0]).head(1)
            raise IngestError(f"{files[0]}: column {c}: row {int(bad[ROW][0])}: list of "
                              f"{int(bad[c].list.len()[0])} values, others have {widths[0]}")
        width = int(widths[0]) if widths.len() else 0
        nulls = int(table[c].null_count())
        inner_nulls = int(table[c].explode().null_count()) - nulls
        if nulls or inner_nulls:
            filled[c] = nulls + inner_nulls
        values = table.select(pl.col(c).list.eval(pl.element().cast(pl.Float64).fill_null(0.0))
                              .fill_null([0.0] * width))[c]
        features = np.asarray(values.explode().to_numpy(), dtype=np.float32).reshape(-1, width)
    elif n.features:
        cast = table.select(pl.col(c).cast(pl.Float64, strict=False) for c in n.features)
        filled = {c: int(cast[c].null_count()) for c in n.features if cast[c].null_count()}
        features = cast.fill_null(0.0).to_numpy().astype(np.float32)
    labels, classes, unlabelled = None, [], 0
    if n.label:
        values = table[n.label]
        if text:  # integers when every label parses as one
            as_int = values.cast(pl.Int64, strict=False)
            if as_int.null_count() == values.null_count():
                values = as_int
        unlabelled = int(values.null_count())
        classes_series = values.drop_nulls().unique().sort()
        classes = classes_series.to_list()
        lookup = pl.DataFrame({"v": classes_series, "k": np.arange(len(classes), dtype=np.int64)})
        labels = (pl.DataFrame({"v": values}).join(lookup, on="v", how="left",
                                                   maintain_order="left")["k"]
                  .fill_null(-1).to_numpy().astype(np.int64))
    split_values = table[split_column].cast(pl.String) if split_column else None
    return NodeTable(ids=table["__id"], features=features, labels=labels, classes=classes,
                      rows_read=rows_read, null_ids=null_ids, filled=filled,
                      unlabelled=unlabelled, split_values=split_values)


def ingest_graph(spec: GraphIngestSpec, inputs: Sequence[str | os.PathLike],
                 out_dir: str | os.PathLike, nodes: Optional[Sequence[str | os.PathLike]] = None,
                 progress: bool = False) -> dict:
    """Runs a graph ingestion job (see the module docstring).

    Args:
        spec: the validated spec (:func:`load_graph_spec`).
        inputs: edge files, directories or globs (``--input``).
        out_dir: output folder; created if missing. An earlier graph data set there is
            replaced; any other non-empty folder is refused.
        nodes: node-table files or globs (``--nodes``); required iff the spec has ``nodes:``.
        progress: show a progress bar on stderr (phases done, elapsed time, the last phase).

    Returns:
        The report written to ``ingest_report.json``.

    Raises:
        IngestError: bad input, one line naming the file (and row and column where it can).
    """
    started = time.perf_counter()
    if spec.nodes is not None and not nodes:
        raise IngestError("--nodes: the spec has a nodes: section; give the node table")
    if spec.nodes is None and nodes:
        raise IngestError("--nodes: the spec has no nodes: section describing the node table")
    out = Path(out_dir)
    _check_out_dir(out)
    edge_files = _resolve(inputs, spec.edges.format)
    node_files = _resolve(nodes, spec.nodes.format) if spec.nodes is not None and nodes else []
    if spec.split.method is SplitMethod.IDS:
        for split, path in id_files(spec.split).items():
            if not path.is_file():
                raise IngestError(f"{path}: id file not found (split.files.{split})")
    with phase_bar(None, "ingest graph", disable=not progress) as bar:
        try:
            return _ingest(spec, edge_files, node_files, out, bar, started)
        except pl.exceptions.PolarsError as e:  # a malformed line, a corrupt page: name the file
            raise _locate_failure(spec, edge_files, node_files, e) from None


def _locate_failure(spec: GraphIngestSpec, edge_files: list[Path], node_files: list[Path],
                    error: Exception) -> IngestError:
    tables: list[tuple[Path, Any]] = [(f, spec.edges) for f in edge_files]
    tables += [(f, spec.nodes) for f in node_files] if spec.nodes is not None else []
    for path, table in tables:  # the error does not say which file: read them one by one
        try:
            frame = (pl.scan_parquet(path) if table.format is InputFormat.PARQUET else
                     pl.scan_csv(path, separator=table.separator or ",", infer_schema=False))
            frame.select(pl.all().null_count()).collect(engine="streaming")
        except pl.exceptions.PolarsError as e:
            return IngestError(f"{path}: cannot read: {first_line(e)}")
    return IngestError(f"{edge_files[0]}: cannot read: {first_line(error)}")


def _ingest(spec: GraphIngestSpec, edge_files: list[Path], node_files: list[Path], out: Path,
            bar: tqdm, started: float) -> dict:
    phases: list[dict] = []

    def phase(name: str, t0: float) -> float:
        now = time.perf_counter()
        phases.append({"phase": name, "seconds": round(now - t0, 3)})
        bar.set_postfix_str(f"{name} ({now - t0:.1f} s)", refresh=False)
        bar.update()
        return now

    t = time.perf_counter()
    edges = _edge_frame(spec, edge_files)
    keys = ["reason"] + (["edge_type"] if spec.edges.edge_type else [])
    counts = edges.frame.group_by(keys).agg(pl.len().alias("n")).collect(engine="streaming")
    dropped = {r: 0 for r in edges.reasons}
    by_type: dict[Optional[str], int] = {}
    rows_read = 0
    for row in counts.iter_rows(named=True):
        rows_read += row["n"]
        if row["reason"] is not None:
            dropped[row["reason"]] += row["n"]
        if spec.edges.edge_type:
            by_type[row["edge_type"]] = by_type.get(row["edge_type"], 0) + row["n"]
    if rows_read == 0:
        raise IngestError(f"{edge_files[0]}: no edges to ingest ({len(edge_files)} file(s))")
    t = phase("check and count edges", t)

    table = _read_node_table(spec, node_files) if spec.nodes is not None else None
    if table is not None:
        t = phase("node table", t)
    kept = edges.frame.filter(pl.col("reason").is_null())
    ids = _id_map(kept, table, spec)
    n_table = 0 if table is None else table.ids.len()
    missing_ids = ids.height - n_table
    add = spec.nodes is None or spec.nodes.missing_nodes is MissingNodes.ADD
    if not add:
        ids = ids.head(n_table)
    lookup = ids.lazy().select(pl.col("id"), pl.col("dense"))
    joined = (kept.join(lookup.rename({"id": "src", "dense": "s"}), on="src", how="left",
                        maintain_order="left")
              .join(lookup.rename({"id": "dst", "dense": "d"}), on="dst", how="left",
                    maintain_order="left"))
    cols = ["s", "d"] + (["weight"] if spec.edges.weight else []) + (
        ["time"] if spec.edges.timestamp else [])
    frame = joined.select(cols).collect(engine="streaming")
    missing_rows = frame.filter(pl.col("s").is_null() | pl.col("d").is_null()).height
    if spec.nodes is not None:
        dropped[NOT_IN_NODE_TABLE] = missing_rows
        frame = frame.filter(pl.col("s").is_not_null() & pl.col("d").is_not_null())
    t = phase("remap ids", t)

    num_nodes = ids.height
    src, dst = frame["s"].to_numpy(), frame["d"].to_numpy()
    weights = frame["weight"].to_numpy() if spec.edges.weight else None
    times = frame["time"].to_numpy() if spec.edges.timestamp else None
    del frame
    g = spec.graph
    indptr, indices, out_w, edge_counts = csr_from_edges(
        src, dst, num_nodes, weights, undirected=not g.directed, self_loops=g.self_loops,
        duplicates=g.duplicates)
    dropped["self_loop"] = edge_counts.self_loops_dropped
    dropped["duplicate"] = edge_counts.duplicates_dropped
    t = phase("CSR", t)

    s = spec.split
    edge_splits = None
    if s.edge_valid_fraction or s.edge_test_fraction:
        rank = None if times is None else _pair_times(src, dst, times, indptr, indices,
                                                      g.directed, num_nodes)
        indptr, indices, out_w, edge_splits = hold_out_edges(
            indptr, indices, out_w, g.directed, s.edge_valid_fraction, s.edge_test_fraction,
            seed=s.seed, rank=rank)
        t = phase("held-out edges", t)
    del src, dst

    features = labels = None
    if table is not None:
        if table.features is not None:
            features = np.zeros((num_nodes, table.features.shape[1]), dtype=np.float32)
            features[:n_table] = table.features
        if table.labels is not None:
            labels = np.full(num_nodes, -1, dtype=np.int64)
            labels[:n_table] = table.labels
    node_splits = choose_node_splits(spec, num_nodes, labels, table, ids, node_files)
    splits = node_splits.splits
    held = {k: int(v.shape[1]) for k, v in (edge_splits or {}).items()}
    report = {
        "name": spec.name,
        "kind": "graph",
        "inputs": {"edges": [str(f) for f in edge_files], "nodes": [str(f) for f in node_files]},
        "edges": {
            "rows_read": rows_read,
            "rows_dropped": dropped,
            "rows_dropped_total": sum(dropped.values()),
            "duplicates_merged": edge_counts.duplicates_merged,
            "self_loops_kept": edge_counts.self_loops - edge_counts.self_loops_dropped,
            "duplicates_kept": edge_counts.duplicates if g.duplicates is Duplicates.KEEP else 0,
            "edges_stored": edge_counts.edges,
            "held_out": held,
            "csr_entries": int(indices.shape[0]),
            "directed": g.directed,
            "self_loops": g.self_loops.value,
            "duplicates": g.duplicates.value,
        },
        "nodes": {
            "num_nodes": num_nodes,
            "from_node_table": n_table,
            "endpoints_not_in_node_table": missing_ids if table is not None else None,
            "added_from_edges": missing_ids if add else 0,
            "isolated": int(np.count_nonzero(np.diff(indptr) == 0)),
        },
        "splits": {"nodes": {k: int(v.shape[0]) for k, v in splits.items()},
                   "node_split_over": "labelled nodes" if labels is not None else "all nodes",
                   "node_split_method": s.method.value,
                   "nodes_in_no_split": node_splits.in_no_split,
                   **node_splits.extra,
                   "edges": held, "edge_split_method": (
                       None if edge_splits is None else "time" if times is not None else "random"),
                   "seed": s.seed},
        "phases": phases,
    }
    if node_splits.warnings:
        report["warnings"] = node_splits.warnings
    if table is not None:
        report["nodes"].update(rows_read=table.rows_read, rows_dropped={"null_id": table.null_ids},
                               feature_nulls_filled=table.filled,
                               labelled=None if labels is None else int((labels >= 0).sum()),
                               unlabelled_in_table=table.unlabelled,
                               num_classes=len(table.classes) if labels is not None else None)
    if times is not None:
        report["edges"]["rows_without_timestamp"] = int(np.isnan(times).sum())
    if spec.edges.edge_type:  # rows read per type, the 100 most frequent
        top = sorted(by_type.items(), key=lambda kv: (-kv[1], str(kv[0])))[:100]
        report["edges"]["rows_by_edge_type"] = {str(k): v for k, v in top}
    report["wall_seconds"] = round(time.perf_counter() - started, 3)
    (out / REPORT_FILE).parent.mkdir(parents=True, exist_ok=True)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    summary = {k: report[k] for k in ("edges", "nodes", "splits")}
    extra: dict[str, Any] = {"ingest_report": summary, "spec": to_dict(spec)}
    if table is not None and labels is not None:
        extra["classes"] = table.classes
    for warning in node_splits.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    write_graph(out, indptr, indices, weights=out_w, features=features, labels=labels,
                num_classes=len(table.classes) if labels is not None else None,
                splits={k: v for k, v in splits.items() if v.shape[0]},  # empty ones: absent
                edge_splits=edge_splits, directed=g.directed, name=spec.name,
                extra_meta=extra, ids=ids["id"].to_arrow())
    return report


def _id_map(kept: pl.LazyFrame, table: Optional[NodeTable], spec: GraphIngestSpec
            ) -> pl.DataFrame:
    """``id -> dense``: node-table ids in table order, then other endpoints by first appearance."""
    endpoints = pl.concat([
        kept.select(pl.col("src").alias("id"), (pl.col(ROW).cast(pl.Int64) * 2).alias("pos")),
        kept.select(pl.col("dst").alias("id"), (pl.col(ROW).cast(pl.Int64) * 2 + 1).alias("pos")),
    ])
    first = endpoints.group_by("id").agg(pl.col("pos").min())
    id_type = pl.Int64 if spec.id_type is ValueType.INTEGER else pl.String
    if table is not None:
        known = pl.DataFrame({"id": table.ids.cast(id_type)})
        first = first.join(known.lazy(), on="id", how="anti")
    extra = first.sort("pos").select("id").collect(engine="streaming")
    head = pl.DataFrame({"id": table.ids.cast(id_type)}) if table is not None else (
        pl.DataFrame(schema={"id": id_type}))
    ids = pl.concat([head, extra.select(pl.col("id").cast(id_type))])
    return ids.with_row_index("dense").with_columns(pl.col("dense").cast(pl.Int64))


def _pair_times(src: np.ndarray, dst: np.ndarray, times: np.ndarray, indptr: np.ndarray,
                indices: np.ndarray, directed: bool, n: int) -> np.ndarray:
    """The first time of every :func:`edge_pairs` edge (NaN times count as the oldest)."""
    big = np.int64(n)
    if directed:
        keys = src.astype(np.int64) * big + dst
    else:
        keys = np.minimum(src, dst).astype(np.int64) * big + np.maximum(src, dst)
    first = (pl.DataFrame({"k": keys, "t": np.nan_to_num(times, nan=-np.inf)})
             .group_by("k").agg(pl.col("t").min()))
    ps, pd = edge_pairs(indptr, indices, directed)
    pairs = pl.DataFrame({"k": ps * big + pd})
    return pairs.join(first, on="k", how="left", maintain_order="left")["t"].fill_null(
        -np.inf).to_numpy()


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise IngestError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / REPORT_FILE).exists() and not (
            out / "metadata.json").exists():
        raise IngestError(f"{out}: not empty and not an earlier graph output; choose another --out")
    ours = {"metadata.json", "metadata.json.tmp", REPORT_FILE, "graph", "nodes", "splits"}
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in ours)
        if foreign:
            raise IngestError(f"{out}: holds files of another kind of data set "
                              f"({', '.join(foreign[:5])}); choose another --out")
