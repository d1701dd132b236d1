"""``encoding: raw``: categorical values as their own int64 ids (no vocabulary), for dynamic tables.

Expected ids come from a slow pure-Python reference: integers as they are, strings through
FNV-1a and splitmix64 (the ``hash`` encoding's stable hash, :mod:`pipelines.core.hashing`) byte by
byte, masked to 63 bits; distinct-id counts from Python sets over the written files.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedtrain.config import ConfigError
from embedtrain.features import load_dataset_meta
from pipelines.core.encode import raw_hash_ids
from pipelines.core.errors import IngestError
from pipelines.core.hashing import fnv1a64
from pipelines.tabular.passes import ingest
from pipelines.tabular.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 2**63 - 1  # raw ids lie in [0, LIMIT)
ALL_TRAIN = "split: {method: hash, valid_fraction: 0.0, test_fraction: 0.0}\n"
SPLITS = ("train", "valid", "test")


# --- the reference -------------------------------------------------------------------------------

def ref_fnv1a64(value: str) -> int:
    h = 0xCBF29CE484222325
    for b in value.encode("utf-8"):
        h = ((h ^ b) * 0x100000001B3) % 2**64
    return h


def ref_splitmix64(x: int, seed: int = 0) -> int:
    z = (x + (seed + 1) * 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def ref_raw_id(value) -> int:
    """A raw id as the spec's docstring defines it."""
    if value is None or value == "":
        return 0
    if isinstance(value, int):
        return value
    masked = ref_splitmix64(ref_fnv1a64(value)) & LIMIT
    return LIMIT - 1 if masked == LIMIT else masked


def test_the_reference_is_the_hashing_modules_fnv():
    for v in ["a", "68fd1e64", "é ü", "x" * 37]:
        assert ref_fnv1a64(v) == int(fnv1a64(pa.array([v]))[0])
    assert ref_fnv1a64("a") == 0xAF63DC4C8601EC8C  # the published FNV-1a test vector


# --- helpers -------------------------------------------------------------------------------------

def run(tmp_path: Path, spec_text: str, inputs: list, out: str = "out") -> dict:
    path = tmp_path / f"{out}.yaml"
    path.write_text(spec_text)
    return ingest(load_spec(path), [str(i) for i in inputs], tmp_path / out, progress=False)


def meta(out: Path) -> dict:
    return json.loads((out / "metadata.json").read_text())


def rows(out: Path, split: str = "train") -> pl.DataFrame:
    return pl.concat([pl.read_parquet(out / f) for f in meta(out)["splits"][split]["files"]])


def assert_balanced(report: dict) -> None:
    assert report["rows_read"] == report["rows_written_total"] + report["rows_dropped_total"]
    assert report["rows_written_total"] == sum(report["rows_written"].values())
    assert report["rows_dropped_total"] == sum(report["rows_dropped"].values())


def by_key(out: Path, column: str) -> dict[float, object]:
    frame = pl.concat([rows(out, s) for s in meta(out)["splits"]])
    return dict(zip(frame["k"].to_list(), frame[column].to_list()))


# --- 1. integers keep their value ----------------------------------------------------------------

BIG = [0, 1, 7, 2**32 - 1, 2**32, 2**32 + 5, 2**53 + 1, 2**62 - 1, 2**62 + 3, LIMIT - 1]


def test_parquet_integers_are_kept_exactly_nulls_are_0_negatives_dropped(tmp_path):
    uid = [*BIG, None, -1, -(2**62), LIMIT, None]
    n = len(uid)
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"y": [i % 2 for i in range(n)], "k": [float(i) for i in range(n)],
                             "uid": pa.array(uid, pa.int64())}), path)
    spec = ("input: {format: parquet}\nlabel: y\ndense: [{name: k}]\n"
            "sparse: [{name: uid, encoding: raw}]\n" + ALL_TRAIN)
    report = run(tmp_path, spec, [path])
    assert_balanced(report)
    # -1, -2^62 and 2^63 - 1 (the dynamic tables' empty-row marker) are invalid rows
    assert report["rows_dropped"] == {"raw_id_out_of_range": 3}
    assert report["rows_dropped_by_column"] == {"raw_id_out_of_range": {"uid": 3}}
    assert report["rows_written_total"] == n - 3
    got = by_key(tmp_path / "out", "uid")
    expected = {float(i): ref_raw_id(v) for i, v in enumerate(uid) if v is None or 0 <= v < LIMIT}
    assert got == expected
    assert pq.read_schema(tmp_path / "out" / meta(tmp_path / "out")["splits"]["train"]["files"][0]
                          ).field("uid").type == pa.int64()
    # nulls: counted as for every encoding
    assert report["repairs"]["categorical_null_to_id_0"] == {"uid": 2}
    assert report["features"]["uid"]["null_rate"] == pytest.approx(2 / (n - 3), abs=1e-6)
    assert report["features"]["uid"]["encoding"] == "raw"


