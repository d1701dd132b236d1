"""What a search leaves in its directory: ``trials.json``, ``best.yaml``, ``best.json``,
``search.png``, and the table ``embedtrain tune`` prints.

Every value comes from the trials' run directories (``metrics.jsonl``, ``summary.json``), not from
Ray's records of what the trials reported: a resumed search and an interrupted one read the same
files. A trial's best value is the best validation value of the selection metric over its
evaluations (with ``train.select: best``, the evaluation its selected checkpoint holds).

Example:
    >>> outcomes = [TrialOutcome("trial_000", 0, {"optim.sparse_lr": 0.02}, TrialStatus.DONE,
    ...                          Path("runs/s/trials/trial_000"), 0.74, 40)]
    >>> best_outcome(outcomes, higher=True).name
    'trial_000'
"""

from __future__ import annotations

import enum
import io
import warnings
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from embedtrain.config import dump_config, load_config, load_run_config
from embedtrain.dependencies import import_optional
from embedtrain.train.run_dir import SUMMARY_FILE, RunDir
from embedtrain.cli.tune.space import Distribution, SearchSpace
from embedtrain.utils import write_atomic

class TrialStatus(enum.Enum):
    """How a trial ended."""

    DONE = "done"  # trained to the end (its summary.json written)
    STOPPED = "stopped"  # stopped by the scheduler (ASHA)
    ERROR = "error"  # failed: a config the model refuses, a crash
    UNFINISHED = "unfinished"  # running or waiting when the search was interrupted




@dataclass
class TrialOutcome:
    """One trial as the search ended.

    Attributes:
        name: ``trial_000``, ...
        index: its number (0, 1, ...): the order trials were created in.
        config: its values of the searched keys.
        status: how it ended.
        run_dir: its run directory (in ``trials.json``: null for a trial that failed before
            writing one).
        best_value: the best validation value of the metric over its evaluations (None: none).
        step: the step of that evaluation.
        error: the one-line error of an ``error`` trial.
    """

    name: str
    index: int
    config: dict[str, Any]
    status: TrialStatus
    run_dir: Path
    best_value: Optional[float] = None
    step: Optional[int] = None
    error: Optional[str] = None

    def to_json(self) -> dict[str, Any]:
        entry = {"trial": self.name, "config": self.config, "best_value": self.best_value,
                 "step": self.step, "status": self.status.value,
                 "run_dir": str(self.run_dir) if self.run_dir.is_dir() else None}
        if self.error is not None:
            entry["error"] = self.error
        return entry


def best_record(records: Iterable[dict[str, Any]], metric: str, higher: bool
                ) -> Optional[dict[str, Any]]:
    """The validation record with the best ``metric`` (the first of equals); None: none has it."""
    best = None
    for r in records:
        v = r.get(metric)
        if r.get("split", "valid") != "valid" or not isinstance(v, (int, float)) or math.isnan(v):
            continue
        if best is None or (v > best[metric] if higher else v < best[metric]):
            best = r
    return best


def trial_outcome(name: str, index: int, config: dict[str, Any], run_dir: Path,
                  metric: Optional[str], higher: bool, ended: bool,
                  error: Optional[str] = None) -> TrialOutcome:
    """A trial's outcome from its run directory.

    Args:
        ended: Ray Tune ended the trial (finished, stopped or failed); False: the search was
            interrupted while it ran or waited.
        error: its one-line error, if it failed.
    """
    if error is not None:
        status = TrialStatus.ERROR
    elif (run_dir / SUMMARY_FILE).is_file():
        status = TrialStatus.DONE
    else:
        status = TrialStatus.STOPPED if ended else TrialStatus.UNFINISHED
    best = best_record(RunDir(run_dir, create=False).read_metrics(), metric, higher) \
        if metric else None
    return TrialOutcome(name, index, config, status, run_dir,
                        best[metric] if best else None, best["step"] if best else None, error)


def best_outcome(outcomes: Sequence[TrialOutcome], higher: bool) -> Optional[TrialOutcome]:
    """The trial with the best value, failed ones left out (the first of equals)."""
    best = None
    for o in outcomes:
        if o.status is TrialStatus.ERROR or o.best_value is None:
            continue
        if best is None or (o.best_value > best.best_value if higher
                            else o.best_value < best.best_value):
            best = o
    return best


