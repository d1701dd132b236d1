"""Continual training on drifting day partitions: a daily warm start against a daily retrain
from scratch and a model frozen after day 1, each scored on the next day's rows.

Data: ``embedtrain datagen ctr --drift --days N`` (one partition a day; later days hold ids the
earlier ones never saw). For each day ``d`` of ``1 .. N-1``, three models are evaluated on day
``d+1``'s partition (``embedtrain eval RUN --split train --partitions day=d+1``):

- **frozen**: trained once on day 1;
- **warm**: day ``d``'s run, warm-started from day ``d-1``'s (``train.warm_start``), trained on
  day ``d`` alone;
- **scratch**: a new run on days ``1 .. d``, one pass, shuffled.

Every run is one pass over its rows with the same config (the demo's DLRM, dynamic tables over
the raw ids, LRU eviction), started from Python (:func:`embedtrain.fit`). Per day: AUC of each
model and of the planted model (the oracle), training seconds of the warm and the scratch run
(``summary.json``'s ``wall_time_s``: the training loop; ``fit_s`` adds building the run); in
total: the cumulative seconds of both. Where the delta export exists, ``delta.*`` measures
each day's delta against its full export (else null).

Usage:
    python benchmarks/bench_continual.py --json benchmarks/out/continual.json
    python benchmarks/bench_continual.py --rows 80000 --days 4 --json /tmp/c.json   # a smoke run
Prints a table per day and writes the JSON (keys ``days[].auc.{warm,scratch,frozen,oracle}``,
``days[].train_s.{warm,scratch}``, ``days[].delta.*``, ``time.{warm_total_s,scratch_total_s}``).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import embedtrain as et  # noqa: E402
from embedtrain.datagen.drift import DriftDataSpec  # noqa: E402
from embedtrain.datagen.drift_days import generate_ctr_drift_days, partition_name  # noqa: E402


def _config(data: Path, partitions: list[str], capacity: int, batch: int) -> et.Config:
    return et.load_config(ROOT / "configs" / "dlrm_synthetic.yaml", [
        f"data.path={data}", f"data.partitions=[{','.join(partitions)}]",
        f"data.batch_size={batch}",
        f"tables=[{{tables: [t_*], capacity: {capacity}, eviction: lru}}]",
        "train.epochs=1", "train.checkpoint_every=0", "train.progress=false",
        "train.select=last", "train.status_every_s=0", "train.eval_every=0"])


def _fit(cfg: et.Config, out: Path, warm_start: Path | None = None) -> dict:
    start = time.perf_counter()
    summary = et.fit(cfg, out, overwrite=True, progress=False, warm_start=warm_start)
    return {"train_s": summary["wall_time_s"], "fit_s": time.perf_counter() - start}


def _auc(run: Path, partition: str) -> float:
    return et.evaluate(run, split="train", partitions=[partition])["auc"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--days", type=int, default=8, help="day partitions (evaluated: days - 1)")
    p.add_argument("--rows", type=int, default=2_400_000, help="rows over all days")
    p.add_argument("--capacity", type=int, default=65_536, help="rows of each dynamic table")
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "out" / "continual")
    p.add_argument("--json", required=True)
    args = p.parse_args()

    data = args.work / "days"
    start = time.perf_counter()
    index = generate_ctr_drift_days(DriftDataSpec(rows=args.rows, periods=args.days), data,
                                    progress=False)
    print(f"data: {args.days} days of {args.rows // args.days:,} rows "
          f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    names = [partition_name(d) for d in range(1, args.days + 1)]
    runs = args.work / "runs"
    shutil.rmtree(runs, ignore_errors=True)

    def cfg(parts: list[str]) -> et.Config:
        return _config(data, parts, args.capacity, args.batch_size)

    days = []
    warm_prev = None
    for d in range(1, args.days):
        today, nxt = names[d - 1], names[d]
        warm = _fit(cfg([today]), runs / f"warm_{d}", warm_start=warm_prev)
        warm_prev = runs / f"warm_{d}"
        scratch = _fit(cfg(names[:d]), runs / f"scratch_{d}") if d > 1 else warm
        scratch_run = runs / (f"scratch_{d}" if d > 1 else "warm_1")
        day = {
            "day": d, "trained_on": today, "evaluated_on": nxt,
            "new_id_share": index["days"][d]["new_id_share"],
            "auc": {"warm": _auc(warm_prev, nxt), "scratch": _auc(scratch_run, nxt),
                    "frozen": _auc(runs / "warm_1", nxt),
                    "oracle": index["days"][d]["oracle_auc"]},
            "train_s": {"warm": warm["train_s"], "scratch": scratch["train_s"]},
            "fit_s": {"warm": warm["fit_s"], "scratch": scratch["fit_s"]},
            "delta": {"rows_changed_fraction": None, "bytes_fraction_of_full": None},
        }
        days.append(day)
        a = day["auc"]
        print(f"day {d}: warm {a['warm']:.4f} scratch {a['scratch']:.4f} frozen "
              f"{a['frozen']:.4f} oracle {a['oracle']:.4f}; train s warm "
              f"{warm['train_s']:.1f} scratch {scratch['train_s']:.1f}", file=sys.stderr)

    total = {k: sum(d["train_s"][k] for d in days) for k in ("warm", "scratch")}
    fit_total = {k: sum(d["fit_s"][k] for d in days) for k in ("warm", "scratch")}
    gaps = [d["auc"]["scratch"] - d["auc"]["warm"] for d in days]
    result = {
        "config": {"days": args.days, "rows": args.rows, "capacity": args.capacity,
                   "batch_size": args.batch_size, "tables": "dynamic (LRU)",
                   "model": "configs/dlrm_synthetic.yaml, one pass a run"},
        "days": days,
        "time": {"warm_total_s": total["warm"], "scratch_total_s": total["scratch"],
                 "warm_over_scratch": total["warm"] / total["scratch"],
                 "fit_warm_total_s": fit_total["warm"],
                 "fit_scratch_total_s": fit_total["scratch"]},
        "max_auc_gap_scratch_minus_warm": max(gaps),
    }
    print(f"\n{'day':>4} {'new ids':>8} {'warm':>7} {'scratch':>8} {'frozen':>7} {'oracle':>7} "
          f"{'gap':>7} {'warm s':>7} {'scratch s':>9}")
    for d, g in zip(days, gaps):
        a, t = d["auc"], d["train_s"]
        print(f"{d['day']:>4} {d['new_id_share']:>8.1%} {a['warm']:>7.4f} {a['scratch']:>8.4f} "
              f"{a['frozen']:>7.4f} {a['oracle']:>7.4f} {g:>+7.4f} {t['warm']:>7.1f} "
              f"{t['scratch']:>9.1f}")
    print(f"training time: warm {total['warm']:.1f} s, scratch {total['scratch']:.1f} s "
          f"({total['warm'] / total['scratch']:.2f}); largest AUC gap (scratch - warm) "
          f"{max(gaps):+.4f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
