"""``embedtrain tune``: the space file and its errors, the trainer's evaluation hook, and one search
on Ray Tune (a local Ray instance) that is killed mid-way and resumed.

The search (module fixture ``search``): 5 trials of a tiny CTR config over two learning rates and
an embedding dimension whose 6 the model refuses (``model.bottom_mlp`` ends with 8); ASHA with a
grace period of one evaluation and reduction factor 2. The first process is SIGKILLed while the
last trial trains (it has a checkpoint, no summary), with the processes Ray started; ``--resume``
then finishes the search. The tests read what it left: the files, the failed trials, ASHA's
stops, the resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, run_cli

from embedtrain.cli.tune.space import Distribution, check_space, load_space
from embedtrain.config import ConfigError, load_config
from embedtrain.runtime import threads_per_rank
from embedtrain.testing import tiny_ctr_dataset

CONFIG = """
data: {{path: {data}, batch_size: 256, eval_batch_size: 1024}}
model: {{embedding_dim: 8, bottom_mlp: [16, 8], top_mlp: [32, 1]}}
train: {{epochs: 4, max_steps: 40, eval_every: 10, checkpoint_every: 10, eval_max_batches: 2,
         progress: false, threads_per_rank: 1}}
"""
SPACE = """
optim.sparse_lr: {loguniform: [0.001, 0.5]}
optim.dense_lr: {loguniform: [0.0001, 0.01]}
data.batch_size: {choice: [256, 8192]}  # 8192: more than the train split: the trial fails
train.keep_checkpoints: 1               # fixed for every trial
"""
TRIALS = 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    data = tiny_ctr_dataset(root / "data", rows=4000)
    config = root / "tiny.yaml"
    config.write_text(CONFIG.format(data=data))
    space = root / "space.yaml"
    space.write_text(SPACE)
    return root, config, space


def _space(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path


# -- the space file ----------------------------------------------------------------------------

def test_each_distribution_parses_and_round_trips_through_the_config_loader(tiny, tmp_path):
    _, config, _ = tiny
    path = _space(tmp_path, """
