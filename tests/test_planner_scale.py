"""The planner's compact machinery against TorchRec's own: shard layouts and greedy placement."""

import copy
import random

import pytest
import torch
from torchrec import EmbeddingBagCollection
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.sharding_plan import calculate_shard_sizes_and_offsets

from embedtrain.sharding.cluster import topology
from embedtrain.sharding.enumerator import CompactEnumerator, shard_layout, shard_runs
from embedtrain.sharding.partition import CompactPartitioner, compact
from embedtrain.sharding.planner import table_constraints
from embedtrain.sharding.types import ClusterConfig, PlannerOptions, ShardingType
from embedtrain.testing import random_embedding_tables

TYPES = ["table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise",
         "data_parallel"]


pytestmark = pytest.mark.usefixtures("quiet_torchrec")


@pytest.mark.parametrize("sharding_type", TYPES)
def test_shard_runs_equal_torchrec_layout(sharding_type):
    rng = random.Random(0)
    shapes = [(1, 4), (3, 8), (5, 16), (7, 128), (8, 64), (1000, 96), (1023, 256)]
    shapes += [(rng.randint(1, 10**6), rng.choice([4, 12, 32, 100, 128])) for _ in range(40)]
    for rows, cols in shapes:
        for world, local in [(1, 1), (2, 2), (8, 4), (24, 8), (1024, 8)]:
            for cw in (None, 32):
                sizes, offsets = calculate_shard_sizes_and_offsets(
                    torch.empty(rows, cols, device="meta"), world, local, sharding_type, cw)
                runs = shard_runs(rows, cols, sharding_type, world, local, cw)
                assert shard_layout(runs, sharding_type) == list(zip(sizes, offsets)), (
                    rows, cols, world, local, cw)
                assert all(a[0] != b[0] for a, b in zip(runs, runs[1:]))  # adjacent runs differ


def _options(cluster, n, seed):
    tables = random_embedding_tables(n, seed=seed, log10_rows=(2, 6), dims=(16, 32, 64, 128))
    m = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    topo = topology(cluster)
    constraints = table_constraints([t.name for t in tables],
                                    PlannerOptions(sharding_types=[ShardingType(t)
                                                                   for t in TYPES]))
    enum = CompactEnumerator(topo, 512, constraints)
    by_table = {}
    for o in enum.enumerate(m, [EmbeddingBagCollectionSharder()]):
        by_table.setdefault(o.fqn, []).append(o)
    return topo, enum, list(by_table.values())


@pytest.mark.parametrize("seed,hbm_gb", [(0, 16.0), (1, 0.05), (2, 0.02), (3, 0.2)])
def test_compact_partitioner_places_as_torchrec(seed, hbm_gb):
    """Random proposals (every sharding type, tight and loose memory): the same rank for every
    shard as TorchRec's GreedyPerfPartitioner, and the same proposals fail."""
    cluster = ClusterConfig(name="t", hosts=3, devices_per_host=4, hbm_gb=hbm_gb)
    topo, enum, tables = _options(cluster, 14, seed)
    rng = random.Random(seed)
    ours, failures = CompactPartitioner(topo), 0
    for _ in range(25):
        choice = [rng.choice(t) for t in tables]
        placed = ours.partition([compact(o, enum.runs(o)) for o in choice])
        full = [copy.deepcopy(enum.expand(o)) for o in choice]
        try:
            GreedyPerfPartitioner().partition(proposal=full, storage_constraint=topo)
        except PlannerError:
            assert placed is None
            failures += 1
            continue
        assert placed is not None
        for option, ranks in zip(full, placed.ranks):
            assert [s.rank for s in option.shards] == ranks.tolist(), option.name
        per_rank = [0.0] * topo.world_size
        for option in full:
            for s in option.shards:
                per_rank[s.rank] += s.perf.total
        assert placed.rating == max(per_rank)  # to the last bit, as NoopPerfModel adds
    if hbm_gb <= 0.02:
        assert failures > 0  # the tight cases do exercise the failures
    if hbm_gb >= 16:
        assert failures == 0


