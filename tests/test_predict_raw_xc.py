"""Scoring raw XC rows (``embedtrain predict --raw``, :mod:`pipelines.xc.serve`) against ingesting
them and scoring the result.

The reference is the slow path a user takes without ``--raw``: ``embedtrain ingest`` the raw
lines (a file split puts the file to score in the test split, so the ingested test files hold
exactly its kept rows, in order), then ``embedtrain predict`` the ingested rows. ``--raw`` must
give the same top-k classes and scores bit for bit (the same batches: ``--batch-size`` valid rows
at a time) and the same P@1, skip exactly the lines ingestion drops, with their reasons and line
numbers, and score the rows ingestion drops only for want of a label. A CSV data set (token and
label vocabularies, truncation, a standardised dense column) is compared row for row with its
ingested rows, without a model.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import run_cli
from embedtrain.export.export import export_run
from embedtrain.export.predict import predict
from pipelines import KEEP_PREFIX, run_ingest  # KEEP_PREFIX: what embedtrain predict reads
from pipelines.core.errors import IngestError
from test_export import _train, _xc_overrides

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY_SPEC = ROOT / "configs" / "ingest" / "xc_repository.yaml"
BATCH = 64  # several batches, none aligned with the invalid lines
F, C = 200, 50  # the training files' header: features, labels
SERVE_ROWS = 300
INVALID = {  # data row of the file to score -> (line, the reason ingestion drops it)
    5: ("3 1:1 7", "feature_without_colon"),
    40: ("2,x 1:1", "unparsable_label"),
    77: ("4 250:1", "feature_out_of_range"),   # 250 >= F
    120: ("50 3:1", "label_out_of_range"),     # 50 >= C
    160: ("", "empty_line"),
}
COLUMNS = {"feature_without_colon": "features", "unparsable_label": "labels",
           "feature_out_of_range": "features", "label_out_of_range": "labels",
           "empty_line": "line"}
NO_FEATURES = 150  # "7": a label and no feature, kept (an empty bag)


def _planted(n: int, rng: np.random.Generator, prototypes: np.ndarray) -> list[str]:
    """Lines whose features mostly come from their first label's prototypes (6-8 features: the
    spec truncates bags to 4)."""
    lines = []
    for _ in range(n):
        labels = sorted(set(rng.integers(0, C, rng.integers(1, 4)).tolist()))
        ids = np.concatenate([rng.choice(prototypes[labels[0]], 4),
                              rng.integers(0, F, rng.integers(2, 5))])
        lines.append(",".join(map(str, labels)) + " " + " ".join(
            f"{j}:{rng.random():.3f}" for j in ids))
    return lines


def _write(path: Path, lines: list[str], features: int = F, labels: int = C) -> Path:
    path.write_text(f"{len(lines)} {features} {labels}\n" + "\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def xc_repo(tmp_path_factory):
    """Repository-format files ingested (the third is the test split), a run on them with a
    sharded full head, its export, and the raw file to score (with malformed lines)."""
    root = tmp_path_factory.mktemp("xc_repo")
    rng = np.random.default_rng(0)
    prototypes = rng.integers(0, F, (C, 6))
    train = _write(root / "train.txt", _planted(900, rng, prototypes))
    valid = _write(root / "valid.txt", _planted(100, rng, prototypes))
    lines = _planted(SERVE_ROWS, rng, prototypes)
    for row, (line, _) in INVALID.items():
        lines[row] = line
    lines[NO_FEATURES] = "7"
    serve = _write(root / "serve.txt", lines)
    data = root / "data"
    report, _ = run_ingest(REPOSITORY_SPEC, [str(train), str(valid), str(serve)], data,
                           overrides=["split.files={valid: '*valid*', test: '*serve*'}",
                                      "tokens.max_length=4"], progress=False)
    run = _train("xc_synthetic.yaml", data, root / "run", *_xc_overrides(data)[1:],
                 "head.kind=full")
    export = export_run(run, root / "export", progress=False).out
    return serve, data, export, report


def _bits(table: pa.Table) -> np.ndarray:
    scores = np.array(table.column("top_scores").to_pylist(), dtype=np.float32)
    return scores.view(np.uint32)


def test_raw_repository_lines_score_as_their_ingested_rows_bit_for_bit(xc_repo, tmp_path):
    serve, data, export, report = xc_repo
    assert report["tokens"]["rows_truncated"] > 0  # the truncation is the spec's, and it cuts
    ingested = predict(export, [str(data / "test")], tmp_path / "a.parquet", batch_size=BATCH,
                       progress=False)
    raw = predict(export, [str(serve)], tmp_path / "b.parquet", batch_size=BATCH, raw=True,
                  progress=False)
    a, b = pq.read_table(tmp_path / "a.parquet"), pq.read_table(tmp_path / "b.parquet")
    assert raw.rows == ingested.rows == b.num_rows == SERVE_ROWS - len(INVALID)
    assert b.column_names == ["top_ids", "top_scores", "labels"]
    assert b.column("top_ids").to_pylist() == a.column("top_ids").to_pylist()
    assert np.array_equal(_bits(a), _bits(b))
    assert b.column("labels").to_pylist() == a.column("labels").to_pylist()
    assert "p@1" in raw.metrics and raw.metrics == ingested.metrics
    # the lines ingestion dropped from this file, and only those, are not scored: counted, listed
    dropped = next(f for f in report["files"] if f["file"] == str(serve))["rows_dropped"]
    assert dropped == dict(Counter(reason for _, reason in INVALID.values()))
    assert raw.invalid == {f"{reason} ({COLUMNS[reason]})": 1 for _, reason in INVALID.values()}
    listed = pq.read_table(raw.invalid_file).to_pylist()
    assert [(r["file"], r["row"], r["line"], r["reason"]) for r in listed] == [
        (str(serve), row, row + 2, reason) for row, (_, reason) in sorted(INVALID.items())]
    ingest_lines = sorted((line, reason) for reason, entries in report["dropped_examples"].items()
                          for e in entries if e["file"] == str(serve) for line in e["lines"])
    assert [(r["line"], r["reason"]) for r in listed] == ingest_lines


def test_repository_rows_without_labels_are_scored(xc_repo, tmp_path):
    """Lines without labels (ingestion drops them: no_label) are scored, their label null."""
    serve, data, export, _ = xc_repo
    lines = serve.read_text().splitlines()
    for i in range(len(lines) - 1):
        if i in INVALID or i == NO_FEATURES:
            continue
        features = lines[i + 1].split(" ", 1)[1]
        lines[i + 1] = (" " if i % 2 else "") + features  # both ways of giving no label
    unlabelled = tmp_path / "unlabelled.txt"
    unlabelled.write_text("\n".join(lines) + "\n")
    r = predict(export, [str(unlabelled)], tmp_path / "u.parquet", batch_size=BATCH, raw=True,
                progress=False)
    reference = pq.read_table(_reference(export, data, tmp_path))
    u = pq.read_table(tmp_path / "u.parquet")
    assert r.rows == reference.num_rows and r.invalid == {
        f"{reason} ({COLUMNS[reason]})": 1 for _, reason in INVALID.values()}
    assert u.column("top_ids").to_pylist() == reference.column("top_ids").to_pylist()
    assert np.array_equal(_bits(u), _bits(reference))
    labels = u.column("labels").to_pylist()
    at = NO_FEATURES - sum(row < NO_FEATURES for row in INVALID)  # its output row
    assert labels[at] == [7] and labels.count(None) == len(labels) - 1
    top1 = reference.column("top_ids").to_pylist()[at][0]
    assert r.metrics == {"p@1": float(top1 == 7)}  # over the one row with a label


def test_on_invalid_error_is_one_line_naming_file_and_line(xc_repo, tmp_path):
    serve, _, export, _ = xc_repo
    out = tmp_path / "e.parquet"
    r = run_cli("predict", str(export), "--input", str(serve), "--out", str(out), "--raw",
                "--on-invalid", "error", "--no-progress")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{serve}: line 7: feature without colon (line '3 1:1 7')" in r.stderr
    assert not out.exists()


def test_ranges_are_the_training_data_s_not_the_served_header_s(xc_repo, tmp_path):
    serve, data, export, _ = xc_repo
    from pipelines.xc.serve import RawRows

    meta = json.loads((export / "dataset_metadata.json").read_text())
    # a header with fewer features and labels: ids up to training's are in range
    small = _write(tmp_path / "small.txt", [f"{C - 1} {F - 1}:1"], features=10, labels=5)
    rows = RawRows(meta, export, [str(small)])
    (_, table), = rows.batches(BATCH)
    assert table.to_pylist() == [{"labels": [C - 1], "tokens": [F]}] and not rows.skipped.counts
    # a header with more: refused in one line, through the CLI too
    for features, labels in [(F + 1, C), (F, C + 1)]:
        big = _write(tmp_path / "big.txt", ["1 1:1"], features=features, labels=labels)
        with pytest.raises(IngestError, match=f"^{big}: line 1: the header gives"):
            RawRows(meta, export, [str(big)])
    r = run_cli("predict", str(export), "--input", str(big), "--out",
                str(tmp_path / "big.parquet"), "--raw", "--no-progress")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{big}: line 1: the header gives {F:,} features and {C + 1:,} labels" in r.stderr


def _reference(export: Path, data: Path, tmp_path: Path) -> Path:
    out = tmp_path / "reference.parquet"
    predict(export, [str(data / "test")], out, batch_size=BATCH, progress=False)
    return out


# --- a CSV data set: vocabularies, truncation, dense; rows compared with the ingested ones -------

CSV_SPEC = """
kind: xc
name: docs
input: {format: csv}
tokens: {column: text, separator: " ", lowercase: true, min_frequency: 2, max_length: 5}
labels: {column: tags, separator: "|"}
dense: [{name: length, log1p: true, standardize: true}]
split: {method: files, files: {test: "*serve*"}, valid_fraction: 0}
"""


def _docs(n: int, seed: int) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    words = [f"W{int(w)}" if w % 7 == 0 else f"w{int(w)}" for w in rng.zipf(1.3, 8 * n) % 90]
    text, tags, length, at = [], [], [], 0
    for _ in range(n):
        k = int(rng.integers(0, 9))
        text.append(" ".join(words[at:at + k]))
        at += k
        tags.append("|".join(f"t{int(t)}" for t in rng.zipf(1.5, int(rng.integers(1, 4))) % 25))
        length.append(str(round(float(rng.lognormal(2, 1)), 2)) if rng.random() > 0.1 else None)
    return pl.DataFrame({"doc_id": [f"d{seed}-{i}" for i in range(n)], "text": text,
                         "tags": tags, "length": length})


def test_csv_rows_encode_as_their_ingested_rows(tmp_path):
    from pipelines.xc.serve import RawRows

    _docs(500, 0).write_csv(tmp_path / "train.csv")
    serve = _docs(150, 1).with_columns(
        pl.when(pl.int_range(150) == 9).then(pl.lit("zzz|yyy"))  # labels unseen in training
        .when(pl.int_range(150) == 31).then(pl.lit(None))        # no labels
        .otherwise(pl.col("tags")).alias("tags"),
        pl.when(pl.int_range(150) == 70).then(pl.lit("abc"))     # unparsable: invalid
        .otherwise(pl.col("length")).alias("length"))
    serve.write_csv(tmp_path / "serve.csv")
    spec = tmp_path / "docs.yaml"
    spec.write_text(CSV_SPEC)
    data = tmp_path / "data"
    report, _ = run_ingest(spec, [str(tmp_path / "train.csv"), str(tmp_path / "serve.csv")],
                           data, progress=False)
    assert report["rows_dropped"] == {"no_label": 2, "unparsable_value": 1}
    assert report["tokens"]["rows_truncated"] > 0 and report["tokens"]["vocab_size"] > 10
    meta = json.loads((data / "metadata.json").read_text())
    rows = RawRows(meta, data, [str(tmp_path / "serve.csv")], keep=["doc_id"])
    assert rows.label_type == pa.list_(pa.int64()) and rows.total is None
    got = pl.concat([pl.from_arrow(t) for _, t in rows.batches(32)])
    ingested = pl.read_parquet(data / "test")
    assert got.columns == ["labels", "length", "tokens", KEEP_PREFIX + "doc_id"]
    kept = [f"d1-{i}" for i in range(150) if i != 70]
    assert got[KEEP_PREFIX + "doc_id"].to_list() == kept
    # the rows ingestion kept are these, encoded alike; the ones without a label are scored
    labelled = got.filter(pl.col("labels").is_not_null())
    assert labelled.drop("__keep:doc_id").equals(ingested)
    assert got.filter(pl.col("labels").is_null())["__keep:doc_id"].to_list() == ["d1-9", "d1-31"]
    assert rows.skipped.counts == {("unparsable_value", "length"): 1}
    (listed,) = rows.skipped.tables
    assert listed.rows() == [(str(tmp_path / "serve.csv"), 70, 72, "unparsable_value", "length")]
    assert report["dropped_examples"]["unparsable_value"][0]["lines"] == [72]
    # without the label column: no label column, the same features
    serve.drop("tags").write_csv(tmp_path / "serve_unlabelled.csv")
    rows = RawRows(meta, data, [str(tmp_path / "serve_unlabelled.csv")])
    assert rows.label_type is None
    bare = pl.concat([pl.from_arrow(t) for _, t in rows.batches(32)])
    assert bare.equals(got.select("length", "tokens"))
