"""Tasks as components: ``task: {_component_: path, ...}`` names a task (built-in or one's own)
with its own keys, checked before anything is built; it runs in the family its class names, its
loss and metrics are its own, and its export is served as it says (a regression's value, not a
click probability). Number labels other than clicks ingest and read with a ``label_range``."""

import json
import subprocess
import sys

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import embedtrain as et
from conftest import ROOT, run_cli
from embedtrain.data.batching import PaddedBatch

EXAMPLE = ROOT / "examples" / "custom_task"


def _batch(dense, labels, padding=0):
    n = len(labels)
    kjt = KeyedJaggedTensor.from_lengths_sync(["c"], torch.zeros(n, dtype=torch.long),
                                              torch.ones(n, dtype=torch.long))
    return PaddedBatch(dense_features=dense, sparse_features=kjt, labels=labels, padding=padding)


def test_regression_loss_and_metrics_against_numpy():
    task = et.Regression()
    model = lambda dense, sparse: dense[:, :1] * 2.0  # noqa: E731 - one output a row
    first = _batch(torch.tensor([[1.0], [2.0], [9.0]]), torch.tensor([1.5, 5.0, -1.0]), padding=1)
    second = _batch(torch.tensor([[0.5], [3.0]]), torch.tensor([0.0, 7.0]))
    out = task.forward(model, first)
    assert out.num_examples == 2  # the padding row is in neither the loss nor the metrics
    assert float(out.loss) == pytest.approx(((2 - 1.5) ** 2 + (4 - 5) ** 2) / 2)
    metrics = task.new_metrics()
    metrics.update(out, first)
    metrics.update(task.forward(model, second), second)
    err = np.array([2 - 1.5, 4 - 5, 1 - 0, 6 - 7])
    got = metrics.compute()
    assert got["mse"] == pytest.approx((err ** 2).mean())
    assert got["rmse"] == pytest.approx(np.sqrt((err ** 2).mean()))
    assert got["mae"] == pytest.approx(np.abs(err).mean())
    assert task.new_metrics().compute() == {}


@pytest.fixture(scope="module")
def ratings(tmp_path_factory):
    """The custom_task example's ratings, ingested with its spec (label_range [1, 5])."""
    root = tmp_path_factory.mktemp("ratings")
    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), "6000",
                    str(root / "ratings.csv")], check=True)
    r = run_cli("ingest", str(EXAMPLE / "ingest.yaml"), "--input", str(root / "ratings.csv"),
                "--out", str(root / "data"))
    assert r.returncode == 0, r.stderr
    return root


def _config(root, task: str, data):
    path = root / "config.yaml"
    path.write_text(f"""
task: {task}
data: {{path: {data}, batch_size: 500, eval_batch_size: 2000, num_workers: 0}}
model: {{embedding_dim: 4, bottom_mlp: [8], top_mlp: [8, 1]}}
train: {{max_steps: 8, eval_every: 4, checkpoint_every: 4, progress: false}}
""")
    return path


def test_the_built_in_regression_trains_exports_and_serves_the_value(ratings, tmp_path):
    run = tmp_path / "run"
    cfg = et.load_config(_config(tmp_path, "{_component_: embedtrain.tasks:Regression}",
                                 ratings / "data"))
    summary = et.fit(cfg, run)
    assert summary["task"] == "regression" and summary["rmse"] == pytest.approx(
        summary["mse"] ** 0.5)
    assert et.load_config(run / "config.yaml").task.path == "embedtrain.tasks:Regression"
    evaluated = et.evaluate(run, split="test")
    assert evaluated["mae"] == pytest.approx(summary["mae"], abs=1e-6)
    et.export_run(run, tmp_path / "export", progress=False)
    assert json.loads((tmp_path / "export" / "model.json").read_text())["score"] == "identity"
    test = ratings / "data" / "test"
    et.predict(tmp_path / "export", [test], tmp_path / "p.parquet", progress=False)
    got = pq.read_table(tmp_path / "p.parquet")
    assert got["score"].to_pylist() == got["logit"].to_pylist()  # the value, no sigmoid
    labels = pl.read_parquet(sorted(test.glob("*.parquet")))["rating"].to_numpy()
    mae = np.abs(got["score"].to_numpy() - labels).mean()
    assert mae == pytest.approx(evaluated["mae"], abs=1e-4)  # served as evaluated


