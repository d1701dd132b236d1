"""``embedtrain ingest`` with a graph spec: edge lists (and a node table) to the graph format.

A graph spec is YAML with ``kind: graph`` at the top (:func:`pipelines.kind_of`); it is read with
:func:`pipelines.graph.spec.load_spec` into a :class:`~pipelines.graph.spec.GraphIngestSpec`.
The job (:func:`ingest`) reads the edge files in passes over shards of them
(:mod:`pipelines.engines.base`: all files as one shard on the local engine, a Ray task per file
on the Ray engine, each numbered from the rows of the files before it); the node table, the CSR
build, held-out edges and splits are one step where the job runs, on the merged edges:

1. checks every input's columns from its CSV header or parquet footer;
2. *checks and counts* (per shard, one streaming pass over its edges): unparsable ids, weights or
   timestamps stop the job with the file, line/row and column; rows with a null endpoint, an
   invalid weight (null, NaN, infinite or <= 0) or an unselected edge type are dropped and
   counted;
3. reads the node table (if any): null ids are dropped and counted, a repeated id is an error,
   null feature values become 0 and null labels -1 (unlabelled), both counted;
4. *remaps* ids of any type to dense int64 with Polars joins: node-table ids first (in table
   order), then edge endpoints not in the table in order of first appearance (``missing_nodes:
   add``; with ``drop`` their edges are dropped and counted): each shard finds its endpoints'
   first positions, merged by minimum, then each shard joins its edges with the id map, the
   shards' edges concatenated in input order. Integer ids of a graph built out of core (step 5)
   are remapped without hash tables (:mod:`pipelines.graph.remap`: a direct table over the ids'
   range, or sorted arrays, streamed a batch at a time on the machine running the job; the same
   dense ids): at 10^8 nodes Polars' hash tables were the job's largest allocation;
5. builds the CSR (:func:`embedtrain.graph.csr.csr_from_edges`): self-loops and
   repeated edges dropped, kept or summed as configured, and counted. Edges whose sort would
   need more than ``graph.memory_gb`` (default a quarter of the RAM; 24 bytes an entry, 48 with
   weights) are built out of core instead, into the same files: each shard's remapped edges are
   streamed to a parquet file beside the output (Polars' streaming engine, never collected) and
   read back a batch at a time into :func:`embedtrain.graph.csr_external.csr_from_edge_chunks`, whose
   memory-mapped arrays are moved into the data set (``csr_build`` in the report says which
   build ran; ``peak_rss_gb`` is the job's peak resident memory). Holding out edges by
   timestamp needs the in-memory build (refused in one line otherwise);
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
    >>> spec = load_spec("configs/ingest/graph_edges.yaml")
    >>> report = ingest(spec, ["edges.csv"], "data/graph",
    ...                       nodes=["nodes.csv"])  # doctest: +SKIP
    >>> report["edges"]["rows_dropped"]["self_loop"]  # doctest: +SKIP
    3
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import polars as pl
from tqdm import tqdm

from embedtrain.config_io import to_dict
from embedtrain.graph.csr import Duplicates, csr_from_edges, edge_pairs, hold_out_edges
from embedtrain.graph.csr_external import (
    ENTRY_BYTES,
    WEIGHTED_ENTRY_BYTES,
    ScratchDir,
    csr_from_edge_chunks,
    memory_budget,
)
from embedtrain.graph.store import FeatureRangeError, cast_features, write_graph
from embedtrain.utils import phase_bar
from pipelines.core.errors import IngestError
from pipelines.core.fields import ValueType
from pipelines.core.output import REPORT_FILE
from pipelines.engines.base import Engine, Pass, Shard
from pipelines.engines.local import LocalEngine
from pipelines.graph.read import (
    NOT_IN_NODE_TABLE, ROW, edge_frame, locate_failure, read_node_table, resolve_inputs)
from pipelines.graph.remap import build_id_map, read_batches, remap_parts, sink_kept
from pipelines.graph.splits import NodeTable, choose_node_splits, id_files
from pipelines.graph.spec import GraphIngestSpec, MissingNodes, SplitMethod


def ingest(spec: GraphIngestSpec, inputs: Sequence[str | os.PathLike],
           out_dir: str | os.PathLike, nodes: Optional[Sequence[str | os.PathLike]] = None,
           progress: bool = False, engine: Optional[Engine] = None) -> dict:
    """Runs a graph ingestion job (see the module docstring).

    Args:
        spec: the validated spec (:func:`load_spec`).
        inputs: edge files, directories or globs (``--input``).
        out_dir: output folder; created if missing. An earlier graph data set there is
            replaced; any other non-empty folder is refused.
        nodes: node-table files or globs (``--nodes``); required iff the spec has ``nodes:``.
        progress: show a progress bar on stderr (phases done, elapsed time, the last phase).
        engine: where the edge passes run (:func:`pipelines.engines.open_engine`); default: the
            local engine. The outputs are the same on every engine.

    Returns:
        The report written to ``ingest_report.json``.

    Raises:
        IngestError: bad input, one line naming the file (and row and column where it can).
    """
    engine = engine or LocalEngine()
    started = time.perf_counter()
    if spec.nodes is not None and not nodes:
        raise IngestError("--nodes: the spec has a nodes: section; give the node table")
    if spec.nodes is None and nodes:
        raise IngestError("--nodes: the spec has no nodes: section describing the node table")
    out = Path(out_dir)
    _check_out_dir(out)
    edge_files = resolve_inputs(inputs, spec.edges.format)
    node_files = (resolve_inputs(nodes, spec.nodes.format) if spec.nodes is not None and nodes
                  else [])
    if spec.split.method is SplitMethod.IDS:
        for split, path in id_files(spec.split).items():
            if not path.is_file():
                raise IngestError(f"{path}: id file not found (split.files.{split})")
    scratch = ScratchDir(out)
    with phase_bar(None, "ingest graph", disable=not progress) as bar:
        try:
            return _ingest(spec, engine, edge_files, node_files, out, bar, started, scratch)
        except pl.exceptions.PolarsError as e:  # a malformed line, a corrupt page: name the file
            raise locate_failure(spec, edge_files, node_files, e) from None
        finally:
            scratch.close()


def _ingest(spec: GraphIngestSpec, engine: Engine, edge_files: list[Path],
            node_files: list[Path], out: Path, bar: tqdm, started: float,
            scratch: ScratchDir) -> dict:
    phases: list[dict] = []

    def phase(name: str, t0: float) -> float:
        now = time.perf_counter()
        phases.append({"phase": name, "seconds": round(now - t0, 3)})
        bar.set_postfix_str(f"{name} ({now - t0:.1f} s)", refresh=False)
        bar.update()
        return now

    t = time.perf_counter()
    shards = engine.shards(edge_files)
    counted = engine.map(_count_edges, shards, spec)
    if len(shards) > 1:  # global row numbers: first appearance counts through the files
        starts = [0]
        for c, _ in counted[:-1]:
            starts.append(starts[-1] + int(c["n"].sum()))
        shards = [s.with_(offset=start) for s, start in zip(shards, starts)]
    counts = _concat([c for c, _ in counted])
    dropped = {r: 0 for r in counted[0][1]}
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

    table = read_node_table(spec, node_files) if spec.nodes is not None else None
    if table is not None:
        t = phase("node table", t)
    g = spec.graph
    budget = memory_budget(g.memory_gb)
    per_entry = WEIGHTED_ENTRY_BYTES if spec.edges.weight else ENTRY_BYTES
    in_memory = rows_read * (1 if g.directed else 2) * per_entry <= budget
    n_table = 0 if table is None else table.ids.len()
    add = spec.nodes is None or spec.nodes.missing_nodes is MissingNodes.ADD
    columns = ["src", "dst"] + (["weight"] if spec.edges.weight else []) + (
        ["time"] if spec.edges.timestamp else [])
    kept = id_map = None
    if not in_memory and spec.id_type is ValueType.INTEGER:  # sorted arrays, not hash tables
        kept = [sink_kept(_kept(shard, spec), columns, scratch.path() / f"kept{i}.parquet")
                for i, shard in enumerate(shards)]
        id_map = build_id_map(kept, None if table is None else table.ids.cast(
            pl.Int64).to_numpy(), budget, lambda msg: bar.set_postfix_str(msg, refresh=True))
        missing_ids = id_map.size - n_table
        if not add:
            id_map.truncate(n_table)
        num_nodes, ids, lookup = id_map.size, None, None  # the id frame once the map is gone
    else:
        ids = _id_map(engine.run(Pass("first appearance", _first_seen, _merge_first_seen),
                                 shards, spec), table, spec)
        missing_ids = ids.height - n_table
        if not add:
            ids = ids.head(n_table)
        num_nodes, lookup = ids.height, ids.select(pl.col("id"), pl.col("dense"))
    src = dst = times = first_times = None
    if in_memory:
        frame = engine.run(Pass("remap ids", _remap, _concat), shards, (spec, lookup))
        missing_rows = frame.filter(pl.col("s").is_null() | pl.col("d").is_null()).height
        if spec.nodes is not None:
            frame = frame.filter(pl.col("s").is_not_null() & pl.col("d").is_not_null())
        t = phase("remap ids", t)
        src, dst = frame["s"].to_numpy(), frame["d"].to_numpy()
        weights = frame["weight"].to_numpy() if spec.edges.weight else None
        times = frame["time"].to_numpy() if spec.edges.timestamp else None
        del frame
        indptr, indices, out_w, edge_counts = csr_from_edges(
            src, dst, num_nodes, weights, undirected=not g.directed, self_loops=g.self_loops,
            duplicates=g.duplicates)
        del weights
        csr_build = {"method": "in memory", "memory_budget_gb": float(f"{budget / 2**30:.4g}")}
    else:
        parts = [scratch.path() / f"edges{i}.parquet" for i in range(len(shards))]
        if id_map is not None:
            remap_parts(kept, id_map, columns, parts,
                        lambda msg: bar.set_postfix_str(msg, refresh=True))
            ids = pl.DataFrame({"dense": np.arange(num_nodes, dtype=np.int64),
                                "id": id_map.ids()})
            del id_map
        else:
            for shard, part in zip(shards, parts):  # streamed to disk, not collected
                _remapped(shard, spec, lookup).sink_parquet(part, row_group_size=1 << 20)
        del lookup
        s = spec.split
        if spec.edges.timestamp and (s.edge_valid_fraction or s.edge_test_fraction):
            first_times = _first_times(pl.scan_parquet(parts).filter(
                pl.col("s").is_not_null() & pl.col("d").is_not_null()), g.directed, num_nodes)
        t = phase("remap ids", t)
        built = _external_csr(spec, parts, num_nodes, scratch.path(), budget, bar)
        indptr, indices, out_w, edge_counts, missing_rows, no_time = built
        csr_build = {"method": "out of core", "memory_budget_gb": float(f"{budget / 2**30:.4g}")}
        if spec.edges.timestamp:
            csr_build["rows_without_timestamp"] = no_time
    if spec.nodes is not None:
        dropped[NOT_IN_NODE_TABLE] = missing_rows
    dropped["self_loop"] = edge_counts.self_loops_dropped
    dropped["duplicate"] = edge_counts.duplicates_dropped
    if edge_counts.edges == 0:
        _no_edges(edge_files, rows_read, dropped, edge_counts.duplicates_merged)
    t = phase("CSR", t)

    s = spec.split
    edge_splits = None
    if s.edge_valid_fraction or s.edge_test_fraction:
        if times is not None:
            first_times = _first_times(pl.DataFrame({"s": src, "d": dst, "time": times}).lazy(),
                                       g.directed, num_nodes)
        rank = None if first_times is None else _pair_times(first_times, indptr, indices,
                                                            g.directed, num_nodes)
        indptr, indices, out_w, edge_splits = hold_out_edges(
            indptr, indices, out_w, g.directed, s.edge_valid_fraction, s.edge_test_fraction,
            seed=s.seed, rank=rank)
        t = phase("held-out edges", t)
    del src, dst

    features = labels = None
    if table is not None:
        if table.features is not None:  # in nodes.feature_dtype, which write_graph keeps
            dtype, names = spec.nodes.feature_dtype, spec.nodes.features
            features = np.zeros((num_nodes, table.features.shape[1]), dtype=dtype.numpy)
            try:
                features[:n_table] = cast_features(table.features, dtype)
            except FeatureRangeError as e:
                column = (names[e.column] if len(names) == features.shape[1]
                          else f"{names[0]}[{e.column}]")  # one list column
                more = f" (+{len(node_files) - 1} files)" if len(node_files) > 1 else ""
                raise IngestError(f"{node_files[0]}{more}: column {column}: node "
                                  f"{table.ids[e.row]!r}: {e.value:g} is outside {dtype.value}'s "
                                  f"range (|x| <= 65504); scale the column or set "
                                  f"nodes.feature_dtype: float32") from None
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
                       None if edge_splits is None else "time" if first_times is not None else "random"),
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
    elif "rows_without_timestamp" in csr_build:
        report["edges"]["rows_without_timestamp"] = csr_build.pop("rows_without_timestamp")
    report["csr_build"] = csr_build
    report["peak_rss_gb"] = peak_rss_gb()
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


# --- the passes' tasks (module level: an engine may run them in another process) -------------

def _concat(parts: list[pl.DataFrame]) -> pl.DataFrame:
    return parts[0] if len(parts) == 1 else pl.concat(parts)


def _kept(shard: Shard, spec: GraphIngestSpec) -> pl.LazyFrame:
    """The shard's usable edges (after the first pass checked them)."""
    edges = edge_frame(spec, shard.files, shard.offset, check=False)
    return edges.frame.filter(pl.col("reason").is_null())


