"""One trial of ``embedtrain tune``: a normal ``embedtrain train`` run inside a Ray Tune trainable.

:func:`run_trial` is the function trainable. It runs in a Ray worker (an actor reused from trial
to trial), trains ``DIR/trials/<trial>/`` in-process as ``embedtrain train`` does
(:func:`embedtrain.recipes.fit`: the config loaded and checked, the run directory's lock,
resume, the summary) and reports every validation evaluation to Ray Tune as the trainer logs it
(``Trainer.on_evaluation``), so that ASHA can stop the trial between two evaluations. A report
carries ``step``, the selection metric's name (``metric``), ``value`` and ``score`` (the value,
negated where lower is better: the scheduler always maximises ``score``), ``mode`` and the run's
best value so far (``best_value`` at ``best_step``).

How a trial ends, as reported last:

- **done**: training finished (``summary.json`` written); a last report says ``finished``.
- **stopped**: the scheduler stopped it. Ray Tune raises ``SystemExit`` inside the report; it
  unwinds through the trainer (loaders closed), the run directory's lock is released and the
  process group destroyed, so the next trial can start in the same worker. The run directory
  holds the evaluations made and their checkpoints (the best one included, see
  ``Trainer.on_evaluation``), no summary.
- **error**: a last report carries ``error``, the one line ``embedtrain train`` would print for
  the failure (a config the model refuses, a bug's last traceback line); the trial ends there
  normally (the worker is reused, and a resumed search does not run it again). A worker that
  dies (a crash, the out-of-memory killer) is an error of Ray's instead.

A trial whose run directory already holds a run (a resumed search) continues it from its
newest checkpoint, as ``embedtrain train --resume`` does. One that ended -- finished (its
``summary.json``), or stopped or failed (``DIR/ended/<trial>.json``, written as it ended) -- is
reported as it ended and not touched: Ray Tune saves its own record of the trials only every few
seconds, so a search killed just after a trial ended may start it again.
The trial's console output (banner, evaluations, errors with their traceback) goes to
``DIR/logs/<trial>.log``. Its torch threads are the CPUs Ray gives it (``EMBEDTRAIN_THREADS``,
see :mod:`embedtrain.runtime`; a config's ``train.threads_per_rank`` wins).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from embedtrain.runtime import tune_allocator
from embedtrain.train.run_dir import SUMMARY_FILE, RunDir, RunDirError
from embedtrain.cli.tune.space import as_overrides
from embedtrain.utils import first_line


@dataclass(frozen=True)
class TrialSetup:
    """What every trial of a search shares (handed to Ray with ``tune.with_parameters``).

    Attributes:
        out: the search directory (absolute).
        base_config: the search's resolved config (``DIR/base.yaml``), with absolute paths.
        lock_wait_s: how long a trial waits for its run directory's lock (held by the worker of
            an earlier attempt that is still dying) before it gives up with an error.
    """

    out: str
    base_config: str
    lock_wait_s: float = 30.0


def trial_name(trial: Any) -> str:
    """``trial_000``, ``trial_001``, ...: a trial's name and directory (from Ray's trial id)."""
    return f"trial_{int(trial.trial_id.rsplit('_', 1)[-1]):03d}"


def run_trial(config: dict[str, Any], setup: TrialSetup) -> None:
    """Ray Tune's function trainable: trains one configuration (module docstring).

    Args:
        config: the trial's values of the searched keys (dotted config key -> value).
        setup: the search's shared settings.
    """
    tune_allocator()  # before torch is imported in this worker (see embedtrain.runtime)
    from ray import tune

    context = tune.get_context()
    name = context.get_trial_name()
    cpus = int(context.get_trial_resources().required_resources.get("CPU", 1))
    out = Path(setup.out)
    run_dir = out / "trials" / name
    (out / "logs").mkdir(parents=True, exist_ok=True)
    reporter = EvaluationReporter(run_dir)
    ended = out / ENDED_DIR / f"{name}.json"
    if (run_dir / SUMMARY_FILE).exists() or ended.exists():
        # ended before a kill of the search that Ray had not yet recorded (it saves its state
        # every few seconds): reported as it ended, not one of its files touched (no lock taken,
        # nothing logged, not trained again)
        mark = json.loads(ended.read_text()) if ended.exists() else {}
        reporter.report_end(finished=mark.get("status") is None, error=mark.get("error"),
                            step=mark.get("step"))
        return
    with _trial_output(out / "logs" / f"{name}.log") as log, _threads(cpus):
        print(f"\n== {name} ({time.strftime('%Y-%m-%d %H:%M:%S')}, pid {os.getpid()}): "
              f"{' '.join(as_overrides(config))}", file=sys.stderr)
        try:
            error = _train(setup, config, run_dir, reporter, log)
        except SystemExit:  # the scheduler stopping the trial: sys.exit(0) in its report
            _mark_ended(ended, {"status": "stopped", "step": reporter.last_step})
            raise
    if error is not None:
        _mark_ended(ended, {"status": "error", "error": error})
        reporter.report_end(error=error)
    else:
        reporter.report_end(finished=True)


ENDED_DIR = "ended"  # DIR/ended/<trial>.json: a trial stopped or failed (for a resumed search)


def _mark_ended(path: Path, mark: dict[str, Any]) -> None:
    from embedtrain.utils import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(mark))


def _train(setup: TrialSetup, config: dict[str, Any], run_dir: Path,
           reporter: "EvaluationReporter", log: "_LogStream") -> Optional[str]:
    """Trains the trial's run (:func:`embedtrain.recipes.fit`, as ``embedtrain train`` does);
    None, or the one-line error (what the CLI would print)."""
    from embedtrain.cli.errors import quiet_libraries, run_command
    from embedtrain.config import load_config
    from embedtrain.processes import destroy_process_group

    quiet_libraries()

    def train(args: argparse.Namespace) -> int:
        from embedtrain.recipes import fit

        cfg = load_config(setup.base_config, as_overrides(config))
        _wait_unlocked(run_dir, setup.lock_wait_s)
        fit(cfg, run_dir, resume=RunDir(run_dir, create=False).has_run(), progress=False,
            on_evaluation=reporter)
        return 0

    try:  # SystemExit (the scheduler stopping the trial) goes through
        code = run_command(argparse.Namespace(command="train", func=train))
    except Exception as e:  # noqa: BLE001 - a bug: its last line, the traceback in the log
        traceback.print_exc()
        return f"{type(e).__name__}: {first_line(e)}"
    finally:
        destroy_process_group()  # the next trial in this worker joins a fresh one
    if code != 0:
        return log.error_line or f"embedtrain train: exit status {code} (see the trial's log)"
    return None


class EvaluationReporter:
    """``Trainer.on_evaluation`` for a trial: each evaluation to Ray Tune (module docstring)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.metric: Optional[str] = None
        self.higher = True
        self.last_step: Optional[int] = None  # of the last evaluation reported (where ASHA stops)

    def __call__(self, trainer: Any, record: dict[str, Any]) -> None:
        from ray import tune

        from embedtrain.train.task import higher_is_better

        self.metric = trainer.select_metric
        self.higher = higher_is_better(self.metric)
        value = record.get(self.metric)
        if not isinstance(value, (int, float)):
            known = sorted(k for k, v in record.items() if isinstance(v, float))
            raise ValueError(f"train.select_metric: {self.metric!r} is not a validation metric of "
                             f"this task ({', '.join(known)}); choose another --metric")
        self.last_step = record["step"]
        passes = record["step"] / max(1, len(trainer.train_data))
        tune.report({"step": record["step"], "passes": passes, "value": value,
                     "score": value if self.higher else -value, **self._best()})

    def report_end(self, finished: bool = False, error: Optional[str] = None,
                   step: Optional[int] = None) -> None:
        """The trial's last report: ``finished`` or its ``error`` (no ``score``: the scheduler
        has seen every evaluation already); ``step``: where a stopped trial stopped, reported
        again for a trial Ray starts after it ended."""
        from ray import tune

        if self.metric is None:  # no evaluation in this attempt (a finished run, an error)
            self.metric, self.higher = _run_metric(self.run_dir)
        result: dict[str, Any] = {**self._best(), "finished": finished}
        if error is not None:
            result["error"] = error
        if step is not None:
            result["step"] = step
        tune.report(result)

    def _best(self) -> dict[str, Any]:
        from embedtrain.cli.tune.results import best_record

        best = best_record(RunDir(self.run_dir, create=False).read_metrics(), self.metric,
                           self.higher) if self.metric else None
        return {"metric": self.metric, "mode": "max" if self.higher else "min",
                "best_value": best[self.metric] if best else None,
                "best_step": best["step"] if best else None}


