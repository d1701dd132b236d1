"""Typed configs: every shipped YAML loads; typos and wrong types name the file and key path."""

from pathlib import Path

import pytest

from embedtrain.config import Config, ConfigError, Interaction, SparseOptimizer, load_config, to_dict

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.model.bottom_mlp[-1] == cfg.model.embedding_dim  # the model builder requires it


def _write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def _error(path, overrides=None) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    return message


def test_values_and_overrides(tmp_path):
    path = _write(tmp_path, "model:\n  interaction: dcn\n  bottom_mlp: [8, 4]\noptim:\n  sparse_lr: 1\n")
    cfg = load_config(path, ["train.max_steps=7", "optim.sparse=sgd", "data.path=/x"])
    assert cfg.model.interaction is Interaction.DCN and cfg.model.bottom_mlp == [8, 4]
    assert cfg.optim.sparse_lr == 1.0 and isinstance(cfg.optim.sparse_lr, float)
    assert cfg.train.max_steps == 7 and cfg.optim.sparse is SparseOptimizer.SGD
    assert cfg.data.path == "/x"
    assert to_dict(cfg)["model"]["interaction"] == "dcn"


def test_unknown_key_names_path_and_suggests(tmp_path):
    message = _error(_write(tmp_path, "train:\n  batchsize: 3\n  epochs: 1\n"))
    assert "train.batchsize: unknown key" in message


def test_unknown_key_suggestion(tmp_path):
    message = _error(_write(tmp_path, "train:\n  eval_evry: 3\n"))
    assert "train.eval_evry: unknown key (did you mean 'eval_every'?)" in message


@pytest.mark.parametrize("text, expected", [
    ("train:\n  epochs: two\n", "train.epochs: expected an integer, got str 'two'"),
    ("train:\n  epochs: true\n", "train.epochs: expected an integer, got bool True"),
    ("data:\n  shuffle: 1\n", "data.shuffle: expected true or false"),
    ("model:\n  bottom_mlp: [8, x]\n", "model.bottom_mlp[1]: expected an integer"),
    ("model:\n  interaction: cross\n", "model.interaction: 'cross' is not one of dot, dcn"),
    ("model: 3\n", "model: expected a mapping"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("train: [\n", "invalid YAML"),
])
def test_bad_values(tmp_path, text, expected):
    assert expected in _error(_write(tmp_path, text))


def test_bad_override(tmp_path):
    path = _write(tmp_path, "")
    assert "train.max_step: unknown key (did you mean 'max_steps'?)" in _error(path, ["train.max_step=3"])


def test_missing_file(tmp_path):
    assert "config file not found" in _error(tmp_path / "nope.yaml")


def test_yaml_cannot_execute_code(tmp_path):
    path = _write(tmp_path, "data:\n  path: !!python/object/apply:os.system ['echo pwned']\n")
    assert "invalid YAML" in _error(path)
