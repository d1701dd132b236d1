"""``benchmarks/bench_baselines.py``: its metrics are embedtrain's, its baselines equal slow
reference computations and beat chance on small planted data sets, deterministically, and the
script's table / JSON holds the baselines beside the ``--model`` runs it starts."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import baseline_models as bm  # noqa: E402
import bench_baselines as bb  # noqa: E402
from bench_seq import figures  # noqa: E402

from embedtrain.train.seq import SeqTaskMetrics  # noqa: E402
from embedtrain.train.task import StepOutput  # noqa: E402


def test_metrics_agree_with_slow_definitions():
    rng = np.random.default_rng(0)
    scores = torch.from_numpy(rng.integers(0, 5, 300).astype(np.float64))  # many ties
    labels = torch.from_numpy(rng.integers(0, 2, 300).astype(np.float64))
    pos, neg = scores[labels == 1].tolist(), scores[labels == 0].tolist()
    pairs = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    assert bm.ctr_auc(scores, labels) == pytest.approx(pairs / (len(pos) * len(neg)), abs=1e-6)
    logits = torch.randn(50, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 4, (50,), generator=torch.Generator().manual_seed(2))
    assert bm.node_accuracy(logits, y, 4) == pytest.approx(
        float((logits.argmax(1) == y).float().mean()), abs=1e-6)
    top = torch.tensor([[3, 1, 2, 0, 4], [0, 1, 2, 3, 4]])
    targets = torch.tensor([[1, 4, -1], [7, -1, -1]])
    assert bm.xc_precision(top, targets) == pytest.approx({"p@1": 0.0, "p@5": 0.2})
    # seq: figures() of 1-based ranks = embedtrain's HR@10 / NDCG@10 / MRR of top-10 lists
    ranks = np.array([1, 3, 10, 11, 250])
    target = torch.arange(100, 105)
    lists = torch.tensor([[t if r == j + 1 else 1000 + j for j in range(10)]
                          for t, r in zip(target.tolist(), ranks)])
    metrics = SeqTaskMetrics((10,))
    metrics.update(StepOutput(loss=torch.zeros(()), predictions=torch.cat(
        [lists, torch.from_numpy(ranks)[:, None]], 1), num_examples=5),
        SimpleNamespace(labels=target))
    assert metrics.compute() == pytest.approx(figures(ranks))


def _ctr_args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"lr": 0.01, "l2": 1e-5, "batch": 512, "epochs": 2,
                                 "min_count": 1, **kw})


@pytest.fixture(scope="module")
def ctr_data(tmp_path_factory):
    from embedtrain.datagen import CTRDataSpec, generate_ctr

    root = tmp_path_factory.mktemp("ctr")
    meta = generate_ctr(CTRDataSpec(rows=10_000, seed=1, structure="fm"), root, progress=False)
    return root, meta


def test_ctr_baselines_beat_chance_deterministically(ctr_data):
    root, meta = ctr_data
    data, rows, slot_field = bm.ctr_splits(root, meta, min_count=5)
    ids = data["train"][1]
    assert slot_field.tolist() == list(range(23)) + [23] * 5 + [24] * 5 + [25] * 5
    assert int(ids.max()) == rows and int(ids[ids < rows - 26].max()) == rows - 27
    rare = (ids >= rows - 26) & (ids < rows)                         # the fields' rare ids
    assert rare.any() and torch.equal(ids[rare], (rows - 26 + slot_field).expand_as(ids)[rare])
    assert (ids[:, 23:] == rows).any()                                 # empty multi-hot slots
    lr = bm.fit_ctr(data, rows, slot_field, 0, 0, _ctr_args(epochs=3), "lr")
    assert lr == bm.fit_ctr(data, rows, slot_field, 0, 0, _ctr_args(epochs=3), "lr")
    assert 0.62 < lr["auc"] < meta["oracle_auc"]["test"]
    fm = bm.fit_ctr(data, rows, slot_field, 4, 0, _ctr_args(), "fm")
    assert 0.6 < fm["auc"] < meta["oracle_auc"]["test"]


def test_factorization_machine_equals_its_pairwise_sum():
    """The FM's logit = bias + weights + the dot products of every pair of fields' vectors
    (a field's: its ids' factors summed; a dense feature's: its factor times its value)."""
    torch.manual_seed(0)
    slot_field = torch.tensor([0, 1, 1, 1, 2])
    model = bm.FieldFM(num_ids=30, num_dense=2, rank=3, slot_field=slot_field)
    with torch.no_grad():
        model.weight.weight[:30].normal_()
    dense = torch.randn(6, 2)
    ids = torch.randint(0, 31, (6, 5))              # 30: an empty slot
    logit, _ = model(dense, ids)
    v, w = model.factors.weight.detach(), model.weight.weight.detach()[:, 0]
    for r in range(6):
        fields = [sum((v[i] for s, i in enumerate(ids[r].tolist()) if slot_field[s] == f),
                      torch.zeros(3)) for f in range(3)]
        fields += [dense[r, j] * model.dense_factors[j].detach() for j in range(2)]
        want = float(model.dense(dense[r:r + 1]).detach()) + float(w[ids[r]].sum())
        want += sum(float(a @ b) for a, b in itertools.combinations(fields, 2))
        assert float(logit[r]) == pytest.approx(want, abs=1e-5)


def test_knn_equals_brute_force_and_beats_popularity(tmp_path):
    from embedtrain.datagen import XCDataSpec, generate_xc

    meta = generate_xc(XCDataSpec(classes=60, rows=1_500, vocab=300, multi_label=True, seed=2,
                                  dense_groups=6),
                       tmp_path, progress=False)
    (train, t_y), (test, e_y) = (bm.xc_rows(tmp_path, meta, s) for s in ("train", "test"))
    idf = bm.inverse_document_frequency(train)
    df = (train.to_dense() > 0).sum(dim=0).tolist()                   # rows holding a token
    n = train.shape[0]
    assert idf.tolist() == pytest.approx([math.log((1 + n) / (1 + d)) + 1 for d in df])
    tv, ev = bm.tfidf(train, idf), bm.tfidf(test, idf)
    sims, rows = bm.knn_neighbours(tv, ev, k=7, block=64)
    flat = t_y.view(-1)
    pop = np.bincount(flat[flat >= 0].numpy(), minlength=60)
    top = bm.knn_topk(sims, rows, t_y, pop, k=7)
    dense_t, dense_e = tv.to_dense().double(), ev.to_dense().double()
    labels = [[c for c in row if c >= 0] for row in t_y.tolist()]
    for q in range(0, ev.shape[0], 15):                   # every 15th test row, by hand
        s = [float(dense_e[q] @ dense_t[i]) for i in range(tv.shape[0])]
        near = sorted(range(len(s)), key=lambda i: (-s[i], i))[:7]
        assert rows[q].tolist() == near or np.allclose(sorted(s, reverse=True)[:7],
                                                       sims[q].tolist(), atol=1e-6)
        votes: dict[int, float] = {}
        for i, sim in zip(rows[q].tolist(), sims[q].tolist()):
            for c in labels[i] if sim > 0 else []:
                votes[c] = votes.get(c, 0.0) + sim
        want = sorted(votes, key=lambda c: (-votes[c], -pop[c], c))[:5]
        want += [c for c in sorted(range(60), key=lambda c: (-pop[c], c)) if c not in votes]
        assert top[q].tolist() == want[:5], q
    knn = bm.xc_precision(top, e_y)["p@1"]
    popular = bm.xc_precision(torch.from_numpy(np.argsort(-pop, kind="stable")[:5]).repeat(
        len(e_y), 1), e_y)["p@1"]
    assert knn > popular + 0.2


def test_gcn_beats_chance_deterministically(tmp_path):
    from embedtrain.datagen import GraphDataSpec, generate_graph
    from embedtrain.datagen.graph import NodeFeatures

    generate_graph(GraphDataSpec(nodes=600, avg_degree=6, communities=3, seed=1, vocab=200,
                                 features=NodeFeatures.BOW, words_per_node=10), tmp_path,
                   progress=False)
    data = bm.load_node_data(tmp_path)
    assert torch.allclose(data.x.sum(1), torch.ones(600))  # row-normalised
    first = bm.fit_gcn(data, seed=0, epochs=40)
    assert first == bm.fit_gcn(data, seed=0, epochs=40)
    assert first["accuracy"] > 0.6                          # chance: 1/3


def test_script_shows_baselines_beside_model_runs(tmp_path, monkeypatch, capsys):
    """``--model``: one ``embedtrain train CONFIG --set data.path=DIR --set train.seed=S`` a seed
    with the ``--set`` overrides given (a stand-in trainer here, which records its arguments and
    writes a summary.json), read back into the table and the JSON with the baselines, the oracle
    and the command; the overrides name the row."""
    from embedtrain.datagen import SeqDataSpec, generate_seq

    data = tmp_path / "seq"
    meta = generate_seq(SeqDataSpec(users=300, items=200, clusters=5, seed=1), data,
                        progress=False)
    fake = tmp_path / "fake_train.py"
    fake.write_text(
        "import json, sys, pathlib\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--out') + 1]); out.mkdir(parents=True)\n"
        "seed = int(next(a for a in sys.argv if a.startswith('train.seed='))[11:])\n"
        "json.dump({'hr@10': 0.5 + seed / 10, 'ndcg@10': 0.25, 'split': 'test', 'argv': "
        "sys.argv[1:]}, open(out / 'summary.json', 'w'))\n")
    monkeypatch.setattr(bb, "TRAIN", [sys.executable, str(fake)])
    out = tmp_path / "b.json"
    argv = ["--family", "seq", "--data", str(data), "--seeds", "2", "--model",
            str(ROOT / "configs/seq_synthetic.yaml"), "--work", str(tmp_path / "runs"),
            "--json", str(out), "--set", "seq.attention_dropout=0.2"]
    assert bb.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["command"].startswith("python benchmarks/bench_baselines.py --family seq")
    rows = {r["name"]: r for r in record["rows"]}
    name = "model: seq_synthetic.yaml seq.attention_dropout=0.2"  # --set names its row
    assert list(rows) == ["popularity", "cooccurrence", name, "oracle (Bayes)"]
    assert rows["cooccurrence"]["mean"]["hr@10"] > rows["popularity"]["mean"]["hr@10"]
    model = rows[name]
    assert model["mean"]["hr@10"] == pytest.approx(0.55) and model["std"]["hr@10"] == (
        pytest.approx(0.05))
    for seed, run in enumerate(model["runs"]):
        summary = json.loads((Path(run["metrics"]["run"]) / "summary.json").read_text())
        assert summary["argv"] == [str(ROOT / "configs/seq_synthetic.yaml"), "--set",
                                   f"data.path={data.resolve()}", "--set",
                                   f"train.seed={seed}", "--set", "seq.attention_dropout=0.2",
                                   "--out", run["metrics"]["run"],
                                   "--no-progress"]
    assert rows["oracle (Bayes)"]["mean"]["hr@10"] == meta["oracle_hr@10"]["test"]
    printed = capsys.readouterr().out
    assert "0.5500 ± 0.0500" in printed and "cooccurrence" in printed
    assert math.isclose(rows["popularity"]["mean"]["ndcg@10"],
                        rows["popularity"]["runs"][0]["metrics"]["ndcg@10"])
