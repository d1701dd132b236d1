"""Cluster calibration: measured bandwidths in the estimator's units, the fixed cost per sharding
group, a loadable YAML file."""

import dataclasses
import math

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from embedtrain.config import load_cluster
from embedtrain.sharding.calibrate import (
    GROUP_SHARDING_TYPES,
    HEADER,
    Calibration,
    CalibrationError,
    _spawn_ranks,
    calibrate,
)
from embedtrain.sharding.calibrate_file import cluster_yaml, measured_fields, write_cluster_yaml
from embedtrain.sharding.calibrate_measure import (
    GIB,
    TINY_BATCH,
    CommTiming,
    GroupTiming,
    LookupTiming,
    calibrated,
    estimator_lookup_bytes,
    group_cluster,
    group_timing,
    tiny_model,
)
from embedtrain.sharding.planner import plan_sharding
from embedtrain.sharding.types import ClusterConfig, DeviceKind, PlannerOptions, ShardingType

BANDWIDTHS = ("hbm_bandwidth_gb_per_s", "ddr_bandwidth_gb_per_s", "intra_host_gb_per_s",
              "inter_host_gb_per_s")
# what a calibration with several devices per host adds to a cluster file
NEW_FIELDS = ("sharding_group_ms", "reduce_scatter_gb_per_s", "all_gather_gb_per_s")

TEMPLATE = """\
# A test machine: two ranks.
name: test-1x2
hosts: 1
devices_per_host: 2
device: cpu
ddr_gb: 10                     # per rank
ddr_bandwidth_gb_per_s: 8
intra_host_gb_per_s: 4         # gloo over loopback
batch_size_per_rank: 64        # small
"""


def _cpu(devices: int = 1, **kw) -> ClusterConfig:
    return ClusterConfig(name="test", devices_per_host=devices, device=DeviceKind.CPU, ddr_gb=4,
                         ddr_bandwidth_gb_per_s=123.0, intra_host_gb_per_s=77.0,
                         batch_size_per_rank=64, **kw)


def _fake(cluster: ClusterConfig, comms: bool = True) -> Calibration:
    """A calibration with made-up figures (no measurement); ``comms=False``: one device per
    host (no collectives, no sharding groups measured)."""
    lookup = LookupTiming(table_rows=[10, 1000], embedding_dim=16, batch_size=128, pooling=1.0,
                          zipf_exponent=1.1, ranks=2, threads=1, forward_ms=0.1, backward_ms=0.4,
                          estimator_bytes=1e6, gb_per_s=1.86, tiny_call_ms=0.05)
    timing = CommTiming(ranks=2, message_bytes=16384, all_to_all_ms=0.2, gb_per_s=0.076,
                        latency_ms=0.1, row_wise_bytes=32768, reduce_scatter_ms=0.4,
                        all_gather_ms=0.3)
    groups = GroupTiming(ranks=2, tables=2, embedding_dim=16, batch_size=8,
                         measured_ms={"table_wise": 4.0, "row_wise": 4.6},
                         estimated_ms={"table_wise": 0.004, "row_wise": 0.006},
                         sharding_group_ms=4.3)
    return Calibration(cluster=cluster, lookup=lookup, comms=timing if comms else None,
                       groups=groups if comms else None, measured_at="2025-01-01T00:00:00Z",
                       machine="testhost, a CPU, 2 cores", software="torch x, fbgemm_gpu y",
                       steps=3)


def _load_text(tmp_path, text: str) -> ClusterConfig:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return load_cluster(path)


def _positive_finite(value: float) -> bool:
    return math.isfinite(value) and value > 0


