"""Class-head precision at equal examples: fp32 vs bf16 class rows, partial_fc and hard_negatives.

Issue 31's accuracy check. Eight ``embedtrain train configs/xc_synthetic.yaml`` runs, one at a
time, on one planted multi-label set: {partial_fc (``--rate``), hard_negatives
(``head.sample_rate=0``, exact index, as ``bench_xc.py`` runs it)} x the head's storage and
optimizer (``head.dtype``, ``head.optimizer``, ``head.rounding``):

- ``fp32_adagrad``: fp32 rows, Adagrad (the ``HeadConfig`` defaults, a D-float accumulator a row);
- ``fp32_rowwise``: fp32 rows, row-wise Adagrad (one fp32 accumulator a row): the control that
  separates the optimizer's effect from the storage's;
- ``bf16_sr_rowwise``: bf16 rows, updated rows rounded back stochastically, row-wise Adagrad;
- ``bf16_nearest_rowwise``: the same, rounded to nearest;
- ``fp32_factored``, ``bf16_sr_factored``, ``bf16_nearest_factored``: the same three with
  ``factored_adagrad`` (row-wise Adagrad's accumulator a row times a ``[D]`` column profile).

Everything else is the same in every run: the data, batch 512, one epoch (every run sees the same
examples in the same order), ``train.seed`` (the config's, or ``--seed``: the model's
initialisation and the heads' sampling; the data set is the same), the head's learning rate (the
config's 0.05 for every optimizer, or ``--lr``), no periodic evaluation, no progress bar.

Data: ``generate_xc`` (the generator behind ``embedtrain datagen xc --multi-label``, through its
Python API for the split sizes) with ``--classes`` classes, ``--rows`` rows and ``--vocab``
tokens, 1-4 labels a row, a small valid split (``--valid-fraction``) and a test split of at
least ``--test-rows`` rows. The runs read a view of it (``bench_xc_memory.eval_view``): the
train split as generated, valid and test cut to their first ``--test-rows`` rows, because the
final evaluation scores every class for every row. The generator's oracle scores exactly those
first ``--test-rows`` test rows (``oracle_rows``), so the Bayes-optimal P@1 is on the rows the
runs are tested on. The data set is reused when its ``metadata.json`` records the same settings.

Test P@1, P@5, nDCG@5, recall@5, PSP@k, training examples/s and time come from each run's
``summary.json``; the head's measured weight and optimizer bytes (``plan_vs_measured.json``,
which include the token table's) show that the storage asked for is what ran. P@1's standard
error is ``sqrt(p (1 - p) / n)`` over the ``n`` test rows (a row's P@1 is a hit or a miss; the
variants share the rows, so a difference between two of them is known better than this).

Usage:
    python benchmarks/bench_xc_precision.py --json benchmarks/out/xc_precision.json \
        [--classes 200000] [--rows 390000] [--vocab 200000] [--test-rows 20000] \
        [--heads partial_fc hard_negatives] [--variants fp32_adagrad bf16_sr_rowwise] \
        [--max-steps N] [--lr LR]

``--max-steps`` (0: the whole epoch) is for sizing: a few steps of one variant tell the
examples/s. Prints a table; JSON: ``runs`` (per head and variant: figures, ``p@1_se``,
``command``), ``p_at_1`` (per head and variant, and ``oracle``), ``oracle_p_at_1``, the data
settings (``data``), ``total_wall_s`` and ``command``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_xc import CONFIG, ROOT, fmt
from bench_xc_memory import eval_view, head_overrides

# name -> (head.dtype, head.optimizer, head.rounding); fp32 rows are never rounded
VARIANTS: dict[str, tuple[str, str, str]] = {
    "fp32_adagrad": ("fp32", "adagrad", "stochastic"),
    "fp32_rowwise": ("fp32", "rowwise_adagrad", "stochastic"),
    "bf16_sr_rowwise": ("bf16", "rowwise_adagrad", "stochastic"),
    "bf16_nearest_rowwise": ("bf16", "rowwise_adagrad", "nearest"),
    "fp32_factored": ("fp32", "factored_adagrad", "stochastic"),
    "bf16_sr_factored": ("bf16", "factored_adagrad", "stochastic"),
    "bf16_nearest_factored": ("bf16", "factored_adagrad", "nearest"),
    "fp8_sr_factored": ("fp8", "factored_adagrad", "stochastic"),
    "fp8_nearest_factored": ("fp8", "factored_adagrad", "nearest"),
}
HEAD_KINDS = ("partial_fc", "hard_negatives")
SUMMARY_KEYS = ("p@1", "p@5", "ndcg@5", "recall@5", "psp@1", "psp@5", "loss",
                "train_examples_per_s", "train_time_s", "wall_time_s", "examples", "steps",
                "oracle_p_at_1")


def ensure_data(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The planted multi-label set in ``--data``: reused when its settings match, else made."""
    from embedtrain.datagen import XCDataSpec, generate_xc

    path = Path(args.data)
    test_fraction = 1.2 * args.test_rows / args.rows  # ~20% spare: the split is drawn per row
    spec = XCDataSpec(classes=args.classes, rows=args.rows, vocab=args.vocab, multi_label=True,
                      seed=0, valid_fraction=args.valid_fraction, test_fraction=test_fraction,
                      oracle_rows=args.test_rows)
    want = {"classes": spec.classes, "rows": spec.rows, "vocab": spec.vocab, "seed": spec.seed,
            "multi_label": True}
    meta_file = path / "metadata.json"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        generator = meta.get("generator", {})
        same = (all(generator.get(k) == v for k, v in want.items())
                and meta["oracle_rows"]["test"] == args.test_rows
                and abs(meta["splits"]["valid"]["rows"] / spec.rows - spec.valid_fraction) < 2e-3)
        if not same:
            raise SystemExit(f"{meta_file}: generated with other settings; pass another --data")
        print(f"reusing {path}", flush=True)
        return path, meta
    print(f"generating {path}: {spec}", flush=True)
    start = time.perf_counter()
    meta = generate_xc(spec, path, progress=False)
    print(f"  {time.perf_counter() - start:.0f} s", flush=True)
    if meta["oracle_rows"]["test"] != args.test_rows:
        raise SystemExit(f"{path}: only {meta['oracle_rows']['test']} test rows, fewer than "
                         f"--test-rows {args.test_rows}; raise --rows")
    return path, meta


