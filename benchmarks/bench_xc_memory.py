"""Extreme classification memory per rank: a row-split class head on 1 and 2 CPU ranks.

Every run is a real ``embedtrain train configs/xc_synthetic.yaml --nproc N`` (torchrun, gloo over
loopback, 1 intra-op thread per rank) with a ``partial_fc`` head (``--rate``) of ``D = 128``
(the config's ``xc.mlp[-1]``), Adagrad on the head's slice (``HeadConfig`` defaults), no
periodic evaluation, one checkpoint at the end:

- Part 1, the split (``--classes``, default 10^6, ``--steps`` steps): one rank, then two.
  From each run's ``plan_vs_measured.json`` (bytes each rank holds right after sharding:
  embedding tables + the head's slice + its optimizer state) the token table's share (its
  shards in ``plan.json``) is subtracted, leaving the head's own bytes per rank, compared with
  ``C x D x 4 / W`` for weights and the same again for Adagrad's sum of squares.
- Part 2, a big head (``--big-classes``, default 10^7, ``--big-batch`` global batch,
  ``--big-steps`` steps) on two ranks: peak RSS per rank (``summary.json``'s
  ``peak_rss_gb_per_rank``: ``ru_maxrss``, so it includes the final evaluation and checkpoint)
  and the training-step time (``train_time_s / steps``).

Evaluation at the end scores every class for every example (10^7 x 128 per example), and the
trainer's final evaluation reads the whole valid split (``eval_max_batches`` only caps periodic
evaluations), so the runs read a view of the data set: train split as generated, valid and test
cut to their first ``--eval-rows`` rows (8 row groups, so both ranks hold some), evaluated in
batches of ``--eval-batch``. Data sets come from ``embedtrain datagen xc`` (reused when their
``metadata.json`` records the same settings); generation time and its peak RSS are recorded.
While a run goes, every process under it is sampled every 0.5 s (``VmRSS``), with the machine's
lowest ``MemAvailable``.

Usage:
    python benchmarks/bench_xc_memory.py --json benchmarks/out/xc_memory.json \
        [--classes 1000000] [--big-classes 10000000] [--skip-split] [--skip-big]

Prints two tables; JSON: ``split`` (per run and rank: measured, token-table and head bytes against
the expected halves), ``big`` (peak RSS per rank, step time), ``datagen``, ``command``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/xc_synthetic.yaml"
HEAD_TABLE = "class_head"
FLOAT_BYTES = 4


class RSSSampler:
    """Samples the resident memory of a process tree (and MemAvailable) in a thread."""

    def __init__(self, root_pid: int, every_s: float = 0.5) -> None:
        self.root, self.every = root_pid, every_s
        self.peak: dict[int, tuple[float, str]] = {}  # pid -> (max GiB, command line)
        self.rank: dict[int, int] = {}  # pid -> RANK of a torchrun worker
        self.peak_total_gb = 0.0
        self.min_available_gb = float("inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "RSSSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
        tree, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo += children.get(pid, [])
        return tree

    def _sample(self) -> None:
        total = 0.0
        for pid in self._tree():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            rss = next((int(line.split()[1]) for line in status.splitlines()
                        if line.startswith("VmRSS:")), 0) / 2**20
            total += rss
            if rss > self.peak.get(pid, (0.0, ""))[0]:
                self.peak[pid] = (rss, cmd[:160])
            if pid not in self.rank:
                self.rank[pid] = _env_rank(pid)
        self.peak_total_gb = max(self.peak_total_gb, total)
        meminfo = Path("/proc/meminfo").read_text()
        available = next(int(line.split()[1]) for line in meminfo.splitlines()
                         if line.startswith("MemAvailable:")) / 2**20
        self.min_available_gb = min(self.min_available_gb, available)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.every)

    def report(self) -> dict[str, Any]:
        top = sorted(self.peak.items(), key=lambda kv: -kv[1][0])[:4]
        ranks = {r: round(self.peak[pid][0], 3) for pid, r in self.rank.items() if r >= 0}
        return {"peak_tree_rss_gb": round(self.peak_total_gb, 3),
                "min_mem_available_gb": round(self.min_available_gb, 3),
                "peak_rss_gb_by_rank": [ranks[r] for r in sorted(ranks)],
                "peak_rss_gb_by_process": [{"pid": pid, "rss_gb": round(rss, 3), "cmd": cmd}
                                           for pid, (rss, cmd) in top]}


def _env_rank(pid: int) -> int:
    """``RANK`` in a process's environment (torchrun workers), -1 if none."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return -1
    return next((int(e[5:]) for e in env if e.startswith(b"RANK=")), -1)


