"""Scoring raw rows (``embedtrain predict --raw``) against ingesting them and scoring the result.

The reference is the slow path a user takes without ``--raw``: ``embedtrain ingest`` the raw
rows (here a file split puts the file to score in the test split, so the ingested test files
hold exactly its kept rows, in order), then ``embedtrain predict`` the ingested rows. ``--raw``
must give the same scores bit for bit (the same batches: ``--batch-size`` valid rows at a time),
skip exactly the rows ingestion drops, with their reasons, and carry ``--keep`` columns.
"""

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from embedtrain.export.export import export_run
from embedtrain.export.predict import predict
from pipelines import run_ingest
from conftest import run_cli
from test_export import TINY, _train

ROOT = Path(__file__).resolve().parent.parent
BATCH = 96  # several batches per file, none aligned with the invalid rows

# Every encoding and dense transform of the tabular job, and a raw-id feature on a dynamic table.
CSV_SPEC = """
name: shop
input: {format: csv}
label: clicked
dense:
  - {name: price, log1p: true, standardize: true}
  - {name: rating, clip_min: 1.0, clip_max: 4.5, standardize: true, fill_null: 3.0}
sparse:
  - {name: city, min_frequency: 2}
  - {name: device, encoding: hash, hash_buckets: 37}
  - {name: age, bucketize: [18, 30, 45, 60]}
  - {name: tags, multi_hot: true, separator: "|", max_length: 3}
  - {name: user, encoding: raw}
split: {method: files, files: {valid: "*valid*", test: "*serve*"}}
"""
DYNAMIC = """
data: {{path: {data}, batch_size: 128, eval_batch_size: 512, shuffle: false}}
model: {{embedding_dim: 8, bottom_mlp: [16, 8], top_mlp: [16, 1]}}
train: {{max_steps: 12, eval_every: 0, checkpoint_every: 0, progress: false}}
tables:
  - {{tables: [t_user], capacity: 60, eviction: lru}}
"""
HEADER = ["request_id", "clicked", "price", "rating", "city", "device", "age", "tags", "user"]


