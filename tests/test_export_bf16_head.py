"""A bfloat16 class head (``head.dtype: bf16``) through ``embedtrain export`` and ``predict``,
and a float8 one (``fp8``: uint8 bit patterns, 1 byte a weight) the same way.

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


# (head.dtype, the exported dtype, its bytes a weight, the .npy's bit-pattern type)
STORAGE = {"bf16": ("bfloat16", 2, np.uint16), "fp8": ("float8_e4m3fn", 1, np.uint8)}


@pytest.mark.parametrize("setting", ["bf16", "fp8"])
def test_bf16_shards_are_written_as_their_bits_and_widened_exactly_to_parquet(tmp_path, setting):
    dtype, size, bits_type = STORAGE[setting]
    w = torch.randn(300, 24, generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": w, "x": torch.zeros(3)}, checkpoint_id=ckpt, no_dist=True)
    assert checkpoint_dtypes(ckpt) == {"w": getattr(torch, dtype), "x": torch.float32}
    with NpyWriter(tmp_path / "w.npy", (300, 24), dtype) as writer:
        stream_tensor(ckpt, "w", (300, 24), writer.write)
    with NpyWriter(tmp_path / "cols.npy", (300, 24), dtype) as writer:  # column blocks
        writer.write((0, 0), w[:, :8])
        writer.write((0, 8), w[:, 8:])
    for name in ("w.npy", "cols.npy"):
        bits = np.load(tmp_path / name)
        assert bits.dtype == bits_type and _data_bytes(tmp_path / name) == 300 * 24 * size
        assert torch.equal(torch.from_numpy(bits).view(getattr(torch, dtype)).float(), w.float())
    write_parquet(tmp_path / "w.npy", tmp_path / "w.parquet")
    vectors = pq.read_table(tmp_path / "w.parquet").column("vector").to_pylist()
    assert torch.equal(torch.tensor(vectors, dtype=torch.float32), w.float())


@pytest.fixture(scope="module", params=[("bf16", "none"), ("bf16", "cosface"), ("fp8", "none")],
                ids=lambda p: "-".join(p))
def bf16_run(request, tmp_path_factory):
    """A 1-rank partial_fc run with a bfloat16 (or float8) head (rowwise_adagrad; unnormalised,
    or cosface: normalised), its head dtype, data and eval's top-5 (ids, scores) and metrics on
    the test split."""
    dtype, margin = request.param
    root = tmp_path_factory.mktemp(f"{dtype}_{margin}")
    data = tiny_xc_dataset(root / "data", rows=3000, classes=CLASSES)
    run = _train("xc_synthetic.yaml", data, root / "run", *_xc_overrides(data)[1:],
                 "head.kind=partial_fc", f"head.dtype={dtype}",
                 "head.optimizer=rowwise_adagrad",
                 f"head.margin={margin}")
    reference, metrics = _eval_outputs(run, k=5)
    return dtype, data, run, reference, metrics


def test_bf16_head_is_exported_as_bf16_and_predicts_as_eval(bf16_run, tmp_path):
    setting, data, run, (ids, scores), metrics = bf16_run
    dtype, size, bits_type = STORAGE[setting]
    result = export_run(run, tmp_path / "out", formats=["npy", "parquet"], progress=False)
    m = result.manifest
    assert m.head.dtype == dtype and m.head.bytes == CLASSES * DIM * size
    assert load_manifest(tmp_path / "out").head.dtype == dtype
    npy = tmp_path / "out" / m.head.files.npy
    bits = np.load(npy)
    assert bits.dtype == bits_type and _data_bytes(npy) == CLASSES * DIM * size
    trained = _checkpoint_tensor(Path(m.source.checkpoint), m.head.checkpoint_key, (CLASSES, DIM))
    head = torch.from_numpy(bits).view(getattr(torch, dtype))
    assert torch.equal(head.float(), trained)  # the trained values, widened exactly by DCP
    vectors = pq.read_table(tmp_path / "out" / m.head.files.parquet).column("vector")
    assert torch.equal(torch.tensor(vectors.to_pylist()), trained)
    assert result.largest_table == max(m.head.bytes, *(t.bytes for t in m.tables))

    assert ExportedModel(tmp_path / "out").head_weight.dtype == getattr(torch, dtype)
    r = predict(tmp_path / "out", [str(data / "test")], tmp_path / "p.parquet", progress=False)
    preds = pq.read_table(tmp_path / "p.parquet")
    assert torch.equal(torch.tensor(preds.column("top_ids").to_pylist()), ids.long())
    assert torch.allclose(torch.tensor(preds.column("top_scores").to_pylist()).double(), scores,
                          atol=1e-5)
    assert r.metrics["p@1"] == pytest.approx(metrics["p@1"], abs=1e-12)


@pytest.mark.parametrize("bf16_run", [("bf16", "cosface")], indirect=True)
def test_bf16_head_stays_bf16_with_int8_tables_and_needs_its_npy(bf16_run, tmp_path):
    _, data, run, _, _ = bf16_run
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
        "embedtrain export: error: --format parquet: the class head is bfloat16 (head.dtype: "
        "bf16), kept as such in its .npy (parquet holds float32 lists); use --format npy,parquet"]