def run_sampled(cmd: list[str], log: Path) -> tuple[int, float, dict[str, Any]]:
    """Runs ``cmd`` (output to ``log``) under the RSS sampler; (exit status, wall s, memory)."""
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        with RSSSampler(proc.pid) as sampler:
            status = proc.wait()
    return status, time.perf_counter() - start, sampler.report()


def ensure_data(path: Path, classes: int, rows: int, vocab: int, logs: Path) -> dict[str, Any]:
    """``embedtrain datagen xc`` into ``path`` unless it already holds the same data set."""
    meta_file = path / "metadata.json"
    want = {"classes": classes, "rows": rows, "vocab": vocab, "seed": 0, "multi_label": False}
    if meta_file.is_file():
        generator = json.loads(meta_file.read_text()).get("generator", {})
        if all(generator.get(k) == v for k, v in want.items()):
            print(f"reusing {path}", flush=True)
            return {"path": str(path), "reused": True}
        raise SystemExit(f"{meta_file}: another data set is there; pass another data folder")
    cmd = [sys.executable, "-m", "embedtrain", "datagen", "xc", "--classes", str(classes),
           "--rows", str(rows), "--vocab", str(vocab), "--out", str(path)]
    status, wall, memory = run_sampled(cmd, logs / f"datagen_{path.name}.log")
    if status:
        tail = (logs / f"datagen_{path.name}.log").read_text()[-3000:]
        raise SystemExit(f"datagen failed (exit status {status}):\n{tail}")
    print(f"  generated in {wall:.0f} s, peak RSS {memory['peak_tree_rss_gb']:.2f} GiB", flush=True)
    return {"path": str(path), "reused": False, "wall_s": wall, "command": " ".join(cmd),
            **memory}


