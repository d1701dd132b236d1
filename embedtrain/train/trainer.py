"""One training loop for every task family: fetch batch, step, maybe evaluate, maybe checkpoint, log.

The loop knows nothing of DLRM, GNN or extreme classification: the :class:`~embedtrain.train.task.Task`
turns a batch into a loss and predictions and names its metrics. Data comes from any object with
``iter_epoch(epoch, skip_batches)`` and ``len()`` (e.g. :class:`~embedtrain.data.ParquetBatchReader`),
which makes a resumed run continue on exactly the batches the uninterrupted run would have seen.

Example:
    >>> trainer = Trainer(task, model, optimizer, train_data, valid_data, RunDir("runs/x"), options)
    >>> summary = trainer.fit(test_data=test_data)       # writes metrics.jsonl, summary.json, ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchrec.optim.keyed import KeyedOptimizer
from tqdm import tqdm

from embedtrain.runtime import peak_rss_gb_per_rank, startup_record
from embedtrain.train.checkpoint import (
    CheckpointError, CheckpointManager, CheckpointMismatch, all_ranks_ok, init_optimizer_state)
from embedtrain.train.loggers import Logger
from embedtrain.train.run_dir import RunDir
from embedtrain.train.state import EpochData, TrainerOptions, TrainState  # noqa: F401 (public here)
from embedtrain.train.status import progress_display
from embedtrain.train.options import PipelineKind, Selection, evaluation_steps
from embedtrain.train.pipeline import BatchArgs, PipelinedSteps
from embedtrain.train.steps import closing_iterator, train_steps
from embedtrain.train.task import StepOutput, Task, higher_is_better


class Trainer:
    """Trains ``model`` on a task.

    Args:
        task: the task family (loss, predictions, metrics).
        model: the model, usually wrapped in ``DistributedModelParallel``.
        optimizer: a keyed optimizer over all parameters (fused sparse + dense).
        train_data: training batches (per rank).
        valid_data: validation batches for periodic and final evaluation; None: a data set
            without a validation split (no evaluation until the test, no best checkpoint).
        run_dir: where records and checkpoints go.
        options: schedule of the run.
        dataset_name: recorded in ``summary.json``.
        extra_summary: more fields for ``summary.json`` (e.g. the data set's oracle AUC).
        lr_scheduler: stepped after every dense optimizer step, checkpointed with the run.
        reference: a reference value of the task's main metric (e.g. the data set's oracle),
            drawn as a line in ``curves.png``.
        batch_args: a batch -> the model's forward arguments; needed by ``options.pipeline``
            other than ``none`` (:mod:`embedtrain.train.pipeline`).
        model_stats: the model -> statistics recorded under ``tables`` with every evaluation in
            ``metrics.jsonl`` and in ``summary.json`` (e.g. the dynamic tables' occupancy); a
            collective, called on every rank.
        before_checkpoint: called with the model on every rank before each checkpoint is
            taken (e.g. dynamic tables admit their pending ids, so a checkpoint falls on an
            admission boundary and a resume replays the run exactly).
        loggers: metric loggers (:mod:`embedtrain.train.loggers`), on rank 0: the training
            loss of every step (each keeps every n-th), every evaluation, the summary.
        on_evaluation: called on rank 0 as ``on_evaluation(trainer, record)`` after each
            validation evaluation, with the record logged to ``metrics.jsonl``: a periodic one
            once the checkpoints it brings (the best so far, one due at that step) are written,
            the final one once the summary is; so a hook that raises (a search scheduler
            stopping the run) leaves a run directory whose records and checkpoints agree.

    Every rank runs the loop; only rank 0 shows progress and writes records. Ranks must get
    the same number of training batches (``LastBatch.PAD``); evaluation copes with ranks holding
    different numbers of batches (the ones that run out repeat a forward pass without counting
    it, so the sharded model's collectives stay matched). Every loader iterator is closed (its
    threads stopped and joined) when the loop leaves it, also on errors.
    """

    def __init__(
        self,
        task: Task,
        model: nn.Module,
        optimizer: KeyedOptimizer,
        train_data: EpochData,
        valid_data: Optional[EpochData],
        run_dir: RunDir,
        options: TrainerOptions,
        dataset_name: str = "",
        extra_summary: Optional[dict[str, Any]] = None,
        lr_scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None,
        reference: Optional[float] = None,
        batch_args: Optional[BatchArgs] = None,
        model_stats: Optional[Callable[[nn.Module], dict[str, Any]]] = None,
        before_checkpoint: Optional[Callable[[nn.Module], None]] = None,
        on_evaluation: Optional[Callable[["Trainer", dict[str, Any]], None]] = None,
        loggers: Sequence[Logger] = (),
    ) -> None:
        self.task, self.model, self.optimizer = task, model, optimizer
        self.train_data, self.valid_data = train_data, valid_data
        # the options left None sized to the training data (TrainerOptions.sized)
        self.run_dir, self.options = run_dir, options.sized(
            len(train_data), _evaluation_steps(train_data, valid_data, options.eval_max_batches))
        self.sizing = options.sizing_line(self.options, len(train_data))
        self.sized_keys = options.derived
        self.dataset_name = dataset_name
        self.extra_summary = extra_summary or {}
        self.reference = reference
        self.model_stats = model_stats
        self.before_checkpoint = before_checkpoint
        self.on_evaluation = on_evaluation
        self.loggers = list(loggers)  # rank 0's: told every step, evaluation and the summary
        self._logged: Optional[dict[str, Any]] = None  # the evaluation record not yet handed on
        self.checkpoints = CheckpointManager(run_dir.checkpoints, keep=options.keep_checkpoints)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.lr_scheduler = lr_scheduler
        self.state = TrainState()
        self.resume_note: dict[str, Any] = {}  # e.g. config keys changed on resume, for the record
        self._saved_step: Optional[int] = None
        self._saved_final = False
        self._final_valid: Optional[dict[str, float]] = None  # the end's validation (checkpointed)
        self._first_step_at: Optional[float] = None  # time.time() of this process's first step
        param = next(model.parameters(), None)
        self.device_type = param.device.type if param is not None else "cpu"  # "cpu", "cuda"
        self.select_metric = options.select_metric or task.main_metric
        self._higher = higher_is_better(self.select_metric) if self._tracks_best else True
        self.pipelined: Optional[PipelinedSteps] = None
        if options.pipeline is not PipelineKind.NONE:
            if batch_args is None:
                raise ValueError(f"train.pipeline: {options.pipeline.value} needs the batch's "
                                 f"model arguments, which this task does not give")
            accumulate = options.grad_accumulation
            self.pipelined = PipelinedSteps(
                options.pipeline, model, task, batch_args, torch.device(self.device_type),
                bf16=options.bf16_dense, loss_scale=1.0 / accumulate if accumulate > 1 else 1.0)

    @property
    def _tracks_best(self) -> bool:
        """Whether evaluations are compared (best-checkpoint selection or early stopping)."""
        o = self.options
        return (o.select is Selection.BEST or o.early_stopping_patience > 0) \
            and self.valid_data is not None

    @property
    def total_steps(self) -> int:
        epoch_steps = self.options.epochs * len(self.train_data)
        return min(self.options.max_steps or epoch_steps, epoch_steps)

    def fit(self, test_data: Optional[EpochData] = None, resume: bool = False) -> dict[str, Any]:
        """Trains to the end of the schedule, evaluates, checkpoints and writes the summary.

        Args:
            test_data: evaluated once at the end for ``summary.json`` (else validation is used).
            resume: continue from the newest complete checkpoint of the run directory, if any.

        Returns:
            The summary (also written to ``summary.json``).
        """
        started = time.perf_counter()
        if resume:
            self.resume()
        if self.sizing and self.rank == 0:
            print(self.sizing, file=sys.stderr)
        opts, st = self.options, self.state
        bar = progress_display(self.total_steps, st.step, len(self.train_data), opts.epochs,
                               opts.progress, opts.status_every_s, self.rank)
        self.model.train()
        with contextlib.closing(self._steps()) as steps:
            for _ in steps:
                bar.set_postfix(loss=f"{st.loss_sum / max(st.loss_steps, 1):.4f}",
                                ex_per_s=f"{st.examples / max(st.train_time_s, 1e-9):,.0f}",
                                refresh=False)
                bar.update(1)
                evaluated = self._evaluation_due()
                stop = evaluated and self._track(self._evaluate_and_log(), save=True)
                if not stop and self._checkpoint_due():
                    self.save()
                if evaluated:
                    self._hand_on_evaluation()
                if stop:
                    break  # stopped early
        bar.close()
        if st.step % opts.grad_accumulation:  # a partial accumulation at the very end
            self._optimizer_step()
        valid, selected = self._final_checkpoint()
        test, split = ((self.evaluate(test_data), "test") if test_data is not None
                       else (valid, "valid" if self.valid_data is not None else None))
        summary = self._write_summary(test, valid, split, time.perf_counter() - started,
                                      selected)
        for logger in self.loggers:
            logger.log_summary(summary)
        self._hand_on_evaluation()  # the final evaluation's, if it ran: the run is complete
        return summary

    def _final_checkpoint(self) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
        """The final validation (once, also across a resume there) and checkpoint; under
        ``select: best`` the best weights restored. Returns ``(valid metrics, selected)``."""
        st = self.state
        final_valid = {}
        if self.valid_data is not None and self._final_valid is not None \
                and self._saved_final and self._saved_step == st.step:
            final_valid = self._final_valid  # resumed at the final checkpoint: logged, tracked
        elif self.valid_data is not None:
            final_valid = self._evaluate_and_log(max_batches=None)
            self._track(final_valid, save=False, final=True)
        self._final_valid = final_valid
        if self._saved_step != st.step or not self._saved_final:
            self.save(final=True)
        if self.options.select is not Selection.BEST or st.best_step is None:
            return final_valid, None
        if st.best_step != st.step:  # evaluate the best checkpoint's weights
            self.restore(self.checkpoints.path(st.best_step))
            self.state = st
        return st.best_valid, {"step": st.best_step, "metric": self.select_metric,
                               "value": st.best_value}

    def _steps(self) -> Generator[None, None, None]:
        """The training steps from where the run stands to the end of the schedule, one per item:
        plain, or through the pipeline, which pauses at the loop's evaluations and checkpoints."""
        return train_steps(self.train_data, self.state, self.total_steps, self._step,
                           self.pipelined,
                           pause_due=lambda: self._evaluation_due() or self._checkpoint_due())

    def _evaluation_due(self) -> bool:
        """Whether the loop evaluates after the step just trained (the last one: after the loop)."""
        every, step = self.options.eval_every, self.state.step
        return self.valid_data is not None and bool(every) and step % every == 0 \
            and step < self.total_steps

    def _checkpoint_due(self) -> bool:
        """Whether the loop checkpoints after the step just trained, if not already saved there."""
        every, step = self.options.checkpoint_every, self.state.step
        return bool(every) and step % every == 0 and step < self.total_steps \
            and self._saved_step != step

    def _track(self, result: dict[str, float], save: bool, final: bool = False) -> bool:
        """Compares an evaluation with the best so far; True when training should stop early.

        A better one becomes the best checkpoint (``save``: written now, at this step, and kept
        beside the newest ``keep_checkpoints``; else by the caller's final save). The ``final``
        evaluation (after the last step trained, planned or early) only updates the best: there
        is nothing left to stop.
        """
        st, opts = self.state, self.options
        if not self._tracks_best or self.select_metric not in result:
            return False
        value = result[self.select_metric]
        better = st.best_value is None or (value > st.best_value if self._higher
                                           else value < st.best_value)
        if better:
            st.best_step, st.best_value, st.best_valid = st.step, value, dict(result)
            st.evals_since_best = 0
            if opts.select is Selection.BEST:
                self.checkpoints.pinned = st.step
                if save and self._saved_step != st.step:
                    self.save()
            return False
        st.evals_since_best += 1
        patience = opts.early_stopping_patience
        if patience and st.evals_since_best >= patience and not final:
            st.stopped_early = True
            if self.rank == 0:
                tqdm.write(f"step {st.step}: {self.select_metric} not better than step "
                           f"{st.best_step}'s {st.best_value:.4f} for {patience} evaluations: "
                           f"stopping early")
            return True
        return False

    def _step(self, batches: Iterator[Any]) -> bool:
        """Trains one step on the next of ``batches``, plain or through the pipeline (which
        fetches ahead); False when none is left."""
        if self.pipelined is None:
            batch = next(batches, None)
            if batch is not None:
                self._train_step(batch)
            return batch is not None
        start = time.perf_counter()
        if self._first_step_at is None:  # the pipeline fetches its first batches in step()
            self._first_step_at = time.time()
        out = self.pipelined.step(batches)  # forward and backward, the next batch fetched
        if out is not None:
            self._end_step(out, start)
        return out is not None

    def _train_step(self, batch: Any) -> None:
        start = time.perf_counter()
        if self._first_step_at is None:
            self._first_step_at = time.time()
        accumulate = self.options.grad_accumulation
        # Every micro-batch's dense gradients are all-reduced (DDP's no_sync trips an internal
        # assert with TorchRec's data-parallel table lookups); the sum is the same.
        with torch.autocast(self.device_type, dtype=torch.bfloat16,
                            enabled=self.options.bf16_dense):
            out = self.task.forward(self.model, batch)
        (out.loss / accumulate if accumulate > 1 else out.loss).backward()
        self._end_step(out, start)

    def _end_step(self, out: StepOutput, start: float) -> None:
        """After a step's backward: the dense step when it ends an accumulation, the records."""
        if (self.state.step + 1) % self.options.grad_accumulation == 0:
            self._optimizer_step()
        st = self.state
        loss = out.loss.item() if out.num_examples else None  # a padding-only step: none
        if loss is not None:
            st.loss_sum += loss
            st.loss_steps += 1
        examples, padding = self.train_data.step_rows(st.batch_in_epoch)
        st.step += 1
        for logger in self.loggers if loss is not None else ():
            logger.log_train(st.step, {"loss": loss})
        st.batch_in_epoch += 1
        st.examples += examples
        st.padded_rows += padding
        st.train_time_s += time.perf_counter() - start

    def _optimizer_step(self) -> None:
        """The dense step (the fused sparse one happened in backward), then the schedule."""
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    @torch.no_grad()
    def evaluate(self, data: EpochData, max_batches: Optional[int] = None) -> dict[str, float]:
        """Task metrics plus mean ``loss`` over ``data`` (all of it, or ``max_batches``), all ranks."""
        was_training = self.model.training
        self.model.eval()
        metrics = self.task.new_metrics()
        loss_sum, count = 0.0, 0
        local = len(data) if max_batches is None else min(len(data), max_batches)
        steps = _max_over_ranks(local, self.device_type) if self.world_size > 1 else local
        last = None
        with closing_iterator(data.iter_epoch(0)) as batches:
            for _ in range(steps):
                batch = next(batches, None)
                if batch is None:  # this rank ran out: keep the collectives matched, count nothing
                    if last is None:
                        raise ValueError(f"rank {self.rank} has no evaluation batch")
                    self.task.forward(self.model, last)
                    continue
                last = batch
                out = self.task.forward(self.model, batch)
                if out.num_examples:
                    metrics.update(out, batch)
                    loss_sum += out.loss.item() * out.num_examples
                    count += out.num_examples
        if self.world_size > 1:
            # on the model's device: a CUDA run's process group is NCCL (no CPU tensors)
            totals = torch.tensor([loss_sum, float(count)], dtype=torch.float64,
                                  device=self.device_type)
            dist.all_reduce(totals)
            loss_sum, count = float(totals[0]), int(totals[1])
        self.model.train(was_training)
        return {"loss": loss_sum / max(count, 1), **metrics.compute()}

    def _evaluate_and_log(self, max_batches: Optional[int] = -1) -> dict[str, float]:
        if max_batches == -1:
            max_batches = self.options.eval_max_batches
        st = self.state
        result = self.evaluate(self.valid_data, max_batches)
        train_loss = st.loss_sum / st.loss_steps if st.loss_steps else None
        st.loss_sum, st.loss_steps = 0.0, 0
        stats = self.model_stats(self.model) if self.model_stats is not None else None
        if self.rank == 0:
            record = {"step": st.step, "examples": st.examples, "split": "valid",
                      "train_loss": train_loss, **result}
            if stats:
                record["tables"] = stats
            self.run_dir.log_metrics(record)
            for logger in self.loggers:
                logger.log_eval(st.step, "valid", {"train_loss": train_loss, **result})
            self._logged = record
            main = result.get(self.task.main_metric, math.nan)
            tqdm.write(f"step {st.step}: valid loss {result['loss']:.4f} "
                       f"{self.task.main_metric} {main:.4f}")
        return result

    def _hand_on_evaluation(self) -> None:
        """Calls ``on_evaluation`` with the evaluation record logged last, once."""
        record, self._logged = self._logged, None
        if record is not None and self.on_evaluation is not None:
            self.on_evaluation(self, record)

    def _checkpoint_state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state()},
        }

    def save(self, final: bool = False) -> None:
        """Checkpoints the run; ``final``: the end of the schedule (``--resume`` has nothing to do)."""
        if self.before_checkpoint is not None:
            self.before_checkpoint(self.model)
        info = {**asdict(self.state), "world_size": self.world_size, "finished": final,
                "total_steps": self.total_steps, "steps_per_epoch": len(self.train_data)}
        if final:
            info["final_valid"] = self._final_valid
        self._saved_final = final
        if self.lr_scheduler is not None:
            info["lr_scheduler"] = self.lr_scheduler.state_dict()
        self.checkpoints.save(self.state.step, self._checkpoint_state(), info,
                              rank_state={"torch_rng": torch.get_rng_state()})
        self._saved_step = self.state.step

    def restore(self, path: Optional[str | os.PathLike] = None) -> Optional[Path]:
        """Loads the given checkpoint (a directory or a step), or else the newest readable one.

        Without ``path``, a checkpoint that cannot be read (on any rank) is skipped with a
        one-line warning naming it, and the next older one is tried.

        Returns:
            The checkpoint loaded; None when the run has none.

        Raises:
            CheckpointError: ``path`` cannot be read, or no checkpoint of the run can.
        """
        candidates = [self.checkpoints.find(path)] if path is not None \
            else self.checkpoints.all()[::-1]
        failures: list[str] = []
        for ckpt in candidates:
            error: Optional[CheckpointError] = None
            try:
                with self.checkpoints.reading(ckpt):  # not pruned by a run training meanwhile
                    self._load_checkpoint(ckpt)
            except CheckpointMismatch:
                raise  # every checkpoint of the run is of the same model: no fallback
            except CheckpointError as e:
                error = e
            if all_ranks_ok(error is None):
                return ckpt
            failures.append(str(error) if error is not None else f"{ckpt}: unreadable on a rank")
            if path is not None:
                raise CheckpointError(failures[-1])
            if self.rank == 0:
                tqdm.write(f"warning: {failures[-1]}; trying an older checkpoint", file=sys.stderr)
        if failures:
            raise CheckpointError(f"{self.checkpoints.root}: no readable checkpoint "
                                  f"({len(failures)} tried; the newest: {failures[0]})")
        return None

    def _load_checkpoint(self, ckpt: Path) -> None:
        init_optimizer_state(self.optimizer)
        state = self._checkpoint_state()
        resharding = self.checkpoints.info(ckpt).get("world_size", self.world_size) != self.world_size
        # On another world size the planner may choose other sharding types; a table moving to or
        # from data_parallel changes which optimizer (fused or dense) holds its state.
        info = self.checkpoints.load(ckpt, state, missing_ok=("optimizer.",) if resharding else ())
        missing = info.pop("missing_keys")
        self._load_state_dicts(ckpt, state)
        rank_state = self.checkpoints.load_rank_state(ckpt)
        torch.set_rng_state(rank_state.get("torch_rng", state["rng"]["torch"]))
        saved_world = info.pop("world_size", self.world_size)
        schedule = info.pop("lr_scheduler", None)
        if self.lr_scheduler is not None and schedule is not None:
            self.lr_scheduler.load_state_dict(schedule)
            for group, lr in zip(self.lr_scheduler.optimizer.param_groups,
                                 self.lr_scheduler.get_last_lr()):
                group["lr"] = lr  # the schedule's, not the construction-time warmup value
        self._saved_final = bool(info.pop("finished", False))
        self._final_valid = info.pop("final_valid", None) if self._saved_final else None
        known = {f.name for f in dataclasses.fields(TrainState)}
        self.state = TrainState(**{k: v for k, v in info.items() if k in known})
        if self.options.select is Selection.BEST:
            self.checkpoints.pinned = self.state.best_step  # keep the best beside the newest
        if saved_world != self.world_size:
            # Resharded: the model and optimizer state were redistributed by DCP; the loader
            # position is kept in global batches, over this world's split of the data.
            self.state.batch_in_epoch = min(self.state.batch_in_epoch, len(self.train_data))
            if self.rank == 0:
                fresh = f"; {len(missing)} optimizer state entries start fresh (tables that " \
                        f"moved to or from data_parallel)" if missing else ""
                tqdm.write(f"checkpoint written by {saved_world} rank(s), loaded on "
                           f"{self.world_size}: tables resharded{fresh}", file=sys.stderr)
        self._saved_step = self.state.step

    def _load_state_dicts(self, ckpt: Path, state: dict[str, Any]) -> None:
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointMismatch(f"{ckpt}: does not fit this model: "
                                     f"{str(e).strip().splitlines()[-1]}") from None

    def warm_start(self, ckpt: Path) -> None:
        """Starts from another run's checkpoint ``ckpt``: its model and optimizer state, tables
        grown where this data set's vocabulary is larger (new rows as a fresh table's, their
        optimizer state fresh); not its step, loader position, schedule or random state."""
        init_optimizer_state(self.optimizer)
        state = self._checkpoint_state()
        del state["rng"]
        source = CheckpointManager(ckpt.parent)
        moved = source.info(ckpt).get("world_size", self.world_size) != self.world_size
        with source.reading(ckpt):
            source.load(ckpt, state, missing_ok=("optimizer.",) if moved else (), grow_rows=True)
        self._load_state_dicts(ckpt, state)

    def resume(self) -> Optional[Path]:
        """Restores the newest readable checkpoint and marks the resume in ``metrics.jsonl``.

        Returns:
            The checkpoint, or None (none yet: training starts from step 0).
        """
        if self.rank == 0:
            left = self.checkpoints.remove_leftovers()
            if left:
                tqdm.write(f"removed {left} half-written checkpoint(s) of an interrupted save")
        path = self.restore()
        if path is None:
            if self.rank == 0:
                # what a run killed before its first checkpoint logged is logged again
                self.run_dir.truncate_after(0)
                tqdm.write(f"no checkpoint in {self.checkpoints.root}: starting from step 0")
            return None
        if self.rank == 0:
            # Records a crashed run wrote after this step are not in the checkpoint: they go,
            # and the resumed run logs them again (one record per step, as uninterrupted).
            self.run_dir.truncate_after(self.state.step)
            self.run_dir.log_resume(self.state.step, str(path), self.resume_note)
            tqdm.write(f"resumed from {path} at step {self.state.step}")
        return path

    def _schedule_record(self) -> dict[str, Any]:
        """The run's schedule as trained, and which of its options were sized to the data."""
        o = self.options
        return {"epochs": o.epochs, "max_steps": o.max_steps, "eval_every": o.eval_every,
                "select": o.select.value, "early_stopping_patience": o.early_stopping_patience,
                "steps_per_epoch": len(self.train_data), "sized_to_data": self.sized_keys}

    def _write_summary(self, test: dict, valid: dict, split: str, wall_s: float,
                       selected: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        st = self.state
        stats = self.model_stats(self.model) if self.model_stats is not None else None
        summary = {
            **test,
            "split": split,
            "selected": selected or {"step": st.step, "metric": None, "value": None},
            "stopped_early": st.stopped_early,
            "dataset": self.dataset_name,
            "task": self.task.name,
            "steps": st.step,
            "examples": st.examples,
            "train_rows": self.train_data.total_rows,
            "padded_rows": st.padded_rows,
            "dropped_rows_per_epoch": self.train_data.dropped_rows,
            "train_examples_per_s": st.examples / st.train_time_s if st.train_time_s else None,
            "train_time_s": st.train_time_s,
            "wall_time_s": wall_s,
            "world_size": self.world_size,
            "peak_rss_gb_per_rank": peak_rss_gb_per_rank(),
            # process start to this process's first training step, and where it went
            **(startup_record(self._first_step_at) if self._first_step_at is not None
               else {"startup_s": None, "startup": {}}),
            "valid": valid,
            "schedule": self._schedule_record(),
            "pipeline": {"kind": self.options.pipeline.value,
                         "pipelined_modules": self.pipelined.modules if self.pipelined else []},
            **self.extra_summary,
        }
        if stats:
            summary["tables"] = stats
        if self.rank == 0:  # the summary last: a run that has one has every file
            self.run_dir.plot_curves(self.task.main_metric, title=self.dataset_name,
                                     reference=self.reference)
            self.run_dir.write_summary(summary)
        return summary


def _evaluation_steps(train: EpochData, valid: Optional[EpochData],
                      max_batches: Optional[int]) -> int:
    """The training steps whose rows number an evaluation's (0: no validation data)."""
    if valid is None:
        return 0
    return evaluation_steps(train.total_rows, len(train), valid.total_rows, len(valid),
                            max_batches)


def _max_over_ranks(value: int, device: str = "cpu") -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
