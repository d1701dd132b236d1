"""A multi-label data set in the XC repository's sparse text format: ingest, train, P@k / PSP@k.

The repository's data sets (Bibtex, EURLex-4K, ...) cannot be downloaded here, so the input is
written in their format from a planted multi-label set (``embedtrain datagen xc --multi-label``):
``train.txt`` (the generator's train and valid rows) and ``test.txt`` (its test rows), a header
line ``rows features labels`` and one line per row, ``l1,l2 f:v ...`` with the row's distinct
token ids as features and their counts as values, plus a few malformed lines (dropped and counted
by the ingestion). Then:

1. ``embedtrain ingest configs/ingest/xc_repository.yaml --input train.txt
   --set split.files.test=test.txt`` (10 % of train.txt as valid);
2. one ``embedtrain train configs/xc_synthetic.yaml`` per head (``--heads``, each
   ``kind[+loss]``, e.g. ``partial_fc+bce``), the same settings otherwise (``--epochs``, batch
   512, no dense features);
3. the most-frequent-labels baseline: every test row gets the training split's most frequent
   labels (P@k, PSP@k computed with embedtrain's metrics on the ingested test split).

Usage:
    python benchmarks/bench_xc_repository.py --json benchmarks/out/xc_repository.json \
        [--classes 2000] [--rows 200000] [--vocab 20000] [--epochs 2] [--work /tmp/xcrepo]

Prints a table (P@1, P@5, PSP@1, PSP@5, nDCG@5 per head and for the baseline, the planted
set's Bayes-optimal P@1 / P@5) and writes it as JSON with the ingestion report's counts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parent.parent
MALFORMED = ["3,x 1:1.0", "2 7", "", "5 99999999:1"]  # bad label, no colon, empty, range


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{cmd[3]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def write_repository_files(data: Path, out: Path, vocab: int, classes: int) -> dict[str, int]:
    """``train.txt`` (train + valid splits) and ``test.txt`` in the repository's format."""
    out.mkdir(parents=True, exist_ok=True)
    meta = json.loads((data / "metadata.json").read_text())
    lines = {"train.txt": [], "test.txt": []}
    for split, name in (("train", "train.txt"), ("valid", "train.txt"), ("test", "test.txt")):
        for f in meta["splits"][split]["files"]:
            table = pq.read_table(data / f, columns=["tokens", "labels"]).to_pydict()
            for tokens, labels in zip(table["tokens"], table["labels"]):
                ids, counts = np.unique(np.asarray(tokens), return_counts=True)
                feats = " ".join(f"{i}:{c:.1f}" for i, c in zip(ids.tolist(), counts.tolist()))
                lines[name].append(f"{','.join(map(str, labels))} {feats}")
    lines["train.txt"][100:100] = MALFORMED  # dropped and counted with their line numbers
    sizes = {}
    for name, rows in lines.items():
        good = len(rows) - (len(MALFORMED) if name == "train.txt" else 0)
        (out / name).write_text(f"{good} {vocab} {classes}\n" + "\n".join(rows) + "\n")
        sizes[name] = len(rows)
    return sizes


def baseline(data: Path, ks: tuple[int, ...]) -> dict[str, float]:
    """Most frequent training labels for every test row, scored like the trainer scores."""
    from embedtrain.data.stats import class_counts
    from embedtrain.features import load_dataset_meta
    from embedtrain.train.xc_metrics import XCMetrics, inverse_propensity, pad_targets

    meta = load_dataset_meta(data)
    counts = torch.from_numpy(class_counts(meta))
    top = torch.sort(counts, descending=True, stable=True).indices[:max(ks)]
    metrics = XCMetrics(ks, inv_propensity=inverse_propensity(counts, meta.split_rows["train"]))
    for f in meta.files("test"):
        labels = pq.read_table(f, columns=[meta.features.label]).column(0).to_pylist()
        metrics.update(top.expand(len(labels), -1), pad_targets(labels))
    return metrics.compute()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--classes", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--vocab", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--heads", default="partial_fc,partial_fc+bce,full,full+bce")
    parser.add_argument("--work", default="/tmp/embedtrain_xc_repository")
    args = parser.parse_args()
    work = Path(args.work)
    exe = [sys.executable, "-m", "embedtrain"]
    planted = work / "planted"
    run(exe + ["datagen", "xc", "--multi-label", "--classes", str(args.classes), "--rows",
               str(args.rows), "--vocab", str(args.vocab), "--out", str(planted)])
    planted_meta = json.loads((planted / "metadata.json").read_text())
    sizes = write_repository_files(planted, work / "repo", args.vocab, args.classes)
    data = work / "ingested"
    start = time.perf_counter()
    run(exe + ["ingest", "configs/ingest/xc_repository.yaml", "--input",
               str(work / "repo" / "train.txt"), "--set",
               f"split.files.test={work / 'repo' / 'test.txt'}", "--out", str(data),
               "--quiet"])  # an earlier ingest output there is replaced
    ingest_s = time.perf_counter() - start
    report = json.loads((data / "ingest_report.json").read_text())
    out: dict[str, Any] = {"date": datetime.date.today().isoformat(), "classes": args.classes,
                           "rows": args.rows, "vocab": args.vocab, "epochs": args.epochs,
                           "lines": sizes, "ingest_s": ingest_s, "ingest_report": report,
                           "oracle": {k: planted_meta.get(f"oracle_{k}", {}).get("test")
                                      for k in ("p_at_1", "p_at_5")},
                           "runs": {}}
    for head in args.heads.split(","):
        kind, _, loss = head.partition("+")
        run_dir = work / "runs" / head.replace("+", "_")
        sets = [f"data.path={data}", "data.batch_size=512", f"train.epochs={args.epochs}",
                "train.eval_every=0", "train.checkpoint_every=0", "train.progress=false",
                f"head.kind={kind}", f"head.loss={loss or 'softmax'}"]
        cmd = exe + ["train", "configs/xc_synthetic.yaml", "--out", str(run_dir), "--overwrite",
                     "--no-progress"] + [x for s in sets for x in ("--set", s)]
        start = time.perf_counter()
        run(cmd)
        summary = json.loads((run_dir / "summary.json").read_text())
        out["runs"][head] = {**{k: summary.get(k) for k in
                                ("p@1", "p@5", "psp@1", "psp@5", "ndcg@5", "recall@5",
                                 "train_examples_per_s", "steps")},
                             "wall_s": time.perf_counter() - start, "command": " ".join(cmd)}
    out["runs"]["most frequent labels"] = baseline(data, (1, 5))
    out["command"] = " ".join(["python", *sys.argv])
    print(f"\n{args.classes:,} labels, {args.rows:,} planted rows written as train.txt "
          f"({sizes['train.txt']:,} lines, {len(MALFORMED)} malformed) + test.txt; ingested in "
          f"{ingest_s:.1f} s; dropped: {report['rows_dropped']} at lines "
          f"{ {k: v[0]['lines'] for k, v in report['dropped_examples'].items()} }")
    print("| head | P@1 | P@5 | PSP@1 | PSP@5 | nDCG@5 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in out["runs"].items():
        print(f"| {name} | {r['p@1']:.4f} | {r['p@5']:.4f} | {r['psp@1']:.4f} | "
              f"{r['psp@5']:.4f} | {r['ndcg@5']:.4f} |")
    o = out["oracle"]
    if o["p_at_1"] is not None:
        print(f"| Bayes-optimal (planted model) | {o['p_at_1']:.4f} | "
              f"{o['p_at_5'] if o['p_at_5'] is None else format(o['p_at_5'], '.4f')} | | | |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
