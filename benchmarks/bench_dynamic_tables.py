"""Dynamic tables vs an offline vocabulary vs modulo hashing on drifting data, and their step time.

Part 1 (accuracy, same rows per table): ``embedtrain datagen ctr --drift`` writes raw 64-bit ids
whose popular ids change over time, split by time. The same rows are ingested three more ways
with ``embedtrain ingest`` (parquet input, the data set's own split files):

- ``vocab``: an offline vocabulary built on the training split, cut to the table's rows (its
  most frequent ids; the rest share bucket 0) -- the same rows as the dynamic table;
- ``vocab_full``: the whole training vocabulary (every id seen in training: more rows, for
  reference);
- ``hashing``: ``1 + hash(id) mod (rows - 1)``, the same rows (collisions);
- ``vocab_same_bytes`` / ``hashing_same_bytes``: the same two with the dynamic table's *bytes*
  (a dynamic row also holds 36 bytes of remapping state: id, row, policy counter, statistics);

and the raw ids train a dynamic table of that many rows (LRU, admission every step). The demo
config's DLRM trains one epoch in time order (``data.shuffle: false``: online training) on each;
test AUC (the last periods) is compared, with the rows and bytes each variant's tables use.

Part 2 (speed): the demo config on the demo data (``data/synthetic_ctr``, generated if missing),
its static tables against the same tables made dynamic (capacity = vocabulary + 1: room for
every id and the default row), in one process, alternating rounds on the same fresh batches
(the steps that follow a warm-up, so new ids keep arriving as in a first epoch); median step
times and their ratio, for admission every step (``eviction_interval: 1``) and every 10.

The dynamic tables remap all tables of a collection together (``ShardedDynamicCollection``);
``--per-table`` times TorchRec's per-table remap instead (the reference the fused one is tested
against), ``--speed-only`` skips part 1 (the JSON then has no ``auc``), ``--skip-speed`` part 2.

Usage:
    python benchmarks/bench_dynamic_tables.py --json benchmarks/out/dynamic_tables.json
    python benchmarks/bench_dynamic_tables.py --speed-only --json benchmarks/out/speed.json
Prints both tables and writes the JSON (keys ``auc.dynamic``, ``auc.vocab``, ``auc.hashing``,
``ratios.step_time_dynamic_vs_static``, ...).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from embedtrain.config import load_config  # noqa: E402
from embedtrain.datagen.drift import DriftDataSpec, generate_ctr_drift  # noqa: E402

DIM = 16  # the demo config's embedding_dim
BYTES_PER_ROW = {"static": DIM * 4 + 4, "dynamic": DIM * 4 + 4 + 36}  # weights, rowwise Adagrad, remap


def _write_spec(path: Path, features: list[str], encoding: str, rows: dict[str, int]) -> Path:
    lines = ["name: drift_" + encoding, "input: {format: parquet}", "label: label",
             "dense:"]
    lines += [f"  - {{name: I{i}}}" for i in range(1, 5)]
    lines.append("sparse:")
    for f in features:
        if encoding == "vocab":
            lines.append(f"  - {{name: {f}, dtype: integer, max_vocab_size: {rows[f] - 1}}}")
        elif encoding == "vocab_full":
            lines.append(f"  - {{name: {f}, dtype: integer}}")
        else:
            lines.append(f"  - {{name: {f}, dtype: integer, encoding: hash, "
                         f"hash_buckets: {rows[f]}}}")
    lines += ["split:", "  method: files", "  files: {valid: '*/valid/*', test: '*/test/*'}",
              "output: {rows_per_file: 10000000}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def _ingest(raw: Path, out: Path, spec: Path) -> None:
    from pipelines.tabular.passes import ingest
    from pipelines.tabular.spec import load_spec

    files = [str(raw / f) for s in ("train", "valid", "test")
             for f in json.loads((raw / "metadata.json").read_text())["splits"][s]["files"]]
    ingest(load_spec(spec), files, out, progress=False)


def _train(data: Path, out: Path, overrides: list[str]) -> dict:
    from embedtrain.recipes import build_run

    cfg = load_config(ROOT / "configs/dlrm_synthetic.yaml", [
        f"data.path={data}", "data.shuffle=false", "train.eval_every=0",
        "train.checkpoint_every=0", "train.epochs=1", "train.progress=false", *overrides])
    run = build_run(cfg, out, progress=False)
    return run.trainer.fit(test_data=run.test_data)


def accuracy(args, out: Path) -> dict:
    raw = out / "drift_raw"
    t0 = time.perf_counter()
    meta = generate_ctr_drift(DriftDataSpec(rows=args.rows, lifetime=args.lifetime,
                                            new_ids_per_period=args.new_ids, seed=args.seed),
                              raw, progress=False)
    features = [f["name"] for f in meta["sparse"]]
    drift = meta["drift"]["features"]
    # the budget: rows for the ids alive at one time (x --rows-factor), + the default/OOV row
    rows = {f: int(drift[f]["alive_ids_per_period"] * args.rows_factor) + 1 for f in features}
    print(f"drift data: {args.rows:,} rows in {time.perf_counter() - t0:.1f} s; test lookups "
          f"unseen in train: {meta['drift']['unseen_in_train_share']['test']:.1%}; oracle test "
          f"AUC {meta['oracle_auc']['test']:.4f}", file=sys.stderr)
    # the same bytes: a static row has no remapping state, so it gets that many more rows
    same_bytes = {f: int((r - 1) * BYTES_PER_ROW["dynamic"] / BYTES_PER_ROW["static"]) + 1
                  for f, r in rows.items()}
    variants = {}
    for name, encoding, budget in (("vocab", "vocab", rows), ("hashing", "hash", rows),
                                   ("vocab_same_bytes", "vocab", same_bytes),
                                   ("hashing_same_bytes", "hash", same_bytes),
                                   ("vocab_full", "vocab_full", rows)):
        t0 = time.perf_counter()
        data = out / f"drift_{name}"
        _ingest(raw, data, _write_spec(out / f"{name}.yaml", features, encoding, budget))
        variants[name] = data
        print(f"ingested {name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    tables = ", ".join(f"{{tables: [t_{f}], capacity: {rows[f]}, eviction: lru}}"
                       for f in features)
    results, table_rows = {}, {}
    for name, data, overrides in [
            ("dynamic", raw, [f"tables=[{tables}]"]), *[(n, d, []) for n, d in variants.items()]]:
        t0 = time.perf_counter()
        summary = _train(data, out / f"run_{name}", overrides)
        results[name] = summary
        plan = json.loads((out / f"run_{name}" / "plan.json").read_text())
        table_rows[name] = {t["name"]: t["rows"] for t in plan["tables"]}
        print(f"trained {name}: test AUC {summary['auc']:.4f} in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    memory = {}
    for name, by_table in table_rows.items():
        kind = "dynamic" if name == "dynamic" else "static"
        memory[name] = {"rows": sum(by_table.values()),
                        "bytes": sum(by_table.values()) * BYTES_PER_ROW[kind]}
    return {"data": {"rows": args.rows, "lifetime": args.lifetime,
                     "new_ids_per_period": args.new_ids, "seed": args.seed,
                     "unseen_in_train_share": meta["drift"]["unseen_in_train_share"],
                     "oracle_auc_test": meta["oracle_auc"]["test"],
                     "rows_per_table": rows},
            "auc": {n: r["auc"] for n, r in results.items()},
            "logloss": {n: r["logloss"] for n, r in results.items()},
            "memory": memory, "table_rows": table_rows,
            "dynamic_tables": results["dynamic"]["tables"],
            "train_examples_per_s": {n: r["train_examples_per_s"] for n, r in results.items()}}


def _timed_runs(data: Path, out: Path, interval: int, warmup: int, steps: int, rounds: int,
                per_table: bool = False):
    from embedtrain.recipes import build_run
    from embedtrain.sharding.dynamic import set_fused_remap

    meta = json.loads((data / "metadata.json").read_text())
    entries = ", ".join(f"{{tables: [t_{f['name']}], capacity: {f['num_embeddings'] + 1}, "
                        f"eviction_interval: {interval}}}" for f in meta["sparse"])
    runs = {}
    for name, extra in (("static", []), ("dynamic", [f"tables=[{entries}]"])):
        cfg = load_config(ROOT / "configs/dlrm_synthetic.yaml", [
            f"data.path={data}", "train.checkpoint_every=0", "data.num_workers=0",
            "train.progress=false", *extra])
        run = build_run(cfg, out / f"speed_{name}_{interval}", progress=False)
        if per_table:
            set_fused_remap(run.trainer.model, False)
        batches = run.trainer.train_data.iter_epoch(0)
        runs[name] = (run.trainer, [next(batches) for _ in range(warmup + rounds * steps)])
    times = {n: [] for n in runs}
    for trainer, batches in runs.values():
        for b in batches[:warmup]:
            trainer._train_step(b)
    for r in range(rounds):
        for name, (trainer, batches) in runs.items():
            for b in batches[warmup + r * steps: warmup + (r + 1) * steps]:
                start = time.perf_counter()
                trainer._train_step(b)
                times[name].append(time.perf_counter() - start)
    return {n: statistics.median(t) * 1000 for n, t in times.items()}


def speed(args, out: Path) -> dict:
    data = Path(args.ctr_data)
    if not (data / "metadata.json").is_file():
        from embedtrain.datagen import CTRDataSpec, generate_ctr

        data = out / "synthetic_ctr"
        if not (data / "metadata.json").is_file():
            generate_ctr(CTRDataSpec(rows=400_000), data, progress=False)
    result = {}
    for interval in (1, 10):
        ms = _timed_runs(data, out, interval, args.warmup, args.steps, args.rounds,
                         args.per_table)
        result[interval] = {"static_ms": ms["static"], "dynamic_ms": ms["dynamic"],
                            "ratio": ms["dynamic"] / ms["static"]}
        print(f"step time, admission every {interval}: static {ms['static']:.1f} ms, dynamic "
              f"{ms['dynamic']:.1f} ms ({ms['dynamic'] / ms['static']:.2f}x)", file=sys.stderr)
    return {"data": str(data), "warmup_steps": args.warmup, "steps_per_round": args.steps,
            "rounds": args.rounds, "remap": "per_table" if args.per_table else "fused",
            "by_interval": result}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="benchmarks/out/dynamic_tables.json")
    p.add_argument("--out", default="benchmarks/out/dynamic_tables", help="work directory")
    p.add_argument("--rows", type=int, default=1_000_000, help="drift data rows")
    p.add_argument("--lifetime", type=int, default=8, help="periods an id stays alive")
    p.add_argument("--new-ids", type=int, default=2_000, help="new ids per period (scaled "
                                                              "per feature)")
    p.add_argument("--rows-factor", type=float, default=1.0,
                   help="table rows per id alive at one time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ctr-data", default="data/synthetic_ctr", help="the demo data (speed)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--rounds", type=int, default=12,
                   help="rounds, static and dynamic alternating")
    p.add_argument("--skip-speed", action="store_true", help="no step times (part 2)")
    p.add_argument("--speed-only", action="store_true", help="step times only (no part 1)")
    p.add_argument("--per-table", action="store_true",
                   help="time TorchRec's per-table remap (the reference) instead of the fused one")
    args = p.parse_args()
    if args.skip_speed and args.speed_only:
        p.error("--skip-speed and --speed-only leave nothing to run")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

    # speed first: six trainings fragment the heap (glibc page-faults big buffers), which would
    # slow the timed steps of whichever variant ran after them
    spd = None if args.skip_speed else speed(args, out)
    acc = None if args.speed_only else accuracy(args, out)
    result = {**(acc or {}), "speed": spd,
              "ratios": {"step_time_dynamic_vs_static": spd["by_interval"][1]["ratio"]
                         if spd else None,
                         "step_time_dynamic_vs_static_interval_10":
                             spd["by_interval"][10]["ratio"] if spd else None},
              "command": "python " + " ".join(sys.argv)}
    if acc:
        print(f"\n{'tables':<20} {'test AUC':>9} {'log loss':>9} {'rows':>11} {'MiB':>8}")
        for name in ("dynamic", "vocab", "hashing", "vocab_same_bytes", "hashing_same_bytes",
                     "vocab_full"):
            m = acc["memory"][name]
            print(f"{name:<20} {acc['auc'][name]:>9.4f} {acc['logloss'][name]:>9.4f} "
                  f"{m['rows']:>11,} {m['bytes'] / 2**20:>8.1f}")
        print(f"oracle test AUC {acc['data']['oracle_auc_test']:.4f}; test lookups unseen in "
              f"train {acc['data']['unseen_in_train_share']['test']:.1%}")
    if spd:
        print(f"\n{'admission':<14} {'static ms':>10} {'dynamic ms':>11} {'ratio':>7}")
        for interval, r in spd["by_interval"].items():
            print(f"every {interval:<8} {r['static_ms']:>10.1f} {r['dynamic_ms']:>11.1f} "
                  f"{r['ratio']:>6.2f}x")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