def test_calibrate_one_device_measures_lookups_and_round_trips(tmp_path):
    base = _cpu()
    cal = calibrate(base, table_rows=[50, 500], steps=3, warmup=1)
    got = cal.cluster
    assert all(_positive_finite(getattr(got, k)) for k in BANDWIDTHS)
    assert got.ddr_bandwidth_gb_per_s != base.ddr_bandwidth_gb_per_s  # measured, not copied
    # one device per host: no collective or sharding group to time: those fields are the base's
    assert cal.comms is None and got.intra_host_gb_per_s == base.intra_host_gb_per_s
    assert cal.groups is None and all(getattr(got, k) == 0 for k in NEW_FIELDS)
    assert dataclasses.replace(got, ddr_bandwidth_gb_per_s=base.ddr_bandwidth_gb_per_s) == base
    lk = cal.lookup
    assert lk.batch_size == base.batch_size_per_rank * base.world_size
    assert lk.forward_ms > 0 and lk.backward_ms > 0 and lk.tiny_call_ms > 0
    # the bandwidth is what makes the estimator's bytes take the measured time
    assert lk.estimator_bytes == estimator_lookup_bytes([50, 500], 16, lk.batch_size, 1.0)
    assert got.ddr_bandwidth_gb_per_s == pytest.approx(
        lk.estimator_bytes / (lk.total_ms / 1000) / GIB, rel=5e-3)  # 3 significant digits
    path = tmp_path / "cal.yaml"
    write_cluster_yaml(cal, path)
    assert load_cluster(path) == got
    assert path.read_text().startswith(HEADER)


def test_estimator_lookup_bytes_is_what_the_planner_charges():
    """The calibrated GB/s mean what the planner expects: its table_wise compute time for these
    tables at bandwidth B is exactly estimator_lookup_bytes / B."""
    rows, batch, gb = [100, 3000, 70_000], 512, 3.0
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=n,
                                 feature_names=[f"f{i}"]) for i, n in enumerate(rows)]
    model = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    cluster = dataclasses.replace(_cpu(), ddr_bandwidth_gb_per_s=gb, batch_size_per_rank=batch)
    report = plan_sharding(model, cluster,
                           PlannerOptions(sharding_types=[ShardingType.TABLE_WISE])).report
    charged_ms = report.ranks[0].time_ms.fwd_compute + report.ranks[0].time_ms.bwd_compute
    assert charged_ms == pytest.approx(
        estimator_lookup_bytes(rows, 16, batch, 1.0) / (gb * GIB / 1000), rel=1e-9)


def test_cluster_yaml_keeps_template_comments_and_replaces_an_old_header(tmp_path):
    base = _load_text(tmp_path, TEMPLATE)
    cal = _fake(dataclasses.replace(base, ddr_bandwidth_gb_per_s=1.86, intra_host_gb_per_s=0.0763,
                                    sharding_group_ms=4.3, reduce_scatter_gb_per_s=0.0763,
                                    all_gather_gb_per_s=0.102))
    text = cluster_yaml(cal, TEMPLATE)
    lines = text.splitlines()
    assert lines[0] == "# A test machine: two ranks."  # the template's own header first
    assert lines[1].startswith(HEADER) and "2025-01-01T00:00:00Z" in lines[1]
    assert all(len(line) <= 100 for line in lines)
    assert "ddr_gb: 10                     # per rank" in lines  # untouched lines as they were
    assert any(line.startswith("intra_host_gb_per_s: 0.0763 ") and "gloo over loopback" in line
               for line in lines)
    # the fields the template lacks are added at its end, marked like the replaced ones
    assert [line.split(":")[0] for line in lines[-3:]] == list(NEW_FIELDS)
    assert all(line.endswith("# calibrated, see the header") for line in lines[-3:])
    header = " ".join(line.removeprefix("#").strip() for line in lines[1:]
                      if line.startswith((HEADER, "#   ")))
    assert all(f"{k} {getattr(cal.cluster, k):g}" in header for k in NEW_FIELDS)
    assert "table_wise 4.00, row_wise 4.59" in header  # per type: measured - estimated
    assert _load_text(tmp_path, text) == cal.cluster
    # calibrating the calibrated file again replaces the header instead of stacking another
    again = _fake(dataclasses.replace(cal.cluster, ddr_bandwidth_gb_per_s=2.5))
    twice = cluster_yaml(again, text)
    assert sum(line.startswith(HEADER) for line in twice.splitlines()) == 1
    assert len(twice.splitlines()) == len(lines)
    assert _load_text(tmp_path, twice).ddr_bandwidth_gb_per_s == 2.5


