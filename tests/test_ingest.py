"""``embedtrain ingest``: specs, splits, vocabularies, repairs, bad input, and the trainer contract.

Small inputs only: hand-written CSV/TSV/parquet of a few dozen rows for exact assertions, and one
20k-row synthetic TSV run through the CLI for the end-to-end contract.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq
import pytest

from embedtrain.config import ConfigError
from embedtrain.datagen.tsv import null_rate
from embedtrain.features import load_dataset_meta
from conftest import run_cli
from pipelines import kind_of
from pipelines.core.errors import IngestError
from pipelines.core.hashing import fnv1a64
from pipelines.tabular.passes import ingest
from pipelines.tabular.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted(p for p in (ROOT / "configs" / "ingest").glob("*.yaml")
               if kind_of(p) == "tabular")  # those: test_*graph*/test_ingest_xc
SPLITS = ("train", "valid", "test")


def embedtrain(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "embedtrain", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=timeout)


def spec_file(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def run(tmp_path: Path, spec_text: str, inputs: list, out: str = "out", **kw) -> dict:
    spec = load_spec(spec_file(tmp_path, spec_text))
    return ingest(spec, [str(i) for i in inputs], tmp_path / out, progress=False, **kw)


def read_split(out: Path, split: str) -> pl.DataFrame:
    meta = json.loads((out / "metadata.json").read_text())
    return pl.concat([pl.read_parquet(out / f) for f in meta["splits"][split]["files"]])


def assert_balanced(report: dict) -> None:
    """Nothing lost silently."""
    assert report["rows_read"] == report["rows_written_total"] + report["rows_dropped_total"]
    assert report["rows_written_total"] == sum(report["rows_written"].values())
    assert report["rows_dropped_total"] == sum(report["rows_dropped"].values())


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    lines = [",".join(header)] + [",".join("" if v is None else str(v) for v in r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


# A time-ordered CSV: t = row number, x grows with t, cat 'late' appears only after row 80.
TIME_CSV_SPEC = """
name: timed
input: {format: csv}
label: y
dense: [{name: x, standardize: true}]
sparse:
  - {name: cat, min_frequency: 2}
