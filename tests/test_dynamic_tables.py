"""Dynamic tables: collision-free remapping, eviction policies, the default row, sharding,
checkpoints and the planner's count of the remapping state.

The remapper (:class:`embedtrain.tables.dynamic.ManagedTable`, TorchRec's MCH) is checked
against a plain-Python reference of what each policy must keep; the sharded tables through
``DistributedModelParallel`` on 1 and 2 gloo ranks; a run through the CLI for resume and
reshard-to-one-rank evaluation.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from embedtrain.config import ConfigError, dynamic_tables, load_config
from embedtrain.tables.dynamic import EMPTY_ID, ManagedTable, managed_table, mix_ids, unmix_ids
from embedtrain.models.options import DynamicTable, Eviction
from conftest import run_ranks
from embedtrain.processes import spawn

ROOT = Path(__file__).resolve().parent.parent
BIG = 2**62  # raw ids from all over the 63-bit range


def _table(capacity: int, eviction: Eviction = Eviction.LRU, interval: int = 1,
           ttl: int = 0) -> ManagedTable:
    return managed_table("t", DynamicTable(capacity, eviction, interval, ttl))


def _step(table: ManagedTable, ids, train: bool = True) -> list[int]:
    """One lookup of ``ids`` (training: profile, admit, remap), the rows they got."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    table.train(train)
    values = torch.tensor(ids, dtype=torch.int64)
    out = table({"t": JaggedTensor(values=values, lengths=torch.ones(len(ids), dtype=torch.int32),
                                   weights=torch.tensor([len(ids)]))})
    return out["t"].values().tolist()


