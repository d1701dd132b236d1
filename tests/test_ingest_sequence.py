"""Sequence ingestion (``kind: sequence``): the rows, splits, truncation, vocabulary and counts
against a pure-Python reference, and bad input in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedtrain.config_io import ConfigError
from pipelines import run_ingest
from pipelines.core.errors import IngestError

SPLITS = ("train", "valid", "test")


def _events(seed: int, n: int = 3000, users: int = 150, items: int = 60) -> list[tuple]:
    """(user, item, time) rows with repeated times (ties), repeated items and some nulls."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        u = f"u{int(rng.integers(users)):03d}"
        i = f"i{int(rng.zipf(1.5)) % items}"
        t = int(rng.integers(0, 400))
        r = rng.random()
        rows.append((None if r < 0.01 else u, None if 0.01 <= r < 0.02 else i,
                     None if 0.02 <= r < 0.03 else t))
    return rows


def _reference(rows: list[tuple], max_length: int, min_length: int, method: str = "lloo",
               valid_time: float = 0, test_time: float = 0) -> tuple[dict, Counter, dict]:
    """The data set by the definition: (user, history, target) rows per split, the drops, the
    vocabulary."""
    dropped, events = Counter(), defaultdict(list)
    for index, (u, i, t) in enumerate(rows):
        if u is None:
            dropped["null_user"] += 1
        elif i is None:
            dropped["null_item"] += 1
        elif t is None:
            dropped["null_time"] += 1
        else:
            events[u].append((t, index, i))
    kept = {u: sorted(v) for u, v in events.items() if len(v) >= min_length}
    dropped["short_history"] = sum(len(v) for v in events.values() if len(v) < min_length)
    counts = Counter(i for v in kept.values() for _, _, i in v)
    vocab = {item: k + 1 for k, (item, _) in
             enumerate(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))}
    out = {s: [] for s in SPLITS}
    for u in sorted(kept):
        x = [vocab[i] for _, _, i in kept[u]]
        times = [t for t, _, _ in kept[u]]
        n, covered = len(x), set()

        def add(split, lo, hi):
            out[split].append((u, x[lo:hi], x[hi]))
            covered.update(range(lo, hi + 1))

        if method == "lloo":
            if n >= 4:
                add("train", max(0, n - 3 - max_length), n - 3)
            add("valid", max(0, n - 2 - max_length), n - 2)
            add("test", max(0, n - 1 - max_length), n - 1)
        else:
            m = sum(t < valid_time for t in times)
            if m >= 2:
                add("train", max(0, m - 1 - max_length), m - 1)
            for k in range(1, n):
                if times[k] >= valid_time:
                    add("valid" if times[k] < test_time else "test", max(0, k - max_length), k)
        dropped["truncated"] += n - len(covered)
    return out, dropped, vocab


def _read(out: Path, split: str) -> list[tuple]:
    meta = json.loads((out / "metadata.json").read_text())
    if split not in meta["splits"]:
        return []
    frames = [pl.read_parquet(out / f) for f in meta["splits"][split]["files"]]
    rows = []
    for frame in frames:
        for r in frame.iter_rows(named=True):
            rows.append((r["user"], list(r["items"]), r["target"]))
    return rows


def _write_csv(path: Path, rows: list[tuple]) -> None:
    lines = ["user,item,timestamp"] + [",".join("" if v is None else str(v) for v in r)
                                       for r in rows]
    path.write_text("\n".join(lines) + "\n")


def _spec(tmp_path: Path, body: str) -> Path:
    spec = tmp_path / "spec.yaml"
    spec.write_text("kind: sequence\n" + body)
    return spec


@pytest.mark.parametrize("max_length,min_length", [(4, 3), (50, 5)])
def test_leave_last_out_equals_the_reference(tmp_path, max_length, min_length):
    rows = _events(0)
    # two CSV files: the input order (file, then line) breaks ties in time
    _write_csv(tmp_path / "a.csv", rows[:1700])
    _write_csv(tmp_path / "b.csv", rows[1700:])
    spec = _spec(tmp_path, f"max_length: {max_length}\nmin_length: {min_length}\n")
    report, lines = run_ingest(spec, [str(tmp_path / "a.csv"), str(tmp_path / "b.csv")],
                               tmp_path / "out", progress=False)
    want, dropped, vocab = _reference(rows, max_length, min_length)
    for split in SPLITS:
        assert _read(tmp_path / "out", split) == [(u, h, t) for u, h, t in want[split]], split
    assert report["events_dropped"] == {k: dropped[k] for k in report["events_dropped"]}
    assert report["rows_read"] == len(rows)
    assert report["rows_read"] == report["events_used"] + sum(report["events_dropped"].values())
    table = pl.read_parquet(tmp_path / "out" / "vocab" / "item.parquet")
    assert dict(zip(table["value"], table["id"])) == vocab
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert meta["task"] == "seq" and meta["num_items"] == len(vocab) + 1
    assert meta["name"] == "a" and meta["max_length"] == max_length
    assert any("events" in line for line in lines)


