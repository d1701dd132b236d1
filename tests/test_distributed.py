"""Two gloo ranks through torchrun: restart after SIGKILL, and checkpoints across world sizes.

Each test launches real processes (``embedtrain train --nproc 2`` runs torchrun), so they are
slow-ish (~20-30 s per launch on 2 cores) and marked ``slow``.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from embedtrain.processes import free_port
from embedtrain.testing import tiny_ctr_dataset
from embedtrain.train.run_dir import RunDir
from conftest import run_cli
from test_train_cli import _assert_equal, _params

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "embedtrain", *args]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def embedtrain(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(*args), capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=timeout)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    data = tiny_ctr_dataset(root / "data", rows=12000)
    config = root / "tiny.yaml"
    config.write_text(f"""
data: {{path: {data}, batch_size: 128, eval_batch_size: 1024, num_workers: 1}}
model: {{embedding_dim: 8, bottom_mlp: [16, 8], top_mlp: [32, 1]}}
train: {{epochs: 3, eval_every: 100, checkpoint_every: 10, keep_checkpoints: 50, progress: false}}
""")
    two = root / "two"
    r = embedtrain("train", str(config), "--out", str(two), "--nproc", "2")
    assert r.returncode == 0, r.stderr[-4000:]
    # two ranks on this machine share its cores (embedtrain.runtime.threads_per_rank)
    cores = len(os.sched_getaffinity(0))
    assert f"threads: {max(1, cores // 2)} per rank (cores / local ranks = {cores} / 2)" in r.stderr
    return root, config, two


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _rank_pids(run_dir: Path, rank: int) -> list[int]:
    """Worker processes of a torchrun job writing to ``run_dir``, by their RANK variable."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(run_dir).encode() in cmd and f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            pids.append(int(proc.name))
    return pids


def test_two_ranks_train_with_the_plan(setup):
    _, _, two = setup
    s = _summary(two)
    assert s["world_size"] == 2 and s["steps"] > 100
    plan = json.loads((two / "plan.json").read_text())
    assert plan["cluster"]["world_size"] == 2 and plan["cluster"]["device"] == "cpu"
    measured = json.loads((two / "plan_vs_measured.json").read_text())
    assert len(measured["ranks"]) == 2
    assert measured["max_abs_deviation"] < 0.10  # the planner's per-rank embedding bytes
    assert len(list((two / "checkpoints").glob("step_*/rank_0000[01].pt"))) >= 2


