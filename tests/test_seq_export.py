"""A seq run's export (issue 33): the item table (looked up per position), the encoder's blocks
as a dense program and the item head; ``predict``'s top-k next items equal evaluation's, with
and without ``seq.exclude_history``; what it cannot do is refused in one line."""

import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from conftest import ROOT, run_cli
from embedtrain.config import dump_config, load_config, load_run_config
from embedtrain.config_io import Component, ConfigError
from embedtrain.data.batching import num_padding
from embedtrain.datagen import SeqDataSpec, generate_seq
from embedtrain.export.export import export_run
from embedtrain.export.manifest import ExportError
from embedtrain.export.predict import predict
from embedtrain.recipes import build_run


@pytest.fixture(scope="module")
def seq_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("seq_export")
    generate_seq(SeqDataSpec(users=1500, items=300, clusters=6, max_length=10, seed=4), out,
                 progress=False)
    return out


def _train(data: Path, out: Path, *overrides: str) -> Path:
    cfg = load_config("configs/seq_synthetic.yaml", overrides=[
        f"data.path={data}", "data.batch_size=128", "data.eval_batch_size=256",
        "data.num_workers=0", "seq.dim=16", "train.eval_every=0", "train.progress=false",
        "train.max_steps=12", "train.checkpoint_every=6", *overrides])
    build_run(cfg, out).trainer.fit()
    dump_config(cfg, out / "config.yaml")
    return out


def _eval_top(run_dir: Path, k: int):
    """Evaluation's top-k item ids of every test row, and its metrics."""
    run = build_run(load_run_config(run_dir / "config.yaml"), run_dir, progress=False,
                    record_plan=False)
    assert run.trainer.restore() is not None
    model = run.trainer.model.eval()
    tops = []
    with torch.no_grad():
        for batch in run.eval_reader("test").iter_epoch(0):
            n = batch.labels.shape[0] - num_padding(batch)
            tops.append(model(batch.dense_features, batch.sparse_features, batch.labels,
                              k)[1][:n])
    return torch.cat(tops), run.trainer.evaluate(run.eval_reader("test"))


@pytest.mark.parametrize("exclude, model", [(False, "sasrec"), (True, "sasrec"),
                                            (False, "hstu")])
def test_predict_top_k_equals_eval(seq_data, tmp_path, exclude, model):
    run = _train(seq_data, tmp_path / "run", f"seq.exclude_history={str(exclude).lower()}",
                 f"seq.model={model}")
    top, metrics = _eval_top(run, 10)
    m = export_run(run, tmp_path / "out", progress=False).manifest
    assert m.model == model and m.dense_program.format == "torch.export"
    assert [(t.name, t.pooling, t.rows, t.dim) for t in m.tables] == [("t_items", "none", 301, 16)]
    assert (m.head.num_classes, m.head.dim) == (301, 16)
    r = predict(tmp_path / "out", [str(seq_data / "test")], tmp_path / "p.parquet",
                progress=False)
    preds = pq.read_table(tmp_path / "p.parquet")
    assert preds.column_names == ["top_ids", "top_scores", "target"]
    assert torch.equal(torch.tensor(preds.column("top_ids").to_pylist()), top.long())
    assert r.metrics["hr@10"] == pytest.approx(metrics["hr@10"], abs=1e-12)
    if exclude:  # no recommended item is in its own history
        rows = pq.read_table(seq_data / "test", columns=["items"]).column("items").to_pylist()
        for history, ids in zip(rows, preds.column("top_ids").to_pylist()):
            assert not set(history) & set(ids)


