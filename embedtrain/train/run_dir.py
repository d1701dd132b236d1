"""The run directory contract: ``metrics.jsonl``, ``summary.json`` and ``curves.png``.

Users script against these names; keep them stable.

``metrics.jsonl`` is the run's history: one JSON object per evaluation, and, where a run was
resumed, one ``{"event": "resume", "step": S, ...}`` line. Each line is appended whole and fsynced.
A run that crashed after its last checkpoint may have logged evaluations past ``S`` (and a torn
last line): a resume from ``S`` drops them, rewriting the file atomically, before it appends its
event, so the file never holds one step's record twice (:meth:`RunDir.truncate_after`). Nothing
but training writes it, and nothing but training writes into a run directory: ``embedtrain eval``
prints its result (``--out FILE`` puts it in a file of the user's).

Every other file is written whole or not at all (a temporary file renamed over it). One process
writes a run directory at a time: ``train`` holds an OS lock on ``.lock`` for its life
(:meth:`RunDir.lock`), released by the OS when the process ends, however it ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any, Iterator, Optional

from embedtrain.dependencies import import_optional
from embedtrain.utils import append_line, write_atomic

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CURVES_FILE = "curves.png"
LINEAGE_FILE = "lineage.json"  # continual training's record (embedtrain.train.lineage)
LOCK_FILE = ".lock"
# What makes a directory a run's (an earlier run, or one that started): ``--out`` that exists and
# holds none of these is a user's folder, refused unless empty.
RUN_FILES = ("config.yaml", METRICS_FILE, SUMMARY_FILE, "checkpoints", "plan.json", LOCK_FILE)
_HELD: dict[str, int] = {}  # run directory -> the descriptor of its lock (held for the process)
LOCKED_ENV = "EMBEDTRAIN_RUN_LOCKED"  # set for the ranks of a run whose launcher holds the lock


class RunDirError(ValueError):
    """The run directory cannot be used; ``str(err)`` is one line naming it."""


class RunDir:
    """A run directory's life: its writer lock, what a new run or a resume may do with it
    (:meth:`check_start`), its records. Only the rank that owns it (rank 0) writes."""

    def __init__(self, root: str | os.PathLike, create: bool = True) -> None:
        self.root = Path(root)
        if create:
            self.root.mkdir(parents=True, exist_ok=True)

    def lock(self) -> None:
        """Takes the run directory's writer lock for this process's life (idempotent).

        An ``flock`` on ``.lock``: the OS drops it when the process dies (a SIGKILLed run leaves
        no stale lock), and a second writer is refused at once.

        Raises:
            RunDirError: another live process holds it (its PID and host named).
        """
        key = str(self.root.resolve())
        if key in _HELD:
            return
        path = self.root / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._refuse(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        _HELD[key] = fd

    def check_unlocked(self) -> None:
        """Refuses (as :meth:`lock`) when another process holds the lock; writes nothing."""
        if str(self.root.resolve()) in _HELD:
            return
        try:
            fd = os.open(self.root / LOCK_FILE, os.O_RDONLY)
        except OSError:
            return  # no lock file: no writer yet
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            self._refuse(fd)
        os.close(fd)

    def _refuse(self, fd: int) -> None:
        holder = os.pread(fd, 200, 0).decode(errors="replace").split()
        os.close(fd)
        who = f"pid {holder[0]} on {holder[1]}" if len(holder) >= 2 else "another process"
        raise RunDirError(f"{self.root}: another embedtrain train is writing this run "
                          f"({who}); wait for it to end, or choose another --out")

    @contextlib.contextmanager
    def writer(self) -> Iterator[None]:
        """One writer per run directory: this process (or the launcher above it) holds ``.lock``.

        ``embedtrain train --nproc N`` takes it before launching and keeps it while torchrun and
        its ranks run (they skip it); a rank started by a user's own torchrun takes it on rank 0.
        A run directory this created and that holds nothing else when the block ends (it failed
        before writing anything) is removed.
        """
        key = str(self.root.resolve())
        if os.environ.get(LOCKED_ENV) == key or env_rank() != 0:
            yield
            return
        created = not self.root.exists()
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock()
        os.environ[LOCKED_ENV] = key  # inherited by the ranks a launcher starts
        try:
            yield
        finally:
            os.environ.pop(LOCKED_ENV, None)
            self.unlock()
            if created and [p.name for p in self.root.iterdir()] == [LOCK_FILE]:
                shutil.rmtree(self.root, ignore_errors=True)

    def unlock(self) -> None:
        """Releases :meth:`lock` (the file stays: removing it would race a new writer)."""
        fd = _HELD.pop(str(self.root.resolve()), None)
        if fd is not None:
            os.close(fd)

    @staticmethod
    def check_out(root: Path) -> None:
        """Whether ``root`` can hold a run: absent, an empty folder, or a run's (read-only).

        Raises:
            RunDirError: a file, a path under a file, or a folder of other files.
        """
        for parent in (root, *root.parents):
            if parent.exists() and not parent.is_dir():
                where = "is a file" if parent == root else f"lies under the file {parent}"
                raise RunDirError(f"{root}: {where}, not a run directory; choose another --out")
            if parent.is_dir():
                break
        if root.is_dir() and not any((root / name).exists() for name in RUN_FILES):
            others = sorted(p.name for p in root.iterdir())
            if others:
                shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more"
                                                 if len(others) > 3 else "")
                raise RunDirError(f"{root}: not empty and not a run directory (holds {shown}); "
                                  "choose another --out")

    def has_run(self) -> bool:
        """Whether an earlier run left records or checkpoints here."""
        return (self.root / METRICS_FILE).exists() or (
            self.checkpoints.is_dir() and any(self.checkpoints.iterdir())
        )

    def clear(self) -> None:
        """Removes an earlier run's records and checkpoints (for ``--overwrite``)."""
        for name in (METRICS_FILE, SUMMARY_FILE, CURVES_FILE, LINEAGE_FILE):
            (self.root / name).unlink(missing_ok=True)
        for old in self.root.glob("eval_*.json"):  # what `embedtrain eval` wrote into runs once
            old.unlink()
        shutil.rmtree(self.checkpoints, ignore_errors=True)

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def log_metrics(self, record: dict[str, Any]) -> None:
        append_line(self.root / METRICS_FILE, json.dumps(record))

    def truncate_after(self, step: int) -> int:
        """Drops the records past ``step`` (a crashed run's, not in its checkpoint) and a torn
        last line, rewriting ``metrics.jsonl`` atomically; returns how many lines went."""
        path = self.root / METRICS_FILE
        if not path.is_file():
            return 0
        lines = path.read_text().splitlines(keepends=True)
        kept = []
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill: only ever the last
                continue
            if not line.endswith("\n"):
                continue
            if record.get("event") == "resume" or record.get("step", 0) <= step:
                kept.append(line)
        if len(kept) != len(lines):
            write_atomic(path, "".join(kept))
        return len(lines) - len(kept)

    def log_resume(self, step: int, checkpoint: str, note: Optional[dict[str, Any]] = None) -> None:
        """Marks in the history that training continued from ``checkpoint`` at ``step``."""
        self.log_metrics({"event": "resume", "step": step, "checkpoint": checkpoint,
                          **(note or {})})

    def read_records(self) -> list[dict[str, Any]]:
        """Every line of ``metrics.jsonl`` as written (evaluations and resume events)."""
        path = self.root / METRICS_FILE
        if not path.is_file():
            return []
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a last line cut short by a kill (dropped on resume)
                continue
        return records

    def read_metrics(self) -> list[dict[str, Any]]:
        """The evaluation records in effect: a resume at step S supersedes earlier records past S."""
        kept: list[dict[str, Any]] = []
        for record in self.read_records():
            if record.get("event") == "resume":
                kept = [r for r in kept if r.get("step", 0) <= record["step"]]
            else:
                kept.append(record)
        return kept

    def selected_step(self) -> tuple[Optional[int], str]:
        """The step whose weights ``summary.json`` reports (``selected.step``: the best
        validation step with ``train.select: best``, else the last), and why, in words; ``(None,
        why)`` for a run without a readable summary (unfinished): its newest checkpoint is the
        one to take."""
        path = self.root / SUMMARY_FILE
        try:
            summary = json.loads(path.read_text())
            selected = summary["selected"]
            step = int(selected["step"])
        except FileNotFoundError:
            return None, "no summary.json (an unfinished run): its newest checkpoint"
        except (OSError, ValueError, TypeError, KeyError):
            return None, f"{path} names no selected step: the run's newest checkpoint"
        metric, value = selected.get("metric"), selected.get("value")
        if metric and value is not None:
            return step, (f"the step summary.json reports (train.select: best, valid {metric} "
                          f"{value:.4f})")
        return step, "the step summary.json reports (the run's last)"

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.root / SUMMARY_FILE
        write_atomic(path, json.dumps(summary, indent=2) + "\n")
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
        buffer = __import__("io").BytesIO()
        fig.savefig(buffer, dpi=100, format="png")
        plt.close(fig)
        write_atomic(path, buffer.getvalue())
        return path


def env_rank() -> int:
    """This process's rank as torchrun set it (0 outside a launch)."""
    return int(os.environ.get("RANK", "0"))

