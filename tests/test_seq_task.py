"""The seq family (issue 33): the SASRec encoder never looks ahead, a row's output does not depend
on the rest of its batch, each position predicts the next item, a run learns past the
popularity and co-occurrence baselines' floor, and a resumed run equals an uninterrupted one."""

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedtrain.config import load_config
from embedtrain.datagen import SeqDataSpec, generate_seq
from embedtrain.models.seq import SeqEncoder, SeqModel


def _kjt(rows):
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["items"], values=torch.tensor([i for r in rows for i in r], dtype=torch.long),
        lengths=torch.tensor([len(r) for r in rows], dtype=torch.long))


MODELS = ["sasrec", "hstu"]


def _encoder(seed=0, model="sasrec"):
    torch.manual_seed(seed)
    enc = SeqEncoder(num_items=50, dim=16, max_length=6, layers=2, heads=2, dropout=0.0,
                     model=model)
    with torch.no_grad():
        for table in enc.ec.embeddings.values():
            table.weight.normal_(0, 0.5)
    return enc.eval()


@pytest.mark.parametrize("model", MODELS)
def test_a_position_never_sees_a_later_item(model):
    enc = _encoder(model=model)
    with torch.no_grad():
        h, lengths = enc(_kjt([[3, 7, 9, 11, 2]]))
        for t in range(4):  # change every item after position t: positions <= t unchanged
            other = [3, 7, 9, 11, 2][:t + 1] + [40, 41, 42, 43][:4 - t]
            g, _ = enc(_kjt([other]))
            # recency positions number from the end, so compare the first t + 1 positions of
            # histories of the same length
            torch.testing.assert_close(g[0, :t + 1], h[0, :t + 1], rtol=0, atol=1e-6)
            assert not torch.allclose(g[0, t + 1:5], h[0, t + 1:5])
    assert lengths.tolist() == [5]


@pytest.mark.parametrize("model", MODELS)
def test_a_rows_output_does_not_depend_on_its_batch(model):
    enc = _encoder(model=model)
    with torch.no_grad():
        alone, _ = enc(_kjt([[5, 6]]))
        together, _ = enc(_kjt([[1, 2, 3, 4, 5, 6], [5, 6], [9]]))
    torch.testing.assert_close(together[1, :2], alone[0, :2], rtol=0, atol=1e-6)


def test_each_position_predicts_the_next_item_and_the_last_the_target():
    model = SeqModel(num_items=50, dim=16, max_length=4, layers=1, heads=2, dropout=0.0,
                     head=torch.nn.Identity())
    nxt = model.next_items(_kjt([[3, 7, 9], [5], [1, 2]]), torch.tensor([11, 12, -1]))
    assert nxt.tolist() == [[7, 9, 11, -1], [12, -1, -1, -1], [-1, -1, -1, -1]]


@pytest.mark.parametrize("margin", ["none", "cosface"])
def test_target_rank_is_the_brute_force_rank(margin):
    """A sharded head's rank of each target among all items (ties: smaller id first), against
    sorting every item's score; a tied pair and evaluation blocks smaller than the head."""
    from embedtrain.heads import sharded as class_head
    from embedtrain.heads.sharded import ShardedSoftmaxHead
    from embedtrain.models.options import Margin

    head = ShardedSoftmaxHead(37, 8, margin=Margin(margin), scale=4.0)
    with torch.no_grad():
        head.weight.copy_(torch.randn(37, 8, generator=torch.Generator().manual_seed(0)))
        head.weight[20] = head.weight[5]  # a tie: item 5 ranks before item 20
    features = torch.randn(12, 8, generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 37, (12,), generator=torch.Generator().manual_seed(2))
    targets[:2] = torch.tensor([5, 20])
    old, class_head._EVAL_BLOCK = class_head._EVAL_BLOCK, 10
    try:
        got = head.target_rank(features, targets)
    finally:
        class_head._EVAL_BLOCK = old
    w = head.weight.detach()
    if margin != "none":
        w = torch.nn.functional.normalize(w, dim=1)
        features = torch.nn.functional.normalize(features, dim=1) * 4.0
    scores = features @ w.t()
    for i, t in enumerate(targets.tolist()):
        order = sorted(range(37), key=lambda j: (-float(scores[i, j]), j))
        assert got[i] == order.index(t) + 1, (i, t)


