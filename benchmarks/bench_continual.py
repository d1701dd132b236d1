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
total: the cumulative seconds of both. Each warm run is exported in full and as a delta against
the day before's export (``embedtrain export --delta-from``): ``delta.rows_changed_fraction`` (of
all table rows), ``delta.bytes_fraction_of_full``, and whether the delta applied to a copy of
the day before's export gives the full export byte for byte (``delta.applied_equals_full``).

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
from typing import Optional

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import embedtrain as et  # noqa: E402
from embedtrain.datagen.drift import DriftDataSpec  # noqa: E402
from embedtrain.datagen.drift_days import generate_ctr_drift_days, partition_name  # noqa: E402
from embedtrain.export.delta import apply_delta, export_delta  # noqa: E402


def _config(data: Path, partitions: list[str], capacity: Optional[int], batch: int
            ) -> et.Config:
    """The demo DLRM on ``partitions`` of ``data``: dynamic tables of ``capacity`` rows, or
    static ones (``None``: the vocabulary's rows)."""
    tables = [f"tables=[{{tables: [t_*], capacity: {capacity}, eviction: lru}}]"] \
        if capacity else []
    return et.load_config(ROOT / "configs" / "dlrm_synthetic.yaml", [
        f"data.path={data}", f"data.partitions=[{','.join(partitions)}]",
        f"data.batch_size={batch}", *tables,
        "train.epochs=1", "train.checkpoint_every=0", "train.progress=false",
        "train.select=last", "train.status_every_s=0", "train.eval_every=0"])


def _ingest_vocab(raw: Path, out: Path, names: list[str]) -> float:
    """The raw day partitions ingested with vocabularies, each extending the day before's;
    returns the seconds it took."""
    from pipelines import run_ingest

    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    for i, name in enumerate(names):
        run_ingest(ROOT / "configs" / "ingest" / "drift_days.yaml", [raw / name / "train"],
                   out / name, progress=False,
                   extend=out / names[i - 1] if i else None)
    return time.perf_counter() - start


def _fit(cfg: et.Config, out: Path, warm_start: Path | None = None) -> dict:
    start = time.perf_counter()
    summary = et.fit(cfg, out, overwrite=True, progress=False, warm_start=warm_start)
    return {"train_s": summary["wall_time_s"], "fit_s": time.perf_counter() - start}


def _delta(run: Path, exports: Path, d: int) -> dict:
    """Day ``d``'s warm run exported in full, and as a delta against day ``d-1``'s export,
    applied to a copy of that export: byte for byte the full one?"""
    full = exports / f"warm_{d}"
    et.export_run(run, full, overwrite=True, progress=False)
    if d == 1:
        return {"rows_changed_fraction": None, "bytes_fraction_of_full": None}
    delta, live = exports / f"delta_{d}", exports / "live"
    shutil.rmtree(delta, ignore_errors=True)
    shutil.rmtree(live, ignore_errors=True)
    start = time.perf_counter()
    record = export_delta(run, exports / f"warm_{d - 1}", delta, progress=False)
    delta_s = time.perf_counter() - start
    shutil.copytree(exports / f"warm_{d - 1}", live)
    start = time.perf_counter()
    apply_delta(delta, live)
    apply_s = time.perf_counter() - start
    same = all((live / f.relative_to(full)).read_bytes() == f.read_bytes()
               for f in full.rglob("*") if f.is_file())
    return {"rows_changed_fraction": record["rows_changed_fraction"],
            "bytes_fraction_of_full": record["bytes_fraction_of_full"],
            "bytes": record["bytes"], "full_bytes": record["full_bytes"],
            "id_map_entries_changed": sum(e["removed"] + e["upserted"]
                                          for e in record["id_maps"]),
            "export_delta_s": delta_s, "apply_s": apply_s, "applied_equals_full": same}


