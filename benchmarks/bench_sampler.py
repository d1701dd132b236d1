"""Neighbour sampling throughput: embedtrain's vectorised sampler vs a per-node Python loop vs the
bytes-touched floor; and a memory-mapped 10M-node / 200M-edge run with its peak RSS.

Main run (one process, alternating rounds so machine noise hits each alike; medians reported):
- embedtrain: ``NeighborSampler.sample`` for ``--fanouts`` (default 15 10), ``--batch`` random
  seed nodes (default 1024), uniform without replacement; also the same through ``SeedBatches``
  with 2 worker threads, and weighted sampling (weights uniform in [0.01, 1.01]) for information;
- python_loop: a straightforward per-node implementation (loop over frontier nodes,
  ``random.sample`` of each row's offsets, a dict relabel), on ``--loop-batches`` batches a round;
- floor: the CSR bytes a batch must read (16 bytes of ``indptr`` per node sampled for, one index
  entry per sampled edge) divided by the measured memory-copy bandwidth (median ``np.copyto`` of
  256 MiB; bandwidth = bytes copied / s), as sampled edges per second. Random gathers cannot
  stream, so the fraction reached is small by nature; the cache-line floor (one 64-byte line per
  node and per sampled edge) is printed alongside.

Usage:
    python benchmarks/bench_sampler.py --nodes 1000000 --avg-degree 20 --json OUT.json \
        [--graph DIR] [--rounds 5] [--batches 20] [--loop-batches 2]
    python benchmarks/bench_sampler.py --mmap-test --nodes 10000000 --avg-degree 20 \
        --graph-dir /tmp/bench_graph_10m --json OUT.json [--batches 50]

The synthetic graph: a directed Chung-Lu-style CSR: out-degrees (row lengths) from a Pareto law
(pdf exponent 2.5, mean ``--avg-degree``, at most ``nodes / 10``), neighbours drawn with
probability proportional to degree (so in-degrees follow the same power law), rows sorted;
duplicate neighbours are possible (a fraction is printed). ``--graph DIR`` reads a graph data set
(``embedtrain.graph.store.load_graph`` if it exists, else the CSR ``.npy`` files named in
``metadata.json``) memory-mapped instead.

``--mmap-test`` writes the graph (in the data set layout: ``graph/indptr.npy``,
``graph/indices.npy``, ``metadata.json``) chunk by chunk in a child process (bounded memory:
about 0.5 GB whatever the size), then samples ``--batches`` batches in a fresh child process from
the ``np.load(mmap_mode="r")`` arrays and reports its peak RSS (``ru_maxrss`` and ``VmHWM``) and
the current split into anonymous and file-backed resident memory (mapped CSR pages that were
touched count as ``RssFile``; the page cache itself is not RSS).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from embedtrain.graph import NeighborSampler, SampledBlocks, SeedBatches

_CHUNK_SLOTS = 8_000_000  # edges generated per chunk when writing a graph to disk
_PARETO_A = 1.5  # Lomax shape: Pareto pdf exponent a + 1 = 2.5


# ---------------------------------------------------------------------------------------- graph
def power_law_degrees(num_nodes: int, avg_degree: float, seed: int) -> np.ndarray:
    """Row lengths with a power-law tail, mean ``avg_degree``, in ``[1, max(1, N / 10)]``."""
    rng = np.random.default_rng([seed, 0])
    raw = (rng.pareto(_PARETO_A, num_nodes) + 1.0) * (avg_degree * (_PARETO_A - 1) / _PARETO_A)
    raw = np.minimum(raw, max(1, num_nodes // 10))
    deg = np.maximum(1, np.rint(raw * (avg_degree * num_nodes / raw.sum()))).astype(np.int64)
    return np.minimum(deg, max(1, num_nodes // 10))


def _chunk_neighbours(deg: np.ndarray, cdf: np.ndarray, first: int, last: int,
                      seed: int) -> np.ndarray:
    """Sorted neighbour rows of nodes ``first..last-1`` (int32/int64 as the graph needs)."""
    n = len(deg)
    counts = deg[first:last]
    rng = np.random.default_rng([seed, 1, first])
    # Sorted draws make the inverse-CDF lookup a merge rather than random probes of a large
    # table; a permutation then deals them to the slots at random.
    nbr = np.searchsorted(cdf, np.sort(rng.random(int(counts.sum()))), side="right")
    nbr = np.minimum(nbr, n - 1)[rng.permutation(len(nbr))]
    row = np.repeat(np.arange(last - first, dtype=np.int64), counts)
    key = np.sort(row * n + nbr)  # sorts by row, then neighbour
    return (key % n).astype(np.int32 if n < 2**31 else np.int64)


def _chunks(indptr: np.ndarray) -> list[tuple[int, int]]:
    out, first = [], 0
    n = len(indptr) - 1
    while first < n:
        last = int(np.searchsorted(indptr, indptr[first] + _CHUNK_SLOTS, side="right")) - 1
        last = min(n, max(last, first + 1))
        out.append((first, last))
        first = last
    return out


def power_law_csr(num_nodes: int, avg_degree: float, seed: int = 0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """An in-memory synthetic CSR (see the module docstring)."""
    deg = power_law_degrees(num_nodes, avg_degree, seed)
    indptr = np.concatenate([[0], np.cumsum(deg)])
    cdf = np.cumsum(deg, dtype=np.float64) / indptr[-1]
    indices = np.concatenate([_chunk_neighbours(deg, cdf, a, b, seed) for a, b in _chunks(indptr)])
    return indptr, indices


def write_power_law_csr(out: Path, num_nodes: int, avg_degree: float, seed: int = 0) -> dict:
    """Writes the synthetic CSR to ``out`` in the graph data set layout, chunk by chunk."""
    (out / "graph").mkdir(parents=True, exist_ok=True)
    deg = power_law_degrees(num_nodes, avg_degree, seed)
    indptr = np.concatenate([[0], np.cumsum(deg)])
    np.save(out / "graph" / "indptr.npy", indptr)
    cdf = np.cumsum(deg, dtype=np.float64) / indptr[-1]
    dtype = np.int32 if num_nodes < 2**31 else np.int64
    indices = np.lib.format.open_memmap(out / "graph" / "indices.npy", mode="w+", dtype=dtype,
                                        shape=(int(indptr[-1]),))
    for a, b in _chunks(indptr):
        indices[indptr[a]:indptr[b]] = _chunk_neighbours(deg, cdf, a, b, seed)
    indices.flush()
    del indices
    meta = {"format_version": 1, "name": "bench_power_law", "task": "graph",
            "num_nodes": num_nodes, "num_edges": int(indptr[-1]), "directed": True,
            "csr": {"indptr": "graph/indptr.npy", "indices": "graph/indices.npy",
                    "weights": None},
            "generator": {"kind": "chung_lu_pareto", "avg_degree": avg_degree, "seed": seed,
                          "pareto_pdf_exponent": _PARETO_A + 1}}
    (out / "metadata.json").write_text(json.dumps(meta, indent=1))
    return meta


def read_csr(graph_dir: Path) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """The CSR ``.npy`` files named in ``metadata.json``, memory-mapped (no other import)."""
    csr = json.loads((graph_dir / "metadata.json").read_text())["csr"]
    return tuple(None if not csr.get(key) else np.load(graph_dir / csr[key], mmap_mode="r")
                 for key in ("indptr", "indices", "weights"))


def load_csr(graph_dir: Path) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """A graph data set's CSR through ``embedtrain.graph.store.load_graph`` (memory-mapped)
    when the graph store exists, else :func:`read_csr`."""
    try:
        from embedtrain.graph.store import load_graph
    except ImportError:
        return read_csr(graph_dir)
    graph = load_graph(graph_dir, mmap=True)
    get = (lambda k: graph[k]) if isinstance(graph, dict) else (lambda k: getattr(graph, k, None))
    return get("indptr"), get("indices"), get("weights")


# ----------------------------------------------------------------------------------- baselines
def python_loop_sample(indptr: np.ndarray, indices: np.ndarray, seeds: np.ndarray,
                       fanouts: list[int], rnd: random.Random) -> int:
    """The per-node reference: returns the number of sampled edges."""
    indptr, indices = np.asarray(indptr), np.asarray(indices)  # plain ndarrays, even if mapped
    local: dict[int, int] = {}
    n_id: list[int] = []
    for s in seeds.tolist():
        if s not in local:
            local[s] = len(n_id)
            n_id.append(s)
    frontier, edges = seeds.tolist(), []
    for fanout in fanouts:
        next_frontier = []
        for u in frontier:
            start, end = int(indptr[u]), int(indptr[u + 1])
            deg = end - start
            if deg <= fanout:
                picks = range(start, end)
            else:
                picks = [start + o for o in rnd.sample(range(deg), fanout)]
            target = local[u]
            for p in picks:
                v = int(indices[p])
                lv = local.get(v)
                if lv is None:
                    lv = local[v] = len(n_id)
                    n_id.append(v)
                    next_frontier.append(v)
                edges.append((lv, target))
        frontier = next_frontier
    return len(edges)


def copy_bandwidth(mib: int = 256, rounds: int = 5) -> float:
    """Median bytes/s of ``np.copyto`` between two ``mib`` MiB arrays (bytes copied / s)."""
    src = np.ones(mib * 2**20 // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return src.nbytes / statistics.median(times)


def batch_bytes(blocks: SampledBlocks, index_itemsize: int) -> int:
    """CSR bytes a batch must read: 2 int64 ``indptr`` entries per node sampled for (every node
    but the last hop's new ones) and one index entry per sampled edge."""
    return 16 * blocks.num_nodes_per_hop[-2] + index_itemsize * blocks.num_sampled_edges


# ----------------------------------------------------------------------------------------- runs
def _rss(mapped_dir: Optional[Path] = None) -> dict:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines()
                  if ":" in line)
    mb = lambda key: int(status[key].split()[0]) / 1024  # noqa: E731 - kB -> MB
    out = {"ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "vm_hwm_mb": mb("VmHWM"), "vm_rss_mb": mb("VmRSS"),
           "rss_anon_mb": mb("RssAnon"), "rss_file_mb": mb("RssFile")}
    if mapped_dir is not None:  # resident pages of the memory-mapped CSR files (from smaps)
        csr_kb, current = 0, None
        for line in Path("/proc/self/smaps").read_text().splitlines():
            head = line.split()
            if head and not head[0].endswith(":"):
                current = head[-1] if len(head) >= 6 else None
            elif head and head[0] == "Rss:" and current and current.startswith(str(mapped_dir)):
                csr_kb += int(head[1])
        out["csr_mapped_rss_mb"] = csr_kb / 1024
    return out