def _count_edges(shard: Shard, spec: GraphIngestSpec) -> tuple[pl.DataFrame, list[str]]:
    """The parse checks, then rows by drop reason (and edge type); and the drop reasons."""
    edges = edge_frame(spec, shard.files, shard.offset)
    keys = ["reason"] + (["edge_type"] if spec.edges.edge_type else [])
    return (edges.frame.group_by(keys).agg(pl.len().alias("n")).collect(engine="streaming"),
            edges.reasons)


def _first_seen(shard: Shard, spec: GraphIngestSpec) -> pl.DataFrame:
    """``id, pos``: each endpoint's first position in the shard (2 * row, + 1 for dst)."""
    kept = _kept(shard, spec)
    endpoints = pl.concat([
        kept.select(pl.col("src").alias("id"), (pl.col(ROW).cast(pl.Int64) * 2).alias("pos")),
        kept.select(pl.col("dst").alias("id"), (pl.col(ROW).cast(pl.Int64) * 2 + 1).alias("pos")),
    ])
    return endpoints.group_by("id").agg(pl.col("pos").min()).collect(engine="streaming")


def _merge_first_seen(parts: list[pl.DataFrame]) -> pl.DataFrame:
    if len(parts) == 1:
        return parts[0]
    return pl.concat(parts).group_by("id").agg(pl.col("pos").min())


