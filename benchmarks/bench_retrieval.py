"""Retrieval on a ``datagen retrieval`` data set: the two-tower model against the oracle and three
classic baselines, every figure over the full item corpus on the same test split.

- ``oracle``: the planted model's ranking (``metadata.json``);
- ``popularity``: items by their count in the train split;
- ``cooccurrence``: item-to-item: items by how often they share a user with the row's history
  items in the train split (``sum over history items i of C[i, j]``, ``C`` the item x item count
  of users' train events), ties by popularity;
- ``als``: implicit-feedback matrix factorisation (Hu, Koren and Volinsky, 2008) from the
  ``implicit`` package on the users x items train matrix, its factors (64, 128, 256),
  regularisation (0.1, 1) and confidence scale (alpha 1, 10, 40) chosen on the valid split
  (``--als-grid`` narrows or widens the grid); a
  test row's user factor is recomputed from its train and valid events (``recalculate_user``);
- ``model``: ``embedtrain train CONFIG`` on the data (``--steps``), and ``model_no_log_q`` the
  same with ``task.log_q=false``: their summaries' test recall@k, training examples/s.

Usage:
    embedtrain datagen retrieval --users 100000 --items 50000 --out data/retrieval
    python benchmarks/bench_retrieval.py --data data/retrieval --json benchmarks/out/ret.json

Writes ``--json`` (keys ``recall@10.{model,model_no_log_q,oracle,als,cooccurrence,popularity}``,
the same for ``recall@50``, ``train_examples_per_s``, ``als_params``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import scipy.sparse as sp

KS = (10, 50)


def read_split(root: Path, meta: dict, split: str) -> dict[str, np.ndarray]:
    """A split's ``user``, ``item`` and ``history`` (as ``offsets``, ``values``)."""
    table = pq.read_table([root / f for f in meta["splits"][split]["files"]]
                          if len(meta["splits"][split]["files"]) > 1
                          else root / meta["splits"][split]["files"][0])
    hist = table.column("history").combine_chunks()
    offsets = hist.offsets.to_numpy().astype(np.int64)
    return {"user": table.column("user").to_numpy(), "item": table.column("item").to_numpy(),
            "offsets": offsets - offsets[0], "values": hist.flatten().to_numpy()}


def recall(top: np.ndarray, targets: np.ndarray) -> dict[int, float]:
    return {k: float((top[:, :k] == targets[:, None]).any(axis=1).mean()) for k in KS}


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    part = np.argpartition(-scores, k, axis=1)[:, :k]
    rows = np.arange(scores.shape[0])[:, None]
    order = np.argsort(-scores[rows, part], axis=1, kind="stable")
    return part[rows, order]


def history_matrix(split: dict, items: int) -> sp.csr_matrix:
    rows = np.repeat(np.arange(len(split["item"])), np.diff(split["offsets"]))
    return sp.csr_matrix((np.ones(len(rows), np.float32), (rows, split["values"])),
                         shape=(len(split["item"]), items))


def user_items(parts: list[dict], users: int, items: int) -> sp.csr_matrix:
    u = np.concatenate([p["user"] for p in parts])
    i = np.concatenate([p["item"] for p in parts])
    m = sp.csr_matrix((np.ones(len(u), np.float32), (u, i)), shape=(users, items))
    m.sum_duplicates()
    return m


def popularity(train: dict, test: dict, items: int) -> tuple[dict, np.ndarray]:
    pop = np.bincount(train["item"], minlength=items).astype(np.float64)
    top = top_k(pop[None, :] - np.arange(items)[None, :] * 1e-9, max(KS))
    return recall(np.repeat(top, len(test["item"]), 0), test["item"]), pop


def cooccurrence(train: dict, test: dict, users: int, items: int, pop: np.ndarray) -> dict:
    x = user_items([train], users, items)
    x.data[:] = 1.0
    c = (x.T @ x).tocsr()
    c.setdiag(0)
    h = history_matrix(test, items)
    tie = pop / (pop.max() + 1) * 1e-3
    tops = []
    for lo in range(0, h.shape[0], 2048):
        scores = (h[lo:lo + 2048] @ c).toarray() + tie[None, :]
        tops.append(top_k(scores, max(KS)))
    return recall(np.concatenate(tops), test["item"])


