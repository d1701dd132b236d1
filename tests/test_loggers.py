"""Loggers as components: TensorBoard event files and an MLflow run, read back with TensorBoard's
``EventAccumulator`` and ``MlflowClient``, hold what the run's own records hold; a logger whose
package is missing is one line before anything is built."""

import json

import pytest

from conftest import run_cli
from embedtrain.testing import tiny_ctr_dataset

LOGGERS = ("loggers: [{_component_: embedtrain.train.loggers:TensorBoard, every_n_steps: 2}, "
           "{_component_: embedtrain.train.loggers:MLflow, experiment: tiny, every_n_steps: 3}]\n")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("loggers")
    data = tiny_ctr_dataset(root / "data", rows=2000)
    config = root / "tiny.yaml"
    config.write_text(f"""
data: {{path: {data}, batch_size: 256, eval_batch_size: 1024, num_workers: 0}}
model: {{embedding_dim: 4, bottom_mlp: [8], top_mlp: [8]}}
train: {{max_steps: 6, eval_every: 3, checkpoint_every: 3, progress: false}}
""" + LOGGERS)
    out = root / "run"
    r = run_cli("train", str(config), "--out", str(out))
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("split") == "valid"]
    return root, out, evals, json.loads((out / "summary.json").read_text())


def test_tensorboard_events_hold_the_runs_records(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out, evals, summary = run
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6]
    auc = events.Scalars("valid/auc")
    assert [e.step for e in auc] == [r["step"] for r in evals]
    assert [e.value for e in auc] == pytest.approx([r["auc"] for r in evals], abs=1e-6)
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")
    final = events.Scalars("hparam/auc")  # the hyperparameters' final metrics
    assert final[0].value == pytest.approx(summary["auc"], abs=1e-6)


def test_a_read_only_command_on_a_run_with_loggers_writes_nothing(run):
    _, out, _, _ = run
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    assert run_cli("eval", str(out), "--split", "valid").returncode == 0
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before


def test_mlflow_run_holds_params_metrics_summary_and_artifacts(run):
    from mlflow import MlflowClient

    _, out, evals, summary = run
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert found.info.status == "FINISHED"
    assert found.data.params["model.embedding_dim"] == "4"
    assert found.data.params["train.max_steps"] == "6"
    history = client.get_metric_history(found.info.run_id, "valid_auc")
    assert [(m.step, round(m.value, 6)) for m in history] == [
        (r["step"], round(r["auc"], 6)) for r in evals]
    assert [m.step for m in client.get_metric_history(found.info.run_id, "train_loss")] == [3, 6]
    assert found.data.metrics["final_auc"] == pytest.approx(summary["auc"])
    artifacts = {a.path for a in client.list_artifacts(found.info.run_id)}
    assert {"summary.json", "curves.png"} <= artifacts
    stored = {p.name for p in (out / "mlflow-artifacts").rglob("*") if p.is_file()}
    assert {"summary.json", "curves.png"} <= stored  # in the run, not the working directory


def test_a_missing_package_or_a_wrong_key_is_one_line_before_anything_is_built(
        run, tmp_path, monkeypatch):
    import importlib.util

    root, _, _, _ = run
    config = (root / "tiny.yaml").read_text()
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else find(name, *a))
    bad = tmp_path / "bad.yaml"
    bad.write_text(config)
    r = run_cli("train", str(bad), "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "embedtrain train: error: loggers[0]: embedtrain.train.loggers:TensorBoard needs the "
        "package 'tensorboard', which is not installed: pip install tensorboard"), r.stderr
    assert not (tmp_path / "run").exists()
    monkeypatch.undo()
    bad.write_text(config.replace("every_n_steps: 2", "every_n_step: 2"))
    r = run_cli("train", str(bad), "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "embedtrain train: error: loggers[0].every_n_step: unknown key of "
        "embedtrain.train.loggers:TensorBoard (did you mean 'every_n_steps'?)"), r.stderr