def _remap(shard: Shard, shared) -> pl.DataFrame:
    """The shard's usable edges as dense ids ``s, d`` (null: not in the id map) with their
    weight and time, in input order."""
    return _remapped(shard, *shared).collect(engine="streaming")


def _remapped(shard: Shard, spec: GraphIngestSpec, ids: pl.DataFrame) -> pl.LazyFrame:
    """:func:`_remap`'s query."""
    lookup = ids.lazy()
    joined = (_kept(shard, spec)
              .join(lookup.rename({"id": "src", "dense": "s"}), on="src", how="left",
                    maintain_order="left")
              .join(lookup.rename({"id": "dst", "dense": "d"}), on="dst", how="left",
                    maintain_order="left"))
    cols = ["s", "d"] + (["weight"] if spec.edges.weight else []) + (
        ["time"] if spec.edges.timestamp else [])
    return joined.select(cols)


# --- where the job runs ----------------------------------------------------------------------

def peak_rss_gb() -> float:
    """This process's peak resident memory so far, GiB (``ru_maxrss``; Ray workers not in it)."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)


def _external_csr(spec: GraphIngestSpec, parts: list[Path], num_nodes: int, scratch: Path,
                  budget: int, bar: tqdm):
    """The CSR of edges too many to sort in memory: the shards' remapped edges (``parts``:
    parquet files Polars' streaming engine wrote, deleted once read) read back a batch at a time
    into :func:`csr_from_edge_chunks`. Returns its four results, the rows with an endpoint not
    in the id map (dropped), and the rows without a timestamp."""
    g = spec.graph
    tally = {"missing": 0, "no_time": 0}
    cols = ["s", "d"] + (["weight"] if spec.edges.weight else []) + (
        ["time"] if spec.edges.timestamp else [])

    def chunks():
        for path in parts:
            for batch in read_batches([path], cols, batch_size=1 << 22):
                frame = pl.from_arrow(batch)
                ok = frame.filter(pl.col("s").is_not_null() & pl.col("d").is_not_null())
                tally["missing"] += frame.height - ok.height
                if spec.edges.timestamp:  # counted among the kept rows, as in memory
                    tally["no_time"] += int(ok["time"].is_nan().fill_null(True).sum())
                yield (ok["s"].to_numpy(), ok["d"].to_numpy(),
                       ok["weight"].to_numpy() if spec.edges.weight else None)
            path.unlink()

    built = csr_from_edge_chunks(
        chunks(), num_nodes, scratch / "csr", weighted=spec.edges.weight is not None,
        undirected=not g.directed, self_loops=g.self_loops, duplicates=g.duplicates,
        memory_budget=budget, progress=lambda msg: bar.set_postfix_str(msg, refresh=True))
    return (*built, tally["missing"], tally["no_time"])


def _id_map(first: pl.DataFrame, table: Optional[NodeTable], spec: GraphIngestSpec
            ) -> pl.DataFrame:
    """``id -> dense``: node-table ids in table order, then other endpoints by first appearance
    (``first``: each endpoint's first position)."""
    id_type = pl.Int64 if spec.id_type is ValueType.INTEGER else pl.String
    found = first.lazy()
    if table is not None:
        known = pl.DataFrame({"id": table.ids.cast(id_type)})
        found = found.join(known.lazy(), on="id", how="anti")
    extra = found.sort("pos").select("id").collect(engine="streaming")
    head = pl.DataFrame({"id": table.ids.cast(id_type)}) if table is not None else (
        pl.DataFrame(schema={"id": id_type}))
    ids = pl.concat([head, extra.select(pl.col("id").cast(id_type))])
    return ids.with_row_index("dense").with_columns(pl.col("dense").cast(pl.Int64))


def _first_times(edges: pl.LazyFrame, directed: bool, n: int) -> pl.DataFrame:
    """``k, t``: the first time of every distinct edge (key ``min * N + max`` undirected, ``src *
    N + dst`` directed) among ``edges`` (columns ``s, d, time``; NaN times count as the oldest),
    by Polars' streaming engine."""
    s, d = pl.col("s").cast(pl.Int64), pl.col("d").cast(pl.Int64)
    key = s * n + d if directed else pl.min_horizontal(s, d) * n + pl.max_horizontal(s, d)
    time = pl.col("time").cast(pl.Float64).fill_nan(-np.inf).fill_null(-np.inf)
    return (edges.select(key.alias("k"), time.alias("t"))
            .group_by("k").agg(pl.col("t").min()).collect(engine="streaming"))


def _pair_times(first: pl.DataFrame, indptr: np.ndarray, indices: np.ndarray, directed: bool,
                n: int) -> np.ndarray:
    """The first time of every :func:`edge_pairs` edge (``first``: :func:`_first_times`)."""
    ps, pd = edge_pairs(indptr, indices, directed)
    pairs = pl.DataFrame({"k": ps * np.int64(n) + pd})
    return pairs.join(first, on="k", how="left", maintain_order="left")["t"].fill_null(
        -np.inf).to_numpy()


def _no_edges(files: Sequence[Path], rows_read: int, dropped: dict[str, int],
              merged: int) -> None:
    """A graph without edges after cleaning is no graph to train on: one line with what was
    dropped, by reason."""
    where = files[0] if len(files) == 1 else f"{files[0]} (+{len(files) - 1} files)"
    counts = ", ".join(f"{k} {v:,}" for k, v in dropped.items() if v) or "none"
    if merged:
        counts += f"; duplicates merged {merged:,}"
    hint = {"self_loop": "; graph.self_loops: keep keeps self-loops",
            "invalid_weight": "; weights must be finite numbers > 0",
            "edge_type_not_selected": "; edges.edge_types lists the types kept",
            "endpoint_not_in_node_table": "; nodes.missing_nodes: add keeps such edges"}
    top = max(dropped, key=lambda k: dropped[k]) if any(dropped.values()) else None
    raise IngestError(f"{where}: no edges left after cleaning ({rows_read:,} rows read; dropped: "
                      f"{counts}); a graph needs at least one edge{hint.get(top, '')}")


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
