"""How much of ``datagen retrieval``'s oracle the item side can reach from the data set's events.

The oracle (``metadata.json``'s ``oracle_recall@10``) ranks with every planted vector. An item's
vector is its brand's plus its own part (``item_noise``), which only the item's train events
reveal. This script fits that own part the best way there is, with everything else given:

- ``brand_only``: each item ranked by its brand's planted vector (no own part at all);
- ``map_item_side``: the planted user vectors, brand vectors and sharpness known; each item's
  own part ``delta_j`` the maximum a posteriori estimate of the full softmax over the warm items
  on the train split's events, with the planted prior ``N(0, item_noise^2 / dim)`` (block Newton:
  each item's ``dim x dim`` Hessian, damped steps, a step that raises the objective undone and
  halved). Scored like the oracle, ``<q_u, b_j + delta_j>``.

What the towers learn is bounded by ``map_item_side`` from above on the item side (they also
estimate the users, from features and history, and the brands); the gap between the two is the
towers' estimator, the gap between ``map_item_side`` and ``oracle`` the data's events per item.

Usage:
    python benchmarks/bench_retrieval_bounds.py --data data/retrieval --iters 10 --json F

Every iteration scores the ``users x warm items`` softmax with its gradient and Hessians
(about 60 s on two cores with the defaults' 100k users and 50k items).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--iters", type=int, default=10, help="Newton iterations")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    import numpy as np
    import pyarrow.dataset as ds
    import torch

    from embedtrain.datagen.retrieval import RetrievalDataSpec, planted_towers

    try:
        meta = json.loads((args.data / "metadata.json").read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{args.data}/metadata.json: cannot read ({e.__class__.__name__})")
    if meta.get("task") != "retrieval" or "generator" not in meta:
        raise SystemExit(f"{args.data}/metadata.json: not a `datagen retrieval` data set")
    spec = RetrievalDataSpec(**meta["generator"])
    m = planted_towers(spec)
    Q = torch.from_numpy(m.user_vectors)
    s, d = spec.sharpness, spec.dim
    B = torch.from_numpy(m.brand_vectors[m.brand].astype(np.float32))
    tr = ds.dataset(args.data / "train").to_table(columns=["user", "item"])
    u, it = (torch.from_numpy(tr[c].to_numpy()) for c in ("user", "item"))
    n_u = torch.bincount(u, minlength=spec.users).float()
    S = torch.zeros(spec.items, d).index_add_(0, it, Q[u])  # each item's events' user vectors
    warm = torch.from_numpy(~m.cold).nonzero().squeeze(1)
    te = ds.dataset(args.data / "test").to_table(columns=["user", "item"])
    tu, ti = (torch.from_numpy(te[c].to_numpy()) for c in ("user", "item"))
    sig2 = spec.item_noise ** 2 / d
    QQ = (Q[:, :, None] * Q[:, None, :]).reshape(len(Q), d * d)

    def recall(V, k=10):
        hits = 0
        for lo in range(0, len(tu), 4096):
            top = (Q[tu[lo:lo + 4096]] @ V.T).topk(k, dim=1).indices
            hits += (top == ti[lo:lo + 4096, None]).any(1).sum().item()
        return hits / len(tu)

    out = {"data": str(args.data), "events_per_warm_item": len(u) / len(warm),
           "oracle": recall(torch.from_numpy(m.item_vectors)), "brand_only": recall(B),
           "iterations": []}
    print(f"oracle {out['oracle']:.4f}, brand only {out['brand_only']:.4f}, "
          f"{out['events_per_warm_item']:.1f} events a warm item", flush=True)
    delta = torch.zeros(spec.items, d)
    t, alpha, best = time.perf_counter(), 0.5, (math.inf, None, None)
    for step in range(args.iters):
        V = B + delta
        Vw = V[warm]
        E = torch.zeros(len(warm), d)
        H = torch.zeros(len(warm), d * d)
        nll = 0.0
        for lo in range(0, spec.users, 4096):
            z = s * Q[lo:lo + 4096] @ Vw.T
            lse = torch.logsumexp(z, 1, keepdim=True)
            w = torch.exp(z - lse) * n_u[lo:lo + 4096, None]
            nll += float((n_u[lo:lo + 4096] * lse.squeeze(1)).sum())
            E += w.T @ Q[lo:lo + 4096]
            H += w.T @ QQ[lo:lo + 4096]
        nll += float((delta ** 2).sum() / (2 * sig2)) - float(s * (S * V).sum())
        if nll > best[0]:  # the last step raised the objective: undo it, take half
            delta, alpha = best[1].clone(), alpha / 2
            delta[warm] += alpha * best[2]
            continue
        g = s * (S[warm] - E) - delta[warm] / sig2
        step_v = torch.linalg.solve(s * s * H.reshape(-1, d, d) + torch.eye(d) / sig2,
                                    g.unsqueeze(-1)).squeeze(-1)
        best = (nll, delta.clone(), step_v)
        delta[warm] += alpha * step_v
        row = {"iteration": step, "nll_per_event": nll / len(u),
               "recall@10": recall(B + delta), "s": time.perf_counter() - t}
        out["iterations"].append(row)
        print(f"iteration {step}: nll/event {row['nll_per_event']:.5f}, recall@10 "
              f"{row['recall@10']:.4f} ({row['s']:.0f} s)", flush=True)
    out["map_item_side"] = out["iterations"][-1]["recall@10"] if out["iterations"] else None
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
