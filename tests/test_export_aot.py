"""``embedtrain export --aot``: the dense program as an AOTInductor package, scored by
``ExportedModel(program="aot")`` and by ``examples/serve_aot.py`` (torch, fbgemm_gpu and numpy
only), both against the ``torch.export`` program's scores.

AOTInductor compiles take tens of seconds: two, in module fixtures (an fp32 and an int8 export
of one tiny CTR run).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from embedtrain.cli import main
from embedtrain.config import dump_config, load_config
from embedtrain.data.batching import Rows, SparseLayout, is_list_type, to_batch
from embedtrain.export.export import export_run
from embedtrain.export.manifest import ExportError, load_manifest
from embedtrain.export.predict import ExportedModel
from embedtrain.testing import tiny_ctr_dataset
from conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "serve_aot.py"
TINY = ["data.batch_size=256", "data.eval_batch_size=1024", "data.num_workers=0",
        "model.embedding_dim=8", "model.bottom_mlp=[16,8]", "model.top_mlp=[16,1]",
        "train.eval_every=0", "train.checkpoint_every=3", "train.max_steps=3",
        "train.progress=false"]

# Runs the example (argv: script, then a JSON list of argument lists) in a process where
# embedtrain and torchrec cannot be imported (embedtrain is installed: a finder refuses them).
WITHOUT_EMBEDTRAIN = """
import json, runpy, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("embedtrain", "torchrec"):
            raise ImportError(f"{name}: not importable here")
sys.meta_path.insert(0, Refuse())
for name in ("embedtrain", "torchrec"):
    try:
        __import__(name)
        raise SystemExit(f"{name} imported")
    except ImportError:
        pass
