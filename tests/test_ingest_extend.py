"""`embedtrain ingest --extend`: a partition's vocabularies extend the one before it, and static
tables follow them through warm starts, evaluations and delta exports."""

import json
import shutil

import polars as pl
import pyarrow.parquet as pq
import pytest

from conftest import ROOT, run_cli
from test_continual import _same_files, _train

from embedtrain.datagen.drift import DriftDataSpec
from embedtrain.datagen.drift_days import generate_ctr_drift_days

SPEC = "configs/ingest/drift_days.yaml"


@pytest.fixture(scope="module")
def vocab_days(tmp_path_factory):
    """Three raw day partitions, ingested with vocabularies, each extending the one before."""
    root = tmp_path_factory.mktemp("extend")
    generate_ctr_drift_days(DriftDataSpec(rows=3000, periods=3, lifetime=2, new_ids_per_period=40,
                                          sparse_features=8, rows_per_row_group=500),
                            root / "raw", progress=False)
    for day in (1, 2, 3):
        extend = ["--extend", str(root / "days" / f"day={day - 1:03d}")] if day > 1 else []
        r = run_cli("ingest", SPEC, "--input", str(root / "raw" / f"day={day:03d}" / "train"),
                    "--out", str(root / "days" / f"day={day:03d}"), "--quiet", *extend)
        assert r.returncode == 0, r.stderr[-2000:]
    return root


def _vocab(root, day, feature):
    return pl.read_parquet(root / "days" / f"day={day:03d}" / "vocab" / f"{feature}.parquet")


def test_an_extended_vocabulary_keeps_every_id_and_appends_the_new_values(vocab_days):
    root = vocab_days
    for feature in ("C1", "C8"):
        old, new = _vocab(root, 1, feature), _vocab(root, 2, feature)
        assert new.head(old.height).select("value", "id").equals(old.select("value", "id"))
        raw = pl.read_parquet(root / "raw" / "day=002" / "train")[feature]
        counts = raw.value_counts(name="n")
        fresh = counts.filter(~pl.col(feature).is_in(old["value"].implode())).sort(
            ["n", feature], descending=[True, False])
        appended = new.slice(old.height)
        assert appended["value"].to_list() == fresh[feature].to_list()
        assert appended["id"].to_list() == list(range(old.height + 1, new.height + 1))
        # every row of day 2 is encoded with the extended vocabulary
        ids = dict(zip(new["value"].to_list(), new["id"].to_list()))
        encoded = pq.read_table(root / "days" / "day=002" / "train").column(feature).to_pylist()
        assert encoded == [ids[v] for v in raw.to_list()]
    m1, m2 = (json.loads((root / "days" / f"day={d:03d}" / "metadata.json").read_text())
              for d in (1, 2))
    assert m2["dense_stats"] == m1["dense_stats"]  # standardised as the day before
    assert m2["extends"] == str((root / "days" / "day=001").resolve())
    assert all(m2["vocab_sizes"][f] > m1["vocab_sizes"][f] for f in m1["vocab_sizes"])


def test_extend_refuses_what_it_cannot_continue(vocab_days, tmp_path):
    root = vocab_days
    raw = str(root / "raw" / "day=002" / "train")
    other = tmp_path / "other.yaml"
    other.write_text((ROOT / SPEC).read_text().replace("{name: C8, dtype: integer}",
                                               "{name: C8, dtype: integer, encoding: hash, "
                                               "hash_buckets: 100}"))
    for spec, base, message in ((SPEC, tmp_path, "not a data set"),
                                (str(other), root / "days" / "day=001",
                                 "other columns or encodings")):
        r = run_cli("ingest", spec, "--input", raw, "--out", str(tmp_path / "out"), "--quiet",
                    "--extend", str(base))
        assert r.returncode != 0 and message in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_static_tables_follow_an_extended_vocabulary(vocab_days, tmp_path):
    """Day 1, a warm start on day 2 (its tables grown), both scored on day 3; the delta export
    of the grown tables applies into the full export byte for byte."""
    from embedtrain.export.delta import apply_delta, export_delta
    from embedtrain.export.export import export_run

    config = tmp_path / "c.yaml"
    config.write_text(f"""
data: {{path: {vocab_days / 'days'}, batch_size: 250, shuffle: false}}
model: {{embedding_dim: 8, bottom_mlp: [16], top_mlp: [16]}}
train: {{epochs: 1, checkpoint_every: 0, progress: false}}
""")
    _train(config, tmp_path / "d1", "--partitions", "day=001")
    _train(config, tmp_path / "d2", "--partitions", "day=002", "--warm-start",
           str(tmp_path / "d1"))
    for run in ("d1", "d2"):
        r = run_cli("eval", str(tmp_path / run), "--split", "train", "--partitions", "day=003")
        assert r.returncode == 0, r.stderr[-2000:]
        assert 0.4 < json.loads(r.stdout)["auc"] < 1
    export_run(tmp_path / "d1", tmp_path / "e1", progress=False)
    export_run(tmp_path / "d2", tmp_path / "e2", progress=False)
    record = export_delta(tmp_path / "d2", tmp_path / "e1", tmp_path / "delta", progress=False)
    grown = [e for e in record["rows"] if e["path"] == "tables/t_C1.npy"][0]
    assert grown["of"] == json.loads((vocab_days / "days" / "day=002" / "metadata.json")
                                     .read_text())["vocab_sizes"]["C1"] + 1
    shutil.copytree(tmp_path / "e1", tmp_path / "live")
    apply_delta(tmp_path / "delta", tmp_path / "live")
    _same_files(tmp_path / "live", tmp_path / "e2")