def write_trials(out: Path, outcomes: Sequence[TrialOutcome]) -> Path:
    """``DIR/trials.json``: one entry per trial, in trial order."""
    path = out / "trials.json"
    write_atomic(path, json.dumps([o.to_json() for o in outcomes], indent=2) + "\n")
    return path


def write_best_config(out: Path, base_config: Path, space: SearchSpace,
                      best: TrialOutcome) -> Path:
    """``DIR/best.yaml``: the search's config (the user's config, ``--set``, the space's fixed
    values) with the best trial's values, as ``embedtrain train`` writes a run's config.yaml."""
    path = out / "best.yaml"
    dump_config(load_config(base_config, space.overrides(best.config)), path)
    return path


def failed_warning(outcomes: Sequence[TrialOutcome]) -> Optional[str]:
    """One line when more than a quarter of the trials failed (the search then explored only
    part of its space), else None."""
    failed = sum(o.status is TrialStatus.ERROR for o in outcomes)
    if outcomes and failed * 4 > len(outcomes):
        return (f"warning: {failed} of {len(outcomes)} trials failed: the best is the best of "
                f"the other {len(outcomes) - failed} (the errors are under the table)")
    return None


def write_best(out: Path, best: TrialOutcome, metric: str, higher: bool,
               outcomes: Sequence[TrialOutcome] = ()) -> dict[str, Any]:
    """``DIR/best.json``: the best trial's run directory, validation value and test metrics.

    The test metrics are those of its selected checkpoint: from ``summary.json`` when it ran to
    the end; else (stopped by the scheduler) its checkpoint of the best evaluation, or its
    newest one, is evaluated on the test split here, as ``embedtrain eval RUN --split test
    --checkpoint STEP`` would. ``outcomes``: every trial, for ``trials`` and ``failed_trials``
    (and ``warning`` where more than a quarter failed).
    """
    summary_file = best.run_dir / SUMMARY_FILE
    if summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        keys = summary.get("valid") or {}
        test = {k: summary[k] for k in keys if k in summary} if summary.get("split") == "test" \
            else None
        step = (summary.get("selected") or {}).get("step", summary.get("steps"))
        source = "summary.json" if test is not None else "summary.json (no test split)"
    else:
        step = checkpoint_step(best.run_dir, best.step)
        test, source = None, "no checkpoint"
        if step is not None:
            test = evaluate_checkpoint(best.run_dir, step, "test")
            source = f"embedtrain eval {best.run_dir} --split test --checkpoint {step}"
    result = {"trial": best.name, "run_dir": str(best.run_dir), "status": best.status.value,
              "config": best.config, "metric": metric, "mode": "max" if higher else "min",
              "valid_value": best.best_value, "valid_step": best.step,
              "test": test, "test_step": step, "test_from": source,
              "trials": len(outcomes),
              "failed_trials": sum(o.status is TrialStatus.ERROR for o in outcomes)}
    warning = failed_warning(outcomes)
    if warning:
        result["warning"] = warning
    write_atomic(out / "best.json", json.dumps(result, indent=2) + "\n")
    return result


def checkpoint_step(run_dir: Path, preferred: Optional[int]) -> Optional[int]:
    """``preferred``'s step if the run has a complete checkpoint of it, else its newest one."""
    from embedtrain.train.checkpoint import CheckpointManager  # torch: only for stopped runs

    checkpoints = CheckpointManager(RunDir(run_dir, create=False).checkpoints)
    steps = [checkpoints.info(c)["step"] for c in checkpoints.all()]
    if preferred in steps:
        return preferred
    return max(steps) if steps else None


def evaluate_checkpoint(run_dir: Path, step: int, split: str) -> Optional[dict[str, float]]:
    """The metrics of a run's checkpoint on ``split`` (``embedtrain eval``'s path, in this
    process: a world of one); None when the data set has no such split."""
    from embedtrain.recipes import build_run

    cfg = load_run_config(run_dir / "config.yaml")
    run = build_run(cfg, run_dir, progress=False, record_plan=False)
    if split not in run.recipe.dataset_info().splits:
        return None
    run.trainer.restore(step)
    return run.trainer.evaluate(run.eval_reader(split))


def format_table(outcomes: Sequence[TrialOutcome], keys: Sequence[str],
                 metric: Optional[str]) -> str:
    """The trials as a text table: trial, the searched keys' values, best value, step, status;
    the errors' lines below it; above it, a warning where more than a quarter failed."""
    head = ["trial", *keys, f"best {metric or 'value'}", "step", "status"]
    rows = [[o.name, *(_short(o.config.get(k)) for k in keys),
             "-" if o.best_value is None else f"{o.best_value:.4f}",
             "-" if o.step is None else str(o.step), o.status.value] for o in outcomes]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    warning = failed_warning(outcomes)
    if warning:
        lines.insert(0, warning)
    lines += [f"{o.name}: {o.error}" for o in outcomes if o.error]
    return "\n".join(lines)


