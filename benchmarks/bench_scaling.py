"""Scaling on this machine: the demo DLRM trained by 1 and 2 gloo ranks at the same global batch.

Every configuration is a real ``embedtrain train`` subprocess (``--nproc 2`` goes through torchrun,
gloo over loopback) of ``configs/dlrm_synthetic.yaml`` (26 tables x 16 dims, global batch 2048, so
each of 2 ranks reads 1024 rows per step) for ``--steps`` steps, no periodic evaluation, one
checkpoint at the end, in a fresh run directory. The figure is ``summary.json``'s
``train_examples_per_s``: global examples per second of training-step time only (start-up,
planning, evaluation and the checkpoint are excluded; the first steps' warm-up is included).
Configurations (``--one-rank-table-wise`` adds the last):

- ``1 rank``: planner's choice, the default threads (cores / local ranks: all cores);
- ``1 rank, 1 thread``: planner's choice with ``EMBEDTRAIN_THREADS=1``, the per-rank thread count
  of the 2-rank runs;
- ``2 ranks``: planner's choice, the default threads (cores / local ranks: one each here);
- ``2 ranks, 2 threads each``: ``EMBEDTRAIN_THREADS=2``, both ranks on all cores (what a launcher
  that leaves torch's default per process gets: the ranks fight for the cores);
- ``2 ranks, row_wise`` / ``2 ranks, table_wise``: ``sharding.sharding_types`` forced;
- ``1 rank, table_wise``: baseline for the forced types (the 1-rank planner already picks
  row_wise, so ``1 rank`` is the row_wise one).

Threads: each rank's torch intra-op threads are what embedtrain sets (``embedtrain.runtime``:
cores / ranks on this machine unless ``EMBEDTRAIN_THREADS`` or ``train.threads_per_rank`` says
otherwise), so ``1 rank`` uses every core and each of the 2 ranks half of them: both use all
cores, the fair comparison of what a user gets; ``1 rank, 1 thread`` isolates the per-rank cost at
equal threads. Each run's count is read from its ``summary.json`` (``threads_per_rank``). Loader
threads (``data.num_workers``, per rank) come on top and are recorded too. On a machine shared with other jobs the default 2 threads of the
1-rank run can collapse (seen here: 3-12k ex/s at load average 3-6, against 32-42k at ~2), while 1
thread per process degrades gently; every run records the 1-minute load average before and after.

Rounds alternate the configurations (round-robin, the order rotated every round) so machine noise
hits them alike; each figure is the median over ``--rounds``. Unless ``--eval-rows 0``, the runs
read a view of the data set whose train split is the original files and whose valid/test splits
hold the first ``--eval-rows`` rows (the final evaluation over 600k rows would otherwise dominate
wall time, and it is not part of the figure). Without ``--data`` the demo data set
(``data/synthetic_ctr``) is used if present, else 1M rows are generated into
``/tmp/bench_scaling_data``.

Usage:
    python benchmarks/bench_scaling.py --json benchmarks/out/scaling.json \
        [--steps 300] [--rounds 2] [--one-rank-table-wise] [--data DIR] [--eval-rows 32768]

Prints a table; JSON: ``examples_per_s`` (median per configuration), ``ratios`` (``two_vs_one``,
``two_vs_one_thread``, ``threads_cores_per_rank_vs_all_cores_each``, ``row_wise_vs_table_wise``),
``sharding`` (types used, from each run's ``plan.json``), ``threads_per_rank``, ``cores``, ``runs`` (every run: rate, steps, times, load average),
``command``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from embedtrain.config import load_config

ROOT = Path(__file__).resolve().parent.parent
DEMO_DATA = ROOT / "data/synthetic_ctr"
GENERATED_DATA = Path("/tmp/bench_scaling_data")
CONFIG = "configs/dlrm_synthetic.yaml"

# name -> (ranks, forced sharding types or None, EMBEDTRAIN_THREADS to set or None: default)
CONFIGS = {
    "1 rank": (1, None, None),
    "1 rank, 1 thread": (1, None, "1"),
    "2 ranks": (2, None, None),
    "2 ranks, 2 threads each": (2, None, "2"),
    "2 ranks, row_wise": (2, "row_wise", None),
    "2 ranks, table_wise": (2, "table_wise", None),
}
ONE_RANK_TW = ("1 rank, table_wise", (1, "table_wise", None))


def _env(threads: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "EMBEDTRAIN_THREADS"}
    if threads is not None:
        env["EMBEDTRAIN_THREADS"] = threads
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def ensure_data(path: str | None) -> Path:
    if path:
        return Path(path).resolve()
    if (DEMO_DATA / "metadata.json").is_file():
        return DEMO_DATA
    if not (GENERATED_DATA / "metadata.json").is_file():
        print(f"generating 1M rows into {GENERATED_DATA}", flush=True)
        subprocess.run([sys.executable, "-m", "embedtrain", "datagen", "ctr", "--rows", "1000000",
                        "--out", str(GENERATED_DATA)], check=True, cwd=ROOT)
    return GENERATED_DATA


def eval_view(data: Path, rows: int, tmp: Path) -> Path:
    """``data`` with its train split as is and valid/test cut to their first ``rows`` rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = json.loads((data / "metadata.json").read_text())
    view = tmp / "data_view"
    view.mkdir()
    for split, info in meta["splits"].items():
        files = [str((data / f).resolve()) for f in info["files"]]
        if split == "train":
            info["files"] = files
            continue
        batches, have = [], 0
        for f in files:
            for b in pq.ParquetFile(f).iter_batches(batch_size=min(rows, 65_536)):
                b = b.slice(0, rows - have)
                batches.append(b)
                have += b.num_rows
                if have >= rows:
                    break
            if have >= rows:
                break
        table = pa.Table.from_batches(batches)
        # 8 row groups: both ranks own some (a rank without a row group cannot evaluate).
        out = view / f"{split}.parquet"
        pq.write_table(table, out, row_group_size=max(1, -(-table.num_rows // 8)))
        info["files"], info["rows"] = [out.name], table.num_rows
    (view / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    return view


def train_once(name: str, spec: tuple, data: Path, steps: int, out: Path) -> dict[str, object]:
    ranks, types, threads = spec
    cmd = [sys.executable, "-m", "embedtrain", "train", CONFIG,
           "--out", str(out), "--no-progress",
           "--set", f"data.path={data}",
           "--set", f"train.max_steps={steps}",
           "--set", "train.eval_every=0",
           "--set", "train.checkpoint_every=0",
           "--set", "train.eval_max_batches=1"]
    if types:
        cmd += ["--set", f"sharding.sharding_types=[{types}]"]
    if ranks > 1:
        cmd += ["--nproc", str(ranks)]
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(threads), capture_output=True, text=True)
    wall = time.perf_counter() - start
    record: dict[str, object] = {"config": name, "ranks": ranks, "wall_s": wall,
                                 "load_avg_1m_before": load_before,
                                 "load_avg_1m_after": os.getloadavg()[0],
                                 "command": " ".join(cmd)}
    summary_path = out / "summary.json"
    if proc.returncode or not summary_path.is_file():
        record["error"] = f"exit status {proc.returncode}"
        record["stderr_tail"] = proc.stderr[-4000:]
        return record
    summary = json.loads(summary_path.read_text())
    plan = json.loads((out / "plan.json").read_text())
    record.update({k: summary.get(k) for k in ("train_examples_per_s", "train_time_s",
                                                 "wall_time_s", "steps", "world_size", "auc",
                                                 "threads_per_rank", "startup_s")})
    record["sharding_types"] = plan["summary"]["sharding_types"]
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="output JSON file")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs per configuration (median)")
    parser.add_argument("--data", help="data set directory (default: data/synthetic_ctr, "
                        "else 1M generated rows in /tmp/bench_scaling_data)")
    parser.add_argument("--eval-rows", type=int, default=32_768,
                        help="rows of the valid/test splits the runs evaluate on (0: all)")
    parser.add_argument("--one-rank-table-wise", action="store_true",
                        help="also run 1 rank with all tables table_wise")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args()

    configs = dict(CONFIGS)
    if args.one_rank_table_wise:
        configs[ONE_RANK_TW[0]] = ONE_RANK_TW[1]
    data = ensure_data(args.data)
    tmp = Path(tempfile.mkdtemp(prefix="bench_scaling_"))
    try:
        run_data = eval_view(data, args.eval_rows, tmp) if args.eval_rows else data
        cfg = load_config(ROOT / CONFIG)
        print(f"cores: {os.cpu_count()}, data: {data} (eval rows: {args.eval_rows or 'all'}), "
              f"{args.steps} steps x {args.rounds} rounds", flush=True)

        runs: list[dict] = []
        names = list(configs)
        n = 0
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                n += 1
                rec = train_once(name, configs[name], run_data, args.steps, tmp / f"run{n}")
                rec["round"] = r
                runs.append(rec)
                if "error" in rec:
                    print(f"round {r} {name:<22} FAILED ({rec['error']}):\n{rec['stderr_tail']}",
                          flush=True)
                else:
                    print(f"round {r} {name:<22} {rec['train_examples_per_s']:>9,.0f} ex/s "
                          f"({rec['steps']} steps, train {rec['train_time_s']:.1f} s, "
                          f"wall {rec['wall_s']:.1f} s, load {rec['load_avg_1m_before']:.1f})",
                          flush=True)
                if not args.keep:
                    shutil.rmtree(tmp / f"run{n}", ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    rates, sharding, steps, threads = {}, {}, {}, {}
    for name in configs:
        ok = [x for x in runs if x["config"] == name and "error" not in x]
        if ok:
            rates[name] = statistics.median(x["train_examples_per_s"] for x in ok)
            sharding[name] = ok[-1]["sharding_types"]
            steps[name] = ok[-1]["steps"]
            threads[name] = ok[-1]["threads_per_rank"]

    def ratio(a: str, b: str) -> float | None:
        return rates[a] / rates[b] if a in rates and b in rates else None

    ratios = {"two_vs_one": ratio("2 ranks", "1 rank"),
              "two_vs_one_thread": ratio("2 ranks", "1 rank, 1 thread"),
              "threads_cores_per_rank_vs_all_cores_each": ratio("2 ranks",
                                                                "2 ranks, 2 threads each"),
              "row_wise_vs_table_wise": ratio("2 ranks, row_wise", "2 ranks, table_wise")}
    if args.one_rank_table_wise:
        ratios["two_vs_one_table_wise"] = ratio("2 ranks, table_wise", "1 rank, table_wise")

    print()
    print(f"{'configuration':<22} {'median ex/s':>12} {'vs 1 rank':>10} {'threads/rank':>13} "
          f"{'steps':>6}  sharding (plan.json)")
    base = rates.get("1 rank")
    for name in configs:
        if name not in rates:
            print(f"{name:<22} {'failed':>12}")
            continue
        t = threads.get(name, "?")
        kinds = ", ".join(f"{k} x{v}" for k, v in sharding[name].items())
        rel = f"{rates[name] / base:.2f}x" if base else "-"
        print(f"{name:<22} {rates[name]:>12,.0f} {rel:>10} {t!s:>13} {steps[name]:>6}  {kinds}")
    print()
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}" if v is not None else f"{k}: n/a")

    out = {
        "examples_per_s": rates,
        "ratios": ratios,
        "sharding": sharding,
        "steps": steps,
        "cores": os.cpu_count(),
        "threads_per_rank": threads,
        "loader_threads_per_rank": cfg.data.num_workers,
        "global_batch": cfg.data.batch_size,
        "steps_per_run": args.steps,
        "rounds": args.rounds,
        "data": str(data),
        "eval_rows": args.eval_rows or "all",
        "runs": runs,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 1 if any("error" in x for x in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
