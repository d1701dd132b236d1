"""The allocator under the training steps: glibc's defaults vs embedtrain's setting vs jemalloc/tcmalloc.

Each (allocator, workload) pair runs in a fresh process (an allocator is chosen at process start),
the allocators alternating within every round so that machine noise hits each alike:

- allocators: ``glibc`` (``EMBEDTRAIN_MALLOC=default``: glibc's dynamic mmap threshold),
  ``embedtrain`` (what every ``embedtrain`` process does by default: ``mallopt`` serves every block
  from the heap and keeps the heap untrimmed, torch asks for huge pages; :mod:`embedtrain.runtime`),
  its two halves alone (``mallopt_only``: ``THP_MEM_ALLOC_ENABLE=0``; ``thp_only``: glibc's
  defaults with torch's huge pages), and, where the system has
  them (Debian's ``libjemalloc2``, ``libtcmalloc-minimal4``), ``jemalloc`` and ``tcmalloc`` through
  ``LD_PRELOAD``;
- workloads: ``demo`` (``embedtrain train configs/dlrm_synthetic.yaml``, ``--demo-steps`` steps on
  ``data/synthetic_ctr``), ``gnn`` (``configs/gnn_node.yaml`` on ``data/synthetic_graph``,
  ``--gnn-steps`` steps), ``xc`` (``benchmarks/bench_xc.py --skip-accuracy``: every head's step at
  ``--xc-classes`` x 128, batch 512). The train runs report ``train_examples_per_s`` (step time
  only: no start-up, evaluation or checkpoint), turned into ms per step; bench_xc its medians.

Usage:
    python benchmarks/bench_allocator.py --json benchmarks/out/allocator.json [--rounds 2]
        [--workloads demo,gnn,xc] [--xc-classes 1000000] [--allocators glibc,embedtrain,...]

Prints a table (median ms per step, and each allocator against glibc's) and writes the JSON:
``ms_per_step[workload][allocator]``, ``vs_glibc[workload][allocator]`` (glibc ms / its ms:
above 1 is faster), ``xc_step_ms[allocator][head]`` and ``xc_full_vs[allocator][head]`` (the XC
ratios under each allocator), every run's figures under ``runs``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRELOADS = {"jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
            "tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"}


def allocators() -> dict[str, dict[str, str]]:
    """Environment of each allocator available here."""
    out = {"glibc": {"EMBEDTRAIN_MALLOC": "default"}, "embedtrain": {},
           # embedtrain's two halves alone: glibc's mallopt without torch's huge pages, and
           # torch's huge pages over glibc's defaults
           "mallopt_only": {"THP_MEM_ALLOC_ENABLE": "0"},
           "thp_only": {"EMBEDTRAIN_MALLOC": "default", "THP_MEM_ALLOC_ENABLE": "1"}}
    for name, path in PRELOADS.items():
        if Path(path).is_file():
            out[name] = {"LD_PRELOAD": path}
    return out


def _env(extra: dict[str, str]) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items()
            if k not in ("EMBEDTRAIN_MALLOC", "LD_PRELOAD", "THP_MEM_ALLOC_ENABLE")
            and not k.startswith("MALLOC_")}
    return {**keep, "PYTHONPATH": str(ROOT), **extra}


def train_ms(config: str, steps: int, env: dict[str, str], overrides: list[str]) -> dict:
    """One ``embedtrain train`` run: ms per training step from its summary."""
    with tempfile.TemporaryDirectory(prefix="bench_alloc_") as out:
        cmd = [sys.executable, "-m", "embedtrain", "train", config, "--out", out, "--no-progress",
               "--set", f"train.max_steps={steps}", "--set", "train.eval_every=0",
               "--set", "train.checkpoint_every=0", *[a for o in overrides for a in ("--set", o)]]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        s = json.loads((Path(out) / "summary.json").read_text())
        batch = s["examples"] / s["steps"]
        return {"ms_per_step": 1e3 * batch / s["train_examples_per_s"],
                "examples_per_s": s["train_examples_per_s"], "startup_s": s.get("startup_s"),
                "peak_rss_gb": max(s["peak_rss_gb_per_rank"])}


def xc_ms(classes: int, env: dict[str, str]) -> dict:
    """``bench_xc.py``'s step-time part in a fresh process: every head's median ms."""
    with tempfile.TemporaryDirectory(prefix="bench_alloc_xc_") as tmp:
        out = Path(tmp) / "xc.json"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_xc.py"), "--skip-accuracy",
               "--classes", str(classes), "--steps", "2", "--rounds", "1", "--json", str(out)]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        return {"step_ms": json.loads(out.read_text())["step_ms"]}


def ensure_data() -> None:
    """The demo and graph data sets (``make demo``'s and ``embedtrain datagen graph``'s)."""
    for path, args in (("data/synthetic_ctr", ["ctr", "--rows", "3000000"]),
                       ("data/synthetic_graph", ["graph", "--nodes", "100000", "--avg-degree", "10"])):
        if not (ROOT / path / "metadata.json").is_file():
            subprocess.run([sys.executable, "-m", "embedtrain", "datagen", *args, "--out", path],
                           cwd=ROOT, check=True, env=_env({}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", default="demo,gnn,xc")
    parser.add_argument("--demo-steps", type=int, default=300)
    parser.add_argument("--gnn-steps", type=int, default=100)
    parser.add_argument("--xc-classes", type=int, default=1_000_000)
    parser.add_argument("--allocators", help="comma-separated subset (default: all found here)")
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    allocs = allocators()
    if args.allocators:
        unknown = set(args.allocators.split(",")) - set(allocs)
        if unknown or "glibc" not in args.allocators.split(","):
            parser.error(f"--allocators: {', '.join(sorted(unknown)) or 'glibc missing'} "
                         f"(known here: {', '.join(allocs)}; glibc is the reference)")
        allocs = {a: allocs[a] for a in args.allocators.split(",")}
    ensure_data()
    runs: dict[str, dict[str, list[dict]]] = {w: {a: [] for a in allocs} for w in workloads}
    started = time.time()
    for r in range(args.rounds):
        order = list(allocs) if r % 2 == 0 else list(reversed(allocs))
        for workload in workloads:
            for name in order:
                env = _env(allocs[name])
                if workload == "demo":
                    result = train_ms("configs/dlrm_synthetic.yaml", args.demo_steps, env, [])
                elif workload == "gnn":
                    result = train_ms("configs/gnn_node.yaml", args.gnn_steps, env, [])
                else:
                    result = xc_ms(args.xc_classes, env)
                runs[workload][name].append(result)
                shown = (f"{result['ms_per_step']:.1f} ms/step" if "ms_per_step" in result else
                         ", ".join(f"{h} {ms:,.0f}" for h, ms in result["step_ms"].items()))
                print(f"round {r + 1} {workload:<5} {name:<10} {shown}  "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    out: dict = {"rounds": args.rounds, "allocators": allocs, "runs": runs,
                 "wall_s": time.time() - started, "ms_per_step": {}, "vs_glibc": {}}
    for workload in workloads:
        if workload == "xc":
            heads = list(runs["xc"]["glibc"][0]["step_ms"])
            med = {a: {h: statistics.median(x["step_ms"][h] for x in rs) for h in heads}
                   for a, rs in runs["xc"].items()}
            out["xc_step_ms"] = med
            out["xc_full_vs"] = {a: {h: m["full"] / ms for h, ms in m.items() if h != "full"}
                                 for a, m in med.items()}
            out["ms_per_step"]["xc"] = {a: m for a, m in med.items()}
            out["vs_glibc"]["xc"] = {a: {h: med["glibc"][h] / ms for h, ms in m.items()}
                                     for a, m in med.items()}
            continue
        med = {a: statistics.median(x["ms_per_step"] for x in rs) for a, rs in runs[workload].items()}
        out["ms_per_step"][workload] = med
        out["vs_glibc"][workload] = {a: med["glibc"] / ms for a, ms in med.items()}
    print(f"\n| workload | {' | '.join(allocs)} |")
    print(f"|---|{'---:|' * len(allocs)}")
    for workload in workloads:
        if workload == "xc":
            for head in out["xc_step_ms"]["glibc"]:
                cells = [f"{out['xc_step_ms'][a][head]:,.0f} ({out['vs_glibc']['xc'][a][head]:.2f}x)"
                         for a in allocs]
                print(f"| xc {head} ms | {' | '.join(cells)} |")
            continue
        cells = [f"{out['ms_per_step'][workload][a]:.1f} ({out['vs_glibc'][workload][a]:.2f}x)"
                 for a in allocs]
        print(f"| {workload} ms/step | {' | '.join(cells)} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
