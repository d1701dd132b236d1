"""A run's length, evaluation cadence, selection and early stopping sized to the data when the
config leaves them out (``TrainerOptions.sized``), and what a sized run records."""

import json
import math

import pytest

from embedtrain.config import load_config
from embedtrain.testing import tiny_ctr_dataset
from embedtrain.train import options as state
from embedtrain.train.options import Selection
from embedtrain.train.run_dir import RunDir
from embedtrain.train.state import TrainerOptions

SIZED = ["epochs", "eval_every", "select", "early_stopping_patience"]


@pytest.mark.parametrize("per_epoch", [1, 3, 4, 13, 250, 999, 1000, 4096, 100_000])
def test_sizing_follows_the_data(per_epoch):
    o = TrainerOptions().sized(per_epoch)
    steps = o.epochs * per_epoch
    small = per_epoch < state.MIN_STEPS
    # enough steps (unless that takes more than the cap's passes), and no pass more than needed
    assert steps >= state.MIN_STEPS or o.epochs == state.MAX_AUTO_EPOCHS
    assert o.epochs == 1 or (o.epochs - 1) * per_epoch < state.MIN_STEPS
    # evaluations a few times a pass (once a step at most), never further apart than the cap
    evals = per_epoch // o.eval_every
    assert o.eval_every <= state.EVAL_EVERY_CAP
    if o.eval_every < state.EVAL_EVERY_CAP:
        assert min(state.EVALS_PER_EPOCH - 1, per_epoch) <= evals <= state.EVALS_PER_EPOCH
    else:
        assert evals >= state.EVALS_PER_EPOCH
    # a small data set keeps its best evaluation and stops after a few passes without a better
    assert o.select is (Selection.BEST if small else Selection.LAST)
    if small:
        passes = o.early_stopping_patience * o.eval_every / per_epoch
        assert o.early_stopping_patience >= state.MIN_PATIENCE
        assert passes == pytest.approx(state.PATIENCE_EPOCHS, rel=0.5) \
            or o.early_stopping_patience == state.MIN_PATIENCE
    else:
        assert o.early_stopping_patience == 0


@pytest.mark.parametrize("per_epoch,eval_steps", [(4, 4), (4, 9), (13, 2), (13, 5), (40, 25),
                                                  (4096, 900), (100_000, 20_000)])
def test_an_evaluation_is_no_closer_than_the_training_rows_it_reads(per_epoch, eval_steps):
    """An evaluation reading as many rows as ``eval_steps`` training steps comes no sooner than
    those steps after the last (on 1,000 users it reads a pass's rows: once a pass, not four
    times), and still at least once a pass and within the cap; patience stays in passes."""
    base, o = TrainerOptions().sized(per_epoch), TrainerOptions().sized(per_epoch, eval_steps)
    assert o.eval_every >= base.eval_every
    assert o.eval_every >= min(eval_steps, per_epoch, state.EVAL_EVERY_CAP)
    assert o.eval_every <= min(per_epoch, state.EVAL_EVERY_CAP)
    if eval_steps <= base.eval_every:
        assert o == base
    if per_epoch < state.MIN_STEPS:
        passes = o.early_stopping_patience * o.eval_every / per_epoch
        assert passes == pytest.approx(state.PATIENCE_EPOCHS, rel=0.5) \
            or o.early_stopping_patience == state.MIN_PATIENCE


def test_an_evaluations_rows_in_training_steps():
    """The trainer sizes its cadence with the validation rows it reads (``eval_max_batches``
    of them, or all) counted in training steps of the training split's rows."""
    from embedtrain.train.trainer import _evaluation_steps

    class Split:
        def __init__(self, rows, batches):
            self.total_rows, self.batches = rows, batches

        def __len__(self):
            return self.batches

    users = Split(1000, 4)  # 1,000 users, batches of 256: a seq data set's split
    assert _evaluation_steps(users, Split(1000, 1), 10) == 4
    assert _evaluation_steps(users, Split(10_000, 10), 1) == 4  # the first batch of ten
    assert _evaluation_steps(users, Split(10_000, 10), None) == 40
    assert _evaluation_steps(Split(80_000, 40), Split(10_000, 1), 4) == 5
    assert _evaluation_steps(users, None, 10) == 0