def test_time_split_equals_the_reference_on_parquet_integer_ids(tmp_path):
    rows = [(None if u is None else int(u[1:]), None if i is None else int(i[1:]), t)
            for u, i, t in _events(1)]
    # users whose first event is already a valid or test target: it has no history, no row
    rows += [(900, 1, 360), (900, 2, 370), (900, 1, 380), (901, 3, 320), (901, 4, 390)]
    frame = pa.table({"uid": pa.array([r[0] for r in rows], pa.int64()),
                      "iid": pa.array([r[1] for r in rows], pa.int64()),
                      "ts": pa.array([None if r[2] is None else float(r[2]) for r in rows])})
    pq.write_table(frame, tmp_path / "events.parquet")
    spec = _spec(tmp_path, "name: ev\ninput: {format: parquet}\nuser: uid\nitem: iid\ntime: ts\n"
                           "id_type: integer\nmax_length: 6\nmin_length: 2\n"
                           "split: {method: time, valid_time: 300, test_time: 350}\n")
    report, _ = run_ingest(spec, [str(tmp_path / "events.parquet")], tmp_path / "out",
                           progress=False)
    want, dropped, _ = _reference(rows, 6, 2, "time", 300, 350)
    for split in SPLITS:
        assert _read(tmp_path / "out", split) == want[split], split
    assert report["events_dropped"] == {k: dropped[k] for k in report["events_dropped"]}
    assert report["rows_read"] == report["events_used"] + sum(report["events_dropped"].values())


def test_dates_as_times_and_a_time_cut_off_as_a_date(tmp_path):
    _write_csv(tmp_path / "e.csv", [("a", "x", "2024-01-01"), ("a", "y", "2024-01-03"),
                                    ("a", "z", "2024-02-02"), ("a", "y", "2024-03-01")])
    spec = _spec(tmp_path, "min_length: 2\nsplit: {method: time, valid_time: 2024-02-01, "
                           "test_time: 2024-02-15}\n")
    run_ingest(spec, [str(tmp_path / "e.csv")], tmp_path / "out", progress=False)
    # y is the most frequent item (id 1); x, z by value (2, 3)
    assert _read(tmp_path / "out", "train") == [("a", [2], 1)]
    assert _read(tmp_path / "out", "valid") == [("a", [2, 1], 3)]
    assert _read(tmp_path / "out", "test") == [("a", [2, 1, 3], 1)]


def test_a_bad_value_is_one_line_naming_file_line_and_column(tmp_path):
    _write_csv(tmp_path / "e.csv", [(1, 2, 3), (1, "x7", 4), (1, 3, 5)])
    spec = _spec(tmp_path, "id_type: integer\nmin_length: 3\n")
    with pytest.raises(IngestError, match=r"e\.csv: line 3: column item: cannot parse as an "
                                          r"integer id.*'x7'"):
        run_ingest(spec, [str(tmp_path / "e.csv")], tmp_path / "out", progress=False)
    _write_csv(tmp_path / "e.csv", [(1, 2, 3), (1, 3, "soon")])
    with pytest.raises(IngestError, match=r"line 3: column timestamp: cannot parse as a number "
                                          r"or a date"):
        run_ingest(spec, [str(tmp_path / "e.csv")], tmp_path / "out", progress=False)
    (tmp_path / "f.csv").write_text("user,item\n1,2\n")
    with pytest.raises(IngestError, match=r"f\.csv: missing column\(s\) timestamp"):
        run_ingest(spec, [str(tmp_path / "f.csv")], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("body,message", [
    ("split: {valid_time: 5}\n", "split.valid_time: only for split.method: time"),
    ("split: {method: time, valid_time: 5}\n", "split.test_time: split.method: time needs it"),
    ("split: {method: time, valid_time: 9, test_time: 5}\n", "split.test_time: must not be "
                                                             "before"),
    ("split: {method: time, valid_time: soon, test_time: 5}\n", "split.valid_time: not a number"),
    ("min_length: 2\n", "min_length: leave_last_out takes a valid and a test item"),
    ("max_length: 0\n", "max_length: must be at least 1"),
    ("item: user\n", "user: the user, item and time columns must differ"),
])
def test_spec_mistakes_are_refused_in_one_line(tmp_path, body, message):
    with pytest.raises(ConfigError, match=message):
        run_ingest(_spec(tmp_path, body), [str(tmp_path)], tmp_path / "out", progress=False)


def test_cli_prints_the_accounting_and_no_traceback(tmp_path):
    _write_csv(tmp_path / "e.csv", [(1, 2, 3), (1, 3, 4), (1, 4, 5), (2, 2, 1)])
    spec = _spec(tmp_path, "min_length: 3\n")
    done = subprocess.run([sys.executable, "-m", "embedtrain", "ingest", str(spec), "--input",
                           str(tmp_path / "e.csv"), "--out", str(tmp_path / "out"), "--quiet"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "short_history 1" in done.stdout and "rows: train 0, valid 1, test 1" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "embedtrain", "ingest", str(spec), "--input",
                          str(tmp_path / "missing.csv"), "--out", str(tmp_path / "o2")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_ingesting_datagens_event_log_gives_datagens_data_set(tmp_path):
    """``datagen seq --events`` and ``ingest`` of that log agree row for row (ids mapped through
    the ingested vocabulary): the generator's splits are the ingestion's definition."""
    from embedtrain.datagen import SeqDataSpec, generate_seq

    spec = SeqDataSpec(users=2000, items=500, clusters=5, max_length=8, min_length=4, seed=3)
    generate_seq(spec, tmp_path / "gen", progress=False, events_dir=tmp_path / "gen",
                 events_format="csv")
    ingest_spec = _spec(tmp_path, "id_type: integer\nmax_length: 8\nmin_length: 4\n")
    run_ingest(ingest_spec, [str(tmp_path / "gen" / "events")], tmp_path / "ing", progress=False)
    table = pl.read_parquet(tmp_path / "ing" / "vocab" / "item.parquet")
    raw = dict(zip(table["id"].to_list(), table["value"].to_list()))
    for split in SPLITS:
        got = [(u, [raw[i] for i in h], raw[t])
               for u, h, t in _read(tmp_path / "ing", split)]
        assert got == _read(tmp_path / "gen", split), split
