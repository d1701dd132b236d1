"""``embedtrain report``: two runs on shared axes with the values their records hold, the keys
that differ, the final metrics beside the oracle; the runs' files untouched; bad input is one
line; the page opens in headless Chromium without console errors (a screenshot shows the curves)."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import file_bytes, run_cli


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Runs ``a`` (batch 256, 6 steps) and ``b`` (batch 128, 9 steps), each evaluated 3 times."""
    from embedtrain.testing import tiny_ctr_dataset

    root = tmp_path_factory.mktemp("report")
    data = tiny_ctr_dataset(root / "data", rows=2000)
    for name, batch, steps in (("a", 256, 6), ("b", 128, 9)):
        config = root / f"{name}.yaml"
        config.write_text(f"""
data: {{path: {data}, batch_size: {batch}, eval_batch_size: 1024, num_workers: 0}}
model: {{embedding_dim: 8, bottom_mlp: [16, 8], top_mlp: [16, 1]}}
train: {{max_steps: {steps}, eval_every: {steps // 3}, checkpoint_every: {steps}, progress: false}}
""")
        r = run_cli("train", str(config), "--out", str(root / name))
        assert r.returncode == 0, r.stderr
    return root, root / "a", root / "b"


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_runs_side_by_side_as_their_files_say(two_runs):
    root, a, b = two_runs
    before = file_bytes(root)
    out = root / "pages" / "compare.html"
    out.parent.mkdir()
    r = run_cli("report", str(a), str(b), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert file_bytes(root) == {**before, "pages/compare.html": out.read_bytes()}  # only --out
    page = out.read_text()
    assert "<script" not in page and "http" not in page.split("</style>")[1]  # self-contained
    # every evaluation of each run is a point of its curve, with the value its record holds
    for run in (a, b):
        for rec in _records(run):
            if "auc" in rec:
                assert f"{run.name}: step {rec['step']}, auc {rec['auc']:.6g}<" in page
    charts = page.split('<svg class="chart"')[1:]
    auc = next(c for c in charts if 'aria-label="auc"' in c)
    assert auc.count("<polyline") == 2
    differences = page.split("<h2>Config differences</h2>")[1].split("<h2>")[0]
    for key in ("data.batch_size", "train.max_steps", "train.eval_every"):
        assert f"<td>{key}</td>" in differences
    assert "<td>model.embedding_dim</td>" not in differences  # the same in both
    final = page.split("<h2>Final metrics</h2>")[1].split("<h2>")[0]
    for run in (a, b):
        summary = json.loads((run / "summary.json").read_text())
        assert f"<td>{summary['auc']:.4g}</td>" in final
    assert "<td>oracle_auc</td>" in final


def test_bad_input_is_one_line_and_writes_nothing(two_runs, tmp_path):
    root, a, _ = two_runs
    r = run_cli("report", str(tmp_path), "--out", str(tmp_path / "x.html"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "not a run directory (no config.yaml)" in r.stderr
    r = run_cli("report", str(a), "--out", str(a / "report.html"))
    assert r.returncode == 2 and "the report writes nothing into a run" in r.stderr
    assert not (a / "report.html").exists() and not list(tmp_path.iterdir())


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt install chromium)")
def test_the_page_opens_in_chromium_without_console_errors(two_runs, tmp_path):
    from matplotlib import image

    root, a, b = two_runs
    page, shot = tmp_path / "compare.html", tmp_path / "compare.png"
    assert run_cli("report", str(a), str(b), "--out", str(page)).returncode == 0
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                        "--enable-logging=stderr", "--v=0", f"--screenshot={shot}",
                        "--window-size=1300,1000", page.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert shot.is_file(), r.stderr[-2000:]
    assert not re.findall(r"CONSOLE.*|Uncaught.*", r.stderr), r.stderr[-2000:]
    pixels = (image.imread(shot)[..., :3] * 255).round().astype(int)
    for color in ((31, 119, 180), (214, 39, 40)):  # both runs' curves: far more than a swatch
        assert (pixels == color).all(-1).sum() > 1000, color
    print(f"screenshot: {shot}")
