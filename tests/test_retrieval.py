"""The retrieval family (issue 56): the data set's rows and oracle, the in-batch softmax against a
slow reference, the full-corpus evaluation against brute force, 2 ranks == 1 rank, a resumed run
== an uninterrupted one, and a run that learns and retrieves items training never saw."""

import json
import math
import types

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedtrain.config import load_config
from embedtrain.datagen.retrieval import (
    RetrievalDataSpec,
    generate_retrieval,
    planted_towers,
    probabilities,
)
from embedtrain.models.retrieval import ItemFrequency, RetrievalModel
from embedtrain.train.retrieval import Retrieval

SPEC = RetrievalDataSpec(users=1500, items=400, segments=5, categories=8, brands=40,
                         attributes=0, user_noise=0.6, mean_extra_events=6.0, max_events=50,
                         max_length=8, seed=3)


@pytest.fixture(scope="module")
def ret_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("retrieval")
    generate_retrieval(SPEC, out, progress=False)
    return out


def _rows(root, split):
    return pq.read_table(sorted((root / split).glob("*.parquet"))).to_pylist()


def test_rows_are_leave_last_out_and_cold_items_never_train(ret_data):
    """Per user: train rows hold its events but the last two, oldest first, each with the events
    before it as history (at most max_length); valid's history is every train event, test's
    also the valid one. Cold items are in no train row (item or history) and in the item table."""
    model = planted_towers(SPEC)
    train, valid, test = (_rows(ret_data, s) for s in ("train", "valid", "test"))
    events: dict[int, list[int]] = {}
    for r in train:
        events.setdefault(r["user"], []).append(r["item"])
    by_user = {r["user"]: r for r in valid}
    assert len(valid) == len(test) == SPEC.users and set(by_user) == set(events)
    seen = {u: 0 for u in events}
    for r in train:
        u, t = r["user"], seen[r["user"]]
        assert r["history"] == events[u][max(0, t - SPEC.max_length):t]
        assert r["segment"] == model.segment[u]
        seen[u] += 1
    for r in test:
        u = r["user"]
        assert by_user[u]["history"] == events[u][-SPEC.max_length:]
        assert r["history"] == (events[u] + [by_user[u]["item"]])[-SPEC.max_length:]
    cold = set(np.flatnonzero(model.cold).tolist())
    assert cold and not cold & {i for r in train for i in [r["item"], *r["history"]]}
    assert cold & {r["item"] for r in test}  # cold items are there to be retrieved
    items = pq.read_table(ret_data / "items.parquet").to_pydict()
    assert items["item"] == list(range(SPEC.items))
    assert items["brand"] == model.brand.tolist() and items["category"] == model.category.tolist()


def test_user_attributes_place_the_user(tmp_path):
    """With ``attributes``, a user's planted vector is its segment's and its attribute values'
    (and its own noise): without noise, users alike in all of them are placed alike, users that
    differ in any are not; the rows carry each attribute's value."""
    spec = RetrievalDataSpec(users=400, items=200, segments=3, attributes=2, attribute_values=3,
                             categories=4, brands=10, user_noise=0.0, seed=1)
    model = planted_towers(spec)
    keys = [(int(model.segment[u]), *model.attributes[u].tolist()) for u in range(spec.users)]
    first = {}
    for u, key in enumerate(keys):
        first.setdefault(key, u)
        assert np.array_equal(model.user_vectors[u], model.user_vectors[first[key]])
    reps = np.stack([model.user_vectors[u] for u in first.values()])
    assert len(first) > 9 and len(np.unique(reps.round(6), axis=0)) == len(first)
    generate_retrieval(spec, tmp_path, progress=False)
    rows = _rows(tmp_path, "train")
    assert all([r["segment"], r["attr0"], r["attr1"]] == list(keys[r["user"]]) for r in rows)


def test_the_same_spec_writes_the_same_data(ret_data, tmp_path):
    generate_retrieval(SPEC, tmp_path, progress=False)
    for split in ("train", "test"):
        assert _rows(tmp_path, split) == _rows(ret_data, split)
    assert (json.loads((tmp_path / "metadata.json").read_text())
            == json.loads((ret_data / "metadata.json").read_text()))