def test_mix_is_a_bijection_of_the_63_bit_range():
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.randint(0, 2**63 - 1, (100_000,), generator=g),
                     torch.tensor([0, 1, 2, 2**32, 2**62, 2**63 - 2, EMPTY_ID])])
    mixed = mix_ids(ids)
    assert bool((mixed >= 0).all()) and not bool((mixed == EMPTY_ID).any())
    assert torch.equal(unmix_ids(mixed), ids)
    assert torch.unique(mixed).numel() == ids.numel()
    # consecutive small ids spread evenly over the row-wise shards' blocks of the id range
    small = mix_ids(torch.arange(80_000))
    for shards in (2, 8):
        block = -(-(2**63 - 1) // shards)
        counts = torch.bincount(small // block, minlength=shards).float()
        assert float(counts.max() / counts.mean()) < 1.05


def test_distinct_ids_get_distinct_rows_below_capacity():
    capacity = 1001  # 1000 rows for ids, the last is the default row
    table = _table(capacity)
    g = torch.Generator().manual_seed(1)
    pool = torch.randint(0, BIG, (1000,), generator=g).unique().tolist()
    assert len(pool) == 1000
    seen: dict[int, int] = {}
    for step in range(12):
        batch = [pool[int(i)] for i in torch.randint(0, len(pool), (300,), generator=g)]
        if step == 11:
            batch = pool  # the table exactly full
        for raw, row in zip(batch, _step(table, batch)):
            assert row != capacity - 1, "an id below capacity got the default row"
            assert seen.setdefault(raw, row) == row, "an id changed rows without eviction"
    assert len(set(seen.values())) == len(seen) == 1000  # distinct ids, distinct rows
    counts = table.counters().tolist()
    assert counts[:3] == [capacity, 1000, 1000]  # rows, occupied, admitted: nothing evicted
    assert counts[4] == 0  # no default-row lookups


def test_lru_gives_up_the_least_recently_used_id():
    table = _table(5)  # 4 rows for ids
    rows = dict(zip([1, 2, 3, 4], _step(table, [1, 2, 3, 4])))
    _step(table, [1, 2, 3])  # 4 is now the least recently used
    (row9,) = _step(table, [9])
    assert row9 == rows[4]
    assert _step(table, [1, 2, 3]) == [rows[1], rows[2], rows[3]]
    assert _step(table, [4], train=False) == [4]  # evicted: the default row (row 4)
    occupied, admitted = table.counters().tolist()[1:3]
    assert (occupied, admitted) == (4, 5)  # one eviction


def test_lfu_admits_a_new_id_only_when_it_outcounts_the_rarest():
    table = _table(5, Eviction.LFU)
    batch = [1, 1, 1, 2, 2, 3, 4]
    rows = dict(zip(batch, _step(table, batch)))
    assert _step(table, [9]) == [4]  # one sighting does not beat 3's or 4's one: default row
    (row9, *_rest) = _step(table, [9, 9, 9])
    assert row9 in (rows[3], rows[4])  # it took the row of one of the rarest ids
    assert _step(table, [1, 2], train=False) == [rows[1], rows[2]]  # the frequent ones stay


def test_ttl_frees_rows_of_ids_not_looked_up_even_when_nothing_waits():
    table = _table(10, Eviction.TTL, ttl=2)
    _step(table, [1, 2, 3])
    for _ in range(3):
        _step(table, [3])
    assert table.counters().tolist()[1] == 1  # 1 and 2 expired: only 3 holds a row
    assert _step(table, [1, 2], train=False) == [9, 9]  # the default row
    lru = _table(10)
    _step(lru, [1, 2, 3])
    for _ in range(3):
        _step(lru, [3])
    assert lru.counters().tolist()[1] == 3  # LRU frees nothing while there is room


def test_unseen_ids_hit_the_default_row_and_evaluation_admits_nothing():
    table = _table(8)
    rows = _step(table, [10, 20, 30])
    state = {k: v.clone() for k, v in table.state_dict().items()}
    assert _step(table, [10, 77, 88, 30], train=False) == [rows[0], 7, 7, rows[2]]
    assert _step(table, [77], train=False) == [7]  # still unseen: evaluation did not admit it
    assert all(torch.equal(v, table.state_dict()[k]) for k, v in state.items())
    assert table._eval_counts.tolist() == [5, 3]
    table.train()
    table.eval()  # a new evaluation starts its own counts
    assert table._eval_counts.tolist() == [0, 0]


def test_new_ids_wait_for_the_admission_interval():
    table = _table(8, interval=3)
    assert _step(table, [5]) == [7]  # seen, not admitted yet: the default row
    assert _step(table, [6]) == [7]
    first, second = _step(table, [5, 6])  # the third step admits what the interval saw
    assert 7 not in (first, second) and first != second


def test_a_later_larger_batch_is_admitted_whole():
    """TorchRec sizes MCH's id history from the first batch and drops what does not fit;
    a row-wise shard sees a different number of ids every step."""
    table = _table(101)
    _step(table, [1, 2])
    batch = list(range(100, 150))
    assert 100 not in _step(table, batch)  # 100: the default row of a 101-row table


def test_config_tables_match_by_name_and_glob(tmp_path):
    cfg = load_config(ROOT / "configs/dlrm_synthetic.yaml", [
        "tables=[{tables: ['t_C*'], capacity: 100}, {tables: [t_C2], kind: static},"
        " {tables: [t_C3], capacity: 50, eviction: ttl, ttl_steps: 9}]"])
    got = dynamic_tables(cfg, ["t_C1", "t_C2", "t_C3", "t_I"])
    assert got == {"t_C1": DynamicTable(100), "t_C3": DynamicTable(50, Eviction.TTL, 1, 9)}
    for overrides, message in [
        (["tables=[{tables: [t_X], capacity: 10}]"], "tables[0].tables: 't_X' matches no table"),
        (["tables=[{tables: [t_C1]}]"], "tables[0].capacity: a dynamic table needs"),
        (["tables=[{tables: [t_C1], capacity: 9, eviction: ttl}]"], "tables[0].ttl_steps"),
        (["tables=[{tables: [t_C1], capacity: 9, eviction: ttl, ttl_steps: 2,"
          " eviction_interval: 3}]"], "tables[0].ttl_steps: 2 is shorter than the"),
        (["tables=[{tables: [t_C1], capacity: 9}]", "train.pipeline=sparse_dist"],
         "train.pipeline: dynamic tables run in the plain loop only"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            dynamic_tables(load_config(ROOT / "configs/dlrm_synthetic.yaml", overrides),
                           ["t_C1", "t_C2"])


def test_every_shard_needs_a_row_besides_its_default_row():
    from embedtrain.config import check_world_size

    cfg = load_config(ROOT / "configs/dlrm_synthetic.yaml",
                      ["tables=[{tables: ['t_*'], capacity: 9}]", "data.batch_size=2048"])
    check_world_size(cfg, 2)  # 5 + 4 rows
    with pytest.raises(ConfigError, match=r"tables\[0\].capacity: 9 rows over 4 ranks leave a "
                                          r"shard of 0 row\(s\)"):
        check_world_size(cfg, 4)  # blocks of 3: 3, 3, 3 and 0


def test_a_raw_feature_needs_a_dynamic_table():
    from embedtrain.features import FeatureSpec, SparseFeature
    from embedtrain.models.dlrm import dcn, dlrm

    spec = FeatureSpec("y", ("d",), (SparseFeature("u", 1234, raw=True),))
    with pytest.raises(ValueError, match=r"feature u holds raw ids .* tables: \[\{tables: "
                                         r"\[t_u\], kind: dynamic, capacity: N\}\]"):
        dlrm(spec, 4, [4], [4, 1], device=torch.device("meta"))
    for build in (dlrm, dcn):
        model = build(spec, 4, [4], [4, 1], device=torch.device("meta"),
                      dynamic={"t_u": DynamicTable(64)})
        tables = model.sparse_arch.embedding_bag_collection
        assert [c.num_embeddings for c in tables.embedding_bag_configs()] == [64]


# -- sharded, on 1 and 2 gloo ranks --------------------------------------------------------------

DIM, CAPACITY, STATIC_ROWS, STEPS, LOCAL = 4, 64, 10, 3, 8


def _batches(world: int, rank: int):
    """STEPS global batches of 2 x LOCAL examples (a dynamic feature of raw ids, new ones every
    step, and a static one), and this rank's share of each."""
    g = torch.Generator().manual_seed(7)
    pool = torch.randint(0, BIG, (40,), generator=g)
    out = []
    for step in range(STEPS):
        dyn = pool[torch.randint(0, 12 + 10 * step, (2 * LOCAL,), generator=g)]
        static = torch.randint(0, STATIC_ROWS, (2 * LOCAL,), generator=g)
        w = torch.randn(2 * LOCAL, 2 * DIM, generator=g)
        share = slice(rank * 2 * LOCAL // world, (rank + 1) * 2 * LOCAL // world)
        out.append((dyn[share], static[share], w[share]))
    return out, pool


def _sharded_run(rank: int, world: int) -> dict:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embedtrain.tables.dynamic import embedding_bags, managed_tables
    from embedtrain.sharding.planner import plan_sharding
    from embedtrain.sharding.sharders import embedding_sharders
    from embedtrain.sharding.types import ClusterConfig, DeviceKind

    configs = [EmbeddingBagConfig(name="t_dyn", embedding_dim=DIM, num_embeddings=CAPACITY,
                                  feature_names=["dyn"]),
               EmbeddingBagConfig(name="t_static", embedding_dim=DIM, num_embeddings=STATIC_ROWS,
                                  feature_names=["static"])]
    model = embedding_bags(configs, {"t_dyn": DynamicTable(CAPACITY)}, torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.5})
    cluster = ClusterConfig(hosts=1, devices_per_host=world, device=DeviceKind.CPU,
                            batch_size_per_rank=LOCAL)
    plan = plan_sharding(model, cluster)
    group = torch.distributed.GroupMember.WORLD
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan.sharding_plan,
                                   sharders=embedding_sharders(),
                                   env=ShardingEnv.from_process_group(group))
    base = torch.arange(1, DIM + 1, dtype=torch.float32) / 10
    with torch.no_grad():  # every row alike: where an id lands cannot matter
        for key, value in dmp.state_dict().items():
            if key.endswith(".weight"):
                for shard in value.local_shards():
                    shard.tensor.copy_(base.expand_as(shard.tensor))
    batches, pool = _batches(world, rank)
    losses = []
    for dyn, static, w in batches:
        kjt = KeyedJaggedTensor.from_lengths_sync(
            ["dyn", "static"], torch.cat([dyn, static]), torch.ones(2 * len(dyn), dtype=torch.int32))
        pooled = dmp(kjt).values()
        loss = (torch.tanh(pooled) * w).sum()
        # TorchRec divides the sharded tables' gradients by the world size: scale the one-rank
        # loss alike, so both take the same step
        (loss / (2 / world)).backward()
        losses.append(float(loss))
    (name, remapper), = managed_tables(dmp)
    ids, rows = remapper.id_map()
    weights = {k: v.local_shards()[0] for k, v in dmp.state_dict().items()
               if k.endswith("t_dyn.weight")}
    (shard,) = weights.values()
    offset = shard.metadata.shard_offsets[0]
    vectors = shard.tensor[rows - offset]
    per_row = sum(b.element_size() for n, b in remapper.named_buffers()
                  if n not in remapper._non_persistent_buffers_set and b.dim() == 1
                  and b.shape[0] == remapper.output_size() and n != "_output_segments_tensor")
    static_w = next(v for k, v in dmp.state_dict().items() if k.endswith("t_static.weight"))
    return {"losses": losses, "ids": ids, "vectors": vectors.clone(),
            "counters": remapper.counters(), "remap_bytes": per_row * remapper.output_size(),
            "planned_remap": plan.report.ranks[rank].memory[plan.report.memory_tier].parts[
                "embedding_remap"],
            "table_remap": plan.report.tables[0].remap_bytes,
            "static": static_w.local_shards()[0].tensor.clone() if static_w.local_shards()
            else None}


@pytest.mark.slow
def test_two_ranks_equal_one_and_the_plan_counts_the_remapping_state():
    one, = spawn(_sharded_run, 1)
    two = spawn(_sharded_run, 2)
    # the same global loss each step, and after the steps the same vector for every id
    for step in range(STEPS):
        assert sum(r["losses"][step] for r in two) == pytest.approx(one["losses"][step],
                                                                     rel=1e-5)
    got = {int(i): v for r in two for i, v in zip(r["ids"], r["vectors"])}
    want = {int(i): v for i, v in zip(one["ids"], one["vectors"])}
    assert got.keys() == want.keys() and len(want) > 20
    for i, v in want.items():
        torch.testing.assert_close(got[i], v, rtol=1e-5, atol=1e-6)
    # nothing evicted, no default row below capacity; ids split over both shards
    assert all(int(r["counters"][4]) == 0 for r in two) and int(one["counters"][4]) == 0
    assert all(int(r["counters"][2]) == int(r["counters"][1]) for r in [one, *two])
    assert all(int(r["counters"][1]) > 0 for r in two)
    # the planner's remapping state per rank is what each rank holds (36 bytes a row)
    for r in [one, *two]:
        assert r["planned_remap"] == r["remap_bytes"]
    assert one["table_remap"] == CAPACITY * 36
    assert sum(r["planned_remap"] for r in two) == CAPACITY * 36


def _evicting_run(rank: int, world: int) -> dict:
    """One rank, capacity 4 (3 rows for ids): an id evicted, its row and optimizer state reset."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embedtrain.tables.dynamic import embedding_bags, managed_tables
    from embedtrain.sharding.planner import plan_sharding
    from embedtrain.sharding.sharders import embedding_sharders
    from embedtrain.sharding.types import ClusterConfig, DeviceKind

    configs = [EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=4,
                                  feature_names=["f"])]
    model = embedding_bags(configs, {"t": DynamicTable(4)}, torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, model.parameters(), {"lr": 0.1})
    plan = plan_sharding(model, ClusterConfig(hosts=1, devices_per_host=1,
                                              device=DeviceKind.CPU, batch_size_per_rank=3))
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan.sharding_plan,
                                   sharders=embedding_sharders(), env=ShardingEnv.from_process_group(
                                       torch.distributed.GroupMember.WORLD))
    (_, remapper), = managed_tables(dmp)
    from embedtrain.sharding.dynamic import ShardedDynamicTables

    sharded = next(m for m in dmp.modules() if isinstance(m, ShardedDynamicTables))
    tbe = sharded._table_to_tbe_and_index["t"][0]

    def step(ids, weight):
        kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor(ids),
                                                  torch.ones(len(ids), dtype=torch.int32))
        (dmp(kjt).values() * torch.tensor(weight)[:, None]).sum().backward()

    step([11, 12, 13], [1.0, 1.0, 1.0])
    step([12, 13], [1.0, 1.0])  # 11 is the least recently used
    ids, rows = remapper.id_map()
    row11 = int(rows[ids.tolist().index(11)])
    before = tbe.split_embedding_weights()[0][row11].clone()
    momentum_before = float(tbe.split_optimizer_states()[0][0][row11])
    step([14], [0.0])  # 14 takes 11's row; no gradient reaches it
    ids, rows = remapper.id_map()
    # what 14's first vector must be: the hash of (table, 14), as on any number of ranks
    expected = remapper.initial_vectors(torch.tensor([row11]), DIM, -configs[0].get_weight_init_max(),
                                        configs[0].get_weight_init_max())[0]
    return {"ids": ids.tolist(), "row14": int(rows[ids.tolist().index(14)]), "row11": row11,
            "expected": expected,
            "before": before, "after": tbe.split_embedding_weights()[0][row11].clone(),
            "momentum_before": momentum_before,
            "momentum_after": float(tbe.split_optimizer_states()[0][0][row11]),
            "bound": configs[0].get_weight_init_max()}


@pytest.mark.slow
def test_an_evicted_row_is_reset_on_cpu():
    r, = run_ranks(_evicting_run, 1)
    assert r["ids"] == [12, 13, 14] and r["row14"] == r["row11"]
    assert r["momentum_before"] > 0 and r["momentum_after"] == 0  # optimizer state reset
    assert not torch.equal(r["before"], r["after"])  # fresh weights, from the initial range
    assert float(r["after"].abs().max()) <= r["bound"]
    assert torch.equal(r["after"], r["expected"])  # 14's own first vector


# -- through the CLI: raw ids in, resume, and a 2-rank checkpoint on 1 rank ---------------------


@pytest.fixture(scope="module")
def drift(tmp_path_factory):
    from embedtrain.datagen.drift import DriftDataSpec, generate_ctr_drift

    root = tmp_path_factory.mktemp("dynamic")
    generate_ctr_drift(DriftDataSpec(rows=6000, periods=10, lifetime=3, new_ids_per_period=40,
                                     sparse_features=3, rows_per_row_group=500),
                       root / "data", progress=False)
    config = root / "dynamic.yaml"
    config.write_text(f"""
data: {{path: {root / 'data'}, batch_size: 256, eval_batch_size: 1024, shuffle: false}}
model: {{embedding_dim: 8, bottom_mlp: [16, 8], top_mlp: [16, 1]}}
train: {{epochs: 2, eval_every: 8, checkpoint_every: 4, keep_checkpoints: 20, progress: false}}
tables:
  - {{tables: ["t_*"], capacity: 120, eviction: lru}}
  - {{tables: [t_C3], capacity: 40, eviction: ttl, ttl_steps: 6, eviction_interval: 3}}
""")
    return root, config


@pytest.mark.slow
def test_raw_ids_train_resume_bit_identical_and_a_two_rank_checkpoint_evaluates_on_one(
        drift, tmp_path):
    from conftest import run_cli
    from test_distributed import embedtrain
    from test_train_cli import _assert_equal, _params

    _, config = drift
    full = tmp_path / "full"
    r = run_cli("train", str(config), "--out", str(full))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "t_C1: dynamic" in r.stdout and "evicted" in r.stdout
    summary = json.loads((full / "summary.json").read_text())
    stats = summary["tables"]
    assert sorted(stats) == ["t_C1", "t_C2", "t_C3"]
    for name, t in stats.items():
        assert t["capacity"] == (40 if name == "t_C3" else 120) and t["default_rows"] == 1
        assert t["evictions"] == t["ids_admitted"] - t["occupied"] > 0  # the ids overflow
        assert 0 < t["eval_default_row_share"] < 1  # the test split brings unseen ids
    assert stats["t_C3"]["default_row_share"] > 0  # 40 rows cannot hold a batch's ids
    records = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert all("tables" in rec for rec in records)
    plan = json.loads((full / "plan.json").read_text())
    assert {t["name"]: t["remap_bytes"] for t in plan["tables"]} == {
        "t_C1": 120 * 36, "t_C2": 120 * 36, "t_C3": 40 * 36}

    # killed after step 18, its last checkpoint at 16 (between t_C3's admissions every 3 steps:
    # the checkpoint admits what is pending), then resumed: bit for bit the same run
    part = tmp_path / "part"
    r = run_cli("train", str(config), "--out", str(part), "--set", "train.max_steps=18")
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.rmtree(part / "checkpoints" / "step_00000018")
    r = run_cli("train", str(config), "--out", str(part), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    last = sorted((full / "checkpoints").glob("step_*"))[-1].name
    a = _params(full / "checkpoints" / last, tmp_path)
    b = _params(part / "checkpoints" / last, tmp_path)
    assert any("_mch_sorted_raw_ids" in k for k in a["model"])
    _assert_equal(a, b)  # weights, remapping state, counters, optimizer state
    resumed = json.loads((part / "summary.json").read_text())
    assert resumed["auc"] == summary["auc"] and resumed["tables"] == stats

    # two ranks; their checkpoint, resharded onto one rank, evaluates to the same test metrics
    two = tmp_path / "two"
    r = embedtrain("train", str(config), "--out", str(two), "--nproc", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    s2 = json.loads((two / "summary.json").read_text())
    assert s2["tables"]["t_C1"]["default_rows"] == 2  # one per shard
    r = run_cli("eval", str(two), "--split", "test")
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert result["auc"] == pytest.approx(s2["auc"], abs=1e-6)
    assert math.isfinite(result["loss"]) and result["loss"] == pytest.approx(s2["loss"], rel=1e-5)


def test_a_checkpoint_loads_only_onto_shards_that_merge_its_own():
    """A shard holds the ids of one block of the id range: a 1-shard checkpoint cannot be split
    onto 2 shards (TorchRec's check would only assert), 2 shards merge onto 1."""
    one = _table(120)
    _step(one, list(range(1, 50)))
    half = one.rebuild_with_output_id_range((0, 60), [0, 60, 120])
    state = {k: (v[:60] if v.dim() and v.shape[0] == 120 else v)
             for k, v in one.state_dict().items()}
    with pytest.raises(ValueError, match="a checkpoint of 1 row-wise shard.s. loads onto 2 "
                                         "only where each of these shards holds whole shards"):
        half.load_state_dict(state)
    # the other way: 2 shards' state, concatenated as DCP gives it, onto one shard
    lo = one.rebuild_with_output_id_range((0, 60), [0, 60, 120])
    hi = one.rebuild_with_output_id_range((60, 120), [0, 60, 120])
    batch = [int(i) for i in torch.randint(0, BIG, (40,), generator=torch.Generator().manual_seed(3))]
    mixed = mix_ids(torch.tensor(batch))
    mine = [lo if int(m) < -(-EMPTY_ID // 2) else hi for m in mixed]
    for b, t in zip(batch, mine):
        _step(t, [b])
    merged = _table(120)
    merged.load_state_dict({k: (torch.cat([v, hi.state_dict()[k]]) if v.dim() and v.shape[0] == 60
                                else v) for k, v in lo.state_dict().items()})
    rows = _step(merged, batch + [123456789], train=False)
    want = [_step(t, [b], train=False)[0] for b, t in zip(batch, mine)]
    assert rows[:-1] == want  # every id keeps its row
    unseen = mix_ids(torch.tensor([123456789]))
    assert rows[-1] == (59 if int(unseen) < -(-EMPTY_ID // 2) else 119)  # its old shard's default
    assert merged._output_segments_tensor[:2].tolist() == [0, 120]  # saves its own layout now


def test_merged_shards_free_their_old_default_rows_for_training():
    """2 LFU shards merged onto 1: the first shard's default row (protected by a count of
    int64 max) becomes a free row like any other, and its lookups count as default lookups."""
    lo = _table(8, Eviction.LFU).rebuild_with_output_id_range((0, 4), [0, 4, 8])
    hi = _table(8, Eviction.LFU).rebuild_with_output_id_range((4, 8), [0, 4, 8])
    g = torch.Generator().manual_seed(11)
    block = -(-EMPTY_ID // 2)
    pool = torch.randint(0, BIG, (200,), generator=g)
    lows = [int(i) for i in pool if int(mix_ids(torch.tensor([int(i)]))) < block][:4]
    highs = [int(i) for i in pool if int(mix_ids(torch.tensor([int(i)]))) >= block][:4]
    _step(lo, lows[:3])  # shard 0 full (3 rows for ids)
    _step(lo, [lows[3]])  # no room, a count of 1 does not win: shard 0's default row (3)
    _step(hi, highs[:2])
    merged = _table(8, Eviction.LFU)
    merged.load_state_dict({k: (torch.cat([v, hi.state_dict()[k]]) if v.dim() and v.shape[0] == 4
                                else v) for k, v in lo.state_dict().items()})
    counts = merged.counters().tolist()
    assert counts[1] == 5 and counts[4] == 1  # 5 ids held; shard 0's default lookup kept
    assert int(merged.open_slots()) == 2  # rows 3 (shard 0's default) and one of shard 1's
    _step(merged, [lows[3], highs[2]])
    held = merged.id_map()[0].tolist()
    assert len(held) == 7 and lows[3] in held and highs[2] in held  # every row used again


@pytest.mark.parametrize("eviction", [Eviction.LRU, Eviction.LFU])
def test_admissions_are_torchrecs_mch_choices(eviction):
    """The remapper's shortcuts (free rows taken without ranking the table, the kept ids found
    by a threshold instead of a sort, the sorted list merged instead of re-sorted) keep exactly
    the ids TorchRec's own MCH module keeps, step by step, through filling and eviction."""
    from torchrec.modules.mc_modules import (
        LFU_EvictionPolicy,
        LRU_EvictionPolicy,
        MCHManagedCollisionModule,
    )
    from torchrec.sparse.jagged_tensor import JaggedTensor

    capacity, batch = 61, 24
    ours = _table(capacity, eviction)
    policy = LFU_EvictionPolicy() if eviction is Eviction.LFU else LRU_EvictionPolicy()
    stock = MCHManagedCollisionModule(zch_size=capacity, device=torch.device("cpu"),
                                      eviction_policy=policy, eviction_interval=1,
                                      input_hash_func=mix_ids)
    g = torch.Generator().manual_seed(5)
    pool = torch.randint(0, BIG, (150,), generator=g)
    for step in range(40):
        # hot ids early, a drifting window later: the table fills, then evicts
        hi = 40 if step < 10 else min(150, 40 + 4 * step)
        ids = pool[torch.randint(max(0, hi - 60), hi, (batch,), generator=g)]
        rows = _step(ours, ids.tolist())
        jt = JaggedTensor(values=ids, lengths=torch.ones(batch, dtype=torch.int32),
                          weights=torch.tensor([batch]))
        stock.train()
        theirs = stock({"t": jt})["t"].values().tolist()
        assert [r == capacity - 1 for r in rows] == [r == capacity - 1 for r in theirs], step
        held = ours.id_map()[0]
        kept = stock._mch_sorted_raw_ids[stock._mch_sorted_raw_ids != EMPTY_ID]
        assert torch.equal(held, torch.sort(unmix_ids(kept)).values), step
    assert int(ours.counters()[2]) > capacity  # evictions happened


@pytest.mark.slow
@pytest.mark.parametrize("family", ["xc", "gnn_node"])
def test_xc_token_tables_and_the_gnn_node_table_can_be_dynamic(family, tmp_path):
    """The other families build their tables through the same code: a dynamic XC token table
    and GNN node-id table train, are planned row-wise with their remapping state, and report."""
    from embedtrain.recipes import build_run
    from embedtrain.testing import tiny_graph_dataset, tiny_xc_dataset

    if family == "xc":
        data = tiny_xc_dataset(tmp_path / "data", rows=3000, classes=100)
        config, table, capacity = "configs/xc_synthetic.yaml", "t_tokens", 500
    else:
        data = tiny_graph_dataset(tmp_path / "data", nodes=1500)
        config, table, capacity = "configs/gnn_node.yaml", "t_node", 300
    extra = ["gnn.embedding_dim=16"] if family == "gnn_node" else []  # shipped without a table
    cfg = load_config(ROOT / config, [*extra,
        f"data.path={data}", "data.batch_size=256", "data.eval_batch_size=512",
        "data.num_workers=0", "train.max_steps=6", "train.eval_every=3",
        "train.checkpoint_every=0", "train.progress=false",
        f"tables=[{{tables: [{table}], capacity: {capacity}}}]"])
    run = build_run(cfg, tmp_path / "run")
    summary = run.trainer.fit(test_data=run.test_data)
    stats = summary["tables"][table]
    assert stats["capacity"] == capacity and stats["ids_admitted"] > 0
    assert stats["lookups"] > 0 and 0 <= stats["eval_default_row_share"] <= 1
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    (entry,) = [t for t in plan["tables"] if t["name"] == table]
    assert entry["sharding_type"] == "row_wise" and entry["remap_bytes"] == capacity * 36
