"""Every bad value is caught where it enters ingestion (issue 28, item 3): one line naming the
file, the column and the row (a 1-based line for text, a 0-based row for parquet), an
``IngestError`` (exit 2 from the CLI), never a traceback or a silent repair; an explicit repair
(``non_finite: fill``) is counted in the report.

Tiny inputs written in ``tmp_path``; each test runs a job or two in-process.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedtrain.cli import main
from pipelines.core.errors import IngestError
from pipelines.graph.passes import ingest as ingest_graph
from pipelines.graph.spec import load_spec as load_graph_spec
from pipelines.tabular.checks import SPLIT_DROP_WARNING
from pipelines.tabular.passes import ingest
from pipelines.tabular.spec import load_spec
from pipelines.xc.passes import ingest as ingest_xc
from pipelines.xc.spec import load_spec as load_xc_spec

ROOT = Path(__file__).resolve().parent.parent
CSV = "input: {format: csv}\nlabel: y\n"
TSV = 'input: {format: csv, separator: "\\t"}\nlabel: y\n'
ALL_TRAIN = "split: {valid_fraction: 0, test_fraction: 0}\n"
XC_CSV = ("kind: xc\ninput: {format: csv}\ntokens: {separator: ' '}\n"
          "labels: {column: label, encoding: pre_encoded, num_classes: 3}\n" + ALL_TRAIN)
XC_PARQUET = ("kind: xc\ninput: {format: parquet}\n"
              "labels: {column: label, encoding: pre_encoded, num_classes: 3}\n" + ALL_TRAIN)
GRAPH = "kind: graph\nedges: {format: csv, src: src, dst: dst}\nsplit: {method: random}\n"


def write(path: Path, data: str | bytes) -> Path:
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def spec_file(tmp_path: Path, text: str) -> Path:
    return write(tmp_path / "spec.yaml", text)


def run(tmp_path: Path, spec: str, inputs: list, out: str = "out") -> dict:
    return ingest(load_spec(spec_file(tmp_path, spec)), [str(i) for i in inputs],
                  tmp_path / out, progress=False)


def run_xc(tmp_path: Path, spec: str, inputs: list, out: str = "out") -> dict:
    return ingest_xc(load_xc_spec(spec_file(tmp_path, spec)), [str(i) for i in inputs],
                     tmp_path / out, progress=False)


def refused(job, *args) -> str:
    """The job's one-line IngestError."""
    with pytest.raises(IngestError) as err:
        job(*args)
    message = str(err.value)
    assert "\n" not in message, message
    return message


# --- 1. NaN and infinity in dense features ------------------------------------------------------

NAN_CSV = "y,x,c\n1,1.5,a\n0,2,b\n1,inf,a\n0,NaN,b\n"


def test_nan_or_inf_in_a_dense_feature_is_refused_with_file_line_and_column(tmp_path):
    path = write(tmp_path / "in.csv", NAN_CSV)
    message = refused(run, tmp_path, CSV + "dense: [{name: x}]\nsparse: [{name: c}]\n" + ALL_TRAIN,
                      [path])
    assert message.startswith(f"{path}: line 4: column x: value 'inf' is not finite")
    assert "2 such value(s)" in message and "dense[0].non_finite: fill" in message
    assert not (tmp_path / "out" / "metadata.json").exists()
    # parquet: the 0-based row; the CLI turns the error into exit 2
    pq.write_table(pa.table({"y": [1.0, 0.0, 1.0], "x": [1.0, 2.0, float("nan")]}),
                   tmp_path / "t.parquet")
    spec = spec_file(tmp_path, "input: {format: parquet}\nlabel: y\ndense: [{name: x}]\n")
    message = refused(ingest, load_spec(spec), [str(tmp_path / "t.parquet")], tmp_path / "o2")
    assert message.startswith(f"{tmp_path / 't.parquet'}: row 2: column x: value nan is not finite")
    assert main(["ingest", str(spec), "--input", str(tmp_path / "t.parquet"), "--out",
                 str(tmp_path / "o3"), "--quiet"]) == 2


def test_non_finite_fill_repairs_and_counts_them(tmp_path):
    path = write(tmp_path / "in.csv", NAN_CSV)
    spec = (CSV + "dense: [{name: x, non_finite: fill, fill_null: -1}]\nsparse: [{name: c}]\n"
            + ALL_TRAIN)
    report = run(tmp_path, spec, [path])
    assert report["repairs"]["dense_non_finite_filled"] == {"x": 2}
    assert report["rows_written_total"] == 4 and report["rows_dropped_total"] == 0
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    part = pl.read_parquet(tmp_path / "out" / meta["splits"]["train"]["files"][0])
    assert part["x"].to_list() == [1.5, 2.0, -1.0, -1.0]
    assert meta["spec"]["dense"][0]["non_finite"] == "fill"
    # the default is left out of metadata.json's spec: earlier data sets stay byte-identical
    report = run(tmp_path, CSV + "dense: [{name: x}]\nsparse: [{name: c}]\n" + ALL_TRAIN,
                 [write(tmp_path / "ok.csv", "y,x,c\n1,1.5,a\n0,2,b\n")], "ok")
    assert "dense_non_finite_filled" not in report["repairs"]
    assert "non_finite" not in json.loads((tmp_path / "ok" / "metadata.json").read_text())[
        "spec"]["dense"][0]


