"""A run directory written before issue 53's changes (commit 5625f92, ``tests/fixtures/
run_5625f92``) still evaluates, exports, serves and resumes with today's code, with the
numbers it recorded."""

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import run_cli

FIXTURE = Path(__file__).parent / "fixtures" / "run_5625f92"


@pytest.fixture
def old_run(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "old")
    root = tmp_path / "old"
    config = root / "run" / "config.yaml"  # the data set moved with the run: say where it is
    text = config.read_text()
    assert "  path: /tmp/p52/oldrun/data\n" in text
    config.write_text(text.replace("/tmp/p52/oldrun/data", str(root / "data")))
    return root


def test_an_old_run_evaluates_with_the_metrics_it_recorded(old_run):
    summary = json.loads((old_run / "run" / "summary.json").read_text())
    r = run_cli("eval", str(old_run / "run"), "--split", "test")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["step"] == 4 == summary["steps"]
    assert result["auc"] == pytest.approx(summary["auc"], abs=1e-9)


def test_an_old_run_exports_serves_and_resumes(old_run, tmp_path):
    run = old_run / "run"
    r = run_cli("export", str(run), "--out", str(tmp_path / "export"))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "preds.parquet"
    r = run_cli("predict", str(tmp_path / "export"), "--input", str(old_run / "data" / "test"),
                "--out", str(out))
    assert r.returncode == 0, r.stderr
    test_rows = json.loads((old_run / "data" / "metadata.json").read_text())["splits"]["test"]
    assert pq.read_metadata(out).num_rows == test_rows["rows"]
    r = run_cli("train", str(run / "config.yaml"), "--out", str(run), "--resume",
                "--set", "train.max_steps=6")
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout + r.stderr and "step_00000004" in r.stdout + r.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
