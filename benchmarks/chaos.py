"""Chaos test of checkpoint and resume: 2-rank runs SIGKILLed at random moments, resumed to the end.

One uninterrupted reference run first (``embedtrain train --nproc 2`` of the demo config on a
small synthetic CTR data set: 80 steps over 4 epochs, a checkpoint every 10, an evaluation every
8; its timeline is recorded). Then each trial starts the same run afresh in a directory of its own
and SIGKILLs it once, alternately:

- ``group``: every process of the run at once (the launcher, torchrun and both workers: torchrun
  and each worker run in process groups of their own, so a ``killpg`` of the launcher's group
  alone would reach only the launcher and let torchrun stop its workers gracefully);
- ``worker``: one worker (rank chosen at random); the launcher must then exit by itself (a
  failed run, ``--max-restarts 0``); one still running 60 s later is killed and recorded.

The moment is drawn from a mix (shuffled with ``--seed``):

- half of the trials are biased to checkpoint saves: the kill comes after
  ``checkpoints/.tmp-step_N`` appears (N drawn among the schedule's saves, the final one
  included), within 1.5 times that save's duration in the reference (most land in the save, the
  rest just after it: the rename, the pruning);
- a third at a uniform time between 1 s and the reference's wall time;
- a sixth after the final checkpoint appears, within twice the reference's time from it to
  ``summary.json`` (the test evaluation and the summary, or the curves and the exit).

The moment is described by what the run directory showed when the kill came (startup, mid-step,
which checkpoint save or pruning, the final evaluation or summary). Run times vary: a run that
ends before its kill is started again (at most 3 times) with the moment drawn anew within its span
(``missed``).

After the kill: every ``checkpoints/step_*`` directory that a resume could pick (one holding
``trainer_state.json``) must be whole (``.metadata`` readable, every shard file it names as long
as it says, one ``rank_*.pt`` per rank, a valid trainer state); then ``embedtrain train --resume``
runs until it exits 0 (at most 5 attempts; one exiting non-zero by itself is a trial that
"needed cleanup", its last line kept). The finished run is compared with the reference:

- ``summary.json`` whole, except the timing keys listed in the JSON (``ignored_summary_keys``);
- ``metrics.jsonl``: its evaluation records (resume events aside; the records carry no timing
  field) equal the reference's, in order, no step twice, no torn line;
- the final checkpoint: the same files, ``trainer_state.json`` equal except ``train_time_s``,
  every tensor of the DCP state (model, optimizer, RNG; read without a process group through
  ``dcp_to_torch_save``) and of each ``rank_*.pt`` equal bit for bit (``torch.equal``).

Where the run directory holds other files than the reference's (other checkpoint directories than
the ``train.keep_checkpoints`` newest, ``.tmp-step_*`` left, ``curves.png`` missing, temporary
files) the trial gets ``notes``: its results are the same, its directory is not.

Not part of ``make test``: it takes about a minute per trial on two cores. Prints a line per
trial, a table and writes the JSON.

Usage:
    python benchmarks/chaos.py --trials 20 --json benchmarks/out/chaos.json
    python benchmarks/chaos.py --trials 8 --warm-start --json benchmarks/out/chaos_warm.json
    python benchmarks/chaos.py --trials 4 --seed 1 --workdir /tmp/chaos --keep

JSON keys: ``trials``, ``identical``, ``needed_cleanup``, ``half_written_seen``, ``with_notes``
(counts of trials), ``per_trial`` (mode, kill moment and what the run was doing, the killed run's
exit, the checkpoints found after it, each resume, the differences and notes), ``reference`` (its
wall time and timeline), ``seconds`` (the whole benchmark), ``command`` (this command line),
``config``, ``ignored_summary_keys``, ``ignored_trainer_state_keys``, ``seed``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from embedtrain.processes import descendants  # noqa: E402

CONFIG = "configs/dlrm_synthetic.yaml"
ROWS = 60_000  # 48k training rows: 24 steps of 2,048 per epoch
MAX_STEPS, CHECKPOINT_EVERY, EVAL_EVERY, KEEP = 80, 10, 8, 2
OVERRIDES = ["data.eval_batch_size=1024", "train.epochs=4", f"train.max_steps={MAX_STEPS}",
             f"train.eval_every={EVAL_EVERY}", f"train.checkpoint_every={CHECKPOINT_EVERY}",
             "train.eval_max_batches=2", f"train.keep_checkpoints={KEEP}"]
SAVES = list(range(CHECKPOINT_EVERY, MAX_STEPS + 1, CHECKPOINT_EVERY))  # the final one included
# summary.json keys that differ between two runs by design (timings, memory, start-up).
SUMMARY_TIMINGS = ("train_examples_per_s", "train_time_s", "wall_time_s", "peak_rss_gb_per_rank",
                   "startup_s", "startup")
STATE_TIMINGS = ("train_time_s",)  # trainer_state.json
KINDS = ["save", "time", "save", "final", "save", "time"]  # the mix, repeated and shuffled
MAX_ATTEMPTS = 5  # resumes per trial
MAX_STARTS = 3  # runs per trial that end before their kill, each drawing the moment anew
RUN_TIMEOUT_S = 600.0
WORKER_EXIT_S = 60.0
POLL_S = 0.002

_LIVE: dict[int, tuple[subprocess.Popen, Path]] = {}  # runs started and not yet ended


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="draws the kill moments and modes")
    parser.add_argument("--workdir", help="data and run directories (default: a fresh temporary "
                        "directory); must be absent or empty")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--json", help="where to write the results")
    parser.add_argument("--warm-start", action="store_true",
                        help="the run under test is a warm start on day partitions 2-3 from a "
                             "finished day-1 run (continual training; dynamic tables)")
    args = parser.parse_args()

    if args.workdir:
        work = Path(args.workdir)
        if work.exists() and any(work.iterdir()):
            parser.error(f"--workdir {work}: not empty")
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="embedtrain-chaos-"))
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.perf_counter()
    try:
        report = _benchmark(args, work)
    except KeyboardInterrupt:
        sys.exit("chaos: interrupted; the runs it started are killed")
    finally:
        for proc, run in list(_LIVE.values()):
            _kill_everything(proc, run)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["command"] = shlex.join(sys.orig_argv)
    _print_table(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"work directory: {work}{'' if args.keep else ' (removed)'}")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


# --warm-start: the run under test is a warm start on day partitions (continual training):
# days 2 and 3 of `datagen ctr --drift --days 4` (40k rows: 20 steps a pass), started from a
# finished 2-rank run on day 1; raw ids in dynamic tables.
CONTINUAL_ROWS = 80_000
CONTINUAL = ["--set", "tables=[{tables: [t_*], capacity: 16384, eviction: lru}]"]
EXTRA: list[str] = []  # what the runs of this benchmark add to the command (--warm-start's)


def _continual_data(work: Path) -> Path:
    """The day partitions and the day-1 run the warm start starts from; sets ``EXTRA``."""
    data = work / "data"
    subprocess.run([sys.executable, "-m", "embedtrain", "datagen", "ctr", "--drift", "--days",
                    "4", "--rows", str(CONTINUAL_ROWS), "--out", str(data)], cwd=ROOT,
                   check=True, capture_output=True)
    EXTRA[:] = CONTINUAL + ["--partitions", "day=001"]
    source = work / "day1"
    subprocess.run(_train_cmd(source, data, False), cwd=ROOT, check=True, capture_output=True)
    EXTRA[:] = CONTINUAL + ["--partitions", "day=002,day=003", "--warm-start", str(source)]
    return data


def _benchmark(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    data = work / "data"
    if args.warm_start:
        _continual_data(work)
    else:
        subprocess.run([sys.executable, "-m", "embedtrain", "datagen", "ctr", "--rows",
                        str(ROWS), "--out", str(data)], cwd=ROOT, check=True,
                       capture_output=True)
    print(f"reference run ({MAX_STEPS} steps, checkpoints every {CHECKPOINT_EVERY}, "
          f"evaluations every {EVAL_EVERY}; data: "
          f"{CONTINUAL_ROWS if args.warm_start else ROWS:,} rows in {data}"
          f"{'; a warm start on days 2-3' if args.warm_start else ''})", flush=True)
    ref = work / "reference"
    timeline = _reference_run(ref, data, work / "reference.log")
    wall, final = timeline["exit"], timeline[f"step_{MAX_STEPS:08d}"]
    print(f"reference: {wall:.1f} s; config.yaml at {timeline['config.yaml']:.1f} s, first "
          f"checkpoint at {timeline[f'step_{SAVES[0]:08d}']:.1f} s, final checkpoint at "
          f"{final:.1f} s, summary.json at {timeline['summary.json']:.1f} s", flush=True)
    expected = _run_outputs(ref, work / "scratch.pt")

    rng = random.Random(args.seed)
    kinds = (KINDS * (args.trials // len(KINDS) + 1))[: args.trials]
    rng.shuffle(kinds)
    trials = []
    for i, kind in enumerate(kinds):
        plan: dict[str, Any] = {"mode": "group" if i % 2 == 0 else "worker", "kind": kind}
        if plan["mode"] == "worker":
            plan["rank"] = rng.randrange(2)
        if kind == "save":  # within 1.5 times that save's duration in the reference
            step = rng.choice(SAVES)
            name = f"step_{step:08d}"
            took = timeline[name] - timeline.get(f".tmp-{name}", timeline[name])
            plan.update(step=step, delay_s=round(rng.uniform(0.0, 1.5 * took), 3))
        elif kind == "time":
            plan["at_s"] = round(rng.uniform(1.0, wall - 0.5), 2)
        else:
            plan["delay_s"] = round(rng.uniform(0.0, 2 * (timeline["summary.json"] - final)), 3)
        trial = _trial(i + 1, plan, random.Random(f"{args.seed}:{i}"),
                       work / f"trial_{i + 1:02d}", data, expected)
        trials.append(trial)
        print(_trial_line(trial, args.trials), flush=True)
        if not args.keep:
            shutil.rmtree(work / f"trial_{i + 1:02d}", ignore_errors=True)
    return {
        "trials": len(trials),
        "identical": sum(t["identical"] for t in trials),
        "needed_cleanup": sum(t["needed_cleanup"] for t in trials),
        "half_written_seen": sum(bool(t["half_written"]) for t in trials),
        "with_notes": sum(bool(t["notes"]) for t in trials),
        "per_trial": trials,
        "reference": {"wall_s": round(wall, 2),
                      "timeline_s": {k: round(v, 3) for k, v in timeline.items()}},
        "config": {"file": CONFIG, "overrides": OVERRIDES, "nproc": 2, "args": EXTRA,
                   "rows": CONTINUAL_ROWS if args.warm_start else ROWS},
        "ignored_summary_keys": list(SUMMARY_TIMINGS),
        "ignored_trainer_state_keys": list(STATE_TIMINGS),
        "seed": args.seed,
    }


# ---------------------------------------------------------------- processes


def _train_cmd(run: Path, data: Path, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "embedtrain", "train", CONFIG, "--out", str(run), "--nproc", "2",
           "--no-progress", "--set", f"data.path={data}"]
    for o in OVERRIDES:
        cmd += ["--set", o]
    return cmd + EXTRA + (["--resume"] if resume else [])


def _start(cmd: list[str], run: Path, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    _LIVE[proc.pid] = (proc, run)
    return proc


def _finish(proc: subprocess.Popen, run: Path, timeout: float) -> dict[str, Any]:
    """Waits for the launcher (killing everything after ``timeout``: ``hung``), then for the
    processes of the run to be gone; returns its exit status and the pids that outlived it
    (``orphans``, killed)."""
    hung = False
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_everything(proc, run)
        code, hung = proc.wait(), True
    deadline = time.monotonic() + 10.0
    while (left := _processes_of(run)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        _sigkill(pid)
    _LIVE.pop(proc.pid, None)
    return {"exit": code, "hung": hung, "orphans": left}


def _processes_of(run: Path) -> list[int]:
    """Live processes whose command line names the run directory (orphans included)."""
    found, needle = [], str(run).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if needle in cmdline.split(b"\0") and stat.rsplit(")", 1)[1].split()[0] != "Z":
            found.append(int(entry.name))
    return found


def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_everything(proc: subprocess.Popen, run: Path) -> None:
    """SIGKILLs the launcher's group and every process under it or naming the run, all found
    before the first signal."""
    pids = {proc.pid, *descendants(proc.pid), *_processes_of(run)}
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in pids:
        _sigkill(pid)


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return kids


def _worker(launcher: int, rank: int) -> Optional[int]:
    """The pid of torchrun's worker of ``rank`` (torchrun is the launcher's child), if started."""
    for torchrun in _children(launcher):
        for pid in _children(torchrun):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return pid
    return None


def _wait_until(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float) -> bool:
    """Polls ``ready`` every few ms; False when the run ended (or timed out) first."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