ALS_GRID = [(f, r, a) for f in (64, 128, 256) for r in (0.1, 1.0) for a in (1.0, 10.0, 40.0)]


def parse_als_grid(text: str) -> list[tuple[int, float, float]]:
    """``FACTORS:REG:ALPHA,...`` -> the ALS settings tried (one-line error on a bad one)."""
    grid = []
    for item in text.split(","):
        try:
            f, r, a = item.split(":")
            grid.append((int(f), float(r), float(a)))
        except ValueError:
            raise SystemExit(f"--als-grid: {item!r} is not FACTORS:REG:ALPHA") from None
    return grid


def als(train: dict, valid: dict, test: dict, users: int, items: int, threads: int,
        grid: list[tuple[int, float, float]]) -> tuple[dict, dict]:
    from implicit.cpu.als import AlternatingLeastSquares

    base = user_items([train], users, items)
    with_valid = user_items([train, valid], users, items)

    def fit(factors, regularization, alpha):
        model = AlternatingLeastSquares(factors=factors, regularization=regularization, alpha=alpha,
                                        iterations=15, random_state=0, num_threads=threads)
        model.fit(base, show_progress=False)
        return model

    def evaluate(model, split, matrix):
        ids, _ = model.recommend(split["user"], matrix[split["user"]], N=max(KS),
                                 filter_already_liked_items=False,
                                 recalculate_user=matrix is not base)
        return recall(ids, split["item"])

    best, best_params = -1.0, None
    for factors, reg, alpha in grid:
        got = evaluate(fit(factors, reg, alpha), valid, base)[10]
        print(f"als factors {factors} regularization {reg} alpha {alpha}: valid "
              f"recall@10 {got:.4f}", file=sys.stderr)
        if got > best:
            best, best_params = got, {"factors": factors, "regularization": reg, "alpha": alpha}
    model = fit(**best_params)
    return evaluate(model, test, with_valid), {**best_params, "valid_recall@10": best}


def ann_rows(sizes: list[int], dim: int, kind_of: dict[int, str]) -> list[dict]:
    """The item index at each size on synthetic clustered unit vectors (what trained item
    embeddings look like: around 2,000 directions): build time, recall@10 against exact search
    on 1,000 queries near the items, and the latency of one query at a time (p50, p99)."""
    from embedtrain.export.items import build_index, exact_top, recall_at_10, sample_queries

    rows = []
    for n in sizes:
        rng = np.random.default_rng(0)
        centres = rng.standard_normal((2_000, dim)).astype(np.float32)
        x = np.empty((n, dim), np.float32)
        for lo in range(0, n, 1 << 20):
            hi = min(n, lo + (1 << 20))
            block = centres[rng.integers(0, 2_000, hi - lo)]
            block += 0.5 * rng.standard_normal((hi - lo, dim), dtype=np.float32)
            x[lo:hi] = block / np.linalg.norm(block, axis=1, keepdims=True)
        t = time.perf_counter()
        index, kind, params, recall = build_index(x, kind_of.get(n, "auto"))
        build = time.perf_counter() - t
        queries = sample_queries(x, seed=1)
        exact = exact_top(x, queries, 10)
        measured = recall_at_10(index, exact, queries)
        times = []
        for q in queries:
            t = time.perf_counter()
            index.search(q[None, :], 10)
            times.append((time.perf_counter() - t) * 1e3)
        rows.append({"items": n, "dim": dim, "index": kind, "params": params,
                     "build_s": build, "recall_at_10_vs_exact": measured,
                     "p50_ms": float(np.percentile(times, 50)),
                     "p99_ms": float(np.percentile(times, 99))})
        print(f"ann {n:,} items: {kind} {params}, built in {build:.1f} s, recall@10 vs exact "
              f"{measured:.4f}, p50 {rows[-1]['p50_ms']:.3f} ms, p99 {rows[-1]['p99_ms']:.3f} ms",
              file=sys.stderr)
        del index, x
    return rows