def plot_search(path: Path, outcomes: Sequence[TrialOutcome], space: SearchSpace,
                metric: Optional[str], higher: bool) -> Optional[Path]:
    """``search.png``: the best validation value against the trial number (with the best so
    far), and one panel against each searched key (log x for ``loguniform`` keys, a choice's
    values in the space's order); stopped trials hollow, failed ones as crosses under the
    values. None: no trial has a value."""
    scored = [o for o in outcomes
              if o.best_value is not None and o.status is not TrialStatus.ERROR]
    if not scored:
        return None
    failed = [o for o in outcomes if o.status is TrialStatus.ERROR]
    import_optional("matplotlib", "matplotlib", "search.png").use("Agg")
    plt = import_optional("matplotlib.pyplot", "matplotlib", "search.png")
    values = [o.best_value for o in scored]
    span = (max(values) - min(values)) or abs(max(values)) or 1.0
    floor = min(values) - 0.08 * span  # where failed trials are drawn
    panels = 1 + len(space.params)
    cols = min(panels, 3)
    rows = -(-panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    label = f"best valid {metric}"
    ax = axes[0][0]
    _points(ax, lambda o: o.index, scored, failed, floor)
    running, best = [], None
    for o in sorted(scored, key=lambda o: o.index):
        if best is None or (o.best_value > best if higher else o.best_value < best):
            best = o.best_value
        running.append((o.index, best))
    ax.step(*zip(*running), where="post", color="C2", label="best so far")
    ax.set(xlabel="trial", ylabel=label, title=f"valid {metric} by trial")
    ax.legend(fontsize=8)
    for i, p in enumerate(space.params, start=1):
        ax = axes[i // cols][i % cols]
        if p.distribution is Distribution.CHOICE:  # the values in the space's order
            names = [_short(v, "\n") for v in p.values]
            _points(ax, lambda o: names.index(_short(o.config.get(p.key), "\n")), scored,
                    failed, floor)
            ax.set_xticks(range(len(names)), names, rotation=30 if len(names) > 4 else 0,
                          fontsize=8)
            ax.set_xlim(-0.5, len(names) - 0.5)
        else:
            _points(ax, lambda o: o.config.get(p.key), scored, failed, floor)
            if p.log_scale:
                ax.set_xscale("log")
        ax.set(xlabel=f"{p.key} ({p.distribution.value})", ylabel=label)
    for j in range(panels, rows * cols):
        axes[j // cols][j % cols].axis("off")
    for row in axes:
        for a in row:
            a.grid(alpha=0.3)
    with warnings.catch_warnings():  # long choice labels: the layout is the best it can be
        warnings.simplefilter("ignore", UserWarning)
        fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=100, format="png")
    plt.close(fig)
    write_atomic(path, buffer.getvalue())
    return path


def _points(ax: Any, x: Any, scored: Sequence[TrialOutcome], failed: Sequence[TrialOutcome],
            floor: float) -> None:
    """Trials at ``(x(trial), best value)``: done filled, stopped or unfinished hollow, failed
    as crosses at ``floor``."""
    for status, face in ((TrialStatus.DONE, "C0"), (TrialStatus.STOPPED, "none"),
                         (TrialStatus.UNFINISHED, "none")):
        points = [(x(o), o.best_value) for o in scored if o.status is status]
        if points:
            ax.scatter(*zip(*points), facecolors=face, edgecolors="C0", label=status.value,
                       zorder=3)
    points = [(x(o), floor) for o in failed if x(o) is not None]
    if points:
        ax.scatter(*zip(*points), marker="x", color="C3", label=TrialStatus.ERROR.value, zorder=3)


def _short(value: Any, sep: str = ", ") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):  # a mapping choice: its values, one line each
        return sep.join(f"{k}={_short(v)}" for k, v in value.items())
    if isinstance(value, list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


__all__ = ["TrialOutcome", "TrialStatus", "best_outcome",
           "best_record", "checkpoint_step", "evaluate_checkpoint", "format_table",
           "plot_search", "trial_outcome", "write_best", "write_best_config", "write_trials"]