def test_oracle_recall_is_the_brute_force_ranking(ret_data):
    """``oracle_recall@k``: the share of test rows whose item is among the k most probable for
    its user (ties: the smaller id first), every item ranked by sorting."""
    meta = json.loads((ret_data / "metadata.json").read_text())
    p = probabilities(SPEC, planted_towers(SPEC), slice(0, SPEC.users))
    for k in (10, 50):
        hits, mass = 0, 0.0
        for r in _rows(ret_data, "test"):
            row = p[r["user"]]
            order = sorted(range(SPEC.items), key=lambda j: (-row[j], j))[:k]
            hits += r["item"] in order
            mass += row[order].sum()
        assert meta[f"oracle_recall@{k}"]["test"] == pytest.approx(hits / SPEC.users, abs=1e-12)
        assert meta[f"oracle_expected_recall@{k}"]["test"] == pytest.approx(mass / SPEC.users)


# ---- the loss and the evaluation against slow references, on towers of plain tensors --------

class Lookup(nn.Module):
    """Towers as two plain tables: a query is its (fake) sparse input's row of ``q``."""

    def __init__(self, users=6, items=9, dim=4, temperature=0.5):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.q = nn.Parameter(torch.randn(users, dim, generator=g))
        self.v = nn.Parameter(torch.randn(items, dim, generator=g))
        self.temperature = temperature

    def forward(self, dense, sparse, items=None):
        norm = torch.nn.functional.normalize
        if isinstance(sparse, KeyedJaggedTensor):
            sparse = sparse["user"].values()
        return (norm(self.q[sparse], dim=1) if sparse is not None else None,
                norm(self.v[items], dim=1) if items is not None else None)


def _batch(users, labels, padding=0):
    return types.SimpleNamespace(dense_features=torch.zeros(len(users), 0),
                                 sparse_features=torch.tensor(users),
                                 labels=torch.tensor(labels), padding=padding)


@pytest.mark.parametrize("log_q,mixed", [(False, 0), (True, 0), (True, 5)])
def test_in_batch_loss_is_the_reference_softmax(log_q, mixed):
    """Each row's cross-entropy over the batch's positives (and the step's uniform negatives),
    logits lowered by log q, the row's own item masked wherever else it appears, padding rows
    neither queries nor candidates."""
    model = RetrievalModel(Lookup(), num_items=9)
    model.frequency.update(torch.tensor([3, 3, 8]))  # a step before: estimates differ by item
    task = Retrieval(log_q=log_q, mixed_negatives=mixed, seed=4)
    users, labels = [0, 1, 2, 3, 4, 5], [3, 5, 3, 7, 0, -1]  # a duplicate positive, a padding row
    batch = _batch(users, labels, padding=1)
    every_neg, _ = task.negatives(model, 1, 0)
    reference_freq = ItemFrequency(9)
    reference_freq.load_state_dict(model.frequency.state_dict())
    got = task.forward(model, batch)
    assert got.num_examples == 5

    reference_freq.update(torch.tensor(labels[:5]))
    q, v = model.towers(None, torch.tensor(users), torch.arange(9))
    losses = []
    for i in range(5):
        cands = [(labels[j], j == i, 0.0 if not log_q else float(reference_freq.log_p(
            torch.tensor(labels[j])))) for j in range(5)]
        cands += [(int(n), False, math.log(mixed / 9)) for n in every_neg]
        logits, own = [], None
        for item, is_own, corr in cands:
            if item == labels[i] and not is_own:
                continue
            if is_own:
                own = len(logits)
            logits.append(float(q[i] @ v[item]) / 0.5 - corr)
        losses.append(torch.logsumexp(torch.tensor(logits), 0) - logits[own])
    assert float(got.loss) == pytest.approx(float(torch.stack(losses).mean()), rel=1e-5)
    assert int(model.frequency.step) == 2


def test_item_frequency_is_the_moving_average_of_the_gaps():
    f = ItemFrequency(4, alpha=0.5)
    for ids in ([1, 2], [1], [], [1, 2, 2]):
        f.update(torch.tensor(ids, dtype=torch.long))
    # item 1 seen at steps 0, 1, 3: delta 1 -> 0.5 * 1 + 0.5 * 1 = 1 -> 0.5 * 1 + 0.5 * 2 = 1.5
    # item 2 at 0, 3: 1 -> 0.5 * 1 + 0.5 * 3 = 2; items 0, 3 never
    assert f.delta.tolist() == [1.0, 1.5, 2.0, 1.0] and f.last.tolist() == [-1, 3, 3, -1]
    f.update(torch.tensor([0]))  # first seen at step 4: delta 5
    assert float(f.delta[0]) == 5.0 and int(f.step) == 5
    torch.testing.assert_close(f.log_p(torch.tensor([1, 0])), -torch.tensor([1.5, 5.0]).log())


