"""Every shipped ingestion spec gives the same data set from two code roots (local engine).

For each ``configs/ingest/*.yaml`` a small deterministic input is generated once (numpy and
``embedtrain.datagen``, nothing from ``pipelines``), then ``python -m embedtrain ingest`` runs
with ``PYTHONPATH=<root>`` for each root (PYTHONPATH precedes the editable install, so the
root's ``pipelines`` and ``embedtrain`` are the ones imported; each run checks which), with
``POLARS_MAX_THREADS=1`` (with more threads, float sums such as the dense means change in the
last bits from one run of the same code to the next). Both
runs write to the same ``--out`` path (moved aside after each run), so paths inside the outputs
agree. The trees are compared file by file: sha256 for every file but ``ingest_report.json``,
which must be equal after dropping the timing keys (``TIMING``, at any depth); the CLI's
summary lines must be equal after dropping their ``in N.N s`` and ``(polars engine)`` (the
graph lines gained the engine's name).

    python benchmarks/check_ingest_identical.py --base /tmp/base --new .   # exit 1 on a change
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "configs" / "ingest"
TIMING = ("wall_seconds", "seconds", "rows_per_s")  # dropped from ingest_report.json


def _write_csv(path: Path, columns: dict) -> None:
    names = list(columns)
    rows = zip(*(columns[n] for n in names))
    path.write_text(",".join(names) + "\n" + "".join(
        ",".join("" if v is None else str(v) for v in row) + "\n" for row in rows))


def _criteo(work: Path) -> list[str]:
    """3 Criteo TSV files (synthetic CTR rows) with a short and an empty line in the second."""
    from embedtrain.datagen import CTRDataSpec, generate_ctr_tsv

    raw = work / "criteo"
    info = generate_ctr_tsv(CTRDataSpec(rows=6_000, seed=3), raw, progress=False)
    source = raw / info["files"][0]
    lines = source.read_text().splitlines(keepends=True)
    source.unlink()
    (raw / "datagen.json").unlink()
    for i in range(3):
        part = lines[i * 2000:(i + 1) * 2000]
        if i == 1:
            part[10:10] = ["not a criteo line\n", "\n", "1\t2\t3\n"]
        (raw / f"day_{i}.tsv").write_text("".join(part))
    return ["--input", str(raw / "day_*.tsv")]


def _ctr_raw(work: Path) -> list[str]:
    """2 parquet files of click logs with raw ids, a negative id and null labels."""
    rng = np.random.default_rng(1)
    (work / "ctr_raw").mkdir()
    for i in range(2):
        n = 1500
        user = rng.zipf(1.5, n).astype(np.int64)
        user[5] = -3
        history = [None if rng.random() < 0.05 else rng.zipf(1.4, rng.integers(0, 25)).tolist()
                   for _ in range(n)]
        pq.write_table(pa.table({
            "clicked": pa.array([None if j == 7 else int(rng.integers(0, 2)) for j in range(n)]),
            "price": rng.lognormal(1, 1, n),
            "user_id": user,
            "item_id": rng.integers(0, 10_000, n),
            "city": pa.array([None if rng.random() < 0.03 else f"city{int(x)}"
                              for x in rng.zipf(1.3, n)]),
            "history": pa.array(history, pa.list_(pa.int64())),
        }), work / "ctr_raw" / f"part-{i}.parquet")
    return ["--input", str(work / "ctr_raw" / "*.parquet")]


def _graph(work: Path, split_column: bool) -> list[str]:
    """2 edge CSV files (string ids, self-loops, repeats, a bad weight) and a node table."""
    rng = np.random.default_rng(2)
    d = work / ("graph_split" if split_column else "graph")
    d.mkdir()
    n, m = 300, 1200
    for i in range(2):
        src, dst = rng.integers(0, n + 20, m), rng.integers(0, n + 20, m)
        columns = {"src": [f"n{s}" for s in src], "dst": [f"n{t}" for t in dst]}
        if not split_column:
            w = (rng.random(m).round(3) + 0.1).tolist()
            w[3] = -1.0
            columns.update(weight=w, ts=(np.arange(m) + i * m).tolist())
        _write_csv(d / f"edges{i}.csv", columns)
    nodes = {"id": [f"n{j}" for j in range(n)],
             **{f"f{k}": [None if rng.random() < 0.02 else round(float(x), 3)
                          for x in rng.random(n)] for k in range(1, 5)},
             "label": [None if rng.random() < 0.05 else int(x) for x in rng.integers(0, 3, n)]}
    if split_column:
        nodes["split"] = rng.choice(["train", "valid", "val", "test", "other"], n).tolist()
    _write_csv(d / "nodes.csv", nodes)
    return ["--input", str(d / "edges*.csv"), "--nodes", str(d / "nodes.csv")]


def _xc_parquet(work: Path) -> list[str]:
    """2 parquet files of text and tag lists (Zipfian, some empty)."""
    rng = np.random.default_rng(4)
    words = [f"w{i}" for i in range(300)]
    tags = [f"t{i}" for i in range(40)]
    wp, tp = 1.0 / np.arange(1, 301), 1.0 / np.arange(1, 41)
    (work / "xc_parquet").mkdir()
    for i in range(2):
        n = 1500
        text = ["  ".join(rng.choice(words, int(rng.integers(0, 9)), p=wp / wp.sum()))
                for _ in range(n)]
        tag = [list(rng.choice(tags, int(rng.integers(0, 4)), p=tp / tp.sum())) for _ in range(n)]
        pq.write_table(pa.table({"text": text, "tags": tag}),
                       work / "xc_parquet" / f"docs{i}.parquet")
    return ["--input", str(work / "xc_parquet" / "*.parquet")]


def _xc_repository(work: Path) -> list[str]:
    """2 Extreme Classification Repository files (one malformed line), test by split.files."""
    rng = np.random.default_rng(5)
    d = work / "xc_repository"
    d.mkdir()
    for name, rows in (("train.txt", 1500), ("test.txt", 300)):
        lines = []
        for _ in range(rows):
            labels = sorted(set(rng.integers(0, 30, rng.integers(1, 3)).tolist()))
            ids = rng.integers(0, 200, 6)
            lines.append(",".join(map(str, labels)) + " " + " ".join(
                f"{j}:{rng.random():.3f}" for j in ids))
        if name == "train.txt":
            lines[20] = "1,x 3:0.5"
        (d / name).write_text(f"{rows} 200 30\n" + "\n".join(lines) + "\n")
    return ["--input", str(d / "train.txt"), "--set", f"split.files.test={d / 'test.txt'}"]


INPUTS = {
    "criteo.yaml": _criteo,
    "criteo_synthetic.yaml": _criteo,
    "ctr_raw.yaml": _ctr_raw,
    "graph_edges.yaml": lambda w: _graph(w, False),
    "graph_split_column.yaml": lambda w: _graph(w, True),
    "xc_parquet.yaml": _xc_parquet,
    "xc_repository.yaml": _xc_repository,
}


def _ingest(root: Path, spec: Path, args: list[str], out: Path) -> tuple[list[str], str]:
    """One CLI run with ``root`` first on the path; returns (the files of ``pipelines`` and
    ``embedtrain`` it imports, the summary lines)."""
    env = {**os.environ, "PYTHONPATH": str(root), "POLARS_MAX_THREADS": "1"}
    # cwd: root too (``-m`` puts the working directory before PYTHONPATH)
    where = subprocess.run([sys.executable, "-c", "import embedtrain, pipelines; "
                            "print(pipelines.__file__, embedtrain.__file__)"], cwd=root,
                           env=env, capture_output=True, text=True, check=True).stdout.split()
    r = subprocess.run([sys.executable, "-m", "embedtrain", "ingest", str(spec), *args,
                        "--out", str(out), "--quiet"], cwd=root, env=env, capture_output=True,
                       text=True)
    if r.returncode:
        raise SystemExit(f"{spec.name} with {root}: exit {r.returncode}: {r.stderr[-2000:]}")
    return where, re.sub(r" in \d+\.\d s| \(\w+ engine\)", "", r.stdout)


def _drop_timing(value):
    if isinstance(value, dict):
        return {k: _drop_timing(v) for k, v in value.items() if k not in TIMING}
    if isinstance(value, list):
        return [_drop_timing(v) for v in value]
    return value


def compare(a: Path, b: Path) -> list[str]:
    """Differences between two output trees (empty: identical)."""
    files_a = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    if files_a != files_b:
        return [f"file lists differ: only base {sorted(set(files_a) - set(files_b))}, "
                f"only new {sorted(set(files_b) - set(files_a))}"]
    diffs = []
    for rel in files_a:
        if Path(rel).name == "ingest_report.json":
            ra, rb = (_drop_timing(json.loads((d / rel).read_text())) for d in (a, b))
            if ra != rb:
                keys = sorted(k for k in set(ra) | set(rb) if ra.get(k) != rb.get(k))
                diffs.append(f"{rel}: differs in {keys}")
        elif (hashlib.sha256((a / rel).read_bytes()).digest()
              != hashlib.sha256((b / rel).read_bytes()).digest()):
            diffs.append(f"{rel}: sha256 differs")
    return diffs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, type=Path, help="the earlier code root")
    parser.add_argument("--new", default=ROOT, type=Path, help="the code root to check")
    parser.add_argument("--keep", type=Path, help="keep the inputs and outputs here")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="ingest_identical_"))
    work.mkdir(parents=True, exist_ok=True)
    failed = 0
    print(f"{'spec':26} {'files':>5}  result")
    for name, make in INPUTS.items():
        case = work / name.removesuffix(".yaml")
        shutil.rmtree(case, ignore_errors=True)
        case.mkdir()
        inputs = make(case)
        out = case / "out"
        runs = {}
        for label, root in (("base", args.base), ("new", args.new)):
            where, summary = _ingest(root.resolve(), SPECS / name, inputs, out)
            if not all(Path(w).resolve().is_relative_to(root.resolve()) for w in where):
                raise SystemExit(f"PYTHONPATH={root} imports {where}")
            out.rename(case / label)
            runs[label] = summary
        diffs = compare(case / "base", case / "new")
        if runs["base"] != runs["new"]:
            diffs.append(f"summary lines differ:\n{runs['base']}---\n{runs['new']}")
        n = sum(1 for p in (case / "base").rglob("*") if p.is_file())
        print(f"{name:26} {n:5}  {'identical' if not diffs else 'DIFFERENT'}")
        for d in diffs:
            print(f"    {d}")
        failed += bool(diffs)
    if not args.keep:
        shutil.rmtree(work)
    print(f"dropped from ingest_report.json: {', '.join(TIMING)}; from the summary lines: "
          "'in N.N s', '(polars engine)'")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
