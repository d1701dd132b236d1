"""Trust at the boundaries: Ctrl-C during ``embedtrain ingest`` is one line and changes nothing;
a GNN process leaves none of PyG's generated code in TMPDIR.

The interrupts are real: ``embedtrain ingest`` runs in a subprocess over a CSV big enough that
Polars is still scanning it when SIGINT comes (sent once the job's temporary folder exists). The
GNN check builds the models in a fresh interpreter (PyG writes its generated module once per
process) with TMPDIR pointing at an empty folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from pipelines import run_ingest
from pipelines.core import atomic

ROOT = Path(__file__).resolve().parent.parent
SPEC = "input: {format: csv}\nlabel: y\ndense: [{name: x}]\nsparse: [{name: c}, {name: d}]\n"
ROWS = 2_000_000  # ~2 s of Polars passes on 2 cores: the signal lands mid-scan


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> dict:
    """The spec and a CSV of :data:`ROWS` rows."""
    root = tmp_path_factory.mktemp("big")
    (root / "spec.yaml").write_text(SPEC)
    r = np.random.default_rng(0)
    pl.DataFrame({"y": r.integers(0, 2, ROWS), "x": r.random(ROWS),
                  "c": r.integers(0, 100_000, ROWS).astype(str),
                  "d": r.integers(0, 1_000, ROWS).astype(str)}).write_csv(root / "big.csv")
    pl.read_csv(root / "big.csv", n_rows=200).write_csv(root / "small.csv")
    return {"spec": root / "spec.yaml", "csv": root / "big.csv", "small": root / "small.csv"}


def hashes(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def ours(out: Path) -> list[str]:
    """The job's temporary or set-aside folders beside ``out``."""
    if not out.parent.is_dir():
        return []
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def interrupted(cmd: list[str], out: Path, after_s: float = 0.3) -> tuple[int, str, float]:
    """Runs ``cmd`` (an ingest into ``out``), sends SIGINT ``after_s`` after its temporary folder
    appears (the passes are running), and returns its exit status, stderr and the seconds it took
    to end after the signal."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(n.startswith(f".{out.name}.tmp-") for n in ours(out)):
            if proc.poll() is not None:
                raise AssertionError(f"ended before the signal: {proc.returncode} "
                                     f"{proc.stderr.read()}")
            assert time.monotonic() < deadline, "the job never started writing"
            time.sleep(0.01)
        time.sleep(after_s)
        assert proc.poll() is None, "ended before the signal: make the input bigger"
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=60)
        return proc.returncode, err, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def ingest_cmd(big: dict, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "embedtrain", "ingest", str(big["spec"]), "--input",
            str(big["csv"]), "--out", str(out), "--quiet", *extra]


def test_ctrl_c_during_ingest_is_one_line_and_writes_nothing(big, tmp_path):
    out = tmp_path / "new" / "ds"  # its parent too is made by the job, and removed
    code, err, took = interrupted(ingest_cmd(big, out), out)
    assert err == f"embedtrain ingest: interrupted; {out} not written\n"  # no panic, traceback
    assert code == 130
    assert not (tmp_path / "new").exists()
    assert took < 10  # Polars stopped its scan; it did not run to the end of the pass


def test_ctrl_c_with_overwrite_keeps_the_earlier_data_set_byte_for_byte(big, tmp_path):
    out = tmp_path / "ds"
    run_ingest(big["spec"], [big["small"]], out, progress=False)
    (out / "notes.txt").write_text("mine")  # another file: only --overwrite replaces it
    before = hashes(out)
    code, err, _ = interrupted(ingest_cmd(big, out, "--overwrite"), out)
    assert err == f"embedtrain ingest: interrupted; {out} not written (earlier output kept)\n"
    assert code == 130
    assert hashes(out) == before and ours(out) == []


@pytest.fixture
def small(tmp_path) -> dict:
    (tmp_path / "spec.yaml").write_text(SPEC)
    pl.DataFrame({"y": [i % 2 for i in range(60)], "x": [float(i) for i in range(60)],
                  "c": [str(i % 7) for i in range(60)],
                  "d": [str(i % 3) for i in range(60)]}).write_csv(tmp_path / "in.csv")
    out = tmp_path / "ds"
    run_ingest(tmp_path / "spec.yaml", [tmp_path / "in.csv"], out, progress=False)
    return {"spec": tmp_path / "spec.yaml", "csv": tmp_path / "in.csv", "out": out,
            "hashes": hashes(out)}


def test_an_interrupt_as_the_data_set_takes_its_place_says_it_is_written(small, monkeypatch):
    """Ctrl-C right after the swap (while the old data set is being deleted): the new data set
    is complete at --out, and the interrupt says so; nothing of the old one is left."""
    real = atomic._fsync

    def interrupted_once(path):
        if Path(path) == small["out"].parent:  # the parent's fsync, after the swap
            monkeypatch.setattr(atomic, "_fsync", real)
            raise KeyboardInterrupt
        real(path)

    monkeypatch.setattr(atomic, "_fsync", interrupted_once)
    with pytest.raises(KeyboardInterrupt) as e:  # not atomic.Interrupted: a failure, not an abort
        run_ingest(small["spec"], [small["csv"]], small["out"], progress=False, overwrite=True)
    assert isinstance(e.value, atomic.Interrupted)
    assert e.value.published and e.value.out == str(small["out"])
    assert json.loads((small["out"] / "metadata.json").read_text())  # the new data set
    assert ours(small["out"]) == []


def test_a_second_interrupt_does_not_cut_the_clean_up_short(small, monkeypatch):
    """Polars' KeyboardInterrupt is followed by Python's own for the same signal, wherever the
    interpreter next checks: here, inside the removal of the temporary folder."""
    real, calls = atomic.shutil.rmtree, []

    def rmtree_interrupted_once(path, *a, **kw):
        calls.append(path)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(path, *a, **kw)

    monkeypatch.setattr(atomic.shutil, "rmtree", rmtree_interrupted_once)
    with pytest.raises(KeyboardInterrupt) as e:
        with atomic.atomic_output(small["out"], lambda _: None, job="ingest") as staging:
            (staging.path / "part.parquet").write_bytes(b"half")
            raise KeyboardInterrupt
    assert isinstance(e.value, atomic.Interrupted) and not e.value.published
    assert hashes(small["out"]) == small["hashes"] and ours(small["out"]) == []


GNN = """
import inspect, os, sys
from embedtrain.models.gnn import GraphSAGE
from embedtrain.models.options import GNNModel

