"""embedtrain: training for models whose size lives in huge embedding tables and class heads.

DLRM-style CTR models, GNNs on sampled neighbourhoods and extreme classification, on TorchRec,
FBGEMM and torch.distributed, from a laptop CPU to many GPU hosts.

``import embedtrain as et`` is the library's public surface; the CLI and the YAML configs are a
layer over it, and a run started here is a run like one ``embedtrain train`` makes (its
``config.yaml`` recorded: ``embedtrain eval``, ``export``, ``plan`` and ``--resume`` work on it)::

    import embedtrain as et

    cfg = et.load_config("configs/dlrm_synthetic.yaml", ["train.max_steps=100"])
    summary = et.fit(cfg, "runs/demo")                  # train (resume=True continues it)
    metrics = et.evaluate("runs/demo", split="valid")   # a checkpoint, read-only
    et.export_run("runs/demo", "exports/demo")          # tables + torch.export program
    et.predict("exports/demo", ["data/synthetic_ctr/test"], "preds.parquet")

Names are imported when first used (``import embedtrain`` does not import torch); everything
else in the package is internal and may change.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from embedtrain import fbgemm_cpu as _fbgemm_cpu  # noqa: E402

_fbgemm_cpu.install()  # FBGEMM's CPU kernels JIT-generated (see embedtrain/fbgemm_cpu.py)

_EXPORTS = {
    # configs
    "Config": "embedtrain.config", "ClusterConfig": "embedtrain.config",
    "load_config": "embedtrain.config", "load_cluster": "embedtrain.config",
    "ConfigError": "embedtrain.config_io", "from_dict": "embedtrain.config_io",
    "dump_config": "embedtrain.config_io",
    # data sets
    "DatasetMeta": "embedtrain.features", "FeatureSpec": "embedtrain.features",
    "SparseFeature": "embedtrain.features", "load_dataset_meta": "embedtrain.features",
    # models: the tables for a data set's features (a model of one's own builds them)
    "embedding_bag_collection": "embedtrain.models.dlrm",
    # runs
    "Recipe": "embedtrain.recipes", "Run": "embedtrain.recipes",
    "build_run": "embedtrain.recipes", "fit": "embedtrain.recipes",
    "evaluate": "embedtrain.recipes", "plan_model": "embedtrain.recipes",
    "follow": "embedtrain.recipes",
    "Trainer": "embedtrain.train.trainer", "Task": "embedtrain.train.task",
    "StepOutput": "embedtrain.train.task", "num_padding": "embedtrain.data.batching",
    "RunDir": "embedtrain.train.run_dir", "RunDirError": "embedtrain.train.run_dir",
    # tasks (each a component: task: {_component_: embedtrain.tasks:Regression})
    "BinaryClassification": "embedtrain.tasks", "Regression": "embedtrain.tasks",
    # serving
    "export_run": "embedtrain.export.export", "predict": "embedtrain.export.predict",
    "add_items": "embedtrain.export.items",
    "export_delta": "embedtrain.export.delta", "apply_delta": "embedtrain.export.delta",
}

__all__ = [
    "__version__", "Config", "ClusterConfig", "load_config", "load_cluster", "ConfigError",
    "from_dict", "dump_config", "DatasetMeta", "FeatureSpec", "SparseFeature", "load_dataset_meta",
    "embedding_bag_collection",
    "Recipe", "Run", "build_run", "fit", "evaluate", "plan_model", "follow", "Trainer", "Task", "RunDir",
    "RunDirError", "StepOutput", "num_padding", "BinaryClassification", "Regression",
    "export_run", "predict", "add_items", "export_delta", "apply_delta",
]
assert set(__all__) == {"__version__", *_EXPORTS}

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from embedtrain.config import ClusterConfig, Config, load_cluster, load_config
    from embedtrain.config_io import ConfigError, dump_config, from_dict
    from embedtrain.export.export import export_run
    from embedtrain.export.delta import apply_delta, export_delta
    from embedtrain.export.items import add_items
    from embedtrain.export.predict import predict
    from embedtrain.features import DatasetMeta, FeatureSpec, SparseFeature, load_dataset_meta
    from embedtrain.models.dlrm import embedding_bag_collection
    from embedtrain.recipes import Recipe, Run, build_run, evaluate, fit, follow, plan_model
    from embedtrain.tasks import BinaryClassification, Regression
    from embedtrain.train.run_dir import RunDir, RunDirError
    from embedtrain.data.batching import num_padding
    from embedtrain.train.task import StepOutput, Task
    from embedtrain.train.trainer import Trainer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'embedtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
