"""A run directory's policy: what a new run, an overwrite or a resume of a config may do with it.

:func:`check_start` is asked twice by :func:`embedtrain.recipes.fit` (and by ``embedtrain
train`` before it imports torch): before anything is touched, and again as the directory's one
writer (:meth:`~embedtrain.train.run_dir.RunDir.writer`). A resume may change only
``RESUME_SAFE_KEYS`` (its length, cadences, loader threads, loggers), compared with derived
sizes written out.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from embedtrain.config import (RESUME_SAFE_KEYS, Config, changed_keys, load_run_config,
                               with_derived_sizes)
from embedtrain.train.run_dir import LOCKED_ENV, SUMMARY_FILE, RunDir, RunDirError, env_rank


def check_start(run_dir: RunDir, cfg: Config, resume: bool, overwrite: bool, quiet: bool = False
                ) -> Optional[dict[str, tuple[Any, Any]]]:
    """What a run of ``cfg`` may do in ``run_dir`` (read-only checks, before anything is built).

    Returns:
        The config keys a resume changes (``{}`` for a fresh run), or None when the run is
        finished and there is nothing to do (said on stderr unless ``quiet``).

    Raises:
        RunDirError: another writer; an earlier run without ``resume``/``overwrite``; a
            resume whose config changes the model, the data or the optimizer (the keys
            named), or that would end before the run's checkpoint.
    """
    if os.environ.get(LOCKED_ENV) != str(run_dir.root.resolve()) and env_rank() == 0:
        run_dir.check_unlocked()
    if not run_dir.has_run():
        return {}
    if not resume:
        if not overwrite:
            raise RunDirError(f"{run_dir.root}: holds an earlier run; pass --resume to continue "
                              "it, --overwrite to replace it, or choose another --out")
        return {}
    saved_file = run_dir.root / "config.yaml"
    if not saved_file.is_file():
        return {}
    saved = load_run_config(saved_file)
    changes = changed_keys(with_derived_sizes(saved), with_derived_sizes(cfg))
    unsafe = {k: v for k, v in changes.items() if k not in RESUME_SAFE_KEYS}
    if unsafe:
        shown = "; ".join(f"{k}: {old!r} -> {new!r}"
                          for k, (old, new) in list(unsafe.items())[:4])
        more = f" (and {len(unsafe) - 4} more)" if len(unsafe) > 4 else ""
        raise RunDirError(
            f"{run_dir.root}: --resume with a config that differs from {saved_file} in "
            f"{shown}{more}; a resumed run may change only its length, its evaluation and "
            f"checkpoint cadence and loader threads ({', '.join(sorted(RESUME_SAFE_KEYS))}): "
            "start a new run (--out)")
    from embedtrain.train.checkpoint import CheckpointError, CheckpointManager  # torch: here

    checkpoints = CheckpointManager(run_dir.checkpoints)
    latest = checkpoints.latest()
    try:
        info = checkpoints.info(latest) if latest else {}
    except CheckpointError:
        info = {}  # unreadable: the trainer falls back to an older checkpoint
    step, total = info.get("step"), _resumed_total(info, saved, cfg)
    if total is not None and step is not None and total < step:
        raise RunDirError(f"{run_dir.root}: --resume would shorten the run to {total:,} steps, "
                          f"below its checkpoint at step {step:,} (train.max_steps / "
                          "train.epochs); the run's files are untouched: start a new run "
                          "(--out) to train fewer steps")
    longer = {"train.epochs", "train.max_steps"} & set(changes) and (total is None
                                                                      or total > step)
    if info.get("finished") and not longer and (run_dir.root / SUMMARY_FILE).is_file():
        if env_rank() == 0 and not quiet:
            total = info.get("total_steps", info["step"])
            print(f"{run_dir.root}: finished at step {info['step']:,} of {total:,}; nothing to "
                  "resume (to train longer, raise train.max_steps or train.epochs with "
                  "--set)", file=sys.stderr)
        return None
    return changes


def _resumed_total(info: dict[str, Any], saved: Any, cfg: Any) -> Optional[int]:
    """The steps a resumed run would end at under ``cfg`` (None where it cannot be known without
    the data: a checkpoint of an older run bounded by ``max_steps`` where ``cfg`` counts in
    epochs). The length is sized as the trainer sizes it, with the checkpoint's steps a pass."""
    total = info.get("total_steps")
    if not isinstance(total, int):
        return None
    per_epoch = info.get("steps_per_epoch")
    if not isinstance(per_epoch, int):  # written before checkpoints held it
        old_max, epochs = saved.train.max_steps, saved.train.epochs
        per_epoch = (total // epochs if (old_max is None or old_max > total) and epochs
                     else None)
    if per_epoch is None:
        return cfg.train.max_steps
    steps = cfg.train.sized(per_epoch).epochs * per_epoch
    return min(steps, cfg.train.max_steps or steps)