def train_variant(head: str, variant: str, args: argparse.Namespace, data: Path,
                  test_rows: int) -> dict[str, Any]:
    """One epoch of ``configs/xc_synthetic.yaml`` with ``head`` stored as ``variant``."""
    dtype, optimizer, rounding = VARIANTS[variant]
    out = Path(args.runs) / f"{head}_{variant}"
    rate = args.rate if head == "partial_fc" else 0.0
    sets = [f"data.path={data}", "data.batch_size=512", "train.epochs=1", "train.eval_every=0",
            "train.checkpoint_every=0", "train.progress=false", f"head.kind={head}",
            f"head.sample_rate={rate}", *head_overrides(dtype, optimizer, rounding)]
    if args.lr:
        sets.append(f"head.lr={args.lr}")
    if args.seed is not None:
        sets.append(f"train.seed={args.seed}")
    if args.max_steps:
        sets.append(f"train.max_steps={args.max_steps}")
    cmd = [sys.executable, "-m", "embedtrain", "train", CONFIG, "--out", str(out), "--overwrite",
           "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    print("$ " + " ".join(cmd), flush=True)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    record: dict[str, Any] = {"head": head, "dtype": dtype, "optimizer": optimizer,
                              "rounding": rounding if dtype != "fp32" else None,
                              "wall_s": time.perf_counter() - start, "command": " ".join(cmd),
                              "load_avg_1m": [load_before, os.getloadavg()[0]]}
    summary_file = out / "summary.json"
    if proc.returncode or not summary_file.is_file():
        record["error"] = f"exit status {proc.returncode}"
        record["stderr_tail"] = proc.stderr[-4000:]
        print(record["stderr_tail"], file=sys.stderr)
        return record
    summary = json.loads(summary_file.read_text())
    record.update({k: summary.get(k) for k in SUMMARY_KEYS})
    p = record["p@1"]
    record["test_rows"] = test_rows
    record["p@1_se"] = math.sqrt(p * (1 - p) / test_rows)
    measured = json.loads((out / "plan_vs_measured.json").read_text())["ranks"][0]
    record["measured_weight_bytes"] = measured["measured_weights"]  # token table + head
    record["measured_optimizer_bytes"] = measured["measured_optimizer"]
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # ~0.3 GB a run, not read again
    print(f"  {head} {variant}: P@1 {p:.4f} (se {record['p@1_se']:.4f}), "
          f"{record['train_examples_per_s']:,.0f} ex/s, wall {record['wall_s']:.0f} s", flush=True)
    return record