split: {method: time, column: t, valid_fraction: 0.1, test_fraction: 0.1}
"""


@pytest.fixture
def timed_csv(tmp_path: Path) -> Path:
    rows = [[t % 2, t, float(t), "late" if t >= 80 else ("a" if t % 3 else "b")]
            for t in range(100)]
    rows[5][3] = "rare"  # seen once in train: below min_frequency
    return write_csv(tmp_path / "timed.csv", ["y", "t", "x", "cat"], rows)


# --- specs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_shipped_ingest_specs_load(path):
    spec = load_spec(path)
    assert spec.dense and spec.sparse and spec.name


@pytest.mark.parametrize("text, key, words", [
    ("label: y\ndense: [{name: x}]\nsparse: [{name: x}]\ninput: {format: csv}",
     "sparse[0].name", "column 'x' is named twice (also dense[0].name)"),
    ("label: y\nsparse: [{name: c, encoding: hash}]\ninput: {format: csv}",
     "sparse[0].hash_buckets", "hash_buckets >= 2"),
    ("label: y\nsparse: [{name: c, multi_hot: true}]\ninput: {format: csv}",
     "sparse[0].separator", "needs a list separator"),
    ("label: label\nsparse: [{name: C99}]", "sparse[0].name", "not a Criteo column"),
    ("label: y\nsparse: [{name: c, encoding: pre_encoded, dtype: integer}]\ninput: {format: csv}",
     "sparse[0].num_embeddings", "pre_encoded needs num_embeddings"),
    ("label: y\nsparse: [{name: c, encodng: hash}]\ninput: {format: csv}",
     "sparse[0].encodng", "unknown key (did you mean 'encoding'?)"),
])
def test_bad_spec_is_one_line_naming_file_and_key(tmp_path, text, key, words):
    path = spec_file(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}: {key}: ") and words in message


# --- end to end: datagen TSV -> CLI ingest -> trainer's reader -> train --------------------------

ROWS = 20_000


@pytest.fixture(scope="module")
def ingested(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("e2e_ingest")
    r = run_cli("datagen", "ctr", "--rows", str(ROWS), "--out", str(root / "raw"),
                "--format", "tsv")
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli("ingest", str(ROOT / "configs/ingest/criteo_synthetic.yaml"),
                "--input", str(root / "raw" / "*.tsv"), "--out", str(root / "data"),
                "--set", "output.rows_per_file=6000", "--set", "output.rows_per_row_group=2048")
    assert r.returncode == 0, r.stderr[-3000:]
    return root / "raw", root / "data", r


@pytest.mark.slow
def test_cli_ingest_output_contract(ingested):
    raw, out, r = ingested
    assert "read 20,000 rows" in r.stdout and str(out) in r.stdout
    shown = [line.split("\r")[-1] for line in r.stderr.split("\n")]  # each bar's final redraw
    stats = [line for line in shown if line.startswith("ingest: row statistics: ")]
    assert len(stats) == 1 and stats[0].startswith("ingest: row statistics: 20000 rows [")
    assert stats[0].endswith(" rows/s]")
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["format_version"] == 1 and meta["dense_transform"] == "none"
    assert meta["label"] == "label" and meta["dense"] == [f"I{i}" for i in range(1, 14)]
    assert [s["name"] for s in meta["sparse"]] == [f"C{i}" for i in range(1, 27)]
    report = json.loads((out / "ingest_report.json").read_text())
    assert_balanced(report)
    assert report["rows_read"] == ROWS and report["rows_dropped_total"] == 0
    assert 0.75 < report["rows_written"]["train"] / ROWS < 0.85
    for split in SPLITS:
        assert meta["splits"][split]["rows"] == report["rows_written"][split]
        rows = 0
        for f in meta["splits"][split]["files"]:
            assert f.startswith(f"{split}/part-")
            md = pq.ParquetFile(out / f).metadata
            sizes = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
            assert md.num_rows <= 6000 and all(s <= 2048 for s in sizes)
            rows += md.num_rows
        assert rows == meta["splits"][split]["rows"]
    assert len(meta["splits"]["train"]["files"]) == -(-report["rows_written"]["train"] // 6000)
    # null rates as generated (2-5% per column); the multi-hot lists have no extra blanks
    for name in ("I1", "I7", "C2", "C13"):
        assert abs(report["features"][name]["null_rate"] - null_rate(name)) < 0.01, name
    assert report["repairs"]["dense_null_filled"]["I1"] > 0


@pytest.mark.slow
def test_output_types_ranges_and_reader(ingested):
    from embedtrain.data.reader import ParquetBatchReader

    _, out, _ = ingested
    meta = load_dataset_meta(out)
    sizes = {s.name: s.num_embeddings for s in meta.features.sparse}
    train = pq.read_table([out / f for f in json.loads(
        (out / "metadata.json").read_text())["splits"]["train"]["files"]][0])
    assert train.schema.field("label").type == pa.float32()
    for name in meta.features.dense:
        assert train.schema.field(name).type == pa.float32() and train[name].null_count == 0
    for s in meta.features.sparse:
        col = train[s.name].combine_chunks()
        if s.multi_hot:
            assert pa.types.is_large_list(col.type) or pa.types.is_list(col.type)
            assert col.type.value_type == pa.int64() and s.max_length == 5
            ids = col.values.to_numpy()
        else:
            assert col.type == pa.int64()
            ids = col.to_numpy()
        assert ids.min() >= 0 and ids.max() < sizes[s.name], s.name
    reader = ParquetBatchReader(meta.files("train"), meta.features, batch_size=512)
    batch = next(iter(reader))
    assert batch.dense_features.shape == (512, 13) and batch.labels.shape == (512,)
    kjt = batch.sparse_features
    assert kjt.keys() == [f"C{i}" for i in range(1, 27)]
    assert kjt.lengths().shape == (26 * 512,)
    assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    assert reader.num_rows == meta.split_rows["train"]


@pytest.mark.slow
def test_vocabulary_matches_training_ids(ingested):
    """Each id's count in the training split is its vocabulary count; the rest went to id 0."""
    _, out, _ = ingested
    train = read_split(out, "train")
    for name in ("C3", "C26"):
        vocab = pl.read_parquet(out / "vocab" / f"{name}.parquet")
        assert vocab["id"].to_list() == list(range(1, vocab.height + 1))
        assert vocab["count"].min() >= 2 and vocab["count"].is_sorted(descending=True)
        ids = train[name].explode() if train.schema[name] != pl.Int64 else train[name]
        seen = ids.drop_nulls().value_counts().filter(pl.col(name) > 0).sort(name)
        assert seen[name].to_list() == vocab["id"].to_list()
        assert seen["count"].cast(pl.Int64).to_list() == vocab["count"].to_list()