optim.sparse_lr: {loguniform: [0.005, 0.2]}
optim.dense_lr: {uniform: [1e-4, 1e-2]}
model.bottom_mlp: {choice: [[16, 8], [32, 8]]}
optim.warmup_steps: {randint: [0, 10]}
train.max_steps: 7
""")
    space = check_space(load_space(path), config, [])
    assert space.keys == ["optim.sparse_lr", "optim.dense_lr", "model.bottom_mlp",
                          "optim.warmup_steps"]
    assert [p.distribution for p in space.params] == [
        Distribution.LOGUNIFORM, Distribution.UNIFORM, Distribution.CHOICE, Distribution.RANDINT]
    assert space.param("optim.dense_lr").values == (1e-4, 1e-2)  # YAML 1.2 floats
    assert space.param("model.bottom_mlp").values == ([16, 8], [32, 8])
    assert space.fixed == {"train.max_steps": 7}
    assert space.param("optim.sparse_lr").log_scale and not space.param("optim.dense_lr").log_scale
    # a trial's values reach the config exactly (floats to the bit, lists, integers)
    values = {"optim.sparse_lr": 0.012345678901234567, "optim.dense_lr": 3.3e-05,
              "model.bottom_mlp": [32, 8], "optim.warmup_steps": 9}
    cfg = load_config(config, space.fixed_overrides() + space.overrides(values))
    assert (cfg.optim.sparse_lr, cfg.optim.dense_lr, cfg.model.bottom_mlp,
            cfg.optim.warmup_steps, cfg.train.max_steps) == (
        0.012345678901234567, 3.3e-05, [32, 8], 9, 7)
    # Ray Tune's domains
    domains = space.param_space()
    assert type(domains["optim.sparse_lr"]).__name__ == "Float"
    assert domains["optim.sparse_lr"].lower == 0.005 and domains["optim.warmup_steps"].upper == 10
    assert domains["model.bottom_mlp"].categories == [[16, 8], [32, 8]]
    assert [type(domains[k].get_sampler()).__name__ for k in space.keys] == [
        "_LogUniform", "_Uniform", "_Uniform", "_Uniform"]


@pytest.mark.parametrize("text,message", [
    ("optim.sparse_lr: {normal: [0, 1]}", "optim.sparse_lr: unknown distribution 'normal'"),
    ("optim.sparse_lr: {uniform: [0.1, 0.2], choice: [0.1]}",
     "optim.sparse_lr: give exactly one of choice, uniform, loguniform, randint, got 2"),
    ("optim.sparse_lr: {uniform: [0.2, 0.1]}",
     "optim.sparse_lr: uniform: lo must be below hi, got [0.2, 0.1]"),
    ("optim.sparse_lr: {loguniform: [0.1, 0.1]}",
     "optim.sparse_lr: loguniform: lo must be below hi, got [0.1, 0.1]"),
    ("optim.sparse_lr: {loguniform: [0, 0.1]}",
     "optim.sparse_lr: loguniform: lo must be positive, got 0"),
    ("optim.warmup_steps: {randint: [5, 5]}",
     "optim.warmup_steps: randint: lo must be below hi, got [5, 5] (hi is excluded"),
    ("optim.warmup_steps: {randint: [0, 5.5]}",
     "optim.warmup_steps: randint: hi must be an integer, got 5.5"),
    ("optim.sparse_lr: {uniform: 0.1}", "optim.sparse_lr: uniform: expected [lo, hi], got 0.1"),
    ("model.embedding_dim: {choice: []}",
     "model.embedding_dim: choice: expected a non-empty list of values, got []"),
    ("train.max_steps: 5", "no key to search"),
    ("- optim.sparse_lr", "expected a mapping of dotted config keys"),
    ("optim: {sparse_lr: {loguniform: [0.01, 0.1]}}",
     "optim: unknown distribution 'sparse_lr'"),
    ("optim.sparse_lr: {uniform: [0.1, 0.2]\n", "invalid YAML"),
])
def test_a_bad_space_file_is_one_line_naming_file_and_key(tmp_path, text, message):
    path = _space(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_space(path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text,message", [
    ("optim.sparse_lrr: {loguniform: [0.01, 0.1]}",
     "optim.sparse_lrr: unknown key (did you mean 'sparse_lr'?) (from loguniform [0.01, 0.1])"),
    ("model.embedding_dim: {choice: [8, 0]}",
     "model.embedding_dim: must be a positive multiple of 4, got 0 (from choice [8, 0])"),
    ("model.embedding_dim: {uniform: [4, 8]}",
     "model.embedding_dim: expected an integer, got float 4.0 (from uniform [4, 8]); uniform "
     "draws floats: use randint or choice"),
    ("optim.sparse: {choice: [sgd, adamw]}", "optim.sparse: 'adamw' is not one of"),
    ("model.dropout: {uniform: [0.5, 1.0]}", "model.dropout: must be in [0, 1), got 1.0"),
    ("optim.warmup_steps: {randint: [-3, 2]}", "optim.warmup_steps: must be at least 0, got -3"),
    ("train.max_stepz: 5\noptim.sparse_lr: {loguniform: [0.01, 0.1]}",
     "train.max_stepz: unknown key (did you mean 'max_steps'?)"),
])
def test_a_key_or_value_the_config_refuses_is_one_line_naming_the_space_file(tiny, tmp_path,
                                                                             text, message):
    _, config, _ = tiny
    path = _space(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        check_space(load_space(path), config, [])
    assert str(e.value) == f"{path}: {message}" or (
        str(e.value).startswith(f"{path}: {message}")), str(e.value)


def test_the_cli_refuses_a_bad_space_before_starting_anything(tiny, tmp_path):
    _, config, _ = tiny
    path = _space(tmp_path, "model.embedding_dim: {choice: [8, -1]}")
    out = tmp_path / "search"
    r = run_cli("tune", str(config), "--space", str(path), "--out", str(out))
    assert r.returncode == 2
    assert r.stderr.strip() == (f"embedtrain tune: error: {path}: model.embedding_dim: must be "
                                f"a positive multiple of 4, got -1 (from choice [8, -1])"), r.stderr
    assert not out.exists()
    r = run_cli("tune", str(config), "--space", str(tmp_path / "none.yaml"), "--out", str(out))
    assert r.returncode == 2 and "none.yaml: search space file not found" in r.stderr
    r = run_cli("tune", str(config), "--space", str(path), "--cpus-per-trial", "2")
    assert r.returncode == 2 and "--cpus-per-trial: only with --engine ray" in r.stderr


def test_a_trial_gets_the_cpus_ray_gives_it_as_torch_threads():
    from embedtrain.cli.tune.trial import _threads

    before = os.environ.get("EMBEDTRAIN_THREADS")
    with _threads(3):
        assert threads_per_rank(None) == (3, "EMBEDTRAIN_THREADS")
        assert threads_per_rank(2) == (2, "train.threads_per_rank")  # a config's wins
    assert os.environ.get("EMBEDTRAIN_THREADS") == before


def test_a_crashing_trial_is_the_last_line_of_its_traceback(tiny, tmp_path, monkeypatch):
    """A trial's failure is one line: the CLI's error line, or a bug's last traceback line (the
    traceback goes to the trial's log)."""
    import embedtrain.recipes
    from embedtrain.cli.tune import trial

    _, config, _ = tiny
    setup = trial.TrialSetup(out=str(tmp_path), base_config=str(config), lock_wait_s=0)
    run = tmp_path / "trials" / "trial_000"
    run.parent.mkdir()
    reporter = trial.EvaluationReporter(run)

    def crash(*args, **kwargs):
        raise KeyError("no such table")

    monkeypatch.setattr(embedtrain.recipes, "fit", crash)  # what a trial trains with
    with trial._trial_output(tmp_path / "log") as log:
        error = trial._train(setup, {"optim.sparse_lr": 0.1}, run, reporter, log)
    assert error == "KeyError: 'no such table'"
    assert "Traceback" in (tmp_path / "log").read_text()

    monkeypatch.undo()
    with trial._trial_output(tmp_path / "log") as log:
        error = trial._train(setup, {"model.embedding_dim": 0}, run, reporter, log)
    assert error == (f"embedtrain train: error: {config}: model.embedding_dim: must be a positive "
                     "multiple of 4, got 0")