def test_given_options_are_kept_and_max_steps_fixes_the_run():
    given = TrainerOptions(epochs=2, eval_every=0, select=Selection.LAST,
                           early_stopping_patience=0)
    assert given.sized(4) == given and given.derived == [] and given.sizing_line(given, 4) is None
    # eval_every 0 (only at the end): nothing to be patient over
    assert TrainerOptions(eval_every=0).sized(4).early_stopping_patience == 0
    # max_steps alone is the run's length, however many passes it takes; a length given (as
    # steps or passes) is trained to the end: no early stopping, the last step's metrics
    o = TrainerOptions(max_steps=30).sized(4)
    assert (o.epochs, o.select, o.early_stopping_patience) == (8, Selection.LAST, 0)
    o = TrainerOptions(epochs=3).sized(4)
    assert (o.epochs, o.eval_every, o.select, o.early_stopping_patience) == (
        3, 1, Selection.LAST, 0)
    assert TrainerOptions(max_steps=30).sized(4000).epochs == 1
    line = TrainerOptions().sizing_line(TrainerOptions().sized(13), 13)
    assert line.startswith("train: ") and "13 steps a pass, a small data set" in line
    assert all(f"train.{k}" in line for k in SIZED)


def test_auto_is_a_spelling_and_the_saved_config_says_it(tmp_path):
    from embedtrain.config_io import dump_config

    cfg = load_config("configs/dlrm_synthetic.yaml", [
        "train.epochs=auto", "train.eval_every=auto", "train.select=auto",
        "train.early_stopping_patience=auto"])
    t = cfg.train
    assert (t.epochs, t.eval_every, t.select, t.early_stopping_patience) == (None,) * 4
    dump_config(cfg, tmp_path / "config.yaml")
    saved = (tmp_path / "config.yaml").read_text()
    assert "epochs: auto" in saved and "select: auto" in saved
    assert load_config(str(tmp_path / "config.yaml")).train == t


def test_a_small_data_sets_run_is_sized_selects_its_best_and_stops_early(tmp_path, capsys):
    from embedtrain.recipes import build_run

    data = tiny_ctr_dataset(tmp_path / "ctr", rows=4000)
    cfg = load_config("configs/dlrm_synthetic.yaml", [
        f"data.path={data}", "data.batch_size=256", "data.eval_batch_size=512",
        "data.num_workers=0", "train.progress=false", "train.status_every_s=0",
        "optim.dense_lr=0.02", "optim.sparse_lr=0.2", "train.checkpoint_every=0"]
        + [f"train.{k}=auto" for k in SIZED])
    run = build_run(cfg, tmp_path / "run")
    per_epoch = len(run.trainer.train_data)
    summary = run.trainer.fit(test_data=run.test_data)
    expected = TrainerOptions().sized(per_epoch)
    record = summary["schedule"]
    assert record["sized_to_data"] == SIZED and record["steps_per_epoch"] == per_epoch
    assert (record["epochs"], record["eval_every"], record["early_stopping_patience"]) == (
        expected.epochs, expected.eval_every, expected.early_stopping_patience)
    assert record["select"] == "best"
    assert "sized to the data" in capsys.readouterr().err
    # it evaluated a few times a pass, stopped once validation stopped improving, and reports
    # the best evaluation
    valid = [r for r in RunDir(tmp_path / "run").read_metrics() if r.get("split") == "valid"]
    assert valid[0]["step"] == expected.eval_every
    assert summary["stopped_early"] and summary["steps"] < expected.epochs * per_epoch
    best = max(valid, key=lambda r: r["auc"])
    assert summary["selected"]["step"] == best["step"]
    after = [r for r in valid if r["step"] > best["step"]]
    assert len(after) >= expected.early_stopping_patience
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["schedule"] == record


def test_a_resumed_runs_length_is_sized_from_its_checkpoints_steps_a_pass():
    """`--resume` with a changed length: the steps it would end at, under the new config, with
    the pass length the checkpoint recorded (the data is not read to know it)."""
    from embedtrain.lifecycle import _resumed_total

    saved = load_config("configs/dlrm_synthetic.yaml", ["train.max_steps=40"])
    info = {"step": 40, "total_steps": 40, "steps_per_epoch": 13}

    def total(*overrides):
        return _resumed_total(info, saved, load_config("configs/dlrm_synthetic.yaml",
                                                       list(overrides)))

    assert total("train.epochs=2") == 26  # shorter than the checkpoint: refused by the caller
    assert total("train.max_steps=60") == 60
    assert total() == 13 * math.ceil(state.MIN_STEPS / 13)  # sized: at least MIN_STEPS steps
    assert total("train.epochs=5", "train.max_steps=60") == 60


def test_tunes_default_grace_is_a_pass_over_the_data():
    """ASHA judges a trial no earlier than a pass over the data, whatever the cadence (a trial
    reports its passes with each evaluation); --grace-steps counts steps."""
    from embedtrain.cli.tune.options import SearchOptions

    assert SearchOptions(trials=1).grace() == ("passes", 1)
    assert SearchOptions(trials=1).describe_grace() == "1 pass"
    assert SearchOptions(trials=1, grace_steps=30).grace() == ("step", 30)
