"""Metric loggers (trackers): components named in the config's ``loggers`` list.

    loggers:
      - {_component_: embedtrain.train.loggers:TensorBoard, every_n_steps: 10}
      - {_component_: embedtrain.train.loggers:MLflow, experiment: ctr}

Each is built on rank 0 with the run directory (``run_dir``) and its own keys, and told, in this
order: the run's hyperparameters (the config, flattened), the training loss every
``every_n_steps`` steps, every evaluation, the summary at the end. The run's own records
(``metrics.jsonl``, ``summary.json``) are written whatever the loggers; a user's logger is any
class with these four methods (:class:`Logger`). The packages are imported when a logger is built
(:func:`embedtrain.dependencies.import_optional`): a missing one is a one-line error naming it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

from embedtrain.components import build, check_keys, resolve
from embedtrain.config_io import Component
from embedtrain.dependencies import import_optional


class Logger(Protocol):
    def log_hparams(self, params: dict[str, Any]) -> None: ...

    def log_train(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_eval(self, step: int, split: str, metrics: dict[str, float]) -> None: ...

    def log_summary(self, summary: dict[str, Any]) -> None: ...


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and other values as they are."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics that are numbers (not the step, the split or nested records)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


def check_loggers(components: Sequence[Component]) -> None:
    """Before anything is built: each logger resolves, its keys fit its signature, and the
    packages it ``requires`` are installed (one line naming the package otherwise)."""
    import importlib.util

    from embedtrain.dependencies import MissingDependency

    for i, c in enumerate(components):
        cls = resolve(c.path, f"loggers[{i}]")
        check_keys(cls, c.keys, f"loggers[{i}]", {"run_dir"})
        for module, package in getattr(cls, "requires", ()):
            if importlib.util.find_spec(module) is None:
                raise MissingDependency(f"loggers[{i}]: {c.path} needs the package {package!r}, "
                                        f"which is not installed: pip install {package}")


def build_loggers(components: Sequence[Component], run_dir: str | os.PathLike,
                  hparams: dict[str, Any]) -> list[Logger]:
    """The config's ``loggers``, built with ``run_dir`` and their keys, told ``hparams``."""
    loggers = [build(c, f"loggers[{i}]", run_dir=run_dir) for i, c in enumerate(components)]
    for logger in loggers:
        logger.log_hparams(flat(hparams))
    return loggers


class TensorBoard:
    """TensorBoard event files in ``run_dir/tensorboard`` (or ``log_dir``): ``train/loss`` every
    ``every_n_steps`` steps, ``<split>/<metric>`` at every evaluation, the hyperparameters with
    the final metrics (the HPARAMS tab)."""

    requires = (("tensorboard", "tensorboard"),)

    def __init__(self, run_dir: str | os.PathLike, every_n_steps: int = 10,
                 log_dir: Optional[str] = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"loggers: TensorBoard every_n_steps: must be at least 1, got "
                             f"{every_n_steps}")
        import_optional("tensorboard", "tensorboard", "TensorBoard loggers")
        from torch.utils.tensorboard import SummaryWriter

        self.every = every_n_steps
        self.writer = SummaryWriter(log_dir or str(Path(run_dir) / "tensorboard"))
        self.params: dict[str, Any] = {}

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.params = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
                       for k, v in params.items() if v is not None}

    def log_train(self, step: int, metrics: dict[str, float]) -> None:
        if step % self.every == 0:
            for key, value in metrics.items():
                self.writer.add_scalar(f"train/{key}", value, step)

    def log_eval(self, step: int, split: str, metrics: dict[str, float]) -> None:
        for key, value in numbers(metrics).items():
            self.writer.add_scalar(f"{split}/{key}", value, step)
        self.writer.flush()

    def log_summary(self, summary: dict[str, Any]) -> None:
        final = {f"hparam/{k}": v for k, v in numbers(summary).items()}
        self.writer.add_hparams(self.params, final, run_name=".")
        self.writer.close()


class MLflow:
    """An MLflow run: the hyperparameters as params, the training loss every ``every_n_steps``
    steps and every evaluation as metrics, the summary's numbers, and the run's plots and
    ``summary.json`` as artifacts. ``tracking_uri`` default: an SQLite store in the run directory
    (``sqlite:///RUN/mlflow.db``, artifacts in ``RUN/mlflow-artifacts``); any MLflow URI (a
    server) works."""

    requires = (("mlflow", "mlflow-skinny"), ("sqlalchemy", "sqlalchemy"), ("alembic", "alembic"))

    def __init__(self, run_dir: str | os.PathLike, experiment: str = "embedtrain",
                 tracking_uri: Optional[str] = None, every_n_steps: int = 10,
                 run_name: Optional[str] = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"loggers: MLflow every_n_steps: must be at least 1, got "
                             f"{every_n_steps}")
        mlflow = import_optional("mlflow", "mlflow-skinny", "MLflow loggers")
        import_optional("sqlalchemy", "sqlalchemy", "MLflow loggers' SQLite stores")
        self.run_dir, self.every = Path(run_dir), every_n_steps
        self.uri = tracking_uri or f"sqlite:///{self.run_dir.resolve() / 'mlflow.db'}"
        self.client = mlflow.MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name(experiment)
        # the default store's artifacts beside it, in the run (MLflow's own default: ./mlruns)
        where = None if tracking_uri else (self.run_dir.resolve() / "mlflow-artifacts").as_uri()
        experiment_id = (found.experiment_id if found is not None
                         else self.client.create_experiment(experiment, artifact_location=where))
        self.run_id = self.client.create_run(
            experiment_id, run_name=run_name or self.run_dir.name).info.run_id

    def log_hparams(self, params: dict[str, Any]) -> None:
        for key, value in params.items():
            self.client.log_param(self.run_id, key, str(value)[:6000])

    def log_train(self, step: int, metrics: dict[str, float]) -> None:
        if step % self.every == 0:
            for key, value in metrics.items():
                self.client.log_metric(self.run_id, f"train_{key}", value, step=step)

    def log_eval(self, step: int, split: str, metrics: dict[str, float]) -> None:
        for key, value in numbers(metrics).items():
            self.client.log_metric(self.run_id, f"{split}_{key}", value, step=step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        for key, value in numbers(summary).items():
            self.client.log_metric(self.run_id, f"final_{key}", value,
                                   step=int(summary.get("steps", 0)))
        for name in ("summary.json", "curves.png"):
            if (self.run_dir / name).is_file():
                self.client.log_artifact(self.run_id, str(self.run_dir / name))
        self.client.set_terminated(self.run_id)
