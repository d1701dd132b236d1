"""Keys that only go together: refused when the config loads (one line naming the file and the
key), so that ``embedtrain tune`` refuses a space that can draw them before any trial starts,
naming the two keys; a dependent key that is harmless to ignore is ignored with a line; a
search where more than a quarter of the trials failed says so above its table and in
``best.json``."""

from __future__ import annotations

from pathlib import Path

import pytest

from embedtrain.cli.tune import results
from embedtrain.cli.tune.space import COMBINATIONS, check_space, load_space
from embedtrain.config import ConfigError, HeadConfig, HeadDtype, HeadKind, load_config

ROOT = Path(__file__).resolve().parents[1]
SEQ = str(ROOT / "configs" / "seq_synthetic.yaml")  # head: partial_fc, optimizer adagrad


def test_a_low_precision_head_without_row_state_is_refused_at_load():
    with pytest.raises(ConfigError) as e:
        load_config(SEQ, ["head.dtype=bf16"])
    assert str(e.value).startswith(f"{SEQ}: head.dtype: bf16 needs optimizer: rowwise_adagrad or "
                                   "factored_adagrad, not adagrad")
    with pytest.raises(ConfigError, match=r": head\.dtype: fp8 needs a full, partial_fc or "
                                          r"hard_negatives head, not mach$"):
        load_config(SEQ, ["head.dtype=fp8", "head.optimizer=rowwise_adagrad", "head.kind=mach"])
    cfg = load_config(SEQ, ["head.dtype=bf16", "head.optimizer=rowwise_adagrad"])
    assert cfg.head.dtype is HeadDtype.BF16
    with pytest.raises(ValueError, match="^dtype: bf16 needs optimizer"):
        HeadConfig(dtype=HeadDtype.BF16)  # a section built in Python is checked the same way


def test_sample_correction_on_a_head_that_samples_nothing_is_ignored_with_a_line(capsys,
                                                                                 monkeypatch):
    from embedtrain.recipes.heads import ClassHeads, head_arguments

    monkeypatch.delenv("RANK", raising=False)
    cfg = load_config(SEQ, ["head.kind=full"])  # the shipped config sets sample_correction
    assert cfg.head.sample_correction and not cfg.head.corrects_sample
    assert head_arguments(cfg.head)["sample_correction"] is False
    ClassHeads(cfg.head, lambda: 10, 8).check()
    assert capsys.readouterr().err == (
        "head.sample_correction: ignored: only partial_fc with loss softmax samples classes "
        "(this head: full, loss softmax)\n")
    cfg = load_config(SEQ)
    assert cfg.head.kind is HeadKind.PARTIAL_FC and cfg.head.corrects_sample
    assert head_arguments(cfg.head)["sample_correction"] is True
    ClassHeads(cfg.head, lambda: 10, 8).check()
    assert capsys.readouterr().err == ""


def test_a_space_whose_keys_cannot_be_combined_is_refused_naming_both(tmp_path):
    path = tmp_path / "space.yaml"
    # each value loads on its own (dtype bf16 with rowwise_adagrad, adagrad with fp32) ...
    path.write_text("head.dtype: {choice: [fp32, bf16]}\n"
                    "head.optimizer: {choice: [rowwise_adagrad, adagrad]}\n"
                    "optim.dense_lr: {loguniform: [0.0001, 0.01]}\n")
    base = ["head.optimizer=rowwise_adagrad"]
    with pytest.raises(ConfigError) as e:  # ... but not bf16 with adagrad
        check_space(load_space(path), SEQ, base)
    assert str(e.value).startswith(
        f"{path}: head.dtype, head.optimizer: cannot be combined: head.dtype='bf16' with "
        f"head.optimizer='adagrad': head.dtype: bf16 needs optimizer: rowwise_adagrad"), e.value
    # a space of more combinations than are loaded whole still finds the pair (pairs first)
    path.write_text("optim.warmup_steps: {randint: [0, 10]}\n"
                    "train.eval_every: {choice: [1, 2]}\n"
                    "data.batch_size: {choice: [8, 16, 32, 64, 128, 256, 512, 1024]}\n"
                    "model.dropout: {choice: [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]}\n"
                    "head.dtype: {choice: [fp32, bf16]}\n"
                    "head.optimizer: {choice: [rowwise_adagrad, adagrad]}\n")
    space = load_space(path)
    assert 2 * 2 * 8 * 8 * 2 * 2 > COMBINATIONS
    with pytest.raises(ConfigError, match="head.dtype, head.optimizer: cannot be combined"):
        check_space(space, SEQ, base)
    path.write_text("head.dtype: {choice: [fp32, bf16]}\n"
                    "optim.dense_lr: {loguniform: [0.0001, 0.01]}\n")
    assert check_space(load_space(path), SEQ, base).keys == ["head.dtype", "optim.dense_lr"]


def _outcome(i: int, status: results.TrialStatus, root: Path = Path("/runs")
             ) -> results.TrialOutcome:
    ok = status is not results.TrialStatus.ERROR
    return results.TrialOutcome(f"trial_{i:03d}", i, {"model.dropout": 0.1 * i}, status,
                                root / f"trial_{i:03d}", best_value=0.7 if ok else None,
                                step=10 if ok else None, error=None if ok else "a config error")


def test_a_search_where_more_than_a_quarter_failed_says_so(tmp_path):
    import json

    done, error = results.TrialStatus.DONE, results.TrialStatus.ERROR
    quarter = [_outcome(0, error), *(_outcome(i, done) for i in range(1, 4))]
    assert results.failed_warning(quarter) is None  # a quarter is not more than a quarter
    assert not results.format_table(quarter, ["model.dropout"], "auc").startswith("warning")
    most = [*(_outcome(i, error) for i in range(3)), _outcome(3, done)]
    table = results.format_table(most, ["model.dropout"], "auc")
    assert table.splitlines()[0] == ("warning: 3 of 4 trials failed: the best is the best of the "
                                     "other 1 (the errors are under the table)")
    best = _outcome(3, done, tmp_path)
    best.run_dir.mkdir()
    (best.run_dir / "summary.json").write_text(json.dumps(
        {"split": "test", "valid": {"auc": 0.7}, "auc": 0.69, "steps": 10}))
    record = results.write_best(tmp_path, best, "auc", True, [*most[:3], best])
    assert json.loads((tmp_path / "best.json").read_text()) == record
    assert (record["trials"], record["failed_trials"]) == (4, 3)
    assert record["warning"].startswith("warning: 3 of 4 trials failed")
    record = results.write_best(tmp_path, best, "auc", True, [_outcome(0, error), *(
        _outcome(i, done) for i in range(1, 4))])
    assert (record["trials"], record["failed_trials"]) == (4, 1) and "warning" not in record


SPACES = sorted((ROOT / "configs" / "tune").glob("*.yaml"))


@pytest.mark.parametrize("space_file", SPACES, ids=lambda p: p.name)
def test_every_shipped_space_is_valid_on_the_config_its_command_names(space_file):
    """A shipped space runs as is: the config its header's command names loads with every
    probe of its keys, alone and together (what `embedtrain tune` checks before a trial)."""
    import re

    commands = re.findall(r"embedtrain tune (\S+) --space (\S+)", space_file.read_text())
    assert commands, f"{space_file.name}: no `embedtrain tune CONFIG --space ...` in its header"
    for config, named in commands:
        assert named == f"configs/tune/{space_file.name}"
        check_space(load_space(space_file), ROOT / config, [])