# ---------------------------------------------------------------- runs


def _reference_run(run: Path, data: Path, log: Path) -> dict[str, float]:
    """Runs the reference to the end; returns when each file first appeared (s after start)."""
    proc = _start(_train_cmd(run, data, resume=False), run, log)
    start, seen = time.perf_counter(), {}
    while proc.poll() is None:
        now = time.perf_counter() - start
        names = [n for n in ("config.yaml", "summary.json") if (run / n).exists()]
        for name in names + _checkpoint_names(run / "checkpoints"):
            seen.setdefault(name, now)
        time.sleep(POLL_S)
    end = _finish(proc, run, RUN_TIMEOUT_S)
    seen["exit"] = time.perf_counter() - start
    if end["exit"] != 0 or end["orphans"]:
        sys.exit(f"reference run failed ({end}): {_last_line(log)}")
    return seen


def _trial(number: int, plan: dict[str, Any], draws: random.Random, trial_dir: Path,
           data: Path, expected: dict[str, Any]) -> dict[str, Any]:
    """One trial: a run killed as ``plan`` says (started again, the moment drawn anew from
    ``draws`` within the missed run's span, when it ended before the kill), resumed, compared."""
    trial_dir.mkdir(parents=True)
    run = trial_dir / "run"
    record: dict[str, Any] = {"trial": number, **plan, "missed": []}
    started = time.perf_counter()
    for attempt in range(1, MAX_STARTS + 1):
        first = _kill_run(plan, run, data, trial_dir / f"killed_{attempt}.log")
        if first["killed"] or attempt == MAX_STARTS:
            break
        record["missed"].append({**{k: plan[k] for k in ("at_s", "delay_s") if k in plan},
                                 "wall_s": first["wall_s"]})
        shutil.rmtree(run)
        if plan["kind"] == "time":
            plan["at_s"] = round(draws.uniform(1.0, max(1.0, first["wall_s"] - 0.5)), 2)
        else:
            span = first.get("after_trigger_s", plan["delay_s"])  # absent: no trigger seen
            plan["delay_s"] = round(draws.uniform(0.0, span), 3)
    record.update(plan, kill_at_s=first.pop("kill_at_s"), moment=first.pop("moment"),
                  first_run=first)
    ckpts = run / "checkpoints"
    record["checkpoints_after_kill"] = _checkpoint_names(ckpts)
    record["half_written"], record["ignored_dirs"] = _check_checkpoints(ckpts)
    record["resumes"] = []
    done = first["exit"] == 0
    while not done and len(record["resumes"]) < MAX_ATTEMPTS:
        log = trial_dir / f"resume_{len(record['resumes']) + 1}.log"
        proc = _start(_train_cmd(run, data, resume=True), run, log)
        t = time.perf_counter()
        end = _finish(proc, run, RUN_TIMEOUT_S)
        record["resumes"].append({**end, "seconds": round(time.perf_counter() - t, 1),
                                  **_resume_info(log)})
        done = end["exit"] == 0
    record["needed_cleanup"] = any(r["exit"] != 0 for r in record["resumes"])
    got = _run_outputs(run, trial_dir / "scratch.pt") if done else None
    record["differences"] = _compare(expected, got) if got else ["the run never finished"]
    record["identical"] = not record["differences"]
    record["notes"] = _notes(expected, got) if got else []
    record["seconds"] = round(time.perf_counter() - started, 1)
    return record