@pytest.mark.slow
def test_standardised_with_training_statistics(ingested):
    _, out, _ = ingested
    train, valid = read_split(out, "train"), read_split(out, "valid")
    stats = json.loads((out / "metadata.json").read_text())["dense_stats"]
    for name in ("I1", "I5"):
        assert abs(train[name].mean()) < 1e-4 and abs(train[name].std() - 1) < 1e-3
        assert valid[name].mean() != pytest.approx(0.0, abs=1e-6)  # not re-centred on valid
        assert stats[name]["standardized"] and stats[name]["std"] > 0


@pytest.mark.slow
def test_train_on_ingested_output(ingested, tmp_path):
    _, out, _ = ingested
    r = run_cli("train", str(ROOT / "configs/dlrm_synthetic.yaml"),
                "--out", str(tmp_path / "run"),
                "--no-progress", "--set", "train.max_steps=5", "--set", f"data.path={out}",
                "--set", "train.eval_every=0", "--set", "data.batch_size=256",
                "--set", "model.embedding_dim=8", "--set", "model.bottom_mlp=[16,8]")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["dataset"] == "synthetic_ctr_ingested" and 0 <= summary["auc"] <= 1


# --- splits and vocabularies ---------------------------------------------------------------------

def test_time_split_vocab_and_standardisation_use_train_only(tmp_path, timed_csv):
    report = run(tmp_path, TIME_CSV_SPEC, [timed_csv])
    assert_balanced(report)
    assert report["rows_written"] == {"train": 80, "valid": 10, "test": 10}
    assert report["split"]["valid_start"] == 80 and report["split"]["test_start"] == 90
    out = tmp_path / "out"
    vocab = pl.read_parquet(out / "vocab" / "cat.parquet")
    assert sorted(vocab["value"].to_list()) == ["a", "b"]  # not 'late' (valid/test), not 'rare'
    valid, train = read_split(out, "valid"), read_split(out, "train")
    assert valid["cat"].to_list() == [0] * 10  # 'late' only appears after train: unknown
    assert report["features"]["cat"]["oov_rate"]["valid"] == 1.0
    assert report["features"]["cat"]["oov_rate"]["train"] == pytest.approx(1 / 80)
    x = np.arange(80, dtype=np.float64)
    assert train["x"].to_numpy() == pytest.approx((x - x.mean()) / x.std(), abs=1e-5)
    assert valid["x"].to_numpy() == pytest.approx((np.arange(80, 90) - x.mean()) / x.std(),
                                                   abs=1e-5)


def test_progress_shows_each_phase_on_stderr(tmp_path, timed_csv, capsys):
    spec = load_spec(spec_file(tmp_path, TIME_CSV_SPEC))
    report = ingest(spec, [str(timed_csv)], tmp_path / "out", progress=True)
    out, err = capsys.readouterr()
    shown = [line.split("\r")[-1] for line in err.rstrip("\n").split("\n")]  # final redraws
    assert out == "" and [p["phase"] for p in report["phases"]] == [
        "split cut-offs", "row statistics", "value counts", "write"]
    assert len(shown) == 4 and shown[0].startswith("ingest: split cut-offs: ")
    assert shown[0].endswith(" s")  # no row count: the phase's time
    for line, name, rows in zip(shown[1:], ["row statistics", "value counts", "write"],
                                [100, 100, 100]):
        assert line.startswith(f"ingest: {name}: {rows} rows [") and line.endswith(" rows/s]")
    ingest(spec, [str(timed_csv)], tmp_path / "out", progress=False)
    assert capsys.readouterr() == ("", "")