def train_model(config: str, data: Path, out: Path, sets: list[str]) -> dict:
    cmd = [sys.executable, "-m", "embedtrain", "train", config, "--out", str(out), "--overwrite",
           "--set", f"data.path={data}", "--set", "train.progress=false",
           *[a for s in sets for a in ("--set", s)]]
    print("$", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)
    return json.loads((out / "summary.json").read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data/retrieval", type=Path)
    p.add_argument("--config", default="configs/retrieval_synthetic.yaml")
    p.add_argument("--work", default=Path("runs/bench_retrieval"), type=Path)
    p.add_argument("--set", action="append", default=[], dest="sets",
                   help="KEY=VALUE for the model runs (repeatable)")
    p.add_argument("--skip-model", action="store_true", help="no model runs")
    p.add_argument("--skip-baselines", action="store_true", help="no baselines")
    p.add_argument("--ann-items", default="1000000",
                   help="comma-separated corpus sizes of the index rows ('' for none)")
    p.add_argument("--ann-index", default="1000000:hnsw,10000000:ivf",
                   help="SIZE:KIND of the index at a size (default: auto)")
    p.add_argument("--ann-dim", type=int, default=64)
    p.add_argument("--als-grid", type=parse_als_grid, default=ALS_GRID,
                   help="FACTORS:REG:ALPHA,... the ALS settings tried on valid (default: "
                        "factors 64/128/256 x regularisation 0.1/1 x alpha 1/10/40)")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    meta = json.loads((args.data / "metadata.json").read_text())
    if meta.get("task") != "retrieval":
        raise SystemExit(f"{args.data}/metadata.json: not a retrieval data set")
    users, items = meta["num_users"], meta["num_classes"]
    train, valid, test = (read_split(args.data, meta, s) for s in ("train", "valid", "test"))
    out: dict = {"data": str(args.data), "users": users, "items": items,
                 "test_rows": len(test["item"])}
    figures: dict[str, dict] = {"oracle": {k: meta[f"oracle_recall@{k}"]["test"] for k in KS}}
    t = time.perf_counter()
    if not args.skip_baselines:
        figures["popularity"], pop = popularity(train, test, items)
        figures["cooccurrence"] = cooccurrence(train, test, users, items, pop)
        from threadpoolctl import threadpool_limits

        with threadpool_limits(1, "blas"):  # implicit's own threads, not OpenBLAS's (its advice)
            figures["als"], out["als_params"] = als(train, valid, test, users, items,
                                                    os.cpu_count() or 1, args.als_grid)
        out["baselines_s"] = time.perf_counter() - t
    if not args.skip_model:
        speed = {}
        for name, extra in (("model", []), ("model_no_log_q", ["task.log_q=false"])):
            summary = train_model(args.config, args.data, args.work / name, args.sets + extra)
            figures[name] = {k: summary[f"recall@{k}"] for k in KS}
            speed[name] = summary.get("train_examples_per_s")
            out[f"{name}_steps"] = summary.get("steps")
        out["train_examples_per_s"] = speed
    for k in KS:
        out[f"recall@{k}"] = {name: f[k] for name, f in figures.items()}
    sizes = [int(v) for v in args.ann_items.split(",") if v]
    kinds = {int(a): b for a, b in (v.split(":") for v in args.ann_index.split(",") if v)}
    out["ann_rows"] = []
    for n in sizes:  # the JSON is rewritten after each row: a long one keeps the others
        write_json(args.json, out)
        out["ann_rows"] += ann_rows([n], args.ann_dim, kinds)
        first = out["ann_rows"][0]
        out["ann"] = {"items": first["items"], "recall_at_10_vs_exact":
                      first["recall_at_10_vs_exact"], "p50_ms": first["p50_ms"],
                      "p99_ms": first["p99_ms"], "index": first["index"]}
    print(f"{'':16}" + "".join(f"{f'recall@{k}':>12}" for k in KS))
    for name, f in figures.items():
        print(f"{name:16}" + "".join(f"{f[k]:12.4f}" for k in KS))
    write_json(args.json, out)
    return 0


def write_json(path: str, out: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