def test_evaluation_ranks_every_item():
    """Top-k ids, each row's item's rank among all items and the full softmax's loss, against
    scoring every item; the corpus is embedded again after the weights change."""
    import embedtrain.train.retrieval as retrieval

    model = RetrievalModel(Lookup(items=40), num_items=40).eval()
    task = Retrieval(top_k=[3, 10])
    batch = _batch([0, 1, 2, 3, 4], [7, 0, 39, 12, 5], padding=1)
    old, retrieval._CORPUS_BLOCK = retrieval._CORPUS_BLOCK, 16  # several blocks
    try:
        out = task.forward(model, batch)
    finally:
        retrieval._CORPUS_BLOCK = old
    q, v = model.towers(None, torch.arange(5), torch.arange(40))
    scores = q @ v.T
    for i, t in enumerate([7, 0, 39, 12]):
        order = sorted(range(40), key=lambda j: (-float(scores[i, j]), j))
        assert out.predictions[i, :10].tolist() == order[:10]
        assert int(out.predictions[i, 10]) == order.index(t) + 1
    expected = (torch.logsumexp(scores[:4] / 0.5, 1) - scores[:4].gather(
        1, torch.tensor([[7], [0], [39], [12]]))[:, 0] / 0.5).mean()
    assert float(out.loss) == pytest.approx(float(expected), rel=1e-5)
    metrics = task.new_metrics()
    metrics.update(out, batch)
    ranks = out.predictions[:, -1].double()
    got = metrics.compute()
    assert got["recall@3"] == float((ranks <= 3).double().mean())
    assert got["mrr"] == pytest.approx(float((1 / ranks).mean()))
    with torch.no_grad():
        model.towers.v.mul_(-1)
    model.eval()  # a new evaluation: the corpus is embedded again
    flipped = task.forward(model, batch)
    assert not torch.equal(flipped.predictions, out.predictions)


def test_excluding_seen_items_ranks_only_the_unseen():
    """``exclude_seen``: a row's history items are out of its top-k and its item's rank (every
    item scored by brute force); a row whose item is in its history is a miss."""
    model = RetrievalModel(Lookup(items=30), num_items=30).eval()
    task = Retrieval(top_k=[3, 5], exclude_seen=True)
    histories = [[4, 9, 4], [], [11], [2, 3, 5, 6]]
    labels = [7, 0, 11, 12]
    sparse = KeyedJaggedTensor.from_lengths_sync(
        ["user", "history"], torch.tensor([0, 1, 2, 3] + sum(histories, [])),
        torch.tensor([1, 1, 1, 1] + [len(h) for h in histories]))
    batch = types.SimpleNamespace(dense_features=torch.zeros(4, 0), sparse_features=sparse,
                                  labels=torch.tensor(labels), padding=0)
    out = task.forward(model, batch)
    q, v = model.towers(None, torch.arange(4), torch.arange(30))
    scores = q @ v.T
    for i, (t, h) in enumerate(zip(labels, histories)):
        order = [j for j in sorted(range(30), key=lambda j: (-float(scores[i, j]), j))
                 if j not in h]
        assert out.predictions[i, :5].tolist() == order[:5]
        rank = order.index(t) + 1 if t not in h else 31
        assert int(out.predictions[i, 5]) == rank
    with pytest.raises(ValueError, match="task.exclude_seen: no query feature 'history'"):
        task.forward(model, types.SimpleNamespace(
            dense_features=torch.zeros(1, 0), labels=torch.tensor([1]), padding=0,
            sparse_features=KeyedJaggedTensor.from_lengths_sync(
                ["user"], torch.tensor([0]), torch.tensor([1]))))


# ---- runs on the data set: learning, cold items, resume, 2 ranks ---------------------------

def _cfg(data, *overrides):
    return load_config("configs/retrieval_synthetic.yaml", overrides=[
        f"data.path={data}", "data.batch_size=128", "data.eval_batch_size=512",
        "data.num_workers=0", "model.dim=16", "model.hidden=[32]", "train.eval_every=0",
        "train.progress=false", *overrides])


