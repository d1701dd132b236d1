"""The search itself: Ray Tune's ``Tuner`` over :func:`embedtrain.cli.tune.trial.run_trial`, with
ASHA stopping trials on their validation metric, quiet, resumable.

Ray is started here: ``Engine.LOCAL`` starts a Ray instance of this machine's cores for the
command's life and runs one trial at a time on all of them; ``Engine.RAY`` joins a running
cluster (``address``) and runs trials side by side, ``cpus_per_trial`` CPUs each (the search
directory must then be on a file system every node sees). Ray's own console output is off
(its progress tables, its tracebacks of failed trials); :class:`TrialProgress` prints one line
as each trial starts and one as it ends. Ray's experiment state is kept under ``DIR/ray/``, so
that ``resume=True`` continues an interrupted search (``Tuner.restore``): trials that ended are
not run again, trials that were running continue from their run's newest checkpoint, and trials
whose worker died are run again the same way.

Imports Ray at import time: import this module only to search.

Example:
    >>> run = run_search(Path("runs/search"), space, SearchOptions(trials=8), resume=False)
    >>> [(t.name, t.ended) for t in run.trials]
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from embedtrain.dependencies import import_optional

tune = import_optional("ray.tune", "ray[tune]", "embedtrain tune")
import ray  # noqa: E402  (after the check above: a missing Ray is one line)
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler  # noqa: E402
from ray.tune.search.basic_variant import BasicVariantGenerator  # noqa: E402

from embedtrain.runtime import usable_cores  # noqa: E402
from embedtrain.utils import first_line  # noqa: E402
from embedtrain.cli.tune.options import Engine, Scheduler, SearchOptions  # noqa: E402
from embedtrain.cli.tune.space import SearchSpace  # noqa: E402
from embedtrain.cli.tune.trial import TrialSetup, run_trial, trial_name  # noqa: E402

EXPERIMENT = "search"  # Ray's experiment directory: DIR/ray/search
ASHA_MAX_STEPS = 2**31  # ASHA's max_t: the runs' own length ends them (stop_last_trials off)


@dataclass
class TrialRecord:
    """A trial as Ray Tune left it: name, number, values, whether it ended, its last report."""

    name: str
    index: int
    config: dict[str, Any]
    ended: bool
    last_result: dict[str, Any]
    error: Optional[str]  # the one-line error (a reported one, or Ray's for a dead worker)


@dataclass
class SearchRun:
    trials: list[TrialRecord]
    interrupted: bool  # the search stopped before every trial ended (Ctrl-C): --resume goes on


def run_search(out: Path, space: SearchSpace, options: SearchOptions, resume: bool,
               metric: Optional[str] = None) -> SearchRun:
    """Runs (or, with ``resume``, continues) the search of ``out`` (which holds ``base.yaml``).

    Args:
        out: the search directory (absolute).
        space: the checked search space.
        options: how to search.
        resume: continue the Ray experiment under ``out/ray`` if there is one.
        metric: the metric's name for the progress lines, if known before any trial reports.
    """
    setup = TrialSetup(out=str(out), base_config=str(out / "base.yaml"))
    resources = {"cpu": options.trial_cpus()}
    if options.gpus_per_trial:
        resources["gpu"] = options.gpus_per_trial
    with _quiet_ray():
        _start_ray(options)
        try:
            trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup),
                                            resources)
            path = out / "ray" / EXPERIMENT
            if resume and tune.Tuner.can_restore(str(path)):
                tuner = tune.Tuner.restore(str(path), trainable=trainable, resume_errored=True)
            else:
                tuner = tune.Tuner(trainable, param_space=space.param_space(),
                                   tune_config=_tune_config(options),
                                   run_config=tune.RunConfig(
                                       name=EXPERIMENT, storage_path=str(out / "ray"), verbose=0,
                                       callbacks=[TrialProgress(space.keys, options.trials,
                                                                metric)],
                                       failure_config=tune.FailureConfig(max_failures=0)))
            results = tuner.fit()
            trials = _trial_records(results.experiment_path)
        finally:
            ray.shutdown()
    ended = sum(t.ended for t in trials)
    return SearchRun(trials, interrupted=ended < options.trials)


def _tune_config(options: SearchOptions) -> Any:
    if options.scheduler is Scheduler.ASHA:
        time_attr, grace = options.grace()
        scheduler = ASHAScheduler(metric="score", mode="max", time_attr=time_attr,
                                  grace_period=grace,
                                  reduction_factor=options.reduction_factor,
                                  max_t=ASHA_MAX_STEPS, stop_last_trials=False)
    else:
        scheduler = FIFOScheduler()
    concurrent = 1 if options.engine is Engine.LOCAL else (options.max_concurrent or None)
    return tune.TuneConfig(num_samples=options.trials, scheduler=scheduler,
                           search_alg=BasicVariantGenerator(random_state=options.seed),
                           max_concurrent_trials=concurrent, reuse_actors=True,
                           trial_name_creator=trial_name, trial_dirname_creator=trial_name)


def _start_ray(options: SearchOptions) -> None:
    quiet = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    if options.engine is Engine.LOCAL:
        ray.init(address="local", num_cpus=usable_cores(), **quiet)
        return
    address = options.address or os.environ.get("RAY_ADDRESS") or "auto"
    _check_reachable(address)
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ValueError(f"--address {address}: cannot join a Ray cluster there "
                         f"({first_line(e)}); start one with `ray start --head`, or use "
                         "--engine local") from None


def _check_reachable(address: str) -> None:
    """Refuses at once an address ``host:port`` nothing listens on (Ray's own client would
    retry, and log each retry, for minutes)."""
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    if not sep or not port.isdigit() or not host:
        return  # "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ValueError(f"--address {address}: nothing answers there ({e.strerror or e}); "
                         "start the cluster's head with `ray start --head`, or use --engine "
                         "local") from None


def _trial_records(experiment_path: str) -> list[TrialRecord]:
    records = []
    for t in tune.ExperimentAnalysis(experiment_path).trials:
        result = dict(t.last_result or {})
        error = result.get("error")
        if t.status == "ERROR" and error is None:
            error = _ray_error_line(t)
        records.append(TrialRecord(str(t), int(t.trial_id.rsplit("_", 1)[-1]),
                                   dict(t.config),
                                   t.status in ("TERMINATED", "ERROR"), result, error))
    return sorted(records, key=lambda r: r.index)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _ray_error_line(trial: Any) -> str:
    """The last line of Ray's record of a trial whose worker failed (no traceback)."""
    try:
        error = trial.get_error()
        text = _ANSI.sub("", str(error) if error is not None else "")
    except Exception:  # noqa: BLE001 - only for the message: say what is known
        text = ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"the trial's worker failed: {lines[-1]}" if lines else "the trial's worker failed"