def test_sigkill_restart_equals_uninterrupted(setup, tmp_path):
    _, config, two = setup
    run = tmp_path / "killed"
    job = subprocess.Popen(_cmd("train", str(config), "--out", str(run), "--nproc", "2",
                                "--max-restarts", "1"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=_env(), cwd=ROOT, start_new_session=True)
    killed = None
    try:
        deadline = time.time() + 300
        while time.time() < deadline and job.poll() is None:
            if (run / "checkpoints" / "step_00000010" / "trainer_state.json").exists():
                pids = _rank_pids(run, 1)
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed = pids[0]
                    break
            time.sleep(0.02)
        out, _ = job.communicate(timeout=400)
    finally:
        if job.poll() is None:  # never leave a hung job behind
            os.killpg(job.pid, signal.SIGKILL)
    assert killed is not None, out[-3000:]
    assert job.returncode == 0, out[-4000:]
    assert "resumed from" in out  # the restarted workers continued from the last checkpoint
    a = _params(sorted((two / "checkpoints").glob("step_*"))[-1], tmp_path)
    b = _params(sorted((run / "checkpoints").glob("step_*"))[-1], tmp_path)
    _assert_equal(a["model"], b["model"])
    _assert_equal(a["optimizer"], b["optimizer"])
    assert _summary(run)["auc"] == _summary(two)["auc"]


def test_every_training_row_once_per_epoch_on_1_2_3_ranks(tmp_path):
    """7,211 training rows (odd, 1 mod 3) in 512-row groups: on 1, 2 and 3 ranks an epoch counts
    exactly 7,211 examples, the ranks step together, and padding (never counted) is the
    world_size - (rows mod world_size) rows that equalise the last step's batches."""
    data = tiny_ctr_dataset(tmp_path / "data", rows=9005)
    rows = json.loads((data / "metadata.json").read_text())["splits"]["train"]["rows"]
    assert rows == 7211 and rows % 2 == 1 and rows % 3 == 2
    for n in (1, 2, 3):
        run = tmp_path / f"ranks{n}"
        args = ["train", "configs/dlrm_synthetic.yaml", "--out", str(run), "--no-progress",
                "--set", f"data.path={data}", "--set", "data.batch_size=192",
                "--set", "data.eval_batch_size=1536", "--set", "train.eval_every=0",
                "--set", "train.checkpoint_every=0", "--set", "train.epochs=1"]
        r = run_cli(*args) if n == 1 else embedtrain(*args, "--nproc", str(n))
        assert r.returncode == 0, r.stderr[-3000:]
        s = _summary(run)
        assert s["examples"] == s["train_rows"] == rows, (n, s["examples"])
        assert s["steps"] == -(-(-(-rows // n)) // (192 // n))
        assert s["padded_rows"] == (-rows) % n
        shares = " + ".join(f"{rows // n + (k < rows % n):,}" for k in range(n))
        expected = f"train rows: {rows:,}" + (f" over {n} ranks ({shares})" if n > 1 else "")
        assert expected in r.stderr, r.stderr[-2000:]


def test_checkpoint_of_two_ranks_loads_on_one(setup, tmp_path):
    _, _, two = setup
    r = run_cli("eval", str(two), "--split", "test")
    assert r.returncode == 0, r.stderr[-3000:]
    final = _summary(two)
    result = json.loads(r.stdout)  # eval writes nothing into the run
    assert result["step"] == final["steps"]
    assert result["auc"] == pytest.approx(final["auc"], abs=1e-9)
    assert result["logloss"] == pytest.approx(final["logloss"], rel=1e-6)


def test_checkpoint_of_one_rank_loads_on_two_and_resumes(setup, tmp_path):
    _, config, _ = setup
    one = tmp_path / "one"
    r = run_cli("train", str(config), "--out", str(one), "--set", "train.max_steps=40")
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "embedtrain", "eval", str(one), "--split", "test",
         "--out", str(tmp_path / "eval.json")],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "eval.json").read_text())
    assert json.loads(r.stdout) == result
    assert result["step"] == 40
    assert result["auc"] == pytest.approx(_summary(one)["auc"], abs=1e-9)
    # Training continues on two ranks from the one-rank checkpoint (optimizer state resharded).
    r = embedtrain("train", str(config), "--out", str(one), "--resume", "--nproc", "2",
                   "--set", "train.max_steps=60")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "loaded on 2" in r.stdout + r.stderr
    assert _summary(one)["steps"] == 60 and _summary(one)["world_size"] == 2
    # The allowed change is recorded with the resume, and config.yaml is the config now in use.
    (resume,) = [x for x in RunDir(one).read_records() if x.get("event") == "resume"]
    assert resume["step"] == 40 and resume["config_changes"] == {"train.max_steps": [40, 60]}
    assert "max_steps: 60" in (one / "config.yaml").read_text()


def test_xc_head_split_over_two_ranks_evaluates_on_one(tmp_path):
    """A Partial FC head split by classes over 2 ranks: the plan's per-rank bytes (tables + head
    slice + its Adagrad state) match what each rank holds, and the checkpoint, resharded onto
    1 rank, evaluates to the 2-rank run's P@k."""
    from embedtrain.datagen import XCDataSpec, generate_xc

    data = tmp_path / "xc"
    generate_xc(XCDataSpec(classes=301, rows=6000, vocab=2000, noise=0.5, seed=2,
                           rows_per_row_group=1000), data, progress=False)
    run = tmp_path / "run"
    r = embedtrain("train", "configs/xc_synthetic.yaml", "--out", str(run), "--nproc", "2",
                   "--set", f"data.path={data}", "--set", "data.batch_size=128",
                   "--set", "head.kind=partial_fc", "--set", "head.sample_rate=0.3",
                   "--set", "train.max_steps=30", "--set", "train.checkpoint_every=10",
                   "--set", "train.progress=false")
    assert r.returncode == 0, r.stderr[-4000:]
    plan = json.loads((run / "plan.json").read_text())
    (head,) = [t for t in plan["tables"] if t["name"] == "class_head"]
    assert head["sharding_type"] == "row_wise" and head["ranks"] == [0, 1]
    measured = json.loads((run / "plan_vs_measured.json").read_text())
    assert measured["max_abs_deviation"] < 0.01, measured
    final = _summary(run)
    assert final["world_size"] == 2 and len(final["peak_rss_gb_per_rank"]) == 2
    r = run_cli("eval", str(run), "--split", "test")
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert result["step"] == 30
    for key in ("p@1", "p@5", "ndcg@5"):
        assert result[key] == pytest.approx(final[key], abs=1e-9), key
    assert result["loss"] == pytest.approx(final["loss"], rel=1e-5)


def test_bad_input_on_one_rank_is_one_line_per_process(tmp_path):
    """A label only rank 1 reads: rank 1 names file, column and row, rank 0 says it stopped for a
    peer, the launcher names the rank; exit status 2, no traceback anywhere."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tiny_ctr_dataset(tmp_path / "data", rows=4000)
    meta = json.loads((data / "metadata.json").read_text())
    path = data / meta["splits"]["train"]["files"][-1]
    table = pq.read_table(path)
    labels = table.column("label").to_numpy().copy()
    labels[-5] = 7  # in the second half of the rows: rank 1's share
    table = table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels))
    pq.write_table(table, path, row_group_size=512)
    row = table.num_rows - 5
    r = embedtrain("train", "configs/dlrm_synthetic.yaml", "--out", str(tmp_path / "run"),
                   "--nproc", "2", "--no-progress", "--set", f"data.path={data}",
                   "--set", "data.batch_size=256", "--set", "data.eval_batch_size=1024")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr
    lines = r.stderr.strip().splitlines()
    rank1 = (f"embedtrain train: [rank 1/2] error: {path}: column label: label 7 at row {row} is "
             "not a click (CTR labels are 0 or 1, or a probability in [0, 1])")
    # Rank 0 says so if it notices before torchrun stops it (SIGTERM), which varies with timing.
    rank0 = ("embedtrain train: [rank 0/2] error: stopped because another rank left the process "
             "group (its error says why)")
    assert rank1 in lines
    assert {line for line in lines if " error: " in line} <= {rank1, rank0}
    assert lines[-1] == ("embedtrain: rank 1 of 2 exited with status 2; 1 other rank(s) stopped "
                         "after it (its error is above)")


def _hang_in_rank(rank, world):
    if rank == 1:
        time.sleep(600)  # never returns: spawn's deadline ends it
    return rank


def _hang_after_return(rank, world):
    import embedtrain.processes as processes

    processes.exit_process = lambda code, barrier: time.sleep(600)  # a teardown that never ends
    return rank


@pytest.mark.serial  # its ranks must start within the 8 s before the stacks are taken
def test_spawn_timeout_shows_where_a_rank_hangs():
    from embedtrain.processes import spawn

    with pytest.raises(TimeoutError) as err:
        spawn(_hang_in_rank, 2, timeout=16.0)  # stacks at 8 s: time for a loaded machine's start
    text = str(err.value)
    # rank 0 returned and waits for rank 1 in the exit barrier
    assert text.startswith("spawn(_hang_in_rank): rank(s) [0, 1] still running after 16 s; "
                           "killed")
    assert "rank 1's threads:" in text and "in _hang_in_rank" in text


def test_spawn_returns_the_results_when_only_teardown_hangs(monkeypatch):
    import embedtrain.processes as processes

    warnings = []
    monkeypatch.setattr(processes, "_TEARDOWN_GRACE_S", 1.0)
    monkeypatch.setattr(processes._log, "warning", lambda msg, *a: warnings.append(msg % a))
    assert processes.spawn(_hang_after_return, 2, timeout=60.0) == [0, 1]
    assert warnings == ["spawn(_hang_after_return): rank(s) [0, 1] returned but did not exit "
                        "within 1 s; killed"]


def _probe(rank, world):
    from embedtrain import fbgemm_cpu  # the server imported embedtrain before TorchRec

    return os.environ.get("EMBEDTRAIN_PROBE"), os.getcwd(), fbgemm_cpu.state


def test_spawned_ranks_take_the_callers_environment_and_directory(monkeypatch, tmp_path):
    # the ranks are forked by a server started at the first spawn: what the caller set after
    # that start still reaches them
    from embedtrain.processes import spawn

    spawn(_probe, 2)  # the server runs from here on
    monkeypatch.setenv("EMBEDTRAIN_PROBE", "after")
    monkeypatch.chdir(tmp_path)
    assert spawn(_probe, 2) == [("after", str(tmp_path), "torch")] * 2
