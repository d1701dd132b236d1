"""Interrupted ingestion and datagen never lose data (issue 28): the temporary folder beside
``--out`` (``pipelines.core.atomic``), ``--overwrite``, a full disk, ``--out`` a file.

Kills are real: a subprocess runs ``embedtrain ingest`` with one function patched to stop at a
chosen moment (after the part files are written; between the two renames of a replace), and the
test SIGKILLs it there. A few seconds in all.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import polars as pl
import pytest

from embedtrain.cli import main
from pipelines.core import atomic

ROOT = Path(__file__).resolve().parent.parent

SPEC = """
name: small
input: {format: csv}
label: y
dense: [{name: x, standardize: true}]
sparse: [{name: cat, min_frequency: 1}]
split: {method: time, column: t, valid_fraction: 0.1, test_fraction: 0.1}
"""


@pytest.fixture
def data(tmp_path: Path) -> dict:
    """A spec, two inputs (100 and 160 rows) and a complete data set at ``ds`` from the first."""
    (tmp_path / "spec.yaml").write_text(SPEC)
    for name, n in (("a.csv", 100), ("b.csv", 160)):
        pl.DataFrame({"y": [t % 2 for t in range(n)], "t": list(range(n)),
                      "x": [float(t) for t in range(n)],
                      "cat": ["a" if t % 3 else "b" for t in range(n)]}).write_csv(tmp_path / name)
    out = tmp_path / "ds"
    assert ingest(tmp_path, out, "a.csv") == 0
    return {"root": tmp_path, "out": out, "hashes": hashes(out)}


def ingest(root: Path, out: Path, inputs: str = "b.csv", *extra: str) -> int:
    return main(["ingest", str(root / "spec.yaml"), "--input", str(root / inputs), "--out",
                 str(out), "--quiet", *extra])


def hashes(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def rows(out: Path) -> int:
    import json

    meta = json.loads((out / "metadata.json").read_text())
    return sum(s["rows"] for s in meta["splits"].values())


def killed_ingest(root: Path, out: Path, patch: str) -> subprocess.Popen:
    """``embedtrain ingest`` of b.csv in a subprocess with ``patch`` applied first; ``patch``
    creates ``root/ready`` at the moment to kill, then sleeps. Returns the killed process."""
    code = textwrap.dedent(patch) + textwrap.dedent(f"""
        import sys
        from embedtrain.cli import main
        sys.exit(main(["ingest", {str(root / 'spec.yaml')!r}, "--input", {str(root / 'b.csv')!r},
                       "--out", {str(out)!r}, "--quiet"]))
    """)
    ready = root / "ready"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(f"ended before the kill: {proc.returncode} {proc.stderr.read()}")
        assert time.monotonic() < deadline, "never reached the moment to kill"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return proc


MID_WRITE = """
    import time
    from pathlib import Path
    import pipelines.tabular.passes as passes

    real = passes.sink_splits
    def sink_then_hang(rows, output, out, prefix="part"):
        written = real(rows, output, out, prefix)
        with open(Path(out) / "train" / "part-00099.parquet", "wb") as f:
            f.write(b"PAR1 truncated")  # a half-written part, as a kill mid-file leaves
        Path({ready!r}).touch()
        time.sleep(600)
    passes.sink_splits = sink_then_hang
"""


def test_ingest_killed_mid_write_keeps_the_data_set_and_the_rerun_cleans_up(data, capsys):
    root, out = data["root"], data["out"]
    killed_ingest(root, out, MID_WRITE.format(ready=str(root / "ready")))
    assert hashes(out) == data["hashes"]  # byte for byte
    left = leftovers(out)
    assert len(left) == 1 and left[0].startswith(".ds.tmp-")
    assert not (out.parent / left[0] / "metadata.json").exists()  # nothing looks complete
    assert (out.parent / left[0] / "train" / "part-00099.parquet").exists()

    capsys.readouterr()
    assert ingest(root, out) == 0
    err = capsys.readouterr().err
    assert err == (f"embedtrain ingest: leftovers of an interrupted ingest beside {out}: "
                   f"removed {left[0]}\n")
    assert leftovers(out) == [] and rows(out) == 160


BETWEEN_RENAMES = """
    import os
    from pathlib import Path
    import pipelines.core.atomic as atomic

    atomic._exchange = lambda a, b: False  # the two-rename replace
    real, calls = os.rename, []
    def rename_then_die(a, b):
        calls.append(a)
        if len(calls) == 2:  # --out renamed aside, the new one not yet in place
            Path({ready!r}).touch()
            import time
            time.sleep(600)
        real(a, b)
    atomic.os.rename = rename_then_die