def test_uint64_and_narrow_parquet_integers(tmp_path):
    """uint64 values from 2^63 - 1 on do not fit a raw id: dropped as out of range (not a read
    error, not a null); narrow widths are widened."""
    path = tmp_path / "t.parquet"
    u = [5, LIMIT - 1, LIMIT, 2**63, 2**64 - 1, None]
    pq.write_table(pa.table({"y": [1, 0, 1, 0, 1, 0], "k": [float(i) for i in range(6)],
                             "u": pa.array(u, pa.uint64()),
                             "small": pa.array([1, -1, 3, 4, 5, 6], pa.int8())}), path)
    spec = ("input: {format: parquet}\nlabel: y\ndense: [{name: k}]\n"
            "sparse: [{name: u, encoding: raw}, {name: small, encoding: raw}]\n" + ALL_TRAIN)
    report = run(tmp_path, spec, [path])
    assert_balanced(report)
    assert report["rows_dropped_by_column"] == {"raw_id_out_of_range": {"small": 1, "u": 3}}
    assert by_key(tmp_path / "out", "u") == {0.0: 5, 5.0: 0}
    assert by_key(tmp_path / "out", "small") == {0.0: 1, 5.0: 6}


def test_csv_integer_text(tmp_path):
    """Text integers: kept; too long for int64 is out of range, not unparsable; blank is null."""
    path = tmp_path / "t.csv"
    values = ["12", " 4294967301 ", "+7", "", "NA", "-3", "99999999999999999999", "abc",
              str(2**62 + 3), str(LIMIT), '""', "   "]
    lines = [f"{i % 2},{i},{v}" for i, v in enumerate(values)]
    path.write_text("y,k,uid\n" + "\n".join(lines) + "\n")
    spec = ("input: {format: csv, null_values: [NA]}\nlabel: y\ndense: [{name: k}]\n"
            "sparse: [{name: uid, encoding: raw, dtype: integer}]\n" + ALL_TRAIN)
    report = run(tmp_path, spec, [path])
    assert_balanced(report)
    assert report["rows_dropped"] == {"raw_id_out_of_range": 3, "unparsable_value": 1}
    assert by_key(tmp_path / "out", "uid") == {0.0: 12, 1.0: 2**32 + 5, 2.0: 7, 3.0: 0, 4.0: 0,
                                               8.0: 2**62 + 3, 10.0: 0, 11.0: 0}
    assert report["repairs"]["categorical_null_to_id_0"] == {"uid": 4}


# --- 2. strings hash to the reference ------------------------------------------------------------

STRINGS = ["a", "b", "paris", "68fd1e64", "é ü", "x" * 41, " ", "0", "a"]


def test_parquet_strings_hash_to_the_reference(tmp_path):
    city = [*STRINGS, None, ""]
    n = len(city)
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"y": [i % 2 for i in range(n)], "k": [float(i) for i in range(n)],
                             "city": city}), path)
    spec = ("input: {format: parquet}\nlabel: y\ndense: [{name: k}]\n"
            "sparse: [{name: city, encoding: raw}]\n" + ALL_TRAIN)
    report = run(tmp_path, spec, [path])
    assert_balanced(report)
    got = by_key(tmp_path / "out", "city")
    assert got == {float(i): ref_raw_id(v) for i, v in enumerate(city)}
    assert all(0 < got[float(i)] < LIMIT for i in range(len(STRINGS)))
    assert got[0.0] == got[8.0] and len(set(got.values())) == len(set(STRINGS)) + 1
    # null and the empty string are id 0, counted as nulls
    assert report["repairs"]["categorical_null_to_id_0"] == {"city": 2}
    assert report["rows_dropped_total"] == 0