def test_a_run_learns_and_retrieves_items_training_never_saw(ret_data, tmp_path):
    """Past popularity on test recall@10, below the oracle; the test rows whose item is cold
    (never in training) rank their item far above chance: the item tower places it by its
    features."""
    from embedtrain.recipes import build_run

    # in-batch negatives only: uniform ones (mixed_negatives) are the only training an item
    # that is never a positive gets, and they push it away from every query
    run = build_run(_cfg(ret_data, "train.max_steps=150", "train.checkpoint_every=0",
                         "task.mixed_negatives=0"), tmp_path)
    summary = run.trainer.fit(test_data=run.test_data)
    counts = np.bincount([r["item"] for r in _rows(ret_data, "train")], minlength=SPEC.items)
    top10 = set(np.argsort(-counts, kind="stable")[:10].tolist())
    test = _rows(ret_data, "test")
    popularity = sum(r["item"] in top10 for r in test) / len(test)
    assert popularity + 0.05 < summary["recall@10"] < summary["oracle_recall_at_10"]
    model, task = run.trainer.model, run.trainer.task
    model.eval()
    cold = planted_towers(SPEC).cold
    ranks = []
    for batch in run.test_data.iter_epoch(0):
        out = task.forward(model, batch)
        targets = batch.labels[:out.num_examples]
        ranks += out.predictions[cold[targets.numpy()], -1].tolist()
    assert len(ranks) > 20
    assert np.mean(ranks) < 0.15 * SPEC.items, np.mean(ranks)  # chance: SPEC.items / 2


def _state(trainer):
    out = {}
    for k, v in trainer.model.state_dict().items():
        out[k] = v.local_shards()[0].tensor.clone() if hasattr(v, "local_shards") else v.clone()
    return out


def test_a_learned_temperature_trains_and_keeps_its_floor(ret_data, tmp_path):
    """``model.learn_temperature``: the loss moves the temperature (a weight of the dense
    optimizer's, checkpointed), never below ``min_temperature``."""
    from embedtrain.recipes import build_run

    run = build_run(_cfg(ret_data, "train.max_steps=8", "model.learn_temperature=true",
                         "model.temperature=0.1", "data.batch_size=64"), tmp_path / "run")
    run.fit()
    towers = unwrap_towers(run.trainer.model)
    assert towers.log_temperature.requires_grad
    assert float(towers.temperature) != pytest.approx(0.1, abs=1e-6)
    assert any("log_temperature" in k for k in run.trainer.model.state_dict())
    with torch.no_grad():
        towers.log_temperature.fill_(math.log(1e-4))
    assert float(towers.temperature) == pytest.approx(towers.min_temperature)


def unwrap_towers(model):
    from embedtrain.train.retrieval import unwrap

    return unwrap(model).towers


def test_resume_equals_uninterrupted(ret_data, tmp_path):
    """Tables, towers, optimizer-driven weights and the item frequencies (the log-q estimates
    and the negatives' step) of a run resumed at step 5 equal the uninterrupted run's."""
    from embedtrain.recipes import build_run

    common = ["train.checkpoint_every=5", "task.mixed_negatives=16"]
    whole = build_run(_cfg(ret_data, *common, "train.max_steps=10"), tmp_path / "whole").trainer
    whole.fit()
    build_run(_cfg(ret_data, *common, "train.max_steps=5"), tmp_path / "part").trainer.fit()
    resumed = build_run(_cfg(ret_data, *common, "train.max_steps=10"), tmp_path / "part").trainer
    assert resumed.resume() == tmp_path / "part" / "checkpoints" / "step_00000005"
    resumed.fit()
    a, b = _state(whole), _state(resumed)
    assert a.keys() == b.keys() and any("frequency.delta" in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _slice(batch, lo, hi):
    kjt = batch.sparse_features
    values, lengths = [], []
    for key in kjt.keys():
        jt = kjt[key]
        offsets = jt.offsets()
        values.append(jt.values()[offsets[lo]:offsets[hi]])
        lengths.append(jt.lengths()[lo:hi])
    local = KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=torch.cat(values),
                                                lengths=torch.cat(lengths))
    return Batch(batch.dense_features[lo:hi], local, batch.labels[lo:hi])


