"""Export and batch scoring: ``embedtrain export`` / ``embedtrain predict`` against ``eval``.

The reference for per-row outputs is what ``embedtrain eval`` computes (``cli._eval``): the run
rebuilt from its ``config.yaml`` by ``build_run``, its checkpoint restored (resharded by DCP),
the split's batches through the sharded model. ``eval`` itself reports only metrics, so the
per-row logits (CTR) and top-k ids (XC) are collected from that same model here, and the
metrics are compared with ``Trainer.evaluate`` (what ``eval`` writes) or ``embedtrain eval``'s
file.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from embedtrain.cli import main
from embedtrain.config import dump_config, load_config, load_run_config
from embedtrain.data.batching import num_padding
from embedtrain.export.export import export_run
from embedtrain.export.manifest import load_manifest
from embedtrain.export.predict import predict
from embedtrain.testing import tiny_ctr_dataset, tiny_xc_dataset
from conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent
TINY = ["data.batch_size=256", "data.eval_batch_size=1024", "data.num_workers=0",
        "model.embedding_dim=8", "model.bottom_mlp=[16,8]", "model.top_mlp=[16,1]",
        "train.eval_every=0", "train.checkpoint_every=3", "train.max_steps=9",
        "train.progress=false"]


def embedtrain(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "embedtrain", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=timeout)


def _train(config: str, data: Path, out: Path, *overrides: str) -> Path:
    from embedtrain.recipes import build_run

    cfg = load_config(ROOT / "configs" / config, [f"data.path={data}", *overrides])
    run = build_run(cfg, out)
    dump_config(cfg, out / "config.yaml")
    run.trainer.fit(test_data=run.test_data)
    return out


def _eval_outputs(run_dir: Path, split: str = "test", k: int = 0):
    """Per-row logits (CTR) or top-k ids (XC, ``k``) of the run's newest checkpoint on
    ``split``, and the metrics ``embedtrain eval`` reports, from the model ``eval`` builds
    (XC: also the head's top-k scores, from its ``topk``, which evaluation ranks by)."""
    from embedtrain.recipes import build_run

    run = build_run(load_run_config(run_dir / "config.yaml"), run_dir, progress=False,
                    record_plan=False)
    assert run.trainer.restore() is not None
    model = run.trainer.model.eval()
    outputs = []
    with torch.no_grad():
        for batch in run.eval_reader(split).iter_epoch(0):
            n = batch.labels.shape[0] - num_padding(batch)
            if k:
                ids = model(batch.dense_features, batch.sparse_features, batch.labels, k)[1]
                inner = model.module
                scores = inner.head.topk(inner.encoder(batch.dense_features,
                                                       batch.sparse_features), k)[0]
                outputs.append(torch.stack([ids.double(), scores.double()])[:, :n])
            else:
                outputs.append(model(batch.dense_features, batch.sparse_features).squeeze(-1)[:n])
    return torch.cat(outputs, dim=1 if k else 0), run.trainer.evaluate(run.eval_reader(split))


def _auc(preds: pa.Table) -> float:
    from torchmetrics.functional.classification import binary_auroc

    p = torch.from_numpy(preds.column("score").to_numpy()).double()
    y = torch.from_numpy(preds.column("label").to_numpy()).long()
    return float(binary_auroc(p, y, thresholds=None))


@pytest.fixture(scope="module")
def ctr(tmp_path_factory):
    """A finished 1-rank CTR run (checkpoints at steps 3, 6, 9), its data and its eval outputs."""
    root = tmp_path_factory.mktemp("export")
    data = tiny_ctr_dataset(root / "data", rows=4000)
    run = _train("dlrm_synthetic.yaml", data, root / "run", *TINY)
    logits, metrics = _eval_outputs(run)
    return data, run, logits, metrics


@pytest.fixture(scope="module")
def ctr_export(ctr, tmp_path_factory):
    _, run, _, _ = ctr
    out = tmp_path_factory.mktemp("exported") / "fp32"
    result = export_run(run, out, formats=["npy", "parquet"], progress=False)
    return result


def _checkpoint_tensor(ckpt: Path, key: str, shape) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    t = {key: torch.zeros(shape)}
    dcp.load(t, checkpoint_id=ckpt, no_dist=True,
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    return t[key]


def test_export_writes_tables_program_and_manifest(ctr, ctr_export):
    data, run, _, _ = ctr
    out, m = ctr_export.out, load_manifest(ctr_export.out)
    assert m.task == "ctr" and m.model == "dlrm" and m.quantize == "none"
    assert m.source.step == 9 and m.source.world_size == 1
    assert m.source.checkpoint == str((run / "checkpoints" / "step_00000009").resolve())
    meta = json.loads((data / "metadata.json").read_text())
    assert [t.name for t in m.tables] == [f"t_{s['name']}" for s in meta["sparse"]]
    assert [f.name for f in m.features.dense] == meta["dense"]
    assert {f.transform for f in m.features.dense} == {"log1p"}  # applied when rows are read
    assert {f.encoding for f in m.features.sparse} == {"pre_encoded"}  # datagen ids: no vocab
    assert m.dense_program.format == "torch.export" and (out / "dense.pt2").is_file()
    assert (out / "config.yaml").read_text() == (run / "config.yaml").read_text()
    assert json.loads((out / "dataset_metadata.json").read_text()) == meta
    ckpt = Path(m.source.checkpoint)
    for t in m.tables:
        table = np.load(out / t.files.npy)
        assert table.shape == (t.rows, t.dim) and table.dtype == np.float32
        assert t.pooling == "sum" and t.bytes == t.float32_bytes == t.rows * t.dim * 4
        assert [(s.row_offset, s.rows) for s in t.shards] == [(0, t.rows)]  # 1 rank: 1 shard
        assert torch.equal(torch.from_numpy(table), _checkpoint_tensor(ckpt, t.checkpoint_key,
                                                                       table.shape))
        column = pq.read_table(out / t.files.parquet)
        assert column.schema.field("vector").type == pa.list_(pa.float32())
        assert column.column("id").to_pylist() == list(range(t.rows))
        assert np.array_equal(np.stack(column.column("vector").to_numpy(zero_copy_only=False)),
                              table)
    program = torch.export.load(out / "dense.pt2").module()
    logits = program(torch.zeros(3, len(m.features.dense)), torch.zeros(3, len(m.tables), 8))
    assert logits.shape == (3,)


def test_fp32_predictions_equal_eval(ctr, ctr_export, tmp_path):
    data, _, reference, metrics = ctr
    result = predict(ctr_export.out, [str(data / "test" / "*.parquet")], tmp_path / "p.parquet",
                     batch_size=100, progress=False)
    preds = pq.read_table(tmp_path / "p.parquet")
    assert preds.column_names == ["logit", "score", "label"] and result.rows == len(reference)
    logits = torch.from_numpy(preds.column("logit").to_numpy())
    assert (logits - reference).abs().max() <= 1e-5
    assert np.allclose(preds.column("score").to_numpy(), torch.sigmoid(logits).numpy())
    labels = pq.read_table(data / "test").column("label").to_numpy()
    assert np.array_equal(preds.column("label").to_numpy(), labels)
    assert round(_auc(preds), 5) == round(metrics["auc"], 5)
    assert round(result.metrics["auc"], 5) == round(metrics["auc"], 5)


def test_dcn_predictions_equal_eval(ctr, tmp_path):
    data = ctr[0]
    run = _train("dcn_synthetic.yaml", data, tmp_path / "run", *TINY[:3], "train.max_steps=3",
                 "train.eval_every=0", "train.progress=false")
    reference, metrics = _eval_outputs(run)
    m = export_run(run, tmp_path / "out", progress=False).manifest
    assert m.model == "dcn" and m.dense_program.format == "torch.export"
    r = predict(tmp_path / "out", [str(data / "test")], tmp_path / "p.parquet", progress=False)
    logits = pq.read_table(tmp_path / "p.parquet").column("logit").to_numpy()
    assert np.abs(logits - reference.numpy()).max() <= 1e-5
    assert round(r.metrics["auc"], 5) == round(metrics["auc"], 5)


@pytest.mark.parametrize("config, overrides, name", [
    ("dlrm_synthetic.yaml", ["model.interaction=fm"], "deepfm"),
    ("dcn_synthetic.yaml", ["model.linear=true", "optim.embedding_l2=0.001"], "dcn"),
])
def test_first_order_models_predict_as_they_evaluate(ctr, tmp_path, config, overrides, name):
    """DeepFM and DCN with the first-order tables: the l_ tables export after the embeddings
    (each feature then feeds two tables), the program takes their weights, and predictions equal
    the evaluation's logits, fp32 and int8."""
    data = ctr[0]
    run = _train(config, data, tmp_path / "run", *TINY[:3], "train.max_steps=3",
                 "train.eval_every=0", "train.progress=false", *overrides)
    reference, metrics = _eval_outputs(run)
    m = export_run(run, tmp_path / "out", progress=False).manifest
    n = len(m.features.sparse)
    assert m.model == name and [t.name[:2] for t in m.tables] == ["t_"] * n + ["l_"] * n
    assert [t.features for t in m.tables[n:]] == [t.features for t in m.tables[:n]]
    assert {t.dim for t in m.tables[n:]} == {4}
    assert [f.table for f in m.features.sparse] == [t.name for t in m.tables[:n]]
    assert any("linear" in i for i in m.dense_program.inputs)
    r = predict(tmp_path / "out", [str(data / "test")], tmp_path / "p.parquet", progress=False)
    logits = pq.read_table(tmp_path / "p.parquet").column("logit").to_numpy()
    assert np.abs(logits - reference.numpy()).max() <= 1e-5
    assert round(r.metrics["auc"], 5) == round(metrics["auc"], 5)
    export_run(run, tmp_path / "int8", quantize="int8", progress=False)
    r8 = predict(tmp_path / "int8", [str(data / "test")], tmp_path / "p8.parquet",
                 progress=False)
    assert abs(r8.metrics["auc"] - metrics["auc"]) < 0.005


def test_int8_tables_are_torchrecs_quantization(ctr, ctr_export, tmp_path):
    """int8 rows equal TorchRec's quantize_embeddings of the whole table (written block by
    block), ~(dim + 4) / (4 dim) of the float bytes; predictions keep the AUC."""
    from torchrec.inference.modules import quantize_embeddings
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    data, run, _, metrics = ctr
    out = tmp_path / "int8"
    result = export_run(run, out, quantize="int8", progress=False)
    m = result.manifest
    assert m.quantize == "int8" and all(t.dtype == "int8" for t in m.tables)
    assert m.float32_bytes == ctr_export.manifest.float32_bytes
    assert m.table_bytes == sum(t.rows * (t.dim + 4) for t in m.tables)  # 8 -> 12 bytes a row
    assert {p.name for p in (out / "tables").iterdir()} == {f"{t.name}.int8.npy"
                                                            for t in m.tables}  # no float32 left
    big = max(m.tables, key=lambda t: t.rows)
    fp32 = np.load(ctr_export.out / "tables" / f"{big.name}.npy")
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=big.name, embedding_dim=big.dim, num_embeddings=big.rows, feature_names=["f"])])
    ebc.embedding_bags[big.name].weight.data.copy_(torch.from_numpy(fp32))
    holder = torch.nn.Sequential(ebc)
    quantized = quantize_embeddings(holder, dtype=torch.qint8, inplace=True)[0]
    theirs = quantized.embedding_bags[big.name].weight.numpy()  # [scale, bias | codes | pad]
    ours = np.load(out / big.files.npy)  # [codes | scale, bias]
    assert np.array_equal(ours[:, :big.dim], theirs[:, 4:4 + big.dim])
    assert np.array_equal(ours[:, big.dim:], theirs[:, :4])
    r = predict(out, [str(data / "test")], tmp_path / "p.parquet", progress=False)
    assert abs(r.metrics["auc"] - metrics["auc"]) <= 0.002
    four = export_run(run, tmp_path / "int4", quantize="int4", progress=False).manifest
    assert four.table_bytes == sum(t.rows * (t.dim // 2 + 4) for t in four.tables)
    assert predict(tmp_path / "int4", [str(data / "test")], tmp_path / "p4.parquet",
                   progress=False).rows == r.rows


def test_predict_without_labels_and_bad_inputs(ctr, ctr_export, tmp_path, capsys):
    data, _, reference, _ = ctr
    test = pq.read_table(data / "test")
    pq.write_table(test.drop(["label"]), tmp_path / "nolabel.parquet", row_group_size=100)
    r = predict(ctr_export.out, [str(tmp_path / "nolabel.parquet")], tmp_path / "p.parquet",
                batch_size=64, progress=False)
    preds = pq.read_table(tmp_path / "p.parquet")
    assert preds.column_names == ["logit", "score"] and r.metrics == {}
    assert np.abs(preds.column("logit").to_numpy() - reference.numpy()).max() <= 1e-5

    ids = test.column("C3").to_numpy().copy()
    ids[123] = 10**9
    bad = test.set_column(test.schema.get_field_index("C3"), "C3", pa.array(ids))
    pq.write_table(bad, tmp_path / "bad.parquet")
    assert main(["predict", str(ctr_export.out), "--input", str(tmp_path / "bad.parquet"),
                 "--out", str(tmp_path / "q.parquet"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"embedtrain predict: error: {tmp_path / 'bad.parquet'}: column C3: row 123: "
                   f"id 1000000000 outside [0, 6271) (the export's table has 6,271 rows)"]
    pq.write_table(test.drop(["I2"]), tmp_path / "short.parquet")
    assert main(["predict", str(ctr_export.out), "--input", str(tmp_path / "short.parquet"),
                 "--out", str(tmp_path / "q.parquet"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "short.parquet: missing column(s): I2" in err[0]
    dense = test.column("I5").to_numpy().astype(np.float32)
    dense[77] = np.nan
    pq.write_table(test.set_column(test.schema.get_field_index("I5"), "I5", pa.array(dense)),
                   tmp_path / "nan.parquet")
    assert main(["predict", str(ctr_export.out), "--input", str(tmp_path / "nan.parquet"),
                 "--out", str(tmp_path / "q.parquet"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"embedtrain predict: error: {tmp_path / 'nan.parquet'}: column I5: row 77: "
                   "value nan is not finite (NaN or infinite)"]
    # --out: a directory, or a path under a file
    for out, says in [(tmp_path, f"{tmp_path}: is a directory; --out names a file (e.g. "
                                 f"{tmp_path / 'predictions.parquet'})"),
                      (tmp_path / "nolabel.parquet" / "p.parquet",
                       f"lies under the file {tmp_path / 'nolabel.parquet'}; choose another --out")]:
        assert main(["predict", str(ctr_export.out), "--input", str(tmp_path / "nolabel.parquet"),
                     "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    pq.write_table(test.slice(0, 0), tmp_path / "empty.parquet")  # the schema, no rows
    assert main(["predict", str(ctr_export.out), "--input", str(tmp_path / "empty.parquet"),
                 "--out", str(tmp_path / "q.parquet"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"embedtrain predict: error: {tmp_path / 'empty.parquet'}: no rows to score; "
                   f"nothing written to {tmp_path / 'q.parquet'}"]
    assert not (tmp_path / "q.parquet").exists()


@pytest.mark.parametrize("args, message", [
    (["--quantize", "int3"], "--quantize: 'int3' is not one of none, int8, int4"),
    (["--quantize", "int8", "--format", "parquet"], "--format parquet: parquet tables are float32"),
    (["--format", "csv"], "--format: unknown csv"),
    (["--checkpoint", "7"], "step_00000007: no such checkpoint (steps of"),
])
def test_export_refusals_are_one_line(ctr, tmp_path, capsys, args, message):
    _, run, _, _ = ctr
    assert main(["export", str(run), "--out", str(tmp_path / "x"), "--no-progress", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "x").exists()


def test_export_of_an_older_checkpoint_and_into_an_earlier_export(ctr, ctr_export, capsys):
    _, run, _, _ = ctr
    out = str(ctr_export.out.parent / "older")
    assert main(["export", str(run), "--out", out, "--checkpoint", "6", "--no-progress"]) == 0
    assert load_manifest(out).source.step == 6
    assert "exported step 6 of" in capsys.readouterr().out
    assert main(["export", str(run), "--out", out, "--no-progress"]) == 2
    assert "holds an export; pass --overwrite" in capsys.readouterr().err
    assert main(["export", str(run), "--out", out, "--no-progress", "--overwrite"]) == 0
    assert load_manifest(out).source.step == 9
    assert main(["export", str(run.parent / "data"), "--out", out]) == 2
    assert "not a run directory (no config.yaml)" in capsys.readouterr().err


def test_unreadable_checkpoint_is_one_line_and_leaves_no_export(ctr, tmp_path, capsys):
    import shutil

    _, run, _, _ = ctr
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shard = copy / "checkpoints" / "step_00000009" / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    assert main(["export", str(copy), "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"embedtrain export: error: {shard}: cannot read model.sparse_arch.")
    assert err[0].endswith(".weight: it ends before the shard (truncated?)")
    assert not (tmp_path / "x").exists()


def test_torchscript_where_torch_export_fails(ctr, tmp_path, monkeypatch):
    data, run, reference, _ = ctr

    def fail(*args, **kwargs):
        raise RuntimeError("unsupported op")

    monkeypatch.setattr(torch.export, "export", fail)
    m = export_run(run, tmp_path / "ts", progress=False).manifest
    assert m.dense_program.format == "torchscript" and m.dense_program.file == "dense.ts"
    monkeypatch.undo()
    predict(tmp_path / "ts", [str(data / "test")], tmp_path / "p.parquet", progress=False)
    logits = pq.read_table(tmp_path / "p.parquet").column("logit").to_numpy()
    assert np.abs(logits - reference.numpy()).max() <= 1e-5


def test_ingested_features_carry_vocabularies_and_preprocessing(tmp_path):
    """An ingested data set's export copies each feature's vocabulary next to the tables and
    records the dense preprocessing (log1p, standardisation with the training mean/std)."""
    from embedtrain.testing import tiny_ctr_tsv
    from pipelines.tabular.passes import ingest
    from pipelines.tabular.spec import load_spec

    tiny_ctr_tsv(tmp_path / "raw", rows=3000)
    data = tmp_path / "ingested"
    ingest(load_spec(ROOT / "configs" / "ingest" / "criteo_synthetic.yaml"),
           [str(tmp_path / "raw" / "*.tsv")], data, progress=False)
    run = _train("dlrm_synthetic.yaml", data, tmp_path / "run", *TINY[:-2], "train.max_steps=2",
                 "train.progress=false")
    m = export_run(run, tmp_path / "out", progress=False).manifest
    stats = json.loads((data / "metadata.json").read_text())["dense_stats"]
    i1 = m.features.dense[0]
    assert i1.transform == "none" and i1.ingest.log1p and i1.ingest.standardize
    assert i1.ingest.mean == stats["I1"]["mean"] and i1.ingest.std == stats["I1"]["std"]
    c1 = m.features.sparse[0]
    assert c1.encoding == "vocab" and c1.vocab == "vocab/C1.parquet" and c1.null_id == 0
    assert c1.min_frequency == 2 and m.tables[0].vocab == "vocab/C1.parquet"
    assert pq.read_table(tmp_path / "out" / c1.vocab) == pq.read_table(data / "vocab" /
                                                                       "C1.parquet")
    r = predict(tmp_path / "out", [str(data / "test")], tmp_path / "p.parquet", progress=False)
    assert r.rows == json.loads((data / "metadata.json").read_text())["splits"]["test"]["rows"]


@pytest.mark.slow
def test_export_memory_is_one_table_over_the_baseline(tmp_path):
    """Peak RSS while the tables are read, written, converted and quantized (VmHWM reset
    before them) stays within the largest table + 20% over the baseline: tables never meet in
    memory, each shard is written as it is read. Measured in a fresh process, as the CLI runs."""
    data = tiny_ctr_dataset(tmp_path / "data", rows=3000)
    run = _train("dlrm_synthetic.yaml", data, tmp_path / "run", *TINY[:3],
                 "model.embedding_dim=64", "model.bottom_mlp=[16,64]", "model.top_mlp=[16,1]",
                 "train.eval_every=0", "train.max_steps=2", "train.progress=false")
    child = ("import json, sys; from embedtrain.export.export import export_run; "
             "r = export_run(sys.argv[1], sys.argv[2], progress=False, **json.loads(sys.argv[3])); "
             "print(json.dumps([r.peak_over_baseline, r.largest_table, "
             "r.manifest.float32_bytes]))")
    for name, options in [("float", dict(formats=["npy", "parquet"])),
                          ("int8", dict(quantize="int8"))]:
        r = subprocess.run([sys.executable, "-c", child, str(run), str(tmp_path / name),
                            json.dumps(options)], capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        over, largest, total = json.loads(r.stdout.strip().splitlines()[-1])
        assert largest == 200_000 * 64 * 4 and total > 2.5 * largest  # C19, 49 MiB of 149
        assert over is not None and over <= 1.2 * largest, (name, over / 2**20, largest / 2**20)


def test_gnn_exports_its_node_table_and_every_nodes_outputs(tmp_path, capsys):
    """No dense program; the per-node outputs of layer-wise inference instead (their values and
    predict: tests/test_gnn_layerwise.py)."""
    from embedtrain.testing import tiny_graph_dataset

    data = tiny_graph_dataset(tmp_path / "graph", nodes=1000)
    run = _train("gnn_node.yaml", data, tmp_path / "run", "data.batch_size=64",
                 "data.num_workers=0", "train.max_steps=2", "train.eval_every=0",
                 "train.progress=false", "gnn.embedding_dim=8")
    assert main(["export", str(run), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    assert "node outputs scores [1,000, 4], embeddings [1,000, 64]" in capsys.readouterr().out
    m = load_manifest(tmp_path / "out")
    assert [t.name for t in m.tables] == ["t_node"] and m.tables[0].rows == 1000
    assert m.dense_program is None and "layer-wise full-graph inference" in m.note
    assert [a.file for a in m.nodes.arrays] == ["nodes/scores.npy", "nodes/embeddings.npy"]
    assert np.load(tmp_path / "out" / "nodes/scores.npy").shape == (1000, 4)
    with pytest.raises(ValueError, match="--top-k: a GNN export's inputs are node ids"):
        predict(tmp_path / "out", [str(tmp_path / "graph")], tmp_path / "p.parquet", top_k=3)


@pytest.mark.slow
def test_two_rank_checkpoint_exports_on_one_process(tmp_path):
    """A 2-rank run (tables row-wise over both ranks) exports on 1 process, shard by shard,
    and its predictions equal eval's (per-row logits, and `embedtrain eval`'s AUC)."""
    data = tiny_ctr_dataset(tmp_path / "data", rows=4000)
    run = tmp_path / "two"
    # row_wise asked for: the planner would place these small tables whole (tiny_table_bytes)
    r = embedtrain("train", "configs/dlrm_synthetic.yaml", "--out", str(run), "--nproc", "2",
                   *[a for s in [f"data.path={data}", *TINY, "sharding.sharding_types=[row_wise]"]
                     for a in ("--set", s)])
    assert r.returncode == 0, r.stderr[-4000:]
    r = run_cli("export", str(run), "--out", str(tmp_path / "out"), "--no-progress")
    assert r.returncode == 0, r.stderr[-4000:]
    m = load_manifest(tmp_path / "out")
    assert m.source.world_size == 2
    assert all(len(t.shards) == 2 for t in m.tables if t.rows > 1000), [t.shards for t in m.tables]
    r = run_cli("predict", str(tmp_path / "out"), "--input", str(data / "test"),
                "--out", str(tmp_path / "p.parquet"), "--no-progress")
    assert r.returncode == 0, r.stderr[-4000:]
    r = run_cli("eval", str(run), "--split", "test")
    assert r.returncode == 0, r.stderr[-4000:]
    evaluated = json.loads(r.stdout)
    reference, _ = _eval_outputs(run)
    preds = pq.read_table(tmp_path / "p.parquet")
    assert np.abs(preds.column("logit").to_numpy() - reference.numpy()).max() <= 1e-5
    assert round(_auc(preds), 5) == round(evaluated["auc"], 5)


def _xc_overrides(data: Path) -> list[str]:
    return [f"data.path={data}", "data.batch_size=256", "data.eval_batch_size=512",
            "data.num_workers=0", "xc.embedding_dim=16", "xc.mlp=[32,16]",
            "train.eval_every=0", "train.checkpoint_every=5", "train.max_steps=10",
            "train.progress=false"]


@pytest.mark.parametrize("head", [["head.kind=full"],
                                  ["head.kind=partial_fc", "head.margin=cosface"]])
def test_xc_export_topk_equals_eval(tmp_path, head):
    data = tiny_xc_dataset(tmp_path / "data", rows=3000, classes=150)
    run = _train("xc_synthetic.yaml", data, tmp_path / "run", *_xc_overrides(data)[1:], *head)
    reference, metrics = _eval_outputs(run, k=5)
    m = export_run(run, tmp_path / "out", progress=False).manifest
    assert m.head.num_classes == 150 and m.head.dim == 16 and m.head.top_k == [1, 5]
    assert m.head.normalised == ("head.margin=cosface" in head)
    r = predict(tmp_path / "out", [str(data / "test")], tmp_path / "p.parquet", progress=False)
    preds = pq.read_table(tmp_path / "p.parquet")
    assert preds.column_names == ["top_ids", "top_scores", "label"]
    ids, scores = reference
    assert torch.equal(torch.tensor(preds.column("top_ids").to_pylist()), ids.long())
    assert torch.allclose(torch.tensor(preds.column("top_scores").to_pylist()).double(), scores,
                          atol=1e-5)
    assert r.metrics["p@1"] == pytest.approx(metrics["p@1"], abs=1e-12)
    with pytest.raises(ValueError, match=r"^--top-k 151: more than the export's 150 classes"):
        predict(tmp_path / "out", [str(data / "test")], tmp_path / "q.parquet", top_k=151,
                progress=False)
    assert not (tmp_path / "q.parquet").exists()


def test_xc_replicated_heads_are_refused_in_one_line(tmp_path, capsys):
    data = tiny_xc_dataset(tmp_path / "data", rows=1000, classes=50)
    run = tmp_path / "run"
    run.mkdir()
    dump_config(load_config(ROOT / "configs" / "xc_synthetic.yaml",
                            [f"data.path={data}", "head.kind=mach"]), run / "config.yaml")
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["embedtrain export: error: head.kind: mach: export writes the sharded "
                   "heads' weights (full, partial_fc, hard_negatives); a mach head scores "
                   "classes with its own structure, which is not exported"]


@pytest.mark.slow
def test_xc_head_sharded_over_two_ranks_exports_shard_by_shard(tmp_path):
    """The class head split by rows over 2 ranks and the token table by columns (column_wise)
    export on 1 process, shard by shard, into the tensors a 1-rank load of the checkpoint gives;
    top-k equals eval's."""
    data = tiny_xc_dataset(tmp_path / "data", rows=3000, classes=151)
    run = tmp_path / "two"
    sets = [*_xc_overrides(data), "xc.embedding_dim=256",
            "sharding.tables=[{tables: [t_tokens], sharding_types: [column_wise]}]"]
    r = embedtrain("train", "configs/xc_synthetic.yaml", "--out", str(run), "--nproc", "2",
                   *[a for s in sets for a in ("--set", s)])
    assert r.returncode == 0, r.stderr[-4000:]
    r = run_cli("export", str(run), "--out", str(tmp_path / "out"), "--no-progress",
                "--format", "npy,parquet")
    assert r.returncode == 0, r.stderr[-4000:]
    m = load_manifest(tmp_path / "out")
    assert [(s.row_offset, s.rows) for s in m.head.shards] == [(0, 76), (76, 75)]
    (tokens,) = m.tables
    assert [(s.col_offset, s.cols) for s in tokens.shards] == [(0, 128), (128, 128)]
    ckpt = Path(m.source.checkpoint)
    for key, file, shape in [(m.head.checkpoint_key, m.head.files.npy, (151, 16)),
                             (tokens.checkpoint_key, tokens.files.npy, (tokens.rows, 256))]:
        exported = torch.from_numpy(np.load(tmp_path / "out" / file))
        assert torch.equal(exported, _checkpoint_tensor(ckpt, key, shape))
    reference, metrics = _eval_outputs(run, k=5)
    r = predict(tmp_path / "out", [str(data / "test")], tmp_path / "p.parquet", progress=False)
    preds = pq.read_table(tmp_path / "p.parquet")
    assert torch.equal(torch.tensor(preds.column("top_ids").to_pylist()), reference[0].long())
    assert torch.allclose(torch.tensor(preds.column("top_scores").to_pylist()).double(),
                          reference[1], atol=1e-5)
    assert r.metrics["p@1"] == pytest.approx(metrics["p@1"], abs=1e-12)
