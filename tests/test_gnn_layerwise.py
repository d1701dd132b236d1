"""Layer-wise full-graph inference (issue 32): equal to the sampled model when the fanouts cover
every neighbour; a GNN export's per-node outputs are that inference, and predict looks them up."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import run_cli
from embedtrain.models.layerwise import layerwise_inference
from embedtrain.graph.sampler import NeighborSampler
from embedtrain.graph.store import load_graph
from embedtrain.models.gnn import GraphSAGE
from embedtrain.models.options import Aggregation, GNNModel
from embedtrain.testing import tiny_graph_dataset
from embedtrain.train.gnn import node_id_kjt


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    return load_graph(tiny_graph_dataset(tmp_path_factory.mktemp("graph"), nodes=300))


def _model(graph, aggr=Aggregation.MEAN, embedding_dim=8, kind=GNNModel.SAGE):
    torch.manual_seed(0)
    return GraphSAGE(graph.num_nodes, graph.num_features, embedding_dim, [16, 12], 5, aggr=aggr,
                     dropout=0.5, kind=kind)


def _sampled(model, graph, seeds):
    """The model's own forward on the seeds' sampled neighbourhoods, with fanouts larger than
    any degree (every neighbour is taken)."""
    fanout = int(np.diff(graph.indptr).max()) + 1
    blocks = NeighborSampler(graph.indptr, graph.indices, [fanout, fanout]).sample(seeds, step=0)
    assert blocks.num_sampled_edges > len(seeds)  # hops were sampled, not empty
    features = torch.from_numpy(np.asarray(graph.features[blocks.n_id.numpy()], np.float32))
    ids = node_id_kjt(blocks.n_id, len(blocks.n_id)) if model.ebc is not None else None
    model.eval()
    with torch.no_grad():
        return model(blocks, ids, features).numpy()


@pytest.mark.parametrize("aggr,kind", [*((a, GNNModel.SAGE) for a in Aggregation),
                                       (Aggregation.MEAN, GNNModel.GCN),
                                       (Aggregation.MEAN, GNNModel.GAT),
                                       (Aggregation.MEAN, GNNModel.APPNP)])
def test_layerwise_equals_the_sampled_model_when_fanouts_cover_every_neighbour(graph, aggr, kind):
    """Node table and features, 2 SAGE (GCN, GAT) layers, many chunks (of at most 200 entries
    and nodes)."""
    model = _model(graph, aggr, kind=kind)
    model.train()  # inference runs in eval mode (dropout 0.5 would show) and restores the mode
    seeds = np.arange(3, graph.num_nodes, 11)
    out = layerwise_inference(model, graph, chunk_entries=200)
    assert model.training and out.nodes is None
    assert out.outputs.shape == (graph.num_nodes, 5) and out.embeddings.shape == (300, 12)
    np.testing.assert_allclose(out.outputs[seeds], _sampled(model, graph, seeds), atol=1e-5,
                               rtol=0)
    np.testing.assert_allclose(model.out(torch.from_numpy(out.embeddings)).detach().numpy(),
                               out.outputs, atol=1e-6, rtol=0)


def test_appnp_is_an_mlp_then_personalised_pagerank_steps(graph):
    """APPNP with one MLP layer and 2 hops, against a dense reference: H = MLP(x), then twice
    Z <- (1 - alpha) D^-1 (A + I) Z + alpha H, then out(Z); sampled and layer-wise alike."""
    torch.manual_seed(0)
    model = GraphSAGE(graph.num_nodes, graph.num_features, 8, [16], 5, dropout=0.5,
                      kind=GNNModel.APPNP, hops=2, alpha=0.2).eval()
    n = graph.num_nodes
    with torch.no_grad():
        x = torch.cat([model.embed_nodes(torch.arange(n)),
                       torch.from_numpy(np.asarray(graph.features, np.float32))], dim=1)
        h = torch.relu(model.convs[0](x))
        a = torch.eye(n, dtype=torch.float64)
        rows = np.repeat(np.arange(n), np.diff(graph.indptr))
        np.add.at(a.numpy(), (rows, np.asarray(graph.indices)), 1.0)  # row v: v's sources
        a = (a / a.sum(dim=1, keepdim=True)).float()
        z = h
        for _ in range(2):
            z = 0.8 * a @ z + 0.2 * h
        expected = model.out(z).numpy()
    seeds = np.arange(0, n, 7)
    np.testing.assert_allclose(_sampled(model, graph, seeds), expected[seeds], atol=1e-5,
                               rtol=0)
    out = layerwise_inference(model, graph, chunk_entries=50)
    np.testing.assert_allclose(out.outputs, expected, atol=1e-5, rtol=0)
    assert out.embeddings.shape == (n, 16)


@pytest.fixture(scope="module")
def directed(tmp_path_factory):
    """A directed multigraph: row v lists the sources of the edges into v, self-loops and
    repeated edges kept; nodes 100..119 have no in-neighbours."""
    from embedtrain.graph.csr import csr_from_edges
    from embedtrain.graph.store import write_graph

    rng = np.random.default_rng(3)
    n = 120
    src, dst = rng.integers(0, n, 900), rng.integers(0, 100, 900)
    indptr, indices, _, _ = csr_from_edges(src, dst, n, undirected=False, self_loops="keep",
                                           duplicates="keep")
    out = tmp_path_factory.mktemp("directed")
    write_graph(out, indptr, indices, features=rng.normal(size=(n, 6)).astype(np.float32),
                directed=True, name="directed")
    return load_graph(out)


@pytest.mark.parametrize("aggr", [Aggregation.MEAN, Aggregation.MAX])
def test_layerwise_follows_the_csr_direction_and_float16_features(directed, aggr):
    """In-neighbours only (the sampler's direction), repeated entries counted, nodes without
    neighbours; features stored as float16 are cast to float32 row by row."""
    import dataclasses

    model = _model(directed, aggr)
    seeds = np.array([0, 5, 99, 100, 119])
    out = layerwise_inference(model, directed, chunk_entries=64)
    np.testing.assert_allclose(out.outputs[seeds], _sampled(model, directed, seeds), atol=1e-5,
                               rtol=0)
    half = dataclasses.replace(directed, features=np.asarray(directed.features, np.float16))
    for model in (model, _model(directed, aggr, embedding_dim=0)):  # with a table, and without
        out = layerwise_inference(model, half, chunk_entries=64)
        np.testing.assert_allclose(out.outputs[seeds], _sampled(model, half, seeds), atol=1e-5,
                                   rtol=0)


def test_a_subset_and_memory_mapped_layers_give_the_same_rows(graph, tmp_path):
    model = _model(graph, Aggregation.MEAN)
    full = layerwise_inference(model, graph)
    nodes = np.array([250, 7, 7, 0, 123])
    sub = layerwise_inference(model, graph, nodes=nodes, chunk_entries=5, max_ram_bytes=0,
                              scratch_dir=tmp_path, outputs_file=tmp_path / "o.npy",
                              keep_embeddings=False)
    assert sub.nodes.tolist() == [0, 7, 123, 250] and sub.embeddings is None
    np.testing.assert_allclose(sub.outputs, full.outputs[sub.nodes], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), sub.outputs)
    assert [p.name for p in tmp_path.iterdir()] == ["o.npy"]  # the scratch layers are gone


@pytest.mark.parametrize("embedding_dim, kind", [(0, GNNModel.SAGE), (8, GNNModel.MLP)])
def test_features_only_and_mlp_models(graph, embedding_dim, kind):
    model = _model(graph, Aggregation.SUM, embedding_dim, kind)
    seeds = np.arange(0, graph.num_nodes, 13)
    out = layerwise_inference(model, graph, chunk_entries=150)
    np.testing.assert_allclose(out.outputs[seeds], _sampled(model, graph, seeds), atol=1e-5,
                               rtol=0)


def test_bad_inputs_are_one_line(graph):
    model = _model(graph)
    with pytest.raises(ValueError, match=r"nodes: node id 300 outside \[0, 300\)"):
        layerwise_inference(model, graph, nodes=[1, 300])
    other = GraphSAGE(graph.num_nodes, 3, 8, [4, 4], 2)
    with pytest.raises(ValueError, match="the graph has 32 node feature\\(s\\), the model takes 3"):
        layerwise_inference(other, graph)


# -- export and predict ------------------------------------------------------------------------


def _run(config, data, out, *overrides):
    from embedtrain.config import dump_config, load_config
    from embedtrain.recipes import build_run

    cfg = load_config(f"configs/{config}", [
        f"data.path={data}", "data.batch_size=64", "data.num_workers=0", "train.max_steps=2",
        "train.eval_every=0", "train.progress=false", "gnn.hidden=[16,16]", "gnn.fanouts=[4,4]",
        *overrides])
    run = build_run(cfg, out)
    dump_config(cfg, out / "config.yaml")
    run.trainer.fit()
    return out


@pytest.fixture(scope="module")
def node_export(graph, tmp_path_factory):
    from embedtrain.export.export import export_run

    tmp = tmp_path_factory.mktemp("node_export")
    run = _run("gnn_node.yaml", graph.root, tmp / "run", "gnn.embedding_dim=8")
    return run, export_run(run, tmp / "out", progress=False)


def test_node_export_holds_layerwise_scores_and_predict_reads_them(graph, node_export, tmp_path):
    from embedtrain.export.nodes import ExportedNodes

    run, result = node_export
    m = result.manifest
    assert [t.name for t in m.tables] == ["t_node"] and m.dense_program is None
    assert m.nodes.output == "scores" and "layer-wise" in m.note
    assert [(a.name, a.rows, a.dim) for a in m.nodes.arrays] == [("scores", 300, 4),
                                                                 ("embeddings", 300, 16)]
    # the trained model, its table read whole from the checkpoint (not the exported file)
    model, _ = load_graph_model(run)
    expected = layerwise_inference(model, graph)
    nodes = ExportedNodes(result.out)
    np.testing.assert_allclose(nodes.arrays["scores"], expected.outputs, atol=1e-5, rtol=0)
    np.testing.assert_allclose(nodes.arrays["embeddings"], expected.embeddings, atol=1e-5, rtol=0)
    assert np.abs(expected.outputs).max() > 1e-3  # not all zeros
    # the table streamed to a file and memory-mapped instead
    mapped, _ = load_graph_model(run, table_dir=tmp_path)
    weight = mapped.ebc.embedding_bags["t_node"].weight
    np.testing.assert_array_equal(weight.numpy(), np.load(tmp_path / "t_node.npy"))
    np.testing.assert_array_equal(weight.numpy(), model.ebc.embedding_bags["t_node"].weight
                                  .detach().numpy())
    np.testing.assert_allclose(layerwise_inference(mapped, graph).outputs, expected.outputs,
                               atol=1e-6, rtol=0)

    ask = [5, 0, 299, 5]
    pq.write_table(pa.table({"node": ask, "label": [1, -1, 0, None], "req": ["a", "b", "c", "d"]}),
                   tmp_path / "in.parquet")
    r = run_cli("predict", str(result.out), "--input", str(tmp_path / "in.parquet"),
                "--out", str(tmp_path / "p.parquet"), "--keep", "req", "--no-progress")
    assert r.returncode == 0, r.stderr
    got = pq.read_table(tmp_path / "p.parquet").to_pydict()
    assert got["node"] == ask and got["req"] == ["a", "b", "c", "d"]
    np.testing.assert_array_equal(np.array(got["scores"], np.float32),
                                  nodes.arrays["scores"][ask])
    predicted = nodes.arrays["scores"][ask].argmax(axis=1)
    assert got["class"] == predicted.tolist()
    accuracy = ((predicted[0] == 1) + (predicted[2] == 0)) / 2  # labels -1 and null not counted
    assert f"accuracy     {accuracy:.6f}" in r.stdout, r.stdout


@pytest.mark.parametrize("rows, message", [
    ({"node": [0, 300]}, "column node: row 1: node 300 outside [0, 300)"),
    ({"node": [0, None]}, "column node: row 1: null value"),
    ({"node": ["a"]}, "column node: integer node ids expected, got string"),
    ({"nodes": [1]}, "no column node (dense node ids 0..299) or id"),
    ({"id": [1]}, "column id: the export has no node id map"),
])
def test_predict_on_bad_node_ids_is_one_line(node_export, tmp_path, rows, message):
    _, result = node_export
    pq.write_table(pa.table(rows), tmp_path / "in.parquet")
    r = run_cli("predict", str(result.out), "--input", str(tmp_path / "in.parquet"),
                "--out", str(tmp_path / "p.parquet"), "--no-progress")
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr
    assert f"{tmp_path / 'in.parquet'}: {message}" in err[0], err
    assert not (tmp_path / "p.parquet").exists()


def test_predict_maps_original_ids_through_the_exports_id_map(node_export, tmp_path):
    """An export whose data set has original node ids (``nodes/ids.parquet``): CSV input."""
    import shutil

    _, result = node_export
    export = tmp_path / "export"
    shutil.copytree(result.out, export)
    pq.write_table(pa.table({"id": [f"n{i}" for i in range(300)]}), export / "nodes/ids.parquet")
    manifest = json.loads((export / "model.json").read_text())
    manifest["nodes"]["ids"] = "nodes/ids.parquet"
    (export / "model.json").write_text(json.dumps(manifest))
    (tmp_path / "in.csv").write_text("id\nn17\nn3\n")
    r = run_cli("predict", str(export), "--input", str(tmp_path / "in.csv"),
                "--out", str(tmp_path / "p.parquet"), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert pq.read_table(tmp_path / "p.parquet").column("node").to_pylist() == [17, 3]
    (tmp_path / "in.csv").write_text("id\nn17\nm3\n")
    r = run_cli("predict", str(export), "--input", str(tmp_path / "in.csv"),
                "--out", str(tmp_path / "q.parquet"), "--no-progress")
    assert r.returncode == 2 and f"{tmp_path / 'in.csv'}: column id: row 1: id 'm3' is not a " \
        "node of the data set" in r.stderr, r.stderr


def test_features_only_link_export_writes_layerwise_embeddings(graph, tmp_path):
    """``gnn.embedding_dim: 0`` (no node table) exports now: its embeddings are the model's."""
    from embedtrain.export.export import export_run
    from embedtrain.export.nodes import ExportedNodes

    run = _run("gnn_link.yaml", graph.root, tmp_path / "run", "gnn.embedding_dim=0",
               "gnn.out_dim=6", "gnn.negatives=2")
    m = export_run(run, tmp_path / "out", progress=False, formats=["parquet"]).manifest
    assert m.tables == [] and [(a.name, a.dim) for a in m.nodes.arrays] == [("embeddings", 6)]
    model, _ = load_graph_model(run)
    expected = layerwise_inference(model, graph).outputs
    embeddings = ExportedNodes(tmp_path / "out").arrays["embeddings"]
    np.testing.assert_allclose(embeddings, expected, atol=1e-5, rtol=0)
    pq.write_table(pa.table({"node": [2, 9]}), tmp_path / "in.parquet")
    r = run_cli("predict", str(tmp_path / "out"), "--input", str(tmp_path / "in.parquet"),
                "--out", str(tmp_path / "p.parquet"), "--no-progress")
    assert r.returncode == 0, r.stderr
    got = np.array(pq.read_table(tmp_path / "p.parquet").column("embedding").to_pylist())
    np.testing.assert_array_equal(got.astype(np.float32), embeddings[[2, 9]])


def _full_graph(model, graph):
    """The model over the whole graph at once, each layer a PyG conv on all nodes (no blocks,
    no chunks): the reference layer-wise inference must equal."""
    n = graph.num_nodes
    features = torch.from_numpy(np.asarray(graph.features, np.float32))
    x = model.node_inputs(model.embed_nodes(torch.arange(n)) if model.ebc is not None else None,
                          features)
    targets = np.repeat(np.arange(n), np.diff(graph.indptr))
    edge_index = torch.from_numpy(np.stack([np.asarray(graph.indices, np.int64), targets]))
    model.eval()
    with torch.no_grad():
        for i in range(len(model.convs)):
            x = model.layer(i, x, edge_index)
        return model.out(x).numpy(), edge_index


@pytest.mark.parametrize("kind", [GNNModel.SAGE, GNNModel.GCN, GNNModel.GAT])
def test_layerwise_equals_the_model_on_the_whole_graph(graph, kind):
    model = _model(graph, kind=kind)
    reference, _ = _full_graph(model, graph)
    out = layerwise_inference(model, graph, chunk_entries=150)
    np.testing.assert_allclose(out.outputs, reference, atol=1e-5, rtol=0)


def test_gcn_layer_is_the_mean_over_the_node_and_its_neighbours(graph):
    """``gcn``: ``D^-1 (A + I) X W + b``, against the dense matrices."""
    model = _model(graph, kind=GNNModel.GCN, embedding_dim=0)
    n = graph.num_nodes
    x = torch.from_numpy(np.asarray(graph.features, np.float32))
    _, edge_index = _full_graph(model, graph)
    a = torch.zeros(n, n).index_put_((edge_index[1], edge_index[0]), torch.ones(1),
                                     accumulate=True) + torch.eye(n)
    conv = model.convs[0]
    want = (a / a.sum(1, keepdim=True)) @ (x @ conv.lin.weight.t()) + conv.bias
    with torch.no_grad():
        got = model.layer(0, x, edge_index)
    torch.testing.assert_close(got, torch.relu(want), atol=1e-5, rtol=0)


def load_graph_model(run_dir, checkpoint=None, table_dir=None):
    """A GNN run's model on CPU, unsharded, with a checkpoint's parameters (the node table
    memory-mapped from ``table_dir/<table>.npy`` when given), and the run's graph: what
    layer-wise inference runs on outside an export."""
    from embedtrain.config import load_run_config, task_family
    from embedtrain.export.programs import model_tables
    from embedtrain.export.manifest import ExportError
    from embedtrain.export.tables import NpyWriter, load_tensors, stream_tensor
    from embedtrain.recipes import recipe_for
    from embedtrain.train.checkpoint import CheckpointManager
    from torch import nn

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ExportError(f"{run_dir}: not a run directory (no config.yaml)")
    cfg = load_run_config(run_dir / "config.yaml")
    if not task_family(cfg).value.startswith("gnn"):
        raise ExportError(f"{run_dir / 'config.yaml'}: task {task_family(cfg).value} is not a "
                          "GNN task")
    recipe = recipe_for(cfg)
    model = recipe.planning_model()
    tables = model_tables(model) if table_dir is not None else []
    model = model.to_empty(device="cpu")  # untouched: a streamed table's pages are never used
    streamed = {t.key for t in tables}
    manager = CheckpointManager(run_dir / "checkpoints")
    with manager.reading(manager.find(checkpoint) if checkpoint is not None else None) as ckpt:
        load_tensors(ckpt, {f"model.{k}": v for k, v in model.state_dict().items()
                            if f"model.{k}" not in streamed})
        for t in tables:
            path = Path(table_dir) / f"{t.name}.npy"
            with NpyWriter(path, (t.rows, t.dim)) as writer:
                stream_tensor(ckpt, t.key, (t.rows, t.dim), writer.write)
            suffix = f".embedding_bags.{t.name}.weight"
            owner = model.get_submodule(t.key[len("model."):-len(suffix)])
            owner.embedding_bags[t.name].weight = nn.Parameter(
                torch.from_numpy(np.load(path, mmap_mode="c")), requires_grad=False)
    return model.eval(), recipe.dataset