def _one_step(rank, world, data, out):
    from embedtrain.data.reader import ParquetBatchReader
    from embedtrain.features import load_dataset_meta
    from embedtrain.recipes.base import local_cluster
    from embedtrain.recipes.retrieval import RetrievalRecipe

    cfg = _cfg(data, "task.mixed_negatives=6", "optim.sparse=sgd", "optim.dense=sgd",
               "optim.momentum=0.0", "optim.sparse_lr=0.5", "optim.dense_lr=0.5")
    meta = load_dataset_meta(data)
    torch.manual_seed(0)
    recipe = RetrievalRecipe(cfg)
    dmp, optimizer, _ = recipe.sharded_model(local_cluster(world, torch.device("cpu"), 64),
                                             torch.device("cpu"), out)
    tables = {}
    with torch.no_grad():  # the same start on every world size
        for name, p in dmp.named_parameters():
            if "mlp" in name:
                g = torch.Generator().manual_seed(len(name))
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for key, value in dmp.state_dict().items():
            if hasattr(value, "local_shards"):
                full = torch.randn(value.size(), generator=torch.Generator().manual_seed(
                    len(key))) * 0.3
                for shard in value.local_shards():
                    r0, c0 = shard.metadata.shard_offsets
                    rows, cols = shard.tensor.shape
                    shard.tensor.copy_(full[r0:r0 + rows, c0:c0 + cols])
                tables[key] = full.shape
    batch = next(iter(ParquetBatchReader(meta.files("train"), meta.features, 128,
                                         num_workers=0)))
    local = _slice(batch, rank * 128 // world, (rank + 1) * 128 // world)
    loss = recipe.make_task().forward(dmp, local).loss
    loss.backward()
    optimizer.step()
    state = dmp.state_dict()
    return {"loss": float(loss),
            "dense": {n: p.detach().clone() for n, p in dmp.named_parameters() if "mlp" in n},
            "frequency": {k: v.clone() for k, v in state.items() if "frequency" in k},
            "tables": {k: (shape, [(s.metadata.shard_offsets, s.tensor.clone())
                                   for s in state[k].local_shards()])
                       for k, shape in tables.items()}}


def _assemble(results, key):
    shape = results[0]["tables"][key][0]
    table = torch.full(tuple(shape), float("nan"))
    for r in results:
        for (r0, c0), t in r["tables"][key][1]:
            table[r0:r0 + t.shape[0], c0:c0 + t.shape[1]] = t
    return table


@pytest.mark.slow
def test_two_ranks_step_like_one(ret_data, tmp_path):
    """One SGD step on 2 ranks (tables sharded by the planner, the tower MLPs under DDP, every
    rank's positives and its share of the uniform negatives all-gathered) equals the step on 1
    rank with the global batch: the loss (the ranks' mean), every table, every tower weight
    and the item frequencies."""
    from embedtrain.processes import spawn
    from embedtrain.train.dist import init_process_group

    two = spawn(_one_step, 2, str(ret_data), str(tmp_path / "two"), timeout=400)
    init_process_group()
    one = _one_step(0, 1, str(ret_data), str(tmp_path / "one"))
    assert (two[0]["loss"] + two[1]["loss"]) / 2 == pytest.approx(one["loss"], rel=1e-6)
    for key in one["tables"]:
        torch.testing.assert_close(_assemble(two, key), _assemble([one], key), atol=1e-6,
                                   rtol=1e-5)
    for name in one["dense"]:
        for r in two:
            torch.testing.assert_close(r["dense"][name], one["dense"][name], atol=1e-6, rtol=1e-5)
    for key in one["frequency"]:
        for r in two:
            assert torch.equal(r["frequency"][key], one["frequency"][key]), key


# ---- export and serving ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(ret_data, tmp_path_factory):
    """A short run with a checkpoint, and its evaluation's top 50 of the test split."""
    from embedtrain.recipes import build_run

    out = tmp_path_factory.mktemp("run")
    run = build_run(_cfg(ret_data, "train.max_steps=40", "train.checkpoint_every=40"), out)
    run.fit()
    model, task = run.trainer.model, run.trainer.task
    model.eval()
    top = [task.forward(model, b).predictions[:, :50]
           for b in run.eval_reader("test").iter_epoch(0)]
    unseen = Retrieval(top_k=[50], exclude_seen=True)
    top_unseen = [unseen.forward(model, b).predictions[:, :50]
                  for b in run.eval_reader("test").iter_epoch(0)]
    return out, torch.cat(top), torch.cat(top_unseen)


def test_predict_from_the_export_is_the_evaluations_top_k(ret_data, trained, tmp_path):
    """The flat index's top 50 of every test row, through the exported query tower and the
    item embeddings computed at export, equal the run's evaluation top 50 (item ids in order);
    the query tower after its lookups and the item tower are programs of their own."""
    from embedtrain.export.export import export_run
    from embedtrain.export.predict import predict

    run_dir, expected, expected_unseen = trained
    result = export_run(run_dir, tmp_path / "export", progress=False)
    m = result.manifest
    assert m.items.index == "flat" and m.items.num_items == SPEC.items and m.head.dim == 16
    assert [t.name for t in m.tables] == ["t_user", "t_segment", "t_history", "t_item_category",
                                          "t_item_brand", "t_item_id"]
    assert (tmp_path / "export" / m.items.program).is_file()
    predict(tmp_path / "export", [str(ret_data / "test")], tmp_path / "p.parquet", top_k=50,
            progress=False)
    got = pq.read_table(tmp_path / "p.parquet").column("top_ids").to_pylist()
    assert torch.equal(torch.tensor(got), expected)
    # task.exclude_seen: predict leaves each row's history out, as the evaluation does
    config = tmp_path / "export" / m.source.config
    config.write_text(config.read_text().replace("log_q: true", "log_q: true\n  exclude_seen: "
                                                 "true"))
    predict(tmp_path / "export", [str(ret_data / "test")], tmp_path / "u.parquet", top_k=50,
            progress=False)
    got = pq.read_table(tmp_path / "u.parquet").column("top_ids").to_pylist()
    assert torch.equal(torch.tensor(got), expected_unseen)
    assert not torch.equal(expected_unseen, expected)
    m = export_run(run_dir, tmp_path / "hnsw", index="hnsw", progress=False).manifest
    assert m.items.index == "hnsw" and m.items.recall_at_10_vs_exact >= 0.95
    predict(tmp_path / "hnsw", [str(ret_data / "test")], tmp_path / "h.parquet", top_k=10,
            progress=False)
    approx = pq.read_table(tmp_path / "h.parquet").column("top_ids").to_pylist()
    found = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(approx, expected[:, :10].tolist())])
    assert found >= 0.95
    config = tmp_path / "hnsw" / m.source.config  # the index's top-k leaves seen items out too
    config.write_text(config.read_text().replace("log_q: true", "log_q: true\n  exclude_seen: "
                                                 "true"))
    predict(tmp_path / "hnsw", [str(ret_data / "test")], tmp_path / "hu.parquet", top_k=10,
            progress=False)
    approx = pq.read_table(tmp_path / "hu.parquet").column("top_ids").to_pylist()
    histories = [r["history"] for r in _rows(ret_data, "test")]
    assert not any(set(a) & set(h) for a, h in zip(approx, histories))
    found = np.mean([len(set(a) & set(b)) / 10
                     for a, b in zip(approx, expected_unseen[:, :10].tolist())])
    assert found >= 0.95


