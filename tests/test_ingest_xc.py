"""``embedtrain ingest`` with ``kind: xc``: the Extreme Classification Repository format and
parquet/CSV tables to the data set the XC trainer reads.

Each test compares the job's output with a small pure-Python reference (a line parser of the
repository format, ``collections.Counter`` vocabularies), so a rule that changes in the job and
not in its documentation shows up here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedtrain.config import ConfigError
from embedtrain.data.stats import class_counts
from embedtrain.features import load_dataset_meta
from conftest import run_cli
from pipelines import kind_of
from pipelines.core.errors import IngestError
from pipelines.xc.passes import ingest as ingest_xc
from pipelines.xc.read import REPOSITORY_REASONS
from pipelines.xc.spec import load_spec as load_xc_spec

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY_SPEC = ROOT / "configs" / "ingest" / "xc_repository.yaml"
SPLITS = ("train", "valid", "test")


def embedtrain(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "embedtrain", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=timeout)


def run(tmp_path: Path, spec_text: str, inputs: list, out: str = "out",
        overrides: list[str] | None = None) -> dict:
    path = tmp_path / "spec.yaml"
    path.write_text(spec_text)
    return ingest_xc(load_xc_spec(path, overrides), [str(i) for i in inputs], tmp_path / out,
                     progress=False)


def meta(out: Path) -> dict:
    return json.loads((out / "metadata.json").read_text())


def rows(out: Path, split: str) -> pl.DataFrame:
    return pl.concat([pl.read_parquet(out / f) for f in meta(out)["splits"][split]["files"]])


def assert_balanced(report: dict) -> None:
    """Nothing lost silently: in total and per file."""
    assert report["rows_read"] == report["rows_written_total"] + report["rows_dropped_total"]
    assert report["rows_written_total"] == sum(report["rows_written"].values())
    assert report["rows_dropped_total"] == sum(report["rows_dropped"].values())
    for f in report["files"]:
        assert f["rows_read"] == sum(f["rows_written"].values()) + sum(f["rows_dropped"].values())
    assert sum(f["rows_read"] for f in report["files"]) == report["rows_read"]


# --- the Extreme Classification Repository format ------------------------------------------------

F, L = 8, 5  # the header's num_features, num_labels
TRAIN_LINES = [
    "0,2 0:1.0 3:0.5",         # good
    " 1:2 4:1",                # no labels (leading space): no_label
    "1 2:0.1\t5:3",            # good (a tab between features)
    "3",                       # labels, no features: kept, an empty bag
    "",                        # empty_line
    "4 2 3",                   # header_line (a header inside the file)
    "2,x 1:1",                 # unparsable_label
    "1,,2 1:1",                # unparsable_label (empty element)
    "1.5 1:1",                 # unparsable_label
    "5 1:1",                   # label_out_of_range (L = 5)
    "-1 1:1",                  # label_out_of_range
    "0 1:1 7",                 # feature_without_colon
    "0 x:1",                   # unparsable_feature_id
    "0 :1",                    # unparsable_feature_id
    "0 3:abc",                 # unparsable_feature_value
    "0 3:",                    # unparsable_feature_value
    "0 3:1:2",                 # unparsable_feature_value
    "0 8:1",                   # feature_out_of_range (F = 8)
    "0 -1:1",                  # feature_out_of_range
    "2,2,4 7:0.25 0:1 7:1\r",  # good: a repeated label (removed, counted), CRLF ending
    "1:0.5 2:0.5",             # no labels (starts with a feature): no_label
    "4,0 6:1",                 # good
]
TEST_LINES = ["3 1:1 2:1", "bad", "0,1 0:2"]


def reference_parse(line: str) -> tuple[str | None, list[int], list[int]]:
    """(drop reason or None, tokens, labels) of one data line, by the documented rules."""
    line = line.rstrip()
    if not line:
        return "empty_line", [], []
    if re.fullmatch(r"\d+\s+\d+\s+\d+", line):
        return "header_line", [], []
    fields = line.split()
    if line[0].isspace() or ":" in fields[0]:
        label_field, features = "", fields
    else:
        label_field, features = fields[0], fields[1:]
    try:
        labels = [int(x) for x in label_field.split(",")] if label_field else []
    except ValueError:
        return "unparsable_label", [], []
    if any(not 0 <= x < L for x in labels):
        return "label_out_of_range", [], []
    if any(":" not in f for f in features):
        return "feature_without_colon", [], []
    pairs = [f.split(":", 1) for f in features]
    try:
        ids = [int(i) for i, _ in pairs]
    except ValueError:
        return "unparsable_feature_id", [], []
    try:
        [float(v) for _, v in pairs]
    except ValueError:
        return "unparsable_feature_value", [], []
    if any(not 0 <= i < F for i in ids):
        return "feature_out_of_range", [], []
    if not labels:
        return "no_label", [], []
    return None, [i + 1 for i in ids], sorted(set(labels))


def write_repository(path: Path, lines: list[str], rows: int | None = None) -> Path:
    n = len(lines) if rows is None else rows
    path.write_bytes((f"{n} {F} {L}\n" + "\n".join(lines) + "\n").encode())
    return path


def test_repository_format_every_malformed_line_dropped_and_located(tmp_path):
    train = write_repository(tmp_path / "train.txt", TRAIN_LINES, rows=len(TRAIN_LINES) + 3)
    test = write_repository(tmp_path / "test.txt", TEST_LINES)
    report = run(tmp_path, REPOSITORY_SPEC.read_text(), [train],
                 overrides=[f"split.files.test={test}", "split.valid_fraction=0",
                            "dropped_line_examples=100"])
    assert_balanced(report)
    expected = {"train": [reference_parse(x) for x in TRAIN_LINES],
                "test": [reference_parse(x) for x in TEST_LINES]}
    assert {r for r, _, _ in expected["train"] if r} == {*REPOSITORY_REASONS, "no_label"}
    # every dropped line, by reason, with its file and 1-based line number (header = line 1)
    want: dict[str, list[dict]] = {}
    for path, parsed in ((train, expected["train"]), (test, expected["test"])):
        for number, (reason, _, _) in enumerate(parsed, start=2):
            if reason:
                entries = want.setdefault(reason, [])
                if not entries or entries[-1]["file"] != str(path):
                    entries.append({"file": str(path), "lines": []})
                entries[-1]["lines"].append(number)
    assert report["dropped_examples"] == dict(sorted(want.items()))
    assert report["rows_dropped"] == dict(sorted(Counter(
        r for part in expected.values() for r, _, _ in part if r).items()))
    assert report["rows_read"] == len(TRAIN_LINES) + len(TEST_LINES)
    by_file = {f["file"]: f for f in report["files"]}
    assert by_file[str(test)]["rows_dropped"] == {"unparsable_label": 1}  # "bad": a label field
    assert by_file[str(train)]["rows_written"] == {"train": 5, "valid": 0, "test": 0}
    # the written rows are exactly the good lines, in order
    out = tmp_path / "out"
    for split in ("train", "test"):
        got = rows(out, split)
        good = [(t, lab) for r, t, lab in expected[split] if r is None]
        assert list(zip(got["tokens"].to_list(), got["labels"].to_list())) == good
    assert report["labels"]["labels_removed"] == {"duplicate_label": 1}
    assert report["tokens"]["rows_without_tokens"] == 1
    assert report["tokens"]["values"].startswith("dropped")
    assert report["warnings"][0] == (f"{train}: line 1: the header says {len(TRAIN_LINES) + 3} "
                                     f"rows, the file has {len(TRAIN_LINES)} data lines")
    m = meta(out)
    assert (m["task"], m["num_classes"], m["multi_label"], m["label"]) == ("xc", L, True, "labels")
    assert m["sparse"] == [{"name": "tokens", "num_embeddings": F + 1, "multi_hot": True,
                            "max_length": 3}]
    assert m["token_column"] == "tokens" and m["vocab_size"] == F + 1
    assert m["labels_per_row"] == [1, 2] and m["max_labels"] == 2
    assert sorted(m["splits"]) == ["test", "train"] and not (out / "valid").exists()
    features = load_dataset_meta(out).features
    assert (features.num_classes, features.max_labels) == (L, 2)


def test_repository_values_column_and_hash_split(tmp_path):
    lines = [f"{i % L} {i % F}:{i / 10} {(i + 3) % F}:1" for i in range(200)]
    train = write_repository(tmp_path / "train.txt", lines)
    report = run(tmp_path, REPOSITORY_SPEC.read_text(), [train],
                 overrides=["tokens.values_column=weights", "tokens.max_length=1"])
    assert_balanced(report)
    assert report["rows_dropped_total"] == 0 and "warnings" not in report
    assert all(n > 0 for n in report["rows_written"].values())
    assert report["tokens"]["rows_truncated"] == 200
    got = pl.concat([rows(tmp_path / "out", s) for s in SPLITS])
    assert got.schema["weights"] == pl.List(pl.Float32)
    assert sorted(got["weights"].to_list()) == sorted([[np.float32(i / 10)] for i in range(200)])
    assert got["tokens"].list.len().max() == 1
    # the same input and seed always give the same split
    again = run(tmp_path, REPOSITORY_SPEC.read_text(), [train], out="again",
                overrides=["tokens.values_column=weights", "tokens.max_length=1"])
    assert again["rows_written"] == report["rows_written"]


@pytest.mark.parametrize("header, words", [
    ("", "expected the header 'num_rows num_features num_labels' (format: xc_repository), got "
         "an empty line"),
    ("100 5000", "got '100 5000'"),
    ("rows features labels", "got 'rows features labels'"),
    ("10 0 4", "gives 0 feature(s) and 4 label(s)"),
])
def test_bad_header_is_one_line_naming_file_and_line_1(tmp_path, header, words):
    path = tmp_path / "bad.txt"
    path.write_text(f"{header}\n0 1:1\n")
    with pytest.raises(IngestError) as err:
        run(tmp_path, REPOSITORY_SPEC.read_text(), [path])
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}: line 1: ") and words in message


def test_bad_header_through_the_cli(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("3 10\n0 1:1\n")
    r = embedtrain("ingest", str(REPOSITORY_SPEC), "--input", str(path), "--out",
                   str(tmp_path / "out"), "--quiet")
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"embedtrain ingest: error: {path}: line 1: expected the header 'num_rows num_features "
        "num_labels' (format: xc_repository), got '3 10'"]
    assert not (tmp_path / "out").exists()


def test_headers_of_several_files_must_agree(tmp_path):
    a = write_repository(tmp_path / "a.txt", ["0 1:1"])
    b = tmp_path / "b.txt"
    b.write_text(f"1 {F + 1} {L}\n0 1:1\n")
    with pytest.raises(IngestError, match=rf"b\.txt: line 1: header gives {F + 1} features and "
                                          rf"{L} labels, .*a\.txt gives {F} and {L}"):
        run(tmp_path, REPOSITORY_SPEC.read_text(), [a, b])


# --- parquet / CSV tables: vocabularies against collections.Counter ------------------------------

WORDS = [f"w{i}" for i in range(300)]
TAGS = [f"t{i}" for i in range(60)]


def random_docs(n: int, seed: int) -> tuple[list[str], list[list[str]]]:
    """Zipfian words (0-6 per row, runs of spaces between them) and 0-3 Zipfian tags per row:
    long tails, so both vocabulary limits cut."""
    rng = np.random.default_rng(seed)
    wp, tp = 1.0 / np.arange(1, len(WORDS) + 1), 1.0 / np.arange(1, len(TAGS) + 1)
    texts, tags = [], []
    for _ in range(n):
        k = int(rng.integers(0, 7))
        texts.append("  ".join(rng.choice(WORDS, size=k, p=wp / wp.sum())))
        tags.append(list(rng.choice(TAGS, size=int(rng.integers(0, 4)), p=tp / tp.sum())))
    return texts, tags


def vocabulary(counts: Counter, min_frequency: int, max_size: int | None, first: int) -> dict:
    """Value -> id: counts >= min_frequency, most frequent first, ties by value, top max_size."""
    kept = sorted((v for v, c in counts.items() if c >= min_frequency),
                  key=lambda v: (-counts[v], v))[:max_size]
    return {v: i for i, v in enumerate(kept, start=first)}


XC_TABLE_SPEC = """
kind: xc
name: docs
input: {format: csv}
tokens: {column: text, separator: " ", min_frequency: %d, max_vocab_size: %s}
labels: {column: tags, separator: ",", min_frequency: %d, max_vocab_size: %s}
split: {files: {test: test.csv}, valid_fraction: 0}
"""


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
@pytest.mark.parametrize("limits", [(3, None, 4, None), (1, 40, 1, 12)],
                         ids=["min_frequency", "max_vocab_size"])
def test_table_vocabularies_match_a_counter_reference(tmp_path, fmt, limits):
    token_min, token_max, label_min, label_max = limits
    data = {"train": random_docs(400, 1), "test": random_docs(100, 2)}
    for split, (texts, tags) in data.items():
        if fmt == "csv":
            cells = [",".join(t) for t in tags]
            pl.DataFrame({"text": texts, "tags": cells}).write_csv(tmp_path / f"{split}.csv")
        else:
            pq.write_table(pa.table({"text": texts, "tags": pa.array(tags, pa.list_(pa.string()))}),
                           tmp_path / f"{split}.parquet")
    spec = XC_TABLE_SPEC % (token_min, "null" if token_max is None else token_max, label_min,
                            "null" if label_max is None else label_max)
    spec = spec.replace("test.csv", f"test.{fmt}")
    if fmt == "parquet":
        spec = spec.replace("format: csv", "format: parquet").replace(', separator: ","', "")
    files = [tmp_path / f"train.{fmt}", tmp_path / f"test.{fmt}"]
    report = run(tmp_path, spec, files, overrides=["dropped_line_examples=1000"])
    assert_balanced(report)

    train_texts, train_tags = data["train"]
    label_counts = Counter(t for tags in train_tags for t in set(tags))
    labels = vocabulary(label_counts, label_min, label_max, first=0)
    kept_train = [i for i, tags in enumerate(train_tags) if set(tags) & set(labels)]
    token_counts = Counter(w for i in kept_train for w in train_texts[i].split())
    tokens = vocabulary(token_counts, token_min, token_max, first=1)
    # the limit under test cuts (else this test could not tell it was applied)
    assert len(labels) < len(label_counts) and len(tokens) < len(token_counts)
    out = tmp_path / "out"
    assert pl.read_parquet(out / "vocab" / "labels.parquet").rows() == [
        (v, i, label_counts[v]) for v, i in labels.items()]
    assert pl.read_parquet(out / "vocab" / "tokens.parquet").rows() == [
        (v, i, token_counts[v]) for v, i in tokens.items()]
    assert meta(out)["sparse"][0]["num_embeddings"] == len(tokens) + 1
    assert meta(out)["num_classes"] == len(labels)
    assert meta(out)["class_counts"] == [label_counts[v] for v in labels]
    removed, no_label = 0, []
    for split, (texts, tags) in data.items():
        want = []
        for row, (text, row_tags) in enumerate(zip(texts, tags)):
            ids = sorted({labels[t] for t in row_tags if t in labels})
            removed += len({t for t in row_tags if t not in labels})
            if not ids:
                no_label.append((split, row))
                continue
            want.append(([tokens.get(w, 0) for w in text.split()], ids))
        got = rows(out, split)
        assert list(zip(got["tokens"].to_list(), got["labels"].to_list())) == want, split
    assert report["rows_dropped"] == {"no_label": len(no_label)}
    # where they are: CSV lines (the header is line 1), parquet rows (0-based), per file
    key, base = ("lines", 2) if fmt == "csv" else ("rows", 0)
    assert report["dropped_examples"]["no_label"] == [
        {"file": str(f), key: [row + base for split, row in no_label if split == s]}
        for f, s in zip(files, ("train", "test"))]
    assert report["labels"]["labels_removed"]["label_out_of_vocabulary"] == removed
    assert report["labels"]["rows_without_label_given"] == sum(
        not t for _, tags in data.values() for t in tags)
    empty = sum(not text.split() for texts, tags in data.values()
                for text, t in zip(texts, tags) if set(t) & set(labels))
    assert report["tokens"]["rows_without_tokens"] == empty > 0


def test_single_label_pre_encoded_parquet_with_dense(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[3, 1], [], None, [9], [2]], pa.list_(pa.int32())),
                             "label": pa.array([1, 0, 2, 1, None], pa.int64()),
                             "x": [1.0, None, 3.0, 4.0, 5.0]}), path)
    spec = ("kind: xc\ninput: {format: parquet}\n"
            "tokens: {encoding: pre_encoded, num_embeddings: 5}\n"
            "labels: {column: label, encoding: pre_encoded, num_classes: 3}\n"
            "dense: [{name: x, fill_null: -1}]\n"
            "split: {valid_fraction: 0, test_fraction: 0}\n")
    report = run(tmp_path, spec, [path])
    assert_balanced(report)
    assert report["rows_dropped"] == {"no_label": 1, "token_out_of_range": 1}
    assert report["dropped_examples"] == {
        "no_label": [{"file": str(path), "rows": [4]}],
        "token_out_of_range": [{"file": str(path), "rows": [3]}]}
    got = rows(tmp_path / "out", "train")
    assert got.schema["label"] == pl.Int64 and got.columns == ["label", "x", "tokens"]
    assert got.to_dict(as_series=False) == {"label": [1, 0, 2], "x": [1.0, -1.0, 3.0],
                                            "tokens": [[3, 1], [], []]}
    m = meta(tmp_path / "out")
    assert (m["multi_label"], m["max_labels"], m["labels_per_row"]) == (False, 1, [1, 1])
    assert m["class_counts"] == [1, 1, 1] and report["repairs"]["dense_null_filled"] == {"x": 1}


# --- class_counts ---------------------------------------------------------------------------------

def test_class_counts_in_metadata_equal_the_written_train_split(tmp_path):
    rng = np.random.default_rng(3)
    lines = []
    for _ in range(300):
        labels = sorted(set(rng.integers(0, L, rng.integers(1, 4)).tolist()))
        lines.append(",".join(map(str, labels)) + " " + " ".join(
            f"{j}:1" for j in rng.integers(0, F, 3)))
    lines[5] = "0 1:x"  # dropped: its label is not counted
    train = write_repository(tmp_path / "train.txt", lines)
    run(tmp_path, REPOSITORY_SPEC.read_text(), [train])
    out = tmp_path / "out"
    written = rows(out, "train")["labels"].explode().to_numpy()
    recomputed = np.bincount(written, minlength=L)
    assert meta(out)["class_counts"] == recomputed.tolist()
    ds = load_dataset_meta(out)
    stored = class_counts(ds)  # from metadata.json
    computed = class_counts(replace(ds, extra={k: v for k, v in ds.extra.items()
                                               if k != "class_counts"}))  # from the files
    assert stored.dtype == computed.dtype == np.int64
    assert stored.tolist() == computed.tolist() == recomputed.tolist()
    assert class_counts(ds, "test").sum() == rows(out, "test")["labels"].list.len().sum()
    broken = replace(ds, extra={**ds.extra, "class_counts": [1, 2]})
    with pytest.raises(ValueError, match=rf"metadata\.json: class_counts: expected {L} "):
        class_counts(broken)


# --- specs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["xc_repository.yaml", "xc_parquet.yaml"])
def test_shipped_xc_specs_load(name):
    path = ROOT / "configs" / "ingest" / name
    assert kind_of(path) == "xc"
    assert load_xc_spec(path).kind == "xc"


@pytest.mark.parametrize("text, key, words", [
    ("input: {format: xc_repository}\ntokens: {min_frequency: 2}", "tokens.min_frequency",
     "not for format: xc_repository"),
    ("input: {format: csv}\ntokens: {column: t}", "tokens.separator", "give the separator"),
    ("input: {format: parquet}\nlabels: {encoding: hash}", "labels.encoding", "merge classes"),
    ("input: {format: parquet}\nlabels: {encoding: raw}", "labels.encoding", "index the head"),
    ("input: {format: parquet}\ntokens: {encoding: raw}", "tokens.encoding", "kind: ctr"),
    ("input: {format: parquet}\nlabels: {encoding: pre_encoded}", "labels.num_classes",
     "num_classes >= 2"),
    ("split: {method: time}", "split.method", "hash or files"),
    ("split: {files: {train: a.txt}}", "split.files.train", "expected valid or test"),
    ("tokens: {name: labels}", "tokens.name", "named twice"),
])
def test_bad_xc_spec_is_one_line(tmp_path, text, key, words):
    path = tmp_path / "s.yaml"
    path.write_text("kind: xc\n" + text + "\n")
    with pytest.raises(ConfigError) as err:
        load_xc_spec(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}: {key}: ") and words in message


# --- end to end: the XC trainer on an ingested repository data set --------------------------------

def planted_repository(paths: dict[str, Path], rows: dict[str, int], classes: int,
                       features: int, seed: int = 0) -> None:
    """Files of one planted model: a row's tokens mostly come from its first label's 6 prototype
    features (shared by all files), so P@1 can approach 1."""
    rng = np.random.default_rng(seed)
    prototypes = rng.integers(0, features, (classes, 6))
    for name, path in paths.items():
        lines = []
        for _ in range(rows[name]):
            labels = sorted(set(rng.integers(0, classes, rng.integers(1, 3)).tolist()))
            ids = np.concatenate([rng.choice(prototypes[labels[0]], 4),
                                  rng.integers(0, features, 2)])
            lines.append(",".join(map(str, labels)) + " " + " ".join(
                f"{j}:{rng.random():.3f}" for j in ids))
        path.write_text(f"{rows[name]} {features} {classes}\n" + "\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def ingested_repository(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("xc_repository")
    train, test = root / "train.txt", root / "test.txt"
    planted_repository({"train": train, "test": test}, {"train": 3000, "test": 600}, 20, 200)
    r = run_cli("ingest", str(REPOSITORY_SPEC), "--input", str(train), "--set",
                f"split.files.test={test}", "--out", str(root / "data"), "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "read 3,600 rows from 2 file(s)" in r.stdout
    return root / "data"


@pytest.mark.slow
@pytest.mark.parametrize("head", ["full", "partial_fc", "full+bce", "partial_fc+bce"])
def test_xc_trainer_trains_on_an_ingested_repository_data_set(ingested_repository, tmp_path,
                                                              head):
    run_dir = tmp_path / "run"
    kind, _, loss = head.partition("+")  # the softmax and the one-vs-all (bce) losses
    r = run_cli("train", str(ROOT / "configs/xc_synthetic.yaml"), "--out", str(run_dir),
                "--no-progress", "--set", f"data.path={ingested_repository}",
                "--set", f"head.kind={kind}", "--set", f"head.loss={loss or 'softmax'}",
                "--set", "head.sample_rate=0.5",
                "--set", "xc.embedding_dim=16", "--set", "xc.mlp=[32,16]",
                "--set", "data.batch_size=128", "--set", "data.eval_batch_size=256",
                "--set", "data.num_workers=0", "--set", "train.epochs=3",
                "--set", "optim.dense_lr=0.01", "--set", "train.eval_every=20",
                "--set", "train.checkpoint_every=0")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    # named after the input files' folder (train.txt, test.txt: a split's names)
    assert summary["split"] == "test" and summary["dataset"] == ingested_repository.parent.name
    assert summary["p@1"] > 0.5  # chance is 1/20: it learnt the planted prototypes


def test_the_data_set_is_named_after_its_input_unless_name_is_set(tmp_path):
    """Issue 34: the shipped repository spec names no data set, so a run on EURLex prints
    "eurlex", not "xc_repository" (a file named for its split takes its folder's name)."""
    (tmp_path / "eurlex").mkdir()
    train = write_repository(tmp_path / "eurlex" / "train.txt", TRAIN_LINES,
                             rows=len(TRAIN_LINES) + 3)
    run(tmp_path, REPOSITORY_SPEC.read_text(), [train])
    assert meta(tmp_path / "out")["name"] == "eurlex"
    run(tmp_path, REPOSITORY_SPEC.read_text(), [train], out="named", overrides=["name=eur"])
    assert meta(tmp_path / "named")["name"] == "eur"


def test_split_keys_that_do_nothing_are_refused(tmp_path):
    """``seed`` (and ``column``) of the hash where no row is hashed: one line, not ignored."""
    path = tmp_path / "spec.yaml"
    path.write_text(REPOSITORY_SPEC.read_text())
    both = ["split.files.test=t.txt", "split.files.valid=v.txt"]
    assert load_xc_spec(path, both).split.seed is None
    with pytest.raises(ConfigError, match=r"spec\.yaml: split\.seed: no row is split by the "
                                          r"hash .*; remove it$"):
        load_xc_spec(path, [*both, "split.seed=3"])
    assert load_xc_spec(path, ["split.files.test=t.txt", "split.seed=3"]).split.hash_seed == 3
