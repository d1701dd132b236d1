"""End to end through the CLI: run files, eval, config errors, and resume == uninterrupted."""

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from embedtrain.testing import tiny_ctr_dataset
from embedtrain.train.run_dir import RunDir
from conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent


def embedtrain(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*args)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    data = tiny_ctr_dataset(root / "data", rows=4000)
    config = root / "tiny.yaml"
    config.write_text(f"""
data: {{path: {data}, batch_size: 256, eval_batch_size: 1024}}
model: {{embedding_dim: 8, bottom_mlp: [16, 8], top_mlp: [32, 1]}}
train: {{epochs: 2, eval_every: 6, checkpoint_every: 5, keep_checkpoints: 3, progress: false}}
""")
    return root, config


def _files(run: Path) -> dict[str, str]:
    """Every file of a run directory (relative path -> content hash)."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def _params(checkpoint: Path, tmp: Path) -> dict:
    out = tmp / f"{checkpoint.parent.parent.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=True)


def _assert_equal(a, b, path="") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    else:
        assert a == b, path


@pytest.mark.slow
def test_train_eval_and_resume(tiny, tmp_path):
    root, config = tiny
    full = tmp_path / "full"
    r = embedtrain("train", str(config), "--out", str(full))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "final metrics on test" in r.stdout and str(full) in r.stdout

    # the run directory contract
    assert (full / "config.yaml").read_text().startswith("task: ctr")
    records = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    # 3,2xx training rows in batches of 256: 13 steps per epoch (the last one short), 2 epochs.
    train_rows = json.loads((root / "data" / "metadata.json").read_text())["splits"]["train"]["rows"]
    assert -(-train_rows // 256) == 13
    assert [r["step"] for r in records] == [6, 12, 18, 24, 26]
    for rec in records:
        assert {"step", "examples", "loss", "auc", "ne", "logloss", "calibration"} <= rec.keys()
    assert records[-1]["examples"] == 2 * train_rows  # every row once per epoch
    summary = json.loads((full / "summary.json").read_text())
    assert summary["dataset"] == "synthetic_ctr" and summary["split"] == "test"
    assert 0.5 < summary["auc"] <= 1 and summary["train_examples_per_s"] > 0
    assert summary["oracle_auc"] > 0.6
    assert (full / "curves.png").stat().st_size > 10_000
    assert summary["steps"] == 26 and summary["examples"] == 2 * train_rows
    assert summary["train_rows"] == train_rows and summary["padded_rows"] == 0
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == [
        "step_00000020", "step_00000025", "step_00000026"]

    # a second run into the same directory must not clobber it silently
    r = embedtrain("train", str(config), "--out", str(full))
    assert r.returncode == 2 and "holds an earlier run; pass --resume" in r.stderr

    # eval of the final checkpoint reproduces the summary's test metrics, and of an older one
    # (by directory or by step) its own; eval prints its result and writes nothing into the run
    before = _files(full)
    r = embedtrain("eval", str(full), "--split", "test")
    assert r.returncode == 0, r.stderr[-3000:]
    evaluated = json.loads(r.stdout)
    assert evaluated["step"] == 26 and evaluated["auc"] == pytest.approx(summary["auc"], abs=1e-9)
    r = embedtrain("eval", str(full), "--split", "valid", "--checkpoint",
                   str(full / "checkpoints" / "step_00000020"), "--out", str(tmp_path / "e.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "e.json").read_text()) == json.loads(r.stdout)
    assert json.loads(r.stdout)["step"] == 20
    r = embedtrain("eval", str(full), "--split", "valid", "--checkpoint", "20")
    assert r.returncode == 0 and json.loads(r.stdout)["step"] == 20, r.stderr[-3000:]
    r = embedtrain("eval", str(full), "--out", str(full))
    assert r.returncode == 2 and f"{full}: is a directory; --out names a file" in r.stderr
    after = _files(full)
    assert after == before

    # resuming the finished run says so and changes nothing
    r = embedtrain("train", str(config), "--out", str(full), "--resume")
    assert r.returncode == 0 and "finished at step 26 of 26; nothing to resume" in r.stderr
    assert _files(full) == after
    # resuming with another model is refused, naming the key; nothing changes either
    r = embedtrain("train", str(config), "--out", str(full), "--resume",
                   "--set", "model.embedding_dim=4", "--set", "model.bottom_mlp=[16,4]")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "model.embedding_dim: 8 -> 4; model.bottom_mlp: [16, 8] -> [16, 4]" in r.stderr
    assert _files(full) == after

    # interrupted after step 16 with its last checkpoint at 15, then resumed
    part = tmp_path / "part"
    r = embedtrain("train", str(config), "--out", str(part), "--set", "train.max_steps=16")
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.rmtree(part / "checkpoints" / "step_00000016")  # as if killed before it was written
    r = embedtrain("train", str(config), "--out", str(part), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout + r.stderr

    a = _params(full / "checkpoints" / "step_00000026", tmp_path)
    b = _params(part / "checkpoints" / "step_00000026", tmp_path)
    assert any("embedding_bags" in k for k in a["model"])
    _assert_equal(a, b)  # model, fused sparse and dense optimizer state: bit for bit
    # The crashed run's evaluation at step 16 is not in its checkpoint: the resume at 15 drops
    # it, so every step has one record, as in the uninterrupted run, and the resume is marked.
    history = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [(r.get("event"), r["step"]) for r in history] == [
        (None, 6), (None, 12), ("resume", 15), (None, 18), (None, 24), (None, 26)]
    resumed = RunDir(part).read_metrics()
    assert [r["step"] for r in resumed] == [6, 12, 18, 24, 26]
    assert resumed[-1]["auc"] == records[-1]["auc"]


def test_config_typo_is_one_line(tiny):
    _, config = tiny
    bad = config.parent / "typo.yaml"
    bad.write_text(config.read_text().replace("eval_every", "eval_evry"))
    r = embedtrain("train", str(bad), "--out", str(config.parent / "never"))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "typo.yaml" in lines[0] and "train.eval_evry: unknown key" in lines[0]
    assert not (config.parent / "never").exists()


def test_missing_dataset_is_one_line(tiny, tmp_path):
    _, config = tiny
    r = embedtrain("train", str(config), "--set", f"data.path={tmp_path}/none", "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"embedtrain train: error: {tmp_path}/none/metadata.json: data set metadata not found "
        "(generate one with: embedtrain datagen ctr|xc --out DIR)"]


def test_a_run_that_wrote_the_mlps_ends_resumes_with_a_config_that_derives_them(tiny, tmp_path):
    # a run directory from before the ends were derived lists them ([16, 8], [32, 1]); the same
    # model from a config of hidden layers ([16], [32]) is no change, another model is
    root, _ = tiny
    data = root / "data"
    run = tmp_path / "run"
    old = tmp_path / "old.yaml"
    old.write_text(f"data: {{path: {data}, batch_size: 256}}\nmodel: {{embedding_dim: 8, "
                   "bottom_mlp: [16, 8], top_mlp: [32, 1]}\ntrain: {max_steps: 4, eval_every: 0, "
                   "checkpoint_every: 2, progress: false}\n")
    assert embedtrain("train", str(old), "--out", str(run)).returncode == 0
    new = tmp_path / "new.yaml"
    new.write_text(old.read_text().replace("[16, 8]", "[16]").replace("[32, 1]", "[32]"))
    saved = (run / "config.yaml").read_bytes()
    r = embedtrain("train", str(new), "--out", str(run), "--resume", "--set", "train.max_steps=6")
    assert r.returncode == 0, r.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
    assert (run / "config.yaml").read_bytes() != saved  # max_steps recorded
    other = new.read_text().replace("[16]", "[24]")
    new.write_text(other)
    r = embedtrain("train", str(new), "--out", str(run), "--resume", "--set", "train.max_steps=8")
    assert r.returncode == 2 and "model.bottom_mlp: [16, 8] -> [24, 8]" in r.stderr, r.stderr
