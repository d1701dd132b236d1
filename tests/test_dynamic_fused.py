"""The fused remap of a collection's dynamic tables against TorchRec's per-table path.

Two copies of one model, sharded alike (``DistributedModelParallel`` on 1 and on 2 gloo ranks):
one remaps its tables together (:class:`embedtrain.sharding.dynamic.ShardedDynamicCollection`,
the default), the other table by table (``set_fused_remap(model, False)``: TorchRec's loop over
each table's :class:`~embedtrain.tables.dynamic.ManagedTable`). They train on the same batches;
after every step the remapped rows, the loss, every remapper buffer (ids, rows, the policies'
counters, the statistics, the step), the embedding rows and their optimizer state must be
identical, bit for bit: through tables that fill up and evict (LRU, LFU, TTL), admission every
step, every 3 steps and on each table's own interval, multi-hot features with empty bags, a
table of two features, ids that two tables share and ids whose top bits tie, an evaluation and
a settle (a checkpoint's admission). The fused path merges new ids into a table's sorted ids later (they wait in its
tail, in the free rows TorchRec gives them): the held ids are compared in id order, and after
the settle byte for byte.
"""

from __future__ import annotations

import pytest
import torch

from embedtrain.models.options import DynamicTable, Eviction
from conftest import run_ranks

DIM, LOCAL, STEPS = 4, 24, 14
BIG = 2**62
# (feature, capacity, eviction, interval, ttl, pool of raw ids, max ids per example)
TABLES = [
    ("a", 40, Eviction.LRU, 1, 0, 90, 1),     # fills, then evicts every step
    ("b", 300, Eviction.LFU, 1, 0, 200, 3),   # multi-hot, room for every id
    ("c", 25, Eviction.TTL, 1, 3, 60, 2),     # TTL: expiry while it has room
    ("d", 60, Eviction.LRU, 3, 0, 150, 1),    # admission every 3 steps
    ("e", 12, Eviction.LFU, 1, 0, 40, 2),     # LFU, full
    ("f", 900, Eviction.LRU, 1, 0, 600, 1),   # room for all
    ("g", 30, Eviction.LRU, 1, 0, 64, 2),     # ids whose mixed values share their top bits
    ("h", 400, Eviction.TTL, 1, 2, 300, 1),   # TTL with room: ids expire as the pool drifts
    ("i", 80, Eviction.LFU, 3, 0, 150, 2),    # every 3 steps, with d: d's ids (one history)
    ("j", 70, Eviction.LRU, 1, 0, 120, 2),    # one table, two features (j1, j2)
]
SHARED = {"j": ["j1", "j2"]}  # a table's features (else the feature is the table's name)


def _pool(i: int) -> torch.Tensor:
    """Table ``i``'s raw ids: random (some shared with another table), or (table g) ids whose
    mixed values are runs of neighbours (the fused search's key holds only an id's top bits:
    these tie on it), some next to the empty-row marker 2^63 - 1."""
    from embedtrain.tables.dynamic import unmix_ids

    feature, size = TABLES[i][0], TABLES[i][5]
    if feature in ("b", "i"):  # the same raw ids as another table (a, d), and more
        same = _pool(0 if feature == "b" else 3)
        more = torch.randint(0, BIG, (size - same.numel(),),
                             generator=torch.Generator().manual_seed(i))
        return torch.cat([same, more])
    if feature != "g":
        return torch.randint(0, BIG, (size,), generator=torch.Generator().manual_seed(i))
    mixed = torch.cat([2**61 + 12345 * 64 + torch.arange(20), 3 * 2**61 + torch.arange(0, 40, 2),
                       2**62 - 10 + torch.arange(10), 2**63 - 2 - torch.arange(14)])
    return unmix_ids(mixed[torch.randperm(size, generator=torch.Generator().manual_seed(i))])


