"""Signals reach every rank of ``embedtrain train --nproc 2``, and no worker outlives its launcher.

SIGTERM to the launcher, SIGINT to its process group: torchrun and both workers are gone within
10 s, the run says so in one line (no traceback) and exits 128 + the signal, and ``--resume``
finishes the run. SIGKILL to the launcher's whole group (no handler runs), or to torchrun alone: the parent-death
signals (``embedtrain.processes.die_with_parent``) take torchrun and the workers with it.

The end-to-end tests launch real processes (7-25 s each on 2 cores) and are marked ``slow``;
the supervisor, the parent-death race and torchrun's last line are checked in a second or two.
Their deadlines are seconds, so the module is ``serial``: ``make test`` runs it alone.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from embedtrain.processes import PARENT_PID_ENV
from embedtrain.testing import tiny_ctr_dataset

ROOT = Path(__file__).resolve().parent.parent
slow = pytest.mark.slow
pytestmark = pytest.mark.serial
STEPS = 20000  # minutes of training: each run is stopped mid-way (its resume runs to RESUMED)
RESUMED = 40


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("signals")
    data = tiny_ctr_dataset(root / "data", rows=4000)
    path = root / "tiny.yaml"
    path.write_text(f"""
data: {{path: {data}, batch_size: 64, eval_batch_size: 1024, num_workers: 1}}
model: {{embedding_dim: 4, bottom_mlp: [8, 4], top_mlp: [8, 1]}}
train: {{max_steps: {STEPS}, epochs: 1000, eval_every: 0, checkpoint_every: 5,
         keep_checkpoints: 2, progress: false}}
""")
    return path


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _start(config: Path, run: Path, log: Path) -> subprocess.Popen:
    """``embedtrain train --nproc 2`` in a session of its own; its output goes to ``log``."""
    with open(log, "w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "embedtrain", "train", str(config), "--out", str(run),
             "--nproc", "2", "--no-progress"],
            stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT, start_new_session=True)


def _processes_of(run: Path) -> list[int]:
    """Every live process whose command line names ``run`` (the launcher, torchrun, workers)."""
    needle = str(run).encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if needle in cmd and state != "Z":  # a zombie has ended (its parent not yet waited)
            pids.append(int(proc.name))
    return pids


def _workers_of(run: Path) -> list[int]:
    pids = []
    for pid in _processes_of(run):
        try:
            if b"LOCAL_RANK=" in Path(f"/proc/{pid}/environ").read_bytes():
                pids.append(pid)
        except OSError:
            continue
    return pids


def _wait_for_training(job: subprocess.Popen, run: Path, log: Path) -> None:
    """Until both workers run and the run has its first checkpoint (training under way)."""
    deadline = time.time() + 240
    while time.time() < deadline and job.poll() is None:
        if list((run / "checkpoints").glob("step_*/trainer_state.json")) \
                and len(_workers_of(run)) == 2:
            return
        time.sleep(0.05)
    _cleanup(job, run)
    pytest.fail(f"training did not start (status {job.poll()}):\n{log.read_text()[-3000:]}")


def _gone_within(run: Path, seconds: float) -> list[int]:
    """The processes of ``run`` still alive after ``seconds`` (waits less when none is left)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        left = _processes_of(run)
        if not left:
            return []
        time.sleep(0.1)
    return _processes_of(run)


def _cleanup(job: subprocess.Popen, run: Path) -> None:
    """Never leave a process of the run behind, whatever the test found."""
    for pid in _processes_of(run):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if job.poll() is None:
        job.kill()
    job.wait(timeout=30)


def _stop(config: Path, tmp_path: Path, send) -> tuple[subprocess.Popen, Path, list[str], float]:
    """Starts a run, waits for training, calls ``send(job)``; the lines printed after it and
    the seconds until no process of the run was left."""
    run, log = tmp_path / "run", tmp_path / "train.log"
    job = _start(config, run, log)
    try:
        _wait_for_training(job, run, log)
        before = log.read_text().splitlines()
        sent = time.time()
        send(job)
        left = _gone_within(run, 10)
        took = time.time() - sent
        assert not left, f"still running 10 s after the signal: {left}\n{log.read_text()[-3000:]}"
        job.wait(timeout=5)
    finally:
        _cleanup(job, run)
    after = log.read_text().splitlines()
    assert after[:len(before)] == before
    return job, run, after[len(before):], took


def _step(run: Path) -> int:
    states = sorted((run / "checkpoints").glob("step_*/trainer_state.json"))
    return json.loads(states[-1].read_text())["step"] if states else 0


