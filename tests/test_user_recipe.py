"""A user's own family without editing the package: ``recipe: package.module:Class`` in a config.

The worked example is ``examples/two_tower.py`` (a two-tower CTR model, a subclass of
``CTRRecipe``): its runs get the same run directory, ``eval``, ``plan`` and ``export`` as a
built-in recipe's, through the command line as a user runs them (from the repository root, so
that ``examples`` imports as ``python -m`` would import it).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from embedtrain.config import Config, ConfigError, load_config
from embedtrain.recipes import recipe_class, recipe_for
from embedtrain.recipes.ctr import CTRRecipe
from embedtrain.testing import tiny_ctr_dataset
from conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "examples.two_tower:TwoTowerRecipe"


def embedtrain(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    return subprocess.run([sys.executable, "-m", "embedtrain", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("towers")
    data = tiny_ctr_dataset(root / "data", rows=4000)
    config = root / "towers.yaml"
    config.write_text(f"""
recipe: {RECIPE}
data: {{path: {data}, batch_size: 256, eval_batch_size: 1024}}
model: {{embedding_dim: 8, bottom_mlp: [16, 8]}}
optim: {{dense_lr: 0.01, sparse_lr: 0.1}}
train: {{epochs: 3, eval_every: 10, checkpoint_every: 10, progress: false}}
""")
    return root, config


def test_the_config_names_the_recipe_and_its_model(tiny, monkeypatch):
    """``recipe:`` replaces the task's recipe: the two-tower model is what gets planned."""
    monkeypatch.chdir(ROOT)
    cfg = load_config(tiny[1])
    recipe = recipe_for(cfg)
    assert type(recipe).__name__ == "TwoTowerRecipe" and isinstance(recipe, CTRRecipe)
    model = recipe.planning_model()
    assert type(model).__name__ == "TwoTower"
    names = [f.name for f in recipe.dataset.features.sparse]
    assert model.features == names and model.towers.split == len(names) // 2
    assert recipe_class(Config()) is not type(recipe)  # without the key: the built-in one


@pytest.mark.parametrize("value,message", [
    ("two_tower.TwoTowerRecipe", "expected an import path package.module:Class"),
    ("no_such_package.towers:TwoTowerRecipe", "cannot import no_such_package.towers"),
    ("embedtrain.recipes.ctr:NoSuchRecipe", "no such name in"),
    ("embedtrain.config:Config", "type, not a Recipe subclass"),
])
def test_a_bad_recipe_is_one_line_naming_the_key(tiny, tmp_path, value, message):
    config = tmp_path / "bad.yaml"
    config.write_text(tiny[1].read_text().replace(RECIPE, value))
    with pytest.raises(ConfigError, match="recipe: ") as e:
        recipe_class(load_config(config))
    assert message in str(e.value)
    r = run_cli("train", str(config), "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


@pytest.mark.slow
def test_a_user_recipe_gets_run_dir_eval_plan_and_export(tiny, tmp_path):
    root, config = tiny
    run = tmp_path / "run"
    r = run_cli("train", str(config), "--out", str(run))
    assert r.returncode == 0, r.stderr
    saved = (run / "config.yaml").read_text()
    assert f"recipe: {RECIPE}" in saved  # the run directory says which recipe built it
    summary = json.loads((run / "summary.json").read_text())
    assert summary["auc"] > 0.6  # it learns (the planted click model is learnable)

    r = run_cli("eval", str(run), "--split", "test")  # the saved config rebuilds the model
    assert r.returncode == 0, r.stderr
    evaluated = json.loads(r.stdout)
    assert evaluated["auc"] == pytest.approx(summary["auc"], abs=1e-9)

    # elsewhere (a process of its own: this one imported it) the module does not import
    r = embedtrain("eval", str(run), cwd=tmp_path)
    assert r.returncode == 2 and "cannot import examples.two_tower" in r.stderr, r.stderr

    r = run_cli("plan", str(config), "--cluster", "configs/clusters/cpu-1x2.yaml",
                "--out", str(tmp_path / "plan"), "--format", "json")
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    planned = {t["name"] for t in plan["tables"]}
    sparse = json.loads((root / "data" / "metadata.json").read_text())["sparse"]
    assert planned == {f"t_{f['name']}" for f in sparse}, planned

    r = run_cli("export", str(run), "--out", str(tmp_path / "export"))
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "export" / "model.json").read_text())
    assert manifest["model"] == "TwoTower" and manifest["dense_program"] is not None
    r = run_cli("predict", str(tmp_path / "export"), "--input", str(root / "data" / "test"),
                "--out", str(tmp_path / "p.parquet"))
    assert r.returncode == 0, r.stderr
    assert "auc" in r.stdout  # the exported towers score the test split as the run did:
    printed = {line.split()[0]: float(line.split()[1]) for line in r.stdout.splitlines()
               if line.startswith("  ") and line.split()[0] == "auc"}
    assert printed["auc"] == pytest.approx(summary["auc"], abs=1e-5)


@pytest.mark.parametrize("source,message", [
    ("import os\nraise RuntimeError('needs a GPU')\n", "importing {m} raised RuntimeError: needs a GPU"),
    ("def broken(:\n    pass\n", "importing {m} raised SyntaxError"),
])
def test_a_recipe_module_that_fails_to_import_is_one_line(tiny, tmp_path, monkeypatch, source,
                                                           message):
    module = f"failing_{abs(hash(source)) % 10**8}"
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "bad.yaml"
    config.write_text(tiny[1].read_text().replace(RECIPE, f"{module}:Recipe"))
    r = run_cli("train", str(config), "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert message.format(m=module) in r.stderr and f"{module}.py, line " in r.stderr, r.stderr
