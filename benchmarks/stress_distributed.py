"""Stress test of 2-rank training: many short `embedtrain train --nproc 2` runs, two at a time.

Counts, per task family (CTR, XC, GNN node classification, GNN link prediction):
- aborts: a rank killed by SIGABRT (e.g. "terminate called without an active exception");
- hangs: a run still going after ``--timeout`` seconds (its process group is killed);
- errors: any other non-zero exit (the last line of its output is kept);
- distinct results: how many different final results the family's successful runs gave (the
  test metrics, losses, steps and examples of ``summary.json``; 1 = every repeat identical).

Not part of ``make test``: it takes minutes. Prints a table and writes JSON.

Usage:
    python benchmarks/stress_distributed.py --runs 100 --json benchmarks/out/stress.json
    python benchmarks/stress_distributed.py --runs 40 --repo /tmp/base   # another checkout

``--repo`` runs another checkout of embedtrain (e.g. ``git worktree add /tmp/base <commit>``)
with this environment, to compare before and after a change in one session.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# family -> (config, data set kind, overrides); short runs that evaluate and checkpoint.
FAMILIES = {
    "ctr": ("configs/dlrm_synthetic.yaml", "ctr", [
        "data.batch_size=256", "data.eval_batch_size=1024", "train.max_steps=40",
        "train.eval_every=20", "train.checkpoint_every=20", "train.eval_max_batches=2"]),
    "xc": ("configs/xc_synthetic.yaml", "xc", [
        "data.batch_size=128", "data.eval_batch_size=512", "xc.embedding_dim=16", "xc.mlp=[32]",
        "head.kind=partial_fc", "head.sample_rate=0.3", "train.max_steps=30",
        "train.eval_every=15", "train.checkpoint_every=15", "train.eval_max_batches=2"]),
    "gnn_node": ("configs/gnn_node.yaml", "graph", [
        "data.batch_size=256", "data.eval_batch_size=1024", "gnn.hidden=[32,32]",
        "gnn.embedding_dim=8", "train.max_steps=16", "train.eval_every=8",
        "train.checkpoint_every=8", "train.eval_max_batches=2"]),
    "gnn_link": ("configs/gnn_link.yaml", "graph_link", [
        "data.batch_size=256", "data.eval_batch_size=512", "gnn.hidden=[32,32]",
        "gnn.embedding_dim=8", "gnn.out_dim=16", "train.max_steps=16", "train.eval_every=8",
        "train.checkpoint_every=8", "train.eval_max_batches=2"]),
}
DATAGEN = {
    "ctr": ["ctr", "--rows", "20000"],
    "xc": ["xc", "--classes", "500", "--rows", "8000", "--vocab", "2000"],
    "graph": ["graph", "--nodes", "5000", "--avg-degree", "8"],
    "graph_link": ["graph", "--nodes", "5000", "--avg-degree", "8", "--link-fraction", "0.1"],
}
# summary.json keys that vary from run to run by design.
TIMINGS = {"train_examples_per_s", "train_time_s", "wall_time_s", "peak_rss_gb_per_rank"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="runs in all, spread over families")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time (default 2)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a hang")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--work", default="/tmp/embedtrain_stress", help="data and run dirs")
    parser.add_argument("--repo", default=str(ROOT), help="embedtrain checkout to run")
    parser.add_argument("--json", required=True, help="where to write the results")
    args = parser.parse_args()

    repo, work = Path(args.repo).resolve(), Path(args.work)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    data = _datasets(work / "data", {FAMILIES[f][1] for f in families}, env)
    jobs = [(families[i % len(families)], i) for i in range(args.runs)]
    started = time.perf_counter()
    results: list[dict] = []

    def one(job: tuple[str, int]) -> dict:
        family, i = job
        config, kind, overrides = FAMILIES[family]
        out = work / "runs" / f"{family}-{i:04d}"
        cmd = [sys.executable, "-m", "embedtrain", "train", config, "--out", str(out),
               "--overwrite", "--nproc", "2", "--no-progress", "--set", f"data.path={data[kind]}"]
        for o in overrides:
            cmd += ["--set", o]
        result = _run(cmd, repo, env, args.timeout)
        result.update(family=family, run=i)
        if result["outcome"] == "ok":
            summary = json.loads((out / "summary.json").read_text())
            result["result"] = {k: v for k, v in summary.items() if k not in TIMINGS}
        done = len(results) + 1
        print(f"[{done}/{len(jobs)}] {family} #{i}: {result['outcome']} in "
              f"{result['seconds']:.1f} s", file=sys.stderr, flush=True)
        results.append(result)
        return result

    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(one, jobs))
    table = _table(results, families)
    report = {"repo": str(repo), "runs": len(results), "parallel": args.parallel,
              "timeout_s": args.timeout, "wall_s": round(time.perf_counter() - started, 1),
              "families": table,
              "failures": [{k: r[k] for k in ("family", "run", "outcome", "returncode", "tail")}
                           for r in results if r["outcome"] != "ok"]}
    _print(report)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


def _datasets(root: Path, kinds: set[str], env: dict) -> dict[str, Path]:
    """Generates each kind's data set once (with this checkout, so every run reads the same)."""
    out = {}
    for kind in sorted(kinds):
        path = root / kind
        if not (path / "metadata.json").is_file():
            subprocess.run([sys.executable, "-m", "embedtrain", "datagen", *DATAGEN[kind],
                            "--out", str(path)], check=True, cwd=ROOT, capture_output=True,
                           env={**env, "PYTHONPATH": str(ROOT)})
        out[kind] = path.resolve()
    return out


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        hung = True
    seconds = time.perf_counter() - start
    aborted = ("terminate called" in output or "SIGABRT" in output
               or proc.returncode in (-signal.SIGABRT, 128 + signal.SIGABRT))
    outcome = ("hang" if hung else "abort" if aborted else "ok" if proc.returncode == 0
               else "error")
    lines = [line for line in output.splitlines() if line.strip()]
    return {"outcome": outcome, "returncode": proc.returncode, "seconds": seconds,
            "tail": lines[-1] if lines and outcome != "ok" else ""}


