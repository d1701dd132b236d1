"""Helpers for the engine tests: small inputs of every kind, and one comparison of two outputs.

Two engines agree (issue 18's rule) when their vocabularies are equal byte for byte, every
split's rows are equal as sets (engines cut part files differently, not rows), every other file
(graph arrays, id maps) is equal byte for byte, and ``metadata.json`` and ``ingest_report.json``
are equal but for the part file lists and counts, the timings and the ``engine`` section (floats
merged from per-shard means and deviations to 1e-12).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "configs" / "ingest"
UNTIMED = ("phases", "wall_seconds", "engine", "files_written",  # timing, layout
           "peak_rss_gb")  # and the memory the engine took


def write_criteo(d: Path, files: int = 3, rows: int = 900) -> list[str]:
    """Criteo TSV files (synthetic CTR rows), a short and an empty line in the second."""
    from embedtrain.datagen import CTRDataSpec, generate_ctr_tsv

    info = generate_ctr_tsv(CTRDataSpec(rows=files * rows, seed=3), d / "raw", progress=False)
    lines = (d / "raw" / info["files"][0]).read_text().splitlines(keepends=True)
    for i in range(files):
        part = lines[i * rows:(i + 1) * rows]
        if i == 1:
            part[10:10] = ["not a criteo line\n", "\n"]
        (d / f"day_{i}.tsv").write_text("".join(part))
    return [str(d / "day_*.tsv")]


def write_xc_repository(d: Path) -> tuple[list[str], list[str]]:
    """Two Extreme Classification Repository files (malformed lines, a header line inside);
    returns the inputs and the overrides (test by split.files)."""
    rng = np.random.default_rng(5)
    for name, rows in (("train.txt", 400), ("test.txt", 100)):
        lines = []
        for _ in range(rows):
            labels = sorted(set(rng.integers(0, 12, rng.integers(1, 3)).tolist()))
            lines.append(",".join(map(str, labels)) + " " + " ".join(
                f"{j}:{rng.random():.2f}" for j in rng.integers(0, 50, 5)))
        lines[7], lines[30], lines[31] = "1,x 3:0.5", "", "4 50 12"
        (d / name).write_text(f"{rows} 50 12\n" + "\n".join(lines) + "\n")
    return [str(d / "train.txt")], [f"split.files.test={d / 'test.txt'}"]


def write_xc_parquet(d: Path) -> list[str]:
    """Two parquet files of text and tag lists (some rows without tags: dropped)."""
    rng = np.random.default_rng(4)
    words, tags = [f"w{i}" for i in range(60)], [f"t{i}" for i in range(15)]
    for i in range(2):
        n = 400
        pq.write_table(pa.table({
            "text": [" ".join(rng.choice(words, int(rng.integers(0, 6)))) for _ in range(n)],
            "tags": [list(rng.choice(tags, int(rng.integers(0, 3)))) for _ in range(n)]}),
            d / f"docs{i}.parquet")
    return [str(d / "docs*.parquet")]


def write_graph(d: Path) -> tuple[list[str], list[str]]:
    """Three edge CSV files (string ids, endpoints missing from the node table, self-loops,
    repeats, a bad weight, timestamps) and a node table; returns the edge and node inputs."""
    rng = np.random.default_rng(2)
    n, m = 80, 300
    for i in range(3):
        src, dst = rng.integers(0, n + 10, m), rng.integers(0, n + 10, m)
        w = rng.random(m).round(3) + 0.1
        w[3] = -1.0
        pl.DataFrame({"src": [f"n{s}" for s in src], "dst": [f"n{t}" for t in dst],
                      "weight": w, "ts": np.arange(m) + i * m}).write_csv(d / f"edges{i}.csv")
    pl.DataFrame({"id": [f"n{j}" for j in range(n)],
                  **{f"f{k}": rng.random(n).round(3) for k in range(1, 5)},
                  "label": rng.integers(0, 3, n)}).write_csv(d / "nodes.csv")
    return [str(d / "edges*.csv")], [str(d / "nodes.csv")]


def write_events(d: Path) -> list[str]:
    """Three event CSV files (string ids, ties in time across files, a null item, users under
    ``min_length``); returns the inputs."""
    rng = np.random.default_rng(3)
    for i in range(3):
        m = 400
        items = [f"i{int(k)}" for k in rng.zipf(1.6, m) % 50]
        items[5] = ""
        pl.DataFrame({"user": [f"u{int(u)}" for u in rng.integers(0, 40, m)], "item": items,
                      "timestamp": rng.integers(0, 200, m)}).write_csv(d / f"events{i}.csv")
    return [str(d / "events*.csv")]


def _close(a, b, path: str = "") -> None:
    """``a == b``, floats to 1e-12 relative, with the path of the first difference."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) <= 1e-12 * max(1.0, abs(a)), (path, a, b)
    else:
        assert a == b, (path, a, b)


def _rows(folder: Path) -> pl.DataFrame:
    frame = pl.concat([pl.read_parquet(p) for p in sorted(folder.glob("*.parquet"))])
    lists = [c for c, t in frame.schema.items() if isinstance(t, pl.List)]
    frame = frame.with_columns(pl.col(c).cast(pl.List(pl.String)).list.join(",", ignore_nulls=True)
                               for c in lists)
    return frame.sort(frame.columns)


def _untimed(report: dict) -> dict:
    return {k: v for k, v in report.items() if k not in UNTIMED}


def assert_same_outputs(a: Path, b: Path) -> None:
    """The two data set folders hold the same data set (see the module docstring)."""
    files_a = {p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file()}
    files_b = {p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file()}
    splits = {rel.split("/")[0] for rel in files_a | files_b
              if rel.endswith(".parquet") and rel.split("/")[0] in ("train", "valid", "test")}
    assert {r for r in files_a if r.split("/")[0] not in splits} == \
        {r for r in files_b if r.split("/")[0] not in splits}
    for split in sorted(splits):
        assert _rows(a / split).equals(_rows(b / split)), split
    for rel in sorted(files_a):
        if rel.split("/")[0] in splits:
            continue
        if rel == "metadata.json":
            ma, mb = (json.loads((d / rel).read_text()) for d in (a, b))
            for m in (ma, mb):
                for entry in m.get("splits", {}).values():
                    if isinstance(entry, dict):
                        entry.pop("files", None)
            _close(ma, mb, "metadata")
        elif rel == "ingest_report.json":
            _close(*(_untimed(json.loads((d / rel).read_text())) for d in (a, b)), "report")
        else:  # vocabularies, graph arrays, the id map: byte for byte
            assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