@slow
def test_sigterm_to_the_launcher_stops_every_rank_and_the_run_resumes(config, tmp_path):
    job, run, lines, took = _stop(config, tmp_path, lambda job: job.send_signal(signal.SIGTERM))
    assert lines == [f"embedtrain: stopped by SIGTERM; continue the run in {run} with --resume"]
    assert job.returncode == 128 + signal.SIGTERM
    step = _step(run)
    assert 0 < step < RESUMED  # stopped mid-training, a checkpoint kept
    print(f"stopped at step {step} in {took:.1f} s")
    r = subprocess.run([sys.executable, "-m", "embedtrain", "train", str(config), "--out",
                        str(run), "--nproc", "2", "--no-progress", "--resume",
                        "--set", f"train.max_steps={RESUMED}"],
                       capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resumed from" in r.stdout + r.stderr, r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == RESUMED and summary["world_size"] == 2


@slow
def test_sigint_to_the_process_group_stops_every_rank(config, tmp_path):
    job, run, lines, took = _stop(config, tmp_path, lambda job: os.killpg(job.pid, signal.SIGINT))
    assert lines == [f"embedtrain: stopped by SIGINT; continue the run in {run} with --resume"]
    assert job.returncode == 128 + signal.SIGINT
    assert 0 < _step(run) < STEPS
    print(f"stopped in {took:.1f} s")


@slow
def test_sigkill_to_the_process_group_takes_every_worker_with_it(config, tmp_path):
    job, run, lines, took = _stop(config, tmp_path, lambda job: os.killpg(job.pid, signal.SIGKILL))
    assert job.returncode == -signal.SIGKILL
    assert not any("Traceback" in line for line in lines), lines
    print(f"all gone in {took:.1f} s")


@slow
def test_sigkill_to_torchrun_takes_its_workers_with_it(config, tmp_path):
    def kill_torchrun(job):
        torchrun = [p for p in _processes_of(tmp_path / "run")
                    if b"embedtrain.train.launch" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(torchrun) == 1
        os.kill(torchrun[0], signal.SIGKILL)

    job, run, lines, took = _stop(config, tmp_path, kill_torchrun)
    assert lines == [f"embedtrain: torchrun was killed by SIGKILL; continue the run in {run} "
                     "with --resume"]
    assert job.returncode == 128 + signal.SIGKILL
    print(f"all gone in {took:.1f} s")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_supervisor_passes_a_signal_on_once_then_kills_what_is_left(tmp_path):
    """SIGTERM to the supervising process reaches its child (which says so and exits 143); a
    child that ignores it is SIGKILLed, with its own children, after the grace period."""
    polite = _python("import signal, sys, time\n"
                     "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(128 + s))\n"
                     "open(sys.argv[1], 'w').close(); time.sleep(60)")
    stubborn = _python("import os, signal, subprocess, sys, time\n"
                       "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                       "kid = subprocess.Popen([sys.executable, '-c', 'import time; "
                       "time.sleep(60)'])\n"
                       "open(sys.argv[1], 'w').write(str(kid.pid)); time.sleep(60)")
    for child, code, grace in ((polite, 143, 5.0), (stubborn, -9, 1.0)):
        ready = tmp_path / f"ready{code}"
        job = subprocess.Popen(_python(
            "import sys; from embedtrain.processes import run_supervised\n"
            f"print(run_supervised({child + [str(ready)]!r}, grace={grace}))"),
            stdout=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
        deadline = time.time() + 30
        while not (ready.exists() and (code == 143 or ready.read_text())):
            assert time.time() < deadline and job.poll() is None
            time.sleep(0.02)
        start = time.time()
        job.send_signal(signal.SIGTERM)
        out, _ = job.communicate(timeout=15)
        assert out.strip() == f"({code}, {int(signal.SIGTERM)})"
        assert job.returncode == 0 and time.time() - start < grace + 2
        if code == -9:  # the grandchild went too
            assert not _alive(int(ready.read_text()))


def test_a_child_whose_parent_is_already_gone_ends_at_once():
    """The start race of die_with_parent: a parent that is not the expected one means the
    expected parent died before the request took effect: the child signals itself."""
    code = ("from embedtrain.processes import die_with_parent; import signal\n"
            "print(die_with_parent(signal.SIGTERM))")
    r = subprocess.run(_python(code), capture_output=True, text=True, timeout=60,
                       env={**_env(), PARENT_PID_ENV: str(os.getpid())})
    assert r.returncode == 0 and r.stdout.strip() == "True"  # the parent is the one named
    r = subprocess.run(_python(code), capture_output=True, text=True, timeout=60,
                       env={**_env(), PARENT_PID_ENV: "1"})  # any pid that is not the parent
    assert r.returncode == -signal.SIGTERM and r.stdout == ""


def test_torchruns_last_line_for_a_rank_killed_by_a_signal(capsys):
    """A rank killed by a signal printed nothing: the line says how it ended, and the restarts,
    and points above only for a rank that printed its error."""
    import argparse

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from embedtrain.train.launch import _failed

    def last_line(exitcode: int, restarts: int) -> tuple[str, int]:
        failure = ProcessFailure(local_rank=1, pid=100, exitcode=exitcode, error_file="<N/A>")
        code = _failed(ChildFailedError("embedtrain", {1: failure}),
                       argparse.Namespace(nproc_per_node=2, max_restarts=restarts))
        return capsys.readouterr().err.strip(), code

    assert last_line(-signal.SIGKILL, 3) == (
        "embedtrain: rank 1 of 2 was killed by SIGKILL (after 3 restarts)", 1)
    assert last_line(-signal.SIGKILL, 0) == ("embedtrain: rank 1 of 2 was killed by SIGKILL", 1)
    assert last_line(2, 1) == (
        "embedtrain: rank 1 of 2 exited with status 2 (after 1 restart) (its error is above)", 2)
