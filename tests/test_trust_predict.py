"""Trust at the boundaries of ``export`` and ``predict``: a write that fails (a full disk, an
I/O error) names the output file, not the checkpoint read; a SIGTERM or SIGINT stops the
command with one line and removes what it was writing; predict's metrics keep a bounded state
(4 bytes a labelled row), with the values torchmetrics computes over every row."""

import errno
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import ROOT, file_bytes, run_cli, train_tiny_ctr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trust_predict")
    _, run = train_tiny_ctr(root)
    export = root / "export"
    r = run_cli("export", str(run), "--out", str(export), "--no-progress")
    assert r.returncode == 0, r.stderr
    return root, run, export


_files = file_bytes


class _FullDisk:
    """A file opened for writing whose writes fail as on a full disk (no file named)."""

    def __init__(self, f) -> None:
        self._f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _fail_table_npy(monkeypatch, export: Path) -> list:
    """The first table file export writes fails on a full disk (reads work)."""
    from embedtrain.export import tables

    failed: list = []

    def open_(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        if ("+" in mode or "w" in mode) and not failed:
            failed.append(Path(path))
            return _FullDisk(f)
        return f

    monkeypatch.setattr(tables, "open", open_, raising=False)
    return failed


def _fail_table_parquet(monkeypatch, export: Path) -> list:
    """The first parquet table file export writes fails with an I/O error."""
    failed: list = []

    def write_table(self, table, *args, **kwargs):
        failed.append(Path(self.where))
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(pq.ParquetWriter, "write_table", write_table)
    return failed


def _fail_dense_program(monkeypatch, export: Path) -> list:
    """Flushing a file under the export to disk fails (no space: NFS reports it there)."""
    failed: list = []
    fsync = os.fsync

    def fsync_(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if export in path.parents:
            failed.append(export / "dense.pt2")  # its temporary file, renamed when complete
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_)
    return failed


@pytest.mark.parametrize("fail, args, why", [
    (_fail_table_npy, [], "no space left on device"),
    (_fail_table_parquet, ["--format", "npy,parquet"], os.strerror(errno.EIO)),
    (_fail_dense_program, [], "no space left on device"),
], ids=["npy", "parquet", "dense"])
def test_export_to_a_failing_disk_names_the_file_it_writes(trained, tmp_path, monkeypatch,
                                                            fail, args, why):
    _, run, _ = trained
    before = _files(run)
    export = tmp_path / "export"
    failed = fail(monkeypatch, export)
    r = run_cli("export", str(run), "--out", str(export), "--no-progress", *args)
    assert failed and export in failed[0].parents, failed  # a file of the export failed
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"embedtrain export: error: {failed[0]}: {why}"], r.stderr
    assert not export.exists() and os.listdir(tmp_path) == []  # nothing half-written
    assert _files(run) == before  # the run read, not changed


def test_sigterm_stops_export_and_removes_it(trained, tmp_path, monkeypatch):
    from embedtrain.export import tables

    _, run, _ = trained
    export = tmp_path / "export"
    write = tables.NpyWriter.write

    def write_and_get_killed(self, *args):
        os.kill(os.getpid(), signal.SIGTERM)  # e.g. a job scheduler's, mid-table
        return write(self, *args)

    def unhandled(signum, frame):  # what the default handler would do, without killing pytest
        raise AssertionError("export did not handle SIGTERM")

    monkeypatch.setattr(tables.NpyWriter, "write", write_and_get_killed)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        r = run_cli("export", str(run), "--out", str(export), "--no-progress")
        assert signal.getsignal(signal.SIGTERM) is unhandled  # restored after the write
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert r.returncode == 128 + signal.SIGTERM and r.stderr.splitlines() == [
        f"embedtrain export: stopped by SIGTERM; {export} not written"], r.stderr
    assert not export.exists() and os.listdir(tmp_path) == []


def test_sigterm_stops_predict_and_leaves_the_earlier_output(trained, tmp_path):
    root, _, export = trained
    rows = pq.read_table(root / "data" / "train")
    inputs = tmp_path / "rows.parquet"
    pq.write_table(pa.concat_tables([rows] * 40), inputs)  # ~64k rows: seconds, 16 at a time
    out = tmp_path / "p.parquet"
    out.write_bytes(b"an earlier run's predictions")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "embedtrain", "predict", str(export),
                          "--input", str(inputs), "--out", str(out), "--batch-size", "16",
                          "--no-progress"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    partial = tmp_path / f".p.parquet.tmp-{p.pid}"
    deadline = time.monotonic() + 120
    while not partial.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert partial.exists(), "predict never started writing"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert err.splitlines() == [f"embedtrain predict: stopped by SIGTERM; {out} not written"], err
    assert sorted(os.listdir(tmp_path)) == ["p.parquet", "rows.parquet"]  # no .tmp- file
    assert out.read_bytes() == b"an earlier run's predictions"


def _batches(scores: np.ndarray, labels: pa.Array, size: int = 8192):
    for i in range(0, len(scores), size):
        yield {"score": pa.array(scores[i:i + size])}, labels[i:i + size], i


def test_click_metrics_keep_four_bytes_a_row_and_torchmetrics_values():
    from torchmetrics.functional.classification import binary_auroc

    from embedtrain.export.predict import _ClickMetrics

    rng = np.random.default_rng(0)
    n = 1_000_000
    scores = np.round(rng.random(n, dtype=np.float32), 3)  # ties
    clicks = rng.random(n) < 0.25 + 0.5 * scores  # informative
    y = clicks.astype(np.float32)
    y[rng.random(n) < 0.01] = 0.5  # a soft label: log loss takes it, AUC counts no click
    labels = pa.array(y, mask=rng.random(n) < 0.02)  # unlabelled rows: not counted
    tracemalloc.start()
    try:
        m = _ClickMetrics(n // 3)  # more rows than announced: grown
        for columns, batch, first in _batches(scores, labels):
            m.update(columns, batch, "rows.parquet: column label", first)
        got = m.compute()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 6 * n + (4 << 20), peak  # ~4 bytes a row (+ a grown copy, a batch)
    valid = labels.is_valid().to_numpy(zero_copy_only=False)
    p, t = torch.from_numpy(scores[valid]).double(), torch.from_numpy(y[valid]).double()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # torchmetrics counts in it: exact, for the reference
    try:
        auc = float(binary_auroc(p, t.long(), thresholds=None))
    finally:
        torch.set_default_dtype(default)
    logloss = torch.nn.functional.binary_cross_entropy(p.clamp(1e-12, 1 - 1e-12), t).item()
    assert got["auc"] == pytest.approx(auc, abs=1e-12) and 0.6 < auc < 0.9
    assert got["logloss"] == pytest.approx(logloss, abs=1e-12)


def test_predict_refuses_to_write_over_its_own_input(trained, tmp_path):
    import shutil

    root, _, export = trained
    given = tmp_path / "in.parquet"
    shutil.copy(sorted((root / "data" / "test").glob("*.parquet"))[0], given)
    before = given.read_bytes()
    link = tmp_path / "link.parquet"
    link.symlink_to(given)
    for out in (given, link):  # by its name, or by another name of the same file
        r = run_cli("predict", str(export), "--input", str(tmp_path), "--out", str(out))
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            f"embedtrain predict: error: {out}: is also an input ({given}"
            "), which the output would replace; choose another --out"], r.stderr
    assert given.read_bytes() == before
