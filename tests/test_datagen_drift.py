"""Tests for embedtrain.datagen.drift (``embedtrain datagen ctr --drift``): small sizes, a few s."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedtrain.datagen.ctr import SPLITS, log_loss, roc_auc
from embedtrain.datagen.drift import (
    RAW_ID_LIMIT, DriftDataSpec, DriftModel, _id_key, _mix63, generate_ctr_drift, new_ids,
    raw_ids, split_periods)

ROWS = 20_000
# Few new ids per period, so that ids repeat within a period at this size.
SPEC = DriftDataSpec(rows=ROWS, seed=3, new_ids_per_period=200, rows_per_file=5_000,
                     rows_per_row_group=2_048)


def _read_split(out: Path, meta: dict, split: str) -> pa.Table:
    return pa.concat_tables([pq.read_table(out / f) for f in meta["splits"][split]["files"]])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("drift")
    return out, generate_ctr_drift(SPEC, out, progress=False)


@pytest.fixture(scope="module")
def tables(dataset) -> dict[str, pa.Table]:
    out, meta = dataset
    return {s: _read_split(out, meta, s) for s in SPLITS}


def test_metadata_layout_and_loader(dataset, tables):
    from embedtrain.features import load_dataset_meta

    out, meta = dataset
    assert json.loads((out / "metadata.json").read_text()) == meta
    assert meta["name"] == "synthetic_ctr_drift" and meta["label"] == "label"
    assert meta["dense"] == ["I1", "I2", "I3", "I4"]
    names = [f"C{i}" for i in range(1, 9)]
    assert [s["name"] for s in meta["sparse"]] == names
    for split in SPLITS:
        files = meta["splits"][split]["files"]
        assert files and all(f.startswith(f"{split}/part-") for f in files)
        assert tables[split].num_rows == meta["splits"][split]["rows"]
    assert sum(meta["splits"][s]["rows"] for s in SPLITS) == ROWS
    loaded = load_dataset_meta(out)
    assert loaded.name == "synthetic_ctr_drift"
    for f, entry in zip(loaded.features.sparse, meta["sparse"]):
        assert f.raw is True and f.multi_hot is False and f.max_length == 1
        distinct = len(np.unique(tables["train"][f.name].to_numpy()))
        assert f.num_embeddings == entry["num_embeddings"] == distinct
        assert meta["drift"]["features"][f.name]["distinct_ids"]["train"] == distinct
    schema = tables["test"].schema
    assert schema.names == ["label", *meta["dense"], *names, "period"]
    assert schema.field("label").type == pa.int8()
    assert all(schema.field(n).type == pa.float32() for n in meta["dense"])
    assert all(schema.field(n).type == pa.int64() for n in names)
    assert schema.field("period").type == pa.int32()
    assert set(np.unique(tables["train"]["label"].to_numpy())) == {0, 1}
    assert {"oracle_auc", "oracle_logloss", "ctr", "drift", "generator"} <= set(meta)


def test_determinism_and_seed_dependence(dataset, tables, tmp_path):
    _, meta = dataset
    again = generate_ctr_drift(SPEC, tmp_path / "again", progress=False)
    assert again == meta
    for split in SPLITS:
        assert _read_split(tmp_path / "again", again, split).equals(tables[split])
    other_spec = DriftDataSpec(rows=ROWS, seed=4, new_ids_per_period=200, rows_per_file=5_000,
                               rows_per_row_group=2_048)
    other = generate_ctr_drift(other_spec, tmp_path / "other", progress=False)
    train = _read_split(tmp_path / "other", other, "train")
    assert not train.equals(tables["train"])
    assert not np.intersect1d(train["C1"].to_numpy(), tables["train"]["C1"].to_numpy()).size


def test_raw_ids_in_range_and_distinct(tables):
    model = DriftModel(SPEC)
    for f, name in enumerate(SPEC.sparse_names):
        ids = model.raw[f]
        assert ids.dtype == np.int64 and len(ids) == model.total[f]
        assert len(np.unique(ids)) == len(ids), name  # no collision within a feature
        assert ids.min() >= 0 and ids.max() < RAW_ID_LIMIT
        assert np.array_equal(ids, raw_ids(SPEC.seed, f, np.arange(model.total[f])))
        for t in tables.values():
            assert np.isin(t[name].to_numpy(), ids).all()
    big = raw_ids(0, 0, np.arange(1_000_000))
    assert len(np.unique(big)) == len(big) and big.min() >= 0 and big.max() < RAW_ID_LIMIT
    assert big.max() > 2**62  # spread over the 63-bit range, not small counters


def _unmix63(y: int) -> int:
    """Inverse of ``_mix63`` (Python ints): undo each xor-shift and product mod 2^63."""
    mod = 2**63

    def unshift(v: int, k: int) -> int:
        x = v
        for _ in range(63 // k + 1):
            x = v ^ (x >> k)
        return x

    y = unshift(y, 31)
    y = (y * pow(0x94D049BB133111EB, -1, mod)) % mod
    y = unshift(y, 27)
    y = (y * pow(0xBF58476D1CE4E5B9, -1, mod)) % mod
    return unshift(y, 30)


def test_mix_is_a_bijection_of_63_bits():
    """``_mix63`` is splitmix64's finaliser mod 2^63: it has an inverse (so ids never collide)."""
    r = np.random.default_rng(1).integers(0, 2**63 - 1, 300, dtype=np.int64).astype(np.uint64)
    x = np.concatenate([r, np.array([0, 1, 2**62, 2**63 - 1], dtype=np.uint64)])
    y = _mix63(x)
    assert y.max() <= np.uint64(2**63 - 1)
    assert [_unmix63(int(v)) for v in y] == [int(v) for v in x]


