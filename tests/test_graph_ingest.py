"""``embedtrain ingest`` with graph specs: exact counts, the id remap, policies and bad input.

Hand-written edge lists of a few rows (CSV and parquet, string and integer ids) so that every
count in the report can be asserted exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedtrain.cli import main
from embedtrain.config import ConfigError
from embedtrain.graph.store import load_graph
from pipelines.graph import ingest_graph
from pipelines.graph_spec import is_graph_spec, load_graph_spec
from pipelines.sources import IngestError

ROOT = Path(__file__).resolve().parent.parent

# src, dst, w: two repeats of u1-u2 (one reversed), a self-loop, a null endpoint, an endpoint
# (u9) missing from the node table, an invalid weight.
EDGES = [("u1", "u2", 1.0), ("u2", "u1", 2.0), ("u2", "u3", 1.0), ("u3", "u3", 1.0),
         ("u1", "u2", 1.0), (None, "u3", 1.0), ("u4", "u9", 1.0), ("u3", "u1", -1.0)]
NODES = [("u1", 0.1, 1.0, "a"), ("u2", 0.2, None, "b"), ("u3", 0.3, 3.0, "a"),
         ("u4", 0.4, 4.0, None), ("u5", 0.5, 5.0, "b")]

SPEC = """
kind: graph
name: tiny
edges: {{format: {fmt}, src: src, dst: dst, weight: w}}
nodes: {{format: {fmt}, id: id, features: [f1, f2], label: label, missing_nodes: {missing}}}
graph: {{directed: {directed}, self_loops: drop, duplicates: {duplicates}}}
split: {{valid_fraction: 0.25, test_fraction: 0.25}}
"""


def write_table(path: Path, columns: dict[str, list], fmt: str) -> Path:
    if fmt == "parquet":
        pq.write_table(pa.table(columns), path)
    else:
        names = list(columns)
        rows = zip(*columns.values())
        lines = [",".join(names)] + [",".join("" if v is None else str(v) for v in r) for r in rows]
        path.write_text("\n".join(lines) + "\n")
    return path


def inputs(tmp_path: Path, fmt: str, edges=EDGES, nodes=NODES) -> tuple[Path, Path]:
    e = write_table(tmp_path / f"edges.{fmt}", {"src": [r[0] for r in edges],
                                                 "dst": [r[1] for r in edges],
                                                 "w": [r[2] for r in edges]}, fmt)
    n = write_table(tmp_path / f"nodes.{fmt}", {"id": [r[0] for r in nodes],
                                                 "f1": [r[1] for r in nodes],
                                                 "f2": [r[2] for r in nodes],
                                                 "label": [r[3] for r in nodes]}, fmt)
    return e, n


def run(tmp_path: Path, fmt: str = "csv", missing: str = "add", directed: bool = False,
        duplicates: str = "drop", **kw) -> tuple[dict, Path]:
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(SPEC.format(fmt=fmt, missing=missing, directed=str(directed).lower(),
                                     duplicates=duplicates))
    e, n = inputs(tmp_path, fmt, **kw)
    out = tmp_path / "out"
    return ingest_graph(load_graph_spec(spec_path), [e], out, nodes=[n]), out


def stored_edges(out: Path) -> list[tuple]:
    """The CSR as (original src, original dst, weight), one per entry."""
    g = load_graph(out)
    ids = pl.read_parquet(g.id_map)["id"].to_list()
    rows = np.repeat(np.arange(g.num_nodes), g.degrees())
    w = g.weights if g.weights is not None else np.ones(g.num_edges)
    return sorted((ids[c], ids[r], float(x)) for r, c, x in zip(rows, g.indices, w))


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_undirected_counts_and_remap(tmp_path, fmt):
    report, out = run(tmp_path, fmt)
    e, n = report["edges"], report["nodes"]
    assert e["rows_read"] == 8
    assert e["rows_dropped"] == {"null_endpoint": 1, "invalid_weight": 1,
                                 "endpoint_not_in_node_table": 0, "self_loop": 1, "duplicate": 2}
    assert e["edges_stored"] == 3 and e["csr_entries"] == 6
    assert e["rows_read"] == e["rows_dropped_total"] + e["duplicates_merged"] + e["edges_stored"]
    assert n["num_nodes"] == 6 and n["from_node_table"] == 5 and n["added_from_edges"] == 1
    assert n["endpoints_not_in_node_table"] == 1 and n["isolated"] == 1  # u5
    assert n["feature_nulls_filled"] == {"f2": 1} and n["labelled"] == 4
    # both directions of each kept edge; the first weight of u1-u2 wins
    assert stored_edges(out) == sorted([("u1", "u2", 1.0), ("u2", "u1", 1.0), ("u2", "u3", 1.0),
                                        ("u3", "u2", 1.0), ("u4", "u9", 1.0), ("u9", "u4", 1.0)])
    g = load_graph(out)
    assert pl.read_parquet(g.id_map)["id"].to_list() == ["u1", "u2", "u3", "u4", "u5", "u9"]
    assert g.labels.tolist() == [0, 1, 0, -1, 1, -1] and g.meta["classes"] == ["a", "b"]
    np.testing.assert_allclose(g.features, [[0.1, 1], [0.2, 0], [0.3, 3], [0.4, 4], [0.5, 5],
                                            [0, 0]], rtol=1e-6)
    labelled = np.concatenate([g.splits[s] for s in ("train", "valid", "test")])
    assert sorted(labelled.tolist()) == [0, 1, 2, 4]  # labelled nodes only, each once
    report_file = json.loads((out / "ingest_report.json").read_text())
    assert report_file["edges"] == e and g.meta["ingest_report"]["edges"] == e


def test_directed_keeps_reversed_edges_apart(tmp_path):
    report, out = run(tmp_path, directed=True)
    e = report["edges"]
    assert e["rows_dropped"]["duplicate"] == 1 and e["edges_stored"] == 4
    assert e["csr_entries"] == 4
    assert stored_edges(out) == sorted([("u1", "u2", 1.0), ("u2", "u1", 2.0), ("u2", "u3", 1.0),
                                        ("u4", "u9", 1.0)])
    g = load_graph(out)
    assert g.directed and g.indices[g.indptr[2]:g.indptr[3]].tolist() == [1]  # u3 <- u2


@pytest.mark.parametrize("duplicates, expected", [
    ("sum", [("u1", "u2", 4.0), ("u2", "u1", 4.0)]),
    ("keep", [("u1", "u2", 1.0), ("u1", "u2", 1.0), ("u1", "u2", 2.0),
              ("u2", "u1", 1.0), ("u2", "u1", 1.0), ("u2", "u1", 2.0)]),
])
def test_duplicate_policies(tmp_path, duplicates, expected):
    report, out = run(tmp_path, duplicates=duplicates)
    e = report["edges"]
    pairs = [t for t in stored_edges(out) if {t[0], t[1]} == {"u1", "u2"}]
    assert pairs == sorted(expected)
    assert e["duplicates_merged"] == (2 if duplicates == "sum" else 0)
    assert e["duplicates_kept"] == (2 if duplicates == "keep" else 0)
    assert e["rows_dropped"]["duplicate"] == 0
    assert e["rows_read"] == e["rows_dropped_total"] + e["duplicates_merged"] + e["edges_stored"]


def test_missing_nodes_drop(tmp_path):
    report, out = run(tmp_path, missing="drop")
    assert report["edges"]["rows_dropped"]["endpoint_not_in_node_table"] == 1
    assert report["nodes"]["num_nodes"] == 5 and report["nodes"]["added_from_edges"] == 0
    assert ("u4", "u9", 1.0) not in stored_edges(out)


def test_edge_type_filter(tmp_path):
    (tmp_path / "e.csv").write_text("s,d,kind\na,b,follows\nb,c,blocks\nc,d,\nd,a,follows\n")
    (tmp_path / "s.yaml").write_text(
        "kind: graph\nedges: {src: s, dst: d, edge_type: kind, edge_types: [follows]}\n")
    report = ingest_graph(load_graph_spec(tmp_path / "s.yaml"), [tmp_path / "e.csv"],
                          tmp_path / "out")
    e = report["edges"]
    assert e["rows_dropped"]["edge_type_not_selected"] == 2 and e["edges_stored"] == 2
    assert e["rows_by_edge_type"] == {"follows": 2, "blocks": 1, "None": 1}
    assert report["nodes"]["num_nodes"] == 3  # a, b, d: c only in dropped edges


def test_integer_ids_edges_only_with_time_split(tmp_path):
    """Parquet int64 ids, no node table: ids by first appearance; the newest edges held out."""
    edges = pa.table({"a": pa.array([70, 30, 30, 50, 10, 70], pa.int64()),
                      "b": pa.array([30, 50, 10, 10, 70, 30], pa.int64()),
                      "t": pa.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])})
    pq.write_table(edges, tmp_path / "e.parquet")
    (tmp_path / "s.yaml").write_text(
        "kind: graph\nid_type: integer\nedges: {format: parquet, src: a, dst: b, timestamp: t}\n"
        "split: {edge_valid_fraction: 0.25, edge_test_fraction: 0.25}\n")
    report = ingest_graph(load_graph_spec(tmp_path / "s.yaml"), [tmp_path / "e.parquet"],
                          tmp_path / "out")
    g = load_graph(tmp_path / "out")
    ids = pl.read_parquet(g.id_map)["id"]
    assert ids.dtype == pl.Int64 and ids.to_list() == [70, 30, 50, 10]
    assert report["edges"]["rows_dropped"]["duplicate"] == 1  # 30-70 again at t=6
    # pairs by first time: 70-30 (1), 30-50 (2), 30-10 (3), 50-10 (4), 10-70 (5)
    test = [sorted((ids[int(u)], ids[int(v)])) for u, v in g.edge_splits["test"].T]
    valid = [sorted((ids[int(u)], ids[int(v)])) for u, v in g.edge_splits["valid"].T]
    assert test == [[10, 70]] and valid == [[10, 50]]
    assert report["splits"]["edge_split_method"] == "time"
    assert g.num_edges == 2 * 3 and sum(len(s) for s in g.splits.values()) == 4


def test_list_feature_column_from_parquet(tmp_path):
    pq.write_table(pa.table({"s": ["x", "y"], "d": ["y", "z"]}), tmp_path / "e.parquet")
    pq.write_table(pa.table({"id": ["z", "y", "x"],
                             "emb": pa.array([[1.0, 2.0], None, [5.0, None]],
                                             pa.list_(pa.float32())),
                             "label": [2, 7, 2]}), tmp_path / "n.parquet")
    (tmp_path / "s.yaml").write_text(
        "kind: graph\nedges: {format: parquet, src: s, dst: d}\n"
        "nodes: {format: parquet, id: id, features: [emb], label: label}\n")
    report = ingest_graph(load_graph_spec(tmp_path / "s.yaml"), [tmp_path / "e.parquet"],
                          tmp_path / "out", nodes=[tmp_path / "n.parquet"])
    g = load_graph(tmp_path / "out")
    assert g.features.tolist() == [[1, 2], [0, 0], [5, 0]]
    assert report["nodes"]["feature_nulls_filled"] == {"emb": 2}
    assert g.labels.tolist() == [0, 1, 0] and g.meta["classes"] == [2, 7]


def test_shipped_graph_spec_runs(tmp_path):
    path = ROOT / "configs" / "ingest" / "graph_edges.yaml"
    assert is_graph_spec(path)
    assert not is_graph_spec(ROOT / "configs" / "ingest" / "criteo.yaml")
    spec = load_graph_spec(path)
    rng = np.random.default_rng(0)
    n, m = 200, 1_000
    src, dst = rng.integers(0, n, m), rng.integers(0, n, m)
    write_table(tmp_path / "edges.csv", {"src": [f"n{i}" for i in src],
                                         "dst": [f"n{i}" for i in dst],
                                         "weight": rng.random(m).round(3) + 0.1,
                                         "ts": np.arange(m)}, "csv")
    write_table(tmp_path / "nodes.csv", {"id": [f"n{i}" for i in range(n)],
                                         **{f"f{j}": rng.random(n).round(3) for j in range(1, 5)},
                                         "label": rng.integers(0, 3, n)}, "csv")
    report = ingest_graph(spec, [tmp_path / "edges.csv"], tmp_path / "out",
                          nodes=[tmp_path / "nodes.csv"])
    e = report["edges"]
    assert e["rows_read"] == m
    assert e["rows_read"] == e["rows_dropped_total"] + e["duplicates_merged"] + e["edges_stored"]
    assert e["held_out"]["valid"] == e["held_out"]["test"] > 0
    assert load_graph(tmp_path / "out").num_features == 4


# --- bad input -----------------------------------------------------------------------------------

def test_missing_file_and_column(tmp_path):
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(SPEC.format(fmt="csv", missing="add", directed="false",
                                     duplicates="drop"))
    spec = load_graph_spec(spec_path)
    e, n = inputs(tmp_path, "csv")
    with pytest.raises(IngestError, match="nowhere.csv: input file not found"):
        ingest_graph(spec, [tmp_path / "nowhere.csv"], tmp_path / "out", nodes=[n])
    e.write_text("src,dst\nu1,u2\n")
    with pytest.raises(IngestError, match=r"edges\.csv: missing column\(s\) w \(has: src, dst\)"):
        ingest_graph(spec, [e], tmp_path / "out", nodes=[n])
    with pytest.raises(IngestError, match="--nodes: the spec has a nodes: section"):
        ingest_graph(spec, [e], tmp_path / "out")


def test_unparsable_values_name_file_line_and_column(tmp_path):
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text("kind: graph\nid_type: integer\nedges: {src: s, dst: d, weight: w}\n")
    spec = load_graph_spec(spec_path)
    (tmp_path / "a.csv").write_text("s,d,w\n1,2,1.0\n2,3,1.0\n")
    (tmp_path / "b.csv").write_text("s,d,w\n1,2,1.0\n4,x7,1.0\n")
    with pytest.raises(IngestError) as err:
        ingest_graph(spec, [tmp_path / "a.csv", tmp_path / "b.csv"], tmp_path / "out")
    assert str(err.value) == (f"{tmp_path / 'b.csv'}: line 3: column d: cannot parse as an "
                              "integer id (id_type: integer) (value 'x7')")
    (tmp_path / "b.csv").write_text("s,d,w\n1,2,abc\n")
    with pytest.raises(IngestError, match=r"b\.csv: line 2: column w: cannot parse as a number"):
        ingest_graph(spec, [tmp_path / "a.csv", tmp_path / "b.csv"], tmp_path / "out")
    pq.write_table(pa.table({"s": ["1"], "d": ["2"], "w": [1.0]}), tmp_path / "c.parquet")
    spec.edges.format = spec.edges.format.__class__("parquet")
    with pytest.raises(IngestError, match="c.parquet: column s: expected integer values, got "):
        ingest_graph(spec, [tmp_path / "c.parquet"], tmp_path / "out")


def test_malformed_csv_names_the_file(tmp_path):
    (tmp_path / "s.yaml").write_text("kind: graph\nedges: {src: s, dst: d}\n")
    (tmp_path / "a.csv").write_text("s,d\n1,2\n")
    (tmp_path / "b.csv").write_text('s,d\n1,2\n"3,4\n')
    with pytest.raises(IngestError, match=r"b\.csv: cannot read: "):
        ingest_graph(load_graph_spec(tmp_path / "s.yaml"), [tmp_path / "a.csv",
                                                            tmp_path / "b.csv"], tmp_path / "o")


def test_duplicate_node_id(tmp_path):
    nodes = NODES + [("u2", 0.9, 0.9, "a")]
    with pytest.raises(IngestError, match=r"nodes\.csv: line 3 and line 7: column id: id 'u2' "
                                          "appears more than once"):
        run(tmp_path, nodes=nodes)


def test_spec_errors_name_the_key(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("kind: graph\nedges: {src: s, dst: d, edge_types: [a]}\n")
    with pytest.raises(ConfigError, match="edges.edge_types: needs edges.edge_type"):
        load_graph_spec(path)
    path.write_text("kind: graph\ngraph: {duplicates: merge}\n")
    with pytest.raises(ConfigError, match="graph.duplicates: 'merge' is not one of drop, keep"):
        load_graph_spec(path)


def test_progress_counts_phases_on_stderr(tmp_path, capsys):
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(SPEC.format(fmt="csv", missing="add", directed="false",
                                     duplicates="drop"))
    e, n = inputs(tmp_path, "csv")
    report = ingest_graph(load_graph_spec(spec_path), [e], tmp_path / "out", nodes=[n],
                          progress=True)
    out, err = capsys.readouterr()
    final = err.rstrip("\n").split("\r")[-1]  # the bar's final redraw
    k = len(report["phases"])
    assert out == "" and k >= 4 and "\n" not in final
    assert final.startswith(f"ingest graph: {k} phases [") and final.endswith(" s)")
    assert f"], {report['phases'][-1]['phase']} (" in final  # the last phase and its time


def test_cli(tmp_path, capsys):
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(SPEC.format(fmt="csv", missing="add", directed="false",
                                     duplicates="drop"))
    e, n = inputs(tmp_path, "csv")
    out = tmp_path / "out"
    assert main(["ingest", str(spec_path), "--input", str(e), "--nodes", str(n), "--out",
                 str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "6 nodes, 6 CSR entries (undirected)" in printed and "self_loop 1" in printed
    e.write_text("src,dst\n")
    assert main(["ingest", str(spec_path), "--input", str(e), "--nodes", str(n), "--out",
                 str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("embedtrain ingest: error: ") and "edges.csv: missing column" in err
    assert "\n" not in err
    assert main(["datagen", "graph", "--nodes", "500", "--avg-degree", "4", "--out",
                 str(tmp_path / "gen")]) == 0
    assert "500 nodes" in capsys.readouterr().out
    assert main(["datagen", "graph", "--nodes", "500", "--avg-degree", "0", "--out",
                 str(tmp_path / "gen")]) == 2
    assert "--avg-degree must be positive" in capsys.readouterr().err
