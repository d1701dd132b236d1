"""``--engine ray`` gives what the one-process Polars engine gives, on the same inputs, for
every kind of spec (tabular, xc, graph).

One local Ray instance (2 CPUs) serves the module; each case runs both engines into their own
directories and compares: vocabularies (values, ids, counts) byte for byte, every split's rows
(as sets: the layout of part files differs, not their rows), the report's counts (read, written,
dropped by reason and column, repairs) and the metadata; the dense standardisation constants,
merged from per-file means and deviations, to 1e-12.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.core.errors import IngestError
from pipelines.engines import open_engine
from pipelines.tabular.passes import ingest
from pipelines.tabular.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"POLARS_MAX_THREADS": "1"}})
    yield
    ray.shutdown()


def _both(spec_path: Path, inputs: list[str], tmp_path: Path, overrides=None) -> tuple:
    spec = load_spec(spec_path, overrides)
    a = ingest(spec, inputs, tmp_path / "polars", progress=False)
    b = ingest(spec, inputs, tmp_path / "ray", progress=False, engine=open_engine("ray"))
    return a, b


def _assert_same(tmp_path: Path, a: dict, b: dict) -> None:
    pa_, ra = tmp_path / "polars", tmp_path / "ray"
    for key in ("rows_read", "rows_written", "rows_written_total", "rows_dropped",
                "rows_dropped_total", "rows_dropped_by_column", "repairs", "features"):
        assert a.get(key) == b.get(key), key
    vocab = sorted(p.name for p in (pa_ / "vocab").iterdir())
    assert vocab == sorted(p.name for p in (ra / "vocab").iterdir())
    for name in vocab:
        assert pl.read_parquet(pa_ / "vocab" / name).equals(pl.read_parquet(ra / "vocab" / name))
    ma, mb = (json.loads((d / "metadata.json").read_text()) for d in (pa_, ra))
    assert ma.keys() == mb.keys()
    for key in ma:
        if key == "splits":
            assert {s: e["rows"] for s, e in ma[key].items()} == \
                {s: e["rows"] for s, e in mb[key].items()}
        elif key == "dense_stats":
            for feature, stats in ma[key].items():
                for stat, value in stats.items():
                    other = mb[key][feature][stat]
                    if isinstance(value, float):
                        assert other == pytest.approx(value, rel=1e-12, abs=1e-12), (feature, stat)
                    else:
                        assert other == value, (feature, stat)
        elif key != "source":
            assert ma[key] == mb[key], key
    for split, entry in ma["splits"].items():
        left = pl.concat([pl.read_parquet(pa_ / f) for f in entry["files"]])
        right = pl.concat([pl.read_parquet(ra / f) for f in mb["splits"][split]["files"]])
        assert left.schema == right.schema
        cols = [c for c, t in left.schema.items() if not isinstance(t, pl.List)]
        lists = [c for c in left.columns if c not in cols]
        key = left.with_columns(*(pl.col(c).list.join(",", ignore_nulls=True)
                                  if left.schema[c].inner == pl.String
                                  else pl.col(c).cast(pl.List(pl.String)).list.join(",")
                                  for c in lists)).sort(left.columns)
        other = right.with_columns(*(pl.col(c).list.join(",", ignore_nulls=True)
                                     if right.schema[c].inner == pl.String
                                     else pl.col(c).cast(pl.List(pl.String)).list.join(",")
                                     for c in lists)).sort(right.columns)
        assert key.equals(other), split


def test_criteo_tsv_with_malformed_lines_splits_by_row_position(tmp_path):
    """4 TSV files (a hash split of each row's position across the files: global row numbers),
    short and empty lines in the second, vocabularies with min_frequency."""
    from embedtrain.datagen import CTRDataSpec, generate_ctr_tsv

    raw = tmp_path / "raw"
    info = generate_ctr_tsv(CTRDataSpec(rows=12_000, seed=3), raw)
    source = raw / info["files"][0]
    lines = source.read_text().splitlines(keepends=True)
    source.unlink()
    for i in range(4):
        part = lines[i * 3000:(i + 1) * 3000]
        if i == 1:
            part[10:10] = ["not a criteo line\n", "\n", "1\t2\t3\n"]
        (raw / f"day_{i}.tsv").write_text("".join(part))
    a, b = _both(ROOT / "configs/ingest/criteo_synthetic.yaml", [str(raw / "*.tsv")], tmp_path)
    assert a["rows_dropped"]["wrong_field_count"] == 3
    _assert_same(tmp_path, a, b)
    ray_files = sorted(p.name for p in (tmp_path / "ray" / "train").iterdir())
    assert ray_files[0].startswith("part-00000-") and len({f[:10] for f in ray_files}) == 4


def test_parquet_with_list_features_time_split_and_every_encoding(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(4):
        n = 2500
        tags = [None if rng.random() < 0.05 else
                [f"t{int(x)}" for x in rng.zipf(1.4, rng.integers(0, 5)) if x < 400]
                for _ in range(n)]
        table = pa.table({
            "label": rng.integers(0, 2, n).astype(np.float64),
            "price": np.where(rng.random(n) < 0.1, np.nan, rng.lognormal(1, 1, n)),
            "user": pa.array([None if rng.random() < 0.02 else f"u{int(x)}"
                              for x in rng.zipf(1.3, n)]),
            "tags": pa.array(tags, pa.list_(pa.string())),
            "item": np.where(rng.random(n) < 0.01, -1, rng.integers(0, 10**12, n)),
            "ts": np.sort(rng.integers(i * 1000, (i + 1) * 1000 + 300, n)),
        })
        pq.write_table(table, tmp_path / f"log_{i}.parquet", row_group_size=700)
    spec = tmp_path / "spec.yaml"
    spec.write_text("""
name: lists
input: {format: parquet}
label: label
dense:
  - {name: price, log1p: true, standardize: true, clip_max: 50, non_finite: fill}
sparse:
  - {name: user, min_frequency: 2}
  - {name: tags, multi_hot: true, max_length: 3, max_vocab_size: 40, empty_list: oov}
  - {name: item_hash, column: item, encoding: hash, hash_buckets: 97}
  - {name: item_raw, column: item, encoding: raw}
split: {method: time, column: ts, valid_fraction: 0.15, test_fraction: 0.15}
""")
    a, b = _both(spec, [str(tmp_path / "log_*.parquet")], tmp_path)
    assert a["rows_dropped"].get("raw_id_out_of_range", 0) > 0  # negative items dropped
    _assert_same(tmp_path, a, b)


def test_each_stage_reports_rows_per_second(tmp_path):
    from embedtrain.datagen import CTRDataSpec, generate_ctr_tsv

    info = generate_ctr_tsv(CTRDataSpec(rows=3000, seed=1), tmp_path / "raw")
    files = [str(tmp_path / "raw" / f) for f in info["files"]]
    report = ingest(load_spec(ROOT / "configs/ingest/criteo_synthetic.yaml"), files,
                    tmp_path / "out", progress=False, engine=open_engine("ray"))
    phases = {p["phase"]: p for p in report["phases"]}
    assert {"field counts", "row statistics", "value counts", "write"} <= phases.keys()
    assert phases["row statistics"]["rows"] == 3000
    assert phases["row statistics"]["rows_per_s"] > 0
    assert report["engine"]["name"] == "ray" and report["engine"]["tasks"] > 0


def test_what_the_ray_engine_refuses_is_one_line(tmp_path, monkeypatch):
    table = pa.table({"label": [0.0, 1.0] * 50, "x": list(range(100))})
    pq.write_table(table, tmp_path / "a.parquet")
    pq.write_table(table, tmp_path / "b.parquet")
    spec = tmp_path / "spec.yaml"
    spec.write_text("input: {format: parquet}\nsparse:\n  - {name: x, quantiles: 4}\n")
    with pytest.raises(IngestError, match=r"sparse\[0\].quantiles: not on --engine ray"):
        ingest(load_spec(spec), [str(tmp_path / "*.parquet")],
               tmp_path / "o", progress=False, engine=open_engine("ray"))
    with pytest.raises(IngestError, match="--address and --num-cpus are for --engine ray"):
        open_engine("polars", num_cpus=2)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(IngestError, match=r"--engine ray needs Ray: pip install "
                                          r"'ray\[data\]==2.60.0'"):
        open_engine("ray")


def test_the_cli_runs_the_ray_engine(tmp_path):
    """Through ``embedtrain ingest --engine ray`` (joining the running instance)."""
    from embedtrain.cli import main
    from embedtrain.datagen import CTRDataSpec, generate_ctr_tsv

    info = generate_ctr_tsv(CTRDataSpec(rows=2000, seed=2), tmp_path / "raw")
    assert main(["ingest", str(ROOT / "configs/ingest/criteo_synthetic.yaml"), "--input",
                 str(tmp_path / "raw" / info["files"][0]), "--out", str(tmp_path / "out"),
                 "--engine", "ray", "--quiet"]) == 0
    assert json.loads((tmp_path / "out" / "ingest_report.json").read_text())["rows_read"] == 2000
    assert main(["ingest", str(ROOT / "configs/ingest/graph_edges.yaml"), "--input", "x",
                 "--out", str(tmp_path / "g"), "--engine", "ray"]) == 2


def test_rows_are_numbered_past_2_to_the_32(tmp_path):
    """A file's rows are numbered from the rows before it in int64: the hash split of a row at
    position 2^33 + i is the one of that global position (Polars numbers each file in 32 bits)."""
    from pipelines.core.hashing import splitmix64, unit_interval
    from pipelines.core.inputs import ROW
    from pipelines.core.output import SPLIT
    from pipelines.engines.base import Shard
    from pipelines.tabular.passes import _frame

    pq.write_table(pa.table({"label": [0.0, 1.0] * 500, "x": list(range(1000))}),
                   tmp_path / "a.parquet")
    spec = tmp_path / "spec.yaml"
    spec.write_text("input: {format: parquet}\nsparse:\n  - {name: x}\n")
    s = load_spec(spec)
    frame = _frame(Shard((tmp_path / "a.parquet",), offset=2**33), (s, None, None)).select(
        ROW, SPLIT).collect()
    assert frame[ROW].dtype == pl.Int64 and frame[ROW].to_list() == [2**33 + i for i in range(1000)]
    u = pl.select(unit_interval(splitmix64(pl.Series(ROW, frame[ROW]), s.split.hash_seed)))
    want = ["test" if v < s.split.test_fraction else
            "valid" if v < s.split.test_fraction + s.split.valid_fraction else "train"
            for v in u.to_series()]
    assert frame[SPLIT].cast(pl.String).to_list() == want


def test_csv_with_an_empty_file_and_a_split_without_rows(tmp_path):
    """CSV inputs, one of them 0 bytes; a column split that lists no test values (no test
    split: a warning, no folder); both engines alike. Then all rows invalid: one line on both."""
    rng = np.random.default_rng(4)
    for i in range(3):
        n = 800
        frame = pl.DataFrame({
            "y": rng.integers(0, 2, n), "age": rng.integers(10, 80, n).astype(float),
            "city": [f"c{int(x)}" for x in rng.zipf(1.5, n)],
            "part": rng.choice(["a", "b", "c"], n)})
        frame.write_csv(tmp_path / f"t_{i}.csv")
    (tmp_path / "t_3.csv").write_text("")
    spec = tmp_path / "spec.yaml"
    spec.write_text("""
input: {format: csv}
label: y
dense: [{name: age, standardize: true}]
sparse: [{name: city, min_frequency: 2}]
split: {method: column, column: part, values: {train: [a, b], valid: [c]}}
""")
    a, b = _both(spec, [str(tmp_path / "t_*.csv")], tmp_path)
    assert a["rows_written"]["test"] == 0 and len(a["inputs"]) == 4
    _assert_same(tmp_path, a, b)
    assert not (tmp_path / "ray" / "test").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("input: {format: csv}\nlabel: city\ndense: [{name: age}]\n"  # no label parses
                   "split: {method: column, column: part, values: {train: [a, b]}}\n")
    for engine in ("polars", "ray"):
        with pytest.raises(IngestError, match="no training rows"):
            ingest(load_spec(bad), [str(tmp_path / "t_*.csv")], tmp_path / f"bad_{engine}",
                   progress=False, engine=open_engine(engine))


@pytest.mark.parametrize("name", ["xc_repository", "xc_parquet", "graph_edges",
                                  "sequence_events", "retrieval_events"])
def test_xc_and_graph_specs_on_ray(name, tmp_path):
    """Through :func:`pipelines.run_ingest`, as the CLI runs it: a Ray task per input file."""
    sys.path.insert(0, str(ROOT / "tests"))
    from ingest_outputs import (
        SPECS, assert_same_outputs, write_events, write_graph, write_xc_parquet,
        write_xc_repository)

    from pipelines import run_ingest

    overrides, nodes = [], []
    if name == "xc_repository":
        inputs, overrides = write_xc_repository(tmp_path)
    elif name == "xc_parquet":
        inputs = write_xc_parquet(tmp_path)
    elif name == "sequence_events":
        inputs = write_events(tmp_path)
    elif name == "retrieval_events":  # the same log as one row per event, with an item table
        from embedtrain.datagen.retrieval import RetrievalDataSpec, generate_retrieval

        generate_retrieval(RetrievalDataSpec(users=300, items=200, brands=20, attributes=3,
                                             seed=2),
                           tmp_path / "gen", progress=False, events=True)
        inputs, overrides = [str(tmp_path / "gen" / "events")], [
            f"items.path={tmp_path / 'gen' / 'items.parquet'}"]
    else:
        inputs, nodes = write_graph(tmp_path)
    runs = {engine: run_ingest(SPECS / f"{name}.yaml", inputs, tmp_path / engine,
                               overrides=overrides, nodes=nodes, engine=engine, progress=False)
            for engine in ("polars", "ray")}
    assert "(ray engine)" in runs["ray"][1][0]
    assert_same_outputs(tmp_path / "polars", tmp_path / "ray")
