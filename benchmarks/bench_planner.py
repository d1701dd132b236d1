"""Planner speed and plan quality: embedtrain's planner vs TorchRec's stock planner and a greedy baseline.

The model is N random tables (rows log-uniform in 1e3..1e8, dims 32..256: the same draw as
``../shared/anchors/torchrec_planner_time.py``) on ``--cluster`` (default h100-16x8) scaled to
each of ``--ranks`` (128 = 16 hosts x 8, 1,024 = 128 hosts x 8), built on ``meta``. Each
(size, ranks) is planned in its own process (so its peak memory is its own) by embedtrain's
:func:`plan_sharding`, and rated by the estimated embedding time of the slowest rank (TorchRec's
``NoopPerfModel``: the sum of shard perf estimates per rank, maximum over ranks). Two references
are rated the same way, from the same TorchRec estimates:

* TorchRec 1.8's default ``EmbeddingShardingPlanner`` for ``--stock-sizes`` (128 ranks; it
  takes minutes per 100 tables);
* a **greedy baseline**, for every size: what one writes by hand (DLRM's table-wise
  placement): every table whole (``table_wise``), or in its column blocks (``column_wise``)
  when it is too large for one rank; the pieces by size, largest first, each on the rank with
  the least estimated time that has room; when that leaves a piece with no room anywhere, the
  same on the rank with the most free memory; in the same per-rank capacity the planner has
  left. ``greedy_max_rank_ms`` is null when neither fits.

Usage:
    python benchmarks/bench_planner.py --json benchmarks/out/planner.json \
        [--tables 100 1000 10000] [--ranks 128 1024] [--stock-sizes 100] [--rounds 1]

Prints a table; JSON: ``seconds`` and ``peak_rss_bytes`` per size on the fewest ``--ranks`` it
fits on (100 and 1,000 tables on 128 ranks; 10,000 need ~40 TiB, more than 128 H100s plus their
hosts have: on 1,024), ``by_ranks`` (every size on every rank count: seconds, peak RSS, fits or
why not, slowest-rank ms, greedy's, planner statistics),
``stock_seconds``, ``quality`` (``ratio`` = embedtrain / stock slowest rank at the first stock
size; ``vs_greedy`` per size = greedy's slowest rank / embedtrain's, >= 1 when embedtrain is no
worse).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import logging
import resource
import statistics
import subprocess
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
from embedtrain.sharding.enumerator import CompactEnumerator  # noqa: E402
from embedtrain.sharding.planner import PlanError, plan_sharding, table_constraints  # noqa: E402
from embedtrain.sharding.reservation import ExplicitStorageReservation  # noqa: E402
from embedtrain.sharding.types import (  # noqa: E402
    ComputeKernel,
    MemoryTier,
    PlannerOptions,
    ShardingType,
)
from embedtrain.testing import random_embedding_tables  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def model(n: int) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=random_embedding_tables(n), device=torch.device("meta"))


def scaled(cluster, ranks: int):
    """``cluster`` with as many hosts as ``ranks`` needs."""
    hosts, rest = divmod(ranks, cluster.devices_per_host)
    if rest or hosts < 1:
        raise SystemExit(f"--ranks {ranks}: not a multiple of {cluster.devices_per_host} "
                         f"devices per host of {cluster.name}")
    return dataclasses.replace(cluster, hosts=hosts)


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


def greedy_plan(m, cluster) -> tuple[float, float, str]:
    """The greedy baseline (module docstring): seconds, slowest-rank ms (inf: no fit) and the
    rule that placed it (``least_time``, else ``most_room``)."""
    start = time.perf_counter()
    topo = topology(cluster)
    names = [t.name for t in m.embedding_bag_configs()]
    options = PlannerOptions(sharding_types=[ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE],
                             compute_kernels=[ComputeKernel.FUSED], tiny_table_bytes=0)
    constraints = table_constraints(names, options)
    sharders = [EmbeddingBagCollectionSharder()]
    left = ExplicitStorageReservation(cluster.reserved_fraction, 2).reserve(
        topo, cluster.batch_size_per_rank, m, sharders, constraints)
    capacity = [d.storage.hbm for d in left.devices]
    enum = CompactEnumerator(topo, cluster.batch_size_per_rank, constraints)
    by_table: dict[str, dict[str, object]] = {}
    for o in enum.enumerate(m, sharders):
        by_table.setdefault(o.name, {})[o.sharding_type] = o
    pieces = []  # (bytes, ms) of each table whole, or of its column blocks when too large
    for opts in by_table.values():
        tw = opts["table_wise"].shards[0]
        if tw.storage.hbm <= max(capacity) or "column_wise" not in opts:
            pieces.append((tw.storage.hbm, tw.perf.total))
        else:
            pieces += [(s.storage.hbm, s.perf.total)
                       for s in enum.expand(opts["column_wise"]).shards]
    for rule in ("least_time", "most_room"):
        ms = _greedy(sorted(pieces, reverse=True), list(capacity), rule)
        if ms < float("inf"):
            return time.perf_counter() - start, ms, rule
    return time.perf_counter() - start, float("inf"), "none"


def _greedy(pieces: list[tuple[float, float]], room: list[float], rule: str) -> float:
    """Places ``pieces`` (bytes, ms), in order, each on the rank with the least estimated time
    (``least_time``) or the most free memory (``most_room``) that has room: the slowest rank's
    ms, or inf when a piece fits nowhere."""
    load = [0.0] * len(room)

    def key(r: int) -> tuple[float, int]:
        return (load[r], r) if rule == "least_time" else (-room[r], r)

    heap = [(key(r), r) for r in range(len(room))]
    heapq.heapify(heap)
    for nbytes, ms in pieces:
        aside = []
        while heap and room[heap[0][1]] < nbytes:
            aside.append(heapq.heappop(heap))
        if not heap:
            return float("inf")
        _, r = heapq.heappop(heap)
        load[r], room[r] = load[r] + ms, room[r] - nbytes
        heapq.heappush(heap, (key(r), r))
        for item in aside:
            heapq.heappush(heap, item)
    return max(load)


def one(n: int, ranks: int, cluster_path: str, rounds: int) -> dict:
    """Plans ``n`` tables on ``ranks`` ranks (in this process) and rates the greedy baseline."""
    cluster = scaled(load_cluster(cluster_path), ranks)
    times = []
    for _ in range(rounds):
        m = model(n)
        start = time.perf_counter()
        try:
            result = plan_sharding(m, cluster)
        except PlanError as e:  # e.g. 10,000 of these tables need 40 TiB: not on 128 ranks
            return {"tables": n, "ranks": ranks, "fits": False, "why": str(e),
                    "seconds": time.perf_counter() - start,
                    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        times.append(time.perf_counter() - start)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = result.report
    p = report.planner
    greedy_seconds, greedy_ms, greedy_rule = greedy_plan(model(n), cluster)
    ours = report.summary.embedding_max_rank_ms
    return {
        "tables": n, "ranks": ranks, "fits": True, "seconds": statistics.median(times),
        "peak_rss_bytes": peak_rss, "max_rank_ms": ours,
        "peak_rank_bytes": max(r.memory[MemoryTier.HBM].total for r in report.ranks),
        "greedy_max_rank_ms": greedy_ms if greedy_ms < float("inf") else None,
        "greedy_seconds": greedy_seconds, "greedy_rule": greedy_rule,
        "vs_greedy": greedy_ms / ours if greedy_ms < float("inf") else None,
        "sharding_types": report.summary.sharding_types,
        "warnings": report.warnings,
        "stats": {k: getattr(p, k) for k in (
            "options", "estimated_shards", "proposals", "partitions", "pruned_by_bound",
            "improving_moves", "best_seed", "search_seconds")},
    }


def _ms(value) -> str:
    return "no fit" if value is None else f"{value:.3f}"


def in_child(n: int, ranks: int, args) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", str(n), str(ranks), "--cluster",
                          args.cluster, "--rounds", str(args.rounds), "--json", "-"],
                         capture_output=True, text=True)
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"planning {n} tables on {ranks} ranks failed: {last}")
    return json.loads(out.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="output JSON file")
    parser.add_argument("--tables", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--ranks", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--stock-sizes", type=int, nargs="*", default=[100],
                        help="sizes also planned by TorchRec's stock planner (slow: ~250 s per "
                             "100 tables), on the first --ranks")
    parser.add_argument("--cluster", default=str(ROOT / "configs/clusters/h100-16x8.yaml"))
    parser.add_argument("--rounds", type=int, default=1, help="timed rounds per size (median)")
    parser.add_argument("--one", type=int, nargs=2, metavar=("TABLES", "RANKS"),
                        help=argparse.SUPPRESS)  # the per-size child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.cluster, args.rounds)))
        return 0
    base = load_cluster(args.cluster)

    by_ranks: dict[str, dict[str, dict]] = {}
    for ranks in args.ranks:
        for n in args.tables:
            r = in_child(n, ranks, args)
            by_ranks.setdefault(str(ranks), {})[str(n)] = r
            head = (f"embedtrain {n:>6} tables on {ranks:>5} ranks: {r['seconds']:6.1f} s, peak "
                    f"{r['peak_rss_bytes'] / 2**30:5.2f} GiB, ")
            print(head + (f"slowest rank {r['max_rank_ms']:9.3f} ms, greedy "
                          f"{_ms(r['greedy_max_rank_ms']):>9} ms ({r['stats']['partitions']} "
                          f"partitions, best seed {r['stats']['best_seed']})" if r["fits"]
                          else r["why"][:100]), flush=True)

    def primary(n: int) -> str:  # the size's own cluster: the fewest ranks it fits on
        fitting = [k for k in args.ranks if by_ranks[str(k)][str(n)]["fits"]]
        return str(min(fitting) if fitting else max(args.ranks))

    def fitted(n: int, key: str):  # None for a size that fits on none of --ranks
        r = by_ranks[primary(n)][str(n)]
        return r[key] if r["fits"] else None

    seconds = {str(n): fitted(n, "seconds") for n in args.tables}
    peak_rss = {str(n): fitted(n, "peak_rss_bytes") for n in args.tables}
    vs_greedy = {str(n): by_ranks[primary(n)][str(n)].get("vs_greedy") for n in args.tables}

    stock_cluster = scaled(base, args.ranks[0])
    stock_seconds, stock_quality, stock_peaks = {}, {}, {}
    for n in args.stock_sizes:
        s, rating, peak = stock_plan(n, stock_cluster)
        stock_seconds[str(n)], stock_quality[str(n)], stock_peaks[str(n)] = s, rating, peak
        print(f"torchrec   {n:>6} tables on {args.ranks[0]:>5} ranks: {s:6.1f} s, slowest rank "
              f"{rating:9.3f} ms", flush=True)

    capacity = int(base.hbm_gb * 2**30)
    ours_first = by_ranks[str(args.ranks[0])]
    out = {
        "cluster": base.name,
        "ranks": args.ranks,
        "primary_ranks": {str(n): int(primary(n)) for n in args.tables},
        "seconds": seconds,
        "peak_rss_bytes": peak_rss,
        "max_rank_ms": {str(n): by_ranks[primary(n)][str(n)].get("max_rank_ms")
                        for n in args.tables},
        "by_ranks": by_ranks,
        "stock_seconds": stock_seconds,
        "stock_max_rank_ms_by_size": stock_quality,
        "stock_peak_rank_shard_bytes": stock_peaks,
        "capacity_bytes": capacity,
        "quality": {"vs_greedy": vs_greedy},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    common = [n for n in stock_quality if ours_first.get(n, {}).get("fits")]
    if common:
        n = common[0]
        ours = ours_first[n]
        out["quality"].update({
            "tables": int(n), "max_rank_ms": ours["max_rank_ms"],
            "stock_max_rank_ms": stock_quality[n], "ratio": ours["max_rank_ms"] / stock_quality[n],
            "fits": ours["peak_rank_bytes"] <= capacity and stock_peaks[n] <= capacity})
        out["speedup"] = {n: stock_seconds[n] / ours_first[n]["seconds"] for n in common}

    print()
    print(f"{'tables':>7} {'ranks':>6} {'seconds':>8} {'peak GiB':>9} {'slowest ms':>11} "
          f"{'greedy ms':>10} {'greedy/ours':>12} {'stock ms':>9} {'ours/stock':>11}")
    for ranks, sizes in by_ranks.items():
        for n, r in sizes.items():
            if not r["fits"]:
                print(f"{n:>7} {ranks:>6} {r['seconds']:8.1f} {r['peak_rss_bytes'] / 2**30:9.2f} "
                      f"  does not fit ({r['why'].split(';')[0][:70]})")
                continue
            sq = stock_quality.get(n) if ranks == str(args.ranks[0]) else None
            print(f"{n:>7} {ranks:>6} {r['seconds']:8.1f} {r['peak_rss_bytes'] / 2**30:9.2f} "
                  f"{r['max_rank_ms']:11.3f} {_ms(r['greedy_max_rank_ms']):>10} "
                  f"{_ms(r['vs_greedy']):>12} {sq if sq else float('nan'):9.3f} "
                  f"{r['max_rank_ms'] / sq if sq else float('nan'):11.3f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
