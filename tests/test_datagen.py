"""Tests for embedtrain.datagen.ctr and .tsv (small sizes: the whole file runs in a few seconds)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedtrain.datagen.ctr import (
    DENSE_NAMES, MULTI_HOT, SPARSE_NAMES, SPLITS, CTRDataSpec, generate_ctr, log_loss, roc_auc,
    vocab_size)

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
])
def test_cli_errors_name_the_option(tmp_path, capsys, argv, says):
    from embedtrain.cli import main

    assert main(["datagen", *argv, "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "Spec." not in err[0], err
    assert not (tmp_path / "d").exists()