def test_time_split_explicit_boundaries_and_row_order(tmp_path, timed_csv):
    spec = TIME_CSV_SPEC.replace("valid_fraction: 0.1, test_fraction: 0.1",
                                 "boundaries: [50, 95]")
    report = run(tmp_path, spec, [timed_csv])
    assert report["rows_written"] == {"train": 50, "valid": 45, "test": 5}
    by_row = TIME_CSV_SPEC.replace("column: t, ", "").replace("test_fraction: 0.1",
                                                              "test_fraction: 0.2")
    report = run(tmp_path, by_row, [timed_csv], out="by_row")
    assert report["rows_written"] == {"train": 70, "valid": 10, "test": 20}
    test_x, train_x = (read_split(tmp_path / "by_row", s)["x"] for s in ("test", "train"))
    assert test_x.is_sorted() and test_x.min() > train_x.max()  # the newest rows, in order


def test_time_split_on_a_parquet_datetime_column(tmp_path):
    import datetime as dt

    days = [dt.datetime(2024, 1, 1 + i // 10, i % 10) for i in range(100)]
    days.insert(3, None)  # no time: cannot be placed, dropped and counted
    path = tmp_path / "events.parquet"
    pq.write_table(pa.table({"y": np.arange(101) % 2, "ts": days,
                             "item": [f"i{i % 7}" for i in range(101)]}), path)
    spec = """
input: {format: parquet}
label: y
sparse: [{name: item}]
split: {method: time, column: ts, valid_fraction: 0.1, test_fraction: 0.1}
"""
    report = run(tmp_path, spec, [path])
    assert_balanced(report)
    assert report["rows_dropped"] == {"null_split_key": 1}
    assert report["rows_written"] == {"train": 80, "valid": 10, "test": 10}
    epoch = dt.datetime(1970, 1, 1)
    assert report["split"]["valid_start"] == (dt.datetime(2024, 1, 9) - epoch).total_seconds()


def test_row_order_spans_files_in_natural_order(tmp_path):
    rows = [[t % 2, float(t)] for t in range(100)]
    write_csv(tmp_path / "day_2.csv", ["y", "x"], rows[:60])  # day_2 sorts before day_10
    write_csv(tmp_path / "day_10.csv", ["y", "x"], rows[60:])
    spec = """
input: {format: csv}
label: y
dense: [{name: x}]
split: {method: time, valid_fraction: 0.1, test_fraction: 0.1}
"""
    report = run(tmp_path, spec, [tmp_path / "day_*.csv"])
    assert report["inputs"] == [str(tmp_path / "day_2.csv"), str(tmp_path / "day_10.csv")]
    out = {s: read_split(tmp_path / "out", s)["x"].to_list() for s in SPLITS}
    assert out == {"train": list(range(80)), "valid": list(range(80, 90)),
                   "test": list(range(90, 100))}


def test_hash_split_is_stable_and_keeps_keys_together(tmp_path):
    rows = [[i % 2, f"user{i % 37}", float(i), f"c{i % 5}"] for i in range(400)]
    data = write_csv(tmp_path / "users.csv", ["y", "user", "x", "cat"], rows)
    spec = """
input: {format: csv}
label: y
dense: [{name: x}]
sparse: [{name: cat}, {name: user}]
split: {method: hash, column: user, valid_fraction: 0.2, test_fraction: 0.2, seed: 3}
"""
    a = run(tmp_path, spec, [data], out="a")
    b = run(tmp_path, spec, [data], out="b")
    assert a["rows_written"] == b["rows_written"]
    for split in SPLITS:
        assert read_split(tmp_path / "a", split).equals(read_split(tmp_path / "b", split))
    users = {s: set((read_split(tmp_path / "a", s)["x"].cast(pl.Int64) % 37).to_list())
             for s in SPLITS}
    assert not (users["train"] & users["valid"]) and not (users["train"] & users["test"])
    assert all(users.values())


def test_hash_encoding_follows_the_documented_formula(tmp_path):
    data = write_csv(tmp_path / "h.csv", ["y", "c", "n"], [[1, "68fd1e64", 7], [0, None, 123]])
    spec = """
input: {format: csv}
label: y
sparse:
  - {name: c, encoding: hash, hash_buckets: 1000}
  - {name: n, dtype: integer, encoding: hash, hash_buckets: 50}
split: {valid_fraction: 0.0, test_fraction: 0.0}
"""
    run(tmp_path, spec, [data])
    out = read_split(tmp_path / "out", "train")

    def bucket(text: str, n: int) -> int:
        z = (int(fnv1a64(pa.array([text]))[0]) + 0x9E3779B97F4A7C15) % 2**64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        return 1 + (z ^ (z >> 31)) % (n - 1)

    assert out["c"].to_list() == [bucket("68fd1e64", 1000), 0]
    assert out["n"].to_list() == [bucket("7", 50), bucket("123", 50)]
    meta = load_dataset_meta(tmp_path / "out")
    assert [s.num_embeddings for s in meta.features.sparse] == [1000, 50]


# --- bad input: a repair counted in the report, or a one-line error naming the file ---------------

def test_null_label_unparsable_and_null_values(tmp_path):
    rows = [[1, 1.0, "a"], [None, 2.0, "a"], [0, "abc", "b"], [1, None, None], [3, 1.0, "a"],
            [0, 4.0, "b"]]
    data = write_csv(tmp_path / "bad.csv", ["y", "x", "c"], rows)
    spec = """
input: {format: csv}
label: y
dense: [{name: x, fill_null: -1}]
sparse: [{name: c}]
split: {valid_fraction: 0.0, test_fraction: 0.0}
"""
    report = run(tmp_path, spec, [data])
    assert_balanced(report)
    assert report["rows_dropped"] == {"label_out_of_range": 1, "null_label": 1,
                                      "unparsable_value": 1}
    assert report["rows_dropped_by_column"]["unparsable_value"] == {"x": 1}
    assert report["repairs"] == {"dense_null_filled": {"x": 1},
                                 "categorical_null_to_id_0": {"c": 1}}
    out = read_split(tmp_path / "out", "train")
    assert out["x"].to_list() == [1.0, -1.0, 4.0] and out["c"].to_list() == [1, 0, 2]
    assert report["features"]["c"]["null_rate"] == pytest.approx(1 / 3)

    strict = spec + "on_invalid: error\n"
    with pytest.raises(IngestError) as err:
        run(tmp_path, strict, [data], out="strict")
    assert str(err.value) == (f"{data}: line 3: column y: null label (value None; on_invalid: "
                              "drop would drop and count such rows)")
    assert not (tmp_path / "strict" / "metadata.json").exists()


def test_missing_column_in_one_of_several_files(tmp_path):
    good = write_csv(tmp_path / "a.csv", ["y", "x"], [[1, 2.0]])
    bad = write_csv(tmp_path / "b.csv", ["y", "z"], [[1, 2.0]])
    spec = "input: {format: csv}\nlabel: y\ndense: [{name: x}]\n"
    with pytest.raises(IngestError, match=rf"^{bad}: missing column\(s\) x \(header has: y, z\)$"):
        run(tmp_path, spec, [tmp_path / "*.csv"])
    assert good.exists()


def test_csv_files_must_share_their_header(tmp_path):
    write_csv(tmp_path / "a.csv", ["y", "x"], [[1, 2.0]])
    swapped = write_csv(tmp_path / "b.csv", ["x", "y"], [[2.0, 1]])
    spec = "input: {format: csv}\nlabel: y\ndense: [{name: x}]\n"
    with pytest.raises(IngestError, match=rf"^{swapped}: header differs from .*a.csv's"):
        run(tmp_path, spec, [tmp_path / "*.csv"])


def test_more_rows_than_one_job_can_number(tmp_path, monkeypatch):
    import pipelines.tabular.read

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"y": [1.0] * 100, "x": np.arange(100.0)}), path)
    monkeypatch.setattr(pipelines.tabular.read, "MAX_ROWS", 99)  # Polars' limit is 2**32 - 1
    spec = "input: {format: parquet}\nlabel: y\ndense: [{name: x}]\n"
    with pytest.raises(IngestError, match=rf"^{path}: 1 input file\(s\) hold 100 rows, over the 99"):
        run(tmp_path, spec, [path])