def _kill_run(plan: dict[str, Any], run: Path, data: Path, log: Path) -> dict[str, Any]:
    """Starts the run afresh and SIGKILLs it as ``plan`` says; how it went and ended."""
    proc = _start(_train_cmd(run, data, resume=False), run, log)
    t0 = time.perf_counter()
    triggered = None
    if plan["kind"] == "time":
        hit = _wait_until(proc, lambda: time.perf_counter() - t0 >= plan["at_s"], RUN_TIMEOUT_S)
    else:
        name = f".tmp-step_{plan['step']:08d}" if plan["kind"] == "save" \
            else f"step_{MAX_STEPS:08d}"
        hit = _wait_until(proc, (run / "checkpoints" / name).exists, RUN_TIMEOUT_S)
        if hit:  # then the delay, unless the run ends meanwhile
            triggered = time.perf_counter()
            deadline = triggered + plan["delay_s"]
            hit = _wait_until(proc, lambda: time.perf_counter() >= deadline, RUN_TIMEOUT_S)
    victim = None
    if hit and plan["mode"] == "worker":  # at 1 s torchrun may not have started its workers
        hit = _wait_until(proc, lambda: _worker(proc.pid, plan["rank"]) is not None, 60.0)
        victim = _worker(proc.pid, plan["rank"])
    out: dict[str, Any] = {"killed": hit, "kill_at_s": round(time.perf_counter() - t0, 2),
                           "moment": _describe(run) if hit else "none: the run ended first"}
    if hit and victim is not None:
        _sigkill(victim)
    elif hit:
        _kill_everything(proc, run)
    killed_at = time.perf_counter()
    out.update(_finish(proc, run, WORKER_EXIT_S if victim is not None else RUN_TIMEOUT_S))
    out.update(exit_after_kill_s=round(time.perf_counter() - killed_at, 2),
               wall_s=round(time.perf_counter() - t0, 2), last_line=_last_line(log))
    if triggered is not None:
        out["after_trigger_s"] = round(time.perf_counter() - triggered, 3)
    return out