def test_excluded_history_leaves_the_ranking_and_the_top_k():
    """``exclude_history``: the top-k are the best items outside each history (and never the
    padding id 0), the rank counts only those (repeats once), and a target in its own history is
    a miss (rank 0)."""
    from embedtrain.heads.sharded import ShardedSoftmaxHead

    torch.manual_seed(0)
    head = ShardedSoftmaxHead(30, 16)
    model = SeqModel(num_items=30, dim=16, max_length=5, layers=1, heads=2, dropout=0.0,
                     head=head, exclude_history=True)
    with torch.no_grad():
        for table in model.encoder.ec.embeddings.values():
            table.weight.normal_(0, 0.5)
    model.eval()
    rows = [[3, 7, 9, 7], [5], [1, 2, 4], [8, 8]]
    with torch.no_grad():
        h, lengths = model.encoder(_kjt(rows))
        scores = h[torch.arange(4), lengths - 1] @ head.weight.t()
        # row 0: its least likely item, so every item of its history (7 twice) is ahead of it;
        # row 2: a target in its own history
        worst = min((j for j in range(1, 30) if j not in rows[0]), key=lambda j: float(scores[0, j]))
        targets = torch.tensor([worst, 12, 2, 20])
        _, top, ranks = model(torch.zeros(4, 0), _kjt(rows), targets, 4)
    for i, history in enumerate(rows):
        order = [j for j in sorted(range(30), key=lambda j: (-float(scores[i, j]), j))
                 if j not in history and j != 0]  # 0: padding, never ranked
        assert top[i].tolist() == order[:4], i
        t = int(targets[i])
        assert ranks[i] == (0 if t in history else order.index(t) + 1), i
    assert ranks[2] == 0 and ranks[0] == 30 - 3 - 1  # behind every item but its history and 0


@pytest.fixture(scope="module")
def seq_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("seq")
    generate_seq(SeqDataSpec(users=3000, items=600, clusters=6, max_length=12, seed=2), out,
                 progress=False)
    return out


def _cfg(data, *overrides):
    return load_config("configs/seq_synthetic.yaml", overrides=[
        f"data.path={data}", "data.batch_size=128", "data.eval_batch_size=512",
        "data.num_workers=0", "seq.dim=32", "train.eval_every=0", "train.progress=false",
        *overrides])


def test_a_run_learns_what_popularity_cannot(seq_data, tmp_path):
    import json
    import sys
    from pathlib import Path

    from embedtrain.recipes import build_run

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_seq import figures, ranks_by_popularity, read_split, with_targets

    meta = json.loads((seq_data / "metadata.json").read_text())
    train = with_targets(*read_split(seq_data, meta, "train"))
    pop = torch.bincount(torch.from_numpy(train[1]), minlength=meta["num_items"]).numpy()
    pop[0] = 0
    popularity = figures(ranks_by_popularity(pop, read_split(seq_data, meta, "test")[2]))
    run = build_run(_cfg(seq_data, "train.max_steps=60", "train.checkpoint_every=0"), tmp_path)
    summary = run.trainer.fit(test_data=run.test_data)
    assert summary["hr@10"] > popularity["hr@10"] + 0.15, (summary, popularity)
    assert summary["oracle_hr_at_10"] > summary["hr@10"]
    assert 0 < summary["ndcg@10"] < summary["hr@10"]
    assert summary["hr@10"] / 10 <= summary["mrr"] < 1  # a top-10 hit is worth >= 1/10