def eval_view(data: Path, rows: int, view: Path) -> Path:
    """``data`` with its train split as is and valid/test cut to their first ``rows`` rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = json.loads((data / "metadata.json").read_text())
    if view.exists():
        shutil.rmtree(view)
    view.mkdir(parents=True)
    for split, info in meta["splits"].items():
        files = [str((data / f).resolve()) for f in info["files"]]
        if split == "train":
            info["files"] = files
            continue
        table = pa.concat_tables(pq.read_table(f) for f in files).slice(0, rows)
        # 8 row groups: both ranks own some (a rank without a row group cannot evaluate).
        out = view / f"{split}.parquet"
        pq.write_table(table, out, row_group_size=max(1, -(-table.num_rows // 8)))
        info["files"], info["rows"] = [out.name], table.num_rows
    (view / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    return view


def train(name: str, data: Path, ranks: int, batch: int, steps: int,
          args: argparse.Namespace) -> dict[str, Any]:
    """One ``embedtrain train`` run; its summary, plan and measured bytes."""
    out = Path(args.runs) / name
    sets = [f"data.path={data}", f"data.batch_size={batch}",
            f"data.eval_batch_size={args.eval_batch}", "xc.head.kind=partial_fc",
            f"xc.head.sample_rate={args.rate}", f"train.max_steps={steps}", "train.epochs=1000",
            "train.eval_every=0", "train.eval_max_batches=1", "train.checkpoint_every=0",
            "train.progress=false"]
    cmd = [sys.executable, "-m", "embedtrain", "train", CONFIG, "--out", str(out), "--overwrite",
           "--no-progress", "--nproc", str(ranks)]
    for s in sets:
        cmd += ["--set", s]
    load_before = os.getloadavg()[0]
    status, wall, memory = run_sampled(cmd, Path(args.runs) / f"{name}.log")
    record: dict[str, Any] = {"name": name, "ranks": ranks, "batch": batch, "wall_s": wall,
                              "load_avg_1m": [load_before, os.getloadavg()[0]],
                              "command": " ".join(cmd), "sampled": memory}
    if status or not (out / "summary.json").is_file():
        record["error"] = f"exit status {status}"
        record["log_tail"] = (Path(args.runs) / f"{name}.log").read_text()[-4000:]
        print(record["log_tail"], file=sys.stderr)
        return record
    summary = json.loads((out / "summary.json").read_text())
    record.update({k: summary.get(k) for k in ("steps", "examples", "train_time_s",
                                                "train_examples_per_s", "peak_rss_gb_per_rank",
                                                "world_size", "p@1", "wall_time_s")})
    record["step_ms"] = 1e3 * summary["train_time_s"] / summary["steps"]
    record["per_rank"] = head_bytes(out, summary)
    return record


def head_bytes(run: Path, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rank: measured bytes, the token tables' share (plan.json) and the head's remainder."""
    plan = json.loads((run / "plan.json").read_text())
    measured = json.loads((run / "plan_vs_measured.json").read_text())["ranks"]
    head = next(t for t in plan["tables"] if t["name"] == HEAD_TABLE)
    classes, dim = head["rows"], head["dim"]
    out = []
    for m in measured:
        rank = m["rank"]
        tokens = {"weights": 0.0, "optimizer": 0.0}
        for t in plan["tables"]:
            if t["name"] == HEAD_TABLE:
                continue
            for s in t["shards"]:
                if s["rank"] == rank:  # a shard's share of the table's bytes, by element count
                    share = s["size"][0] * s["size"][1] / (t["rows"] * t["dim"])
                    tokens["weights"] += t["weight_bytes"] * share
                    tokens["optimizer"] += t["optimizer_bytes"] * share
        head_rows = sum(s["size"][0] for s in head["shards"] if s["rank"] == rank)
        expected = classes * dim * FLOAT_BYTES / len(measured)
        w = m["measured_weights"] - tokens["weights"]
        o = m["measured_optimizer"] - tokens["optimizer"]
        out.append({"rank": rank, "measured_weights": m["measured_weights"],
                    "measured_optimizer": m["measured_optimizer"],
                    "estimated_weights": m["estimated_weights"],
                    "estimated_optimizer": m["estimated_optimizer"],
                    "token_weights": tokens["weights"], "token_optimizer": tokens["optimizer"],
                    "head_rows_planned": head_rows, "head_weights": w, "head_optimizer": o,
                    "expected_head_bytes": expected, "head_weights_vs_expected": w / expected,
                    "head_optimizer_vs_expected": o / expected,
                    "peak_rss_gb": summary["peak_rss_gb_per_rank"][rank]})
    return out


def mb(x: float) -> str:
    return f"{x / 1e6:,.1f}"