def _describe(run: Path) -> str:
    """What the run was doing, from its directory: the kill's moment in words."""
    ckpts = run / "checkpoints"
    names = _checkpoint_names(ckpts)
    saving = [n for n in names if n.startswith(".tmp-step_")]
    done = [int(n[5:]) for n in names if n.startswith("step_")]
    if (run / "summary.json").exists():
        return "after summary.json was written (curves, exit)"
    if saving:
        step = int(saving[-1].split("_")[1])
        return f"during checkpoint save of step {step}" + (" (final)" if step == MAX_STEPS else "")
    whole = [s for s in done if (ckpts / f"step_{s:08d}" / "trainer_state.json").is_file()]
    if len(whole) < len(done):
        return f"pruning step {min(set(done) - set(whole))} (partly deleted)"
    if len(whole) > KEEP:
        return f"after the save of step {max(whole)}, before pruning"
    if MAX_STEPS in done:
        return "during final test evaluation / summary"
    if not (run / "config.yaml").exists():
        return "during startup (imports, plan, build)"
    last = max(done, default=0)
    evals = [r.get("step") for r in _records(run) if "event" not in r]
    seen = f"; last eval {evals[-1]}" if evals else ""
    if last + CHECKPOINT_EVERY >= MAX_STEPS:
        return f"mid-step or final evaluation (steps {last + 1}-{MAX_STEPS}{seen})"
    return f"mid-step (steps {last + 1}-{last + CHECKPOINT_EVERY}{seen})"


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _resume_info(log: Path) -> dict[str, Any]:
    """From a resume's output: the checkpoint it started from, leftovers it removed, its end."""
    text = log.read_text(errors="replace")
    resumed = re.search(r"resumed from (\S+) at step (\d+)", text)
    removed = re.search(r"removed (\d+) half-written checkpoint", text)
    return {
        "from_step": int(resumed.group(2)) if resumed else
        (0 if "starting from step 0" in text else None),
        "from_checkpoint": resumed.group(1) if resumed else None,
        "removed_tmp": int(removed.group(1)) if removed else 0,
        "nothing_to_do": "nothing to resume" in text,
        "last_line": _last_line(log),
    }


