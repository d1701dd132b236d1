"""Tests for embedtrain.datagen.xc (small sizes: the whole file runs in a few seconds)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedtrain.datagen.ctr import SPLITS
from embedtrain.datagen.xc import (
    TOKEN_COLUMN, XCDataSpec, XCPlantedModel, _oracle_hits, dense_names, generate_xc)

ROWS = 20_000
SPEC = XCDataSpec(classes=200, rows=ROWS, vocab=2_000, dense_groups=8, rows_per_row_group=2_048,
                  rows_per_file=6_000, seed=0)
# Tiny instances for the brute-force oracle check: groups larger than the oracle's pool (13),
# so the pool, its bound and the all-classes fallback are all exercised.
TINY = XCDataSpec(classes=60, rows=4_000, vocab=80, prototype_tokens=4, noise=0.6,
                  tokens_per_row=(2, 6), dense_groups=2, related_classes=3, seed=3)
TINY_MULTI = XCDataSpec(classes=60, rows=4_000, vocab=80, prototype_tokens=4, noise=0.6,
                        tokens_per_row=(2, 6), dense_groups=2, related_classes=3, seed=3,
                        multi_label=True, labels_per_row=(1, 3))


def _read_split(out: Path, meta: dict, split: str) -> pa.Table:
    return pa.concat_tables([pq.read_table(out / f) for f in meta["splits"][split]["files"]])


def _csr(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (offsets, values)."""
    col = column.combine_chunks()
    offsets = col.offsets.to_numpy().astype(np.int64)
    return offsets - offsets[0], col.values.to_numpy()[offsets[0]:offsets[-1]]