def _batch(step: int, world: int, rank: int):
    """Step ``step``'s ids per feature (this rank's examples), drifting over the pools."""
    g = torch.Generator().manual_seed(1000 + step)
    values, lengths = [], []
    for i, (feature, _, _, _, _, pool, hot) in enumerate(TABLES):
        ids = _pool(i)
        for _ in SHARED.get(feature, [feature]):
            n = torch.randint(0 if hot > 1 else 1, hot + 1, (LOCAL * 2,), generator=g)
            lo = min(step * pool // (2 * STEPS), pool - 10)
            picks = ids[torch.randint(lo, pool, (int(n.sum()),), generator=g)]
            share = slice(rank * 2 * LOCAL // world, (rank + 1) * 2 * LOCAL // world)
            ends = torch.cumsum(n, 0)
            first = int(ends[share.start - 1]) if share.start else 0
            values.append(picks[first:int(ends[share.stop - 1])])
            lengths.append(n[share])
    static = torch.randint(0, 10, (2 * LOCAL // world,), generator=g)
    return values, lengths, static


def _schedule(interval: int, schedule: str) -> int:
    """A table's admission interval: its own (``mixed``), or every table's the same."""
    return {"mixed": interval, "each step": 1, "every 3": 3}[schedule]


def _build(world: int, fused: bool, schedule: str, layout: str = "one dim"):
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from embedtrain.tables.dynamic import embedding_bags
    from embedtrain.sharding.dynamic import set_fused_remap
    from embedtrain.sharding.planner import plan_sharding
    from embedtrain.sharding.sharders import embedding_sharders
    from embedtrain.sharding.types import ClusterConfig, DeviceKind

    # "two dims": tables of 4 and 8 columns and Adagrad's per-element state, whose rows the
    # reset writes table by table (else all tables' rows in one write per storage)
    dims = [DIM * (1 + (i % 2 if layout == "two dims" else 0)) for i in range(len(TABLES))]
    configs = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=dim, num_embeddings=cap,
                                  feature_names=SHARED.get(f, [f]))
               for (f, cap, *_), dim in zip(TABLES, dims)]
    configs.append(EmbeddingBagConfig(name="t_s", embedding_dim=DIM, num_embeddings=10,
                                      feature_names=["s"]))
    dynamic = {f"t_{f}": DynamicTable(cap, ev, _schedule(interval, schedule),
                                      max(ttl, _schedule(interval, schedule)) if ttl else 0)
               for f, cap, ev, interval, ttl, *_ in TABLES}
    torch.manual_seed(0)
    model = embedding_bags(configs, dynamic, torch.device("meta"))
    optimizer = torch.optim.Adagrad if layout == "two dims" else RowWiseAdagrad
    apply_optimizer_in_backward(optimizer, model.parameters(), {"lr": 0.1})
    plan = plan_sharding(model, ClusterConfig(hosts=1, devices_per_host=world,
                                              device=DeviceKind.CPU, batch_size_per_rank=LOCAL))
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan.sharding_plan,
                                   sharders=embedding_sharders(),
                                   env=ShardingEnv.from_process_group(
                                       torch.distributed.GroupMember.WORLD))
    set_fused_remap(dmp, fused)
    with torch.no_grad():  # the same start for both copies
        for key, value in dmp.state_dict().items():
            if key.endswith(".weight"):
                for shard in value.local_shards():
                    g = torch.Generator().manual_seed(hash(key) % 2**31)
                    shard.tensor.copy_(torch.rand(shard.tensor.shape, generator=g) - 0.5)
    return dmp


_BY_POSITION = ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_last_access_iter",
                "_mch_counts")


def _state(dmp, layout: bool = False) -> dict[str, torch.Tensor]:
    """Every remapper buffer but TorchRec's id history (the fused path keeps its own), and
    every table's rows and optimizer state, of this rank. The held ids (and their rows and
    counters) in id order, unless ``layout``: the fused path merges new ids into the sorted
    ones later (the free rows after them, which decide where an id goes, are the same)."""
    from embedtrain.tables.dynamic import EMPTY_ID, managed_tables
    from embedtrain.sharding.dynamic import ShardedDynamicTables

    out = {}
    for name, table in managed_tables(dmp):
        ids = table._mch_sorted_raw_ids
        held = int((ids != EMPTY_ID).sum())
        order = torch.cat([torch.argsort(ids[:held]), torch.arange(held, ids.numel())])
        for b, value in table.named_buffers():
            if not b.startswith("_history"):
                keyed = b in _BY_POSITION and not layout
                out[f"{name}.{b}"] = (value[order] if keyed else value).clone()
        out[f"{name}.iter"] = torch.tensor([table._current_iter, table._last_eviction_iter])
    sharded = next(m for m in dmp.modules() if isinstance(m, ShardedDynamicTables))
    for table, (tbe, index) in sharded._table_to_tbe_and_index.items():
        i = int(index)
        out[f"{table}.weight"] = tbe.split_embedding_weights()[i].clone()
        for j, state in enumerate(tbe.split_optimizer_states()[i]):
            out[f"{table}.state{j}"] = state.clone()
    return out