def test_a_search_directory_is_resumed_only_with_the_same_settings(tiny, tmp_path):
    """Checked before Ray starts: an earlier search needs --resume, and a resume with another
    setting, config or space is refused naming it; a search that never started (Ray did not
    come up) may start again."""
    _, config, space = tiny
    out = tmp_path / "search"
    argv = ["tune", str(config), "--space", str(space), "--trials", "5", "--out", str(out)]
    for _ in range(2):  # nothing listens there: the search never starts, and may start again
        r = run_cli(*argv, "--engine", "ray", "--address", "127.0.0.1:1")
        assert r.returncode == 2 and "--address 127.0.0.1:1: nothing answers there" in r.stderr
    assert (out / "search.json").is_file() and (out / "base.yaml").is_file()
    (out / "trials").mkdir()  # as if a trial had started
    r = run_cli(*argv)
    assert r.returncode == 2 and "holds an earlier search; pass --resume" in r.stderr
    r = run_cli(*[a if a != "5" else "7" for a in argv], "--resume")
    assert r.returncode == 2 and "(--trials: 5 -> 7)" in r.stderr, r.stderr
    r = run_cli(*argv, "--resume", "--set", "model.top_mlp=[16,1]")
    assert r.returncode == 2 and "(model.top_mlp: [32, 1] -> [16, 1])" in r.stderr, r.stderr
    other = _space(tmp_path, SPACE.replace("0.001, 0.5", "0.001, 0.4"))
    r = run_cli(*[a if a != str(space) else str(other) for a in argv], "--resume")
    assert r.returncode == 2 and f"(the space ({space}))" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# -- the trainer's evaluation hook (no Ray) ------------------------------------------------------