def _odd_topology(rng):
    """1-5 hosts of 1-8 ranks, pods, cuda or cpu, every memory tier, uneven capacities."""
    from torchrec.distributed.planner.types import CustomTopologyData, Storage, Topology

    gib = 2**30
    hosts, lws = rng.choice([1, 2, 3, 4, 5]), rng.choice([1, 2, 3, 4, 8])
    pod = rng.choice([None, 2, 3])
    pod = pod if pod and pod <= hosts else None
    world = hosts * lws
    hbm = int(rng.choice([0.002, 0.01, 0.05, 1.0]) * gib)
    ddr = int(rng.choice([0.005, 0.05, 4.0]) * gib)
    ssd = int(rng.choice([0, 0.05 * gib, 10 * gib]))
    custom = None
    if rng.random() < 0.25:
        custom = CustomTopologyData(
            data={"hbm_cap": [int(hbm * rng.uniform(0.5, 1.5)) for _ in range(world)],
                  "ddr_cap": [int(ddr * rng.uniform(0.5, 1.5)) for _ in range(world)]},
            world_size=world)
    topo = Topology(world_size=world, local_world_size=lws, pod_size=pod,
                    compute_device=rng.choice(["cuda", "cuda", "cpu"]), hbm_cap=hbm, ddr_cap=ddr,
                    ssd_cap=ssd, custom_topology_data=custom)
    if rng.random() < 0.3:  # uneven capacity left, as after a reservation
        for d in topo.devices:
            d.storage = Storage(hbm=int(d.storage.hbm * rng.uniform(0.3, 1.0)),
                                ddr=int(d.storage.ddr * rng.uniform(0.3, 1.0)), ssd=d.storage.ssd)
    return topo, ssd


def test_compact_partitioner_on_odd_topologies():
    """Pods, hosts of 1-8 ranks, DDR/SSD tiers, uneven capacities, every kernel, repeated table
    shapes (ties): the same ranks and failures as TorchRec's, and the same rating to the bit."""
    from torchrec import EmbeddingBagConfig
    from torchrec.distributed.planner.perf_models import NoopPerfModel
    from torchrec.distributed.planner.types import ParameterConstraints

    from embedtrain.sharding.partition import supported

    placed_ok = failed = 0
    for seed in range(24):
        rng = random.Random(seed)
        topo, ssd = _odd_topology(rng)
        shapes, tables = [], []
        for i in range(rng.randint(3, 30)):
            shape = (rng.choice(shapes) if shapes and rng.random() < 0.35 else
                     (int(10 ** rng.uniform(1, 6)), rng.choice([16, 32, 64, 128, 256])))
            shapes.append(shape)
            tables.append(EmbeddingBagConfig(name=f"t{i}", embedding_dim=shape[1],
                                             num_embeddings=shape[0], feature_names=[f"f{i}"]))
        m = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        kernels = ["fused", "fused_uvm_caching", "fused_uvm", "dense"] + (["key_value"] if ssd
                                                                          else [])
        cons = {t.name: ParameterConstraints(sharding_types=TYPES, compute_kernels=kernels)
                for t in tables}
        enum = CompactEnumerator(topo, rng.choice([64, 512]), cons,
                                 offload_tables=[t.name for t in tables])
        by_table = {}
        for o in enum.enumerate(m, [EmbeddingBagCollectionSharder()]):
            by_table.setdefault(o.fqn, []).append(o)
        part = CompactPartitioner(topo)
        for _ in range(12):
            choice = [rng.choice(t) for t in by_table.values()]
            if not all(supported(o) for o in choice):
                continue
            placed = part.partition([compact(o, enum.runs(o)) for o in choice])
            full = [copy.deepcopy(enum.expand(o)) for o in choice]
            try:
                GreedyPerfPartitioner().partition(proposal=full, storage_constraint=topo)
            except PlannerError:
                assert placed is None, seed
                failed += 1
                continue
            assert placed is not None, seed
            for option, ranks in zip(full, placed.ranks):
                assert [s.rank for s in option.shards] == ranks.tolist(), (seed, option.name)
            assert placed.rating == NoopPerfModel(topo).rate(full), seed
            placed_ok += 1
    assert placed_ok > 20 and failed > 20  # both outcomes are exercised
