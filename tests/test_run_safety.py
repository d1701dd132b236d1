"""Runs that fail safe: unreadable checkpoints fall back to older ones, a full disk keeps the
earlier checkpoints, and bad settings are refused in one line before anything starts."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embedtrain.config import load_config
from embedtrain.testing import tiny_ctr_dataset
from embedtrain.train.checkpoint import CheckpointError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_ctr_dataset(tmp_path_factory.mktemp("safety") / "data", rows=3000)


def _cfg(data, *overrides):
    return load_config(ROOT / "configs" / "dlrm_synthetic.yaml", [
        f"data.path={data}", "data.batch_size=256", "data.eval_batch_size=1024",
        "data.num_workers=0", "model.embedding_dim=8", "model.bottom_mlp=[16,8]",
        "model.top_mlp=[16,1]", "train.eval_every=0", "train.checkpoint_every=3",
        "train.keep_checkpoints=5", "train.max_steps=9", "train.progress=false", *overrides])


@pytest.fixture(scope="module")
def run_dir(data, tmp_path_factory):
    """A finished run with checkpoints at steps 3, 6 and 9."""
    from embedtrain.recipes import build_run

    out = tmp_path_factory.mktemp("run")
    build_run(_cfg(data), out).trainer.fit()
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == [
        "step_00000003", "step_00000006", "step_00000009"]
    return out


def _copy(run_dir, tmp_path) -> Path:
    import shutil

    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _trainer(data, out):
    from embedtrain.recipes import build_run

    return build_run(_cfg(data), out, record_plan=False).trainer


def test_unreadable_checkpoints_fall_back_to_the_newest_readable(data, run_dir, tmp_path, capsys):
    run = _copy(run_dir, tmp_path)
    _truncate(run / "checkpoints" / "step_00000009" / "__0_0.distcp")  # a truncated shard
    (run / "checkpoints" / "step_00000006" / "trainer_state.json").write_text('{"step": 6')
    trainer = _trainer(data, run)
    assert trainer.restore() == run / "checkpoints" / "step_00000003"
    assert trainer.state.step == 3
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert len(warnings) == 2
    assert "step_00000009/__0_0.distcp: truncated (" in warnings[0]  # the file named
    assert "bytes; step_00000009/.metadata says it holds" in warnings[0]
    assert "trying an older" in warnings[0]
    assert "step_00000006/trainer_state.json: unreadable" in warnings[1]
    # The same checkpoint by name is an error, not a silent substitute.
    with pytest.raises(CheckpointError, match=r"step_00000009/__0_0.distcp: truncated"):
        _trainer(data, run).restore(run / "checkpoints" / "step_00000009")


def test_no_readable_checkpoint_is_one_line(data, run_dir, tmp_path):
    run = _copy(run_dir, tmp_path)
    for step in (3, 6, 9):
        _truncate(run / "checkpoints" / f"step_{step:08d}" / "__0_0.distcp")
    with pytest.raises(CheckpointError) as err:
        _trainer(data, run).restore()
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{run / 'checkpoints'}: no readable")
    assert "3 tried; the newest: " in message and "step_00000009/__0_0.distcp: truncated" in message


def test_full_disk_keeps_the_earlier_checkpoints(data, run_dir, tmp_path, monkeypatch):
    import embedtrain.train.checkpoint as checkpoint

    run = _copy(run_dir, tmp_path)
    trainer = _trainer(data, run)
    assert trainer.restore().name == "step_00000009"

    def full_disk(state, checkpoint_id):  # writes part of a shard, then the disk is full
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.dcp, "save", full_disk)
    trainer.state.step = 10
    with pytest.raises(CheckpointError) as err:
        trainer.save()
    assert str(err.value) == (f"{run / 'checkpoints' / 'step_00000010'}: checkpoint not written: "
                              "no space left on device (the partial one is removed; earlier "
                              "checkpoints are kept)")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_00000003", "step_00000006", "step_00000009"]  # no .tmp-step_00000010 left
    monkeypatch.undo()
    assert _trainer(data, run).restore().name == "step_00000009"


def test_full_disk_at_the_summary_leaves_no_partial_file_and_the_resume_writes_it(
        data, run_dir, tmp_path, monkeypatch):
    import embedtrain.utils as utils

    run = _copy(run_dir, tmp_path)
    expected = json.loads((run / "summary.json").read_text())
    (run / "summary.json").unlink()  # killed after the final checkpoint, before the summary
    fsync = os.fsync

    def full_disk(fd):  # the summary's bytes do not fit (the other files do)
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".summary.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(utils.os, "fsync", full_disk)
    with pytest.raises(OSError) as err:
        _trainer(data, run).fit(resume=True)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(run / "summary.json")
    assert not (run / "summary.json").exists()
    assert not [p.name for p in run.iterdir() if p.name.startswith(".summary")]
    monkeypatch.undo()  # space again: the resume writes the summary of the finished run
    summary = _trainer(data, run).fit(resume=True)
    timing = {"wall_time_s", "train_time_s", "train_examples_per_s", "startup_s", "startup",
              "peak_rss_gb_per_rank"}
    assert {k: v for k, v in summary.items() if k not in timing} == \
        {k: v for k, v in expected.items() if k not in timing}
    assert json.loads((run / "summary.json").read_text())["auc"] == expected["auc"]


def test_a_checkpoint_of_another_model_is_refused_without_fallback(data, run_dir, tmp_path):
    from embedtrain.recipes import build_run

    run = _copy(run_dir, tmp_path)
    other = build_run(_cfg(data, "model.embedding_dim=4", "model.bottom_mlp=[16,4]"), run,
                      record_plan=False).trainer
    with pytest.raises(CheckpointError, match=r"step_00000009: does not fit this model \(.*Size "
                                              r"mismatch.*did the model or the data set change"):
        other.restore()


def _cli(*args, cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "embedtrain", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


@pytest.mark.slow
def test_batch_that_does_not_split_is_refused_before_launching(data, tmp_path):
    r = _cli("train", str(ROOT / "configs" / "dlrm_synthetic.yaml"), "--out", str(tmp_path / "r"),
             "--nproc", "3", "--set", f"data.path={data}", "--set", "data.batch_size=1000")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"embedtrain train: error: {ROOT / 'configs' / 'dlrm_synthetic.yaml'}: data.batch_size: "
        "1000 (the global batch) does not split evenly over 3 ranks; use a multiple of 3"]
    assert not (tmp_path / "r").exists()  # nothing launched, nothing written


def test_batch_larger_than_the_split_is_one_line(data, tmp_path):
    from embedtrain.recipes import build_run

    rows = json.loads((data / "metadata.json").read_text())["splits"]["train"]["rows"]
    with pytest.raises(ValueError, match=rf"data.batch_size: 4,096 \(the global batch\) is larger "
                                         rf"than the train split of {data} \({rows:,} rows\)"):
        build_run(_cfg(data, "data.batch_size=4096"), tmp_path)


@pytest.mark.slow
def test_config_paths_work_from_any_directory(data, tmp_path):
    """A config's relative data.path is its own directory's: `plan` runs from anywhere."""
    config = tmp_path / "cfgs" / "mine.yaml"
    config.parent.mkdir()
    link = tmp_path / "cfgs" / "tiny"
    link.symlink_to(data)
    config.write_text("data:\n  path: tiny\n")
    r = _cli("plan", str(config), "--cluster", str(ROOT / "configs/clusters/cpu-1x2.yaml"),
             "--out", str(tmp_path / "plan"), cwd=tmp_path / "cfgs" / "..")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "plan" / "plan.json").read_text())["model"]["dataset_path"] == (
        str(link))


def test_trainer_state_of_a_restored_run_is_exact(data, run_dir, tmp_path):
    """Restoring the newest checkpoint brings its step, epoch, loader position and examples."""
    trainer = _trainer(data, _copy(run_dir, tmp_path))
    trainer.restore()
    info = json.loads((run_dir / "checkpoints" / "step_00000009" / "trainer_state.json")
                      .read_text())
    assert info["finished"] is True and info["total_steps"] == 9
    assert (trainer.state.step, trainer.state.examples) == (9, 9 * 256)
    assert torch.get_rng_state().shape[0] > 0