def test_csv_strings_and_null_markers(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("y,k,c\n1,0,paris\n0,1,\n1,2,NA\n0,3,\"\"\n1,4,68fd1e64\n0,5,42\n")
    spec = ("input: {format: csv, null_values: [NA]}\nlabel: y\ndense: [{name: k}]\n"
            "sparse: [{name: c, encoding: raw, dtype: string}]\n" + ALL_TRAIN)
    report = run(tmp_path, spec, [path])
    assert by_key(tmp_path / "out", "c") == {
        0.0: ref_raw_id("paris"), 1.0: 0, 2.0: 0, 3.0: 0, 4.0: ref_raw_id("68fd1e64"),
        5.0: ref_raw_id("42")}  # dtype: string hashes digits too
    assert report["repairs"]["categorical_null_to_id_0"] == {"c": 3}


def test_the_reserved_hash_is_moved_and_the_top_bit_masked():
    h = pl.Series([0, 5, LIMIT, 2**64 - 1, 2**63, 2**63 + 7, LIMIT - 1], dtype=pl.UInt64)
    got = pl.select(raw_hash_ids(pl.lit(h))).to_series()
    assert got.dtype == pl.Int64
    assert got.to_list() == [0, 5, LIMIT - 1, LIMIT - 1, 0, 7, LIMIT - 1]


# --- 3. lists ------------------------------------------------------------------------------------

def test_parquet_lists_per_element(tmp_path):
    tags = [["a", None, "b"], [], None, ["", "c"], ["a", "b", "c", "d"]]
    hist = [[2**40, 3], [None], None, [0], [-5, 1]]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"y": [1, 0, 1, 0, 1], "k": [0.0, 1.0, 2.0, 3.0, 4.0], "tags": tags,
                             "hist": pa.array(hist, pa.list_(pa.int64()))}), path)
    spec = ("input: {format: parquet}\nlabel: y\ndense: [{name: k}]\nsparse:\n"
            "  - {name: tags, encoding: raw, multi_hot: true, max_length: 3}\n"
            "  - {name: hist, encoding: raw, multi_hot: true, empty_list: oov}\n" + ALL_TRAIN)
    report = run(tmp_path, spec, [path])
    assert_balanced(report)
    assert report["rows_dropped"] == {"raw_id_out_of_range": 1}  # the -5 in row 4's list
    out = tmp_path / "out"
    r = ref_raw_id
    assert by_key(out, "tags") == {0.0: [r("a"), r("b")], 1.0: [], 2.0: [], 3.0: [r("c")]}
    assert by_key(out, "hist") == {0.0: [2**40, 3], 1.0: [0], 2.0: [0], 3.0: [0]}
    types = pq.read_schema(out / meta(out)["splits"]["train"]["files"][0])
    assert types.field("tags").type.value_type == pa.int64()
    assert report["repairs"]["empty_list_to_id_0"] == {"hist": 2}
    sparse = {s["name"]: s for s in meta(out)["sparse"]}
    assert sparse["tags"]["max_length"] == 2 and sparse["tags"]["raw"] is True