@pytest.mark.parametrize("task, message", [
    ("{_component_: huber:HuberRegression, detla: 2}",
     "task.detla: unknown key of huber:HuberRegression (did you mean 'delta'?)"),
    ("{_component_: huber:HuberRegression, delta: big}",
     "task.delta: expected a number, got str 'big'"),
    ("{_component_: collections:OrderedDict}",
     "task: collections:OrderedDict: has no name, main_metric, forward, new_metrics (a task "
     "has name, main_metric, forward(model, batch) and new_metrics())"),
    ("{_component_: no_such:Task}", "task: no_such:Task: cannot import no_such"),
    ("ctr2", "task: 'ctr2' is not one of ctr, xc, gnn_node, gnn_link, seq"),
])
def test_a_task_components_mistakes_are_one_line(ratings, tmp_path, task, message):
    config = _config(tmp_path, task, ratings / "data")
    r = run_cli("train", str(config), "--out", str(tmp_path / "run"), cwd=EXAMPLE)
    assert r.returncode == 2 and message in r.stderr.strip().splitlines()[-1], r.stderr
    assert not (tmp_path / "run").exists()


def test_a_task_runs_in_the_family_its_class_names(tmp_path, monkeypatch):
    (tmp_path / "fam.py").write_text("class T:\n    family = 'nope'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = et.from_dict(et.Config, {"task": {"_component_": "fam:T"}})
    from embedtrain.config import TaskKind, task_family

    with pytest.raises(et.ConfigError, match=r"^task: fam:T: family 'nope' is not one of ctr"):
        task_family(cfg)
    cfg = et.from_dict(et.Config, {"task": {"_component_": "embedtrain.tasks:NextItem"}})
    assert task_family(cfg) is TaskKind.SEQ
    assert task_family(et.from_dict(et.Config, {"task": "xc"})) is TaskKind.XC


def test_number_labels_ingest_by_label_range_and_are_checked_at_read(ratings, tmp_path):
    # clicks by default: ratings 1..5 above 1 are dropped and counted
    spec = tmp_path / "clicks.yaml"
    spec.write_text((EXAMPLE / "ingest.yaml").read_text().replace("label_range: [1, 5]", ""))
    r = run_cli("ingest", str(spec), "--input", str(ratings / "ratings.csv"), "--out",
                str(tmp_path / "clicks"))
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "clicks" / "ingest_report.json").read_text())
    ratings_csv = pl.read_csv(ratings / "ratings.csv")
    assert report["rows_dropped"]["label_out_of_range"] == (ratings_csv["rating"] > 1).sum()
    # the reader holds a data set's labels to its metadata's range
    meta = json.loads((ratings / "data" / "metadata.json").read_text())
    assert meta["label_range"] == [1.0, 5.0]
    bad = tmp_path / "narrow"
    import shutil

    shutil.copytree(ratings / "data", bad)
    (bad / "metadata.json").write_text(json.dumps({**meta, "label_range": [1.0, 4.0]}))
    config = _config(tmp_path, "{_component_: embedtrain.tasks:Regression}", bad)
    r = run_cli("train", str(config), "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "is outside metadata.json's label_range [1.0, 4.0]" in \
        r.stderr.strip().splitlines()[-1], r.stderr


@pytest.mark.parametrize("value", ["[5, 1]", "[1]", "[1, 2, 3]"])
def test_a_label_range_that_is_not_low_high_is_one_line(ratings, tmp_path, value):
    spec = tmp_path / "bad.yaml"
    spec.write_text((EXAMPLE / "ingest.yaml").read_text().replace("[1, 5]", value))
    r = run_cli("ingest", str(spec), "--input", str(ratings / "ratings.csv"), "--out",
                str(tmp_path / "out"))
    assert r.returncode == 2 and r.stderr.strip().endswith(
        f"label_range: [low, high] with low <= high (or null: any finite number), got "
        f"{[float(v) for v in json.loads(value)]}"), r.stderr
    assert not (tmp_path / "out").exists()
