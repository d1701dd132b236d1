"""Best-checkpoint selection, early stopping, training without a validation split, dropout."""

import json
import shutil

import pytest
import torch
from torch import nn
from torchrec.optim.keyed import KeyedOptimizerWrapper

from embedtrain.config import load_config
from embedtrain.testing import random_ctr_table, tiny_ctr_dataset
from embedtrain.train.options import Selection
from embedtrain.train.run_dir import RunDir
from embedtrain.train.task import StepOutput
from embedtrain.train.trainer import Trainer, TrainerOptions


@pytest.fixture(scope="module")
def ctr_data(tmp_path_factory):
    return tiny_ctr_dataset(tmp_path_factory.mktemp("sel") / "ctr", rows=4000)


def _cfg(data, *overrides):
    return load_config("configs/dlrm_synthetic.yaml", [
        f"data.path={data}", "data.batch_size=256", "data.eval_batch_size=512",
        "data.num_workers=0", "train.progress=false", "optim.dense_lr=0.02",
        "optim.sparse_lr=0.2", *overrides])


def test_select_best_reports_the_best_validation_steps_test_metrics(ctr_data, tmp_path):
    from embedtrain.recipes import build_run

    cfg = _cfg(ctr_data, "train.epochs=4", "train.eval_every=3", "train.checkpoint_every=0",
               "train.keep_checkpoints=1", "train.select=best")
    run = build_run(cfg, tmp_path / "run")
    summary = run.trainer.fit(test_data=run.test_data)
    valid = [r for r in RunDir(tmp_path / "run").read_metrics() if r.get("split") == "valid"]
    best = max(valid, key=lambda r: r["auc"])
    assert summary["selected"] == {"step": best["step"], "metric": "auc", "value": best["auc"]}
    assert summary["valid"]["auc"] == best["auc"] and summary["steps"] == valid[-1]["step"]
    assert best["step"] != valid[-1]["step"]  # the case worth testing: the best is not the last
    # The best checkpoint is kept beside the newest (keep_checkpoints: 1) ...
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert kept == [f"step_{best['step']:08d}", f"step_{valid[-1]['step']:08d}"]
    # ... and the reported test metrics are its weights' on the test split.
    again = build_run(cfg, tmp_path / "run", record_plan=False)
    again.trainer.restore(tmp_path / "run" / "checkpoints" / kept[0])
    assert again.trainer.evaluate(again.test_data)["auc"] == pytest.approx(summary["auc"],
                                                                            abs=1e-12)
    last = build_run(cfg, tmp_path / "run", record_plan=False)
    last.trainer.restore(tmp_path / "run" / "checkpoints" / kept[1])
    assert last.trainer.evaluate(last.test_data)["auc"] != summary["auc"]


def test_training_without_a_validation_split(ctr_data, tmp_path, capsys):
    from embedtrain.recipes import build_run

    data = tmp_path / "noval"
    shutil.copytree(ctr_data, data)
    meta = json.loads((data / "metadata.json").read_text())
    del meta["splits"]["valid"]
    (data / "metadata.json").write_text(json.dumps(meta))
    run = build_run(_cfg(data, "train.max_steps=6", "train.eval_every=2",
                         "train.select=best"), tmp_path / "run")
    summary = run.trainer.fit(test_data=run.test_data)
    assert "no valid split" in capsys.readouterr().err
    assert summary["split"] == "test" and summary["auc"] > 0.5 and summary["valid"] == {}
    assert summary["selected"]["step"] == 6 and summary["selected"]["metric"] is None
    assert not [r for r in RunDir(tmp_path / "run").read_metrics() if r.get("split") == "valid"]


class _ScriptedTask:
    """A task whose validation metric follows a script: one value per evaluation."""

    name, main_metric = "scripted", "auc"

    def __init__(self, values):
        self.values = list(values)

    def forward(self, model, batch):
        loss = model(batch).pow(2).mean()
        return StepOutput(loss=loss, predictions=loss.detach().view(1), num_examples=len(batch))

    def new_metrics(self):
        task = self

        class Metrics:
            def update(self, output, batch):
                pass

            def compute(self):
                return {"auc": task.values.pop(0)}

        return Metrics()


class _Batches:
    unit, total_rows, rank_rows, dropped_rows = "rows", 40, [40], 0

    def __len__(self):
        return 10

    def iter_epoch(self, epoch, skip_batches=0):
        g = torch.Generator().manual_seed(epoch)
        batches = [torch.randn(4, 3, generator=g) for _ in range(10)]
        return iter(batches[skip_batches:])

    def step_rows(self, index):
        return 4, 0


