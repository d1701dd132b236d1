"""One writer per run directory, ``--out`` checks, and resumes that never duplicate a record."""

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from embedtrain.testing import tiny_ctr_dataset
from embedtrain.train.run_dir import RunDir, RunDirError
from conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent


def embedtrain(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "embedtrain", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("rundir")
    data = tiny_ctr_dataset(root / "data", rows=3000)
    config = root / "tiny.yaml"
    config.write_text(f"""
data: {{path: {data}, batch_size: 256, eval_batch_size: 1024, num_workers: 0}}
model: {{embedding_dim: 8, bottom_mlp: [16, 8], top_mlp: [16, 1]}}
train: {{max_steps: 9, eval_every: 3, checkpoint_every: 3, keep_checkpoints: 5, progress: false}}
""")
    return root, config


def _files(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    RunDir(tmp_path / "run").lock()
    holder = subprocess.run([sys.executable, "-c", (
        "from embedtrain.train.run_dir import RunDir\n"
        f"RunDir({str(tmp_path / 'run')!r}).lock()")], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert holder.returncode != 0
    assert (f"run: another embedtrain train is writing this run (pid {os.getpid()} on "
            f"{socket.gethostname()}); wait for it to end, or choose another --out") in holder.stderr
    RunDir(tmp_path / "run").unlock()
    RunDir(tmp_path / "run").lock()  # free again once released
    RunDir(tmp_path / "run").unlock()


def test_train_beside_a_running_train_is_refused_at_once(tiny, tmp_path):
    _, config = tiny
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "embedtrain", "train", str(config), "--out",
                              str(run), "--set", "train.max_steps=400", "--set",
                              "train.eval_every=0"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.time() + 120
        while not (run / "checkpoints").is_dir() and time.time() < deadline:
            time.sleep(0.2)
        started = time.time()
        second = embedtrain("train", str(config), "--out", str(run), "--resume",
                            "--set", "train.max_steps=400", "--set", "train.eval_every=0")
        took = time.time() - started
        assert second.returncode == 2, second.stderr
        assert second.stderr.strip().splitlines() == [
            f"embedtrain train: error: {run}: another embedtrain train is writing this run (pid "
            f"{first.pid} on {socket.gethostname()}); wait for it to end, or choose another --out"]
        print(f"refused in {took:.2f} s")
        _, err = first.communicate(timeout=300)
        assert first.returncode == 0, err[-2000:]
    finally:
        if first.poll() is None:
            first.kill()
    steps = [r["step"] for r in RunDir(run).read_records()]
    assert steps == sorted(set(steps))  # the first run's records, once each


@pytest.mark.parametrize("make, expected", [
    (lambda p: p.write_text("x"), "{out}: is a file, not a run directory; choose another --out"),
    (lambda p: p.parent.joinpath("f").write_text("x"),
     "{out}: lies under the file {file}, not a run directory; choose another --out"),
    (lambda p: (p.mkdir(), p.joinpath("notes.txt").write_text("x")),
     "{out}: not empty and not a run directory (holds notes.txt); choose another --out"),
])
def test_out_that_is_not_a_run_is_refused(tiny, tmp_path, make, expected):
    _, config = tiny
    target = tmp_path / "out"
    make(target)
    out = tmp_path / "f" / "run" if "under" in expected else target
    r = run_cli("train", str(config), "--out", str(out))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["embedtrain train: error: " + expected.format(
        out=out, file=tmp_path / "f")]


def test_a_finished_run_is_never_shortened_and_a_crash_before_the_summary_resumes(tiny, tmp_path):
    _, config = tiny
    full, part = tmp_path / "full", tmp_path / "part"
    r = run_cli("train", str(config), "--out", str(full))
    assert r.returncode == 0, r.stderr[-2000:]
    before = _files(full)
    r = run_cli("train", str(config), "--out", str(full), "--resume",
                   "--set", "train.max_steps=5")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--resume would shorten the run to 5 steps, below its checkpoint at step 9" in r.stderr
    assert _files(full) == before  # not even the lock file

    # killed after the final checkpoint and the curves, before summary.json (written last): the
    # resume writes the summary without a second record of the final evaluation; killed before
    # its first checkpoint, after evaluations were logged: the resume starts over and logs them
    # once
    early = tmp_path / "early"
    shutil.copytree(full, part)
    (part / "summary.json").unlink()
    early.mkdir()
    for name in ("config.yaml", "metrics.jsonl"):
        shutil.copy(full / name, early / name)
    timing = {"wall_time_s", "train_time_s", "train_examples_per_s", "startup_s", "startup",
              "peak_rss_gb_per_rank"}
    for run in (part, early):
        r = run_cli("train", str(config), "--out", str(run), "--resume")
        assert r.returncode == 0, r.stderr[-2000:]
        records = [x for x in RunDir(run).read_records() if "event" not in x]
        assert [x["step"] for x in records] == [3, 6, 9]
        assert records == [x for x in RunDir(full).read_records() if "event" not in x]
        a, b = (json.loads((d / "summary.json").read_text()) for d in (full, run))
        assert {k: v for k, v in a.items() if k not in timing} == \
            {k: v for k, v in b.items() if k not in timing}


def test_a_torn_last_record_and_records_past_the_checkpoint_go_on_resume(tmp_path):
    run = RunDir(tmp_path)
    for step in (3, 6):
        run.log_metrics({"step": step, "split": "valid"})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "spl')  # killed mid-append
    assert [r["step"] for r in run.read_records()] == [3, 6]
    assert run.truncate_after(3) == 2
    run.log_resume(3, "ckpt")
    assert [(r.get("event"), r["step"]) for r in run.read_records()] == [(None, 3), ("resume", 3)]


def test_a_pinned_checkpoint_is_not_pruned_while_read(tmp_path):
    import torch

    from embedtrain.train.checkpoint import CheckpointManager

    ckpts = CheckpointManager(tmp_path, keep=1)
    ckpts.save(1, {"w": torch.ones(2)}, {"step": 1})
    with ckpts.reading() as held:
        assert held == ckpts.path(1)
        ckpts.save(2, {"w": torch.ones(2)}, {"step": 2})
        assert [p.name for p in ckpts.all()] == ["step_00000001", "step_00000002"]
    ckpts.save(3, {"w": torch.ones(2)}, {"step": 3})  # released: pruned now
    assert [p.name for p in ckpts.all()] == ["step_00000003"]
    assert ckpts.find("3") == ckpts.path(3)
    with pytest.raises(Exception, match=r"step_00000007: no such checkpoint \(steps of this run: 3\)"):
        ckpts.find("7")


def test_a_prune_or_save_killed_half_way_leaves_nothing_the_next_run_keeps(tmp_path, monkeypatch):
    import torch

    from embedtrain.train import checkpoint
    from embedtrain.train.checkpoint import CheckpointManager

    ckpts = CheckpointManager(tmp_path, keep=1)
    ckpts.save(1, {"w": torch.ones(2)}, {"step": 1})
    with monkeypatch.context() as m:  # killed after the prune's rename, before its delete
        m.setattr(checkpoint.shutil, "rmtree", lambda *a, **k: None)
        ckpts.save(2, {"w": torch.ones(2)}, {"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == [  # step 1 out of view, whole
        ".tmp-pruned-step_00000001", "step_00000002"]
    (tmp_path / "step_00000005").mkdir()  # an older version's prune, killed half-way
    (tmp_path / "step_00000005" / ".metadata").write_bytes(b"")
    (tmp_path / ".tmp-step_00000006").mkdir()  # a save killed half-way
    assert ckpts.remove_leftovers() == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]


def test_the_summary_is_written_last(tiny, tmp_path, monkeypatch):
    """A run that has a summary has every file: a kill before it leaves a run to resume."""
    from embedtrain.config import load_config
    from embedtrain.recipes import build_run

    _, config = tiny
    run = build_run(load_config(config, ["train.max_steps=2", "train.eval_every=0"]), tmp_path)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(RunDir, "plot_curves", killed)
    with pytest.raises(KeyboardInterrupt):
        run.trainer.fit()
    assert not (tmp_path / "summary.json").exists()
    assert (tmp_path / "checkpoints" / "step_00000002").is_dir()


def test_run_dir_errors_are_value_errors():
    assert issubclass(RunDirError, ValueError)  # the CLI's one-line errors