def test_xc_dense_nan_refused_or_filled_and_counted(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"tokens": [["a"], ["b"], ["c"], ["a"]], "label": [0, 1, 2, 1],
                             "x": [1.0, float("nan"), 2.0, float("inf")]}), path)
    message = refused(run_xc, tmp_path, XC_PARQUET + "dense: [{name: x}]\n", [path])
    assert message.startswith(f"{path}: row 1: column x: value nan is not finite")
    report = run_xc(tmp_path, XC_PARQUET + "dense: [{name: x, non_finite: fill}]\n", [path], "f")
    assert report["repairs"]["dense_non_finite_filled"] == {"x": 2}


# --- 2. lists in single-valued columns, and the other way round -------------------------------

@pytest.mark.parametrize("column, value, sep", [("c", "a1,b2", ","), ("c", "3|7", "|")])
def test_a_list_in_a_single_valued_column_is_refused(tmp_path, column, value, sep):
    path = write(tmp_path / "in.tsv", f"y\tc\n1\t1\n0\t2\n1\t{value}\n0\t2\n")
    dtype = ", dtype: integer" if sep == "|" else ""
    message = refused(run, tmp_path, TSV + f"sparse: [{{name: c{dtype}}}]\n" + ALL_TRAIN, [path])
    assert message.startswith(f"{path}: line 4: column c: value {value!r} is a list "
                              f"(2 values separated by {sep!r}), but feature c is single-valued")
    assert f"set multi_hot: true and separator: {sep!r}" in message


def test_a_list_joined_by_another_separator_is_refused(tmp_path):
    path = write(tmp_path / "in.csv", "y,tags\n1,a|b\n0,b\n1,a;b\n")
    spec = CSV + "sparse: [{name: tags, multi_hot: true, separator: '|'}]\n" + ALL_TRAIN
    message = refused(run, tmp_path, spec, [path])
    assert message.startswith(f"{path}: line 4: column tags: value 'a;b' is a list separated "
                              "by ';', but feature tags splits on '|'")


def test_parquet_list_and_scalar_columns_must_match_multi_hot(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"y": [1, 0], "ids": [[1, 2], [3]], "one": [1, 2]}), path)
    base = "input: {format: parquet}\nlabel: y\nsparse: "
    assert refused(run, tmp_path, base + "[{name: ids}]\n", [path]).startswith(
        f"{path}: column ids: expected single values, got list")
    assert refused(run, tmp_path, base + "[{name: one, multi_hot: true}]\n", [path]).startswith(
        f"{path}: column one: expected a list column (multi_hot: true), got int64")


# --- 3. duplicate input columns -----------------------------------------------------------------

def test_a_column_named_twice_in_a_header_is_refused(tmp_path):
    path = write(tmp_path / "in.csv", "y,c,x,c\n1,a,1,b\n")
    want = (f"{path}: line 1: column c appears twice in the header (fields 2 and 4); column "
            "names must be unique")
    assert refused(run, tmp_path, CSV + "sparse: [{name: c}]\n", [path]).startswith(want)
    edges = write(tmp_path / "e.csv", "src,dst,src\na,b,c\n")
    assert refused(ingest_graph, load_graph_spec(spec_file(tmp_path, GRAPH)), [str(edges)],
                   tmp_path / "g").startswith(f"{edges}: line 1: column src appears twice")


# --- 4. empty and non-UTF-8 files ---------------------------------------------------------------

def test_a_zero_byte_csv_is_one_line(tmp_path):
    empty = write(tmp_path / "empty.csv", b"")
    good = write(tmp_path / "b.csv", "y,c\n1,a\n,b\n")
    # on_invalid: error looks for the first bad row file by file: the empty one has none
    message = refused(run, tmp_path, CSV + "sparse: [{name: c}]\non_invalid: error\n",
                      [empty, good])
    assert message.startswith(f"{good}: line 3: column y: null label")
    assert refused(run, tmp_path, CSV + "sparse: [{name: c}]\n", [empty]) == (
        f"{empty}: no rows to ingest (1 file(s), all empty)")
    assert refused(run_xc, tmp_path, XC_CSV, [empty]).startswith(f"{empty}: empty file (0 bytes")


