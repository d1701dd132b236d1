"""Loading runs no code: a checkpoint's DCP ``.metadata`` pickle that names a callable, and an
export whose ``config.yaml`` names a component module, are refused or ignored by every command that
reads them (``eval``, ``export``, ``train --resume``, ``predict``), and no marker file appears.
A refused command changes no file of the run (every file hashed before and after)."""

import os
import pickle
import shutil
from pathlib import Path

import pytest

from conftest import file_bytes, run_cli, train_tiny_ctr
from embedtrain.train.checkpoint import CheckpointError, SafeFileSystemReader


class _Payload:
    """Unpickling it calls ``os.system`` (what an attacker's checkpoint would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trust")
    return root, train_tiny_ctr(root)[1]


def _poisoned(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of ``run`` whose every checkpoint's ``.metadata`` runs a command when unpickled."""
    copy, marker = tmp_path / "run", tmp_path / "MARKER"
    shutil.copytree(run, copy)
    for meta in copy.glob("checkpoints/*/.metadata"):
        meta.write_bytes(pickle.dumps(_Payload(marker)))
    return copy, marker


_files = file_bytes


def test_the_payload_really_runs_under_plain_pickle(tmp_path):
    # The test's premise: what the commands below refuse does run code when unpickled.
    marker = tmp_path / "MARKER"
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.exists()


@pytest.mark.parametrize("command", ["eval", "export", "resume"])
def test_a_checkpoint_metadata_pickle_runs_no_code(trained, tmp_path, command):
    _, run = trained
    run, marker = _poisoned(run, tmp_path)
    before = _files(run)
    args = {"eval": ["eval", str(run)],
            "export": ["export", str(run), "--out", str(tmp_path / "export")],
            "resume": ["train", str(run / "config.yaml"), "--out", str(run), "--resume",
                       "--set", "train.max_steps=9"]}[command]
    r = run_cli(*args)
    assert not marker.exists()  # nothing ran
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert ".metadata" in r.stderr and "os" in r.stderr and "system" in r.stderr, r.stderr
    assert _files(run) == before  # refused: the run as it was, plan files included


def test_real_checkpoint_metadata_passes_the_allow_list(trained):
    _, run = trained
    for ckpt in sorted((run / "checkpoints").iterdir()):
        metadata = SafeFileSystemReader(ckpt).read_metadata()
        assert metadata.state_dict_metadata  # every key DCP wrote is read back