def test_an_approximate_index_states_its_recall(tmp_path):
    """``hnsw`` / ``ivf`` on 20,000 clustered unit vectors: the search parameter found reaches
    recall@10 >= 0.95 against exact search, the recall stated is the one measured, and the
    index read back from its file searches as it did (same recall)."""
    from embedtrain.export.items import (
        build_index, exact_top, read_index, recall_at_10, sample_queries, write_index)
    from embedtrain.export.manifest import ItemIndex

    rng = np.random.default_rng(0)
    centres = rng.standard_normal((200, 16))
    x = centres[rng.integers(0, 200, 20_000)] + 0.3 * rng.standard_normal((20_000, 16))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    queries = sample_queries(x)
    exact = exact_top(x, queries, 10)
    for kind, param in (("hnsw", "ef_search"), ("ivf", "nprobe")):
        index, got_kind, params, recall = build_index(x, kind)
        assert got_kind == kind and recall >= 0.95 and param in params
        assert recall == recall_at_10(index, exact, queries)
        write_index(index, tmp_path / f"{kind}.faiss")
        entry = ItemIndex(len(x), "", [], [], "", kind, f"{kind}.faiss", params)
        assert recall_at_10(read_index(tmp_path, entry), exact, queries) == recall
    assert build_index(x[:100], "auto")[1] == "flat"


