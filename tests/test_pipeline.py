"""train.pipeline: sparse_dist (TorchRec's TrainPipelineSparseDist) trains exactly as the plain
loop does on 2 gloo ranks, through evaluations and checkpoints, and resumes bit for bit."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from embedtrain.testing import tiny_ctr_dataset
from test_distributed import embedtrain
from test_train_cli import _assert_equal, _params


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    data = tiny_ctr_dataset(root / "data", rows=6000)
    config = root / "tiny.yaml"
    # 50 steps of 2 x 64 rows: over an epoch boundary (37 steps an epoch), with evaluations
    # and checkpoints mid-epoch (the pipeline pauses and its fetched batches are read again).
    config.write_text(f"""
data: {{path: {data}, batch_size: 128, eval_batch_size: 1024, num_workers: 1}}
model: {{embedding_dim: 8, bottom_mlp: [16, 8], top_mlp: [32, 1]}}
train: {{epochs: 2, max_steps: 50, eval_every: 15, checkpoint_every: 20, keep_checkpoints: 10,
         progress: false}}
""")
    return root, config


def _train(config: Path, out: Path, *sets: str) -> dict:
    args = ["train", str(config), "--out", str(out), "--nproc", "2"]
    for s in sets:
        args += ["--set", s]
    r = embedtrain(*args)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads((out / "summary.json").read_text())


def _valid_aucs(run: Path) -> list:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["auc"]) for r in records if r.get("split") == "valid"]


def _final(run: Path, tmp: Path) -> dict:
    return _params(sorted((run / "checkpoints").glob("step_*"))[-1], tmp)


@pytest.mark.slow
def test_sparse_dist_equals_the_plain_loop_and_resumes_bit_for_bit(tiny, tmp_path):
    _, config = tiny
    plain = _train(config, tmp_path / "plain")
    piped = _train(config, tmp_path / "piped", "train.pipeline=sparse_dist")
    assert piped["pipeline"] == {"kind": "sparse_dist",
                                 "pipelined_modules": ["sparse_arch.embedding_bag_collection"]}
    assert plain["steps"] == piped["steps"] == 50
    a, b = _final(tmp_path / "plain", tmp_path), _final(tmp_path / "piped", tmp_path)
    _assert_equal(a["model"], b["model"])  # tables (both ranks' shards) and dense layers
    _assert_equal(a["optimizer"], b["optimizer"])
    for key in ("auc", "loss", "logloss", "examples"):
        assert piped[key] == plain[key], key
    assert _valid_aucs(tmp_path / "piped") == _valid_aucs(tmp_path / "plain")
    # the plain run as if killed after its checkpoint at step 20, then resumed with the pipeline
    # to 50 (a checkpoint, batches in flight at steps 30 and 40): the same weights.
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "plain", part)
    (part / "summary.json").unlink()
    for later in ("step_00000040", "step_00000050"):
        shutil.rmtree(part / "checkpoints" / later)
    r = embedtrain("train", str(config), "--out", str(part), "--nproc", "2", "--resume",
                   "--set", "train.pipeline=sparse_dist")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "step_00000020 at step 20" in r.stdout + r.stderr
    _assert_equal(_final(part, tmp_path)["model"], b["model"])
    _assert_equal(_final(part, tmp_path)["optimizer"], b["optimizer"])


@pytest.mark.parametrize("task, kind, words", [
    ("xc", "sparse_dist", "runs task ctr only"),
    ("ctr", "semi_sync", "semi_sync is not supported yet"),
])
def test_pipelines_a_family_cannot_run_are_one_line(tmp_path, task, kind, words):
    from embedtrain.config import load_config
    from embedtrain.recipes import build_run

    config = "configs/xc_synthetic.yaml" if task == "xc" else "configs/dlrm_synthetic.yaml"
    cfg = load_config(config, overrides=[f"train.pipeline={kind}"])
    with pytest.raises(ValueError, match=f"train.pipeline: .*{words}") as err:
        build_run(cfg, tmp_path)
    assert "\n" not in str(err.value)


def _one_rank(data: Path, out: Path, pipeline: str) -> dict:
    from embedtrain.config import load_config
    from embedtrain.recipes import build_run

    cfg = load_config("configs/dlrm_synthetic.yaml", overrides=[
        f"data.path={data}", "data.batch_size=64", "data.num_workers=0", "model.embedding_dim=8",
        "model.bottom_mlp=[16,8]", "model.top_mlp=[16,1]", "train.max_steps=13",
        "train.eval_every=5", "train.checkpoint_every=0", "train.progress=false",
        "train.grad_accumulation=2", "train.bf16_dense=true", "optim.lr_decay=cosine",
        "optim.warmup_steps=2", f"train.pipeline={pipeline}"])
    run = build_run(cfg, out)
    summary = run.trainer.fit()
    state = {k: (v.local_shards()[0].tensor if hasattr(v, "local_shards") else v).clone()
             for k, v in run.trainer.model.state_dict().items()}
    return {"summary": summary, "state": state,
            "lr": run.trainer.lr_scheduler.get_last_lr()}


@pytest.mark.slow
def test_accumulation_bf16_and_the_schedule_run_the_same_through_the_pipeline(tmp_path):
    """One rank, 13 steps of 2-batch accumulation under bf16 autocast with a warm-up + cosine
    schedule and two mid-run evaluations (pauses): the pipeline's weights are the loop's."""
    data = tiny_ctr_dataset(tmp_path / "data", rows=3000)
    plain = _one_rank(data, tmp_path / "plain", "none")
    piped = _one_rank(data, tmp_path / "piped", "sparse_dist")
    assert piped["summary"]["pipeline"]["pipelined_modules"]  # the tables ran in the pipeline
    assert plain["state"].keys() == piped["state"].keys()
    for key, value in plain["state"].items():
        assert torch.equal(value, piped["state"][key]), key
    assert plain["lr"] == piped["lr"]
    assert plain["summary"]["loss"] == piped["summary"]["loss"]