def test_blocks_of_ones_own_train_in_batch_and_serve_as_evaluated(seq_data, tmp_path,
                                                                monkeypatch):
    # examples/two_tower's query tower by import path, in-batch negatives with the log-q
    # correction: its keys checked, the run recorded with it, and predict (no towers.py
    # imported) gives evaluation's top-k
    import dataclasses

    monkeypatch.syspath_prepend(str(ROOT / "examples" / "two_tower"))
    cfg = load_config("configs/seq_synthetic.yaml", overrides=[
        f"data.path={seq_data}", "data.batch_size=128", "data.eval_batch_size=256",
        "data.num_workers=0", "seq.dim=16", "train.eval_every=0", "train.progress=false",
        "train.max_steps=12", "train.checkpoint_every=6", "head.sample_rate=0.0",
        "head.margin=cosface", "head.margin_value=0.0", "head.scale=20"])
    run = tmp_path / "run"
    wrong = dataclasses.replace(cfg, model=Component("towers:MeanTower", {"hiden": [8]}))
    with pytest.raises(ConfigError, match=r"^model.hiden: unknown key of towers:MeanTower "
                                          r"\(did you mean 'hidden'\?\)"):
        build_run(wrong, run)
    cfg = dataclasses.replace(cfg, model=Component("towers:MeanTower", {"hidden": [8]}))
    build_run(cfg, run).fit()
    assert load_run_config(run / "config.yaml").model == cfg.model
    top, metrics = _eval_top(run, 10)
    m = export_run(run, tmp_path / "out", progress=False).manifest
    assert m.model == "MeanTower" and m.head.normalised and m.head.scale == 20
    monkeypatch.delitem(sys.modules, "towers")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "two_tower" not in p])
    r = predict(tmp_path / "out", [str(seq_data / "test")], tmp_path / "p.parquet",
                progress=False)
    assert "towers" not in sys.modules
    preds = pq.read_table(tmp_path / "p.parquet")
    assert torch.equal(torch.tensor(preds.column("top_ids").to_pylist()), top.long())
    assert r.metrics["hr@10"] == pytest.approx(metrics["hr@10"], abs=1e-12)


def test_what_a_seq_export_cannot_do_is_refused_in_one_line(seq_data, tmp_path):
    run = _train(seq_data, tmp_path / "run", "train.max_steps=6")
    with pytest.raises(ExportError, match=r"^--quantize int8: t_items is looked up per position"):
        export_run(run, tmp_path / "q", quantize="int8", progress=False)
    assert not (tmp_path / "q").exists()
    export_run(run, tmp_path / "out", progress=False)
    r = run_cli("predict", str(tmp_path / "out"), "--input", str(seq_data / "test"), "--raw",
                "--out", str(tmp_path / "p.parquet"), "--no-progress")
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "a sequence data set" in err[0], err


def test_an_event_csv_ingested_trains_and_exports_with_its_item_vocabulary(tmp_path):
    """The README's worked example in small: a raw event CSV (string item ids) -> ingest ->
    train -> export: the history feature and the head name the item vocabulary, whose ids the
    predictions are, so a served top-k maps back to the log's own item ids."""
    import json
    import random

    import pyarrow.parquet as pq

    from pipelines import run_ingest

    rnd = random.Random(0)
    lines = ["user,item,timestamp"] + [
        f"u{rnd.randrange(80)},sku-{rnd.randrange(40)},{t}" for t in range(1500)]
    (tmp_path / "events.csv").write_text("\n".join(lines) + "\n")
    run_ingest("configs/ingest/sequence_events.yaml", [str(tmp_path / "events.csv")],
               tmp_path / "data", overrides=["max_length=8", "min_length=3"], progress=False)
    run = _train(tmp_path / "data", tmp_path / "run", "train.max_steps=4",
                 "train.checkpoint_every=4", "data.batch_size=16")
    m = export_run(run, tmp_path / "out", progress=False).manifest
    (items,) = m.features.sparse
    assert items.encoding == "vocab" and items.vocab == m.head.vocab == "vocab/item.parquet"
    vocab = pq.read_table(tmp_path / "out" / m.head.vocab).to_pydict()
    value = dict(zip(vocab["id"], vocab["value"]))
    assert sorted(value) == list(range(1, m.head.num_classes))  # 0: padding, no item
    predict(tmp_path / "out", [str(tmp_path / "data" / "test")], tmp_path / "p.parquet",
            progress=False)
    top = pq.read_table(tmp_path / "p.parquet").column("top_ids").to_pylist()
    assert all(value[i].startswith("sku-") for ids in top for i in ids)  # never 0
    assert json.loads((tmp_path / "out" / "model.json").read_text())["model"] == "sasrec"