def _evict(paths: list[Path]) -> None:
    """Drops these files' pages from the page cache (only these files: nothing else is
    touched), so the next reads come from disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def mmap_child(args: argparse.Namespace) -> None:
    graph_dir = Path(args.graph_dir)
    if args.child == "write":
        t = time.perf_counter()
        meta = write_power_law_csr(graph_dir, args.nodes, args.avg_degree, args.seed)
        print(json.dumps({"write_s": time.perf_counter() - t, "num_edges": meta["num_edges"],
                          **_rss()}))
        return
    if args.child == "sample-cold":
        _evict(sorted((graph_dir / "graph").glob("*.npy")))
    before = _rss(graph_dir)
    # Not load_csr: importing embedtrain.data pulls in torchrec (135 MB), not the sampler's cost.
    indptr, indices, _ = read_csr(graph_dir)
    sampler = NeighborSampler(indptr, indices, args.fanouts, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    edges, t = 0, time.perf_counter()
    for b in range(args.batches):
        seeds = rng.integers(0, len(indptr) - 1, args.batch)
        edges += sampler.sample(seeds, step=b).num_sampled_edges
    wall = time.perf_counter() - t
    print(json.dumps({"before": before, "after": _rss(graph_dir), "batches": args.batches,
                      "sampled_edges": edges, "edges_per_s": edges / wall, "wall_s": wall,
                      "num_nodes": len(indptr) - 1, "num_edges": len(indices),
                      "csr_bytes_on_disk": indptr.nbytes + indices.nbytes}))


def run_child(args: argparse.Namespace, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--mmap-test", "--child", mode, "--nodes", str(args.nodes),
           "--avg-degree", str(args.avg_degree), "--graph-dir", args.graph_dir,
           "--batches", str(args.batches), "--batch", str(args.batch), "--seed", str(args.seed),
           "--json", args.json, "--fanouts", *map(str, args.fanouts)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def mmap_test(args: argparse.Namespace) -> dict:
    graph_dir = Path(args.graph_dir)
    written = None
    if not (graph_dir / "metadata.json").exists():
        written = run_child(args, "write")
        print(f"wrote {written['num_edges']:,} edges in {written['write_s']:.1f} s, writer peak "
              f"RSS {written['vm_hwm_mb']:,.0f} MB")
    runs = {mode: run_child(args, mode) for mode in ("sample", "sample-cold")}
    for mode, run in runs.items():
        after = run["after"]
        peak = max(after["ru_maxrss_mb"], after["vm_hwm_mb"])
        cache = "CSR pages in the page cache" if mode == "sample" else "CSR evicted first"
        print(f"{mode} ({cache}): {run['num_nodes']:,} nodes, {run['num_edges']:,} edges "
              f"memory-mapped ({run['csr_bytes_on_disk'] / 2**30:.2f} GiB of CSR); "
              f"{run['batches']} batches of {args.batch} seeds, fanouts {args.fanouts}: "
              f"{run['edges_per_s']:,.0f} edges/s ({run['wall_s']:.1f} s)")
        print(f"  peak RSS {peak:,.0f} MB (ru_maxrss {after['ru_maxrss_mb']:,.0f}, VmHWM "
              f"{after['vm_hwm_mb']:,.0f}); at the end RssAnon {after['rss_anon_mb']:,.0f} MB + "
              f"RssFile {after['rss_file_mb']:,.0f} MB, of which mapped CSR pages "
              f"{after['csr_mapped_rss_mb']:,.0f} MB; before loading the CSR "
              f"{run['before']['vm_rss_mb']:,.0f} MB (Python + torch)")
        run["peak_rss_mb"] = peak
    peak = max(r["peak_rss_mb"] for r in runs.values())
    return {"mmap_test": {"writer": written, "sampler": runs["sample"],
                          "sampler_cold": runs["sample-cold"], "peak_rss_mb": peak,
                          "under_8gb": peak < 8 * 1024, "graph_dir": str(graph_dir)}}


def main_run(args: argparse.Namespace) -> dict:
    t = time.perf_counter()
    if args.graph:
        indptr, indices, _ = load_csr(Path(args.graph))
    else:
        indptr, indices = power_law_csr(args.nodes, args.avg_degree, args.seed)
    build_s = time.perf_counter() - t
    n, e = len(indptr) - 1, len(indices)
    deg = np.diff(indptr)
    print(f"graph: {n:,} nodes, {e:,} edges, max degree {deg.max():,}, "
          f"built/loaded in {build_s:.1f} s")
    fanouts, rng = args.fanouts, np.random.default_rng(args.seed)
    weights = rng.random(e, dtype=np.float32) + 0.01
    uniform = NeighborSampler(indptr, indices, fanouts, seed=args.seed)
    weighted = NeighborSampler(indptr, indices, fanouts, weights=weights, seed=args.seed)
    batches = [rng.integers(0, n, args.batch) for _ in range(args.batches)]
    for b in batches[:3]:  # warm-up: relabel arrays, page faults
        uniform.sample(b, step=0)
        weighted.sample(b, step=0)

    def run_sampler(sampler: NeighborSampler, which: list[np.ndarray]) -> tuple[float, dict]:
        """Seconds for the batches, and their totals; each batch is dropped once counted, as a
        training loop would (keeping them all would add page faults of fresh memory)."""
        totals = {"edges": 0, "bytes": 0, "lines": 0}
        t0 = time.perf_counter()
        for i, b in enumerate(which):
            blocks = sampler.sample(b, step=i)
            totals["edges"] += blocks.num_sampled_edges
            totals["bytes"] += batch_bytes(blocks, indices.itemsize)
            totals["lines"] += blocks.num_nodes_per_hop[-2] + blocks.num_sampled_edges
        return time.perf_counter() - t0, totals

    def run_workers(round_: int) -> tuple[float, int]:
        ids = np.concatenate(batches)
        loader = SeedBatches(ids, args.batch, shuffle=False, seed=args.seed, num_workers=2,
                             collate=lambda s, g: uniform.sample(s, g).num_sampled_edges)
        t0 = time.perf_counter()
        count = sum(loader.iter_epoch(round_))
        return time.perf_counter() - t0, count

    rates: dict[str, list[float]] = {k: [] for k in
                                     ("embedtrain", "embedtrain_2_threads", "weighted",
                                      "python_loop")}
    run_workers(args.rounds)  # warm-up: the thread pool
    bytes_per_edge, lines_per_edge, bandwidths = [], [], []
    for r in range(args.rounds):
        bandwidths.append(copy_bandwidth())
        wall, totals = run_sampler(uniform, batches)
        rates["embedtrain"].append(totals["edges"] / wall)
        bytes_per_edge.append(totals["bytes"] / totals["edges"])
        lines_per_edge.append(totals["lines"] * 64 / totals["edges"])
        wall, count = run_workers(r)
        rates["embedtrain_2_threads"].append(count / wall)
        wall, wtotals = run_sampler(weighted, batches)
        rates["weighted"].append(wtotals["edges"] / wall)
        rnd = random.Random(r)
        t0 = time.perf_counter()
        loop_edges = sum(python_loop_sample(indptr, indices, b, fanouts, rnd)
                         for b in batches[:args.loop_batches])
        rates["python_loop"].append(loop_edges / (time.perf_counter() - t0))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items())
              + f" edges/s; copy {bandwidths[-1] / 1e9:.1f} GB/s", flush=True)

    med = {k: statistics.median(v) for k, v in rates.items()}
    bw = statistics.median(bandwidths)
    floor = bw / statistics.median(bytes_per_edge)
    line_floor = bw / statistics.median(lines_per_edge)
    edges_per_batch = totals["edges"] / len(batches)
    rows = [("embedtrain NeighborSampler (1 thread)", med["embedtrain"]),
            ("embedtrain via SeedBatches, 2 worker threads", med["embedtrain_2_threads"]),
            ("per-node Python loop", med["python_loop"]),
            ("bytes-touched floor (copy bandwidth)", floor),
            ("cache-line floor (64 B per node and per edge)", line_floor),
            ("embedtrain weighted, random weights (info)", med["weighted"])]
    print(f"\nfanouts {fanouts}, batch {args.batch} seeds, {edges_per_batch:,.0f} sampled edges "
          f"per batch, copy bandwidth {bw / 1e9:.1f} GB/s, medians of {args.rounds} rounds")
    print(f"{'':48s} {'edges/s':>14s} {'vs loop':>9s}")
    for name, rate in rows:
        print(f"{name:48s} {rate:14,.0f} {rate / med['python_loop']:8.1f}x")
    paired = [a / b for a, b in zip(rates["embedtrain"], rates["python_loop"])]
    ratios = {"vs_python_loop": med["embedtrain"] / med["python_loop"],
              "vs_python_loop_per_round": [round(x, 1) for x in paired],
              "fraction_of_floor": med["embedtrain"] / floor,
              "fraction_of_cache_line_floor": med["embedtrain"] / line_floor,
              "two_threads_vs_one": med["embedtrain_2_threads"] / med["embedtrain"],
              "weighted_vs_uniform": med["weighted"] / med["embedtrain"]}
    print("ratios: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                 for k, v in ratios.items()))
    return {"edges_per_s": {"embedtrain": med["embedtrain"], "python_loop": med["python_loop"],
                            "embedtrain_2_threads": med["embedtrain_2_threads"],
                            "embedtrain_weighted": med["weighted"], "floor": floor,
                            "cache_line_floor": line_floor},
            "ratios": ratios,
            "per_round": rates,
            "copy_bandwidth_gb_s": bw / 1e9,
            "bytes_per_sampled_edge": statistics.median(bytes_per_edge),
            "sampled_edges_per_batch": edges_per_batch,
            "nodes": n, "edges": e, "max_degree": int(deg.max()), "avg_degree": args.avg_degree,
            "graph": args.graph, "fanouts": fanouts, "batch": args.batch,
            "batches_per_round": args.batches, "loop_batches_per_round": args.loop_batches,
            "rounds": args.rounds, "seed": args.seed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1_000_000)
    parser.add_argument("--avg-degree", type=float, default=20.0)
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--graph", help="a graph data set directory to load (memory-mapped)")
    parser.add_argument("--fanouts", type=int, nargs="+", default=[15, 10])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--batches", type=int, default=20, help="sampler batches per round")
    parser.add_argument("--loop-batches", type=int, default=2, help="Python-loop batches/round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mmap-test", action="store_true",
                        help="write a graph to --graph-dir and sample it memory-mapped")
    parser.add_argument("--graph-dir", default="/tmp/bench_graph_mmap")
    parser.add_argument("--child", choices=["write", "sample", "sample-cold"],
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mmap_child(args)
        return
    result = mmap_test(args) if args.mmap_test else main_run(args)
    result["command"] = " ".join(sys.argv)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