class TrialProgress(tune.Callback):
    """One line as each trial starts and one as it ends: its values, its best value, the best
    so far and how many trials ended (Ray's own output is off)."""

    def __init__(self, keys: list[str], total: int, metric: Optional[str] = None) -> None:
        self.keys, self.total, self.metric = keys, total, metric

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        values = ", ".join(f"{k}={_short(trial.config.get(k))}" for k in self.keys)
        self._say(f"{trial} started: {values}")

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        r = trial.last_result or {}
        if r.get("error"):
            what = f"error: {r['error']}"
        elif r.get("finished"):
            what = "done"
        else:
            what = f"stopped by ASHA at step {r.get('step', '?')}"
        self._say(f"{trial} {what}{self._best(r)}; {self._standing(trials, trial)}")

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._say(f"{trial} error: {_ray_error_line(trial)}; {self._standing(trials, trial)}")

    def _best(self, r: dict[str, Any]) -> str:
        if r.get("best_value") is None:
            return ""
        return f", best {r.get('metric') or self.metric} {r['best_value']:.4f} at step " \
               f"{r.get('best_step')}"

    def _standing(self, trials: list, trial: Any) -> str:
        ended = 1 + sum(t.status in ("TERMINATED", "ERROR") for t in trials if t is not trial)
        best = None
        for t in trials:
            r = t.last_result or {}
            v = r.get("best_value")
            if v is None or r.get("error"):
                continue
            higher = r.get("mode", "max") == "max"
            if best is None or (v > best[0] if higher else v < best[0]):
                best = (v, str(t))
        lead = f"best so far {best[0]:.4f} ({best[1]}); " if best else ""
        return f"{lead}{ended} of {self.total} trials ended"

    def _say(self, line: str) -> None:
        print(f"tune: {line}", file=sys.stderr, flush=True)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


@contextlib.contextmanager
def _quiet_ray() -> Iterator[None]:
    """Ray Tune without its console output (progress tables, the traceback of every failed
    trial: ours says it in a line), its trials in the working directory of this command (not
    their own: paths relative to it keep working), a report without the scheduler's ``score``
    allowed (a trial's last one), the experiment's state saved often."""
    env = {"RAY_AIR_NEW_OUTPUT": "0", "RAY_CHDIR_TO_TRIAL_DIR": "0",
           "TUNE_DISABLE_STRICT_METRIC_CHECKING": "1",
           # the experiment's state saved every second (Ray's default: every 10 s or more), so
           # that a search killed just after a trial ended does not schedule it again on resume
           "TUNE_GLOBAL_CHECKPOINT_S": "1"}
    saved_env = {k: os.environ.get(k) for k in env}
    loggers = {name: logging.getLogger(name) for name in ("ray", "ray.tune", "ray.train")}
    levels = {name: log.level for name, log in loggers.items()}
    os.environ.update(env)
    for log in loggers.values():
        log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="ray")
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            yield
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for name, log in loggers.items():
            log.setLevel(levels[name])
