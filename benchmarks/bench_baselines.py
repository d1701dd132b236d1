"""Each family's classic baselines on a data set's own splits, beside embedtrain models on it.

What a model must beat on the data users have (issue 55): the baselines are fitted on the data
set's ``train`` split, selected on ``valid`` and scored on ``test`` (the files of its
``metadata.json``, the splits ``embedtrain train`` uses), with embedtrain's own test metric:

- ``ctr``: test AUC (``embedtrain.train.ctr.CTRMetrics``, exact). ``logistic regression``: one
  weight per id of every categorical field (a multi-hot field's ids summed) and the dense
  features (``log1p`` where the metadata says so, then standardised on train); ``factorization
  machine``: the same plus rank ``--fm-rank`` factors of every field (a multi-hot field's summed)
  and of every dense feature (scaled by its value), interacting pairwise across fields. Ids seen
  fewer than ``--min-count`` times in train (default 1) share their field's rare-id row; ids
  unseen in train add nothing. Plain torch, Adam (``--lr``, ``--fm-lr``; batch ``--batch``), L2
  ``--l2`` on the rows a batch looks up, up to ``--epochs`` epochs (stopping after 2 without a
  better valid AUC), the test AUC of the epoch with the best valid AUC; deterministic for a
  seed.
- ``seq``: HR@10 and NDCG@10 of each test row's target ranked over every item ``1..V`` (ties: the
  smaller id first, as embedtrain's top-k), from ``bench_seq.py``: ``popularity`` (counts in the
  train rows) and ``cooccurrence`` (how often an item followed the row's last item in the train
  rows, then popularity); deterministic.
- ``node``: test accuracy (``embedtrain.train.gnn.NodeMetrics``). ``gcn``: Kipf & Welling's
  full-batch two-layer GCN (``torch_geometric`` ``GCNConv``: self-loops, symmetric normalisation)
  on the whole graph of the data set's files, features row-normalised, hidden 64, dropout 0.5 on
  the input and hidden layer, Adam lr 0.01 with weight decay 5e-4 on the first layer (as PyG's
  ``examples/gcn.py``), 200 epochs, the test accuracy of the epoch with the best valid accuracy.
- ``xc``: P@1 and P@5 (``embedtrain.train.xc_metrics.XCMetrics``). ``knn``: the rows' token bags
  as TF-IDF vectors (idf from train; the dense features unused), cosine similarity to every train
  row (torch matmuls in blocks), the labels of the ``k`` most similar train rows voted by
  similarity (ties: the more frequent label in train, then the smaller id), ``k`` in 1, 5, 10, 20,
  50 chosen by valid P@1; deterministic.

The baselines' code is ``benchmarks/baseline_models.py``. ``--model CONFIG`` (repeatable) also
trains the shipped config on the data set, once per seed: ``embedtrain train CONFIG --set
data.path=DIR --set train.seed=S --out WORK/<config>_seedS --no-progress`` (nothing else changed
but what ``--set KEY=VALUE`` gives, for every ``--model`` run; the row names it), and reads the
test metrics of the run's ``summary.json``. The planted oracle of a datagen set is shown too
(a graph's: the one-hop and the features-only Bayes accuracy). Figures: the mean and
population standard deviation of each metric over seeds 0 .. ``--seeds`` - 1 (the model runs':
``--model-seeds``, default the same); a deterministic baseline runs once.

Usage, on replicas of small public logs' sizes (planted structure, with their oracles):
    embedtrain datagen ctr --rows 100000 --structure fm --out data/replicas/ctr
    embedtrain datagen seq --users 1000 --items 1700 --clusters 20 --min-length 20 \\
        --mean-extra-events 80 --max-events 700 --max-length 200 --out data/replicas/seq
    embedtrain datagen graph --nodes 3000 --avg-degree 4 --communities 7 --features bow \\
        --vocab 1433 --words-per-node 18 --out data/replicas/graph
    embedtrain datagen xc --rows 20000 --classes 4000 --vocab 5000 --multi-label \\
        --out data/replicas/xc
    python benchmarks/bench_baselines.py --family ctr --data data/replicas/ctr \\
        --model configs/dlrm_synthetic.yaml --json benchmarks/out/baselines_ctr.json

Prints a table (method, each metric's mean ± std, runs, seconds a run); progress lines go to
stderr. JSON: ``family``, ``data``, ``split`` (test), ``metrics``, ``rows`` (per method: ``kind``
baseline / model / oracle, ``runs`` with their seed, metrics and seconds, ``mean``, ``std``) and
the exact ``command``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from baseline_models import (  # noqa: E402
    ctr_splits, fit_ctr, fit_gcn, inverse_document_frequency, knn_neighbours, knn_topk,
    load_node_data, progress, tfidf, xc_precision, xc_rows)
from bench_seq import (  # noqa: E402
    figures, ranks_by_cooccurrence, ranks_by_popularity, read_split, with_targets)

FAMILIES = {"ctr": ("auc",), "seq": ("hr@10", "ndcg@10"), "node": ("accuracy",),
            "xc": ("p@1", "p@5")}
TRAIN = [sys.executable, "-m", "embedtrain", "train"]  # the model runs' command
KNN_KS = (1, 5, 10, 20, 50)


# --- each family's baselines -------------------------------------------------------------------

def ctr_baselines(root: Path, meta: dict, args: argparse.Namespace) -> list[dict]:
    """Logistic regression and a factorization machine, once per seed."""
    data, num_ids, slot_field = ctr_splits(root, meta, args.min_count)
    rows = []
    for name, rank, lr in (("logistic regression", 0, args.lr),
                           (f"factorization machine (rank {args.fm_rank})", args.fm_rank,
                            args.fm_lr)):
        rows.append(seeded_row(name, args.seeds, lambda s, r=rank, n=name, lr=lr: fit_ctr(
            data, num_ids, slot_field, r, s, args, n, lr)))
    return rows


def seq_baselines(root: Path, meta: dict, args: argparse.Namespace) -> list[dict]:
    """Popularity and last-item co-occurrence (``bench_seq.py``'s rankers), once."""
    train = (*with_targets(*read_split(root, meta, "train")), None)
    offsets, items, targets = read_split(root, meta, "test")
    pop = np.bincount(train[1], minlength=meta["num_items"]).astype(np.int64)
    pop[0] = 0
    rankers = {"popularity": lambda: ranks_by_popularity(pop, targets),
               "cooccurrence": lambda: ranks_by_cooccurrence(train, pop, offsets, items,
                                                             targets)}
    return [single_row(name, lambda f=f: figures(f())) for name, f in rankers.items()]


def node_baselines(root: Path, meta: dict, args: argparse.Namespace) -> list[dict]:
    """A full-batch GCN, once per seed."""
    data = load_node_data(root)
    return [seeded_row("gcn (Kipf & Welling)", args.seeds, lambda s: fit_gcn(data, s))]


def xc_baselines(root: Path, meta: dict, args: argparse.Namespace) -> list[dict]:
    """Item kNN, its ``k`` chosen on valid, once."""
    bags, targets = {}, {}
    for split in ("train", "valid", "test"):
        bags[split], targets[split] = xc_rows(root, meta, split)
    idf = inverse_document_frequency(bags["train"])
    vectors = {s: tfidf(b, idf) for s, b in bags.items()}
    flat = targets["train"].view(-1)
    popularity = np.bincount(flat[flat >= 0].numpy(), minlength=meta["num_classes"])

    def run() -> dict[str, Any]:
        found = {}
        for split in ("valid", "test"):
            progress(f"xc: knn: neighbours of the {split} rows")
            found[split] = knn_neighbours(vectors["train"], vectors[split], max(KNN_KS))
        valid = {k: xc_precision(knn_topk(*found["valid"], targets["train"], popularity, k),
                                 targets["valid"])["p@1"] for k in KNN_KS}
        k = max(KNN_KS, key=lambda k: (valid[k], -k))
        test = xc_precision(knn_topk(*found["test"], targets["train"], popularity, k),
                            targets["test"])
        return {**test, "k": k, "valid_p@1": valid[k]}

    return [single_row("knn (tf-idf cosine)", run)]


# --- rows: baselines, models, oracle -----------------------------------------------------------

def summarise(name: str, kind: str, runs: list[dict]) -> dict:
    """A table row: its runs, and each metric's mean and standard deviation over them."""
    keys = [k for k in runs[0]["metrics"] if all(isinstance(r["metrics"].get(k), (int, float))
                                                  for r in runs)] if runs else []
    return {"name": name, "kind": kind, "runs": runs,
            "mean": {k: statistics.mean(r["metrics"][k] for r in runs) for k in keys},
            "std": {k: statistics.pstdev(r["metrics"][k] for r in runs) for k in keys}}


def seeded_row(name: str, seeds: int, fit: Callable[[int], dict]) -> dict:
    """A baseline run once per seed."""
    runs = []
    for seed in range(seeds):
        start = time.perf_counter()
        metrics = fit(seed)
        runs.append({"seed": seed, "metrics": metrics,
                     "seconds": round(time.perf_counter() - start, 2)})
        progress(f"{name}, seed {seed}: {metrics}")
    return summarise(name, "baseline", runs)


def single_row(name: str, fit: Callable[[], dict]) -> dict:
    """A deterministic baseline: one run (no seed)."""
    start = time.perf_counter()
    metrics = fit()
    progress(f"{name}: {metrics}")
    return summarise(name, "baseline", [{"seed": None, "metrics": metrics,
                                         "seconds": round(time.perf_counter() - start, 2)}])


def train_model(config: Path, data: Path, seed: int, out: Path,
                overrides: Sequence[str] = ()) -> dict[str, Any]:
    """``embedtrain train CONFIG --set data.path=DATA --set train.seed=SEED [--set KEY=VALUE
    of overrides] --out OUT``; the test metrics of its ``summary.json`` (or ``error``: the log's
    path)."""
    argv = [*TRAIN, str(config), "--set", f"data.path={data.resolve()}", "--set",
            f"train.seed={seed}", *[a for o in overrides for a in ("--set", o)],
            "--out", str(out), "--no-progress"]
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        code = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    summary_file = out / "summary.json"
    if code or not summary_file.is_file():
        return {"error": f"exit status {code}; see {log}"}
    summary = json.loads(summary_file.read_text())
    metrics = {k: v for k, v in summary.items() if isinstance(v, (int, float))
               and not isinstance(v, bool)}
    return {**metrics, "split": summary.get("split"), "run": str(out)}


def model_row(config: Path, data: Path, seeds: int, work: Path,
              overrides: Sequence[str] = ()) -> dict:
    runs = []
    for seed in range(seeds):
        progress(f"model {config}: seed {seed}: training ...")
        start = time.perf_counter()
        metrics = train_model(config, data, seed, work / f"{config.stem}_seed{seed}", overrides)
        runs.append({"seed": seed, "metrics": metrics,
                     "seconds": round(time.perf_counter() - start, 1)})
        progress(f"model {config}: seed {seed}: {metrics.get('error') or 'done'}")
    ok = [r for r in runs if "error" not in r["metrics"]]
    row = summarise(" ".join([f"model: {config.name}", *overrides]), "model", ok)
    row["runs"], row["failed"] = runs, len(runs) - len(ok)
    return row


# the planted model's figures in a datagen set's metadata: (row, metric, key in metadata)
ORACLES = {"ctr": [("oracle (Bayes)", "auc", "oracle_auc")],
           "seq": [("oracle (Bayes)", "hr@10", "oracle_hr@10"),
                   ("oracle (Bayes)", "ndcg@10", "oracle_ndcg@10")],
           "node": [("oracle (one-hop Bayes)", "accuracy", "one_hop_bayes_accuracy"),
                    ("oracle (features only, Bayes)", "accuracy", "feature_bayes_accuracy")],
           "xc": [("oracle (Bayes)", "p@1", "oracle_p_at_1"),
                  ("oracle (Bayes)", "p@5", "oracle_p_at_5")]}


def oracle_rows(family: str, meta: dict) -> list[dict]:
    """The planted model's test figures (a graph's under ``generator``), one row per oracle."""
    found = (meta.get("generator") or {}) if family == "node" else meta
    rows: dict[str, dict] = {}
    for name, metric, key in ORACLES[family]:
        value = (found.get(key) or {}).get("test")
        if value is not None:
            rows.setdefault(name, {"name": name, "kind": "oracle", "runs": [], "mean": {},
                                   "std": {}})["mean"][metric] = value
    return list(rows.values())


BASELINES = {"ctr": ctr_baselines, "seq": seq_baselines, "node": node_baselines,
             "xc": xc_baselines}


def family_refusal(family: str, meta: dict) -> Optional[str]:
    """Why the data set of ``meta`` is not one of ``family`` (its ``task``), or None."""
    task = meta.get("task")
    want = {"seq": ("seq",), "xc": ("xc",), "node": ("graph",), "ctr": (None, "ctr")}[family]
    if task not in want:
        return f"a {task or 'tabular CTR'} data set, not one of --family {family}"
    if family == "node" and not (meta.get("labels") and meta.get("num_features")):
        return "a graph without node labels or features: --family node needs both"
    return None


def print_table(rows: list[dict], metrics: tuple[str, ...], title: str) -> None:
    print(title)
    print(f"{'method':<36}" + "".join(f"{m:>18}" for m in metrics) + f"{'runs':>6}"
          f"{'s/run':>8}")
    for row in rows:
        cells = []
        for m in metrics:
            v = row["mean"].get(m)
            sd = row["std"].get(m)
            cells.append("-" if v is None else f"{v:.4f}" + ("" if sd is None or
                                                            len(row["runs"]) < 2 else
                                                            f" ± {sd:.4f}"))
        secs = [r["seconds"] for r in row["runs"] if "error" not in r["metrics"]]
        runs = len(row["runs"]) - row.get("failed", 0)
        print(f"{row['name']:<36}" + "".join(f"{c:>18}" for c in cells)
              + f"{runs if row['runs'] else '-':>6}"
              + (f"{statistics.mean(secs):>8.1f}" if secs else f"{'-':>8}"))
        if row.get("failed"):
            print(f"{'':<4}{row['failed']} run(s) failed: " + "; ".join(
                r["metrics"]["error"] for r in row["runs"] if "error" in r["metrics"]))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", required=True, choices=sorted(FAMILIES))
    p.add_argument("--data", type=Path, required=True, help="the data set (its metadata.json)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 of the seeded baselines "
                   "and the model runs (default 3)")
    p.add_argument("--model", type=Path, action="append", default=[], metavar="CONFIG",
                   help="also train this config on --data once per seed (repeatable)")
    p.add_argument("--model-seeds", type=int, metavar="N",
                   help="seeds 0..N-1 of the --model runs (default: --seeds)")
    p.add_argument("--work", type=Path, help="the model runs' directories (default: a new "
                   "temporary folder)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override of every --model run (repeatable)")
    p.add_argument("--json", type=Path, help="write the figures and the command here")
    g = p.add_argument_group("ctr baselines")
    g.add_argument("--epochs", type=int, default=10, help="at most (default 10)")
    g.add_argument("--lr", type=float, default=0.01,
                   help="Adam's, logistic regression (default 0.01)")
    g.add_argument("--fm-lr", type=float, default=0.001,
                   help="Adam's, factorization machine (default 0.001: at 0.01 its factors "
                        "overfit within an epoch on the 100k-row replica)")
    g.add_argument("--l2", type=float, default=1e-5,
                   help="on the looked-up rows' squared norms (default 1e-5)")
    g.add_argument("--batch", type=int, default=1024, help="rows a step (default 1024)")
    g.add_argument("--fm-rank", type=int, default=8, help="the FM's factor rank (default 8)")
    g.add_argument("--min-count", type=int, default=1,
                   help="ids seen fewer times in train share their field's rare-id weight "
                        "(default 1: every id of train has its own)")
    args = p.parse_args(argv)
    meta_file = args.data / "metadata.json"
    if not meta_file.is_file():
        raise SystemExit(f"{meta_file}: no such file (--data names a data set's folder)")
    for config in args.model:
        if not config.is_file():
            raise SystemExit(f"--model {config}: no such file")
    for flag, value in (("--seeds", args.seeds), ("--model-seeds", args.model_seeds)):
        if value is not None and value < 1:
            raise SystemExit(f"{flag} must be >= 1, got {value}")
    model_seeds = args.seeds if args.model_seeds is None else args.model_seeds
    meta = json.loads(meta_file.read_text())
    why = family_refusal(args.family, meta)
    if why:
        raise SystemExit(f"{meta_file}: {why}")
    start = time.perf_counter()
    rows = BASELINES[args.family](args.data, meta, args)
    if args.model:
        work = args.work or Path(tempfile.mkdtemp(prefix="bench_baselines_"))
        rows += [model_row(c, args.data, model_seeds, work, args.set) for c in args.model]
    rows += oracle_rows(args.family, meta)
    metrics = FAMILIES[args.family]
    print_table(rows, metrics, f"{args.family} on {args.data} (test split; mean ± std over "
                               f"the runs' seeds 0, 1, ..)")
    failed = sum(r.get("failed", 0) for r in rows)
    if args.json:
        record = {"family": args.family, "data": str(args.data), "split": "test",
                  "metrics": list(metrics), "rows": rows, "seeds": args.seeds,
                  "model_seeds": model_seeds if args.model else None,
                  "seconds": round(time.perf_counter() - start, 1),
                  "command": "python " + shlex.join(sys.argv if argv is None
                                                    else ["benchmarks/bench_baselines.py",
                                                          *argv])}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
