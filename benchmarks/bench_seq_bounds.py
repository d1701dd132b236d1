"""How much of ``datagen seq``'s oracle a learner can reach from the data set's own events.

The oracle (``metadata.json``'s ``oracle_hr@10``) ranks with the planted model's true parameters.
With ``transition: item`` those include ``S`` successors for each of the ``N`` items, which a data
set of a few events per item reveals only in part; this script measures two bounds that say how
much:

- ``cooccurrence_more_data``: the item-to-item co-occurrence baseline of ``bench_seq.py``, its
  counts taken from the train split of ``--more`` (a larger draw of the same planted model:
  ``datagen seq`` with the same seed, items, clusters and mixture, more users), ranking the test
  rows of ``--data``. With ten times the users it approaches what the last item alone says.
- ``known_structure``: every parameter of the planted model known (clusters, popularities, the
  user's cluster posterior from the whole history) except the successors, whose term is the
  counted ``(last item -> item)`` pairs of ``--data``'s train split with a Dirichlet prior of
  strength ``mu`` toward the known rest (``(count_j + mu * rest_j) / (n_last + mu)``, the best
  ``mu`` of a sweep reported): a learner that needs to learn nothing but the successors, from
  the events the model trains on.
- ``oracle_last_item``: the oracle's ranking with the user's interest inferred from the last
  item alone (as if the history were that one event): the gap to ``oracle`` is what the rest of
  the history adds, and this is the most an item-to-item method can reach.

Both rank all items for ``--rows`` test rows drawn at random (seed 0; the oracle on the same rows
as the reference).

Usage:
    embedtrain datagen seq --out data/seq
    embedtrain datagen seq --users 1000000 --out data/seq1m
    python benchmarks/bench_seq_bounds.py --data data/seq --more data/seq1m --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from bench_seq import figures, pair_counts, ranks_by_cooccurrence, read_split, with_targets

MUS = (10, 30, 100, 300)


def known_structure_ranks(meta: dict, train: tuple, test: tuple, rows: np.ndarray,
                          block: int = 500) -> dict[str, np.ndarray]:
    """1-based ranks of the target, per ranking (``oracle``, ``mu=..``), for test ``rows``."""
    from embedtrain.datagen.seq_model import SeqDataSpec, SeqPlantedModel

    spec = SeqDataSpec(**{k: v for k, v in meta["generator"].items() if k != "description"})
    model = SeqPlantedModel(spec)
    size = meta["num_items"]
    keys, counts = pair_counts(train[0], train[1], size)
    offsets, items, targets = test
    ranks: dict[str, list] = {}
    for lo in range(0, len(rows), block):
        rs = rows[lo:lo + block]
        hist = [items[offsets[r]:offsets[r + 1]] for r in rs]
        off = np.concatenate([[0], np.cumsum([len(h) for h in hist])])
        flat = np.concatenate(hist)
        row_of = np.repeat(np.arange(len(rs)), np.diff(off))
        post = model.posterior(row_of, model.cluster[flat], model.event_evidence(off, flat),
                               len(rs))
        last = flat[off[1:] - 1]
        rest = model.b * post[:, model.cluster] * model.pop + model.c * model.g   # (R, size)
        rest /= rest.sum(axis=1, keepdims=True)
        counted = np.zeros((len(rs), size))
        a, b = np.searchsorted(keys, last * size), np.searchsorted(keys, (last + 1) * size)
        for i in range(len(rs)):
            counted[i, keys[a[i]:b[i]] - last[i] * size] = counts[a[i]:b[i]]
        n_last = counted.sum(axis=1, keepdims=True)
        every = np.broadcast_to(np.arange(size), (len(rs), size))
        alone = model.posterior(np.arange(len(rs)), model.cluster[last],
                                model.event_evidence(np.arange(len(rs) + 1), last), len(rs))
        every = np.ascontiguousarray(every)
        scores = {"oracle": model.next_probs(post, last, every),
                  "oracle_last_item": model.next_probs(alone, last, every)}
        for mu in MUS:
            scores[f"mu={mu}"] = (counted + mu * rest) / (n_last + mu)
        t = targets[rs]
        for name, s in scores.items():
            s[:, 0] = -np.inf                                  # the padding id is no item
            st = s[np.arange(len(rs)), t]
            ranks.setdefault(name, []).append((s > st[:, None]).sum(axis=1) + 1)
    return {name: np.concatenate(r) for name, r in ranks.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="a datagen seq data set")
    p.add_argument("--more", help="a larger draw of the same planted model (more users)")
    p.add_argument("--rows", type=int, default=5000, help="test rows ranked (default 5,000)")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    start = time.perf_counter()
    root = Path(args.data)
    meta = json.loads((root / "metadata.json").read_text())
    if "generator" not in meta:
        raise SystemExit(f"{root}/metadata.json: not a datagen seq data set (no generator)")
    train = with_targets(*read_split(root, meta, "train"))
    test = read_split(root, meta, "test")
    rows = np.sort(np.random.default_rng(0).choice(len(test[2]), min(args.rows, len(test[2])),
                                                   replace=False))
    ranks = known_structure_ranks(meta, train, test, rows)
    out = {name: figures(r) for name, r in ranks.items()}
    best = max(MUS, key=lambda mu: out[f"mu={mu}"]["hr@10"])
    record = {"data": str(root), "rows": int(len(rows)), "oracle_hr@10_all_rows":
              meta["oracle_hr@10"]["test"], "oracle": out["oracle"],
              "known_structure": {**out[f"mu={best}"], "mu": best},
              "oracle_last_item": out["oracle_last_item"],
              "known_structure_sweep": {k: v for k, v in out.items() if k.startswith("mu=")}}
    if args.more:
        more = Path(args.more)
        mmeta = json.loads((more / "metadata.json").read_text())
        same = [k for k in ("seed", "items", "clusters", "successor_prob", "interest_prob",
                            "transition")   # data sets from before transition: item
                if mmeta["generator"].get(k, "item") != meta["generator"].get(k, "item")]
        if same:
            raise SystemExit(f"{more}: another planted model than {root} ({', '.join(same)})")
        starts, ends = test[0][rows], test[0][rows + 1]
        sub = (np.concatenate([[0], np.cumsum(ends - starts)]),
               np.concatenate([test[1][s:e] for s, e in zip(starts, ends)]), test[2][rows])
        for name, (offsets, items) in (("cooccurrence", train), ("cooccurrence_more_data",
                                       with_targets(*read_split(more, mmeta, "train")))):
            pop = np.bincount(items, minlength=meta["num_items"]).astype(np.int64)
            pop[0] = 0
            record[name] = figures(ranks_by_cooccurrence((offsets, items, None), pop, *sub))
        record["cooccurrence_more_data"]["users"] = mmeta["num_users"]
    record["seconds"] = round(time.perf_counter() - start, 1)
    record["command"] = " ".join([Path(sys.executable).name, *sys.argv])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    oracle = out["oracle"]["hr@10"]
    print(f"{'':>24}  {'hr@10':>7}  {'ndcg@10':>7}  of the oracle's HR@10  ({len(rows):,} test "
          f"rows)")
    for name in ("oracle", "oracle_last_item", "known_structure", "cooccurrence",
                 "cooccurrence_more_data"):
        if name in record:
            r = record[name]
            print(f"{name:>24}  {r['hr@10']:7.4f}  {r['ndcg@10']:7.4f}  {r['hr@10'] / oracle:.3f}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