def _table(results: list[dict], families: list[str]) -> dict:
    table = {}
    for family in families:
        mine = [r for r in results if r["family"] == family]
        ok = [r for r in mine if r["outcome"] == "ok"]
        distinct = {json.dumps(r["result"], sort_keys=True) for r in ok}
        table[family] = {
            "runs": len(mine), "ok": len(ok),
            "aborts": sum(r["outcome"] == "abort" for r in mine),
            "hangs": sum(r["outcome"] == "hang" for r in mine),
            "errors": sum(r["outcome"] == "error" for r in mine),
            "distinct_results": len(distinct),
            "median_s": round(statistics.median(r["seconds"] for r in mine), 1) if mine else None,
        }
    return table


def _print(report: dict) -> None:
    print(f"\n{report['runs']} runs of 2 ranks, {report['parallel']} at a time, "
          f"{report['wall_s']:.0f} s, code: {report['repo']}")
    print(f"{'family':<10} {'runs':>5} {'ok':>5} {'aborts':>7} {'hangs':>6} {'errors':>7} "
          f"{'distinct':>9} {'median s':>9}")
    for family, row in report["families"].items():
        print(f"{family:<10} {row['runs']:>5} {row['ok']:>5} {row['aborts']:>7} {row['hangs']:>6} "
              f"{row['errors']:>7} {row['distinct_results']:>9} {row['median_s']:>9}")
    for failure in report["failures"][:10]:
        print(f"  {failure['family']} #{failure['run']}: {failure['outcome']} "
              f"(exit {failure['returncode']}): {failure['tail'][:160]}")


if __name__ == "__main__":
    main()
