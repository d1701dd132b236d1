"""GraphSAGE vs GCN vs GAT vs an MLP on the same graph and splits (``gnn.model``), with all labels
and with few (a 140-label-style split: ``--per-class`` labelled training nodes a class).

The graph is ``--data`` (default: ``embedtrain datagen graph --nodes 20000`` drawn into ``--work``).
The few-label variant is the same data set but for its train split: ``--per-class`` nodes of each
class drawn from the train split (seeded), the other splits as they are; it is written beside it
with the large arrays linked, not copied. Each (model, seed) is one ``embedtrain train
configs/gnn_node.yaml`` run (``--set gnn.model=M --set train.seed=S``, the config's fanouts
and optimizer, :data:`LAYERS`' layers and node-id table); all labels: ``--epochs`` epochs; few
labels: batch ``--few-batch`` and ``--few-epochs`` epochs. Figures: test accuracy and macro-F1
from each run's ``summary.json``, the mean and standard deviation over ``--seeds``, training
seeds/s.

Usage:
    python benchmarks/bench_gnn_layers.py --json benchmarks/out/gnn_layers.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("sage", "gcn", "gat", "mlp")
# The layers the recorded figures were measured with (the shipped config's until it became APPNP
# with one MLP layer and no node-id table): one layer of 128 a hop, a 32-wide node-id table.
LAYERS = ("gnn.hidden=[128,128]", "gnn.embedding_dim=32", "gnn.dropout=0.0")


def few_label_copy(data: Path, out: Path, per_class: int, seed: int = 0) -> Path:
    """``data`` with a train split of ``per_class`` nodes a class (from its own train split);
    the arrays linked, ``metadata.json`` and the train split written anew."""
    meta = json.loads((data / "metadata.json").read_text())
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for sub in ("graph", "nodes"):
        os.symlink((data / sub).resolve(), out / sub)
    (out / "splits").mkdir()
    for split, rel in meta["splits"].items():
        if split != "train":
            os.symlink((data / rel).resolve(), out / rel)
    labels = np.load(data / meta["labels"], mmap_mode="r")
    train = np.load(data / meta["splits"]["train"])
    rng = np.random.default_rng(seed)
    picked = [rng.choice(train[labels[train] == c], per_class, replace=False)
              for c in range(meta["num_classes"]) if (labels[train] == c).sum() >= per_class]
    np.save(out / meta["splits"]["train"], np.sort(np.concatenate(picked)).astype(np.int64))
    meta["name"] = f"{meta['name']}_{per_class}_per_class"
    (out / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def train(data: Path, out: Path, model: str, seed: int, sets: list[str]) -> dict:
    """One run; its summary (test accuracy, macro-F1, seeds/s)."""
    args = [sys.executable, "-m", "embedtrain", "train", str(ROOT / "configs/gnn_node.yaml"),
            "--out", str(out), "--no-progress", "--set", f"data.path={data}",
            "--set", f"gnn.model={model}", "--set", f"train.seed={seed}",
            "--set", "train.checkpoint_every=0", "--set", "train.eval_every=0",
            *[a for s in (*LAYERS, *sets) for a in ("--set", s)]]
    r = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, help="a node-classification graph (default: draw one)")
    p.add_argument("--nodes", type=int, default=20_000, help="nodes of the drawn graph")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_gnn_layers"))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--per-class", type=int, default=20)
    p.add_argument("--few-batch", type=int, default=64)
    p.add_argument("--few-epochs", type=int, default=30)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    data = args.data
    if data is None:
        data = args.work / "graph"
        if not (data / "metadata.json").is_file():
            subprocess.run([sys.executable, "-m", "embedtrain", "datagen", "graph", "--nodes",
                            str(args.nodes), "--out", str(data)], check=True, cwd=ROOT)
    few = few_label_copy(data, args.work / "few", args.per_class)
    regimes = {"all labels": (data, [f"train.epochs={args.epochs}"]),
               f"{args.per_class} labels a class": (few, [
                   f"train.epochs={args.few_epochs}", f"data.batch_size={args.few_batch}"])}
    rows = []
    print(f"{'labels':<20} {'model':<6} {'accuracy':>17} {'macro-F1':>17} {'seeds/s':>9}")
    for regime, (path, sets) in regimes.items():
        for model in args.models.split(","):
            runs = []
            for seed in range(args.seeds):
                start = time.perf_counter()
                s = train(path, args.work / "runs" / f"{regime[:3]}_{model}_{seed}", model, seed,
                          sets)
                runs.append({"seed": seed, "accuracy": s["accuracy"], "macro_f1": s["macro_f1"],
                             "seeds_per_s": s["train_examples_per_s"],
                             "wall_s": round(time.perf_counter() - start, 1)})
            acc, f1 = ([r[k] for r in runs] for k in ("accuracy", "macro_f1"))
            row = {"labels": regime, "model": model, "runs": runs,
                   "accuracy_mean": statistics.mean(acc), "accuracy_std": statistics.pstdev(acc),
                   "macro_f1_mean": statistics.mean(f1), "macro_f1_std": statistics.pstdev(f1),
                   "seeds_per_s": statistics.median(r["seeds_per_s"] for r in runs)}
            rows.append(row)
            print(f"{regime:<20} {model:<6} {row['accuracy_mean']:.4f} ± {row['accuracy_std']:.4f}"
                  f"  {row['macro_f1_mean']:.4f} ± {row['macro_f1_std']:.4f} "
                  f"{row['seeds_per_s']:>9,.0f}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"data": str(data), "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