@pytest.mark.slow
def test_on_evaluation_sees_a_consistent_run_and_a_stop_releases_it(tiny, tmp_path):
    """The hook gets each logged record after its checkpoints (the best one) are written, the
    final one after the summary; a hook that raises SystemExit (ASHA stopping a trial) leaves a
    run that ``--resume`` continues in the same process (lock and process group released). The
    hook is ``et.fit``'s ``on_evaluation``, as a trial gives it."""
    import embedtrain as et
    from embedtrain.train import run_dir as run_dir_module
    from embedtrain.train.run_dir import RunDir

    _, config, _ = tiny
    run = tmp_path / "run"
    seen = []

    def hook(trainer, record):
        best = trainer.state.best_step
        seen.append((record["step"], record["auc"], best,
                     best is not None and (run / "checkpoints" / f"step_{best:08d}").is_dir(),
                     (run / "summary.json").is_file()))

    cfg = et.load_config(config, ["train.select=best", "train.max_steps=30"])
    assert et.fit(cfg, run, progress=False, on_evaluation=hook)["steps"] == 30
    records = [r for r in RunDir(run).read_metrics() if r.get("split") == "valid"]
    assert [(s, a) for s, a, *_ in seen] == [(r["step"], r["auc"]) for r in records]
    assert [s for s, *_ in seen] == [10, 20, 30]
    assert all(has_best for *_, has_best, _ in seen)  # the best so far is checkpointed
    assert [done for *_, done in seen] == [False, False, True]  # the final one: run complete

    stopped = tmp_path / "stopped"

    def stop_at_20(trainer, record):
        if record["step"] == 20:
            raise SystemExit(0)

    argv = (str(config), "--out", str(stopped), "--no-progress", "--set", "train.select=best",
            "--set", "train.max_steps=30")
    with pytest.raises(SystemExit):
        et.fit(cfg, stopped, progress=False, on_evaluation=stop_at_20)
    assert str(stopped.resolve()) not in run_dir_module._HELD  # the lock went with the stop
    assert [r["step"] for r in RunDir(stopped).read_metrics()] == [10, 20]
    assert not (stopped / "summary.json").exists()
    r = run_cli("train", *argv, "--resume")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout + r.stderr
    assert json.loads((stopped / "summary.json").read_text())["steps"] == 30


# -- one search, killed and resumed --------------------------------------------------------------

