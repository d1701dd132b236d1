"""GNN tasks end to end through the trainer: GraphSAGE uses the graph (beats the features-only
MLP), link prediction ranks held-out edges above sampled negatives, and resume is exact."""

import pytest
import torch

from embedtrain.config import load_config
from embedtrain.data.datagen_graph import GraphDataSpec, generate_graph


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    out = tmp_path_factory.mktemp("graph")
    generate_graph(GraphDataSpec(nodes=4_000, avg_degree=10, communities=8, seed=1,
                                 link_fraction=0.1), out, progress=False)
    return out


def _cfg(config, data, *overrides):
    return load_config(config, overrides=[
        f"data.path={data}", "data.batch_size=256", "data.eval_batch_size=1024",
        "data.num_workers=0", "gnn.hidden=[32,32]", "gnn.embedding_dim=0", "train.eval_every=0",
        "train.checkpoint_every=0", "train.progress=false", "train.pipeline=false", *overrides])


def test_graphsage_beats_features_only_mlp(graph, tmp_path):
    from embedtrain.train.recipe import build_run

    accuracy = {}
    for model in ("mlp", "sage"):
        run = build_run(_cfg("configs/gnn_node.yaml", graph, f"gnn.model={model}",
                             "train.epochs=3"), tmp_path / model)
        accuracy[model] = run.trainer.fit(test_data=run.test_data)["accuracy"]
    # Features alone reach at most the features-only Bayes accuracy (~0.58 here); the
    # neighbourhood carries the planted communities.
    assert accuracy["sage"] > accuracy["mlp"] + 0.15, accuracy


def test_link_prediction_ranks_held_out_edges(graph, tmp_path):
    from embedtrain.train.recipe import build_run

    run = build_run(_cfg("configs/gnn_link.yaml", graph, "gnn.negatives=5",
                         "train.max_steps=40"), tmp_path)
    summary = run.trainer.fit(test_data=run.test_data)
    # A random scorer's MRR with 5 negatives is mean(1/r, r = 1..6) = 0.41.
    assert summary["mrr"] > 0.5 and summary["hits@1"] <= summary["hits@3"], summary


def test_node_task_resume_equals_uninterrupted(graph, tmp_path):
    from embedtrain.train.recipe import build_run

    common = ["train.checkpoint_every=5", "gnn.embedding_dim=8"]
    whole = build_run(_cfg("configs/gnn_node.yaml", graph, *common, "train.max_steps=10"),
                      tmp_path / "whole").trainer
    whole.fit()
    part = build_run(_cfg("configs/gnn_node.yaml", graph, *common, "train.max_steps=5"),
                     tmp_path / "part").trainer
    part.fit()
    resumed = build_run(_cfg("configs/gnn_node.yaml", graph, *common, "train.max_steps=10"),
                        tmp_path / "part").trainer
    resumed.fit(resume=True)
    a = {k: v for k, v in whole.model.named_parameters()}
    b = {k: v for k, v in resumed.model.named_parameters()}
    for k in a:
        assert torch.equal(a[k].detach(), b[k].detach()), k


def test_cli_trains_and_plans_the_node_table(graph, tmp_path):
    """`embedtrain train configs/gnn_node.yaml` end to end; the node table is in the plan."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "embedtrain", "train", "configs/gnn_node.yaml",
                        "--out", str(run), "--no-progress", "--set", f"data.path={graph}",
                        "--set", "train.max_steps=20", "--set", "train.eval_every=10",
                        "--set", "data.batch_size=256"],
                       capture_output=True, text=True, cwd=root, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["task"] == "gnn_node" and summary["steps"] == 20 and summary["accuracy"] > 0.3
    plan = json.loads((run / "plan.json").read_text())
    assert [t["name"] for t in plan["tables"]] == ["t_node"]
    r = subprocess.run([sys.executable, "-m", "embedtrain", "plan", "configs/gnn_node.yaml",
                        "--cluster", "configs/clusters/h100-16x8.yaml", "--out",
                        str(tmp_path / "plan"), "--set", f"data.path={graph}"],
                       capture_output=True, text=True, cwd=root, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "t_node" in (tmp_path / "plan" / "plan.md").read_text()
