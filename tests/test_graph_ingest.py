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
from pipelines import kind_of
from pipelines.core.errors import IngestError
from pipelines.graph.passes import ingest as ingest_graph
from pipelines.graph.spec import load_spec as load_graph_spec

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
    assert kind_of(path) == "graph"
    assert kind_of(ROOT / "configs" / "ingest" / "criteo.yaml") == "tabular"
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


# --- node splits ---------------------------------------------------------------------------------

SPLIT_SPEC = """
kind: graph
name: tiny
id_type: {id_type}
edges: {{format: csv, src: src, dst: dst, weight: w}}
nodes: {{format: {fmt}, id: id, features: [f1, f2], label: label}}
split: {split}
"""
# u1 train, u2 valid, u3 test, u4 train but unlabelled, u5 a value listed nowhere; u9 (from
# the edges) has no row
PARTS = ["train", "valid", "test", "train", "extra"]


def run_split(tmp_path: Path, split: str, fmt: str = "csv", parts=PARTS, nodes=NODES,
              id_type: str = "string") -> tuple[dict, Path]:
    (tmp_path / "spec.yaml").write_text(SPLIT_SPEC.format(fmt=fmt, split=split, id_type=id_type))
    e, _ = inputs(tmp_path, "csv")
    columns = {"id": [r[0] for r in nodes], "f1": [r[1] for r in nodes],
               "f2": [r[2] for r in nodes], "label": [r[3] for r in nodes], "part": parts}
    n = write_table(tmp_path / f"nodes.{fmt}", columns, fmt)
    out = tmp_path / "out"
    return ingest_graph(load_graph_spec(tmp_path / "spec.yaml"), [e], out, nodes=[n]), out


def split_lists(out: Path) -> dict[str, list[str]]:
    """The stored node splits as original ids."""
    g = load_graph(out)
    ids = pl.read_parquet(g.id_map)["id"].to_list()
    return {k: [ids[i] for i in v] for k, v in g.splits.items()}


def accounted(report: dict) -> bool:
    s = report["splits"]
    return (sum(s["nodes"].values()) + sum(s["nodes_in_no_split"].values())
            == report["nodes"]["num_nodes"])


def test_random_split_is_the_default_and_unchanged(tmp_path):
    """The shipped behaviour: the same nodes as before splits could be chosen (issue 13)."""
    report, out = run(tmp_path)
    g = load_graph(out)
    assert {k: v.tolist() for k, v in g.splits.items()} == {"train": [1, 4], "valid": [2],
                                                             "test": [0]}
    s = report["splits"]
    assert s["node_split_method"] == "random" and s["nodes_in_no_split"] == {"unlabelled": 2}
    assert accounted(report)
    (tmp_path / "b").mkdir()
    _, out2 = run_split(tmp_path / "b", "{method: random, valid_fraction: 0.25, "
                        "test_fraction: 0.25}")
    assert split_lists(out2) == split_lists(out)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_split_column(tmp_path, fmt):
    report, out = run_split(tmp_path, "{method: column, column: part}", fmt)
    assert split_lists(out) == {"train": ["u1"], "valid": ["u2"], "test": ["u3"]}
    s = report["splits"]
    assert s["nodes"] == {"train": 1, "valid": 1, "test": 1}
    assert s["nodes_in_no_split"] == {"not_in_node_table": 1, "null_value": 0,
                                      "value_not_listed": 1, "unlabelled": 1}
    assert s["unlisted_values"] == {"extra": 1} and accounted(report)
    assert json.loads((out / "ingest_report.json").read_text())["splits"] == s


def test_split_column_values_lists_and_numbers(tmp_path):
    """``values`` maps a split to one value or a list; numbers match the column's text."""
    parts = [0, 1, 2, 1, 5]  # an integer column in parquet
    nodes = [NODES[0], NODES[1], NODES[2], ("u4", 0.4, 4.0, "b"), NODES[4]]
    report, out = run_split(tmp_path, "{method: column, column: part, values: {train: [0, 5], "
                            "valid: 1}}", "parquet", parts=parts, nodes=nodes)
    assert split_lists(out) == {"train": ["u1", "u5"], "valid": ["u2", "u4"]}  # test: absent
    assert report["splits"]["nodes"]["test"] == 0
    assert report["splits"]["unlisted_values"] == {"2": 1} and accounted(report)