def test_wrong_type_in_parquet(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"y": [1, 0], "x": ["1.5", "2"], "c": ["a", "b"]}), path)
    spec = "input: {format: parquet}\nlabel: y\ndense: [{name: x}]\nsparse: [{name: c}]\n"
    with pytest.raises(IngestError, match=rf"^{path}: column x: expected numbers, got string; "
                       "numbers stored as strings: set cast: float on the dense feature$"):
        run(tmp_path, spec, [path])
    spec = "input: {format: parquet}\nlabel: y\nsparse: [{name: c, dtype: integer}]\n"
    with pytest.raises(IngestError, match=rf"^{path}: column c holds string, spec says dtype: "
                       "integer; remove dtype to use the file's type, or set dtype: string$"):
        run(tmp_path, spec, [path])


def test_parquet_lists_nulls_and_empty_lists(tmp_path):
    path = tmp_path / "l.parquet"
    pq.write_table(pa.table({
        "y": pa.array([True, False, True, False]),
        "x": pa.array([1.0, float("nan"), None, 4.0]),
        "tags": pa.array([["a", "b", "a"], [], None, ["b", None, "c"]]),
        "more": pa.array([["p"], [], ["q"], None]),
    }), path)
    spec = """
input: {format: parquet}
label: y
dense: [{name: x, non_finite: fill}]
sparse:
  - {name: tags, multi_hot: true, max_length: 2}
  - {name: more, multi_hot: true, empty_list: oov}
split: {valid_fraction: 0.0, test_fraction: 0.0}
"""
    report = run(tmp_path, spec, [path])
    assert_balanced(report)
    out = read_split(tmp_path / "out", "train")
    vocab = pl.read_parquet(tmp_path / "out/vocab/tags.parquet").select("value", "id")
    vocab = dict(vocab.iter_rows())
    assert vocab == {"b": 1, "a": 2, "c": 3}  # counted after truncation: b twice, a and c once
    assert out["tags"].to_list() == [[2, 1], [], [], [1, 3]]  # truncated to 2; null list -> []
    assert out["more"].to_list() == [[1], [0], [2], [0]]  # empty and null lists -> [0]
    assert out["x"].to_list() == [1.0, 0.0, 0.0, 4.0]
    assert report["repairs"]["list_truncated"] == {"tags": 1}
    assert report["repairs"]["empty_list_to_id_0"] == {"more": 2}
    assert report["repairs"]["dense_non_finite_filled"] == {"x": 1}
    assert report["repairs"]["dense_null_filled"] == {"x": 1}
    meta = load_dataset_meta(tmp_path / "out")
    assert [(s.multi_hot, s.max_length) for s in meta.features.sparse] == [(True, 2), (True, 1)]