def _scripted_trainer(tmp_path, values, epochs, patience):
    model = nn.Linear(3, 1)
    optimizer = KeyedOptimizerWrapper(dict(model.named_parameters()),
                                      lambda p: torch.optim.SGD(p, lr=0.01))
    task = _ScriptedTask(values)
    options = TrainerOptions(epochs=epochs, eval_every=2, checkpoint_every=0, progress=False,
                             select=Selection.BEST, early_stopping_patience=patience)
    return task, Trainer(task, model, optimizer, _Batches(), _Batches(), RunDir(tmp_path),
                         options)


def test_early_stopping_stops_after_patience_evaluations_without_a_better_one(tmp_path, capsys):
    # evaluations at steps 2, 4, 6, 8: best at step 4, two worse after it; then the final
    # (full) evaluation of the stopping step's weights
    task, trainer = _scripted_trainer(tmp_path, [0.60, 0.70, 0.65, 0.69, 0.69], 3, 2)
    summary = trainer.fit()
    assert summary["stopped_early"] and summary["steps"] == 8  # not the 30 scheduled
    # one line, with the step, the best step and the patience (not again at the final evaluation)
    said = [line for line in capsys.readouterr().out.splitlines() if "stopping early" in line]
    assert said == ["step 8: auc not better than step 4's 0.7000 for 2 evaluations: "
                    "stopping early"]
    assert summary["selected"] == {"step": 4, "metric": "auc", "value": 0.70}
    assert not task.values  # exactly the 4 periodic evaluations and the final one ran
    info = json.loads((tmp_path / "checkpoints" / "step_00000008" / "trainer_state.json")
                      .read_text())
    assert info["finished"] and info["best_step"] == 4


def test_patience_running_out_at_the_planned_last_step_is_not_an_early_stop(tmp_path, capsys):
    # 10 steps: evaluations at 2, 4, 6, 8 and the final one at step 10, the 4th without a
    # better value: the run ended as planned, nothing was stopped
    task, trainer = _scripted_trainer(tmp_path, [0.70, 0.60, 0.65, 0.69, 0.50], 1, 4)
    summary = trainer.fit()
    assert summary["steps"] == 10 and not summary["stopped_early"]
    assert not task.values and "stopping early" not in capsys.readouterr().out
    assert summary["selected"] == {"step": 2, "metric": "auc", "value": 0.70}


def test_select_metric_needs_a_direction(ctr_data, tmp_path):
    from embedtrain.recipes import build_run

    with pytest.raises(ValueError, match="train.select_metric: 'calibration' cannot select"):
        build_run(_cfg(ctr_data, "train.select=best", "train.select_metric=calibration"),
                  tmp_path)


def test_dropout_changes_the_forward_in_training_only():
    from embedtrain.models.dlrm import dcn, dlrm

    table, spec = random_ctr_table(rows=64, seed=0)
    dense = torch.randn(64, 3)
    from embedtrain.data.reader import ParquetBatchReader
    from embedtrain.testing import write_parquet
    import tempfile

    path = write_parquet(table, f"{tempfile.mkdtemp()}/t.parquet")
    batch = next(iter(ParquetBatchReader([path], spec, 64)))
    for build in (dlrm, dcn):
        torch.manual_seed(0)
        plain = build(spec, 8, [16, 8], [16, 8, 1])
        torch.manual_seed(0)
        dropped = build(spec, 8, [16, 8], [16, 8, 1], dropout=0.5)
        dropped.load_state_dict(plain.state_dict())  # same parameter names, same weights
        dense = batch.dense_features
        plain.eval(), dropped.eval()
        assert torch.equal(plain(dense, batch.sparse_features),
                           dropped(dense, batch.sparse_features))
        dropped.train()
        a, b = dropped(dense, batch.sparse_features), dropped(dense, batch.sparse_features)
        assert not torch.equal(a, b)
        plain.train()
        assert torch.equal(plain(dense, batch.sparse_features),
                           plain(dense, batch.sparse_features))


def test_resume_keeps_the_best_so_far(ctr_data, tmp_path):
    """A run stopped and resumed selects the same checkpoint, with the same test metrics, as
    one that ran through (the best-so-far state travels in the checkpoint)."""
    from embedtrain.recipes import build_run

    common = ("train.eval_every=3", "train.checkpoint_every=3", "train.select=best",
              "train.keep_checkpoints=1", "optim.dense_lr=0.2")  # best early, then worse
    whole = build_run(_cfg(ctr_data, "train.max_steps=18", *common), tmp_path / "whole")
    expected = whole.trainer.fit(test_data=whole.test_data)
    part = build_run(_cfg(ctr_data, "train.max_steps=9", *common), tmp_path / "part")
    part.trainer.fit(test_data=part.test_data)
    resumed = build_run(_cfg(ctr_data, "train.max_steps=18", *common), tmp_path / "part")
    resumed.trainer.resume()
    got = resumed.trainer.fit(test_data=resumed.test_data)
    assert expected["selected"]["step"] < 9  # the best is in the part before the stop
    assert got["selected"] == expected["selected"] and got["auc"] == expected["auc"]