def test_cluster_yaml_without_measured_comms_leaves_intra_host_alone(tmp_path):
    base = _load_text(tmp_path, TEMPLATE)
    cal = _fake(dataclasses.replace(base, ddr_bandwidth_gb_per_s=1.86), comms=False)
    assert measured_fields(cal) == {"ddr_bandwidth_gb_per_s"}
    text = cluster_yaml(cal, TEMPLATE)
    assert "intra_host_gb_per_s: 4         # gloo over loopback" in text.splitlines()
    assert "not measured" in text
    assert not any(line.startswith(NEW_FIELDS) for line in text.splitlines())  # not written
    assert _load_text(tmp_path, text) == cal.cluster


def test_calibrated_fills_the_row_wise_collective_rates():
    """The collectives' medians become the cluster's rates (bytes TorchRec charges per ms, 1 GB =
    2^30 bytes, 3 significant digits); the TBE's become ddr_bandwidth_gb_per_s."""
    base = _cpu(devices=2)
    spec = dict(table_rows=[50, 500], embedding_dim=16, batch_size=128, pooling=1.0,
                zipf_exponent=None, message_bytes=16384, row_wise_bytes=32768)
    rank = dict(threads=1, forward_ms=0.1, backward_ms=0.3, tiny_call_ms=0.05, latency_ms=0.1,
                all_to_all_ms=0.2, reduce_scatter_ms=0.5, all_gather_ms=0.25)
    cluster, lookup, comms = calibrated(base, spec, [rank, {**rank, "all_to_all_ms": 0.4}])
    assert comms.all_to_all_ms == pytest.approx(0.3)  # averaged over ranks
    assert cluster.intra_host_gb_per_s == pytest.approx(16384 / 0.3e-3 / GIB, rel=5e-3)
    assert cluster.reduce_scatter_gb_per_s == pytest.approx(32768 / 0.5e-3 / GIB, rel=5e-3)
    assert cluster.all_gather_gb_per_s == pytest.approx(32768 / 0.25e-3 / GIB, rel=5e-3)
    assert cluster.ddr_bandwidth_gb_per_s == pytest.approx(
        lookup.estimator_bytes / 0.4e-3 / GIB, rel=5e-3)
    assert all(_positive_finite(getattr(cluster, k)) for k in NEW_FIELDS[1:])
    assert cluster.sharding_group_ms == 0  # set by calibrate from the tiny models


def test_group_timing_is_the_median_fixed_cost_over_sharding_types():
    """Per type: measured - estimated, averaged over ranks; sharding_group_ms: their median."""
    ranks = [{"table_wise": {"ms": 4.0, "estimated_ms": 0.01},
              "row_wise": {"ms": 5.0, "estimated_ms": 0.02},
              "column_wise": {"ms": 3.0, "estimated_ms": 0.01}},
             {"table_wise": {"ms": 4.2, "estimated_ms": 0.03},
              "row_wise": {"ms": 5.4, "estimated_ms": 0.02},
              "column_wise": {"ms": 3.6, "estimated_ms": 0.01}}]
    g = group_timing(ranks, 16)
    assert (g.ranks, g.tables, g.batch_size) == (2, 2, TINY_BATCH)
    assert g.fixed_ms == pytest.approx({"table_wise": 4.08, "row_wise": 5.18,
                                        "column_wise": 3.29})
    assert g.sharding_group_ms == pytest.approx(4.08)  # table_wise's: the median


