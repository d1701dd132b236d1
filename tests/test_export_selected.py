"""``embedtrain export`` without ``--checkpoint`` exports the model the run's summary describes
(issue 34): the best validation step with ``train.select: best``, whose predictions reproduce
the summary's test metric; an unfinished run (no summary) its newest checkpoint, said so."""

import json

import pyarrow.parquet as pq
import pytest
import torch

from conftest import run_cli
from embedtrain.config import dump_config, load_config
from embedtrain.export.export import export_run
from embedtrain.export.predict import predict
from embedtrain.testing import tiny_ctr_dataset


@pytest.fixture(scope="module")
def best_run(tmp_path_factory):
    from embedtrain.recipes import build_run

    root = tmp_path_factory.mktemp("selected")
    data = tiny_ctr_dataset(root / "ctr", rows=4000)
    cfg = load_config("configs/dlrm_synthetic.yaml", [
        f"data.path={data}", "data.batch_size=256", "data.eval_batch_size=512",
        "data.num_workers=0", "train.progress=false", "optim.dense_lr=0.02",
        "optim.sparse_lr=0.2", "train.epochs=4", "train.eval_every=3",
        "train.checkpoint_every=0", "train.keep_checkpoints=1", "train.select=best"])
    run = build_run(cfg, root / "run")
    dump_config(cfg, root / "run" / "config.yaml")
    summary = run.trainer.fit(test_data=run.test_data)
    return data, root / "run", summary


def test_export_takes_the_selected_step_and_predict_reproduces_the_summary(best_run, tmp_path):
    from torchmetrics.functional.classification import binary_auroc

    data, run, summary = best_run
    best = summary["selected"]["step"]
    assert best != summary["steps"]  # the case worth testing: the newest is another step
    r = run_cli("export", str(run), "--out", str(tmp_path / "out"), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"  checkpoint   step {best:,}: the step summary.json reports (train.select: best, " \
           f"valid auc {summary['selected']['value']:.4f})" in r.stdout.splitlines()
    predict(tmp_path / "out", [str(data / "test")], tmp_path / "p.parquet", progress=False)
    preds = pq.read_table(tmp_path / "p.parquet")
    auc = float(binary_auroc(torch.from_numpy(preds.column("score").to_numpy()).double(),
                             torch.from_numpy(preds.column("label").to_numpy()).long(),
                             thresholds=None))
    assert auc == pytest.approx(summary["auc"], abs=1e-5)
    asked = export_run(run, tmp_path / "last", checkpoint=summary["steps"], progress=False)
    assert asked.manifest.source.step == summary["steps"]
    assert asked.chosen == "the checkpoint asked for (--checkpoint)"


def test_a_run_without_a_summary_exports_its_newest_and_says_so(best_run, tmp_path):
    import shutil

    _, run, summary = best_run
    unfinished = tmp_path / "run"
    shutil.copytree(run, unfinished)
    (unfinished / "summary.json").unlink()
    result = export_run(unfinished, tmp_path / "out", progress=False)
    assert result.manifest.source.step == summary["steps"]
    assert result.chosen == "no summary.json (an unfinished run): its newest checkpoint"
    # a summary whose step's checkpoint is gone: one line, not another step silently
    (unfinished / "summary.json").write_text(json.dumps({"selected": {"step": 7}}))
    r = run_cli("export", str(unfinished), "--out", str(tmp_path / "gone"), "--no-progress")
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(err) == 1 and "summary.json reports step 7" in err[0], err
