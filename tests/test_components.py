"""A model of one's own by import path, with its own keys: ``model: {_component_: mod:Name, ...}``
trains, evaluates and resumes through the same machinery as the built-in DLRM (planned, sharded
by DMP, fused sparse optimizer, DCP checkpoints, the run directory), its keys checked against its
signature before anything is built, each mistake one line naming the key."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_cli
from embedtrain.components import build, check_keys
from embedtrain.config import load_config, load_run_config
from embedtrain.config_io import Component, ConfigError
from embedtrain.testing import tiny_ctr_dataset

# the user's model: examples/custom_interaction's, as a module of the user's own folder
GATED = (ROOT / "examples" / "custom_interaction" / "gated.py").read_text()


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """A folder holding the user's module (``gated_user.py``) and a config naming it."""
    root = tmp_path_factory.mktemp("component")
    (root / "gated_user.py").write_text(GATED)
    data = tiny_ctr_dataset(root / "data", rows=2000)
    config = root / "gated.yaml"
    config.write_text(f"""
data: {{path: {data}, batch_size: 256, eval_batch_size: 1024, num_workers: 0}}
model: {{_component_: gated_user:GatedDLRM, embedding_dim: 4, hidden: [8, 8]}}
train: {{max_steps: 6, eval_every: 3, checkpoint_every: 3, progress: false}}
""")
    return root, config


def test_a_model_by_import_path_trains_evaluates_and_resumes(user, tmp_path):
    root, config = user
    run = tmp_path / "run"
    r = run_cli("train", str(config), "--out", str(run), "--set", "train.max_steps=3", cwd=root)
    assert r.returncode == 0, r.stderr
    saved = load_run_config(run / "config.yaml")  # the component and its keys recorded
    assert saved.model == Component("gated_user:GatedDLRM", {"embedding_dim": 4, "hidden": [8, 8]})
    r = run_cli("train", str(config), "--out", str(run), "--resume", cwd=root)
    assert r.returncode == 0, r.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and 0 < summary["auc"] < 1
    r = run_cli("eval", str(run), "--split", "test", cwd=root)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["auc"] == pytest.approx(summary["auc"], abs=1e-6)
    # its keys are its own: --set reaches them; a resume that changes one is refused
    r = run_cli("train", str(config), "--out", str(run), "--resume", "--set", "model.hidden=[16]",
                "--set", "train.max_steps=9", cwd=root)
    assert r.returncode == 2 and "in model.hidden: [8, 8] -> [16];" in r.stderr, r.stderr
    # exported (its forward_pooled the dense program) and served without its code: predict
    # scores the test split with the AUC evaluation gave
    r = run_cli("export", str(run), "--out", str(tmp_path / "export"), cwd=root)
    assert r.returncode == 0, r.stderr
    data = load_run_config(run / "config.yaml").data.path
    r = subprocess.run([sys.executable, "-m", "embedtrain", "predict", str(tmp_path / "export"),
                        "--input", f"{data}/test", "--out", str(tmp_path / "p.parquet")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr  # gated_user.py is not importable from tmp_path
    auc = float(next(line.split()[-1] for line in r.stdout.splitlines() + r.stderr.splitlines()
                     if line.strip().startswith("auc")))
    assert auc == pytest.approx(summary["auc"], abs=1e-4)


def test_a_component_without_forward_pooled_is_refused_at_export(user, tmp_path):
    root, config = user
    (tmp_path / "plain_user.py").write_text(GATED.replace("def forward_pooled", "def _pooled")
                                            .replace("self.forward_pooled(", "self._pooled("))
    cfg = tmp_path / "plain.yaml"
    cfg.write_text(config.read_text().replace("gated_user:", "plain_user:"))
    run = tmp_path / "run"
    assert run_cli("train", str(cfg), "--out", str(run), cwd=tmp_path).returncode == 0
    r = run_cli("export", str(run), "--out", str(tmp_path / "export"), cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().endswith(
        "model: plain_user:GatedDLRM: has no forward_pooled(dense, pooled) (the model after "
        "its tables' lookups), which export writes as the dense program"), r.stderr
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("keys, message", [
    ("hiden: [8]", "model.hiden: unknown key of gated_user:GatedDLRM (did you mean 'hidden'?)"),
    ("hidden: abc", "model.hidden: expected a list, got str 'abc'"),
    ("hidden: [8, x]", "model.hidden[1]: expected an integer, got str 'x'"),
    ("embedding_dim: 4.5", "model.embedding_dim: expected an integer, got float 4.5"),
    ("features: 3", "model.features: supplied by embedtrain (the data set's), not a key"),
])
def test_a_components_keys_are_checked_against_its_signature(user, tmp_path, keys, message):
    root, config = user
    bad = tmp_path / "bad.yaml"
    bad.write_text(config.read_text().replace("embedding_dim: 4, hidden: [8, 8]", keys))
    r = run_cli("train", str(bad), "--out", str(tmp_path / "run"), cwd=root)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"embedtrain train: error: {message}"), r.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("path, message", [
    ("no_such_module:Model", "model: no_such_module:Model: cannot import no_such_module"),
    ("gated_user:Nope", "model: gated_user:Nope: no such name in"),
    ("gated_user", "model._component_: expected an import path package.module:Name, got str"),
])
def test_a_component_that_does_not_resolve_is_one_line(user, tmp_path, path, message):
    root, config = user
    bad = tmp_path / "bad.yaml"
    bad.write_text(config.read_text().replace("gated_user:GatedDLRM", path))
    r = run_cli("train", str(bad), "--out", str(tmp_path / "run"), cwd=root)
    assert r.returncode == 2 and message in r.stderr.strip().splitlines()[-1], r.stderr
    assert "Traceback" not in r.stderr


def test_keys_of_a_plain_function_and_a_required_one():
    def tower(features, dim: int, layers: list[int] = (), scale: float = 1.0):
        return features, dim, layers, scale

    assert check_keys(tower, {"dim": 8, "scale": 2}, "model", {"features"}) == {
        "dim": 8, "scale": 2.0}
    with pytest.raises(ConfigError, match=r"^model.dim: missing \(a required argument of "):
        check_keys(tower, {}, "model", {"features"})
    assert build(Component("builtins:dict", {"a": 1}), "model") == {"a": 1}  # **kwargs: any key


def test_the_built_in_model_keys_stay_a_schema(user):
    # without _component_, model: is the built-in DLRM's section, checked as before
    _, config = user
    text = config.read_text().replace("_component_: gated_user:GatedDLRM, ", "")
    path = config.parent / "builtin.yaml"
    path.write_text(text.replace("hidden: [8, 8]", "bottom_mlp: [8]"))
    assert load_config(path).model.bottom_mlp == [8]
    path.write_text(text)
    with pytest.raises(ConfigError, match="model.hidden: unknown key"):
        load_config(path)