@pytest.mark.parametrize("kind", GROUP_SHARDING_TYPES)
def test_tiny_group_plans_give_every_rank_a_shard_and_cost_nearly_nothing(kind):
    """What sharding_group_ms subtracts: the planner's estimate of the tiny model the ranks time,
    planned without any group cost (a file calibrated before must not count itself in), tiny
    next to the few ms measured; and the plan gives every rank a lookup."""
    cluster = group_cluster(_cpu(devices=2, sharding_group_ms=4.0, reduce_scatter_gb_per_s=0.7,
                                  all_gather_gb_per_s=1.1), world=2)
    assert (cluster.world_size, cluster.batch_size_per_rank, cluster.sharding_group_ms) == (
        2, TINY_BATCH, 0)
    plan = plan_sharding(tiny_model(2, 16, torch.device("meta")), cluster,
                         PlannerOptions(sharding_types=[ShardingType(kind)]))
    assert {o.sharding_type for o in plan.options} == {kind}
    assert {s.rank for o in plan.options for s in o.shards} == {0, 1}
    for r in plan.report.ranks:
        assert 0 < r.time_ms.embedding_total < 0.05
        assert r.time_ms.part("sharding_groups") == 0


def test_calibrate_refuses_gpu_clusters_and_bad_arguments():
    with pytest.raises(CalibrationError, match="only device: cpu") as e:
        calibrate(ClusterConfig(name="gpu", device=DeviceKind.CUDA))
    assert "\n" not in str(e.value)
    with pytest.raises(CalibrationError, match="table_rows"):
        calibrate(_cpu(), table_rows=[])
    with pytest.raises(CalibrationError, match="pooling"):
        calibrate(_cpu(), pooling=0.5)
    with pytest.raises(CalibrationError, match="group_sharding_types"):
        calibrate(_cpu(devices=2), group_sharding_types=["table_wise", "data_parallel"])
    with pytest.raises(CalibrationError, match="group_sharding_types.*diagonal"):
        calibrate(_cpu(devices=2), group_sharding_types=["diagonal"])


@pytest.mark.slow
def test_calibrate_two_ranks_measures_collectives_and_sharding_groups(tmp_path):
    """About 10 s: two gloo ranks, TBE + collectives + a tiny sharded model per sharding type."""
    base = _cpu(devices=2, sharding_group_ms=99.0)  # a stale figure, replaced
    cal = calibrate(base, table_rows=[50, 500], steps=5, warmup=1)
    assert cal.comms is not None and cal.comms.ranks == 2
    assert _positive_finite(cal.cluster.intra_host_gb_per_s)
    assert cal.cluster.intra_host_gb_per_s != 77.0
    assert cal.comms.message_bytes == 128 * 16 * 4 * 2  # global batch x dim x fp32 x tables
    assert cal.comms.row_wise_bytes == 2 * cal.comms.message_bytes  # a rank's row_wise share
    assert all(_positive_finite(v) for v in (cal.comms.latency_ms, cal.comms.reduce_scatter_ms,
                                             cal.comms.all_gather_ms))
    assert all(_positive_finite(getattr(cal.cluster, k)) for k in NEW_FIELDS)
    g = cal.groups
    assert g is not None and list(g.measured_ms) == list(GROUP_SHARDING_TYPES)
    # a real fixed cost (milliseconds on gloo), far above the tiny plans' estimates; the upper
    # bound is loose: on two busy cores a gloo round trip was seen at over 100 ms
    assert all(0.2 < ms < 2000 for ms in g.fixed_ms.values())
    assert 0 < max(g.estimated_ms.values()) < 0.1 * min(g.fixed_ms.values())
    assert cal.cluster.sharding_group_ms == pytest.approx(g.sharding_group_ms, rel=5e-3)
    path = tmp_path / "cal.yaml"
    write_cluster_yaml(cal, path)
    assert load_cluster(path) == cal.cluster


@pytest.mark.slow
def test_a_failing_rank_is_a_one_line_calibration_error():
    """A spawned rank that raises ends the calibration with one line: which rank, and why."""
    with pytest.raises(CalibrationError, match=r"^calibrate: rank [01] failed: KeyError: 'steps'$"):
        _spawn_ranks(2, {}, timeout=120)