def _auc(run: Path, partition: str) -> float:
    return et.evaluate(run, split="train", partitions=[partition])["auc"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--days", type=int, default=8, help="day partitions (evaluated: days - 1)")
    p.add_argument("--rows", type=int, default=2_400_000, help="rows over all days")
    p.add_argument("--capacity", type=int, default=65_536, help="rows of each dynamic table")
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--tables", default="dynamic,static",
                   help="variants: dynamic (raw ids, --capacity rows, LRU) and/or static (the "
                        "days ingested with vocabularies, each extending the one before)")
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
    variants = {}
    for kind in args.tables.split(","):
        if kind not in ("dynamic", "static"):
            p.error(f"--tables: {kind!r} is not dynamic or static")
        if kind == "static":
            seconds = _ingest_vocab(data, args.work / "days_vocab", names)
            print(f"static: day partitions ingested with extended vocabularies ({seconds:.0f} s)",
                  file=sys.stderr)
        source = data if kind == "dynamic" else args.work / "days_vocab"
        capacity = args.capacity if kind == "dynamic" else None
        variants[kind] = _line(kind, lambda parts: _config(source, parts, capacity,
                                                           args.batch_size),
                               names, index, args.work)
    first = variants[args.tables.split(",")[0]]
    result = {
        "config": {"days": args.days, "rows": args.rows, "capacity": args.capacity,
                   "batch_size": args.batch_size, "tables": args.tables,
                   "model": "configs/dlrm_synthetic.yaml, one pass a run"},
        "days": first["days"], "time": first["time"],  # the first variant's (dynamic)
        "variants": variants,
    }
    for kind, v in variants.items():
        _table(kind, v)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _line(kind: str, cfg, names: list[str], index: dict, work: Path) -> dict:
    """One variant's daily warm starts, retrains and frozen model (the module docstring)."""
    runs, exports = work / "runs" / kind, work / "exports" / kind
    shutil.rmtree(runs, ignore_errors=True)
    days = []
    warm_prev = None
    for d in range(1, len(names)):
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
            "delta": _delta(warm_prev, exports, d),
        }
        days.append(day)
        a, x = day["auc"], day["delta"]
        delta = (f"; delta {x['bytes_fraction_of_full']:.1%} of the full export's bytes, "
                 f"{x['rows_changed_fraction']:.1%} of the rows changed"
                 if x["bytes_fraction_of_full"] is not None else "")
        print(f"{kind} day {d}: warm {a['warm']:.4f} scratch {a['scratch']:.4f} frozen "
              f"{a['frozen']:.4f} oracle {a['oracle']:.4f}; train s warm "
              f"{warm['train_s']:.1f} scratch {scratch['train_s']:.1f}{delta}", file=sys.stderr)
    total = {k: sum(d["train_s"][k] for d in days) for k in ("warm", "scratch")}
    fit_total = {k: sum(d["fit_s"][k] for d in days) for k in ("warm", "scratch")}
    return {"days": days,
            "time": {"warm_total_s": total["warm"], "scratch_total_s": total["scratch"],
                     "warm_over_scratch": total["warm"] / total["scratch"],
                     "fit_warm_total_s": fit_total["warm"],
                     "fit_scratch_total_s": fit_total["scratch"]},
            "max_auc_gap_scratch_minus_warm": max(d["auc"]["scratch"] - d["auc"]["warm"]
                                                  for d in days)}


def _table(kind: str, v: dict) -> None:
    days, total = v["days"], v["time"]
    print(f"\n{kind} tables")
    print(f"{'day':>4} {'new ids':>8} {'warm':>7} {'scratch':>8} {'frozen':>7} {'oracle':>7} "
          f"{'gap':>7} {'warm s':>7} {'scratch s':>9} {'rows chg':>8} {'delta B':>8}")
    for d in days:
        a, t, x = d["auc"], d["train_s"], d["delta"]
        changed = "-" if x["rows_changed_fraction"] is None else \
            f"{x['rows_changed_fraction']:.1%}"
        size = "-" if x["bytes_fraction_of_full"] is None else \
            f"{x['bytes_fraction_of_full']:.1%}"
        print(f"{d['day']:>4} {d['new_id_share']:>8.1%} {a['warm']:>7.4f} {a['scratch']:>8.4f} "
              f"{a['frozen']:>7.4f} {a['oracle']:>7.4f} {a['scratch'] - a['warm']:>+7.4f} "
              f"{t['warm']:>7.1f} {t['scratch']:>9.1f} {changed:>8} {size:>8}")
    print(f"training time: warm {total['warm_total_s']:.1f} s, scratch "
          f"{total['scratch_total_s']:.1f} s ({total['warm_over_scratch']:.2f}); largest AUC "
          f"gap (scratch - warm) {v['max_auc_gap_scratch_minus_warm']:+.4f}")


if __name__ == "__main__":
    sys.exit(main())