def test_raw_ids_skip_the_reserved_value_by_cycle_walking():
    top = RAW_ID_LIMIT  # 2^63 - 1, the one 63-bit value a raw id must not take
    x = _unmix63(top)
    assert int(_mix63(np.array([x], dtype=np.uint64))[0]) == top and x != top
    key = _id_key(5, 2)
    index = (x - key) % RAW_ID_LIMIT  # the id index whose first mix is 2^63 - 1
    # and the index that would reach x = 2^63 - 1 if the offset wrapped at 2^63 (then its mix
    # would be the walked value of `index`)
    wrap = (RAW_ID_LIMIT - key) % RAW_ID_LIMIT
    indices = np.array([index, (index + 1) % RAW_ID_LIMIT, (index - 1) % RAW_ID_LIMIT, wrap])
    ids = raw_ids(5, 2, indices)
    assert ids[0] == int(_mix63(np.array([top], dtype=np.uint64))[0]) != top
    assert ids.min() >= 0 and ids.max() < RAW_ID_LIMIT and len(set(ids.tolist())) == 4


def test_time_split_and_id_lifetimes(dataset, tables):
    _, meta = dataset
    model = DriftModel(SPEC)
    n_periods = split_periods(SPEC)
    assert n_periods == {"train": 16, "valid": 2, "test": 2}
    drift = meta["drift"]
    assert drift["split_periods"] == {"train": [0, 16], "valid": [16, 18], "test": [18, 20]}
    period = np.concatenate([tables[s]["period"].to_numpy() for s in SPLITS])
    # row i of the whole data set (train, valid, test in order) is in period floor(i * P / rows)
    assert np.array_equal(period, np.arange(ROWS) * SPEC.periods // ROWS)
    assert drift["period_rows"] == np.bincount(period).tolist()
    for s in SPLITS:
        lo, hi = drift["split_periods"][s]
        p = tables[s]["period"].to_numpy()
        assert p.min() == lo and p.max() == hi - 1
    for f, name in enumerate(SPEC.sparse_names):
        n, lifetime = new_ids(SPEC, f), SPEC.lifetime
        order = np.argsort(model.raw[f])
        info = drift["features"][name]
        assert info["alive_ids_per_period"] == n * lifetime == model.alive[f]
        per_period = []
        for s in SPLITS:
            ids, p = tables[s][name].to_numpy(), tables[s]["period"].to_numpy()
            index = order[np.searchsorted(model.raw[f], ids, sorter=order)]
            birth = index // n - (lifetime - 1)
            assert ((birth <= p) & (birth > p - lifetime)).all(), name  # alive when looked up
            per_period += [len(np.unique(ids[p == t])) for t in np.unique(p)]
        assert info["distinct_ids_per_period"] == per_period
        # ids turn over: the training split sees many more ids than one period does
        assert info["distinct_ids"]["train"] > 3 * max(per_period), name


def test_unseen_in_train_share_matches_files(dataset, tables):
    _, meta = dataset
    drift = meta["drift"]
    total = {"valid": 0, "test": 0}
    for name in SPEC.sparse_names:
        train_ids = np.unique(tables["train"][name].to_numpy())
        for s in ("valid", "test"):
            unseen = ~np.isin(tables[s][name].to_numpy(), train_ids)
            total[s] += int(unseen.sum())
            share = drift["features"][name]["unseen_in_train_share"][s]
            assert share == pytest.approx(unseen.mean(), abs=1e-12), (name, s)
    for s in ("valid", "test"):
        expected = total[s] / (tables[s].num_rows * SPEC.sparse_features)
        assert drift["unseen_in_train_share"][s] == pytest.approx(expected, abs=1e-12)
    # new ids appear over time: later splits see more of them
    assert 0 < drift["unseen_in_train_share"]["valid"] < drift["unseen_in_train_share"]["test"]
    assert drift["unseen_in_train_share"]["test"] > 0.5


def test_oracle_metrics_match_the_planted_model(dataset, tables):
    """A reference for the logits from the written columns (raw ids mapped back to the planted
    per-id effects): the metadata's oracle AUC, log loss and CTR follow from it."""
    _, meta = dataset
    model = DriftModel(SPEC)
    lookup = [dict(zip(model.raw[f].tolist(), range(model.total[f])))
              for f in range(SPEC.sparse_features)]
    for s in SPLITS:
        t = tables[s]
        logit = np.full(t.num_rows, model.bias)
        for d, name in enumerate(SPEC.dense_names):
            logit += model.dense_w[d] * t[name].to_numpy().astype(np.float64)
        for f, name in enumerate(SPEC.sparse_names):
            index = np.array([lookup[f][v] for v in t[name].to_pylist()])
            logit += model.effect[f][index]
        p = 1.0 / (1.0 + np.exp(-logit))
        y = t["label"].to_numpy()
        assert meta["oracle_auc"][s] == pytest.approx(roc_auc(p, y), abs=1e-9), s
        assert meta["oracle_logloss"][s] == pytest.approx(log_loss(p, y), abs=1e-9), s
        assert meta["ctr"][s] == pytest.approx(y.mean(), abs=1e-12)
        assert 0.18 < meta["ctr"][s] < 0.32, s
        assert 0.72 < meta["oracle_auc"][s] < 0.85, s


def test_reader_reads_raw_ids_and_ignores_the_period_column(dataset, tables):
    pytest.importorskip("torchrec")
    from embedtrain.data.reader import ParquetBatchReader
    from embedtrain.features import load_dataset_meta

    out, _ = dataset
    meta = load_dataset_meta(out)
    reader = ParquetBatchReader(meta.files("test"), meta.features, 256, num_workers=0)
    batch = next(iter(reader))
    kjt = batch.sparse_features
    assert kjt.keys() == SPEC.sparse_names
    c1 = kjt["C1"].values().numpy()
    assert np.array_equal(c1, tables["test"]["C1"].to_numpy()[:256])
    assert tuple(batch.dense_features.shape) == (256, SPEC.dense_features)


def test_empty_valid_split_and_progress(tmp_path, capsys):
    spec = DriftDataSpec(rows=500, periods=10, valid_fraction=0.0, new_ids_per_period=20)
    meta = generate_ctr_drift(spec, tmp_path / "ds", progress=True)
    captured = capsys.readouterr()
    final = captured.err.rstrip("\n").split("\r")[-1]
    assert captured.out == "" and final.startswith("datagen: 100%|") and " 500/500 [" in final
    assert meta["splits"]["valid"] == {"files": ["valid/part-00000.parquet"], "rows": 0}
    assert meta["drift"]["split_periods"] == {"train": [0, 9], "valid": [9, 9], "test": [9, 10]}
    assert meta["oracle_auc"]["valid"] is None and meta["ctr"]["valid"] is None
    assert meta["drift"]["unseen_in_train_share"]["valid"] is None
    assert meta["splits"]["test"]["rows"] == 50


@pytest.mark.parametrize("kwargs, field", [
    ({"rows": 9}, "rows"),
    ({"rows": 15, "periods": 20}, "rows"),
    ({"seed": -1}, "seed"),
    ({"periods": 0}, "periods"),
    ({"lifetime": 0}, "lifetime"),
    ({"new_ids_per_period": 0}, "new_ids_per_period"),
    ({"sparse_features": 0}, "sparse_features"),
    ({"zipf_exponent": float("inf")}, "zipf_exponent"),
    ({"valid_fraction": 1.0}, "valid_fraction"),
    ({"valid_fraction": 0.5, "test_fraction": 0.5}, "valid_fraction"),
    ({"periods": 2, "valid_fraction": 0.1, "test_fraction": 0.1}, "valid_fraction"),
    ({"rows_per_file": 0}, "rows_per_file"),
])
def test_spec_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DriftDataSpec(**kwargs)


def test_cli_datagen_ctr_drift(tmp_path, capsys):
    from embedtrain.cli import main

    out = tmp_path / "drift"
    assert main(["datagen", "ctr", "--drift", "--rows", "20000", "--seed", "1", "--out",
                 str(out)]) == 0
    printed = capsys.readouterr().out.strip()
    meta = json.loads((out / "metadata.json").read_text())
    assert printed.startswith(f"wrote {out}: rows: train 16,000, valid 2,000, test 2,000, "
                              "oracle AUC on test 0.")
    ids = " ".join(f"{s['num_embeddings']:,}" for s in meta["sparse"])
    share = meta["drift"]["unseen_in_train_share"]["test"]
    assert f"distinct train ids per feature: {ids}" in printed
    assert printed.endswith(f"{share:.1%} of test lookups unseen in train")
    assert meta["generator"]["seed"] == 1 and meta["drift"]["lifetime"] == 4
    assert main(["datagen", "ctr", "--drift", "--rows", "2000", "--drift-periods", "10",
                 "--drift-lifetime", "2", "--drift-new-ids", "50", "--out", str(out)]) == 0
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["drift"]["periods"] == 10 and meta["drift"]["lifetime"] == 2
    assert meta["drift"]["features"]["C3"]["new_ids_per_period"] == 50
    capsys.readouterr()
    for argv, message in [
        (["--drift", "--format", "tsv"], "--format tsv: not with --drift"),
        (["--drift-lifetime", "3"], "--drift-lifetime: only with --drift"),
        (["--drift", "--drift-lifetime", "0"], "--drift-lifetime must be an integer >= 1"),
        (["--drift", "--drift-periods", "30", "--rows", "20"], "--rows must be >= periods"),
    ]:
        assert main(["datagen", "ctr", *argv, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err
