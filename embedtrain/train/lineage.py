"""Continual training's record: the run a run warm-started from, and the partitions its line of
runs consumed.

A run on a partitioned data set (``data.partitions``) or warm-started from another run
(``train.warm_start``) writes ``lineage.json`` into its directory when it starts::

    {"data": "/abs/data/days", "partitions": ["day=003"],
     "warm_start": {"run": "/abs/runs/day2", "checkpoint": ".../step_00000040", "step": 40},
     "consumed": [{"data": "/abs/data/days", "partition": "day=001", "run": "/abs/runs/day1"},
                  {"data": "/abs/data/days", "partition": "day=002", "run": "/abs/runs/day2"}]}

``consumed`` is what the line consumed before this run: the source's ``consumed`` plus the
source's own partitions. A warm start is only taken from a finished run (its
``summary.json`` written), so every partition of the line was read to the end, each row once per
epoch (the loader's exactly-once position; a crashed run resumes from it with ``--resume``,
which warm-starts again only where no checkpoint was written). A warm start whose partitions the
line already consumed is refused in one line, before anything is written.

Which checkpoint: the source's selected one (``summary.json``'s ``selected.step``: the best
validation's with ``select: best``, else the last).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from embedtrain.features import list_partitions
from embedtrain.train.run_dir import LINEAGE_FILE, SUMMARY_FILE, RunDirError
from embedtrain.utils import write_atomic

__all__ = ["LINEAGE_FILE", "check_warm_start", "consumed", "read_lineage", "run_partitions",
           "source_checkpoint", "write_lineage"]


def run_partitions(cfg: Any) -> list[str]:
    """The partitions a run of ``cfg`` reads: ``data.partitions``, or all of a partitioned data
    set's; [] for a data set without partitions."""
    if cfg.data.partitions is not None:
        return list(cfg.data.partitions)
    return list_partitions(cfg.data.path)


def read_lineage(run: Path) -> dict[str, Any]:
    """A run's ``lineage.json`` ({} where it has none: a run on whole data sets)."""
    path = run / LINEAGE_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RunDirError(f"{path}: unreadable: {e}") from None


def consumed(run: Path) -> list[dict[str, str]]:
    """The partitions ``run``'s line consumed, ``run``'s own included (a finished run)."""
    lineage = read_lineage(run)
    own = [{"data": lineage["data"], "partition": p, "run": str(run.resolve())}
           for p in lineage.get("partitions", [])]
    return [*lineage.get("consumed", []), *own]


def source_checkpoint(run: Path) -> tuple[Path, int]:
    """The checkpoint a warm start from ``run`` loads, and its step.

    Raises:
        RunDirError: not a run, not finished, or its selected checkpoint is gone (one line).
    """
    if not (run / "config.yaml").is_file():
        raise RunDirError(f"train.warm_start: {run}: not a run directory (no config.yaml)")
    summary_file = run / SUMMARY_FILE
    if not summary_file.is_file():
        raise RunDirError(f"train.warm_start: {run}: not finished (no {SUMMARY_FILE}); finish "
                          f"it first (embedtrain train ... --resume --out {run})")
    from embedtrain.train.checkpoint import CheckpointError, CheckpointManager  # torch: here

    step = json.loads(summary_file.read_text()).get("selected", {}).get("step")
    checkpoints = CheckpointManager(run / "checkpoints")
    try:
        path = checkpoints.find(step) if step is not None else checkpoints.latest()
        if path is None:
            raise CheckpointError(f"{run / 'checkpoints'}: no checkpoint")
        return path, int(checkpoints.info(path)["step"])
    except CheckpointError as e:
        raise RunDirError(f"train.warm_start: {e}") from None


def check_warm_start(cfg: Any) -> Optional[tuple[Path, int]]:
    """Refusals of ``cfg``'s warm start (none: None), read-only; returns the source checkpoint.

    Raises:
        RunDirError: an unusable source, or a partition its line consumed (one line).
    """
    if cfg.train.warm_start is None:
        return None
    run = Path(cfg.train.warm_start)
    ckpt = source_checkpoint(run)
    data = str(Path(cfg.data.path).resolve())
    done = {(c["data"], c["partition"]): c["run"] for c in consumed(run)}
    for p in run_partitions(cfg):
        if (data, p) in done:
            raise RunDirError(f"data.partitions: {p} was consumed by {done[(data, p)]} (the line "
                              f"of {run}); a partition is trained on once: name the new ones")
    return ckpt


def write_lineage(run_dir: Path, cfg: Any, source: Optional[tuple[Path, int]]) -> None:
    """Writes ``run_dir/lineage.json`` for a run on partitions or warm-started (else nothing)."""
    partitions = run_partitions(cfg)
    if source is None and not partitions:
        return
    record: dict[str, Any] = {"data": str(Path(cfg.data.path).resolve()),
                              "partitions": partitions, "warm_start": None, "consumed": []}
    if source is not None:
        run = Path(cfg.train.warm_start).resolve()
        record["warm_start"] = {"run": str(run), "checkpoint": str(source[0].resolve()),
                                "step": source[1]}
        record["consumed"] = consumed(run)
    write_atomic(run_dir / LINEAGE_FILE, json.dumps(record, indent=2) + "\n")