def _run_metric(run_dir: Path) -> tuple[Optional[str], bool]:
    """The selection metric of a run that did not evaluate in this process: its summary's, else
    its config's (``train.select_metric``, else the task's main metric)."""
    metric = None
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        metric = (summary.get("selected") or {}).get("metric")
    except (OSError, ValueError):
        pass
    try:
        if metric is None and (run_dir / "config.yaml").is_file():
            from embedtrain.config import load_run_config
            from embedtrain.recipes import recipe_for

            cfg = load_run_config(run_dir / "config.yaml")
            metric = cfg.train.select_metric or recipe_for(cfg).make_task().main_metric
        if metric is None:
            return None, True
        from embedtrain.train.task import higher_is_better

        return metric, higher_is_better(metric)
    except (OSError, ValueError):  # a run that cannot say: its report names no metric
        return None, True


def _wait_unlocked(run_dir: Path, timeout: float) -> None:
    """Waits up to ``timeout`` s for another process's lock on ``run_dir`` to go (a worker of an
    interrupted search, still ending); then refuses as ``embedtrain train`` does."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            RunDir(run_dir, create=False).check_unlocked()
            return
        except RunDirError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


class _LogStream(io.TextIOBase):
    """The trial's stdout and stderr: appended to its log file, remembering the CLI's last
    ``embedtrain train: error: ...`` line."""

    def __init__(self, file: io.TextIOBase) -> None:
        self.file = file
        self.error_line: Optional[str] = None
        self._partial = ""

    def write(self, text: str) -> int:
        self.file.write(text)
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if line.startswith("embedtrain train") and " error: " in line:
                self.error_line = line.strip()
        return len(text)

    def flush(self) -> None:
        self.file.flush()

    def isatty(self) -> bool:
        return False


@contextlib.contextmanager
def _trial_output(path: Path) -> Iterator[_LogStream]:
    with open(path, "a", buffering=1) as f:
        stream = _LogStream(f)
        with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
            yield stream


@contextlib.contextmanager
def _threads(cpus: int) -> Iterator[None]:
    """``EMBEDTRAIN_THREADS`` = the CPUs Ray gives the trial, for the trial's life."""
    before = os.environ.get("EMBEDTRAIN_THREADS")
    os.environ["EMBEDTRAIN_THREADS"] = str(max(1, cpus))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("EMBEDTRAIN_THREADS", None)
        else:
            os.environ["EMBEDTRAIN_THREADS"] = before