"""


def test_killed_between_the_renames_the_next_run_puts_the_old_data_set_back(data, capsys):
    root, out = data["root"], data["out"]
    killed_ingest(root, out, BETWEEN_RENAMES.format(ready=str(root / "ready")))
    assert not out.exists()  # the one instant --out is missing
    left = leftovers(out)
    assert [n.split("-")[0] for n in left] == [".ds.old", ".ds.tmp"]
    assert hashes(out.parent / left[0]) == data["hashes"]

    capsys.readouterr()
    assert ingest(root, out, "none.csv") == 2  # fails on its input, after the recovery
    err = capsys.readouterr().err.splitlines()
    assert err[1].endswith("none.csv: input file not found")
    assert err[0] == (f"embedtrain ingest: leftovers of an interrupted ingest beside {out}: "
                      f"put {left[0]} back as {out}; removed {left[1]}")
    assert hashes(out) == data["hashes"] and leftovers(out) == []
    assert ingest(root, out) == 0 and rows(out) == 160


def test_a_failed_ingest_leaves_the_data_set_and_no_leftovers(data, capsys):
    root, out = data["root"], data["out"]
    (root / "bad.csv").write_text("y,t,x\n1,2,3\n")  # no column cat
    assert ingest(root, out, "bad.csv") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.csv" in err and ".tmp-" not in err
    assert hashes(out) == data["hashes"] and leftovers(out) == []


def test_messages_and_report_show_out_not_the_temporary_folder(data, capsys):
    root, out = data["root"], data["out"]
    assert ingest(root, out, "b.csv", "--set", "split.valid_fraction=0.0") == 0
    err = capsys.readouterr().err
    assert f"{out}: no valid split" in err and ".tmp-" not in err
    report = (out / "ingest_report.json").read_text()
    assert str(out) in report and ".tmp-" not in report


def test_a_live_writer_is_refused_and_its_folder_kept(data, capsys):
    out = data["out"]
    busy = out.parent / f".ds.tmp-{atomic._host()}-{os.getpid()}"
    busy.mkdir()
    fd = os.open(busy, os.O_RDONLY)
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert ingest(data["root"], out) == 2
        assert capsys.readouterr().err == (
            f"embedtrain ingest: error: {out}: another ingest is writing it (pid {os.getpid()} "
            f"on {atomic._host()}, into {busy.name}); wait for it to end or choose another "
            "--out\n")
        assert busy.is_dir() and hashes(out) == data["hashes"]
    finally:
        os.close(fd)
    assert ingest(data["root"], out) == 0 and not busy.exists()  # the lock is free: a leftover


def test_overwrite(data, capsys):
    root, out = data["root"], data["out"]
    assert ingest(root, out) == 0 and rows(out) == 160  # an earlier ingest output: replaced
    capsys.readouterr()

    (out / "notes.txt").write_text("mine")
    assert ingest(root, out, "a.csv") == 2
    assert capsys.readouterr().err == (
        f"embedtrain ingest: error: {out}: an earlier data set that also holds other files "
        "(notes.txt); pass --overwrite to replace all of it, or choose another --out\n")
    assert rows(out) == 160 and (out / "notes.txt").exists()
    assert ingest(root, out, "a.csv", "--overwrite") == 0
    assert rows(out) == 100 and not (out / "notes.txt").exists()

    gen = root / "gen"
    assert main(["datagen", "ctr", "--rows", "200", "--out", str(gen)]) == 0
    capsys.readouterr()
    assert ingest(root, gen) == 2
    assert capsys.readouterr().err == (
        f"embedtrain ingest: error: {gen}: holds a data set that ingest did not write (no "
        "ingest_report.json); pass --overwrite to replace it, or choose another --out\n")
    assert ingest(root, gen, "b.csv", "--overwrite") == 0
    assert rows(gen) == 160 and (gen / "ingest_report.json").exists()

    foreign = root / "mine"
    (foreign / "train").mkdir(parents=True)
    (foreign / "train" / "notes.txt").write_text("mine")
    for extra in ((), ("--overwrite",)):
        assert ingest(root, foreign, "b.csv", *extra) == 2
        assert capsys.readouterr().err == (f"embedtrain ingest: error: {foreign}: not empty and "
                                           "not an earlier ingest output; choose another --out\n")
    assert (foreign / "train" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("failure", ["oserror", "polars"])
def test_a_full_disk_names_the_output_and_keeps_the_data_set(data, capsys, monkeypatch, failure):
    import pipelines.tabular.passes as passes

    real = passes.sink_splits

    def sink_then_full(rows, output, out, prefix="part"):
        real(rows, output, out, prefix)
        if failure == "polars":  # what Polars raises; the job's read wrapper calls it unreadable
            raise pl.exceptions.ComputeError("parquet: File out of specification: underlying "
                                             "IO error: No space left on device (os error 28)")
        raise OSError(errno.ENOSPC, "No space left on device",
                      str(Path(out) / "train" / "part-00001.parquet"))

    monkeypatch.setattr(passes, "sink_splits", sink_then_full)
    root, out = data["root"], data["out"]
    assert ingest(root, out) == 2
    assert capsys.readouterr().err == (
        f"embedtrain ingest: error: {out}: cannot write the data set: no space left on device "
        "(the earlier data set there is kept)\n")
    assert hashes(out) == data["hashes"] and leftovers(out) == []
    fresh = root / "fresh" / "ds"
    assert ingest(root, fresh) == 2
    assert capsys.readouterr().err == (
        f"embedtrain ingest: error: {fresh}: cannot write the data set: no space left on device\n")
    assert not (root / "fresh").exists()


def test_out_a_file_or_under_a_file(data, capsys):
    root = data["root"]
    (root / "file").write_text("x")
    for out, why in ((root / "file", "exists and is not a directory"),
                     (root / "file" / "sub" / "ds", f"{root / 'file'} is a file, not a directory")):
        assert ingest(root, out) == 2
        assert capsys.readouterr().err == (f"embedtrain ingest: error: {out}: {why}; choose "
                                           "another --out\n")
        assert main(["datagen", "ctr", "--rows", "100", "--out", str(out)]) == 2
        assert capsys.readouterr().err == (f"embedtrain datagen: error: {out}: {why}; choose "
                                           "another --out\n")
    assert (root / "file").read_text() == "x"


# --- datagen ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, name", [
    (["ctr", "--rows", "200"], "generate_ctr"),
    (["ctr", "--rows", "200", "--format", "tsv"], "generate_ctr_tsv"),
    (["ctr", "--drift", "--rows", "400", "--drift-periods", "4"], "generate_ctr_drift"),
    (["xc", "--classes", "20", "--rows", "200", "--vocab", "100"], "generate_xc"),
    (["graph", "--nodes", "100", "--avg-degree", "3", "--feature-dim", "4"], "generate_graph")],
    ids=["ctr", "tsv", "drift", "xc", "graph"])
def test_datagen_replaces_only_when_complete(tmp_path, capsys, monkeypatch, kind, name):
    import embedtrain.datagen as datagen

    out = tmp_path / "gen"
    argv = ["datagen", *kind, "--out", str(out)]
    assert main(argv) == 0
    before = hashes(out)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f".gen.tmp-{atomic._host()}-{dead}"  # a killed run's folder
    (stale / "train").mkdir(parents=True)

    real = getattr(datagen, name)

    def write_then_fail(spec, out_dir, *a, **k):
        real(spec, out_dir, *a, **k)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(datagen, name, write_then_fail)
    capsys.readouterr()
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines()
           if line.startswith("embedtrain datagen:")]  # not the progress bars
    assert len(err) == 2
    assert err[0] == (f"embedtrain datagen: leftovers of an interrupted datagen beside {out}: "
                      f"removed {stale.name}")
    assert err[-1] == (f"embedtrain datagen: error: {out}: cannot write the data set: no space "
                       "left on device (the earlier data set there is kept)")
    assert hashes(out) == before and leftovers(out) == []

    monkeypatch.setattr(datagen, name, real)
    (out / "notes.txt").write_text("mine")
    assert main(argv) == 2
    assert capsys.readouterr().err.endswith(
        f"{out}: not empty and not an earlier datagen output (notes.txt); choose another --out\n")
    (out / "notes.txt").unlink()
    assert main(argv) == 0 and hashes(out) == before  # the same spec: the same bytes
