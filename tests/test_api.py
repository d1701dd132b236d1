"""The public surface, ``import embedtrain as et``: every name it lists resolves, importing it
costs no torch, and a run started from Python is a run like any other (``embedtrain eval``,
``export`` and ``predict`` work on it, with the same numbers as the library's calls)."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import embedtrain as et
from conftest import run_cli
from embedtrain.config import load_run_config
from embedtrain.testing import tiny_ctr_dataset

ROOT = Path(__file__).resolve().parent.parent


def test_every_public_name_resolves_and_nothing_else():
    for name in et.__all__:
        assert getattr(et, name) is not None, name
    assert set(et.__all__) <= set(dir(et))
    with pytest.raises(AttributeError, match="has no attribute 'Trainr'"):
        et.Trainr  # noqa: B018


def test_importing_embedtrain_imports_no_torch():
    code = "import sys, embedtrain; print('torch' in sys.modules, embedtrain.__version__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.stdout.split() == ["False", et.__version__], r.stderr


@pytest.fixture(scope="module")
def python_run(tmp_path_factory):
    """A run made from Python alone: a config from a dict, ``et.fit``."""
    root = tmp_path_factory.mktemp("api")
    data = tiny_ctr_dataset(root / "data", rows=2000)
    cfg = et.from_dict(et.Config, {
        "data": {"path": str(data), "batch_size": 256, "eval_batch_size": 1024, "num_workers": 0},
        "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
        "train": {"max_steps": 6, "eval_every": 0, "checkpoint_every": 3, "progress": False},
    })
    summary = et.fit(cfg, root / "run")
    return root, data, summary


def test_a_run_from_python_records_its_config(python_run):
    root, data, summary = python_run
    saved = et.load_config(root / "run" / "config.yaml")
    assert saved.model.embedding_dim == 4 and saved.train.max_steps == 6
    assert summary["steps"] == 6


def test_a_run_from_python_is_evaluated_exported_and_served_like_any_other(python_run, tmp_path):
    root, data, summary = python_run
    r = run_cli("eval", str(root / "run"), "--split", "test")
    assert r.returncode == 0, r.stderr
    cli = json.loads(r.stdout)
    assert cli == et.evaluate(root / "run", split="test")
    assert cli["step"] == 6 and cli["auc"] == pytest.approx(summary["auc"], abs=1e-6)
    # export: example inputs from the model's tables (embedding_dim 4, not the default 16)
    et.export_run(root / "run", tmp_path / "export", progress=False)
    out = tmp_path / "preds.parquet"
    r = run_cli("predict", str(tmp_path / "export"), "--input", str(data / "test"), "--out",
                str(out))
    assert r.returncode == 0, r.stderr
    assert pq.read_metadata(out).num_rows == et.load_dataset_meta(data).split_rows["test"]


def test_a_recipe_class_is_refused_and_an_old_runs_empty_one_is_read(tmp_path):
    # components replaced recipe subclasses: naming one is one line naming the file and the
    # key; a run written before (recipe: null) still loads
    config = tmp_path / "c.yaml"
    config.write_text("recipe: my_recipes:Mine\ndata: {path: data}\n")
    for load in (et.load_config, load_run_config):
        with pytest.raises(et.ConfigError) as e:
            load(config)
        assert str(e.value).startswith(f"{config}: recipe: a recipe class is no longer read")
        assert "\n" not in str(e.value)
    config.write_text("recipe: null\ndata: {path: data}\n")
    assert load_run_config(config).data.path.endswith("data")
    assert et.load_config(config).data.path.endswith("data")


def test_export_takes_the_dense_shapes_from_the_model_not_the_config(python_run):
    # a model's tables may be of another width than model.embedding_dim says
    import dataclasses

    from embedtrain.recipes.ctr import CTRRecipe

    root, data, _ = python_run
    cfg = et.load_config(root / "run" / "config.yaml")
    recipe = CTRRecipe(cfg)
    model = recipe.planning_model()
    tables = [(c.name, c.num_embeddings, c.embedding_dim)
              for c in model.sparse_arch.embedding_bag_collection.embedding_bag_configs()]
    recipe.cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, embedding_dim=16))
    parts = recipe.export_parts(model, tables)
    assert parts.dense.example[1].shape[1:] == (len(tables), 4)


def test_a_run_from_python_has_the_cli_runs_life(tmp_path, capsys):
    # et.fit owns the run directory as `embedtrain train` does: an earlier run is refused
    # unless resumed or overwritten, a resume continues from the checkpoint, a finished one
    # says so, and a resume may not change the model
    import dataclasses

    data = tiny_ctr_dataset(tmp_path / "data", rows=1000)
    cfg = et.from_dict(et.Config, {
        "data": {"path": str(data), "batch_size": 200, "num_workers": 0},
        "model": {"embedding_dim": 4, "bottom_mlp": [8], "top_mlp": [8, 1]},
        "train": {"max_steps": 3, "eval_every": 0, "checkpoint_every": 3, "progress": False},
    })
    run = tmp_path / "run"
    assert et.fit(cfg, run)["steps"] == 3
    with pytest.raises(et.RunDirError, match="holds an earlier run; pass --resume"):
        et.fit(cfg, run)
    assert et.fit(cfg, run, resume=True) is None
    assert "finished at step 3 of 3; nothing to resume" in capsys.readouterr().err
    wider = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, embedding_dim=8))
    with pytest.raises(et.RunDirError, match="model.embedding_dim: 4 -> 8"):
        et.fit(wider, run, resume=True)
    longer = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=5))
    assert et.fit(longer, run, resume=True)["steps"] == 5
    events = [r for r in et.RunDir(run, create=False).read_records() if r.get("event")]
    assert [e["step"] for e in events] == [3]
    assert et.load_config(run / "config.yaml").train.max_steps == 5  # what the run now is
    assert et.fit(cfg, run, overwrite=True)["steps"] == 3