script, runs = sys.argv[1], json.loads(sys.argv[2])
for args in runs:
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    print(f"exit {code}", flush=True)
assert not {m.partition(".")[0] for m in sys.modules} & {"embedtrain", "torchrec"}
"""


def _train(data: Path, out: Path) -> Path:
    from embedtrain.recipes import build_run

    cfg = load_config(ROOT / "configs" / "dlrm_synthetic.yaml", [f"data.path={data}", *TINY])
    run = build_run(cfg, out)
    dump_config(cfg, out / "config.yaml")
    run.trainer.fit(test_data=run.test_data)
    return out


def _logits(model: ExportedModel, rows: pa.Table) -> torch.Tensor:
    """``model``'s logits of ``rows`` (the data set's layout), converted as predict does."""
    spec, rows = model.spec, rows.combine_chunks()
    layout = SparseLayout(tuple(is_list_type(rows.schema.field(f.name).type)
                                for f in spec.sparse))
    batch = to_batch([(Rows.from_table(rows, spec, layout), 0, rows.num_rows)], layout,
                     spec.sparse_names)
    return model.outputs(batch.dense_features, batch.sparse_features)


@pytest.fixture(scope="module")
def ctr(tmp_path_factory):
    """A tiny CTR run, its test split as one file, and its fp32 export with --aot."""
    root = tmp_path_factory.mktemp("aot")
    data = tiny_ctr_dataset(root / "data", rows=4000)
    run = _train(data, root / "run")
    pq.write_table(pq.read_table(data / "test"), root / "rows.parquet")
    export_run(run, root / "fp32", aot=True, progress=False)
    return run, root / "rows.parquet", root / "fp32"


@pytest.fixture(scope="module")
def int8(ctr):
    """An int8 export with --aot, through the CLI (progress on): its stdout and stderr."""
    run, _, fp32 = ctr
    r = run_cli("export", str(run), "--out", str(fp32.parent / "int8"), "--quantize", "int8",
                "--aot")
    assert r.returncode == 0, r.stderr[-3000:]
    return fp32.parent / "int8", r


def test_aot_package_scores_as_the_torch_export_program(ctr):
    _, rows, out = ctr
    m = load_manifest(out)
    assert m.dense_program.aot == "dense.aoti.pt2" and (out / "dense.aoti.pt2").is_file()
    assert json.loads((out / "model.json").read_text())["dense_program"]["aot"] == \
        "dense.aoti.pt2"
    program, aot = ExportedModel(out), ExportedModel(out, program="aot")
    table = pq.read_table(rows)
    reference = _logits(program, table)
    assert reference.shape == (table.num_rows,) and reference.std() > 0
    assert (_logits(aot, table) - reference).abs().max() <= 1e-5
    assert (_logits(aot, table.slice(7, 1)) - reference[7:8]).abs().max() <= 1e-5  # 1 row
    # 1024 rows, and inputs that are not contiguous (the kernels' strides are compiled in)
    dense, pooled = torch.randn(13, 1024).t(), torch.randn(1024, 8, 26).transpose(1, 2)
    with torch.no_grad():
        assert (aot.program(dense, pooled) - program.program(dense, pooled)).abs().max() <= 1e-5


def test_example_scores_without_embedtrain_or_torchrec(ctr, int8, tmp_path):
    """The example, in a process that cannot import embedtrain or TorchRec, scores the rows as
    ExportedModel does: fp32 tables (sum pooling), the same with mean pooling, int8 rows; an
    export without a package is refused in one line."""
    _, rows, fp32 = ctr
    out8, export_cli = int8
    assert "compiling the dense program with AOTInductor" in export_cli.stderr
    assert "  AOT package  dense.aoti.pt2 (AOTInductor" in export_cli.stdout
    mean = tmp_path / "mean"
    shutil.copytree(fp32, mean)
    manifest = json.loads((mean / "model.json").read_text())
    for t in manifest["tables"]:
        t["pooling"] = "mean"
    (mean / "model.json").write_text(json.dumps(manifest))
    without = tmp_path / "without"
    shutil.copytree(fp32, without)
    manifest["dense_program"]["aot"] = None
    (without / "model.json").write_text(json.dumps(manifest))
    exports = [fp32, mean, out8, without]
    runs = [[str(e), str(rows), "--out", str(tmp_path / f"{i}.npy")]
            for i, e in enumerate(exports)]
    r = subprocess.run([sys.executable, "-c", WITHOUT_EMBEDTRAIN, str(EXAMPLE), json.dumps(runs)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert [line for line in r.stdout.splitlines() if line.startswith("exit")] == \
        ["exit 0"] * 3 + ["exit 2"], r.stdout + r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == \
        f"serve_aot: error: {without}: no AOTInductor package; export with --aot"
    table = pq.read_table(rows)
    assert f"scored {table.num_rows} rows with {out8} (dlrm, int8 tables" in r.stdout
    for i, export in enumerate(exports[:3]):
        saved = np.load(tmp_path / f"{i}.npy")
        reference = _logits(ExportedModel(export), table).numpy()
        assert saved.shape == (table.num_rows, 2)
        assert np.abs(saved[:, 0] - reference).max() <= 1e-5, export
        assert np.allclose(saved[:, 1], 1 / (1 + np.exp(-saved[:, 0])), atol=1e-6)


def test_aot_without_a_torch_export_program_is_one_line(ctr, tmp_path, capsys, monkeypatch):
    run = ctr[0]

    def fail(*args, **kwargs):
        raise RuntimeError("unsupported op")

    monkeypatch.setattr(torch.export, "export", fail)  # the program falls back to TorchScript
    assert main(["export", str(run), "--out", str(tmp_path / "x"), "--aot",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["embedtrain export: error: --aot: torch.export could not trace the dense "
                   "model (it was written as TorchScript, dense.ts); AOTInductor compiles "
                   "torch.export programs only: export without --aot"]
    assert not (tmp_path / "x").exists()


def test_an_older_manifest_without_aot_still_loads(ctr, tmp_path):
    _, rows, fp32 = ctr
    old = tmp_path / "old"
    shutil.copytree(fp32, old, ignore=shutil.ignore_patterns("dense.aoti.pt2"))
    manifest = json.loads((old / "model.json").read_text())
    del manifest["dense_program"]["aot"]  # as exports before --aot wrote it
    (old / "model.json").write_text(json.dumps(manifest))
    assert load_manifest(old).dense_program.aot is None
    table = pq.read_table(rows).slice(0, 50)
    assert torch.equal(_logits(ExportedModel(old), table), _logits(ExportedModel(fp32), table))
    with pytest.raises(ExportError) as e:
        ExportedModel(old, program="aot")
    assert str(e.value) == f"{old / 'model.json'}: no AOTInductor package; export with --aot"
