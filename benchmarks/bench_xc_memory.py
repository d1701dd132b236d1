"""Extreme classification memory per rank: a row-split class head on 1 and 2 CPU ranks.

Every run is a real ``embedtrain train configs/xc_synthetic.yaml --nproc N`` (torchrun, gloo over
loopback, 1 intra-op thread per rank) with a ``partial_fc`` head (``--rate``) of ``D = 128``
(the config's ``xc.mlp[-1]``), Adagrad on the head's slice (``HeadConfig`` defaults), no
periodic evaluation, one checkpoint at the end:

- Part 1, the split (``--classes``, default 10^6, ``--steps`` steps): one rank, then two.
  From each run's ``plan_vs_measured.json`` (bytes each rank holds right after sharding:
  embedding tables + the head's slice + its optimizer state) the token table's share (its
  shards in ``plan.json``) is subtracted, leaving the head's own bytes per rank, compared with
  ``C x D x 4 / W`` for weights and the same again for Adagrad's sum of squares.
- Part 2, a big head (``--big-classes``, default 10^7, ``--big-batch`` global batch,
  ``--big-steps`` steps) on two ranks: peak RSS per rank (``summary.json``'s
  ``peak_rss_gb_per_rank``: ``ru_maxrss``, so it includes the final evaluation and checkpoint)
  and the training-step time (``train_time_s / steps``).

Evaluation at the end scores every class for every example (10^7 x 128 per example), and the
trainer's final evaluation reads the whole valid split (``eval_max_batches`` only caps periodic
evaluations), so the runs read a view of the data set: train split as generated, valid and test
cut to their first ``--eval-rows`` rows (8 row groups, so both ranks hold some), evaluated in
batches of ``--eval-batch``. Data sets come from ``embedtrain datagen xc`` (reused when their
``metadata.json`` records the same settings); generation time and its peak RSS are recorded.
While a run goes, every process under it is sampled every 0.5 s (``VmRSS``), with the machine's
lowest ``MemAvailable``.

With ``--nproc N`` the script makes one *record* run instead of parts 1 and 2: a head of
``--classes`` rows and ``--dim`` columns (``xc.mlp = [256, dim]``) stored in ``--dtype`` (default
bf16: ``head.dtype``, updated rows rounded by ``--rounding``, ``head.rounding``) with
``--optimizer`` (default ``rowwise_adagrad``: one fp32 accumulator per class row,
``head.optimizer``), partial_fc at ``--rate``, ``--steps`` steps of global batch ``--batch``
on N ranks, then the final evaluation (top-k over every class) of ``--eval-rows`` valid and test
rows and the final checkpoint, whose size on disk is measured and which is then deleted (unless
``--keep``). Defaults differ from parts 1 and 2 where the head's size calls for it:

- ``--rate 0.01``: partial_fc gathers ``rate x C / W`` rows a rank a step and the step's logits
  are ``B x rate x C / W`` floats; at 5 x 10^7 classes on 2 ranks, r = 0.1 would gather 2.5M rows
  (1.3 GB in fp32) a step with logits of 256 x 2.5M (2.6 GB, and as much again for their
  gradient), more than the bf16 head saves; r = 0.01 keeps both near 0.5 GB.
- The data set (``--data``, default ``/tmp/embedtrain_xc_<classes>``, e.g. ``..._50m``) is made
  by ``generate_xc`` (datagen's own planted model and oracle, through its Python API) with
  ``--prototype-tokens 2`` and ``related_classes = 0``, ``--rows 40000`` (100 steps of 256 fit in
  one epoch of the 32k train rows) and ``--vocab`` C / 25 (at least 50k). The CLI's defaults
  (8 prototype tokens, 8 related classes) keep about 330 bytes per class in memory while
  generating (measured 2M-5M classes: 50M would need about 16 GiB); related classes only feed
  multi-label rows, so leaving them out changes no single-label row (checked: identical files at
  2M classes), and 2 prototype tokens a class quarter what the prototypes and the token -> class
  index hold. At 5 x 10^7 classes (vocabulary 2M, 40k rows): 89 s and 6.9 GiB peak RSS, oracle
  P@1 0.945 on its 3,942 test rows.
- The evaluation's rows per second: rows of the test split over the time from the final
  checkpoint's directory appearing to ``curves.png`` (or ``summary.json``) appearing, seen by
  polling every 0.25 s, less the loss plot's time (about 0.9 s, re-measured in a fresh process
  afterwards): the trainer records no evaluation time of its own, and the test evaluation is
  the only work between those two files.

Usage:
    python benchmarks/bench_xc_memory.py --json benchmarks/out/xc_memory.json \
        [--classes 1000000] [--big-classes 10000000] [--skip-split] [--skip-big]
    python benchmarks/bench_xc_memory.py --classes 50000000 --dim 128 --nproc 2 \
        --json benchmarks/out/xc_memory_50m.json

Prints two tables (record mode: one); JSON: ``split`` (per run and rank: measured, token-table
and head bytes against the expected halves), ``big`` (peak RSS per rank, step time),
``datagen``, ``command``. Record mode: ``classes``, ``peak_rss_gb_per_rank``, ``step_ms``,
``eval_rows_per_s``, ``dim``, ``dtype``, ``optimizer``, ``rounding``, ``rate``, ``steps``,
``batch``, ``checkpoint_bytes``, ``run`` (the whole run record), ``datagen``, ``command``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from process_memory import run_sampled  # benchmarks/, beside this script

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/xc_synthetic.yaml"
HEAD_TABLE = "class_head"
FLOAT_BYTES = 4


def ensure_data(path: Path, classes: int, rows: int, vocab: int, logs: Path,
                prototype_tokens: Optional[int] = None) -> dict[str, Any]:
    """An XC data set in ``path``, generated unless it already holds the same one.

    ``prototype_tokens`` None: ``embedtrain datagen xc`` (its defaults: 8 prototype tokens a
    class, 8 related classes). Otherwise ``generate_xc`` through the Python API with that many
    prototype tokens and no related classes (they only feed multi-label rows), for heads too big
    for the CLI's generator (see the module docstring).
    """
    meta_file = path / "metadata.json"
    want = {"classes": classes, "rows": rows, "vocab": vocab, "seed": 0, "multi_label": False}
    if prototype_tokens is not None:
        want.update(prototype_tokens=prototype_tokens, related_classes=0)
    if meta_file.is_file():
        generator = json.loads(meta_file.read_text()).get("generator", {})
        if all(generator.get(k) == v for k, v in want.items()):
            print(f"reusing {path}", flush=True)
            return {"path": str(path), "reused": True, "generator": want}
        raise SystemExit(f"{meta_file}: another data set is there ({generator.get('classes')} "
                         f"classes, {generator.get('prototype_tokens')} prototype tokens); "
                         "pass another data folder (--data)")
    if prototype_tokens is None:
        cmd = [sys.executable, "-m", "embedtrain", "datagen", "xc", "--classes", str(classes),
               "--rows", str(rows), "--vocab", str(vocab), "--out", str(path)]
    else:
        cmd = [sys.executable, "-c",
               "from embedtrain.datagen import XCDataSpec, generate_xc; "
               f"generate_xc(XCDataSpec(classes={classes}, rows={rows}, vocab={vocab}, "
               f"prototype_tokens={prototype_tokens}, related_classes=0), {str(path)!r}, "
               "progress=False)"]
    status, wall, memory = run_sampled(cmd, logs / f"datagen_{path.name}.log")
    if status:
        tail = (logs / f"datagen_{path.name}.log").read_text()[-3000:]
        raise SystemExit(f"datagen failed (exit status {status}):\n{tail}")
    print(f"  generated in {wall:.0f} s, peak RSS {memory['peak_tree_rss_gb']:.2f} GiB", flush=True)
    return {"path": str(path), "reused": False, "wall_s": wall, "command": " ".join(cmd),
            "generator": want, **memory}


def eval_view(data: Path, rows: int, view: Path) -> Path:
    """``data`` with its train split as is and valid/test cut to their first ``rows`` rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = json.loads((data / "metadata.json").read_text())
    if view.exists():
        shutil.rmtree(view)
    view.mkdir(parents=True)
    for split, info in meta["splits"].items():
        files = [str((data / f).resolve()) for f in info["files"]]
        if split == "train":
            info["files"] = files
            continue
        table = pa.concat_tables(pq.read_table(f) for f in files).slice(0, rows)
        # 8 row groups: both ranks own some (a rank without a row group cannot evaluate).
        out = view / f"{split}.parquet"
        pq.write_table(table, out, row_group_size=max(1, -(-table.num_rows // 8)))
        info["files"], info["rows"] = [out.name], table.num_rows
    (view / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    return view


def train(name: str, data: Path, ranks: int, batch: int, steps: int,
          args: argparse.Namespace, extra_sets: tuple[str, ...] = (),
          head_row_bytes: Optional[tuple[float, float]] = None) -> dict[str, Any]:
    """One ``embedtrain train`` run; its summary, plan and measured bytes.

    ``extra_sets``: more ``--set`` overrides. ``head_row_bytes``: the head's expected weight and
    optimizer bytes per class row (default fp32 weights and Adagrad: ``D x 4`` each).
    """
    out = Path(args.runs) / name
    sets = [f"data.path={data}", f"data.batch_size={batch}",
            f"data.eval_batch_size={args.eval_batch}", "head.kind=partial_fc",
            f"head.sample_rate={args.rate}", f"train.max_steps={steps}", "train.epochs=1000",
            "train.eval_every=0", "train.eval_max_batches=1", "train.checkpoint_every=0",
            "train.progress=false", *extra_sets]
    cmd = [sys.executable, "-m", "embedtrain", "train", CONFIG, "--out", str(out), "--overwrite",
           "--no-progress", "--nproc", str(ranks)]
    for s in sets:
        cmd += ["--set", s]
    # The final evaluation's bounds (see the module docstring): the valid record logged, the
    # final checkpoint begun and renamed into place, the plot and summary written.
    ckpts = out / "checkpoints"
    watch = {"valid_logged": str(out / "metrics.jsonl"), "checkpoint_begun": str(ckpts / ".tmp-*"),
             "checkpoint_done": str(ckpts / "step_*"), "curves": str(out / "curves.png"),
             "summary": str(out / "summary.json")}
    shutil.rmtree(out, ignore_errors=True)  # an earlier run's files would be seen at once
    load_before = os.getloadavg()[0]
    status, wall, memory = run_sampled(cmd, Path(args.runs) / f"{name}.log", every_s=0.25,
                                       watch=watch)
    record: dict[str, Any] = {"name": name, "ranks": ranks, "batch": batch, "wall_s": wall,
                              "load_avg_1m": [load_before, os.getloadavg()[0]],
                              "command": " ".join(cmd), "sampled": memory}
    if status or not (out / "summary.json").is_file():
        record["error"] = f"exit status {status}"
        record["log_tail"] = (Path(args.runs) / f"{name}.log").read_text()[-4000:]
        print(record["log_tail"], file=sys.stderr)
        return record
    summary = json.loads((out / "summary.json").read_text())
    record.update({k: summary.get(k) for k in ("steps", "examples", "train_time_s",
                                                "train_examples_per_s", "peak_rss_gb_per_rank",
                                                "world_size", "p@1", "p@5", "split",
                                                "startup_s", "wall_time_s")})
    record["step_ms"] = 1e3 * summary["train_time_s"] / summary["steps"]
    record["per_rank"] = head_bytes(out, summary, *(head_row_bytes or ()))
    return record


def head_bytes(run: Path, summary: dict[str, Any], weight_row_bytes: Optional[float] = None,
               optimizer_row_bytes: Optional[float] = None) -> list[dict[str, Any]]:
    """Per rank: measured bytes, the token tables' share (plan.json) and the head's remainder.

    The remainder is compared with ``C x weight_row_bytes / W`` (default ``D x 4``: fp32) and
    ``C x optimizer_row_bytes / W`` (default ``D x 4``: Adagrad's sum of squares).
    """
    plan = json.loads((run / "plan.json").read_text())
    measured = json.loads((run / "plan_vs_measured.json").read_text())["ranks"]
    head = next(t for t in plan["tables"] if t["name"] == HEAD_TABLE)
    classes, dim = head["rows"], head["dim"]
    out = []
    for m in measured:
        rank = m["rank"]
        tokens = {"weights": 0.0, "optimizer": 0.0}
        for t in plan["tables"]:
            if t["name"] == HEAD_TABLE:
                continue
            for s in t["shards"]:
                if s["rank"] == rank:  # a shard's share of the table's bytes, by element count
                    share = s["size"][0] * s["size"][1] / (t["rows"] * t["dim"])
                    tokens["weights"] += t["weight_bytes"] * share
                    tokens["optimizer"] += t["optimizer_bytes"] * share
        head_rows = sum(s["size"][0] for s in head["shards"] if s["rank"] == rank)
        expected = classes * (weight_row_bytes or dim * FLOAT_BYTES) / len(measured)
        expected_opt = classes * (optimizer_row_bytes or dim * FLOAT_BYTES) / len(measured)
        w = m["measured_weights"] - tokens["weights"]
        o = m["measured_optimizer"] - tokens["optimizer"]
        out.append({"rank": rank, "measured_weights": m["measured_weights"],
                    "measured_optimizer": m["measured_optimizer"],
                    "estimated_weights": m["estimated_weights"],
                    "estimated_optimizer": m["estimated_optimizer"],
                    "token_weights": tokens["weights"], "token_optimizer": tokens["optimizer"],
                    "head_rows_planned": head_rows, "head_weights": w, "head_optimizer": o,
                    "expected_head_bytes": expected, "head_weights_vs_expected": w / expected,
                    "expected_head_optimizer_bytes": expected_opt,
                    "head_optimizer_vs_expected": o / expected_opt,
                    "peak_rss_gb": summary["peak_rss_gb_per_rank"][rank]})
    return out


def mb(x: float) -> str:
    return f"{x / 1e6:,.1f}"


def print_tables(out: dict[str, Any]) -> None:
    if "split" in out:
        print(f"\nhead split: {out['classes']:,} classes x {out['dim']} partial_fc, "
              "bytes each rank holds after sharding (MB = 10^6 bytes)")
        print("| run | rank | weights measured / estimated | head weights (= minus tokens) "
              "| expected C x D x 4 / W | Adagrad measured / estimated | head Adagrad | "
              "peak RSS GiB |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for run in out["split"]:
            if "error" in run:
                print(f"| {run['name']} | failed: {run['error']} |")
                continue
            for r in run["per_rank"]:
                print(f"| {run['name']} | {r['rank']} | {mb(r['measured_weights'])} / "
                      f"{mb(r['estimated_weights'])} | {mb(r['head_weights'])} "
                      f"({r['head_weights_vs_expected']:.3f}x) | {mb(r['expected_head_bytes'])} "
                      f"| {mb(r['measured_optimizer'])} / {mb(r['estimated_optimizer'])} | "
                      f"{mb(r['head_optimizer'])} ({r['head_optimizer_vs_expected']:.3f}x) | "
                      f"{r['peak_rss_gb']:.2f} |")
    if "big" in out:
        run = out["big"]
        print(f"\nbig head: {out['big_classes']:,} classes x {out['dim']} partial_fc "
              f"(r={out['rate']}), global batch {out['big_batch']}, 2 ranks")
        if "error" in run:
            print(f"failed: {run['error']}")
            return
        print("| rank | head rows | head weights MB | head Adagrad MB | peak RSS GiB "
              "(ru_maxrss) | sampled peak GiB |")
        print("|---:|---:|---:|---:|---:|---:|")
        sampled = run["sampled"]["peak_rss_gb_by_rank"]
        for r in run["per_rank"]:
            seen = sampled[r["rank"]] if r["rank"] < len(sampled) else None
            print(f"| {r['rank']} | {r['head_rows_planned']:,} | {mb(r['head_weights'])} | "
                  f"{mb(r['head_optimizer'])} | {r['peak_rss_gb']:.2f} | "
                  f"{'-' if seen is None else format(seen, '.2f')} |")
        print(f"step time {run['step_ms']:,.0f} ms ({run['train_examples_per_s']:,.0f} "
              f"examples/s over {run['steps']} steps); run wall {run['wall_s']:.0f} s; lowest "
              f"MemAvailable {run['sampled']['min_mem_available_gb']:.1f} GiB")

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}


def short_count(n: int) -> str:
    """``50m`` for 50,000,000, ``200k`` for 200,000 (data folder names)."""
    for div, unit in ((10**6, "m"), (10**3, "k")):
        if n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def head_overrides(dtype: str, optimizer: str, rounding: str) -> list[str]:
    """``--set`` overrides of the head's storage and optimizer, checked against ``HeadConfig``.

    A key the config does not have yet is left out when the value asked for is what runs
    without it (fp32 rows); anything else is an error naming the key.
    """
    from embedtrain.config import HeadConfig, HeadOptimizer

    fields = {f.name for f in dataclasses.fields(HeadConfig)}
    if optimizer not in {o.value for o in HeadOptimizer}:
        raise SystemExit(f"--optimizer {optimizer}: head.optimizer takes "
                         f"{sorted(o.value for o in HeadOptimizer)}")
    sets = [f"head.optimizer={optimizer}"]
    for key, value, implied in (("dtype", dtype, "fp32"), ("rounding", rounding, None)):
        if key in fields:
            sets.append(f"head.{key}={value}")
        elif dtype != "fp32" or value != (implied or value):
            raise SystemExit(f"head.{key}: embedtrain's HeadConfig has no such key yet, so "
                             f"--dtype {dtype} cannot run")
    return sets


def check_disk(run: Path, checkpoint_bytes: float) -> None:
    """Exits unless the run's file system holds its final checkpoint, with 20% to spare."""
    run.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(run.parent).free
    if run.exists():  # --overwrite deletes the previous run first
        free += sum(f.stat().st_size for f in run.rglob("*") if f.is_file())
    if free < 1.2 * checkpoint_bytes + 2**30:
        raise SystemExit(f"{run.parent}: {free / 1e9:.1f} GB free, the final checkpoint needs "
                         f"about {checkpoint_bytes / 1e9:.1f} GB; free some or pass --runs")


def plot_seconds(run_dir: Path) -> float:
    """The trainer's loss plot (``curves.png``, inside the evaluation's window) re-timed in a
    fresh process on a copy of the run's ``metrics.jsonl``."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(run_dir / "metrics.jsonl", tmp)
        code = ("import time; from embedtrain.train.run_dir import RunDir; "
                f"d = RunDir({tmp!r}, create=False); t = time.perf_counter(); "
                "d.plot_curves('p@1', title='record', reference=0.9); "
                "print(time.perf_counter() - t)")
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                              text=True, check=True)
    return float(done.stdout.split()[-1])


def eval_rate(run: dict[str, Any], run_dir: Path, view: Path) -> dict[str, Any]:
    """Rows of the final (test) evaluation over its time, from when the run's files appeared.

    The window runs from the final checkpoint's directory appearing to ``curves.png`` (or
    ``summary.json``) appearing; the loss plot's time, re-measured, is taken off. What is left
    includes the trainer's peak-RSS gather (a collective, milliseconds); each end is known to
    the sampling interval.
    """
    seen = run["sampled"]["first_seen_s"]
    ends = [seen[k] for k in ("curves", "summary") if k in seen]
    split = run.get("split") or "test"
    rows = json.loads((view / "metadata.json").read_text())["splits"][split]["rows"]
    if "checkpoint_done" not in seen or not ends:
        return {"rows": rows, "split": split, "seconds": None, "rows_per_s": None}
    window = min(ends) - seen["checkpoint_done"]
    plot = plot_seconds(run_dir) if "curves" in seen else 0.0
    seconds = max(window - plot, run["sampled"]["sample_every_s"])
    return {"rows": rows, "split": split, "seconds": round(seconds, 3),
            "rows_per_s": rows / seconds, "window_s": round(window, 3),
            "plot_s": round(plot, 3),
            "checkpoint_write_s": (round(seen["checkpoint_done"] - seen["checkpoint_begun"], 3)
                                   if "checkpoint_begun" in seen else None),
            "how": "first sight of checkpoints/step_* to first sight of curves.png or "
                   f"summary.json (polled every {run['sampled']['sample_every_s']} s), less the "
                   "loss plot's time re-measured in a fresh process"}


def record_run(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--nproc`` mode: one head of ``--classes`` x ``--dim`` (see the module docstring)."""
    runs = Path(args.runs)
    data = Path(args.data)
    datagen = ensure_data(data, args.classes, args.rows, args.vocab, runs,
                          prototype_tokens=args.prototype_tokens)
    view = eval_view(data, args.eval_rows, runs / "view_record")
    optimizer_row = {"adagrad": args.dim * FLOAT_BYTES, "rowwise_adagrad": FLOAT_BYTES,
                     "factored_adagrad": FLOAT_BYTES, "sgd": 0}.get(args.optimizer, 0)
    weight_row = args.dim * DTYPE_BYTES[args.dtype]
    run_dir = runs / "record"
    check_disk(run_dir, args.classes * (weight_row + optimizer_row)
               + args.vocab * 64 * FLOAT_BYTES)
    sets = (f"xc.mlp=[256,{args.dim}]",
            *head_overrides(args.dtype, args.optimizer, args.rounding))
    run = train("record", view, args.nproc, args.batch, args.steps, args, sets,
                head_row_bytes=(weight_row, optimizer_row or None))
    out: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "cores": os.cpu_count(),
        "classes": args.classes, "dim": args.dim, "dtype": args.dtype,
        "optimizer": args.optimizer, "rounding": args.rounding, "rate": args.rate,
        "steps": args.steps, "batch": args.batch, "nproc": args.nproc,
        "eval_rows": args.eval_rows, "eval_batch": args.eval_batch,
        "peak_rss_gb_per_rank": run.get("peak_rss_gb_per_rank"),
        "sampled_peak_rss_gb_per_rank": run["sampled"]["peak_rss_gb_by_rank"],
        "step_ms": run.get("step_ms"), "eval_rows_per_s": None, "checkpoint_bytes": None,
        "datagen": datagen, "run": run}
    if "error" in run:
        return out
    out["eval"] = eval_rate(run, run_dir, view)
    out["eval_rows_per_s"] = out["eval"]["rows_per_s"]
    ckpts = run_dir / "checkpoints"
    out["checkpoint_bytes"] = int(subprocess.run(["du", "-sb", str(ckpts)], capture_output=True,
                                                 text=True, check=True).stdout.split()[0])
    if not args.keep:
        shutil.rmtree(ckpts)
    out["checkpoint_kept"] = args.keep
    meta = json.loads((data / "metadata.json").read_text())
    out["oracle_p_at_1"] = meta["oracle_p_at_1"]["test"]
    return out


def print_record(out: dict[str, Any]) -> None:
    run = out["run"]
    print(f"\nrecord: {out['classes']:,} classes x {out['dim']} {out['dtype']} head "
          f"({out['optimizer']}, {out['rounding']} rounding), partial_fc r={out['rate']}, "
          f"global batch {out['batch']}, {out['nproc']} ranks")
    if "error" in run:
        print(f"failed: {run['error']}")
        return
    print("| rank | head rows | head weights MB (x expected) | head optimizer MB | peak RSS GiB "
          "(summary) | sampled peak GiB |")
    print("|---:|---:|---:|---:|---:|---:|")
    sampled = out["sampled_peak_rss_gb_per_rank"]
    for r in run["per_rank"]:
        seen = sampled[r["rank"]] if r["rank"] < len(sampled) else None
        print(f"| {r['rank']} | {r['head_rows_planned']:,} | {mb(r['head_weights'])} "
              f"({r['head_weights_vs_expected']:.3f}x) | {mb(r['head_optimizer'])} | "
              f"{r['peak_rss_gb']:.2f} | {'-' if seen is None else format(seen, '.2f')} |")
    ev = out["eval"]
    rate = "-" if ev["rows_per_s"] is None else f"{ev['rows_per_s']:,.1f}"
    print(f"step time {out['step_ms']:,.0f} ms over {run['steps']} steps; final {ev['split']} "
          f"evaluation {ev['rows']} rows in {ev['seconds']} s ({rate} rows/s); checkpoint "
          f"{out['checkpoint_bytes'] / 1e9:.2f} GB; p@1 {run.get('p@1')} (oracle "
          f"{out['oracle_p_at_1']:.3f}); run wall {run['wall_s']:.0f} s; lowest MemAvailable "
          f"{run['sampled']['min_mem_available_gb']:.1f} GiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="output JSON file")
    parser.add_argument("--rate", type=float,
                        help="partial_fc sample rate (default 0.1; record mode 0.01)")
    parser.add_argument("--classes", type=int, default=1_000_000,
                        help="part 1 classes; record mode: the head's classes")
    parser.add_argument("--rows", type=int, help="data rows (default 100k; record mode 40k)")
    parser.add_argument("--vocab", type=int,
                        help="token vocabulary (default 50k; record mode classes / 25, >= 50k)")
    parser.add_argument("--steps", type=int, help="training steps (default 20; record mode 100)")
    parser.add_argument("--batch", type=int, help="global batch (default 512; record mode 256)")
    parser.add_argument("--data", help="data folder (default /tmp/embedtrain_xc_1m; record mode "
                                       "/tmp/embedtrain_xc_<classes>)")
    parser.add_argument("--big-classes", type=int, default=10_000_000)
    parser.add_argument("--big-rows", type=int, default=40_000)
    parser.add_argument("--big-steps", type=int, default=100)
    parser.add_argument("--big-batch", type=int, default=256)
    parser.add_argument("--big-vocab", type=int, default=500_000,
                        help="part 2 token vocabulary (datagen's oracle memory grows with "
                             "classes / vocab: 10^7 / 5 x 10^4 would need an estimated 15-17 GB)")
    parser.add_argument("--big-data", default="/tmp/embedtrain_xc_10m")
    parser.add_argument("--eval-rows", type=int, default=128,
                        help="valid/test rows the runs evaluate")
    parser.add_argument("--eval-batch", type=int, default=64, help="global evaluation batch")
    parser.add_argument("--runs", default="/tmp/embedtrain_xc_memory_runs",
                        help="run directories, views and logs")
    parser.add_argument("--skip-split", action="store_true")
    parser.add_argument("--skip-big", action="store_true")
    record = parser.add_argument_group("record mode (--nproc)")
    record.add_argument("--nproc", type=int,
                        help="ranks: one record run instead of parts 1 and 2")
    record.add_argument("--dim", type=int, help="head columns, xc.mlp[-1] (default: the config's)")
    record.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16",
                        help="head.dtype")
    record.add_argument("--optimizer", default="rowwise_adagrad", help="head.optimizer")
    record.add_argument("--rounding", choices=["stochastic", "nearest"], default="stochastic",
                        help="head.rounding")
    record.add_argument("--prototype-tokens", type=int, default=2,
                        help="the generated data's prototype tokens a class")
    record.add_argument("--keep", action="store_true", help="keep the run's final checkpoint")
    args = parser.parse_args()
    from embedtrain.config import load_config

    dim = load_config(ROOT / CONFIG).xc.mlp[-1]
    recording = args.nproc is not None
    defaults = ({"rate": 0.01, "rows": 40_000, "vocab": max(50_000, args.classes // 25),
                 "steps": 100, "batch": 256,
                 "data": f"/tmp/embedtrain_xc_{short_count(args.classes)}", "dim": dim}
                if recording else
                {"rate": 0.1, "rows": 100_000, "vocab": 50_000, "steps": 20, "batch": 512,
                 "data": "/tmp/embedtrain_xc_1m", "dim": dim})
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    if recording:
        out = record_run(args)
        malloc = [f"{k}={os.environ[k]}" for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_",
                  "MALLOC_TRIM_THRESHOLD_", "EMBEDTRAIN_MALLOC") if os.environ.get(k)]
        out["command"] = " ".join([*malloc, "python", *sys.argv])
        print_record(out)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        return 1 if "error" in out["run"] else 0
    out: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "cores": os.cpu_count(),
        "dim": dim, "rate": args.rate,
        "classes": args.classes, "rows": args.rows, "vocab": args.vocab, "steps": args.steps,
        "batch": args.batch, "big_classes": args.big_classes, "big_rows": args.big_rows,
        "big_vocab": args.big_vocab,
        "big_steps": args.big_steps, "big_batch": args.big_batch, "eval_rows": args.eval_rows,
        "eval_batch": args.eval_batch, "datagen": {},
    }
    if not args.skip_split:
        data = Path(args.data)
        out["datagen"]["split"] = ensure_data(data, args.classes, args.rows, args.vocab, runs)
        view = eval_view(data, args.eval_rows, runs / "view_split")
        out["split"] = [train(f"split_{w}rank", view, w, args.batch, args.steps, args)
                        for w in (1, 2)]
    if not args.skip_big:
        data = Path(args.big_data)
        out["datagen"]["big"] = ensure_data(data, args.big_classes, args.big_rows,
                                            args.big_vocab, runs)
        view = eval_view(data, args.eval_rows, runs / "view_big")
        out["big"] = train("big_2rank", view, 2, args.big_batch, args.big_steps, args)
    out["command"] = " ".join(["python", *sys.argv])
    print_tables(out)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
