"""Next-item prediction on a sequence data set (``task: seq``): the oracle and two baselines.

Every figure ranks the whole corpus (items ``1..V``; no sampled negatives) for each row of the
evaluated split (``target`` after ``items``):

- ``oracle``: the planted model's Bayes ranking, from ``metadata.json`` (``embedtrain datagen
  seq`` data sets only);
- ``popularity``: items by their count in the train split (each row's history and target; ties:
  lower id first);
- ``cooccurrence``: items by how often they followed the row's last item in the train split
  (consecutive pairs of each train row's history then target), ties and unseen items by
  popularity: the item-to-item baseline a sequence model has to beat.

- ``model``: a ``task: seq`` run on the same data set (``--run``: its ``summary.json``, the
  test split's HR@10, NDCG@10 and MRR over every item; its ``train_examples_per_s``); null
  without one. HR@k = the target is in the top k; NDCG@k = ``1 / log2(rank + 1)`` when it
is; MRR = the mean of ``1 / rank`` over the full ranking.

Usage:
    embedtrain train configs/seq_synthetic.yaml --set data.path=data/seq --out runs/seq
    python benchmarks/bench_seq.py --data data/seq --run runs/seq --json benchmarks/out/seq.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq


def read_split(root: Path, meta: dict, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(offsets, items, targets)`` of a split's rows."""
    offsets, values, targets, base = [np.zeros(1, np.int64)], [], [], 0
    for rel in meta["splits"][split]["files"]:
        table = pq.read_table(root / rel)
        lists = table.column(meta["items_column"]).combine_chunks()
        flat = lists.flatten().to_numpy().astype(np.int64)
        off = lists.offsets.to_numpy().astype(np.int64)
        offsets.append(off[1:] - off[0] + base)
        values.append(flat)
        base += len(flat)
        targets.append(table.column(meta["target_column"]).to_numpy().astype(np.int64))
    cat = (lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype))
    return np.concatenate(offsets), cat(values, np.int64), cat(targets, np.int64)


def with_targets(offsets: np.ndarray, items: np.ndarray, targets: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Each row's history followed by its target, as ``(offsets, items)``."""
    lengths = np.diff(offsets) + 1
    new = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=new[1:])
    out = np.empty(new[-1], np.int64)
    out[new[1:] - 1] = targets
    keep = np.ones(new[-1], bool)
    keep[new[1:] - 1] = False
    out[keep] = items
    return new, out


def ranks_by_popularity(pop: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """1-based rank of each target among items ``1..V`` by ``pop`` (ties: lower id first)."""
    items = np.arange(1, len(pop))
    order = np.lexsort((items, -pop[1:]))  # descending count, then id
    rank = np.empty(len(pop), np.int64)
    rank[items[order]] = np.arange(1, len(items) + 1)
    return rank[targets]


def pair_counts(offsets: np.ndarray, items: np.ndarray, size: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Sorted keys ``prev * size + next`` of the consecutive pairs within rows, and their
    counts."""
    row = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    nxt = np.flatnonzero(row[1:] == row[:-1]) + 1
    return np.unique(items[nxt - 1] * size + items[nxt], return_counts=True)


def ranks_by_cooccurrence(train: tuple, pop: np.ndarray, offsets: np.ndarray,
                          items: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """1-based rank of each target: by the count of (last item -> item) pairs in train rows,
    then by popularity, then by id."""
    t_off, t_items, _ = train
    size = np.int64(len(pop))
    keys, counts = pair_counts(t_off, t_items, size)
    pop_rank = ranks_by_popularity(pop, np.arange(len(pop)))  # rank of every item by popularity
    last = items[offsets[1:] - 1]
    out = np.empty(len(targets), np.int64)
    lo = np.searchsorted(keys, last * size)
    hi = np.searchsorted(keys, (last + 1) * size)
    for r in range(len(targets)):
        succ = keys[lo[r]:hi[r]] - last[r] * size
        c = counts[lo[r]:hi[r]]
        t = targets[r]
        hit = np.flatnonzero(succ == t)
        ct = c[hit[0]] if len(hit) else 0
        # items with a larger count; among equal counts, a better popularity rank
        better = int((c > ct).sum()) + int(((c == ct) & (pop_rank[succ] < pop_rank[t])).sum())
        if ct == 0:  # also every non-successor with a better popularity rank
            better += int(pop_rank[t] - 1) - int((pop_rank[succ] < pop_rank[t]).sum())
        out[r] = better + 1
    return out


def figures(ranks: np.ndarray, k: int = 10) -> dict:
    hit = ranks <= k
    return {f"hr@{k}": float(hit.mean()),
            f"ndcg@{k}": float(np.where(hit, 1.0 / np.log2(ranks + 1.0), 0.0).mean()),
            "mrr": float((1.0 / ranks).mean())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="a task: seq data set (datagen seq or ingest)")
    p.add_argument("--split", default="test", choices=["valid", "test"])
    p.add_argument("--run", help="a task: seq run on --data (its summary.json's test metrics)")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    root = Path(args.data)
    meta = json.loads((root / "metadata.json").read_text())
    if meta.get("task") != "seq":
        raise SystemExit(f"{root}/metadata.json: task {meta.get('task')!r}, not a seq data set")
    start = time.perf_counter()
    train = (*with_targets(*read_split(root, meta, "train")), None)
    offsets, items, targets = read_split(root, meta, args.split)
    pop = np.bincount(train[1], minlength=meta["num_items"]).astype(np.int64)
    pop[0] = 0
    results = {"popularity": figures(ranks_by_popularity(pop, targets)),
               "cooccurrence": figures(ranks_by_cooccurrence(train, pop, offsets, items,
                                                             targets))}
    oracle = {m: meta.get(f"oracle_{m}", {}).get(args.split) for m in ("hr@10", "ndcg@10")}
    record = {"data": str(root), "split": args.split, "rows": int(len(targets)),
              "num_items": meta["num_items"], "command": " ".join([Path(sys.executable).name,
                                                                  *sys.argv]),
              "seconds": round(time.perf_counter() - start, 2)}
    model = {}
    if args.run:
        summary = json.loads((Path(args.run) / "summary.json").read_text())
        if args.split != "test":
            raise SystemExit("--run: the run's summary holds the test split's metrics")
        model = {m: summary.get(m) for m in ("hr@10", "ndcg@10", "mrr")}
        record["examples_per_s"] = summary.get("train_examples_per_s")
        record["run"] = args.run
    for metric in ("hr@10", "ndcg@10", "mrr"):
        record[metric] = {"model": model.get(metric), "oracle": oracle.get(metric),
                          **{name: round(r[metric], 4) for name, r in results.items()}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    print(f"{'':>14}  {'hr@10':>7}  {'ndcg@10':>7}  {'mrr':>7}   ({len(targets):,} {args.split} "
          f"rows, {meta['num_items'] - 1:,} items)")
    for name in ("model", "oracle", "popularity", "cooccurrence"):
        row = [record[m][name] for m in ("hr@10", "ndcg@10", "mrr")]
        print(f"{name:>14}  " + "  ".join("      -" if v is None else f"{v:7.4f}" for v in row))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