def print_table(out: dict[str, Any]) -> None:
    d = out["data"]
    print(f"\n{d['classes']:,} classes (multi-label, 1-4 labels a row), {d['train_rows']:,} "
          f"training rows (one epoch, batch 512), {d['test_rows']:,} test rows; oracle P@1 "
          f"{fmt(out['oracle_p_at_1'], '.4f')}")
    print("| head | rows | optimizer | rounding | P@1 | ± se | vs fp32 Adagrad | P@5 | nDCG@5 | "
          "train ex/s | train s |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for head, runs in out["runs"].items():
        base = runs.get("fp32_adagrad", {}).get("p@1")
        for r in runs.values():
            p = r.get("p@1")
            delta = None if p is None or base is None else p - base
            print(f"| {head} | {r['dtype']} | {r['optimizer']} | {r['rounding'] or '-'} | "
                  f"{fmt(p, '.4f')} | {fmt(r.get('p@1_se'), '.4f')} | {fmt(delta, '+.4f')} | "
                  f"{fmt(r.get('p@5'), '.4f')} | {fmt(r.get('ndcg@5'), '.4f')} | "
                  f"{fmt(r.get('train_examples_per_s'), ',.0f')} | "
                  f"{fmt(r.get('train_time_s'), ',.0f')} |")
    print(f"total wall time {out['total_wall_s'] / 60:.1f} min")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="output JSON file")
    parser.add_argument("--classes", type=int, default=200_000)
    parser.add_argument("--rows", type=int, default=390_000, help="rows of all splits together")
    parser.add_argument("--vocab", type=int, default=200_000)
    parser.add_argument("--test-rows", type=int, default=20_000,
                        help="test rows evaluated (and scored by the oracle)")
    parser.add_argument("--valid-fraction", type=float, default=0.0065,
                        help="valid split's share of the rows (evaluated once, at the end)")
    parser.add_argument("--rate", type=float, default=0.1, help="partial_fc sample rate")
    parser.add_argument("--heads", nargs="+", choices=HEAD_KINDS, default=list(HEAD_KINDS))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--max-steps", type=int, default=0, help="0: one whole epoch")
    parser.add_argument("--lr", type=float, default=0.0,
                        help="head.lr of every run (0: the config's)")
    parser.add_argument("--seed", type=int, help="train.seed of every run (default: the config's)")
    parser.add_argument("--data", default="/tmp/embedtrain_xc_precision")
    parser.add_argument("--runs", default="/tmp/embedtrain_xc_precision_runs")
    args = parser.parse_args()
    start = time.perf_counter()
    data, meta = ensure_data(args)
    view = eval_view(data, args.test_rows, Path(args.runs) / "view")
    splits = json.loads((view / "metadata.json").read_text())["splits"]
    test_rows = splits["test"]["rows"]
    runs = {head: {v: train_variant(head, v, args, view, test_rows) for v in args.variants}
            for head in args.heads}
    oracle = meta["oracle_p_at_1"]["test"]
    out: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "cores": os.cpu_count(),
        "data": {"path": str(data), "classes": args.classes, "rows": args.rows,
                 "vocab": args.vocab, "multi_label": True,
                 "labels_per_row": meta["labels_per_row"],
                 "train_rows": splits["train"]["rows"], "valid_rows": splits["valid"]["rows"],
                 "test_rows": test_rows, "oracle_rows": meta["oracle_rows"]["test"],
                 "class_frequencies": meta["class_frequencies"]},
        "rate": args.rate, "max_steps": args.max_steps, "head_lr": args.lr or None,
        "seed": args.seed,
        "oracle_p_at_1": oracle, "oracle_p_at_1_se": math.sqrt(oracle * (1 - oracle) / test_rows),
        "p_at_1": {h: {v: r.get("p@1") for v, r in rs.items()} for h, rs in runs.items()},
        "runs": runs, "total_wall_s": time.perf_counter() - start,
        "command": " ".join(["python", *sys.argv]),
    }
    out["p_at_1"]["oracle"] = oracle
    print_table(out)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