@pytest.mark.parametrize("kind", ["csv", "parquet", "npy"])
def test_split_id_files(tmp_path, kind):
    lists = {"train": ["u1", "u3", "u1", "u4"], "valid": ["u2"], "test": ["u9", "u5"]}
    for split, ids in lists.items():
        path = tmp_path / f"{split}.{kind}"
        if kind == "npy":
            np.save(path, np.array(ids))
        else:
            write_table(path, {"node": ids}, kind)
    split = ("{method: ids, id_column: node, files: {train: train.KIND, valid: valid.KIND, "
             "test: test.KIND}}").replace("KIND", kind)  # relative to the spec's folder
    report, out = run_split(tmp_path, split)
    # u4 and u9 have no label: dropped from their splits, counted
    assert split_lists(out) == {"train": ["u1", "u3"], "valid": ["u2"], "test": ["u5"]}
    s = report["splits"]
    assert s["nodes_in_no_split"] == {"not_listed": 0, "unlabelled": 2} and accounted(report)
    files = s["node_split_files"]
    assert files["train"] == {"file": str(tmp_path / f"train.{kind}"), "rows_read": 4,
                              "duplicates": 1, "unlabelled": 1}
    assert all(f["rows_read"] == s["nodes"][k] + f["duplicates"] + f["unlabelled"]
               for k, f in files.items())


def test_split_id_files_integer_ids(tmp_path):
    """Integer ids: a .npy of the original ids and a CSV, through the same remap as the edges."""
    (tmp_path / "e.csv").write_text("s,d\n70,30\n30,50\n50,10\n10,70\n")
    np.save(tmp_path / "train.npy", np.array([10, 70, 50], dtype=np.int32))
    (tmp_path / "test.csv").write_text("id\n30\n")
    (tmp_path / "s.yaml").write_text(
        "kind: graph\nid_type: integer\nedges: {src: s, dst: d}\n"
        f"split: {{method: ids, files: {{train: {tmp_path / 'train.npy'}, test: test.csv}}}}\n")
    report = ingest_graph(load_graph_spec(tmp_path / "s.yaml"), [tmp_path / "e.csv"],
                          tmp_path / "out")
    g = load_graph(tmp_path / "out")
    assert pl.read_parquet(g.id_map)["id"].to_list() == [70, 30, 50, 10]
    assert {k: v.tolist() for k, v in g.splits.items()} == {"train": [0, 2, 3], "test": [1]}
    assert report["splits"]["nodes"] == {"train": 3, "valid": 0, "test": 1}
    assert report["splits"]["node_split_over"] == "all nodes"
    assert "warnings" not in report  # no labels: no node classification to warn about


@pytest.mark.parametrize("kind", ["csv", "npy"])
def test_unknown_id_in_an_id_file(tmp_path, kind):
    path = tmp_path / f"train.{kind}"
    if kind == "npy":
        np.save(path, np.array(["u1", "u7", "u8"]))
    else:
        write_table(path, {"id": ["u1", "u7", "u8"]}, "csv")
    with pytest.raises(IngestError) as err:
        run_split(tmp_path, f"{{method: ids, files: {{train: train.{kind}}}}}")
    where = "position 1" if kind == "npy" else "line 3"
    assert str(err.value) == (f"{path}: {where}: id 'u7' is not a node of the graph (2 of 3 ids "
                              "unknown; ids are compared as strings) (split.files.train)")
    assert not (tmp_path / "out" / "metadata.json").exists()


def test_id_in_two_split_files(tmp_path):
    write_table(tmp_path / "a.csv", {"id": ["u1", "u2"]}, "csv")
    write_table(tmp_path / "b.csv", {"id": ["u3", "u2"]}, "csv")
    with pytest.raises(IngestError, match=r"b\.csv: line 3: id 'u2' is also in the train id "
                                          r"file \(.*a\.csv\); a node belongs to one split"):
        run_split(tmp_path, "{method: ids, files: {train: a.csv, test: b.csv}}")


def test_empty_valid_split_is_omitted_and_warned(tmp_path, capsys):
    report, out = run_split(tmp_path, "{method: random, valid_fraction: 0, test_fraction: 0.25}")
    g = load_graph(out)
    assert set(g.splits) == {"train", "test"}
    assert set(json.loads((out / "metadata.json").read_text())["splits"]) == {"train", "test"}
    assert report["splits"]["nodes"]["valid"] == 0 and accounted(report)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: node split valid is empty "
                                                   "(split.valid_fraction: 0.0); ")
    assert report["warnings"] == [err[len("warning: "):].rstrip("\n")]


def test_empty_valid_and_test_from_a_column(tmp_path, capsys):
    report, out = run_split(tmp_path, "{method: column, column: part, values: {train: train}}")
    assert set(load_graph(out).splits) == {"train"}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "warning: node splits valid and test are empty (split.values.valid: not given; "
        "split.values.test: not given); written without them")
    report, out = run_split(tmp_path, "{method: column, column: part, values: {train: train, "
                            "valid: [valid, val], test: [exam]}}")
    assert set(load_graph(out).splits) == {"train", "valid"}
    assert "(no labelled node has split.values.test ['exam'] in column part)" in (
        capsys.readouterr().err)