def test_sample_correction_takes_every_positions_label(seq_data, tmp_path):
    """``head.sample_correction`` on a sequence run: the items' frequencies are counted over
    the train split's histories and targets (every position's next item is a label), not over
    the targets alone, and reach the head."""
    import numpy as np
    import pyarrow.parquet as pq

    from embedtrain.recipes import build_run

    run = build_run(_cfg(seq_data, "train.max_steps=1", "train.checkpoint_every=0",
                         "head.loss=softmax", "head.sample_correction=true"), tmp_path)
    meta = run.recipe.dataset
    ids = []
    for path in meta.files("train"):
        table = pq.read_table(path, columns=["items", meta.features.label])
        ids += [np.concatenate(table.column("items").to_pylist()),
                table.column(meta.features.label).to_numpy()]
    expected = np.bincount(np.concatenate(ids), minlength=meta.features.num_classes)
    assert np.array_equal(run.recipe.class_counts.numpy(), expected)
    head = run.trainer.model.module.head
    torch.testing.assert_close(head.frequencies, torch.from_numpy(expected).double().clamp(min=1)
                               / expected.sum())
    targets_only = np.bincount(ids[1], minlength=len(expected))
    assert not np.array_equal(expected, targets_only)


def _state(trainer):
    model = trainer.model.module
    tables = {k: v.local_shards()[0].tensor.clone() if hasattr(v, "local_shards") else v.clone()
              for k, v in trainer.model.state_dict().items() if "embeddings" in k}
    dense = {n: p.detach().clone() for n, p in model.encoder.named_parameters()
             if not n.startswith("ec.")}
    return model.head.weight.detach().clone(), tables, dense


def test_resume_equals_uninterrupted(seq_data, tmp_path):
    from embedtrain.recipes import build_run

    common = ["train.checkpoint_every=5", "head.sample_rate=0.3"]
    whole = build_run(_cfg(seq_data, *common, "train.max_steps=10"), tmp_path / "whole").trainer
    whole.fit()
    build_run(_cfg(seq_data, *common, "train.max_steps=5"), tmp_path / "part").trainer.fit()
    resumed = build_run(_cfg(seq_data, *common, "train.max_steps=10"), tmp_path / "part").trainer
    assert resumed.resume() == tmp_path / "part" / "checkpoints" / "step_00000005"
    resumed.fit()
    assert resumed.state.step == 10
    (h1, t1, d1), (h2, t2, d2) = _state(whole), _state(resumed)
    assert t1 and d1
    assert torch.equal(h1, h2)
    for k in t1:
        assert torch.equal(t1[k], t2[k]), k
    for k in d1:  # the encoder's blocks and positions, dropout included
        assert torch.equal(d1[k], d2[k]), k


# ---- 2 ranks == 1 rank: a step of the sharded model (item table, DDP encoder, head slices) ----

TABLE_KEY = "encoder.ec.embeddings.t_items.weight"


def _slice(batch, lo, hi):
    from torchrec.datasets.utils import Batch

    jt = batch.sparse_features["items"]
    offsets = jt.offsets()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["items"], values=jt.values()[offsets[lo]:offsets[hi]], lengths=jt.lengths()[lo:hi])
    return Batch(batch.dense_features[lo:hi], kjt, batch.labels[lo:hi])


