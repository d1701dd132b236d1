"""Planner speed and plan quality: embedtrain's planner vs TorchRec's stock planner.

The model is ``--tables`` random tables (rows log-uniform in 1e3..1e8, dims 32..256: the same
draw as ``../shared/anchors/torchrec_planner_time.py``) on the ``--cluster`` (default h100-16x8,
128 ranks), built on ``meta``. For each size embedtrain's :func:`plan_sharding` is timed; for
``--stock-sizes`` TorchRec 1.8's default ``EmbeddingShardingPlanner`` plans the same model on the
same topology, and both plans are rated the same way: the estimated embedding time of the slowest
rank (TorchRec's ``NoopPerfModel``: the sum of shard perf estimates per rank, maximum over ranks).

Usage:
    python benchmarks/bench_planner.py --json benchmarks/out/planner.json \
        [--tables 100 300 1000] [--stock-sizes 100] [--rounds 1]

Prints a table; JSON: ``seconds`` (per size, median over rounds), ``stock_seconds``, ``quality``
(``max_rank_ms``, ``stock_max_rank_ms``, ``ratio`` on the first stock size), ``peak_rank_bytes``,
``capacity_bytes`` and per-size planner statistics.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

from torchrec import EmbeddingBagCollection  # noqa: E402
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # noqa: E402
from torchrec.distributed.planner import EmbeddingShardingPlanner  # noqa: E402
from torchrec.distributed.planner.perf_models import NoopPerfModel  # noqa: E402

from embedtrain.config import load_cluster  # noqa: E402
from embedtrain.sharding.cluster import topology  # noqa: E402
from embedtrain.sharding.planner import plan_sharding  # noqa: E402
from embedtrain.sharding.types import MemoryTier  # noqa: E402
from embedtrain.testing import random_embedding_tables  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def model(n: int) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=random_embedding_tables(n), device=torch.device("meta"))


def stock_plan(n: int, cluster) -> tuple[float, float, int]:
    """Seconds, slowest-rank ms and peak per-rank shard bytes of TorchRec's default planner."""
    topo = topology(cluster)
    planner = EmbeddingShardingPlanner(topology=topo, batch_size=cluster.batch_size_per_rank)
    start = time.perf_counter()
    planner.plan(model(n), [EmbeddingBagCollectionSharder()])
    seconds = time.perf_counter() - start
    best = planner._best_plan  # the ShardingOptions behind the returned plan
    per_rank = [0] * topo.world_size
    for option in best:
        for shard in option.shards:
            per_rank[shard.rank] += shard.storage.hbm
    return seconds, NoopPerfModel(topo).rate(best), max(per_rank)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="output JSON file")
    parser.add_argument("--tables", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--stock-sizes", type=int, nargs="*", default=[100],
                        help="sizes also planned by TorchRec's stock planner (slow: ~100 s per 100)")
    parser.add_argument("--cluster", default=str(ROOT / "configs/clusters/h100-16x8.yaml"))
    parser.add_argument("--rounds", type=int, default=1, help="timed rounds per size (median)")
    args = parser.parse_args()
    cluster = load_cluster(args.cluster)

    seconds, stats, quality_ours, peaks = {}, {}, {}, {}
    for n in args.tables:
        times = []
        for _ in range(args.rounds):
            m = model(n)
            start = time.perf_counter()
            result = plan_sharding(m, cluster)
            times.append(time.perf_counter() - start)
        report = result.report
        seconds[str(n)] = statistics.median(times)
        quality_ours[str(n)] = report.summary.embedding_max_rank_ms
        peaks[str(n)] = max(r.memory[MemoryTier.HBM].total for r in report.ranks)
        p = report.planner
        stats[str(n)] = {k: getattr(p, k) for k in (
            "options", "estimated_shards", "proposals", "partitions", "pruned_by_bound",
            "improving_moves", "best_seed", "search_seconds")}
        print(f"embedtrain  {n:>5} tables: {seconds[str(n)]:7.1f} s  slowest rank "
              f"{quality_ours[str(n)]:8.3f} ms  ({p.partitions} partitions, best seed "
              f"{p.best_seed})", flush=True)

    stock_seconds, stock_quality, stock_peaks = {}, {}, {}
    for n in args.stock_sizes:
        s, rating, peak = stock_plan(n, cluster)
        stock_seconds[str(n)], stock_quality[str(n)], stock_peaks[str(n)] = s, rating, peak
        print(f"torchrec    {n:>5} tables: {s:7.1f} s  slowest rank {rating:8.3f} ms", flush=True)

    capacity = int(cluster.hbm_gb * 2**30)
    out = {
        "cluster": cluster.name,
        "world_size": cluster.world_size,
        "seconds": seconds,
        "stock_seconds": stock_seconds,
        "max_rank_ms": quality_ours,
        "stock_max_rank_ms_by_size": stock_quality,
        "peak_rank_bytes": peaks,
        "stock_peak_rank_shard_bytes": stock_peaks,
        "capacity_bytes": capacity,
        "planner_stats": stats,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    common = [n for n in stock_quality if n in quality_ours]
    if common:
        n = common[0]
        out["quality"] = {"tables": int(n), "max_rank_ms": quality_ours[n],
                          "stock_max_rank_ms": stock_quality[n],
                          "ratio": quality_ours[n] / stock_quality[n],
                          "fits": peaks[n] <= capacity and stock_peaks[n] <= capacity}
        out["speedup"] = {n: stock_seconds[n] / seconds[n] for n in common}

    print()
    print(f"{'tables':>7} {'embedtrain s':>13} {'stock s':>9} {'slowest rank ms':>16} "
          f"{'stock ms':>9} {'ratio':>6}")
    for n in seconds:
        st = stock_seconds.get(n)
        sq = stock_quality.get(n)
        print(f"{n:>7} {seconds[n]:13.1f} {st if st is not None else float('nan'):9.1f} "
              f"{quality_ours[n]:16.3f} {sq if sq is not None else float('nan'):9.3f} "
              f"{quality_ours[n] / sq if sq else float('nan'):6.3f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