def _run(rank: int, world: int, schedule: str, layout: str = "one dim") -> dict:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embedtrain.sharding.dynamic import ShardedDynamicCollection, settle_dynamic_tables

    models = {fused: _build(world, fused, schedule, layout) for fused in (True, False)}
    remapped = {True: [], False: []}
    for fused, dmp in models.items():
        mcc = next(m for m in dmp.modules() if isinstance(m, ShardedDynamicCollection))
        assert (mcc.fused_tables is not None) and mcc.fused is fused
        compute = mcc.compute

        def capture(ctx, dist_input, compute=compute, out=remapped[fused]):
            result = compute(ctx, dist_input)
            out.append(torch.cat([k.values() for k in result]).clone())
            return result
        mcc.compute = capture
    keys = [name for f, *_ in TABLES for name in SHARED.get(f, [f])] + ["s"]
    fused_tables = next(m for m in models[True].modules()
                        if isinstance(m, ShardedDynamicCollection)).fused_tables
    checked, admitted, tails = 0, 0, 0
    for step in range(STEPS):
        values, lengths, static = _batch(step, world, rank)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys, torch.cat([*values, static]),
            torch.cat([*lengths, torch.ones_like(static)]).int())
        evaluate = step == 7
        losses = {}
        for fused, dmp in models.items():
            dmp.train(not evaluate)
            with torch.set_grad_enabled(not evaluate):
                pooled = dmp(kjt).values()
                loss = (torch.sin(pooled * 3) * (torch.arange(pooled.shape[1]) + 1)).sum()
                if not evaluate:
                    loss.backward()
            losses[fused] = float(loss)
            if step == 10:
                settle_dynamic_tables(dmp)
        assert torch.equal(remapped[True][-1], remapped[False][-1]), f"step {step}: rows"
        assert losses[True] == losses[False], f"step {step}: loss"
        # after a settle (as before a checkpoint) the buffers are the same bytes, layout too
        a, b = _state(models[True], step == 10), _state(models[False], step == 10)
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"step {step}: {key}"
        checked += len(a)
        tails = max(tails, fused_tables._index[0].numel() - 1)
        admitted = sum(int(v.sum()) for k, v in a.items() if k.endswith("_stat_admissions"))
    return {"checked": checked, "admitted": admitted, "tails": tails,
            "occupied": {k: int((v != 2**63 - 1).sum()) for k, v in a.items()
                         if k.endswith("_mch_sorted_raw_ids")}}


@pytest.mark.parametrize("schedule", ["mixed", "each step", "every 3"])
@pytest.mark.parametrize("world", [1, 2])
def test_fused_remap_equals_the_per_table_path_step_by_step(world, schedule):
    """Admission every step (this step's ids alone), every 3 steps (several steps' ids at
    once) and each table on its own interval (some tables' history kept while others admit)."""
    results = run_ranks(_run, world, schedule)
    for r in results:
        assert r["checked"] > 0
        assert r["tails"] > 0  # new ids waited in tails (merged later)
    # the tables filled up and evicted: more admissions than rows held
    total = sum(r["admitted"] for r in results)
    held = sum(n for r in results for n in r["occupied"].values())
    assert total > held


def test_fused_row_reset_of_tables_of_two_dims_and_per_element_state():
    """The reset of rows that do not share one layout (two dimensions, Adagrad's state per
    element) goes table by table, with the same vectors."""
    (r,) = run_ranks(_run, 1, "mixed", "two dims")
    assert r["checked"] > 0 and r["tails"] > 0


def _switch(rank: int, world: int) -> dict:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embedtrain.sharding.dynamic import set_fused_remap, settle_dynamic_tables

    dmp = _build(world, True, "every 3")
    values, lengths, static = _batch(0, world, rank)
    keys = [name for f, *_ in TABLES for name in SHARED.get(f, [f])] + ["s"]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys, torch.cat([*values, static]), torch.cat([*lengths, torch.ones_like(static)]).int())
    dmp(kjt).values().sum().backward()
    try:
        set_fused_remap(dmp, False)  # step 1 of 3: its ids wait for their admission
        refused = ""
    except ValueError as e:
        refused = str(e)
    settle_dynamic_tables(dmp)
    set_fused_remap(dmp, False)  # after the settle: nothing waits
    dmp(kjt).values().sum().backward()  # the per-table path takes over
    return {"refused": refused}


def test_the_remap_path_switches_only_when_no_ids_wait():
    (r,) = run_ranks(_switch, 1)
    assert "ids wait for admission" in r["refused"]


def _one_rank_dist(rank: int, world: int) -> dict:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embedtrain.sharding.dynamic import ShardedDynamicCollection, _OneRankDist

    dmp = _build(world, True, "mixed")
    mcc = next(m for m in dmp.modules() if isinstance(m, ShardedDynamicCollection))
    keys = [name for f, *_ in TABLES for name in SHARED.get(f, [f])]
    values, lengths, static = _batch(0, world, rank)
    dmp(KeyedJaggedTensor.from_lengths_sync(  # the input dists are made on the first batch
        keys + ["s"], torch.cat([*values, static]),
        torch.cat([*lengths, torch.ones_like(static)]).int()))
    (dist,) = mcc._input_dists
    assert isinstance(dist, _OneRankDist)
    compared = 0
    for step in range(3):
        values, lengths, _ = _batch(step, world, rank)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys, torch.cat(values),
                                                  torch.cat(lengths).int())
        short, full = dist(kjt).wait().wait(), dist._rw(kjt).wait().wait()
        assert short.keys() == full.keys()
        assert torch.equal(short.values(), full.values()), f"step {step}: values"
        assert torch.equal(short.lengths(), full.lengths()), f"step {step}: lengths"
        compared += short.values().numel()
    return {"compared": compared}


def test_one_rank_input_dist_without_bucketize_equals_torchrecs():
    """In a world of one the row-wise input distribution skips FBGEMM's block bucketize (one
    bucket: the identity); its output is TorchRec's, id for id."""
    (r,) = run_ranks(_one_rank_dist, 1)
    assert r["compared"] > 0
