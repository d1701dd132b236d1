"""Node features on disk in float16 and node-id tables capped below the node count (issue 32).

- the generator and graph ingestion store float16 features (``feature_dtype``), the same values
  as float32 rounded; a value float16 cannot hold is refused in one line naming it;
- :func:`load_graph` checks the stored type against the metadata and advises the features' map
  for random reads; a batch reads the sampled rows and casts them to float32, exactly;
- a dynamic node-id table of fewer rows than nodes trains, and the plan counts its rows, not the
  nodes; the 100M-node config plans from a sizes-only data set.

The 2-rank == 1-rank step on float16 features is ``tests/test_gnn_task.py``'s.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import torch

from embedtrain.cli import main
from embedtrain.config import ConfigError, load_cluster, load_config
from embedtrain.datagen import GraphDataSpec, generate_graph
from embedtrain.features import DatasetError
from embedtrain.graph.store import (
    FeatureDtype, FeatureRangeError, advise_random_reads, load_graph, write_graph)
from pipelines.core.errors import IngestError
from pipelines.graph.passes import ingest as ingest_graph
from pipelines.graph.spec import load_spec as load_graph_spec

ROOT = Path(__file__).resolve().parent.parent
SPEC = GraphDataSpec(nodes=3_000, avg_degree=8, communities=4, seed=2)
F16, F32 = FeatureDtype.FLOAT16, FeatureDtype.FLOAT32


@pytest.fixture(scope="module")
def graphs(tmp_path_factory) -> dict[FeatureDtype, Path]:
    """The same synthetic graph with float32 and with float16 features."""
    root = tmp_path_factory.mktemp("half")
    for dtype in FeatureDtype:
        generate_graph(dataclasses.replace(SPEC, feature_dtype=dtype), root / dtype.value,
                       progress=False)
    return {d: root / d.value for d in FeatureDtype}


# --- the generator --------------------------------------------------------------------------

def test_generator_stores_the_float32_features_rounded_to_float16(graphs):
    g32, g16 = load_graph(graphs[F32]), load_graph(graphs[F16])
    assert g32.meta["feature_dtype"] == "float32" and g16.meta["feature_dtype"] == "float16"
    assert g16.meta["generator"]["spec"]["feature_dtype"] == "float16"
    assert g32.features.dtype == np.float32 and g16.features.dtype == np.float16
    assert np.array_equal(g16.features, g32.features.astype(np.float16))
    assert not np.array_equal(g16.features.astype(np.float32), g32.features)  # really rounded
    file = "nodes/features.npy"
    assert (graphs[F16] / file).stat().st_size < 0.51 * (graphs[F32] / file).stat().st_size
    for rel in ("graph/indptr.npy", "graph/indices.npy", "nodes/labels.npy",
                "splits/train_nodes.npy", "splits/test_nodes.npy"):  # the same graph otherwise
        assert (graphs[F16] / rel).read_bytes() == (graphs[F32] / rel).read_bytes(), rel


def test_generator_refuses_features_beyond_float16(tmp_path):
    spec = GraphDataSpec(nodes=200, avg_degree=4, feature_noise=1e5, feature_dtype=F16)
    with pytest.raises(ValueError, match=r"^GraphDataSpec\.feature_dtype: features: node 0, "
                                         r"column \d+: .* is outside float16's range") as err:
        generate_graph(spec, tmp_path / "g", progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "g" / "metadata.json").exists()
    with pytest.raises(ValueError, match=r"GraphDataSpec\.feature_dtype must be a FeatureDtype"):
        GraphDataSpec(feature_dtype="float16")


def test_cli_feature_dtype(tmp_path, capsys):
    out = tmp_path / "g"
    assert main(["datagen", "graph", "--nodes", "500", "--avg-degree", "4", "--feature-dtype",
                 "float16", "--out", str(out)]) == 0
    assert "32 float16 features" in capsys.readouterr().out
    assert load_graph(out).features.dtype == np.float16
    assert main(["datagen", "graph", "--nodes", "500", "--feature-dtype", "bfloat16", "--out",
                 str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--feature-dtype: expected one of float32, float16, got 'bfloat16'")
    assert "\n" not in err
    assert load_graph(out).features.dtype == np.float16  # the earlier data set is untouched


# --- the store and the collate ----------------------------------------------------------------

def test_a_batch_reads_the_float16_rows_as_float32(graphs):
    from embedtrain.graph.batch import node_batch
    from embedtrain.graph.sampler import NeighborSampler

    batches = {}
    for dtype in FeatureDtype:
        g = load_graph(graphs[dtype])
        sampler = NeighborSampler(g.indptr, g.indices, [5, 5], seed=0)
        batches[dtype] = node_batch(g.splits["train"][:64], np.random.default_rng(0), sampler, g)
    b32, b16 = batches[F32], batches[F16]
    assert torch.equal(b16.blocks.n_id, b32.blocks.n_id) and b16.num_nodes > 64
    assert b16.features.dtype == torch.float32
    # exactly the float32 features rounded to float16 (every float16 is a float32)
    assert torch.equal(b16.features, b32.features.half().float())
    assert 0 < float((b16.features - b32.features).abs().max()) <= 2**-11 * float(
        b32.features.abs().max())


def test_load_graph_advises_random_reads_of_the_features(graphs, monkeypatch):
    from embedtrain.graph import store

    advised = []
    monkeypatch.setattr(store, "advise_random_reads", lambda a: advised.append(a) or True)
    g = load_graph(graphs[F16])
    assert len(advised) == 1 and advised[0] is g.features
    monkeypatch.undo()
    mapped = np.load(graphs[F16] / "nodes/features.npy", mmap_mode="r")
    assert advise_random_reads(mapped) == hasattr(mmap, "MADV_RANDOM")
    assert not advise_random_reads(np.zeros((2, 2), np.float16))  # not a map: nothing to advise


def _tiny(root: Path, features, dtype=None) -> Path:
    write_graph(root, np.array([0, 1, 2, 2]), np.array([1, 0], dtype=np.int32),
                features=features, feature_dtype=dtype)
    return root


def test_write_graph_refuses_a_value_float16_cannot_hold(tmp_path):
    ok = np.array([[65519.0, -np.inf], [np.nan, 0.1], [-65519.0, 1.0]])  # 65519 rounds to 65504
    g = load_graph(_tiny(tmp_path / "ok", ok, F16))
    assert g.features.dtype == np.float16 and g.meta["feature_dtype"] == "float16"
    assert g.features[0, 0] == 65504 and np.isinf(g.features[0, 1])
    assert np.isnan(g.features[1, 0]) and g.features[2, 0] == -65504
    bad = ok.copy()
    bad[2, 0] = -65520.0  # rounds to -inf
    with pytest.raises(FeatureRangeError, match=r"^features: node 2, column 0: -65520 is "
                                                r"outside float16's range \(\|x\| <= 65504\)$"):
        _tiny(tmp_path / "bad", bad, F16)
    assert not (tmp_path / "bad" / "metadata.json").exists()
    # None keeps float16 features float16 and makes anything else float32
    assert load_graph(_tiny(tmp_path / "keep", ok.astype(np.float16))).features.dtype == np.float16
    assert load_graph(_tiny(tmp_path / "f64", ok[:, 1:])).meta["feature_dtype"] == "float32"


@pytest.mark.parametrize("edit, words", [
    ({"feature_dtype": "float32"}, "features.npy: dtype float16, but metadata.json feature_dtype "
                                   "is float32"),
    ({"feature_dtype": "bfloat16"}, "metadata.json: feature_dtype: expected one of float32, "
                                    "float16, got 'bfloat16'"),
])
def test_load_graph_checks_the_feature_dtype(tmp_path, edit, words):
    root = _tiny(tmp_path / "g", np.ones((3, 2)), F16)
    meta = json.loads((root / "metadata.json").read_text())
    (root / "metadata.json").write_text(json.dumps({**meta, **edit}))
    with pytest.raises(DatasetError) as err:
        load_graph(root)
    assert str(err.value).startswith(str(root)) and words in str(err.value)
    assert "\n" not in str(err.value)
    del meta["feature_dtype"]  # a data set from before the key: its features load as they are
    (root / "metadata.json").write_text(json.dumps(meta))
    assert load_graph(root).features.dtype == np.float16


# --- ingestion ----------------------------------------------------------------------------------

INGEST_SPEC = """
kind: graph
edges: {{format: {fmt}, src: s, dst: d}}
nodes: {{format: {fmt}, id: id, features: {features}, feature_dtype: {dtype}}}
"""


def _ingest(tmp_path: Path, nodes: pa.Table, fmt: str = "csv", features: str = "[f1, f2]",
            dtype: str = "float16"):
    (tmp_path / "spec.yaml").write_text(INGEST_SPEC.format(fmt=fmt, features=features,
                                                           dtype=dtype))
    edges = pa.table({"s": ["a", "b", "c"], "d": ["b", "c", "x"]})  # x: not in the node table
    if fmt == "csv":
        pa_csv.write_csv(edges, tmp_path / "e.csv")
        pa_csv.write_csv(nodes, tmp_path / "n.csv")
    else:
        pq.write_table(edges, tmp_path / "e.parquet")
        pq.write_table(nodes, tmp_path / "n.parquet")
    report = ingest_graph(load_graph_spec(tmp_path / "spec.yaml"), [tmp_path / f"e.{fmt}"],
                          tmp_path / "out", nodes=[tmp_path / f"n.{fmt}"])
    return report, load_graph(tmp_path / "out")


def test_ingest_stores_float16_features(tmp_path):
    f1, f2 = [0.1, 0.2, 1e-5], [1.0, -3.5, 60000.0]
    _, g = _ingest(tmp_path, pa.table({"id": ["a", "b", "c"], "f1": f1, "f2": f2}))
    assert g.meta["feature_dtype"] == "float16" and g.features.dtype == np.float16
    want = np.array([f1, f2], dtype=np.float32).T.astype(np.float16)
    assert np.array_equal(g.features[:3], want) and g.features[3].tolist() == [0, 0]  # x: added
    assert g.meta["spec"]["nodes"]["feature_dtype"] == "float16"


def test_ingest_refuses_a_value_float16_cannot_hold(tmp_path, capsys):
    nodes = pa.table({"id": ["a", "b", "c"], "f1": [0.1, 0.2, 0.3], "f2": [1.0, 7e4, 2.0]})
    with pytest.raises(IngestError) as err:
        _ingest(tmp_path, nodes)
    assert str(err.value) == (f"{tmp_path / 'n.csv'}: column f2: node 'b': 70000 is outside "
                              "float16's range (|x| <= 65504); scale the column or set "
                              "nodes.feature_dtype: float32")
    assert not (tmp_path / "out" / "metadata.json").exists()
    assert main(["ingest", str(tmp_path / "spec.yaml"), "--input", str(tmp_path / "e.csv"),
                 "--nodes", str(tmp_path / "n.csv"), "--out", str(tmp_path / "cli"),
                 "--quiet"]) == 2
    err_text = capsys.readouterr().err.strip()
    assert "column f2: node 'b': 70000 is outside" in err_text and "\n" not in err_text
    # a list column names the position in the list; float32 keeps the value
    emb = pa.array([[1.0, 2.0], [3.0, -1e5], [0.0, 0.0]], pa.list_(pa.float32()))
    nodes = pa.table({"id": ["a", "b", "c"], "emb": emb})
    (tmp_path / "list").mkdir()
    with pytest.raises(IngestError, match=r"n\.parquet: column emb\[1\]: node 'b': -100000 is"):
        _ingest(tmp_path / "list", nodes, fmt="parquet", features="[emb]")
    _, g = _ingest(tmp_path / "list", nodes, fmt="parquet", features="[emb]", dtype="float32")
    assert g.features.dtype == np.float32 and g.features[1, 1] == -1e5


@pytest.mark.parametrize("nodes, words", [
    ("{id: id, features: [f1], feature_dtype: bfloat16}",
     "nodes.feature_dtype: 'bfloat16' is not one of float32, float16"),
    ("{id: id, feature_dtype: float16}",
     "nodes.feature_dtype: float16 but nodes.features names no feature columns"),
])
def test_ingest_spec_checks_the_feature_dtype(tmp_path, nodes, words):
    path = tmp_path / "spec.yaml"
    path.write_text(f"kind: graph\nedges: {{src: s, dst: d}}\nnodes: {nodes}\n")
    with pytest.raises(ConfigError) as err:
        load_graph_spec(path)
    assert str(err.value) == f"{path}: {words}"


# --- node-id tables that fit --------------------------------------------------------------------

CAPACITY = 500  # rows of the capped node-id table, for 3,000 nodes


def _gnn_cfg(data: Path, *overrides: str):
    return load_config(ROOT / "configs/gnn_node.yaml", [
        f"data.path={data}", "data.batch_size=256", "data.eval_batch_size=1024",
        "data.num_workers=0", "gnn.hidden=[32,32]", "gnn.embedding_dim=16",
        "train.eval_every=0", "train.checkpoint_every=0", "train.progress=false", *overrides])


def test_plan_counts_the_capped_rows_not_the_nodes(graphs):
    from embedtrain.recipes import plan_model

    cluster = load_cluster(ROOT / "configs/clusters/cpu-1x2.yaml")
    for tables, rows in (("[]", SPEC.nodes),
                         (f"[{{tables: [t_node], capacity: {CAPACITY}}}]", CAPACITY)):
        report = plan_model(_gnn_cfg(graphs[F16], f"tables={tables}"), cluster).report
        (table,) = report.tables
        assert (table.name, table.rows, table.dim) == ("t_node", rows, 16)
        assert table.weight_bytes == rows * 16 * 4, tables
        assert table.remap_bytes == (36 * rows if rows == CAPACITY else 0)


def test_the_100m_node_config_plans_from_sizes_only():
    """configs/gnn_node_100m.yaml: 100M nodes, a node-id table of 10M rows, float16 features."""
    from embedtrain.recipes import plan_model

    g = load_graph(ROOT / "configs/datasets/graph_100m")
    assert g.num_nodes == 100_000_000 and g.splits == {} and g.num_edges == 0
    assert g.features.dtype == np.float16 and g.features.nbytes == 100_000_000 * 64 * 2
    assert g.features.strides == (0, 0)  # zeros broadcast: no memory
    cluster = load_cluster(ROOT / "configs/clusters/a100-1x8.yaml")
    capped = plan_model(load_config(ROOT / "configs/gnn_node_100m.yaml"), cluster).report
    full = plan_model(load_config(ROOT / "configs/gnn_node_100m.yaml", ["tables=[]"]),
                      cluster).report
    (t_capped,), (t_full,) = capped.tables, full.tables
    assert t_capped.rows == 10_000_000 and t_full.rows == 100_000_000
    assert t_capped.weight_bytes == 10_000_000 * 32 * 4 and t_capped.remap_bytes == 36 * 10**7
    assert t_full.weight_bytes == 10 * t_capped.weight_bytes
    s = capped.summary
    assert s.peak_rank_memory_bytes <= s.rank_memory_capacity_bytes
    # the features are not placed by the planner: the report names their bytes apart
    assert capped.model["node_features"]["bytes"] == 100_000_000 * 64 * 2
    assert any("node features (100,000,000 x 64 float16" in w for w in capped.warnings)


@pytest.mark.slow
def test_a_capped_node_table_trains_on_float16_features(graphs, tmp_path):
    """3,000 nodes through a node-id table of 500 rows: nodes are admitted and evicted, the table
    holds 500 rows (on the model and in plan.json) and the model learns."""
    from embedtrain.recipes import build_run

    cfg = _gnn_cfg(graphs[F16], "train.max_steps=30",
                   f"tables=[{{tables: [t_node], capacity: {CAPACITY}}}]")
    run = build_run(cfg, tmp_path / "run")
    assert run.recipe.dataset.features.dtype == np.float16
    summary = run.trainer.fit(test_data=run.test_data)
    stats = summary["tables"]["t_node"]
    assert stats["capacity"] == CAPACITY and stats["evictions"] > 0
    assert stats["ids_admitted"] > CAPACITY  # more nodes than rows passed through
    (weight,) = [v for k, v in run.trainer.model.state_dict().items()
                 if k.endswith("t_node.weight")]
    rows = sum(s.tensor.shape[0] for s in weight.local_shards()) if hasattr(
        weight, "local_shards") else weight.shape[0]
    assert rows == CAPACITY
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    (entry,) = plan["tables"]
    assert entry["rows"] == CAPACITY and entry["weight_bytes"] == CAPACITY * 16 * 4
    assert summary["accuracy"] > 0.5, summary  # 4 classes: chance is ~0.25