def _label_csr(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    if "labels" in table.column_names:
        return _csr(table["labels"])
    return np.arange(table.num_rows + 1), table["label"].to_numpy()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("xc")
    return out, generate_xc(SPEC, out, progress=False)


def test_metadata_file_matches_return_value_and_keys(dataset):
    out, meta = dataset
    assert json.loads((out / "metadata.json").read_text()) == meta
    assert meta["task"] == "xc" and meta["num_classes"] == 200 and meta["vocab_size"] == 2_000
    assert meta["label"] == meta["label_column"] == "label" and meta["multi_label"] is False
    assert meta["token_column"] == TOKEN_COLUMN
    assert meta["dense"] == dense_names(4) == ["D1", "D2", "D3", "D4"]
    assert meta["sparse"] == [{"name": "tokens", "num_embeddings": 2_000, "multi_hot": True,
                               "max_length": 32}]
    for key in ("oracle_p_at_1", "oracle_p_at_5", "oracle_recall_at_5",
                "oracle_expected_p_at_1", "oracle_rows"):
        assert set(meta[key]) == {"test"}, key
    assert meta["oracle_rows"]["test"] == meta["splits"]["test"]["rows"]
    assert meta["generator"]["planted"] and meta["generator"]["seed"] == 0
    assert meta["class_frequencies"]["splits"]["train"]["labels"] == meta["splits"]["train"]["rows"]


def test_determinism_and_seed_dependence(dataset, tmp_path):
    out, meta = dataset
    meta2 = generate_xc(SPEC, tmp_path / "again", progress=False)
    assert meta2 == meta
    for split in SPLITS:
        for f in meta["splits"][split]["files"]:
            assert (out / f).read_bytes() == (tmp_path / "again" / f).read_bytes()
    other = XCDataSpec(**{**SPEC.__dict__, "seed": 1})
    meta3 = generate_xc(other, tmp_path / "other", progress=False)
    assert not _read_split(out, meta, "train").equals(_read_split(tmp_path / "other", meta3,
                                                                  "train"))


def test_schema_ranges_and_split_counts(dataset):
    out, meta = dataset
    assert sum(meta["splits"][s]["rows"] for s in SPLITS) == ROWS
    for split in SPLITS:
        t = _read_split(out, meta, split)
        assert t.num_rows == meta["splits"][split]["rows"] > 0
        assert t.column_names == ["label", "D1", "D2", "D3", "D4", "tokens"]
        assert t.schema.field("label").type == pa.int64()
        assert t.schema.field("tokens").type == pa.list_(pa.int64())
        assert all(t.schema.field(n).type == pa.float32() for n in dense_names(4))
        assert all(t[n].null_count == 0 for n in t.column_names)
        labels = t["label"].to_numpy()
        assert labels.min() >= 0 and labels.max() < SPEC.classes
        offsets, tokens = _csr(t["tokens"])
        lengths = np.diff(offsets)
        assert lengths.min() >= 8 and lengths.max() <= 32
        assert tokens.min() >= 0 and tokens.max() < SPEC.vocab
    pf = pq.ParquetFile(out / meta["splits"]["train"]["files"][0])
    assert pf.metadata.row_group(0).num_rows == 2_048


def test_class_frequencies_are_zipfian(dataset):
    out, meta = dataset
    model = XCPlantedModel(SPEC)
    labels = np.concatenate([_read_split(out, meta, s)["label"].to_numpy() for s in SPLITS])
    counts = np.bincount(labels, minlength=SPEC.classes)
    by_rank = counts[np.argsort(-model.prior, kind="stable")]      # classes by true prior
    ranks = np.arange(1, 31)
    slope = np.polyfit(np.log(ranks), np.log(by_rank[:30]), 1)[0]
    assert abs(-slope - SPEC.zipf_a) < 0.15
    assert by_rank[0] / np.median(counts) > 50                     # ~100**1.1 = 158 in law
    assert abs(by_rank[0] / ROWS - model.prior.max()) < 0.02
    cf = meta["class_frequencies"]
    assert cf["top1_share"] == pytest.approx(by_rank[0] / ROWS)
    assert cf["classes_seen"] == int((counts > 0).sum())


def test_planted_signal_is_learnable_and_oracle_bounds_it(dataset):
    out, meta = dataset
    train, test = _read_split(out, meta, "train"), _read_split(out, meta, "test")
    C, V = SPEC.classes, SPEC.vocab
    # Multinomial Naive Bayes with add-one smoothing, fitted on the train split.
    off, tok = _csr(train["tokens"])
    y = train["label"].to_numpy()
    counts = np.zeros((C, V))
    np.add.at(counts, (np.repeat(y, np.diff(off)), tok), 1.0)
    log_pt = np.log(counts + 1) - np.log((counts + 1).sum(axis=1, keepdims=True))
    log_prior = np.log(np.bincount(y, minlength=C) + 1)
    off, tok = _csr(test["tokens"])
    scores = np.add.reduceat(log_pt.T[tok], off[:-1], axis=0) + log_prior
    truth = test["label"].to_numpy()
    nb_p1 = float((scores.argmax(axis=1) == truth).mean())
    majority = float((truth == np.bincount(y).argmax()).mean())
    oracle = meta["oracle_p_at_1"]["test"]
    assert nb_p1 > majority + 0.3, (nb_p1, majority)
    assert nb_p1 - 0.02 <= oracle <= 1.0, (nb_p1, oracle)
    assert abs(oracle - meta["oracle_expected_p_at_1"]["test"]) < 0.03
    assert meta["oracle_recall_at_5"]["test"] == pytest.approx(5 * meta["oracle_p_at_5"]["test"])


def _brute_marginals(spec: XCDataSpec, model: XCPlantedModel, tokens: np.ndarray,
                     x: np.ndarray) -> np.ndarray:
    """P(c in Y | row) for every class, straight from the generative model's definition."""
    C, P = spec.classes, spec.prototype_tokens
    in_proto = np.zeros((C, spec.vocab), bool)          # in_proto[c, t]: t in c's prototype
    in_proto[np.arange(C)[:, None], model.prototypes] = True
    p_token = spec.noise * model.background[tokens] + (1 - spec.noise) * in_proto[:, tokens] / P
    mu = model.group_means[np.arange(C) % model.num_groups]
    logp = (np.log(model.prior) + np.log(p_token).sum(axis=1)
            - ((x.astype(np.float64) - mu) ** 2).sum(axis=1) / (2 * spec.dense_noise ** 2))
    p = np.exp(logp - logp.max())
    p /= p.sum()
    if not spec.multi_label:
        return p
    r = model.related.shape[1]
    rho = ((spec.labels_per_row[0] + spec.labels_per_row[1]) / 2 - 1) / r
    m = p.copy()
    for y in range(C):
        m[model.related[y]] += rho * p[y]
    return m


@pytest.mark.parametrize("spec", [TINY, TINY_MULTI], ids=["single", "multi"])
def test_oracle_matches_brute_force(spec, tmp_path):
    meta = generate_xc(spec, tmp_path, progress=False)
    model = XCPlantedModel(spec)
    t = _read_split(tmp_path, meta, "test")
    off, tok = _csr(t["tokens"])
    x = np.stack([t[n].to_numpy() for n in dense_names(spec.dense_features)], axis=1)
    ref = np.stack([_brute_marginals(spec, model, tok[off[i]:off[i + 1]], x[i])
                    for i in range(t.num_rows)])
    ref_top = np.argsort(-ref, axis=1, kind="stable")[:, :5]
    for pool in (None, 3):  # default pool, then one so small that rows fall back to all classes
        if pool:
            model._set_pool(pool)
        top, prob = model.posterior_topk(off, tok, x)
        assert (model.fallback_rows > 0) == (pool is not None)
        np.testing.assert_allclose(prob, np.take_along_axis(ref, ref_top, 1), atol=1e-9)
        np.testing.assert_allclose(np.take_along_axis(ref, top, 1), prob, atol=1e-9)
        assert (top[:, 0] == ref_top[:, 0]).mean() > 0.999
    lab_off, lab = _label_csr(t)
    p1 = _oracle_hits(ref_top[:, :1], lab_off, lab, spec.classes).mean()
    assert meta["oracle_p_at_1"]["test"] == pytest.approx(p1, abs=2e-3)
    assert meta["oracle_expected_p_at_1"]["test"] == pytest.approx(ref.max(axis=1).mean())
    assert 0.3 < meta["oracle_p_at_1"]["test"] < 1.0   # a hard instance: Bayes error shows


def test_multi_label_column(tmp_path):
    meta = generate_xc(TINY_MULTI, tmp_path, progress=False)
    assert meta["label"] == meta["label_column"] == "labels" and meta["multi_label"] is True
    model = XCPlantedModel(TINY_MULTI)
    sizes = []
    for split in SPLITS:
        t = _read_split(tmp_path, meta, split)
        assert t.column_names[0] == "labels"
        assert t.schema.field("labels").type == pa.list_(pa.int64())
        off, lab = _csr(t["labels"])
        k = np.diff(off)
        assert k.min() >= 1 and k.max() <= 3
        rows = np.repeat(np.arange(t.num_rows), k)
        assert lab.min() >= 0 and lab.max() < TINY_MULTI.classes
        same_row = rows[1:] == rows[:-1]
        assert (lab[1:][same_row] > lab[:-1][same_row]).all()   # sorted, hence distinct
        # All of a row's labels come from one group (primary plus its related classes).
        g = model.group[lab]
        assert (g[1:][same_row] == g[:-1][same_row]).all()
        sizes.append(k)
    assert set(np.unique(np.concatenate(sizes))) == {1, 2, 3}
    assert 0 < meta["oracle_p_at_1"]["test"] <= 1


def test_loadable_by_dataset_meta_and_reader(dataset):
    from embedtrain.data.reader import ParquetBatchReader
    from embedtrain.features import load_dataset_meta

    out, meta = dataset
    dm = load_dataset_meta(out)
    assert dm.features.label == "label" and dm.features.dense == tuple(dense_names(4))
    assert [(f.name, f.num_embeddings, f.multi_hot) for f in dm.features.sparse] == [
        ("tokens", 2_000, True)]
    assert dm.split_rows == {s: meta["splits"][s]["rows"] for s in SPLITS}
    assert dm.extra["task"] == "xc" and dm.extra["num_classes"] == 200
    reader = ParquetBatchReader(dm.files("train"), dm.features, batch_size=256, num_workers=0)
    batch = next(iter(reader))
    first = pq.read_table(out / meta["splits"]["train"]["files"][0]).slice(0, 256)
    assert batch.sparse_features.keys() == ["tokens"]
    np.testing.assert_array_equal(batch.labels.numpy(), first["label"].to_numpy())
    off, tok = _csr(first["tokens"])
    np.testing.assert_array_equal(batch.sparse_features.lengths().numpy(), np.diff(off))
    np.testing.assert_array_equal(batch.sparse_features.values().numpy(), tok)
    assert tuple(batch.dense_features.shape) == (256, 4)


def test_empty_test_split_and_validation(tmp_path):
    meta = generate_xc(XCDataSpec(classes=50, rows=500, vocab=100, dense_groups=4,
                                  test_fraction=0.0), tmp_path, progress=False)
    assert meta["splits"]["test"]["rows"] == 0 and meta["oracle_rows"]["test"] == 0
    assert meta["oracle_p_at_1"]["test"] is None
    with pytest.raises(ValueError, match="noise"):
        XCDataSpec(noise=0.0)
    with pytest.raises(ValueError, match="tokens_per_row"):
        XCDataSpec(tokens_per_row=(5, 2))
    with pytest.raises(ValueError, match="labels_per_row"):
        XCDataSpec(classes=20, dense_groups=4, multi_label=True, labels_per_row=(1, 8))
    assert XCDataSpec(tokens_per_row=[4, 9]).tokens_per_row == (4, 9)


def test_progress_goes_to_stderr(tmp_path, capsys):
    spec = XCDataSpec(classes=50, rows=500, vocab=100, dense_groups=4)
    generate_xc(spec, tmp_path / "on", progress=True)
    captured = capsys.readouterr()
    final = captured.err.rstrip("\n").split("\r")[-1]  # tqdm's last redraw: the finished bar
    assert captured.out == "" and final.startswith("datagen xc: 100%|") and " 500/500 [" in final
    assert final.endswith(" rows/s]")
    generate_xc(spec, tmp_path / "off", progress=False)
    assert capsys.readouterr() == ("", "")
