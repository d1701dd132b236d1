"""How close to the oracle a model of exactly the planted terms gets on a ``datagen ctr --structure
fm`` set: the ceiling a general CTR model (DLRM, DCN, DeepFM) can be held to at that size.

The reference is plain torch, not embedtrain: ``logit = b + w . z(dense) + sum_f bias_f[id_f] +
<sum_{u in user fields} U_u[id_u], sum_{i in item fields} V_i[id_i]>`` over the planted fields
(``embedtrain.datagen.ctr_clicks``: rank 8, the same fields), trained with Adam on the training
split (batch 4096, ``--l2`` on the looked-up rows), validated every ``--eval-every`` steps on the
validation split, and the test AUC taken at the best validation AUC. Ids are used as given:
run it on a data set re-encoded with ``configs/ingest/ctr_fm.yaml`` to see the threshold's effect
(``--oracle-from`` names the datagen set, whose metadata holds the oracle).

Usage:
    python benchmarks/bench_fm_reference.py --data data/fm_1m_min300 --oracle-from data/fm_1m \\
        [--epochs 4] [--lr 0.01] [--l2 1e-5] [--json benchmarks/out/fm_reference.json]

Prints the validation curve and a line: test AUC, oracle, gap; JSON: the same with the command.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from embedtrain.datagen.ctr import roc_auc
from embedtrain.datagen.ctr_clicks import _FM_BIAS_ONLY, _FM_DENSE, _FM_ITEM, _FM_RANK, _FM_USER


def _load(data: Path, meta: dict, split: str) -> tuple[torch.Tensor, dict, torch.Tensor]:
    t = pa.concat_tables([pq.read_table(data / f) for f in meta["splits"][split]["files"]])
    dense = np.stack([t[c].to_numpy().astype(np.float64) for c in _FM_DENSE], axis=1)
    ids = {c: torch.from_numpy(t[c].to_numpy().astype(np.int64))
           for c in (*_FM_USER, *_FM_ITEM, *_FM_BIAS_ONLY)}
    return torch.from_numpy(dense), ids, torch.from_numpy(t["label"].to_numpy().astype(np.float32))


class Planted(torch.nn.Module):
    def __init__(self, sizes: dict[str, int], n_dense: int):
        super().__init__()
        self.dense = torch.nn.Linear(n_dense, 1)
        self.bias = torch.nn.ModuleDict({c: torch.nn.Embedding(n, 1) for c, n in sizes.items()})
        self.factors = torch.nn.ModuleDict({c: torch.nn.Embedding(sizes[c], _FM_RANK)
                                            for c in (*_FM_USER, *_FM_ITEM)})
        for e in self.bias.values():
            torch.nn.init.zeros_(e.weight)
        for e in self.factors.values():
            torch.nn.init.normal_(e.weight, std=0.05)

    def forward(self, dense, ids):
        bias = [self.bias[c](ids[c]) for c in self.bias]
        factors = {c: self.factors[c](ids[c]) for c in self.factors}  # each looked up once
        u = sum(factors[c] for c in _FM_USER)
        v = sum(factors[c] for c in _FM_ITEM)
        logit = self.dense(dense).squeeze(1) + sum(b.squeeze(1) for b in bias)
        penalty = sum((r * r).sum(1).mean() for r in [*bias, *factors.values()])
        return logit + (u * v).sum(1), penalty


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--oracle-from", type=Path, default=None)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--l2", type=float, default=1e-5)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--cosine", action="store_true", help="decay the lr to 0 over the run (cosine)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    meta = json.loads((args.data / "metadata.json").read_text())
    oracle_meta = json.loads(((args.oracle_from or args.data) / "metadata.json").read_text())
    oracle = oracle_meta["oracle_auc"]["test"]
    sizes = {s["name"]: s["num_embeddings"] for s in meta["sparse"]}
    splits = {s: _load(args.data, meta, s) for s in ("train", "valid", "test")}
    # log1p + standardise with the training split's moments (the datagen's dense are raw counts;
    # an ingested set's are transformed already, and standardising again changes nothing)
    raw = meta.get("dense_transform") == "log1p"
    d_train = torch.log1p(splits["train"][0]) if raw else splits["train"][0]
    mean, std = d_train.mean(0), d_train.std(0)
    prep = {s: (((torch.log1p(d) if raw else d) - mean) / std).float()
            for s, (d, _, _) in splits.items()}
    model = Planted({c: sizes[c] for c in (*_FM_USER, *_FM_ITEM, *_FM_BIAS_ONLY)}, len(_FM_DENSE))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    total = args.epochs * -(-len(splits["train"][2]) // args.batch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total) if args.cosine else None
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def auc(split: str) -> float:
        with torch.no_grad():
            logit, _ = model(prep[split], splits[split][1])
        return roc_auc(logit.numpy(), splits[split][2].numpy())

    n = len(splits["train"][2])
    best, step, curve = (-1.0, 0, 0.0), 0, []
    for _ in range(args.epochs):
        order = torch.randperm(n)
        for lo in range(0, n, args.batch):
            idx = order[lo:lo + args.batch]
            logit, penalty = model(prep["train"][idx], {c: v[idx] for c, v in
                                                       splits["train"][1].items()})
            loss = loss_fn(logit, splits["train"][2][idx]) + args.l2 * penalty
            opt.zero_grad()
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
            step += 1
            if step % args.eval_every == 0:
                v = auc("valid")
                curve.append((step, round(v, 4)))
                if v > best[0]:
                    best = (v, step, auc("test"))
        print(f"epoch done at step {step}: valid AUC {curve[-1][1] if curve else '-'}", flush=True)
    valid, at, test = best
    print(f"reference: test AUC {test:.4f} at step {at} (best valid {valid:.4f}); oracle "
          f"{oracle:.4f}; gap {test - oracle:+.4f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "data": str(args.data), "oracle_auc": oracle, "test_auc": test, "gap": test - oracle,
            "best_valid_auc": valid, "best_step": at, "curve": curve, "lr": args.lr,
            "l2": args.l2, "epochs": args.epochs, "cosine": args.cosine,
            "command": "python benchmarks/bench_fm_reference.py " + " ".join(argv or sys.argv[1:])},
            indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