def _hashes(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILLs the search process and what it started (Ray's processes, the trial's worker)."""
    from embedtrain.processes import descendants

    kids = descendants(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for pid in kids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 20
    while any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in kids) \
            and time.monotonic() < deadline:
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except (OSError, IndexError):
        return "zombie"


@pytest.fixture(scope="module")
def search(tiny):
    root, config, space = tiny
    out = root / "search"
    argv = ["tune", str(config), "--space", str(space), "--trials", str(TRIALS), "--out",
            str(out), "--grace-steps", "10", "--reduction-factor", "2", "--seed", "0"]
    last = out / "trials" / f"trial_{TRIALS - 1:03d}"
    log = root / "first.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "embedtrain", *argv], cwd=ROOT,
                                stdout=err, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 240
            while not list((last / "checkpoints").glob("step_*")) and proc.poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            _kill_tree(proc)
    first = log.read_text()
    assert list((last / "checkpoints").glob("step_*")), first[-3000:]
    assert not (last / "summary.json").exists(), "the last trial ended before the kill"
    before = {t.name: _hashes(t) for t in (out / "trials").iterdir() if t != last}
    resumed = run_cli(*argv, "--resume")
    return out, first, before, resumed


@pytest.mark.slow
def test_a_killed_search_resumes_without_rerunning_finished_trials(search):
    out, first, before, resumed = search
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    trials = json.loads((out / "trials.json").read_text())
    assert [t["trial"] for t in trials] == [f"trial_{i:03d}" for i in range(TRIALS)]
    for name, files in before.items():  # ended before the kill: not one file touched
        assert _hashes(out / "trials" / name) == files, name
        assert len(re.findall(r"^== ", (out / "logs" / f"{name}.log").read_text(), re.M)) == 1
    last = out / "trials" / f"trial_{TRIALS - 1:03d}"
    events = [r for r in json.loads("[" + ",".join(
        (last / "metrics.jsonl").read_text().splitlines()) + "]") if r.get("event") == "resume"]
    assert len(events) == 1 and events[0]["step"] >= 10  # went on from its checkpoint
    assert (last / "summary.json").is_file()
    assert f"trial_{TRIALS - 1:03d} started" in resumed.stderr
    # Ray saves its record of the trials every second, so it may start again a trial that ended
    # just before the kill: such a trial is reported as it ended (how and at which step it ended,
    # its best value, as in the first run; its files and log untouched: above), never trained
    # again.
    for name in before:
        if f"tune: {name} started" in resumed.stderr:
            end = rf"^tune: {name} (done|stopped by ASHA|error)( at step \S+)?([^;]*)"
            ends = [re.findall(end, text, re.M) for text in (first, resumed.stderr)]
            assert ends[1] and ends[1] == ends[0][-1:], (name, ends)


@pytest.mark.slow
def test_the_search_writes_consistent_results(search, tiny):
    out, _, _, resumed = search
    trials = json.loads((out / "trials.json").read_text())
    valued = [t for t in trials if t["status"] != "error" and t["best_value"] is not None]
    best = json.loads((out / "best.json").read_text())
    assert best["valid_value"] == max(t["best_value"] for t in valued)
    winner = next(t for t in valued if t["best_value"] == best["valid_value"])
    assert best["run_dir"] == winner["run_dir"] and best["metric"] == "auc"
    # each trial's best value is its run's best validation auc, at that step
    for t in valued:
        records = [json.loads(x) for x in Path(t["run_dir"], "metrics.jsonl").read_text()
                   .splitlines()]
        evals = [r for r in records if r.get("split") == "valid"]
        top = max(evals, key=lambda r: r["auc"])
        assert (t["best_value"], t["step"]) == (top["auc"], top["step"]), t["trial"]
    # best.yaml: the whole config with the winner's values, loadable, = the winner's run config
    cfg = load_config(out / "best.yaml")
    assert cfg.optim.sparse_lr == winner["config"]["optim.sparse_lr"]
    assert cfg.optim.dense_lr == winner["config"]["optim.dense_lr"]
    assert cfg.data.batch_size == winner["config"]["data.batch_size"]
    assert cfg.train.select.value == "best" and cfg.train.keep_checkpoints == 1
    assert cfg == load_config(Path(winner["run_dir"]) / "config.yaml")
    # best.json's test metrics: the winner's selected checkpoint's
    if winner["status"] == "done":
        summary = json.loads(Path(winner["run_dir"], "summary.json").read_text())
        assert best["test"]["auc"] == summary["auc"] and best["test_from"] == "summary.json"
    assert (out / "search.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "search.png").stat().st_size > 20_000
    # the table: one row per trial with its status
    table = [line for line in resumed.stdout.splitlines() if line.startswith("trial_")]
    assert [line.split()[0] for line in table[:TRIALS]] == [t["trial"] for t in trials]
    assert [line.split()[-1] for line in table[:TRIALS]] == [t["status"] for t in trials]
    # a trial's run directory is a normal run: `embedtrain eval` takes it
    r = run_cli("eval", winner["run_dir"], "--split", "valid", "--checkpoint",
                str(winner["step"]))
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["auc"] == pytest.approx(winner["best_value"], abs=1e-6)


@pytest.mark.slow
def test_a_failing_trial_is_one_line_and_the_search_goes_on(search):
    out, _, _, resumed = search
    trials = json.loads((out / "trials.json").read_text())
    failed = [t for t in trials if t["status"] == "error"]
    assert failed and all(t["config"]["data.batch_size"] == 8192 for t in failed)
    for t in failed:
        assert t["error"].startswith("embedtrain train: error: data.batch_size: 8,192 (the "
                                     "global batch) is larger than the train split"), t["error"]
        assert "\n" not in t["error"]
        assert t["best_value"] is None
    ok = [t for t in trials if t["status"] in ("done", "stopped")]
    assert len(ok) + len(failed) == TRIALS and any(t["status"] == "done" for t in ok)
    assert "Traceback" not in resumed.stderr + resumed.stdout


@pytest.mark.slow
def test_asha_stops_trials_that_fall_behind(search):
    """Grace one evaluation, reduction factor 2, trials one after another: a trial below the
    median of those before it at a rung stops. A stopped trial is a consistent run: its
    evaluations up to the stop, its best one checkpointed, no summary, no lock held; the next
    trial ran in the same Ray worker."""
    from embedtrain.train.run_dir import RunDir

    out, first, _, _ = search
    trials = json.loads((out / "trials.json").read_text())
    stopped = [t for t in trials if t["status"] == "stopped"]
    assert stopped, trials
    for t in stopped:
        run = Path(t["run_dir"])
        steps = [r["step"] for r in RunDir(run).read_metrics()]
        assert steps == list(range(10, steps[-1] + 1, 10)) and steps[-1] < 40
        assert not (run / "summary.json").exists()
        assert (run / "checkpoints" / f"step_{t['step']:08d}").is_dir()  # its best evaluation
        RunDir(run).check_unlocked()
    assert "stopped by ASHA at step" in first
    # the trial after a stopped one started in the same worker process
    pids = {}
    for log in (out / "logs").glob("*.log"):
        for name, pid in re.findall(r"^== (trial_\d+) \([^)]*, pid (\d+)\)", log.read_text(),
                                    re.M):
            pids.setdefault(name, pid)
    index = {t["trial"]: i for i, t in enumerate(trials)}
    after = [trials[index[t["trial"]] + 1]["trial"] for t in stopped
             if index[t["trial"]] + 1 < len(trials)]
    assert any(pids[n] == pids[s["trial"]] for n, s in zip(after, stopped)), pids


@pytest.mark.slow
def test_a_stopped_best_trial_is_tested_from_its_best_checkpoint(search, tmp_path):
    """best.json of a trial ASHA stopped (no summary): its best checkpoint on the test split,
    as `embedtrain eval --split test --checkpoint STEP` reports it."""
    from embedtrain.cli.tune import results

    out, _, _, _ = search
    t = next(t for t in json.loads((out / "trials.json").read_text())
             if t["status"] == "stopped")
    outcome = results.TrialOutcome(t["trial"], 0, t["config"], results.TrialStatus(t["status"]),
                                   Path(t["run_dir"]), t["best_value"], t["step"])
    written = results.write_best(tmp_path, outcome, "auc", True)
    assert written == json.loads((tmp_path / "best.json").read_text())
    assert written["test_step"] == t["step"] and written["valid_value"] == t["best_value"]
    r = run_cli("eval", t["run_dir"], "--split", "test", "--checkpoint", str(t["step"]))
    assert r.returncode == 0, r.stderr[-2000:]
    assert written["test"]["auc"] == pytest.approx(json.loads(r.stdout)["auc"], abs=1e-9)


def test_a_mapping_choice_sets_keys_together_and_keeps_the_rest_of_the_section(tiny, tmp_path):
    """``model: {choice: [{embedding_dim: 8, bottom_mlp: [64, 8]}, ...]}``: the keys that must
    change together (the bottom MLP ends with the embedding size), set one by one, so the
    section's other keys (the config's interaction) stay."""
    from embedtrain.cli.tune.space import as_overrides

    base = ROOT / "configs" / "dcn_synthetic.yaml"
    space_file = tmp_path / "space.yaml"
    space_file.write_text("model: {choice: [{embedding_dim: 8, bottom_mlp: [64, 8]}, "
                          "{embedding_dim: 32, bottom_mlp: [64, 32]}]}\n")
    space = check_space(load_space(space_file), base, [f"data.path={tiny[0] / 'data'}"])
    assert space.keys == ["model"]
    assert space.params[0].values == ({"embedding_dim": 8, "bottom_mlp": [64, 8]},
                                      {"embedding_dim": 32, "bottom_mlp": [64, 32]})
    overrides = as_overrides({"model": {"embedding_dim": 32, "bottom_mlp": [64, 32]}})
    assert overrides == ["model.embedding_dim=32", "model.bottom_mlp=[64, 32]"]
    cfg = load_config(base, overrides)
    assert (cfg.model.embedding_dim, cfg.model.bottom_mlp) == (32, [64, 32])
    assert cfg.model.interaction.value == "dcn" and cfg.model.dcn_num_layers == 2


def test_a_stopped_trial_started_again_is_reported_at_the_step_it_stopped(tmp_path, monkeypatch):
    """A trial ASHA stopped keeps the step in its end mark; Ray starting it again after a kill of
    the search gets it reported as stopped at that step (not trained again, not finished)."""
    from types import SimpleNamespace

    from ray import tune

    from embedtrain.cli.tune import trial

    reports: list[dict] = []
    context = SimpleNamespace(get_trial_name=lambda: "trial_007", get_trial_resources=lambda: (
        SimpleNamespace(required_resources={"CPU": 1})))
    monkeypatch.setattr(tune, "get_context", lambda: context)
    monkeypatch.setattr(tune, "report", reports.append)
    monkeypatch.setattr(trial.EvaluationReporter, "_best", lambda self: {})
    trained = []

    def stopped_by_the_scheduler(setup, config, run_dir, reporter, log):
        trained.append(run_dir)
        trainer = SimpleNamespace(select_metric="auc", train_data=range(20))  # 20 steps a pass
        reporter(trainer, {"step": 30, "auc": 0.7})
        raise SystemExit(0)  # what tune.report does to a trial the scheduler stops

    monkeypatch.setattr(trial, "_train", stopped_by_the_scheduler)
    setup = trial.TrialSetup(out=str(tmp_path), base_config="unused.yaml")
    with pytest.raises(SystemExit):
        trial.run_trial({"optim.sparse_lr": 0.1}, setup)
    assert reports == [{"step": 30, "passes": 1.5, "value": 0.7, "score": 0.7}]
    reports.clear()
    trial.run_trial({"optim.sparse_lr": 0.1}, setup)  # Ray starts it again
    assert len(trained) == 1
    assert reports == [{"finished": False, "step": 30}]


@pytest.mark.slow
def test_report_of_a_search_shows_its_trials_and_their_curves(search, tmp_path):
    out = search[0]
    before = {t.name: _hashes(t) for t in (out / "trials").iterdir()}
    r = run_cli("report", str(out), "--out", str(tmp_path / "search.html"))
    assert r.returncode == 0, r.stderr
    assert {t.name: _hashes(t) for t in (out / "trials").iterdir()} == before
    page = (tmp_path / "search.html").read_text()
    trials = json.loads((out / "trials.json").read_text())
    best = json.loads((out / "best.json").read_text())["trial"]
    searched = page.split("<h2>Searches</h2>")[1]
    for t in trials:
        mark = "★ " if t["trial"] == best else ""
        assert f"<td>{mark}{t['trial']}</td><td>{t['status']}</td>" in searched
        ran = (out / "trials" / t["trial"] / "config.yaml").is_file()
        assert (f"<b>{out.name}/{t['trial']}</b>" in page) == ran  # its run among the curves