def test_pre_encoded_ids_out_of_range(tmp_path):
    rows = [[1, 0, "1|2"], [0, 9, "3"], [1, -1, ""], [0, 10, "1"], [1, 4, "2|7"], [0, None, "1"]]
    data = write_csv(tmp_path / "ids.csv", ["y", "item", "hist"], rows)
    spec = """
input: {format: csv}
label: y
sparse:
  - {name: item, dtype: integer, encoding: pre_encoded, num_embeddings: 10}
  - {name: hist, dtype: integer, encoding: pre_encoded, num_embeddings: 5, multi_hot: true,
     separator: "|"}
split: {valid_fraction: 0.0, test_fraction: 0.0}
"""
    report = run(tmp_path, spec, [data])
    assert_balanced(report)
    assert report["rows_dropped"] == {"id_out_of_range": 3, "null_id": 1}
    assert report["rows_dropped_by_column"]["id_out_of_range"] == {"hist": 1, "item": 2}
    out = read_split(tmp_path / "out", "train")
    assert out["item"].to_list() == [0, 9] and out["hist"].to_list() == [[1, 2], [3]]
    with pytest.raises(IngestError, match=rf"^{data}: line 4: column item: id out of range "
                                          r"\(value '-1'"):
        run(tmp_path, spec + "on_invalid: error\n", [data], out="strict")