def test_items_added_to_an_export_are_served_without_retraining(ret_data, trained, tmp_path):
    """``add_items``: each new item is the item tower's output over its features (no row of its
    own id: zeros), appended to the embeddings, the item table and the flat index; predict
    then ranks the grown corpus exactly. A bad id is one line naming the file, column and
    row, and leaves the export as it was; so does a crash before ``model.json`` is swapped."""
    import pyarrow as pa

    import embedtrain.export.manifest as manifest_module

    from embedtrain.export.export import export_run
    from embedtrain.export.items import add_items
    from embedtrain.export.manifest import ExportError, load_manifest
    from embedtrain.export.predict import ExportedModel, predict

    run_dir = trained[0]
    out = tmp_path / "export"
    export_run(run_dir, out, progress=False)
    before = np.load(out / "items/embeddings.npy")
    source = pq.read_table(ret_data / "items.parquet").slice(0, 5)
    bad = pa.table({"category": [0, SPEC.categories], "brand": [0, 0]})
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(ExportError, match=r"bad.parquet: column category, row 1: id 8 outside"):
        add_items(out, tmp_path / "bad.parquet")
    assert load_manifest(out).items.num_items == SPEC.items
    pq.write_table(source.drop(["item"]), tmp_path / "new.parquet")
    predict(out, [str(ret_data / "test")], tmp_path / "p0.parquet", top_k=20, progress=False)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed")

    real = manifest_module.write_manifest
    manifest_module.write_manifest = crash
    try:
        with pytest.raises(KeyboardInterrupt):
            add_items(out, tmp_path / "new.parquet")
    finally:
        manifest_module.write_manifest = real
    old = load_manifest(out)
    assert old.items.num_items == SPEC.items and np.array_equal(
        np.load(out / old.head.files.npy), before)
    predict(out, [str(ret_data / "test")], tmp_path / "p1.parquet", top_k=20, progress=False)
    assert pq.read_table(tmp_path / "p1.parquet").equals(pq.read_table(tmp_path / "p0.parquet"))
    add_items(out, tmp_path / "new.parquet")
    m = load_manifest(out)
    assert m.items.num_items == m.head.num_classes == SPEC.items + 5 == m.items.added_items + 400
    assert not any((out / f).exists() for f in (old.head.files.npy, old.items.table,
                                                old.items.index_file))
    after = np.load(out / m.head.files.npy)
    assert np.array_equal(after[:SPEC.items], before)
    from embedtrain.export.items import read_index

    index = read_index(out, m.items)
    assert index.ntotal == SPEC.items + 5
    assert np.array_equal(index.reconstruct_n(0, index.ntotal), after)
    program = torch.export.load(out / m.items.program).module()
    tables = [np.load(out / f"tables/{t}.npy") for t in m.items.tables]
    cats, brands = source.column("category").to_numpy(), source.column("brand").to_numpy()
    pooled = torch.from_numpy(np.stack([tables[0][cats], tables[1][brands],
                                        np.zeros_like(tables[0][cats])], 1))
    with torch.no_grad():
        expected = program(torch.zeros(5, 0), pooled).numpy()
    np.testing.assert_allclose(after[SPEC.items:], expected, rtol=1e-6, atol=1e-7)
    assert pq.read_table(out / m.items.table).column("item").to_pylist()[-5:] == \
        list(range(SPEC.items, SPEC.items + 5))
    predict(out, [str(ret_data / "test")], tmp_path / "p.parquet", top_k=20, progress=False)
    got = torch.tensor(pq.read_table(tmp_path / "p.parquet").column("top_ids").to_pylist())
    model = ExportedModel(out)
    from embedtrain.data.reader import ParquetBatchReader

    queries = torch.cat([model.outputs(b.dense_features, b.sparse_features) for b in
                         ParquetBatchReader([ret_data / "test" / "part-00000.parquet"],
                                            model.spec, 512, num_workers=0)])
    scores = queries @ torch.from_numpy(after).T
    assert torch.equal(got, torch.topk(scores, 20, dim=1).indices)
    assert (got >= SPEC.items).any()  # the new items are retrieved