def _one_step(rank, world, data, out):
    from embedtrain.data.reader import ParquetBatchReader
    from embedtrain.features import load_dataset_meta
    from embedtrain.recipes.base import local_cluster
    from embedtrain.recipes.seq import SeqRecipe

    cfg = _cfg(data, "head.kind=partial_fc", "head.sample_rate=1.0", "seq.dropout=0.0",
               "optim.sparse=sgd", "optim.dense=sgd", "optim.momentum=0.0",
               "head.optimizer=sgd", "optim.sparse_lr=0.5", "optim.dense_lr=0.5",
               "head.lr=0.5")
    meta = load_dataset_meta(data)
    torch.manual_seed(0)
    recipe = SeqRecipe(cfg)
    dmp, optimizer, _ = recipe.sharded_model(local_cluster(world, torch.device("cpu"), 64),
                                             torch.device("cpu"), out)
    with torch.no_grad():  # the same start on every world size
        for name, p in dmp.named_parameters():
            if "encoder" in name and ".ec." not in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)))
                        * 0.1)
        full = torch.randn(meta.features.num_classes, 32,
                           generator=torch.Generator().manual_seed(1)) * 0.1
        for shard in dmp.state_dict()[TABLE_KEY].local_shards():
            r0, c0 = shard.metadata.shard_offsets
            rows, cols = shard.tensor.shape
            shard.tensor.copy_(full[r0:r0 + rows, c0:c0 + cols])
    batch = next(iter(ParquetBatchReader(meta.files("train"), meta.features, 128,
                                         num_workers=0)))
    local = _slice(batch, rank * 128 // world, (rank + 1) * 128 // world)
    loss = recipe.task().forward(dmp, local).loss
    loss.backward()
    optimizer.step()
    head = dmp.module.head
    return {"loss": float(loss), "head": (head.start, head.weight.detach().clone()),
            "dense": {n: p.detach().clone() for n, p in dmp.named_parameters()
                      if "encoder" in n and ".ec." not in n},
            "table": [(s.metadata.shard_offsets, s.tensor.clone())
                      for s in dmp.state_dict()[TABLE_KEY].local_shards()]}


def _assemble(results, rows):
    head = torch.cat([w for _, w in sorted((r["head"] for r in results), key=lambda x: x[0])])
    table = torch.full((rows, 32), float("nan"))
    for r in results:
        for (r0, c0), t in r["table"]:
            table[r0:r0 + t.shape[0], c0:c0 + t.shape[1]] = t
    return head, table


@pytest.mark.slow
def test_two_ranks_step_like_one(seq_data, tmp_path):
    """One SGD step on 2 ranks (the item table sharded by the planner, the encoder under DDP, the
    head split by items, every position an example of the head) equals the step on 1 rank with
    the global batch."""
    from embedtrain.processes import spawn
    from embedtrain.train.dist import init_process_group

    two = spawn(_one_step, 2, str(seq_data), str(tmp_path / "two"), timeout=400)
    init_process_group()
    one = _one_step(0, 1, str(seq_data), str(tmp_path / "one"))
    assert two[0]["loss"] == two[1]["loss"] == pytest.approx(one["loss"], rel=1e-6)
    rows = one["head"][1].shape[0]
    head2, table2 = _assemble(two, rows)
    head1, table1 = _assemble([one], rows)
    torch.testing.assert_close(head2, head1, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(table2, table1, atol=1e-6, rtol=1e-5)
    for name in one["dense"]:
        for r in two:
            torch.testing.assert_close(r["dense"][name], one["dense"][name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["sasrec", "hstu"])
def test_attention_dropout_drops_the_attention_weights_in_training_only(kind):
    """``seq.attention_dropout`` reaches every block's attention weights: with it (and no other
    dropout) two training forwards differ, without it they agree; in evaluation it does
    nothing."""
    from embedtrain.models.seq import encode

    def encoder(p):
        torch.manual_seed(0)
        return SeqEncoder(20, 8, 6, layers=2, heads=2, dropout=0.0, model=kind,
                          attention_dropout=p)

    with_it, without = encoder(0.5), encoder(0.0)
    history, lengths = torch.randn(3, 6, 8), torch.tensor([6, 3, 1])
    with torch.no_grad():
        assert not torch.equal(encode(with_it, history, lengths),
                               encode(with_it, history, lengths))
        assert torch.equal(encode(without, history, lengths), encode(without, history, lengths))
        with_it.eval(), without.eval()
        torch.testing.assert_close(encode(with_it, history, lengths),
                                   encode(without, history, lengths))