def test_a_non_utf8_byte_names_the_file_and_line(tmp_path):
    bad = b"y\tc\n1\ta\n0\tb\n1\t\xffc\n"
    path = write(tmp_path / "in.tsv", bad)
    want = f"{path}: line 4: not UTF-8 text (byte 0xff)"
    for sparse in ("[{name: c}]", "[{name: c, dtype: string}]"):  # read at inference, or scan
        assert refused(run, tmp_path, TSV + f"sparse: {sparse}\n", [path]).startswith(want)
    xc = write(tmp_path / "x.csv", b"tokens,label\na b,1\na b,2\na \xffb,2\n")
    assert refused(run_xc, tmp_path, XC_CSV, [xc]).startswith(f"{xc}: line 4: not UTF-8")
    edges = write(tmp_path / "e.csv", b"src,dst\na,b\nb,c\nc,\xffd\n")
    assert refused(ingest_graph, load_graph_spec(spec_file(tmp_path, GRAPH)), [str(edges)],
                   tmp_path / "g").startswith(f"{edges}: line 4: not UTF-8")
    header = write(tmp_path / "h.csv", b"y,c\xff\n1,a\n")
    assert refused(run, tmp_path, CSV + "sparse: [{name: c, dtype: string}]\n",
                   [header]).startswith(f"{header}: line 1: not UTF-8")


@pytest.mark.parametrize("kind", ["gzip", "bzip2", "xz", "zip"])
def test_a_compressed_text_input_is_named_as_such(tmp_path, kind):
    import bz2
    import gzip
    import lzma
    import zipfile

    text = b"y,c\n1,a\n0,b\n"
    path = tmp_path / "in.csv"
    if kind == "zip":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("in.csv", text)
    else:
        path.write_bytes({"gzip": gzip, "bzip2": bz2, "xz": lzma}[kind].compress(text))
    message = refused(run, tmp_path, CSV + "sparse: [{name: c}]\n", [path])
    assert message.startswith(f"{path}: {kind}-compressed; csv input is read as plain text: "
                              "decompress it first"), message


# --- 5. text labels -----------------------------------------------------------------------------

def test_text_labels_name_the_label_column_and_the_values(tmp_path):
    rows = "".join(f"{'yes' if i % 2 else 'no'},a\n" for i in range(299))
    path = write(tmp_path / "in.csv", "y,c\n" + rows)
    message = refused(run, tmp_path, CSV + "sparse: [{name: c}]\n", [path])
    assert message.startswith(f"{path}: no training rows")
    assert ("dropped: unparsable_value 299); column y: unparsable_value 299, values seen: "
            "'no', 'yes'; the label must be a number in [0, 1]") in message


# --- 6. XC rows named right ---------------------------------------------------------------------

def test_xc_out_of_range_label_names_its_line_after_a_multi_line_field(tmp_path):
    # line 10 holds label 7; a quoted token cell spans lines 6-7, so that line is data row 7
    # (0-based), which row + 2 would put at line 9
    path = write(tmp_path / "in.csv", 'tokens,label\na b,0\na b,1\na b,2\na b,1\n"a\nb",2\n'
                                      'a b,0\na b,1\na c,7\na b,0\n')
    report = run_xc(tmp_path, XC_CSV, [path])
    assert report["rows_dropped"] == {"label_out_of_range": 1}
    assert report["dropped_examples"] == {"label_out_of_range": [{"file": str(path),
                                                                   "lines": [10]}]}


# --- 7. a graph without edges -------------------------------------------------------------------

def test_a_graph_of_only_self_loops_is_refused(tmp_path):
    edges = write(tmp_path / "e.csv", "src,dst\na,a\nb,b\nc,c\n")
    message = refused(ingest_graph, load_graph_spec(spec_file(tmp_path, GRAPH)), [str(edges)],
                      tmp_path / "g")
    assert message == (f"{edges}: no edges left after cleaning (3 rows read; dropped: "
                       "self_loop 3); a graph needs at least one edge; graph.self_loops: keep "
                       "keeps self-loops")
    assert not (tmp_path / "g" / "metadata.json").exists()


# --- 8. a split that drops most rows ------------------------------------------------------------