for kind in (GNNModel.SAGE, GNNModel.GCN, GNNModel.GAT):
    model = GraphSAGE(num_nodes=0, num_features=4, embedding_dim=0, hidden=[8, 8], out_dim=2,
                      kind=kind, heads=2)
    conv = type(model.convs[0])
    assert conv.propagate.__module__.endswith("_propagate"), conv  # PyG's generated code
    assert "def propagate" in inspect.getsource(conv.propagate)  # still readable
print(sorted(os.listdir(sys.argv[1])))
"""


def test_gnn_models_leave_no_generated_code_in_tmpdir(tmp_path):
    """PyG writes ``torch_geometric.nn.conv.<conv>_propagate_XXXX.py`` into TMPDIR for each
    conv class and never deletes it. What may stay is torch's per-user inductor cache folder
    (``torchinductor_<user>``, made by ``import torchrec``, shared by every process of the user):
    not this process's, so not removed here."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = subprocess.run([sys.executable, "-c", GNN, str(tmp)], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)},
                       timeout=120)
    assert r.returncode == 0, r.stderr
    left = [p.name for p in tmp.iterdir()
            if not (p.name.startswith("torchinductor_") and p.is_dir())]
    assert left == []
    assert eval(r.stdout.strip().splitlines()[-1]) == sorted(p.name for p in tmp.iterdir())