def test_empty_train_split_is_refused(tmp_path, capsys):
    with pytest.raises(IngestError) as err:  # 4 labelled nodes: 2 valid, 2 test
        run_split(tmp_path, "{valid_fraction: 0.45, test_fraction: 0.45}")
    assert str(err.value) == ("split.valid_fraction + split.test_fraction (0.45 + 0.45) leave no "
                              "training nodes of the 4 labelled; lower them")
    with pytest.raises(IngestError, match=r"nodes\.csv: column part: no labelled node has a "
                                          r"split\.values\.train value \['training'\]"):
        run_split(tmp_path, "{method: column, column: part, values: {train: training, "
                            "valid: valid}}")
    write_table(tmp_path / "v.csv", {"id": ["u2"]}, "csv")
    with pytest.raises(IngestError, match="split.files.train: not given; node classification"):
        run_split(tmp_path, "{method: ids, files: {valid: v.csv}}")
    assert not (tmp_path / "out" / "metadata.json").exists()
    assert capsys.readouterr().err == ""


def test_split_spec_errors_name_the_key(tmp_path):
    path = tmp_path / "s.yaml"
    cases = [
        ("split: {method: column}", "nodes: {id: id}", "split.column: method: column needs"),
        ("split: {method: column, column: c}", "", "split.method: column needs a nodes: section"),
        ("split: {method: column, column: c, values: {training: [a]}}", "nodes: {id: id}",
         "split.values.training: not a split"),
        ("split: {method: column, column: c, values: {train: [a], test: a}}", "nodes: {id: id}",
         "split.values.test: value 'a' is also listed under train"),
        ("split: {method: column, column: id}", "nodes: {id: id}",
         "nodes: a column is named twice"),
        ("split: {column: c}", "", r"split.column: only for split.method: column \(method is "
                                   r"random\)"),
        ("split: {files: {train: a.csv}}", "", "split.files.train: only for split.method: ids"),
        ("split: {method: ids}", "", "split.files: method: ids needs at least one"),
        ("split: {method: ids, files: {train: a.json}}", "", r"split.files.train: .*a\.json: "
                                                            "expected a .parquet, .csv"),
        ("split: {method: column, column: c, values: {train: {a: 1}}}", "nodes: {id: id}",
         "split.values.train: expected a list, got dict"),
        ("split: {method: mask}", "", "split.method: 'mask' is not one of random, column, ids"),
    ]
    for split, nodes, words in cases:
        path.write_text(f"kind: graph\n{nodes}\n{split}\n")
        with pytest.raises(ConfigError, match=words):
            load_graph_spec(path)


def test_split_overrides_on_the_command_line(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("kind: graph\nnodes: {id: id}\nsplit: {method: column, column: c}\n")
    spec = load_graph_spec(path, ["split.values.train=[1, 2]", "split.values.valid=3"])
    assert spec.split.values == {"train": ["1", "2"], "valid": ["3"]}


def test_missing_id_file_is_reported_before_reading(tmp_path):
    write_table(tmp_path / "t.csv", {"id": ["u1"]}, "csv")
    with pytest.raises(IngestError, match=r"nope\.npy: id file not found \(split\.files\.test\)"):
        run_split(tmp_path, "{method: ids, files: {train: t.csv, test: nope.npy}}")


def test_cli_warns_and_refuses_in_one_line(tmp_path, capsys):
    (tmp_path / "spec.yaml").write_text(SPLIT_SPEC.format(
        fmt="csv", id_type="string", split="{valid_fraction: 0.0, test_fraction: 0.25}"))
    e, n = inputs(tmp_path, "csv")
    args = ["ingest", str(tmp_path / "spec.yaml"), "--input", str(e), "--nodes", str(n),
            "--quiet", "--out"]
    assert main([*args, str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "node split valid is empty" in err
    assert main([*args, str(tmp_path / "out2"), "--set", "split.test_fraction=0.9",
                 "--set", "split.valid_fraction=0.05"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("embedtrain ingest: error: split.valid_fraction")


def test_shipped_split_column_spec_runs(tmp_path):
    spec = load_graph_spec(ROOT / "configs" / "ingest" / "graph_split_column.yaml")
    (tmp_path / "edges.csv").write_text("src,dst\np1,p2\np2,p3\np3,p4\np4,p1\n")
    (tmp_path / "nodes.csv").write_text(
        "id,f1,f2,f3,f4,label,split\np1,1,0,0,0,A,train\np2,0,1,0,0,B,val\n"
        "p3,0,0,1,0,A,train\np4,0,0,0,1,B,test\n")
    report = ingest_graph(spec, [tmp_path / "edges.csv"], tmp_path / "out",
                          nodes=[tmp_path / "nodes.csv"])
    assert report["splits"]["nodes"] == {"train": 2, "valid": 1, "test": 1}
    assert split_lists(tmp_path / "out") == {"train": ["p1", "p3"], "valid": ["p2"],
                                             "test": ["p4"]}