def print_tables(out: dict[str, Any]) -> None:
    if "split" in out:
        print(f"\nhead split: {out['classes']:,} classes x {out['dim']} partial_fc, "
              "bytes each rank holds after sharding (MB = 10^6 bytes)")
        print("| run | rank | weights measured / estimated | head weights (= minus tokens) "
              "| expected C x D x 4 / W | Adagrad measured / estimated | head Adagrad | "
              "peak RSS GiB |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for run in out["split"]:
            if "error" in run:
                print(f"| {run['name']} | failed: {run['error']} |")
                continue
            for r in run["per_rank"]:
                print(f"| {run['name']} | {r['rank']} | {mb(r['measured_weights'])} / "
                      f"{mb(r['estimated_weights'])} | {mb(r['head_weights'])} "
                      f"({r['head_weights_vs_expected']:.3f}x) | {mb(r['expected_head_bytes'])} "
                      f"| {mb(r['measured_optimizer'])} / {mb(r['estimated_optimizer'])} | "
                      f"{mb(r['head_optimizer'])} ({r['head_optimizer_vs_expected']:.3f}x) | "
                      f"{r['peak_rss_gb']:.2f} |")
    if "big" in out:
        run = out["big"]
        print(f"\nbig head: {out['big_classes']:,} classes x {out['dim']} partial_fc "
              f"(r={out['rate']}), global batch {out['big_batch']}, 2 ranks")
        if "error" in run:
            print(f"failed: {run['error']}")
            return
        print("| rank | head rows | head weights MB | head Adagrad MB | peak RSS GiB "
              "(ru_maxrss) | sampled peak GiB |")
        print("|---:|---:|---:|---:|---:|---:|")
        sampled = run["sampled"]["peak_rss_gb_by_rank"]
        for r in run["per_rank"]:
            seen = sampled[r["rank"]] if r["rank"] < len(sampled) else None
            print(f"| {r['rank']} | {r['head_rows_planned']:,} | {mb(r['head_weights'])} | "
                  f"{mb(r['head_optimizer'])} | {r['peak_rss_gb']:.2f} | "
                  f"{'-' if seen is None else format(seen, '.2f')} |")
        print(f"step time {run['step_ms']:,.0f} ms ({run['train_examples_per_s']:,.0f} "
              f"examples/s over {run['steps']} steps); run wall {run['wall_s']:.0f} s; lowest "
              f"MemAvailable {run['sampled']['min_mem_available_gb']:.1f} GiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="output JSON file")
    parser.add_argument("--rate", type=float, default=0.1, help="partial_fc sample rate")
    parser.add_argument("--classes", type=int, default=1_000_000, help="part 1 classes")
    parser.add_argument("--rows", type=int, default=100_000, help="part 1 data rows")
    parser.add_argument("--vocab", type=int, default=50_000, help="part 1 token vocabulary")
    parser.add_argument("--steps", type=int, default=20, help="part 1 training steps")
    parser.add_argument("--batch", type=int, default=512, help="part 1 global batch")
    parser.add_argument("--data", default="/tmp/embedtrain_xc_1m")
    parser.add_argument("--big-classes", type=int, default=10_000_000)
    parser.add_argument("--big-rows", type=int, default=40_000)
    parser.add_argument("--big-steps", type=int, default=100)
    parser.add_argument("--big-batch", type=int, default=256)
    parser.add_argument("--big-vocab", type=int, default=500_000,
                        help="part 2 token vocabulary (datagen's oracle memory grows with "
                             "classes / vocab: 10^7 / 5 x 10^4 would need an estimated 15-17 GB)")
    parser.add_argument("--big-data", default="/tmp/embedtrain_xc_10m")
    parser.add_argument("--eval-rows", type=int, default=128,
                        help="valid/test rows the runs evaluate")
    parser.add_argument("--eval-batch", type=int, default=64, help="global evaluation batch")
    parser.add_argument("--runs", default="/tmp/embedtrain_xc_memory_runs",
                        help="run directories, views and logs")
    parser.add_argument("--skip-split", action="store_true")
    parser.add_argument("--skip-big", action="store_true")
    args = parser.parse_args()
    from embedtrain.config import load_config

    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "cores": os.cpu_count(),
        "dim": load_config(ROOT / CONFIG).xc.mlp[-1], "rate": args.rate,
        "classes": args.classes, "rows": args.rows, "vocab": args.vocab, "steps": args.steps,
        "batch": args.batch, "big_classes": args.big_classes, "big_rows": args.big_rows,
        "big_vocab": args.big_vocab,
        "big_steps": args.big_steps, "big_batch": args.big_batch, "eval_rows": args.eval_rows,
        "eval_batch": args.eval_batch, "datagen": {},
    }
    if not args.skip_split:
        data = Path(args.data)
        out["datagen"]["split"] = ensure_data(data, args.classes, args.rows, args.vocab, runs)
        view = eval_view(data, args.eval_rows, runs / "view_split")
        out["split"] = [train(f"split_{w}rank", view, w, args.batch, args.steps, args)
                        for w in (1, 2)]
    if not args.skip_big:
        data = Path(args.big_data)
        out["datagen"]["big"] = ensure_data(data, args.big_classes, args.big_rows,
                                            args.big_vocab, runs)
        view = eval_view(data, args.eval_rows, runs / "view_big")
        out["big"] = train("big_2rank", view, 2, args.big_batch, args.big_steps, args)
    out["command"] = " ".join(["python", *sys.argv])
    print_tables(out)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
