"""The run directory contract: ``metrics.jsonl``, ``summary.json`` and ``curves.png``.

Users script against these names; keep them stable.

``metrics.jsonl`` is append-only history: one JSON object per evaluation, and, where a run was
resumed, one ``{"event": "resume", "step": S, ...}`` line. A run that crashed after its last
checkpoint may have logged evaluations past ``S``; they stay in the file, superseded by what the
resumed run logs (:meth:`RunDir.read_metrics` returns the records in effect, :meth:`RunDir.
read_records` every line). Nothing but training appends to it: ``embedtrain eval`` writes its own
``eval_<split>_<step>.json``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from embedtrain.dependencies import import_optional

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CURVES_FILE = "curves.png"


class RunDir:
    """Writes a run's records; only the rank that owns it (rank 0) should write."""

    def __init__(self, root: str | os.PathLike, create: bool = True) -> None:
        self.root = Path(root)
        if create:
            self.root.mkdir(parents=True, exist_ok=True)

    def has_run(self) -> bool:
        """Whether an earlier run left records or checkpoints here."""
        return (self.root / METRICS_FILE).exists() or (
            self.checkpoints.is_dir() and any(self.checkpoints.iterdir())
        )

    def clear(self) -> None:
        """Removes an earlier run's records and checkpoints (for ``--overwrite``)."""
        for name in (METRICS_FILE, SUMMARY_FILE, CURVES_FILE):
            (self.root / name).unlink(missing_ok=True)
        for old in self.root.glob("eval_*.json"):
            old.unlink()
        shutil.rmtree(self.checkpoints, ignore_errors=True)

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def log_metrics(self, record: dict[str, Any]) -> None:
        with open(self.root / METRICS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")

    def log_resume(self, step: int, checkpoint: str, note: Optional[dict[str, Any]] = None) -> None:
        """Marks in the history that training continued from ``checkpoint`` at ``step``."""
        self.log_metrics({"event": "resume", "step": step, "checkpoint": checkpoint,
                          **(note or {})})

    def read_records(self) -> list[dict[str, Any]]:
        """Every line of ``metrics.jsonl`` as written (evaluations and resume events)."""
        path = self.root / METRICS_FILE
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def read_metrics(self) -> list[dict[str, Any]]:
        """The evaluation records in effect: a resume at step S supersedes earlier records past S."""
        kept: list[dict[str, Any]] = []
        for record in self.read_records():
            if record.get("event") == "resume":
                kept = [r for r in kept if r.get("step", 0) <= record["step"]]
            else:
                kept.append(record)
        return kept

    def write_eval(self, split: str, step: int, result: dict[str, Any]) -> Path:
        """``eval_<split>_<step>.json`` (``embedtrain eval``'s result; the history is untouched)."""
        path = self.root / f"eval_{split}_{step:08d}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        return path

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.root / SUMMARY_FILE
        path.write_text(json.dumps(summary, indent=2) + "\n")
        return path

    def plot_curves(
        self, main_metric: str, title: Optional[str] = None, reference: Optional[float] = None
    ) -> Optional[Path]:
        """Plots training/validation loss and ``main_metric`` against steps from metrics.jsonl.

        ``reference`` (e.g. a synthetic data set's oracle AUC) is drawn as a dashed line.
        """
        records = [r for r in self.read_metrics() if r.get("split") == "valid"]
        if not records:
            return None
        import_optional("matplotlib", "matplotlib", "curves.png").use("Agg")
        plt = import_optional("matplotlib.pyplot", "matplotlib", "curves.png")

        steps = [r["step"] for r in records]
        fig, (ax_loss, ax_metric) = plt.subplots(1, 2, figsize=(10, 4))
        train = [(r["step"], r["train_loss"]) for r in records if r.get("train_loss") is not None]
        if train:
            ax_loss.plot(*zip(*train), marker="o", label="train (mean since last eval)")
        ax_loss.plot(steps, [r["loss"] for r in records], marker="o", label="valid")
        ax_loss.set(xlabel="step", ylabel="loss", title="loss")
        ax_loss.legend()
        ax_metric.plot(steps, [r.get(main_metric) for r in records], marker="o", color="C2")
        if reference is not None:
            ax_metric.axhline(reference, color="k", linestyle="--", label=f"oracle {reference:.4f}")
            ax_metric.legend()
        ax_metric.set(xlabel="step", ylabel=main_metric, title=f"valid {main_metric}")
        for ax in (ax_loss, ax_metric):
            ax.grid(alpha=0.3)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        path = self.root / CURVES_FILE
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