def test_truncated_parquet_file(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"y": [1.0] * 100, "x": np.arange(100.0)}), path)
    path.write_bytes(path.read_bytes()[:-20])
    spec = "input: {format: parquet}\nlabel: y\ndense: [{name: x}]\n"
    with pytest.raises(IngestError, match=rf"^{path}: not a readable parquet file \(truncated"):
        run(tmp_path, spec, [path])


def test_empty_inputs(tmp_path):
    spec = "input: {format: csv}\nlabel: y\ndense: [{name: x}]\n"
    with pytest.raises(IngestError, match=r"nothing\*\.csv: no input files match$"):
        run(tmp_path, spec, [tmp_path / "nothing*.csv"])
    header_only = write_csv(tmp_path / "h.csv", ["y", "x"], [])
    with pytest.raises(IngestError, match=rf"^{header_only}: no rows to ingest"):
        run(tmp_path, spec, [header_only])
    (tmp_path / "e.tsv").write_text("")
    with pytest.raises(IngestError, match=r"e.tsv: no rows to ingest"):
        run(tmp_path, "label: label\ndense: [{name: I1}]\n", [tmp_path / "e.tsv"])


def test_wrong_field_count_in_criteo_tsv(tmp_path):
    path = tmp_path / "x.tsv"
    path.write_text("1,2,3\n")
    with pytest.raises(IngestError, match=rf"^{path}: not Criteo TSV: line 1 has 1 "
                                          "tab-separated fields, and none of the first 1 line"):
        run(tmp_path, "label: label\ndense: [{name: I1}]\n", [path])


def test_refuses_foreign_output_dir_and_replaces_own(tmp_path, timed_csv):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(IngestError, match="not empty and not an earlier ingest output"):
        run(tmp_path, TIME_CSV_SPEC, [timed_csv])
    run(tmp_path, TIME_CSV_SPEC, [timed_csv], out="own")
    report = run(tmp_path, TIME_CSV_SPEC.replace("test_fraction: 0.1", "test_fraction: 0.3"),
                 [timed_csv], out="own")
    assert load_dataset_meta(tmp_path / "own").split_rows["test"] == 30
    assert report["rows_written"]["test"] == 30