def test_csv_lists_truncated_and_hashed(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("y,k,h,t\n1,0,1|2|3,x|y\n0,1,,\n1,2,4294967296|  | 8,z||x\n0,3,-1,x\n")
    spec = ("input: {format: csv}\nlabel: y\ndense: [{name: k}]\nsparse:\n"
            "  - {name: h, encoding: raw, multi_hot: true, separator: '|', max_length: 2,\n"
            "     dtype: integer}\n"
            "  - {name: t, encoding: raw, multi_hot: true, separator: '|'}\n" + ALL_TRAIN)
    report = run(tmp_path, spec, [path])
    assert_balanced(report)
    assert report["rows_dropped"] == {"raw_id_out_of_range": 1}
    assert meta(tmp_path / "out")["spec"]["sparse"][1]["dtype"] == "string"  # inferred
    assert by_key(tmp_path / "out", "h") == {0.0: [1, 2], 1.0: [], 2.0: [2**32, 8]}
    assert by_key(tmp_path / "out", "t") == {0.0: [ref_raw_id("x"), ref_raw_id("y")], 1.0: [],
                                             2.0: [ref_raw_id("z"), ref_raw_id("x")]}
    assert report["repairs"]["list_truncated"] == {"h": 1}


# --- 4. on_invalid: error ------------------------------------------------------------------------

def test_on_invalid_error_names_file_row_and_column(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"y": [1, 0, 1, 0], "uid": pa.array([3, 4, -7, 5], pa.int64()),
                             "l": pa.array([[1], [2, -1], [3], [4]], pa.list_(pa.int64()))}), path)
    spec = ("input: {format: parquet}\nlabel: y\nsparse: [{name: uid, encoding: raw}, "
            "{name: l, encoding: raw, multi_hot: true}]\non_invalid: error\n" + ALL_TRAIN)
    with pytest.raises(IngestError) as err:
        run(tmp_path, spec, [path])
    message = str(err.value)
    assert "\n" not in message
    assert message == (f"{path}: row 1: column l: raw id out of range (value [2, -1], raw ids "
                       "must lie in [0, 2^63 - 1); on_invalid: drop would drop and count such "
                       "rows)")
    assert not (tmp_path / "out" / "metadata.json").exists()

    csv = tmp_path / "t.csv"
    csv.write_text("y,uid\n1,3\n0,4\n1,-7\n")
    spec = ("input: {format: csv}\nlabel: y\nsparse: [{name: uid, encoding: raw}]\n"
            "on_invalid: error\n" + ALL_TRAIN)
    with pytest.raises(IngestError) as err:
        run(tmp_path, spec, [csv], out="strict")
    assert str(err.value) == (f"{csv}: line 4: column uid: raw id out of range (value '-7', raw "
                              "ids must lie in [0, 2^63 - 1); on_invalid: drop would drop and "
                              "count such rows)")


# --- 5. spec checks ------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, key, words", [
    ("min_frequency: 2", "sparse[0].min_frequency", "only for encoding: vocab"),
    ("max_vocab_size: 100", "sparse[0].max_vocab_size", "only for encoding: vocab"),
    ("hash_buckets: 100", "sparse[0].hash_buckets", "only for encoding: hash"),
    ("num_embeddings: 100", "sparse[0].num_embeddings", "not for encoding: raw"),
    ("bucketize: [1, 2]", "sparse[0].bucketize", "encoding: raw keeps the values as ids"),
    ("quantiles: 4", "sparse[0].quantiles", "encoding: raw keeps the values as ids"),
])
def test_vocab_and_bucket_keys_are_refused(tmp_path, extra, key, words):
    path = tmp_path / "s.yaml"
    path.write_text("input: {format: csv}\nlabel: y\ndense: [{name: x}]\n"
                    f"sparse: [{{name: c, column: x, encoding: raw, {extra}}}]\n")
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}: {key}: ") and words in message


# --- 6. metadata, report, the loader -------------------------------------------------------------

def write_logs(path: Path, n: int = 600) -> None:
    """Users and items with ids beyond 2^32, cities as strings, item histories; some nulls."""
    user = [None if i % 37 == 0 else 2**40 + (i * 7919) % 150 for i in range(n)]
    item = [(i * 104729) % 400 * 2**33 + 1 for i in range(n)]
    city = [None if i % 11 == 0 else f"city-{(i * 31) % 50}" for i in range(n)]
    history = [[(i + j) % 90 + 2**61 for j in range(i % 4)] for i in range(n)]
    pq.write_table(pa.table({
        "clicked": [float((i * 13) % 3 == 0) for i in range(n)],
        "price": [float(i % 17) for i in range(n)],
        "user_id": pa.array(user, pa.int64()), "item_id": pa.array(item, pa.int64()),
        "city": city, "history": pa.array(history, pa.list_(pa.int64())),
    }), path)


def python_ids(out: Path, split: str, name: str) -> set[int]:
    ids: set[int] = set()
    for v in rows(out, split)[name].to_list():
        ids.update(v if isinstance(v, list) else [v])
    return ids