# ---------------------------------------------------------------- checks


def _checkpoint_names(ckpts: Path) -> list[str]:
    return sorted(os.listdir(ckpts)) if ckpts.is_dir() else []


def _check_checkpoints(ckpts: Path) -> tuple[list[str], list[str]]:
    """Problems of the ``step_*`` directories a resume could pick (with ``trainer_state.json``),
    and the ``step_*`` directories without one (which ``CheckpointManager.all`` passes over)."""
    import torch
    import torch.distributed.checkpoint as dcp

    problems, ignored = [], []
    for name in _checkpoint_names(ckpts):
        path = ckpts / name
        if not name.startswith("step_"):
            continue
        if not (path / "trainer_state.json").is_file():
            ignored.append(f"{name}: {', '.join(sorted(os.listdir(path))) or 'empty'}")
            continue
        try:
            state = json.loads((path / "trainer_state.json").read_text())
            if not isinstance(state.get("step"), int):
                raise ValueError("no integer step")
            meta = dcp.FileSystemReader(str(path)).read_metadata()
            for info in meta.storage_data.values():
                shard = path / info.relative_path
                if not shard.is_file() or shard.stat().st_size < info.offset + info.length:
                    raise ValueError(f"{info.relative_path} missing or short")
            for rank in range(state.get("world_size", 1)):
                torch.load(path / f"rank_{rank:05d}.pt", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure is the finding, reported in one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            problems.append(f"{name}: {type(e).__name__}: {first}")
    return problems, ignored


def _records(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            records.append({"event": "torn line", "text": line[:80]})
    return records


def _run_outputs(run: Path, scratch: Path) -> dict[str, Any]:
    """What a finished run is compared on (see the module docstring)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    import torch

    final = run / "checkpoints" / f"step_{MAX_STEPS:08d}"
    out: dict[str, Any] = {}
    summary = json.loads((run / "summary.json").read_text()) \
        if (run / "summary.json").is_file() else {}
    out["summary"] = {k: v for k, v in summary.items() if k not in SUMMARY_TIMINGS}
    records = _records(run)
    out["records"] = [r for r in records if "event" not in r]
    out["torn"] = [r["text"] for r in records if r.get("event") == "torn line"]
    out["kept"] = _checkpoint_names(run / "checkpoints")
    out["run_files"] = sorted(os.listdir(run))
    if not final.is_dir():
        return out
    out["files"] = sorted(os.listdir(final))
    state = json.loads((final / "trainer_state.json").read_text())
    out["trainer_state"] = {k: v for k, v in state.items() if k not in STATE_TIMINGS}
    dcp_to_torch_save(str(final), str(scratch))
    out["tensors"] = dict(_flatten(torch.load(scratch, weights_only=True), "dcp"))
    scratch.unlink()
    for rank_file in sorted(final.glob("rank_*.pt")):
        out["tensors"].update(_flatten(torch.load(rank_file, weights_only=True), rank_file.name))
    return out


def _notes(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Where the run directory holds other files than the reference's (not a difference in the
    run's results): checkpoint directories, top-level files (``curves.png``, temporary files)."""
    notes = [f"checkpoints/ also holds {n}" for n in got["kept"] if n not in expected["kept"]]
    notes += [f"checkpoints/ lacks {n}" for n in expected["kept"] if n not in got["kept"]]
    notes += [f"missing {n}" for n in expected["run_files"] if n not in got["run_files"]]
    return notes + [f"extra {n}" for n in got["run_files"] if n not in expected["run_files"]]


def _flatten(obj: Any, prefix: str) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [kv for k, v in obj.items() for kv in _flatten(v, f"{prefix}.{k}")]
    if isinstance(obj, (list, tuple)):
        return [kv for i, v in enumerate(obj) for kv in _flatten(v, f"{prefix}.{i}")]
    return [(prefix, obj)]


def _compare(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """The differences of a finished run from the reference, one line each (empty: identical)."""
    import torch

    diffs = []
    keys = sorted(set(expected["summary"]) | set(got["summary"]))
    diffs += [f"summary.json {k}: {got['summary'].get(k)!r} != {expected['summary'].get(k)!r}"
              for k in keys if got["summary"].get(k) != expected["summary"].get(k)]
    steps = [r.get("step") for r in got["records"]]
    twice = sorted({s for s in steps if steps.count(s) > 1})
    if twice:
        diffs.append(f"metrics.jsonl: evaluation steps logged twice: {twice} (steps in order: "
                     f"{steps})")
    if got["torn"]:
        diffs.append(f"metrics.jsonl: {len(got['torn'])} unreadable line(s): {got['torn'][0]!r}")
    if got["records"] != expected["records"] and not twice:
        for i, (a, b) in enumerate(zip(got["records"], expected["records"])):
            if a != b:
                keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                diffs.append(f"metrics.jsonl record {i} (step {a.get('step')}): differs in "
                             f"{keys}")
                break
        else:
            diffs.append(f"metrics.jsonl: {len(got['records'])} evaluation records, the "
                         f"reference {len(expected['records'])}")
    if "tensors" not in got:
        return diffs + [f"no final checkpoint step_{MAX_STEPS:08d}"]
    if got["files"] != expected["files"]:
        diffs.append(f"final checkpoint files: {got['files']} != {expected['files']}")
    for k in sorted(set(got["trainer_state"]) | set(expected["trainer_state"])):
        if got["trainer_state"].get(k) != expected["trainer_state"].get(k):
            diffs.append(f"trainer_state.json {k}: {got['trainer_state'].get(k)!r} != "
                         f"{expected['trainer_state'].get(k)!r}")
    a, b = got["tensors"], expected["tensors"]
    if set(a) != set(b):
        diffs.append(f"final checkpoint entries: missing {sorted(set(b) - set(a))[:3]}, extra "
                     f"{sorted(set(a) - set(b))[:3]}")
    unequal = [k for k in sorted(set(a) & set(b))
               if not (torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype
                       if isinstance(a[k], torch.Tensor) and isinstance(b[k], torch.Tensor)
                       else a[k] == b[k])]
    if unequal:
        diffs.append(f"final checkpoint: {len(unequal)} of {len(b)} entries differ, e.g. "
                     f"{', '.join(unequal[:3])}")
    return diffs


# ---------------------------------------------------------------- report


def _trial_line(t: dict[str, Any], total: int) -> str:
    mode = "group" if t["mode"] == "group" else f"rank {t['rank']}"
    resumes = t["resumes"]
    froms = ",".join(_from(r) for r in resumes)
    result = "identical" if t["identical"] else "DIFFERS: " + "; ".join(t["differences"])
    extra = "".join([f" (started {len(t['missed']) + 1} times: ended before the kill)"
                     if t["missed"] else "",
                     " NEEDED CLEANUP" if t["needed_cleanup"] else "",
                     f" HALF-WRITTEN: {t['half_written']}" if t["half_written"] else "",
                     " HUNG after the kill" if t["first_run"]["hung"] else "",
                     f" notes: {', '.join(t['notes'])}" if t["notes"] else "",
                     f" orphans {t['first_run']['orphans']}" if t["first_run"]["orphans"] else ""])
    return (f"[{t['trial']:>2}/{total}] kill {mode:<6} at {t['kill_at_s']:>5.1f} s, "
            f"{t['moment']}; resumes {len(resumes)}" + (f" (from {froms})" if resumes else "")
            + f"; {result}{extra} ({t['seconds']:.0f} s)")


def _from(resume: dict[str, Any]) -> str:
    """Where a resume started: a step, ``done`` (nothing to resume) or ``?``."""
    if resume["nothing_to_do"]:
        return "done"
    return "?" if resume["from_step"] is None else str(resume["from_step"])


def _print_table(report: dict[str, Any]) -> None:
    print(f"\n{'#':>3} {'kill':<7} {'at s':>6}  {'moment':<62} {'resumes':>7} {'from':>5} "
          f"{'identical':>9} {'cleanup':>7} {'half-written':>12}  notes")
    for t in report["per_trial"]:
        froms = ",".join(_from(r) for r in t["resumes"]) or "-"
        mode = "group" if t["mode"] == "group" else f"rank {t['rank']}"
        print(f"{t['trial']:>3} {mode:<7} {t['kill_at_s']:>6.1f}  {t['moment'][:62]:<62} "
              f"{len(t['resumes']):>7} "
              f"{froms:>5} {'yes' if t['identical'] else 'NO':>9} "
              f"{'YES' if t['needed_cleanup'] else 'no':>7} "
              f"{'YES' if t['half_written'] else 'no':>12}  {', '.join(t['notes'])}")
    print(f"\n{report['identical']} of {report['trials']} identical to the uninterrupted run, "
          f"{report['needed_cleanup']} needed cleanup, {report['half_written_seen']} saw a "
          f"half-written checkpoint, {report['with_notes']} left other files than the "
          f"reference's (notes); {report['seconds']:.0f} s in all "
          f"(reference run {report['reference']['wall_s']:.1f} s)")
    print(f"command: {report['command']}")


if __name__ == "__main__":
    main()