@pytest.mark.slow
def test_cli_errors_are_one_line_with_exit_2(tmp_path, timed_csv):
    spec = spec_file(tmp_path, TIME_CSV_SPEC.replace("name: cat,", "name: x,"))
    r = embedtrain("ingest", str(spec), "--input", str(timed_csv), "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"embedtrain ingest: error: {spec}: sparse[0].name: column 'x' is named twice "
        "(also dense[0].name)"]
    spec = spec_file(tmp_path, TIME_CSV_SPEC, name="ok.yaml")
    r = embedtrain("ingest", str(spec), "--input", str(tmp_path / "none" / "*.csv"),
                   "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"embedtrain ingest: error: {tmp_path}/none/*.csv: no input files match"]
    assert not (tmp_path / "o").exists()


def test_criteo_lines_with_a_wrong_field_count_are_dropped_and_counted(tmp_path):
    """A short line is not padded with nulls, a long one does not stop a drop job: each is
    dropped under wrong_field_count and the totals stay exact; on_invalid: error names the line."""
    from embedtrain.testing import tiny_ctr_tsv

    (path,) = tiny_ctr_tsv(tmp_path / "raw", rows=300)
    lines = path.read_text().splitlines()
    lines[6] = "\t".join(lines[6].split("\t")[:20])  # line 7: 20 of 40 fields
    lines[9] = lines[9] + "\textra\tfields"  # line 10: 42 fields
    lines[12] = lines[12] + "\r"  # a CRLF line is a good line
    path.write_text("\n".join(lines) + "\n")
    spec = load_spec(ROOT / "configs" / "ingest" / "criteo_synthetic.yaml")
    report = ingest(spec, [str(path)], tmp_path / "out", progress=False)
    assert report["rows_read"] == 300
    assert report["rows_dropped"] == {"wrong_field_count": 2}
    assert_balanced(report)
    written = sum(len(read_split(tmp_path / "out", s)) for s in SPLITS)
    assert written == 298
    spec = load_spec(ROOT / "configs" / "ingest" / "criteo_synthetic.yaml", ["on_invalid=error"])
    with pytest.raises(IngestError) as err:
        ingest(spec, [str(path)], tmp_path / "out2", progress=False)
    assert str(err.value) == (f"{path}: line 7: 20 tab-separated field(s), criteo_tsv expects 40 "
                              "(on_invalid: drop would drop and count such lines)")


# --- frequency thresholds on a datagen set: configs/ingest/ctr_fm.yaml ----------------------------

def test_ctr_fm_spec_thresholds_ids_and_keeps_the_datagen_splits(tmp_path):
    """Re-encoding a datagen data set with ``min_frequency`` keeps every row in its split, in
    order, and maps a value to a shared id 0 exactly when the training split holds it fewer times
    than the threshold; the kept values get distinct ids (checked per feature, lists included)."""
    threshold = 40
    r = run_cli("datagen", "ctr", "--structure", "fm", "--rows", "20000", "--out",
                str(tmp_path / "raw"))
    assert r.returncode == 0, r.stderr[-2000:]
    text = (ROOT / "configs/ingest/ctr_fm.yaml").read_text()
    assert text.count("min_frequency: 300") == 26
    spec = tmp_path / "ctr_fm.yaml"  # the shipped spec at a threshold 20k rows can show
    spec.write_text(text.replace("min_frequency: 300", f"min_frequency: {threshold}"))
    r = run_cli("ingest", str(spec), "--input", str(tmp_path / "raw" / "*" / "*.parquet"),
                "--out", str(tmp_path / "data"))
    assert r.returncode == 0, r.stderr[-3000:]
    raw_meta = json.loads((tmp_path / "raw" / "metadata.json").read_text())
    meta = json.loads((tmp_path / "data" / "metadata.json").read_text())

    def split(root: Path, m: dict, name: str) -> pa.Table:
        return pa.concat_tables([pq.read_table(root / f) for f in m["splits"][name]["files"]])

    raw = {s: split(tmp_path / "raw", raw_meta, s) for s in ("train", "valid", "test")}
    new = {s: split(tmp_path / "data", meta, s) for s in raw}
    for s in raw:
        assert new[s].num_rows == raw[s].num_rows
        assert new[s]["label"].to_pylist() == raw[s]["label"].to_pylist()  # the same rows, in order

    def flat(col) -> np.ndarray:
        col = col.combine_chunks()
        nested = pa.types.is_list(col.type) or pa.types.is_large_list(col.type)
        values = pa.compute.list_flatten(col) if nested else col
        return values.to_numpy(zero_copy_only=False)

    for i, feature in enumerate(meta["sparse"]):
        name = feature["name"]
        counts = np.bincount(flat(raw["train"][name]))
        kept = np.flatnonzero(counts >= threshold)
        assert feature["num_embeddings"] == len(kept) + 1
        for s in raw:
            before, after = flat(raw[s][name]), flat(new[s][name])
            frequent = np.isin(before, kept)
            assert np.array_equal(after != 0, frequent), (s, name)
            pairs = np.unique(np.stack([before[frequent], after[frequent]]), axis=1)
            assert len(np.unique(pairs[0])) == len(np.unique(pairs[1])) == pairs.shape[1]
            assert after.max(initial=0) < feature["num_embeddings"]


def test_a_split_key_the_method_does_not_use_is_refused(tmp_path):
    """Issue 34: ``seed`` with ``method: time`` meant nothing and was accepted silently."""
    path = spec_file(tmp_path, TIME_CSV_SPEC.replace("test_fraction: 0.1}",
                                                     "test_fraction: 0.1, seed: 7}"))
    with pytest.raises(ConfigError, match=r"split\.seed: only for method: hash \(method: time "
                                          r"draws no hash; remove it\)"):
        load_spec(path)
    assert load_spec(spec_file(tmp_path, TIME_CSV_SPEC)).split.seed is None