def test_metadata_report_and_reader(tmp_path):
    path = tmp_path / "logs.parquet"
    write_logs(path)
    spec = (ROOT / "configs" / "ingest" / "ctr_raw.yaml").read_text()
    spec = spec.replace("  - {name: city, encoding: raw}",
                        "  - {name: city, encoding: raw}\n  - {name: city_v, column: city}")
    spec = spec.replace("valid_fraction: 0.1", "valid_fraction: 0.2")
    report = run(tmp_path, spec, [path])
    assert_balanced(report)
    out = tmp_path / "out"
    m = meta(out)
    assert set(m["splits"]) == set(SPLITS)
    sparse = {s["name"]: s for s in m["sparse"]}
    raw = ["user_id", "item_id", "city", "history"]
    assert all(sparse[n]["raw"] is True for n in raw) and "raw" not in sparse["city_v"]
    for name in raw:
        train = python_ids(out, "train", name)
        assert sparse[name]["num_embeddings"] == len(train), name  # distinct train ids, 0 included
        info = report["features"][name]
        assert info["num_embeddings"] == info["distinct_train_ids"] == len(train)
        for split in SPLITS:
            assert info["distinct_ids_by_split"][split] == len(python_ids(out, split, name))
        assert info["unseen_in_train"] == {
            s: len(python_ids(out, s, name) - train) for s in ("valid", "test")}
    assert 0 in python_ids(out, "train", "user_id")  # the nulls' id is counted like any other
    assert report["features"]["item_id"]["unseen_in_train"]["valid"] > 0  # worth reporting
    # no vocabulary for raw features (the vocab feature on the same column still has one)
    assert sorted(p.name for p in (out / "vocab").iterdir()) == ["city_v.parquet"]
    assert m["vocab_files"] == {"city_v": "vocab/city_v.parquet"}
    written = set().union(*(python_ids(out, s, "city") for s in SPLITS))
    assert written == {ref_raw_id(c) for c in pl.read_parquet(path)["city"].to_list()}
    assert len(written) == 51  # 50 cities and null (no row was dropped)

    from embedtrain.data.reader import ParquetBatchReader

    dataset = load_dataset_meta(out)
    features = {f.name: f for f in dataset.features.sparse}
    assert features["user_id"].raw and features["history"].raw and not features["city_v"].raw
    assert features["item_id"].num_embeddings == len(python_ids(out, "train", "item_id"))
    reader = ParquetBatchReader(dataset.files("train"), dataset.features, batch_size=64)
    batch = next(iter(reader))
    kjt = batch.sparse_features.to_dict()
    first = rows(out, "train").head(64)
    assert kjt["item_id"].values().tolist() == first["item_id"].to_list()
    assert kjt["history"].values().tolist() == first["history"].explode().drop_nulls().to_list()
    assert kjt["city"].values().tolist() == first["city"].to_list()
    assert kjt["user_id"].values().tolist() == first["user_id"].to_list()


def test_num_embeddings_is_at_least_1(tmp_path):
    # both features are empty in every training row (a value only in the test row: a column
    # empty in every row is refused)
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"y": [1, 0, 1, 0], "s": ["train", "train", "train", "test"],
                             "h": pa.array([[], [], None, [5]], pa.list_(pa.int64())),
                             "c": pa.array([None, None, None, "x"], pa.string())}), path)
    spec = ("input: {format: parquet}\nlabel: y\nsparse: [{name: h, encoding: raw, multi_hot: "
            "true}, {name: c, encoding: raw}]\nsplit: {method: column, column: s, values: "
            "{train: [train], test: [test]}}\n")
    report = run(tmp_path, spec, [path])
    assert report["features"]["h"]["distinct_train_ids"] == 0
    assert report["features"]["c"]["distinct_train_ids"] == 1  # id 0 of the nulls
    assert [s["num_embeddings"] for s in meta(tmp_path / "out")["sparse"]] == [1, 1]
    assert [s.num_embeddings for s in load_dataset_meta(tmp_path / "out").features.sparse] == [1, 1]


def test_one_integer_column_feeding_a_raw_and_a_vocab_feature(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"y": [1, 0, 1, 0], "k": [0.0, 1.0, 2.0, 3.0],
                             "uid": pa.array([2**33, 9, 2**33, None], pa.int64())}), path)
    spec = ("input: {format: parquet}\nlabel: y\ndense: [{name: k}]\nsparse: [{name: uid}, "
            "{name: uid_raw, column: uid, encoding: raw}]\n" + ALL_TRAIN)
    report = run(tmp_path, spec, [path])
    assert by_key(tmp_path / "out", "uid") == {0.0: 1, 1.0: 2, 2.0: 1, 3.0: 0}
    assert by_key(tmp_path / "out", "uid_raw") == {0.0: 2**33, 1.0: 9, 2.0: 2**33, 3.0: 0}
    assert report["features"]["uid_raw"]["column"] == "uid"
    assert [s.get("raw", False) for s in meta(tmp_path / "out")["sparse"]] == [False, True]
