"""A bfloat16 class head (``xc.head.dtype: bf16``) through ``embedtrain export`` and ``predict``.

The head is written as it was trained: ``head/weight.npy`` holds the bfloat16 bit patterns as
uint16 (2 bytes a weight, ``head.dtype: bfloat16`` in ``model.json``), read from the checkpoint
shard by shard and never widened to float32; ``predict`` views its memory map as
``torch.bfloat16`` and scores it block by block. The reference is ``embedtrain eval``'s model,
as in ``tests/test_export.py`` (whose helpers train and evaluate here too).
"""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed.checkpoint as dcp

from embedtrain.export.export import export_run
from embedtrain.export.manifest import load_manifest
from embedtrain.export.predict import ExportedModel, predict
from embedtrain.export.tables import NpyWriter, checkpoint_dtypes, stream_tensor, write_parquet
from embedtrain.testing import tiny_xc_dataset
from conftest import run_cli
from test_export import _checkpoint_tensor, _eval_outputs, _train, _xc_overrides

CLASSES, DIM = 150, 16


def _data_bytes(npy: Path) -> int:
    """Bytes of an ``.npy``'s data (the file less its header)."""
    return npy.stat().st_size - np.load(npy, mmap_mode="r").offset


def test_bf16_shards_are_written_as_their_bits_and_widened_exactly_to_parquet(tmp_path):
    w = torch.randn(300, 24, generator=torch.Generator().manual_seed(0)).bfloat16()
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": w, "x": torch.zeros(3)}, checkpoint_id=ckpt, no_dist=True)
    assert checkpoint_dtypes(ckpt) == {"w": torch.bfloat16, "x": torch.float32}
    with NpyWriter(tmp_path / "w.npy", (300, 24), "bfloat16") as writer:
        stream_tensor(ckpt, "w", (300, 24), writer.write)
    with NpyWriter(tmp_path / "cols.npy", (300, 24), "bfloat16") as writer:  # column blocks
        writer.write((0, 0), w[:, :8])
        writer.write((0, 8), w[:, 8:])
    for name in ("w.npy", "cols.npy"):
        bits = np.load(tmp_path / name)
        assert bits.dtype == np.uint16 and _data_bytes(tmp_path / name) == 300 * 24 * 2
        assert torch.equal(torch.from_numpy(bits).view(torch.bfloat16), w)
    write_parquet(tmp_path / "w.npy", tmp_path / "w.parquet")
    vectors = pq.read_table(tmp_path / "w.parquet").column("vector").to_pylist()
    assert torch.equal(torch.tensor(vectors, dtype=torch.float32), w.float())


@pytest.fixture(scope="module", params=["none", "cosface"])
def bf16_run(request, tmp_path_factory):
    """A 1-rank partial_fc run with a bfloat16 head (rowwise_adagrad; unnormalised, or cosface:
    normalised), its data and eval's top-5 (ids, scores) and metrics on the test split."""
    root = tmp_path_factory.mktemp(f"bf16_{request.param}")
    data = tiny_xc_dataset(root / "data", rows=3000, classes=CLASSES)
    run = _train("xc_synthetic.yaml", data, root / "run", *_xc_overrides(data)[1:],
                 "xc.head.kind=partial_fc", "xc.head.dtype=bf16",
                 "xc.head.optimizer=rowwise_adagrad",
                 f"xc.head.margin={request.param}")
    reference, metrics = _eval_outputs(run, k=5)
    return data, run, reference, metrics


def test_bf16_head_is_exported_as_bf16_and_predicts_as_eval(bf16_run, tmp_path):
    data, run, (ids, scores), metrics = bf16_run
    result = export_run(run, tmp_path / "out", formats=["npy", "parquet"], progress=False)
    m = result.manifest
    assert m.head.dtype == "bfloat16" and m.head.bytes == CLASSES * DIM * 2
    assert load_manifest(tmp_path / "out").head.dtype == "bfloat16"
    npy = tmp_path / "out" / m.head.files.npy
    bits = np.load(npy)
    assert bits.dtype == np.uint16 and _data_bytes(npy) == CLASSES * DIM * 2
    trained = _checkpoint_tensor(Path(m.source.checkpoint), m.head.checkpoint_key, (CLASSES, DIM))
    head = torch.from_numpy(bits).view(torch.bfloat16)
    assert torch.equal(head.float(), trained)  # the trained bf16 values, widened exactly by DCP
    vectors = pq.read_table(tmp_path / "out" / m.head.files.parquet).column("vector")
    assert torch.equal(torch.tensor(vectors.to_pylist()), trained)
    assert result.largest_table == max(m.head.bytes, *(t.bytes for t in m.tables))

    assert ExportedModel(tmp_path / "out").head_weight.dtype == torch.bfloat16
    r = predict(tmp_path / "out", [str(data / "test")], tmp_path / "p.parquet", progress=False)
    preds = pq.read_table(tmp_path / "p.parquet")
    assert torch.equal(torch.tensor(preds.column("top_ids").to_pylist()), ids.long())
    assert torch.allclose(torch.tensor(preds.column("top_scores").to_pylist()).double(), scores,
                          atol=1e-5)
    assert r.metrics["p@1"] == pytest.approx(metrics["p@1"], abs=1e-12)


@pytest.mark.parametrize("bf16_run", ["cosface"], indirect=True)
def test_bf16_head_stays_bf16_with_int8_tables_and_needs_its_npy(bf16_run, tmp_path):
    data, run, _, _ = bf16_run
    plain = export_run(run, tmp_path / "plain", progress=False).manifest
    m = export_run(run, tmp_path / "int8", quantize="int8", progress=False).manifest
    assert [t.dtype for t in m.tables] == ["int8"] and m.head.dtype == "bfloat16"
    assert (tmp_path / "int8" / m.head.files.npy).read_bytes() == \
        (tmp_path / "plain" / plain.head.files.npy).read_bytes()
    predict(tmp_path / "int8", [str(data / "test")], tmp_path / "p.parquet", progress=False)
    assert pq.read_table(tmp_path / "p.parquet").column("top_ids").type.value_type == pa.int64()

    r = run_cli("export", str(run), "--out", str(tmp_path / "pq"), "--format", "parquet",
                "--no-progress")
    assert r.returncode == 2 and not (tmp_path / "pq").exists()
    assert r.stderr.strip().splitlines() == [
        "embedtrain export: error: --format parquet: the class head is bfloat16 (xc.head.dtype: "
        "bf16), kept as such in its .npy (parquet holds float32 lists); use --format npy,parquet"]