def test_metadata_that_is_not_dcp_metadata_is_one_line(trained, tmp_path):
    _, run = trained
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sorted((run / "checkpoints").iterdir())[-1], ckpt)
    (ckpt / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(CheckpointError, match=r"\.metadata: not a checkpoint's metadata \(a dict\)"):
        SafeFileSystemReader(ckpt).read_metadata()
    (ckpt / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointError, match=r"\.metadata: not a checkpoint's metadata"):
        SafeFileSystemReader(ckpt).read_metadata()


def test_predict_imports_no_module_the_export_names(trained, tmp_path):
    # An export whose config.yaml names a model and a task module beside it: predict scores
    # with the built-in recipe of the export's family and never imports them.
    import yaml

    root, run = trained
    export = tmp_path / "export"
    r = run_cli("export", str(run), "--out", str(export))
    assert r.returncode == 0, r.stderr
    marker = tmp_path / "MARKER"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = export / "config.yaml"
    raw = yaml.safe_load(config.read_text())
    raw["model"], raw["task"] = {"_component_": "evil:Model"}, {"_component_": "evil:Task"}
    config.write_text(yaml.safe_dump(raw))
    r = run_cli("predict", str(export), "--input", str(root / "data" / "test"),
                "--out", str(tmp_path / "p.parquet"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not marker.exists()


def test_a_refused_resume_changes_no_file(trained, tmp_path):
    # The run's own config.yaml edited by hand to another embedding dimension: the resume
    # builds the model, finds no checkpoint that fits and stops, the plan files untouched.
    _, run = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    config = copy / "config.yaml"
    import yaml

    raw = yaml.safe_load(config.read_text())
    raw["model"].update(embedding_dim=16, bottom_mlp=[16, 16])
    config.write_text(yaml.safe_dump(raw))
    before = _files(copy)
    r = run_cli("train", str(config), "--out", str(copy), "--resume", "--set",
                "train.max_steps=9")
    assert r.returncode != 0 and "does not fit this model" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert _files(copy) == before


@pytest.mark.parametrize("corruption", ["truncated", "pickle", "torch.save"])
def test_a_corrupt_dense_program_is_one_line(trained, tmp_path, corruption):
    import torch

    root, run = trained
    export = tmp_path / "export"
    r = run_cli("export", str(run), "--out", str(export))
    assert r.returncode == 0, r.stderr
    program = export / "dense.pt2"
    marker = tmp_path / "MARKER"
    if corruption == "truncated":
        program.write_bytes(program.read_bytes()[: program.stat().st_size // 2])
    elif corruption == "pickle":
        program.write_bytes(pickle.dumps(_Payload(marker)))
    else:
        torch.save({"weights": torch.zeros(3)}, program)
    out = tmp_path / "p.parquet"
    r = run_cli("predict", str(export), "--input", str(root / "data" / "test"), "--out", str(out))
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "dense.pt2: not a loadable" in r.stderr
    assert not marker.exists() and not out.exists()


def test_a_corrupt_dense_program_is_one_line_in_a_process_of_its_own(trained, tmp_path):
    # torch.export logs the archive's traceback through a handler made at import, bound to the
    # process's stderr: only a real process shows whether it reaches the user
    import subprocess
    import sys

    root, run = trained
    export = tmp_path / "export"
    assert run_cli("export", str(run), "--out", str(export)).returncode == 0
    program = export / "dense.pt2"
    program.write_bytes(program.read_bytes()[: program.stat().st_size // 2])
    r = subprocess.run([sys.executable, "-m", "embedtrain", "predict", str(export), "--input",
                        str(root / "data" / "test"), "--out", str(tmp_path / "p.parquet")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [
        f"embedtrain predict: error: {program}: not a loadable torch.export program: "
        "BadZipFile: File is not a zip file"], r.stderr


def test_predict_refuses_a_label_that_is_no_click_before_writing(trained, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root, run = trained
    export = tmp_path / "export"
    assert run_cli("export", str(run), "--out", str(export)).returncode == 0
    first = sorted((root / "data" / "test").glob("*.parquet"))[0]
    table = pq.read_table(first)
    labels = table.column("label").to_pylist()
    labels[7] = 3
    inputs = tmp_path / "rows.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("label"), "label",
                                    pa.array(labels, table.schema.field("label").type)), inputs)
    out = tmp_path / "p.parquet"
    r = run_cli("predict", str(export), "--input", str(inputs), "--out", str(out))
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert f"{inputs}: column label: row 7: label 3 is not a click (0..1)" in r.stderr, r.stderr
    assert not out.exists() and not list(tmp_path.glob(".p.parquet.tmp-*"))


def test_predict_removes_what_a_killed_predict_left(trained, tmp_path):
    import subprocess

    root, run = trained
    export = tmp_path / "export"
    assert run_cli("export", str(run), "--out", str(export)).returncode == 0
    gone = subprocess.Popen(["true"])
    gone.wait()  # a process that is no more: what a SIGKILLed predict leaves behind
    stale = tmp_path / f".p.parquet.tmp-{gone.pid}"
    live = tmp_path / f".p.parquet.tmp-{os.getppid()}"  # a running process's: not touched
    stale.write_bytes(b"half a parquet file")
    live.write_bytes(b"being written")
    r = run_cli("predict", str(export), "--input", str(root / "data" / "test"),
                "--out", str(tmp_path / "p.parquet"))
    assert r.returncode == 0, r.stderr
    assert not stale.exists() and live.exists() and (tmp_path / "p.parquet").is_file()


def test_a_checkpoint_missing_its_rank_file_is_not_resumed(trained, tmp_path):
    # The newest checkpoint lost rank_00000.pt (an incomplete copy): the resume falls back to
    # the older one, saying why, instead of resuming without the rank's RNG state.
    _, run = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    newest = sorted((copy / "checkpoints").iterdir())[-1]
    (newest / "rank_00000.pt").unlink()
    r = run_cli("train", str(copy / "config.yaml"), "--out", str(copy), "--resume", "--set",
                "train.max_steps=9")
    assert r.returncode == 0, r.stderr
    assert f"{newest}/rank_00000.pt: missing (an incomplete checkpoint" in r.stderr, r.stderr
    assert "trying an older checkpoint" in r.stderr


def test_predict_to_a_full_disk_names_the_output(trained, tmp_path, monkeypatch):
    import errno

    import pyarrow.parquet as pq

    root, run = trained
    export = tmp_path / "export"
    assert run_cli("export", str(run), "--out", str(export)).returncode == 0

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", full)
    out = tmp_path / "p.parquet"
    r = run_cli("predict", str(export), "--input", str(root / "data" / "test"), "--out", str(out),
                "--no-progress")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"embedtrain predict: error: {out}: no space left on device"], r.stderr
    assert not out.exists() and not list(tmp_path.glob(".p.parquet.tmp-*"))
