"""Two installed stacks side by side: the demo and the headline speed rows, run by each
interpreter in turn (old, new, old, new, ...), on the same checkout and the same data.

For an upgrade of torch / FBGEMM / TorchRec: install the new stack in a second virtual
environment (e.g. a worktree's ``make install``), then::

    python benchmarks/bench_stack.py --python .venv/bin/python --python ../up/.venv/bin/python \\
        --json benchmarks/out/stack.json

Each row is one benchmark script of this folder (or the demo's ``embedtrain train``) with
reduced sizes, its JSON read back; ``--rounds`` repeats the whole alternation and the table
shows medians. The stack of each interpreter (torch, fbgemm-gpu(-cpu), torchrec) is read from
the interpreter itself. Rows: the demo (test AUC, training examples/s), the training loop
(hand-written DMP loop, Trainer step, Trainer + reader: examples/s), the embedding step
(``bench_roofline.py``: demo and large tables, ms), XC heads at 1M classes (ms a step), serving
(p50 ms of one row, rows/s at batch 1024, torch.export and AOTInductor) and TorchRec's stock
planner on 20 tables (s).
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
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

VERSIONS = ("import json, importlib.metadata as m\n"
            "def v(n):\n"
            "    try: return m.version(n)\n"
            "    except m.PackageNotFoundError: return None\n"
            "print(json.dumps({'torch': v('torch'), 'fbgemm': v('fbgemm-gpu-cpu') or "
            "v('fbgemm-gpu'), 'torchrec': v('torchrec')}))")


def _demo(py: str, work: Path) -> tuple[list[str], Callable[[Path], dict[str, float]]]:
    out = work / "demo"
    argv = [py, "-m", "embedtrain", "train", str(ROOT / "configs/dlrm_synthetic.yaml"),
            "--out", str(out), "--overwrite"]

    def read(_: Path) -> dict[str, float]:
        s = json.loads((out / "summary.json").read_text())
        return {"demo test AUC": s["auc"], "demo training examples/s": s["train_examples_per_s"]}
    return argv, read


def _script(name: str, *args: str, read: Callable[[dict], dict[str, float]]):
    def make(py: str, work: Path):
        out = work / f"{name}.json"
        argv = [py, str(BENCH / f"{name}.py"), *args, "--json", str(out)]
        return argv, lambda _: read(json.loads(out.read_text()))
    return make


def _train_loop(r: dict) -> dict[str, float]:
    rows = r["rows"]
    return {f"{n} examples/s": rows[n]["median_examples_per_s"] for n in
            ("hand-written DMP loop", "Trainer step", "Trainer + ParquetBatchReader")}


def _roofline(r: dict) -> dict[str, float]:
    return {f"embedding step {n} ms": c["sharded_ms"]["total"] for n, c in r["configs"].items()}


def _xc(r: dict) -> dict[str, float]:
    return {f"XC 1M x 128 {n} ms/step": ms for n, ms in r["step_ms"].items()}


def _serving(r: dict) -> dict[str, float]:
    out = {}
    for program, lat in r["latency_ms"].items():
        out[f"serving {program} p50 ms (1 row)"] = lat["p50"]
        out[f"serving {program} rows/s @1024"] = r["rows_per_s"][program]["1024"]
    return out


def _planner(r: dict) -> dict[str, float]:
    out = {f"TorchRec stock planner, {n} tables, s": s for n, s in r["stock_seconds"].items()}
    for n, s in r["seconds"].items():
        out[f"embedtrain planner, {n} tables, s"] = s
    return out


ROWS: dict[str, Callable[[str, Path], tuple[list[str], Callable]]] = {
    "demo": _demo,
    "train_loop": _script("bench_train_loop", "--steps", "100", "--rounds", "3",
                          read=_train_loop),
    "roofline": _script("bench_roofline", "--memory", "embedtrain", "--rounds", "3",
                        read=_roofline),
    "xc": _script("bench_xc", "--classes", "1000000", "--dim", "128", "--skip-accuracy",
                  "--heads", "partial_fc,hard_negatives_clustered,adaptive", "--steps", "4",
                  "--rounds", "2", read=_xc),
    "serving": _script("bench_serving", "--rows", "100000", "--steps", "100", "--requests", "300",
                       "--seconds", "2", read=_serving),
    "planner": _script("bench_planner", "--tables", "20", "--ranks", "16", "--stock-sizes", "20",
                       "--rounds", "1", read=_planner),
}


def stack_of(py: str) -> dict[str, str]:
    """torch / FBGEMM / TorchRec as ``py`` has them installed."""
    r = subprocess.run([py, "-c", VERSIONS], capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", action="append", required=True,
                   help="an interpreter of a stack (give two or more, in order)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"which rows (default: {','.join(ROWS)})")
    p.add_argument("--rounds", type=int, default=1, help="alternations of the whole set")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    rows = args.rows.split(",")
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        p.error(f"--rows: unknown {', '.join(unknown)}; known: {', '.join(ROWS)}")
    stacks = [stack_of(py) for py in args.python]
    labels = [f"torch {s['torch']} / fbgemm {s['fbgemm']} / torchrec {s['torchrec']}"
              for s in stacks]
    values: dict[str, list[dict[str, list[float]]]] = {r: [{} for _ in stacks] for r in rows}
    # every interpreter runs this checkout's code, whichever checkout it was installed from
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory(prefix="bench_stack_") as tmp:
        for rnd in range(args.rounds):
            for row in rows:
                for i, py in enumerate(args.python):
                    work = Path(tmp) / f"{row}_{i}_{rnd}"
                    work.mkdir()
                    argv, read = ROWS[row](py, work)
                    print(f"[round {rnd + 1}/{args.rounds}] {row} on {labels[i]} ...", flush=True)
                    t0 = time.perf_counter()
                    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env)
                    if r.returncode != 0:
                        print(r.stdout[-2000:], r.stderr[-4000:], sep="\n", file=sys.stderr)
                        raise SystemExit(f"bench_stack: {row} failed on {labels[i]} "
                                         f"(exit {r.returncode})")
                    for k, v in read(work).items():
                        values[row][i].setdefault(k, []).append(v)
                    print(f"  {time.perf_counter() - t0:.0f} s: {values[row][i]}", flush=True)
    table: dict[str, Any] = {}
    width = max(len(k) for r in rows for k in values[r][0]) + 2
    print(f"\n{'row':<{width}}" + "".join(f"{f'stack {i + 1}':>14}" for i in range(len(stacks)))
          + f"{'2 / 1':>9}")
    for row in rows:
        for key in values[row][0]:
            med = [statistics.median(values[row][i][key]) for i in range(len(stacks))]
            table[key] = {"medians": med, "all": [values[row][i][key] for i in range(len(stacks))]}
            print(f"{key:<{width}}" + "".join(f"{m:>14,.4f}" if m < 10 else f"{m:>14,.1f}"
                                              for m in med) + f"{med[1] / med[0]:>8.3f}x"
                  if len(med) > 1 else "")
    for i, label in enumerate(labels):
        print(f"stack {i + 1}: {label} ({args.python[i]})")
    out = {"stacks": stacks, "pythons": args.python, "rounds": args.rounds, "rows": table,
           "command": " ".join(["python", *sys.argv])}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
