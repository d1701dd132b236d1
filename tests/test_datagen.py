"""Tests for embedtrain.datagen.ctr and .tsv (small sizes: the whole file runs in a few seconds)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedtrain.datagen.ctr import (
    DENSE_NAMES, MULTI_HOT, SPARSE_NAMES, SPLITS, CTRDataSpec, CTRStructure, PlantedModel,
    generate_ctr, log_loss, planted_description, roc_auc, vocab_size)

ROWS = 20_000
SPEC = CTRDataSpec(rows=ROWS, seed=0, rows_per_file=6_000, rows_per_row_group=2_048)


def _read_split(out: Path, meta: dict, split: str) -> pa.Table:
    return pa.concat_tables([pq.read_table(out / f) for f in meta["splits"][split]["files"]])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("ctr")
    return out, generate_ctr(SPEC, out, progress=False)


def test_metadata_file_matches_return_value_and_has_exact_keys(dataset):
    out, meta = dataset
    assert json.loads((out / "metadata.json").read_text()) == meta
    assert set(meta) == {"format_version", "name", "label", "dense", "dense_transform", "sparse",
                         "splits", "oracle_auc", "oracle_logloss", "ctr", "generator"}
    assert meta["format_version"] == 1 and meta["label"] == "label"
    assert meta["dense_transform"] == "log1p"
    assert meta["dense"] == DENSE_NAMES
    assert [s["name"] for s in meta["sparse"]] == SPARSE_NAMES
    assert set(meta["generator"]) == {"seed", "rows", "zipf_exponent", "planted"}
    assert meta["generator"]["rows"] == ROWS and meta["generator"]["planted"]
    for s in meta["sparse"]:
        assert set(s) == {"name", "num_embeddings", "multi_hot", "max_length"}
        assert s["multi_hot"] == (s["name"] in MULTI_HOT)
        assert s["max_length"] == (5 if s["multi_hot"] else 1)


def test_determinism_and_seed_dependence(dataset, tmp_path):
    out, meta = dataset
    meta2 = generate_ctr(SPEC, tmp_path / "again", progress=False)
    assert meta2 == meta
    for split in SPLITS:
        again = _read_split(tmp_path / "again", meta2, split)
        assert _read_split(out, meta, split).equals(again)
    other = CTRDataSpec(rows=ROWS, seed=1, rows_per_file=6_000, rows_per_row_group=2_048)
    meta3 = generate_ctr(other, tmp_path / "other", progress=False)
    other_train = _read_split(tmp_path / "other", meta3, "train")
    assert not _read_split(out, meta, "train").equals(other_train)


def test_schema_ranges_and_split_counts(dataset):
    out, meta = dataset
    assert sum(meta["splits"][s]["rows"] for s in SPLITS) == ROWS
    vocab = {s["name"]: s["num_embeddings"] for s in meta["sparse"]}
    for split in SPLITS:
        files = meta["splits"][split]["files"]
        assert all(f.startswith(f"{split}/part-") for f in files)
        t = _read_split(out, meta, split)
        assert t.num_rows == meta["splits"][split]["rows"]
        assert t.column_names == ["label"] + DENSE_NAMES + SPARSE_NAMES
        assert t.schema.field("label").type == pa.int8()
        assert set(np.unique(t["label"].to_numpy())) <= {0, 1}
        for name in t.column_names:
            assert t[name].null_count == 0, name
        for name in DENSE_NAMES:
            assert t.schema.field(name).type == pa.int64()
            assert t[name].to_numpy().min() >= 0
        for name in SPARSE_NAMES:
            col = t[name].combine_chunks()
            if name in MULTI_HOT:
                assert t.schema.field(name).type == pa.list_(pa.int64())
                assert col.values.null_count == 0
                lengths = np.diff(col.offsets.to_numpy())
                assert lengths.min() >= 0 and lengths.max() <= 5
                ids = col.values.to_numpy()
            else:
                assert t.schema.field(name).type == pa.int64()
                ids = col.to_numpy()
            assert ids.min() >= 0 and ids.max() < vocab[name], name


def test_files_and_row_groups_respect_limits(dataset):
    out, meta = dataset
    train_files = meta["splits"]["train"]["files"]
    assert len(train_files) == -(-meta["splits"]["train"]["rows"] // SPEC.rows_per_file)
    for split in SPLITS:
        for f in meta["splits"][split]["files"]:
            md = pq.ParquetFile(out / f).metadata
            assert md.num_rows <= SPEC.rows_per_file
            sizes = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
            assert all(s == SPEC.rows_per_row_group for s in sizes[:-1])
            assert sizes[-1] <= SPEC.rows_per_row_group


def test_vocab_sizes_spread_and_ids_skewed(dataset):
    out, meta = dataset
    sizes = [s["num_embeddings"] for s in meta["sparse"]]
    assert sizes == [vocab_size(i) for i in range(26)]
    assert max(sizes) / min(sizes) >= 1000 and sum(sizes) < 1_500_000
    big = max((s for s in meta["sparse"] if not s["multi_hot"]), key=lambda s: s["num_embeddings"])
    train = _read_split(out, meta, "train")
    counts = np.bincount(train[big["name"]].to_numpy())
    counts = counts[counts > 0]
    assert counts.max() >= 100 * np.median(counts)
    # ids are permuted: the most frequent id is not always 0
    assert any(np.argmax(np.bincount(train[c].to_numpy())) != 0 for c in SPARSE_NAMES[:23])


def test_oracle_metrics_are_plausible(dataset):
    _, meta = dataset
    assert 0.7 < meta["oracle_auc"]["test"] < 0.9
    for split in SPLITS:
        assert 0.2 < meta["ctr"][split] < 0.3
        assert 0.3 < meta["oracle_logloss"][split] < 0.6


def _pairwise_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


@pytest.mark.parametrize("seed", range(5))
def test_roc_auc_matches_pairwise_definition_with_ties(seed):
    rng = np.random.default_rng(seed)
    scores = np.round(rng.random(300), 1)  # only 11 distinct values: many ties
    labels = (rng.random(300) < 0.3).astype(np.int8)
    assert abs(roc_auc(scores, labels) - _pairwise_auc(scores, labels)) <= 1e-12
    cont = rng.random(300)
    assert abs(roc_auc(cont, labels) - _pairwise_auc(cont, labels)) <= 1e-12
    assert np.isnan(roc_auc(scores, np.zeros(300)))


@pytest.mark.parametrize("seed", range(5))
def test_roc_auc_matches_torchmetrics_binary_auroc(seed):
    """The oracle AUC in the metadata and the trainer's AUC (BinaryAUROC, exact) are one metric.

    BinaryAUROC counts true positives in torch's default dtype (float32: ~1e-7), so the
    reference runs with float64 as the default to be comparable to 1e-9.
    """
    torch = pytest.importorskip("torch")
    from torchmetrics.classification import BinaryAUROC

    rng = np.random.default_rng(100 + seed)
    n = 5_000
    labels = (rng.random(n) < 0.25).astype(np.int64)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for scores in (np.round(rng.random(n), 2),               # 101 distinct values: many ties
                       rng.integers(0, 3, n) / 2.0,              # three values: nearly all tied
                       (rng.random(n) + 0.3 * labels) / 1.3):    # distinct, informative
            metric = BinaryAUROC(thresholds=None)
            metric.update(torch.from_numpy(scores), torch.from_numpy(labels))
            expected = metric.compute()
            assert expected.dtype == torch.float64
            assert abs(roc_auc(scores, labels) - float(expected)) <= 1e-9
    finally:
        torch.set_default_dtype(default)


def test_log_loss_matches_formula():
    p, y = np.array([0.1, 0.8, 0.5]), np.array([0, 1, 1])
    expected = -(np.log(0.9) + np.log(0.8) + np.log(0.5)) / 3
    assert log_loss(p, y) == pytest.approx(expected, abs=1e-12)


def test_empty_split_and_overwrite(tmp_path):
    out = tmp_path / "ds"
    generate_ctr(CTRDataSpec(rows=3_000, rows_per_file=500), out, progress=False)
    assert len(list((out / "train").iterdir())) > 1
    meta = generate_ctr(CTRDataSpec(rows=1_000, valid_fraction=0.0), out, progress=False)
    assert sorted(p.name for p in (out / "train").iterdir()) == ["part-00000.parquet"]
    assert meta["splits"]["valid"] == {"files": ["valid/part-00000.parquet"], "rows": 0}
    assert pq.read_table(out / "valid/part-00000.parquet").num_rows == 0
    assert meta["oracle_auc"]["valid"] is None


def test_refuses_to_clobber_foreign_files(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        generate_ctr(CTRDataSpec(rows=100), tmp_path, progress=False)
    assert (tmp_path / "train" / "notes.txt").exists()


@pytest.mark.parametrize("kwargs, field", [
    ({"rows": 9}, "rows"),
    ({"rows": 100.0}, "rows"),
    ({"seed": -1}, "seed"),
    ({"valid_fraction": 1.0}, "valid_fraction"),
    ({"test_fraction": -0.1}, "test_fraction"),
    ({"valid_fraction": 0.5, "test_fraction": 0.5}, "valid_fraction"),
    ({"rows_per_row_group": 0}, "rows_per_row_group"),
    ({"rows_per_file": 0}, "rows_per_file"),
    ({"zipf_exponent": 0.0}, "zipf_exponent"),
    ({"structure": "bogus"}, "structure"),
    ({"structure": None}, "structure"),
])
def test_spec_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CTRDataSpec(**kwargs)


@pytest.mark.parametrize("form", ["parquet", "tsv"])
def test_progress_goes_to_stderr(tmp_path, capsys, form):
    from embedtrain.datagen import generate_ctr_tsv

    generate = generate_ctr if form == "parquet" else generate_ctr_tsv
    generate(CTRDataSpec(rows=100), tmp_path / "on", progress=True)
    captured = capsys.readouterr()
    final = captured.err.rstrip("\n").split("\r")[-1]  # tqdm's last redraw: the finished bar
    assert captured.out == "" and final.startswith("datagen: 100%|") and " 100/100 [" in final
    assert final.endswith(" rows/s]")
    generate(CTRDataSpec(rows=100), tmp_path / "off", progress=False)
    assert capsys.readouterr() == ("", "")


# --- the raw TSV form (`embedtrain datagen ctr --format tsv`) ------------------------------------

TSV_SPEC = CTRDataSpec(rows=6_000, seed=4, rows_per_file=2_500)


@pytest.fixture(scope="module")
def tsv_and_parquet(tmp_path_factory: pytest.TempPathFactory):
    from embedtrain.datagen import generate_ctr_tsv

    root = tmp_path_factory.mktemp("tsv")
    info = generate_ctr_tsv(TSV_SPEC, root / "tsv", progress=False)
    meta = generate_ctr(TSV_SPEC, root / "pq", progress=False)
    return root, info, meta


def _read_tsv(paths: list[Path]):
    import polars as pl

    names = ["label"] + DENSE_NAMES + SPARSE_NAMES
    return pl.concat([pl.read_csv(p, has_header=False, separator="\t", new_columns=names,
                                  infer_schema=False, quote_char=None) for p in paths])


def test_tsv_holds_the_parquet_rows(tsv_and_parquet):
    import polars as pl
    from embedtrain.datagen.ctr import PlantedModel, iter_chunks
    from embedtrain.datagen.tsv import hex_tokens

    root, info, meta = tsv_and_parquet
    assert info["files"] == ["part-00000.tsv", "part-00001.tsv", "part-00002.tsv"]
    assert info["rows"] == TSV_SPEC.rows
    tsv = _read_tsv([root / "tsv" / f for f in info["files"]])
    assert tsv.height == TSV_SPEC.rows
    split = np.concatenate([c.split for c in iter_chunks(TSV_SPEC, PlantedModel(TSV_SPEC))])
    train_tsv = tsv.filter(pl.Series(split == 0))
    train_pq = _read_split(root / "pq", meta, "train")
    assert train_tsv["label"].cast(pl.Int8).to_list() == train_pq["label"].to_pylist()
    i1 = train_tsv["I1"].cast(pl.Int64)
    present = i1.is_not_null().to_numpy()
    assert (i1.to_numpy()[present] == train_pq["I1"].to_numpy()[present]).all()
    c5 = train_tsv["C5"].to_numpy()
    present = train_tsv["C5"].is_not_null().to_numpy()
    expected = hex_tokens(SPARSE_NAMES.index("C5"), train_pq["C5"].to_numpy()).astype(str)
    assert (c5[present] == expected[present]).all()
    lists = train_pq["C24"].to_pylist()
    index = SPARSE_NAMES.index("C24")
    joined = [",".join(hex_tokens(index, np.array(ids, dtype=np.int64)).astype(str)) or None
              for ids in lists]
    assert train_tsv["C24"].to_list() == joined  # an empty list is an empty field


def test_tsv_null_rates_and_determinism(tsv_and_parquet, tmp_path):
    from embedtrain.datagen.tsv import generate_ctr_tsv, null_rate

    root, info, _ = tsv_and_parquet
    tsv = _read_tsv([root / "tsv" / f for f in info["files"]])
    assert tsv["label"].null_count() == 0
    for name in DENSE_NAMES + [c for c in SPARSE_NAMES if c not in MULTI_HOT]:
        assert 0.02 <= null_rate(name) <= 0.05
        assert abs(tsv[name].null_count() / tsv.height - null_rate(name)) < 0.015, name
    for name in MULTI_HOT:
        assert null_rate(name) == 0.0
    again = generate_ctr_tsv(TSV_SPEC, tmp_path / "again", progress=False)
    for f in again["files"]:
        assert (tmp_path / "again" / f).read_bytes() == (root / "tsv" / f).read_bytes()


def test_hex_tokens_are_distinct_per_feature():
    from embedtrain.datagen.tsv import hex_tokens

    big = max(range(26), key=vocab_size)
    tokens = hex_tokens(big, np.arange(vocab_size(big)))
    assert tokens.dtype == np.dtype("S8") and len(set(tokens.tolist())) == vocab_size(big)
    assert all(len(t) == 8 and int(t, 16) >= 0 for t in tokens[:100].tolist())


def test_datagen_imports_no_torch():
    """The generators (all of ``embedtrain.datagen``) import neither torch nor torchrec."""
    import subprocess
    import sys

    code = ("import sys, embedtrain.datagen; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchrec')); "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("argv, says", [
    (["ctr", "--rows", "0"], "--rows must be"),
    (["xc", "--rows", "0"], "--rows must be"),
    (["ctr", "--structure", "bogus"], "--structure must be one of criteo, fm, got 'bogus'"),
    (["ctr", "--structure", "fm", "--drift"], "--structure: not with --drift"),
])
def test_cli_errors_name_the_option(tmp_path, capsys, argv, says):
    from embedtrain.cli import main

    assert main(["datagen", *argv, "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "Spec." not in err[0], err
    assert not (tmp_path / "d").exists()


# --- `--structure`: the default (criteo) is unchanged; fm (per-id biases + user x item factors) -

# The SPEC data set as the generator wrote it before `structure` existed: metadata (floats to 10
# digits) and every split's decoded columns. A change to the default's rows or metadata fails.
DEFAULT_CONTENT_SHA256 = "9b29db30a3bfbbcea6c55bb087b811a6383325ca63690928ea894d88ccdee9e7"


def _content_sha256(out: Path, meta: dict) -> str:
    def rounded(x):
        if isinstance(x, float):
            return float(f"{x:.10g}")
        if isinstance(x, dict):
            return {k: rounded(v) for k, v in x.items()}
        return [rounded(v) for v in x] if isinstance(x, list) else x

    h = hashlib.sha256(json.dumps(rounded(meta), sort_keys=True).encode())
    for split in SPLITS:
        for f in meta["splits"][split]["files"]:
            t = pq.read_table(out / f)
            for name in t.column_names:
                col = t[name].combine_chunks()
                if pa.types.is_list(col.type):
                    h.update(col.offsets.to_numpy().astype("<i8").tobytes())
                    col = col.values
                h.update(col.to_numpy().astype("<i8").tobytes())
    return h.hexdigest()


def test_default_structure_is_unchanged(dataset):
    out, meta = dataset
    assert CTRDataSpec().structure is CTRStructure.CRITEO
    assert "structure" not in meta["generator"] and meta["name"] == "synthetic_ctr"
    assert meta["generator"]["planted"] == planted_description()
    assert _content_sha256(out, meta) == DEFAULT_CONTENT_SHA256


FM_SPEC = CTRDataSpec(rows=ROWS, seed=0, rows_per_file=6_000, rows_per_row_group=2_048,
                      structure="fm")


@pytest.fixture(scope="module")
def fm_dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("ctr_fm")
    return out, generate_ctr(FM_SPEC, out, progress=False)


def test_fm_structure_is_recorded_and_keeps_the_layout(dataset, fm_dataset):
    (out, meta), (fm_out, fm) = dataset, fm_dataset
    assert FM_SPEC.structure is CTRStructure.FM  # the value "fm" becomes the enum
    assert fm["name"] == "synthetic_ctr_fm" and fm["generator"]["structure"] == "fm"
    assert fm["generator"]["planted"] == planted_description(CTRStructure.FM)
    assert "C3, C11, C18" in fm["generator"]["planted"] != meta["generator"]["planted"]
    assert json.loads((fm_out / "metadata.json").read_text()) == fm
    same = {k: v for k, v in fm.items() if k not in ("name", "generator", "oracle_auc",
                                                       "oracle_logloss", "ctr")}
    assert same == {k: meta[k] for k in same} and set(fm) == set(meta)
    assert 0.2 < fm["ctr"]["train"] < 0.3
    # for a seed, the same features but for the 8 signal fields (more concentrated ids)
    signal = ["C3", "C11", "C18", "C7", "C14", "C22", "C10", "C21"]
    train, fm_train = _read_split(out, meta, "train"), _read_split(fm_out, fm, "train")
    assert fm_train.drop(["label", *signal]).equals(train.drop(["label", *signal]))
    assert not fm_train["label"].equals(train["label"])
    for name in signal:
        top = np.bincount(fm_train[name].to_numpy()).max() / fm_train.num_rows
        assert 0.44 < top < 0.54, name  # Zipf(1.7): the top id holds ~49% of the rows


def test_fm_terms_have_the_planted_sizes():
    """Under the id distribution: biases sd 0.40, factors centred with E[U U^T] = c^2 I, so each
    of the 9 user x item pairs has sd 0.38; only the top 50 ids carry anything, and each is
    expected in >= 500 of 800k training rows."""
    from embedtrain.datagen.ctr_clicks import _FM_ITEM, _FM_USER

    model = PlantedModel(FM_SPEC)
    clicks = model.clicks
    assert sorted(clicks.bias) == sorted(["C3", "C11", "C18", "C7", "C14", "C22", "C10", "C21"])
    for name, b in clicks.bias.items():
        w = model.pmf[name]
        assert 1_000 < len(w) < 50_000 and not b[50:].any() and b[:50].all()
        assert 800_000 * w[49] > 500 and w[:50].sum() > 0.95
        assert abs(w @ b) < 1e-12 and np.sqrt(w @ b**2) == pytest.approx(0.40, abs=1e-12)
    moments = {}
    for name in _FM_USER + _FM_ITEM:
        u, w = clicks.factors[name], model.pmf[name]
        assert u.shape == (len(w), 8) and not u[50:].any()
        assert np.abs(w @ u).max() < 1e-12
        moments[name] = u.T @ (w[:, None] * u)
    for a in _FM_USER:
        for b in _FM_ITEM:  # Var <U_a[i], V_b[j]> = tr(E[U U^T] E[V V^T]) for independent ids
            assert np.sqrt(np.trace(moments[a] @ moments[b])) == pytest.approx(0.38, abs=1e-9)


def _fm_logit_from_rows(model: PlantedModel, t: pa.Table) -> np.ndarray:
    """The planted fm logit of the rows as written, term by term, each pair on its own."""
    from embedtrain.datagen.ctr_clicks import _FM_ITEM, _FM_USER

    def rank(name):  # the files hold permuted ids; the model's tables are indexed by Zipf rank
        inverse = np.argsort(model.perm[name])
        return inverse[t[name].to_numpy()]

    def z(name):
        j = DENSE_NAMES.index(name)
        return (np.log1p(t[name].to_numpy()) - model.dense_mean[j]) / model.dense_std[j]

    logit = model.bias + 0.30 * z("I1") + 0.30 * z("I3")
    for name, b in model.clicks.bias.items():
        logit = logit + b[rank(name)]
    f = model.clicks.factors
    for a in _FM_USER:
        for b in _FM_ITEM:
            logit = logit + (f[a][rank(a)] * f[b][rank(b)]).sum(axis=1)
    return logit


def test_fm_oracle_is_the_planted_click_probability(fm_dataset):
    out, meta = fm_dataset
    model = PlantedModel(FM_SPEC)
    for split in SPLITS:
        t = _read_split(out, meta, split)
        p = 1 / (1 + np.exp(-_fm_logit_from_rows(model, t)))
        y = t["label"].to_numpy()
        assert roc_auc(p, y) == pytest.approx(meta["oracle_auc"][split], abs=1e-12)
        assert log_loss(p, y) == pytest.approx(meta["oracle_logloss"][split], abs=1e-9)
    assert 0.78 < meta["oracle_auc"]["test"] < 0.87


def test_cli_structure_fm_and_help(tmp_path, capsys):
    from embedtrain.cli import main

    assert main(["datagen", "ctr", "--structure", "fm", "--rows", "1000",
                 "--out", str(tmp_path / "fm")]) == 0
    meta = json.loads((tmp_path / "fm" / "metadata.json").read_text())
    assert meta["generator"]["structure"] == "fm" and meta["generator"]["rows"] == 1000
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["datagen", "ctr", "--help"])
    assert "--structure {criteo,fm}" in capsys.readouterr().out
