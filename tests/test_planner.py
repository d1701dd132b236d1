"""The sharding planner on ``meta``, with no GPU: exact estimates, constraints, failures, CLI."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torchrec import EmbeddingBagCollection
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.perf_models import NoopPerfModel

from embedtrain.cli import main
from embedtrain.config import load_cluster
from embedtrain.sharding.cluster import topology
from embedtrain.sharding.enumerator import CompactEnumerator
from embedtrain.sharding.planner import PlanError, plan_sharding, table_constraints
from embedtrain.sharding.report import render_markdown
from embedtrain.sharding.report_types import PlanReport
from embedtrain.sharding.types import (
    ClusterConfig,
    CommPrecision,
    ComputeKernel,
    DeviceKind,
    MemoryTier,
    PlannerOptions,
    ShardingType,
    TableConstraint,
)
from embedtrain.testing import random_embedding_tables, tiny_ctr_dataset

ROOT = Path(__file__).parent.parent
CLUSTERS = sorted((ROOT / "configs" / "clusters").glob("*.yaml"))
MULTI_HOST = ClusterConfig(name="test-2x4", hosts=2, devices_per_host=4, hbm_gb=16)
CPU2 = ClusterConfig(name="test-cpu", hosts=1, devices_per_host=2, device=DeviceKind.CPU, ddr_gb=4)


pytestmark = pytest.mark.usefixtures("quiet_torchrec")


def model(n=6, seed=0, log10_rows=(3, 6), dims=(16, 32, 64)):
    tables = random_embedding_tables(n, seed=seed, log10_rows=log10_rows, dims=dims)
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.stem)
def test_shipped_clusters_load(path):
    cluster = load_cluster(path)
    assert cluster.name == path.stem
    assert topology(cluster).world_size == cluster.world_size


def test_cluster_typo_names_key(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("hosts: 2\ndevices_per_hosts: 8\n")
    with pytest.raises(ValueError, match=r"c.yaml: devices_per_hosts: unknown key \(did you mean"):
        load_cluster(bad)
    for text, message in [("hosts: 0", "hosts: must be positive, got 0"),
                          ("inter_host_gb_per_s: -1", "inter_host_gb_per_s: must be positive"),
                          ("reserved_fraction: 1.0", "reserved_fraction: must be in [0, 1), got")]:
        bad.write_text(f"device: cpu\nddr_gb: 4\n{text}\n")
        with pytest.raises(ValueError) as err:
            load_cluster(bad)
        assert str(err.value).startswith(f"{bad}: {message}")


def test_a_cluster_file_names_its_device_and_memory(tmp_path):
    """``name: x`` alone would plan for an 80 GB GPU: refused unless the defaults are asked for."""
    bad = tmp_path / "c.yaml"
    bad.write_text("name: x\n")
    with pytest.raises(ValueError) as err:
        load_cluster(bad)
    assert str(err.value) == (
        f"{bad}: device and hbm_gb: not given; a cluster file names its device kind and memory "
        "per device (e.g. device: cuda, hbm_gb: 80), or says defaults: true to plan for cuda "
        "with 80 GB (hbm_gb)")
    bad.write_text("name: x\ndevice: cpu\n")
    with pytest.raises(ValueError, match=r"c.yaml: ddr_gb: not given"):
        load_cluster(bad)
    assert load_cluster(bad, ["ddr_gb=4"]).ddr_gb == 4  # named through --set
    bad.write_text("name: x\ndefaults: true\n")
    assert load_cluster(bad).hbm_gb == 80


def test_compact_estimates_equal_stock_enumerator():
    """Every shard of every option: the same perf and storage as TorchRec's enumerator."""
    m = model(5, seed=1)
    topo = topology(MULTI_HOST)
    sharders = [EmbeddingBagCollectionSharder()]
    everything = table_constraints([f"t{i}" for i in range(5)],
                                   PlannerOptions(sharding_types=list(ShardingType)))
    ours = CompactEnumerator(topo, 512, everything, offload_tables=[f"t{i}" for i in range(5)])
    compact = ours.enumerate(m, sharders)
    stock = {(o.fqn, o.sharding_type, o.compute_kernel): o
             for o in EmbeddingEnumerator(topology=topo, batch_size=512,
                                          constraints=everything).enumerate(m, sharders)}
    # the one difference: a column_wise option of one block (the whole table) is left out,
    # table_wise being the same placement said as what it is
    kept = {(o.fqn, o.sharding_type, o.compute_kernel) for o in compact}
    skipped = [o for k, o in stock.items() if k not in kept]
    assert all(o.sharding_type == "column_wise" and len(o.shards) == 1 for o in skipped)
    assert len(compact) + len(skipped) == len(stock) and skipped
    assert ours.num_estimated_shards < sum(len(o.shards) for o in stock.values())
    for option in compact:
        full = ours.expand(option)
        ref = stock[(option.fqn, option.sharding_type, option.compute_kernel)]
        assert [(s.size, s.offset) for s in full.shards] == [(s.size, s.offset) for s in ref.shards]
        assert [s.perf for s in full.shards] == [s.perf for s in ref.shards]
        assert [s.storage for s in full.shards] == [s.storage for s in ref.shards]