def test_a_column_split_dropping_most_rows_warns_with_the_values_to_list(tmp_path, capsys):
    regions = ["us", "fr", "fr", "de", "it"]
    path = write(tmp_path / "in.csv", "y,c,r\n" + "".join(
        f"{i % 2},a,{regions[i % 5]}\n" for i in range(100)))
    split = "split: {method: column, column: r, values: {train: [us], test: [de]}}\n"
    report = run(tmp_path, CSV + "sparse: [{name: c}]\n" + split, [path])
    assert report["rows_dropped"] == {"split_value_not_listed": 60}
    lines = [x for x in capsys.readouterr().err.splitlines() if "split.values:" in x]
    assert lines == [f"warning: {path}: split.values: 60 of 100 rows (60%, over 10%) dropped as "
                     "split_value_not_listed (column r); values not listed: 'fr' 40, 'it' 20; "
                     "list them in split.values.train, .valid or .test to keep their rows"]
    # at most the stated fraction: no warning
    assert SPLIT_DROP_WARNING == 0.10
    few = write(tmp_path / "few.csv", "y,c,r\n" + "".join(
        f"{i % 2},a,{'fr' if i == 0 else 'us'}\n" for i in range(10)))
    run(tmp_path, CSV + "sparse: [{name: c}]\n" + split, [few], "few")
    assert "split.values:" not in capsys.readouterr().err


# --- ids beyond int64, columns with no value -----------------------------------------------------

def test_an_integer_beyond_int64_is_named_not_read_as_text(tmp_path):
    rows = "".join(f"{i % 2},{i}\n" for i in range(50))
    path = write(tmp_path / "in.csv", f"y,c\n{rows}1,{2**63}\n0,3\n")
    message = refused(run, tmp_path, CSV + "sparse: [{name: c}]\n" + ALL_TRAIN, [path])
    assert message.startswith(f"{path}: line 52: column c: integer {2**63} does not fit int64 "
                              "ids; set dtype: string on feature c")
    # said to be text, it is text: every row kept
    report = run(tmp_path, CSV + "sparse: [{name: c, dtype: string}]\n" + ALL_TRAIN, [path], "s")
    assert report["rows_written_total"] == 52
    multi = write(tmp_path / "m.csv", f"y,c\n1,1|2\n0,3|{2**64}\n")
    message = refused(run, tmp_path, CSV + "sparse: [{name: c, multi_hot: true, separator: '|'}]\n"
                      + ALL_TRAIN, [multi])
    assert message.startswith(f"{multi}: line 3: column c: integer {2**64} does not fit int64")


def test_uint64_ids_beyond_int64_are_named_with_row(tmp_path):
    path = tmp_path / "u.parquet"
    ids = pa.array([1, 2, 3, 2**63 + 1, 5] * 4, pa.uint64())
    pq.write_table(pa.table({"y": [1, 0] * 10, "c": ids}), path)
    base = "input: {format: parquet}\nlabel: y\nsparse: "
    message = refused(run, tmp_path, base + "[{name: c}]\n" + ALL_TRAIN, [path])
    assert message.startswith(f"{path}: row 3: column c: uint64 id {2**63 + 1} does not fit int64")
    report = run(tmp_path, base + "[{name: c, encoding: raw}]\n" + ALL_TRAIN, [path], "raw")
    assert report["rows_dropped"] == {"raw_id_out_of_range": 4}
    small = tmp_path / "small.parquet"  # uint64 within int64: read as before
    pq.write_table(pa.table({"y": [1, 0] * 10, "c": pa.array(range(20), pa.uint64())}), small)
    assert run(tmp_path, base + "[{name: c}]\n" + ALL_TRAIN, [small], "ok")["rows_written_total"] == 20


@pytest.mark.parametrize("feature", ["dense: [{name: x}]\n", "sparse: [{name: c}]\n",
                                     "sparse: [{name: c, multi_hot: true, separator: '|'}]\n"])
def test_a_column_empty_in_every_row_is_refused(tmp_path, feature):
    name = "x" if "dense" in feature else "c"
    path = write(tmp_path / "in.csv", "y,x,c\n" + "".join(f"{i % 2},,\n" for i in range(30)))
    message = refused(run, tmp_path, CSV + feature + ALL_TRAIN, [path])
    assert message.startswith(f"{path}: column {name}: empty in all 30 rows kept, so feature "
                              f"{name} would be only its fill value")
    one = write(tmp_path / "one.csv", "y,x,c\n" + "".join(f"{i % 2},,\n" for i in range(29))
                + "1,2.5,a\n")  # one value: trains, its nulls counted as repairs
    assert run(tmp_path, CSV + feature + ALL_TRAIN, [one], "one")["rows_written_total"] == 30


def test_a_line_with_more_fields_than_the_header_is_named(tmp_path):
    path = write(tmp_path / "in.csv", 'y,c\n1,a\n0,"b,c"\n1,c,d\n0,e\n')
    message = refused(run, tmp_path, CSV + "sparse: [{name: c}]\n" + ALL_TRAIN, [path])
    assert message == (f"{path}: line 4: 3 fields, the header has 2; quote fields that hold the "
                       "separator ','")
    other = write(tmp_path / "ok.csv", "y,c\n1,a\n")  # among several files: the ragged one named
    assert refused(run, tmp_path, CSV + "sparse: [{name: c}]\n" + ALL_TRAIN,
                   [other, path]).startswith(f"{path}: line 4: 3 fields")
