"""The recipes: one per task kind, their printed metrics, and the oracle line of curves.png."""

import pytest

from embedtrain.config import Config, TaskKind, load_config
from embedtrain.recipes import RECIPES, recipe_for
from embedtrain.testing import tiny_ctr_dataset, tiny_xc_dataset
from embedtrain.train.run_dir import RunDir


def test_every_task_kind_has_a_recipe():
    assert set(RECIPES) == set(TaskKind)
    for kind in TaskKind:
        assert isinstance(recipe_for(Config(task=kind)), RECIPES[kind])


@pytest.mark.parametrize("task,summary,expected", [
    (TaskKind.CTR, {"auc": 0.78, "ne": 0.9, "logloss": 0.5, "calibration": 1.0, "ctr": 0.2,
                    "loss": 0.5, "oracle_auc": 0.79},
     ["auc", "ne", "logloss", "calibration", "loss", "oracle_auc"]),
    (TaskKind.XC, {"p@1": 0.5, "p@5": 0.2, "ndcg@5": 0.6, "recall@10": 0.7, "loss": 3.0,
                   "oracle_p_at_1": 0.96},
     ["ndcg@5", "p@1", "p@5", "recall@10", "loss", "oracle_p@1"]),
    (TaskKind.GNN_NODE, {"accuracy": 0.9, "macro_f1": 0.89, "loss": 0.3},
     ["accuracy", "macro_f1", "loss"]),
    (TaskKind.GNN_LINK, {"mrr": 0.7, "hits@1": 0.6, "hits@10": 0.9, "hits@3": 0.8, "loss": 0.6},
     ["mrr", "hits@1", "hits@3", "hits@10", "loss"]),
])
def test_each_recipe_prints_its_metrics(task, summary, expected):
    lines = recipe_for(Config(task=task)).summary_lines(summary)
    assert [line.split()[0] for line in lines] == expected
    for line in lines:
        label, value = line.split()[:2]
        key = label if label in summary else label.replace("p@1", "p_at_1")  # the oracle's
        assert float(value) == pytest.approx(summary[key], abs=1e-4)


def test_a_recipe_that_says_nothing_of_export_is_refused_in_one_line():
    """Export asks the recipe what it cannot export: the built-in ones say, a recipe without
    ``export_parts`` (a user's Recipe on the tabular data) is refused before anything is read."""
    from embedtrain.recipes.base import Recipe
    from embedtrain.recipes.tabular import TabularData

    class RatingRecipe(Recipe):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.data = TabularData(cfg)

    assert recipe_for(Config(task=TaskKind.CTR)).export_refusal() is None
    assert recipe_for(Config(task=TaskKind.XC)).export_refusal() is None  # a full head
    assert RatingRecipe(Config(task=TaskKind.CTR)).export_refusal() == (
        "task ctr: RatingRecipe does not say what to export (it has no export_parts)")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    return {"ctr": tiny_ctr_dataset(root / "ctr", rows=3000),
            "xc": tiny_xc_dataset(root / "xc", rows=3000, classes=100)}


@pytest.mark.parametrize("config,data,key", [
    ("configs/dlrm_synthetic.yaml", "ctr", "oracle_auc"),
    ("configs/xc_synthetic.yaml", "xc", "oracle_p_at_1"),
])
def test_curves_draw_the_data_sets_oracle(datasets, tmp_path, monkeypatch, config, data, key):
    """The oracle of the data set (summary.json) is the reference line of curves.png."""
    from embedtrain.recipes import build_run

    drawn = []
    original = RunDir.plot_curves

    def plot_curves(self, main_metric, title=None, reference=None):
        drawn.append((main_metric, reference))
        return original(self, main_metric, title=title, reference=reference)

    monkeypatch.setattr(RunDir, "plot_curves", plot_curves)
    cfg = load_config(config, [f"data.path={datasets[data]}", "data.batch_size=256",
                               "data.eval_batch_size=512", "data.num_workers=0",
                               "train.max_steps=4", "train.eval_every=2",
                               "train.checkpoint_every=0", "train.progress=false"])
    run = build_run(cfg, tmp_path / "run")
    summary = run.trainer.fit(test_data=run.test_data)
    assert summary[key] > 0.5
    assert drawn == [(run.trainer.task.main_metric, summary[key])]
    assert (tmp_path / "run" / "curves.png").is_file()


def test_torchs_fx_tracing_warning_is_spent_quietly(caplog):
    """TorchRec's forward calls torch.fx's is_fx_tracing(), which logs a deprecation warning
    once per process; building a run spends it without printing, and only that one."""
    import logging

    from torch.fx import _symbolic_trace as fx_trace

    from embedtrain.recipes.base import quiet_fx_tracing_warning

    fx_trace.is_fx_tracing_warning.cache_clear()
    with caplog.at_level(logging.WARNING, logger=fx_trace.log.name):
        fx_trace.is_fx_tracing()
    assert any("is_fx_tracing" in r.getMessage() for r in caplog.records)  # what users saw
    caplog.clear()
    fx_trace.is_fx_tracing_warning.cache_clear()
    with caplog.at_level(logging.WARNING, logger=fx_trace.log.name):
        quiet_fx_tracing_warning()
        fx_trace.is_fx_tracing()
    assert not caplog.records and not fx_trace.log.disabled