def _shop_rows(n: int, seed: int, first_id: int) -> list[list]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        city = f"c{min(int(rng.zipf(1.5)), 40)}"
        user = int(rng.integers(0, 200)) * 1_000_003 + 7
        price = round(float(rng.lognormal(3, 1)), 2) if rng.random() > 0.05 else None
        rating = round(float(rng.uniform(0, 5)), 1) if rng.random() > 0.1 else None
        tags = "|".join(f"t{int(t)}" for t in rng.integers(0, 12, int(rng.integers(0, 5))))
        logit = (0.8 * (city in ("c1", "c2")) + 0.3 * ((user // 1_000_003) % 3 == 0)
                 - 0.2 * (rating or 3))
        clicked = int(rng.random() < 1 / (1 + np.exp(-logit)))
        rows.append([f"r{first_id + i}", clicked, price, rating, city,
                     f"d{int(rng.integers(0, 90))}", int(rng.integers(10, 80)), tags, user])
    return rows


def _write_csv(path: Path, rows: list[list], header: list[str] = HEADER) -> Path:
    lines = [",".join(header)]
    lines += [",".join("" if v is None else str(v) for v in r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def _ingest(spec_text: str, inputs: list[Path], out: Path, *overrides: str) -> dict:
    spec = out.parent / f"{out.name}.yaml"
    spec.write_text(spec_text)
    report, _ = run_ingest(spec, [str(p) for p in inputs], out, overrides=overrides,
                           progress=False)
    return report


def _scores(path: Path) -> np.ndarray:
    return pq.read_table(path).column("logit").to_numpy()


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    """A CSV data set (vocab, hash, bucketize, a list, log1p/clip/standardise, raw ids on a
    dynamic table) ingested, a run on it exported, and the raw file to score: its test split."""
    root = tmp_path_factory.mktemp("shop")
    _write_csv(root / "train.csv", _shop_rows(2400, 0, 0))
    _write_csv(root / "valid.csv", _shop_rows(200, 1, 10_000))
    rows = _shop_rows(500, 2, 20_000)
    rows[7][2] = "abc"                     # unparsable price: dropped by ingestion
    rows[100][8] = -5                      # a raw id below 0: dropped
    rows[101][4] = None                    # a null category: id 0, kept
    rows[250][6] = "old"                   # an unparsable bucketized value: bucket 0, kept
    serve = _write_csv(root / "serve.csv", rows)
    data = root / "data"
    report = _ingest(CSV_SPEC, [root / "train.csv", root / "valid.csv", serve], data)
    config = root / "dynamic.yaml"
    config.write_text(DYNAMIC.format(data=data))
    r = run_cli("train", str(config), "--out", str(root / "run"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = export_run(root / "run", root / "export", progress=False).out
    return root, data, serve, out, report


def test_raw_csv_rows_score_as_their_ingested_rows_bit_for_bit(shop, tmp_path):
    root, data, serve, export, report = shop
    manifest = json.loads((export / "model.json").read_text())
    encodings = {f["name"]: f["encoding"] for f in manifest["features"]["sparse"]}
    assert encodings == {"city": "vocab", "device": "hash", "age": "bucketize", "tags": "vocab",
                         "user": "raw"}
    assert any(t.get("id_map") for t in manifest["tables"])  # the dynamic table's raw ids
    ingested = predict(export, [str(data / "test")], tmp_path / "a.parquet", batch_size=BATCH,
                       progress=False)
    raw = predict(export, [str(serve)], tmp_path / "b.parquet", batch_size=BATCH, raw=True,
                  keep=["request_id"], progress=False)
    a, b = pq.read_table(tmp_path / "a.parquet"), pq.read_table(tmp_path / "b.parquet")
    assert raw.rows == ingested.rows == 498 and b.num_rows == 498
    assert np.array_equal(a.column("logit").to_numpy(), b.column("logit").to_numpy())
    assert np.array_equal(a.column("score").to_numpy(), b.column("score").to_numpy())
    assert a.column("clicked") == b.column("clicked") and raw.metrics == ingested.metrics
    # the rows ingestion dropped, and only those, are not scored: counted and listed
    assert report["rows_dropped"] == {"unparsable_value": 1, "raw_id_out_of_range": 1}
    assert raw.invalid == {"unparsable_value (price)": 1, "raw_id_out_of_range (user)": 1}
    listed = pq.read_table(raw.invalid_file).to_pylist()
    assert [(r["row"], r["line"], r["reason"]) for r in listed] == [
        (7, 9, "unparsable_value"), (100, 102, "raw_id_out_of_range")]
    kept = [f"r{20_000 + i}" for i in range(500) if i not in (7, 100)]
    assert b.column("request_id").to_pylist() == kept
    # scores written again to the same file, with no invalid rows: no stale list beside them
    again = predict(export, [str(data / "test")], tmp_path / "b.parquet", progress=False)
    assert again.invalid_file is None and not raw.invalid_file.exists()


def test_raw_rows_without_labels_and_one_line_errors(shop, tmp_path):
    root, data, serve, export, _ = shop
    unlabelled = _drop_column(serve, "clicked", tmp_path / "unlabelled.csv")
    r = predict(export, [str(unlabelled)], tmp_path / "u.parquet", batch_size=BATCH, raw=True,
                progress=False)
    assert r.metrics == {} and "clicked" not in pq.read_table(tmp_path / "u.parquet").schema.names
    assert np.array_equal(_scores(tmp_path / "u.parquet"),
                          _scores(_reference(export, data, tmp_path)))
    # --on-invalid error: the first invalid row, in one line, exit 2
    out = tmp_path / "e.parquet"
    r = run_cli("predict", str(export), "--input", str(serve), "--out", str(out), "--raw",
                "--on-invalid", "error", "--no-progress")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{serve}: line 9: column price: unparsable value (value 'abc')" in r.stderr
    assert not out.exists()
    # a raw file without a feature's column
    _drop_column(serve, "city", tmp_path / "no_city.csv")
    r = run_cli("predict", str(export), "--input", str(tmp_path / "no_city.csv"), "--out",
                str(out), "--raw", "--no-progress")
    assert r.returncode == 2 and "no_city.csv" in r.stderr and "city" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def _drop_column(path: Path, column: str, out: Path) -> Path:
    lines = [line.split(",") for line in path.read_text().splitlines()]
    i = lines[0].index(column)
    out.write_text("".join(",".join(f[:i] + f[i + 1:]) + "\n" for f in lines))
    return out


def _reference(export: Path, data: Path, tmp_path: Path) -> Path:
    out = tmp_path / "reference.parquet"
    if not out.exists():
        predict(export, [str(data / "test")], out, batch_size=BATCH, progress=False)
    return out


@pytest.fixture(scope="module")
def criteo(tmp_path_factory):
    """Criteo TSV logs ingested (the third file is the test split), a run, its export."""
    from embedtrain.testing import tiny_ctr_tsv

    root = tmp_path_factory.mktemp("criteo")
    files = tiny_ctr_tsv(root / "raw", rows=3000, rows_per_file=1000)
    lines = files[2].read_text().splitlines(keepends=True)
    lines[3] = "1\t2\t3\n"                                    # 3 fields: wrong_field_count
    fields = lines[10].split("\t")
    lines[10] = "\t".join([fields[0], "x7", *fields[2:]])     # I1 unparsable
    files[2].write_text("".join(lines))
    data = root / "data"
    spec = (ROOT / "configs" / "ingest" / "criteo_synthetic.yaml").read_text()
    report = _ingest(spec, files, data, "split.method=files",
                     "split.files={valid: '*00001*', test: '*00002*'}")
    run = _train("dlrm_synthetic.yaml", data, root / "run", *TINY)
    return files[2], data, export_run(run, root / "export", progress=False).out, report


def test_raw_criteo_lines_score_as_their_ingested_rows_bit_for_bit(criteo, tmp_path):
    serve, data, export, report = criteo
    assert report["rows_dropped"] == {"wrong_field_count": 1, "unparsable_value": 1}
    ingested = predict(export, [str(data / "test")], tmp_path / "a.parquet", batch_size=BATCH,
                       progress=False)
    r = run_cli("predict", str(export), "--input", str(serve), "--out",
                str(tmp_path / "b.parquet"), "--raw", "--batch-size", str(BATCH), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "not scored   2 invalid row(s)" in r.stdout
    assert np.array_equal(_scores(tmp_path / "a.parquet"), _scores(tmp_path / "b.parquet"))
    assert pq.read_table(tmp_path / "b.parquet").num_rows == ingested.rows == 998
    listed = pq.read_table(tmp_path / "b.invalid.parquet").to_pylist()
    assert [(r["line"], r["reason"]) for r in listed] == [(4, "wrong_field_count"),
                                                          (11, "unparsable_value")]


def test_generated_data_sets_have_no_raw_layout(tmp_path):
    from embedtrain.testing import tiny_ctr_dataset

    data = tiny_ctr_dataset(tmp_path / "data", rows=600)
    run = _train("dlrm_synthetic.yaml", data, tmp_path / "run", *TINY[:-2], "train.max_steps=1",
                 "train.progress=false")
    export = export_run(run, tmp_path / "export", progress=False).out
    r = run_cli("predict", str(export), "--input", str(data / "test"), "--out",
                str(tmp_path / "p.parquet"), "--raw", "--no-progress")
    assert r.returncode == 2 and "not made by embedtrain ingest" in r.stderr, r.stderr