@pytest.mark.parametrize("seed", [0, 1])
def test_plan_as_fast_as_stock_planner(seed):
    """The search finds a plan whose slowest rank is no slower than TorchRec's default planner's."""
    m = model(8, seed=seed, log10_rows=(3, 7), dims=(32, 64, 128, 256))
    topo = topology(MULTI_HOST)
    stock = EmbeddingShardingPlanner(topology=topo, batch_size=512)
    stock.plan(m, [EmbeddingBagCollectionSharder()])
    stock_rating = NoopPerfModel(topo).rate(stock._best_plan)
    ours = plan_sharding(m, MULTI_HOST).report.summary.embedding_max_rank_ms
    assert ours <= stock_rating * 1.0001


def test_multi_host_plan_on_meta_is_complete():
    m = model(8)
    result = plan_sharding(m, MULTI_HOST)
    world = MULTI_HOST.world_size
    names = {f"t{i}" for i in range(8)}
    module_plan = result.sharding_plan.plan["" if "" in result.sharding_plan.plan else next(iter(result.sharding_plan.plan))]
    assert set(module_plan) == names
    report = result.report
    assert {t.name for t in report.tables} == names
    for t in report.tables:
        rows = sum(s.size[0] for s in t.shards) if t.sharding_type in ("row_wise", "table_row_wise") else t.rows
        assert rows == t.rows
        assert all(0 <= s.rank < world for s in t.shards)
        if t.sharding_type == "row_wise":
            assert sorted(s.rank for s in t.shards) == list(range(world))
        if t.sharding_type == "table_row_wise":
            assert len({s.rank // 4 for s in t.shards}) == 1  # one host
    ranks = report.ranks
    assert len(ranks) == world and [r.host for r in ranks] == [r // 4 for r in range(world)]
    # Per-rank weights add up to the tables' weights (data-parallel ones count on every rank).
    weights = sum(r.memory[MemoryTier.HBM].get("embedding_params") for r in ranks)
    expected = sum(t.weight_bytes * (world if t.sharding_type == "data_parallel" else 1)
                   for t in report.tables)
    assert weights == expected
    slowest = max(r.time_ms.embedding_total for r in ranks)
    assert report.summary.embedding_max_rank_ms == pytest.approx(slowest)
    assert report.table("t3").name == "t3"
    with pytest.raises(KeyError, match="no table 'nope'"):
        report.table("nope")


def test_report_schema_is_stable():
    typed = plan_sharding(model(3), MULTI_HOST).report
    report = typed.to_dict()
    assert json.loads(json.dumps(report)) == report
    assert PlanReport.from_dict(json.loads(json.dumps(report))) == typed
    # plan.json's keys, in order (users script against it).
    assert list(report) == ["schema_version", "cluster", "sharding", "summary", "warnings",
                            "planner", "tables", "ranks"]
    assert list(report["cluster"]) == [
        "name", "hosts", "devices_per_host", "device", "hbm_gb", "ddr_gb",
        "hbm_bandwidth_gb_per_s", "ddr_bandwidth_gb_per_s", "intra_host_gb_per_s",
        "inter_host_gb_per_s", "batch_size_per_rank", "reserved_fraction", "sharding_group_ms",
        "reduce_scatter_gb_per_s", "all_gather_gb_per_s", "world_size"]
    assert list(report["sharding"]) == [
        "sharding_types", "compute_kernels", "tables", "forward_comm_precision",
        "backward_comm_precision", "pooling_factors_from_data", "dense_allreduce",
        "powersgd_rank", "search_budget", "tiny_table_bytes"]
    assert list(report["summary"]) == [
        "tables", "embedding_weight_bytes", "embedding_optimizer_bytes", "dense_parameter_bytes",
        "dense_allreduce_bytes",
        "embedding_max_rank_ms", "embedding_mean_rank_ms", "imbalance", "slowest_rank",
        "peak_memory_rank", "dense_allreduce_ms",
        "step_estimate_ms", "memory_tier", "peak_rank_memory_bytes", "rank_memory_capacity_bytes",
        "sharding_types"]
    assert list(report["planner"]) == [
        "seconds", "search_seconds", "options", "estimated_shards", "proposals", "partitions",
        "pruned_by_bound", "improving_moves", "best_seed", "seed_ratings_ms"]
    assert list(report["tables"][0]) == [
        "name", "rows", "dim", "pooling_factor", "sharding_type", "compute_kernel", "ranks",
        "weight_bytes", "optimizer_bytes", "perf_ms_all_shards", "slowest_shard_ms", "shards",
        "remap_bytes"]
    assert list(report["tables"][0]["shards"][0]) == ["rank", "offset", "size", "hbm_bytes",
                                                      "ddr_bytes", "perf_ms"]
    rank = report["ranks"][0]
    assert list(rank) == ["rank", "host", "memory", "time_ms"]
    assert list(rank["memory"]) == ["hbm", "ddr"]
    assert list(rank["memory"]["hbm"]) == [
        "embedding_params", "embedding_optimizer", "embedding_remap", "io_and_cache", "dense_model",
        "dense_gradients", "dense_optimizer", "kjt_buffers", "reserved", "total", "capacity"]
    assert list(rank["memory"]["ddr"]) == [
        "embedding_params", "embedding_optimizer", "embedding_remap", "io_and_cache", "total",
        "capacity"]
    assert list(rank["time_ms"]) == ["fwd_compute", "fwd_comms", "bwd_compute", "bwd_comms",
                                     "prefetch", "embedding_total", "dense_allreduce", "total",
                                     "sharding_groups"]


def test_planner_options_mirror_the_config_section():
    """plan.json's ``sharding`` is the options' fields: the config's section has the same ones."""
    import dataclasses

    from embedtrain.config import ShardingConfig
    from embedtrain.config_io import to_dict

    names = [f.name for f in dataclasses.fields(PlannerOptions)]
    assert [f.name for f in dataclasses.fields(ShardingConfig)] == names
    assert to_dict(ShardingConfig()) == to_dict(PlannerOptions())


def test_optimizer_state_is_counted():
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    plain = plan_sharding(model(3), MULTI_HOST).report
    m = model(3)
    apply_optimizer_in_backward(torch.optim.Adam, m.parameters(), {"lr": 0.1})
    adam = plan_sharding(m, MULTI_HOST).report
    m = model(3)
    apply_optimizer_in_backward(RowWiseAdagrad, m.parameters(), {"lr": 0.1})
    rowwise = plan_sharding(m, MULTI_HOST).report
    weights = plain.summary.embedding_weight_bytes
    assert plain.summary.embedding_optimizer_bytes == 0
    assert adam.summary.embedding_optimizer_bytes == 2 * weights
    # Row-wise Adagrad keeps one value per row.
    rows = sum(t.rows * 4 for t in rowwise.tables)
    assert rowwise.summary.embedding_optimizer_bytes == pytest.approx(rows, rel=0.01)


def test_impossible_model_says_by_how_much_and_which_tables():
    huge = EmbeddingBagCollection(
        tables=random_embedding_tables(3, log10_rows=(8.5, 9), dims=(256,)),
        device=torch.device("meta"))
    with pytest.raises(PlanError) as err:
        plan_sharding(huge, MULTI_HOST)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("does not fit:") and "short by" in msg and "HBM" in msg
    biggest = max(huge.embedding_bag_configs(), key=lambda c: c.num_embeddings * c.embedding_dim)
    assert f"largest tables: {biggest.name} (" in msg


def test_constraints_are_honoured():
    sharding = PlannerOptions(
        sharding_types=[ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE],
        tables=[TableConstraint(tables=["t0", "t1"], sharding_types=[ShardingType.ROW_WISE]),
                TableConstraint(tables=["t2"], compute_kernels=[ComputeKernel.FUSED_UVM_CACHING],
                                cache_load_factor=0.3, pooling_factor=7.5)])
    report = plan_sharding(model(5), MULTI_HOST, sharding).report
    by = {t.name: t for t in report.tables}
    assert by["t0"].sharding_type == by["t1"].sharding_type == "row_wise"
    assert by["t2"].compute_kernel == "fused_uvm_caching"
    assert by["t2"].pooling_factor == 7.5
    assert {by[n].sharding_type for n in ("t2", "t3", "t4")} <= {"table_wise", "column_wise"}


def test_inconsistent_constraints_are_named():
    sharding = PlannerOptions(tables=[TableConstraint(
        tables=["t1"], sharding_types=[ShardingType.DATA_PARALLEL],
        compute_kernels=[ComputeKernel.FUSED])])
    with pytest.raises(PlanError, match=r"table t1: compute kernel\(s\) fused cannot do sharding "
                                        r"type\(s\) data_parallel on cuda \(data_parallel takes dense\)"):
        plan_sharding(model(3), MULTI_HOST, sharding)
    typo = PlannerOptions(tables=[TableConstraint(tables=["t_C*"])])
    with pytest.raises(PlanError, match=r"sharding.tables\[0\].tables: 't_C\*' matches no table"):
        plan_sharding(model(3), MULTI_HOST, typo)


@pytest.mark.parametrize("kind", [ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE])
def test_row_wise_offered_on_cpu(kind):
    """TorchRec's stock sharders refuse row-wise on cpu; embedtrain's plan it."""
    sharding = PlannerOptions(sharding_types=[kind])
    report = plan_sharding(model(3), CPU2, sharding).report
    assert {t.sharding_type for t in report.tables} == {kind.value}
    assert report.summary.memory_tier is MemoryTier.DDR
    assert report.ranks[0].memory[MemoryTier.DDR].get("embedding_params") > 0
    assert report.ranks[0].memory[MemoryTier.HBM].total == 0
    assert report.to_dict()["summary"]["memory_tier"] == "ddr"
    assert report.to_dict()["cluster"]["hbm_gb"] == 0.0


def test_qcomms_halve_the_estimated_all_to_all():
    fixed = dict(sharding_types=[ShardingType.TABLE_WISE])
    fp32 = plan_sharding(model(4), MULTI_HOST, PlannerOptions(**fixed)).report
    fp16 = plan_sharding(model(4), MULTI_HOST, PlannerOptions(
        **fixed, forward_comm_precision=CommPrecision.FP16,
        backward_comm_precision=CommPrecision.BF16)).report

    def comms(r):
        return sum(x.time_ms.fwd_comms + x.time_ms.bwd_comms for x in r.ranks)

    assert comms(fp16) < 0.75 * comms(fp32)
    assert fp16.to_dict()["sharding"]["forward_comm_precision"] == "fp16"


def test_cli_plan_writes_reports(tmp_path, capsys):
    out = tmp_path / "plan"
    rc = main(["plan", str(ROOT / "configs/dlrm.yaml"),
               "--cluster", str(ROOT / "configs/clusters/h100-16x8.yaml"), "--out", str(out)])
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == ["plan.html", "plan.json", "plan.md"]
    report = json.loads((out / "plan.json").read_text())
    assert report["cluster"]["world_size"] == 128 and report["summary"]["tables"] == 26
    printed = capsys.readouterr().out
    assert "slowest rank" in printed and "plan.html" in printed


def test_cli_plan_failure_is_one_line(tmp_path, capsys):
    small = tmp_path / "tiny.yaml"
    small.write_text("name: tiny\nhosts: 1\ndevices_per_host: 2\ndevice: cuda\nhbm_gb: 8\nddr_gb: 1\n")
    rc = main(["plan", str(ROOT / "configs/dlrm.yaml"), "--cluster", str(small),
               "--out", str(tmp_path / "p"), "--format", "json"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert "does not fit" in err and "t_C20" in err and "short by" in err
    rc = main(["plan", str(ROOT / "configs/dlrm.yaml"), "--cluster", str(small), "--format", "pdf"])
    assert rc == 2 and "--format: unknown pdf" in capsys.readouterr().err


def test_pooling_factors_measured_from_data(tmp_path):
    from embedtrain.config import Config, DataConfig
    from embedtrain.recipes import plan_model

    data = tiny_ctr_dataset(tmp_path / "data", rows=3000)
    cfg = Config(data=DataConfig(path=str(data)))
    report = plan_model(cfg, CPU2).report
    by = {t.name: t.pooling_factor for t in report.tables}
    assert by["t_C1"] == 1.0
    assert 1.5 < by["t_C24"] < 3.5  # lists of 0..5 ids
    assert report.model["pooling_factors"].startswith("measured")


def test_data_parallel_only_where_listed():
    """Replicating a table changes its optimizer (TorchRec steps it with the dense one)."""
    tiny = model(4, log10_rows=(1, 2))  # tables of 10-100 rows: cheap to replicate
    default = plan_sharding(tiny, CPU2).report
    assert "data_parallel" not in {t.sharding_type for t in default.tables}
    listed = PlannerOptions(tables=[TableConstraint(tables=["t1"],
                                                    sharding_types=[ShardingType.DATA_PARALLEL])])
    by = {t.name: t for t in plan_sharding(tiny, CPU2, listed).report.tables}
    assert by["t1"].sharding_type == "data_parallel" and by["t1"].ranks == [0, 1]
    assert by["t0"].sharding_type != "data_parallel"


def test_tiny_tables_are_placed_whole_and_single_blocks_are_table_wise():
    """A 3-row table is not spread over 8 ranks (unless its sharding types say so); a table of
    one column block is reported table_wise, not column_wise."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    tables = [EmbeddingBagConfig(name="tiny", embedding_dim=16, num_embeddings=3,
                                 feature_names=["a"]),
              EmbeddingBagConfig(name="big", embedding_dim=64, num_embeddings=4_000_000,
                                 feature_names=["b"])]
    m = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    cluster = ClusterConfig(name="a-1x8", hosts=1, devices_per_host=8, hbm_gb=80)
    plan = {t.name: t for t in plan_sharding(m, cluster).report.tables}
    assert plan["tiny"].sharding_type == "table_wise" and len(plan["tiny"].ranks) == 1
    forced = PlannerOptions(tables=[TableConstraint(tables=["tiny"],
                                                    sharding_types=[ShardingType.ROW_WISE])])
    spread = {t.name: t for t in plan_sharding(m, cluster, forced).report.tables}
    assert spread["tiny"].sharding_type == "row_wise"
    for t in plan_sharding(m, cluster, PlannerOptions(tiny_table_bytes=0)).report.tables:
        assert not (t.sharding_type == "column_wise" and len(t.shards) == 1), t.name
    # column_wise asked for by name, on a table of one block: planned so, and said so
    one_block = PlannerOptions(tables=[TableConstraint(tables=["tiny"],
                                                       sharding_types=[ShardingType.COLUMN_WISE])])
    report = plan_sharding(m, cluster, one_block).report
    assert report.table("tiny").sharding_type == "column_wise"
    assert "column_wise (1 block: the whole table)" in render_markdown(report)


def test_uneven_embedding_memory_is_a_warning():
    """One table holding most of the memory on one rank: the plan says so."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    tables = [EmbeddingBagConfig(name="huge", embedding_dim=128, num_embeddings=30_000_000,
                                 feature_names=["a"])] + [
        EmbeddingBagConfig(name=f"s{i}", embedding_dim=128, num_embeddings=100_000,
                           feature_names=[f"b{i}"]) for i in range(3)]
    m = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    cluster = ClusterConfig(name="a-1x4", hosts=1, devices_per_host=4, hbm_gb=80)
    report = plan_sharding(m, cluster, PlannerOptions(sharding_types=[ShardingType.TABLE_WISE])
                           ).report
    assert any(w.startswith("memory is uneven: rank") for w in report.warnings), report.warnings
    # the same tables row-wise: even memory, no such warning
    even = plan_sharding(m, cluster, PlannerOptions(sharding_types=[ShardingType.ROW_WISE])).report
    assert not any("uneven" in w for w in even.warnings), even.warnings


def test_uneven_time_is_a_warning():
    """One table looked up 200 times per example, placed whole: its rank is the bottleneck."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=1_000_000,
                                 feature_names=[f"f{i}"]) for i in range(4)]
    m = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    cluster = ClusterConfig(name="a-1x4", hosts=1, devices_per_host=4, hbm_gb=80)
    whole = PlannerOptions(sharding_types=[ShardingType.TABLE_WISE])
    hot = plan_sharding(m, cluster, whole, pooling_factors={"t0": 200.0}).report
    assert hot.summary.imbalance > 1.5
    assert any(w.startswith(f"rank {hot.summary.slowest_rank} is the bottleneck")
               for w in hot.warnings), hot.warnings
    flat = plan_sharding(m, cluster, whole).report
    assert flat.summary.imbalance < 1.5 and not any("bottleneck" in w for w in flat.warnings)


def test_plan_sweep_over_clusters_and_host_counts(tmp_path, capsys):
    """``embedtrain plan CONFIG --cluster A --cluster B --hosts 1,2``: every candidate planned,
    the smallest that fits named (exit 0); none fitting: exit 1."""
    from embedtrain.cli import main

    root = Path(__file__).resolve().parent.parent
    config, a100, cpu = (str(root / p) for p in (
        "configs/dlrm.yaml", "configs/clusters/a100-1x8.yaml", "configs/clusters/cpu-1x2.yaml"))
    assert main(["plan", config, "--cluster", a100, "--cluster", cpu, "--hosts", "1,2",
                 "--out", str(tmp_path / "s")]) == 0
    sweep = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert [c["cluster"] for c in sweep["candidates"]] == [
        "a100-1x8@1x8", "a100-1x8@2x8", "cpu-1x2@1x2", "cpu-1x2@2x2"]
    assert [c["fits"] for c in sweep["candidates"]] == [True, True, False, False]
    assert sweep["smallest_that_fits"] == "a100-1x8@1x8"
    assert "does not fit" in sweep["candidates"][2]["why"]
    assert "<- smallest that fits" in capsys.readouterr().out
    assert 'class="best"' in (tmp_path / "s" / "sweep.html").read_text()
    assert main(["plan", config, "--cluster", cpu, "--hosts", "1", "--out",
                 str(tmp_path / "n")]) == 1
    assert main(["plan", config, "--cluster", cpu, "--hosts", "0..2"]) == 2  # one-line usage error
    capsys.readouterr()
    assert main(["plan", config, "--cluster", cpu, "--hosts", "4..2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--hosts 4..2: A..B needs A <= B" in err[0], err
    # sizes that would exhaust memory are refused before any topology is built, in one line
    import time

    start = time.perf_counter()
    assert main(["plan", config, "--cluster", cpu, "--hosts", "1..100000"]) == 2
    assert main(["plan", config, "--cluster", a100, "--hosts", "4096"]) == 2  # 32,768 ranks
    huge = tmp_path / "huge.yaml"
    huge.write_text(Path(a100).read_text().replace("hosts: 1\n", "hosts: 1000000\n"))
    assert main(["plan", config, "--cluster", str(huge)]) == 2
    assert time.perf_counter() - start < 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "at most 256 host counts" in err[0] and "32,768 ranks" in err[1]
    # a range is sized, not listed: 10**18 host counts are refused, not enumerated
    assert main(["plan", config, "--cluster", cpu, "--hosts", f"1..{10**18}"]) == 2
    assert f"got {10**18:,} up to" in capsys.readouterr().err
    assert "8,000,000 ranks: more than embedtrain plans for" in err[2], err
    # a constraint error is the config's (one line, exit 2), not "does not fit" on every row
    assert main(["plan", config, "--cluster", a100, "--hosts", "1", "--set",
                 "sharding.tables=[{tables: [nope], sharding_types: [row_wise]}]"]) == 2


def test_fixed_cost_per_sharding_type_is_charged_and_avoided():
    """``sharding_group_ms``: every rank pays it once per sharding type the plan uses, and a
    large one makes the planner use a single type."""
    import dataclasses

    m = model(8, seed=1, log10_rows=(2, 7), dims=(32, 64, 128, 256))  # tiny ones: table_wise
    free = plan_sharding(m, MULTI_HOST).report
    assert len({t.sharding_type for t in free.tables}) > 1  # mixed when types cost nothing
    costly = dataclasses.replace(MULTI_HOST, sharding_group_ms=50.0)
    report = plan_sharding(m, costly).report
    types = {t.sharding_type for t in report.tables}
    assert len(types) == 1, types
    assert all(r.time_ms.sharding_groups == 50.0 for r in report.ranks)
    slowest = max(r.time_ms.embedding_total for r in report.ranks)
    assert report.summary.embedding_max_rank_ms == pytest.approx(slowest)
    assert slowest == pytest.approx(50.0 + max(
        r.time_ms.fwd_compute + r.time_ms.fwd_comms + r.time_ms.bwd_compute
        + r.time_ms.bwd_comms + r.time_ms.prefetch for r in report.ranks))


def test_reduce_scatter_and_all_gather_rates_change_row_wise_only():
    import dataclasses

    m = model(4, seed=2)
    rw, tw = (PlannerOptions(sharding_types=[t]) for t in (ShardingType.ROW_WISE,
                                                           ShardingType.TABLE_WISE))
    host = ClusterConfig(name="test-1x4", hosts=1, devices_per_host=4, hbm_gb=16)
    slow = dataclasses.replace(host, reduce_scatter_gb_per_s=0.5, all_gather_gb_per_s=0.5)
    base_rw, slow_rw = (plan_sharding(m, c, rw).report for c in (host, slow))
    assert slow_rw.summary.embedding_max_rank_ms > 2 * base_rw.summary.embedding_max_rank_ms
    base_tw, slow_tw = (plan_sharding(m, c, tw).report for c in (host, slow))
    assert slow_tw.summary.embedding_max_rank_ms == base_tw.summary.embedding_max_rank_ms


def test_plan_calibrate_usage_errors(capsys):
    cpu = str(ROOT / "configs/clusters/cpu-1x2.yaml")
    gpu = str(ROOT / "configs/clusters/a100-1x8.yaml")
    assert main(["plan", "--calibrate", "--cluster", cpu, "--cluster", gpu]) == 2
    assert main(["plan", "configs/dlrm.yaml", "--calibrate", "--cluster", cpu]) == 2
    assert main(["plan", "--cluster", cpu]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all("Traceback" not in e for e in err), err


@pytest.mark.slow
def test_plan_calibrate_writes_a_loadable_cluster_file(tmp_path):
    """``embedtrain plan --calibrate``: measured on this machine, written to --out (the
    shipped file untouched), loadable, every measured field positive."""
    src = ROOT / "configs/clusters/cpu-1x2.yaml"
    before = src.read_text()
    out = tmp_path / "cpu.yaml"
    assert main(["plan", "--calibrate", "--cluster", str(src), "--out", str(out)]) == 0
    assert src.read_text() == before
    cal = load_cluster(out)
    assert cal.name == "cpu-1x2" and cal.world_size == 2
    for field in ("ddr_bandwidth_gb_per_s", "intra_host_gb_per_s", "sharding_group_ms",
                  "reduce_scatter_gb_per_s", "all_gather_gb_per_s"):
        assert 0 < getattr(cal, field) < 1e4, field
    assert out.read_text().startswith(before.splitlines()[0])  # its comments kept


def test_reduce_scatter_rate_is_a_within_host_rate():
    """Measured between one host's ranks: a plan over 2 hosts charges the inter-host rate."""
    import dataclasses

    m = model(4, seed=2)
    rw = PlannerOptions(sharding_types=[ShardingType.ROW_WISE])
    slow = dataclasses.replace(MULTI_HOST, reduce_scatter_gb_per_s=0.5, all_gather_gb_per_s=0.5)
    assert (plan_sharding(m, slow, rw).report.summary.embedding_max_rank_ms
            == plan_sharding(m, MULTI_HOST, rw).report.summary.embedding_max_rank_ms)


def test_a_batch_too_large_to_buffer_names_the_batch_size():
    ebc = EmbeddingBagCollection(tables=random_embedding_tables(2, log10_rows=(3, 4), dims=(16,)),
                                 device=torch.device("meta"))
    with pytest.raises(PlanError) as err:
        plan_sharding(ebc, dataclasses.replace(CPU2, batch_size_per_rank=10**12))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("does not fit:")
    assert "the input buffers of 1,000,000,000,000 rows per rank take" in msg
    assert "data.batch_size" in msg and "batch_size_per_rank" in msg
