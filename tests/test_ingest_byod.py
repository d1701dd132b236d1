"""``embedtrain ingest`` on the user's own tables: types from the schema, numeric strings, one
column feeding several features (bucketize, quantiles), column and file splits, empty splits."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedtrain.config import ConfigError
from embedtrain.features import load_dataset_meta
from pipelines.core.errors import IngestError
from pipelines.tabular.passes import ingest
from pipelines.tabular.spec import load_spec


def run(tmp_path: Path, spec_text: str, inputs: list, out: str = "out") -> dict:
    path = tmp_path / "spec.yaml"
    path.write_text(spec_text)
    return ingest(load_spec(path), [str(i) for i in inputs], tmp_path / out, progress=False)


def meta(out: Path) -> dict:
    return json.loads((out / "metadata.json").read_text())


def rows(out: Path, split: str) -> pl.DataFrame:
    return pl.concat([pl.read_parquet(out / f) for f in meta(out)["splits"][split]["files"]])


def everything(out: Path) -> pl.DataFrame:
    return pl.concat([rows(out, s) for s in meta(out)["splits"]])


def assert_balanced(report: dict) -> None:
    assert report["rows_read"] == report["rows_written_total"] + report["rows_dropped_total"]
    assert report["rows_written_total"] == sum(report["rows_written"].values())
    assert report["rows_dropped_total"] == sum(report["rows_dropped"].values())


ALL_TRAIN = "split: {method: hash, valid_fraction: 0.0, test_fraction: 0.0}\n"


# --- 1. types from the schema --------------------------------------------------------------------

def test_parquet_integer_ids_need_no_dtype(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"y": [1, 0, 1, 0], "user_id": pa.array([7, 7, 3, 9], pa.int32()),
                             "c": ["a", "b", "a", None]}), path)
    spec = "input: {format: parquet}\nlabel: y\nsparse: [{name: user_id}, {name: c}]\n" + ALL_TRAIN
    report = run(tmp_path, spec, [path])
    assert_balanced(report)
    vocab = pl.read_parquet(tmp_path / "out" / "vocab" / "user_id.parquet")
    assert vocab.schema["value"] == pl.Int64 and vocab["value"].to_list() == [7, 3, 9]
    assert pl.read_parquet(tmp_path / "out" / "vocab" / "c.parquet").schema["value"] == pl.String
    assert rows(tmp_path / "out", "train")["user_id"].to_list() == [1, 1, 2, 3]
    assert meta(tmp_path / "out")["spec"]["sparse"][0]["dtype"] == "integer"  # resolved


@pytest.mark.parametrize("columns,spec,message", [
    ({"y": [1, 0], "user_id": [1, 2]},
     "input: {format: parquet}\nlabel: y\nsparse: [{name: user_id, dtype: string}]\n",
     "column user_id holds int64, spec says dtype: string; remove dtype to use the file's "
     "type, or set dtype: integer"),
    ({"y": [1, 0], "x": pa.array(["1", "2"], pa.large_string()), "c": ["a", "b"]},
     "input: {format: parquet}\nlabel: y\ndense: [{name: x}]\nsparse: [{name: c}]\n",
     "column x: expected numbers, got large_string; numbers stored as strings: set cast: "
     "float on the dense feature"),
])
def test_parquet_type_errors_say_the_fix(tmp_path, columns, spec, message):
    """A dtype that contradicts the file, numbers stored as strings: one line with the fix."""
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table(columns), path)
    with pytest.raises(IngestError) as err:
        run(tmp_path, spec, [path])
    assert str(err.value) == f"{path}: {message}"


def test_parquet_pre_encoded_ids_inferred(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"y": [1, 0, 1], "item": [0, 4, 2]}), path)
    spec = ("input: {format: parquet}\nlabel: y\n"
            "sparse: [{name: item, encoding: pre_encoded, num_embeddings: 5}]\n" + ALL_TRAIN)
    run(tmp_path, spec, [path])
    assert rows(tmp_path / "out", "train")["item"].to_list() == [0, 4, 2]


def test_csv_types_inferred_from_the_values(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("y,user_id,city,tags\n1,10,paris,1;2\n0,10,rome,3\n1,20,paris,\n0,30,7a,2\n")
    spec = ("input: {format: csv}\nlabel: y\nsparse:\n  - {name: user_id}\n  - {name: city}\n"
            "  - {name: tags, multi_hot: true, separator: ';'}\n" + ALL_TRAIN)
    run(tmp_path, spec, [path])
    out = tmp_path / "out"
    assert [s["dtype"] for s in meta(out)["spec"]["sparse"]] == ["integer", "string", "integer"]
    assert pl.read_parquet(out / "vocab" / "user_id.parquet")["value"].to_list() == [10, 20, 30]
    assert pl.read_parquet(out / "vocab" / "tags.parquet")["value"].to_list() == [2, 1, 3]
    # an explicit dtype still wins
    run(tmp_path, spec.replace("{name: user_id}", "{name: user_id, dtype: string}"), [path], "o2")
    assert pl.read_parquet(tmp_path / "o2" / "vocab" / "user_id.parquet").schema["value"] == \
        pl.String


# --- 2. numeric strings as dense features --------------------------------------------------------

def test_parquet_numeric_strings_with_cast_float(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"y": [1, 0, 1, 0, 1], "x": ["1.5", "abc", None, " 2 ", "n/a"],
                             "c": ["a"] * 5}), path)
    spec = ("input: {format: parquet}\nlabel: y\ndense: [{name: x, cast: float, fill_null: -1}]\n"
            "sparse: [{name: c}]\n" + ALL_TRAIN)
    report = run(tmp_path, spec, [path])
    assert_balanced(report)
    assert report["rows_dropped_total"] == 0  # repaired, not dropped
    assert report["repairs"]["unparsable_number"] == {"x": 2}
    assert report["repairs"]["dense_null_filled"] == {"x": 1}
    assert rows(tmp_path / "out", "train")["x"].to_list() == [1.5, -1.0, -1.0, 2.0, -1.0]


def test_csv_cast_float_repairs_instead_of_dropping(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("y,x\n1,1.5\n0,oops\n1,\n0,3\n")
    base = "input: {format: csv}\nlabel: y\ndense: [{name: x%s}]\n" + ALL_TRAIN
    report = run(tmp_path, base % "", [path], "plain")
    assert report["rows_dropped"] == {"unparsable_value": 1}  # the existing convention
    report = run(tmp_path, base % ", cast: float", [path], "cast")
    assert_balanced(report)
    assert report["rows_dropped_total"] == 0
    assert report["repairs"]["unparsable_number"] == {"x": 1}
    assert report["repairs"]["dense_null_filled"] == {"x": 1}


# --- 3. one column, several features --------------------------------------------------------------

AGES = [None, 5.0, 17.9, 18.0, 29.0, 30.0, 64.0, 90.0, float("nan"), 45.0]


def test_one_column_feeds_dense_bucketized_and_quantile_features(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"y": [i % 2 for i in range(10)], "age": AGES}), path)
    spec = ("input: {format: parquet}\nlabel: y\n"
            "dense: [{name: age, fill_null: 0, non_finite: fill}]\nsparse:\n"
            "  - {name: age_bucket, column: age, bucketize: [18, 30, 65]}\n"
            "  - {name: age_q, column: age, quantiles: 2}\n" + ALL_TRAIN)
    report = run(tmp_path, spec, [path])
    assert_balanced(report)
    out = tmp_path / "out"
    m = meta(out)
    assert [s["name"] for s in m["sparse"]] == ["age_bucket", "age_q"]
    assert [s["num_embeddings"] for s in m["sparse"]] == [5, 3]
    # finite ages sorted: 5, 17.9, 18, 29, 30, 45, 64, 90 -> the median (nearest) is 30
    assert m["bucket_boundaries"] == {"age_bucket": [18.0, 30.0, 65.0], "age_q": [30.0]}
    assert report["features"]["age_q"]["boundaries"] == [30.0]
    got = rows(out, "train")
    assert got["age_bucket"].to_list() == [0, 1, 1, 2, 2, 3, 3, 4, 0, 3]
    assert got["age_q"].to_list() == [0, 1, 1, 1, 1, 2, 2, 2, 0, 2]
    assert got["age"][0] == 0.0 and got["age"][1] == 5.0
    assert report["repairs"]["categorical_null_to_id_0"] == {"age_bucket": 2, "age_q": 2}
    ds = load_dataset_meta(out)
    assert ds.features.sparse_names == ["age_bucket", "age_q"]


def test_bucketize_on_csv_and_a_string_column_feeding_two_features(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("y,age,city\n1,12,paris\n0,40,rome\n1,x,paris\n0,,rome\n")
    spec = ("input: {format: csv}\nlabel: y\nsparse:\n"
            "  - {name: age_b, column: age, bucketize: [18]}\n"
            "  - {name: city}\n"
            "  - {name: city_h, column: city, encoding: hash, hash_buckets: 8}\n" + ALL_TRAIN)
    report = run(tmp_path, spec, [path])
    assert_balanced(report)
    assert report["rows_dropped_total"] == 0  # 'x' is repaired to bucket 0, and counted
    assert report["repairs"]["unparsable_number"] == {"age_b": 1}
    assert report["repairs"]["categorical_null_to_id_0"] == {"age_b": 1}
    got = rows(tmp_path / "out", "train")
    assert got["age_b"].to_list() == [1, 2, 0, 0]
    assert got["city"].to_list() == [1, 2, 1, 2]
    assert got["city_h"].n_unique() == 2 and got["city_h"].min() >= 1


@pytest.mark.parametrize("text, key, words", [
    ("dense: [{name: age}]\nsparse: [{name: age}]", "sparse[0].name", "named twice"),
    ("sparse: [{name: a, column: age, bucketize: [3, 1]}]", "sparse[0].bucketize", "ascending"),
    ("sparse: [{name: a, column: age, bucketize: [1], quantiles: 4}]", "sparse[0].quantiles",
     "not both"),
    ("sparse: [{name: a, column: age, quantiles: 4, dtype: integer}]", "sparse[0].dtype",
     "remove dtype"),
    ("sparse: [{name: age, column: b}, {name: c, column: age}]", "sparse[1].column",
     "also the name of the feature at sparse[0].name"),
    ("sparse: [{name: c}]\nsplit: {method: column, column: c, values: {valid: ['1']}}",
     "split.values", "values of the train split"),
    ("sparse: [{name: c}]\nsplit: {method: column, column: c, values: {train: ['1'], "
     "test: ['1']}}", "split.values.test", "also listed for train"),
    ("sparse: [{name: c}]\nsplit: {method: files, files: {train: 'a*'}}", "split.files.train",
     "no other split's glob matches"),
])
def test_bad_byod_spec_is_one_line(tmp_path, text, key, words):
    path = tmp_path / "s.yaml"
    path.write_text("input: {format: csv}\nlabel: y\n" + text + "\n")
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}: {key}: ") and words in message


# --- 4. splits the user chooses -----------------------------------------------------------------

def test_column_split_by_listed_values(tmp_path):
    path = tmp_path / "t.parquet"
    year = [2019, 2019, 2020, 2020, 2021, 2022, None, 2019]
    pq.write_table(pa.table({"y": [i % 2 for i in range(8)], "year": year,
                             "c": list("abcdefgh")}), path)
    spec = ("input: {format: parquet}\nlabel: y\nsparse: [{name: c}]\n"
            "split: {method: column, column: year, values: {train: ['2019', '2020'], "
            "test: ['2021']}}\n")
    report = run(tmp_path, spec, [path])
    assert_balanced(report)
    assert report["rows_written"] == {"train": 5, "valid": 0, "test": 1}
    assert report["rows_dropped"] == {"null_split_key": 1, "split_value_not_listed": 1}
    assert report["rows_dropped_by_column"]["split_value_not_listed"] == {"year": 1}
    out = tmp_path / "out"
    assert sorted(meta(out)["splits"]) == ["test", "train"]
    assert rows(out, "test").height == 1 and not (out / "valid").exists()
    assert report["warnings"] == [f"{out}: no valid split: training will not evaluate "
                                  "periodically or select a best checkpoint; list the column's "
                                  "values of valid in split.values.valid to have one"]


def test_column_split_on_a_csv_string_column(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("y,fold,c\n1,a,x\n0,b,y\n1,c,z\n0,a,x\n1,d,x\n")
    spec = ("input: {format: csv}\nlabel: y\nsparse: [{name: c}]\n"
            "split: {method: column, column: fold, values: {train: [a, d], valid: [b], "
            "test: [c]}}\n")
    report = run(tmp_path, spec, [path])
    assert report["rows_written"] == {"train": 3, "valid": 1, "test": 1}
    assert "warnings" not in report


def test_files_split(tmp_path):
    for i, name in enumerate(["day_1.csv", "day_2.csv", "day_3.csv"]):
        (tmp_path / name).write_text("y,c\n" + "".join(f"{j % 2},{name}\n" for j in range(i + 2)))
    spec = ("input: {format: csv}\nlabel: y\nsparse: [{name: c}]\n"
            "split: {method: files, files: {valid: '*day_2.csv', test: day_3.csv}}\n")
    report = run(tmp_path, spec, [tmp_path / "day_*.csv"])
    assert_balanced(report)
    assert report["rows_written"] == {"train": 2, "valid": 3, "test": 4}
    assert report["split"]["files"] == {"valid": "*day_2.csv", "test": "day_3.csv"}
    # every file to test or valid: no train rows, refused in one line naming the split and fix
    spec = spec.replace("test: day_3.csv", "test: 'day_[13].csv'")
    with pytest.raises(IngestError) as err:
        run(tmp_path, spec, [tmp_path / "day_*.csv"], "o2")
    message = str(err.value)
    assert "\n" not in message and "split train receives no rows (valid 3, test 6)" in message
    assert message.endswith("leave some files unmatched by split.files (they are train)")


def test_files_split_on_parquet(tmp_path):
    for name, n in [("a.parquet", 3), ("b.parquet", 2)]:
        pq.write_table(pa.table({"y": [1] * n, "c": ["q"] * n}), tmp_path / name)
    spec = ("input: {format: parquet}\nlabel: y\nsparse: [{name: c}]\n"
            "split: {method: files, files: {test: b.parquet}}\n")
    report = run(tmp_path, spec, [tmp_path / "a.parquet", tmp_path / "b.parquet"])
    assert report["rows_written"] == {"train": 3, "valid": 0, "test": 2}


# --- 5. optional validation, empty splits ---------------------------------------------------------

def test_valid_fraction_zero_omits_the_valid_split(tmp_path, capsys):
    path = tmp_path / "t.csv"
    path.write_text("y,c\n" + "".join(f"{i % 2},v{i % 5}\n" for i in range(200)))
    spec = ("input: {format: csv}\nlabel: y\nsparse: [{name: c}]\n"
            "split: {method: hash, valid_fraction: 0.0, test_fraction: 0.2}\n")
    report = run(tmp_path, spec, [path])
    out = tmp_path / "out"
    assert sorted(meta(out)["splits"]) == ["test", "train"]
    assert not (out / "valid").exists()
    assert report["rows_written"]["valid"] == 0 and report["files_written"]["valid"] == 0
    assert set(load_dataset_meta(out).split_files) == {"train", "test"}
    err = capsys.readouterr().err
    assert (f"warning: {out}: no valid split: training will not evaluate periodically or select "
            "a best checkpoint; set split.valid_fraction > 0 to have one") in err.splitlines()
    assert "no test split" not in err


def test_empty_train_split_is_refused(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("y,c,fold\n1,a,x\n0,b,y\n")
    spec = ("input: {format: csv}\nlabel: y\nsparse: [{name: c}]\n"
            "split: {method: column, column: fold, values: {train: [z], valid: [x, y]}}\n")
    with pytest.raises(IngestError) as err:
        run(tmp_path, spec, [path])
    assert str(err.value) == (f"{path}: split train receives no rows (valid 2, test 0); list the "
                              "column's values of train in split.values.train")
    assert not (tmp_path / "out" / "metadata.json").exists()
